"""Sparse ``[N, V]`` targets: checks, conversion to the kernels' CSR form (once per step), per-shard column
slices, and the per-row algebra of the two losses that read them (DESIGN.md, "Sparse targets").

A user's target is a ``torch.sparse_csr`` or ``torch.sparse_coo`` tensor of shape ``[N, V]`` with floating
values (absent entries are 0), or one already converted by :func:`csr_target` (a :class:`CsrTarget`, which
holds only dense tensors: ``torch.compile`` can carry it into a compiled model, where it does not take
sparse tensors). :func:`prepare` checks it before any kernel runs and returns a :class:`CsrTarget`: row pointers, columns sorted ascending and distinct within each row (COO is coalesced,
duplicates summed as ``to_dense`` would), values in the accumulation dtype, on the compute device. The
kernels find a row's entries in a chunk by binary search on those columns; a shard takes only its columns
(:meth:`CsrTarget.columns`).

Softmax with probability targets (``F.cross_entropy`` with a dense probability target, weight ``w``,
label smoothing ``eps``): the smoothed target is ``t' = (1 - eps) t + eps / V`` and the row loss
``-Σ_j w_j t'_j log p_j = M_i lse_i - (1 - eps) Σ_e w t c - eps / V Σ_j w_j c_j`` with the row's mass
``M_i = (1 - eps) Σ_e w t + eps / V Σ_j w_j``; ``"mean"`` divides by N. Index targets with class weights
are the same algebra with one entry ``(y_i, 1)`` per row, ``"mean"`` dividing by ``Σ w_{y_i}`` over the
rows not ignored (:func:`index_target`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "CsrTarget",
    "csr_target",
    "is_sparse_target",
    "prepare",
    "index_target",
    "check_class_weight",
    "check_pos_weight",
]

_SPARSE_LAYOUTS = (torch.sparse_csr, torch.sparse_coo)


def is_sparse_target(target) -> bool:
    """True for a ``torch.sparse_csr`` / ``torch.sparse_coo`` tensor or a :class:`CsrTarget` (the
    multi-label target forms)."""
    return isinstance(target, CsrTarget) or (isinstance(target, Tensor) and target.layout in _SPARSE_LAYOUTS)


@dataclass(frozen=True)
class CsrTarget:
    """A sparse ``[N, V]`` target as the kernels read it, all on one device.

    Attributes:
        crow: ``[N + 1]`` int64 offsets of each row's entries in ``col`` / ``val``.
        col: ``[nnz]`` int64 global class ids, sorted ascending and distinct within each row.
        val: ``[nnz]`` target values in the accumulation dtype.
        row: ``[nnz]`` int64 row of each entry (for per-row sums).
        num_classes: ``V``.
    """

    crow: Tensor
    col: Tensor
    val: Tensor
    row: Tensor
    num_classes: int

    @property
    def num_rows(self) -> int:
        return self.crow.shape[0] - 1

    def row_sum(self, values: Tensor) -> Tensor:
        """``[N]`` sums of per-entry ``values [nnz]`` over each row."""
        out = torch.zeros(self.num_rows, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.row, values)

    def with_values(self, val: Tensor) -> "CsrTarget":
        """The same pattern with other per-entry values ``[nnz]``."""
        return CsrTarget(self.crow, self.col, val, self.row, self.num_classes)

    @property
    def device(self) -> torch.device:
        return self.crow.device

    def to(self, device: torch.device, non_blocking: bool = False) -> "CsrTarget":
        """A copy on ``device``."""
        if self.crow.device == device:
            return self
        return CsrTarget(*(t.to(device, non_blocking=non_blocking) for t in (self.crow, self.col, self.val, self.row)),
                         self.num_classes)

    def columns(self, start: int, stop: int) -> "CsrTarget":
        """The entries with class ids in ``[start, stop)`` (a shard's classes), ids kept global: what a
        shard or rank reads of the target. No host synchronization."""
        keep = (self.col >= start) & (self.col < stop)
        counts = torch.zeros(self.num_rows, dtype=torch.int64, device=self.col.device)
        counts.index_add_(0, self.row, keep.to(torch.int64))
        crow = torch.zeros(self.num_rows + 1, dtype=torch.int64, device=self.col.device)
        torch.cumsum(counts, 0, out=crow[1:])
        index = keep.nonzero().squeeze(1)
        return CsrTarget(crow, self.col[index], self.val[index], self.row[index], self.num_classes)

    def rows(self, r0: int, r1: int) -> "CsrTarget":
        """Rows ``[r0, r1)`` for a kernel: ``crow`` sliced (offsets stay absolute, so ``col`` / ``val``
        are shared, not copied). ``row`` is not rebased: use the block only to call kernels."""
        return CsrTarget(self.crow[r0:r1 + 1], self.col, self.val, self.row, self.num_classes)


def prepare(
    target: Tensor,
    num_rows: int,
    num_classes: int,
    *,
    kind: str,
    dtype: torch.dtype,
    device: torch.device,
) -> CsrTarget:
    """Check a sparse ``[N, V]`` target and convert it to the kernels' CSR form.

    Args:
        target: ``torch.sparse_csr`` or ``torch.sparse_coo`` tensor ``[N, V]`` with floating-point values
            (absent entries are 0); duplicate COO entries are summed, as ``to_dense`` does. Or a
            :class:`CsrTarget` of ``[N, V]`` (from :func:`csr_target`), checked again the same way.
        kind: ``"probability"`` (softmax: values must be >= 0), ``"binary"`` (one-vs-all: values in
            ``[0, 1]``) or None (no rule on the values: :func:`csr_target`).
        dtype: accumulation dtype the values are converted to; device: where the kernels run.
    Returns:
        A :class:`CsrTarget` on ``device``.
    Raises:
        TypeError: not a sparse CSR/COO tensor, or non-floating values.
        ValueError: shape not ``[N, V]``, a class id outside ``[0, V)``, a negative value (probability
            targets) or one outside ``[0, 1]`` (binary targets); a :class:`CsrTarget` whose row pointers
            do not delimit its entries. Checked before any kernel (one small device-to-host read).
    """
    if isinstance(target, CsrTarget):
        return _prepare_converted(target, num_rows, num_classes, kind, dtype, device)
    if not is_sparse_target(target):
        raise TypeError(
            f"hugehead: a multi-label target must be a torch.sparse_csr or torch.sparse_coo tensor, got "
            f"{getattr(target, 'layout', type(target))}"
        )
    if target.dim() != 2 or tuple(target.shape) != (num_rows, num_classes):
        raise ValueError(
            f"hugehead: sparse target must be [N, V]=[{num_rows}, {num_classes}], got shape {tuple(target.shape)}"
        )
    if not target.dtype.is_floating_point:
        raise TypeError(f"hugehead: sparse target values must be floating point, got {target.dtype}")
    if target.layout == torch.sparse_coo:
        if target.sparse_dim() != 2:
            raise ValueError("hugehead: a COO target must have 2 sparse dimensions (no dense dimensions)")
        indices = target._indices()
        row, col, val = indices[0], indices[1], target._values()
    else:
        crow, col, val = target.crow_indices(), target.col_indices(), target.values()
        if val.dim() != 1:
            raise ValueError("hugehead: a CSR target must have scalar values (no dense dimensions)")
        # torch builds sparse CSR tensors without checking their invariants: the pointers are checked here.
        crow = crow.to(torch.int64)
        row, bad_crow = _rows_of(crow, num_rows, col.shape[0], "a CSR target's crow_indices")
        return _to_csr(row, col, val, num_rows, num_classes, kind, dtype, device,
                       pointers=(crow, bad_crow, "a CSR target's crow_indices"))
    return _to_csr(row, col, val, num_rows, num_classes, kind, dtype, device)


def _rows_of(crow: Tensor, num_rows: int, nnz: int, what: str) -> Tuple[Tensor, Tensor]:
    """``(row [nnz], bad)``: each entry's row from int64 row pointers ``crow [N + 1]``, and a 0-d flag of
    pointers that do not delimit ``nnz`` entries. No host read (the flag is read with the entry checks);
    the rows of bad pointers stay in range and are never used."""
    if crow.dim() != 1 or crow.shape[0] != num_rows + 1:
        raise ValueError(f"hugehead: {what} must be [N + 1]=[{num_rows + 1}], got {tuple(crow.shape)}")
    bad = (crow[0] != 0) | (crow[-1] != nnz) | (crow[1:] < crow[:-1]).any()
    row = torch.searchsorted(crow[1:], torch.arange(nnz, device=crow.device), right=True)
    return row, bad


def _crow_problem(crow: Tensor, nnz: int, what: str) -> str:
    """What is wrong with row pointers ``crow`` that :func:`_rows_of` flagged (for the error)."""
    rule = f"{what} must be [N + 1] non-decreasing offsets from 0 to its {nnz} entries"
    first, last = int(crow[0]), int(crow[-1])
    if first != 0:
        return f"{rule}; it starts at {first}"
    if last != nnz:
        return f"{rule}; it ends at {last}"
    i = int((crow[1:] < crow[:-1]).nonzero()[0, 0])
    return f"{rule}; it falls from {int(crow[i])} to {int(crow[i + 1])} after row {i}"


def _to_csr(row: Tensor, col: Tensor, val: Tensor, num_rows: int, num_classes: int, kind: Optional[str],
            dtype: torch.dtype, device: torch.device,
            pointers: Optional[Tuple[Tensor, Tensor, str]] = None) -> CsrTarget:
    """Entries ``(row, col, val)`` checked, sorted by ``(row, col)`` with duplicates summed, as CSR.
    ``pointers``: a CSR input's ``(crow, bad flag from _rows_of, its name for errors)``, the flag read
    with the other checks."""
    row, col = row.to(device=device, dtype=torch.int64), col.to(device=device, dtype=torch.int64)
    val = val.to(device=device, dtype=dtype)
    key = row * num_classes + col
    # One host read for the questions: any entry out of range, any bad value, keys out of order (and a
    # converted target's row pointers).
    bad_index = (col < 0) | (col >= num_classes) | (row < 0) | (row >= num_rows)
    checks = [bad_index.any(), _bad_values(val, kind).any(),
              (key[1:] <= key[:-1]).any() if key.numel() > 1 else bad_index.new_zeros(())]
    if pointers is not None:
        checks.append(pointers[1].to(device))
    flags = torch.stack(checks).tolist()
    if pointers is not None and flags[3]:  # before the entries: their rows come from the pointers
        raise ValueError(f"hugehead: {_crow_problem(pointers[0], col.shape[0], pointers[2])}")
    if flags[0] or flags[1]:
        _check_entries(row, col, val, num_rows, num_classes, kind)
    # Columns sorted within rows, duplicates merged: one sort of the (row, col) keys when out of order.
    if flags[2]:
        key, order = torch.sort(key)
        val = val[order]
        key, inverse = torch.unique_consecutive(key, return_inverse=True)
        if key.numel() != val.numel():  # duplicates: summed, as to_dense does
            val = torch.zeros(key.numel(), dtype=val.dtype, device=device).index_add_(0, inverse, val)
        row, col = key // num_classes, key % num_classes
        if kind == "binary" and key.numel() != inverse.numel():  # a sum of duplicates may pass 1
            _check_range(row, col, val, kind)
    # index_add, not bincount: no host read of the largest row id.
    counts = torch.zeros(num_rows, dtype=torch.int64, device=device).index_add_(0, row, torch.ones_like(row))
    crow = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=crow[1:])
    return CsrTarget(crow, col.contiguous(), val.contiguous(), row.contiguous(), num_classes)


def _check_entries(row: Tensor, col: Tensor, val: Tensor, num_rows: int, num_classes: int, kind: str) -> None:
    bad = (col < 0) | (col >= num_classes) | (row < 0) | (row >= num_rows)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"hugehead: sparse target entry ({int(row[first])}, {int(col[first])}) is out of range for "
            f"[N, V]=[{num_rows}, {num_classes}] (class ids must be in 0..{num_classes - 1})"
        )
    _check_range(row, col, val, kind)


def _bad_values(val: Tensor, kind: Optional[str]) -> Tensor:
    if kind is None:
        return torch.zeros(val.shape, dtype=torch.bool, device=val.device)
    if kind == "probability":
        return ~torch.isfinite(val) | (val < 0)
    if kind == "binary":
        return ~torch.isfinite(val) | (val < 0) | (val > 1)
    raise ValueError(f"hugehead: unknown sparse target kind {kind!r}")


def _check_range(row: Tensor, col: Tensor, val: Tensor, kind: str) -> None:
    """Raises for the first entry whose value ``kind`` rejects, naming its ``(row, class)`` and value."""
    bad = _bad_values(val, kind)
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0, 0])
    v, where = float(val[first]), f"(row {int(row[first])}, class {int(col[first])})"
    if math.isnan(v):
        raise ValueError(f"hugehead: sparse target value at {where} is NaN; target values must be finite")
    if math.isinf(v):
        raise ValueError(f"hugehead: sparse target value at {where} is {v}; target values must be finite")
    what = ("probability targets must be >= 0" if kind == "probability"
            else "binary cross-entropy targets must be in [0, 1]")
    raise ValueError(f"hugehead: {what}; got {v} at {where}")


def _prepare_converted(target: CsrTarget, num_rows: int, num_classes: int, kind: Optional[str], dtype: torch.dtype,
                       device: torch.device) -> CsrTarget:
    """:func:`prepare` of a :class:`CsrTarget`: its entries checked again (it may have been built by hand)."""
    if (target.num_rows, target.num_classes) != (num_rows, num_classes):
        raise ValueError(f"hugehead: sparse target must be [N, V]=[{num_rows}, {num_classes}], got a CsrTarget of "
                         f"[{target.num_rows}, {target.num_classes}]")
    crow, col, val = target.crow, target.col, target.val
    for name, t in (("crow", crow), ("col", col)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"hugehead: a CsrTarget's {name} must be a 1-D int64 tensor, got {t.dtype} "
                            f"{tuple(t.shape)}")
    if not val.dtype.is_floating_point:
        raise TypeError(f"hugehead: sparse target values must be floating point, got {val.dtype}")
    if val.shape != col.shape:
        raise ValueError(f"hugehead: a CsrTarget's val {tuple(val.shape)} and col {tuple(col.shape)} differ in shape")
    crow = crow.to(device=col.device, dtype=torch.int64)
    row, bad_crow = _rows_of(crow, num_rows, col.shape[0], "a CsrTarget's crow")
    return _to_csr(row, col, val, num_rows, num_classes, kind, dtype, device,
                   pointers=(crow, bad_crow, "a CsrTarget's crow"))


def csr_target(target: Tensor, *, device: Optional[Union[str, torch.device]] = None) -> CsrTarget:
    """A sparse ``[N, V]`` target converted once, ahead of the step: what the losses take in its place.

    Use it to carry a multi-label target into ``torch.compile``: dynamo does not take sparse tensors, so a
    compiled model called with one runs eagerly, whole; called with the :class:`CsrTarget` (dense tensors
    only) it compiles everything but the loss's target preparation, one graph break
    (``head(x, csr_target(t))`` with ``t`` from the data loader). The losses check it again (one host read).

    Args:
        target: ``torch.sparse_csr`` or ``torch.sparse_coo`` ``[N, V]`` with floating values (COO
            duplicates summed, as ``to_dense`` does).
        device: where the result lives (default: the target's device), e.g. the device of ``x``.
    Returns:
        A :class:`CsrTarget`, values in the target's dtype, columns sorted within rows.
    Raises:
        TypeError: not a sparse CSR/COO tensor, non-floating values. ValueError: not 2-D, class ids
            outside ``[0, V)``.
    """
    if not (isinstance(target, Tensor) and target.layout in _SPARSE_LAYOUTS):
        raise TypeError(f"hugehead: csr_target takes a torch.sparse_csr or torch.sparse_coo tensor, got "
                        f"{getattr(target, 'layout', type(target))}")
    if target.dim() != 2:
        raise ValueError(f"hugehead: a sparse target must be [N, V], got shape {tuple(target.shape)}")
    n, v = target.shape
    return prepare(target, n, v, kind=None, dtype=target.dtype,
                   device=target.device if device is None else torch.device(device))


def index_target(target: Tensor, valid: Tensor, num_classes: int, dtype: torch.dtype) -> CsrTarget:
    """Index targets ``[N]`` (already range-checked) as CSR: one entry ``(y_i, 1)`` per row not ignored,
    none for ignored rows. Lets class weights and label smoothing share the sparse kernels."""
    n = target.shape[0]
    rows = valid.nonzero().squeeze(1)
    crow = torch.zeros(n + 1, dtype=torch.int64, device=target.device)
    torch.cumsum(valid.to(torch.int64), 0, out=crow[1:])
    col = target[rows].to(torch.int64)
    return CsrTarget(crow, col, torch.ones(col.shape[0], dtype=dtype, device=target.device), rows, num_classes)


def check_class_weight(class_weight: Optional[Tensor], num_classes: int, device: torch.device) -> None:
    """``class_weight`` must be None or a floating ``[V]`` tensor on ``device`` (as ``F.cross_entropy``'s
    ``weight``).

    Raises:
        TypeError: not a tensor, or not floating point. ValueError: wrong shape or device.
    """
    _check_class_vector(class_weight, "class_weight", num_classes, device)


def check_pos_weight(pos_weight: Optional[Tensor], num_classes: int, device: torch.device) -> None:
    """``pos_weight`` must be None or a floating ``[V]`` (or single-element) tensor on ``device``.

    Raises:
        TypeError: not a tensor, or not floating point. ValueError: wrong shape or device.
    """
    if pos_weight is not None and isinstance(pos_weight, Tensor) and pos_weight.numel() == 1 and pos_weight.dim() <= 1:
        _check_class_vector(pos_weight.reshape(1).expand(num_classes), "pos_weight", num_classes, device)
        return
    _check_class_vector(pos_weight, "pos_weight", num_classes, device)


def _check_class_vector(t: Optional[Tensor], name: str, num_classes: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"hugehead: {name} must be a tensor or None, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"hugehead: {name} must be floating point, got {t.dtype}")
    if t.layout != torch.strided or t.dim() != 1 or t.shape[0] != num_classes:
        raise ValueError(f"hugehead: {name} must be a dense [V]=[{num_classes}] tensor, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"hugehead: {name} is on {t.device} but x is on {device}")
