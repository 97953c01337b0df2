"""The local placement engine: shards on devices of this process (several GPUs, CPU, or a mix).

Each shard runs the one chunk loop of :mod:`hugehead.functional` on its own device, on that device's
current stream. ``x`` and the targets are copied to each device once; only per-row statistics (forward)
and ``dX`` partials (backward) travel back to ``x``'s device. Every device's work is launched before
anything is waited on, so GPUs overlap; a CPU shard runs on the host, so CPU shards go last.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional import (
    RowStats,
    merge_row_stats,
    merge_topk,
    plan_chunks,
    plan_topk_chunks,
    shard_backward,
    shard_forward_stats,
    shard_topk,
)
from ..ops import acc_dtype

__all__ = ["ShardTensors", "PlacedInputs", "LocalEngine"]


class ShardTensors(NamedTuple):
    """One shard as the engine sees it: ``weight [V_k, D]``, ``bias [V_k]`` or None, and the global id
    of its first class."""

    weight: Tensor
    bias: Optional[Tensor]
    start: int


class PlacedInputs(NamedTuple):
    """``x [N, D]`` and ``target [N]`` as copied to one shard's device (shared by shards on one device)."""

    x: Tensor
    target: Tensor


def _device_guard(device: torch.device):
    # Our kernels and ATen launch on the current device's stream: make the shard's device current.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _to(t: Tensor, device: torch.device) -> Tensor:
    """Copy ``t`` to ``device`` without a host synchronization where that is safe.

    Into a CUDA device the copy is ordered on the streams (device to device) or staged before returning
    (pageable host memory). Into host memory it must block: the host computes on it right away.
    """
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type == "cuda")


def _launch_order(shards: Sequence[ShardTensors]) -> List[int]:
    """Shard indices with the GPU shards first: their work is queued asynchronously, so it overlaps the
    host computing the CPU shards that follow."""
    return sorted(range(len(shards)), key=lambda i: shards[i].weight.device.type == "cpu")


class LocalEngine:
    """Runs the per-shard chunk loop for shards that live on devices of this process.

    Args:
        chunk_size: classes per chunk (None: planned per shard from the shapes and ``memory_budget``).
        memory_budget: bytes of workspace each shard's loop may use (None: the planner's default).
    """

    name = "local"

    def __init__(self, chunk_size: Optional[int] = None, memory_budget: Optional[int] = None):
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget

    def _plan(self, x: Tensor, shard: ShardTensors):
        return plan_chunks(
            x.shape[0], x.shape[1], shard.weight.shape[0], x.dtype, shard.weight.device,
            self.chunk_size, self.memory_budget,
        )

    def row_stats(
        self, x: Tensor, target: Tensor, shards: Sequence[ShardTensors], softcap: float
    ) -> Tuple[Tensor, Tensor, Tensor, List[PlacedInputs]]:
        """Merged per-row statistics over all shards.

        Args:
            x: ``[N, D]``; target: ``[N]`` int64, already validated, on ``x``'s device.
            shards: in class order. softcap: ``<= 0`` for none.
        Returns:
            ``(lse, target_logit, logit_sum)``, each ``[N]`` in the accumulation dtype on ``x``'s device,
            and the inputs as placed on each shard's device (aligned with ``shards``) for the backward.
        """
        by_device: Dict[torch.device, PlacedInputs] = {}
        stats: List[Optional[RowStats]] = [None] * len(shards)
        for i in _launch_order(shards):
            shard = shards[i]
            device = shard.weight.device
            with _device_guard(device):
                if device not in by_device:  # x and target cross to each device once
                    by_device[device] = PlacedInputs(_to(x, device), _to(target, device))
                inputs = by_device[device]
                stats[i] = shard_forward_stats(
                    inputs.x, shard.weight, shard.bias, inputs.target, shard.start, softcap, self._plan(x, shard)
                )
        placed = [by_device[s.weight.device] for s in shards]
        # Only now wait on anything: N-element statistics cross to x's device.
        parts = [RowStats(*(_to(s, x.device) for s in st)) for st in stats]
        lse, target_logit, logit_sum = merge_row_stats(parts)
        return lse, target_logit, logit_sum, placed

    def backward(
        self,
        placed: Sequence[PlacedInputs],
        shards: Sequence[ShardTensors],
        num_classes: int,
        lse: Tensor,
        grad_rows: Tensor,
        label_smoothing: float,
        z_loss: float,
        softcap: float,
        need_x: bool,
        need_weight: Sequence[bool],
        x_like: Tensor,
    ) -> Tuple[Optional[Tensor], List[Optional[Tensor]], List[Optional[Tensor]]]:
        """Gradients of all shards, each shard recomputing its logits chunk by chunk on its device.

        Args:
            placed: the inputs returned by :meth:`row_stats`.
            lse, grad_rows: ``[N]`` accumulation dtype on ``x``'s device; ``grad_rows`` is zero on
                ignored rows.
            need_x: compute ``dX``. need_weight: per shard, compute ``dW`` (and ``db``).
            x_like: the original ``x`` (its device and dtype are those of ``dX``).
        Returns:
            ``(dX [N, D] in x's dtype on x's device or None, [dW_k or None], [db_k or None])``, each
            shard's gradients on that shard's device in its parameters' dtype.
        """
        acc = acc_dtype(x_like.dtype)
        out_device = x_like.device
        row_inputs: Dict[torch.device, Tuple[Tensor, Tensor]] = {}
        # One fp32 (fp64 for fp64 inputs) dX buffer per device, shared by that device's shards.
        grad_x_parts: Dict[torch.device, Tensor] = {}
        grad_w: List[Optional[Tensor]] = [None] * len(shards)
        grad_b: List[Optional[Tensor]] = [None] * len(shards)
        for i in _launch_order(shards):
            shard, inputs = shards[i], placed[i]
            device = shard.weight.device
            if not (need_x or need_weight[i]):
                continue
            with _device_guard(device):
                if device not in row_inputs:
                    row_inputs[device] = (_to(lse, device), _to(grad_rows, device))
                if need_x and device not in grad_x_parts:
                    grad_x_parts[device] = torch.zeros(inputs.x.shape, dtype=acc, device=device)
                lse_k, grad_rows_k = row_inputs[device]
                grad_w[i], grad_b[i] = shard_backward(
                    inputs.x, shard.weight, shard.bias, inputs.target, shard.start, num_classes, lse_k,
                    grad_rows_k, label_smoothing, z_loss, softcap, self._plan(inputs.x, shard),
                    grad_x_parts.get(device), need_weight[i],
                )
        grad_x = None
        if need_x:
            for device, part in grad_x_parts.items():
                if device == out_device:
                    grad_x = part if grad_x is None else grad_x.add_(part)
            for device, part in grad_x_parts.items():
                if device != out_device:
                    part = _to(part, out_device)
                    grad_x = part if grad_x is None else grad_x.add_(part)
            grad_x = grad_x.to(x_like.dtype)
        return grad_x, grad_w, grad_b

    def topk(self, x: Tensor, shards: Sequence[ShardTensors], softcap: float, k: int) -> Tuple[Tensor, Tensor]:
        """Top ``k`` logits over all classes, streamed per shard and merged on ``x``'s device.

        Returns:
            ``(values [N, k] in x's dtype, indices [N, k] int64)`` sorted by value descending, ties by the
            lower class id.
        """
        placed: Dict[torch.device, Tensor] = {}
        parts: List[Optional[Tuple[Tensor, Tensor]]] = [None] * len(shards)
        for i in _launch_order(shards):
            shard = shards[i]
            device = shard.weight.device
            with _device_guard(device):
                if device not in placed:
                    placed[device] = _to(x, device)
                xk = placed[device]
                plan = plan_topk_chunks(
                    xk.shape[0], xk.shape[1], shard.weight.shape[0], xk.dtype, device,
                    self.chunk_size, self.memory_budget,
                )
                parts[i] = shard_topk(xk, shard.weight, shard.bias, shard.start, softcap, k, plan)
        values = torch.cat([_to(v, x.device) for v, _ in parts], dim=1)
        indices = torch.cat([_to(ix, x.device) for _, ix in parts], dim=1)
        return merge_topk(values, indices, k)
