"""Softmax cross-entropy on one device against sparse probability targets, or class ids with class weights,
as a registered op pair over the one chunk loop (:mod:`hugehead.loop`), so ``torch.compile`` sees one node;
and the kit of single-device ops over a chunk target that :mod:`hugehead.onevsall` shares.

- :func:`hugehead.target_prep.softmax_target` turns the target into the loop's
  :class:`~hugehead.targets.SoftmaxCsrTarget` plus what the per-row loss needs.
- With a scalar reduction and gradients wanted, the softmax takes the plan the class-id loss would take
  (:func:`plan_softmax`); where that is the rows plan, ``hugehead::linear_softmax_csr_rows`` computes the
  loss and every gradient in the forward (three GEMMs, the loop's :func:`hugehead.loop.rows_steps` with
  :func:`~hugehead.target_prep.softmax_row_losses` per row block) and the backward only scales them.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops, sparse
from .lce_op import autocast_off, register_rows_autograd, rows_fake, rows_pass
from .loop import shard_forward_stats, whole_head_backward
from .loop.chunks import merge_row_stats
from .loop.sources import ResidentChunks
from .options import LossOptions, check_inputs
from .budget import shard_oom_guard
from .plan import Plan, kept_shape, plan_loss
from .target_prep import PreparedTarget, SoftmaxRows, reduce_softmax, softmax_row_losses, softmax_target
from .targets import SoftmaxCsrTarget

__all__ = [
    "check_head_inputs",
    "wants_grad",
    "forward_through_loop",
    "backward_through_loop",
    "fake_forward",
    "fake_backward",
    "plan_softmax",
    "prepared_rows_loss",
    "softmax_rows_loss",
    "linear_softmax_csr",
]


# --------------------------------------------------------------------------------------------------
# Inputs, planning and the chunk loop of one device (the kit of these ops and hugehead.onevsall's)
# --------------------------------------------------------------------------------------------------
def check_head_inputs(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[torch.dtype]:
    """Check ``x [N, D]``, ``weight [V, D]``, ``bias [V]``; returns the autocast compute dtype, or None
    when the inputs' dtype decides (as :func:`hugehead.linear_cross_entropy`).

    Raises:
        TypeError: not tensors, unsupported or mismatched dtypes. ValueError: shapes, devices.
    """
    if isinstance(x, Tensor) and x.dim() != 2:
        raise ValueError(f"hugehead: x must be [N, D] with a sparse [N, V] target, got shape {tuple(x.shape)}")
    return check_inputs(x, weight, None, bias)


def wants_grad(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether an eager call on these inputs wants gradients (never while torch.compile traces)."""
    return (not torch.compiler.is_compiling()) and torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))


def _options(label_smoothing: float, z_loss: float, softcap: float) -> LossOptions:
    return LossOptions(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap if softcap > 0 else None)


def backward_through_loop(x, weight, bias, chunk_target, lse, grad_rows, kept, label_smoothing, z_loss, softcap,
                          plan: List[int], need_x, need_weight, grad_lse):
    """``(dX, dW, db)`` of one device's loss, recomputing the logits chunk by chunk (or from ``kept``), in the
    forward's ``plan`` (:meth:`Plan.encode`'s list: never planned again here)."""
    plan = Plan.decode(plan)
    with autocast_off(x.device), shard_oom_guard(0, 0, weight.shape[0], x.device, plan):
        return whole_head_backward(x, weight, bias, chunk_target, lse, grad_rows,
                                   _options(label_smoothing, z_loss, softcap), plan, need_x, need_weight, kept,
                                   grad_lse)


def forward_through_loop(x, weight, bias, chunk_target, softcap, plan: List[int]):
    """Merged row statistics ``(lse, target_logit, logit_sum)`` of one device and the kept logits, in ``plan``
    (:meth:`Plan.encode`'s list, made by the caller: :func:`plan_softmax`, :func:`hugehead.lce_op.op_plan`)."""
    v = weight.shape[0]
    plan = Plan.decode(plan)
    with autocast_off(x.device), shard_oom_guard(0, 0, v, x.device, plan):
        stats, kept = shard_forward_stats(x, ResidentChunks(weight, bias, x.dtype), chunk_target, 0,
                                          _options(0.0, 0.0, softcap), plan)
        lse, target_logit, logit_sum = merge_row_stats([stats])
    return lse, target_logit, logit_sum, (x.new_empty(0) if kept is None else kept)


def fake_backward(x, weight, bias, need_x, need_weight):
    """The fake ``(dX, dW, db)`` of a backward op over a chunk target."""
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else x.new_empty(0),
        torch.empty_like(bias) if (need_weight and bias is not None) else x.new_empty(0),
    )


def fake_forward(x, plan: List[int]):
    """The fake ``(loss_rows [N], lse [N], kept)`` of a forward op over a chunk target in ``plan``."""
    acc = ops.acc_dtype(x.dtype)
    plan = Plan.decode(plan)
    kept = x.new_empty(kept_shape(plan, x.shape[0])) if plan.keep_logits else x.new_empty(0)
    return x.new_empty(x.shape[0], dtype=acc), x.new_empty(x.shape[0], dtype=acc), kept


# --------------------------------------------------------------------------------------------------
# Softmax with a CSR target: the registered op pair
# --------------------------------------------------------------------------------------------------
def _softmax_chunk_target(crow, col, row, stats_val, grad_val, mass, class_weight, num_classes):
    return SoftmaxCsrTarget(sparse.CsrTarget(crow, col, stats_val, row, num_classes), grad_val, mass, class_weight)


@torch.library.custom_op("hugehead::linear_softmax_csr_forward", mutates_args=())
def _softmax_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor, row: Tensor, stats_val: Tensor,
    grad_val: Tensor, mass: Tensor, row_weight: Tensor, weight_sum: Tensor, valid: Optional[Tensor],
    class_weight: Optional[Tensor], label_smoothing: float, z_loss: float, softcap: float, plan: List[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-row losses ``[N]``, lse ``[N]`` (accumulation dtype) and the kept logits (or an empty tensor)
    of the softmax against a CSR target (:func:`softmax_target`; ``valid`` given: index targets), in ``plan``
    (:func:`plan_softmax`'s, encoded), which the backward op is given too."""
    v = weight.shape[0]
    target = _softmax_chunk_target(crow, col, row, stats_val, grad_val, mass, class_weight, v)
    lse, target_dot, logit_sum, kept = forward_through_loop(x, weight, bias, target, softcap, plan)
    rows = SoftmaxRows(row_weight, weight_sum, valid, valid is not None)
    return softmax_row_losses(lse, target_dot, logit_sum, rows, v, label_smoothing, z_loss), lse, kept


@_softmax_forward.register_fake
def _(x, weight, bias, crow, col, row, stats_val, grad_val, mass, row_weight, weight_sum, valid, class_weight,
      label_smoothing, z_loss, softcap, plan):
    return fake_forward(x, plan)


@torch.library.custom_op("hugehead::linear_softmax_csr_backward", mutates_args=("kept",))
def _softmax_backward(
    grad_loss: Tensor, grad_lse: Optional[Tensor], x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor,
    col: Tensor, row: Tensor, stats_val: Tensor, grad_val: Tensor, mass: Tensor, valid: Optional[Tensor],
    class_weight: Optional[Tensor], lse: Tensor, kept: Tensor, label_smoothing: float, z_loss: float,
    softcap: float, plan: List[int], need_x: bool, need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dX, dW, db)`` of :func:`_softmax_forward` (empty where not asked for); non-empty ``kept``
    logits are overwritten by their gradient."""
    acc = ops.acc_dtype(x.dtype)
    grad_rows = grad_loss.to(acc)
    if valid is not None:
        grad_rows = torch.where(valid, grad_rows, torch.zeros((), dtype=acc, device=x.device))
    target = _softmax_chunk_target(crow, col, row, stats_val, grad_val, mass, class_weight, weight.shape[0])
    return backward_through_loop(x, weight, bias, target, lse, grad_rows.contiguous(), kept, label_smoothing,
                                  z_loss, softcap, plan, need_x, need_weight,
                                  None if grad_lse is None else grad_lse.to(acc).contiguous())


@_softmax_backward.register_fake
def _(grad_loss, grad_lse, x, weight, bias, crow, col, row, stats_val, grad_val, mass, valid, class_weight, lse,
      kept, label_smoothing, z_loss, softcap, plan, need_x, need_weight):
    return fake_backward(x, weight, bias, need_x, need_weight)


def _softmax_setup_context(ctx, inputs, output):
    (x, weight, bias, crow, col, row, stats_val, grad_val, mass, row_weight, weight_sum, valid, class_weight,
     label_smoothing, z_loss, softcap, plan) = inputs
    _, lse, kept = output
    ctx.save_for_backward(x, weight, bias, crow, col, row, stats_val, grad_val, mass, valid, class_weight, lse)
    ctx.options = (label_smoothing, z_loss, softcap, plan)
    ctx.mark_non_differentiable(kept)
    # As for index targets: the kept logits ride on ctx, not saved, and are used once.
    ctx.kept = kept if Plan.decode(plan).keep_logits else None
    ctx.set_materialize_grads(False)


def _softmax_backward_autograd(ctx, grad_loss, grad_lse, grad_kept):
    x, weight, bias, crow, col, row, stats_val, grad_val, mass, valid, class_weight, lse = ctx.saved_tensors
    kept, ctx.kept = ctx.kept, None
    if kept is None:
        kept = x.new_empty(0)
    if grad_loss is None:
        grad_loss = torch.zeros_like(lse)
    need_x = ctx.needs_input_grad[0]
    need_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
    grad_x, grad_w, grad_b = torch.ops.hugehead.linear_softmax_csr_backward(
        grad_loss, grad_lse, x, weight, bias, crow, col, row, stats_val, grad_val, mass, valid, class_weight, lse,
        kept, *ctx.options, need_x, need_weight,
    )
    return (grad_x if need_x else None, grad_w if ctx.needs_input_grad[1] else None,
            grad_b if (bias is not None and ctx.needs_input_grad[2]) else None) + (None,) * 14


_softmax_forward.register_autograd(_softmax_backward_autograd, setup_context=_softmax_setup_context)


# --------------------------------------------------------------------------------------------------
# Softmax with a CSR target through the rows plan: the scalar loss and its gradients in one pass
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("hugehead::linear_softmax_csr_rows", mutates_args=())
def _softmax_rows(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor, row: Tensor, stats_val: Tensor,
    grad_val: Tensor, mass: Tensor, row_weight: Tensor, weight_sum: Tensor, valid: Optional[Tensor],
    class_weight: Optional[Tensor], label_smoothing: float, z_loss: float, softcap: float, mean: bool,
    need_x: bool, need_weight: bool, hold: bool, plan: List[int],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The loss of :func:`_softmax_forward` reduced to a scalar (``mean``: :func:`reduce_softmax`'s
    ``"mean"``, else the sum; 0-d, accumulation dtype) and its gradients for an incoming gradient of 1:
    ``(dX [N, D] in x's dtype, dW [V, D] in the weight's dtype, db [V])`` (empty when not asked for), in one
    pass over the row blocks of ``plan`` (an encoded rows plan, :func:`hugehead.plan.plan_rows`), as
    ``hugehead::linear_cross_entropy_rows`` does for class ids. ``hold``: as there."""
    acc = ops.acc_dtype(x.dtype)
    n, v = x.shape[0], weight.shape[0]
    target = _softmax_chunk_target(crow, col, row, stats_val, grad_val, mass, class_weight, v)
    rows = SoftmaxRows(row_weight, weight_sum, valid, valid is not None)
    divisor = rows.mean_divisor(n, acc, x.device) if mean else torch.ones((), dtype=acc, device=x.device)
    # The reduction's scale of every row is known before the pass. A "mean" over nothing (N = 0, or every
    # index row ignored) has an inf scale: where() keeps ignored rows' gradient at 0, and the loss is NaN.
    scale = 1.0 / divisor
    grad_rows = (scale.expand(n) if valid is None else
                 torch.where(valid, scale, torch.zeros((), dtype=acc, device=x.device))).contiguous()

    def row_losses_of(r0: int, r1: int, lse: Tensor, target_dot: Tensor, logit_sum: Tensor) -> Tensor:
        return softmax_row_losses(lse, target_dot, logit_sum, rows.rows(r0, r1), v, label_smoothing, z_loss)

    loss_rows, grad_x, grad_w, grad_b = rows_pass(x, weight, bias, target, _options(label_smoothing, z_loss, softcap),
                                                  Plan.decode(plan), grad_rows, need_x, need_weight, row_losses_of)
    return loss_rows.sum() / divisor, grad_x, grad_w, grad_b


@_softmax_rows.register_fake
def _(x, weight, bias, crow, col, row, stats_val, grad_val, mass, row_weight, weight_sum, valid, class_weight,
      label_smoothing, z_loss, softcap, mean, need_x, need_weight, hold, plan):
    return rows_fake(x, weight, bias, need_x, need_weight)


register_rows_autograd(_softmax_rows, hold_index=19)


def plan_softmax(x: Tensor, weight: Tensor, bias: Optional[Tensor], *, reduction: str, return_lse: bool,
                 chunk_size: Optional[int], memory_budget: Optional[int]):
    """The plan of a softmax loss against a CSR target on one device: the one
    :func:`hugehead.plan.plan_loss` makes for the same call with class ids (the rows plan for a scalar
    loss with gradients when it picks it, else kept or recomputed logits)."""
    grad = wants_grad(x, weight, bias)
    return plan_loss(x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size, memory_budget,
                     weight_dtype=weight.dtype, allow_keep=grad, direct_dx=True,
                     allow_rows=grad and not return_lse and reduction != "none")


def softmax_rows_loss(x: Tensor, weight: Tensor, bias: Optional[Tensor], chunk_target: SoftmaxCsrTarget,
                      rows: SoftmaxRows, plan, *, reduction: str, label_smoothing: float, z_loss: float,
                      softcap: float) -> Tensor:
    """The scalar loss (``reduction`` ``"mean"`` or ``"sum"``) of a rows ``plan`` (:func:`plan_softmax`)
    through ``hugehead::linear_softmax_csr_rows``: ``x [N, D]`` in the compute dtype and the whole
    ``weight [V, D]`` on one device, ``chunk_target``/``rows`` from :func:`softmax_target` (or a
    :class:`PreparedTarget`'s)."""
    t = chunk_target.stats
    need_weight = weight.requires_grad or (bias is not None and bias.requires_grad)
    loss, _, _, _ = torch.ops.hugehead.linear_softmax_csr_rows(
        x, weight, bias, t.crow, t.col, t.row, t.val, chunk_target.grad_val, chunk_target.mass, rows.row_weight,
        rows.weight_sum, rows.valid, chunk_target.class_weight, float(label_smoothing), float(z_loss), float(softcap),
        reduction == "mean", x.requires_grad, need_weight, not torch.compiler.is_compiling(),
        plan.encode(),
    )
    return loss


def prepared_rows_loss(x: Tensor, weight: Tensor, bias: Optional[Tensor], prepared: PreparedTarget, *,
                       reduction: str, label_smoothing: float, z_loss: float, softcap: float,
                       chunk_size: Optional[int], memory_budget: Optional[int]) -> Optional[Tensor]:
    """The scalar loss of a softmax :class:`PreparedTarget` through the rows plan when :func:`plan_softmax`
    picks it (``x [N, D]`` in the compute dtype, the whole ``weight [V, D]`` on its device), else None (the
    caller runs its engine's chunk loop). ``ChunkedClassifier`` asks this for a head of one local shard."""
    if prepared.kind != "softmax":
        return None
    plan = plan_softmax(x, weight, bias, reduction=reduction, return_lse=False, chunk_size=chunk_size,
                        memory_budget=memory_budget)
    if not plan.grad_in_forward:
        return None
    return softmax_rows_loss(x, weight, bias, prepared.chunk, prepared.rows, plan, reduction=reduction,
                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)


def linear_softmax_csr(
    x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], *, class_weight: Optional[Tensor],
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, softcap: float,
    chunk_size: Optional[int], memory_budget: Optional[int], return_lse: bool,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`hugehead.linear_cross_entropy` for a sparse target or with ``class_weight`` (inputs and
    options already checked, ``x [N, D]`` in the compute dtype)."""
    n, v = x.shape[0], weight.shape[0]
    sparse.check_class_weight(class_weight, v, x.device)
    acc = ops.acc_dtype(x.dtype)
    chunk_target, rows = softmax_target(target, n, v, class_weight=class_weight, label_smoothing=label_smoothing,
                                        ignore_index=ignore_index, dtype=acc, device=x.device)
    plan = plan_softmax(x, weight, bias, reduction=reduction, return_lse=return_lse, chunk_size=chunk_size,
                        memory_budget=memory_budget)
    if plan.grad_in_forward:
        return softmax_rows_loss(x, weight, bias, chunk_target, rows, plan, reduction=reduction,
                                 label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    t = chunk_target.stats
    loss_rows, lse, _ = torch.ops.hugehead.linear_softmax_csr_forward(
        x, weight, bias, t.crow, t.col, t.row, t.val, chunk_target.grad_val, chunk_target.mass, rows.row_weight,
        rows.weight_sum, rows.valid, chunk_target.class_weight, float(label_smoothing), float(z_loss), float(softcap),
        plan.encode(),
    )
    loss = reduce_softmax(loss_rows, rows, reduction)
    return (loss, lse) if return_lse else loss

