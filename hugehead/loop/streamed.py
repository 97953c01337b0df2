"""The one-stream loop (any rows split): chunks outer, row blocks inner; kept chunks (logits or probabilities)
stored in the forward and read back by the backward, the others recomputed; fused GEMMs where they apply.
"""
from __future__ import annotations

from .. import ops
from ..plan import kept_shape
from .chunks import RowStats, _WeightGradWriter, _add_dx, _chunk_grad, _chunk_stats, _logits_into, _mm_dw, _new_stats
from .chunks import _workspace_view
from .fused import _fused_grad, _fused_stats, _stored_stats, _tma_ready
from .kept import KeptLogits, _forward_chunks, _ptr, _spare
from .probs import _FactoredKept, _kept_probs

__all__: list = []


def _forward_streamed(x, source, target, class_start, softcap, plan, logit_sum=True, store=None):
    """:func:`hugehead.loop.forward_stats_steps` on one stream (any rows split), on the plan's GEMM paths."""
    n = x.shape[0]
    v = source.num_rows
    stats = _new_stats(x, target)
    kept = x.new_empty(kept_shape(plan, n)) if plan.keep_logits else None
    slots = KeptLogits(plan, kept, store, n) if kept is not None else None
    if n == 0 or v == 0:
        return stats, kept
    kept_classes = plan.kept_chunks * plan.cols if kept is not None else 0
    workspace = None  # allocated at the first chunk that needs stored logits (none when every one is fused)
    fused, exact = plan.fused, plan.exact
    cols = plan.stats_cols if kept is None else plan.cols
    # The chunks not kept, folded first, take the fused GEMM's wider chunks too (partials only, no workspace:
    # fewer GEMMs and merges), where x suits its loads (else each would need a workspace that wide).
    widen = fused and kept is not None and _tma_ready(x)
    # Chunks outer, rows inner: each weight chunk is fetched once, however many row blocks there are.
    chunks, kept_last = _forward_chunks(source, cols, kept_classes, plan.stats_cols if widen else None)
    probs = _kept_probs(plan, slots)
    for chunk in chunks:
        for r0 in range(0, n, plan.rows):
            r1 = min(r0 + plan.rows, n)
            # (rows whole: the tensors themselves, not six views a chunk, the first chunk's before its GEMM)
            whole = r0 == 0 and r1 == n
            rows = stats if whole else RowStats(*(s[r0:r1] for s in stats))
            xr = x if whole else x[r0:r1]
            if chunk.c0 >= kept_classes and fused and _fused_stats(
                    xr, chunk, target if whole else target[r0:r1], class_start + chunk.c0, softcap, rows, logit_sum,
                    exact=exact):
                continue
            if chunk.c0 < kept_classes:
                k = chunk.c0 // plan.cols
                chunk_ref = None
                if probs:  # this chunk's references, where the backward finds them (a flagged row's is moved)
                    chunk_ref = slots.scale_area()[k]
                    chunk_ref.copy_(stats.max)
                elif kept_last and plan.rows >= n:
                    chunk_ref = stats.max.clone()
                z = slots.chunk(k, chunk.c1 - chunk.c0)
                _stored_stats(xr, chunk, z, target, r0, r1, class_start + chunk.c0, softcap, rows, plan.fused_store,
                              logit_sum, reference=chunk_ref, probs=probs)
                continue
            if workspace is None or workspace.numel() < (r1 - r0) * (chunk.c1 - chunk.c0):
                # (a widened chunk the fused GEMM refused -- its layout -- needs its own width)
                workspace = x.new_empty(min(plan.rows, n) * min(max(plan.cols, chunk.c1 - chunk.c0), v))
            z = _workspace_view(workspace, r1 - r0, chunk.c1 - chunk.c0)
            _logits_into(xr, chunk, z)
            _chunk_stats(target, r0, r1, z, class_start + chunk.c0, softcap, rows)
        yield
    if probs:
        slots.scale_area()[plan.kept_chunks].copy_(stats.target_logit)
    return stats, kept


def _backward_streamed(x, source, target, class_start, num_classes, lse, grad_rows, options, plan, grad_x,
                       need_weight, kept, grad_lse, store=None, *, grad_x_zero=False):
    """:func:`hugehead.loop.backward_steps` on one stream (any rows split), on the forward plan's GEMM paths."""
    n, d = x.shape
    v = source.num_rows
    acc = ops.acc_dtype(x.dtype)
    if need_weight:
        source.start_grads(need_bias=True)
    if n == 0 or v == 0:
        if need_weight:
            grad_w, grad_b = source.finish_grads()
            grad_w.zero_()
            if grad_b is not None:
                grad_b.zero_()
            return grad_w, grad_b
        return None, None
    rows_split = plan.rows < n
    fused, exact = plan.fused, plan.exact
    kept_classes = plan.kept_chunks * plan.cols if kept is not None else 0
    slots = KeptLogits(plan, kept, store, n) if kept is not None else None
    probs = kept_classes > 0 and _kept_probs(plan, slots)
    # The streamed chunks' workspace (one chunk at a time: the widest not kept). After a factored backward, which
    # takes the kept chunks first, the kept tensor's memory is free for it where large enough.
    width = min(plan.cols, v - kept_classes)
    workspace = None
    if kept_classes < v:
        spare = _spare(kept, min(plan.rows, n) * width) if probs else None
        workspace = spare if spare is not None else x.new_empty(min(plan.rows, n) * width)
    dx_partial = None
    if grad_x is not None and grad_x.dtype != x.dtype:
        # (CUDA sums a chunk's dX in float32 into grad_x itself: _add_dx reads no partial there)
        dx_partial = x.new_empty(0) if x.is_cuda else x.new_empty(min(plan.rows, n), d)
    dw_acc = x.new_empty(min(plan.cols, v), d, dtype=acc) if (rows_split and need_weight) else None
    dw_writer = _WeightGradWriter(source, x, min(plan.cols, v))
    factored = None
    if probs:
        factored = _FactoredKept(x, target, lse, grad_rows, options, grad_lse, slots, class_start, source,
                                 dw_writer if need_weight else None, grad_x,
                                 None if workspace is None or workspace.data_ptr() == _ptr(kept) else workspace,
                                 grad_x_zero=grad_x_zero)
    for chunk in source.chunks(plan.cols):
        c0, c1 = chunk.c0, chunk.c1
        db_chunk = None
        if factored is not None and c0 < kept_classes:  # rows whole
            factored.chunk(chunk, c0 // plan.cols, slots.chunk(c0 // plan.cols, c1 - c0), grad_x)
            if c1 >= kept_classes:
                factored.finish(grad_x)
            yield
            continue
        for r0 in range(0, n, plan.rows):
            r1 = min(r0 + plan.rows, n)
            xr = x[r0:r1]
            rows_grad_lse = None if grad_lse is None else grad_lse[r0:r1]
            if c0 < kept_classes:
                g = slots.chunk(c0 // plan.cols, c1 - c0)
                in_epilogue = False
            else:
                g = _workspace_view(workspace, r1 - r0, c1 - c0)
                # dLoss/dlogits straight from the recompute GEMM's epilogue, where it applies
                in_epilogue = fused and _fused_grad(xr, chunk, target[r0:r1], class_start + c0, num_classes,
                                                    lse[r0:r1], grad_rows[r0:r1], options, rows_grad_lse, g,
                                                    exact=exact)
                if not in_epilogue:
                    _logits_into(xr, chunk, g)
            if not in_epilogue:
                _chunk_grad(
                    target, r0, r1, g, class_start + c0, num_classes, lse[r0:r1], grad_rows[r0:r1],
                    options.label_smoothing, options.z_loss, options.kernel_softcap, rows_grad_lse,
                )
            if grad_x is not None:
                _add_dx(grad_x[r0:r1], g, chunk.weight, dx_partial)
            if need_weight:
                if rows_split:
                    _mm_dw(dw_acc[: c1 - c0], g, xr, accumulate=r0 > 0)
                if source.bias is not None:
                    part_b = g.sum(dim=0, dtype=acc)
                    db_chunk = part_b if db_chunk is None else db_chunk + part_b
        if need_weight:
            if rows_split:
                source.put_grad(c0, c1, dw_acc[: c1 - c0], db_chunk)
            else:
                dw_writer.write(chunk, g, db_chunk)
        yield
    if need_weight:
        return source.finish_grads()
    return None, None

