"""The head's loss as one autograd node over all shards: the forward asks the placement engine for the
merged per-row statistics, the backward streams the shards again (or uses the logits a shard kept) and
returns each shard's gradients on its device in its Parameters' dtype."""
from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .engines.local import LocalEngine, PlacedInputs, ShardTensors
from .options import LossOptions, no_second_order, row_losses

__all__ = ["LossSpec", "ShardedLinearCrossEntropy", "no_autocast"]


@dataclass(frozen=True)
class LossSpec:
    """What the autograd op needs besides tensors (kept on ctx for the backward)."""

    engine: LocalEngine
    starts: List[int]
    has_bias: bool
    num_classes: int
    options: LossOptions

    def shards(self, params: Sequence[Tensor]) -> List[ShardTensors]:
        k = len(self.starts)
        biases = params[k:2 * k] if self.has_bias else [None] * k
        return [ShardTensors(w, b, s) for w, b, s in zip(params[:k], biases, self.starts)]


class ShardedLinearCrossEntropy(torch.autograd.Function):
    """Per-row losses and lse ``[N]`` (accumulation dtype) of ``x`` against every shard; one node in
    the graph. ``x`` is in the compute dtype; the shards' Parameters may be stored in another float
    dtype (autocast: cast chunk by chunk in the loop).

    The backward streams the shards again (recomputing logits, or from logits a shard kept) and returns
    each shard's gradients on that shard's device in its Parameters' dtype.
    """

    @staticmethod
    def forward(ctx, spec: LossSpec, x: Tensor, target, *params: Tensor) -> Tuple[Tensor, Tensor]:
        # target: [N] class ids, or a hugehead.target_prep.PreparedTarget (sparse / weighted / one-vs-all),
        # whose chunk target the engines place and whose rules give the row losses and row gradients.
        prepared = None if isinstance(target, Tensor) else target
        shards = spec.shards(params)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            lse, target_logit, logit_sum, placed = spec.engine.row_stats(
                x, target if prepared is None else prepared.chunk, shards, spec.options,
                keep=any(ctx.needs_input_grad),
            )
            if prepared is None:
                valid = target != spec.options.ignore_index
                loss = row_losses(lse, target_logit, logit_sum, valid, spec.num_classes, spec.options)
            else:
                loss = prepared.row_losses(lse, target_logit, logit_sum, spec.options.label_smoothing,
                                           spec.options.z_loss)
        ctx.spec = spec
        ctx.num_params = len(params)
        ctx.prepared = prepared
        if prepared is not None:  # its tensors ride on ctx (they are not autograd inputs)
            ctx.placed_targets = [p.target for p in placed]
            target = lse.new_empty(0)
            placed = [p._replace(target=target) for p in placed]
        ctx.save_for_backward(x, target, lse, *params, *(p.x for p in placed), *(p.target for p in placed))
        # Not saved for backward: the backward turns kept logits into their gradient in place and drops
        # them, so a second backward (retain_graph=True) finds none and recomputes instead.
        ctx.kept = [p.kept for p in placed]
        # The forward's plan of every shard: the backward follows it instead of planning again.
        ctx.plans = [p.plan for p in placed]
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss: Optional[Tensor], grad_lse: Optional[Tensor]):
        spec: LossSpec = ctx.spec
        saved = ctx.saved_tensors
        x, target, lse = saved[:3]
        params = saved[3:3 + ctx.num_params]
        k = len(spec.starts)
        base = 3 + ctx.num_params
        placed_x, placed_target = saved[base:base + k], saved[base + k:base + 2 * k]
        placed_kept, ctx.kept = ctx.kept or [px.new_empty(0) for px in placed_x], None
        needs = ctx.needs_input_grad
        need_x = needs[1]
        need_w = [needs[3 + i] for i in range(k)]
        need_b = [spec.has_bias and needs[3 + k + i] for i in range(k)]
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        if grad_loss is None:
            grad_loss = zero.expand(lse.shape)
        if ctx.prepared is None:
            grad_rows = torch.where(target != spec.options.ignore_index, grad_loss.to(lse.dtype), zero)
        else:
            grad_rows = ctx.prepared.grad_rows(grad_loss, lse.dtype)
            placed_target = ctx.placed_targets
        shards = spec.shards(params)
        placed = [PlacedInputs(px, pt, pk, plan)
                  for px, pt, pk, plan in zip(placed_x, placed_target, placed_kept, ctx.plans)]
        # No graph of the backward itself (create_graph=True would record the loop's out= GEMMs):
        # no_second_order below makes differentiating these gradients a clear error instead.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False), torch.no_grad():
            grad_x, grad_w, grad_b = spec.engine.backward(
                placed, shards, spec.num_classes, lse, grad_rows, spec.options, need_x,
                [w or b for w, b in zip(need_w, need_b)], x,
                grad_lse=None if grad_lse is None else grad_lse.to(lse.dtype).contiguous(),
            )
        grads_w = [g if need else None for g, need in zip(grad_w, need_w)]
        grads_b = [g if need else None for g, need in zip(grad_b, need_b)] if spec.has_bias else []
        grads = no_second_order("ChunkedClassifier", [x, *params], [grad_x if need_x else None, *grads_w, *grads_b])
        return (None, grads[0], None, *grads[1:])


def no_autocast(x: Tensor, shards: Sequence[ShardTensors]):
    """Autocast off on every device type involved: the loop picks its own dtypes (x's compute dtype,
    weight chunks cast to it) and issues GEMMs with out= that autocast must not recast. (The autograd
    op below writes the two contexts out instead: dynamo traces a ``with torch.autocast`` only there.)"""
    types = {x.device.type} | {s.weight.device.type for s in shards}
    stack = contextlib.ExitStack()
    for device_type in sorted(types & {"cuda", "cpu"}):
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack
