"""The per-shard chunk loop every placement engine runs, fed by a weight-chunk source: the driver, which picks the
execution path of the plan it is handed (one file each) and runs it.

The loop streams one shard's classes in chunks of ``C`` (and, for very large batches, the rows in blocks
of ``R``): ``Z = X W_cᵀ + b_c`` goes into a reused workspace (GEMM through ATen), then one of our kernels
folds it into per-row statistics (forward) or turns it into its gradient in place (backward). No
``[N, V]`` tensor is allocated unless the planner chose to keep the logits (they fit the budget), in
which case the backward skips the recompute.

- :mod:`.sources`: the weight-chunk sources (:class:`~hugehead.loop.sources.ResidentChunks`; the offload
  engine's source has the same interface);
- :mod:`.chunks`: the steps every path shares (logits GEMM, statistics and gradient kernels, dX/dW GEMMs);
- :mod:`.streamed`: the one-stream loop; :mod:`.overlapped`: the side-stream loop;
- :mod:`.kept`, :mod:`.probs`: kept logits, and kept probabilities with their factored backward;
- :mod:`.fused`: the fused statistics / gradient GEMM steps; :mod:`.rows`: the rows plan.
"""
from __future__ import annotations

from typing import Callable, Generator, Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from ..options import LossOptions
from ..plan import Plan
from .chunks import RowStats, run_steps
from .overlapped import _backward_overlapped, _forward_overlapped
from .rows import row_block_steps
from .sources import ResidentChunks
from .streamed import _backward_streamed, _forward_streamed

__all__ = [
    "forward_stats_steps",
    "backward_steps",
    "rows_steps",
    "shard_forward_stats",
    "shard_backward",
    "whole_head_backward",
]


def forward_stats_steps(
    x: Tensor,
    source: ResidentChunks,
    target: Tensor,
    class_start: int,
    options: LossOptions,
    plan: Plan,
    store: Optional[Tensor] = None,
) -> Generator[None, None, Tuple[RowStats, Optional[Tensor]]]:
    """Row statistics of one shard's classes ``[class_start, class_start + V_k)``.

    Args:
        x: ``[N, D]`` in the compute dtype on the shard's compute device.
        source: the shard's weight chunks (:class:`ResidentChunks` or the offload engine's source).
        target: ``[N]`` int64 global class ids on the compute device, or a chunk target of
            :mod:`hugehead.targets` (sparse / weighted / one-vs-all: its kernels fill the same statistics).
        options: the loss (its softcap).
        plan: the step's plan for this shard (its backward gets the same one).
        store: the weight gradient's buffer ``[V, D]``, allocated for the backward, where the plan's first
            ``kept_in_grad`` chunks are kept (:class:`~hugehead.loop.kept.KeptLogits`); None where the plan keeps
            none there.
    A generator that yields after queueing each weight chunk's work, so an engine can interleave the
    loops of several devices (:func:`run_steps` runs one alone).

    Returns:
        ``(stats, kept)``: :class:`RowStats` on the compute device (``target_logit`` is 0 for rows whose
        target is not in this shard, so shards merge by summing it), and the kept logits
        ``[kept_chunks, N, cols]`` when ``plan.keep_logits`` (else None), to pass to :func:`shard_backward`.
    """
    if plan.overlap:
        return _forward_overlapped(x, source, target, class_start, options.kernel_softcap, plan, store)
    # Only label smoothing reads the logit sums: without it the fused GEMM skips them.
    return _forward_streamed(x, source, target, class_start, options.kernel_softcap, plan,
                             logit_sum=bool(options.label_smoothing), store=store)


def backward_steps(
    x: Tensor,
    source: ResidentChunks,
    target: Tensor,
    class_start: int,
    num_classes: int,
    lse: Tensor,
    grad_rows: Tensor,
    options: LossOptions,
    plan: Plan,
    grad_x: Optional[Tensor],
    need_weight: bool,
    kept: Optional[Tensor] = None,
    grad_lse: Optional[Tensor] = None,
    store: Optional[Tensor] = None,
    grad_x_zero: bool = False,
) -> Generator[None, None, Tuple[Optional[Tensor], Optional[Tensor]]]:
    """Gradients of one shard, recomputing its logits chunk by chunk (or from ``kept``); a generator
    that yields after each weight chunk (see :func:`forward_stats_steps`).

    Args:
        x: ``[N, D]`` compute dtype on the compute device; source: the shard's weight chunks.
        lse, grad_rows: ``[N]`` accumulation dtype, on the compute device; ``grad_rows`` is
            ``dLoss/dloss_row`` and zero on ignored rows. grad_lse: ``[N]`` gradient reaching a returned
            lse, or None.
        options: the loss. plan: the forward's plan of this shard (never planned again here: the chunk
            widths, and with them the order of the dX sums, are the forward's).
        grad_x: ``[N, D]`` accumulation-dtype buffer that ``dX`` of this shard is added into, or None.
        need_weight: compute ``dW`` (and ``db`` when the shard has a bias).
        kept: the kept logits ``[kept_chunks, N, cols]`` from :func:`forward_stats_steps` (None: a second
            backward, or nothing was kept: every chunk is recomputed); overwritten by their gradient.
        store: the weight gradient's buffer holding the plan's ``kept_in_grad`` chunks
            (:class:`~hugehead.loop.kept.KeptLogits`; the source writes ``dW`` into it), or None.
        grad_x_zero: ``grad_x`` holds zeros (this shard's ``dX`` is all it will hold): the factored backward
            then writes its first kept chunk's ``dX`` into it rather than through a buffer of its own.
    Returns:
        ``(grad_weight [V_k, D], grad_bias [V_k] or None)`` in the stored dtype, from the source's
        gradient sink, each chunk written once (no atomics: deterministic), or ``(None, None)``.
    """
    args = (x, source, target, class_start, num_classes, lse, grad_rows, options, plan, grad_x, need_weight, kept,
            grad_lse, store)
    if plan.overlap:
        return _backward_overlapped(*args)
    return _backward_streamed(*args, grad_x_zero=grad_x_zero)


def rows_steps(x: Tensor, source: ResidentChunks, target, *args, **kwargs
               ) -> Generator[None, None, Tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]]:
    """The ``"rows"`` plan's pass: :func:`hugehead.loop.rows.row_block_steps` (whose docstring gives the other
    arguments and the results), per-row losses and every gradient of one shard holding all ``V`` classes."""
    return row_block_steps(x, source, target, *args, **kwargs)


def shard_forward_stats(*args, after_first: Optional[Callable[[], None]] = None,
                        **kwargs) -> Tuple[RowStats, Optional[Tensor]]:
    """:func:`forward_stats_steps` run to its end (``after_first``: as :func:`run_steps`')."""
    return run_steps(forward_stats_steps(*args, **kwargs), after_first)


def shard_backward(*args, **kwargs) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """:func:`backward_steps` run to its end."""
    return run_steps(backward_steps(*args, **kwargs))


def whole_head_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target, lse: Tensor, grad_rows: Tensor,
                        options: LossOptions, plan: Plan, need_x: bool, need_weight: bool, kept: Tensor,
                        grad_lse: Optional[Tensor] = None, store: Optional[Tensor] = None
                        ) -> Tuple[Tensor, Tensor, Tensor]:
    """The backward of a head whose whole weight ``[V, D]`` is one shard on ``x``'s device (the registered
    ops of :mod:`hugehead.functional` and :mod:`hugehead.multilabel`): ``(dX [N, D] in x's dtype, dW [V, D],
    db [V])``, a gradient not asked for (or db without bias) empty. Non-empty ``kept`` logits are turned
    into their gradient in place (no recompute); ``store``: the weight gradient's buffer from the forward, which
    holds the plan's ``kept_in_grad`` chunks (:class:`~hugehead.loop.kept.KeptLogits`) and becomes ``dW`` (None: a
    fresh one). The caller holds the no-autocast and out-of-memory guards."""
    keep = kept.numel() > 0 or (store is not None and plan.kept_in_grad > 0)
    # All logits kept as one chunk (plan_chunks(direct_dx=True)): dX is one GEMM of their gradient
    # straight into x's dtype, as F.linear's backward does; no accumulation buffers.
    direct = (keep and kept.dim() == 3 and kept.shape[0] == 1 and kept.shape[2] == weight.shape[0]
              and weight.dtype == x.dtype and plan.kept_in_grad == 0)
    grad_x = torch.zeros(x.shape, dtype=ops.acc_dtype(x.dtype), device=x.device) if (need_x and not direct) else None
    grad_w, grad_b = shard_backward(
        x, ResidentChunks(weight, bias, x.dtype, grad_weight_into=store if need_weight else None), target, 0,
        weight.shape[0], lse, grad_rows, options, plan, grad_x, need_weight, kept=kept if keep else None,
        grad_lse=grad_lse, store=store, grad_x_zero=True,
    )
    if need_x and direct:
        grad_x = torch.mm(kept[0], weight)  # kept[0] now holds the logits' gradient
    # A gradient not asked for is a fresh empty tensor each: custom op outputs may not alias each other.
    return (
        grad_x.to(x.dtype) if grad_x is not None else x.new_empty(0),
        grad_w if grad_w is not None else x.new_empty(0),
        grad_b if grad_b is not None else x.new_empty(0),
    )
