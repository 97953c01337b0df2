"""Multi-label heads beside the single-label step, in one run: forward+backward of

- ``single``: ``hugehead.linear_cross_entropy(x, W, y)`` with class ids (the baseline),
- ``multi``: ``hugehead.linear_cross_entropy(x, W, T)`` with a sparse probability target of ``k`` positives
  per row (each 1/k),
- ``ova``: ``hugehead.linear_binary_cross_entropy(x, W, T)`` (one-vs-all, the same ``k`` positives as 1),
- ``multi_no_rows``: ``multi`` with ``HUGEHEAD_ROWS=0``, where ``multi`` takes the rows plan (the A/B of that
  plan in the same run: kept or recomputed logits instead),
- on the CPU also the dense PyTorch formulations (``F.cross_entropy(F.linear(x, W), T.to_dense())`` and
  ``F.binary_cross_entropy_with_logits``) where the ``[N, V]`` logits fit.

The sparse target is built (COO, as a data loader would hand it over) outside the timed step; its
conversion to the kernels' CSR form and its checks are inside it. A check per shape: with one positive of
value 1 per row, the multi-label loss must equal the single-label one (``multi_vs_single_rel``).

    python -m bench.bench_multilabel                       # H200: xc1M, xc6M in bf16 (about 1 minute)
    python -m bench.bench_multilabel --cpu                 # CPU table: small shapes, float32, dense peers
    python -m bench.bench_multilabel --memory-budget 1073741824   # every hugehead case at a 1 GiB budget
Writes ``bench/results/<gpu or cpu>/multilabel.{json,md}``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hugehead  # noqa: E402

GPU_SHAPES = {"xc1M": dict(n=8192, d=768, v=1_000_000), "xc6M": dict(n=4096, d=768, v=6_000_000)}
CPU_SHAPES = {"cpu_16k": dict(n=256, d=128, v=16384), "cpu_64k": dict(n=512, d=128, v=65536)}
SMOKE_SHAPES = {"smoke": dict(n=64, d=32, v=4096)}
TARGETS = {"multi": 1.10, "ova": 1.0}  # step time at most this many single-label steps


def sparse_target(n: int, v: int, k: int, value: float, device: torch.device, seed: int) -> torch.Tensor:
    """A COO ``[n, v]`` target with ``k`` distinct random classes per row, each ``value``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    # k distinct classes per row: k draws from [0, v - k + 1) made distinct by adding their rank.
    cols = torch.randint(0, v - k + 1, (n, k), generator=g).sort(dim=1).values + torch.arange(k)
    rows = torch.arange(n).repeat_interleave(k)
    idx = torch.stack([rows, cols.reshape(-1)]).to(device)
    return torch.sparse_coo_tensor(idx, torch.full((n * k,), value, device=device), (n, v)).coalesce()


def step(loss_fn, params):
    def run():
        for p in params:
            p.grad = None
        loss = loss_fn()
        loss.backward()
        return loss.detach()
    return run


def plan_kinds(x, w, memory_budget=None) -> dict:
    """The plan each softmax case takes (``kept`` / ``rows`` / ``recompute``): the multi-label softmax takes
    the single-label call's plan (at the default budget the rows plan at xc1M on an H200)."""
    from hugehead import multilabel
    from hugehead.plan import plan_loss

    n, d, v = x.shape[0], x.shape[1], w.shape[0]
    single = plan_loss(n, d, v, x.dtype, x.device, None, memory_budget, weight_dtype=w.dtype, allow_rows=True,
                       direct_dx=True)
    multi = multilabel.plan_softmax(x, w, None, reduction="mean", return_lse=False, chunk_size=None,
                                    memory_budget=memory_budget)
    return {"single_plan": single.kind, "multi_plan": multi.kind}


def without_rows(fn):
    """``fn()`` with the rows plan off (``HUGEHEAD_ROWS=0``)."""
    before = os.environ.get("HUGEHEAD_ROWS")
    os.environ["HUGEHEAD_ROWS"] = "0"
    try:
        return fn()
    finally:
        if before is None:
            del os.environ["HUGEHEAD_ROWS"]
        else:
            os.environ["HUGEHEAD_ROWS"] = before


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU table (float32, small shapes, dense peers)")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (tests)")
    ap.add_argument("--positives", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--memory-budget", type=int, default=None,
                    help="memory_budget (bytes) of every hugehead case (default: the library's default)")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the shape names")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/<device>)")
    harness.add_record_flag(ap)
    args = ap.parse_args(argv)
    on_cpu = args.cpu or args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if on_cpu else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else (CPU_SHAPES if on_cpu else GPU_SHAPES)
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",")}
    dtype = torch.float32 if on_cpu else torch.bfloat16
    meta = harness.run_meta("multilabel", device, options=args, shapes=shapes, smoke=args.smoke,
                            dtype=str(dtype), positives=args.positives)
    rows = []
    for name, s in shapes.items():
        n, d, v, k = s["n"], s["d"], s["v"], args.positives
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(n, d, generator=g) / d ** 0.5).to(device, dtype).requires_grad_()
        w = (torch.randn(v, d, generator=g) * 0.02).to(device, dtype).requires_grad_()
        y = torch.randint(0, v, (n,), generator=g).to(device)
        t_multi = sparse_target(n, v, k, 1.0 / k, device, seed=1)
        t_ova = sparse_target(n, v, k, 1.0, device, seed=1)
        budget = args.memory_budget
        cases = {
            "single": lambda: hugehead.linear_cross_entropy(x, w, y, memory_budget=budget),
            "multi": lambda: hugehead.linear_cross_entropy(x, w, t_multi, memory_budget=budget),
            "ova": lambda: hugehead.linear_binary_cross_entropy(x, w, t_ova, memory_budget=budget),
        }
        row = {"shape": name, **s, "positives": k, **plan_kinds(x, w, budget)}
        if row["multi_plan"] == "rows":
            # The A/B of the rows plan in the same run: the plan the multi-label step had before (kept or
            # recomputed logits), through HUGEHEAD_ROWS=0 (read at each call's planning).
            cases["multi_no_rows"] = lambda: without_rows(
                lambda: hugehead.linear_cross_entropy(x, w, t_multi, memory_budget=budget))
        if on_cpu:
            dense_multi, dense_ova = t_multi.to_dense(), t_ova.to_dense()
            cases["dense_multi"] = lambda: F.cross_entropy(F.linear(x, w), dense_multi)
            cases["dense_ova"] = lambda: F.binary_cross_entropy_with_logits(F.linear(x, w), dense_ova)
        for case, fn in cases.items():
            try:
                t = harness.measure(step(fn, [x, w]), device, reps=args.reps, warmup=args.warmup,
                                    input_bytes=harness.tensor_bytes(x, w) * 2)
                row[f"{case}_ms"] = t.ms
                row[f"{case}_peak_extra_gib"] = t.peak_extra_gib
                row[f"{case}_loss"] = float(t.result)
                row[f"{case}_timing"] = t.fields()
            except Exception as exc:  # noqa: BLE001  (an out-of-memory dense peer is a result, not a crash)
                row[f"{case}_error"] = harness.error_text(exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for case in ("multi", "multi_no_rows", "ova", "dense_multi", "dense_ova"):
            if f"{case}_ms" in row and "single_ms" in row:
                row[f"{case}_vs_single"] = row[f"{case}_ms"] / row["single_ms"]
        with torch.no_grad():  # one positive of value 1 per row: the two losses are the same number
            one = torch.sparse_coo_tensor(torch.stack([torch.arange(n, device=device), y]),
                                          torch.ones(n, device=device), (n, v))
            a = hugehead.linear_cross_entropy(x, w, one)
            b = hugehead.linear_cross_entropy(x, w, y)
            row["multi_vs_single_rel"] = float((a - b).abs() / b.abs())
        rows.append(row)
        print({k2: v2 for k2, v2 in row.items() if not k2.endswith("_timing")}, flush=True)

    cols = ["shape", "N x D x V", "plan (single / multi)", "single ms", "multi ms (x single)",
            "multi, HUGEHEAD_ROWS=0 ms (x single)", "ova ms (x single)"]
    if on_cpu:
        cols += ["dense multi ms", "dense ova ms"]
    cols += ["1-positive check"]
    table = []
    for r in rows:
        line = [r["shape"], f"{r['n']}x{r['d']}x{r['v']}", f"{r['single_plan']} / {r['multi_plan']}",
                harness.fmt(r.get("single_ms"), ".1f")]
        for case in ("multi", "multi_no_rows", "ova"):
            if case == "multi_no_rows" and f"{case}_ms" not in r and f"{case}_error" not in r:
                line.append("- (same plan)")
                continue
            line.append(f"{harness.fmt(r.get(f'{case}_ms'), '.1f')} ({harness.fmt(r.get(f'{case}_vs_single'), '.3f')})"
                        if f"{case}_ms" in r else r.get(f"{case}_error", "-"))
        if on_cpu:
            for case in ("dense_multi", "dense_ova"):
                line.append(harness.fmt(r.get(f"{case}_ms"), ".1f") if f"{case}_ms" in r else "error")
        line.append(harness.fmt(r.get("multi_vs_single_rel"), ".1e"))
        table.append(line)
    md = harness.header(f"Multi-label heads: {args.positives} positives per row, {str(dtype).replace('torch.', '')}, "
                        "forward + backward", meta)
    md += harness.md_table(cols, table)
    md += (f"\n\nTargets (H200): multi-label softmax <= {TARGETS['multi']:.2f}x and one-vs-all <= "
           f"{TARGETS['ova']:.2f}x the single-label step; on the CPU both faster than the dense PyTorch "
           "formulation. The 1-positive check is |multi - single| / single with one positive of value 1 per row.\n")
    md += harness.footer(meta)
    slug = "cpu" if device.type == "cpu" else harness.gpu_slug(torch.cuda.get_device_name(device))
    out = args.out or harness.REPO_ROOT / "bench" / "results" / slug
    if args.smoke and args.out is None:
        out = Path("/tmp") / "hugehead_bench_smoke"
    paths = harness.write_report(out, "multilabel", {"meta": meta, "rows": rows}, md, record=args.record)
    print(f"wrote {paths['md']}")
    return paths


if __name__ == "__main__":
    main()
