"""The local placement engine: shards on devices of this process (several GPUs, CPU, or a mix).

Each shard runs the one chunk loop of :mod:`hugehead.loop` on its compute device, on that device's
current stream. ``x`` and the targets are copied to each device once; only per-row statistics (forward)
and ``dX`` partials (backward) travel back to ``x``'s device.

Ordering: a cross-device copy is queued on the *source* device's current
stream, so a copy issued after shard 0's chunk loop has been queued on ``x``'s device would wait for
that whole loop and the GPUs would take turns. Every step therefore queues the inputs of every device
first, then the shards' loops, then the small transfers back. The loops are generators that yield after
each chunk, and the GPU shards' loops are advanced in turn (round robin): queueing a chunk costs the
host tens of microseconds, so queueing shard 0's whole loop before shard 1's first chunk would leave
GPU 1 idle for milliseconds, and any host synchronization hidden in an ATen op (top-k) would make the
GPUs take turns. A CPU shard computes on the host as it is advanced, so CPU shards go last, once every
GPU's work is queued.

Subclasses (the offload engine) change where a shard computes and where its weight chunks come from
(:meth:`LocalEngine.compute_device`, :meth:`LocalEngine.source`); the loop and the ordering stay here.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..loop import backward_steps, forward_stats_steps
from ..loop.chunks import RowStats, merge_row_stats, run_steps, step_result, sum_slot
from ..loop.sources import ResidentChunks
from ..ops import acc_dtype
from ..options import LossOptions
from ..budget import Budget, device_budgets, resolve_budget, shard_oom_guard
from ..plan import Operands, Plan, plan_chunks, plan_topk_chunks
from ..topk import CUDA_MAX_K, merge_topk, topk_steps

__all__ = ["ShardTensors", "PlacedInputs", "LocalEngine"]


class ShardTensors(NamedTuple):
    """One shard as the engine sees it: ``weight [V_k, D]``, ``bias [V_k]`` or None, and the global id
    of its first class."""

    weight: Tensor
    bias: Optional[Tensor]
    start: int


class PlacedInputs(NamedTuple):
    """``x [N, D]`` and ``target [N]`` as copied to one shard's compute device (shared by the shards
    computing there), that shard's kept logits ``[kept_chunks, N, cols]`` (an empty tensor when
    streaming) and the forward's plan of the shard, which its backward follows (plan once per step)."""

    x: Tensor
    target: Tensor
    kept: Tensor
    plan: Optional[Plan] = None


def _device_guard(device: torch.device):
    # Our kernels and ATen launch on the current device's stream: make the shard's device current.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _to(t: Tensor, device: torch.device) -> Tensor:
    """Copy ``t`` to ``device`` without a host synchronization where that is safe.

    Into a CUDA device the copy is ordered on the streams (device to device: on the source device's
    current stream) or staged before returning (pageable host memory). Into host memory it must block:
    the host computes on it right away.
    """
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type == "cuda")


class LocalEngine:
    """Runs the per-shard chunk loop for shards that live on devices of this process.

    Args:
        chunk_size: classes per chunk (None: planned per shard from the shapes and ``memory_budget``).
        memory_budget: bytes of workspace each compute device may use, shared by the shards computing
            there (None: the planner's default, :func:`hugehead.budget.resolve_budget`).
    """

    name = "local"
    # dX comes back in the accumulation dtype instead of x's: the distributed engine sums the partials of
    # all ranks before the one rounding to x's dtype (as this engine does with its devices' partials).
    grad_x_in_acc_dtype = False

    def __init__(self, chunk_size: Optional[int] = None, memory_budget: Optional[int] = None):
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget

    # Capabilities the module asks for (each engine answers for its placement) -------------------------
    def agree_seed(self, seed: int) -> int:
        """The seed every process holding part of this head initializes with (here: ``seed`` itself)."""
        return seed

    def cast_parameter(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """A shard Parameter's data cast to ``dtype`` where the placement keeps it (``Module.to(dtype)``)."""
        return t.to(dtype=dtype)

    def stats(self) -> Dict[str, float]:
        """Counters of the placement's own memory (the offload engine's host gradients); empty here."""
        return {}

    def holds_every_class(self) -> bool:
        """Whether this process holds every class's weights, so that it alone can compute full logits."""
        return True

    # Where a shard computes and how its weight chunks reach the loop (the offload engine overrides) -----
    def compute_device(self, shard: ShardTensors) -> torch.device:
        return shard.weight.device

    def source(self, shard: ShardTensors, compute_dtype: torch.dtype):
        """The shard's weight-chunk source for :mod:`hugehead.loop`."""
        return ResidentChunks(shard.weight, shard.bias, compute_dtype)

    def allow_keep(self) -> bool:
        """Whether a shard may keep its logits between forward and backward (False under compile)."""
        return not torch.compiler.is_compiling()

    # Planning (hugehead.plan): the budgets once per step, then one plan per shard ----------------------
    def budgets(self, shards: Sequence[ShardTensors], keep: bool) -> Dict[torch.device, Budget]:
        """Each compute device's budget per shard for this step (shards on one device share it)."""
        return device_budgets(self.memory_budget, [self.compute_device(s) for s in shards])

    def plan(self, x: Tensor, shard: ShardTensors, keep: bool, budget: Optional[Budget] = None,
             options: Optional[LossOptions] = None, class_ids: bool = True) -> Plan:
        """The plan of ``shard``'s loop over ``x [N, D]`` under ``options`` (None: the defaults; ``budget``: from
        :meth:`budgets`; None: as if the shard were alone on its device; ``class_ids``: plain class-id targets, not
        a chunk target of :mod:`hugehead.targets`)."""
        device = self.compute_device(shard)
        if budget is None:
            budget = resolve_budget(self.memory_budget, device)
        return plan_chunks(
            x.shape[0], x.shape[1], shard.weight.shape[0], x.dtype, device, self.chunk_size, budget,
            weight_dtype=shard.weight.dtype, allow_keep=keep, operands=self.operands(x, shard, options, class_ids),
        )

    def operands(self, x: Tensor, shard: ShardTensors, options: Optional[LossOptions],
                 class_ids: bool = True) -> Operands:
        """What the shard's GEMM paths depend on (:class:`hugehead.plan.Operands`): its loop runs where the head
        is called, so under torch.compile it is traced (one stream, no fused GEMMs)."""
        options = LossOptions() if options is None else options
        return Operands.of_loss(x, shard.bias, options.label_smoothing, options.kernel_softcap,
                                traced=torch.compiler.is_compiling(), class_ids=class_ids)

    def topk_plan(self, x: Tensor, shard: ShardTensors, budget: Optional[Budget] = None) -> Plan:
        """The plan of ``shard``'s streaming top-k over ``x [N, D]``."""
        device = self.compute_device(shard)
        return plan_topk_chunks(x.shape[0], x.shape[1], shard.weight.shape[0], x.dtype, device, self.chunk_size,
                                resolve_budget(self.memory_budget, device) if budget is None else budget)

    # Checkpoints (hugehead.checkpoint.head asks) --------------------------------------------------------
    def checkpoint_group(self):
        """The process group a checkpoint of the head is collective over: None (this process holds it)."""
        return None

    def logical_rows(self, pieces: Sequence[Tuple[int, Tensor]], rows: int, dst: Optional[int] = None) -> Tensor:
        """The logical ``[rows, ...]`` tensor of the shards' ``(first_row, tensor)`` pieces: the piece itself
        when one piece holds every row (no copy), else one host tensor, each piece copied into its rows.
        ``dst`` (the rank that gets it, for heads spanning ranks) is this process."""
        if len(pieces) == 1 and pieces[0][1].shape[0] == rows:
            return pieces[0][1]
        first = pieces[0][1]
        out = torch.empty((rows, *first.shape[1:]), dtype=first.dtype)
        for start, piece in pieces:
            out[start:start + piece.shape[0]].copy_(piece.detach())
        return out

    def _launch_order(self, shards: Sequence[ShardTensors]) -> List[int]:
        """Shard indices with the GPU shards first: their work is queued asynchronously, so it overlaps
        the host computing the CPU shards that follow."""
        return sorted(range(len(shards)), key=lambda i: self.compute_device(shards[i]).type == "cpu")

    def _oom_guard(self, i: int, shard: ShardTensors, plan: Optional[Plan]):
        return shard_oom_guard(i, shard.start, shard.start + shard.weight.shape[0], self.compute_device(shard),
                               plan, self.memory_budget)

    def _interleave(self, tasks: Sequence[Tuple[int, ShardTensors, Optional[Plan], "object"]]) -> Dict[int, object]:
        """Run chunk-loop generators ``(shard index, shard, plan, generator)`` to their ends: the GPU
        shards' loops one chunk each in turn, then the CPU shards' loops. Returns each result by index."""
        results: Dict[int, object] = {}
        pending = [t for t in tasks if self.compute_device(t[1]).type != "cpu"]
        host = [t for t in tasks if self.compute_device(t[1]).type == "cpu"]
        while pending:
            still = []
            for task in pending:
                i, shard, plan, steps = task
                with _device_guard(self.compute_device(shard)), self._oom_guard(i, shard, plan):
                    try:
                        next(steps)
                        still.append(task)
                    except StopIteration as done:
                        results[i] = step_result(done)
            pending = still
        for i, shard, plan, steps in host:
            with self._oom_guard(i, shard, plan):
                results[i] = run_steps(steps)
        return results

    def _place(self, tensors: Sequence[Tensor], shards: Sequence[ShardTensors]) -> Dict[torch.device, List[Tensor]]:
        """``tensors`` copied to every shard's compute device, all queued before any shard's loop."""
        placed: Dict[torch.device, List[Tensor]] = {}
        for i in self._launch_order(shards):
            device = self.compute_device(shards[i])
            if device not in placed:
                with _device_guard(device):
                    placed[device] = [_to(t, device) for t in tensors]
        return placed

    # The engine interface ------------------------------------------------------------------------------
    def row_stats(
        self, x: Tensor, target: Tensor, shards: Sequence[ShardTensors], options: LossOptions, keep: bool = False
    ) -> Tuple[Tensor, Tensor, Tensor, List[PlacedInputs]]:
        """Merged per-row statistics over all shards.

        Args:
            x: ``[N, D]`` in the compute dtype (the shards' Parameters may be stored in another float
                dtype; each weight chunk is cast in the loop); target: ``[N]`` int64, already validated,
                on ``x``'s device. shards: in class order. options: the loss (its softcap here).
            keep: a shard may keep its logits for the backward when they fit its budget.
        Returns:
            ``(lse, target_logit, logit_sum)`` (``logit_sum`` the entropy for an
            :class:`~hugehead.targets.EntropyTarget`), each ``[N]`` in the accumulation dtype on ``x``'s device,
            and the inputs as placed on each shard's compute device (aligned with ``shards``, with any
            kept logits and the shard's plan) for the backward.
        """
        by_device = self._place([x, target], shards)
        keep = keep and self.allow_keep()
        budgets = self.budgets(shards, keep)
        tasks = []
        plans: Dict[int, Plan] = {}
        for i in self._launch_order(shards):
            shard = shards[i]
            device = self.compute_device(shard)
            xk, tk = by_device[device]
            plans[i] = plan = self.plan(xk, shard, keep, budgets[device], options, isinstance(tk, Tensor))
            tasks.append((i, shard, plan, forward_stats_steps(xk, self.source(shard, x.dtype), tk, shard.start,
                                                              options, plan)))
        results = self._interleave(tasks)
        stats: List[RowStats] = [results[i][0] for i in range(len(shards))]
        kept: List[Optional[Tensor]] = [results[i][1] for i in range(len(shards))]
        placed = []
        for i, (shard, k) in enumerate(zip(shards, kept)):
            xk, tk = by_device[self.compute_device(shard)]
            placed.append(PlacedInputs(xk, tk, xk.new_empty(0) if k is None else k, plans[i]))
        # Only now wait on anything: N-element statistics cross to x's device.
        parts = [RowStats(*(_to(s, x.device) for s in st)) for st in stats]
        lse, target_logit, logit_sum = merge_row_stats(parts, sum_slot(target))
        return lse, target_logit, logit_sum, placed

    def backward(
        self,
        placed: Sequence[PlacedInputs],
        shards: Sequence[ShardTensors],
        num_classes: int,
        lse: Tensor,
        grad_rows: Tensor,
        options: LossOptions,
        need_x: bool,
        need_weight: Sequence[bool],
        x_like: Tensor,
        grad_lse: Optional[Tensor] = None,
        row_terms: Optional[Tuple[Tensor, ...]] = None,
    ) -> Tuple[Optional[Tensor], List[Optional[Tensor]], List[Optional[Tensor]]]:
        """Gradients of all shards, each shard recomputing its logits chunk by chunk (or from its kept
        logits) on its compute device.

        Args:
            placed: the inputs returned by :meth:`row_stats`, with each shard's plan (followed as is).
            lse, grad_rows: ``[N]`` accumulation dtype on ``x``'s device; ``grad_rows`` is zero on
                ignored rows. grad_lse: ``[N]`` gradient reaching a returned lse, or None.
            row_terms: ``[N]`` tensors on ``x``'s device that the chunk targets' backward needs, placed beside the
                others (each shard's target becomes ``target.with_grads(*row_terms)``): an
                :class:`~hugehead.targets.EntropyTarget`'s ``(dL/dH, H)``; None for targets that need none.
            need_x: compute ``dX``. need_weight: per shard, compute ``dW`` (and ``db``).
            x_like: the compute-dtype ``x`` (its device and dtype are those of ``dX``).
        Returns:
            ``(dX [N, D] in x_like's dtype (the accumulation dtype with :attr:`grad_x_in_acc_dtype`) on its
            device or None, [dW_k or None], [db_k or None])``, each
            shard's gradients on that shard's device in its Parameters' dtype.
        """
        acc = acc_dtype(x_like.dtype)
        out_device = x_like.device
        active = [i for i in self._launch_order(shards) if need_x or need_weight[i]]
        row_vectors = [lse, grad_rows] + ([] if grad_lse is None else [grad_lse]) + list(row_terms or ())
        by_device = self._place(row_vectors, [shards[i] for i in active])
        # One fp32 (fp64 for fp64 inputs) dX buffer per device, shared by that device's shards.
        grad_x_parts: Dict[torch.device, Tensor] = {}
        grad_w: List[Optional[Tensor]] = [None] * len(shards)
        grad_b: List[Optional[Tensor]] = [None] * len(shards)
        tasks = []
        for i in active:
            shard, inputs = shards[i], placed[i]
            device = self.compute_device(shard)
            kept = inputs.kept if inputs.kept.numel() > 0 else None
            plan = inputs.plan
            if plan is None:
                raise RuntimeError("hugehead: the backward needs the forward's plan of every shard (row_stats)")
            with _device_guard(device), self._oom_guard(i, shard, plan):
                if need_x and device not in grad_x_parts:
                    grad_x_parts[device] = torch.zeros(inputs.x.shape, dtype=acc, device=inputs.x.device)
            lse_k, grad_rows_k, *rest = by_device[device]
            grad_lse_k = rest[:1] if grad_lse is not None else []
            target = inputs.target if row_terms is None else inputs.target.with_grads(*rest[len(rest) - len(row_terms):])
            tasks.append((i, shard, plan, backward_steps(
                inputs.x, self.source(shard, x_like.dtype), target, shard.start, num_classes,
                lse_k, grad_rows_k, options, plan, grad_x_parts.get(device),
                need_weight[i], kept=kept, grad_lse=grad_lse_k[0] if grad_lse_k else None,
            )))
        for i, (gw, gb) in self._interleave(tasks).items():
            grad_w[i], grad_b[i] = gw, gb
        grad_x = None
        if need_x:
            for device, part in grad_x_parts.items():
                if device == out_device:
                    grad_x = part if grad_x is None else grad_x.add_(part)
            for device, part in grad_x_parts.items():
                if device != out_device:
                    part = _to(part, out_device)
                    grad_x = part if grad_x is None else grad_x.add_(part)
            if not self.grad_x_in_acc_dtype:
                grad_x = grad_x.to(x_like.dtype)
        return grad_x, grad_w, grad_b

    def topk(self, x: Tensor, shards: Sequence[ShardTensors], softcap: float, k: int) -> Tuple[Tensor, Tensor]:
        """Top ``k`` logits over all classes, streamed per shard and merged on ``x``'s device.

        Returns:
            ``(values [N, k] in x's dtype, indices [N, k] int64)`` sorted by value descending, ties by the
            lower class id.
        """
        for shard in shards:
            if self.compute_device(shard).type == "cuda" and min(k, shard.weight.shape[0]) > CUDA_MAX_K:
                raise ValueError(f"hugehead: k must be at most {CUDA_MAX_K} for a shard on CUDA, got {k}")
        by_device = self._place([x], shards)
        budgets = self.budgets(shards, keep=False)
        tasks = []
        for i in self._launch_order(shards):
            shard = shards[i]
            device = self.compute_device(shard)
            (xk,) = by_device[device]
            plan = self.topk_plan(xk, shard, budgets[device])
            tasks.append((i, shard, plan, topk_steps(xk, self.source(shard, x.dtype), shard.start, softcap, k, plan)))
        results = self._interleave(tasks)
        parts = [results[i] for i in range(len(shards))]
        if len(parts) == 1:  # one shard's top-k is already in order
            return _to(parts[0][0], x.device), _to(parts[0][1], x.device)
        values = torch.cat([_to(v, x.device) for v, _ in parts], dim=1)
        indices = torch.cat([_to(ix, x.device) for _, ix in parts], dim=1)
        return merge_topk(values, indices, k)
