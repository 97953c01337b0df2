"""Placement engines: one per placement, same interface (``row_stats``, ``backward``, ``topk``), all
running the one chunk loop of :mod:`hugehead.loop`.

``local``: shards on devices of this process. ``offload``: shards in pinned host memory, streamed to
the compute GPUs on copy streams. ``distributed``: a contiguous class range per rank of a process
group (its shards themselves local or offloaded).
"""
from .local import LocalEngine, PlacedInputs, ShardTensors

__all__ = ["LocalEngine", "PlacedInputs", "ShardTensors"]
