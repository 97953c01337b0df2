"""What the chunk loop's kernels read of the target, per loss kind, and each kind's per-row loss.

The loop (:mod:`hugehead.loop`) hands every logits chunk to a *chunk target*: :class:`IndexTarget` (class
ids, ``chunk_stats_`` / ``chunk_grad_``), :class:`EntropyTarget` (class ids, for the log-probability with the
entropy: ``entropy_chunk_stats_`` / ``entropy_chunk_grad_``), :class:`SoftmaxCsrTarget` (a sparse probability
target, or index targets with class weights: ``sparse_chunk_stats_`` / ``sparse_chunk_grad_``) or
:class:`BinaryCsrTarget` (one-vs-all BCE: ``bce_chunk_``). Each fills the same per-row statistics
(:class:`hugehead.loop.chunks.RowStats`: max, sumexp, target_logit, logit_sum), so shards and ranks merge them
the same way whatever the loss (the entropy's slot by its own rule, :func:`hugehead.loop.chunks.merge_row_stats`):
``target_logit`` holds the row's target-weighted logit sum for the
softmax kinds and the row's summed one-vs-all loss for BCE (max/sumexp stay ``-inf``/0 there); each is 0
for classes outside the shard, so shards add it.

A chunk target also knows how to move to another device (:meth:`to`), to keep only a shard's columns
(:meth:`columns`: a shard reads only its entries) and to take a row block (:meth:`rows`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops
from .ops import target_chunks
from .sparse import CsrTarget

__all__ = ["IndexTarget", "EntropyTarget", "SoftmaxCsrTarget", "BinaryCsrTarget", "ChunkTarget", "as_chunk_target",
           "gather_csr", "gather_chunk_target", "moved", "TargetBase"]


def _to(t: Optional[Tensor], device: torch.device, non_blocking: bool = False) -> Optional[Tensor]:
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=non_blocking)


def moved(target, device: torch.device, non_blocking: bool = False):
    """A chunk target (a frozen dataclass with a ``device``) on ``device``: every tensor field moved there, and
    every field with a ``to(device, non_blocking)`` of its own (a CSR target, a teacher's logits); itself when it is
    there already."""
    if target.device == device:
        return target
    changes = {}
    for f in fields(target):
        value = getattr(target, f.name)
        if isinstance(value, Tensor):
            changes[f.name] = _to(value, device, non_blocking)
        elif hasattr(value, "to"):
            changes[f.name] = value.to(device, non_blocking)
    return replace(target, **changes)


class TargetBase:
    """What the chunk targets share: :meth:`to` moves every tensor field (:func:`moved`); :meth:`columns` keeps the
    whole target (one holding per-class entries cuts them instead)."""

    def to(self, device: torch.device, non_blocking: bool = False):
        return moved(self, device, non_blocking)

    def columns(self, start: int, stop: int):
        return self


@dataclass(frozen=True)
class IndexTarget(TargetBase):
    """Class ids ``[N]`` int64 (ignored rows hold anything outside ``[0, V)``)."""

    target: Tensor

    @property
    def device(self) -> torch.device:
        return self.target.device

    def rows(self, r0: int, r1: int) -> "IndexTarget":
        return IndexTarget(self.target[r0:r1])

    def stats_(self, z: Tensor, class_start: int, softcap: float, stats) -> None:
        ops.chunk_stats_(z, self.target, class_start, softcap, *stats)

    def grad_(self, z: Tensor, class_start: int, num_classes: int, lse: Tensor, grad_rows: Tensor,
              label_smoothing: float, z_loss: float, softcap: float, grad_lse: Optional[Tensor]) -> None:
        ops.chunk_grad_(z, self.target, class_start, num_classes, lse, grad_rows, label_smoothing, z_loss, softcap,
                        grad_lse)


@dataclass(frozen=True)
class EntropyTarget(TargetBase):
    """Class ids ``[N]`` for the log-probability with the entropy of each row's softmax (:mod:`hugehead.logprob`):
    ``entropy_chunk_stats_`` fills ``logit_sum``'s slot with the running shifted sum the entropy needs (see
    :func:`hugehead.loop.chunks.merge_row_stats`), ``entropy_chunk_grad_`` adds the entropy's gradient.

    Attributes:
        grad_entropy, entropy: ``[N]`` (the backward only): ``dL/dH`` (0 on ignored rows) and ``H`` per row.
    """

    target: Tensor
    grad_entropy: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    GRAD_TERMS = 1  # of with_grads' arguments, the leading ones that are gradients (scaled as grad_rows)
    SUM_SLOT = "entropy"  # logit_sum's slot holds the shifted sum (hugehead.loop.chunks.sum_slot)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def rows(self, r0: int, r1: int) -> "EntropyTarget":
        return EntropyTarget(*(None if t is None else t[r0:r1] for t in (self.target, self.grad_entropy, self.entropy)))

    def with_grads(self, grad_entropy: Tensor, entropy: Tensor) -> "EntropyTarget":
        """The target of the backward: ``grad_entropy`` and ``entropy`` ``[N]`` on its device."""
        return EntropyTarget(self.target, grad_entropy, entropy)

    def stats_(self, z: Tensor, class_start: int, softcap: float, stats) -> None:
        target_chunks.entropy_chunk_stats_(z, self.target, class_start, softcap, *stats)

    def grad_(self, z: Tensor, class_start: int, num_classes: int, lse: Tensor, grad_rows: Tensor,
              label_smoothing: float, z_loss: float, softcap: float, grad_lse: Optional[Tensor]) -> None:
        if self.grad_entropy is None or self.entropy is None:
            raise RuntimeError("hugehead: the entropy's backward needs EntropyTarget.with_grads")
        target_chunks.entropy_chunk_grad_(z, self.target, class_start, softcap, lse, grad_rows, self.grad_entropy,
                                          self.entropy)


@dataclass(frozen=True)
class SoftmaxCsrTarget(TargetBase):
    """Softmax against a CSR target (the algebra is in :mod:`hugehead.sparse`).

    Attributes:
        stats: entries whose values the forward dots with the logits (``target_logit += Σ v c``): the
            class-weighted target values, or 1 per entry for index targets (so ``target_logit`` is the
            target's logit itself and the row loss ``w_y (lse - c_y)`` loses nothing to rounding).
        grad_val: ``[nnz]`` the entries' values in the gradient (class-weighted targets).
        mass: ``[N]`` factor of softmax in the row's gradient, ``(1 - eps) Σ w t + eps / V Σ_j w_j``.
        class_weight: ``[V]`` accumulation dtype when label smoothing meets class weights (the smoothing
            term weighs every class), else None.
    """

    stats: CsrTarget
    grad_val: Tensor
    mass: Tensor
    class_weight: Optional[Tensor]

    @property
    def device(self) -> torch.device:
        return self.mass.device

    def columns(self, start: int, stop: int) -> "SoftmaxCsrTarget":
        keep = (self.stats.col >= start) & (self.stats.col < stop)
        index = keep.nonzero().squeeze(1)
        return replace(self, stats=self.stats.columns(start, stop), grad_val=self.grad_val[index])

    def rows(self, r0: int, r1: int) -> "SoftmaxCsrTarget":
        return replace(self, stats=self.stats.rows(r0, r1), mass=self.mass[r0:r1])

    def _class_weight(self, class_start: int, cols: int) -> Optional[Tensor]:
        return None if self.class_weight is None else self.class_weight[class_start:class_start + cols]

    def stats_(self, z: Tensor, class_start: int, softcap: float, stats) -> None:
        t = self.stats
        target_chunks.sparse_chunk_stats_(z, t.crow, t.col, t.val, class_start, softcap,
                                          self._class_weight(class_start, z.shape[1]), *stats)

    def grad_(self, z: Tensor, class_start: int, num_classes: int, lse: Tensor, grad_rows: Tensor,
              label_smoothing: float, z_loss: float, softcap: float, grad_lse: Optional[Tensor]) -> None:
        t = self.stats
        target_chunks.sparse_chunk_grad_(z, t.crow, t.col, self.grad_val, class_start, num_classes, lse, grad_rows,
                                         self.mass, label_smoothing, z_loss, softcap,
                                         self._class_weight(class_start, z.shape[1]), grad_lse)


@dataclass(frozen=True)
class BinaryCsrTarget(TargetBase):
    """One-vs-all binary cross-entropy against a CSR target with values in ``[0, 1]``.

    Attributes:
        target: the entries. entry_weight: ``[nnz]`` ``1 + (pos_weight_j - 1) t`` per entry, or None.
    """

    target: CsrTarget
    entry_weight: Optional[Tensor]

    @property
    def device(self) -> torch.device:
        return self.target.crow.device

    def columns(self, start: int, stop: int) -> "BinaryCsrTarget":
        if self.entry_weight is None:
            return BinaryCsrTarget(self.target.columns(start, stop), None)
        keep = ((self.target.col >= start) & (self.target.col < stop)).nonzero().squeeze(1)
        return BinaryCsrTarget(self.target.columns(start, stop), self.entry_weight[keep])

    def rows(self, r0: int, r1: int) -> "BinaryCsrTarget":
        return BinaryCsrTarget(self.target.rows(r0, r1), self.entry_weight)

    def stats_(self, z: Tensor, class_start: int, softcap: float, stats) -> None:
        # The row's loss goes into the target_logit slot (summed over chunks, shards and ranks).
        t = self.target
        target_chunks.bce_chunk_(z, t.crow, t.col, t.val, self.entry_weight, class_start, stats[2], None)

    def loss_and_grad_(self, z: Tensor, class_start: int, row_loss: Tensor, grad_rows: Tensor) -> None:
        """Both in one pass (the forward that produces the gradient)."""
        t = self.target
        target_chunks.bce_chunk_(z, t.crow, t.col, t.val, self.entry_weight, class_start, row_loss, grad_rows)

    def grad_(self, z: Tensor, class_start: int, num_classes: int, lse: Tensor, grad_rows: Tensor,
              label_smoothing: float, z_loss: float, softcap: float, grad_lse: Optional[Tensor]) -> None:
        t = self.target
        target_chunks.bce_chunk_(z, t.crow, t.col, t.val, self.entry_weight, class_start, None, grad_rows)


ChunkTarget = Union[IndexTarget, EntropyTarget, SoftmaxCsrTarget, BinaryCsrTarget]


# --------------------------------------------------------------------------------------------------
# Distributed: every rank's rows (the distributed engine all-gathers x and the targets)
# --------------------------------------------------------------------------------------------------
def gather_csr(engine, csr: CsrTarget, rows: int, *per_entry: Tensor) -> Tuple[CsrTarget, List[Tensor]]:
    """The CSR targets of every rank's rows, each rank's padded to ``rows`` rows (as
    ``engine.gather_rows`` pads ``x``), in rank order, and per-entry tensors ``[nnz]`` gathered alike.
    Entries differ in number between ranks: their counts are all-gathered first (one host read), then
    the entries padded to the largest count, all-gathered and trimmed."""
    device = csr.crow.device
    counts = csr.crow[1:] - csr.crow[:-1]
    counts_all = engine.gather_rows(counts, rows, 0)
    crow = torch.zeros(counts_all.shape[0] + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts_all, 0, out=crow[1:])
    nnz = engine.gather_rows(torch.tensor([csr.col.shape[0]], dtype=torch.int64, device=device), 1, 0).tolist()
    most = max(nnz) if nnz else 0
    keep = torch.cat([torch.arange(r * most, r * most + k, device=device) for r, k in enumerate(nnz)]) if nnz else (
        torch.zeros(0, dtype=torch.int64, device=device))

    def gather_entries(t: Tensor, fill) -> Tensor:
        return engine.gather_rows(t, most, fill)[keep]

    rank_of_entry = torch.repeat_interleave(torch.arange(len(nnz), device=device),
                                            torch.tensor(nnz, dtype=torch.int64, device=device))
    row = gather_entries(csr.row, 0) + rank_of_entry * rows
    out = CsrTarget(crow, gather_entries(csr.col, 0), gather_entries(csr.val, 0), row, csr.num_classes)
    return out, [gather_entries(t, 0) for t in per_entry]


def gather_chunk_target(engine, target: ChunkTarget, rows: int) -> ChunkTarget:
    """``target`` of this rank's rows -> the target of every rank's rows (see :func:`gather_csr`)."""
    if isinstance(target, IndexTarget):
        return IndexTarget(engine.gather_rows(target.target, rows, -1))
    if isinstance(target, EntropyTarget):  # the forward's: its backward's rows are gathered by the engine
        return EntropyTarget(engine.gather_rows(target.target, rows, -1))
    if hasattr(target, "gather"):  # a target of its own module (hugehead.distill_target)
        return target.gather(engine, rows)
    if isinstance(target, SoftmaxCsrTarget):
        stats, (grad_val,) = gather_csr(engine, target.stats, rows, target.grad_val)
        return SoftmaxCsrTarget(stats, grad_val, engine.gather_rows(target.mass, rows, 0), target.class_weight)
    extra = () if target.entry_weight is None else (target.entry_weight,)
    csr, gathered = gather_csr(engine, target.target, rows, *extra)
    return BinaryCsrTarget(csr, gathered[0] if gathered else None)


def as_chunk_target(target) -> ChunkTarget:
    """A chunk target as is; a plain ``[N]`` tensor of class ids as an :class:`IndexTarget`."""
    return IndexTarget(target) if isinstance(target, Tensor) else target
