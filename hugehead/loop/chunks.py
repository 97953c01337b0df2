"""The steps every execution path of the loop shares: a chunk's logits GEMM, the kernels that fold it into row
statistics or turn it into its gradient, the ``dX`` / ``dW`` GEMMs, the statistics' merge over shards, and
running a chunk-loop generator to its end.
"""
from __future__ import annotations

import math
from typing import Callable, Generator, List, NamedTuple, Optional, Tuple, TypeVar

import torch
from torch import Tensor

from .. import ops
from .sources import ResidentChunks, WeightChunk

__all__ = ["RowStats", "LSE_IN_TARGET_SLOT", "sum_slot", "merge_row_stats", "merge_shares", "merge_parts", "run_steps",
           "step_result"]

T = TypeVar("T")


class RowStats(NamedTuple):
    """Per-row statistics of one shard (or merged over shards), all ``[N]`` in the accumulation dtype."""

    max: Tensor
    sumexp: Tensor
    target_logit: Tensor
    logit_sum: Tensor


def _new_stats(x: Tensor, target=None) -> RowStats:
    """Empty statistics for ``x``'s rows: the max at -inf, the sums at 0, and ``target_logit`` at -inf where the
    target's slot rule keeps a log-sum-exp there (:func:`sum_slot`)."""
    n, acc = x.shape[0], ops.acc_dtype(x.dtype)
    slot_lse = sum_slot(target) in LSE_IN_TARGET_SLOT
    # Four tensors of their own, not rows of one buffer: ops return some of them (target_logit, logit_sum) as
    # outputs, which may not share storage with each other (torch.library) nor start at an offset (their fakes).
    return RowStats(
        torch.full((n,), -math.inf, dtype=acc, device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
        torch.full((n,), -math.inf, dtype=acc, device=x.device) if slot_lse else torch.zeros(n, dtype=acc,
                                                                                          device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
    )


def _logits_into(x: Tensor, chunk: WeightChunk, z: Tensor) -> Tensor:
    """``x [R, D] @ chunk.weightᵀ (+ chunk.bias)`` into ``z [R, C]`` (a workspace view or a column block
    of the kept logits: unit column stride, any row stride)."""
    if chunk.bias is None:
        torch.mm(x, chunk.weight.t(), out=z)
    else:
        torch.addmm(chunk.bias, x, chunk.weight.t(), out=z)
    return z


def _workspace_view(workspace: Tensor, rows: int, cols: int) -> Tensor:
    return workspace[: rows * cols].view(rows, cols)


def _chunk_stats(target, r0: int, r1: int, z: Tensor, class_start: int, softcap: float, stats: RowStats) -> None:
    """Fold logits chunk ``z`` (rows ``[r0, r1)``) into ``stats``: class ids ``[N]`` through
    ``chunk_stats_``, a chunk target of :mod:`hugehead.targets` through its own kernels."""
    if isinstance(target, Tensor):
        ops.chunk_stats_(z, target[r0:r1], class_start, softcap, *stats)
    else:
        target.rows(r0, r1).stats_(z, class_start, softcap, stats)


def _chunk_grad(target, r0: int, r1: int, g: Tensor, class_start: int, num_classes: int, lse: Tensor,
                grad_rows: Tensor, label_smoothing: float, z_loss: float, softcap: float,
                grad_lse: Optional[Tensor]) -> None:
    """Turn logits chunk ``g`` (rows ``[r0, r1)``) into its gradient in place (see :func:`_chunk_stats`)."""
    if isinstance(target, Tensor):
        ops.chunk_grad_(g, target[r0:r1], class_start, num_classes, lse, grad_rows, label_smoothing, z_loss, softcap,
                        grad_lse)
    else:
        target.rows(r0, r1).grad_(g, class_start, num_classes, lse, grad_rows, label_smoothing, z_loss, softcap,
                                  grad_lse)


# The slot rules whose target_logit slot holds a (teacher's) log-sum-exp, merged as one.
LSE_IN_TARGET_SLOT = ("student_mean", "teacher_mean")


def sum_slot(target) -> str:
    """How ``target``'s two free slots merge over class sets: ``"sum"`` (plain sums over classes: class ids and
    most chunk targets), ``"entropy"`` (:class:`hugehead.targets.EntropyTarget`: ``logit_sum`` holds the shifted
    sum ``Σ exp(c - max) (c - max)``), or, with a log-sum-exp in ``target_logit`` (the teacher's,
    :mod:`hugehead.distill_target`), ``"student_mean"`` (``logit_sum`` a sum ``Σ exp(c - max) v`` rescaled with the
    student's max, merged as the student softmax's mean of ``v``) or ``"teacher_mean"`` (``logit_sum`` already a
    mean under the teacher's softmax of the classes so far)."""
    return getattr(target, "SUM_SLOT", "sum")


def merge_row_stats(parts: List[RowStats], slot: str = "sum") -> Tuple[Tensor, Tensor, Tensor]:
    """Merge per-shard statistics (all on one device) into ``(lse, target_logit, logit_sum)`` by the slots' rule
    (:func:`sum_slot`): plain sums; or each shard's entropy or mean merged as :func:`merge_parts` merges ranks', the
    slot then holding the entropy or the mean over all classes (``target_logit`` a log-sum-exp where it holds one)."""
    if slot == "sum":
        if len(parts) == 1:
            p = parts[0]
            return p.max + p.sumexp.log(), p.target_logit, p.logit_sum
        m = torch.stack([p.max for p in parts])
        s = torch.stack([p.sumexp for p in parts])
        m_all = m.max(dim=0).values
        # exp(-inf - -inf) must count as 0 (an all -inf shard), not NaN.
        scale = torch.where(m == -math.inf, torch.zeros_like(m), (m - m_all).exp())
        lse = m_all + (s * scale).sum(dim=0).log()
        target_logit = torch.stack([p.target_logit for p in parts]).sum(dim=0)
        logit_sum = torch.stack([p.logit_sum for p in parts]).sum(dim=0)
        return lse, target_logit, logit_sum
    log_s = [p.sumexp.log() for p in parts]
    if slot == "entropy":
        values = [ls - p.logit_sum / p.sumexp for p, ls in zip(parts, log_s)]
    elif slot == "student_mean":
        values = [torch.where(p.sumexp > 0, p.logit_sum / p.sumexp, torch.zeros_like(p.sumexp)) for p in parts]
    else:
        values = [p.logit_sum for p in parts]
    return merge_parts(torch.stack([torch.stack([p.max + ls, p.target_logit, v])
                                    for p, ls, v in zip(parts, log_s, values)]), slot)


def merge_shares(lse: Tensor, target_logit: Tensor, values: Tensor, entropy: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(lse, target_logit, value)`` ``[N]`` over all classes from those of ``K`` disjoint class sets, each
    ``[K, N]``, where a set's value is a mean under its own softmax (or, with ``entropy``, that softmax's
    entropy): with ``w_k = exp(lse_k - lse)`` the sets' shares of the softmax, the mean over all classes is
    ``Σ_k w_k v_k`` and the entropy of the mixture ``Σ_k w_k H_k + Σ_k entr(w_k)`` (a set without mass,
    ``lse_k = -inf``, adds nothing)."""
    if lse.shape[0] == 1:
        return lse[0], target_logit[0], values[0]
    total = torch.logsumexp(lse, dim=0)
    empty = lse == -math.inf
    # The shares as a softmax over the sets (each against the largest lse), not exp(lse_k - total): a log-sum-exp
    # of large logits rounds to its magnitude's ulp, which shares formed from it would carry as a relative error.
    w = torch.where(empty, torch.zeros_like(lse), torch.softmax(lse, dim=0))
    merged = torch.where(empty, torch.zeros_like(values), w * values).sum(dim=0)
    if entropy:
        merged = merged + torch.special.entr(w).sum(dim=0)
    return total, target_logit.sum(dim=0), merged


def merge_parts(parts: Tensor, slot: str = "sum") -> Tuple[Tensor, Tensor, Tensor]:
    """``(lse, target_logit, logit_sum)`` ``[N]`` from ``parts [K, 3, N]``, those of ``K`` disjoint class sets (ranks)
    as :func:`merge_row_stats` returns them, by the slots' rule (:func:`sum_slot`): log-sum-exp and sums;
    ``"entropy"`` / ``"student_mean"`` the third row merged by the sets' shares of the student's softmax
    (:func:`merge_shares`), ``"teacher_mean"`` by their shares of the teacher's (``target_logit``'s log-sum-exps);
    and in the two means ``target_logit`` merged as a log-sum-exp."""
    lse, target_logit, values = parts[:, 0], parts[:, 1], parts[:, 2]
    if slot == "sum":
        return torch.logsumexp(lse, dim=0), target_logit.sum(dim=0), values.sum(dim=0)
    if slot == "teacher_mean":
        teacher_lse, _, mean = merge_shares(target_logit, target_logit, values, False)
        return torch.logsumexp(lse, dim=0), teacher_lse, mean
    total, summed, merged = merge_shares(lse, target_logit, values, slot == "entropy")
    if slot == "student_mean":
        summed = target_logit[0] if target_logit.shape[0] == 1 else torch.logsumexp(target_logit, dim=0)
    return total, summed, merged


def _mm_dw(out: Tensor, g: Tensor, x: Tensor, accumulate: bool = False) -> None:
    """``out = gᵀ x`` (or ``+=``) for a chunk's dW in ATen's GEMM, with the products in ``out``'s dtype (a
    float32 sum of 16-bit ``g`` and ``x``)."""
    gt, xo = g.t().to(out.dtype), x.to(out.dtype)
    if accumulate:
        out.addmm_(gt, xo)
    else:
        torch.mm(gt, xo, out=out)


def _add_dx(grad_x: Tensor, g: Tensor, weight: Tensor, dx_partial: Optional[Tensor]) -> None:
    """``grad_x += g @ weight``. When ``grad_x`` is in the accumulation dtype and ``g`` is not: on CUDA one
    GEMM that sums in float32 into ``grad_x`` itself (cuBLAS's addmm with ``out_dtype``), elsewhere through a
    partial in the compute dtype, each chunk's partial rounded on its own
    (as a single GEMM's would be): never a low-precision running sum."""
    if dx_partial is None:
        grad_x.addmm_(g, weight)
    elif g.is_cuda:
        # cuBLAS accumulates into the float32 grad_x itself (addmm's out_dtype, CUDA only): no rounded partial
        # and no add pass.
        torch.addmm(grad_x, g, weight, out_dtype=grad_x.dtype, out=grad_x)
    else:
        part = dx_partial[: g.shape[0]]
        torch.mm(g, weight, out=part)
        grad_x.add_(part)


class _WeightGradWriter:
    """Writes a chunk's ``dW = gᵀ x`` (whole rows) into the source's gradient sink: straight into it when
    it stores the compute dtype, else, as autocast's ``F.linear`` does, in the compute dtype first through
    one reused scratch chunk, then cast by :meth:`ResidentChunks.put_grad`."""

    def __init__(self, source: ResidentChunks, x: Tensor, cols: int):
        self.source, self.x, self.cols = source, x, cols
        self.scratch: Optional[Tensor] = None

    def write(self, chunk: WeightChunk, g: Tensor, grad_bias: Optional[Tensor]) -> None:
        c0, c1 = chunk.c0, chunk.c1
        out = self.source.grad_weight_out(c0, c1, self.x.dtype)
        if out is not None:
            _mm_dw(out, g, self.x)
            self.source.put_grad(c0, c1, None, grad_bias)
            return
        if self.scratch is None:
            self.scratch = self.x.new_empty(self.cols, self.x.shape[1])
        _mm_dw(self.scratch[: c1 - c0], g, self.x)
        self.source.put_grad(c0, c1, self.scratch[: c1 - c0], grad_bias)


def step_result(done: StopIteration):
    """The value a finished chunk-loop generator returned. Read from ``args``: dynamo (torch.compile)
    traces that, not ``StopIteration.value`` (nor the value of a ``yield from``, so the loops below pick
    their variant in a plain function and hand back its generator instead of delegating to it)."""
    return done.args[0] if done.args else None


def run_steps(steps: Generator[None, None, T], after_first: Optional[Callable[[], None]] = None) -> T:
    """Run a chunk-loop generator to its end and return its result. ``after_first``: called once, when the
    first chunk's work is queued (or at the end, where there was none): host work the first GEMM need not
    wait for (an eager step's GPU idles until the host launches it)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            if after_first is not None:
                after_first()
            return step_result(done)
        if after_first is not None:
            after_first, call = None, after_first
            call()
