"""The memory-bound pass of the rows plan on one GPU: ``chunk_grad_`` turning one row block's logits into
their gradient in place (xc1M's block: 2048 rows x 1M classes, bf16, 8.2 GB read and written), beside the
in-place passes torch makes of the same buffer (``mul_``, ``exp_``) as the achievable bandwidth. CUDA events,
the median of ``--reps`` after a warm-up; the buffer is restored from a copy before each call (untimed), so
every call sees real logits. ``HUGEHEAD_GRAD_SEGMENT`` (chunk_grad_'s columns a block; 0: a block a row) is
recorded, for an A/B in two processes.

    python -m bench.bench_passes [--rows 2048] [--cols 1000000] [--reps 9] [--out DIR]   # passes_<tag>.{json,md}
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported

import hugehead  # noqa: E402,F401  (registers torch.ops.hugehead.*)
import torch  # noqa: E402


def _time_ms(fn, restore, reps: int) -> list:
    times = []
    for i in range(reps + 1):
        restore()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i:  # the first call is the warm-up
            times.append(float(start.elapsed_time(end)))
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_passes needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n, c = args.rows, args.cols
    source = (torch.randn(n, c, device=dev) * 2).to(torch.bfloat16)
    z = source.clone()
    lse = torch.logsumexp(source.float(), dim=1)
    target = torch.randint(0, c, (n,), device=dev)
    grad_rows = torch.full((n,), 1.0 / n, device=dev)

    def restore():
        z.copy_(source)

    passes = {
        "chunk_grad_": lambda: torch.ops.hugehead.chunk_grad_(z, target, 0, c, lse, grad_rows, 0.0, 0.0, 0.0),
        "torch mul_": lambda: z.mul_(0.5),
        "torch exp_": lambda: z.exp_(),
    }
    moved = 2 * z.numel() * z.element_size()  # each element read and written once
    rows = []
    for name, fn in passes.items():
        times = _time_ms(fn, restore, args.reps)
        ms = statistics.median(times)
        rows.append({"pass": name, "ms": ms, "min_ms": min(times), "tb_per_s": moved / ms / 1e9, "reps": len(times)})
    segment = os.environ.get("HUGEHEAD_GRAD_SEGMENT", "default (16384)")
    result = {"meta": {**harness.git_sha(), **harness.environment(dev), "rows": n, "cols": c,
                       "HUGEHEAD_GRAD_SEGMENT": segment, "bytes_moved": moved}, "rows": rows}
    lines = [f"# memory-bound passes, {n} x {c} bf16 in place ({moved / 1e9:.1f} GB moved), "
             f"HUGEHEAD_GRAD_SEGMENT={segment}, {harness.short_sha(result['meta'])}", "",
             "| pass | ms (median) | min | TB/s |", "|---|--:|--:|--:|"]
    lines += [f"| {r['pass']} | {r['ms']:.3f} | {r['min_ms']:.3f} | {r['tb_per_s']:.2f} |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "rowblocks" if segment == "0" else "segments"
        harness.write_json(args.out / f"passes_{tag}.json", result)
        (args.out / f"passes_{tag}.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
