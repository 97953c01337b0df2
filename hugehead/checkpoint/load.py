"""Loading a checkpoint directory written by :func:`~hugehead.checkpoint.save_checkpoint`: one version of it
pinned (a save replacing the path meanwhile is never mixed in), every file's presence, size and digest
checked before any byte is written into the model or the optimizers, and nothing unpickled that could
run code unless ``weights_only=False`` is asked for."""
from __future__ import annotations

import contextlib
import io
import os
import pickle
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .atomic import PathLike, _as_rank_error
from .dcp import (_FORMAT, _FORMATS_READ, _META_FILE, IO_THREADS, _group_rank, _resolve_group, _single_process_dcp,
                  _TensorRef)
from .optim import place_optimizer_state
from .sharded import DCP_BLOCK_BYTES, ShardedRows, _for_dcp, optional_state_keys, sharded_state_dict
from .threads import empty_for_reading, load_planner, reader as _reader
from .verify import DIGEST, CheckpointCorruptError, PinnedDir, check_extents, check_files, crc32, load_dcp_metadata

__all__ = ["read_checkpoint", "load_checkpoint", "load_dcp"]

# A directory swapped out while it was being opened is opened again (the new version) this many times.
_PIN_ATTEMPTS = 20


def _read_meta(pinned: PinnedDir, weights_only: bool) -> dict:
    meta_path = os.path.join(pinned.path, _META_FILE)
    try:
        data = pinned.read(_META_FILE)
    except FileNotFoundError:
        raise FileNotFoundError(f"hugehead: {pinned.path} is not a checkpoint directory written by save_checkpoint "
                                f"(no {_META_FILE})") from None
    meta = _torch_load(data, meta_path, weights_only)
    if isinstance(meta, dict) and meta.get("format") == _FORMAT:  # the meta's bytes beside their digest
        if not isinstance(meta.get("meta"), bytes) or crc32(meta["meta"]) != meta.get(DIGEST):
            raise CheckpointCorruptError(meta_path, f"fails its {DIGEST} digest: its bytes changed since it was written")
        meta = _torch_load(meta["meta"], meta_path, weights_only)
    if not isinstance(meta, dict) or meta.get("format") not in _FORMATS_READ:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointCorruptError(meta_path, f"has checkpoint format {found!r}, expected {_FORMAT!r} (or the "
                                     "older formats this release reads)")
    return meta


def _torch_load(data: bytes, path: str, weights_only: bool) -> Any:
    if not data.startswith(b"PK\x03\x04"):  # every meta file is torch.save's zip format
        raise CheckpointCorruptError(path, f"is not a torch.save file ({len(data)} bytes, starting {data[:8]!r})")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError:
        raise  # torch's own message: what weights_only refused, and how to allow it
    except (RuntimeError, EOFError, ValueError, OSError, LookupError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(path, f"is not a readable torch.save file (truncated or of another kind: "
                                     f"{type(exc).__name__}: {exc})") from None


def _verified_metadata(pinned: PinnedDir, meta: dict, weights_only: bool, threads: int):
    """Every file the meta lists checked (sizes, then digests), then DCP's ``.metadata`` read (None when
    the checkpoint holds no tensors) and every file it places data in checked for length."""
    if meta.get("files") is not None:
        check_files(pinned, meta["files"], threads)
    try:
        data = pinned.read(".metadata")
    except FileNotFoundError:
        if meta["model_shapes"]:
            raise CheckpointCorruptError(os.path.join(pinned.path, ".metadata"), "is missing (the checkpoint's "
                                         "tensors are indexed there)") from None
        return None
    metadata = load_dcp_metadata(data, os.path.join(pinned.path, ".metadata"), weights_only)
    check_extents(pinned, metadata)
    return metadata


@contextlib.contextmanager
def _pinned_checkpoint(path: str, weights_only: bool, threads: int) -> Iterator[Tuple[PinnedDir, dict, Any]]:
    """``(pinned directory, meta, DCP metadata)`` of one whole, verified version of ``path``: a file that
    vanished or changed because a save swapped the directory out while it was opened means reading the
    version that replaced it."""
    for attempt in range(_PIN_ATTEMPTS):
        pinned = PinnedDir(path)
        try:
            meta = _read_meta(pinned, weights_only)
            metadata = _verified_metadata(pinned, meta, weights_only, threads)
            break
        except (FileNotFoundError, CheckpointCorruptError):
            replaced = pinned.replaced()
            pinned.close()
            if not replaced or attempt == _PIN_ATTEMPTS - 1:
                raise
        except BaseException:
            pinned.close()
            raise
    try:
        yield pinned, meta, metadata
    finally:
        pinned.close()


def _optimizer_params(optimizer: torch.optim.Optimizer) -> List[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def read_checkpoint(path: PathLike, model_state: Mapping[str, Any],
                    optimizers: Optional[Sequence[torch.optim.Optimizer]] = None, *, strict: bool = True,
                    weights_only: Optional[bool] = True,
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

    Nothing is written into ``model_state`` or an optimizer before every file of one version of ``path``
    was found whole: each file's size and digest (checkpoints of this release) and every extent DCP's
    index names. ``weights_only`` (True; None means True): nothing unpickled may run code (the meta file,
    ``extra`` and DCP's ``.metadata`` through allow-lists); False only for a checkpoint you trust.

    Raises:
        FileNotFoundError, ValueError: not a checkpoint; different shapes; optimizer state saved for other
            parameters (another placement, another optimizer, another world size). RuntimeError:
            (``strict``) other keys. CheckpointCorruptError (an ``OSError``): a file missing, truncated, of
            another kind or failing its digest, named. pickle.UnpicklingError: a file would run code.
    """
    pg = _resolve_group(process_group)
    rank, world = _group_rank(pg)
    threads = IO_THREADS if io_threads is None else int(io_threads)
    path = os.fspath(path)
    if pg is None and any(isinstance(v, ShardedRows) and v._partial for v in model_state.values()):
        raise ValueError("hugehead: the model holds a head that spans ranks: pass its process_group to "
                         "read_checkpoint/load_checkpoint (every rank reads its rows)")
    weights_only = True if weights_only is None else bool(weights_only)
    with _pinned_checkpoint(path, weights_only, threads) as (pinned, meta, metadata):
        return _read_pinned(path, pinned, meta, metadata, model_state, optimizers, strict=strict,
                            weights_only=weights_only, block_bytes=block_bytes, pg=pg, rank=rank, world=world,
                            threads=threads, optional_keys=optional_keys)


def _read_pinned(path, pinned, meta, metadata, model_state, optimizers, *, strict, weights_only, block_bytes, pg,
                 rank, world, threads, optional_keys):
    import torch.distributed.checkpoint as dcp

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
                    tensor = empty_for_reading(value.shape, value.dtype, param.device if on_param_device else "cpu")
                    targets[value.key] = _for_dcp(tensor, block_bytes)
                    param_state[key] = tensor
                state[pid] = param_state
            optimizer_states.append({**{k: v for k, v in saved.items() if k != "state"}, "state": state})

    if targets and metadata is None:
        raise CheckpointCorruptError(os.path.join(path, ".metadata"), "is missing (the checkpoint's tensors are "
                                     "indexed there)")
    storage = _reader(path, threads, pinned, metadata, weights_only)
    if pg is not None:
        try:
            dcp.load(targets, storage_reader=storage, planner=load_planner(weights_only), process_group=pg)
        except BaseException as exc:
            raise _as_rank_error(exc, rank) from None
    elif targets:
        with _single_process_dcp():
            dcp.load(targets, storage_reader=storage, planner=load_planner(weights_only), no_dist=True)
    return model_state, optimizer_states, meta["extra"]


def load_checkpoint(path: PathLike, model: nn.Module, optimizers=None, *, strict: bool = True,
                    weights_only: Optional[bool] = True, process_group=None, io_threads: Optional[int] = None) -> Any:
    """Load a directory written by :func:`save_checkpoint` into ``model`` (any placement and shard count
    of its heads: each shard reads only its rows, block by block, straight into its Parameters) and into
    ``optimizers`` (same placement; each state tensor is read onto its parameter's device).

    Args:
        strict: passed to ``model.load_state_dict``. weights_only: True (None means True): nothing read runs
            code; False only for a checkpoint you trust. process_group: as for :func:`save_checkpoint`
            (collective).
        io_threads: files read at once (None: :data:`IO_THREADS`).
    Returns:
        The ``extra`` object that was saved.
    Raises:
        FileNotFoundError, ValueError, CheckpointCorruptError, pickle.UnpicklingError: see
            :func:`read_checkpoint` (the model and optimizers are then unchanged); RuntimeError from
            ``load_state_dict``.
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



def load_dcp(state_dict: Dict[str, Any], path: PathLike, *, process_group=None, weights_only: bool = True,
             io_threads: Optional[int] = None) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=path)`` that runs no code from the
    checkpoint and reads one version of it: ``.metadata`` and every non-tensor value are unpickled through
    allow-lists (unless ``weights_only=False``), every file is read through one handle on the directory,
    and a missing or truncated file raises :class:`CheckpointCorruptError` before anything is loaded. For
    any DCP checkpoint (e.g. one ``dcp.save`` wrote for an FSDP2 model); collective over ``process_group``
    (None: the default group when ``torch.distributed`` is initialized, else this process only)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    threads = IO_THREADS if io_threads is None else int(io_threads)
    with PinnedDir(os.fspath(path)) as pinned:
        # Read and checked here, before dcp.load (which would fold its error into an AssertionError's text).
        metadata_path = os.path.join(pinned.path, ".metadata")
        try:
            data = pinned.read(".metadata")
        except FileNotFoundError:
            raise CheckpointCorruptError(metadata_path, "is missing (every DCP checkpoint has one)") from None
        metadata = load_dcp_metadata(data, metadata_path, weights_only)
        check_extents(pinned, metadata)
        storage = _reader(os.fspath(path), threads, pinned, metadata, weights_only)
        distributed = dist.is_available() and dist.is_initialized()
        dcp.load(state_dict, storage_reader=storage, planner=load_planner(weights_only),
                 process_group=process_group, no_dist=not distributed)
