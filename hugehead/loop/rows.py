"""The rows plan: a scalar loss's losses and gradients in the forward, one block of rows over all classes at a
time.
"""
from __future__ import annotations

from typing import Callable, Generator, Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from ..options import LossOptions, row_losses
from ..plan import Plan
from .chunks import _add_dx, _chunk_grad, _mm_dw, _new_stats, merge_row_stats
from .fused import _stored_stats
from .sources import ResidentChunks

__all__: list = []


def row_block_steps(
    x: Tensor,
    source: ResidentChunks,
    target: Tensor,
    options: LossOptions,
    plan: Plan,
    grad_rows: Tensor,
    need_x: bool,
    need_weight: bool,
    row_losses_of: Optional[Callable[[int, int, Tensor, Tensor, Tensor], Tensor]] = None,
) -> Generator[None, None, Tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]]:
    """Per-row losses and every gradient of one shard holding all ``V`` classes, in one pass (the
    ``"rows"`` plan of :func:`hugehead.plan.plan_rows`); a generator that yields after each row block.

    For each block of ``plan.rows`` rows: its logits, ``plan.cols`` classes a chunk, into one
    ``rows × V`` workspace; the chunks' statistics (the kernels of the forward) give the rows' lse and
    losses; the chunks are turned into their gradient in place (the kernels of the backward, with
    ``grad_rows``); then ``dX`` rows ``= G W`` (one GEMM straight into the gradient when one chunk spans
    the classes), ``dW += Gᵀ X_b`` in the weight's dtype and ``db += Σ G`` in the accumulation dtype.

    Args:
        x: ``[N, D]`` compute dtype; source: the weight's chunks (cast to the compute dtype chunk by chunk
            when stored in another dtype: autocast).
        target: ``[N]`` int64 class ids, checked; or a chunk target of :mod:`hugehead.targets` (a sparse
            probability target, class-weighted ids) with ``row_losses_of``. options: the loss.
        grad_rows: ``[N]`` accumulation dtype: ``dLoss/dloss_row`` (the reduction's scale; 0 on ignored
            rows), known before the pass.
        need_x, need_weight: which gradients to compute (``need_weight``: dW, and db with a bias).
        row_losses_of: for a chunk target, ``(r0, r1, lse, target_logit, logit_sum) -> [r1 - r0]`` losses of
            rows ``[r0, r1)`` from their merged statistics (its loss's rules, e.g.
            :func:`hugehead.multilabel.softmax_row_losses`); None: class ids under ``options``' rules.
    Returns:
        ``(loss_rows [N] accumulation dtype (0 on ignored rows), dX [N, D] in x's (compute) dtype or None,
        dW [V, D] in the weight's stored dtype or None, db [V] in the bias's stored dtype or None)``.
    """
    n, d = x.shape
    v = source.num_rows
    acc = ops.acc_dtype(x.dtype)
    loss_rows = torch.zeros(n, dtype=acc, device=x.device)
    grad_x = x.new_empty(n, d) if need_x else None
    # dW is written by the first block's GEMM (no fill); db accumulates from zero.
    grad_w = torch.empty_like(source.weight, memory_format=torch.contiguous_format) if need_weight else None
    grad_b = (torch.zeros(v, dtype=acc, device=x.device)
              if (need_weight and source.bias is not None) else None)
    if n == 0:
        if grad_w is not None:
            grad_w.zero_()
        return loss_rows, grad_x, grad_w, _bias_grad(grad_b, source)
    valid = target != options.ignore_index if row_losses_of is None else None
    # Each block's logits stored by the fused statistics GEMM as it folds them, where it applies; the logit
    # sums only where label smoothing reads them (class ids: a chunk target's kernels fold their own).
    fold_sums = bool(options.label_smoothing)
    workspace = x.new_empty(min(plan.rows, n) * v)
    one_chunk = plan.cols >= v
    dx_acc = x.new_empty(min(plan.rows, n), d, dtype=acc) if (need_x and not one_chunk) else None
    dx_partial = x.new_empty(min(plan.rows, n), d) if dx_acc is not None else None
    # A dW stored in another dtype (float32 under autocast): each block's partial in the compute dtype first,
    # rounded once as autocast's F.linear rounds its dW, then added in the stored dtype.
    dw_scratch = (x.new_empty(min(plan.cols, v), d) if (need_weight and grad_w.dtype != x.dtype) else None)
    for r0 in range(0, n, plan.rows):
        r1 = min(r0 + plan.rows, n)
        xr = x[r0:r1]
        block = workspace[: (r1 - r0) * v].view(r1 - r0, v)
        stats = _new_stats(xr)
        # Two passes over the weight's chunks (slices, or casts made again: never a whole cast weight).
        for chunk in source.chunks(plan.cols):
            _stored_stats(xr, chunk, block[:, chunk.c0:chunk.c1], target, r0, r1, chunk.c0, options.kernel_softcap,
                          stats, plan.fused_store, fold_sums)
        lse, target_logit, logit_sum = merge_row_stats([stats])
        if row_losses_of is None:
            loss_rows[r0:r1] = row_losses(lse, target_logit, logit_sum, valid[r0:r1], v, options)
        else:
            loss_rows[r0:r1] = row_losses_of(r0, r1, lse, target_logit, logit_sum)
        if dx_acc is not None:
            dx_acc[: r1 - r0].zero_()
        for chunk in source.chunks(plan.cols):
            g = block[:, chunk.c0:chunk.c1]
            _chunk_grad(target, r0, r1, g, chunk.c0, v, lse, grad_rows[r0:r1], options.label_smoothing,
                        options.z_loss, options.kernel_softcap, None)
            if need_x:
                if one_chunk:
                    torch.mm(g, chunk.weight, out=grad_x[r0:r1])
                else:
                    _add_dx(dx_acc[: r1 - r0], g, chunk.weight, dx_partial)
            if need_weight:
                dw = grad_w[chunk.c0:chunk.c1]
                if dw_scratch is not None:
                    part = dw_scratch[: chunk.c1 - chunk.c0]
                    _mm_dw(part, g, xr)
                    dw.copy_(part) if r0 == 0 else dw.add_(part)
                elif r0 == 0:
                    _mm_dw(dw, g, xr)
                else:
                    # In the weight's dtype: a 16-bit dW rounds once per block (plan_rows caps the blocks).
                    _mm_dw(dw, g, xr, accumulate=True)
                if grad_b is not None:
                    grad_b[chunk.c0:chunk.c1].add_(g.sum(dim=0, dtype=acc))
        if dx_acc is not None:
            grad_x[r0:r1].copy_(dx_acc[: r1 - r0])
        yield
    return loss_rows, grad_x, grad_w, _bias_grad(grad_b, source)


def _bias_grad(grad_b: Optional[Tensor], source: ResidentChunks) -> Optional[Tensor]:
    """db, accumulated in the accumulation dtype, in the bias's dtype."""
    if grad_b is None or grad_b.dtype == source.bias.dtype:
        return grad_b
    return grad_b.to(source.bias.dtype)
