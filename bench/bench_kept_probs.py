"""What a kept chunk costs at the LLM shapes' depths, piece by piece (one GPU, bf16): the forward's
cuBLAS GEMM + chunk_stats_ (today's path at depths of 2048 and more) against the fused statistics GEMMs that
store the chunk (its logits, or exp(z - ref) for the factored backward), and the backward's chunk_grad_ pass
that a factored backward would not run. Each variant in turns (rounds), CUDA events, medians.

    python -m bench.bench_kept_probs --shapes llama3_4k,llama3,gemma2 --out $OUT/kept_probs
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported
from bench.common import find_shape

import torch  # noqa: E402


def _events_ms(fn, reps: int) -> float:
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return harness.median([s.elapsed_time(e) for s, e in zip(start, end)])


def run_shape(name: str, rounds: int, reps: int) -> dict:
    from hugehead import ops

    s = find_shape(name)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(s.n, s.d, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(s.v, s.d, device=dev, dtype=torch.bfloat16, generator=g) / s.d ** 0.5).to(torch.bfloat16)
    target = torch.randint(0, s.v, (s.n,), device=dev, generator=g)
    z = torch.empty(s.n, s.v, device=dev, dtype=torch.bfloat16)
    f32 = dict(device=dev, dtype=torch.float32)

    def fresh():
        return (torch.full((s.n,), -float("inf"), **f32), torch.zeros(s.n, **f32), torch.zeros(s.n, **f32),
                torch.zeros(s.n, **f32))

    # the reference a kept-last plan would fold against: each row's max over a small tail of classes
    ref = (x.float() @ w[-1280:].float().t()).max(dim=1).values
    stats = fresh()
    torch.mm(x, w.t(), out=z)
    ops.chunk_stats_(z, target, 0, 0.0, *stats)
    lse = stats[0] + stats[1].log()
    grad_rows = torch.full((s.n,), 1.0 / s.n, **f32)

    def cublas():
        torch.mm(x, w.t(), out=z)

    def cublas_stats():
        st = fresh()
        torch.mm(x, w.t(), out=z)
        ops.chunk_stats_(z, target, 0, 0.0, *st)

    def fused_store():
        ops.gemm_chunk_stats_(x, w, None, target, 0, 0.0, *fresh(), with_logit_sum=False, logits=z)

    def fused_probs():
        ops.gemm_chunk_stats_(x, w, None, target, 0, 0.0, *fresh(), with_logit_sum=False, logits=z,
                              reference=ref.clone(), probs=True)

    def grad_pass():
        torch.mm(x, w.t(), out=z)  # (fresh logits each time; the GEMM's time is taken off below)
        ops.chunk_grad_(z, target, 0, s.v, lse, grad_rows, 0.0, 0.0, 0.0)

    variants = {"cublas GEMM": cublas, "cublas + chunk_stats_": cublas_stats, "fused + stored logits": fused_store,
                "fused + stored exp(z - ref)": fused_probs, "cublas + chunk_grad_": grad_pass}
    for fn in variants.values():  # warm-up
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            times[k].append(_events_ms(fn, reps))
    row = {"shape": name, "n": s.n, "d": s.d, "v": s.v}
    row.update({k: harness.median(v) for k, v in times.items()})
    row["chunk_grad_ pass"] = row["cublas + chunk_grad_"] - row["cublas GEMM"]
    row["chunk_stats_ pass"] = row["cublas + chunk_stats_"] - row["cublas GEMM"]
    del z, x, w
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="llama3_4k,llama3,gemma2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    meta = harness.run_meta("kept_probs", dev, options=vars(args))
    rows = [run_shape(name, args.rounds, args.reps) for name in args.shapes.split(",")]
    cols = ["cublas GEMM", "cublas + chunk_stats_", "fused + stored logits", "fused + stored exp(z - ref)",
            "cublas + chunk_grad_", "chunk_stats_ pass", "chunk_grad_ pass"]
    md = harness.header("A kept chunk's pieces at the LLM depths", meta) + harness.md_table(
        ["shape", "N×D×V"] + [c + " ms" for c in cols],
        [[r["shape"], f"{r['n']}×{r['d']}×{r['v']}"] + [harness.fmt(r[c], ".3f") for c in cols] for r in rows])
    print(md)
    if args.out:
        harness.write_report(Path(args.out), "kept_probs", {"meta": meta, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
