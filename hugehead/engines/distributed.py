"""The distributed placement engine: a vocabulary-parallel head over the ranks of a process group.

Rank ``r`` owns the contiguous classes ``[start_r, stop_r)``, held by a local engine (one or several
devices of its process, or host memory with offload); every rank passes its own rows ``x_r [N_r, D]``.

One step, per rank (``W`` ranks, ``n = max_r N_r``; rows are padded to ``n`` with zero rows so every
collective has equal sizes on every rank, as NCCL's all-gather and reduce-scatter require):

- forward: all-gather the row counts (the one host synchronization), then ``x`` and the targets
  (``[W·n, D]``); the local engine folds this rank's classes for all rows into per-row
  ``(lse_r, target_logit_r, logit_sum_r)``; one all-to-all sends each row's three numbers to the row's
  owner, who merges them: ``lse = logsumexp_r lse_r``, the others summed.
- backward: one all-gather of ``[lse, grad_rows, grad_lse]`` of every rank's rows; the local engine
  computes this rank's shard gradients and ``dX`` partials of all rows (accumulation dtype); one
  reduce-scatter sums the partials and hands each rank its own rows.

Gradient convention: rank ``r``'s loss ``L_r`` is the reduction over its own rows; ``dX_r = dL_r/dx_r``;
each shard's gradient is that of ``(1/W) Σ_r L_r``, the objective whose backbone gradients DDP averages.

The engine also answers the checkpoint questions of :mod:`hugehead.checkpoint.head` (the logical weight
gathered from all ranks); the DDP helpers live in :mod:`hugehead.ddp`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..loop.chunks import merge_parts, sum_slot
from ..options import LossOptions
from ..topk import merge_topk
from ..targets import gather_chunk_target
from .local import LocalEngine, PlacedInputs, ShardTensors

__all__ = ["DistributedEngine", "rank_class_ranges", "resolve_group", "ranks_agree"]

# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The calls whose first collective is the row-count all-gather, as exchanged there (0: any other caller).
_OPS = {"forward": 1, "topk": 2, "log_prob": 3}
_OP_NAMES = {v: k for k, v in _OPS.items()}
_OP_NAMES[0] = "another call"


def ranks_agree(op: str):
    """Decorate a head method whose first collective is the row-count all-gather: with a distributed
    engine, an error the method raises before that collective (a bad input on this rank) is handed to
    every rank through it, and every rank raises the same error, instead of the other ranks waiting in it
    (see :meth:`DistributedEngine.agreed`). Other engines: the method as it is."""
    def wrap(method):
        @functools.wraps(method)
        def agreed_method(self, *args, **kwargs):
            agreed = getattr(self.engine, "agreed", None)
            if agreed is None:
                return method(self, *args, **kwargs)
            with agreed(op):
                return method(self, *args, **kwargs)
        return agreed_method
    return wrap


# Bytes of the logical weight moved per collective when a checkpoint gathers it.
GATHER_BLOCK_BYTES = 1 << 26


def resolve_group(process_group) -> "dist.ProcessGroup":
    """The process group a head spans: a ``ProcessGroup`` (e.g. ``torch.distributed.group.WORLD`` or
    one from ``new_group``) of which this process is a member.

    Raises:
        RuntimeError: torch.distributed is not initialized. TypeError: not a process group.
        ValueError: this process is not in the group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "hugehead: process_group= needs torch.distributed initialized first "
            "(torch.distributed.init_process_group, as torchrun or Lightning's DDP strategy do)"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"hugehead: process_group must be a torch.distributed.ProcessGroup (e.g. "
            f"torch.distributed.group.WORLD), got {type(process_group).__name__}"
        )
    if dist.get_rank(process_group) < 0:
        raise ValueError("hugehead: this process is not a member of process_group")
    return process_group


def rank_class_ranges(num_classes: int, world_size: int, shard_sizes: Optional[Sequence[int]] = None
                      ) -> List[Tuple[int, int]]:
    """``[start_r, stop_r)`` of every rank, in rank order: ``shard_sizes`` classes per rank, or balanced
    (the first ``V mod W`` ranks one class more).

    Raises:
        ValueError: fewer classes than ranks, or ``shard_sizes`` not ``W`` positive integers summing to V.
    """
    if shard_sizes is None:
        if num_classes < world_size:
            raise ValueError(f"hugehead: {num_classes} classes cannot be split over {world_size} ranks")
        base, extra = divmod(num_classes, world_size)
        sizes = [base + (r < extra) for r in range(world_size)]
    else:
        sizes = list(shard_sizes)
        if len(sizes) != world_size:
            raise ValueError(
                f"hugehead: with process_group, shard_sizes gives the classes of each rank: {world_size} "
                f"entries expected, got {len(sizes)}"
            )
        if any(isinstance(s, bool) or int(s) != s or s <= 0 for s in sizes):
            raise ValueError(f"hugehead: shard_sizes must be positive integers, got {sizes}")
        sizes = [int(s) for s in sizes]
        if sum(sizes) != num_classes:
            raise ValueError(f"hugehead: shard_sizes {sizes} sum to {sum(sizes)}, not num_classes={num_classes}")
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def _backend_device_types(group) -> dict:
    """``{device type: backend}`` of a group, e.g. ``{"cpu": "gloo", "cuda": "nccl"}``."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(","))
    if backend == "nccl":
        return {"cuda": "nccl"}
    if backend == "gloo":  # gloo has CUDA paths for some collectives only: stage through the host
        return {"cpu": "gloo"}
    return {"cpu": backend, "cuda": backend}


def _pad_rows(t: Tensor, rows: int, fill) -> Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0]].copy_(t)
    return out


class DistributedEngine:
    """Runs a local engine's chunk loop on this rank's classes for the rows of all ranks, and merges
    with collectives on ``group`` (see the module docstring for the data flow).

    Every rank of the group must make the same calls in the same order (forward, backward, topk,
    log_prob, state_dict, save_safetensors), as with DDP: each one runs collectives.

    Args:
        local: the engine of this rank's shards (:class:`LocalEngine` or a subclass: offload).
        group: the process group. class_ranges: ``[start_r, stop_r)`` per group rank.
    """

    name = "distributed"

    def __init__(self, local: LocalEngine, group, class_ranges: Sequence[Tuple[int, int]]):
        self.local = local
        # dX partials of all ranks are summed in the accumulation dtype before the one rounding to x's.
        self.local.grad_x_in_acc_dtype = True
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.class_ranges = [tuple(r) for r in class_ranges]
        self.num_classes = self.class_ranges[-1][1]
        self._device_types = _backend_device_types(group)
        # Agreement (see agreed): calls that made the row-count exchange, the call now running and
        # whether it made it yet.
        self._calls = 0
        self._op: Optional[str] = None
        self._exchanged = False

    def __deepcopy__(self, memo):
        # A copied head (an EMA model, say) spans the same group; only the local engine is copied.
        new = copy.copy(self)
        new.local = copy.deepcopy(self.local, memo)
        return new

    @property
    def chunk_size(self) -> Optional[int]:
        return self.local.chunk_size

    @property
    def memory_budget(self) -> Optional[int]:
        return self.local.memory_budget

    def comm_device(self, device: torch.device) -> torch.device:
        """Where collectives about a tensor on ``device`` run: ``device`` itself when the group has a
        backend for its type (NCCL for CUDA tensors), else the host (gloo) or the current GPU (NCCL only)."""
        if device.type in self._device_types:
            return device
        if "cpu" in self._device_types:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    # Collectives --------------------------------------------------------------------------------------
    def row_counts(self, n: int, device: torch.device, error: Optional[BaseException] = None) -> List[int]:
        """``N_r`` of every rank: one tiny all-gather and a host read, the first collective of a step. It
        also carries each rank's input-error flag, call counter and op (:meth:`agreed`), so the ranks
        fail together and a call-order mismatch is named instead of pairing unrelated collectives.

        Raises:
            ValueError / TypeError: some rank's input error (``error`` on this rank), the same on every rank.
            RuntimeError: the ranks are at different calls (every rank raises it).
        """
        mine = torch.tensor([n, int(error is not None), self._calls, _OPS.get(self._op or "", 0)],
                            dtype=torch.int64).to(device)
        every = torch.empty(self.world_size * 4, dtype=torch.int64, device=device)
        _all_gather_single(every, mine, group=self.group)
        self._calls += 1
        self._exchanged = True
        table = every.view(self.world_size, 4).tolist()
        if any(row[1] for row in table):
            self._raise_shared_error(table, error)
        if len({(row[2], row[3]) for row in table}) > 1:
            where = ", ".join(f"rank {r} at call {row[2]} ({_OP_NAMES.get(row[3], row[3])})" for r, row in enumerate(table))
            raise RuntimeError(
                f"hugehead: the ranks of a process_group head are out of step: {where}. Every rank must make the "
                "same calls (forward, topk, log_prob, ...) in the same order; one that skipped a step after an "
                "error of its own (caught and carried on) is the usual cause")
        return [row[0] for row in table]

    def _raise_shared_error(self, table: List[List[int]], error: Optional[BaseException]) -> None:
        """Every rank raises the first failing rank's error (its type if ValueError or TypeError)."""
        messages: List[Optional[str]] = [None] * self.world_size
        mine = None if error is None else (type(error).__name__, str(error))
        dist.all_gather_object(messages, mine, group=self.group)
        first = next(r for r, row in enumerate(table) if row[1])
        kind, text = messages[first] or ("RuntimeError", "an error")
        cls = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
        raise cls(f"{text} [raised by rank {first} of {self.world_size}; every rank of the head's process "
                  f"group raises it]") from error

    @contextlib.contextmanager
    def agreed(self, op: str) -> Iterator[None]:
        """Run one head call (``op``: forward, topk, log_prob) so that the ranks fail together: an
        exception raised on this rank before the call's row-count exchange is sent through it (the
        other ranks are waiting there), and every rank raises it (:meth:`row_counts`). Nested calls
        belong to the outer one."""
        if self._op is not None:
            yield
            return
        self._op, self._exchanged = op, False
        try:
            yield
        except Exception as exc:
            if not self._exchanged:
                self.row_counts(0, self.comm_device(torch.device("cpu")), error=exc)
            raise
        finally:
            self._op = None

    def gather_rows(self, t: Tensor, rows: int, fill) -> Tensor:
        """``t [N_r, ...]`` of every rank, each padded to ``rows`` with ``fill``: ``[W·rows, ...]``."""
        mine = _pad_rows(t, rows, fill)
        out = mine.new_empty((self.world_size * rows, *t.shape[1:]))
        _all_gather_single(out, mine, group=self.group)
        return out

    def all_to_all(self, t: Tensor) -> Tensor:
        """``t [W, ...]``: block ``j`` goes to rank ``j``; returns ``[W, ...]`` whose block ``r`` came from
        rank ``r``."""
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        return out

    # The engine interface -----------------------------------------------------------------------------
    def row_stats(
        self, x: Tensor, target: Tensor, shards: Sequence[ShardTensors], options: LossOptions, keep: bool = False
    ) -> Tuple[Tensor, Tensor, Tensor, List[PlacedInputs]]:
        """Per-row statistics of this rank's rows over the classes of all ranks.

        Args:
            x: ``[N_r, D]`` this rank's rows in the compute dtype; target: ``[N_r]`` int64, validated.
            shards: this rank's shards. options: the loss. keep: as :meth:`LocalEngine.row_stats`.
        Returns:
            ``(lse, target_logit, logit_sum)``, each ``[N_r]`` in the accumulation dtype on ``x``'s device,
            and the local engine's placed inputs for the backward: the rows of all ranks, ``[W·n, D]``.
        """
        n_own = x.shape[0]
        device = self.comm_device(x.device)
        n = max(self.row_counts(n_own, device))
        # Zero rows pad: their logits are finite and their gradient rows are exactly zero.
        x_all = self.gather_rows(x.to(device), n, 0)
        if isinstance(target, Tensor):
            target_all = self.gather_rows(target.to(device), n, -1)
        else:  # a sparse / weighted chunk target: every rank's rows, then only this rank's classes
            first = min(s.start for s in shards)
            stop = max(s.start + s.weight.shape[0] for s in shards)
            target_all = gather_chunk_target(self, target.to(device), n).columns(first, stop)
        lse, target_logit, logit_sum, placed = self.local.row_stats(x_all, target_all, shards, options, keep)
        if n == 0:
            return lse.to(x.device), target_logit.to(x.device), logit_sum.to(x.device), placed
        stats = torch.stack([lse, target_logit, logit_sum]).view(3, self.world_size, n).transpose(0, 1)
        parts = self.all_to_all(stats)[:, :, :n_own]  # [W, 3, N_r]: every rank's stats of my rows
        lse, target_logit, logit_sum = merge_parts(parts, sum_slot(target))
        return lse.to(x.device), target_logit.to(x.device), logit_sum.to(x.device), placed

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
        """Gradients: ``dX`` of this rank's rows (``dL_r/dx_r``) and this rank's shard gradients (of the
        mean over ranks of their losses).

        Args:
            placed: from :meth:`row_stats`. lse, grad_rows, grad_lse: ``[N_r]`` of this rank's rows. row_terms:
                the chunk target's row terms of them (every rank passes them, or none does: the loss is the same on
                every rank), all-gathered, the target's leading ``GRAD_TERMS`` scaled as ``grad_rows``.
            need_x: this rank wants ``dX``; the partials of all rows are computed when any rank does.
            Others: as :meth:`LocalEngine.backward`.
        Returns:
            ``(dX [N_r, D] in x_like's dtype or None, [dW_k or None], [db_k or None])``.
        """
        n_own, acc = lse.shape[0], lse.dtype
        world = self.world_size
        n = placed[0].x.shape[0] // world
        device = self.comm_device(x_like.device)
        # The local engine takes dX's dtype and device from x_like; the rows themselves are in `placed`.
        x_comm = x_like.new_empty(0, device=device)
        if n == 0:  # no rank has rows: no collective
            _, grad_w, grad_b = self.local.backward(
                placed, shards, num_classes, lse.to(device), grad_rows.to(device), options, False, need_weight,
                x_comm, row_terms=None if row_terms is None else tuple(t.to(device) for t in row_terms),
            )
            return (x_like.new_zeros(x_like.shape) if need_x else None), grad_w, grad_b
        # One all-gather: lse, grad_rows, grad_lse (and the chunk target's row terms) of every rank's rows, and two
        # flags per rank.
        terms = list(row_terms or ())
        vectors = 3 + len(terms)
        mine = torch.zeros(vectors * n + 2, dtype=acc, device=device)
        for i, t in enumerate([lse, grad_rows, grad_lse] + terms):
            if t is not None:
                mine[i * n:i * n + n_own] = t
        mine[vectors * n] = float(need_x)
        mine[vectors * n + 1] = float(grad_lse is not None)
        every = mine.new_empty(world, vectors * n + 2)
        _all_gather_single(every, mine.view(1, -1), group=self.group)
        any_x, any_lse = (bool(f) for f in (every[:, vectors * n:] != 0).any(dim=0).tolist())
        # Scaled by 1/W so the shard gradients are those of the mean of the ranks' losses; dX is scaled
        # back after the reduction.
        lse_all = every[:, :n].reshape(-1)
        grad_rows_all = every[:, n:2 * n].reshape(-1).div_(world)
        grad_lse_all = every[:, 2 * n:3 * n].reshape(-1).div_(world) if any_lse else None
        # the chunk target's leading GRAD_TERMS row terms are gradients, scaled like grad_rows
        scaled = getattr(placed[0].target, "GRAD_TERMS", 0) if placed else 0
        terms_all = None if row_terms is None else tuple(
            every[:, (3 + i) * n:(4 + i) * n].reshape(-1).div_(world if i < scaled else 1) for i in range(len(terms)))
        grad_x_all, grad_w, grad_b = self.local.backward(
            placed, shards, num_classes, lse_all, grad_rows_all, options, any_x, need_weight, x_comm,
            grad_lse=grad_lse_all, row_terms=terms_all,
        )
        grad_x = None
        if any_x:
            own = grad_x_all.new_empty(n, grad_x_all.shape[1])
            _reduce_scatter_single(own, grad_x_all.to(device).contiguous(), group=self.group)
            if need_x:
                grad_x = own[:n_own].mul_(world).to(device=x_like.device, dtype=x_like.dtype)
        return grad_x, grad_w, grad_b

    def topk(self, x: Tensor, shards: Sequence[ShardTensors], softcap: float, k: int) -> Tuple[Tensor, Tensor]:
        """Top ``k`` logits of this rank's rows over the classes of all ranks: each rank's streamed top-k
        for all rows, then one all-to-all of values and one of indices, merged by each row's owner.

        Returns:
            ``(values [N_r, k] in x's dtype, indices [N_r, k] int64)``, as :meth:`LocalEngine.topk`.
        """
        n_own = x.shape[0]
        device = self.comm_device(x.device)
        n = max(self.row_counts(n_own, device))
        if n == 0 or k == 0:
            return x.new_empty(n_own, k), torch.empty(n_own, k, dtype=torch.int64, device=x.device)
        x_all = self.gather_rows(x.to(device), n, 0)
        values, indices = self.local.topk(x_all, shards, softcap, k)
        have = values.shape[1]
        if have < k:  # fewer local classes than k: fill with candidates that lose to every real one
            fill = torch.arange(k - have, device=device) + (self.num_classes + self.rank * k)
            values = torch.cat([values, values.new_full((values.shape[0], k - have), -math.inf)], dim=1)
            indices = torch.cat([indices, fill.expand(indices.shape[0], -1)], dim=1)
        values = self.all_to_all(values.view(self.world_size, n, k))[:, :n_own]
        indices = self.all_to_all(indices.view(self.world_size, n, k))[:, :n_own]
        values = values.permute(1, 0, 2).reshape(n_own, self.world_size * k)
        indices = indices.permute(1, 0, 2).reshape(n_own, self.world_size * k)
        values, indices = merge_topk(values, indices, k)
        return values.to(x.device), indices.to(x.device)

    # Construction-time agreement ------------------------------------------------------------------------
    def check_agreement(self, in_features: int, has_bias: bool, dtype: torch.dtype) -> None:
        """Every rank built the same head (V, D, bias, dtype) with the same class ranges: one all-gather.

        Raises:
            ValueError: on every rank, naming the first rank that differs.
        """
        codes = {t: i for i, t in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))}
        start, stop = self.class_ranges[self.rank]
        mine = torch.tensor([self.num_classes, in_features, int(has_bias), codes[dtype], start, stop],
                            dtype=torch.int64)
        device = self.comm_device(torch.device("cpu"))
        every = torch.empty(self.world_size, mine.numel(), dtype=torch.int64, device=device)
        _all_gather_single(every, mine.view(1, -1).to(device), group=self.group)
        rows = every.tolist()
        # Decided from the gathered numbers only, so every rank raises the same error (or none).
        names = ("num_classes", "in_features", "bias", "dtype")
        for r, row in enumerate(rows):
            diff = ", ".join(f"{k}={a} (rank 0: {b})" for k, a, b in zip(names, row, rows[0]) if a != b)
            expected_start = 0 if r == 0 else rows[r - 1][5]
            if not diff and row[4] != expected_start:
                diff = f"its classes start at {row[4]}, after rank {r - 1}'s end at {expected_start}"
            if diff:
                raise ValueError(
                    f"hugehead: rank {r} of the process group built a different head than rank 0 ({diff}); "
                    f"every rank must pass the same in_features, num_classes, bias, dtype and shard_sizes"
                )
        if rows[-1][5] != rows[0][0]:
            raise ValueError(
                f"hugehead: the ranks' classes end at {rows[-1][5]}, not num_classes={rows[0][0]}; every rank "
                f"must pass the same shard_sizes"
            )

    def holds_every_class(self) -> bool:
        """False: this rank holds only its own classes; no rank alone has a row's full logits."""
        return False

    # Checkpoints (hugehead.checkpoint.head asks) --------------------------------------------------------
    def checkpoint_group(self):
        """The process group a checkpoint of the head is collective over: every rank holds other classes."""
        return self.group

    def logical_rows(self, pieces: Sequence[Tuple[int, Tensor]], rows: int, dst: Optional[int] = None,
                     block_bytes: int = GATHER_BLOCK_BYTES) -> Optional[Tensor]:
        """The logical ``[rows, ...]`` tensor (a head's ``weight`` or ``bias``) as one host tensor, from this
        rank's ``(first_class, tensor)`` pieces and those of every other rank. Collective: each rank
        broadcasts its classes in blocks of at most ``block_bytes`` from where its shards live; the
        receiving ranks copy each block into their host tensor.

        Args:
            dst: the group rank that gets the tensor (the others return None); None: every rank.
        """
        first = pieces[0][1]
        tail, dtype = tuple(first.shape[1:]), first.dtype
        keep = dst is None or dst == self.rank
        out = torch.empty((rows, *tail), dtype=dtype, device="cpu") if keep else None
        device = self.comm_device(first.device)
        row_bytes = max(1, math.prod(tail) * first.element_size())
        step = max(1, block_bytes // row_bytes)
        with torch.no_grad():
            for r, (start, stop) in enumerate(self.class_ranges):
                src = dist.get_global_rank(self.group, r)
                for b0 in range(start, stop, step):
                    b1 = min(b0 + step, stop)
                    block = torch.empty((b1 - b0, *tail), dtype=dtype, device=device)
                    if r == self.rank:
                        for piece_start, piece in pieces:
                            lo, hi = max(b0, piece_start), min(b1, piece_start + piece.shape[0])
                            if lo < hi:
                                block[lo - b0:hi - b0].copy_(piece[lo - piece_start:hi - piece_start])
                    dist.broadcast(block, src=src, group=self.group)
                    if keep:
                        out[b0:b1].copy_(block)
        return out

    def cast_parameter(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        return self.local.cast_parameter(t, dtype)

    def stats(self) -> dict:
        return self.local.stats()

    def agree_seed(self, seed: int) -> int:
        """Rank 0's ``seed`` on every rank (one broadcast), so all ranks initialize one logical weight."""
        t = torch.tensor([seed], dtype=torch.int64).to(self.comm_device(torch.device("cpu")))
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(t.item())


def __getattr__(name: str):
    # The DDP helpers' old address: they live in hugehead.ddp (imported lazily: ddp.py sits above engines).
    if name in ("ignore_heads_in_ddp", "distributed_head_parameter_names"):
        from .. import ddp

        return getattr(ddp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
