"""What the forward of ``hugehead.linear_cross_entropy`` costs on the host before its first GEMM runs (issue 21:
xc1M's forward at 21.26 ms against a 21.0 ms target): the driver's free-memory query the default budget
asks (``torch.cuda.mem_get_info``), the target check (one reduction and the call's one device-to-host read),
the host time of a whole forward call, and the forward timed by CUDA events twice: from an idle GPU (as
bench_lce times it: the host's prologue shows as the GPU waiting) and queued behind a 20 ms kernel (as in a
training loop that never waits: the check's synchronization then drains the queue first, and the GPU
waits for the host's work after it).

``--timeline``: one forward + backward step as bench_lce times hugehead (``torch.autograd.grad`` of the loss
and of x and the weight), from an idle GPU, with the first call of each of the loop's functions (those named
in :data:`PROBES`, and every function of ``hugehead.ops``) marked: the host's microseconds since the step
started, and in some passes a CUDA event's (when the GPU reached that point of its queue; where the two
agree the GPU was waiting for the host). The first GEMM's GPU time is the prologue the step exposes. An
event costs the host microseconds, so three passes (:data:`TIMELINE_PASSES`) take the first GEMM's GPU time
with no other event, the host's times with none, and the GPU's at every probe; the unprobed step is timed
beside them.

    python -m bench.bench_prologue --out bench/results/h200           # one H200, ~30 s
    python -m bench.bench_prologue --timeline --shapes xc6M,llama3_4k --out /tmp/tl
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

GPU_SHAPES = {"xc1M": dict(n=8192, d=768, v=1_000_000), "xc6M": dict(n=4096, d=768, v=6_000_000),
              "llama3_4k": dict(n=4096, d=4096, v=128256)}
# The functions --timeline marks (module: names looked up through the module at each call), besides hugehead.ops'.
PROBES = {
    "hugehead.functional": ["check_inputs", "_linear_cross_entropy", "loss_plan", "eager_dispatch",
                            "start_target_check", "_given_plan", "shard_oom_guard", "_grad_store",
                            "shard_forward_stats", "merge_row_stats", "row_losses", "reduce_loss",
                            "_lce_backward_impl", "whole_head_backward", "no_second_order"],
    "hugehead.loop": ["_new_stats", "fused_applies", "_forward_chunks", "_probs_plan", "_exact_logits",
                      "_fused_stats", "_stored_stats", "_logits_into", "_chunk_stats", "_backward_streamed",
                      "_kept_tail_backward", "_fused_grad", "_chunk_grad", "_mm_dw", "_add_dx", "_row_scaled"],
}
# The probes that launch a GEMM: the first of them to run ends the prologue.
GEMM_PROBES = ("ops.gemm_chunk_stats_", "loop._logits_into", "ops.gemm_chunk_grad_", "loop._mm_dw", "loop._add_dx")
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


def _probed(names: dict):
    """Wrap the functions :data:`PROBES` names and every function of ``hugehead.ops``. While ``holder[0]`` is
    a dict ``marks``, the first call of each records ``name -> (host seconds, CUDA event or None)`` there:
    the event only where ``holder[1]`` (a set of names, or None for all) allows it and CUDA is up. Returns
    ``(holder, restore)``."""
    import importlib
    import inspect

    holder = [None, None]
    undo = []
    targets = [(importlib.import_module(m), f) for m, fs in names.items() for f in fs]
    ops = importlib.import_module("hugehead.ops")
    targets += [(ops, f) for f, fn in vars(ops).items()
                if inspect.isfunction(fn) and fn.__module__ == ops.__name__ and not f.startswith("_")]
    for module, name in targets:
        fn = getattr(module, name, None)
        if fn is None or not callable(fn):
            continue
        label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"

        def wrapper(*args, __fn=fn, __label=label, **kwargs):
            marks = holder[0]
            if marks is not None and __label not in marks:
                ev = None
                if (holder[1] is None or __label in holder[1]) and torch.cuda.is_initialized():
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                marks[__label] = (time.perf_counter(), ev)
            return __fn(*args, **kwargs)

        setattr(module, name, wrapper)
        undo.append((module, name, fn))

    def restore():
        for module, name, fn in undo:
            setattr(module, name, fn)

    return holder, restore


# --timeline's three passes: which probes record a CUDA event (the others the host's clock only; None: all).
# "first": the GEMM probes alone, so the first GEMM's GPU time carries no other probe's event; "host": none,
# the host's times with the least overhead; "events": all, where the GPU was at each.
TIMELINE_PASSES = {"first": set(GEMM_PROBES), "host": set(), "events": None}


def step_timeline(name: str, s: dict, reps: int, device: torch.device, dtype: torch.dtype) -> dict:
    """One shape's ``--timeline``: the unprobed step (CUDA events, median of ``reps``) and, for each of
    :data:`TIMELINE_PASSES`, the median step (by time) of ``reps`` probed ones: each probe's host and GPU
    microseconds since the step started (on the CPU, the smoke test's, host times only)."""
    cuda = device.type == "cuda"
    x, w, target = make_inputs(Shape(name, s["n"], s["d"], s["v"]), device, dtype=dtype, seed=0)
    x.requires_grad_(True)
    w.requires_grad_(True)

    def fwd_bwd():  # as bench/lce_case.py times every implementation
        loss = hugehead.linear_cross_entropy(x, w, target)
        gx, gw = torch.autograd.grad(loss, (x, w))
        return loss.detach(), gx, gw

    step = harness.measure(fwd_bwd, device, reps=reps, warmup=2)
    row = {"shape": name, "n": s["n"], "d": s["d"], "v": s["v"], "step_ms": step.ms, "step_ms_all": step.ms_all}
    holder, restore = _probed(PROBES)
    try:
        for pass_name, with_events in TIMELINE_PASSES.items():
            holder[1] = with_events
            runs = []
            for _ in range(reps + 1):
                out = None  # noqa: F841  (freed before the next step, as the harness does)
                harness.synchronize([device])
                marks = {}
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                holder[0] = marks
                out = fwd_bwd()
                holder[0] = None
                host_end = time.perf_counter()
                if cuda:
                    end.record()
                    end.synchronize()
                runs.append({
                    "step_ms": start.elapsed_time(end) if cuda else (host_end - t0) * 1e3,
                    "host_ms": (host_end - t0) * 1e3,
                    "marks": sorted(((k, (t - t0) * 1e6, start.elapsed_time(ev) * 1e3 if ev is not None else None)
                                     for k, (t, ev) in marks.items()), key=lambda m: m[1]),
                })
            runs = sorted(runs[1:], key=lambda r: r["step_ms"])
            mid = runs[len(runs) // 2]
            gemms = [m for m in mid["marks"] if m[0] in GEMM_PROBES]
            first = min(gemms, key=lambda m: m[1]) if gemms else None
            firsts = [min((m for m in r["marks"] if m[0] in GEMM_PROBES), key=lambda m: m[1], default=None)
                      for r in runs]
            row[pass_name] = {
                "step_ms": mid["step_ms"], "host_ms": mid["host_ms"],
                "first_gemm": None if first is None else {"probe": first[0], "host_us": first[1], "gpu_us": first[2]},
                "first_gemm_host_us_all": [f[1] for f in firsts if f is not None],
                "first_gemm_gpu_us_all": [f[2] for f in firsts if f is not None and f[2] is not None],
                "marks": [{"probe": k, "host_us": h, "gpu_us": g} for k, h, g in mid["marks"]]}
    finally:
        holder[0] = None
        restore()
    return row


def _med(values):
    return harness.median(values) if values else None


def _timeline_md(rows, meta) -> str:
    md = harness.header("Where a training step's GPU waits for the host (first call of each function)", meta)
    md += ("The first GEMM's GPU time (pass `first`: only the GEMM probes record an event) is the prologue the "
           "step exposes: the GPU idles until the host launches it. Medians over the probed steps.\n\n")
    md += harness.md_table(
        ["shape", "step ms (unprobed)", "first GEMM", "its host us (pass host)", "its GPU us (pass first)",
         "host ms of the step (pass host)"],
        [[r["shape"], harness.fmt(r["step_ms"], ".2f"), ((r["first"]["first_gemm"] or {}).get("probe", "-")),
          harness.fmt(_med(r["host"]["first_gemm_host_us_all"]), ".0f"),
          harness.fmt(_med(r["first"]["first_gemm_gpu_us_all"]), ".0f"),
          harness.fmt(r["host"]["host_ms"], ".2f")] for r in rows])
    for r in rows:
        gpu = {m["probe"]: m["gpu_us"] for m in r["events"]["marks"]}
        md += (f"\n### {r['shape']}: the probes in host order (us since the step started; host: pass `host`, "
               f"GPU: pass `events`, whose own events make its steps' host times longer)\n\n")
        md += harness.md_table(["probe", "host us", "GPU us"],
                               [[m["probe"], harness.fmt(m["host_us"], ".0f"), harness.fmt(gpu.get(m["probe"]), ".0f")]
                                for m in r["host"]["marks"]])
    return md + harness.footer(meta)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/h200")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--shapes", default=None, help="comma list (default: xc1M,xc6M; --timeline: xc6M,llama3_4k)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (a test of this script)")
    p.add_argument("--timeline", action="store_true", help="a training step's probes (CUDA; see the docstring)")
    opts = p.parse_args(argv)
    device = torch.device("cpu" if opts.cpu_smoke else "cuda")
    shapes = SMOKE_SHAPES if opts.cpu_smoke else GPU_SHAPES
    default = list(shapes) if opts.cpu_smoke else (["xc6M", "llama3_4k"] if opts.timeline else ["xc1M", "xc6M"])
    shapes = {k: shapes[k] for k in (opts.shapes.split(",") if opts.shapes else default)}
    dtype = torch.float32 if opts.cpu_smoke else torch.bfloat16
    if opts.timeline:
        meta = harness.run_meta("bench_prologue_timeline", device, options=opts, shapes=shapes,
                                smoke=opts.cpu_smoke, dtype=str(dtype), gemm_path=hugehead.ops.gemm_path(device, dtype))
        rows = [step_timeline(k, s, opts.reps, device, dtype) for k, s in shapes.items()]
        md = _timeline_md(rows, meta)
        written = harness.write_report(Path(opts.out), "prologue_timeline", {"meta": meta, "rows": rows}, md)
        print(md)
        print(f"wrote {', '.join(str(p) for p in written.values())}")
        return 0
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
