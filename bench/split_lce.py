"""Where hugehead's forward+backward time goes on one GPU: each stage of the chunk loop timed on its own
(CUDA events, median) at the plan ``linear_cross_entropy`` chooses, beside the whole step with the
side-stream overlap on and off, and the step with ``memory_budget=256 MiB``. The GEMM stages' sum is what
the loop costs at cuBLAS's own speed with no memory-bound work at all: the floor of this loop's design.

    python -m bench.split_lce [--shapes llama3_4k,xc6M] [--out DIR] [--widths 16384,32768,65536]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        python -m bench.split_lce --ncu xc6M      # one chunk of every stage, for Nsight Compute

Stages (per chunk of ``cols`` classes; counts from the plan):
  logits GEMM  ``Z = X W_cᵀ`` (forward: every chunk; backward: the chunks not kept, recomputed)
  stats        ``chunk_stats_`` (forward, every chunk)
  grad         ``chunk_grad_`` (backward, every chunk, in place)
  dX GEMM      ``G W_c`` (into a bf16 partial added to a float32 sum; one GEMM into x's dtype when the plan
               keeps all logits as one chunk)
  dW GEMM      ``Gᵀ X`` (backward, every chunk)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

from bench import harness  # first: decides which hugehead is imported
from bench.common import SHAPES, find_shape, make_inputs

import torch  # noqa: E402

BF16 = torch.bfloat16
PEAK_TFLOPS = 790.0  # DESIGN.md: the bf16 dense GEMM ceiling measured on this H200
TARGETS_MS = {"llama3_4k": 17.0, "llama3": 36.0, "gemma2": 40.0, "xc1M": 60.0, "xc6M": 200.0, "xc6M_16k": 780.0}


def _events_ms(fn: Callable[[], object], reps: int, warmup: int = 1, before: Callable[[], object] = None) -> float:
    """Median CUDA-event time of ``fn`` (``before`` runs outside the timed region each time)."""
    return harness.measure(fn, torch.device("cuda"), reps=reps, warmup=warmup, before=before).ms


class Stages:
    """The loop's stages on one chunk of ``width`` classes, on real (seeded, non-zero) data."""

    def __init__(self, x, w, t, width: int, direct_dx: bool):
        from hugehead import ops

        self.ops = ops
        self.x, self.t, self.width, self.num_classes = x, t, width, w.shape[0]
        n, d = x.shape
        self.wc = w[:width]
        self.z = x.new_empty(n, width)
        torch.mm(x, self.wc.t(), out=self.z)
        self.z_saved = self.z.clone()
        self.lse = torch.logsumexp(self.z.float(), dim=1) + 3.0  # as if other chunks added mass
        self.grad_rows = torch.full((n,), 1.0 / n, device=x.device)
        self.stats = (torch.full((n,), -float("inf"), device=x.device), torch.zeros(n, device=x.device),
                      torch.zeros(n, device=x.device), torch.zeros(n, device=x.device))
        self.direct_dx = direct_dx
        self.partial = x.new_empty(n, d)
        self.grad_x = torch.zeros(n, d, device=x.device)
        self.dw = x.new_empty(width, d)
        self.g = self.z_saved.clone()
        ops.chunk_grad_(self.g, t, 0, w.shape[0], self.lse, self.grad_rows, 0.0, 0.0, 0.0, None)

    def logits(self):
        torch.mm(self.x, self.wc.t(), out=self.z)

    def stats_(self):
        self.ops.chunk_stats_(self.z, self.t, 0, 0.0, *self.stats)

    def restore(self):
        self.z.copy_(self.z_saved)

    def grad(self):
        self.ops.chunk_grad_(self.z, self.t, 0, self.num_classes, self.lse, self.grad_rows,
                             0.0, 0.0, 0.0, None)

    def dx(self):
        torch.mm(self.g, self.wc, out=self.partial)
        if not self.direct_dx:  # the streamed loop adds each chunk's bf16 partial into a float32 sum
            self.grad_x.add_(self.partial)

    def dw_(self):
        torch.mm(self.g.t(), self.x, out=self.dw)

    def dx_dw_side_by_side(self):
        """dX on a second stream beside dW (both only read the gradient chunk)."""
        main = torch.cuda.current_stream()
        side = _second_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.dx()
        self.dw_()
        main.wait_stream(side)


_STREAM = []


def _second_stream():
    if not _STREAM:
        _STREAM.append(torch.cuda.Stream())
    return _STREAM[0]


def _step_ms(x, w, t, reps: int, **kwargs) -> Dict[str, float]:
    import hugehead

    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def step():
        loss = hugehead.linear_cross_entropy(xg, wg, t, **kwargs)
        return torch.autograd.grad(loss, (xg, wg))

    timing = harness.measure(step, x.device, reps=reps, warmup=2)
    # beyond what was allocated before the timed calls (the inputs) and the two returned gradients
    grads = harness.tensor_bytes(x, w)
    return {"ms": timing.ms, "peak_extra_gib": max(0, timing.peak_extra_bytes - grads) / 2**30}


def split_shape(shape, reps: int, widths: List[int]) -> dict:
    from hugehead.loop import plan_chunks

    dev = torch.device("cuda")
    x, w, t = make_inputs(shape, dev, dtype=BF16, seed=0)
    n, d, v = shape.n, shape.d, shape.v
    plan = plan_chunks(n, d, v, BF16, dev, direct_dx=True)
    out = {"shape": shape.name, "n": n, "d": d, "v": v, "plan": dict(vars(plan)),
           "target_ms": TARGETS_MS.get(shape.name),
           "floor_6ndv_ms": 6.0 * n * d * v / PEAK_TFLOPS / 1e9, "floor_8ndv_ms": 8.0 * n * d * v / PEAK_TFLOPS / 1e9}

    # The whole step: overlap on (the default), overlap off, and a 256 MiB budget.
    os.environ.pop("HUGEHEAD_OVERLAP", None)
    out["step"] = _step_ms(x, w, t, reps)
    os.environ["HUGEHEAD_OVERLAP"] = "0"
    out["step_no_overlap"] = _step_ms(x, w, t, reps)
    os.environ.pop("HUGEHEAD_OVERLAP", None)
    out["step_256mib"] = _step_ms(x, w, t, reps, memory_budget=256 << 20)
    out["plan_256mib"] = dict(vars(plan_chunks(n, d, v, BF16, dev, memory_budget=256 << 20, direct_dx=True)))
    torch.cuda.empty_cache()

    # Each stage on its own.
    cols = plan.cols
    n_chunks = -(-v // cols)
    kept = plan.kept_chunks if plan.keep_logits else 0
    direct = plan.keep_logits and plan.kept_chunks == 1 and cols == v
    widths_used = {cols: v // cols}
    if v % cols:
        widths_used[v % cols] = 1
    per_width = {}
    for width in widths_used:
        s = Stages(x, w, t, width, direct)
        per_width[width] = {
            "logits": _events_ms(s.logits, reps), "stats": _events_ms(s.stats_, reps),
            "grad": _events_ms(s.grad, reps, before=s.restore), "dx": _events_ms(s.dx, reps),
            "dw": _events_ms(s.dw_, reps),
        }
        del s
        torch.cuda.empty_cache()
    # Chunks in order: the first `kept` are not recomputed in the backward.
    widths_in_order = [cols] * (v // cols) + ([v % cols] if v % cols else [])
    stages = {"fwd_logits_gemm": 0.0, "fwd_stats": 0.0, "bwd_recompute_gemm": 0.0, "bwd_grad": 0.0,
              "bwd_dx_gemm": 0.0, "bwd_dw_gemm": 0.0}
    flops = dict.fromkeys(stages, 0.0)
    for j, width in enumerate(widths_in_order):
        p = per_width[width]
        f = 2.0 * n * d * width
        stages["fwd_logits_gemm"] += p["logits"]
        flops["fwd_logits_gemm"] += f
        stages["fwd_stats"] += p["stats"]
        if j >= kept:
            stages["bwd_recompute_gemm"] += p["logits"]
            flops["bwd_recompute_gemm"] += f
        stages["bwd_grad"] += p["grad"]
        stages["bwd_dx_gemm"] += p["dx"]
        flops["bwd_dx_gemm"] += f
        stages["bwd_dw_gemm"] += p["dw"]
        flops["bwd_dw_gemm"] += f
    out["chunks"] = n_chunks
    out["per_chunk_ms"] = {str(k): v_ for k, v_ in per_width.items()}
    out["stages_ms"] = stages
    out["stage_tflops"] = {k: (flops[k] / stages[k] / 1e9 if flops[k] and stages[k] else None) for k in stages}
    gemm = sum(v_ for k, v_ in stages.items() if k.endswith("gemm"))
    mem = sum(v_ for k, v_ in stages.items() if not k.endswith("gemm"))
    out["gemm_sum_ms"], out["memory_bound_sum_ms"], out["serial_sum_ms"] = gemm, mem, gemm + mem
    out["gemm_tflops"] = sum(flops.values()) / gemm / 1e9

    # Chunk widths for the streamed loop: GEMM cost per class at each width.
    sweep = {}
    for width in widths:
        if width > v:
            continue
        s = Stages(x, w, t, width, False)
        ms = {"logits": _events_ms(s.logits, reps), "dx": _events_ms(s.dx, reps), "dw": _events_ms(s.dw_, reps)}
        f = 2.0 * n * d * width
        row = {**ms, **{f"{k}_tflops": f / ms[k] / 1e9 for k in ms},
               "streamed_gemms_ms_per_step": (2 * ms["logits"] + ms["dx"] + ms["dw"]) * v / width,
               "dx_dw_side_by_side": _events_ms(s.dx_dw_side_by_side, reps)}
        try:  # the same GEMMs through cuBLASLt
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row.update({f"{k}_cublaslt": _events_ms(fn, reps) for k, fn in
                        (("logits", s.logits), ("dx", s.dx), ("dw", s.dw_))})
        except Exception as e:  # noqa: BLE001  (recorded, not fatal)
            row["cublaslt_error"] = repr(e)[:200]
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        sweep[str(width)] = row
        del s
        torch.cuda.empty_cache()
    out["width_sweep"] = sweep
    del x, w, t
    torch.cuda.empty_cache()
    return out


def square_gemm_tflops(reps: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    ms = _events_ms(lambda: a @ b, reps, warmup=3)
    return 2.0 * 8192**3 / ms / 1e9


def render(doc: dict) -> str:
    m = doc["meta"]
    lines = [harness.header(f"Timing splits of hugehead's chunk loop: {m['machine']} (bfloat16, forward + backward)",
                            m),
             f"8192³ bf16 GEMM on this GPU now: {m['square_gemm_tflops']:.0f} TFLOP/s.", "",
             "Each stage timed alone over real data (CUDA events, median), summed over the plan's chunks; "
             "step = `linear_cross_entropy` forward + backward (median), with the side-stream overlap on "
             "(default) and off. The GEMM sum is this loop at cuBLAS's speed with no memory-bound work.", "",
             "| shape | plan | step ms | no overlap | fwd GEMM | stats | recompute GEMM | grad | dX GEMM | dW GEMM "
             "| GEMM sum | memory-bound sum | target | 6·NDV / 8·NDV at 790 |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in doc["results"]:
        s, p = r["stages_ms"], r["plan"]
        if p["keep_logits"] and p["cols"] == r["v"]:
            plan = "keep all"
        else:
            plan = f"cols={p['cols']}, kept {p['kept_chunks'] if p['keep_logits'] else 0}/{r['chunks']}"
        plan += ", overlap" if p["overlap"] else ""
        tf = r["stage_tflops"]

        def cell(k):
            return f"{s[k]:.2f}" + (f" ({tf[k]:.0f})" if tf.get(k) else "")

        lines.append(
            f"| {r['shape']} | {plan} | {r['step']['ms']:.2f} | {r['step_no_overlap']['ms']:.2f} | "
            + " | ".join(cell(k) for k in s)
            + f" | {r['gemm_sum_ms']:.2f} ({r['gemm_tflops']:.0f}) | {r['memory_bound_sum_ms']:.2f} | "
            f"{r['target_ms'] if r['target_ms'] else '-'} | {r['floor_6ndv_ms']:.1f} / {r['floor_8ndv_ms']:.1f} |")
    lines += ["", "GEMM cells: ms (TFLOP/s).", "",
              "## `memory_budget=256 MiB` against the default", "",
              "| shape | default ms | peak extra GiB | 256 MiB ms | peak extra GiB | ratio | 256 MiB plan |",
              "|---|--:|--:|--:|--:|--:|---|"]
    for r in doc["results"]:
        a, b = r["step"], r["step_256mib"]
        p = r["plan_256mib"]
        lines.append(f"| {r['shape']} | {a['ms']:.2f} | {a['peak_extra_gib']:.2f} | {b['ms']:.2f} | "
                     f"{b['peak_extra_gib']:.3f} | {b['ms'] / a['ms']:.2f}× | rows={p['rows']}, cols={p['cols']}, "
                     f"kept={p['kept_chunks'] if p['keep_logits'] else 0}, overlap={p['overlap']} |")
    lines += ["", "## Streamed-loop GEMMs per chunk width (ms per chunk, TFLOP/s; per step = 2 logits + dX + dW "
              "GEMMs over all V; cuBLASLt: the same GEMMs with `preferred_blas_library('cublaslt')`; dX ∥ dW: dX on a "
              "second stream beside dW)", "",
              "| shape | width | logits GEMM | dX GEMM | dW GEMM | GEMMs per step ms | cuBLASLt logits / dX / dW "
              "| dX + dW | dX ∥ dW |", "|---|--:|--:|--:|--:|--:|---|--:|--:|"]
    for r in doc["results"]:
        for width, q in r["width_sweep"].items():
            lines.append(f"| {r['shape']} | {width} | {q['logits']:.3f} ({q['logits_tflops']:.0f}) | "
                         f"{q['dx']:.3f} ({q['dx_tflops']:.0f}) | {q['dw']:.3f} ({q['dw_tflops']:.0f}) | "
                         f"{q['streamed_gemms_ms_per_step']:.1f} | "
                         + (" / ".join(f"{q[k + '_cublaslt']:.3f}" for k in ("logits", "dx", "dw"))
                            if "logits_cublaslt" in q else q.get("cublaslt_error", "-"))
                         + f" | {q['dx'] + q['dw']:.3f} | {q['dx_dw_side_by_side']:.3f} |")
    return "\n".join(lines) + "\n" + harness.footer(m)


def ncu_one(shape_name: str) -> None:
    """One chunk of every stage between cudaProfilerStart/Stop (after a warm-up), for ncu."""
    from hugehead.loop import plan_chunks

    shape = find_shape(shape_name)
    dev = torch.device("cuda")
    x, w, t = make_inputs(shape, dev, dtype=BF16, seed=0)
    plan = plan_chunks(shape.n, shape.d, shape.v, BF16, dev, direct_dx=True)
    direct = plan.keep_logits and plan.kept_chunks == 1 and plan.cols == shape.v
    s = Stages(x, w, t, min(plan.cols, shape.v), direct)
    order = [s.logits, s.stats_, s.restore, s.grad, s.dx, s.dw_]
    for fn in order:
        fn()
    torch.cuda.synchronize()
    print(f"ncu: {shape.name} width {s.width}: logits GEMM, stats, (copy), grad, dX GEMM (+add), dW GEMM", flush=True)
    torch.cuda.profiler.start()
    for fn in order:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--widths", default="16384,32768,65536", help="chunk widths for the streamed-GEMM sweep")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="folder for split.json / split.md")
    p.add_argument("--ncu", metavar="SHAPE", help="run one chunk of each stage for Nsight Compute and exit")
    opts = p.parse_args(argv)
    if opts.ncu:
        ncu_one(opts.ncu)
        return 0
    meta = harness.run_meta("split", torch.device("cuda"), options=opts,
                            shapes={n: vars(find_shape(n)) for n in opts.shapes.split(",")},
                            command=" ".join(["python", "-m", "bench.split_lce", *sys.argv[1:]]),
                            square_gemm_tflops=square_gemm_tflops(opts.reps))
    widths = [int(c) for c in opts.widths.split(",") if c]
    results = []
    for name in opts.shapes.split(","):
        t0 = time.perf_counter()
        r = split_shape(find_shape(name), opts.reps, widths)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(f"{name:<9} step {r['step']['ms']:.2f} ms (no overlap {r['step_no_overlap']['ms']:.2f}, 256 MiB "
              f"{r['step_256mib']['ms']:.2f}); GEMM sum {r['gemm_sum_ms']:.2f}, memory-bound sum "
              f"{r['memory_bound_sum_ms']:.2f}; {r['wall_s']} s", flush=True)
        doc = {"meta": meta, "results": results}
        if opts.out:
            harness.write_report(Path(opts.out), "split", doc, render)
    print(render({"meta": meta, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
