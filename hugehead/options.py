"""The loss's rules: what the options mean, how they are checked, which dtypes the head computes and
returns in, the per-row loss and the reductions.

Every entry point (``linear_cross_entropy``, ``ChunkedClassifier``) builds one :class:`LossOptions` and
passes it down; engines and the chunk loop read it, never loose scalars. Checks run before any kernel
and raise errors that name the option; the target-range check works under ``torch.compile``
(``torch._check``), with the same message in eager mode.

Mixed precision: under ``torch.autocast`` the head computes in the autocast dtype — ``x`` is
cast once, the weight and bias chunk by chunk inside the loop — with float32 accumulation; Parameters
keep their dtype and get gradients in it. The loss is float32 for 16-bit inputs (float64 for float64).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from . import ops
from ._extension import require_kernels

__all__ = [
    "LossOptions",
    "REDUCTIONS",
    "check_chunk_size",
    "check_inputs",
    "check_memory_budget",
    "check_target_tensor",
    "check_target_range",
    "start_target_check",
    "check_targets",
    "validate_options",
    "autocast_dtype",
    "loss_dtype",
    "row_losses",
    "reduce_loss",
    "no_second_order",
]

REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------------
# Option checks
# --------------------------------------------------------------------------------------------------
def _real(name: str, value) -> float:
    """``value`` as a float, or TypeError naming the option (bools and strings are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"hugehead: {name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _integer(name: str, value) -> int:
    """``value`` as an int: an integral number (``4``, ``4.0``, a 0-d integer tensor is not accepted);
    TypeError for bools, strings and other types, ValueError for a fractional number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"hugehead: {name} must be an integer, got {type(value).__name__} {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if not (math.isfinite(float(value)) and float(value) == int(value)):
        raise ValueError(f"hugehead: {name} must be an integer, got {value!r}")
    return int(value)


def _positive(name: str, value, unit: str = "") -> Optional[int]:
    if value is None:
        return None
    count = _integer(name, value)
    if count < 1:
        raise ValueError(f"hugehead: {name} must be >= 1{unit}, got {value}")
    return count


def check_chunk_size(chunk_size) -> Optional[int]:
    """``chunk_size`` (classes per chunk) as an int ``>= 1``, or None (planned).

    Raises:
        TypeError: not an integer (a string, a bool). ValueError: fractional, or below 1.
    """
    return _positive("chunk_size", chunk_size)


def check_memory_budget(memory_budget) -> Optional[int]:
    """``memory_budget`` (bytes) as an int ``>= 1``, or None (the planner's default).

    Raises:
        TypeError: not an integer (a string, a bool). ValueError: fractional, or below 1 byte.
    """
    return _positive("memory_budget", memory_budget, " byte")


@dataclass(frozen=True)
class LossOptions:
    """What the loss means, checked once where it is built (``__post_init__``) and read everywhere below.

    Fields (as in :func:`torch.nn.functional.cross_entropy`, plus two of the field's extensions):
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"``.
        ignore_index: target value whose rows contribute nothing.
        label_smoothing: in ``[0, 1]``, PyTorch's formula.
        z_loss: ``>= 0``; adds ``z_loss * lse**2`` per non-ignored row (PaLM).
        softcap: None, or a finite positive number: logits become ``softcap * tanh(z / softcap)`` (Gemma 2).

    A new option is a new field with a default (the old behaviour) and a check in ``__post_init__``;
    callers that do not know it keep working.

    Raises:
        TypeError: an option of the wrong type (``softcap="2"``, ``ignore_index=1.5``, ``reduction=None``).
        ValueError: an unknown reduction, an option out of range.
    """

    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: Optional[float] = None

    def __post_init__(self):
        if not isinstance(self.reduction, str):
            raise TypeError(f"hugehead: reduction must be a string, got {type(self.reduction).__name__}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"hugehead: unknown reduction {self.reduction!r}; expected one of {REDUCTIONS}")
        ignore_index = _integer("ignore_index", self.ignore_index)
        label_smoothing = _real("label_smoothing", self.label_smoothing)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"hugehead: label_smoothing must be in [0, 1], got {self.label_smoothing}")
        z_loss = _real("z_loss", self.z_loss)
        if not (math.isfinite(z_loss) and z_loss >= 0.0):
            raise ValueError(f"hugehead: z_loss must be finite and >= 0, got {self.z_loss}")
        softcap = self.softcap
        if softcap is not None:
            if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
                raise TypeError(
                    f"hugehead: softcap must be a finite positive number or None, got {type(softcap).__name__} "
                    f"{softcap!r}"
                )
            softcap = float(softcap)
            if not (math.isfinite(softcap) and softcap > 0.0):
                raise ValueError(f"hugehead: softcap must be a finite positive number or None, got {self.softcap}")
        # Normalized types: the ops take Python ints and floats.
        object.__setattr__(self, "ignore_index", ignore_index)
        object.__setattr__(self, "label_smoothing", label_smoothing)
        object.__setattr__(self, "z_loss", z_loss)
        object.__setattr__(self, "softcap", softcap)

    @property
    def kernel_softcap(self) -> float:
        """softcap as the kernels take it: ``0.0`` for none."""
        return 0.0 if self.softcap is None else self.softcap

    def replace(self, **changes) -> "LossOptions":
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)


def validate_options(reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float]) -> float:
    """Check loose loss options (kept for callers of the old API); returns softcap as the kernels take it.
    Prefer :class:`LossOptions`.

    Raises:
        TypeError, ValueError: as :class:`LossOptions`.
    """
    return LossOptions(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                       softcap=softcap).kernel_softcap


# --------------------------------------------------------------------------------------------------
# Target checks
# --------------------------------------------------------------------------------------------------
def check_target_tensor(target, x: Tensor) -> Tensor:
    """Check ``target`` against ``x [..., D]`` (shape ``[...]``, an integer dtype, ``x``'s device) and
    return it flattened to ``[N]`` int64, contiguous.

    Raises:
        TypeError: not a tensor, or not int64/int32. ValueError: wrong shape, another device than ``x``.
    """
    _check_target_tensor(target, x)
    return target.reshape(-1).long().contiguous()


def _check_target_tensor(target, x: Tensor) -> None:
    """:func:`check_target_tensor`'s checks alone (no flattened copy made)."""
    if not isinstance(target, Tensor):
        raise TypeError(f"hugehead: target must be a tensor, got {type(target).__name__}")
    lead = tuple(x.shape[:-1])
    if tuple(target.shape) != lead:
        if len(lead) == 1:
            raise ValueError(f"hugehead: target must be [N] = [{lead[0]}], got shape {tuple(target.shape)}")
        raise ValueError(
            f"hugehead: x must be [N, D] with target [N], or [..., D] with target [...] (its leading shape): "
            f"x has shape {tuple(x.shape)} but target has shape {tuple(target.shape)}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"hugehead: target must be int64 or int32, got {target.dtype}")
    if target.device != x.device:
        raise ValueError(f"hugehead: target is on {target.device} but x is on {x.device}")


def _out_of_range(target: Tensor, num_classes: int, ignore_index: Optional[int]) -> Tensor:
    bad = (target < 0) | (target >= num_classes)
    return bad if ignore_index is None else bad & (target != ignore_index)


def _low_high(target: Tensor, ignore_index: Optional[int]) -> Tensor:
    """``[min, max]`` of ``target`` on its device, ``ignore_index`` counted as 0 (valid)."""
    exempt = target if ignore_index is None else torch.where(target == ignore_index, 0, target)
    return torch.stack(torch.aminmax(exempt))


def check_target_range(target: Tensor, num_classes: int, ignore_index: Optional[int], what: str = "target") -> None:
    """Raise ValueError naming the first value of ``target [N]`` outside ``[0, num_classes)`` that is not
    ``ignore_index`` (None: none exempt). One reduction and one device-to-host read (the call's one
    synchronization). For code that runs eagerly inside a registered op, which needs no checked copy;
    elsewhere use :func:`check_targets`."""
    # -- host syncs: where(ignored, 0) and aminmax, 3 kernels before the read, where a mask of the
    # bad rows took 6 (the mask is made only on the error path).
    if target.numel() == 0:
        return
    low, high = _low_high(target, ignore_index).tolist()
    if low < 0 or high >= num_classes:
        bad = _out_of_range(target, num_classes, ignore_index)
        first = int(bad.nonzero()[0, 0])
        valid = f"0..{num_classes - 1}" + ("" if ignore_index is None else f", or ignore_index={ignore_index}")
        raise ValueError(f"hugehead: {what} {int(target[first])} at row {first} is out of range for {num_classes} "
                         f"classes (valid: {valid})")


# Targets of up to this many rows are checked on the host from a copy (one copy before the loop's first kernel,
# the reduction after it is queued); more rows take the reduction on the device (four kernels) and copy its two
# values: a long copy on the stream would hold up the loop's kernels.
HOST_CHECK_MAX_ROWS = 1 << 16


def start_target_check(target: Tensor, num_classes: int, ignore_index: Optional[int],
                       what: str = "target") -> Callable[[], None]:
    """:func:`check_target_range` without waiting for the device: returns the function that finishes it
    (raises the same ValueError). On CUDA the targets (up to :data:`HOST_CHECK_MAX_ROWS` of them; more: the
    reduction's two values) are copied into pinned host memory with an event, and the finisher waits for that
    event only and checks the copy on the host, so the caller can queue its kernels first: the host neither
    drains the queue (the model's kernels before the loss) nor launches the check's kernels ahead of the
    loss's (an eager step's GPU waits for every launch before its first GEMM). Elsewhere the check runs now
    and the finisher does nothing.

    Only for ops whose outputs are fresh tensors, which call the finisher before returning them: the
    kernels queued in between read the targets as class ids compared with column ranges (none indexes
    memory by them), so out-of-range ids compute garbage that is never returned, and nothing is corrupted."""
    if target.device.type != "cuda" or target.numel() == 0:
        check_target_range(target, num_classes, ignore_index, what)
        return _checked
    whole = target.numel() <= HOST_CHECK_MAX_ROWS
    source = target if whole else _low_high(target, ignore_index)
    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    host.copy_(source, non_blocking=True)  # (on the current stream of the targets' device, as the event below)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(target.device))

    def finish() -> None:
        done.synchronize()
        if whole:
            check_target_range(host, num_classes, ignore_index, what)
            return
        low, high = host.tolist()
        if low < 0 or high >= num_classes:
            check_target_range(target, num_classes, ignore_index, what)  # the error naming the first bad value

    return finish


def _checked() -> None:
    return None


@torch.library.custom_op("hugehead::checked_targets", mutates_args=())
def _checked_targets(target: Tensor, num_classes: int, ignore_index: Optional[int], what: str) -> Tensor:
    """``target`` as a fresh contiguous int64 tensor, once every value is in ``[0, num_classes)`` or
    ``ignore_index``; else ValueError naming the first bad one. An op of its own so that ``torch.compile``
    (``fullgraph=True``) keeps the check, and its message, in the graph: dynamo does not trace into it."""
    check_target_range(target, num_classes, ignore_index, what)
    return target.to(torch.int64, memory_format=torch.contiguous_format, copy=True)


@_checked_targets.register_fake
def _(target, num_classes, ignore_index, what):
    return torch.empty_like(target, dtype=torch.int64, memory_format=torch.contiguous_format)


def check_targets(target: Tensor, num_classes: int, ignore_index: Optional[int], what: str = "target") -> Tensor:
    """``target [N]`` checked: every value in ``[0, num_classes)`` or equal to ``ignore_index`` (None: no
    value is exempt). Returns the targets as a contiguous int64 tensor to use from here on (the check's
    output: under ``torch.compile`` a check whose result nobody used could be dropped from the graph).
    One small device-to-host read; runs before any kernel sees the targets.

    Raises:
        ValueError: naming the first target out of range, its row and the valid range (eager and compiled).
    """
    return torch.ops.hugehead.checked_targets(target, int(num_classes), ignore_index, what)


# --------------------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------------------
def check_inputs(x: Tensor, weight: Tensor, target: Optional[Tensor], bias: Optional[Tensor]) -> Optional[torch.dtype]:
    """Check a loss's inputs ``x [..., D]``, ``weight [V, D]``, ``target [...]`` (x's leading shape; None: not
    checked here) and ``bias [V]`` or None: types, shapes, float dtypes, devices, and that this build has kernels
    for x's device.
    Returns the autocast compute dtype, or None when the inputs' dtype decides (they must then agree).

    Raises:
        TypeError: a non-tensor, an unsupported or (outside autocast) mismatched dtype.
        ValueError: a shape or device mismatch, no classes.
        RuntimeError: no hugehead kernels for x's device.
    """
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or not isinstance(target, (Tensor, type(None))):
        raise TypeError("hugehead: x, weight and target must be tensors")
    if x.dim() < 2:
        raise ValueError(f"hugehead: x must be [N, D] (or [..., D]), got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"hugehead: weight must be [V, D], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"hugehead: x has D={x.shape[-1]} features but weight is {tuple(weight.shape)} "
            f"(expected [V, {x.shape[-1]}])"
        )
    if weight.shape[0] == 0:
        raise ValueError("hugehead: weight has no classes (V=0)")
    if target is not None:
        _check_target_tensor(target, x)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in FLOAT_DTYPES:
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
    tensors = {"weight": weight}
    if bias is not None:
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"hugehead: {name} is on {t.device} but x is on {x.device}")
    require_kernels(x.device)
    return compute


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
# The per-row loss and the reductions
# --------------------------------------------------------------------------------------------------
def row_losses(
    lse: Tensor,
    target_logit: Tensor,
    logit_sum: Tensor,
    valid: Tensor,
    num_classes: int,
    options: LossOptions,
) -> Tensor:
    """Per-row loss ``lse - (1-eps) c_y - eps/V sum_j c_j + z_loss lse^2``, 0 on ignored rows; all
    ``[N]`` in the accumulation dtype (``valid`` bool)."""
    # Differences first, as F.cross_entropy does: (1-eps)(lse - c_y) + eps(lse - mean_j c_j). Scaling
    # lse and c_y before subtracting would leave a rounding error of order |c_y| on a loss that may be
    # far smaller (a confident row; a single class).
    eps = options.label_smoothing
    loss = lse - target_logit
    if eps:
        loss = (1.0 - eps) * loss + eps * (lse - logit_sum / num_classes)
    if options.z_loss:
        loss = loss + options.z_loss * lse.square()
    return torch.where(valid, loss, torch.zeros_like(loss))


def reduce_loss(loss_rows: Tensor, valid: Tensor, reduction: str, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Apply ``reduction`` to per-row losses ``[N]`` as F.cross_entropy does ("mean" over non-ignored
    rows, NaN when there are none). The per-row losses are already in :func:`loss_dtype`; ``dtype``,
    when given, casts the result."""
    if reduction == "none":
        out = loss_rows
    elif reduction == "sum":
        out = loss_rows.sum()
    else:
        out = loss_rows.sum() / valid.sum()
    return out if dtype is None else out.to(dtype)


# --------------------------------------------------------------------------------------------------
# Derivatives: first order only
# --------------------------------------------------------------------------------------------------
class _FirstOrderOnly(torch.autograd.Function):
    """Passes gradients through; differentiating them raises (the chunked backward has no derivative)."""

    @staticmethod
    def forward(ctx, what: str, anchor: Tensor, *grads: Tensor):
        ctx.what = what
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"hugehead: second-order gradients (differentiating the gradients of {ctx.what}, e.g. after "
            f"backward(create_graph=True) or torch.autograd.grad(..., create_graph=True)) are not supported: "
            f"the chunked backward is not itself differentiable. Compute the head's loss with plain PyTorch "
            f"(F.linear + F.cross_entropy) where you need higher-order derivatives."
        )


def no_second_order(what: str, inputs: Sequence[Optional[Tensor]], grads: Sequence[Optional[Tensor]]
                    ) -> List[Optional[Tensor]]:
    """``grads`` as they are — unless the backward runs with ``create_graph=True`` (grad mode on), where
    they are tied to one node whose own backward raises a clear "not supported" error (instead of
    PyTorch's "does not require grad" or a silently wrong zero). ``inputs``: the op's inputs; one that
    requires grad anchors the node."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return list(grads)
    anchor = next((t for t in inputs if isinstance(t, Tensor) and t.requires_grad), None)
    present = [g for g in grads if g is not None]
    if anchor is None or not present:
        return list(grads)
    tied = iter(_FirstOrderOnly.apply(what, anchor, *present))
    return [None if g is None else next(tied) for g in grads]
