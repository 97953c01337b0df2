"""The per-shard chunk loop every placement engine runs, fed by a weight-chunk source.

The loop streams one shard's classes in chunks of ``C`` (and, for very large batches, the rows in blocks
of ``R``): ``Z = X W_cᵀ + b_c`` goes into a reused workspace (GEMM through ATen), then one of our kernels
folds it into per-row statistics (forward) or turns it into its gradient in place (backward). No
``[N, V]`` tensor is allocated unless the planner chose to keep the logits (they fit the budget), in
which case the backward skips the recompute.

Weight chunks come from a *source*: :class:`ResidentChunks` slices a shard that lives on the compute
device (casting each chunk to the compute dtype under autocast, never the whole weight); the offload
engine's source hands out device buffers that a copy stream filled from pinned host memory. The loop
does not know which.
"""
from __future__ import annotations

import math
from typing import Callable, Generator, Iterator, List, NamedTuple, Optional, Tuple, TypeVar

import torch
from torch import Tensor

from . import ops
from .options import LossOptions, row_losses
from .plan import (  # noqa: F401  (re-exported: the planner's names were public here before plan.py)
    _MAX_COLS,
    DEFAULT_MEMORY_BUDGET,
    FUSED_STATS_WIDEN,
    Plan,
    grad_store_layout,
    kept_plan,
    kept_shape,
    plan_chunks,
    plan_topk_chunks,
    scale_area_bytes,
)

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "Plan",
    "plan_chunks",
    "plan_topk_chunks",
    "kept_plan",
    "kept_shape",
    "KeptLogits",
    "RowStats",
    "WeightChunk",
    "ResidentChunks",
    "shard_forward_stats",
    "merge_row_stats",
    "shard_backward",
    "forward_stats_steps",
    "backward_steps",
    "rows_steps",
    "run_steps",
    "step_result",
]

T = TypeVar("T")


# --------------------------------------------------------------------------------------------------
# Weight-chunk sources
# --------------------------------------------------------------------------------------------------
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
        it (:func:`_forward_chunks`)."""
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


# --------------------------------------------------------------------------------------------------
# The chunk loop (one shard on one device)
# --------------------------------------------------------------------------------------------------
class KeptLogits:
    """Where a plan's kept chunks live between forward and backward: the first ``plan.kept_in_grad`` in the
    weight gradient's buffer ``store [V, D]`` (:func:`hugehead.plan.grad_store_layout`: laid out so that the
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
        probabilities (:func:`_probs_plan`): row ``k`` the reference kept chunk ``k``'s values are relative to,
        the last row the forward's target logits. None where nothing is kept there or the gap is too small."""
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


class RowStats(NamedTuple):
    """Per-row statistics of one shard (or merged over shards), all ``[N]`` in the accumulation dtype."""

    max: Tensor
    sumexp: Tensor
    target_logit: Tensor
    logit_sum: Tensor


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


def _ptr(t: Optional[Tensor]) -> int:
    return -1 if t is None or t.numel() == 0 else t.data_ptr()


def _spare(kept: Optional[Tensor], numel: int) -> Optional[Tensor]:
    """The kept tensor's memory as a flat buffer of ``numel`` elements of its dtype (None: too small, or no kept
    tensor): free for other use once every kept chunk's GEMMs are queued (the factored backward takes them
    first; the stream orders what comes after)."""
    if kept is None or numel <= 0 or kept.numel() < numel or not kept.is_contiguous():
        return None
    return kept.view(-1)[:numel]


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
    holds the plan's ``kept_in_grad`` chunks (:class:`KeptLogits`) and becomes ``dW`` (None: a fresh one). The
    caller holds the no-autocast and out-of-memory guards."""
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
            ``kept_in_grad`` chunks are kept (:class:`KeptLogits`); None where the plan keeps none there.
    A generator that yields after queueing each weight chunk's work, so an engine can interleave the
    loops of several devices (:func:`run_steps` runs one alone).

    Returns:
        ``(stats, kept)``: :class:`RowStats` on the compute device (``target_logit`` is 0 for rows whose
        target is not in this shard, so shards merge by summing it), and the kept logits
        ``[kept_chunks, N, cols]`` when ``plan.keep_logits`` (else None), to pass to :func:`shard_backward`.
    """
    # The fused GEMM has no side-stream kernel to overlap: its chunks take the one-stream loop.
    if _overlapped(plan, x, source) and not fused_applies(x, target):
        return _forward_overlapped(x, source, target, class_start, options.kernel_softcap, plan, store)
    # Only label smoothing reads the logit sums: without it the fused GEMM skips them.
    return _forward_streamed(x, source, target, class_start, options.kernel_softcap, plan,
                             logit_sum=bool(options.label_smoothing), store=store)


def _overlapped(plan: Plan, x: Tensor, source) -> bool:
    """Whether the loop runs its side-stream variant: the plan has two workspaces, rows whole, and this is
    not a graph being traced by torch.compile (a traced head runs one stream; inside the functional's
    opaque op the loop runs eagerly and overlaps)."""
    n = x.shape[0]
    return (plan.overlap and x.is_cuda and plan.rows >= n and n > 0 and source.num_rows > 0
            and not torch.compiler.is_compiling())


def _new_stats(x: Tensor) -> RowStats:
    n, acc = x.shape[0], ops.acc_dtype(x.dtype)
    # Four tensors of their own, not rows of one buffer: ops return some of them (target_logit, logit_sum) as
    # outputs, which may not share storage with each other (torch.library) nor start at an offset (their fakes).
    return RowStats(
        torch.full((n,), -math.inf, dtype=acc, device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
    )


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


def _probs_plan(x: Tensor, source, target, plan: Plan, slots: Optional[KeptLogits], kept_last: bool, fused: bool,
                logit_sum: bool, softcap: float) -> bool:
    """Whether the forward's kept chunks hold ``exp(z - ref)`` (``ref``: each row's max over the chunks not
    kept) in place of their logits, for the factored backward (:class:`_FactoredKept`): the fused statistics
    GEMM folding against that reference (bf16, no bias, softcap or logit sums, rows whole, the others first),
    and room in the weight gradient's buffer to tell the backward the references (:meth:`KeptLogits.scale_area`).
    The forward and the backward both ask it (the same inputs, options and plan: the same answer), so nothing
    else tells the backward what its kept chunks hold. Elsewhere the kept chunks hold their logits and
    chunk_grad_ turns them into their gradient."""
    return (fused and kept_last and slots is not None and isinstance(target, Tensor) and plan.rows >= x.shape[0]
            and x.dtype == torch.bfloat16 and source.weight.dtype == x.dtype and source.bias is None
            and not logit_sum and not softcap and slots.scale_area() is not None)


def _forward_streamed(x, source, target, class_start, softcap, plan, logit_sum=True, store=None):
    """:func:`forward_stats_steps` on one stream (any rows split)."""
    n = x.shape[0]
    v = source.num_rows
    stats = _new_stats(x)
    kept = x.new_empty(kept_shape(plan, n)) if plan.keep_logits else None
    slots = KeptLogits(plan, kept, store, n) if kept is not None else None
    if n == 0 or v == 0:
        return stats, kept
    kept_classes = plan.kept_chunks * plan.cols if kept is not None else 0
    fused = fused_applies(x, target)
    workspace = None  # allocated at the first chunk that needs stored logits (none when every one is fused)
    cols = _fused_stats_cols(plan, source) if (fused and kept is None) else plan.cols
    # The chunks not kept, folded first, take the fused GEMM's wider chunks too (partials only, no workspace:
    # fewer GEMMs and merges), where x suits its loads (else each would need a workspace that wide).
    widen = fused and kept is not None and _tma_ready(x)
    # Chunks outer, rows inner: each weight chunk is fetched once, however many row blocks there are.
    chunks, kept_last = _forward_chunks(source, cols, kept_classes,
                                        _fused_stats_cols(plan, source) if widen else None)
    probs = _probs_plan(x, source, target, plan, slots, kept_last, fused, logit_sum, softcap)
    exact = _exact_logits(x, source, target, softcap, logit_sum)
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
                _stored_stats(xr, chunk, z, target, r0, r1, class_start + chunk.c0, softcap, rows, fused,
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


# -- the chunk steps through the CUTLASS GEMMs with the statistics (forward) or dLoss/dlogits
# (backward) in their epilogues.
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
    (:func:`_forward_chunks`), which the GEMM folds against (no tile maxima); ``probs``: ``z`` then gets
    ``exp(min(z - reference, 80))`` in place of the logits (:func:`_probs_plan`), on either path."""
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


def _exact_logits(x: Tensor, source, target, softcap: float, smoothing: bool) -> bool:
    """Whether the chunks the forward does not keep take the float32 accumulator as each logit on both sides
    (:func:`ops.gemm_chunk_stats_` / :func:`ops.gemm_chunk_grad_` ``exact``): both fused (a chunk whose layout
    the fused GEMMs refuse takes cuBLAS on both sides alike), no bias, softcap or label smoothing (the forward's
    logit sums: the 128 x 192 fold has none) and a depth under :data:`FUSED_STORE_MAX_DEPTH` (the rounded
    logits would cost a cvt a pair and two integer ops an element in both epilogues). The forward and the backward ask it of the same inputs and options: the same answer, so a confident row's
    ``p - 1`` sees the forward's lse and the backward's logits as the same numbers. Kept chunks keep their
    rounded logits (stored, and read back by the backward)."""
    return (not softcap and not smoothing and source.bias is None and x.shape[1] < FUSED_STORE_MAX_DEPTH
            and fused_applies(x, target))


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


def _forward_overlapped(x, source, target, class_start, softcap, plan, store=None):
    """:func:`forward_stats_steps` with the statistics kernel of chunk ``j`` on the side stream while the
    main stream computes chunk ``j + 1``'s logits (rows whole)."""
    n = x.shape[0]
    stats = _new_stats(x)
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


def merge_row_stats(parts: List[RowStats]) -> Tuple[Tensor, Tensor, Tensor]:
    """Merge per-shard statistics (all on one device) into ``(lse, target_logit, logit_sum)``."""
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
    GEMM that sums in float32 into ``grad_x`` itself (cuBLAS's addmm with ``out_dtype``), elsewhere through a partial in the compute dtype, each chunk's partial rounded on its own
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
        store: the weight gradient's buffer holding the plan's ``kept_in_grad`` chunks (:class:`KeptLogits`;
            the source writes ``dW`` into it), or None.
        grad_x_zero: ``grad_x`` holds zeros (this shard's ``dX`` is all it will hold): the factored backward
            then writes its first kept chunk's ``dX`` into it rather than through a buffer of its own.
    Returns:
        ``(grad_weight [V_k, D], grad_bias [V_k] or None)`` in the stored dtype, from the source's
        gradient sink, each chunk written once (no atomics: deterministic), or ``(None, None)``.
    """
    args = (x, source, target, class_start, num_classes, lse, grad_rows, options, plan, grad_x, need_weight, kept,
            grad_lse, store)
    # The fused gradient GEMM has no side-stream kernel to overlap: its chunks take the one-stream loop.
    if _overlapped(plan, x, source) and getattr(source, "lookahead", False) and not fused_applies(x, target):
        return _backward_overlapped(*args)
    return _backward_streamed(*args, grad_x_zero=grad_x_zero)


def _backward_streamed(x, source, target, class_start, num_classes, lse, grad_rows, options, plan, grad_x,
                       need_weight, kept, grad_lse, store=None, grad_x_zero=False):
    """:func:`backward_steps` on one stream (any rows split)."""
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
    fused = fused_applies(x, target)
    exact = _exact_logits(x, source, target, options.kernel_softcap, bool(options.label_smoothing))  # as the forward
    kept_classes = plan.kept_chunks * plan.cols if kept is not None else 0
    slots = KeptLogits(plan, kept, store, n) if kept is not None else None
    probs = kept_classes > 0 and _probs_plan(x, source, target, plan, slots, _kept_last(source, kept_classes),
                                             fused_applies(x, target), bool(options.label_smoothing),
                                             options.kernel_softcap)
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


# How far above a kept chunk's reference a row's lse may lie before its scale s = g exp(ref - lse) is taken as 0
# there. A kept chunk's values are exp(z - ref) <= 2^80 (the fused op's kFlagSum; the cuBLAS path rebases at
# KEPT_PROBS_REBASE), so such a row's entries p = e exp(ref - lse) are all below 2^80 exp(-144) < 2^-126, the
# exponentials' flush (sfu_exp.cuh). A gap of 60 alone does not bound them: a chunk whose values reach 2^79
# under a lse 61 above its reference holds p ~ e^-6 (a row whose max is in a later kept chunk).
FACTORED_DROP_GAP = 144.0


class _FactoredKept:
    """The backward of kept chunks that hold ``e = exp(z - ref_k)`` (:func:`_probs_plan`; ``ref_k`` chunk
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
    ``out_dtype``), elsewhere through ``a``'s dtype (as :func:`_add_dx`'s partial)."""
    if a.is_cuda:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        out.copy_(torch.mm(a, b))


def _backward_overlapped(x, source, target, class_start, num_classes, lse, grad_rows, options, plan, grad_x,
                         need_weight, kept, grad_lse, store=None):
    """:func:`backward_steps` (rows whole) as a two-stage pipeline: chunk ``j``'s logits (main stream)
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


# --------------------------------------------------------------------------------------------------
# The rows plan: a scalar loss's gradients in the forward, one block of rows over all classes at a time
# --------------------------------------------------------------------------------------------------
def rows_steps(
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
    fused = fused_applies(x, target)
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
                          stats, fused, fold_sums)
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
