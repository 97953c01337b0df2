"""Kept logits: where a plan's kept chunks live between the forward and the backward (their own tensor, or slots
of the weight gradient's buffer), and the forward's chunk order around them.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..grad_store import grad_store_layout, scale_area_bytes
from ..plan import Plan
from .sources import ResidentChunks

__all__ = ["KeptLogits"]


class KeptLogits:
    """Where a plan's kept chunks live between forward and backward: the first ``plan.kept_in_grad`` in the
    weight gradient's buffer ``store [V, D]`` (:func:`hugehead.grad_store.grad_store_layout`: laid out so that the
    backward, taking the chunks in order, writes each chunk's ``dW`` over slots it already consumed), the
    others in ``kept [kept_chunks - kept_in_grad, N, cols]``. :meth:`chunk` gives chunk ``i``'s ``[N, width]``
    view (unit column stride, row stride ``cols``), the same either way."""

    def __init__(self, plan: Plan, kept: Tensor, store: Optional[Tensor], n: int):
        self.plan, self.kept, self.n = plan, kept, n
        self.in_grad = plan.kept_in_grad
        self.slots = None
        if self.in_grad and store is None:
            raise RuntimeError(f"hugehead: the plan keeps {self.in_grad} chunks in the weight gradient's buffer, "
                               "and none was given")
        if self.in_grad:
            offset, stride, slots = grad_store_layout(n, store.shape[1], store.shape[0], plan.cols,
                                                      kept.element_size(), store.element_size())
            if slots < self.in_grad or not store.is_contiguous():
                raise RuntimeError(f"hugehead: the weight gradient's buffer holds {slots} kept chunks, the plan "
                                   f"{self.in_grad}")
            self.slots = (store.view(-1).view(torch.uint8), offset, stride)

    def scale_area(self) -> Optional[Tensor]:
        """float32 ``[kept_chunks + 1, N]`` in the weight gradient's buffer ahead of its first slot (bytes the
        backward first writes with chunk 0's ``dW``, after it read them) where the kept chunks hold
        probabilities (:attr:`hugehead.plan.Plan.kept_probs`): row ``k`` the reference kept chunk ``k``'s values
        are relative to, the last row the forward's target logits. None where nothing is kept there or the gap is
        too small."""
        need = scale_area_bytes(self.plan.kept_chunks, self.n)
        if self.slots is None:
            return None
        raw, offset, _ = self.slots
        if offset < need:
            return None
        return raw[:need].view(torch.float32).view(self.plan.kept_chunks + 1, self.n)

    def regions(self) -> List[Tuple[int, Tensor]]:
        """The kept chunks as ``(first chunk, [chunks, N, cols] view)`` per storage: the weight gradient's
        buffer's slots (strided, as :meth:`chunk` finds them), then ``kept``."""
        out = []
        if self.in_grad:
            raw, offset, stride = self.slots
            size = self.kept.element_size()
            flat = raw.view(self.kept.dtype)[offset // size:]
            out.append((0, flat.as_strided((self.in_grad, self.n, self.plan.cols), (stride // size, self.plan.cols, 1))))
        if self.kept.numel():
            out.append((self.in_grad, self.kept))
        return out

    def put_rows(self, chunk: Tensor, col: Tensor, where: Tensor, values: Tensor) -> None:
        """Entry ``(row i, column col[i])`` of kept chunk ``chunk[i]`` set to ``values[i]`` where ``where[i]``
        (``[N]`` each): one gather and one scatter per storage region. Each row writes one entry of its own
        (the others write back what they read), so the scatter has no conflicts."""
        rows = torch.arange(self.n, device=chunk.device)
        for first, view in self.regions():
            count = view.shape[0]
            ours = where & (chunk >= first) & (chunk < first + count)
            k = (chunk - first).clamp(0, count - 1)
            view[k, rows, col] = torch.where(ours, values.to(view.dtype), view[k, rows, col])

    def chunk(self, i: int, width: int) -> Tensor:
        if i < self.in_grad:
            raw, offset, stride = self.slots
            start = offset + i * stride
            size = self.n * self.plan.cols * self.kept.element_size()
            return raw[start:start + size].view(self.kept.dtype).view(self.n, self.plan.cols)[:, :width]
        return self.kept[i - self.in_grad, :, :width]


def _ptr(t: Optional[Tensor]) -> int:
    return -1 if t is None or t.numel() == 0 else t.data_ptr()


def _spare(kept: Optional[Tensor], numel: int) -> Optional[Tensor]:
    """The kept tensor's memory as a flat buffer of ``numel`` elements of its dtype (None: too small, or no kept
    tensor): free for other use once every kept chunk's GEMMs are queued (the factored backward takes them
    first; the stream orders what comes after)."""
    if kept is None or numel <= 0 or kept.numel() < numel or not kept.is_contiguous():
        return None
    return kept.view(-1)[:numel]


def _kept_last(source, kept_classes: int) -> bool:
    """Whether the forward takes the kept chunks (the first ``kept_classes`` classes) after the others: a
    resident shard that keeps some of its chunks and not all (:func:`_forward_chunks`)."""
    return isinstance(source, ResidentChunks) and 0 < kept_classes < source.num_rows


def _forward_chunks(source, cols: int, kept_classes: int, lead_cols: Optional[int] = None):
    """The forward's chunks: where :func:`_kept_last`, the chunks not kept first (``lead_cols`` wide, default
    ``cols``), so that each kept chunk's statistics GEMM finds every row's max over most classes to fold against
    (:func:`ops.gemm_chunk_stats_`'s ``reference``). Returns the chunks and whether they come in that order. The
    sums then fold in this order on every path (same bits on each)."""
    if _kept_last(source, kept_classes):
        return source.chunks(cols, last=kept_classes, lead_cols=lead_cols), True
    return source.chunks(cols), False
