"""The targets of the multi-label and weighted losses, prepared once per step, and their per-row algebra:
a sparse ``[N, V]`` probability target (or class ids with class weights) as the loop's
:class:`~hugehead.targets.SoftmaxCsrTarget`, a one-vs-all target as its
:class:`~hugehead.targets.BinaryCsrTarget`, ``F.cross_entropy``'s and
``F.binary_cross_entropy_with_logits``' per-row losses and reductions for them (``hugehead.sparse`` writes
the algebra out), and :class:`PreparedTarget`, which carries all of it through a head's engines."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import sparse
from .targets import BinaryCsrTarget, SoftmaxCsrTarget

__all__ = [
    "SoftmaxRows",
    "softmax_target",
    "softmax_row_losses",
    "reduce_softmax",
    "binary_target",
    "reduce_binary",
    "PreparedTarget",
    "prepare_target",
]


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

