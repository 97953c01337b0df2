"""Multi-label and weighted heads on one device: softmax cross-entropy against sparse probability targets,
class weights, and one-vs-all binary cross-entropy, each as a registered op pair over the one chunk loop
(:mod:`hugehead.loop`), so ``torch.compile`` sees one node.

- :func:`softmax_target` turns a sparse ``[N, V]`` target (or index targets with ``class_weight``) into the
  loop's :class:`~hugehead.targets.SoftmaxCsrTarget` plus what the per-row loss needs; :func:`softmax_row_losses`
  and :func:`reduce_softmax` are ``F.cross_entropy``'s formula and reductions for it (``hugehead.sparse``
  writes the algebra out).
- With a scalar reduction and gradients wanted, the softmax takes the plan the class-id loss would take
  (:func:`plan_softmax`); where that is the rows plan, ``hugehead::linear_softmax_csr_rows`` computes the
  loss and every gradient in the forward (three GEMMs, the loop's :func:`hugehead.loop.rows_steps` with
  :func:`softmax_row_losses` per row block) and the backward only scales them.
- :func:`linear_binary_cross_entropy`: ``F.binary_cross_entropy_with_logits(F.linear(x, weight, bias),
  target.to_dense(), pos_weight=...)``. Its gradient needs no global normalizer, so with a scalar
  reduction (and gradients wanted, outside ``torch.compile``) the forward produces it in the same pass as
  the loss (logits GEMM, one kernel, dX and dW GEMMs: 6·N·D·V FLOPs, no recompute) and the backward only
  scales it by the incoming gradient. ``dW`` then lives from the forward to the backward (the size of
  ``weight.grad``, which the backward would allocate anyway).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops, sparse
# The rows plan's op body and autograd are shared with the class-id op (functional.py imports this module
# only inside a function, so there is no import cycle).
from .functional import register_rows_autograd, rows_fake, rows_pass
from .plan import Plan
from .targets import BinaryCsrTarget, SoftmaxCsrTarget

__all__ = [
    "PreparedTarget",
    "prepare_target",
    "plan_softmax",
    "prepared_rows_loss",
    "softmax_target",
    "binary_target",
    "softmax_row_losses",
    "reduce_softmax",
    "reduce_binary",
    "linear_binary_cross_entropy",
]


# --------------------------------------------------------------------------------------------------
# Target preparation and per-row algebra (shared with the module's engines)
# --------------------------------------------------------------------------------------------------
class SoftmaxRows:
    """What the per-row softmax loss needs besides the statistics: ``row_weight [N]`` (``Σ_e w t`` of a
    sparse row; ``w_{y_i}`` of an index row, 0 when ignored), ``weight_sum`` (0-d: ``Σ_j w_j``, or V),
    ``valid [N]`` bool (index targets; None for sparse ones) and ``index`` (index targets)."""

    def __init__(self, row_weight: Tensor, weight_sum: Tensor, valid: Optional[Tensor], index: bool):
        self.row_weight, self.weight_sum, self.valid, self.index = row_weight, weight_sum, valid, index

    def rows(self, r0: int, r1: int) -> "SoftmaxRows":
        """Rows ``[r0, r1)`` (a row block of the rows plan)."""
        return SoftmaxRows(self.row_weight[r0:r1], self.weight_sum,
                           None if self.valid is None else self.valid[r0:r1], self.index)

    def mean_divisor(self, num_rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """0-d divisor of ``"mean"`` (:func:`reduce_softmax`): N for probability targets, ``Σ w_{y_i}`` of the
        rows not ignored for index targets; on the device, known before the loss (no host synchronization)."""
        if self.index:
            return self.row_weight.sum()
        return torch.full((), num_rows, dtype=dtype, device=device)


def softmax_target(
    target: Tensor,
    num_rows: int,
    num_classes: int,
    *,
    class_weight: Optional[Tensor],
    label_smoothing: float,
    ignore_index: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tuple[SoftmaxCsrTarget, SoftmaxRows]:
    """The loop's target for the softmax with a sparse probability target, or with index targets ``[N]``
    (already range-checked) and ``class_weight`` (checked by :func:`hugehead.sparse.check_class_weight`).

    ``dtype``: the accumulation dtype. Sparse targets are checked by :func:`hugehead.sparse.prepare`.
    """
    eps = float(label_smoothing)
    w = None if class_weight is None else class_weight.to(device=device, dtype=dtype)
    weight_sum = (w.sum() if w is not None else torch.tensor(float(num_classes), dtype=dtype, device=device))
    if sparse.is_sparse_target(target):
        csr = sparse.prepare(target, num_rows, num_classes, kind="probability", dtype=dtype, device=device)
        val = csr.val if w is None else csr.val * w[csr.col]
        stats, grad_val, valid, index = csr.with_values(val), val, None, False
    else:
        valid = target != ignore_index
        csr = sparse.index_target(target, valid, num_classes, dtype)
        # The forward dots ones (target_logit = c_y exactly); the weights enter the row loss and gradient.
        grad_val = csr.val if w is None else w[csr.col]
        stats, index = csr, True
    row_weight = csr.row_sum(grad_val)
    mass = (1.0 - eps) * row_weight + (eps / num_classes) * weight_sum
    chunk_target = SoftmaxCsrTarget(stats, grad_val.contiguous(), mass.contiguous(),
                                    w.contiguous() if (w is not None and eps > 0) else None)
    return chunk_target, SoftmaxRows(row_weight, weight_sum, valid, index)


def softmax_row_losses(lse: Tensor, target_dot: Tensor, logit_sum: Tensor, rows: SoftmaxRows, num_classes: int,
                       label_smoothing: float, z_loss: float) -> Tensor:
    """Per-row ``-Σ_j w_j t'_j log p_j (+ z_loss lse²)``, 0 on ignored index rows.

    Index rows: ``(1 - eps) w_y (lse - c_y) + eps / V (W lse - Σ_j w_j c_j)`` (the difference
    ``lse - c_y`` first, as for unweighted index targets); sparse rows:
    ``(1 - eps) (Σ w t · lse - Σ w t c) + eps / V (W lse - Σ_j w_j c_j)``.
    """
    eps = float(label_smoothing)
    if rows.index:
        loss = rows.row_weight * (lse - target_dot)
    else:
        loss = rows.row_weight * lse - target_dot
    if eps:
        loss = (1.0 - eps) * loss + (eps / num_classes) * (rows.weight_sum * lse - logit_sum)
    if z_loss:
        loss = loss + z_loss * lse.square()
    if rows.valid is not None:
        loss = torch.where(rows.valid, loss, torch.zeros_like(loss))
    return loss


def reduce_softmax(loss_rows: Tensor, rows: SoftmaxRows, reduction: str) -> Tensor:
    """``F.cross_entropy``'s reductions: ``"mean"`` over N rows for probability targets, over
    ``Σ w_{y_i}`` of the rows not ignored for index targets (NaN when that is 0, as PyTorch)."""
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    if rows.index:
        return total / rows.row_weight.sum()
    return total / loss_rows.shape[0]


def binary_target(target: Tensor, num_rows: int, num_classes: int, pos_weight: Optional[Tensor],
                  dtype: torch.dtype, device: torch.device) -> BinaryCsrTarget:
    """The loop's one-vs-all target: a sparse ``[N, V]`` target with values in ``[0, 1]`` and
    ``pos_weight`` (None, ``[V]`` or one element; checked by :func:`hugehead.sparse.check_pos_weight`)
    folded into a per-entry ``1 + (pos_weight_j - 1) t``."""
    csr = sparse.prepare(target, num_rows, num_classes, kind="binary", dtype=dtype, device=device)
    entry_weight = None
    if pos_weight is not None:
        pw = pos_weight.to(device=device, dtype=dtype).reshape(-1).expand(num_classes)
        entry_weight = (1.0 + (pw[csr.col] - 1.0) * csr.val).contiguous()
    return BinaryCsrTarget(csr, entry_weight)


def reduce_binary(loss_rows: Tensor, num_classes: int, reduction: str) -> Tensor:
    """``"mean"`` over all ``N·V`` logits (as ``F.binary_cross_entropy_with_logits``), ``"sum"``, or the
    per-row sums ``[N]`` for ``"none"`` (the elementwise ``[N, V]`` losses are what this avoids)."""
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    return total if reduction == "sum" else total / (loss_rows.shape[0] * num_classes)


class PreparedTarget:
    """A head's target for the multi-label / weighted losses, prepared once per step: the loop's chunk
    target, and the rules that turn the merged per-row statistics into losses and the incoming gradient
    into the rows' gradients (what :class:`hugehead.sharded_loss.ShardedLinearCrossEntropy` needs)."""

    def __init__(self, chunk, kind: str, rows: Optional[SoftmaxRows], num_classes: int):
        self.chunk, self.kind, self.rows, self.num_classes = chunk, kind, rows, num_classes

    @property
    def valid(self) -> Optional[Tensor]:
        return None if self.rows is None else self.rows.valid

    def row_losses(self, lse: Tensor, target_logit: Tensor, logit_sum: Tensor, label_smoothing: float,
                   z_loss: float) -> Tensor:
        if self.kind == "binary":
            return target_logit  # the one-vs-all row sums
        return softmax_row_losses(lse, target_logit, logit_sum, self.rows, self.num_classes, label_smoothing, z_loss)

    def grad_rows(self, grad_loss: Tensor, dtype: torch.dtype) -> Tensor:
        g = grad_loss.to(dtype)
        if self.valid is not None:
            g = torch.where(self.valid, g, torch.zeros((), dtype=dtype, device=g.device))
        return g.contiguous()

    def reduce(self, loss_rows: Tensor, reduction: str) -> Tensor:
        if self.kind == "binary":
            return reduce_binary(loss_rows, self.num_classes, reduction)
        return reduce_softmax(loss_rows, self.rows, reduction)


def prepare_target(target: Tensor, num_rows: int, num_classes: int, *, loss: str, class_weight: Optional[Tensor],
                   label_smoothing: float, ignore_index: int, dtype: torch.dtype, device: torch.device,
                   pos_weight: Optional[Tensor] = None) -> PreparedTarget:
    """:class:`PreparedTarget` of a head's loss ``"cross_entropy"`` (sparse probability target, or index
    targets with ``class_weight``) or ``"binary_cross_entropy"`` (sparse target in [0, 1], ``pos_weight``
    ``[V]`` or one element, folded into per-entry weights that travel with the entries: a shard or rank
    reads the weights of its columns only).

    Raises:
        TypeError, ValueError: as :func:`hugehead.sparse.prepare`, :func:`hugehead.sparse.check_class_weight`
            and :func:`hugehead.sparse.check_pos_weight`.
    """
    if loss == "binary_cross_entropy":
        if pos_weight is not None:
            sparse.check_pos_weight(pos_weight, num_classes, pos_weight.device if isinstance(pos_weight, Tensor)
                                    else device)
        return PreparedTarget(binary_target(target, num_rows, num_classes, pos_weight, dtype, device), "binary",
                              None, num_classes)
    sparse.check_class_weight(class_weight, num_classes, class_weight.device if class_weight is not None else device)
    chunk, rows = softmax_target(target, num_rows, num_classes, class_weight=class_weight,
                                 label_smoothing=label_smoothing, ignore_index=ignore_index, dtype=dtype, device=device)
    return PreparedTarget(chunk, "softmax", rows, num_classes)


# --------------------------------------------------------------------------------------------------
# Inputs and planning (as for index targets)
# --------------------------------------------------------------------------------------------------
def check_head_inputs(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[torch.dtype]:
    """Check ``x [N, D]``, ``weight [V, D]``, ``bias [V]``; returns the autocast compute dtype, or None
    when the inputs' dtype decides (as :func:`hugehead.linear_cross_entropy`).

    Raises:
        TypeError: not tensors, unsupported or mismatched dtypes. ValueError: shapes, devices.
    """
    from .options import check_inputs

    if isinstance(x, Tensor) and x.dim() != 2:
        raise ValueError(f"hugehead: x must be [N, D] with a sparse [N, V] target, got shape {tuple(x.shape)}")
    placeholder = torch.zeros(x.shape[0] if isinstance(x, Tensor) and x.dim() >= 1 else 0, dtype=torch.int64,
                              device=x.device if isinstance(x, Tensor) else None)
    return check_inputs(x, weight, placeholder, bias)


def _plan(x: Tensor, weight: Tensor, chunk_size: int, memory_budget: int, keep: bool):
    from .plan import plan_chunks

    return plan_chunks(
        x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size or None, memory_budget or None,
        weight_dtype=weight.dtype, allow_keep=keep, direct_dx=True,
    )


def _wants_grad(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    return (not torch.compiler.is_compiling()) and torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))


def _options(label_smoothing: float, z_loss: float, softcap: float):
    from .options import LossOptions

    return LossOptions(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap if softcap > 0 else None)


def _no_autocast(device: torch.device):
    # The loop issues its GEMMs with out= in the dtypes it chose; autocast must not recast inside it.
    return torch.autocast(device.type, enabled=False)


def _backward_through_loop(x, weight, bias, chunk_target, lse, grad_rows, kept, label_smoothing, z_loss, softcap,
                           chunk_size, memory_budget, need_x, need_weight, grad_lse):
    """``(dX, dW, db)`` of one device's loss, recomputing the logits chunk by chunk (or from ``kept``)."""
    from .loop import whole_head_backward
    from .plan import kept_plan
    from .plan import shard_oom_guard

    plan = kept_plan(kept) if kept.numel() > 0 else _plan(x, weight, chunk_size, memory_budget, False)
    with _no_autocast(x.device), shard_oom_guard(0, 0, weight.shape[0], x.device, plan, memory_budget or None):
        return whole_head_backward(x, weight, bias, chunk_target, lse, grad_rows,
                                   _options(label_smoothing, z_loss, softcap), plan, need_x, need_weight, kept, grad_lse)


def _forward_through_loop(x, weight, bias, chunk_target, softcap, chunk_size, memory_budget, keep_logits):
    """Merged row statistics ``(lse, target_logit, logit_sum)`` of one device and the kept logits."""
    from .loop import shard_forward_stats
    from .loop.chunks import merge_row_stats
    from .loop.sources import ResidentChunks
    from .plan import shard_oom_guard

    v = weight.shape[0]
    plan = _plan(x, weight, chunk_size, memory_budget, keep_logits)
    with _no_autocast(x.device), shard_oom_guard(0, 0, v, x.device, plan, memory_budget or None):
        stats, kept = shard_forward_stats(x, ResidentChunks(weight, bias, x.dtype), chunk_target, 0,
                                          _options(0.0, 0.0, softcap), plan)
        lse, target_logit, logit_sum = merge_row_stats([stats])
    return lse, target_logit, logit_sum, (x.new_empty(0) if kept is None else kept)


def _fake_backward(x, weight, bias, need_x, need_weight):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else x.new_empty(0),
        torch.empty_like(bias) if (need_weight and bias is not None) else x.new_empty(0),
    )


def _fake_forward(x, weight, chunk_size, memory_budget, keep_logits):
    from .plan import kept_shape

    acc = ops.acc_dtype(x.dtype)
    plan = _plan(x, weight, chunk_size, memory_budget, keep_logits)
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
    class_weight: Optional[Tensor], label_smoothing: float, z_loss: float, softcap: float, chunk_size: int,
    memory_budget: int, keep_logits: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-row losses ``[N]``, lse ``[N]`` (accumulation dtype) and the kept logits (or an empty tensor)
    of the softmax against a CSR target (:func:`softmax_target`; ``valid`` given: index targets)."""
    v = weight.shape[0]
    target = _softmax_chunk_target(crow, col, row, stats_val, grad_val, mass, class_weight, v)
    lse, target_dot, logit_sum, kept = _forward_through_loop(x, weight, bias, target, softcap, chunk_size,
                                                             memory_budget, keep_logits)
    rows = SoftmaxRows(row_weight, weight_sum, valid, valid is not None)
    return softmax_row_losses(lse, target_dot, logit_sum, rows, v, label_smoothing, z_loss), lse, kept


@_softmax_forward.register_fake
def _(x, weight, bias, crow, col, row, stats_val, grad_val, mass, row_weight, weight_sum, valid, class_weight,
      label_smoothing, z_loss, softcap, chunk_size, memory_budget, keep_logits):
    return _fake_forward(x, weight, chunk_size, memory_budget, keep_logits)


@torch.library.custom_op("hugehead::linear_softmax_csr_backward", mutates_args=("kept",))
def _softmax_backward(
    grad_loss: Tensor, grad_lse: Optional[Tensor], x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor,
    col: Tensor, row: Tensor, stats_val: Tensor, grad_val: Tensor, mass: Tensor, valid: Optional[Tensor],
    class_weight: Optional[Tensor], lse: Tensor, kept: Tensor, label_smoothing: float, z_loss: float,
    softcap: float, chunk_size: int, memory_budget: int, need_x: bool, need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dX, dW, db)`` of :func:`_softmax_forward` (empty where not asked for); non-empty ``kept``
    logits are overwritten by their gradient."""
    acc = ops.acc_dtype(x.dtype)
    grad_rows = grad_loss.to(acc)
    if valid is not None:
        grad_rows = torch.where(valid, grad_rows, torch.zeros((), dtype=acc, device=x.device))
    target = _softmax_chunk_target(crow, col, row, stats_val, grad_val, mass, class_weight, weight.shape[0])
    return _backward_through_loop(x, weight, bias, target, lse, grad_rows.contiguous(), kept, label_smoothing,
                                  z_loss, softcap, chunk_size, memory_budget, need_x, need_weight,
                                  None if grad_lse is None else grad_lse.to(acc).contiguous())


@_softmax_backward.register_fake
def _(grad_loss, grad_lse, x, weight, bias, crow, col, row, stats_val, grad_val, mass, valid, class_weight, lse,
      kept, label_smoothing, z_loss, softcap, chunk_size, memory_budget, need_x, need_weight):
    return _fake_backward(x, weight, bias, need_x, need_weight)


def _softmax_setup_context(ctx, inputs, output):
    (x, weight, bias, crow, col, row, stats_val, grad_val, mass, row_weight, weight_sum, valid, class_weight,
     label_smoothing, z_loss, softcap, chunk_size, memory_budget, keep_logits) = inputs
    _, lse, kept = output
    ctx.save_for_backward(x, weight, bias, crow, col, row, stats_val, grad_val, mass, valid, class_weight, lse)
    ctx.options = (label_smoothing, z_loss, softcap, chunk_size, memory_budget)
    ctx.mark_non_differentiable(kept)
    # As for index targets: the kept logits ride on ctx, not saved, and are used once.
    ctx.kept = kept if keep_logits else None
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
            grad_b if (bias is not None and ctx.needs_input_grad[2]) else None) + (None,) * 16


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
    loss with gradients when it picks it, ``HUGEHEAD_ROWS=0`` turning it off; else kept or recomputed
    logits)."""
    from .plan import plan_loss

    wants_grad = _wants_grad(x, weight, bias)
    return plan_loss(x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size, memory_budget,
                     weight_dtype=weight.dtype, allow_keep=wants_grad, direct_dx=True,
                     allow_rows=wants_grad and not return_lse and reduction != "none")


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
    chunk_size: Optional[int], memory_budget: Optional[int], return_lse: bool, compute: Optional[torch.dtype],
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`hugehead.linear_cross_entropy` for a sparse target or with ``class_weight`` (inputs and
    options already checked; ``compute``: the autocast dtype or None)."""
    n, v = x.shape[0], weight.shape[0]
    sparse.check_class_weight(class_weight, v, x.device)
    if compute is not None and x.dtype != compute:
        x = x.to(compute)
    acc = ops.acc_dtype(x.dtype)
    chunk_target, rows = softmax_target(target, n, v, class_weight=class_weight, label_smoothing=label_smoothing,
                                        ignore_index=ignore_index, dtype=acc, device=x.device)
    plan = plan_softmax(x, weight, bias, reduction=reduction, return_lse=return_lse, chunk_size=chunk_size,
                        memory_budget=memory_budget)
    if plan.grad_in_forward:
        return softmax_rows_loss(x, weight, bias, chunk_target, rows, plan, reduction=reduction,
                                 label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    keep = _wants_grad(x, weight, bias) and plan.keep_logits
    t = chunk_target.stats
    loss_rows, lse, _ = torch.ops.hugehead.linear_softmax_csr_forward(
        x, weight, bias, t.crow, t.col, t.row, t.val, chunk_target.grad_val, chunk_target.mass, rows.row_weight,
        rows.weight_sum, rows.valid, chunk_target.class_weight, float(label_smoothing), float(z_loss), float(softcap),
        int(chunk_size or 0), int(memory_budget or 0), keep,
    )
    loss = reduce_softmax(loss_rows, rows, reduction)
    return (loss, lse) if return_lse else loss


# --------------------------------------------------------------------------------------------------
# One-vs-all binary cross-entropy: the registered ops
# --------------------------------------------------------------------------------------------------
def _binary_chunk_target(crow, col, row, val, entry_weight, num_classes):
    return BinaryCsrTarget(sparse.CsrTarget(crow, col, val, row, num_classes), entry_weight)


@torch.library.custom_op("hugehead::linear_bce_csr_forward", mutates_args=())
def _bce_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor, row: Tensor, val: Tensor,
    entry_weight: Optional[Tensor], chunk_size: int, memory_budget: int, keep_logits: bool,
) -> Tuple[Tensor, Tensor]:
    """Per-row sums ``[N]`` (accumulation dtype) of the one-vs-all losses, and the kept logits."""
    target = _binary_chunk_target(crow, col, row, val, entry_weight, weight.shape[0])
    _, row_loss, _, kept = _forward_through_loop(x, weight, bias, target, 0.0, chunk_size, memory_budget,
                                                 keep_logits)
    return row_loss, kept


@_bce_forward.register_fake
def _(x, weight, bias, crow, col, row, val, entry_weight, chunk_size, memory_budget, keep_logits):
    loss, _, kept = _fake_forward(x, weight, chunk_size, memory_budget, keep_logits)
    return loss, kept


@torch.library.custom_op("hugehead::linear_bce_csr_backward", mutates_args=("kept",))
def _bce_backward(
    grad_loss: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor, row: Tensor,
    val: Tensor, entry_weight: Optional[Tensor], kept: Tensor, chunk_size: int, memory_budget: int, need_x: bool,
    need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dX, dW, db)`` of :func:`_bce_forward`, recomputing the logits (or from ``kept``)."""
    acc = ops.acc_dtype(x.dtype)
    target = _binary_chunk_target(crow, col, row, val, entry_weight, weight.shape[0])
    no_lse = torch.zeros(x.shape[0], dtype=acc, device=x.device)
    return _backward_through_loop(x, weight, bias, target, no_lse, grad_loss.to(acc).contiguous(), kept, 0.0, 0.0,
                                  0.0, chunk_size, memory_budget, need_x, need_weight, None)


@_bce_backward.register_fake
def _(grad_loss, x, weight, bias, crow, col, row, val, entry_weight, kept, chunk_size, memory_budget, need_x,
      need_weight):
    return _fake_backward(x, weight, bias, need_x, need_weight)


def _bce_setup_context(ctx, inputs, output):
    x, weight, bias, crow, col, row, val, entry_weight, chunk_size, memory_budget, keep_logits = inputs
    _, kept = output
    ctx.save_for_backward(x, weight, bias, crow, col, row, val, entry_weight)
    ctx.options = (chunk_size, memory_budget)
    ctx.mark_non_differentiable(kept)
    ctx.kept = kept if keep_logits else None
    ctx.set_materialize_grads(False)


def _bce_backward_autograd(ctx, grad_loss, grad_kept):
    x, weight, bias, crow, col, row, val, entry_weight = ctx.saved_tensors
    kept, ctx.kept = ctx.kept, None
    if kept is None:
        kept = x.new_empty(0)
    need_x = ctx.needs_input_grad[0]
    need_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
    grad_x, grad_w, grad_b = torch.ops.hugehead.linear_bce_csr_backward(
        grad_loss, x, weight, bias, crow, col, row, val, entry_weight, kept, *ctx.options, need_x, need_weight)
    return (grad_x if need_x else None, grad_w if ctx.needs_input_grad[1] else None,
            grad_b if (bias is not None and ctx.needs_input_grad[2]) else None) + (None,) * 8


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
    entry_weight: Optional[Tensor], scale: float, chunk_size: int, memory_budget: int, need_x: bool,
    need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``scale * Σ`` of the one-vs-all losses (0-d, accumulation dtype) and its gradients ``(dX [N, D] in the
    accumulation dtype, dW, db)`` for an incoming gradient of 1, in one streaming pass."""
    from .loop import shard_backward
    from .loop.sources import ResidentChunks
    from .plan import shard_oom_guard

    acc = ops.acc_dtype(x.dtype)
    n, v = x.shape[0], weight.shape[0]
    target = _binary_chunk_target(crow, col, row, val, entry_weight, v)
    row_loss = torch.zeros(n, dtype=acc, device=x.device)
    plan = _plan(x, weight, chunk_size, memory_budget, False)
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
    with _no_autocast(x.device), shard_oom_guard(0, 0, v, x.device, plan, memory_budget or None):
        grad_w, grad_b = shard_backward(
            x, ResidentChunks(weight, bias, x.dtype), _LossAndGrad(target, row_loss), 0, v,
            torch.zeros(n, dtype=acc, device=x.device), torch.full((n,), scale, dtype=acc, device=x.device),
            _options(0.0, 0.0, 0.0), plan, grad_x, need_weight,
        )
    return (
        row_loss.sum() * scale,
        grad_x if grad_x is not None else x.new_empty(0, dtype=acc),
        grad_w if grad_w is not None else x.new_empty(0),
        grad_b if grad_b is not None else x.new_empty(0),
    )


@_bce_fused.register_fake
def _(x, weight, bias, crow, col, row, val, entry_weight, scale, chunk_size, memory_budget, need_x, need_weight):
    acc = ops.acc_dtype(x.dtype)
    grad_x, grad_w, grad_b = _fake_backward(x, weight, bias, need_x, need_weight)
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
        return (None,) * 13
    # In place through ops.scale_ (one vectorized pass on CUDA): the product in float32 with the whole
    # grad_loss, rounded once to each gradient's dtype.
    out_x = ops.scale_(grad_x, grad_loss).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    out_w = ops.scale_(grad_w, grad_loss) if ctx.needs_input_grad[1] else None
    out_b = ops.scale_(grad_b, grad_loss) if (ctx.has_bias and ctx.needs_input_grad[2]) else None
    return (out_x, out_w, out_b) + (None,) * 10


_bce_fused.register_autograd(_bce_fused_backward, setup_context=_bce_fused_setup_context)


# Under torch.compile this runs eagerly, as one graph break (see functional._linear_cross_entropy_weighted).
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
    from .options import LossOptions, check_chunk_size, check_memory_budget

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
    sizes = (int(chunk_size or 0), int(memory_budget or 0))
    if reduction != "none" and _wants_grad(x, weight, bias):
        # The forward produces the gradients: three GEMMs per chunk in one pass, a chunk's workspace. Keeping
        # logits for the backward costs the same three GEMMs and more memory, and keeping only some chunks
        # (what a plan does when not all fit) recomputes the rest: 3.3-4 GEMMs (measured on an H200 at xc1M:
        # 88.6 ms with a partial keep against 85.3 ms for the single-label step).
        scale = 1.0 / (n * v) if (reduction == "mean" and n) else 1.0
        need_weight = weight.requires_grad or (bias is not None and bias.requires_grad)
        loss, _, _, _ = torch.ops.hugehead.linear_bce_csr_fused(*args, scale, *sizes, x.requires_grad,
                                                                need_weight)
        return loss * float("nan") if (reduction == "mean" and not n) else loss
    row_loss, _ = torch.ops.hugehead.linear_bce_csr_forward(*args, *sizes, False)
    return reduce_binary(row_loss, v, reduction)
