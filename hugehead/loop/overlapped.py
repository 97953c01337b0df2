"""The overlapped loop (CUDA, rows whole): each chunk's memory-bound kernel (statistics, gradient) on a side stream
while the main stream's GEMMs go on with the next chunk.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from ..plan import kept_shape
from .chunks import _WeightGradWriter, _add_dx, _chunk_grad, _chunk_stats, _logits_into, _new_stats, _workspace_view
from .kept import KeptLogits, _forward_chunks
from .sources import WeightChunk

__all__: list = []


_SIDE_STREAMS = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for the memory-bound kernels of the overlapped loop."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


class _Overlap:
    """Two workspaces on one CUDA device: the main (current) stream writes logits chunk ``j`` into
    workspace ``j % 2``; the side stream runs the memory-bound kernel on it; events order the two, so
    workspace ``j % 2`` is not overwritten (chunk ``j + 2``) before the side stream is done with it and
    the main stream reads a gradient only once the side stream wrote it. Deterministic: every kernel
    reads and writes what it would in the one-stream loop."""

    def __init__(self, x: Tensor, rows: int, cols: int):
        self.main = torch.cuda.current_stream(x.device)
        self.side = _side_stream(x.device)
        self.buffers = [x.new_empty(rows * cols), x.new_empty(rows * cols)]
        self.side_done: List[Optional[torch.cuda.Event]] = [None, None]

    def workspace(self, j: int, rows: int, cols: int) -> Tensor:
        """Workspace of chunk ``j``, once the side stream finished with chunk ``j - 2`` (main stream)."""
        if self.side_done[j % 2] is not None:
            self.main.wait_event(self.side_done[j % 2])
        return _workspace_view(self.buffers[j % 2], rows, cols)

    def on_side(self, j: int):
        """Context for chunk ``j``'s side-stream work, after what the main stream queued so far."""
        self.side.wait_stream(self.main)
        return torch.cuda.stream(self.side)

    def side_finished(self, j: int) -> None:
        event = torch.cuda.Event()
        event.record(self.side)
        self.side_done[j % 2] = event

    def join(self) -> None:
        """The main stream waits for everything queued on the side stream (before results are used or
        the workspaces freed)."""
        self.main.wait_stream(self.side)


def _forward_overlapped(x, source, target, class_start, softcap, plan, store=None):
    """:func:`hugehead.loop.forward_stats_steps` with the statistics kernel of chunk ``j`` on the side stream while the
    main stream computes chunk ``j + 1``'s logits (rows whole)."""
    n = x.shape[0]
    stats = _new_stats(x, target)
    kept = x.new_empty(kept_shape(plan, n)) if plan.keep_logits else None
    slots = KeptLogits(plan, kept, store, n) if kept is not None else None
    kept_classes = plan.kept_chunks * plan.cols if kept is not None else 0
    lanes = _Overlap(x, n, min(plan.cols, source.num_rows))
    for j, chunk in enumerate(_forward_chunks(source, plan.cols, kept_classes)[0]):
        width = chunk.c1 - chunk.c0
        if chunk.c0 < kept_classes:
            z = slots.chunk(chunk.c0 // plan.cols, width)
        else:
            z = lanes.workspace(j, n, width)
        _logits_into(x, chunk, z)
        with lanes.on_side(j):
            _chunk_stats(target, 0, n, z, class_start + chunk.c0, softcap, stats)
        lanes.side_finished(j)
        yield
    lanes.join()
    return stats, kept


def _backward_overlapped(x, source, target, class_start, num_classes, lse, grad_rows, options, plan, grad_x,
                         need_weight, kept, grad_lse, store=None):
    """:func:`hugehead.loop.backward_steps` (rows whole) as a two-stage pipeline: chunk ``j``'s logits (main stream)
    and gradient kernel (side stream) are queued before chunk ``j - 1``'s dX and dW GEMMs (main stream),
    so the gradient kernel runs beside those GEMMs. Needs a source whose chunk ``j - 1`` stays valid
    while chunk ``j`` is fetched (``source.lookahead``)."""
    n, d = x.shape
    acc = ops.acc_dtype(x.dtype)
    if need_weight:
        source.start_grads(need_bias=True)
    kept_classes = plan.kept_chunks * plan.cols if kept is not None else 0
    slots = KeptLogits(plan, kept, store, n) if kept is not None else None
    lanes = _Overlap(x, n, min(plan.cols, source.num_rows)) if kept_classes < source.num_rows else None
    dx_partial = x.new_empty(n, d) if (grad_x is not None and grad_x.dtype != x.dtype) else None
    dw_writer = _WeightGradWriter(source, x, min(plan.cols, source.num_rows))
    ready: List[Tuple[WeightChunk, Tensor, torch.cuda.Event]] = []
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)

    def produce(j: int, chunk: WeightChunk) -> None:
        width = chunk.c1 - chunk.c0
        if chunk.c0 < kept_classes:
            g = slots.chunk(chunk.c0 // plan.cols, width)
        else:
            g = _logits_into(x, chunk, lanes.workspace(j, n, width))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _chunk_grad(target, 0, n, g, class_start + chunk.c0, num_classes, lse, grad_rows, options.label_smoothing,
                        options.z_loss, options.kernel_softcap, grad_lse)
        done = torch.cuda.Event()
        done.record(side)
        if lanes is not None and chunk.c0 >= kept_classes:
            lanes.side_done[j % 2] = done
        ready.append((chunk, g, done))

    def consume() -> None:
        chunk, g, done = ready.pop(0)
        main.wait_event(done)
        if grad_x is not None:
            _add_dx(grad_x, g, chunk.weight, dx_partial)
        if need_weight:
            dw_writer.write(chunk, g, g.sum(dim=0, dtype=acc) if source.bias is not None else None)

    for j, chunk in enumerate(source.chunks(plan.cols)):
        produce(j, chunk)
        if len(ready) > 1:
            consume()
        yield
    while ready:
        consume()
    main.wait_stream(side)
    if need_weight:
        return source.finish_grads()
    return None, None
