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
from .atomic import PathLike, _as_rank_error, _atomic_dir_across_ranks, _fsync_dir, _remove_path, atomic_path
from .optim import place_optimizer_state, state_bytes
from .sharded import DCP_BLOCK_BYTES, ShardedRows, _for_dcp, optional_state_keys, sharded_state_dict
from .threads import reader as _reader, writer as _writer

_FORMAT = "hugehead.checkpoint/1"
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
            if tensors:
                with _single_process_dcp():
                    dcp.save(tensors, storage_writer=_writer(tmp, threads), no_dist=True)
            # The metadata file goes last: a directory with it is complete (is_checkpoint_dir).
            with open(os.path.join(tmp, _META_FILE), "wb") as f:
                f.write(meta_bytes.getbuffer())
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
        dcp.save(tensors, storage_writer=_writer(tmp, threads), process_group=group)
        if rank == 0:
            with open(os.path.join(tmp, _META_FILE), "wb") as f:
                f.write(meta_bytes.getbuffer())


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


def _read_meta(path: str, weights_only: Optional[bool]) -> dict:
    meta_path = os.path.join(path, _META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"hugehead: {path} is not a checkpoint directory written by save_checkpoint "
                                f"(no {_META_FILE})")
    meta = torch.load(meta_path, map_location="cpu", weights_only=weights_only)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"hugehead: {path} has checkpoint format {meta.get('format')!r}, expected {_FORMAT!r}")
    return meta


def _optimizer_params(optimizer: torch.optim.Optimizer) -> List[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def read_checkpoint(path: PathLike, model_state: Mapping[str, Any],
                    optimizers: Optional[Sequence[torch.optim.Optimizer]] = None, *, strict: bool = True, weights_only: Optional[bool] = None,
                    block_bytes: int = DCP_BLOCK_BYTES, process_group=None, io_threads: Optional[int] = None,
                    optional_keys: Sequence[str] = ()) -> Tuple[Dict[str, Any], List[dict], Any]:
    """The loading half of :func:`load_checkpoint`, for callers that apply the states themselves
    (``hugehead.lightning``): loads in place into ``model_state`` (a :func:`sharded_state_dict`) and into
    optimizer state tensors allocated on each parameter's device.

    Returns:
        ``(model_state, optimizer_state_dicts, extra)``; ``optimizer_state_dicts`` is None when
        ``optimizers`` is None or the checkpoint holds no optimizer state (nothing of it is read then).
    With ``process_group`` (a model whose heads span its ranks): collective; each rank reads its rows
    and, from a checkpoint saved by the same world size, its own optimizer state. ``io_threads``: files
    read at once (None: :data:`IO_THREADS`). ``optional_keys``: keys of ``model_state`` the checkpoint may
    lack even when ``strict`` (:func:`hugehead.checkpoint.optional_state_keys`); they keep their values.

    Raises:
        FileNotFoundError, ValueError: not a checkpoint; different shapes; optimizer state saved for other
            parameters (another placement, another optimizer, another world size). RuntimeError:
            (``strict``) other keys.
    """
    import torch.distributed.checkpoint as dcp

    pg = _resolve_group(process_group)
    rank, world = _group_rank(pg)
    threads = IO_THREADS if io_threads is None else int(io_threads)
    path = os.fspath(path)
    meta = _read_meta(path, weights_only)
    if pg is None and any(isinstance(v, ShardedRows) and v._partial for v in model_state.values()):
        raise ValueError("hugehead: the model holds a head that spans ranks: pass its process_group to "
                         "read_checkpoint/load_checkpoint (every rank reads its rows)")
    model_state = dict(model_state)
    saved_shapes = meta["model_shapes"]
    if strict:
        missing = [k for k in model_state if k not in meta["model_keys"] and k not in set(optional_keys)]
        unexpected = [k for k in meta["model_keys"] if k not in model_state]
        if missing or unexpected:
            raise RuntimeError(f"hugehead: {path} does not match the model: missing keys {missing}, "
                               f"unexpected keys {unexpected} (pass strict=False to load the common keys)")
    targets: Dict[str, Any] = {}
    for key, value in model_state.items():
        if not isinstance(value, Tensor) or key not in saved_shapes:
            continue
        if tuple(value.shape) != tuple(saved_shapes[key]):
            raise ValueError(
                f"hugehead: {path}: {key} was saved with shape {tuple(saved_shapes[key])}, the model has "
                f"{tuple(value.shape)}"
            )
        targets[f"model.{key}"] = _for_dcp(value, block_bytes)
    for key, value in meta["model_other"].items():
        if key in model_state:
            model_state[key] = value

    optimizer_states: Optional[List[dict]] = None
    saved_optimizers = meta["optimizers"]
    saved_world = meta.get("world_size", 1)
    if optimizers is not None and saved_optimizers is not None:
        if saved_world != world:
            raise ValueError(
                f"hugehead: {path} holds the optimizer state of {saved_world} rank(s); this is {world}. Optimizer "
                "state resumes into the same world size and placement only; load the weights alone with "
                "optimizers=None"
            )
        if saved_world > 1:
            saved_optimizers = saved_optimizers[rank]  # this rank's own lists
        optimizer_states = []
        if len(optimizers) != len(saved_optimizers):
            raise ValueError(f"hugehead: {path} holds state of {len(saved_optimizers)} optimizer(s), "
                             f"got {len(optimizers)}")
        for i, (optimizer, saved) in enumerate(zip(optimizers, saved_optimizers)):
            params = _optimizer_params(optimizer)
            groups = optimizer.param_groups
            saved_counts = [len(g["params"]) for g in saved["param_groups"]]
            if saved_counts != [len(g["params"]) for g in groups]:
                raise ValueError(
                    f"hugehead: {path}: optimizer {i} was saved with parameter groups of sizes {saved_counts}, this "
                    f"optimizer has {[len(g['params']) for g in groups]} (another model or head placement?). "
                    "Optimizer state resumes into the same placement only; load the weights alone with optimizers=None"
                )
            group_of = {id(p): group for group in groups for p in group["params"]}
            state = {}
            for pid, entry in saved["state"].items():
                param = params[int(pid)]
                group = group_of[id(param)]
                param_state = {}
                for key, value in entry.items():
                    if not isinstance(value, _TensorRef):
                        param_state[key] = value
                        continue
                    # A moment of another shard size: same trailing shape, other row count.
                    if len(value.shape) == param.dim() >= 1 and value.shape[1:] == tuple(param.shape[1:]) \
                            and value.shape[0] != param.shape[0]:
                        raise ValueError(
                            f"hugehead: {path}: optimizer {i} state {key!r} of parameter {pid} has shape "
                            f"{value.shape}, the parameter has {tuple(param.shape)} (another head placement?). "
                            "Optimizer state resumes into the same placement only; load the weights alone "
                            "with optimizers=()"
                        )
                    on_param_device = key != "step" or group.get("fused") or group.get("capturable")
                    tensor = torch.empty(value.shape, dtype=value.dtype,
                                         device=param.device if on_param_device else "cpu")
                    targets[value.key] = _for_dcp(tensor, block_bytes)
                    param_state[key] = tensor
                state[pid] = param_state
            optimizer_states.append({**{k: v for k, v in saved.items() if k != "state"}, "state": state})

    if pg is not None:
        try:
            dcp.load(targets, storage_reader=_reader(path, threads), process_group=pg)
        except BaseException as exc:
            raise _as_rank_error(exc, rank) from None
    elif targets:
        with _single_process_dcp():
            dcp.load(targets, storage_reader=_reader(path, threads), no_dist=True)
    return model_state, optimizer_states, meta["extra"]


def load_checkpoint(path: PathLike, model: nn.Module, optimizers=None, *, strict: bool = True,
                    weights_only: Optional[bool] = None, process_group=None, io_threads: Optional[int] = None) -> Any:
    """Load a directory written by :func:`save_checkpoint` into ``model`` (any placement and shard count
    of its heads: each shard reads only its rows, block by block, straight into its Parameters) and into
    ``optimizers`` (same placement; each state tensor is read onto its parameter's device).

    Args:
        strict: passed to ``model.load_state_dict``. weights_only: for the small ``torch.save`` part
            (None: torch's default). process_group: as for :func:`save_checkpoint` (collective).
        io_threads: files read at once (None: :data:`IO_THREADS`).
    Returns:
        The ``extra`` object that was saved.
    Raises:
        FileNotFoundError, ValueError: see :func:`read_checkpoint`; RuntimeError from ``load_state_dict``.
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = None if optimizers is None else list(optimizers)
    state, optimizer_states, extra = read_checkpoint(path, sharded_state_dict(model), optimizers,
                                                     strict=strict, weights_only=weights_only,
                                                     process_group=process_group, io_threads=io_threads,
                                                     optional_keys=optional_state_keys(model))
    if optimizers and optimizer_states is None:
        raise ValueError(f"hugehead: {os.fspath(path)} holds no optimizer state (it was saved without optimizers)")
    model.load_state_dict(state, strict=strict)
    for optimizer, opt_state in zip(optimizers or [], optimizer_states or []):
        optimizer.load_state_dict(opt_state)
        place_optimizer_state(optimizer)
    return extra

