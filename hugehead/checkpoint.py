"""Checkpoints of models that hold sharded heads: optimizer state kept on each shard's device, sharded
``torch.distributed.checkpoint`` (DCP) state dicts that never gather a head, a streamed safetensors
writer, and atomic writes (temporary sibling, fsync, rename) for every file and directory written here.

Nothing here imports Lightning; ``hugehead.lightning`` builds its callback and strategy on top of this.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import json
import os
import re
import shutil
import struct
import uuid
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = [
    "place_optimizer_state", "keep_optimizer_state_on_shards", "ShardedRows", "sharded_state_dict",
    "save_checkpoint", "load_checkpoint", "is_checkpoint_dir", "write_safetensors", "atomic_path",
]

PathLike = Union[str, "os.PathLike[str]"]

# Bytes of a tensor handled at a time: the host staging of a streamed safetensors write, and the largest
# item a DCP checkpoint stores (DCP reads a stored item whole, so this also bounds host memory on load).
BLOCK_BYTES = 1 << 26
DCP_BLOCK_BYTES = 1 << 28
_FORMAT = "hugehead.checkpoint/1"
_META_FILE = "hugehead_checkpoint.pt"


# --------------------------------------------------------------------------------------------------
# Atomic writes: a temporary sibling, fsync, then one rename over the target
# --------------------------------------------------------------------------------------------------
_TMP_TAG = ".hugehead-tmp."
_RENAME_EXCHANGE = 2  # renameat2 flag (Linux >= 3.15): swap two paths atomically
_AT_FDCWD = -100


def _temp_sibling(path: str) -> str:
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}{_TMP_TAG}{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _fsync_path(path: str) -> None:
    """fsync a file, or a directory tree (its files, then each directory after its entries)."""
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                _fsync_path(os.path.join(root, name))
            _fsync_dir(root)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale_temps(path: str) -> None:
    """Remove temporaries a killed writer left next to ``path`` (their pid is gone)."""
    parent, base = os.path.split(path)
    pattern = re.compile(re.escape(f".{base}{_TMP_TAG}") + r"(\d+)\.[0-9a-f]+$")
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return
    for name in names:
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_path(os.path.join(parent, name))


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where the OS cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: no exchange here; fall back
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _commit(tmp: str, path: str) -> None:
    if not os.path.isdir(tmp) and not os.path.isdir(path):
        os.replace(tmp, path)  # a file over a file: atomic by POSIX
    elif not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _remove_path(tmp)  # tmp now names the previous checkpoint
    else:
        # No atomic swap of a directory on this OS: two renames. Between them `path` is absent and the
        # previous checkpoint is the temporary; a killed writer leaves it there (load it by that name).
        old = _temp_sibling(path)
        os.rename(path, old)
        os.rename(tmp, path)
        _remove_path(old)
    _fsync_dir(os.path.dirname(path) or ".")


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """Write ``path`` (a file or a directory) all or nothing.

    Yields a temporary name in the same directory; the caller writes the file or directory there. When
    the block ends normally, the temporary is fsynced and renamed over ``path`` (a directory is swapped
    in with ``renameat2(RENAME_EXCHANGE)`` where Linux has it), then the parent directory is fsynced. A
    writer killed at any moment leaves ``path`` as it was (the previous checkpoint, or nothing); an
    exception removes the temporary and propagates. Temporaries of writers that were killed are removed by
    the next write to the same path.
    """
    path = os.path.abspath(os.fspath(path))
    _clean_stale_temps(path)
    tmp = _temp_sibling(path)
    try:
        yield tmp
        if not os.path.lexists(tmp):
            raise FileNotFoundError(f"hugehead: nothing was written to the temporary {tmp} for {path}")
        _fsync_path(tmp)
        _commit(tmp, path)
    except BaseException:
        _remove_path(tmp)
        raise


@contextlib.contextmanager
def _atomic_dir_across_ranks(path: PathLike, group) -> Iterator[str]:
    """:func:`atomic_path` for a directory that every rank of ``group`` writes into (a shared file
    system): group rank 0 names and creates the temporary, every rank writes its part, and rank 0 swaps it
    in only once the block ended normally on every rank. A failure on any rank removes the temporary and
    raises on every rank (the failing rank re-raises its own exception)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0)
    path = os.path.abspath(os.fspath(path))
    name: List[Any] = [None]
    if rank == 0:
        try:
            _clean_stale_temps(path)
            name[0] = _temp_sibling(path)
            os.makedirs(name[0])
        except OSError as exc:  # every rank learns it (none waits for a directory that will not come)
            name[0] = exc
    dist.broadcast_object_list(name, src=src, group=group)
    if isinstance(name[0], BaseException):
        raise name[0]
    tmp = name[0]
    error: Optional[BaseException] = None
    try:
        yield tmp
    except BaseException as exc:  # reported to every rank below, then re-raised
        error = _as_rank_error(exc, rank)
    reports: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, None if error is None else f"rank {rank}: {type(error).__name__}: {error}",
                           group=group)
    failures = [r for r in reports if r is not None]
    if rank == 0:
        if not failures:
            try:
                _fsync_path(tmp)
                _commit(tmp, path)
            except BaseException as exc:
                failures = [f"rank 0: {type(exc).__name__}: {exc}"]
        if failures:
            _remove_path(tmp)
    outcome = [failures]
    dist.broadcast_object_list(outcome, src=src, group=group)
    if error is not None:
        raise error
    if outcome[0]:
        raise RuntimeError(f"hugehead: checkpoint {path} was not written ({'; '.join(outcome[0])}); the previous "
                           "one, if any, is unchanged")


def _as_rank_error(exc: BaseException, rank: int) -> BaseException:
    """DCP raises a ``CheckpointException`` (a BaseException, not an Exception) on every rank when any rank
    failed: on a failing rank, its own original error instead; on the others, a RuntimeError naming the
    failing ranks and their errors. Anything else is returned as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return exc
    failures = dict(getattr(exc, "failures", {}) or {})
    own = failures.get(rank)
    own = own[0] if isinstance(own, tuple) else own
    if isinstance(own, BaseException):
        own.__cause__ = exc
        return own
    described = []
    for r, failure in sorted(failures.items()):
        original = failure[0] if isinstance(failure, tuple) else failure
        described.append(f"rank {r}: {type(original).__name__}: {original}")
    error = RuntimeError(f"hugehead: torch.distributed.checkpoint failed on another rank ({'; '.join(described)})")
    error.__cause__ = exc
    return error


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


# --------------------------------------------------------------------------------------------------
# Optimizer state on each parameter's device
# --------------------------------------------------------------------------------------------------
def place_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Move every state tensor of ``optimizer`` to its parameter's device, in place.

    Lightning restores optimizer state onto its root device and moves it to the CPU after ``fit``; a
    shard on ``cuda:1`` then has its Adam moments on ``cuda:0`` and a fused or foreach step fails. This
    undoes that. The scalar ``step`` follows PyTorch's own rule (``Optimizer.load_state_dict``): moved to
    the parameter's device in groups with ``fused`` or ``capturable``, else left where it is (the CPU,
    where Lightning leaves it too). Dtypes are never changed.

    Returns:
        The number of tensors moved (0 when everything already was in place).
    """
    moved = 0
    for group in optimizer.param_groups:
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not isinstance(state, dict):
                continue
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    continue
                if key == "step" and not step_on_device:
                    continue
                if value.device != param.device:
                    state[key] = value.to(param.device)
                    moved += 1
    return moved


def _place_before_step(optimizer, args, kwargs):
    place_optimizer_state(optimizer)


def keep_optimizer_state_on_shards(optimizer: torch.optim.Optimizer):
    """Place ``optimizer``'s state now (:func:`place_optimizer_state`) and again before every ``step()``
    (a step pre-hook), so whatever moved it in between — a Lightning restore or teardown, a user's
    ``optimizer_to(device)`` — the step finds each shard's state on that shard's device. The check
    costs a loop over the state's tensors per step; nothing moves when all is in place.

    Idempotent per optimizer. Returns the hook's handle (``.remove()`` stops it).
    """
    place_optimizer_state(optimizer)
    handle = getattr(optimizer, "_hugehead_placement_hook", None)
    if handle is None or handle.id not in optimizer._optimizer_step_pre_hooks:
        handle = optimizer.register_step_pre_hook(_place_before_step)
        optimizer._hugehead_placement_hook = handle
    return handle


# --------------------------------------------------------------------------------------------------
# ShardedRows: a logical tensor whose row ranges live apart, as DCP sees it
# --------------------------------------------------------------------------------------------------
class ShardedRows(Tensor):
    """The logical ``[R, ...]`` tensor whose row ranges are separate tensors ("pieces"), possibly on
    different devices — e.g. a head's ``weight [V, D]`` as its shards' weights. It holds no data of its
    own and supports no tensor operations; it exists for ``torch.distributed.checkpoint``, which saves
    each piece as a chunk of the logical tensor (with its row offset) and loads into the pieces in place,
    resharding from whatever layout was saved (the ``__create_write_items__`` / ``__create_chunk_list__``
    / ``__get_tensor_shard__`` protocol that DCP's planner asks of DTensor).

    Args:
        pieces: ``(first_row, tensor)`` pairs; tensors share trailing shape and dtype; the row ranges must
            tile ``[0, rows)`` without overlap.
        rows: ``R``.
        local: the pieces are this process's part of a tensor whose other rows live in other ranks (a head
            spanning ranks): they must lie in ``[0, rows)`` without overlap but need not cover it. DCP then
            saves and loads, on every rank, that rank's pieces of the one logical tensor.
    """

    _pieces: List[Tuple[int, Tensor]]

    @staticmethod
    def __new__(cls, pieces: Sequence[Tuple[int, Tensor]], rows: int, local: bool = False):
        pieces = sorted(((int(s), t) for s, t in pieces), key=lambda p: p[0])
        if not pieces:
            raise ValueError("hugehead: ShardedRows needs at least one piece")
        first = pieces[0][1]
        expected = 0
        for start, piece in pieces:
            if piece.dim() < 1 or piece.shape[1:] != first.shape[1:] or piece.dtype != first.dtype:
                raise ValueError(
                    f"hugehead: ShardedRows pieces must share trailing shape and dtype; got {tuple(piece.shape)} "
                    f"{piece.dtype} next to {tuple(first.shape)} {first.dtype}"
                )
            if start < expected if local else start != expected:
                raise ValueError(f"hugehead: ShardedRows piece starts at row {start}, expected "
                                 f"{'at least ' if local else ''}{expected}")
            expected = start + piece.shape[0]
        if expected > rows if local else expected != rows:
            raise ValueError(f"hugehead: ShardedRows pieces cover {expected} rows, not {rows}")
        out = Tensor._make_wrapper_subclass(cls, (rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
        out._pieces = pieces
        out._local = bool(local)
        out._partial = bool(local) and (sum(p.shape[0] for _, p in pieces) != rows)
        out._stage_to_host = False
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(
            f"hugehead: ShardedRows is a checkpoint view of tensors on several devices and supports no "
            f"operations ({func}); use .rows(start, stop) to materialize rows, or the module's state_dict()"
        )

    def __repr__(self, *, tensor_contents=None) -> str:
        layout = ", ".join(f"[{s}, {s + t.shape[0]}) on {t.device}" for s, t in self._pieces)
        local = ", local" if self._local else ""
        return f"ShardedRows(shape={tuple(self.shape)}, dtype={self.dtype}, pieces=[{layout}]{local})"

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "hugehead: ShardedRows cannot be pickled (torch.save); save it with torch.distributed.checkpoint "
            "or hugehead.checkpoint.save_checkpoint, or torch.save the module's state_dict() instead"
        )

    @property
    def pieces(self) -> List[Tuple[int, Tensor]]:
        """``(first_row, tensor)`` in row order."""
        return list(self._pieces)

    def blocks(self, max_bytes: int) -> "ShardedRows":
        """The same rows as pieces of at most ``max_bytes`` (views of the pieces; at least one row each)."""
        out = []
        for start, piece in self._pieces:
            row_bytes = max(1, piece[:1].numel() * piece.element_size())
            step = max(1, int(max_bytes) // row_bytes)
            out.extend((start + r, piece[r:r + step]) for r in range(0, piece.shape[0], step))
        return ShardedRows(out, self.shape[0], self._local)

    def staged_to_host(self) -> "ShardedRows":
        """The same pieces, handed to DCP's writer as host copies made one at a time when it asks for
        each (a blocking copy on the current stream of the piece's device). DCP's own copy-ahead of GPU
        tensors waits on the current device's stream only, so a piece on another GPU of this process
        could be written before its copy finished; a piece already on the CPU is handed over as is."""
        out = ShardedRows(self._pieces, self.shape[0], self._local)
        out._stage_to_host = True
        return out

    def rows(self, start: int, stop: int, device=None) -> Tensor:
        """Rows ``[start, stop)`` as one tensor on ``device`` (default: the first piece's device). Returns
        the piece itself when one piece is exactly those rows there; else a new tensor."""
        device = torch.device(device) if device is not None else self.device
        for piece_start, piece in self._pieces:
            if piece_start == start and piece.shape[0] == stop - start and piece.device == device:
                return piece
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype, device=device)
        covered = 0
        for piece_start, piece in self._pieces:
            lo, hi = max(start, piece_start), min(stop, piece_start + piece.shape[0])
            if lo < hi:
                out[lo - start:hi - start].copy_(piece[lo - piece_start:hi - piece_start])
                covered += hi - lo
        if covered != stop - start:
            raise ValueError(f"hugehead: rows [{start}, {stop}) are not all in this process's pieces of "
                             f"the ShardedRows ({self!r})")
        return out

    # The protocol torch.distributed.checkpoint's default planners call (DTensor implements the same).
    def _chunks(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        tail = [0] * (self.dim() - 1)
        return [ChunkStorageMetadata(offsets=torch.Size([s, *tail]), sizes=t.shape) for s, t in self._pieces]

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape))
            for chunk in self._chunks()
        ]

    def __create_chunk_list__(self) -> list:
        return self._chunks()

    def __get_tensor_shard__(self, index) -> Tensor:
        for (start, piece), chunk in zip(self._pieces, self._chunks()):
            if chunk.offsets == index.offset:
                if self._stage_to_host and piece.device.type != "cpu":
                    return piece.to("cpu")
                return piece
        raise ValueError(f"hugehead: ShardedRows {index.fqn!r} has no piece at offset {tuple(index.offset)}")


_SHARDED_STATE_DICT = contextvars.ContextVar("hugehead_sharded_state_dict", default=False)


def sharded_state_dict_requested() -> bool:
    """True inside :func:`sharded_state_dict` (the heads' state-dict hooks ask)."""
    return _SHARDED_STATE_DICT.get()


def sharded_state_dict(module: nn.Module, *, for_save: bool = False) -> Dict[str, Any]:
    """``module.state_dict()`` where every :class:`~hugehead.ChunkedClassifier` inside gives its logical
    ``weight [V, D]`` and ``bias [V]`` as :class:`ShardedRows` over its shards' tensors instead of a
    gathered copy: no memory is allocated, and ``torch.distributed.checkpoint`` saves each shard where
    it lives and loads into any placement and shard count.

    ``for_save=True`` prepares the dict for ``dcp.save`` in this process: tensors in row blocks of at most
    256 MiB, each GPU block copied to the host by this process when DCP asks for it
    (:meth:`ShardedRows.staged_to_host`; DCP's own copy-ahead only waits on the current GPU, so a shard
    on another GPU could be written before its copy finished). The usual DCP pattern then works as for
    FSDP2/DTensor models::

        dcp.save(hugehead.checkpoint.sharded_state_dict(model, for_save=True), checkpoint_id=path)
        state = hugehead.checkpoint.sharded_state_dict(model)  # the same keys, this placement
        dcp.load(state, checkpoint_id=path)                   # in place, into the shards
        model.load_state_dict(state)                          # the rest (no copy for the head)

    A head that spans ranks (``process_group``) gives this rank's shards (``ShardedRows(local=True)``):
    with the process group initialized, ``dcp.save``/``dcp.load`` on every rank write and read each rank's
    rows of the one logical tensor, and load into any world size or into one process.

    Other entries are those of ``state_dict()`` (tensors sharing the module's storage).
    """
    token = _SHARDED_STATE_DICT.set(True)
    try:
        state = module.state_dict()
    finally:
        _SHARDED_STATE_DICT.reset(token)
    if for_save:
        for key, value in state.items():
            state[key] = _for_dcp(value, DCP_BLOCK_BYTES, saving=True)
    return state


# --------------------------------------------------------------------------------------------------
# A checkpoint directory: DCP for the tensors, a small torch.save file for everything else
# --------------------------------------------------------------------------------------------------
class _TensorRef:
    """Where a tensor of an optimizer state went in the DCP part (shape and dtype to allocate it)."""

    __slots__ = ("key", "shape", "dtype")

    def __init__(self, key: str, shape, dtype: torch.dtype):
        self.key, self.shape, self.dtype = key, tuple(shape), dtype

    def __reduce__(self):
        return (_TensorRef, (self.key, self.shape, self.dtype))


torch.serialization.add_safe_globals([_TensorRef])


def _for_dcp(value: Any, block_bytes: int, saving: bool = False) -> Any:
    """Values as DCP stores them: tensors larger than a block split into row blocks (DCP reads each stored
    item whole). For a save (``saving``), every tensor not on the CPU is also wrapped, staged to the host
    a block at a time by this process (:meth:`ShardedRows.staged_to_host`), and 0-d ones copied now."""
    if isinstance(value, ShardedRows):
        rows = value.blocks(block_bytes)
    elif type(value) in (Tensor, nn.Parameter) and value.dim() >= 1 and value.numel() > 0 and (
            value.numel() * value.element_size() > block_bytes or (saving and value.device.type != "cpu")):
        rows = ShardedRows([(0, value)], value.shape[0]).blocks(block_bytes)
    elif saving and isinstance(value, Tensor) and value.device.type != "cpu":
        return value.to("cpu")
    else:
        return value
    return rows.staged_to_host() if saving else rows


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


def save_checkpoint(path: PathLike, model: Union[nn.Module, Mapping[str, Any]], optimizers=None,
                    extra: Any = None, *, block_bytes: int = DCP_BLOCK_BYTES, io_threads: int = 1,
                    process_group=None) -> None:
    """Write a checkpoint directory, atomically: the model's tensors and the optimizers' state tensors
    with ``torch.distributed.checkpoint``, everything else (param groups, ``extra``) in one small
    ``torch.save`` file inside it.

    Heads are never gathered: each shard is written from where it lives, in row blocks of at most
    ``block_bytes`` (a GPU block is staged through host memory one at a time). The model's weights load
    back into any placement and shard count (:func:`load_checkpoint`); optimizer state into the same
    placement.

    Args:
        path: the directory to create or replace (written as a temporary sibling, then swapped in).
        model: an ``nn.Module`` (its :func:`sharded_state_dict` is saved) or a state dict built by it.
        optimizers: an optimizer, a list of them, or their ``state_dict()``s (Lightning's
            ``checkpoint["optimizer_states"]``); None: no optimizer state.
        extra: anything else ``torch.save`` can write (Lightning's loops, callbacks, hyper-parameters).
        block_bytes: the largest piece stored (and read back) at once. io_threads: DCP writer threads
            (one file each; host memory grows by a block per thread).
        process_group: for a model whose heads span the ranks of this group (``process_group=`` heads,
            e.g. under DDP): a collective call; every rank writes its own head rows and optimizer state
            into the one directory (a shared file system), a replicated tensor once, and group rank 0
            commits it. Weights then load into any world size or one process; optimizer state into the
            same world size and placement. None: one process.
    Raises:
        Whatever writing raises (on every rank, with ``process_group``); ``path`` is then left as it was
        and no temporary remains.
    """
    import torch.distributed.checkpoint as dcp

    group = _resolve_group(process_group)
    rank, world = _group_rank(group)
    state = sharded_state_dict(model) if isinstance(model, nn.Module) else dict(model)
    if group is None and any(isinstance(v, ShardedRows) and v._partial for v in state.values()):
        raise ValueError("hugehead: the model holds a head that spans ranks: pass its process_group to "
                         "save_checkpoint (every rank writes its rows)")
    tensors: Dict[str, Any] = {}
    model_other: Dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Tensor):
            tensors[f"model.{key}"] = _for_dcp(value, block_bytes, saving=True)
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
    if group is None:
        with atomic_path(path) as tmp:
            os.makedirs(tmp)
            if tensors:
                with _single_process_dcp():
                    writer = dcp.FileSystemWriter(tmp, sync_files=True, thread_count=io_threads)
                    dcp.save(tensors, storage_writer=writer, no_dist=True)
            # The metadata file goes last: a directory with it is complete (is_checkpoint_dir).
            with open(os.path.join(tmp, _META_FILE), "wb") as f:
                torch.save(meta, f)
        return
    import torch.distributed as dist

    per_rank: List[Any] = [None] * world
    dist.all_gather_object(per_rank, optimizer_meta, group=group)
    meta["optimizers"] = None if optimizer_meta is None else per_rank  # one list per rank
    with _atomic_dir_across_ranks(path, group) as tmp:
        writer = dcp.FileSystemWriter(tmp, sync_files=True, thread_count=io_threads)
        dcp.save(tensors, storage_writer=writer, process_group=group)
        if rank == 0:
            with open(os.path.join(tmp, _META_FILE), "wb") as f:
                torch.save(meta, f)


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
                    block_bytes: int = DCP_BLOCK_BYTES, process_group=None) -> Tuple[Dict[str, Any], List[dict], Any]:
    """The loading half of :func:`load_checkpoint`, for callers that apply the states themselves
    (``hugehead.lightning``): loads in place into ``model_state`` (a :func:`sharded_state_dict`) and into
    optimizer state tensors allocated on each parameter's device.

    Returns:
        ``(model_state, optimizer_state_dicts, extra)``; ``optimizer_state_dicts`` is None when
        ``optimizers`` is None or the checkpoint holds no optimizer state (nothing of it is read then).
    With ``process_group`` (a model whose heads span its ranks): collective; each rank reads its rows
    and, from a checkpoint saved by the same world size, its own optimizer state.

    Raises:
        FileNotFoundError, ValueError: not a checkpoint; different shapes; optimizer state saved for other
            parameters (another placement, another optimizer, another world size). RuntimeError:
            (``strict``) other keys.
    """
    import torch.distributed.checkpoint as dcp

    pg = _resolve_group(process_group)
    rank, world = _group_rank(pg)
    path = os.fspath(path)
    meta = _read_meta(path, weights_only)
    if pg is None and any(isinstance(v, ShardedRows) and v._partial for v in model_state.values()):
        raise ValueError("hugehead: the model holds a head that spans ranks: pass its process_group to "
                         "read_checkpoint/load_checkpoint (every rank reads its rows)")
    model_state = dict(model_state)
    saved_shapes = meta["model_shapes"]
    if strict:
        missing = [k for k in model_state if k not in meta["model_keys"]]
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
            dcp.load(targets, storage_reader=dcp.FileSystemReader(path), process_group=pg)
        except BaseException as exc:
            raise _as_rank_error(exc, rank) from None
    elif targets:
        with _single_process_dcp():
            dcp.load(targets, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return model_state, optimizer_states, meta["extra"]


def load_checkpoint(path: PathLike, model: nn.Module, optimizers=None, *, strict: bool = True,
                    weights_only: Optional[bool] = None, process_group=None) -> Any:
    """Load a directory written by :func:`save_checkpoint` into ``model`` (any placement and shard count
    of its heads: each shard reads only its rows, block by block, straight into its Parameters) and into
    ``optimizers`` (same placement; each state tensor is read onto its parameter's device).

    Args:
        strict: passed to ``model.load_state_dict``. weights_only: for the small ``torch.save`` part
            (None: torch's default). process_group: as for :func:`save_checkpoint` (collective).
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
                                                     process_group=process_group)
    if optimizers and optimizer_states is None:
        raise ValueError(f"hugehead: {os.fspath(path)} holds no optimizer state (it was saved without optimizers)")
    model.load_state_dict(state, strict=strict)
    for optimizer, opt_state in zip(optimizers or [], optimizer_states or []):
        optimizer.load_state_dict(opt_state)
        place_optimizer_state(optimizer)
    return extra


# --------------------------------------------------------------------------------------------------
# safetensors, streamed
# --------------------------------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def _write_tensor_bytes(f, tensor: Tensor, block_bytes: int, staged: Optional[bool] = None) -> None:
    """Write ``tensor``'s bytes (row-major) a block of rows at a time. A CPU tensor is written from its
    own memory (a non-contiguous block is copied first); a GPU tensor is staged through two pinned host
    buffers, the copy of block b+1 (queued on the current stream of the tensor's device, after whatever
    wrote the tensor) overlapping the file write of block b. ``staged`` forces staging (tests)."""
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.numel() == 0:
        return
    rows = tensor.shape[0]
    row_bytes = tensor[:1].numel() * tensor.element_size()
    step = max(1, block_bytes // row_bytes)
    cuda = tensor.device.type == "cuda"

    def as_bytes(block: Tensor) -> memoryview:
        return memoryview(block.reshape(-1).view(torch.uint8).numpy())

    if not (cuda if staged is None else staged):
        for r in range(0, rows, step):
            f.write(as_bytes(tensor[r:r + step].contiguous()))
        return
    buffers = [torch.empty((min(step, rows), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=cuda)
               for _ in range(2)]
    pending: List[Tuple[Tensor, Any]] = []  # (block, event) copies queued, not yet written

    def write_oldest() -> None:
        block, event = pending.pop(0)
        if event is not None:
            event.synchronize()
        f.write(as_bytes(block))

    with torch.cuda.device(tensor.device) if cuda else contextlib.nullcontext():
        for i, r in enumerate(range(0, rows, step)):
            block = buffers[i % 2][:min(step, rows - r)]  # the other buffer's block was queued just before
            block.copy_(tensor[r:r + step], non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            pending.append((block, event))
            if len(pending) == 2:  # write the previous block while this one copies
                write_oldest()
        while pending:
            write_oldest()


def write_safetensors(path: PathLike, tensors: Sequence[Tuple[str, Tensor]], metadata: Optional[Mapping[str, str]] = None,
                      *, block_bytes: int = BLOCK_BYTES) -> None:
    """Write a safetensors file (readable by ``safetensors.safe_open`` / ``load_file``) without holding
    the tensors in host memory: the header first, then each tensor's bytes in blocks of at most
    ``block_bytes`` — host memory stays within two blocks whatever the size. Written atomically
    (:func:`atomic_path`).

    Args:
        tensors: ``(name, tensor)`` in file order, on any devices; any strides.
        metadata: string to string, stored as the file's ``__metadata__``.
    Raises:
        TypeError: a dtype safetensors has no code for, or non-string metadata.
    """
    header: Dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"hugehead: safetensors cannot store {name!r} of dtype {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("hugehead: safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, tensor in tensors:
                _write_tensor_bytes(f, tensor, block_bytes)
            f.flush()
            os.fsync(f.fileno())
