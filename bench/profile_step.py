"""Where one hugehead step's GPU time goes: torch.profiler over a few steps of one case, the CUDA kernels
grouped by name (total ms per step, calls per step), beside the step's wall time (CUDA events). For the
gaps between what bench_lce / bench_multilabel measure and the kernels' sum.

    python -m bench.profile_step --shape xc6M --case fwd            # forward only (eval loss)
    python -m bench.profile_step --shape xc1M --case single         # forward + backward, class ids
    python -m bench.profile_step --shape xc1M --case multi          # forward + backward, 5 positives
    [--out DIR]  writes profile_<shape>_<case>.md there as well
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported
from bench.bench_multilabel import GPU_SHAPES, sparse_target
from bench.common import ALL_SHAPES, Shape, make_inputs

import torch  # noqa: E402

import hugehead  # noqa: E402


# bench_multilabel's GPU shapes and every bench_lce shape (llama3_4k, ...): the same inputs as those benchmarks.
SHAPES = {**{k: Shape(k, s["n"], s["d"], s["v"]) for k, s in GPU_SHAPES.items()}, **ALL_SHAPES}


def build(shape: str, case: str):
    s = SHAPES[shape]
    dev = torch.device("cuda")
    x, w, t = make_inputs(s, dev, dtype=torch.bfloat16, seed=0)
    target = sparse_target(s.n, s.v, 5, 0.2, dev, seed=1) if case == "multi" else t
    if case == "fwd":
        def run():
            with torch.no_grad():
                return hugehead.linear_cross_entropy(x, w, target)
        return run
    x.requires_grad_(True)
    w.requires_grad_(True)

    def run():
        x.grad = w.grad = None
        loss = hugehead.linear_cross_entropy(x, w, target)
        loss.backward()
        return loss.detach()
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="xc1M", choices=sorted(SHAPES))
    p.add_argument("--case", default="single", choices=["fwd", "single", "multi"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None)
    opts = p.parse_args(argv)
    run = build(opts.shape, opts.case)
    step_ms = harness.measure(run, torch.device("cuda"), reps=5, warmup=2).ms
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(opts.steps):
            run()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.device_time_total / 1e3 / opts.steps
            k[1] += 1
    total = sum(v[0] for v in kernels.values())
    # (an older hugehead on PYTHONPATH, for an A/B of two commits, may predate the fused GEMMs)
    gemm = hugehead.ops.gemm_path(torch.device("cuda"), torch.bfloat16) if hasattr(hugehead.ops, "gemm_path") else "cublas"
    lines = [f"# profile: {opts.shape} {opts.case}, HUGEHEAD_GEMM={gemm}, hugehead from {Path(hugehead.__file__).parent}",
             "", f"step {step_ms:.2f} ms (CUDA events, median of 5); kernels {total:.2f} ms per step; "
             f"gaps {step_ms - total:.2f} ms", "", "| kernel | ms / step | calls / step |", "|---|--:|--:|"]
    for name, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: opts.top]:
        lines.append(f"| `{name[:110]}` | {ms:.2f} | {calls / opts.steps:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / f"profile_{opts.shape}_{opts.case}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
