"""Where the time of one linear cross-entropy step goes: torch.profiler over forward + backward of hugehead
and of plain PyTorch on the same inputs, self time per operator grouped into GEMM / hugehead kernels /
copies and casts / allocation and fills / other, and the plan hugehead chose. For tuning the chunk loop.

    python -m bench.profile_lce --device cpu [--shapes cpu_100k,cpu_200k,cpu_1M] [--out DIR]
    python -m bench.profile_lce --device cuda --shapes llama3 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List

from bench import harness  # first: decides which hugehead is imported
from bench.common import ALL_SHAPES, CPU_SHAPES, make_inputs
from bench.peers import IMPLS

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

GROUPS = [  # (group, operator name prefixes), first match wins
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("hugehead kernels", ("hugehead::chunk_",)),
    ("softmax / loss", ("aten::_log_softmax", "aten::log_softmax", "aten::nll_loss", "aten::_softmax",
                        "aten::softmax")),
    ("copies / casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")),
    ("alloc / fill", ("aten::empty", "aten::zeros", "aten::zero_", "aten::fill_", "aten::full", "aten::new_")),
]


def _group(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "other"


def _load(spec: str):
    """``IMPL`` from bench/peers.py, or ``hugehead@key=value[@key=value]`` with linear_cross_entropy
    keyword arguments (e.g. ``hugehead@chunk_size=8192`` streams 8192-class chunks instead of keeping the
    logits). Returns (loss_fn, plan_fn or None, kwargs)."""
    name, *pairs = spec.split("@")
    kwargs = {k: int(v) for k, v in (p.split("=", 1) for p in pairs)}
    if not kwargs:
        return IMPLS[name].load()[0], IMPLS[name].plan, kwargs
    if name != "hugehead":
        raise SystemExit(f"options with @ are for hugehead only, got {spec!r}")
    import hugehead
    from hugehead import functional

    def plan(n, d, v, dtype, device):
        return dict(vars(functional.plan_chunks(n, d, v, dtype, device, kwargs.get("chunk_size"),
                                                kwargs.get("memory_budget"))))

    return (lambda x, w, t: hugehead.linear_cross_entropy(x, w, t, **kwargs)), plan, kwargs


def profile_step(impl: str, shape, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """Median wall time of ``reps`` forward+backward steps (after one warm-up), then one profiled step:
    self time per operator (device time on CUDA, CPU time on the CPU) and per group."""
    loss_fn, plan_fn, _ = _load(impl)
    x, w, t = make_inputs(shape, device, dtype=dtype, seed=0)
    x.requires_grad_(True)
    w.requires_grad_(True)

    def step():
        loss = loss_fn(x, w, t)
        return torch.autograd.grad(loss, (x, w))

    timing = harness.measure(step, device, reps=reps, warmup=1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        harness.synchronize(device)
    ops: Dict[str, dict] = {}
    for e in prof.key_averages():
        us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        if us <= 0:
            continue
        ops[e.key] = {"calls": e.count, "self_ms": us / 1e3, "group": _group(e.key)}
    groups: Dict[str, float] = {}
    for op in ops.values():
        groups[op["group"]] = groups.get(op["group"], 0.0) + op["self_ms"]
    out = {"impl": impl, "shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": str(dtype),
           "step_ms": timing.ms, "step_ms_all": timing.ms_all, "profiled_total_ms": sum(groups.values()),
           "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
           "top_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["self_ms"])[:12])}
    if plan_fn is not None:
        out["plan"] = plan_fn(shape.n, shape.d, shape.v, dtype, device)
    out["foreign_cpu"] = timing.foreign_cpu
    return out


def render(results: List[dict], meta: dict) -> str:
    lines = [harness.header(f"Profile of one forward+backward step: {meta['machine']} ({meta['dtype']})", meta),
             f"{meta['torch_threads']} threads · self time per operator group from torch.profiler (one profiled step; "
             "the step time is the median of unprofiled steps)", ""]
    groups = [g for g, _ in GROUPS] + ["other"]
    lines += ["| shape | impl | step ms | others' CPU | " + " | ".join(groups) + " | plan |",
              "|---|---|--:|--:|" + "--:|" * len(groups) + "---|"]
    for r in results:
        cells = [f"{r['groups_ms'].get(g, 0.0):.0f}" for g in groups]
        plan = ", ".join(f"{k}={v}" for k, v in r.get("plan", {}).items()) or "-"
        busy = "-" if r.get("foreign_cpu") is None else f"{100 * r['foreign_cpu']:.0f}%"
        lines.append(f"| {r['shape']} | {r['impl']} | {r['step_ms']:.0f} | {busy} | " + " | ".join(cells) + f" | {plan} |")
    lines += ["", "Top operators (self ms, calls):", ""]
    for r in results:
        top = ", ".join(f"{k} {v['self_ms']:.0f} ({v['calls']})" for k, v in list(r["top_ops"].items())[:8])
        lines.append(f"- {r['shape']} / {r['impl']}: {top}")
    return "\n".join(lines) + "\n" + harness.footer(meta)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--shapes", default=None, help=f"comma list (default on cpu: {','.join(CPU_SHAPES)})")
    p.add_argument("--impls", default="hugehead,torch",
                   help="comma list of bench_lce implementations, or hugehead@chunk_size=8192 (keyword arguments)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="folder for profile.json / profile.md (default: print only)")
    opts = p.parse_args(argv)
    device = torch.device(opts.device)
    dtype = getattr(torch, opts.dtype or ("float32" if opts.device == "cpu" else "bfloat16"))
    shapes = [ALL_SHAPES[s] for s in (opts.shapes.split(",") if opts.shapes else CPU_SHAPES)]
    meta = harness.run_meta("profile", device, options=opts, shapes={s.name: vars(s) for s in shapes},
                            command=" ".join(["python", "-m", "bench.profile_lce", *sys.argv[1:]]), dtype=str(dtype))
    results = []
    for shape in shapes:
        for impl in opts.impls.split(","):
            results.append(profile_step(impl, shape, device, dtype, opts.reps))
            r = results[-1]
            print(f"{shape.name:<9} {impl:<14} {r['step_ms']:9.1f} ms  "
                  + "  ".join(f"{g} {ms:.0f}" for g, ms in r["groups_ms"].items()), flush=True)
    text = render(results, meta)
    print(text)
    if opts.out:
        harness.write_report(Path(opts.out), "profile", {"meta": meta, "results": results}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
