"""One-vs-all binary cross-entropy on one device: :func:`linear_binary_cross_entropy`,
``F.binary_cross_entropy_with_logits(F.linear(x, weight, bias), target.to_dense(), pos_weight=...)`` without the
``[N, V]`` logits, as registered ops over the one chunk loop (:mod:`hugehead.loop`).

Its gradient needs no global normalizer, so with a scalar reduction (and gradients wanted, outside
``torch.compile``) the forward produces it in the same pass as the loss (logits GEMM, one kernel, dX and dW
GEMMs: 6·N·D·V FLOPs, no recompute) and the backward only scales it by the incoming gradient. ``dW`` then
lives from the forward to the backward (the size of ``weight.grad``, which the backward would allocate anyway).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import ops, sparse
from .lce_op import autocast_off, op_plan
from .loop import shard_backward
from .loop.sources import ResidentChunks
from .multilabel import (backward_through_loop, check_head_inputs, fake_backward, fake_forward, forward_through_loop,
                         wants_grad)
from .options import LossOptions, check_chunk_size, check_memory_budget
from .budget import shard_oom_guard
from .plan import Plan
from .target_prep import binary_target, reduce_binary
from .targets import BinaryCsrTarget

__all__ = ["linear_binary_cross_entropy"]


# --------------------------------------------------------------------------------------------------
# One-vs-all binary cross-entropy: the registered ops
# --------------------------------------------------------------------------------------------------
def _binary_chunk_target(crow, col, row, val, entry_weight, num_classes):
    return BinaryCsrTarget(sparse.CsrTarget(crow, col, val, row, num_classes), entry_weight)


@torch.library.custom_op("hugehead::linear_bce_csr_forward", mutates_args=())
def _bce_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor, row: Tensor, val: Tensor,
    entry_weight: Optional[Tensor], plan: List[int],
) -> Tuple[Tensor, Tensor]:
    """Per-row sums ``[N]`` (accumulation dtype) of the one-vs-all losses, and the kept logits, in ``plan``
    (the caller's, encoded; the backward op is given it too)."""
    target = _binary_chunk_target(crow, col, row, val, entry_weight, weight.shape[0])
    _, row_loss, _, kept = forward_through_loop(x, weight, bias, target, 0.0, plan)
    return row_loss, kept


@_bce_forward.register_fake
def _(x, weight, bias, crow, col, row, val, entry_weight, plan):
    loss, _, kept = fake_forward(x, plan)
    return loss, kept


@torch.library.custom_op("hugehead::linear_bce_csr_backward", mutates_args=("kept",))
def _bce_backward(
    grad_loss: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor, row: Tensor,
    val: Tensor, entry_weight: Optional[Tensor], kept: Tensor, plan: List[int], need_x: bool, need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dX, dW, db)`` of :func:`_bce_forward`, recomputing the logits (or from ``kept``)."""
    acc = ops.acc_dtype(x.dtype)
    target = _binary_chunk_target(crow, col, row, val, entry_weight, weight.shape[0])
    no_lse = torch.zeros(x.shape[0], dtype=acc, device=x.device)
    return backward_through_loop(x, weight, bias, target, no_lse, grad_loss.to(acc).contiguous(), kept, 0.0, 0.0,
                                  0.0, plan, need_x, need_weight, None)


@_bce_backward.register_fake
def _(grad_loss, x, weight, bias, crow, col, row, val, entry_weight, kept, plan, need_x, need_weight):
    return fake_backward(x, weight, bias, need_x, need_weight)


def _bce_setup_context(ctx, inputs, output):
    x, weight, bias, crow, col, row, val, entry_weight, plan = inputs
    _, kept = output
    ctx.save_for_backward(x, weight, bias, crow, col, row, val, entry_weight)
    ctx.plan = plan
    ctx.mark_non_differentiable(kept)
    ctx.kept = kept if Plan.decode(plan).keep_logits else None
    ctx.set_materialize_grads(False)


def _bce_backward_autograd(ctx, grad_loss, grad_kept):
    x, weight, bias, crow, col, row, val, entry_weight = ctx.saved_tensors
    kept, ctx.kept = ctx.kept, None
    if kept is None:
        kept = x.new_empty(0)
    need_x = ctx.needs_input_grad[0]
    need_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
    grad_x, grad_w, grad_b = torch.ops.hugehead.linear_bce_csr_backward(
        grad_loss, x, weight, bias, crow, col, row, val, entry_weight, kept, ctx.plan, need_x, need_weight)
    return (grad_x if need_x else None, grad_w if ctx.needs_input_grad[1] else None,
            grad_b if (bias is not None and ctx.needs_input_grad[2]) else None) + (None,) * 6


_bce_forward.register_autograd(_bce_backward_autograd, setup_context=_bce_setup_context)


class _LossAndGrad:
    """A one-vs-all chunk target whose gradient step also adds the chunk's losses into ``row_loss``: run
    through :func:`hugehead.loop.backward_steps` it is the forward that produces the gradient."""

    def __init__(self, target: BinaryCsrTarget, row_loss: Tensor):
        self.target, self.row_loss = target, row_loss

    def rows(self, r0: int, r1: int) -> "_LossAndGrad":
        return _LossAndGrad(self.target.rows(r0, r1), self.row_loss[r0:r1])

    def grad_(self, z, class_start, num_classes, lse, grad_rows, label_smoothing, z_loss, softcap, grad_lse):
        self.target.loss_and_grad_(z, class_start, self.row_loss, grad_rows)


@torch.library.custom_op("hugehead::linear_bce_csr_fused", mutates_args=())
def _bce_fused(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor, row: Tensor, val: Tensor,
    entry_weight: Optional[Tensor], scale: float, plan: List[int], need_x: bool, need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``scale * Σ`` of the one-vs-all losses (0-d, accumulation dtype) and its gradients ``(dX [N, D] in the
    accumulation dtype, dW, db)`` for an incoming gradient of 1, in one streaming pass of ``plan`` (the
    caller's, encoded)."""
    acc = ops.acc_dtype(x.dtype)
    n, v = x.shape[0], weight.shape[0]
    target = _binary_chunk_target(crow, col, row, val, entry_weight, v)
    row_loss = torch.zeros(n, dtype=acc, device=x.device)
    plan = Plan.decode(plan)
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
    with autocast_off(x.device), shard_oom_guard(0, 0, v, x.device, plan):
        grad_w, grad_b = shard_backward(
            x, ResidentChunks(weight, bias, x.dtype), _LossAndGrad(target, row_loss), 0, v,
            torch.zeros(n, dtype=acc, device=x.device), torch.full((n,), scale, dtype=acc, device=x.device),
            LossOptions(), plan, grad_x, need_weight,
        )
    return (
        row_loss.sum() * scale,
        grad_x if grad_x is not None else x.new_empty(0, dtype=acc),
        grad_w if grad_w is not None else x.new_empty(0),
        grad_b if grad_b is not None else x.new_empty(0),
    )


@_bce_fused.register_fake
def _(x, weight, bias, crow, col, row, val, entry_weight, scale, plan, need_x, need_weight):
    acc = ops.acc_dtype(x.dtype)
    grad_x, grad_w, grad_b = fake_backward(x, weight, bias, need_x, need_weight)
    return x.new_empty((), dtype=acc), grad_x.to(acc), grad_w, grad_b


def _bce_fused_setup_context(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    _, grad_x, grad_w, grad_b = output
    ctx.mark_non_differentiable(grad_x, grad_w, grad_b)
    # Held on ctx (not saved for backward): the backward scales them in place and drops them.
    ctx.grads = (grad_x, grad_w, grad_b)
    ctx.x_dtype = x.dtype
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)


def _bce_fused_backward(ctx, grad_loss, *unused):
    if ctx.grads is None:
        raise RuntimeError("hugehead: linear_binary_cross_entropy's gradients were produced in the forward and "
                           "already used; call backward once (or pass retain_graph=False)")
    grad_x, grad_w, grad_b = ctx.grads
    ctx.grads = None
    if grad_loss is None:
        return (None,) * 12
    # In place through ops.scale_ (one vectorized pass on CUDA): the product in float32 with the whole
    # grad_loss, rounded once to each gradient's dtype.
    out_x = ops.scale_(grad_x, grad_loss).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    out_w = ops.scale_(grad_w, grad_loss) if ctx.needs_input_grad[1] else None
    out_b = ops.scale_(grad_b, grad_loss) if (ctx.has_bias and ctx.needs_input_grad[2]) else None
    return (out_x, out_w, out_b) + (None,) * 9


_bce_fused.register_autograd(_bce_fused_backward, setup_context=_bce_fused_setup_context)


# Under torch.compile this runs eagerly, as one graph break (see hugehead.functional's weighted loss).
@torch.compiler.disable
def linear_binary_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    pos_weight: Optional[Tensor] = None,
    reduction: str = "mean",
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Tensor:
    """One-vs-all ``F.binary_cross_entropy_with_logits(F.linear(x, weight, bias), target.to_dense(),
    pos_weight=pos_weight, reduction=reduction)`` without the ``[N, V]`` logits or dense target.

    Args:
        x: ``[N, D]`` float16, bfloat16, float32 or float64. weight: ``[V, D]``; bias: ``[V]`` or None (same
            dtype as ``x`` outside ``torch.autocast``; under autocast computed in its dtype, as
            :func:`hugehead.linear_cross_entropy`).
        target: sparse ``[N, V]`` (``torch.sparse_csr`` or ``torch.sparse_coo``, any device) with floating
            values in ``[0, 1]``; absent entries are 0. Or that target converted by :func:`hugehead.csr_target`.
        pos_weight: ``[V]`` (or one-element) weight of the positive term, as in PyTorch; None for 1.
        reduction: ``"mean"`` (over all ``N·V`` logits), ``"sum"``, or ``"none"``: the per-row sums ``[N]``
            over the classes (not PyTorch's elementwise ``[N, V]``, which this function exists to avoid).
        chunk_size, memory_budget: as for :func:`hugehead.linear_cross_entropy`.

    Under ``torch.compile`` it runs eagerly, as one graph break (the target's preparation reads the data;
    dynamo does not take sparse tensors at all: a compiled function called with one runs eagerly, whole,
    which :func:`hugehead.csr_target` avoids).
    With ``"mean"``/``"sum"`` and gradients wanted the gradients are produced
    in the forward, in the same pass as the loss, and the backward only scales them: the step costs three
    GEMMs instead of four, and ``weight``'s gradient (its size) lives from the forward to the backward.

    Returns:
        The loss, float32 for float16/bfloat16/float32 computations (float64 for float64).
    Raises:
        ValueError: shape or device mismatch, target values outside [0, 1] or class ids outside [0, V),
            bad options. TypeError: unsupported dtypes, a target that is not sparse.
    """
    compute = check_head_inputs(x, weight, bias)
    LossOptions(reduction=reduction)
    chunk_size, memory_budget = check_chunk_size(chunk_size), check_memory_budget(memory_budget)
    n, v = x.shape[0], weight.shape[0]
    sparse.check_pos_weight(pos_weight, v, x.device)
    if compute is not None and x.dtype != compute:
        x = x.to(compute)
    acc = ops.acc_dtype(x.dtype)
    chunk_target = binary_target(target, n, v, pos_weight, acc, x.device)
    t = chunk_target.target
    args = (x, weight, bias, t.crow, t.col, t.row, t.val, chunk_target.entry_weight)
    # One plan of the chunk loop, never of kept logits (see below), for whichever op runs.
    plan = op_plan(x, weight, chunk_size or 0, memory_budget or 0, False).encode()
    if reduction != "none" and wants_grad(x, weight, bias):
        # The forward produces the gradients: three GEMMs per chunk in one pass, a chunk's workspace. Keeping
        # logits for the backward costs the same three GEMMs and more memory, and keeping only some chunks
        # (what a plan does when not all fit) recomputes the rest: 3.3-4 GEMMs (measured on an H200 at xc1M:
        # 88.6 ms with a partial keep against 85.3 ms for the single-label step).
        scale = 1.0 / (n * v) if (reduction == "mean" and n) else 1.0
        need_weight = weight.requires_grad or (bias is not None and bias.requires_grad)
        loss, _, _, _ = torch.ops.hugehead.linear_bce_csr_fused(*args, scale, plan, x.requires_grad, need_weight)
        return loss * float("nan") if (reduction == "mean" and not n) else loss
    row_loss, _ = torch.ops.hugehead.linear_bce_csr_forward(*args, plan)
    return reduce_binary(row_loss, v, reduction)
