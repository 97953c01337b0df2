"""linear_cross_entropy: input checks, the mixed-precision policy, the single-device registered op over
the chunk loop of :mod:`hugehead.loop`, and the reductions.

Mixed precision (DESIGN.md): under ``torch.autocast`` the head computes in the autocast dtype — ``x`` is
cast once, the weight and bias chunk by chunk inside the loop — with float32 accumulation; Parameters
keep their dtype and get gradients in it. The loss is float32 for 16-bit inputs (float64 for float64).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops
from ._extension import require_kernels
from .engines.local import shard_oom_guard
from .sparse import is_sparse_target
from .loop import (  # noqa: F401  (re-exported: the loop's names were public here before loop.py)
    DEFAULT_MEMORY_BUDGET,
    Plan,
    ResidentChunks,
    RowStats,
    kept_shape,
    merge_row_stats,
    merge_topk,
    plan_chunks,
    plan_topk_chunks,
    row_losses,
    shard_backward,
    shard_forward_stats,
    shard_topk,
)

__all__ = [
    "linear_cross_entropy",
    "autocast_dtype",
    "loss_dtype",
    "check_targets",
    "validate_options",
    "reduce_loss",
]

_REDUCTIONS = ("mean", "sum", "none")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def autocast_dtype(device_type: str, *dtypes: torch.dtype) -> Optional[torch.dtype]:
    """The dtype the head computes in under ``torch.autocast`` on ``device_type``, or None when autocast
    is off there (or, as for ``F.linear``, when an input is float64, which autocast leaves alone)."""
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    if not all(dt in _AUTOCAST_ELIGIBLE for dt in dtypes):
        return None
    return torch.get_autocast_dtype(device_type)


def loss_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16/float32 computations, float64 for float64 (as ``F.cross_entropy``
    under autocast, Cut Cross-Entropy and Liger-Kernel return a float32 loss for 16-bit logits)."""
    return ops.acc_dtype(compute_dtype)


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


def _check_inputs(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor]) -> Optional[torch.dtype]:
    """Check the inputs; returns the autocast compute dtype, or None when the inputs' dtype decides."""
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
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"hugehead: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"hugehead: bias must be [V]=[{weight.shape[0]}], got shape {tuple(bias.shape)}")
    compute = autocast_dtype(x.device.type, x.dtype, weight.dtype, *(() if bias is None else (bias.dtype,)))
    if compute is None:  # as plain PyTorch outside autocast: the dtypes must agree
        if weight.dtype != x.dtype:
            raise TypeError(
                f"hugehead: weight dtype {weight.dtype} differs from x dtype {x.dtype} (outside torch.autocast "
                f"the dtypes must match, as for F.linear)"
            )
        if bias is not None and bias.dtype != x.dtype:
            raise TypeError(f"hugehead: bias dtype {bias.dtype} differs from x dtype {x.dtype}")
    tensors = {"weight": weight, "target": target}
    if bias is not None:
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"hugehead: {name} is on {t.device} but x is on {x.device}")
    require_kernels(x.device)
    return compute


def _no_autocast(device: torch.device):
    # The loop issues its GEMMs with out= in the dtypes it chose; autocast must not recast inside it.
    return torch.autocast(device.type, enabled=False)


def _plan(x: Tensor, weight: Tensor, chunk_size: int, memory_budget: int, keep: bool) -> Plan:
    return plan_chunks(
        x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size or None, memory_budget or None,
        weight_dtype=weight.dtype, allow_keep=keep, direct_dx=True,
    )


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
    keep_logits: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-row losses ``[N]``, lse ``[N]`` (accumulation dtype) and the kept logits
    ``[kept_chunks, N, cols]`` (empty unless ``keep_logits`` and the plan keeps some). ``x`` is in the
    compute dtype; weight and bias may be stored in another float dtype (autocast), cast chunk by chunk.
    chunk_size/memory_budget 0: planned."""
    v = weight.shape[0]
    check_targets(target, v, ignore_index)
    plan = _plan(x, weight, chunk_size, memory_budget, keep_logits)
    with _no_autocast(x.device), shard_oom_guard(0, 0, v, x.device, plan, memory_budget or None):
        stats, kept = shard_forward_stats(x, ResidentChunks(weight, bias, x.dtype), target, 0, softcap, plan)
        lse, target_logit, logit_sum = merge_row_stats([stats])
        loss = row_losses(lse, target_logit, logit_sum, target != ignore_index, v, label_smoothing, z_loss)
    return loss, lse, (x.new_empty(0) if kept is None else kept)


@_lce_forward.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget,
      keep_logits):
    acc = ops.acc_dtype(x.dtype)
    plan = _plan(x, weight, chunk_size, memory_budget, keep_logits)
    kept = x.new_empty(kept_shape(plan, x.shape[0])) if plan.keep_logits else x.new_empty(0)
    return x.new_empty(x.shape[0], dtype=acc), x.new_empty(x.shape[0], dtype=acc), kept


@torch.library.custom_op("hugehead::linear_cross_entropy_backward", mutates_args=("kept",))
def _lce_backward(
    grad_loss: Tensor,
    grad_lse: Optional[Tensor],
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    lse: Tensor,
    kept: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    memory_budget: int,
    need_x: bool,
    need_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dX [N, D], dW [V, D], db [V])``; a gradient not asked for (or db without bias) is empty.
    Non-empty ``kept`` logits are overwritten by their gradient (no recompute)."""
    acc = ops.acc_dtype(x.dtype)
    keep = kept.numel() > 0
    plan = _plan(x, weight, chunk_size, memory_budget, keep)
    with _no_autocast(x.device), shard_oom_guard(0, 0, weight.shape[0], x.device, plan, memory_budget or None):
        grad_rows = torch.where(target != ignore_index, grad_loss.to(acc), torch.zeros((), dtype=acc, device=x.device))
        # All logits kept as one chunk (plan_chunks(direct_dx=True)): dX is one GEMM of their gradient
        # straight into x's dtype, as F.linear's backward does; no accumulation buffers.
        direct = keep and kept.shape[0] == 1 and kept.shape[2] == weight.shape[0] and weight.dtype == x.dtype
        grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if (need_x and not direct) else None
        grad_w, grad_b = shard_backward(
            x, ResidentChunks(weight, bias, x.dtype), target, 0, weight.shape[0], lse, grad_rows, label_smoothing,
            z_loss, softcap, plan, grad_x, need_weight, kept=kept if keep else None,
            grad_lse=None if grad_lse is None else grad_lse.to(acc).contiguous(),
        )
        if need_x and direct:
            grad_x = torch.mm(kept[0], weight)  # kept[0] now holds the logits' gradient
    # A gradient not asked for is a fresh empty tensor each: custom op outputs may not alias each other.
    return (
        grad_x.to(x.dtype) if grad_x is not None else x.new_empty(0),
        grad_w if grad_w is not None else x.new_empty(0),
        grad_b if grad_b is not None else x.new_empty(0),
    )


@_lce_backward.register_fake
def _(grad_loss, grad_lse, x, weight, bias, target, lse, kept, ignore_index, label_smoothing, z_loss, softcap,
      chunk_size, memory_budget, need_x, need_weight):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else x.new_empty(0),
        torch.empty_like(bias) if (need_weight and bias is not None) else x.new_empty(0),
    )


def _lce_setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget, keep_logits = (
        inputs)
    _, lse, kept = output
    ctx.save_for_backward(x, weight, bias, target, lse)
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget)
    ctx.mark_non_differentiable(kept)
    # Not saved for backward: the backward turns the kept logits into their gradient in place and drops
    # them, so a second backward (retain_graph=True) finds none and recomputes instead.
    # Under torch.compile nothing is kept (keep_logits is False there), so nothing rides on ctx.
    ctx.kept = kept if keep_logits else None
    # Outputs nobody differentiates (the kept logits always, lse unless returned) get None, not a
    # materialized zero tensor: for the kept logits that would be an [N, V]-sized allocation and fill.
    ctx.set_materialize_grads(False)


def _lce_backward_autograd(ctx, grad_loss, grad_lse, grad_kept):
    x, weight, bias, target, lse = ctx.saved_tensors
    kept, ctx.kept = ctx.kept, None
    if kept is None:
        kept = x.new_empty(0)
    if grad_loss is None:  # only the returned lse is differentiated
        grad_loss = torch.zeros_like(lse)
    need_x = ctx.needs_input_grad[0]
    need_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
    grad_x, grad_w, grad_b = torch.ops.hugehead.linear_cross_entropy_backward(
        grad_loss, grad_lse, x, weight, bias, target, lse, kept, *ctx.options, need_x, need_weight
    )
    return (
        grad_x if need_x else None,
        grad_w if ctx.needs_input_grad[1] else None,
        grad_b if (bias is not None and ctx.needs_input_grad[2]) else None,
        None, None, None, None, None, None, None, None,
    )


_lce_forward.register_autograd(_lce_backward_autograd, setup_context=_lce_setup_context)


def reduce_loss(loss_rows: Tensor, valid: Tensor, reduction: str, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Apply ``reduction`` to per-row losses as F.cross_entropy does ("mean" over non-ignored rows,
    NaN when there are none). The per-row losses are already in :func:`loss_dtype`; ``dtype``, when
    given, casts the result."""
    if reduction == "none":
        out = loss_rows
    elif reduction == "sum":
        out = loss_rows.sum()
    else:
        out = loss_rows.sum() / valid.sum()
    return out if dtype is None else out.to(dtype)


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
    return_lse: bool = False,
    class_weight: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` without the ``[N, V]`` logits.

    Args:
        x: ``[N, D]`` float16, bfloat16, float32 or float64; any strides.
        weight: ``[V, D]``, same device as ``x``; same dtype outside ``torch.autocast``. bias: ``[V]`` or None.
        target: ``[N]`` int64 or int32 class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index, reduction, label_smoothing: as in :func:`torch.nn.functional.cross_entropy`
            ("mean" divides by the number of non-ignored rows).
        z_loss: adds ``z_loss * lse**2`` per non-ignored row (PaLM).
        softcap: maps logits (bias included) through ``softcap * tanh(z / softcap)`` first (Gemma 2).
        chunk_size: classes per chunk; None plans it from the shapes and ``memory_budget`` (and keeps the
            ``N × V`` logits between forward and backward when they fit it: no recompute).
        memory_budget: bytes of workspace the planner may use (default 4 GiB).
        return_lse: also return the per-row log-sum-exp of the (softcapped) logits.
        class_weight: ``[V]`` floating weights of the classes, as ``F.cross_entropy``'s ``weight`` (for
            index targets ``"mean"`` divides by the weights of the rows not ignored; for sparse targets
            each term ``t_ij log p_ij`` is weighted by ``w_j`` and ``"mean"`` divides by N).

    ``target`` may also be a sparse ``[N, V]`` tensor (``torch.sparse_csr`` or ``torch.sparse_coo``) of
    non-negative probabilities: ``F.cross_entropy(F.linear(x, weight, bias), target.to_dense(), ...)``
    (label smoothing as PyTorch applies it to probability targets, ``"mean"`` over N rows, rows need not
    sum to 1; ``ignore_index`` does not apply). See :mod:`hugehead.sparse` for the format.

    Under ``torch.autocast`` (CUDA or CPU) the GEMMs run in the autocast dtype: ``x`` is cast once and
    the weight and bias a chunk at a time (never a full low-precision copy); ``weight.grad`` has the
    weight's dtype and ``x.grad`` ``x``'s dtype, as with ``F.linear`` under autocast.

    Returns:
        The loss — float32 for float16/bfloat16/float32 computations, float64 for float64 — a scalar, or
        ``[N]`` for ``reduction="none"``; with ``return_lse``, ``(loss, lse [N])`` where ``lse`` (same
        dtype as the loss) is differentiable, for a z-loss or distillation term of your own.
    Raises:
        ValueError: shape or device mismatch, a target out of range, bad options.
        TypeError: unsupported or mismatched dtypes.
    """
    if is_sparse_target(target) or class_weight is not None:
        return _linear_cross_entropy_weighted(
            x, weight, target, bias, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, chunk_size=chunk_size, memory_budget=memory_budget,
            return_lse=return_lse, class_weight=class_weight)
    compute = _check_inputs(x, weight, target, bias)
    cap = validate_options(reduction, label_smoothing, z_loss, softcap)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"hugehead: chunk_size must be >= 1, got {chunk_size}")
    if memory_budget is not None and int(memory_budget) < 1:
        raise ValueError(f"hugehead: memory_budget must be >= 1 byte, got {memory_budget}")
    if compute is not None and x.dtype != compute:
        x = x.to(compute)  # differentiable: x.grad comes back in x's own dtype
    target = target.long().contiguous()
    keep = False
    if not torch.compiler.is_compiling() and (torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))):
        keep = plan_chunks(
            x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size, memory_budget,
            weight_dtype=weight.dtype, direct_dx=True,
        ).keep_logits
    loss_rows, lse, _ = torch.ops.hugehead.linear_cross_entropy_forward(
        x, weight, bias, target, int(ignore_index), float(label_smoothing), float(z_loss), cap,
        int(chunk_size or 0), int(memory_budget or 0), keep,
    )
    loss = reduce_loss(loss_rows, target != ignore_index, reduction)
    return (loss, lse) if return_lse else loss


# Under torch.compile the sparse/weighted loss runs eagerly, as one graph break: its target preparation
# reads the data (checks, sizes that depend on it) and dynamo cannot carry a sparse tensor across the
# breaks that would cause. The registered ops inside it are the same either way.
@torch.compiler.disable
def _linear_cross_entropy_weighted(x, weight, target, bias, *, ignore_index, reduction, label_smoothing, z_loss,
                                   softcap, chunk_size, memory_budget, return_lse, class_weight):
    """:func:`linear_cross_entropy` with a sparse target or class weights (:mod:`hugehead.multilabel`)."""
    from .multilabel import check_head_inputs, linear_softmax_csr

    compute = check_head_inputs(x, weight, bias)
    cap = validate_options(reduction, label_smoothing, z_loss, softcap)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"hugehead: chunk_size must be >= 1, got {chunk_size}")
    if memory_budget is not None and int(memory_budget) < 1:
        raise ValueError(f"hugehead: memory_budget must be >= 1 byte, got {memory_budget}")
    if not is_sparse_target(target):
        if not isinstance(target, Tensor) or target.dim() != 1 or target.shape[0] != x.shape[0]:
            raise ValueError(f"hugehead: target must be [N]=[{x.shape[0]}] class ids or a sparse [N, V] tensor, got "
                             f"{tuple(getattr(target, 'shape', ()))}")
        if target.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"hugehead: target must be int64 or int32, got {target.dtype}")
        if target.device != x.device:
            raise ValueError(f"hugehead: target is on {target.device} but x is on {x.device}")
        target = target.long().contiguous()
        check_targets(target, weight.shape[0], ignore_index)
    return linear_softmax_csr(
        x, weight, target, bias, class_weight=class_weight, ignore_index=int(ignore_index), reduction=reduction,
        label_smoothing=float(label_smoothing), z_loss=float(z_loss), softcap=cap, chunk_size=chunk_size,
        memory_budget=memory_budget, return_lse=return_lse, compute=compute)

