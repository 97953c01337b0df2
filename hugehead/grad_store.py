"""Where kept logits live in the weight gradient's buffer before the backward writes it: the byte layout the
planner counts slots in and the loop reads and writes them by.
"""
from __future__ import annotations

from typing import Tuple

__all__ = ["grad_store_layout", "scale_area_bytes"]


def scale_area_bytes(kept_chunks: int, n: int) -> int:
    """Bytes of the references a plan of kept probabilities keeps ahead of the weight gradient buffer's first slot
    (``hugehead.loop.kept.KeptLogits.scale_area``): ``kept_chunks + 1`` float32 rows of ``N``."""
    return (kept_chunks + 1) * n * 4


_STORE_ALIGN = 256  # bytes: a kept chunk's first row in the gradient's buffer (16 for the GEMMs' TMA loads)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def grad_store_layout(n: int, d: int, v: int, cols: int, itemsize: int, grad_itemsize: int) -> Tuple[int, int, int]:
    """Where kept logits can live in the weight gradient's buffer ``[V, D]`` (``grad_itemsize`` bytes an
    element) before the backward writes it: ``(offset, stride, slots)``, in bytes, a kept chunk ``[N, cols]``
    (``itemsize`` bytes an element) ``i < slots`` at ``offset + i * stride``.

    The backward takes the chunks in order and writes chunk ``i``'s ``dW`` (rows ``[i cols, (i + 1) cols)``,
    bytes up to ``(i + 1) cols D grad_itemsize``) while it reads chunk ``i``'s gradient: the first slot starts
    past one chunk's ``dW`` and a slot is at least as long as one, so that write ends at or before slot ``i``'s
    start (``(i + 1) dW ≤ offset + i stride``), over slots already consumed. Where a chunk's logits are
    smaller than its ``dW`` (``N itemsize < D grad_itemsize``) nothing lives there (0 slots)."""
    chunk_bytes = n * cols * itemsize
    dw_bytes = cols * d * grad_itemsize
    if chunk_bytes < dw_bytes or cols <= 0 or n <= 0:
        return 0, 0, 0
    offset = _round_up(dw_bytes, _STORE_ALIGN)
    stride = _round_up(chunk_bytes, _STORE_ALIGN)
    total = v * d * grad_itemsize
    return offset, stride, max(0, (total - offset) // stride)
