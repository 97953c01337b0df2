"""Quick timing splits for tuning the planner (not a results file): hugehead with its default plan
(logits kept when they fit) vs forced streaming (chunk_size pinned) vs plain PyTorch, one GPU, bf16.

    python -m bench.probe_speed [--shapes llama3_4k,gemma2,xc1M] [--out file.json]
"""
from __future__ import annotations

import argparse
import json
import sys

from . import common  # noqa: F401  (selects which hugehead is imported)
from .common import git_sha

import torch
import torch.nn.functional as F

SHAPES = {"llama3_4k": (4096, 4096, 128256), "llama3": (8192, 4096, 128256), "gemma2": (8192, 2304, 256000),
          "xc1M": (8192, 768, 1_000_000), "xc6M": (4096, 768, 6_000_000)}


def timed(fn, reps=7, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main(argv=None):
    import hugehead
    from hugehead.loop import plan_chunks

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="llama3_4k,gemma2,xc1M,xc6M")
    p.add_argument("--out")
    args = p.parse_args(argv)
    rows = []
    for name in args.shapes.split(","):
        n, d, v = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(n, d, device="cuda", generator=g) / d ** 0.25).bfloat16().requires_grad_()
        w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.25).bfloat16().requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda", generator=g)

        def run(fn):
            def step():
                x.grad = w.grad = None
                fn().backward()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = timed(step)
            return ms, (torch.cuda.max_memory_allocated() - base) / 2**30

        plan = plan_chunks(n, d, v, torch.bfloat16, torch.device("cuda"))
        variants = {
            "hugehead": lambda: hugehead.linear_cross_entropy(x, w, t),
            "hugehead_stream": lambda: hugehead.linear_cross_entropy(x, w, t, chunk_size=plan.cols if not plan.keep_logits
                                                                      else 32768),
            "hugehead_256MiB": lambda: hugehead.linear_cross_entropy(x, w, t, memory_budget=256 << 20),
        }
        if n * v * 2 < 40 << 30:
            variants["plain"] = lambda: F.cross_entropy(F.linear(x, w).float(), t)
        import os

        variants["hugehead_no_overlap"] = variants["hugehead"]
        for impl, fn in variants.items():
            os.environ["HUGEHEAD_OVERLAP"] = "0" if impl == "hugehead_no_overlap" else "1"
            plan = plan_chunks(n, d, v, torch.bfloat16, torch.device("cuda"))
            try:
                ms, peak = run(fn)
                with torch.no_grad():
                    fwd = timed(fn)
                rows.append(dict(shape=name, impl=impl, fwd_bwd_ms=ms, fwd_ms=fwd, peak_extra_gib=peak,
                                 plan=str(plan), tflops=8 * n * d * v / ms / 1e9))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(shape=name, impl=impl, error=f"{type(exc).__name__}: {exc}"[:300]))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        del x, w, t
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(git=git_sha(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
