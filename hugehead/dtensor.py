"""A head weight that is a ``DTensor`` (FSDP2's ``fully_shard``, tensor parallelism) used where it lies.

A weight split by rows over a one-dimensional device mesh (placement ``Shard(0)``) already *is* a
vocabulary-parallel head: rank ``r`` holds the classes ``[start_r, stop_r)`` in ``torch.chunk``'s layout
(``ceil(V / W)`` rows per rank, the last ranks fewer or none when ``W`` does not divide ``V``, as DTensor
and FSDP2 split it). :func:`linear_cross_entropy` computes the exact loss on it without ever gathering
the weight, with the engines of :mod:`hugehead.engines.distributed` over the mesh's process group:

- ``x`` a plain tensor (or a ``Shard(0)`` DTensor): different rows on every rank (data parallel, FSDP2).
  The distributed engine: all-gather of the rows and targets, each rank's classes for all rows, per-row
  statistics sent to the rows' owners, a reduce-scatter of ``dX``. Rank ``r``'s loss is the reduction
  over its own rows; the weight's gradient is that of ``(1/W) Σ_r L_r``: what FSDP2's reduce-scatter
  with averaging would have made of the gathered weight's gradients.
- ``x`` a ``Replicate()`` DTensor: the same rows on every rank (tensor parallelism, ``ColwiseParallel`` on
  ``lm_head``). Megatron's vocabulary-parallel loss: each rank's classes for the same rows, one
  collective of the per-row statistics, ``dX`` summed over the ranks by one all-reduce; no rows move.
  The loss is the same on every rank and the weight's gradient is that of this one loss.
- weight ``Replicate()``: the local computation on the local tensors.

The weight's (and bias's) gradient comes back as a DTensor with the weight's placement, ``dX`` as ``x``
was given (a DTensor ``x`` gets a DTensor gradient of its placement). The loss and lse are plain tensors.

Every rank of the mesh must make the same calls (forward and backward) in the same order: each one runs
collectives, bounded by the process group's ``timeout`` (``init_process_group(timeout=...)``).
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .engines.distributed import DistributedEngine, _all_gather_single
from .engines.local import LocalEngine, PlacedInputs, ShardTensors
from .lce_op import class_id_loss
from .loop.chunks import merge_parts, sum_slot
from .options import LossOptions, check_targets, reduce_loss
from .sharded_loss import LossSpec, ShardedLinearCrossEntropy

__all__ = ["is_dtensor", "linear_cross_entropy", "mesh_head", "shard_class_ranges", "TensorParallelEngine"]


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing DTensor's module when
    nothing has: then no DTensor can exist)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def shard_class_ranges(num_classes: int, world_size: int) -> List[Tuple[int, int]]:
    """``[start_r, stop_r)`` of every rank of a ``Shard(0)`` DTensor of ``num_classes`` rows: ``torch.chunk``'s
    split (``ceil(V / W)`` rows each, the last ranks fewer, possibly none)."""
    per_rank = -(-num_classes // world_size)
    return [(min(r * per_rank, num_classes), min((r + 1) * per_rank, num_classes)) for r in range(world_size)]


class TensorParallelEngine(DistributedEngine):
    """The same rows on every rank, each rank its own classes (Megatron's vocabulary-parallel
    cross-entropy): the local engine folds this rank's classes; one all-gather of the per-row
    ``(lse_r, target_logit_r, logit_sum_r)`` of every rank, merged in rank order on every rank (the same
    bits everywhere); the backward is local, plus one all-reduce of the ``dX`` partials. Nothing of the
    rows or of the weight crosses ranks. Gradients are those of the one (replicated) loss: no ``1/W``."""

    name = "tensor_parallel"

    def row_stats(
        self, x: Tensor, target: Tensor, shards: Sequence[ShardTensors], options: LossOptions, keep: bool = False
    ) -> Tuple[Tensor, Tensor, Tensor, List[PlacedInputs]]:
        lse, target_logit, logit_sum, placed = self.local.row_stats(x, target, shards, options, keep)
        device = self.comm_device(x.device)
        mine = torch.stack([lse, target_logit, logit_sum]).to(device)
        every = mine.new_empty(self.world_size * 3, mine.shape[1])
        _all_gather_single(every, mine, group=self.group)
        every = every.view(self.world_size, 3, -1).to(x.device)
        return (*merge_parts(every, sum_slot(target)), placed)

    def backward(self, placed, shards, num_classes, lse, grad_rows, options, need_x, need_weight, x_like,
                 grad_lse=None, row_terms=None):
        grad_x, grad_w, grad_b = self.local.backward(
            placed, shards, num_classes, lse, grad_rows, options, need_x, need_weight, x_like, grad_lse=grad_lse,
            row_terms=row_terms,
        )
        if need_x:  # partials in the accumulation dtype, summed before the one rounding to x's dtype
            device = self.comm_device(x_like.device)
            grad_x = grad_x.to(device)
            dist.all_reduce(grad_x, group=self.group)
            grad_x = grad_x.to(device=x_like.device, dtype=x_like.dtype)
        return grad_x, grad_w, grad_b


# --------------------------------------------------------------------------------------------------
# Placements
# --------------------------------------------------------------------------------------------------
def _placement_name(t: Tensor) -> str:
    return f"placements {tuple(t.placements)} on a mesh of shape {tuple(t.device_mesh.shape)}"


def _weight_placement(weight: Tensor, bias: Optional[Tensor]):
    """``(mesh, "shard" | "replicate")`` of a DTensor weight (and bias).

    Raises:
        ValueError: a mesh of more than one dimension, a placement other than ``Shard(0)`` or
            ``Replicate()``, a bias that is not a DTensor of the same mesh and placement, or local shards
            that are not DTensor's even split.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"hugehead: a DTensor weight must live on a one-dimensional device mesh; got {_placement_name(weight)}"
        )
    (placement,) = weight.placements
    if placement == Shard(0):
        kind = "shard"
    elif placement == Replicate():
        kind = "replicate"
    else:
        raise ValueError(
            f"hugehead: a DTensor weight must be Shard(0) (rows split: FSDP2, ColwiseParallel) or Replicate(); "
            f"got {placement!r} ({_placement_name(weight)})"
        )
    if bias is not None:
        if not is_dtensor(bias):
            raise TypeError("hugehead: with a DTensor weight the bias must be a DTensor of the same mesh and placement, "
                            "got a plain tensor")
        if bias.device_mesh != mesh or tuple(bias.placements) != tuple(weight.placements):
            raise ValueError(
                f"hugehead: bias has {_placement_name(bias)} but weight has {_placement_name(weight)}; they must match"
            )
    if kind == "shard":
        # The engines order classes by group rank; DTensor orders shards by mesh coordinate.
        if mesh.mesh.flatten().tolist() != dist.get_process_group_ranks(mesh.get_group()):
            raise ValueError(
                f"hugehead: the device mesh's ranks {mesh.mesh.flatten().tolist()} are not in the order of its process "
                f"group's {dist.get_process_group_ranks(mesh.get_group())}; build the mesh with its ranks ascending"
            )
        rank = mesh.get_local_rank()
        start, stop = shard_class_ranges(weight.shape[0], mesh.size())[rank]
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.to_local().shape[0] != stop - start:
                raise ValueError(
                    f"hugehead: the {name} DTensor's local shard on mesh rank {rank} has {t.to_local().shape[0]} rows; "
                    f"Shard(0) of {weight.shape[0]} rows over {mesh.size()} ranks gives it {stop - start}"
                )
    return mesh, kind


def _local_rows(x: Tensor, target: Tensor, mesh) -> Tuple[Tensor, Tensor, bool]:
    """This rank's ``x`` and ``target`` as plain tensors (differentiable for ``x``), and whether the rows
    are the same on every rank (``x`` a ``Replicate()`` DTensor).

    Raises:
        ValueError: ``x`` or ``target`` a DTensor on another mesh or with a placement other than
            ``Shard(0)`` or ``Replicate()``; a DTensor ``target`` whose placement differs from ``x``'s.
    """
    from torch.distributed.tensor import Replicate, Shard

    replicated = False
    if is_dtensor(x):
        if x.device_mesh != mesh:
            raise ValueError("hugehead: x is a DTensor on another device mesh than the weight")
        (placement,) = x.placements if x.device_mesh.ndim == 1 else (None,)
        if placement not in (Shard(0), Replicate()):
            raise ValueError(
                f"hugehead: a DTensor x must be Replicate() (tensor parallelism) or Shard(0) (rows per rank); got "
                f"{_placement_name(x)}"
            )
        replicated = placement == Replicate()
        if is_dtensor(target) and tuple(target.placements) != tuple(x.placements):
            raise ValueError(f"hugehead: target has {_placement_name(target)} but x has {_placement_name(x)}")
        x = x.to_local()
    elif is_dtensor(target):
        raise ValueError("hugehead: target is a DTensor but x is not; pass both as plain tensors or both as DTensors")
    if is_dtensor(target):
        target = target.to_local()
    return x, target, replicated


def _check_targets_on_every_rank(engine: DistributedEngine, target: Tensor, num_classes: int,
                                 ignore_index: Optional[int]) -> Tensor:
    """``target`` checked on every rank at once (one tiny all-gather of a flag): when any rank has a target
    outside ``[0, V)``, every rank raises — the rank with the bad target naming it, the others naming that
    rank — so nobody is left waiting in a collective the failing rank never reaches. Returns the checked
    int64 targets (as :func:`hugehead.options.check_targets`).

    Raises:
        ValueError: on every rank of the group.
    """
    bad = (target < 0) | (target >= num_classes)
    if ignore_index is not None:
        bad &= target != ignore_index
    device = engine.comm_device(target.device)
    flags = torch.empty(engine.world_size, dtype=torch.int64, device=device)
    _all_gather_single(flags, bad.any().to(device=device, dtype=torch.int64).view(1), group=engine.group)
    ranks = [r for r, flag in enumerate(flags.tolist()) if flag]
    target = check_targets(target, num_classes, ignore_index)  # raises on a rank whose own targets are bad
    if ranks:
        raise ValueError(f"hugehead: a target out of range for {num_classes} classes on rank(s) {ranks} of the "
                         f"weight's device mesh (their error names it)")
    return target


# --------------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------------
def mesh_head(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], *,
              compute_dtype: Optional[torch.dtype], options: LossOptions, chunk_size: Optional[int],
              memory_budget: Optional[int], check_local: bool = True) -> Tuple[LossSpec, Tensor, Tensor, List[Tensor]]:
    """A DTensor ``weight`` (and ``bias``) as this rank's part of one head: ``(spec, x, target, params)`` — the
    :class:`LossSpec` of its engine (the local engine for a ``Replicate()`` weight, else the distributed engine
    over the mesh, tensor-parallel when ``x`` is ``Replicate()``), this rank's rows in the compute dtype, its
    targets (range-checked on every rank at once; a replicated weight's only with ``check_local``) and the local
    ``[weight, bias]`` (``to_local()``: differentiable, the gradients come back as DTensors of their placement).

    Raises: as :func:`linear_cross_entropy`."""
    if not is_dtensor(weight):
        raise TypeError("hugehead: x is a DTensor but weight is not; pass the weight as a DTensor on the same mesh "
                        "(or x.to_local() beside a plain weight)")
    mesh, kind = _weight_placement(weight, bias)
    x, target, replicated = _local_rows(x, target, mesh)
    if compute_dtype is not None and x.dtype != compute_dtype:
        x = x.to(compute_dtype)  # differentiable: x.grad comes back in x's own dtype
    params = [weight.to_local()] + ([] if bias is None else [bias.to_local()])
    num_classes = weight.shape[0]
    if kind == "replicate":
        target = check_targets(target, num_classes, options.ignore_index) if check_local else target
        return LossSpec(LocalEngine(chunk_size, memory_budget), [0], bias is not None, num_classes, options), x, \
            target, params
    ranges = shard_class_ranges(num_classes, mesh.size())
    engine_type = TensorParallelEngine if replicated else DistributedEngine
    engine = engine_type(LocalEngine(chunk_size, memory_budget), mesh.get_group(), ranges)
    spec = LossSpec(engine, [ranges[mesh.get_local_rank()][0]], bias is not None, num_classes, options)
    target = _check_targets_on_every_rank(engine, target.long().contiguous(), num_classes, options.ignore_index)
    return spec, x, target, params


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    *,
    compute_dtype: Optional[torch.dtype],
    options: LossOptions,
    chunk_size: Optional[int],
    memory_budget: Optional[int],
    return_lse: bool,
):
    """:func:`hugehead.linear_cross_entropy` of a DTensor ``weight [V, D]`` (and ``bias [V]``) on a 1-D mesh,
    as the module docstring describes; called by it once its checks (on the global shapes) have passed.

    Args:
        x: ``[N_r, D]`` this rank's rows (plain tensor or ``Shard(0)`` DTensor), or a ``Replicate()``
            DTensor ``[N, D]`` of the rows every rank shares. target: ``[N_r]`` int64 (plain tensor, or a
            DTensor of ``x``'s placement).
        compute_dtype: the autocast dtype, or None (the inputs' dtype). options: the loss, checked.
        Others: as :func:`hugehead.linear_cross_entropy`, already validated.
    Returns:
        This rank's loss (``reduction`` over its own rows; with replicated rows the same on every rank),
        a plain tensor; with ``return_lse``, ``(loss, lse [N_r])``.
    Raises:
        ValueError: a placement or mesh that is not supported (named in the message); a target out of
            range on any rank (raised on every rank). TypeError: a plain-tensor bias beside a DTensor weight.
    """
    replicated_weight = _weight_placement(weight, bias)[1] == "replicate" if is_dtensor(weight) else False
    spec, x, target, params = mesh_head(x, weight, target, bias, compute_dtype=compute_dtype, options=options,
                                        chunk_size=chunk_size, memory_budget=memory_budget,
                                        check_local=not replicated_weight)
    if replicated_weight:  # the local computation on the local tensors (the class-id op checks the targets)
        loss, lse = class_id_loss(x, params[0], target, params[1] if len(params) > 1 else None, options,
                                  chunk_size, memory_budget, return_lse)
        return (loss, lse) if return_lse else loss
    loss_rows, lse = ShardedLinearCrossEntropy.apply(spec, x, target, *params)
    loss = reduce_loss(loss_rows, target != options.ignore_index, options.reduction)
    return (loss, lse) if return_lse else loss
