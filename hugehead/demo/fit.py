"""Will it fit? The demo's estimate of the bytes each device needs (the chunk workspace asked from the
planner), what each device has available, and the ``--offload auto`` decision."""
from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..budget import resolve_budget
from ..plan import GRAD_RING_DEPTH, WEIGHT_RING_DEPTH, plan_chunks, plan_streamed
from .cli import dtype_name

_GiB = float(1 << 30)
# Bytes per head parameter element kept per device while training: the weight, its gradient and
# Adam's two moments, all in the head's dtype.
_COPIES_PER_PARAM = 4
# The head's chunk-loop workspace budget when the demo plans it (bytes per device).
WORKSPACE_BUDGET = 1 << 30


def workspace_bytes(n: int, d: int, shard_sizes: Sequence[int], dtype: torch.dtype, device: torch.device,
                    chunk_size: Optional[int] = None, memory_budget: Optional[int] = None, *,
                    offload: bool = False, keep: bool = True) -> int:
    """Bytes of ``device`` that one training step's loops use at their peak, for the shards of
    ``shard_sizes`` classes computing there (sharing its budget) over ``N`` rows of ``D`` features: each
    shard's plan's kept logits and workspace(s), one ``dX`` buffer pair, and, offloaded, each shard's
    rings of weight and gradient slots. What :func:`plan_chunks` plans, for estimates made before a head
    exists (``hugehead.demo``'s "will it fit")."""
    itemsize = dtype.itemsize
    budget = resolve_budget(memory_budget, device, shards_on_device=len(shard_sizes), streamed_keep=offload and keep)
    total = n * d * (itemsize + 4) if shard_sizes else 0
    for v in shard_sizes:
        if offload:
            plan = plan_streamed(n, d, v, dtype, dtype, device, chunk_size, budget, keep)
            total += (WEIGHT_RING_DEPTH + GRAD_RING_DEPTH) * min(v, plan.cols) * (d + 1) * itemsize
        else:
            plan = plan_chunks(n, d, v, dtype, device, chunk_size, budget, allow_keep=keep)
        streaming = 0 if plan.keep_logits and plan.kept_chunks * plan.cols >= v else 1 + int(plan.overlap)
        total += (plan.kept_chunks if plan.keep_logits else 0) * n * plan.cols * itemsize
        total += streaming * plan.rows * min(plan.cols, v) * itemsize
    return total


def balanced_shard_sizes(num_classes: int, shards: int) -> List[int]:
    """Classes per shard when ``num_classes`` are split evenly over ``shards`` (the first get one more)."""
    base, extra = divmod(num_classes, shards)
    return [base + (i < extra) for i in range(shards)]


def estimate_bytes_per_device(args: argparse.Namespace) -> Dict[torch.device, int]:
    """Bytes each device needs while training: per shard the weight and bias with their gradient and
    Adam's two moments, plus the chunk workspace; on the first device also the backbone (with its
    gradient and Adam state), the class-frequency tables and one batch of activations. With
    ``args.offload is True`` the parameters, gradients and Adam state are counted in host memory (``cpu``)
    and each GPU holds the workspace and the offload engine's rings of weight and gradient chunks."""
    itemsize = torch.empty((), dtype=args.dtype).element_size()
    offloaded = getattr(args, "offload", False) is True
    host = torch.device("cpu")
    need: Dict[torch.device, int] = {}
    on_device: Dict[torch.device, List[int]] = {}
    for dev, v in zip(args.devices, balanced_shard_sizes(args.classes, len(args.devices))):
        params = v * (args.dim + 1) * itemsize * _COPIES_PER_PARAM
        where = host if offloaded else dev
        need[where] = need.get(where, 0) + params
        on_device.setdefault(dev, []).append(v)
    # The chunk loops' workspace, kept logits and (offloaded) rings: what the planner will choose.
    for dev, sizes in on_device.items():
        need[dev] = need.get(dev, 0) + workspace_bytes(args.batch, args.dim, sizes, args.dtype, dev,
                                                       memory_budget=WORKSPACE_BUDGET, offload=offloaded)
    first = args.devices[0]
    backbone_params = args.input_dim * args.hidden + args.hidden * args.hidden + args.hidden * args.dim
    activations = args.batch * (args.input_dim + 2 * args.hidden + 2 * args.dim) * 4 * 3
    need[first] = need.get(first, 0) + backbone_params * 4 * 4 + activations + args.classes * 8 * 3
    return need


def available_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, or the memory the OS reports as available for a CPU process."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def _shortfall(args: argparse.Namespace) -> Optional[Tuple[torch.device, int, int]]:
    """The first device whose estimated need exceeds 92% of what it has available: (device, need, have)."""
    for dev, need in estimate_bytes_per_device(args).items():
        have = available_bytes(dev)
        if need > 0.92 * have:
            return dev, need, have
    return None


def check_fits(args: argparse.Namespace) -> None:
    """Decide ``--offload auto`` (sets ``args.offload`` to a bool: offload when the head does not fit the
    GPUs but fits the host's RAM), then raise ``SystemExit`` with a message when the estimate exceeds
    what a device has available."""
    gpus = any(d.type == "cuda" for d in args.devices)
    choice = getattr(args, "offload", "auto")
    if choice in ("on", True) and not gpus:
        raise SystemExit("hugehead.demo: error: --offload on streams the head to GPUs; none are in --devices")
    args.offload = choice in ("on", True)
    short = _shortfall(args)
    resident_short = None
    if choice == "auto" and gpus and short is not None:
        resident_short = short
        args.offload = True
        short = _shortfall(args)
        if short is None:
            dev, need, have = resident_short
            print(f"hugehead.demo: the head needs about {need / _GiB:.1f} GiB on {dev}, which has "
                  f"{have / _GiB:.1f} GiB free: keeping it in pinned host memory instead (--offload auto)",
                  flush=True)
        else:
            args.offload = False
            short = resident_short
    if short is not None:
        dev, need, have = short
        where = "available RAM" if dev.type == "cpu" else "free memory"
        smaller_dtype = " or a 2-byte --dtype (bfloat16)" if args.dtype.itemsize > 2 else ""
        offload_text = ""
        if resident_short is not None:
            args.offload = True
            host = estimate_bytes_per_device(args).get(torch.device("cpu"), 0)
            args.offload = False
            offload_text = (f" Offloading the head to host memory would need about {host / _GiB:.1f} GiB of RAM, "
                            f"and {available_bytes(torch.device('cpu')) / _GiB:.1f} GiB are available.")
        raise SystemExit(
            f"hugehead.demo: error: {args.classes:,} classes × {args.dim} features in "
            f"{dtype_name(args.dtype)} on {len(args.devices)} device(s) need about {need / _GiB:.1f} GiB "
            f"on {dev} (weights, gradients, Adam state and workspace) but it has {have / _GiB:.1f} GiB "
            f"{where}.{offload_text} Use more --devices, fewer --classes, a smaller --dim{smaller_dtype}."
        )
