"""Checkpoints of models that hold sharded heads, one concern per file:

- ``atomic.py``: atomic writes (temporary sibling, fsync, rename) for every file and directory written here;
- ``optim.py``: optimizer state kept on each shard's device;
- ``sharded.py``: :class:`ShardedRows` and :func:`sharded_state_dict` (heads as ``torch.distributed.checkpoint``
  sees them, never gathered);
- ``dcp.py``: the checkpoint directory (:func:`save_checkpoint`, :func:`load_checkpoint`), and
  ``threads.py``: its storage writer and reader (several threads, a file per writer thread);
- ``safetensors.py``: the streamed safetensors writer;
- ``space.py``: room on disk, checked before any byte is written (:class:`CheckpointSpaceError`);
- ``head.py``: how a ``ChunkedClassifier`` is saved and loaded in every placement (state-dict hooks,
  its safetensors file).

Nothing here imports Lightning; ``hugehead.lightning`` builds its callback and strategy on top of this.
"""
from .atomic import atomic_path
from .dcp import is_checkpoint_dir, load_checkpoint, read_checkpoint, save_checkpoint
from .optim import keep_optimizer_state_on_shards, place_optimizer_state
from .safetensors import BLOCK_BYTES, _write_tensor_bytes, write_safetensors
from .space import CheckpointSpaceError
from .sharded import (DCP_BLOCK_BYTES, ShardedRows, _for_dcp, optional_state_keys, sharded_state_dict,
                      sharded_state_dict_requested)

__all__ = [
    "place_optimizer_state", "keep_optimizer_state_on_shards", "ShardedRows", "sharded_state_dict",
    "save_checkpoint", "load_checkpoint", "is_checkpoint_dir", "write_safetensors", "atomic_path",
    "CheckpointSpaceError", "optional_state_keys",
]
