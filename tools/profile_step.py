"""Where one hugehead step's GPU time goes: torch.profiler over a few steps of one case, the CUDA kernels
grouped by name (total ms per step, calls per step), beside the step's wall time (CUDA events). For the
gaps between what bench_lce / bench_multilabel measure and the kernels' sum.

    python -m tools.profile_step --shape xc6M --case fwd            # forward only (eval loss)
    python -m tools.profile_step --shape xc1M --case single         # forward + backward, class ids
    python -m tools.profile_step --shape xc1M --case multi          # forward + backward, 5 positives
    [--out DIR]  writes profile_<shape>_<case>.md there as well
    [--host N]   also the host's time per Python function over the profiled steps (cProfile, the N largest by
                 cumulative time): where the host spends the wait before a step's first kernel
    [--trace]    also one step under torch.profiler with Python stacks: its Chrome trace (gzip) in --out, and
                 for the largest GPU gaps the Python functions the host ran between the launches on either
                 side (:func:`host_in_gaps`, also ``python -m tools.profile_step --gaps TRACE.json.gz``). The
                 Python tracer inflates host times many-fold (one H100: a cached pinned torch.empty took 2.1 ms
                 under it, 4.8 us without): it says which functions run in a gap, not how long each takes
    [--impl NAME]  a peer of bench_lce (bench/peers.py: hugehead, torch_compile, torch, ...) called as bench_lce
                 calls it (loss, then torch.autograd.grad for x and W): the same tables, side by side

Besides the step's time (CUDA events around one call from an idle GPU, as bench_lce times it), the step with
its host work hidden: the same call queued behind ~20 ms of GPU sleep (``torch.cuda._sleep``), so its launches
are queued ahead of the GPU unless the call waits on the GPU. The difference is the host latency the step
exposes (Python before its first kernel, launch gaps, synchronizations).

Besides the kernels' totals it reports where the GPU waited inside each profiled step: from the step's
start on the host (a ``record_function`` range) to its first kernel, and the largest idle gaps between
kernels (with the kernels on either side), so a gap is traced to the host work or synchronization before it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from bench import harness  # first: decides which hugehead is imported
from bench.bench_multilabel import GPU_SHAPES, sparse_target
from bench.common import ALL_SHAPES, Shape, make_inputs

import torch  # noqa: E402

import hugehead  # noqa: E402


# bench_multilabel's GPU shapes and every bench_lce shape (llama3_4k, ...): the same inputs as those benchmarks.
SHAPES = {**{k: Shape(k, s["n"], s["d"], s["v"]) for k, s in GPU_SHAPES.items()}, **ALL_SHAPES}


def build(shape: str, case: str, impl: Optional[str] = None):
    s = SHAPES[shape]
    dev = torch.device("cuda")
    x, w, t = make_inputs(s, dev, dtype=torch.bfloat16, seed=0)
    if impl is not None:  # a peer of bench_lce (hugehead included), called as bench_lce calls it
        from bench.peers import IMPLS

        if case != "single":
            raise SystemExit(f"profile_step: --impl {impl} takes --case single only")
        fn, _ = IMPLS[impl].load()
        x.requires_grad_(True)
        w.requires_grad_(True)

        def run_peer():
            loss = fn(x, w, t)
            torch.autograd.grad(loss, (x, w))
            return loss.detach()
        return run_peer
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


STEP_MARK = "profile_step.step"

# The chunk loop's stages, from the op that launched each kernel: hugehead's own ops by name, cuBLAS's GEMMs
# (aten::mm / addmm) by their shapes: one without the features' count of columns out is a logits GEMM, one
# whose rows are the loss's rows (or a block of them) and whose depth is classes is dX, one with classes for
# rows and the loss's rows for depth is dW. (Not by the Python stack: the profiler's stacks of the backward's
# ops, which run on autograd's thread, are the main thread's, from an earlier op.)
OP_STAGES = {
    "hugehead::gemm_chunk_stats_": "statistics GEMM (fused)",
    "hugehead::gemm_chunk_grad_": "gradient GEMM (fused)",
    "hugehead::chunk_stats_": "chunk_stats_ (kept logits)",
    "hugehead::chunk_grad_": "chunk_grad_ (kept logits)",
}
MERGE_KERNEL = "merge_partials"
GEMM_STAGE_WORDS = ("GEMM",)


def _aten_gemm(op: str) -> bool:
    return op in ("aten::mm", "aten::addmm", "aten::addmm_")


def _aten_gemm_mkn(op: str, shapes: Sequence[Sequence[int]]) -> Optional[Tuple[int, int, int]]:
    """(M, K, N) of an aten GEMM call from its recorded input shapes (mm: A, B; addmm: C, A, B); None when
    they were not recorded."""
    try:
        (m, k), (_, n) = (shapes[0], shapes[1]) if op == "aten::mm" else (shapes[1], shapes[2])
    except (IndexError, TypeError, ValueError):
        return None
    return m, k, n


def gemm_flops(op: str, shapes: Sequence[Sequence[int]]) -> float:
    """2·M·N·K of one call of a GEMM op from its recorded input shapes (0 for other ops or missing shapes)."""
    try:
        if op in ("hugehead::gemm_chunk_stats_", "hugehead::gemm_chunk_grad_"):  # x [R, D], weight [C, D]
            (r, d), (c, _) = shapes[0], shapes[1]
            return 2.0 * r * d * c
        mkn = _aten_gemm_mkn(op, shapes) if _aten_gemm(op) else None
        if mkn is not None:
            return 2.0 * mkn[0] * mkn[1] * mkn[2]
    except (IndexError, TypeError, ValueError):
        pass
    return 0.0


def _a_transposed(op: str, shapes: Sequence[Sequence[int]], strides) -> Optional[bool]:
    """Whether an aten GEMM's first operand is a transposed view (``gᵀ``, as dW's is), from the profiler's
    recorded strides (``FunctionEvent.structured_input_strides``, newer torch); None where they were not
    recorded."""
    i = 0 if op == "aten::mm" else 1
    try:
        (rows, cols), (s0, s1) = shapes[i], strides[i]
    except (IndexError, TypeError, ValueError):
        return None
    if rows > 1 and cols > 1:
        return s0 == 1 and s1 != 1
    return None


def stage_of(op: str, shapes: Sequence[Sequence[int]], kernel: str, n: int, d: int, strides=None) -> str:
    """The loop stage a kernel belongs to (``op``: the op that launched it; ``n``, ``d``: the loss's rows and
    features; ``strides``: the op's recorded input strides, where the profiler has them)."""
    if op == "hugehead::gemm_chunk_stats_" and MERGE_KERNEL in kernel:
        return "partials' merge"
    if op in OP_STAGES:
        return OP_STAGES[op]
    if _aten_gemm(op):
        mkn = _aten_gemm_mkn(op, shapes)
        if mkn is None:
            return "GEMM (cuBLAS, shapes not recorded)"
        m, k, n_out = mkn
        # logits: x [R, D] @ W_cᵀ [D, C] (C columns out); dX: g [R, C] @ W_c [C, D], R <= n rows; dW: gᵀ [C, R]
        # @ x [R, D]. Only dX and dW have D columns out, and only dW more rows than the loss (or the same
        # count as dX's depth, below it, as a ragged last chunk's dW).
        if n_out != d:
            return "logits GEMM (cuBLAS)"
        transposed = _a_transposed(op, shapes, strides)
        if transposed is not None:  # dW's first operand is gᵀ, dX's g itself: decisive where recorded
            return "dW GEMM (cuBLAS)" if transposed else "dX GEMM (cuBLAS)"
        if m > n:
            return "dW GEMM (cuBLAS)"
        if m == n == k and op == "aten::mm" and len(shapes) == 3:
            # A chunk of exactly N classes (xc6M_16k: 16384 both) gives dX and dW the same shapes. On CUDA a 16-bit
            # dX sums in float32 through the out_dtype overloads (a dtype among the inputs: 4 of them for mm) or
            # returns a new tensor (2); dW is written by mm(gᵀ, x, out=) (3).
            return "dW GEMM (cuBLAS)"
        return "dX GEMM (cuBLAS)" if (m == n or k > n) else "dW GEMM (cuBLAS)"
    if op.startswith("hugehead::"):
        return op[len("hugehead::"):]
    return "other"


def stage_split(events, steps: int, n: int, d: int) -> dict:
    """Per loop stage: ms, calls and TFLOP/s per step, from a profile's CPU ops (``record_shapes`` on) and
    the kernels each launched. A GEMM op's FLOPs count once per call, in the stage of
    its GEMM kernel (not its merge's)."""
    stages: dict = {}
    for e in events:
        kernels = getattr(e, "kernels", None)
        if e.device_type != torch.autograd.DeviceType.CPU or not kernels:
            continue
        shapes = getattr(e, "input_shapes", None) or []
        flops, counted = gemm_flops(e.name, shapes), False
        for k in kernels:
            name = stage_of(e.name, shapes, k.name, n, d, getattr(e, "structured_input_strides", None))
            st = stages.setdefault(name, {"ms": 0.0, "calls": 0, "flops": 0.0})
            st["ms"] += k.duration / 1e3 / steps
            if not counted and name != "partials' merge":
                st["calls"] += 1
                st["flops"] += flops / steps
                counted = True
    for st in stages.values():
        st["calls"] = st["calls"] / steps
        st["tflops"] = st["flops"] / st["ms"] / 1e9 if st["flops"] and st["ms"] else None
    return dict(sorted(stages.items(), key=lambda kv: -kv[1]["ms"]))


def is_gemm_stage(name: str) -> bool:
    return any(w in name for w in GEMM_STAGE_WORDS)


def stage_lines(stages: dict, step_ms: float) -> List[str]:
    """Markdown table of :func:`stage_split`'s result."""
    lines = ["| stage | ms / step | calls / step | TFLOP/s | share of the step |", "|---|--:|--:|--:|--:|"]
    for name, st in stages.items():
        tf = f"{st['tflops']:.0f}" if st["tflops"] else "-"
        lines.append(f"| {name} | {st['ms']:.2f} | {st['calls']:.0f} | {tf} | {100 * st['ms'] / step_ms:.1f}% |")
    return lines


def _is_kernel(e) -> bool:
    """A CUDA event of the trace that is GPU work (not the step's own annotation mirrored on the GPU row)."""
    return e.device_type == torch.autograd.DeviceType.CUDA and e.name != STEP_MARK


def idle_gaps(kernels: Sequence[Tuple[str, float, float]], min_gap_us: float = 10.0
              ) -> Tuple[float, List[Tuple[float, str, str]]]:
    """The GPU's idle time between kernels ``(name, start_us, end_us)`` (any order; overlapping kernels on
    other streams count as busy): ``(total idle us between the first start and the last end, [(gap us,
    kernel before, kernel after)] for each gap of at least min_gap_us, largest first)``."""
    spans = sorted(kernels, key=lambda k: k[1])
    total, gaps = 0.0, []
    if not spans:
        return total, gaps
    busy_until, last = spans[0][2], spans[0][0]
    for name, start, end in spans[1:]:
        if start > busy_until:
            gap = start - busy_until
            total += gap
            if gap >= min_gap_us:
                gaps.append((gap, last, name))
        if end >= busy_until:
            busy_until, last = end, name
    return total, sorted(gaps, key=lambda g: -g[0])


def _step_waits(prof, steps: int, top: int) -> List[str]:
    """Markdown lines: per profiled step the wait before its first kernel and the idle gaps between kernels."""
    marks = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.name == STEP_MARK and e.device_type == torch.autograd.DeviceType.CPU)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if _is_kernel(e)]
    lines = ["", "Where the GPU waited (us), per profiled step: before its first kernel (from the step's start on "
             "the host), between kernels in all, and the largest gaps:", "",
             "| step | before the first kernel | between kernels | largest gaps (us: kernel before → kernel after) |",
             "|--:|--:|--:|---|"]
    for i, (t0, t1) in enumerate(marks[:steps]):
        mine = [k for k in kernels if t0 <= k[1] < (marks[i + 1][0] if i + 1 < len(marks) else float("inf"))]
        if not mine:
            continue
        total, gaps = idle_gaps(mine)
        first = min(k[1] for k in mine) - t0
        shown = "; ".join(f"{g:.0f}: `{a[:40]}` → `{b[:40]}`" for g, a, b in gaps[:top])
        lines.append(f"| {i + 1} | {first:.0f} | {total:.0f} | {shown} |")
    return lines


def hidden_host_ms(run, reps: int = 5, sleep_ms: float = 20.0) -> float:
    """Median ms of ``run`` between CUDA events queued behind ``sleep_ms`` of GPU sleep: the host queues the
    call's launches while the GPU sleeps, so its Python and launch latency is hidden unless it waits on the GPU."""
    rate = torch.cuda.get_device_properties(0).clock_rate  # kHz: cycles a ms
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_ms * rate))
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def profile_steps(run, steps: int):
    """torch.profiler over ``steps`` calls of ``run``, each from an idle GPU (as bench_lce times it) inside a
    ``STEP_MARK`` range, with the ops' shapes for :func:`stage_split`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with torch.profiler.record_function(STEP_MARK):
                run()
        torch.cuda.synchronize()
    return prof


def _host_profile(run, steps: int, top: int) -> List[str]:
    """Markdown lines: cProfile over ``steps`` calls of ``run``, each from an idle GPU, the ``top`` functions
    by cumulative host time (ms per step)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        prof.enable()
        run()
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]
    lines = ["", f"Host time per step (cProfile over {steps} steps; a CUDA call that waits counts as host time):",
             "", "| function | calls / step | own ms / step | cumulative ms / step |", "|---|--:|--:|--:|"]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).name}:{line} {name}" if line else name
        lines.append(f"| `{where[:100]}` | {calls / steps:.0f} | {1e3 * own / steps:.3f} | {1e3 * cum / steps:.3f} |")
    return lines


def trace_step(run, path: Path) -> Path:
    """One call of ``run`` from an idle GPU under torch.profiler with Python stacks; its Chrome trace (gzipped by
    torch.profiler where ``path`` ends in ``.gz``)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], with_stack=True) as prof:
        with torch.profiler.record_function(STEP_MARK):
            run()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def load_trace(path) -> dict:
    """A Chrome trace of :func:`trace_step` (``.json`` or ``.json.gz``)."""
    import gzip
    import json

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def host_in_gaps(trace: dict, min_gap_us: float = 50.0, top: int = 8, per_gap: int = 6) -> List[str]:
    """Markdown lines: the ``top`` largest idle gaps of the GPU between kernels (and before the first one, from
    the step's range), each with the Python functions of hugehead (else any) that the host ran between the
    launch of the kernel before the gap and the launch of the one after (their time inside that window, the
    innermost first), from a Chrome trace of :func:`trace_step`."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    launches, kernels, py, step = {}, [], [], None
    for e in events:
        cat, ph = e.get("cat", ""), e.get("ph")
        if ph != "X":
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
        elif cat == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
        elif cat == "python_function":
            py.append(e)
        elif e.get("name") == STEP_MARK and cat == "user_annotation":
            step = e
    kernels.sort(key=lambda e: e["ts"])
    gaps = []
    if step is not None and kernels:
        gaps.append((kernels[0]["ts"] - step["ts"], None, kernels[0], step["ts"]))
    last = kernels[0] if kernels else None  # the kernel that ended last so far (other streams overlap)
    for b in kernels[1:]:
        gap = b["ts"] - (last["ts"] + last["dur"])
        la = launches.get(last.get("args", {}).get("correlation"))
        if gap >= min_gap_us and la is not None:
            gaps.append((gap, last, b, la["ts"] + la["dur"]))
        if b["ts"] + b["dur"] > last["ts"] + last["dur"]:
            last = b
    gaps.sort(key=lambda g: -g[0])
    lines = ["", f"Host work in the GPU's largest gaps (us; Python functions between the two launches, the "
             f"innermost hugehead ones first):", "", "| gap us | kernel before -> after | host window us | "
             "what the host ran (us inside the window) |", "|--:|---|--:|---|"]
    for gap, a, b, t0 in gaps[:top]:
        lb = launches.get(b.get("args", {}).get("correlation"))
        t1 = lb["ts"] if lb is not None else b["ts"]
        inside = []
        for e in py:
            lo, hi = max(t0, e["ts"]), min(t1, e["ts"] + e["dur"])
            if hi - lo > 0.02 * max(t1 - t0, 1.0):
                inside.append((e["name"], hi - lo, e["dur"]))
        ours = [i for i in inside if "hugehead" in i[0]] or inside
        ours.sort(key=lambda i: (i[2], -i[1]))  # innermost (shortest) first among those that fill the window
        what = "; ".join(f"{name.split('/')[-1][:60]} {us:.0f}" for name, us, _ in ours[:per_gap])
        before = "step start" if a is None else a["name"][:40]
        lines.append(f"| {gap:.0f} | `{before}` -> `{b['name'][:40]}` | {t1 - t0:.0f} | {what} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="xc1M", choices=sorted(SHAPES))
    p.add_argument("--case", default="single", choices=["fwd", "single", "multi"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None)
    p.add_argument("--host", type=int, default=0, help="cProfile's N largest functions by cumulative time")
    p.add_argument("--impl", default=None, help="a bench_lce peer (hugehead, torch_compile, torch, ...), called as "
                   "bench_lce calls it (default: hugehead, its gradients by loss.backward())")
    p.add_argument("--trace", action="store_true", help="also one step's Chrome trace with Python stacks (--out) "
                   "and the host's work in the largest GPU gaps")
    p.add_argument("--gaps", default=None, help="only print host_in_gaps of this Chrome trace (.json or .json.gz)")
    opts = p.parse_args(argv)
    if opts.gaps:
        print("\n".join(host_in_gaps(load_trace(opts.gaps), top=opts.top)))
        return 0
    run = build(opts.shape, opts.case, opts.impl)
    step_ms = harness.measure(run, torch.device("cuda"), reps=5, warmup=2).ms
    hidden_ms = hidden_host_ms(run)
    prof = profile_steps(run, opts.steps)
    kernels = {}
    for e in prof.events():
        if _is_kernel(e):
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.device_time_total / 1e3 / opts.steps
            k[1] += 1
    total = sum(v[0] for v in kernels.values())
    # (an older hugehead on PYTHONPATH, for an A/B of two commits, may predate the fused GEMMs)
    gemm = hugehead.ops.gemm_path(torch.device("cuda"), torch.bfloat16) if hasattr(hugehead.ops, "gemm_path") else "cublas"
    who = "hugehead" if opts.impl is None else f"{opts.impl} (as bench_lce calls it)"
    lines = [f"# profile: {opts.shape} {opts.case}, {who}, HUGEHEAD_GEMM={gemm}, hugehead from "
             f"{Path(hugehead.__file__).parent}",
             "", f"step {step_ms:.2f} ms (CUDA events, median of 5); kernels {total:.2f} ms per step; "
             f"gaps {step_ms - total:.2f} ms; with the host's work hidden (queued behind GPU sleep) "
             f"{hidden_ms:.2f} ms: the host latency the step exposes {step_ms - hidden_ms:.2f} ms", "",
             "| kernel | ms / step | calls / step |", "|---|--:|--:|"]
    for name, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: opts.top]:
        lines.append(f"| `{name[:110]}` | {ms:.2f} | {calls / opts.steps:.0f} |")
    lines += ["", "By stage of the chunk loop (the op that launched each kernel; TFLOP/s from its shapes):", ""]
    lines += stage_lines(stage_split(prof.events(), opts.steps, SHAPES[opts.shape].n, SHAPES[opts.shape].d), step_ms)
    lines += _step_waits(prof, opts.steps, top=5)
    if opts.host:
        lines += _host_profile(run, opts.steps, opts.host)
    if opts.trace:
        tag = "" if opts.impl is None else f"_{opts.impl}"
        path = trace_step(run, Path(opts.out or ".") / f"trace_{opts.shape}_{opts.case}{tag}.json.gz")
        lines += host_in_gaps(load_trace(path), top=opts.top)
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        tag = "" if opts.impl is None else f"_{opts.impl}"
        (Path(opts.out) / f"profile_{opts.shape}_{opts.case}{tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
