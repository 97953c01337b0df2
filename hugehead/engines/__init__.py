"""Placement engines: one per placement, same interface (``row_stats``, ``backward``, ``topk``).

``local``: shards on devices of this process. Planned: ``offload`` (pinned host memory) and
``distributed`` (a shard per rank).
"""
from .local import LocalEngine, PlacedInputs, ShardTensors

__all__ = ["LocalEngine", "PlacedInputs", "ShardTensors"]
