"""Checkpoints of models that hold sharded heads, one concern per file:

- ``atomic.py``: atomic writes (temporary sibling, fsync, rename) for every file and directory written here;
- ``optim.py``: optimizer state kept on each shard's device;
- ``sharded.py``: :class:`ShardedRows` and :func:`sharded_state_dict` (heads as ``torch.distributed.checkpoint``
  sees them, never gathered);
- ``dcp.py``: the checkpoint directory (:func:`save_checkpoint`); ``load.py``: reading it back
  (:func:`load_checkpoint`, and :func:`load_dcp` for any DCP checkpoint); ``threads.py``: the storage writer
  and reader (several threads, a file per writer thread; the reader reads one pinned version);
- ``verify.py``: what a load trusts: one version pinned, sizes and digests checked before the model is
  written (:class:`CheckpointCorruptError`), DCP's ``.metadata`` unpickled through an allow-list;
- ``safetensors.py``: the streamed safetensors writer;
- ``space.py``: room on disk, checked before any byte is written (:class:`CheckpointSpaceError`);
- ``head.py``: how a ``ChunkedClassifier`` is saved and loaded in every placement (state-dict hooks,
  its safetensors file).

Nothing here imports Lightning; ``hugehead.lightning`` builds its callback and strategy on top of this.
"""
from .atomic import atomic_path
from .dcp import is_checkpoint_dir, save_checkpoint
from .load import load_checkpoint, load_dcp, read_checkpoint
from .optim import keep_optimizer_state_on_shards, place_optimizer_state
from .safetensors import BLOCK_BYTES, _write_tensor_bytes, write_safetensors
from .space import CheckpointSpaceError
from .verify import CheckpointCorruptError
from .sharded import (DCP_BLOCK_BYTES, ShardedRows, _for_dcp, optional_state_keys, sharded_state_dict,
                      sharded_state_dict_requested)

__all__ = [
    "place_optimizer_state", "keep_optimizer_state_on_shards", "ShardedRows", "sharded_state_dict",
    "save_checkpoint", "load_checkpoint", "is_checkpoint_dir", "write_safetensors", "atomic_path",
    "CheckpointSpaceError", "CheckpointCorruptError", "optional_state_keys", "load_dcp", "read_checkpoint",
]
