"""The fused CUTLASS GEMMs of issue 21 against the cuBLAS stages they replace, one chunk at a time (CUDA
events, median), at the chunk width ``linear_cross_entropy`` plans for each shape:

  forward   cuBLAS ``Z = X W_cᵀ`` (bf16 out) + ``chunk_stats_``  vs  ``gemm_chunk_stats_`` (pingpong, cooperative)
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
import os
import sys
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported
from bench.common import find_shape, make_inputs

import torch  # noqa: E402

BF16 = torch.bfloat16
# HUGEHEAD_GEMM_SCHEDULE values each fused GEMM has (the gradient GEMM has cooperative and pingpong_cluster_192
# ones for its TMA store only).
STATS_SCHEDULES = ("pingpong", "pingpong_cluster", "cooperative")
GRAD_SCHEDULES = ("pingpong", "pingpong_cluster")
GRAD_TMA_ONLY = ("pingpong_cluster_192", "cooperative")
# The statistics GEMM without logit sums (a loss without label smoothing) has 128 x 192 tiles too (the default
# below a depth of 2048); with them pingpong_cluster_192 runs pingpong_cluster.
NOSUM_SCHEDULES = ("pingpong_cluster", "pingpong_cluster_192")
# HUGEHEAD_GEMM_GRAD_STORE values: the gradient through shared memory and TMA stores (the default where it
# applies) or the register epilogue's direct stores.
GRAD_STORES = ("tma", "direct")


def _grad_key(schedule: str, store: str) -> str:
    return f"fused_grad_{schedule}" + ("" if store == "tma" else f"_{store}")


def _ms(fn, reps: int) -> float:
    return harness.measure(fn, torch.device("cuda"), reps=reps, warmup=2).ms


def planned_chunk(name: str, cols=None):
    """A shape's bf16 inputs on the GPU and its first chunk as the loop plans it (``cols`` None: the planned
    width): ``(shape, x, w, t, cols, wc, tc)``, with every row's target clamped into the chunk so the
    target-logit path is exercised. """
    from hugehead.loop import plan_chunks

    shape = find_shape(name)
    dev = torch.device("cuda")
    x, w, t = make_inputs(shape, dev, dtype=BF16, seed=0)
    cols = min(cols or plan_chunks(shape.n, shape.d, shape.v, BF16, dev).cols, shape.v)
    return shape, x, w, t, cols, w[:cols], t.clamp(max=cols - 1)


def bench_shape(name: str, reps: int, cols=None) -> dict:
    from hugehead import ops
    from hugehead.loop import plan_chunks

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
    timings = {"cublas_logits": _ms(cublas_logits, reps), "cublas_stats": _ms(cublas_stats, reps)}
    for schedule in STATS_SCHEDULES:
        os.environ["HUGEHEAD_GEMM_SCHEDULE"] = schedule
        timings[f"fused_stats_{schedule}"] = _ms(fused_stats, reps)
    # Without the logit sums (a loss without label smoothing): the default schedule, and by schedule.
    def fused_stats_nosum():
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False)

    os.environ.pop("HUGEHEAD_GEMM_SCHEDULE", None)
    timings["fused_stats_nosum"] = _ms(fused_stats_nosum, reps)
    for schedule in NOSUM_SCHEDULES:
        os.environ["HUGEHEAD_GEMM_SCHEDULE"] = schedule
        timings[f"fused_stats_nosum_{schedule}"] = _ms(fused_stats_nosum, reps)
    timings["cublas_grad"] = _ms(cublas_grad, reps)
    for store in GRAD_STORES:
        os.environ["HUGEHEAD_GEMM_GRAD_STORE"] = store
        for schedule in GRAD_SCHEDULES + (GRAD_TMA_ONLY if store == "tma" else ()):
            os.environ["HUGEHEAD_GEMM_SCHEDULE"] = schedule
            timings[_grad_key(schedule, store)] = _ms(fused_grad, reps)
    os.environ.pop("HUGEHEAD_GEMM_GRAD_STORE")
    # The floors: each schedule's mainloop alone (the epilogue returns at once; nothing is computed).
    os.environ["HUGEHEAD_GEMM_MAINLOOP_ONLY"] = "1"
    for schedule in STATS_SCHEDULES:
        os.environ["HUGEHEAD_GEMM_SCHEDULE"] = schedule
        timings[f"mainloop_{schedule}"] = _ms(fused_stats, reps)
    os.environ["HUGEHEAD_GEMM_SCHEDULE"] = "pingpong_cluster_192"  # its tiles run without logit sums only
    timings["mainloop_pingpong_cluster_192"] = _ms(fused_stats_nosum, reps)
    os.environ.pop("HUGEHEAD_GEMM_MAINLOOP_ONLY")
    os.environ.pop("HUGEHEAD_GEMM_SCHEDULE", None)
    # With a bias (nn.Linear's default), the default schedule.
    bias = torch.randn(cols, device=dev).to(BF16)
    timings["fused_stats_bias"] = _ms(lambda: ops.gemm_chunk_stats_(x, wc, bias, tc, 0, 0.0, *state), reps)
    timings["fused_grad_bias"] = _ms(
        lambda: ops.gemm_chunk_grad_(x, wc, bias, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, z), reps)
    row.update(_bench_dense(x, wc, z, reps, timings))  # z: the last gradient chunk written
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
    # Both stores of the gradient GEMM compute the same arithmetic: their chunks must be the same bits.
    g_tma = z.clone()
    os.environ["HUGEHEAD_GEMM_GRAD_STORE"] = "direct"
    fused_grad()
    os.environ.pop("HUGEHEAD_GEMM_GRAD_STORE")
    row["grad_tma_equals_direct"] = bool(torch.equal(g_tma, z))
    del x, w, t, z
    torch.cuda.empty_cache()
    return row


def _bench_dense(x, wc, g, reps: int, timings: dict) -> dict:
    """The backward's dX (into float32) and dW (bf16) GEMMs on the gradient chunk ``g``: cuBLAS against ours
    (both tile choices, ``HUGEHEAD_GEMM_DENSE``), timed into ``timings``; each one's relative error against
    float64 products of the same bf16 operands."""
    from hugehead import ops

    n, d = x.shape
    gx = torch.zeros(n, d, device=x.device)
    dw = wc.new_empty(wc.shape)
    part = x.new_empty(n, d)

    def cublas_dx_partial():
        torch.mm(g, wc, out=part)
        gx.add_(part)

    dense = {
        "cublas_dx": lambda: torch.addmm(gx, g, wc, out_dtype=gx.dtype, out=gx),
        "cublas_dx_partial": cublas_dx_partial,
        "cublas_dw": lambda: torch.mm(g.t(), x, out=dw),
    }
    for key, fn in dense.items():
        timings[key] = _ms(fn, reps)
    for config in ("cutlass", "alternate"):
        os.environ["HUGEHEAD_GEMM_DENSE"] = config
        suffix = "" if config == "cutlass" else "_alt"
        timings["dense_dx" + suffix] = _ms(lambda: ops.gemm_dx_(gx, g, wc, True), reps)
        timings["dense_dw" + suffix] = _ms(lambda: ops.gemm_dw_(dw, g, x, False), reps)
    os.environ.pop("HUGEHEAD_GEMM_DENSE", None)
    # Errors against float64 (one chunk: dX = g W_c written, not added; dW = gᵀ x).
    ref_dx = g.double() @ wc.double()
    ref_dw = g.double().t() @ x.double()
    rel = lambda a, ref: float((a.double() - ref).norm() / ref.norm())  # noqa: E731
    out = {}
    torch.addmm(gx, g, wc, beta=0, out_dtype=gx.dtype, out=gx)
    out["dx_rel_err_cublas"] = rel(gx, ref_dx)
    ops.gemm_dx_(gx, g, wc, False)
    out["dx_rel_err_dense"] = rel(gx, ref_dx)
    torch.mm(g.t(), x, out=dw)
    out["dw_rel_err_cublas"] = rel(dw, ref_dw)
    ops.gemm_dw_(dw, g, x, False)
    out["dw_rel_err_dense"] = rel(dw, ref_dw)
    ops.gemm_dx_(gx, g, wc, False)
    first = gx.clone()
    ops.gemm_dx_(gx, g, wc, False)
    out["dense_dx_repeat_bitwise"] = bool(torch.equal(first, gx))
    del ref_dx, ref_dw
    return out


def ncu_one(name: str) -> None:
    """One planned chunk of the fused statistics GEMM (both schedules) and of the fused gradient GEMM between
    cudaProfilerStart/Stop, after a warm-up."""
    from hugehead import ops

    shape, x, w, t, cols, wc, tc = planned_chunk(name)
    dev = torch.device("cuda")
    n, v = shape.n, shape.v
    state = (torch.full((n,), -math.inf, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev),
             torch.zeros(n, device=dev))
    g = x.new_empty(n, cols)
    lse, grad_rows = torch.full((n,), 12.0, device=dev), torch.full((n,), 1.0 / n, device=dev)

    def chunk():
        for schedule in STATS_SCHEDULES:
            os.environ["HUGEHEAD_GEMM_SCHEDULE"] = schedule
            ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state)
        os.environ["HUGEHEAD_GEMM_SCHEDULE"] = "pingpong_cluster_192"  # 128 x 192: without logit sums
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False)
        for schedule in GRAD_SCHEDULES + GRAD_TMA_ONLY[:1]:  # no bias: the TMA store applies
            os.environ["HUGEHEAD_GEMM_SCHEDULE"] = schedule
            ops.gemm_chunk_grad_(x, wc, None, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, g)
        os.environ.pop("HUGEHEAD_GEMM_SCHEDULE", None)
        # what the step runs by default for a chunk it does not keep: the exact-logits fold (128 x 192) and
        # the exact gradient through the TMA store (64 x 64 subtiles)
        ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False, exact=True)
        ops.gemm_chunk_grad_(x, wc, None, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, g, exact=True)

    chunk()
    torch.cuda.synchronize()
    print(f"ncu: {name} width {cols}: stats GEMM (+ merge) for each of {STATS_SCHEDULES} and pingpong_cluster_192 "
          "(without logit sums), grad GEMM for each of "
          f"{GRAD_SCHEDULES + GRAD_TMA_ONLY[:1]}, then the step's default pair (exact logits: stats without "
          "logit sums, grad through the TMA store)", flush=True)
    torch.cuda.profiler.start()
    chunk()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def render(doc: dict) -> str:
    m = doc["meta"]
    stats = [f"fused_stats_{k}" for k in STATS_SCHEDULES]
    grads = ([_grad_key(k, st) for st in GRAD_STORES for k in GRAD_SCHEDULES]
             + [_grad_key(k, "tma") for k in GRAD_TMA_ONLY])
    lines = [harness.header(f"Fused CUTLASS GEMMs vs cuBLAS + kernels, one chunk: {m['machine']} (bfloat16)", m),
             "ms per chunk (TFLOP/s on 2·N·D·C); per step = × V / C. Fused = no logits in HBM; the fused columns "
             "are the HUGEHEAD_GEMM_SCHEDULE values; grad tma / direct: the gradient stored through shared memory "
             "by TMA (the default where it applies) or by the register epilogue (HUGEHEAD_GEMM_GRAD_STORE=direct).", "",
             "| shape | C | cuBLAS logits GEMM | cuBLAS + chunk_stats_ | "
             + " | ".join(f"stats {k}" for k in STATS_SCHEDULES) + " | cuBLAS + chunk_grad_ | "
             + " | ".join(f"grad {k} {st}" for st in GRAD_STORES for k in GRAD_SCHEDULES)
             + "".join(f" | grad {k} tma" for k in GRAD_TMA_ONLY)
             + " | fwd per step cuBLAS → best fused | bwd recompute per step cuBLAS → best fused | Δlse max | grad rel Δ "
             "| tma = direct bitwise |",
             "|---|--:|" + "--:|" * (4 + len(stats) + len(grads)) + "---|---|--:|--:|---|"]
    for r in doc["results"]:
        c, tf, s = r["chunk_ms"], r["chunk_tflops"], r["step_ms"]

        def cell(k):
            return f"{c[k]:.3f} ({tf[k]:.0f})" if k in c else "–"

        best_s = min(s[k] for k in stats if k in s)
        best_g = min(s[k] for k in grads if k in s)
        lines.append(f"| {r['shape']} | {r['cols']} | {cell('cublas_logits')} | {cell('cublas_stats')} | "
                     + " | ".join(cell(k) for k in stats) + f" | {cell('cublas_grad')} | "
                     + " | ".join(cell(k) for k in grads)
                     + f" | {s['cublas_stats']:.1f} → {best_s:.1f} ms | {s['cublas_grad']:.1f} → {best_g:.1f} ms | "
                     f"{r['max_abs_lse_diff']:.2g} | {r['grad_rel_diff']:.2g} | {r.get('grad_tma_equals_direct', '–')} |")
    lines += ["", "The floors (HUGEHEAD_GEMM_MAINLOOP_ONLY=1: the epilogue returns at once) and a bias (the default "
              "schedule):", "",
              "| shape | C | " + " | ".join(f"mainloop {k}" for k in STATS_SCHEDULES + ("pingpong_cluster_192",))
              + " | stats + bias | grad + bias | stats without logit sums (no label smoothing) | "
              + " | ".join(f"stats without logit sums {k}" for k in NOSUM_SCHEDULES) + " |",
              "|---|--:|" + "--:|" * (len(STATS_SCHEDULES) + 4 + len(NOSUM_SCHEDULES))]
    for r in doc["results"]:
        c, tf = r["chunk_ms"], r["chunk_tflops"]

        def cell2(k):
            return f"{c[k]:.3f} ({tf[k]:.0f})" if k in c else "–"

        lines.append(f"| {r['shape']} | {r['cols']} | "
                     + " | ".join(cell2(f"mainloop_{k}") for k in STATS_SCHEDULES + ("pingpong_cluster_192",))
                     + f" | {cell2('fused_stats_bias')} | {cell2('fused_grad_bias')} | {cell2('fused_stats_nosum')} | "
                     + " | ".join(cell2(f"fused_stats_nosum_{k}") for k in NOSUM_SCHEDULES) + " |")
    dense = ("cublas_dx", "cublas_dx_partial", "dense_dx", "dense_dx_alt", "cublas_dw", "dense_dw", "dense_dw_alt")
    lines += ["", "The backward's dense GEMMs on a gradient chunk (HUGEHEAD_GEMM_DENSE: ours on the default or the "
              "alternate tiles, or cuBLAS): dX = g W_c into float32 (cuBLAS: addmm with out_dtype, or a bf16 "
              "partial + add), dW = gᵀ x in bf16; relative errors against float64 products of the same operands:", "",
              "| shape | C | cuBLAS dX | cuBLAS dX (bf16 partial + add) | dX ours | dX ours (alternate) | cuBLAS dW "
              "| dW ours | dW ours (alternate) | dX rel err cuBLAS / ours | dW rel err cuBLAS / ours | dX repeat bitwise |",
              "|---|--:|" + "--:|" * len(dense) + "--:|--:|---|"]
    for r in doc["results"]:
        c, tf = r["chunk_ms"], r["chunk_tflops"]
        if "dense_dx" not in c:
            continue
        lines.append(f"| {r['shape']} | {r['cols']} | " + " | ".join(f"{c[k]:.3f} ({tf[k]:.0f})" for k in dense)
                     + f" | {r['dx_rel_err_cublas']:.2g} / {r['dx_rel_err_dense']:.2g} | "
                     f"{r['dw_rel_err_cublas']:.2g} / {r['dw_rel_err_dense']:.2g} | {r['dense_dx_repeat_bitwise']} |")
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
