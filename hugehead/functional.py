"""linear_cross_entropy and the per-shard chunk loop every placement engine runs.

The loop streams the vocabulary in chunks of ``C`` classes (and, for very large batches, the rows in
blocks of ``R``): ``Z = X W_cᵀ + b_c`` goes into a reused workspace (GEMM through ATen), then one of our
kernels folds it into per-row statistics (forward) or turns it into its gradient in place (backward).
No ``[N, V]`` tensor is ever allocated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from ._extension import require_kernels

__all__ = [
    "linear_cross_entropy",
    "Plan",
    "plan_chunks",
    "RowStats",
    "shard_forward_stats",
    "merge_row_stats",
    "row_losses",
    "shard_backward",
    "check_targets",
    "validate_options",
]

DEFAULT_MEMORY_BUDGET = 4 << 30
_MAX_COLS = {"cuda": 32768, "cpu": 8192}
_MIN_COLS = 256
_REDUCTIONS = ("mean", "sum", "none")


# --------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Workspace shape of one shard's chunk loop: ``rows`` × ``cols`` logits at a time."""

    rows: int
    cols: int


def plan_chunks(
    n: int,
    d: int,
    v: int,
    dtype: torch.dtype,
    device: torch.device,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Plan:
    """Choose the chunk shape for ``N`` rows, ``D`` features and ``V`` classes within a memory budget.

    The workspace is one ``rows × cols`` logits chunk plus, in the backward, two ``rows × D`` buffers
    for ``dX``. ``chunk_size`` pins ``cols``; ``memory_budget`` (bytes, default 4 GiB, and at most a
    quarter of the free memory of a CUDA device) bounds the rest. Rows are split only when even a
    ``_MIN_COLS``-wide chunk of all rows would not fit.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if memory_budget is None:
        memory_budget = DEFAULT_MEMORY_BUDGET
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory_budget = min(memory_budget, free // 4)
    n, v = max(n, 1), max(v, 1)
    max_cols = _MAX_COLS.get(device.type, _MAX_COLS["cpu"])
    if chunk_size is not None:
        cols = min(int(chunk_size), v)
    else:
        dx_bytes = n * d * (itemsize + 4)
        cols = (memory_budget - dx_bytes) // (n * itemsize)
        cols = max(_MIN_COLS, min(max_cols, cols))
        if cols < v:  # round down to a multiple of 256 columns: aligned rows, GEMM-friendly widths
            cols = max(_MIN_COLS, cols // _MIN_COLS * _MIN_COLS)
        cols = min(cols, v)
    rows = n
    if rows * cols * itemsize + rows * d * (itemsize + 4) > memory_budget:
        rows = max(1, memory_budget // (cols * itemsize + d * (itemsize + 4)))
    return Plan(rows=min(rows, n), cols=max(cols, 1))


# --------------------------------------------------------------------------------------------------
# The chunk loop (one shard on one device)
# --------------------------------------------------------------------------------------------------
class RowStats(NamedTuple):
    """Per-row statistics of one shard (or merged over shards), all ``[N]`` in the accumulation dtype."""

    max: Tensor
    sumexp: Tensor
    target_logit: Tensor
    logit_sum: Tensor


def _chunk_logits(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], c0: int, c1: int, workspace: Tensor
) -> Tensor:
    """``x [R, D] @ weight[c0:c1]ᵀ (+ bias[c0:c1])`` into the flat ``workspace``; returns ``[R, c1-c0]``."""
    z = workspace[: x.shape[0] * (c1 - c0)].view(x.shape[0], c1 - c0)
    w = weight[c0:c1]
    if bias is None:
        torch.mm(x, w.t(), out=z)
    else:
        torch.addmm(bias[c0:c1], x, w.t(), out=z)
    return z


def shard_forward_stats(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_start: int,
    softcap: float,
    plan: Plan,
) -> RowStats:
    """Row statistics of one shard's classes ``[class_start, class_start + V_k)``.

    Args:
        x: ``[N, D]`` on the shard's device. weight: ``[V_k, D]``; bias: ``[V_k]`` or None.
        target: ``[N]`` int64 global class ids on the shard's device.
        softcap: ``<= 0`` for none.
    Returns:
        :class:`RowStats` on the shard's device; ``target_logit`` is 0 for rows whose target is not in
        this shard, so shards merge by summing it.
    """
    n = x.shape[0]
    v = weight.shape[0]
    acc = ops.acc_dtype(x.dtype)
    stats = RowStats(
        torch.full((n,), -math.inf, dtype=acc, device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
        torch.zeros(n, dtype=acc, device=x.device),
    )
    if n == 0 or v == 0:
        return stats
    workspace = torch.empty(min(plan.rows, n) * min(plan.cols, v), dtype=x.dtype, device=x.device)
    for r0 in range(0, n, plan.rows):
        r1 = min(r0 + plan.rows, n)
        rows = RowStats(*(s[r0:r1] for s in stats))
        for c0 in range(0, v, plan.cols):
            c1 = min(c0 + plan.cols, v)
            z = _chunk_logits(x[r0:r1], weight, bias, c0, c1, workspace)
            ops.chunk_stats_(z, target[r0:r1], class_start + c0, softcap, *rows)
    return stats


def merge_row_stats(parts: List[RowStats]) -> Tuple[Tensor, Tensor, Tensor]:
    """Merge per-shard statistics (all on one device) into ``(lse, target_logit, logit_sum)``."""
    if len(parts) == 1:
        p = parts[0]
        return p.max + p.sumexp.log(), p.target_logit, p.logit_sum
    m = torch.stack([p.max for p in parts])
    s = torch.stack([p.sumexp for p in parts])
    m_all = m.max(dim=0).values
    # exp(-inf - -inf) must count as 0 (an all -inf shard), not NaN.
    scale = torch.where(m == -math.inf, torch.zeros_like(m), (m - m_all).exp())
    lse = m_all + (s * scale).sum(dim=0).log()
    target_logit = torch.stack([p.target_logit for p in parts]).sum(dim=0)
    logit_sum = torch.stack([p.logit_sum for p in parts]).sum(dim=0)
    return lse, target_logit, logit_sum


def row_losses(
    lse: Tensor,
    target_logit: Tensor,
    logit_sum: Tensor,
    valid: Tensor,
    num_classes: int,
    label_smoothing: float,
    z_loss: float,
) -> Tensor:
    """Per-row loss ``lse - (1-eps) c_y - eps/V sum_j c_j + z_loss lse^2``, 0 on ignored rows."""
    # Differences first, as F.cross_entropy does: (1-eps)(lse - c_y) + eps(lse - mean_j c_j). Scaling
    # lse and c_y before subtracting would leave a rounding error of order |c_y| on a loss that may be
    # far smaller (a confident row; a single class).
    loss = lse - target_logit
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - logit_sum / num_classes)
    if z_loss:
        loss = loss + z_loss * lse.square()
    return torch.where(valid, loss, torch.zeros_like(loss))


def shard_backward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_start: int,
    num_classes: int,
    lse: Tensor,
    grad_rows: Tensor,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    plan: Plan,
    grad_x: Optional[Tensor],
    need_weight: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients of one shard, recomputing its logits chunk by chunk.

    Args:
        lse, grad_rows: ``[N]`` accumulation dtype, on the shard's device; ``grad_rows`` is
            ``dLoss/dloss_row`` and zero on ignored rows.
        grad_x: ``[N, D]`` accumulation-dtype buffer that ``dX`` of this shard is added into, or None.
        need_weight: compute ``dW`` (and ``db`` when bias is given).
    Returns:
        ``(grad_weight [V_k, D], grad_bias [V_k] or None)`` in the parameters' dtypes, each chunk of
        ``grad_weight`` written once (no atomics: deterministic), or ``(None, None)``.
    """
    n, d = x.shape
    v = weight.shape[0]
    acc = ops.acc_dtype(x.dtype)
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else None
    grad_b = torch.empty_like(bias) if (need_weight and bias is not None) else None
    if n == 0 or v == 0:
        if grad_w is not None:
            grad_w.zero_()
        if grad_b is not None:
            grad_b.zero_()
        return grad_w, grad_b
    rows_split = plan.rows < n
    workspace = torch.empty(min(plan.rows, n) * min(plan.cols, v), dtype=x.dtype, device=x.device)
    # dX partials are added in the accumulation dtype; a low-precision partial per chunk keeps the
    # rounding of each partial independent (and matches a single GEMM's error), unlike a low-precision
    # running sum.
    dx_partial = None
    if grad_x is not None and grad_x.dtype != x.dtype:
        dx_partial = torch.empty(min(plan.rows, n), d, dtype=x.dtype, device=x.device)
    dw_acc = (
        torch.empty(min(plan.cols, v), d, dtype=acc, device=x.device) if (rows_split and need_weight) else None
    )
    for c0 in range(0, v, plan.cols):
        c1 = min(c0 + plan.cols, v)
        w = weight[c0:c1]
        db_chunk = None
        for r0 in range(0, n, plan.rows):
            r1 = min(r0 + plan.rows, n)
            xr = x[r0:r1]
            g = _chunk_logits(xr, weight, bias, c0, c1, workspace)
            ops.chunk_grad_(
                g, target[r0:r1], class_start + c0, num_classes, lse[r0:r1], grad_rows[r0:r1],
                label_smoothing, z_loss, softcap,
            )
            if grad_x is not None:
                if dx_partial is None:
                    grad_x[r0:r1].addmm_(g, w)
                else:
                    part = dx_partial[: r1 - r0]
                    torch.mm(g, w, out=part)
                    grad_x[r0:r1].add_(part)
            if need_weight:
                if not rows_split:
                    torch.mm(g.t(), xr, out=grad_w[c0:c1])
                elif r0 == 0:
                    torch.mm(g.t().to(acc), xr.to(acc), out=dw_acc[: c1 - c0])
                else:
                    dw_acc[: c1 - c0].addmm_(g.t().to(acc), xr.to(acc))
                if grad_b is not None:
                    part_b = g.sum(dim=0, dtype=acc)
                    db_chunk = part_b if db_chunk is None else db_chunk + part_b
        if need_weight and rows_split:
            grad_w[c0:c1].copy_(dw_acc[: c1 - c0])
        if grad_b is not None:
            grad_b[c0:c1].copy_(db_chunk)
    return grad_w, grad_b


# --------------------------------------------------------------------------------------------------
# Checks shared by the functional API and the module
# --------------------------------------------------------------------------------------------------
def validate_options(reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float]) -> float:
    """Check the loss options; returns softcap as the kernels take it (0.0 for none).

    Raises:
        ValueError: unknown reduction, label_smoothing outside [0, 1], negative or non-finite z_loss,
            non-finite or non-positive softcap.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"hugehead: unknown reduction {reduction!r}; expected one of {_REDUCTIONS}")
    if not (0.0 <= float(label_smoothing) <= 1.0):
        raise ValueError(f"hugehead: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(float(z_loss)) and float(z_loss) >= 0.0):
        raise ValueError(f"hugehead: z_loss must be finite and >= 0, got {z_loss}")
    if softcap is None:
        return 0.0
    if not (math.isfinite(float(softcap)) and float(softcap) > 0.0):
        raise ValueError(f"hugehead: softcap must be a finite positive number or None, got {softcap}")
    return float(softcap)


def check_targets(target: Tensor, num_classes: int, ignore_index: int) -> None:
    """Raise ``ValueError`` naming the first target outside ``[0, num_classes)`` that is not
    ``ignore_index``. One small device-to-host read; runs before any kernel sees the targets."""
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        value = int(target[first])
        raise ValueError(
            f"hugehead: target {value} at row {first} is out of range for {num_classes} classes "
            f"(valid: 0..{num_classes - 1}, or ignore_index={ignore_index})"
        )


def _check_inputs(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor]) -> None:
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or not isinstance(target, Tensor):
        raise TypeError("hugehead: x, weight and target must be tensors")
    if x.dim() != 2:
        raise ValueError(f"hugehead: x must be [N, D], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"hugehead: weight must be [V, D], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"hugehead: x has D={x.shape[1]} features but weight is {tuple(weight.shape)} (expected [V, {x.shape[1]}])"
        )
    if weight.shape[0] == 0:
        raise ValueError("hugehead: weight has no classes (V=0)")
    if target.dim() != 1 or target.shape[0] != x.shape[0]:
        raise ValueError(f"hugehead: target must be [N]=[{x.shape[0]}], got shape {tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"hugehead: target must be int64 or int32, got {target.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"hugehead: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"hugehead: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    tensors = {"weight": weight, "target": target}
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(f"hugehead: bias must be [V]=[{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"hugehead: bias dtype {bias.dtype} differs from x dtype {x.dtype}")
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"hugehead: {name} is on {t.device} but x is on {x.device}")
    require_kernels(x.device)


# --------------------------------------------------------------------------------------------------
# The single-device op: a custom op over the whole chunk loop, so torch.compile sees one node
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("hugehead::linear_cross_entropy_forward", mutates_args=())
def _lce_forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    memory_budget: int,
) -> Tuple[Tensor, Tensor]:
    """Per-row losses ``[N]`` and lse ``[N]`` (accumulation dtype). chunk_size/memory_budget 0: planned."""
    v = weight.shape[0]
    check_targets(target, v, ignore_index)
    plan = plan_chunks(x.shape[0], x.shape[1], v, x.dtype, x.device, chunk_size or None, memory_budget or None)
    stats = shard_forward_stats(x, weight, bias, target, 0, softcap, plan)
    lse, target_logit, logit_sum = merge_row_stats([stats])
    loss = row_losses(lse, target_logit, logit_sum, target != ignore_index, v, label_smoothing, z_loss)
    return loss, lse


@_lce_forward.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget):
    acc = ops.acc_dtype(x.dtype)
    return x.new_empty(x.shape[0], dtype=acc), x.new_empty(x.shape[0], dtype=acc)


@torch.library.custom_op("hugehead::linear_cross_entropy_backward", mutates_args=())
def _lce_backward(
    grad_loss: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    memory_budget: int,
    need_x: bool,
    need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dX [N, D], dW [V, D], db [V])``; a gradient not asked for (or db without bias) is empty."""
    v = weight.shape[0]
    acc = ops.acc_dtype(x.dtype)
    plan = plan_chunks(x.shape[0], x.shape[1], v, x.dtype, x.device, chunk_size or None, memory_budget or None)
    grad_rows = torch.where(target != ignore_index, grad_loss.to(acc), torch.zeros((), dtype=acc, device=x.device))
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
    grad_w, grad_b = shard_backward(
        x, weight, bias, target, 0, v, lse, grad_rows, label_smoothing, z_loss, softcap, plan, grad_x, need_weight
    )
    # A gradient not asked for is a fresh empty tensor each: custom op outputs may not alias each other.
    return (
        grad_x.to(x.dtype) if grad_x is not None else x.new_empty(0),
        grad_w if grad_w is not None else x.new_empty(0),
        grad_b if grad_b is not None else x.new_empty(0),
    )


@_lce_backward.register_fake
def _(grad_loss, x, weight, bias, target, lse, ignore_index, label_smoothing, z_loss, softcap, chunk_size,
      memory_budget, need_x, need_weight):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else x.new_empty(0),
        torch.empty_like(bias) if (need_weight and bias is not None) else x.new_empty(0),
    )


def _lce_setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget = inputs
    _, lse = output
    ctx.save_for_backward(x, weight, bias, target, lse)
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget)
    ctx.mark_non_differentiable(lse)


def _lce_backward_autograd(ctx, grad_loss, grad_lse):
    x, weight, bias, target, lse = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0]
    need_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
    grad_x, grad_w, grad_b = torch.ops.hugehead.linear_cross_entropy_backward(
        grad_loss, x, weight, bias, target, lse, *ctx.options, need_x, need_weight
    )
    return (
        grad_x if need_x else None,
        grad_w if ctx.needs_input_grad[1] else None,
        grad_b if (bias is not None and ctx.needs_input_grad[2]) else None,
        None, None, None, None, None, None, None,
    )


_lce_forward.register_autograd(_lce_backward_autograd, setup_context=_lce_setup_context)


def reduce_loss(loss_rows: Tensor, valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """Apply ``reduction`` to per-row losses as F.cross_entropy does ("mean" over non-ignored rows,
    NaN when there are none) and cast to the inputs' dtype."""
    if reduction == "none":
        return loss_rows.to(dtype)
    total = loss_rows.sum()
    if reduction == "sum":
        return total.to(dtype)
    return (total / valid.sum()).to(dtype)


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` without the ``[N, V]`` logits.

    Args:
        x: ``[N, D]`` float16, bfloat16, float32 or float64; any strides.
        weight: ``[V, D]``, same dtype and device as ``x``. bias: ``[V]`` or None.
        target: ``[N]`` int64 or int32 class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index, reduction, label_smoothing: as in :func:`torch.nn.functional.cross_entropy`
            ("mean" divides by the number of non-ignored rows).
        z_loss: adds ``z_loss * lse**2`` per non-ignored row (PaLM).
        softcap: maps logits (bias included) through ``softcap * tanh(z / softcap)`` first (Gemma 2).
        chunk_size: classes per chunk; None plans it from the shapes and ``memory_budget``.
        memory_budget: bytes of workspace the planner may use (default 4 GiB).
    Returns:
        The loss in ``x``'s dtype: a scalar, or ``[N]`` for ``reduction="none"``.
    Raises:
        ValueError: shape or device mismatch, a target out of range, bad options.
        TypeError: unsupported or mismatched dtypes.
    """
    _check_inputs(x, weight, target, bias)
    cap = validate_options(reduction, label_smoothing, z_loss, softcap)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"hugehead: chunk_size must be >= 1, got {chunk_size}")
    if memory_budget is not None and int(memory_budget) < 1:
        raise ValueError(f"hugehead: memory_budget must be >= 1 byte, got {memory_budget}")
    target = target.long().contiguous()
    loss_rows, _ = torch.ops.hugehead.linear_cross_entropy_forward(
        x, weight, bias, target, int(ignore_index), float(label_smoothing), float(z_loss), cap,
        int(chunk_size or 0), int(memory_budget or 0),
    )
    return reduce_loss(loss_rows, target != ignore_index, reduction, x.dtype)


# --------------------------------------------------------------------------------------------------
# Streaming top-k: inference over all classes without the [N, V] logits
# --------------------------------------------------------------------------------------------------
__all__ += ["plan_topk_chunks", "shard_topk", "merge_topk"]

# Bytes per logit that the exact selection of a chunk holds beyond the workspace: two bool masks and
# two int32 rank tensors.
_TOPK_TEMP_BYTES = 10


def plan_topk_chunks(
    n: int,
    d: int,
    v: int,
    dtype: torch.dtype,
    device: torch.device,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Plan:
    """:func:`plan_chunks` for :func:`shard_topk`: the same budget also covers the selection's
    temporaries (about 10 bytes per logit), so unpinned chunks are narrower."""
    plan = plan_chunks(n, d, v, dtype, device, chunk_size, memory_budget)
    if chunk_size is not None:
        return plan
    itemsize = torch.empty((), dtype=dtype).element_size()
    cols = plan.cols * itemsize // (itemsize + _TOPK_TEMP_BYTES)
    if cols >= _MIN_COLS:
        cols = cols // _MIN_COLS * _MIN_COLS
    return Plan(rows=plan.rows, cols=max(1, min(cols, v)))


def merge_topk(values: Tensor, indices: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The ``k`` best of candidate sets ``values, indices [N, M]`` (class ids distinct within a row),
    sorted by value descending with ties to the lower class id (NaN counts as largest, as in
    :func:`torch.topk`). Returns ``(values [N, k], indices [N, k])``."""
    by_index = indices.argsort(dim=1)
    values, indices = values.gather(1, by_index), indices.gather(1, by_index)
    by_value = values.argsort(dim=1, descending=True, stable=True)[:, :k]
    return values.gather(1, by_value), indices.gather(1, by_value)


def _chunk_topk(z: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The exact top ``k`` columns of ``z [R, C]`` by (value descending, column ascending), unsorted.

    :func:`torch.topk` picks among values tied with the k-th largest arbitrarily; here every column
    above the k-th value is kept and the tied ones are taken lowest column first, through a second
    top-k over distinct integer ranks.
    """
    c = z.shape[1]
    if k >= c:
        cols = torch.arange(c, device=z.device).expand(z.shape[0], c)
        return z.clone(), cols
    kth = torch.topk(z, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    col = torch.arange(c, device=z.device, dtype=torch.int32)
    rank = torch.where(z > kth, 2 * c - col, torch.where(z == kth, c - col, -1))
    cols = torch.topk(rank, k, dim=1, sorted=False).indices
    return z.gather(1, cols), cols


def shard_topk(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    class_start: int,
    softcap: float,
    k: int,
    plan: Plan,
) -> Tuple[Tensor, Tensor]:
    """Top ``min(k, V_k)`` logits of one shard's classes, chunk by chunk (no ``[N, V_k]`` tensor).

    Args:
        x: ``[N, D]`` on the shard's device. weight: ``[V_k, D]``; bias: ``[V_k]`` or None.
        softcap: ``<= 0`` for none; otherwise logits become ``softcap * tanh(z / softcap)`` (computed
            in the accumulation dtype, returned in ``x``'s dtype).
        plan: from :func:`plan_topk_chunks`.
    Returns:
        ``(values [N, min(k, V_k)]`` in ``x``'s dtype, ``indices`` int64 global class ids``)``, sorted by
        value descending, ties to the lower class id.
    """
    n, v = x.shape[0], weight.shape[0]
    k = min(int(k), v)
    values = x.new_empty(n, k)
    indices = torch.empty(n, k, dtype=torch.int64, device=x.device)
    if n == 0 or k == 0:
        return values, indices
    acc = ops.acc_dtype(x.dtype)
    workspace = torch.empty(min(plan.rows, n) * min(plan.cols, v), dtype=x.dtype, device=x.device)
    for r0 in range(0, n, plan.rows):
        r1 = min(r0 + plan.rows, n)
        best = None
        for c0 in range(0, v, plan.cols):
            c1 = min(c0 + plan.cols, v)
            z = _chunk_logits(x[r0:r1], weight, bias, c0, c1, workspace)
            if softcap > 0:
                if z.dtype == acc:
                    z.div_(softcap).tanh_().mul_(softcap)
                else:
                    z.copy_(z.to(acc).div_(softcap).tanh_().mul_(softcap))
            chunk_values, chunk_cols = _chunk_topk(z, k)
            chunk_ids = chunk_cols.to(torch.int64) + (class_start + c0)
            if best is not None:
                chunk_values = torch.cat([best[0], chunk_values], dim=1)
                chunk_ids = torch.cat([best[1], chunk_ids], dim=1)
            best = merge_topk(chunk_values, chunk_ids, k)
        values[r0:r1], indices[r0:r1] = best
    return values, indices
