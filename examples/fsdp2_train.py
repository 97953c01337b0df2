"""FSDP2 training of a model whose output layer is huge: ``fully_shard`` on the whole model, the loss
through hugehead on the head's weight as FSDP2 sharded it — never gathered.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py                     # CPU (gloo), tiny sizes
    torchrun --nproc-per-node 1 examples/fsdp2_train.py --backend nccl \\
        --classes 6000000 --dim 768 --batch 4096 --optimizer sgd             # one GPU, the 6M x 768 head
    python examples/fsdp2_train.py                                          # one process, no torchrun

The recipe (``build_model``): every backbone layer is its own FSDP2 unit; the head (an ``nn.Linear``)
is its own unit too, and is never called: the model's ``forward`` passes ``self.head.weight`` — a
``DTensor`` with placement ``Shard(0)``, each rank's rows — to :func:`hugehead.linear_cross_entropy`,
which runs the vocabulary-parallel loss over the mesh's ranks. FSDP2 never gathers the head (its
forward never runs), and hugehead returns the weight's gradient as a ``Shard(0)`` DTensor equal to what
FSDP2's averaging over the ranks would have produced for the gathered weight, so the optimizer,
``clip_grad_norm_`` and ``torch.distributed.checkpoint`` see an ordinary FSDP2 parameter.

``--head gathered`` builds the same model with the head inside the root's unit instead: FSDP2 then
all-gathers the whole weight (and reduce-scatters its whole gradient) every step, as it does for any
layer, and hugehead computes on the gathered weight. ``--head both`` (the default) times both; each rank
prints its step time. ``--accumulate M`` splits each rank's batch into M micro-batches with gradient
sync off for all but the last (``set_requires_gradient_sync``): the same gradients as one batch.
``--ckpt DIR`` writes the model and optimizer (``torch.distributed.checkpoint``) at the end (of the
sharded mode with ``--head both``);
``--resume DIR`` loads such a directory first, from any world size, through
:func:`hugehead.checkpoint.load_dcp` (no code runs from it; one version of it is read).

The data: Zipf-distributed classes with a prototype each (see examples/ddp_train.py). On GPUs the step
runs under bf16 autocast with float32 master weights (hugehead casts the weight chunk by chunk).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hugehead
from hugehead.dtensor import is_dtensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_train import synthetic_batch  # noqa: E402  (the same learnable synthetic data)
from example_common import add_size_args, example_parser, fill_defaults  # noqa: E402


class Model(nn.Module):
    """``inputs [N, in_dim]`` -> an MLP backbone -> ``[N, dim]`` -> hugehead's loss on ``head.weight``."""

    def __init__(self, in_dim: int, dim: int, classes: int):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(in_dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim), nn.LayerNorm(dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        # self.head.weight is the Shard(0) DTensor when the head is its own (never-called) FSDP2 unit, and
        # the gathered weight when it belongs to the root's unit.
        weight = self.head.weight
        local = weight.to_local() if is_dtensor(weight) else weight
        self.head_weight_seen = f"{type(weight).__name__} with {local.shape[0]:,} local rows"
        return hugehead.linear_cross_entropy(self.backbone(inputs), weight, target, self.head.bias)


def build_model(args, device: torch.device, head: str) -> Model:
    """The model, built on the meta device, sharded with FSDP2, then materialized on ``device``: every rank
    allocates and initializes only its shards (a 6M x 768 head is never whole on any rank)."""
    with torch.device("meta"):
        model = Model(args.in_dim, args.dim, args.classes)
    # The mesh on the training device: FSDP2's default mesh takes CUDA whenever a GPU is visible, also
    # when this run trains on the CPU over gloo.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.backbone:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    if head == "sharded":
        fully_shard(model.head, mesh=mesh)  # its own unit, never called: never gathered
    fully_shard(model, mesh=mesh)  # the root (with head="gathered" it holds the head: gathered every forward)
    model.to_empty(device=device)
    rank = dist.get_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            # Each rank initializes its own rows; the seed makes both head modes start alike.
            g = torch.Generator(device=device).manual_seed(args.seed + 1000 * rank + sum(map(ord, name)))
            if name.endswith("bias"):
                local.zero_()
            elif "backbone.3" in name:  # LayerNorm
                local.fill_(1.0)
            else:
                fan_in = p.shape[1]
                local.normal_(0.0, fan_in ** -0.5, generator=g)
    return model


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = example_parser(__doc__)
    p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
    gpu, small = dict(classes=6_000_000, dim=768, batch=4096, steps=10), dict(classes=2001, dim=32, batch=64, steps=30)
    add_size_args(p, dict(classes="number of classes", dim="head in_features", batch="rows per rank per step",
                          steps="timed training steps per head mode"), gpu, small, "gloo")
    p.add_argument("--in-dim", type=int, default=64, help="input features of the backbone")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--head", choices=["sharded", "gathered", "both"], default="both")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="sgd keeps no state (the 6M head with AdamW state and a gathered copy is ~130 GB)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", help="write the sharded model and optimizer here at the end (DCP)")
    p.add_argument("--resume", help="load a --ckpt directory first (any world size)")
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    fill_defaults(args, gpu if args.backend == "nccl" else small)
    if args.batch % args.accumulate:
        p.error("--batch must be a multiple of --accumulate")
    return args


def train(args, device: torch.device, head: str) -> Dict[str, float]:
    """Warm-up and timed steps of one head mode; returns its first and last loss (the mean over ranks) and
    the median step time."""
    model = build_model(args, device, head)
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * 30)
    if args.resume:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        # Not dcp.load: it unpickles .metadata and non-tensor values with the plain unpickler (code could run).
        hugehead.checkpoint.load_dcp(state, args.resume)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        inputs, target = synthetic_batch(args.batch, args.classes, args.in_dim, 1.3, 0.5, gen, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for m, (x, t) in enumerate(zip(inputs.chunk(args.accumulate), target.chunk(args.accumulate))):
            model.set_requires_gradient_sync(m == args.accumulate - 1)  # reduce-scatter once, at the last
            with autocast:
                loss = model(x, t) / args.accumulate
            loss.backward()
            total += loss.detach()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    seen = model.head_weight_seen
    if args.ckpt and head == ("sharded" if args.head == "both" else args.head):
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.ckpt)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times.sort()
    return dict(first=losses[0], last=losses[-1], step_ms=1000 * times[len(times) // 2], peak_gib=peak,
                head_weight_seen=seen)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, dict]:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
    if args.backend == "nccl":  # this process's GPU first: NCCL's communicator binds to the current device
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{world} ranks ({args.backend}); head {args.classes:,} x {args.dim} (float32 master weights"
              f"{', bf16 autocast' if device.type == 'cuda' else ''}); batch {args.batch} rows per rank"
              f"{f' in {args.accumulate} micro-batches' if args.accumulate > 1 else ''}; {args.optimizer}", flush=True)
    results = {}
    for head in (["sharded", "gathered"] if args.head == "both" else [args.head]):
        results[head] = r = train(args, device, head)
        # One write with its newline: every rank prints to the same stream, and print()'s separate write of
        # the end let another rank's line in before it (seen once under CI: "...rowsrank 1: head ...").
        sys.stdout.write(f"rank {rank}: head {head}: step {r['step_ms']:.1f} ms (median of {args.steps}); loss "
                         f"{r['first']:.4f} -> {r['last']:.4f}; hugehead got a {r['head_weight_seen']}"
                         + (f"; peak {r['peak_gib']:.1f} GiB" if device.type == "cuda" else "") + "\n")
        sys.stdout.flush()
    if rank == 0 and len(results) == 2:
        s, g = results["sharded"], results["gathered"]
        print(f"sharded head {s['step_ms']:.1f} ms vs gathered {g['step_ms']:.1f} ms per step "
              f"({s['step_ms'] / g['step_ms']:.3f}x); first-step loss {s['first']:.6f} vs {g['first']:.6f}", flush=True)
    if args.ckpt and rank == 0:
        print(f"checkpoint written to {args.ckpt}")
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (see examples/ddp_train.py)
