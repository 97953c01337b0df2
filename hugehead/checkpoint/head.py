"""How a :class:`~hugehead.ChunkedClassifier` is saved and loaded in every placement: its state-dict hooks
(the logical ``weight [V, D]`` and ``bias [V]`` in and out, whatever the shards), and its safetensors
file (one writer for every placement, streamed shard by shard; read into any placement).

The head's engine answers the two placement questions: ``checkpoint_group()`` (the process group a
checkpoint of the head is collective over, None for one process) and ``logical_rows(pieces, rows,
dst)`` (the logical tensor from this process's shards: a view, a host gather, or a gather over ranks).
Nothing here tests which engine it holds.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .sharded import ShardedRows, sharded_state_dict_requested
from .space import check_room

__all__ = ["save_safetensors", "load_safetensors", "state_dict_hook", "load_state_dict_pre_hook",
           "rename_missing_keys_hook", "SAFETENSORS_FORMAT"]

SAFETENSORS_FORMAT = "hugehead.ChunkedClassifier/1"
# Rows of the logical weight read from a checkpoint at a time: bounds the host memory such a pass needs,
# independent of the head's size.
_ROW_BLOCK_ELEMENTS = 1 << 24


def _names(head) -> Tuple[str, ...]:
    return ("weight", "bias") if head.has_bias else ("weight",)


# --------------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------------
def save_safetensors(head, path: str, *, keep_previous: bool = True) -> None:
    """Write ``head`` to a safetensors file; see :meth:`hugehead.ChunkedClassifier.save_safetensors`.

    One process: one tensor per shard (``weight.<k>``, ``bias.<k>``) with the class ranges in the file's
    metadata, each written from where it lives a block of rows at a time. A head spanning ranks
    (collective): the logical ``weight`` (and ``bias``) gathered to group rank 0, which writes the file
    after checking the disk has room for it (before anything is gathered); every rank returns once the
    file is complete, or raises rank 0's error.
    """
    from .safetensors import file_bytes, write_safetensors

    engine = head.engine
    group = engine.checkpoint_group()
    metadata = {
        "format": "pt",
        "hugehead.format": SAFETENSORS_FORMAT,
        "hugehead.in_features": str(head.in_features),
        "hugehead.num_classes": str(head.num_classes),
    }
    if group is None:  # every shard streamed from its own memory: nothing gathered
        tensors: List[Tuple[str, Tensor]] = []
        for k, shard in enumerate(head.shards):
            tensors += [(f"{name}.{k}", getattr(shard, name)) for name in _names(head)]
        metadata["hugehead.class_ranges"] = json.dumps([[s.start, s.stop] for s in head.shards])
        write_safetensors(path, tensors, metadata, keep_previous=keep_previous)
        return
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    rank = dist.get_rank(group)

    def on_rank_zero(step) -> None:
        """Run ``step`` on group rank 0 and raise its error, if any, on every rank."""
        outcome: List[Optional[BaseException]] = [None]
        if rank == 0:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - handed to every rank
                outcome[0] = exc
        dist.broadcast_object_list(outcome, src=src, group=group)
        if outcome[0] is not None:
            if rank == 0:
                raise outcome[0]
            raise outcome[0] from None

    itemsize = head.shards[0].weight.element_size()
    data_bytes = head.num_classes * (head.in_features + int(head.has_bias)) * itemsize
    target = os.path.abspath(os.fspath(path))
    on_rank_zero(lambda: check_room(target, file_bytes(data_bytes + (1 << 16)), f"safetensors file "
                                    f"{os.path.basename(target)}", removable=[] if keep_previous else [target]))
    tensors = []
    for name in _names(head):
        pieces = [(s.start, getattr(s, name)) for s in head.shards]
        tensors.append((name, engine.logical_rows(pieces, head.num_classes, dst=0)))
    metadata["hugehead.saved_world_size"] = str(group.size())
    on_rank_zero(lambda: write_safetensors(path, tensors, metadata, keep_previous=keep_previous))


_FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def _lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of ``src`` is a value of ``dst`` (float16 -> float32, float32 -> float64; never an
    integer into a float, nor float16 <-> bfloat16)."""
    return src == dst or (src.is_floating_point and dst.is_floating_point
                          and torch.promote_types(src, dst) == dst and torch.finfo(src).bits < torch.finfo(dst).bits)


def _check_dtypes(header: dict, path: str, head_dtype: torch.dtype, dtype: Optional[torch.dtype]) -> None:
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        src = _FILE_DTYPES.get(entry.get("dtype"))
        if src is None:
            raise TypeError(f"hugehead: {path}: {name} has dtype {entry.get('dtype')!r}, which a head cannot load")
        if dtype is not None:
            if src != dtype:
                raise TypeError(f"hugehead: {path}: {name} is {src}, not the dtype={dtype} asked for")
        elif not _lossless(src, head_dtype):
            raise TypeError(
                f"hugehead: {path}: {name} is {src}; loading it into this {head_dtype} head would cast it "
                f"lossily. Pass dtype={src} to cast it anyway, or build the head in {src}")


@torch.no_grad()
def load_safetensors(head, path: str, strict: bool = True, dtype: Optional[torch.dtype] = None) -> None:
    """Copy a safetensors file into ``head``'s shards; see :meth:`hugehead.ChunkedClassifier.load_safetensors`.
    The file is opened once (a save replacing it meanwhile is not mixed in), checked whole (extents,
    digest, dtypes) before any shard is written."""
    from safetensors import safe_open

    from .safetensors import check_safetensors

    with open(path, "rb") as pinned:
        header = check_safetensors(pinned, os.fspath(path))
        _check_dtypes(header, os.fspath(path), head.shards[0].weight.dtype, dtype)
        # safe_open reads the file this handle holds (the same inode, even if the path was replaced).
        same_file = f"/proc/self/fd/{pinned.fileno()}" if os.path.isdir("/proc/self/fd") else path
        with safe_open(same_file, framework="pt", device="cpu") as f:
            _copy_into(head, f, path, strict)


def _copy_into(head, f, path, strict: bool) -> None:
    names = set(f.keys())
    if "weight" in names:
        pieces = [(0, None, "weight", "bias")]
    else:
        ranges = json.loads((f.metadata() or {}).get("hugehead.class_ranges", "null"))
        if ranges is None:
            raise ValueError(
                f"hugehead: {path} has neither a 'weight' tensor nor hugehead shard metadata "
                f"(tensors: {sorted(names)})"
            )
        pieces = [(start, stop, f"weight.{k}", f"bias.{k}") for k, (start, stop) in enumerate(ranges)]
    stop = 0
    for i, (start, _, weight_name, bias_name) in enumerate(pieces):
        if weight_name not in names:
            raise ValueError(f"hugehead: {path} lacks tensor {weight_name!r}")
        shape = f.get_slice(weight_name).get_shape()
        if len(shape) != 2 or shape[1] != head.in_features:
            raise ValueError(
                f"hugehead: {path}: {weight_name} has shape {list(shape)}, but the head has "
                f"in_features={head.in_features} (expected [rows, {head.in_features}])"
            )
        if start != stop:
            raise ValueError(f"hugehead: {path}: {weight_name} starts at class {start}, expected {stop}")
        stop = start + shape[0]
        pieces[i] = (start, stop, weight_name, bias_name)
        if bias_name in names:
            bias_shape = f.get_slice(bias_name).get_shape()
            if list(bias_shape) != [shape[0]]:
                raise ValueError(
                    f"hugehead: {path}: {bias_name} has shape {list(bias_shape)}, expected [{shape[0]}]"
                )
    if stop != head.num_classes:
        raise ValueError(
            f"hugehead: {path} holds {stop} classes but the head has num_classes={head.num_classes}"
        )
    file_has_bias = all(p[3] in names for p in pieces)
    if strict and file_has_bias != head.has_bias:
        raise ValueError(
            f"hugehead: {path} {'has' if file_has_bias else 'has no'} bias but the head "
            f"{'has' if head.has_bias else 'has no'} bias (pass strict=False to ignore it)"
        )
    rows = max(1, _ROW_BLOCK_ELEMENTS // head.in_features)
    for shard in head.shards:
        for start, stop, weight_name, bias_name in pieces:
            lo, hi = max(start, shard.start), min(stop, shard.stop)
            destinations = [(weight_name, shard.weight)]
            if head.has_bias and file_has_bias:
                destinations.append((bias_name, shard.bias))
            for name, param in destinations:
                source = f.get_slice(name)
                for r0 in range(lo, hi, rows):
                    r1 = min(r0 + rows, hi)
                    param[r0 - shard.start:r1 - shard.start].copy_(source[r0 - start:r1 - start])


# --------------------------------------------------------------------------------------------------
# Placement-independent state dicts: logical ``weight [V, D]`` and ``bias [V]``
# --------------------------------------------------------------------------------------------------
def state_dict_hook(head, state_dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: the per-shard entries replaced by the logical ``weight`` and ``bias``.

    Inside :func:`hugehead.checkpoint.sharded_state_dict` they are :class:`ShardedRows` over this
    process's shards (no copy, nothing collective; ``local=True`` for a head spanning ranks). Otherwise
    the engine's ``logical_rows``: the shard itself when one shard holds every class, else one host
    tensor gathered from the shards (from every rank, collectively, for a head spanning ranks).
    """
    sharded = sharded_state_dict_requested()
    engine = head.engine
    spans_ranks = engine.checkpoint_group() is not None
    for name in _names(head):
        pieces = [(s.start, state_dict.pop(f"{prefix}shards.{k}.{name}")) for k, s in enumerate(head.shards)]
        if sharded:
            state_dict[prefix + name] = ShardedRows(pieces, head.num_classes, local=spans_ranks)
        else:
            state_dict[prefix + name] = engine.logical_rows(pieces, head.num_classes)


def load_state_dict_pre_hook(head, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                             error_msgs) -> None:
    """Load-state-dict pre-hook: the logical ``weight``/``bias`` (a tensor or :class:`ShardedRows` of any
    placement) split into this head's per-shard entries. A logical tensor of the wrong shape is reported
    as a size mismatch naming the shape expected (and not as a missing key)."""
    head._load_prefix = prefix
    head._load_mismatched = set()
    assign = local_metadata.get("assign_to_params_buffers", False)
    expected = {"weight": (head.num_classes, head.in_features), "bias": (head.num_classes,)}
    for name in _names(head):
        if prefix + name not in state_dict:
            continue
        logical = state_dict.pop(prefix + name)
        if not isinstance(logical, Tensor):
            error_msgs.append(f"hugehead: {prefix}{name} must be a tensor of shape {expected[name]}, got "
                              f"{type(logical).__name__}")
            head._load_mismatched.add(name)
            continue
        if tuple(logical.shape) != expected[name]:
            error_msgs.append(
                f"size mismatch for {prefix}{name}: copying a param with shape {tuple(logical.shape)} from "
                f"checkpoint, the shape in current model is {expected[name]} (in_features={head.in_features}, "
                f"num_classes={head.num_classes})."
            )
            head._load_mismatched.add(name)
            continue
        for k, shard in enumerate(head.shards):
            if isinstance(logical, ShardedRows):
                # Only this shard's rows, built on its device from the overlapping pieces (or the piece
                # itself when it already is this shard's tensor, e.g. after dcp.load in place).
                state_dict[f"{prefix}shards.{k}.{name}"] = logical.rows(shard.start, shard.stop, shard.device)
                continue
            piece = logical[shard.start:shard.stop]
            if assign and len(head.shards) > 1:
                # Assigned shards must not be views of one tensor (that would keep the whole logical
                # tensor alive, possibly on another device, and make shards share storage).
                piece = piece.to(shard.device, copy=True)
            elif assign:
                piece = piece.to(shard.device)
            state_dict[f"{prefix}shards.{k}.{name}"] = piece


def rename_missing_keys_hook(head, incompatible_keys) -> None:
    """Load-state-dict post-hook: a missing logical key is reported as itself, not as the per-shard keys it
    would have filled; a key that was present with the wrong shape is not reported missing (its size
    mismatch is)."""
    prefix = getattr(head, "_load_prefix", "")
    mismatched = getattr(head, "_load_mismatched", set())
    missing = incompatible_keys.missing_keys
    renamed: List[str] = []
    for key in missing:
        logical: Optional[str] = None
        for name in ("weight", "bias"):
            if key.startswith(prefix + "shards.") and key.endswith("." + name):
                logical = name
        if logical is not None:
            if logical in mismatched:
                continue
            key = prefix + logical
        if key not in renamed:
            renamed.append(key)
    missing[:] = renamed
