"""ShardedRows: a logical tensor whose row ranges live apart (a head's ``weight [V, D]`` as its shards'
weights), as ``torch.distributed.checkpoint`` sees it; and :func:`sharded_state_dict`, a model's state
dict with every head given that way (nothing gathered, nothing copied)."""
from __future__ import annotations

import contextvars
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn

# The largest item a DCP checkpoint stores (DCP reads a stored item whole, so this also bounds host memory
# on load).
DCP_BLOCK_BYTES = 1 << 28


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
                return _with_own_storage(piece) if self._stage_to_host else piece
        raise ValueError(f"hugehead: ShardedRows {index.fqn!r} has no piece at offset {tuple(index.offset)}")


def _with_own_storage(block: Tensor) -> Tensor:
    """``block`` (a contiguous CPU row block, e.g. of an offloaded shard) as a tensor sharing its memory whose
    storage is exactly its bytes: DCP's writer copies a tensor whose storage is larger than it (it would
    otherwise save the whole storage), which for a block of a shard would be a host copy of every byte."""
    if block.device.type != "cpu" or not block.is_contiguous() or block.numel() == 0 \
            or block.untyped_storage().nbytes() == block.numel() * block.element_size():
        return block
    raw = torch.from_numpy(block.detach().reshape(-1).view(torch.uint8).numpy())  # keeps block alive
    return raw.view(block.dtype).view(block.shape)


_SHARDED_STATE_DICT = contextvars.ContextVar("hugehead_sharded_state_dict", default=False)


def sharded_state_dict_requested() -> bool:
    """True inside :func:`sharded_state_dict` (the heads' state-dict hooks ask)."""
    return _SHARDED_STATE_DICT.get()


def optional_state_keys(module: nn.Module) -> List[str]:
    """The keys of ``module.state_dict()`` that a checkpoint may lack: those a submodule names in its
    ``optional_state_keys`` attribute (a head's ``class_weight`` / ``pos_weight`` buffers, which
    checkpoints of older releases do not have), with the submodule's prefix."""
    keys = []
    for prefix, sub in module.named_modules():
        for name in getattr(sub, "optional_state_keys", ()):
            if getattr(sub, name, None) is not None:
                keys.append(f"{prefix}.{name}" if prefix else name)
    return keys


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

