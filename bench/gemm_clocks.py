"""SM clock and board power while each kind of chunk GEMM runs back to back (nvidia-smi sampled every 100 ms
beside a few seconds of each): whether a fused epilogue costs time by its instructions or by the clock the
GPU drops to under the extra power. Needs a CUDA build with CUTLASS on an sm_90 GPU and nvidia-smi.

    python -m bench.gemm_clocks [--shape xc1M] [--cols C] [--seconds 3] [--out DIR]   # gemm_clocks.{json,md}
    python -m bench.gemm_clocks --shape xc6M_16k --only "statistics, no logit sums (pingpong_cluster_192)" \
        --orders default,m8,n8          # the fused GEMMs' tile orders (HUGEHEAD_GEMM_RASTER / _SWIZZLE)
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported
from bench.bench_gemm import planned_chunk

import torch  # noqa: E402

BF16 = torch.bfloat16


def _variants(name: str, cols=None):
    from hugehead import ops

    shape, x, w, t, cols, wc, tc = planned_chunk(name, cols)
    dev = torch.device("cuda")
    n, v = shape.n, shape.v
    z = x.new_empty(n, cols)
    state = (torch.full((n,), -math.inf, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev),
             torch.zeros(n, device=dev))
    torch.mm(x, wc.t(), out=z)
    lse = torch.logsumexp(z.float(), dim=1) + 3.0
    grad_rows = torch.full((n,), 1.0 / n, device=dev)

    def env(**kv):
        def set_():
            for k in ("HUGEHEAD_GEMM_MAINLOOP_ONLY", "HUGEHEAD_GEMM_GRAD_STORE", "HUGEHEAD_GEMM_SCHEDULE",
                      "HUGEHEAD_GEMM_DENSE", "HUGEHEAD_GEMM_RASTER", "HUGEHEAD_GEMM_SWIZZLE", "HUGEHEAD_GEMM_GRAD_EPI"):
                os.environ.pop(k, None)
            os.environ.update(kv)
        return set_

    stats = lambda: ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state)  # noqa: E731
    # What the loop runs without label smoothing: no logit sums.
    stats_plain = lambda: ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False)  # noqa: E731
    grad = lambda: ops.gemm_chunk_grad_(x, wc, None, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, z)  # noqa: E731
    # The float32 accumulator as each logit (HUGEHEAD_GEMM_EXACT_LOGITS' calls: the 128 x 192 fold, no round trip).
    stats_exact = lambda: ops.gemm_chunk_stats_(x, wc, None, tc, 0, 0.0, *state, with_logit_sum=False,  # noqa: E731
                                                exact=True)
    grad_exact = lambda: ops.gemm_chunk_grad_(  # noqa: E731
        x, wc, None, tc, 0, v, lse, grad_rows, 0.0, 0.0, 0.0, None, z, exact=True)
    tma192 = dict(HUGEHEAD_GEMM_GRAD_STORE="tma", HUGEHEAD_GEMM_SCHEDULE="pingpong_cluster_192")
    cutlass_epi = dict(HUGEHEAD_GEMM_GRAD_EPI="32")  # CUTLASS's 64 x 32 subtiles (the default is 64 x 64)
    # The backward's dense GEMMs on the chunk z (as if it held dLoss/dlogits): dX into float32, dW in bf16.
    gx = torch.zeros(n, shape.d, device=dev)
    dw = wc.new_empty(wc.shape)
    dx_ours = lambda: ops.gemm_dx_(gx, z, wc, True)  # noqa: E731
    dw_ours = lambda: ops.gemm_dw_(dw, z, x, False)  # noqa: E731
    dense = [
        ("cuBLAS dX (addmm into float32)", env(), lambda: torch.addmm(gx, z, wc, out_dtype=gx.dtype, out=gx)),
        ("dX, ours", env(HUGEHEAD_GEMM_DENSE="cutlass"), dx_ours),
        ("dX, ours (alternate tiles)", env(HUGEHEAD_GEMM_DENSE="alternate"), dx_ours),
        ("dX, ours (pingpong)", env(HUGEHEAD_GEMM_DENSE="pingpong"), dx_ours),
        ("dX, ours (stream-K)", env(HUGEHEAD_GEMM_DENSE="streamk"), dx_ours),
        ("cuBLAS dW (mm, bf16 out)", env(), lambda: torch.mm(z.t(), x, out=dw)),
        ("dW, ours", env(HUGEHEAD_GEMM_DENSE="cutlass"), dw_ours),
        ("dW, ours (alternate tiles)", env(HUGEHEAD_GEMM_DENSE="alternate"), dw_ours),
        ("dW, ours (pingpong)", env(HUGEHEAD_GEMM_DENSE="pingpong"), dw_ours),
        ("dW, ours (stream-K)", env(HUGEHEAD_GEMM_DENSE="streamk"), dw_ours),
    ]
    return cols, 2.0 * n * shape.d * cols, dense + [
        ("cuBLAS logits GEMM", env(), lambda: torch.mm(x, wc.t(), out=z)),
        ("mainloop only (pingpong)", env(HUGEHEAD_GEMM_MAINLOOP_ONLY="1", HUGEHEAD_GEMM_SCHEDULE="pingpong"), stats),
        ("fused statistics (pingpong)", env(HUGEHEAD_GEMM_SCHEDULE="pingpong"), stats),
        ("fused statistics, no logit sums (pingpong)", env(HUGEHEAD_GEMM_SCHEDULE="pingpong"), stats_plain),
        ("mainloop only (pingpong_cluster)",
         env(HUGEHEAD_GEMM_MAINLOOP_ONLY="1", HUGEHEAD_GEMM_SCHEDULE="pingpong_cluster"), stats),
        ("fused statistics, no logit sums (pingpong_cluster)", env(HUGEHEAD_GEMM_SCHEDULE="pingpong_cluster"),
         stats_plain),
        # 128 x 192 tiles serve the statistics GEMM without logit sums only (else pingpong_cluster)
        ("mainloop only (pingpong_cluster_192)",
         env(HUGEHEAD_GEMM_MAINLOOP_ONLY="1", HUGEHEAD_GEMM_SCHEDULE="pingpong_cluster_192"), stats_plain),
        ("fused statistics, no logit sums (pingpong_cluster_192)",
         env(HUGEHEAD_GEMM_SCHEDULE="pingpong_cluster_192"), stats_plain),
        ("fused statistics, exact logits (pingpong_cluster_192)", env(), stats_exact),
        ("mainloop only (cooperative)", env(HUGEHEAD_GEMM_MAINLOOP_ONLY="1", HUGEHEAD_GEMM_SCHEDULE="cooperative"),
         stats),
        ("fused statistics (cooperative)", env(HUGEHEAD_GEMM_SCHEDULE="cooperative"), stats),
        ("fused gradient, TMA store (pingpong)", env(HUGEHEAD_GEMM_GRAD_STORE="tma", HUGEHEAD_GEMM_SCHEDULE="pingpong"),
         grad),
        ("fused gradient, TMA store (pingpong_cluster)",
         env(HUGEHEAD_GEMM_GRAD_STORE="tma", HUGEHEAD_GEMM_SCHEDULE="pingpong_cluster"), grad),
        ("fused gradient, TMA store (pingpong_cluster_192)", env(**tma192, **cutlass_epi), grad),
        ("fused gradient, TMA store, 64 x 64 subtiles (pingpong_cluster_192)", env(**tma192), grad),
        ("fused gradient, TMA store, exact logits (pingpong_cluster_192)", env(**tma192, **cutlass_epi), grad_exact),
        ("fused gradient, TMA store, exact logits, 64 x 64 subtiles (pingpong_cluster_192)", env(**tma192),
         grad_exact),
        ("fused gradient, TMA store (cooperative)",
         env(HUGEHEAD_GEMM_GRAD_STORE="tma", HUGEHEAD_GEMM_SCHEDULE="cooperative"), grad),
        ("fused gradient, direct stores (pingpong_cluster)",
         env(HUGEHEAD_GEMM_GRAD_STORE="direct", HUGEHEAD_GEMM_SCHEDULE="pingpong_cluster"), grad),
    ]


def order_env(order: str) -> dict:
    """A fused GEMM tile order as its environment (gemm.h's tile_order_from_env): "default", or a raster "m" /
    "n" and / or a swizzle 2 / 4 / 8, e.g. "m8", "n4", "8" (CUTLASS's raster with swizzle 8), "m"."""
    import re

    if order == "default":
        return {}
    match = re.fullmatch(r"([mn]?)([248]?)", order)
    if not match or not order:
        raise ValueError(f"tile order {order!r}: expected default, or m / n and / or 2 / 4 / 8 (e.g. m8)")
    raster, swizzle = match.groups()
    return {**({"HUGEHEAD_GEMM_RASTER": raster} if raster else {}),
            **({"HUGEHEAD_GEMM_SWIZZLE": swizzle} if swizzle else {})}


def with_orders(variants, orders):
    """Each variant under each tile order in turn (labels suffixed [order]), so drift weighs on each alike."""
    if not orders:
        return variants
    out = []
    for label, set_env, fn in variants:
        for order in orders:
            extra = order_env(order)

            def set_both(set_env=set_env, extra=extra):
                set_env()
                os.environ.update(extra)
            out.append((f"{label} [{order}]", set_both, fn))
    return out


def soak(fn, seconds: float):
    """Runs fn back to back for about `seconds`, with nvidia-smi sampling the clock and power meanwhile; returns
    (ms per call by CUDA events, median SM MHz, median W, median GPU °C, median memory utilization %: the share
    of the sample time HBM was read or written)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,utilization.memory",
                            "--format=csv,noheader,nounits", "-lms", "100", "-i", str(torch.cuda.current_device())],
                           stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.monotonic()
    start.record()
    while time.monotonic() - t0 < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate(timeout=10)
    rows = smi_rows(out)
    rows = rows[len(rows) // 4:]  # the first quarter: the clock still settling
    med = lambda i: statistics.median(r[i] for r in rows) if rows else float("nan")  # noqa: E731
    return start.elapsed_time(end) / calls, med(0), med(1), med(2), med(3)


def smi_rows(out: str):
    """nvidia-smi's CSV samples (clock, power, temperature, memory utilization %) as floats; a field it cannot
    report ("[N/A]") is NaN, a line of another shape is dropped."""
    def num(v):
        try:
            return float(v)
        except ValueError:
            return float("nan")
    return [[num(v) for v in line.split(",")] for line in out.strip().splitlines() if line.count(",") == 3]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="xc1M")
    p.add_argument("--seconds", type=float, default=2.5)
    p.add_argument("--cols", type=int, default=None,
                   help="chunk width (default: the planned one); e.g. a gradient chunk that fits in L2")
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None, help="comma-separated substrings: soak only the variants whose label has one")
    p.add_argument("--orders", default=None,
                   help="comma-separated fused GEMM tile orders to soak each variant under, e.g. default,m8,n8")
    a = p.parse_args(argv)
    orders = a.orders.split(",") if a.orders else []
    for order in orders:
        order_env(order)  # a bad one fails before any soak
    cols, flops, variants = _variants(a.shape, a.cols)
    if a.only:
        variants = [v for v in variants if any(k in v[0] for k in a.only.split(","))]
    variants = with_orders(variants, orders)
    results = []
    for label, set_env, fn in variants:
        set_env()
        ms, mhz, watts, temp, mem = soak(fn, a.seconds)
        results.append({"variant": label, "ms": ms, "tflops": flops / ms / 1e9, "sm_mhz": mhz, "watts": watts,
                         "temp_c": temp, "mem_util_pct": mem})
        print(f"{label:32s} {ms:.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  {mhz:6.0f} MHz {watts:6.0f} W {temp:4.0f} C",
              flush=True)
    meta = harness.run_meta("gemm_clocks", torch.device("cuda"), options=a,
                            command=" ".join(["python", "-m", "bench.gemm_clocks", *sys.argv[1:]]))
    doc = {"meta": meta, "shape": a.shape, "cols": cols, "results": results}
    title = f"Chunk GEMMs, clock and power: {meta.get('machine')} (bfloat16, {a.shape}, {cols} columns)"
    lines = [harness.header(title, meta),
             f"Each variant back to back for {a.seconds:g} s; ms by CUDA events over all its calls, SM clock / power /"
             " temperature / HBM busy (utilization.memory: the share of a sample's time HBM was read or written) the"
             " median of nvidia-smi's 100 ms samples after the first quarter.", "",
             "| variant | ms per chunk | TFLOP/s | SM MHz | W | °C | HBM busy % |", "|---|--:|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['sm_mhz']:.0f} | {r['watts']:.0f} | "
              f"{r['temp_c']:.0f} | {r['mem_util_pct']:.0f} |" for r in results]
    md = "\n".join(lines) + "\n" + harness.footer(meta)
    if a.out:
        harness.write_report(Path(a.out), "gemm_clocks", doc, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
