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

__all__ = ["LossSpec", "ShardedLinearCrossEntropy", "backward_of_shards", "no_autocast", "save_for_shards",
           "saved_rows"]


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


def save_for_shards(ctx, spec: LossSpec, x: Tensor, rows: Sequence[Tensor], params: Sequence[Tensor],
                    placed: Sequence[PlacedInputs]) -> None:
    """Keep what :func:`backward_of_shards` needs from a forward over the shards of ``spec``: ``x``, the per-row
    tensors its backward reads (:func:`saved_rows`), the shards' params and the placed inputs. Tensors go through
    ``save_for_backward`` (placed class ids too); chunk targets ride on ctx (they are not tensors), and so do the
    kept logits (not saved: the backward turns them into their gradient in place and drops them, so a second
    backward, ``retain_graph=True``, recomputes) and the forward's plan of every shard (the backward follows it
    instead of planning again)."""
    ctx.spec, ctx.num_rows, ctx.num_params = spec, len(rows), len(params)
    ctx.placed_targets = [None if isinstance(p.target, Tensor) else p.target for p in placed]
    ctx.kept = [p.kept for p in placed]
    ctx.plans = [p.plan for p in placed]
    ctx.save_for_backward(x, *rows, *params, *(p.x for p in placed),
                          *(p.target for p in placed if isinstance(p.target, Tensor)))
    ctx.set_materialize_grads(False)


def saved_rows(ctx) -> Tuple[Tensor, ...]:
    """The per-row tensors :func:`save_for_shards` kept, in their order."""
    return ctx.saved_tensors[1:1 + ctx.num_rows]


def backward_of_shards(ctx, name: str, x_at: int, params_at: int, lse: Tensor, grad_rows: Tensor,
                       **engine_args) -> List[Optional[Tensor]]:
    """The gradients of a node saved by :func:`save_for_shards` whose ``x`` is input ``x_at`` of its forward and
    whose shards' params are its inputs from ``params_at`` on: ``[dx, *dparams]`` (None where no input needs one),
    from the engine's backward with the rows' gradient ``grad_rows`` (and ``engine_args``: ``grad_lse``,
    ``row_terms``)."""
    spec: LossSpec = ctx.spec
    saved = ctx.saved_tensors
    base = 1 + ctx.num_rows
    x, params = saved[0], saved[base:base + ctx.num_params]
    num_placed = len(ctx.plans)
    placed_x = saved[base + ctx.num_params:base + ctx.num_params + num_placed]
    class_ids = iter(saved[base + ctx.num_params + num_placed:])
    targets = [next(class_ids) if t is None else t for t in ctx.placed_targets]
    kept, ctx.kept = ctx.kept or [px.new_empty(0) for px in placed_x], None
    needs = ctx.needs_input_grad
    k = len(spec.starts)
    need_w = [needs[params_at + i] for i in range(k)]
    need_b = [spec.has_bias and needs[params_at + k + i] for i in range(k)]
    placed = [PlacedInputs(*inputs) for inputs in zip(placed_x, targets, kept, ctx.plans)]
    # No graph of the backward itself (create_graph=True would record the loop's out= GEMMs): no_second_order
    # below makes differentiating these gradients a clear error instead.
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False), torch.no_grad():
        grad_x, grad_w, grad_b = spec.engine.backward(
            placed, spec.shards(params), spec.num_classes, lse, grad_rows.contiguous(), spec.options, needs[x_at],
            [w or b for w, b in zip(need_w, need_b)], x, **engine_args)
    grads_w = [g if need else None for g, need in zip(grad_w, need_w)]
    grads_b = [g if need else None for g, need in zip(grad_b, need_b)] if spec.has_bias else []
    return no_second_order(name, [x, *params], [grad_x if needs[x_at] else None, *grads_w, *grads_b])


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
        ctx.prepared = prepared  # its tensors ride on ctx (they are not autograd inputs)
        save_for_shards(ctx, spec, x, [lse] if prepared is not None else [lse, target], params, placed)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss: Optional[Tensor], grad_lse: Optional[Tensor]):
        lse, *class_ids = saved_rows(ctx)
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        if grad_loss is None:
            grad_loss = zero.expand(lse.shape)
        if ctx.prepared is None:
            grad_rows = torch.where(class_ids[0] != ctx.spec.options.ignore_index, grad_loss.to(lse.dtype), zero)
        else:
            grad_rows = ctx.prepared.grad_rows(grad_loss, lse.dtype)
        grads = backward_of_shards(ctx, "ChunkedClassifier", 1, 3, lse, grad_rows,
                                   grad_lse=None if grad_lse is None else grad_lse.to(lse.dtype).contiguous())
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
