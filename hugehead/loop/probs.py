"""Kept probabilities: a forward whose kept chunks hold ``exp(z - ref)`` in place of their logits, and the
factored backward that turns them into ``dX`` and ``dW`` with one scale a row and chunk (no pass over them).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops
from ..plan import Plan
from .kept import KeptLogits, _spare
from .sources import WeightChunk

__all__ = ["FACTORED_DROP_GAP"]


def _kept_probs(plan: Plan, slots: Optional[KeptLogits]) -> bool:
    """Whether this step's kept chunks hold probabilities (:attr:`hugehead.plan.Plan.kept_probs`, and chunks are
    kept: a second backward finds none). The planner left room for their references in the weight gradient's
    buffer; a buffer without it is a caller's error, not a path."""
    if not (plan.kept_probs and slots is not None):
        return False
    if slots.scale_area() is None:
        raise RuntimeError("hugehead: the plan keeps probabilities, and the weight gradient's buffer it was given "
                           "has no room for their references")
    return True


# How far above a kept chunk's reference a row's lse may lie before its scale s = g exp(ref - lse) is taken as 0
# there. A kept chunk's values are exp(z - ref) <= 2^80 (the fused op's kFlagSum; the cuBLAS path rebases at
# KEPT_PROBS_REBASE), so such a row's entries p = e exp(ref - lse) are all below 2^80 exp(-144) < 2^-126, the
# exponentials' flush (sfu_exp.cuh). A gap of 60 alone does not bound them: a chunk whose values reach 2^79
# under a lse 61 above its reference holds p ~ e^-6 (a row whose max is in a later kept chunk).
FACTORED_DROP_GAP = 144.0


class _FactoredKept:
    """The backward of kept chunks that hold ``e = exp(z - ref_k)`` (:attr:`hugehead.plan.Plan.kept_probs`; ``ref_k`` chunk
    ``k``'s references, :meth:`KeptLogits.scale_area`): their gradient is ``s_k e`` with one scale a row and
    chunk, ``s_k = (g (1 + 2 z_loss lse) + g_lse) exp(ref_k - lse)``, less ``g`` at the target. So no pass turns
    them into their gradient: ``dW_k = eᵀ (s_k x)`` (``s_k x`` rounded once to x's dtype) and ``dX += s_k (e W_k)``
    (``e W_k`` summed in float32, then scaled), with each kept target's entry of ``e`` set to 0 and its whole
    gradient ``G_t`` (from the forward's target logit in float32, as chunk_grad_ computes it) added apart by
    :meth:`finish`: ``dX += G_t W_t`` and ``dW_t += G_t x`` in float32, after the kept chunks' ``dW`` are written.
    The target's entry is most of a row's gradient (``G_t ~ -g`` where the softmax is wide), and through the
    GEMMs it would be ``round(G_t / s) round(s x)``: two roundings to x's dtype where the logits path has at most
    one (``round(G_t)``, exact when g is a power of two: a mean over 2^k rows), ~1e-3 relative in ``dW``, over an
    order of magnitude more than the logits path's error.

    Everything that is not a chunk's two GEMMs is done once for all kept chunks, here: the ``[kept_chunks, N]``
    scales, and the targets' entries zeroed by one scatter per storage region (:meth:`KeptLogits.regions`), so
    a kept chunk costs two GEMMs and two small elementwise kernels (its ``s_k x`` and the ``dX`` scale) where it
    cost chunk_grad_'s pass over its logits (0.27 ms at xc6M on an H200). A row's other entries keep ``s_k e``
    up to :data:`FACTORED_DROP_GAP` (its lse that far above ``ref_k``), past which ``s_k = 0`` (every such entry
    is below 2^-126). Rows with ``s = 0`` (ignored) have ``s x = 0`` and finite ``e``."""

    def __init__(self, x, target, lse, grad_rows, options, grad_lse, slots: "KeptLogits", class_start, source,
                 writer, grad_x, scratch: Optional[Tensor] = None, grad_x_zero: bool = False):
        acc = lse.dtype
        plan = slots.plan
        k_n, cols = plan.kept_chunks, plan.cols
        area = slots.scale_area()
        g = grad_rows
        scale = g * (1 + 2 * options.z_loss * lse) if options.z_loss else g
        row_scale = scale + grad_lse if grad_lse is not None else scale
        # (all read before chunk 0's dW is written over the area)
        gap = lse[None, :] - area[:k_n]
        self.scales = torch.where(gap <= FACTORED_DROP_GAP, row_scale[None, :] * torch.exp(-gap),
                                  torch.zeros((), dtype=acc, device=x.device))
        p_t = torch.exp(area[k_n] - lse)
        d_t = p_t - 1 + 2 * options.z_loss * lse * p_t if options.z_loss else p_t - 1
        g_t = g * d_t + grad_lse * p_t if grad_lse is not None else g * d_t
        kept_classes = k_n * cols
        local = target - class_start
        inside = (local >= 0) & (local < kept_classes)
        # Rows whose target is not kept (most of them) take a kept class of their own, their row index modulo the
        # kept classes, where they add exact zeros: clamped to the last kept class, thousands of rows would share
        # one class, whose rows index_put_'s kernel sums one after another (milliseconds of a step where spread
        # rows take a fraction of one).
        spread = torch.remainder(torch.arange(local.shape[0], device=local.device), kept_classes)
        cls = torch.where(inside, local, spread)
        k_t = torch.div(cls, cols, rounding_mode="floor")
        # Each kept target's entry of e becomes 0; its G_t is added apart (finish). Rows whose target is not kept
        # add exact zeros there.
        slots.put_rows(k_t, cls - k_t * cols, inside, torch.zeros_like(g_t))
        self.apart = torch.where(inside, g_t, torch.zeros((), dtype=acc, device=x.device))
        self.apart_cls = cls
        self.x, self.source, self.writer, self.slots = x, source, writer, slots
        # The first kept chunk with a grad_x of zeros writes its dX into grad_x itself (a float32 GEMM, then the
        # row scale in place), and its s x into grad_x's bytes before that (the dW GEMM reads it first). Other
        # chunks take dX's float32 product and s x from ``scratch`` (x's dtype: the streamed chunks' workspace,
        # free until the first of them, which the stream orders after these) where it is large enough, else
        # from a buffer of their own, made when first needed.
        self.in_place = (grad_x_zero and grad_x is not None and grad_x.dtype == acc and grad_x.is_contiguous()
                         and acc.itemsize >= x.dtype.itemsize)
        self.scratch = scratch
        self.dx: Optional[Tensor] = None
        self.xs: Optional[Tensor] = None

    def _buffers(self, grad_x: Optional[Tensor]) -> None:
        if self.xs is not None:
            return
        n, d = self.x.shape
        acc = self.scales.dtype
        size = acc.itemsize // self.x.dtype.itemsize
        scratch = self.scratch
        if scratch is None or scratch.numel() < (size + 1) * n * d or scratch.dtype != self.x.dtype:
            scratch = self.x.new_empty((size + 1) * n * d)
        self.dx = scratch[: size * n * d].view(acc).view(n, d) if grad_x is not None else None
        self.xs = scratch[size * n * d: (size + 1) * n * d].view(n, d)

    def chunk(self, chunk: WeightChunk, k: int, e: Tensor, grad_x: Optional[Tensor]) -> None:
        s = self.scales[k][:, None]
        if k == 0 and self.in_place:
            if self.writer is not None:
                self._write_dw(chunk, e, s, grad_x.view(-1).view(self.x.dtype)[: self.x.numel()].view(self.x.shape))
            _mm_float(grad_x, e, chunk.weight)
            grad_x.mul_(s)
            return
        self._buffers(grad_x)
        if self.dx is not None:
            _mm_float(self.dx, e, chunk.weight)
            grad_x.addcmul_(self.dx, s)
        if self.writer is not None:
            self._write_dw(chunk, e, s, self.xs)

    def _write_dw(self, chunk: WeightChunk, e: Tensor, s: Tensor, xs: Tensor) -> None:
        _row_scaled(xs, self.x, s[:, 0])  # in float32 (s's dtype), rounded once to x's dtype
        plain_x, self.writer.x = self.writer.x, xs
        self.writer.write(chunk, e, None)
        self.writer.x = plain_x

    def finish(self, grad_x: Optional[Tensor]) -> None:
        """The targets' gradients taken apart (:attr:`apart`: ``G_t`` where the row's target is kept, else 0), once
        every kept chunk's ``dW`` is written: ``dX += G_t W_t`` in float32, and ``dW_t += G_t x`` (each product
        rounded once to x's dtype: exact when G_t is, as the logits path's ``round(G_t) x``) by
        ``index_put_(accumulate=True)``, whose CUDA kernel sorts the classes and sums each class's rows in order
        onto ``dW_t`` in float32 (deterministic, unlike index_add_'s atomics: many rows may share a target)."""
        n, d = self.x.shape
        # Its two [N, D] temporaries in the kept tensor's memory where it has room (every kept chunk's GEMMs are
        # queued by now), else in the chunks' buffers
        spare = _spare(self.slots.kept, 2 * n * d) if self.x.dtype == self.source.weight.dtype else None
        if spare is None:
            self._buffers(grad_x)
        if grad_x is not None:
            self.targets_dx(grad_x, None if spare is None else spare[n * d:].view(n, d))
        if self.writer is not None:
            self.targets_dw(self.source.grad_weight_out(0, self.source.num_rows, self.x.dtype),
                            self.xs if spare is None else spare[: n * d].view(n, d))

    def targets_dx(self, grad_x: Tensor, rows: Optional[Tensor]) -> None:
        """``grad_x += G_t W_t`` in float32 (grad_x's dtype); ``rows``: an ``[N, D]`` buffer of the weight's dtype
        for the gathered ``W_t`` (None: a new one)."""
        w = self.source.weight
        picked = w[self.apart_cls] if rows is None else torch.index_select(w, 0, self.apart_cls, out=rows)
        grad_x.addcmul_(picked, self.apart[:, None])

    def targets_dw(self, dw: Tensor, xs: Tensor) -> None:
        """``dW_t += G_t x`` by ``index_put_(accumulate=True)``; ``xs``: an ``[N, D]`` buffer of x's dtype (any
        strides) for the products."""
        dw.index_put_((self.apart_cls,), _row_scaled(xs, self.x, self.apart), accumulate=True)


def _row_scaled(out: Tensor, x: Tensor, scale: Tensor) -> Tensor:
    """``out = x * scale[:, None]`` (``scale [N]`` in the accumulation dtype), the product rounded once to ``out``'s
    dtype: :func:`ops.row_scale`, ``torch.mul``'s bits in one vectorized pass where ATen's CUDA kernel takes its
    broadcast-with-cast path, a fraction of the copy bandwidth."""
    return ops.row_scale(out, x, scale)


def _mm_float(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out = a @ b`` into a float32 ``out`` from 16-bit ``a``, ``b``: summed in float32 on CUDA (cuBLAS's
    ``out_dtype``), elsewhere through ``a``'s dtype (as :func:`hugehead.loop.chunks._add_dx`'s partial)."""
    if a.is_cuda:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        out.copy_(torch.mm(a, b))
