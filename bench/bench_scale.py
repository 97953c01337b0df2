"""hugehead.ops.scale_ against ``self.mul_(scale)`` (a 0-d float32 scale on the device): the in-place scaling
of the gradients the rows plan's forward made (dW [V, D], dX [N, D]). Medians of CUDA events, and the
bandwidth of one read and one write of ``self``.

    python -m bench.bench_scale --out bench/results/h200            # one H200: ~20 s
    python -m bench.bench_scale --cpu-smoke --out /tmp/scale         # CPU, tiny shapes (the tests run it)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported

import torch  # noqa: E402

from hugehead import ops  # noqa: E402

# (name, shape, dtype): xc1M's dW and dX (bf16), xc6M's dW, and a float32 dW (autocast's master weights)
GPU_CASES = [
    ("xc1M dW", (1_000_000, 768), torch.bfloat16),
    ("xc1M dX", (8192, 768), torch.bfloat16),
    ("xc6M dW", (6_000_000, 768), torch.bfloat16),
    ("xc1M dW fp32", (1_000_000, 768), torch.float32),
]
SMOKE_CASES = [("tiny", (1000, 33), torch.bfloat16), ("tiny fp32", (1000, 33), torch.float32)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/h200")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (a test of this script)")
    opts = p.parse_args(argv)
    device = torch.device("cpu" if opts.cpu_smoke else "cuda")
    cases = SMOKE_CASES if opts.cpu_smoke else GPU_CASES
    meta = harness.run_meta("bench_scale", device, options=opts, smoke=opts.cpu_smoke,
                            shapes={name: dict(shape=list(shape), dtype=str(dtype)) for name, shape, dtype in cases})
    scale = torch.tensor(1.0, device=device)  # 1: the values stay put however often they are scaled
    rows = []
    for name, shape, dtype in cases:
        t = torch.randn(shape, device=device).to(dtype)
        nbytes = 2 * t.numel() * t.element_size()  # one read and one write
        row = {"case": name, "shape": list(shape), "dtype": str(dtype)[6:]}
        for impl, fn in (("scale_", lambda: ops.scale_(t, scale)), ("mul_", lambda: t.mul_(scale))):
            timing = harness.measure(fn, device, reps=opts.reps, warmup=3)
            row[f"{impl}_ms"] = timing.ms
            row[f"{impl}_tb_s"] = nbytes / (timing.ms * 1e-3) / 1e12
        row["speedup"] = row["mul__ms"] / row["scale__ms"]
        rows.append(row)
        del t
    md = harness.header("In-place scaling by a 0-d device tensor: hugehead.ops.scale_ vs mul_", meta) + harness.md_table(
        ["case", "shape", "dtype", "scale_ ms", "scale_ TB/s", "mul_ ms", "mul_ TB/s", "speedup"],
        [[r["case"], "x".join(map(str, r["shape"])), r["dtype"], harness.fmt(r["scale__ms"], ".3f"),
          harness.fmt(r["scale__tb_s"], ".2f"), harness.fmt(r["mul__ms"], ".3f"), harness.fmt(r["mul__tb_s"], ".2f"),
          harness.fmt(r["speedup"], ".2f")] for r in rows]) + harness.footer(meta)
    written = harness.write_report(Path(opts.out), "scale", {"meta": meta, "rows": rows}, md)
    print(md)
    print(f"wrote {', '.join(str(p) for p in written.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
