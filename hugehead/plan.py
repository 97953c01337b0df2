"""Every workspace decision of a step within its memory budget (:mod:`hugehead.budget`): the chunk shape of a
shard's loop (:class:`Plan`), which logits are kept between forward and backward (and which of them in the weight
gradient's buffer, :mod:`hugehead.grad_store`), the offload engine's caps on a streamed chunk, and the
out-of-memory message that states what was chosen.

A plan is made once per step, in the forward, and travels with the saved inputs to the backward
(DESIGN.md): the backward never asks the planner again, so the chunk widths — and with them the order
of the ``dX`` sums — are those of the forward, whatever the free memory did in between.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops, tuning
from .budget import Budget, resolve_budget
from .grad_store import grad_store_layout, scale_area_bytes

__all__ = [
    "Plan", "Operands", "fused_gemms", "plan_chunks", "plan_rows", "plan_loss", "plan_topk_chunks", "plan_streamed",
    "kept_shape", "stream_cols", "cap_plan",
    "ROWS_BLOCKS", "ROWS_MIN_BLOCK_ROWS", "ROWS_MIN_SPLIT_ROWS", "SLOT_BYTES", "STREAM_MAX_COLS", "WEIGHT_RING_DEPTH",
    "GRAD_RING_DEPTH", "FUSED_STATS_WIDEN", "FUSED_STORE_MAX_DEPTH",
]

_MAX_COLS = {"cuda": 65536, "cpu": 8192}
_MIN_COLS = 256
# CUDA: a streamed chunk of about 2**28 logits (512 MiB in bf16), i.e. 65536 / 32768 / 16384 classes at
# N = 4096 / 8192 / 16384 rows: wide enough that a chunk's four GEMMs run near their peak, narrow enough
# that its logits stay a small part of the memory budget (tools/split_lce.py --widths sweeps the widths).
_CHUNK_ELEMS = {"cuda": 1 << 28}

# Offload: bytes of one weight slot of the ring at most (a chunk of 256 MiB still copies at full PCIe
# speed), and the widest planned chunk of a streamed shard (the planner's streaming width on a GPU).
SLOT_BYTES = 256 << 20
STREAM_MAX_COLS = 32768
_MIN_STREAM_COLS = 256
# Offload rings. Weight slots: the chunk computing, the one before it (still read by the overlapped
# backward) and two in flight. dW slots: one being written while the two before it are copied out.
WEIGHT_RING_DEPTH = 4
GRAD_RING_DEPTH = 3


# --------------------------------------------------------------------------------------------------
# The plan of one shard's chunk loop
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Everything one shard's chunk loop executes: ``rows`` × ``cols`` logits at a time, and the path of each step.

    ``keep_logits``: the forward writes its first ``kept_chunks`` chunks into a kept
    ``[kept_chunks, N, cols]`` tensor (:func:`kept_shape`) that the backward turns into their gradient in
    place, skipping their recompute (6·N·D·V FLOPs instead of 8 for the kept classes); the other chunks
    stream through the workspace as usual. ``kept_in_grad`` of those chunks (the first ones) live in the weight
    gradient's own buffer instead (:func:`hugehead.grad_store.grad_store_layout`), allocated at the forward
    rather than the backward: memory the backward takes anyway, so they cost nothing against the budget.

    ``overlap`` (CUDA): two workspaces, and each chunk's memory-bound kernel (statistics, gradient) runs
    on a side stream while the main stream's GEMMs go on with the next chunk.

    ``grad_in_forward`` (the ``"rows"`` plan of :func:`plan_rows`): a scalar loss whose forward computes
    every gradient, ``rows`` rows at a time over all classes (``cols`` classes a chunk), and whose backward
    only scales them; ``reason`` says why the planner chose it (and how ``dW`` accumulates).

    The GEMM paths (:func:`_paths`): ``fused``, the chunks not kept take the fused CUTLASS GEMMs (a chunk whose
    layout they refuse: cuBLAS and our kernels); ``fused_cols``, the width of the forward's chunks that only fold
    statistics there; ``fused_store``, kept chunks and row blocks stored by the fused statistics GEMM as it folds
    them; ``exact``, the chunks not kept take the float32 accumulator as each logit on both sides;
    ``kept_probs``, the kept chunks hold ``exp(z - ref)`` for the factored backward (:mod:`hugehead.loop.probs`).

    ``budget``/``budget_reason``: the bytes the planner worked within and why (not part of equality).
    """

    rows: int
    cols: int
    keep_logits: bool = False
    kept_chunks: int = 0
    overlap: bool = False
    grad_in_forward: bool = False
    kept_in_grad: int = 0
    fused: bool = False
    fused_cols: int = 0
    fused_store: bool = False
    exact: bool = False
    kept_probs: bool = False
    budget: int = field(default=0, compare=False)
    budget_reason: str = field(default="", compare=False)
    reason: str = field(default="", compare=False)

    @property
    def kind(self) -> str:
        """``"rows"`` (gradients in the forward over row blocks, 3 GEMMs), ``"kept"`` (all or the leading
        chunks' logits kept for the backward: 3 GEMMs for the kept classes) or ``"recompute"`` (the
        backward recomputes every chunk's logits: 4 GEMMs)."""
        if self.grad_in_forward:
            return "rows"
        return "kept" if self.keep_logits else "recompute"

    @property
    def stats_cols(self) -> int:
        """The width of the forward's chunks that are not kept (:attr:`fused_cols` on the fused path)."""
        return self.fused_cols if self.fused and self.fused_cols else self.cols

    def encode(self) -> List[int]:
        """The plan as a custom op's ``int[]`` argument, its fields in order (the kept ones 0 where nothing is
        kept, ``budget`` last). :meth:`decode` reverses it: the backward executes the plan the forward was
        given, never a new one."""
        keep = self.keep_logits
        return [self.rows, self.cols, self.kept_chunks if keep else 0, int(self.overlap),
                self.kept_in_grad if keep else 0, int(self.grad_in_forward), int(self.fused), self.fused_cols,
                int(self.fused_store), int(self.exact), int(self.kept_probs and keep), self.budget]

    @staticmethod
    def decode(values: Optional[Sequence[int]]) -> Optional["Plan"]:
        """The plan :meth:`encode` gave (equal to it, ``budget`` included), or None for an empty or missing list.
        Raises ``ValueError`` for a list of another length."""
        if not values:
            return None
        if len(values) != _ENCODED_LEN:
            raise ValueError(f"hugehead: an encoded plan has {_ENCODED_LEN} entries, got {len(values)}")
        rows, cols, kept_chunks, overlap, in_grad, rows_plan, fused, fused_cols, store, exact, probs, budget = (
            int(v) for v in values)
        return Plan(rows=rows, cols=cols, keep_logits=kept_chunks > 0, kept_chunks=kept_chunks, overlap=bool(overlap),
                    grad_in_forward=bool(rows_plan), kept_in_grad=in_grad, fused=bool(fused), fused_cols=fused_cols,
                    fused_store=bool(store), exact=bool(exact), kept_probs=bool(probs), budget=budget,
                    budget_reason=f"a budget of {budget} bytes")


_ENCODED_LEN = 12


# --------------------------------------------------------------------------------------------------
# The GEMM paths of a step
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operands:
    """What a step's GEMM paths depend on beyond its shapes and dtypes: ``fused``, :func:`fused_gemms` of the step;
    ``resident``, the chunks are slices of a weight on the compute device (not an offload ring's copies); ``bias``,
    ``softcap``, ``smoothing``, the loss has them; ``traced``, the loop runs while torch.compile traces it."""

    fused: bool = False
    resident: bool = True
    bias: bool = False
    softcap: bool = False
    smoothing: bool = False
    traced: bool = False

    @staticmethod
    def of_loss(x: Tensor, bias: Optional[Tensor], label_smoothing: float, softcap: float, traced: bool = False,
                class_ids: bool = True) -> "Operands":
        """A loss on ``x`` (``softcap``: the kernels' cap, 0 for none; ``class_ids``: plain class-id targets,
        the only ones the fused GEMMs fold — a chunk target of :mod:`hugehead.targets` takes its own kernels)."""
        return Operands(fused=fused_gemms(x.device, x.dtype, x.shape[1], class_ids, traced), bias=bias is not None,
                        softcap=bool(softcap), smoothing=bool(label_smoothing), traced=traced)


def fused_gemms(device: torch.device, dtype: torch.dtype, d: int, class_ids: bool, traced: bool = False) -> bool:
    """Whether the fused statistics and gradient GEMMs (:func:`hugehead.ops.gemm_chunk_stats_`,
    :func:`hugehead.ops.gemm_chunk_grad_`) take a step's chunks: class-id targets, a bf16/fp16 ``x`` of a width
    that is a multiple of 8 on an sm_90 GPU of a CUTLASS build, :func:`hugehead.ops.gemm_path` saying ``cutlass``,
    and a loop that runs eagerly (``traced``: fake tensors have no data pointers for the chunks' layout checks)."""
    return (class_ids and device.type == "cuda" and d > 0 and d % 8 == 0 and not traced
            and ops.gemm_path(device, dtype) == "cutlass")


# The fused statistics GEMM stores no logits: its one buffer is the partials, 16 bytes per row and 128 columns
# (a sixteenth of a 16-bit logits chunk of the same width; 8 bytes without label smoothing's logit sums). So
# where the weight is resident in the compute dtype (chunks are slices, never casts) its chunks are this many
# times the plan's width: fewer launches, merges and tails, each of which costs time beside the GEMMs'.
FUSED_STATS_WIDEN = 8
# The statistics GEMM that stores its logits pays below this depth (D = K) only: deeper, chunk_stats_' pass is a
# small part of a long GEMM, and the cooperative fused GEMM's store costs more than that pass. The exact
# logits stop there too (the rounded logits cost a cvt a pair and two integer ops an element in both epilogues).
FUSED_STORE_MAX_DEPTH = 2048


def _paths(plan: Plan, n: int, d: int, v: int, dtype: torch.dtype, weight_dtype: torch.dtype,
           operands: Operands) -> Plan:
    """``plan`` with the GEMM paths of its steps (see :class:`Plan`), decided from the operands.

    Exact logits need both sides fused and no bias, softcap or label smoothing (the forward's logit sums: the
    128 x 192 fold has none), so that a confident row's ``p - 1`` sees the forward's lse and the backward's logits
    as the same numbers; kept chunks keep their rounded logits (stored, and read back). Kept probabilities need
    the fused statistics GEMM folding against each row's max over the chunks not kept, which come first (a
    resident shard keeping some chunks, not all, rows whole), bf16 throughout, no bias, softcap or logit sums,
    and room in the weight gradient's buffer ahead of its first slot for the references
    (:func:`scale_area_bytes`). Stored logits are uncapped, so a softcap keeps them on cuBLAS."""
    o = operands
    if not o.fused or plan.rows <= 0:
        return plan
    kept_classes = plan.kept_chunks * plan.cols if plan.keep_logits else 0
    plain = not (o.bias or o.softcap or o.smoothing)
    in_grad_room = plan.keep_logits and plan.kept_in_grad > 0 and grad_store_layout(
        n, d, v, plan.cols, dtype.itemsize, weight_dtype.itemsize)[0] >= scale_area_bytes(plan.kept_chunks, n)
    probs = (plain and in_grad_room and o.resident and 0 < kept_classes < v and plan.rows >= n
             and dtype == weight_dtype == torch.bfloat16)
    widen = o.resident and weight_dtype == dtype and not plan.grad_in_forward
    return replace(plan, fused=True, fused_cols=plan.cols * FUSED_STATS_WIDEN if widen else plan.cols,
                   fused_store=not o.softcap and (d < FUSED_STORE_MAX_DEPTH or probs),
                   exact=plain and d < FUSED_STORE_MAX_DEPTH and not plan.grad_in_forward, kept_probs=probs)


def kept_shape(plan: Plan, n: int) -> Tuple[int, int, int]:
    """Shape of the kept logits tensor of a plan that keeps them: ``[kept_chunks - kept_in_grad, N, cols]``
    (the chunks that do not live in the weight gradient's buffer)."""
    return (plan.kept_chunks - plan.kept_in_grad, n, plan.cols)


def probs_kept_chunks(n: int, d: int, cols: int, num_chunks: int, memory_budget: int, itemsize: int,
                      grad_offset: int, grad_slots: int) -> int:
    """The chunks a plan whose kept chunks hold probabilities (:func:`plan_chunks`' ``kept_probs``) keeps in the
    budget, or 0 where that rule does not apply. Its forward stores no logits outside the kept chunks, and its
    backward recomputes the others into the kept tensor's memory (``hugehead.loop.kept._spare``): the budget holds
    one kept chunk more than the streaming rule's, beside ``dX``'s float32 sums and the factored backward's
    ``[N, D]`` buffers (twice ``dx_bytes``) and the widened forward's partials (8 bytes a row per 128 columns).
    It needs one chunk in the budget and one in the weight gradient's buffer, ahead of which the references
    live (:func:`scale_area_bytes`)."""
    chunk_bytes = n * cols * itemsize
    held = 2 * n * d * (itemsize + 4) + n * (-(-cols * FUSED_STATS_WIDEN // 128)) * 8
    kept = min((memory_budget - held) // chunk_bytes, num_chunks - 1)
    in_grad = min(grad_slots, num_chunks - kept)
    if kept < 1 or in_grad < 1 or grad_offset < scale_area_bytes(kept + in_grad, n):
        return 0
    return int(kept)





def _as_budget(memory_budget, device: torch.device) -> Budget:
    if isinstance(memory_budget, Budget):
        return memory_budget
    return resolve_budget(memory_budget, device)


def plan_chunks(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, chunk_size: Optional[int] = None,
                memory_budget=None, *, weight_dtype: Optional[torch.dtype] = None, allow_keep: bool = True,
                direct_dx: bool = False, side_stream: bool = True, grad_store: bool = False, kept_probs: bool = False,
                operands: Optional[Operands] = None) -> Plan:
    """Choose the chunk shape for ``N`` rows, ``D`` features and ``V`` classes within a memory budget, and the
    GEMM paths of its steps for ``operands`` (:class:`Operands`; None: no fused GEMMs).

    The workspace is one ``rows × cols`` logits chunk in ``dtype`` (the compute dtype) plus, in the
    backward, two ``rows × D`` buffers for ``dX``. ``chunk_size`` pins ``cols`` (and streams);
    ``memory_budget`` (bytes, a :class:`Budget`, or None for :func:`hugehead.budget.resolve_budget`'s default)
    bounds the rest. When all ``N × V`` logits fit the budget (and ``allow_keep``), they are kept
    (:attr:`Plan.keep_logits`); a weight stored in another dtype than ``dtype`` (autocast) is still cast
    a chunk at a time. Rows are split only when even a ``_MIN_COLS``-wide chunk of all rows would not fit.
    ``direct_dx``: the caller computes the ``dX`` of a plan that keeps all logits in one chunk as one GEMM
    straight into the gradient (the single-device op), so that plan needs no ``dX`` buffers.
    ``side_stream``: the loop has memory-bound kernels to overlap with the GEMMs on a side stream (never where
    the fused GEMMs fold them or the loop is traced: a second workspace would buy nothing, so its memory keeps
    one more chunk of logits instead).
    ``grad_store``: the forward may hold kept logits in the weight gradient's buffer (``[V, D]`` in
    ``weight_dtype``, allocated at the forward; :func:`grad_store_layout`): the plan keeps the chunks that fit
    there as well (:attr:`Plan.kept_in_grad`, the leading ones), beyond those the budget holds.
    ``kept_probs``: the caller's kept chunks may hold probabilities (:attr:`Plan.kept_probs`, in the layouts of
    the fused GEMMs' TMA loads): where only some chunks are kept, the streamed chunks' workspace lives in the
    kept tensor's memory, so the budget keeps one chunk more (:func:`probs_kept_chunks`).
    """
    o = Operands() if operands is None else operands
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    plan = _chunk_shape(n, d, v, dtype, device, chunk_size, memory_budget, weight_dtype, allow_keep, direct_dx,
                        side_stream and not (o.fused or o.traced) and n > 0 and v > 0, grad_store, kept_probs)
    return _paths(plan, n, d, v, dtype, weight_dtype, o)


def _chunk_shape(n, d, v, dtype, device, chunk_size, memory_budget, weight_dtype, allow_keep, direct_dx, side_stream,
                 grad_store, kept_probs) -> Plan:
    budget = _as_budget(memory_budget, device)
    chosen = dict(budget=budget.bytes, budget_reason=budget.reason)
    memory_budget = budget.bytes
    itemsize = dtype.itemsize
    n, v = max(n, 1), max(v, 1)
    max_cols = _MAX_COLS.get(device.type, _MAX_COLS["cpu"])
    dx_bytes = n * d * (itemsize + 4)
    if weight_dtype != dtype:
        # Under autocast a cast weight chunk, the next one and a dW chunk in the compute dtype also live:
        # count them (at the widest chunk) against the budget.
        memory_budget = max(1, memory_budget - 3 * min(v, max_cols) * d * itemsize)
    keep = chunk_size is None and allow_keep
    if keep and direct_dx and weight_dtype == dtype and n * v * itemsize <= memory_budget:
        return Plan(rows=n, cols=v, keep_logits=True, kept_chunks=1, **chosen)
    if keep and n * v * itemsize + dx_bytes <= memory_budget:
        # A cast weight chunk (and its dW in the compute dtype) costs C × D each: keep those chunks at the
        # streaming width; a weight already in the compute dtype is used whole (one GEMM each way).
        cols = v if weight_dtype == dtype else min(v, max_cols)
        return Plan(rows=n, cols=cols, keep_logits=True, kept_chunks=-(-v // cols), **chosen)
    if chunk_size is not None:
        cols = min(int(chunk_size), v)
    else:
        cols = (memory_budget - dx_bytes) // (n * itemsize)
        if device.type in _CHUNK_ELEMS:
            cols = min(cols, max(_MIN_COLS, _CHUNK_ELEMS[device.type] // n))
        cols = max(_MIN_COLS, min(max_cols, cols))
        if cols < v:  # round down to a multiple of 256 columns: aligned rows, GEMM-friendly widths
            cols = max(_MIN_COLS, cols // _MIN_COLS * _MIN_COLS)
        cols = min(cols, v)
    rows = n
    if rows * cols * itemsize + rows * d * (itemsize + 4) > memory_budget:
        rows = max(1, memory_budget // (cols * itemsize + d * (itemsize + 4)))
    chunk_bytes = n * cols * itemsize
    # A second workspace lets the memory-bound kernels overlap the next chunk's GEMMs (CUDA, rows whole).
    overlap = (side_stream and device.type == "cuda" and rows >= n and cols < v
               and dx_bytes + 2 * chunk_bytes <= memory_budget)
    if keep and rows >= n:
        # Keep as many leading chunks as the budget holds beyond the streaming workspace(s).
        num_chunks = -(-v // cols)
        kept_chunks = (memory_budget - dx_bytes - (2 if overlap else 1) * chunk_bytes) // chunk_bytes
        kept_chunks = max(0, min(kept_chunks, num_chunks - 1))
        in_grad = 0
        if grad_store:
            offset, _, slots = grad_store_layout(n, d, v, cols, itemsize, weight_dtype.itemsize)
            if kept_probs and not overlap and weight_dtype == dtype:
                kept_chunks = max(kept_chunks, probs_kept_chunks(n, d, cols, num_chunks, memory_budget, itemsize,
                                                                 offset, slots))
            in_grad = min(slots, num_chunks - kept_chunks)
        if kept_chunks + in_grad >= 1:
            return Plan(rows=n, cols=cols, keep_logits=True, kept_chunks=int(kept_chunks + in_grad), overlap=overlap,
                        kept_in_grad=int(in_grad), **chosen)
    return Plan(rows=min(rows, n), cols=max(cols, 1), overlap=overlap, **chosen)


# --------------------------------------------------------------------------------------------------
# The "rows" plan: a scalar loss's gradients in the forward, over row blocks
# --------------------------------------------------------------------------------------------------
# Row blocks the rows plan prefers (when each keeps at least ROWS_MIN_BLOCK_ROWS rows): a sixth of the kept
# logits' memory at the same three GEMMs. It is also the most a 16-bit weight gradient is accumulated
# over: dW += G_bᵀ X_b in the weight's dtype rounds once per block, and the error grows about like
# sqrt((b + 1) / 2) times a single rounding. Measured on the CPU (bf16, N 4096, D 128, V 2048, dW error
# over plain PyTorch's, both against float64, three seeds; tests/test_rows.py): with small logits (where
# rounding, not the logits, dominates) 1.51x / 1.65x / 1.80x / 2.01x at 4 / 5 / 6 / 8 blocks; with logits of
# std 3.4, 1.07x at 4 and 1.19x at 8. Six blocks keep DESIGN.md's 2x rule at any logit scale.
ROWS_BLOCKS = 6
# Rows a block keeps at least when the planner splits by choice (not for the budget): the dW GEMM of a
# block reads and writes all of dW once (V x D), about 4% of a K = 2752 GEMM's time on an H200 in bf16.
ROWS_MIN_BLOCK_ROWS = 2048
# Rows a block keeps at least when the budget forces the split: every block reads and writes all of dW
# (2 V D itemsize bytes) beside its 6 r V D FLOPs, so on an H200 (~175 FLOP a byte) the traffic costs about
# 58 itemsize / r of the GEMMs' time: 11% for bf16 at 1024 rows, while recomputing the logits costs 33%.
# Below the floor the chunk loop (which recomputes) is the cheaper plan. The CPU's balance is lower.
ROWS_MIN_SPLIT_ROWS = {"cuda": 1024, "cpu": 32}


def plan_rows(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, memory_budget=None, *,
              weight_dtype: Optional[torch.dtype] = None) -> Optional[Plan]:
    """The ``"rows"`` plan of a scalar loss (``"mean"``/``"sum"`` with gradients), or None where it does
    not apply: the forward computes, for each block of ``rows`` rows, the block's ``rows × V`` logits (one
    GEMM into a reused workspace), its full-row statistics, the row losses and the logits' gradient in
    place, then ``dX`` rows ``= G W`` and ``dW += Gᵀ X_b`` (and ``db``); the backward only scales the held
    gradients. Three GEMMs like kept logits, but the workspace is one block's logits.

    Blocks: the fewest whose logits fit the budget beside ``dX`` (``N × D`` in ``dtype``, written in the
    forward), and no fewer than the most (up to :data:`ROWS_BLOCKS`) that keep :data:`ROWS_MIN_BLOCK_ROWS`
    rows each: less memory at the same cost.
    ``dW`` accumulates in the weight's dtype: a float32/float64 weight any number of blocks; a 16-bit one
    at most :data:`ROWS_BLOCKS` (its rounding per block; the plan is None beyond). Blocks of fewer than
    :data:`ROWS_MIN_SPLIT_ROWS` rows are not planned (None: rereading dW per block would cost more than the
    recompute it saves). A weight stored in another dtype than ``dtype`` (float32 under autocast) is cast
    a chunk of the streaming width at a time, twice a block, never whole; each block's dW partial is rounded
    to ``dtype`` once (as autocast's ``F.linear`` rounds its dW) and summed in the weight's dtype.
    """
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    budget = _as_budget(memory_budget, device)
    itemsize = dtype.itemsize
    n, v = max(n, 1), max(v, 1)
    cols, extra, per_row = v, 0, v * itemsize
    if weight_dtype != dtype:
        # Autocast: the weight is cast a chunk at a time, twice a block (logits, then dX), never whole: a
        # cast chunk, the next one and a dW partial in the compute dtype live, and dX of a block sums its
        # chunks in the accumulation dtype (plus one partial in the compute dtype).
        cols = min(v, _MAX_COLS.get(device.type, _MAX_COLS["cpu"]))
        extra = 3 * cols * d * itemsize
        per_row += d * (4 + itemsize)
    fit = (budget.bytes - n * d * itemsize - extra) // per_row  # rows whose logits fit beside dX
    if fit < 1:
        return None
    wide = weight_dtype.itemsize >= 4
    blocks = max(-(-n // fit), min(ROWS_BLOCKS, n // ROWS_MIN_BLOCK_ROWS), 1)
    if not wide and blocks > ROWS_BLOCKS:
        return None
    rows = -(-n // blocks)
    if rows < n and -(-rows // 64) * 64 <= fit:
        rows = min(n, -(-rows // 64) * 64)  # whole 64-row tiles for the GEMMs
    blocks = -(-n // rows)
    if blocks > 1 and rows < ROWS_MIN_SPLIT_ROWS.get(device.type, ROWS_MIN_SPLIT_ROWS["cuda"]):
        return None
    accumulate = (f"dW accumulated in {weight_dtype} (exact enough at any block count)" if wide else
                  f"dW accumulated in {weight_dtype} over at most {ROWS_BLOCKS} blocks (one rounding each)")
    why = "the fewest blocks whose logits fit the budget" if blocks > min(ROWS_BLOCKS, n // ROWS_MIN_BLOCK_ROWS) \
        else f"up to {ROWS_BLOCKS} blocks of at least {ROWS_MIN_BLOCK_ROWS} rows: less memory than kept logits"
    chunks = "" if cols >= v else f", {cols} classes a chunk (the weight cast chunk by chunk)"
    return Plan(rows=rows, cols=cols, grad_in_forward=True, budget=budget.bytes, budget_reason=budget.reason,
                reason=f"rows: {blocks} block(s) of {rows} rows x {v} classes{chunks} ({why}); {accumulate}")


def plan_loss(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, chunk_size: Optional[int] = None,
              memory_budget=None, *, weight_dtype: Optional[torch.dtype] = None, allow_keep: bool = True,
              allow_rows: bool = False, direct_dx: bool = False, side_stream: bool = True,
              grad_store: bool = False, kept_probs: bool = False, operands: Optional[Operands] = None) -> Plan:
    """The plan of one loss call: the cheapest that fits the budget.

    Cost first (GEMM passes over ``N × D × V``), then memory: kept logits and the rows plan take three
    passes, recomputing the logits four. ``allow_rows`` (the caller's loss is a scalar with gradients, one
    local weight, no returned lse — class ids, or a sparse / class-weighted softmax target of
    :func:`hugehead.multilabel.plan_softmax`, which asks this with the same arguments; ``hugehead.tuning``'s
    ``rows=False`` turns it off) makes
    :func:`plan_rows` a candidate: it is chosen when all logits do not fit (instead of keeping some and
    recomputing the rest); when they fit, keeping them is faster at the same three passes. Otherwise
    :func:`plan_chunks` decides (kept logits when they fit, some kept, or all recomputed). A pinned
    ``chunk_size`` asks for the chunk loop: no rows.
    """
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    budget = _as_budget(memory_budget, device)
    plan = plan_chunks(n, d, v, dtype, device, chunk_size, budget, weight_dtype=weight_dtype,
                       allow_keep=allow_keep, direct_dx=direct_dx, side_stream=side_stream, grad_store=grad_store,
                       kept_probs=kept_probs, operands=operands)
    if not (allow_rows and chunk_size is None and tuning.current().rows):
        return plan
    rows = plan_rows(n, d, v, dtype, device, budget, weight_dtype=weight_dtype)
    if rows is None:
        return plan
    rows = _paths(rows, n, d, v, dtype, weight_dtype, Operands() if operands is None else operands)
    # All logits kept beats the rows plan at the same three GEMMs: the rows plan's blocks run their statistics
    # and gradient kernels between the GEMMs (no side stream) and reread dW once a block. So the rows plan
    # replaces partial keeping and recomputing, not keeping all; a smaller memory_budget asks for it.
    kept_all = plan.keep_logits and plan.kept_chunks * plan.cols >= v
    if kept_all:
        return plan
    return rows


def plan_topk_chunks(
    n: int,
    d: int,
    v: int,
    dtype: torch.dtype,
    device: torch.device,
    chunk_size: Optional[int] = None,
    memory_budget=None,
) -> Plan:
    """:func:`plan_chunks` for :func:`hugehead.topk.topk_steps`: always streaming, the normal chunk width
    (the top-k kernel needs no temporaries beyond the workspace) and no ``dX`` buffers; on the CPU at
    least ``_CPU_TOPK_CHUNK_ELEMS`` logits a chunk when the budget holds them."""
    plan = plan_chunks(n, 0, v, dtype, device, chunk_size, memory_budget, allow_keep=False)
    if chunk_size is None and device.type == "cpu" and plan.rows >= n and plan.cols < v:
        cols = max(plan.cols, _CPU_TOPK_CHUNK_ELEMS // max(n, 1) // _MIN_COLS * _MIN_COLS)
        cols = min(v, cols, max(plan.cols, plan.budget // max(1, n * dtype.itemsize)))
        plan = replace(plan, cols=cols)
    return plan


# CPU top-k: with few rows the normal width (8192 classes) makes many small GEMMs, each a fork-join of the
# BLAS threads; measured at 256 x 64 x 1M on the 2-core CI machine, 32768 classes a chunk took 25% less time.
_CPU_TOPK_CHUNK_ELEMS = 1 << 23


# --------------------------------------------------------------------------------------------------
# Offload: chunks streamed from host memory through a ring of device slots
# --------------------------------------------------------------------------------------------------
def stream_cols(cols: int, d: int, itemsize: int, slot_bytes: int = SLOT_BYTES) -> int:
    """The width of a streamed chunk: the plan's ``cols``, at most ``slot_bytes`` of ``[C, D]`` weight
    (a multiple of 256 rows when capped)."""
    cap = slot_bytes // max(1, d * itemsize)
    if cap >= _MIN_STREAM_COLS:
        cap = cap // _MIN_STREAM_COLS * _MIN_STREAM_COLS
    return max(1, min(int(cols), max(cap, _MIN_STREAM_COLS)))


def cap_plan(plan: Plan, num_rows: int, cap: int) -> Plan:
    """``plan`` with chunks at most ``cap`` classes wide. Kept logits let a resident shard use one
    whole-shard chunk; a streamed one needs short chunks (a ring slot each, and the copy of the first
    chunk, which nothing overlaps, stays short). The kept classes stay kept, in whole chunks: all of them
    when the plan kept all, else as many chunks as fit in what it kept."""
    if plan.cols <= cap:
        return plan
    chunks = -(-num_rows // cap)
    kept = 0
    if plan.keep_logits:
        kept_classes = min(num_rows, plan.kept_chunks * plan.cols)
        kept = chunks if kept_classes >= num_rows else kept_classes // cap
    return Plan(rows=plan.rows, cols=cap, keep_logits=kept > 0, kept_chunks=kept, overlap=plan.overlap,
                budget=plan.budget, budget_reason=plan.budget_reason)


def plan_streamed(n: int, d: int, v: int, dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device,
                  chunk_size: Optional[int], budget: Budget, allow_keep: bool,
                  operands: Optional[Operands] = None) -> Plan:
    """The plan of an offloaded shard: :func:`plan_chunks` within ``budget`` (from :func:`resolve_budget`
    with ``streamed_keep``), its chunks capped to the streaming width (:func:`cap_plan`), then its paths (the
    chunks are a ring's copies: ``operands.resident`` does not hold)."""
    o = replace(Operands() if operands is None else operands, resident=False)
    plan = plan_chunks(n, d, v, dtype, device, chunk_size, budget, weight_dtype=weight_dtype, allow_keep=allow_keep,
                       operands=o)
    capped = cap_plan(plan, v, stream_cols(STREAM_MAX_COLS, d, weight_dtype.itemsize))
    return plan if capped is plan else _paths(capped, n, d, v, dtype, weight_dtype, o)
