"""A vocabulary-parallel head over the ranks of a process group (NCCL) against the same head on one GPU,
at the same global batch: forward + backward, forward only and top-5. Run by torchrun, one rank per GPU:

    torchrun --standalone --nproc_per_node 2 -m bench.bench_dist                  # xc6M on 2 GPUs
    torchrun --standalone --nproc_per_node 2 -m bench.bench_dist --cpu-smoke --out /tmp/d   # gloo, tiny

xc6M: global N=4096 (N/W rows per rank), D=768, V=6,000,000, bf16 weights and inputs, no bias. First rank 0
alone times a one-GPU ChunkedClassifier on all N rows (the others wait), then every rank times its part
of the distributed head (``process_group=WORLD``, V/W classes and N/W rows each). Both heads hold the same
logical weight (same seed, hashed initialization), so the checks compare them: the mean of the ranks'
losses against the one-GPU loss, every rank's dX against W times the one-GPU dX of its rows (the
one-GPU loss is the mean over all N rows), rank 0's shard gradient against the same rows of the one-GPU
gradient.

Timing (``bench.harness.measure``): CUDA events around each step on each rank (host clocks on the CPU), every rank synchronized and
at a barrier before each step; a step's time is the slowest rank's; median after warm-up. Writes
``dist.json`` and ``dist.md`` to ``--out`` (default ``bench/results/<gpu>x<W>/``): one record per
placement with ``n`` (global rows), ``d``, ``v``, ``world_size``, ``fwd_bwd_ms``, the git SHA in the
document, and the ratio against the one-GPU row (target <= 0.52 on 2 GPUs).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bench import harness  # first: decides which hugehead is imported

import torch
import torch.distributed as dist

TARGET_RATIO = 0.52


def comm_bytes_per_rank(n_per_rank: int, d: int, world: int, itemsize: int) -> Dict[str, int]:
    """Bytes each rank receives (and about as many it sends) in one training step of the distributed
    engine, ring collectives: the rows and targets of the others (forward), three float32 statistics per
    row (forward all-to-all), three per row again (backward all-gather) and the float32 dX partials of
    its own rows from every other rank (reduce-scatter). Independent of V."""
    peers = world - 1
    return dict(
        x=peers * n_per_rank * d * itemsize,
        target=peers * n_per_rank * 8,
        stats=peers * n_per_rank * 3 * 4,
        backward_rows=peers * (3 * n_per_rank + 2) * 4,
        grad_x=peers * n_per_rank * d * 4,
    )


def timed_steps(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int,
                group_barrier: bool):
    """bench.harness.measure of ``repeats`` calls after ``warmup``; with ``group_barrier`` every rank
    starts each call together and a call's time is the slowest rank's."""
    def reduce(times: List[float]) -> List[float]:
        t = torch.tensor(times, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    return harness.measure(fn, device, reps=repeats, warmup=warmup,
                           before=(lambda: (harness.synchronize(device), dist.barrier())) if group_barrier else None,
                           reduce=reduce if group_barrier else None)


def measure(head, x: torch.Tensor, target: torch.Tensor, device, repeats: int, warmup: int, distributed: bool) -> dict:
    """fwd+bwd (gradients of x and the shards), fwd only and top-5 of ``head`` on ``x``; leaves the
    gradients of the last step in ``x.grad`` and the shards' ``.grad``."""
    params = list(head.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        head(x, target).backward()

    fwd_bwd = timed_steps(step, device, repeats, warmup, distributed)
    peak = None if fwd_bwd.peak_bytes is None else fwd_bwd.peak_bytes / 2**30
    with torch.no_grad():
        fwd = timed_steps(lambda: head(x, target), device, repeats, warmup, distributed)
        topk = timed_steps(lambda: head.topk(x, 5), device, max(1, repeats // 2), 1, distributed)
        loss = head(x, target).float()
    return dict(fwd_bwd_ms=fwd_bwd.ms, fwd_ms=fwd.ms, topk_ms=topk.ms, all_fwd_bwd_ms=fwd_bwd.ms_all,
                loss=float(loss), peak_gib=peak, clock=fwd_bwd.clock)


def rel_err(a: torch.Tensor, b: torch.Tensor, rows: int = 1 << 18) -> float:
    """‖a − b‖ / ‖b‖ in float64, a block of rows at a time (a [3M, 768] gradient in float64 is 18 GB)."""
    num = den = 0.0
    for r in range(0, a.shape[0], rows):
        ab, bb = a[r:r + rows].double(), b[r:r + rows].double()
        num += float((ab - bb).square().sum())
        den += float(bb.square().sum())
    return (num / max(den, 1e-300)) ** 0.5


def render_markdown(doc: dict) -> str:
    meta = doc["meta"]
    lines = [harness.header(f"Vocabulary-parallel head over ranks: {meta.get('gpu_name', 'CPU')} x{doc['world_size']}",
                            meta),
             "Same global batch for every row; the distributed row's N is the global batch (N/W per rank). "
             "fwd+bwd: loss, then gradients of x and the shards; ms are medians (CUDA events, slowest rank).", "",
             "| placement | world size | N×D×V | dtype | fwd+bwd ms | fwd ms | top-5 ms | vs one GPU | peak GiB | "
             "bytes received per rank per step |",
             "|---|--:|---|---|--:|--:|--:|--:|--:|--:|"]
    for r in doc["records"]:
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
        lines.append(
            f"| {r['name']} | {r['world_size']} | {r['n']}×{r['d']}×{r['v']:,} | {r['dtype']} | {r['fwd_bwd_ms']:.1f} | "
            f"{r['fwd_ms']:.1f} | {r['topk_ms']:.1f} | {r['fwd_bwd_ratio_vs_one_gpu']:.3f}× | {peak} | "
            f"{sum(r['comm_bytes_per_rank'].values()) / 1e6:.2f} MB |")
    checks = doc.get("checks", {})
    if checks:
        lines += ["", "Checks against the one-GPU head (same logical weight): "
                  + ", ".join(f"{k} {v:.2e}" for k, v in checks.items()) + "."]
    dist_row = doc["records"][-1]
    lines += ["", f"Target: distributed fwd+bwd <= {TARGET_RATIO}× the one-GPU time: "
                  f"{dist_row['fwd_bwd_ratio_vs_one_gpu']:.3f}× ({'met' if dist_row['meets_target'] else 'NOT met'})."]
    return "\n".join(lines) + "\n" + harness.footer(meta)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, tiny sizes (checks the pipeline)")
    p.add_argument("--n", type=int, help="global rows (default 4096; smoke 64)")
    p.add_argument("--d", type=int, help="default 768; smoke 32")
    p.add_argument("--v", type=int, help="default 6000000; smoke 20000")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path)
    harness.add_record_flag(p)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        print("bench_dist runs under torchrun: torchrun --standalone --nproc_per_node 2 -m bench.bench_dist",
              file=sys.stderr)
        return 2

    import hugehead
    from hugehead.engines.distributed import _all_gather_single as all_gather_single

    if args.cpu_smoke:
        backend, dtype = "gloo", torch.float32
        n, d, v = args.n or 64, args.d or 32, args.v or 20_000
        device = torch.device("cpu")
    else:
        backend, dtype = "nccl", torch.bfloat16
        n, d, v = args.n or 4096, args.d or 768, args.v or 6_000_000
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if n % world:
        raise SystemExit(f"--n {n} must be a multiple of the world size {world}")
    per_rank = n // world
    gen = torch.Generator().manual_seed(1)  # the same global batch on every rank
    x_all = torch.randn(n, d, generator=gen).to(device, dtype)
    target_all = torch.randint(0, v, (n,), generator=gen).to(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    records, checks = [], {}

    # One GPU: rank 0 alone, all N rows.
    one = None
    if rank == 0:
        torch.manual_seed(0)
        head = hugehead.ChunkedClassifier(d, v, bias=False, dtype=dtype, devices=[device])
        x = x_all.clone().requires_grad_()
        one = measure(head, x, target_all, device, args.repeats, args.warmup, distributed=False)
        one.update(name="one GPU", world_size=1, n=n, d=d, v=v, dtype=str(dtype).replace("torch.", ""),
                   comm_bytes_per_rank=comm_bytes_per_rank(n, d, 1, itemsize))
        # Kept for the checks: the one-GPU gradients of every row, and of rank 0's classes.
        one_grad_x = x.grad.clone()
        one_head, one_x = head, x
        print(f"one GPU: fwd+bwd {one['fwd_bwd_ms']:.1f} ms, fwd {one['fwd_ms']:.1f} ms, top-5 {one['topk_ms']:.1f} ms, "
              f"loss {one['loss']:.6f}", flush=True)
    dist.barrier()

    torch.manual_seed(0)  # rank 0's seed initializes every rank: the same logical weight as the one-GPU head
    head = hugehead.ChunkedClassifier(d, v, bias=False, dtype=dtype, devices=[device], process_group=dist.group.WORLD)
    start, stop = head.shards[0].start, head.shards[-1].stop
    if rank == 0:
        one_grad_w0 = one_head.shards[0].weight.grad[start:stop].clone()
        del one_head, one_x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    x = x_all[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
    target = target_all[rank * per_rank:(rank + 1) * per_rank]
    part = measure(head, x, target, device, args.repeats, args.warmup, distributed=True)

    # Checks (collective): mean of the ranks' losses, every rank's dX, rank 0's shard gradient.
    losses = torch.tensor([part["loss"]], dtype=torch.float64, device=device if backend == "nccl" else "cpu")
    dist.all_reduce(losses)
    grad_x = torch.empty(n, d, dtype=dtype, device=device)
    all_gather_single(grad_x, x.grad.contiguous())
    peaks = [None] * world
    dist.all_gather_object(peaks, part["peak_gib"])
    if rank == 0:
        checks = {
            "loss rel diff": abs(float(losses) / world - one["loss"]) / abs(one["loss"]),
            "dX rel err": rel_err(grad_x, world * one_grad_x),
            "rank 0 dW rel err": rel_err(head.shards[0].weight.grad, one_grad_w0),
        }
        part.update(name=f"{world} ranks ({backend})", world_size=world, n=n, n_per_rank=per_rank, d=d, v=v,
                    v_per_rank=stop - start, dtype=str(dtype).replace("torch.", ""),
                    peak_gib=max((p for p in peaks if p is not None), default=None), peak_gib_per_rank=peaks,
                    comm_bytes_per_rank=comm_bytes_per_rank(per_rank, d, world, itemsize))
        records = [one, part]
        for r in records:
            r["fwd_bwd_ratio_vs_one_gpu"] = r["fwd_bwd_ms"] / one["fwd_bwd_ms"]
            r["fwd_ratio_vs_one_gpu"] = r["fwd_ms"] / one["fwd_ms"]
            r["tflops"] = 8 * n * d * v / r["fwd_bwd_ms"] / 1e9
        part["target_ratio"] = TARGET_RATIO
        part["meets_target"] = part["fwd_bwd_ratio_vs_one_gpu"] <= TARGET_RATIO
        meta = harness.run_meta(
            "dist", device, options=args, smoke=args.cpu_smoke, shapes={"global": dict(n=n, d=d, v=v)},
            command=f"torchrun --standalone --nproc_per_node {world} -m bench.bench_dist "
                    + " ".join(argv if argv is not None else sys.argv[1:]))
        doc = dict(meta=meta, world_size=world, backend=backend, records=records, checks=checks)
        out = args.out or (harness.REPO_ROOT / "bench" / "results"
                           / f"{harness.gpu_slug(meta.get('gpu_name', 'cpu'))}x{world}")
        harness.write_report(out, "dist", doc, render_markdown, record=args.record)
        print(f"{world} ranks: fwd+bwd {part['fwd_bwd_ms']:.1f} ms = {part['fwd_bwd_ratio_vs_one_gpu']:.3f}x one GPU "
              f"(target <= {TARGET_RATIO}); fwd {part['fwd_ms']:.1f} ms, top-5 {part['topk_ms']:.1f} ms; checks "
              + ", ".join(f"{k} {v:.2e}" for k, v in checks.items()) + f"; wrote {out / 'dist.json'}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
