"""The chunk steps through the CUTLASS GEMMs with the statistics (forward) or dLoss/dlogits (backward) in their
epilogues, and the statistics step of stored logits (kept chunks, the rows plan's blocks), fused or through cuBLAS
and our kernels.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops
from ..options import LossOptions
from .chunks import RowStats, _chunk_stats, _logits_into
from .sources import WeightChunk

__all__ = ["KEPT_PROBS_REBASE"]


def _tma_ready(t: Tensor) -> bool:
    """K-major with 16-byte aligned rows: what the GEMM's TMA loads take."""
    return t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _fused_layout(x: Tensor, chunk: WeightChunk) -> bool:
    """The chunk's operands suit the fused GEMMs (else the chunk takes cuBLAS and our kernels)."""
    w, b = chunk.weight, chunk.bias
    return (_tma_ready(x) and _tma_ready(w) and w.dtype == x.dtype
            and (b is None or (b.is_contiguous() and b.dtype == x.dtype))
            and x.shape[0] < 2**31 - 1 and w.shape[0] < 2**31 - 1)


def _tma_store_ready(z: Tensor) -> bool:
    """A logits chunk view the fused GEMM can store into by TMA: unit column stride, a width and row stride
    that are multiples of 8, a 16-byte aligned start."""
    return z.stride(1) == 1 and z.stride(0) % 8 == 0 and z.shape[1] % 8 == 0 and z.data_ptr() % 16 == 0


def _stored_stats(x: Tensor, chunk: WeightChunk, z: Tensor, target, r0: int, r1: int, class_start: int,
                  softcap: float, stats: RowStats, fused_store: bool, logit_sum: bool = True,
                  reference: Optional[Tensor] = None, probs: bool = False) -> None:
    """Logits chunk ``x @ chunk.weightᵀ + chunk.bias`` (rows ``[r0, r1)`` of the shard, ``x`` already those
    rows) stored into ``z`` (a kept chunk, a block of the rows plan) and folded into ``stats``. Where the plan
    stores them through the fused statistics GEMM (``fused_store``: :attr:`hugehead.plan.Plan.fused_store`) and
    the layouts suit it, one GEMM stores them as it folds them (:func:`ops.gemm_chunk_stats_` with ``logits``): no
    pass reads them back. Else cuBLAS's GEMM, then :func:`_chunk_stats` on what it stored. ``reference``: each
    row's max over the chunks the forward does not keep (:func:`hugehead.loop.kept._forward_chunks`), which the
    GEMM folds against (no tile maxima); ``probs``: ``z`` then gets ``exp(min(z - reference, 80))`` in place of
    the logits (:attr:`hugehead.plan.Plan.kept_probs`), on either path."""
    if fused_store and _fused_layout(x, chunk) and _tma_store_ready(z):
        ops.gemm_chunk_stats_(x, chunk.weight, chunk.bias, target[r0:r1], class_start, 0.0, *stats,
                              with_logit_sum=logit_sum, logits=z, reference=reference, probs=probs)
        return
    _logits_into(x, chunk, z)
    _chunk_stats(target, r0, r1, z, class_start, softcap, stats)
    if probs:  # as the fused op: a row with a logit far above its reference (or none finite) takes its own max
        zf = z.float()
        top = zf.max(dim=1).values
        reference.copy_(torch.where(~(top - reference <= KEPT_PROBS_REBASE), top, reference))
        z.copy_(torch.exp(zf - reference[:, None]))


# Where a kept chunk's row takes its own max as its reference on the cuBLAS path (the fused op's flag, kFlagSum
# = 2^80 on a tile's sum, sits near this): exp(z - reference) stays far inside bf16's range.
KEPT_PROBS_REBASE = 50.0


def _fused_stats(x: Tensor, chunk: WeightChunk, target: Tensor, class_start: int, softcap: float,
                 stats: RowStats, logit_sum: bool = True, exact: bool = False) -> bool:
    """Fold chunk ``x @ chunk.weightᵀ + chunk.bias`` into ``stats`` in one fused GEMM (``logit_sum`` False:
    ``stats.logit_sum`` left as it is, for a loss that never reads it); False (nothing done) when this
    chunk's layout does not suit it. Each tile folds against its own max (the 128-column folds check its
    bits)."""
    if not _fused_layout(x, chunk):
        return False
    ops.gemm_chunk_stats_(x, chunk.weight, chunk.bias, target, class_start, softcap, *stats,
                          with_logit_sum=logit_sum, exact=exact)
    return True


def _fused_grad(x: Tensor, chunk: WeightChunk, target: Tensor, class_start: int, num_classes: int, lse: Tensor,
                grad_rows: Tensor, options: LossOptions, grad_lse: Optional[Tensor], g: Tensor,
                exact: bool = False) -> bool:
    """Write dLoss/dlogits of chunk ``x @ chunk.weightᵀ + chunk.bias`` into ``g`` in one fused GEMM; False
    (nothing done) when this chunk's layout does not suit it. ``exact``: :attr:`hugehead.plan.Plan.exact`."""
    if not _fused_layout(x, chunk):
        return False
    ops.gemm_chunk_grad_(x, chunk.weight, chunk.bias, target, class_start, num_classes, lse, grad_rows,
                         options.label_smoothing, options.z_loss, options.kernel_softcap, grad_lse, g, exact=exact)
    return True
