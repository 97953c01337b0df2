"""A checkpoint directory: the tensors of a model (its heads never gathered) and of its optimizers
written with ``torch.distributed.checkpoint`` (DCP), everything else in one small ``torch.save`` file
inside it; written atomically, in one process or collectively over the ranks a head spans."""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import space
from .atomic import PathLike, _atomic_dir_across_ranks, _fsync_dir, _remove_path, atomic_path
from .optim import place_optimizer_state, state_bytes
from .sharded import DCP_BLOCK_BYTES, ShardedRows, _for_dcp, optional_state_keys, sharded_state_dict
from .threads import writer as _writer
from .verify import DIGEST, crc32, file_table

# /2 adds "files" (each file's size and digest); /1 (hugehead 0.1.0) still loads, unverified.
_FORMAT = "hugehead.checkpoint/2"
_FORMATS_READ = ("hugehead.checkpoint/1", _FORMAT)
_META_FILE = "hugehead_checkpoint.pt"
# DCP writer threads per process (one file each) and reader threads on load: a single thread leaves a fast
# disk half idle (measured: 0.67-0.80 GB/s of a 1.52 GB/s disk with one writer).
IO_THREADS = 8


def _group_rank(group) -> Tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` for None (one process)."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _resolve_group(process_group):
    """The process group a checkpoint is written or read with: None (one process) unless one is given
    and ``torch.distributed`` is initialized with more than one rank in it."""
    if process_group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("hugehead: process_group was given but torch.distributed is not initialized")
    return process_group if dist.get_world_size(process_group) > 1 else None



class _TensorRef:
    """Where a tensor of an optimizer state went in the DCP part (shape and dtype to allocate it)."""

    __slots__ = ("key", "shape", "dtype")

    def __init__(self, key: str, shape, dtype: torch.dtype):
        self.key, self.shape, self.dtype = key, tuple(shape), dtype

    def __reduce__(self):
        return (_TensorRef, (self.key, self.shape, self.dtype))


torch.serialization.add_safe_globals([_TensorRef])


@contextlib.contextmanager
def _single_process_dcp():
    """DCP in this process only: its warning that it assumes one process is the intent here, and the
    error of a failed read or write (which DCP wraps per rank in a CheckpointException) is re-raised
    as itself, so a full disk reads as ``OSError: No space left on device``."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled, unavailable or uninitialized.*")
        try:
            yield
        except CheckpointException as exc:
            failures = list(getattr(exc, "failures", {}).values())
            original = failures[0][0] if len(failures) == 1 and isinstance(failures[0], tuple) else None
            if isinstance(original, BaseException):
                raise original from exc
            raise


def is_checkpoint_dir(path: PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory written by :func:`save_checkpoint`."""
    return os.path.isfile(os.path.join(os.fspath(path), _META_FILE))


def _optimizer_state_dicts(optimizers) -> Optional[List[dict]]:
    if optimizers is None:
        return None
    if isinstance(optimizers, (torch.optim.Optimizer, Mapping)):
        optimizers = [optimizers]
    return [opt.state_dict() if isinstance(opt, torch.optim.Optimizer) else opt for opt in optimizers]


def _stored_bytes(value: Any) -> Tuple[int, int]:
    """``(bytes, items)`` DCP stores for one value of a state dict prepared by :func:`_for_dcp`."""
    if isinstance(value, ShardedRows):
        return sum(p.numel() * p.element_size() for _, p in value._pieces), len(value._pieces)
    if isinstance(value, Tensor):
        return value.numel() * value.element_size(), 1
    return 0, 0


def _remove_previous(paths: Sequence[str]) -> None:
    for previous in paths:
        if os.path.lexists(previous):
            _remove_path(previous)
    for parent in {os.path.dirname(p) or "." for p in paths}:
        _fsync_dir(parent)


def _write_meta(directory: str, meta: dict, threads: int, known=None) -> None:
    """The meta file, last (a directory with it is complete: is_checkpoint_dir), with the size and digest
    of every other file (``known``: those the writer computed as it wrote; others read back), which a
    load checks before using any."""
    import io

    
    inner = io.BytesIO()
    torch.save({**meta, "files": file_table(directory, skip=(_META_FILE,), threads=threads, known=known or {})}, inner)
    # torch.load checks no digest of its own: the meta travels as bytes beside its CRC-32.
    data = io.BytesIO()
    torch.save({"format": _FORMAT, "meta": inner.getvalue(), DIGEST: crc32(inner.getbuffer())}, data)
    with open(os.path.join(directory, _META_FILE), "wb") as f:
        f.write(data.getbuffer())
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(path: PathLike, model: Union[nn.Module, Mapping[str, Any]], optimizers=None,
                    extra: Any = None, *, block_bytes: int = DCP_BLOCK_BYTES, io_threads: Optional[int] = None,
                    process_group=None, keep_previous: bool = True, previous: Optional[PathLike] = None) -> None:
    """Write a checkpoint directory, atomically: the model's tensors and the optimizers' state tensors
    with ``torch.distributed.checkpoint``, everything else (param groups, ``extra``) in one small
    ``torch.save`` file inside it.

    Heads are never gathered: each shard is written from where it lives, in row blocks of at most
    ``block_bytes`` (a GPU block is staged through host memory when a writer thread asks for it, so the
    copies of one thread overlap the writes of the others). The model's weights load back into any
    placement and shard count (:func:`load_checkpoint`); optimizer state into the same placement.

    Before any byte is written, the bytes the checkpoint will take are checked against the free space of
    ``path``'s file system: the new checkpoint is written beside the previous one (then swapped in), so
    the free space must hold all of it. A write that still runs out of space raises the same error.

    Args:
        path: the directory to create or replace (written as a temporary sibling, then swapped in).
        model: an ``nn.Module`` (its :func:`sharded_state_dict` is saved) or a state dict built by it.
        optimizers: an optimizer, a list of them, or their ``state_dict()``s (Lightning's
            ``checkpoint["optimizer_states"]``); None: no optimizer state.
        extra: anything else ``torch.save`` can write (Lightning's loops, callbacks, hyper-parameters).
        block_bytes: the largest piece stored (and read back) at once. io_threads: DCP writer threads per
            process, each writing its own file (host memory grows by a block per thread); None:
            :data:`IO_THREADS`. Loads read those files in parallel too.
        process_group: for a model whose heads span the ranks of this group (``process_group=`` heads,
            e.g. under DDP): a collective call; every rank writes its own head rows and optimizer state
            into the one directory (a shared file system), a replicated tensor once, and group rank 0
            commits it. Weights then load into any world size or one process; optimizer state into the
            same world size and placement. None: one process.
        keep_previous: True (default): the previous checkpoint stays intact until the new one is complete
            (the disk must hold both for a moment). False: the previous checkpoint at ``path`` (and at
            ``previous``) is removed *before* the new one is written, so the disk needs room for one.
            **Risk**: until the new checkpoint is complete there is no checkpoint on disk; a crash, a kill
            or a failed write in that window loses it (and the training it holds).
        previous: another checkpoint this one replaces (the last one written under another name, as a
            Lightning ``ModelCheckpoint`` does): with ``keep_previous=False`` it is removed first too.
    Raises:
        CheckpointSpaceError (an ``OSError``, errno ENOSPC): not enough free space, found before writing
            (naming the directory, the bytes needed and free), or a write that ran out of space. Whatever
            else writing raises (on every rank, with ``process_group``). ``path`` is then left as it was
            (unless ``keep_previous=False`` removed it) and no temporary remains.
    """
    import io

    import torch.distributed.checkpoint as dcp

    group = _resolve_group(process_group)
    rank, world = _group_rank(group)
    threads = IO_THREADS if io_threads is None else int(io_threads)
    if threads < 1:
        raise ValueError(f"hugehead: io_threads must be at least 1, got {io_threads}")
    path = os.path.abspath(os.fspath(path))
    state = sharded_state_dict(model) if isinstance(model, nn.Module) else dict(model)
    if group is None and any(isinstance(v, ShardedRows) and v._partial for v in state.values()):
        raise ValueError("hugehead: the model holds a head that spans ranks: pass its process_group to "
                         "save_checkpoint (every rank writes its rows)")
    tensors: Dict[str, Any] = {}
    model_other: Dict[str, Any] = {}
    data_bytes = items = 0
    for key, value in state.items():
        if isinstance(value, Tensor):
            tensors[f"model.{key}"] = _for_dcp(value, block_bytes, saving=True)
            # Over ranks, a replicated tensor is written once (DCP deduplicates it): counted on rank 0.
            if rank == 0 or (isinstance(value, ShardedRows) and value._local):
                nbytes, n = _stored_bytes(tensors[f"model.{key}"])
                data_bytes, items = data_bytes + nbytes, items + n
        else:
            model_other[key] = value
    opt_states = _optimizer_state_dicts(optimizers)
    optimizer_meta = None if opt_states is None else []
    for i, opt_state in enumerate(opt_states or []):
        per_param = {}
        for pid, param_state in opt_state.get("state", {}).items():
            entry = {}
            for key, value in param_state.items():
                if isinstance(value, Tensor):
                    # Over ranks, each rank's optimizer state is its own (its head shards): keyed by rank.
                    name = f"optimizer.{i}.{pid}.{key}" if group is None else f"optimizer.{i}.rank{rank}.{pid}.{key}"
                    tensors[name] = _for_dcp(value, block_bytes, saving=True)
                    entry[key] = _TensorRef(name, value.shape, value.dtype)
                    nbytes, n = _stored_bytes(tensors[name])
                    data_bytes, items = data_bytes + nbytes, items + n
                else:
                    entry[key] = value
            per_param[pid] = entry
        optimizer_meta.append({**{k: v for k, v in opt_state.items() if k != "state"}, "state": per_param})
    meta = {
        "format": _FORMAT,
        "model_keys": list(state),
        "model_other": model_other,
        "model_shapes": {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)},
        "optimizers": optimizer_meta,
        "extra": extra,
        "world_size": world,
    }
    removable = [] if keep_previous else [path] + ([os.path.abspath(os.fspath(previous))] if previous else [])
    what = f"checkpoint {os.path.basename(path)}"

    if group is None:
        # Serialized now: its size counts, and the file written last is then a plain copy of bytes.
        meta_bytes = io.BytesIO()
        torch.save(meta, meta_bytes)
        needed = space.estimate(data_bytes + meta_bytes.tell(), items)
        space.check_room(path, needed, what, removable=removable)
        _remove_previous(removable)
        # Mapped once the temporary is gone (atomic_path removes it first): the free space reported is then
        # what this write had.
        with space.out_of_space_as_error(path, needed, what), atomic_path(path) as tmp:
            os.makedirs(tmp)
            storage = _writer(tmp, threads)
            if tensors:
                with _single_process_dcp():
                    dcp.save(tensors, storage_writer=storage, no_dist=True)
            _write_meta(tmp, meta, threads, storage.fs.digests())
        return
    import torch.distributed as dist

    per_rank: List[Any] = [None] * world
    dist.all_gather_object(per_rank, (optimizer_meta, data_bytes, items), group=group)
    meta["optimizers"] = None if optimizer_meta is None else [entry[0] for entry in per_rank]  # one list per rank
    meta_bytes = io.BytesIO()
    if rank == 0:
        torch.save(meta, meta_bytes)
    needed = space.estimate(sum(entry[1] for entry in per_rank) + meta_bytes.tell(),
                            sum(entry[2] for entry in per_rank))

    def prepare() -> None:  # group rank 0, before the temporary is created; its error reaches every rank
        space.check_room(path, needed, what, removable=removable)
        _remove_previous(removable)

    # A rank whose write failed raises its own error, the others one naming it (_atomic_dir_across_ranks).
    with space.out_of_space_as_error(path, needed, what), \
            _atomic_dir_across_ranks(path, group, prepare=prepare) as tmp:
        storage = _writer(tmp, threads)
        dcp.save(tensors, storage_writer=storage, process_group=group)
        if rank == 0:  # every rank's files are complete once dcp.save returned on the coordinator
            _write_meta(tmp, meta, threads, storage.fs.digests())  # the other ranks' files read back


def estimate_checkpoint_bytes(model: nn.Module, optimizers=(), *, block_bytes: int = DCP_BLOCK_BYTES) -> int:
    """Bytes :func:`save_checkpoint` would write for ``model`` (this process's part of its heads) and
    ``optimizers`` (their state, or the state their first step will allocate: :func:`state_bytes`),
    without writing or copying anything."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    data_bytes = items = 0
    for value in sharded_state_dict(model).values():
        if isinstance(value, Tensor):
            nbytes, n = _stored_bytes(_for_dcp(value, block_bytes))
            data_bytes, items = data_bytes + nbytes, items + n
    for optimizer in optimizers or ():
        nbytes = state_bytes(optimizer)
        data_bytes += nbytes
        items += sum(len(g["params"]) for g in optimizer.param_groups) * 2 + nbytes // block_bytes
    return space.estimate(data_bytes, items)
