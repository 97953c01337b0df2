"""The fused CUTLASS GEMMs against the cuBLAS stages they replace, one chunk at a time (CUDA
events, median), at the chunk width ``linear_cross_entropy`` plans for each shape:

  forward   cuBLAS ``Z = X W_cᵀ`` (bf16 out) + ``chunk_stats_``  vs  ``gemm_chunk_stats_``
  backward  cuBLAS recompute + ``chunk_grad_`` in place          vs  ``gemm_chunk_grad_``
  the cuBLAS logits GEMM alone (its TFLOP/s: the stored-output GEMM the fused ones must beat)

with TFLOP/s on 2·N·D·C, the per-step totals (× V / C), and how far the fused results are from the cuBLAS
path's (max |Δ lse|, relative error of the gradient chunk). Needs a CUDA build with CUTLASS on an sm_90 GPU.

    python -m tools.bench_gemm [--shapes xc1M,xc6M] [--out DIR] [--reps 10]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        python -m tools.bench_gemm --ncu xc6M       # one fused chunk of each kind, for Nsight Compute
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported
from bench.common import find_shape, make_inputs

import torch  # noqa: E402

BF16 = torch.bfloat16
# Each fused GEMM runs the schedule its depth picks (csrc/cuda/gemm/dispatch.cu); nothing here selects another.


def _ms(fn, reps: int) -> float:
    return harness.measure(fn, torch.device("cuda"), reps=reps, warmup=2).ms


def planned_chunk(name: str, cols=None):
    """A shape's bf16 inputs on the GPU and its first chunk as the loop plans it (``cols`` None: the planned
    width): ``(shape, x, w, t, cols, wc, tc)``, with every row's target clamped into the chunk so the
    target-logit path is exercised. """
    from hugehead.plan import plan_chunks

    shape = find_shape(name)
    dev = torch.device("cuda")
    x, w, t = make_inputs(shape, dev, dtype=BF16, seed=0)
    cols = min(cols or plan_chunks(shape.n, shape.d, shape.v, BF16, dev).cols, shape.v)
    return shape, x, w, t, cols, w[:cols], t.clamp(max=cols - 1)


def bench_shape(name: str, reps: int, cols=None) -> dict:
    from hugehead import ops
    from hugehead.plan import plan_chunks

    shape, x, w, t, cols, wc, tc = planned_chunk(name, cols)
    dev = torch.device("cuda")
    n, d, v = shape.n, shape.d, shape.v
    plan = plan_chunks(n, d, v, BF16, dev)  # recorded in the row
    z = x.new_empty(n, cols)
    fresh = lambda: (torch.full((n,), -math.inf, device=dev), torch.zeros(n, device=dev),  # noqa: E731
                     torch.zeros(n, device=dev), torch.zeros(n, device=dev))
    state = fresh()
    torch.mm(x, wc.t(), out=z)
    lse = torch.logsumexp(z.float(), dim=1) + 3.0  # as if other chunks added mass
    grad_rows = torch.full((n,), 1.0 / n, device=dev)

    def cublas_logits():
        torch.mm(x, wc.t(), out=z)

    def cublas_stats():
        torch.mm(x, wc.t(), out=z)
        ops.chunk_stats_(z, tc, 0, 0.0, *state)

    def fused_stats():
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state)

    def cublas_grad():
        torch.mm(x, wc.t(), out=z)
        ops.chunk_grad_(z, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None)

    def fused_grad():
        ops.gemm_chunk_grad_(x, wc, None, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, z)

    flops = 2.0 * n * d * cols
    per_step = v / cols
    row = {"shape": name, "n": n, "d": d, "v": v, "cols": cols, "plan": dict(vars(plan))}
    def fused_stats_nosum():  # without the logit sums (a loss without label smoothing)
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False)

    timings = {"cublas_logits": _ms(cublas_logits, reps), "cublas_stats": _ms(cublas_stats, reps),
               "fused_stats": _ms(fused_stats, reps), "fused_stats_nosum": _ms(fused_stats_nosum, reps),
               "cublas_grad": _ms(cublas_grad, reps), "fused_grad": _ms(fused_grad, reps)}
    # With a bias (nn.Linear's default; the gradient then takes the register epilogue, not the TMA store).
    bias = torch.randn(cols, device=dev).to(BF16)
    timings["fused_stats_bias"] = _ms(lambda: ops.gemm_chunk_stats_(x, wc, bias, tc, 0, 0.0, *state), reps)
    timings["fused_grad_bias"] = _ms(
        lambda: ops.gemm_chunk_grad_(x, wc, bias, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, z), reps)
    row["chunk_ms"] = timings
    row["chunk_tflops"] = {k: flops / ms / 1e9 for k, ms in timings.items()}
    row["step_ms"] = {k: ms * per_step for k, ms in timings.items()}

    # How far the fused results are from the cuBLAS path's on this chunk.
    a, b = fresh(), fresh()
    torch.mm(x, wc.t(), out=z)
    ops.chunk_stats_(z, tc, 0, 0.0, *a)
    ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *b)
    row["max_abs_lse_diff"] = float(((a[0] + a[1].log()) - (b[0] + b[1].log())).abs().max())
    row["max_abs_target_logit_diff"] = float((a[2] - b[2]).abs().max())
    cublas_grad()
    g_cublas = z.float().clone()
    fused_grad()
    row["grad_rel_diff"] = float((z.float() - g_cublas).norm() / g_cublas.norm())
    del x, w, t, z
    torch.cuda.empty_cache()
    return row


def ncu_one(name: str) -> None:
    """One planned chunk of the fused statistics GEMM (with and without logit sums) and of the fused gradient
    GEMM, then the step's exact-logits pair, between cudaProfilerStart/Stop, after a warm-up."""
    from hugehead import ops

    shape, x, w, t, cols, wc, tc = planned_chunk(name)
    dev = torch.device("cuda")
    n, v = shape.n, shape.v
    state = (torch.full((n,), -math.inf, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev),
             torch.zeros(n, device=dev))
    g = x.new_empty(n, cols)
    lse, grad_rows = torch.full((n,), 12.0, device=dev), torch.full((n,), 1.0 / n, device=dev)

    def chunk():
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state)
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False)
        ops.gemm_chunk_grad_(x, wc, None, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, g)  # no bias: TMA store
        # what the step runs by default for a chunk it does not keep: the exact-logits fold (128 x 192) and
        # the exact gradient through the TMA store (64 x 64 subtiles)
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False, exact=True)
        ops.gemm_chunk_grad_(x, wc, None, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, g, exact=True)

    chunk()
    torch.cuda.synchronize()
    print(f"ncu: {name} width {cols}: stats GEMM (+ merge) with and without logit sums, grad GEMM, then the "
          "step's default pair (exact logits: stats without logit sums, grad through the TMA store)", flush=True)
    torch.cuda.profiler.start()
    chunk()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def render(doc: dict) -> str:
    m = doc["meta"]
    lines = [harness.header(f"Fused CUTLASS GEMMs vs cuBLAS + kernels, one chunk: {m['machine']} (bfloat16)", m),
             "ms per chunk (TFLOP/s on 2·N·D·C); per step = × V / C. Fused = no logits in HBM, each on the "
             "schedule its depth picks; the gradient is stored through shared memory by TMA where that applies "
             "(not with a bias).", "",
             "| shape | C | cuBLAS logits GEMM | cuBLAS + chunk_stats_ | fused stats | cuBLAS + chunk_grad_ "
             "| fused grad | fwd per step cuBLAS → fused | bwd recompute per step cuBLAS → fused | Δlse max "
             "| grad rel Δ |",
             "|---|--:|--:|--:|--:|--:|--:|---|---|--:|--:|"]
    for r in doc["results"]:
        c, tf, s = r["chunk_ms"], r["chunk_tflops"], r["step_ms"]

        def cell(k):
            return f"{c[k]:.3f} ({tf[k]:.0f})" if k in c else "–"

        lines.append(f"| {r['shape']} | {r['cols']} | {cell('cublas_logits')} | {cell('cublas_stats')} | "
                     f"{cell('fused_stats')} | {cell('cublas_grad')} | {cell('fused_grad')} | "
                     f"{s['cublas_stats']:.1f} → {s['fused_stats']:.1f} ms | "
                     f"{s['cublas_grad']:.1f} → {s['fused_grad']:.1f} ms | "
                     f"{r['max_abs_lse_diff']:.2g} | {r['grad_rel_diff']:.2g} |")
    lines += ["", "With a bias, and the statistics without logit sums (no label smoothing):", "",
              "| shape | C | stats + bias | grad + bias | stats without logit sums |",
              "|---|--:|--:|--:|--:|"]
    for r in doc["results"]:
        c, tf = r["chunk_ms"], r["chunk_tflops"]

        def cell2(k):
            return f"{c[k]:.3f} ({tf[k]:.0f})" if k in c else "–"

        lines.append(f"| {r['shape']} | {r['cols']} | {cell2('fused_stats_bias')} | {cell2('fused_grad_bias')} | "
                     f"{cell2('fused_stats_nosum')} |")
    return "\n".join(lines) + "\n" + harness.footer(m)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="xc1M,xc6M")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cols", type=int, default=None, help="chunk width (default: the planned one)")
    p.add_argument("--out", default=None, help="folder for gemm.json / gemm.md")
    p.add_argument("--ncu", metavar="SHAPE", help="run one fused chunk of each kind for Nsight Compute and exit")
    opts = p.parse_args(argv)
    from hugehead import ops

    if not ops.has_fused_gemm(torch.device("cuda"), BF16):
        print("no fused GEMMs here: needs a CUDA build with CUTLASS (HUGEHEAD_CUTLASS=ON) and an sm_90 GPU")
        return 2
    if opts.ncu:
        ncu_one(opts.ncu)
        return 0
    meta = harness.run_meta("gemm", torch.device("cuda"), options=opts,
                            command=" ".join(["python", "-m", "tools.bench_gemm", *sys.argv[1:]]))
    results = []
    for name in opts.shapes.split(","):
        results.append(bench_shape(name, opts.reps, opts.cols))
        r = results[-1]
        print(f"{name:<9} C={r['cols']}: " + ", ".join(f"{k} {ms:.3f} ms ({r['chunk_tflops'][k]:.0f} TFLOP/s)"
                                                      for k, ms in r["chunk_ms"].items())
              + f"; max |Δlse| {r['max_abs_lse_diff']:.2g}, grad rel Δ {r['grad_rel_diff']:.2g}", flush=True)
        doc = {"meta": meta, "results": results}
        if opts.out:
            harness.write_report(Path(opts.out), "gemm", doc, render)
    print(render({"meta": meta, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
