"""What the forward of ``hugehead.linear_cross_entropy`` costs on the host before its first GEMM runs (issue 21:
xc1M's forward at 21.26 ms against a 21.0 ms target): the driver's free-memory query the default budget
asks (``torch.cuda.mem_get_info``), the target check (one reduction and the call's one device-to-host read),
the host time of a whole forward call, and the forward timed by CUDA events twice: from an idle GPU (as
bench_lce times it: the host's prologue shows as the GPU waiting) and queued behind a 20 ms kernel (as in a
training loop that never waits: the check's synchronization then drains the queue first, and the GPU
waits for the host's work after it).

    python -m bench.bench_prologue --out bench/results/h200           # one H200, ~30 s
    python -m bench.bench_prologue --cpu-smoke --out /tmp/prologue     # CPU, tiny shapes (the tests run it)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported
from bench.common import Shape, make_inputs

import torch  # noqa: E402

import hugehead  # noqa: E402
from hugehead.options import check_targets  # noqa: E402

GPU_SHAPES = {"xc1M": dict(n=8192, d=768, v=1_000_000), "xc6M": dict(n=4096, d=768, v=6_000_000)}
SMOKE_SHAPES = {"smoke": dict(n=64, d=32, v=4096)}
SLEEP_CYCLES = 40_000_000  # torch.cuda._sleep: ~20 ms on an H200 at ~1.98 GHz


def _host_us(fn, reps: int, device: torch.device) -> float:
    """Median host microseconds of ``fn()`` called on an idle device (synchronized before each call)."""
    times = []
    for _ in range(reps + 3):
        harness.synchronize([device])
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return harness.median(times[3:])


def _behind_busy_gpu_ms(fn, reps: int) -> float:
    """Median CUDA-event ms of ``fn()`` from the moment a 20 ms kernel queued before it ends."""
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return harness.median(times[2:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/h200")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--shapes", default=None, help="comma list (default: xc1M,xc6M)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (a test of this script)")
    opts = p.parse_args(argv)
    device = torch.device("cpu" if opts.cpu_smoke else "cuda")
    shapes = SMOKE_SHAPES if opts.cpu_smoke else GPU_SHAPES
    if opts.shapes:
        shapes = {k: shapes[k] for k in opts.shapes.split(",")}
    dtype = torch.float32 if opts.cpu_smoke else torch.bfloat16
    meta = harness.run_meta("bench_prologue", device, options=opts, shapes=shapes, smoke=opts.cpu_smoke,
                            dtype=str(dtype), gemm_path=hugehead.ops.gemm_path(device, dtype))
    facts = {}
    if device.type == "cuda":
        facts["mem_get_info_us"] = _host_us(lambda: torch.cuda.mem_get_info(device), 200, device)
    rows = []
    for name, s in shapes.items():
        x, w, target = make_inputs(Shape(name, s["n"], s["d"], s["v"]), device, dtype=dtype, seed=0)
        target[::13] = -100

        def forward():
            with torch.no_grad():
                return hugehead.linear_cross_entropy(x, w, target)

        row = {"shape": name, "n": s["n"], "d": s["d"], "v": s["v"]}
        row["check_targets_us"] = _host_us(lambda: check_targets(target, s["v"], -100), 50, device)
        row["forward_host_us"] = _host_us(forward, opts.reps, device)
        row["forward_ms"] = harness.measure(forward, device, reps=opts.reps, warmup=2).ms
        row["forward_behind_busy_gpu_ms"] = _behind_busy_gpu_ms(forward, opts.reps) if device.type == "cuda" else None
        rows.append(row)
        del x, w, target
    md = harness.header("The forward's host work before its first GEMM", meta)
    if "mem_get_info_us" in facts:
        md += f"torch.cuda.mem_get_info(): {facts['mem_get_info_us']:.1f} us a call (median of 200)\n\n"
    md += harness.md_table(
        ["shape", "check_targets us", "forward host us", "forward ms (idle GPU)", "forward ms (behind a busy GPU)"],
        [[r["shape"], harness.fmt(r["check_targets_us"], ".1f"), harness.fmt(r["forward_host_us"], ".0f"),
          harness.fmt(r["forward_ms"], ".3f"), harness.fmt(r["forward_behind_busy_gpu_ms"], ".3f")] for r in rows])
    md += harness.footer(meta)
    written = harness.write_report(Path(opts.out), "prologue", {"meta": meta, **facts, "rows": rows}, md)
    print(md)
    print(f"wrote {', '.join(str(p) for p in written.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
