"""DDP training with a vocabulary-parallel head: a small MLP backbone replicated by
``DistributedDataParallel`` and a :class:`hugehead.ChunkedClassifier` whose classes are split over the
ranks (``process_group=``), each rank holding only its class range. Launched by ``torchrun``; the same
script runs on one node or several.

    torchrun --nproc_per_node 2 examples/ddp_train.py                    # 2 GPUs, NCCL, 6M classes, bf16
    torchrun --nproc_per_node 2 examples/ddp_train.py --backend gloo     # CPU, tiny sizes
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        examples/ddp_train.py --classes 50000000                          # 16 GPUs on 2 nodes

Each rank draws its own batches (rank-dependent seed; ``--uneven`` gives the ranks different batch
sizes). Rank r's loss is the mean over its own rows; DDP averages the backbone's gradients over the
ranks, and the head's shard gradients are those of the same mean of the ranks' losses, so the whole model
follows one objective. DDP must not touch the head (its ranks hold different classes): the model is
wrapped after :func:`hugehead.ignore_heads_in_ddp`, which lists the head's
Parameters in DDP's ignore list (equivalently, keep the head outside the DDP wrapper).

The data: class ``c`` has a random prototype in input space, an input is its prototype plus noise, and
classes are Zipf-distributed, so the frequent ones are learnable within a short run. At the end, top-1 and
top-5 accuracy on held-out inputs (:func:`hugehead.predict_topk_chunks` over the head's streaming top-k,
:class:`hugehead.metrics.AccuracyAtK` summed over the ranks) beside the always-most-frequent baseline
(the training set's most frequent classes), every rank's checks (backbones identical, shards disjoint),
and with ``--save`` a safetensors file of the head that loads into any world size or one process.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import hugehead
from hugehead import ignore_heads_in_ddp
from hugehead.metrics import AccuracyAtK, most_frequent_topk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_common import add_size_args, example_parser, fill_defaults  # noqa: E402

TOP_K = (1, 5)


def prototypes(classes: Tensor, in_dim: int, data_seed: int = 1234) -> Tensor:
    """``[n, in_dim]`` values in ``[-1, 1)``: an integer hash of ``(data_seed, class, feature)``, the same on
    every rank and device, computed for the given classes only (never for all of them)."""
    feature = torch.arange(in_dim, device=classes.device)
    h = (classes[:, None] * 0x9E3779B1 + feature[None, :] * 0x85EBCA6B + data_seed) & 0xFFFFFFFF
    for mult in (0x7FEB352D, 0x846CA68B):
        h = ((h ^ (h >> 16)) * mult) & 0xFFFFFFFF
    return (h ^ (h >> 16)).float() / 2**31 - 1


def synthetic_batch(n: int, num_classes: int, in_dim: int, zipf: float, noise: float, generator: torch.Generator,
                    device: torch.device):
    """``(inputs [n, in_dim], target [n])`` on ``device``: Zipf-distributed classes (a continuous power law
    by inverse transform, spread over the class ids by a fixed permutation), prototype plus noise."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    rank = torch.floor((1 - u) ** (-1 / (zipf - 1))).clamp_(max=num_classes).long() - 1
    mult = 1_000_003 if num_classes % 1_000_003 else 999_983  # primes: rank -> class is a bijection
    target = ((rank * mult + 7) % num_classes).to(device)
    inputs = prototypes(target, in_dim) + noise * torch.randn(n, in_dim, generator=generator).to(device)
    return inputs, target


class Model(nn.Module):
    """``inputs [N, in_dim]`` -> an MLP backbone -> ``[N, dim]`` -> the vocabulary-parallel head's loss."""

    def __init__(self, in_dim: int, dim: int, head: hugehead.ChunkedClassifier):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(in_dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim), nn.LayerNorm(dim))
        self.head = head

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        return self.head(self.backbone(inputs), target)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = example_parser(__doc__)
    p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
    gpu, small = dict(classes=6_000_000, dim=768, batch=2048, steps=200, eval=8192), dict(classes=2000, dim=32, batch=64,
                                                                                        steps=40, eval=256)
    add_size_args(p, dict(classes="number of classes", dim="head in_features", batch="rows per rank per step",
                          steps="training steps", eval="held-out rows per rank"), gpu, small, "gloo")
    p.add_argument("--in-dim", type=int, default=64, help="input features of the backbone")
    p.add_argument("--uneven", action="store_true", help="rank r uses batch - 3*r rows (unequal batches)")
    p.add_argument("--zipf", type=float, default=1.3)
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the head to this safetensors file at the end")
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    fill_defaults(args, gpu if args.backend == "nccl" else small)
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc_per_node 2 examples/ddp_train.py")
    if args.backend == "nccl":  # this process's GPU first: NCCL's communicator binds to the current device
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same backbone on every rank (DDP would broadcast rank 0's anyway)

    # fp32 master weights; on GPUs the step computes in bf16 under autocast (the head casts each weight
    # chunk in its loop, never the whole shard).
    head = hugehead.ChunkedClassifier(args.dim, args.classes, devices=[device], process_group=dist.group.WORLD)
    model = Model(args.in_dim, args.dim, head).to(device)
    ignored = ignore_heads_in_ddp(model)  # before wrapping: DDP neither broadcasts nor all-reduces these
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, stop = head.shards[0].start, head.shards[-1].stop
    if rank == 0:
        print(f"{world} ranks ({args.backend}); {args.classes:,} classes, D={args.dim}; DDP ignores {ignored}")
    print(f"rank {rank}: classes [{start:,}, {stop:,}) on {device}", flush=True)

    batch = args.batch - 3 * rank if args.uneven else args.batch
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    first = last = None
    train_counts = torch.zeros(args.classes, dtype=torch.int64, device=device)  # for the baseline
    t0 = time.perf_counter()
    for step in range(args.steps):
        inputs, target = synthetic_batch(batch, args.classes, args.in_dim, args.zipf, args.noise, gen, device)
        train_counts += torch.bincount(target, minlength=args.classes)
        with autocast:
            loss = ddp(inputs, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == 0 or step == args.steps - 1 or (step + 1) % max(1, args.steps // 5) == 0:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # for printing: the mean of the ranks' losses, the objective
            mean_loss = float(mean_loss) / world
            first = mean_loss if first is None else first
            last = mean_loss
            if rank == 0:
                print(f"step {step + 1}/{args.steps}: loss {mean_loss:.4f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    # Held-out accuracy: every rank ranks its own rows against all classes (the head's streamed top-k is
    # collective: each rank takes the same number of batches); the metrics' sums are added over the ranks.
    model.eval()
    eval_gen = torch.Generator().manual_seed(10_000 + args.seed + rank)
    inputs, target = synthetic_batch(args.eval, args.classes, args.in_dim, args.zipf, args.noise, eval_gen, device)
    batches = [(inputs[i:i + args.batch], target[i:i + args.batch]) for i in range(0, args.eval, args.batch)]
    ks = [k for k in TOP_K if k <= args.classes]
    accuracy = {k: AccuracyAtK(k).to(device) for k in ks}
    baseline = {k: AccuracyAtK(k).to(device) for k in ks}
    dist.all_reduce(train_counts)  # the whole training set's class frequencies
    frequent = most_frequent_topk(train_counts, max(ks), args.batch)
    for chunk in hugehead.predict_topk_chunks(head, batches, max(ks), features=lambda b: model.backbone(b[0]),
                                              autocast=torch.bfloat16 if device.type == "cuda" else None,
                                              progress=False):
        for k in ks:
            accuracy[k].update(chunk.indices, chunk.target)
            baseline[k].update(frequent[: chunk.target.shape[0]], chunk.target)
    accuracy = {k: float(m.compute()) for k, m in accuracy.items()}  # compute() sums the states over ranks
    baseline = {k: float(m.compute()) for k, m in baseline.items()}

    # Checks: DDP kept the backbones identical; the heads hold disjoint class ranges covering [0, V).
    flat = torch.cat([p.detach().flatten().float() for p in model.backbone.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    in_sync = bool(torch.equal(spread, flat))
    ranges = [None] * world
    dist.all_gather_object(ranges, (start, stop))
    covered = sorted(ranges)[0][0] == 0 and sorted(ranges)[-1][1] == args.classes and all(
        a[1] == b[0] for a, b in zip(sorted(ranges), sorted(ranges)[1:]))
    if args.save:
        head.save_safetensors(args.save)  # collective; rank 0 writes one file
    if rank == 0:
        print(f"trained {args.steps} steps in {seconds:.1f} s; loss {first:.4f} -> {last:.4f}; "
              + ", ".join(f"held-out top-{k} {accuracy[k]:.4f}" for k in ks)
              + " (always-most-frequent " + ", ".join(f"top-{k} {baseline[k]:.4f}" for k in ks)
              + f"; uniform chance {1 / args.classes:.1e})")
        print(f"backbones identical on all ranks: {in_sync}; class ranges {ranges} cover [0, {args.classes}): {covered}")
        if args.save:
            print(f"head written to {args.save}")
    dist.destroy_process_group()
    if not (in_sync and covered):
        raise SystemExit("check failed")
    return dict(first_loss=first, last_loss=last, accuracy=accuracy, baseline=baseline, seconds=seconds)


if __name__ == "__main__":
    main()
    # The work is done and the process group destroyed. On torch 2.13 (CPU, gloo) the interpreter's own
    # teardown after DDP sometimes aborts in a library thread ("terminate called without an active
    # exception", about 1 run in 5 here), which would turn a finished run into SIGABRT for torchrun:
    # leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
