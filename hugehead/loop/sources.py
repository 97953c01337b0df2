"""Weight-chunk sources: where the loop gets each chunk of a shard's weight (and puts its gradient).

:class:`ResidentChunks` slices a shard that lives on the compute device (casting each chunk to the compute dtype
under autocast, never the whole weight); the offload engine's source hands out device buffers that a copy stream
filled from pinned host memory. The loop does not know which.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["WeightChunk", "ResidentChunks"]


class WeightChunk(NamedTuple):
    """Classes ``[c0, c1)`` of a shard (local ids): ``weight [c1 - c0, D]`` and ``bias`` in the compute
    dtype, on the compute device."""

    c0: int
    c1: int
    weight: Tensor
    bias: Optional[Tensor]


class ResidentChunks:
    """The source of a shard that lives on the compute device: chunks are slices of the Parameters,
    cast to ``compute_dtype`` one chunk at a time when stored in another dtype (float32 master weights
    under autocast). Gradients are written into ``[V_k, D]`` tensors in the Parameters' dtype.

    Args:
        weight: ``[V_k, D]``; bias: ``[V_k]`` or None; compute_dtype: dtype of ``x`` and the logits.
    """

    # Chunk j - 1 stays valid while chunk j is fetched (slices, or casts the caller holds).
    lookahead = True

    def __init__(self, weight: Tensor, bias: Optional[Tensor], compute_dtype: torch.dtype,
                 grad_weight_into: Optional[Tensor] = None):
        self.weight = weight
        self.bias = bias
        self.compute_dtype = compute_dtype
        # The buffer the weight's gradient goes into (the forward's, which held kept logits: KeptLogits), or
        # None: a fresh one at start_grads.
        self.grad_weight_into = grad_weight_into
        self.grad_weight: Optional[Tensor] = None
        self.grad_bias: Optional[Tensor] = None

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.weight.dtype

    def chunks(self, cols: int, last: int = 0, lead_cols: Optional[int] = None) -> Iterator[WeightChunk]:
        """Chunks ``[0, cols), [cols, 2 cols), …`` of the shard in the compute dtype; with ``last`` (a multiple
        of ``cols``), those from ``last`` on first, ``lead_cols`` wide (default ``cols``), and then those before
        it (:func:`hugehead.loop.kept._forward_chunks`)."""
        bounds = [(c0, min(c0 + cols, self.num_rows)) for c0 in range(0, self.num_rows, cols)]
        if 0 < last < self.num_rows:
            lead = lead_cols or cols
            bounds = ([(c0, min(c0 + lead, self.num_rows)) for c0 in range(last, self.num_rows, lead)]
                      + [(c0, min(c0 + cols, last)) for c0 in range(0, last, cols)])
        for c0, c1 in bounds:
            w = self.weight[c0:c1]
            b = None if self.bias is None else self.bias[c0:c1]
            if w.dtype != self.compute_dtype:
                w = w.to(self.compute_dtype)
            if b is not None and b.dtype != self.compute_dtype:
                b = b.to(self.compute_dtype)
            yield WeightChunk(c0, c1, w, b)

    # Gradient sink -------------------------------------------------------------------------------
    def start_grads(self, need_bias: bool) -> None:
        out, self.grad_weight_into = self.grad_weight_into, None
        self.grad_weight = out if out is not None else torch.empty_like(self.weight, memory_format=torch.contiguous_format)
        self.grad_bias = torch.empty_like(self.bias) if (need_bias and self.bias is not None) else None

    def grad_weight_out(self, c0: int, c1: int, dtype: torch.dtype) -> Optional[Tensor]:
        """Where a ``dW`` chunk computed in ``dtype`` can be written directly (None: hand it to
        :meth:`put_grad`, which converts)."""
        return self.grad_weight[c0:c1] if self.grad_weight.dtype == dtype else None

    def put_grad(self, c0: int, c1: int, grad_weight: Optional[Tensor], grad_bias: Optional[Tensor]) -> None:
        """Store chunk gradients (either may be None when already written in place)."""
        if grad_weight is not None:
            self.grad_weight[c0:c1].copy_(grad_weight)
        if grad_bias is not None and self.grad_bias is not None:
            self.grad_bias[c0:c1].copy_(grad_bias)

    def finish_grads(self) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        out = self.grad_weight, self.grad_bias
        self.grad_weight = self.grad_bias = None
        return out
