"""Top-k benchmark: hugehead.linear_topk against the forward-only loss of the same shape (GPU), and against
``torch.topk(x @ W.T + b, k)`` over the full logits (CPU).

    python -m bench.bench_topk                              # one GPU, bf16: xc6M and xc1M, k = 1, 5, 100
    python -m bench.bench_topk --device cpu                 # float32 CPU shapes vs torch.topk (~3 min, 2 cores)
    python -m bench.bench_topk --cpu-smoke --out /tmp/topk  # the pipeline, tiny

GPU targets: top-5 within 1.25x and top-100 within 1.5x of ``linear_cross_entropy``'s
forward (no grad) at the same shape, measured in the same run (CUDA events, median of ``--reps``). Each
row also checks its answer (``check``): the share of the first rows (16 GPU, 64 CPU) whose top-k ids
equal those of a stable sort (ties to the lower class id) of their logits, computed by the same GEMMs
the loop runs, so exactly 1.0 is expected.

CPU: float32 with a bias; ``torch.topk`` needs the whole ``[N, V]`` logits (skipped when they would not
fit ``--cpu-logits-gib``); target: hugehead at least as fast.

Writes topk.json (rows: ``shape``, ``n``, ``d``, ``v``, ``k``, ``topk_ms``, ``fwd_ms`` or
``torch_topk_ms``, ...; git SHA in ``meta``), topk.md and topk.png to --out (default
bench/results/<gpu>/ or bench/results/cpu/).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Dict, List

from bench import harness  # first: decides which hugehead is imported
from bench import common
from bench.common import Shape

import torch

import hugehead

GPU_SHAPES = {s: common.SHAPES[s] for s in ("xc6M", "xc1M")}
SMOKE_SHAPES = {"tiny": Shape("tiny", 64, 32, 5003, "smoke"), "tiny_wide": Shape("tiny_wide", 16, 16, 40000, "smoke")}
TARGETS = {1: 1.25, 5: 1.25, 100: 1.5}
CHECK_ROWS = {"gpu": 16, "cpu": 64}


def _agreement(x, w, b, k: int, indices: torch.Tensor, rows: int) -> float:
    """Share of the first ``rows`` rows whose top-k ids equal a stable sort's of their logits, computed by
    the same GEMMs the loop runs (all rows, the plan's chunk width, so the same kernels and the same
    rounding; exact agreement expected)."""
    plan = hugehead.topk.plan_topk_chunks(x.shape[0], x.shape[1], w.shape[0], x.dtype, x.device)
    parts = []
    for c0 in range(0, w.shape[0], plan.cols):
        wc = w[c0:c0 + plan.cols]
        z = torch.mm(x, wc.t()) if b is None else torch.addmm(b[c0:c0 + plan.cols], x, wc.t())
        parts.append(z[:rows].clone())
        del z
    z = torch.cat(parts, dim=1)
    ref = torch.sort(z, dim=1, descending=True, stable=True).indices[:, :k]
    return float((ref == indices[:rows]).all(dim=1).float().mean())


def run_gpu(shapes: Dict[str, Shape], ks: List[int], device: torch.device, dtype: torch.dtype, args) -> List[dict]:
    rows = []
    for shape in shapes.values():
        x, w, target = common.make_inputs(shape, device, dtype)
        fwd = harness.measure(lambda: hugehead.linear_cross_entropy(x, w, target), device, reps=args.reps,
                              warmup=args.warmup, input_bytes=harness.tensor_bytes(x, w, target))
        print(f"{shape.name}: forward (loss, no grad) {fwd.ms:.1f} ms", flush=True)
        for k in ks:
            t = harness.measure(lambda: hugehead.linear_topk(x, w, k), device, reps=args.reps, warmup=args.warmup,
                                input_bytes=harness.tensor_bytes(x, w, target))
            check = _agreement(x, w, None, k, t.result[1], CHECK_ROWS["gpu"])
            ratio = t.ms / fwd.ms
            target_ratio = TARGETS.get(k)
            rows.append(dict(shape=shape.name, n=shape.n, d=shape.d, v=shape.v, k=k, dtype=str(dtype).replace("torch.", ""),
                             topk_ms=t.ms, fwd_ms=fwd.ms, ratio=ratio, target_ratio=target_ratio,
                             meets_target=None if target_ratio is None else ratio <= target_ratio, check=check,
                             **{f"topk_{key}": v for key, v in t.fields().items() if key != "ms"},
                             fwd_all_ms=fwd.ms_all))
            print(f"  top-{k}: {t.ms:.1f} ms = {ratio:.2f}x forward (target {target_ratio}), check {check:.3f}",
                  flush=True)
        del x, w, target
        torch.cuda.empty_cache()
    return rows


def _interleaved(fns: Dict[str, object], reps: int, warmup: int) -> Dict[str, "harness.Timing"]:
    """Host-clock timings of several calls taken in turn (a, b, a, b, ...): on a shared machine whose load
    drifts, each call's median sees the same load. Each Timing's ``foreign_cpu`` is over the whole run."""
    for _ in range(warmup):
        for fn in fns.values():
            harness.time_call_ms(fn, None, "host")
    times: Dict[str, List[float]] = {name: [] for name in fns}
    results = {}
    busy0, t0 = harness.cpu_busy_seconds(), time.perf_counter()
    for _ in range(reps):
        for name, fn in fns.items():
            ms, results[name] = harness.time_call_ms(fn, None, "host")
            times[name].append(ms)
    busy = harness.foreign_cpu_fraction(busy0, harness.cpu_busy_seconds(), time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        out[name] = harness.Timing.of(ts, clock="host")
        out[name].foreign_cpu, out[name].result = busy, results[name]
    return out


def run_cpu(shapes: Dict[str, Shape], ks: List[int], args) -> List[dict]:
    rows = []
    for shape in shapes.values():
        x, w, _ = common.make_inputs(shape, torch.device("cpu"), torch.float32)
        b = torch.randn(shape.v, generator=torch.Generator().manual_seed(1)) * 0.1
        with_torch = shape.n * shape.v * 4 / 2**30 <= args.cpu_logits_gib
        for k in ks:
            fns = {"hugehead": lambda: hugehead.linear_topk(x, w, k, b)}
            if with_torch:
                fns["torch"] = lambda: torch.topk(torch.addmm(b, x, w.t()), k, dim=1)
            t = _interleaved(fns, args.reps, args.warmup)
            ours = t["hugehead"]
            row = dict(shape=shape.name, n=shape.n, d=shape.d, v=shape.v, k=k, dtype="float32", topk_ms=ours.ms,
                       topk_all_ms=ours.ms_all, foreign_cpu=ours.foreign_cpu, torch_topk_ms=None, speedup=None,
                       values_equal=None)
            if with_torch:
                ref = t["torch"]
                row.update(torch_topk_ms=ref.ms, torch_topk_all_ms=ref.ms_all, speedup=ref.ms / ours.ms,
                           values_equal=bool(torch.allclose(ref.result[0], ours.result[0])))
            row["check"] = _agreement(x, w, b, k, ours.result[1], CHECK_ROWS["cpu"])
            rows.append(row)
            print(f"{shape.name} top-{k}: hugehead {ours.ms:.0f} ms, torch.topk {harness.fmt(row['torch_topk_ms'], '.0f')} "
                  f"ms, check {row['check']:.3f}", flush=True)
    return rows


def markdown(doc: dict) -> str:
    meta, rows = doc["meta"], doc["rows"]
    if meta["mode"] == "gpu":
        md = harness.header("Streaming top-k vs the forward-only loss", meta)
        md += ("`hugehead.linear_topk(x, W, k)` against `hugehead.linear_cross_entropy(x, W, target)` under no "
               "grad at the same shape (no bias), CUDA events, median of "
               f"{meta['options']['reps']}. Target: top-1/top-5 within 1.25x, top-100 within 1.5x.\n\n")
        md += harness.md_table(
            ["shape", "N × D × V", "k", "top-k ms", "forward ms", "ratio", "target", "met", "check"],
            [[*harness.shape_cells(r), r["k"], harness.fmt(r["topk_ms"], ".1f"),
              harness.fmt(r["fwd_ms"], ".1f"), harness.fmt(r["ratio"], ".2f") + "×",
              harness.fmt(r["target_ratio"], ".2f") + "×", harness.yes_no(r["meets_target"]),
              harness.fmt(r["check"], ".3f")] for r in rows])
    else:
        md = harness.header("Streaming top-k on the CPU vs torch.topk over the full logits", meta)
        md += ("float32 with a bias: `hugehead.linear_topk(x, W, k, b)` against `torch.topk(torch.addmm(b, x, W.T), k)`"
               f", host clock, median of {meta['options']['reps']}, the two calls taken in turn (the machine is shared: "
               "others' CPU is the share of the cores other processes used meanwhile). Target: hugehead at least as "
               "fast. check: share of the first 64 rows whose ids equal a stable sort of the same logits.\n\n")
        md += harness.md_table(
            ["shape", "N × D × V", "k", "hugehead ms", "torch.topk ms", "speed-up", "values = torch.topk's", "check",
             "others' CPU"],
            [[*harness.shape_cells(r), r["k"], harness.fmt(r["topk_ms"], ".0f"),
              harness.fmt(r["torch_topk_ms"], ".0f"), harness.fmt(r["speedup"], ".2f") + "×",
              harness.yes_no(r["values_equal"]), harness.fmt(r["check"], ".3f"),
              harness.fmt(r["foreign_cpu"], ".2f")] for r in rows])
    return md + harness.footer(meta)


def plot(doc: dict, path: Path) -> None:
    rows = doc["rows"]
    cats = [f"{r['shape']} k={r['k']}" for r in rows]
    if doc["meta"]["mode"] == "gpu":
        series = {"top-k": [r["topk_ms"] for r in rows], "forward (loss)": [r["fwd_ms"] for r in rows]}
    else:
        series = {"hugehead": [r["topk_ms"] for r in rows], "torch.topk(x @ W.T + b)": [r["torch_topk_ms"] for r in rows]}
    harness.bar_chart(path, cats, harness.Panel("ms (median)", series), title="Streaming top-k",
                      smoke=doc["meta"].get("smoke", False))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the pipeline)")
    p.add_argument("--ks", default="1,5,100", help="comma list of k")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2 GPU, 1 CPU)")
    p.add_argument("--cpu-logits-gib", type=float, default=4.0, help="largest [N, V] float32 logits torch.topk gets")
    p.add_argument("--out", type=Path, help="output folder")
    harness.add_record_flag(p)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else args.device)
    gpu = device.type == "cuda"
    args.reps = args.reps or (5 if gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    ks = [int(k) for k in args.ks.split(",")]
    shapes = SMOKE_SHAPES if args.cpu_smoke else (GPU_SHAPES if gpu else common.CPU_SHAPES)
    meta = harness.run_meta("topk", device, options=args, smoke=args.cpu_smoke, mode="gpu" if gpu else "cpu",
                            shapes={s.name: dict(n=s.n, d=s.d, v=s.v) for s in shapes.values()})
    start = time.perf_counter()
    rows = run_gpu(shapes, ks, device, torch.bfloat16, args) if gpu else run_cpu(shapes, ks, args)
    meta["elapsed_s"] = time.perf_counter() - start
    doc = {"meta": meta, "rows": rows}
    out = args.out or harness.REPO_ROOT / "bench" / "results" / (
        harness.gpu_slug(str(meta["gpu_name"])) if gpu else "cpu")
    written = harness.write_report(out, "topk", doc, markdown, plot=lambda path: plot(doc, path), record=args.record)
    print("wrote", ", ".join(str(v) for v in written.values()))


if __name__ == "__main__":
    main()
