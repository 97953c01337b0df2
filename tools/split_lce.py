"""Where hugehead's forward+backward time goes on one GPU: the real step (``linear_cross_entropy`` forward
+ backward at the plan it chooses) under torch.profiler, its kernels summed by stage of the chunk loop with
each GEMM stage's achieved TFLOP/s (from the shapes of the ops that launched them: the fused statistics and
gradient GEMMs, cuBLAS's dX / dW, the kept chunks' logits GEMMs and memory-bound passes, the
partials' merges), beside the step with ``memory_budget=256 MiB``.

    python -m tools.split_lce [--shapes llama3_4k,xc6M] [--out DIR] [--widths 16384,32768,65536]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        python -m tools.split_lce --ncu xc6M      # one chunk of every cuBLAS-path stage, for Nsight Compute
    (one fused chunk of each kind for Nsight Compute: ``python -m tools.bench_gemm --ncu xc6M``)

``--widths``: a sweep of cuBLAS's three GEMMs of one chunk at each width (the streamed loop's cost per class).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

from bench import harness  # first: decides which hugehead is imported
from tools import profile_step
from bench.common import SHAPES, find_shape, make_inputs

import torch  # noqa: E402

BF16 = torch.bfloat16
PEAK_TFLOPS = 790.0  # an H200's 8192^3 bf16 GEMM (docs/performance.md, "The floors")
TARGETS_MS = {"xc1M": 70.0, "xc6M": 215.0, "xc6M_16k": 900.0}  # the step targets (default budget, exact gradients)


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

    # beyond the inputs and the two returned gradients, as bench_lce counts it. (Without input_bytes the
    # baseline would be what was allocated when the timed calls began, the last warm-up's gradients included.)
    timing = harness.measure(step, x.device, reps=reps, warmup=2, input_bytes=harness.tensor_bytes(x, w, t))
    grads = harness.tensor_bytes(x, w)
    return {"ms": timing.ms, "peak_extra_gib": max(0, timing.peak_extra_bytes - grads) / 2**30}


PROFILED_STEPS = 3


def _profiled_step(x, w, t):
    import hugehead

    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def run():
        loss = hugehead.linear_cross_entropy(xg, wg, t)
        return torch.autograd.grad(loss, (xg, wg))
    return run


def split_shape(shape, reps: int, widths: List[int]) -> dict:
    from hugehead.lce_op import loss_plan

    dev = torch.device("cuda")
    x, w, t = make_inputs(shape, dev, dtype=BF16, seed=0)
    n, d, v = shape.n, shape.d, shape.v
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    plan = loss_plan(xg, wg, t)  # the plan the step below takes
    out = {"shape": shape.name, "n": n, "d": d, "v": v, "plan": dict(vars(plan)),
           "target_ms": TARGETS_MS.get(shape.name),
           "floor_6ndv_ms": 6.0 * n * d * v / PEAK_TFLOPS / 1e9, "floor_8ndv_ms": 8.0 * n * d * v / PEAK_TFLOPS / 1e9}

    # The whole step at the planned default, and at a 256 MiB budget.
    out["step"] = _step_ms(x, w, t, reps)
    out["step_256mib"] = _step_ms(x, w, t, reps, memory_budget=256 << 20)
    out["plan_256mib"] = dict(vars(loss_plan(xg, wg, t, memory_budget=256 << 20)))
    torch.cuda.empty_cache()

    # The real step's kernels by stage (profile_step's attribution).
    run = _profiled_step(x, w, t)
    step_ms = out["step"]["ms"]
    prof = profile_step.profile_steps(run, PROFILED_STEPS)
    stages = profile_step.stage_split(prof.events(), PROFILED_STEPS, n, d)
    out["stages"] = stages
    gemm = {k: v_ for k, v_ in stages.items() if profile_step.is_gemm_stage(k)}
    out["gemm_sum_ms"] = sum(v_["ms"] for v_ in gemm.values())
    out["gemm_tflops"] = (sum(v_["flops"] for v_ in gemm.values()) / out["gemm_sum_ms"] / 1e9
                          if out["gemm_sum_ms"] else None)
    out["other_sum_ms"] = sum(v_["ms"] for k, v_ in stages.items() if k not in gemm)
    out["gaps_ms"] = step_ms - out["gemm_sum_ms"] - out["other_sum_ms"]
    del prof, run
    torch.cuda.empty_cache()

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


def _plan_text(p: dict, v: int) -> str:
    if p.get("grad_in_forward"):
        return f"rows={p['rows']}, cols={p['cols']} (rows plan)"
    if p["keep_logits"] and p["cols"] == v:
        return "keep all"
    return f"cols={p['cols']}, kept {p['kept_chunks'] if p['keep_logits'] else 0}" + (", overlap" if p["overlap"] else "")


def render(doc: dict) -> str:
    m = doc["meta"]
    lines = [harness.header(f"Timing splits of hugehead's chunk loop: {m['machine']} (bfloat16, forward + backward)",
                            m),
             f"8192³ bf16 GEMM on this GPU now: {m['square_gemm_tflops']:.0f} TFLOP/s.", "",
             "step = `linear_cross_entropy` forward + backward (CUDA events, median), at the plan it chooses. "
             "Stages: the same step under torch.profiler "
             f"({PROFILED_STEPS} steps), each kernel counted in the stage of the op that launched it; TFLOP/s "
             "from that op's shapes. gaps = step − every kernel's time.", "",
             "| shape | plan | step ms | GEMMs ms (TFLOP/s) | other kernels ms | gaps ms | target | "
             "6·NDV / 8·NDV at 790 |",
             "|---|---|--:|--:|--:|--:|--:|---|"]
    for r in doc["results"]:
        lines.append(
            f"| {r['shape']} | {_plan_text(r['plan'], r['v'])} | {r['step']['ms']:.2f} | "
            f"{r['gemm_sum_ms']:.2f} ({r['gemm_tflops'] or 0:.0f}) | {r['other_sum_ms']:.2f} | {r['gaps_ms']:.2f} | "
            f"{r['target_ms'] if r['target_ms'] else '-'} | {r['floor_6ndv_ms']:.1f} / {r['floor_8ndv_ms']:.1f} |")
    for r in doc["results"]:
        lines += ["", f"### {r['shape']} ({r['n']}×{r['d']}×{r['v']}): step {r['step']['ms']:.2f} ms", ""]
        lines += profile_step.stage_lines(r["stages"], r["step"]["ms"])
    lines += ["", "## `memory_budget=256 MiB` against the default", "",
              "| shape | default ms | peak extra GiB | 256 MiB ms | peak extra GiB | ratio | 256 MiB plan |",
              "|---|--:|--:|--:|--:|--:|---|"]
    for r in doc["results"]:
        a, b = r["step"], r["step_256mib"]
        p = r["plan_256mib"]
        lines.append(f"| {r['shape']} | {a['ms']:.2f} | {a['peak_extra_gib']:.2f} | {b['ms']:.2f} | "
                     f"{b['peak_extra_gib']:.3f} | {b['ms'] / a['ms']:.2f}× | {_plan_text(p, r['v'])} |")
    if not any(r.get("width_sweep") for r in doc["results"]):
        return "\n".join(lines) + "\n" + harness.footer(m)
    lines += ["", "## Streamed-loop GEMMs per chunk width (ms per chunk, TFLOP/s; per step = 2 logits + dX + dW "
              "GEMMs over all V; cuBLASLt: the same GEMMs with `preferred_blas_library('cublaslt')`; dX ∥ dW: dX on a "
              "second stream beside dW)", "",
              "| shape | width | logits GEMM | dX GEMM | dW GEMM | GEMMs per step ms | cuBLASLt logits / dX / dW "
              "| dX + dW | dX ∥ dW |", "|---|--:|--:|--:|--:|--:|---|--:|--:|"]
    for r in doc["results"]:
        for width, q in r.get("width_sweep", {}).items():
            lines.append(f"| {r['shape']} | {width} | {q['logits']:.3f} ({q['logits_tflops']:.0f}) | "
                         f"{q['dx']:.3f} ({q['dx_tflops']:.0f}) | {q['dw']:.3f} ({q['dw_tflops']:.0f}) | "
                         f"{q['streamed_gemms_ms_per_step']:.1f} | "
                         + (" / ".join(f"{q[k + '_cublaslt']:.3f}" for k in ("logits", "dx", "dw"))
                            if "logits_cublaslt" in q else q.get("cublaslt_error", "-"))
                         + f" | {q['dx'] + q['dw']:.3f} | {q['dx_dw_side_by_side']:.3f} |")
    return "\n".join(lines) + "\n" + harness.footer(m)


def ncu_one(shape_name: str) -> None:
    """One chunk of every stage between cudaProfilerStart/Stop (after a warm-up), for ncu."""
    from hugehead.plan import plan_chunks

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
    p.add_argument("--widths", default="", help="chunk widths for a sweep of cuBLAS's GEMMs of one chunk (e.g. "
                   "16384,32768,65536; none by default)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="folder for split.json / split.md")
    p.add_argument("--ncu", metavar="SHAPE", help="run one chunk of each stage for Nsight Compute and exit")
    opts = p.parse_args(argv)
    if opts.ncu:
        ncu_one(opts.ncu)
        return 0
    meta = harness.run_meta("split", torch.device("cuda"), options=opts,
                            shapes={n: vars(find_shape(n)) for n in opts.shapes.split(",")},
                            command=" ".join(["python", "-m", "tools.split_lce", *sys.argv[1:]]),
                            square_gemm_tflops=square_gemm_tflops(opts.reps))
    widths = [int(c) for c in opts.widths.split(",") if c]
    results = []
    for name in opts.shapes.split(","):
        t0 = time.perf_counter()
        r = split_shape(find_shape(name), opts.reps, widths)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(f"{name:<9} step {r['step']['ms']:.2f} ms (256 MiB "
              f"{r['step_256mib']['ms']:.2f}); GEMMs {r['gemm_sum_ms']:.2f}, other kernels "
              f"{r['other_sum_ms']:.2f}, gaps {r['gaps_ms']:.2f}; {r['wall_s']} s", flush=True)
        doc = {"meta": meta, "results": results}
        if opts.out:
            harness.write_report(Path(opts.out), "split", doc, render)
    print(render({"meta": meta, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
