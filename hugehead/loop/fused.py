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
from ..plan import FUSED_STATS_WIDEN, Plan
from .chunks import RowStats, _chunk_stats, _logits_into
from .sources import ResidentChunks, WeightChunk

__all__ = ["fused_applies", "FUSED_STORE_MAX_DEPTH", "KEPT_PROBS_REBASE"]


def fused_applies(x: Tensor, target) -> bool:
    """Whether this shard's chunks may take :func:`ops.gemm_chunk_stats_` and :func:`ops.gemm_chunk_grad_`
    (one answer for both): class-id targets, a bf16/fp16 ``x`` on an sm_90 GPU of a
    CUTLASS build, and :func:`ops.gemm_path` saying ``cutlass``; each chunk still checks its own layout
    (:func:`_fused_layout`). Not while torch.compile traces: the layout checks read data pointers, which fake
    tensors do not have."""
    return (isinstance(target, Tensor) and x.is_cuda and x.shape[1] > 0 and x.shape[1] % 8 == 0
            and not torch.compiler.is_compiling() and ops.gemm_path(x.device, x.dtype) == "cutlass")


def _tma_ready(t: Tensor) -> bool:
    """K-major with 16-byte aligned rows: what the GEMM's TMA loads take."""
    return t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _fused_layout(x: Tensor, chunk: WeightChunk) -> bool:
    """The chunk's operands suit the fused GEMMs (else the chunk takes cuBLAS and our kernels)."""
    w, b = chunk.weight, chunk.bias
    return (_tma_ready(x) and _tma_ready(w) and w.dtype == x.dtype
            and (b is None or (b.is_contiguous() and b.dtype == x.dtype))
            and x.shape[0] < 2**31 - 1 and w.shape[0] < 2**31 - 1)


# The fused statistics GEMM stores no logits: its one buffer is the partials, 16 bytes per row and 128 columns
# (a sixteenth of a 16-bit logits chunk of the same width; 8 bytes without label smoothing's logit sums). So
# where the weight is resident in the compute dtype (chunks are slices, never casts) it takes chunks
# FUSED_STATS_WIDEN (hugehead.plan, which counts their partials) times the plan's width: fewer launches, merges
# and tails, each of which costs time beside the GEMMs'.


def _fused_stats_cols(plan: Plan, source) -> int:
    """Chunk width of a forward whose chunks all take the fused statistics GEMM (no kept logits)."""
    if not isinstance(source, ResidentChunks) or source.weight.dtype != source.compute_dtype or (
            source.bias is not None and source.bias.dtype != source.compute_dtype):
        return plan.cols
    return plan.cols * FUSED_STATS_WIDEN


def _tma_store_ready(z: Tensor) -> bool:
    """A logits chunk view the fused GEMM can store into by TMA: unit column stride, a width and row stride
    that are multiples of 8, a 16-byte aligned start."""
    return z.stride(1) == 1 and z.stride(0) % 8 == 0 and z.shape[1] % 8 == 0 and z.data_ptr() % 16 == 0


# The statistics GEMM that stores its logits pays below this depth (D = K) only: deeper, chunk_stats_' pass is a
# small part of a long GEMM, and the cooperative fused GEMM's store costs more than that pass.
FUSED_STORE_MAX_DEPTH = 2048


def _stored_stats(x: Tensor, chunk: WeightChunk, z: Tensor, target, r0: int, r1: int, class_start: int,
                  softcap: float, stats: RowStats, fused: bool, logit_sum: bool = True,
                  reference: Optional[Tensor] = None, probs: bool = False) -> None:
    """Logits chunk ``x @ chunk.weightᵀ + chunk.bias`` (rows ``[r0, r1)`` of the shard, ``x`` already those
    rows) stored into ``z`` (a kept chunk, a block of the rows plan) and folded into ``stats``. Where the fused
    statistics GEMM applies (``fused``: :func:`fused_applies`; no softcap, since kept logits are stored
    uncapped; the layouts; a depth under :data:`FUSED_STORE_MAX_DEPTH`, or any depth with ``probs``, whose
    cuBLAS path takes four passes over the chunk), one GEMM stores them as it folds
    them (:func:`ops.gemm_chunk_stats_` with ``logits``): no pass reads them back. Else cuBLAS's GEMM, then
    :func:`_chunk_stats` on what it stored. ``reference``: each row's max over the chunks the forward does not keep
    (:func:`hugehead.loop.kept._forward_chunks`), which the GEMM folds against (no tile maxima); ``probs``: ``z``
    then gets ``exp(min(z - reference, 80))`` in place of the logits (:func:`hugehead.loop.probs._probs_plan`), on
    either path."""
    if (fused and not softcap and (x.shape[1] < FUSED_STORE_MAX_DEPTH or probs) and _fused_layout(x, chunk)
            and _tma_store_ready(z)):
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


def _exact_logits(x: Tensor, source, softcap: float, smoothing: bool, fused: bool) -> bool:
    """Whether the chunks the forward does not keep take the float32 accumulator as each logit on both sides
    (:func:`ops.gemm_chunk_stats_` / :func:`ops.gemm_chunk_grad_` ``exact``): both fused (a chunk whose layout
    the fused GEMMs refuse takes cuBLAS on both sides alike), no bias, softcap or label smoothing (the forward's
    logit sums: the 128 x 192 fold has none) and a depth under :data:`FUSED_STORE_MAX_DEPTH` (the rounded
    logits would cost a cvt a pair and two integer ops an element in both epilogues). The forward and the
    backward ask it of the same inputs and options: the same answer, so a confident row's
    ``p - 1`` sees the forward's lse and the backward's logits as the same numbers. Kept chunks keep their
    rounded logits (stored, and read back by the backward)."""
    return fused and not softcap and not smoothing and source.bias is None and x.shape[1] < FUSED_STORE_MAX_DEPTH


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
    (nothing done) when this chunk's layout does not suit it. ``exact``: :func:`_exact_logits`."""
    if not _fused_layout(x, chunk):
        return False
    ops.gemm_chunk_grad_(x, chunk.weight, chunk.bias, target, class_start, num_classes, lse, grad_rows,
                         options.label_smoothing, options.z_loss, options.kernel_softcap, grad_lse, g, exact=exact)
    return True
