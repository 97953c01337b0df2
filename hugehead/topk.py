"""Streaming top-k over a shard's chunks, the merge across shards, and :func:`linear_topk`.

Each chunk's logits ``Z = X W_cᵀ + b_c`` go into a reused workspace (GEMM through ATen), and one kernel
(``chunk_topk_``) folds them into a running ``[N, k]`` of values and class ids in place: no ``[N, V]``
tensor, no per-chunk sort of the candidates, no host synchronization. On CUDA the kernel of chunk ``j``
runs on a side stream while the main stream computes chunk ``j + 1``'s logits, as the loss's forward does.
Shards (devices, ranks) merge their ``[N, k]`` candidates by one sort of ``[N, shards * k]``.

The order everywhere: value descending, NaN above everything, ties to the lower class id; values are the
logits (softcapped when asked) in the compute dtype.
"""
from __future__ import annotations

import math
import numbers
from typing import Generator, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from ._extension import require_kernels
from .loop.chunks import _logits_into, _workspace_view, run_steps
from .loop.overlapped import _Overlap
from .loop.sources import ResidentChunks
from .options import FLOAT_DTYPES, autocast_dtype, check_chunk_size, check_memory_budget
from .budget import shard_oom_guard
from .plan import Plan, plan_topk_chunks

__all__ = ["linear_topk", "topk_state", "topk_steps", "shard_topk", "merge_topk", "check_k", "CUDA_MAX_K"]

# The CUDA kernel's shared memory holds 2k candidates and the k running entries of a row.
CUDA_MAX_K = 4096


def check_k(k, num_classes: int, device: torch.device) -> int:
    """``k`` as an int in ``[0, num_classes]`` (0: empty ``[N, 0]`` results), at most :data:`CUDA_MAX_K` on
    CUDA.

    Raises:
        TypeError: ``k`` is not an integer (a bool, a float, a tensor). ValueError: out of range.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"hugehead: k must be an int, got {type(k).__name__} {k!r}")
    k = int(k)
    if not 0 <= k <= num_classes:
        raise ValueError(f"hugehead: k must be in [0, num_classes={num_classes}], got {k}")
    if device.type == "cuda" and k > CUDA_MAX_K:
        raise ValueError(f"hugehead: k must be at most {CUDA_MAX_K} on CUDA, got {k}")
    return k


# --------------------------------------------------------------------------------------------------
# One shard
# --------------------------------------------------------------------------------------------------
def topk_state(n: int, k: int, dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor]:
    """An empty running top-k for :func:`hugehead.ops.chunk_topk_`: ``values [N, k]`` (``-inf``, ignored
    while empty) and ``indices [N, k]`` int64, all ``-1`` (empty slots)."""
    values = torch.full((n, k), -math.inf, dtype=dtype, device=device)
    indices = torch.full((n, k), -1, dtype=torch.int64, device=device)
    return values, indices


def topk_steps(
    x: Tensor,
    source: ResidentChunks,
    class_start: int,
    softcap: float,
    k: int,
    plan: Plan,
) -> Generator[None, None, Tuple[Tensor, Tensor]]:
    """Top ``min(k, V_k)`` logits of one shard's classes, chunk by chunk (no ``[N, V_k]`` tensor); a
    generator that yields after queueing each weight chunk's work (see
    :func:`hugehead.loop.forward_stats_steps`; :func:`shard_topk` runs it alone).

    Args:
        x: ``[N, D]`` compute dtype on the compute device. source: the shard's weight chunks (any
            source of :mod:`hugehead.loop`: resident or streamed).
        class_start: global id of the shard's first class. softcap: ``<= 0`` for none; otherwise the
            logits become ``softcap * tanh(z / softcap)`` (in the accumulation dtype, then ``x``'s).
        plan: from :func:`hugehead.plan.plan_topk_chunks`.
    Returns:
        ``(values [N, min(k, V_k)]`` in ``x``'s dtype, ``indices`` int64 global class ids``)``, sorted by
        value descending, ties to the lower class id.
    """
    n, v = x.shape[0], source.num_rows
    k = min(int(k), v)
    values, indices = topk_state(n, k, x.dtype, x.device)
    if n == 0 or k == 0:
        return values, indices
    if plan.overlap and x.is_cuda and plan.rows >= n:
        # The kernel of chunk j (side stream) overlaps chunk j + 1's GEMM (main stream); the running
        # top-k is only touched on the side stream, in chunk order. The GEMM adds the bias (cuBLAS fuses it).
        lanes = _Overlap(x, n, min(plan.cols, v))
        for j, chunk in enumerate(source.chunks(plan.cols)):
            z = _logits_into(x, chunk, lanes.workspace(j, n, chunk.c1 - chunk.c0))
            with lanes.on_side(j):
                ops.chunk_topk_(z, None, class_start + chunk.c0, softcap, values, indices)
            lanes.side_finished(j)
            yield
        lanes.join()
        return values, indices
    workspace = x.new_empty(min(plan.rows, n) * min(plan.cols, v))
    # The CPU BLAS adds a bias as a separate pass over the chunk (addmm with out=): the kernel adds it
    # while it reads the chunk anyway. On CUDA the GEMM's epilogue does.
    kernel_bias = not x.is_cuda
    # Chunks outer, rows inner: each weight chunk is fetched once, however many row blocks there are.
    for chunk in source.chunks(plan.cols):
        bias = None
        if kernel_bias and chunk.bias is not None:
            bias, chunk = chunk.bias.contiguous(), chunk._replace(bias=None)
        for r0 in range(0, n, plan.rows):
            r1 = min(r0 + plan.rows, n)
            z = _logits_into(x[r0:r1], chunk, _workspace_view(workspace, r1 - r0, chunk.c1 - chunk.c0))
            ops.chunk_topk_(z, bias, class_start + chunk.c0, softcap, values[r0:r1], indices[r0:r1])
        yield
    return values, indices


def shard_topk(*args, **kwargs) -> Tuple[Tensor, Tensor]:
    """:func:`topk_steps` run to its end."""
    return run_steps(topk_steps(*args, **kwargs))


def merge_topk(values: Tensor, indices: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The ``k`` best of candidate sets ``values, indices [N, M]`` (class ids distinct within a row; the
    shards' top-k side by side), sorted by value descending with ties to the lower class id (NaN counts
    as largest, as in :func:`torch.topk`). Returns ``(values [N, k], indices [N, k])``."""
    by_index = indices.argsort(dim=1)
    values, indices = values.gather(1, by_index), indices.gather(1, by_index)
    by_value = values.argsort(dim=1, descending=True, stable=True)[:, :k]
    return values.gather(1, by_value), indices.gather(1, by_value)


# --------------------------------------------------------------------------------------------------
# linear_topk: the functional API and its registered op
# --------------------------------------------------------------------------------------------------
def _check_inputs(x, weight, bias) -> Optional[torch.dtype]:
    """Check the inputs; returns the autocast compute dtype, or None when the inputs' dtype decides."""
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or not (bias is None or isinstance(bias, Tensor)):
        raise TypeError("hugehead: x and weight must be tensors, bias a tensor or None")
    if x.dim() != 2:
        raise ValueError(f"hugehead: x must be [N, D], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"hugehead: weight must be [V, D=x.shape[1]={x.shape[1]}], got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("hugehead: weight has no classes (V=0)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"hugehead: bias must be [V]=[{weight.shape[0]}], got shape {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"hugehead: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"hugehead: {name} is on {t.device} but x is on {x.device}")
    compute = autocast_dtype(x.device.type, x.dtype, weight.dtype, *(() if bias is None else (bias.dtype,)))
    if compute is None:
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.dtype != x.dtype:
                raise TypeError(f"hugehead: {name} dtype {t.dtype} differs from x dtype {x.dtype} (outside "
                                f"torch.autocast the dtypes must match, as for F.linear)")
    require_kernels(x.device)
    return compute


def _check_softcap(softcap) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
            math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"hugehead: softcap must be a finite positive number or None, got {softcap!r}")
    return float(softcap)


def _plan(x: Tensor, weight: Tensor, chunk_size: int, memory_budget: int) -> Plan:
    return plan_topk_chunks(x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size or None,
                            memory_budget or None)


@torch.library.custom_op("hugehead::linear_topk", mutates_args=())
def _linear_topk(x: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, softcap: float, chunk_size: int,
                 memory_budget: int) -> Tuple[Tensor, Tensor]:
    """``(values [N, k]`` in ``x``'s dtype, ``indices [N, k]`` int64``)``: the streamed top-k of
    ``x @ weight.T + bias`` on one device. ``x`` is in the compute dtype; weight and bias may be stored in
    another float dtype (autocast), cast chunk by chunk. chunk_size / memory_budget 0: planned."""
    plan = _plan(x, weight, chunk_size, memory_budget)
    v = weight.shape[0]
    # The loop issues its GEMMs with out= in the dtypes it chose: autocast must not recast inside it.
    with torch.autocast(x.device.type, enabled=False), shard_oom_guard(0, 0, v, x.device, plan,
                                                                         memory_budget or None):
        return shard_topk(x, ResidentChunks(weight, bias, x.dtype), 0, softcap, k, plan)


@_linear_topk.register_fake
def _(x, weight, bias, k, softcap, chunk_size, memory_budget):
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.int64)


def linear_topk(
    x: Tensor,
    weight: Tensor,
    k: int,
    bias: Optional[Tensor] = None,
    *,
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """The ``k`` largest logits of ``F.linear(x, weight, bias)`` per row, without the ``[N, V]`` logits:
    ``torch.topk(F.linear(x, weight, bias), k)`` with ties broken by the lower class id.

    Args:
        x: ``[N, D]`` float16, bfloat16, float32 or float64. weight: ``[V, D]``, same device; same dtype
            outside ``torch.autocast``. bias: ``[V]`` or None.
        k: an int in ``[0, V]`` (at most 4096 on CUDA); 0 gives ``[N, 0]`` results, as :meth:`ChunkedClassifier.topk`.
        softcap: ranks (and returns) ``softcap * tanh(z / softcap)`` of the logits (bias included).
        chunk_size: classes per chunk; None plans it from the shapes and ``memory_budget``.
        memory_budget: bytes of workspace the planner may use (default 4 GiB, at most a quarter of a CUDA
            device's free memory).

    Under ``torch.autocast`` the logits are computed in the autocast dtype (``x`` cast once, the weight
    and bias a chunk at a time), as :func:`hugehead.linear_cross_entropy` does. Works under
    ``torch.compile`` (one registered op). No gradients flow (inference).

    Returns:
        ``(values [N, k]`` in the compute dtype, ``indices [N, k]`` int64 class ids``)`` on ``x``'s
        device, sorted by value descending (NaN first), ties to the lower class id.
    Raises:
        TypeError: non-tensor inputs, an unsupported or mismatched dtype, a non-int ``k``.
        ValueError: shape or device mismatch, ``k`` out of range, bad softcap/chunk_size/memory_budget.
    """
    compute = _check_inputs(x, weight, bias)
    k = check_k(k, weight.shape[0], x.device)
    cap = _check_softcap(softcap)
    chunk_size = check_chunk_size(chunk_size)
    memory_budget = check_memory_budget(memory_budget)
    if compute is not None and x.dtype != compute:
        x = x.to(compute)
    with torch.no_grad():
        return torch.ops.hugehead.linear_topk(x.detach(), weight.detach(), None if bias is None else bias.detach(),
                                              k, cap, int(chunk_size or 0), int(memory_budget or 0))
