"""The registered single-device ops of the class-id loss and the kit they share with the other losses'
ops (:mod:`hugehead.multilabel`, :mod:`hugehead.onevsall`): the forward/backward op pair over the whole chunk
loop of :mod:`hugehead.loop` (so ``torch.compile`` sees one node), the rows plan's op, their fakes and autograd,
and the single-device loss of checked inputs that plans a step and calls them.

The plan is made once per call (:func:`loss_plan`) and travels to the backward as an argument of the op
(never planned again with the free memory of that moment).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .eager import eager_dispatch, eager_twin
from .loop import rows_steps, shard_forward_stats, whole_head_backward
from .loop.chunks import merge_row_stats, run_steps
from .loop.fused import _tma_ready
from .loop.overlapped import _side_stream
from .loop.sources import ResidentChunks
from .options import LossOptions, no_second_order, reduce_loss, row_losses, start_target_check
from .budget import shard_oom_guard
from .plan import Operands, Plan, kept_shape, plan_chunks, plan_loss

__all__ = [
    "autocast_off",
    "op_plan",
    "given_plan",
    "loss_plan",
    "class_id_loss",
    "rows_loss",
    "rows_pass",
    "rows_fake",
    "register_rows_autograd",
]


def autocast_off(device: torch.device):
    """Autocast off on ``device``'s type: the loop issues its GEMMs with ``out=`` in the dtypes it chose, and
    autocast must not recast inside it."""
    return torch.autocast(device.type, enabled=False)


def op_plan(x: Tensor, weight: Tensor, chunk_size: int, memory_budget: int, keep: bool) -> Plan:
    """The op's plan (chunk_size/memory_budget 0: planned/default)."""
    return plan_chunks(
        x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size or None, memory_budget or None,
        weight_dtype=weight.dtype, allow_keep=keep, direct_dx=True,
    )


def given_plan(plan: Optional[List[int]]) -> Plan:
    """The plan an op was handed (:meth:`Plan.decode`); ValueError where none was."""
    decoded = Plan.decode(plan)
    if decoded is None:
        raise ValueError("hugehead: this op executes its caller's plan: pass plan=Plan.encode() (see "
                         "hugehead.lce_op.loss_plan)")
    return decoded


def _options(ignore_index: int, label_smoothing: float, z_loss: float, softcap: float) -> LossOptions:
    return LossOptions(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                       softcap=softcap if softcap > 0 else None)


# --------------------------------------------------------------------------------------------------
# The single-device op: a custom op over the whole chunk loop, so torch.compile sees one node
# --------------------------------------------------------------------------------------------------
def _lce_forward_impl(
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
    plan: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row losses ``[N]``, lse ``[N]`` (accumulation dtype), the kept logits
    ``[kept_chunks - kept_in_grad, N, cols]`` (empty unless ``keep_logits`` and the plan keeps some) and the
    weight gradient's buffer ``[V, D]`` holding the plan's ``kept_in_grad`` chunks (empty when none: see
    :func:`hugehead.plan.grad_store_layout`), which the backward returns as ``dW``. ``x`` is in the
    compute dtype; weight and bias may be stored in another float dtype (autocast), cast chunk by chunk.
    ``plan``: the caller's (:func:`loss_plan`), encoded (:meth:`Plan.encode`); chunk_size/memory_budget (0: planned,
    the default) are what the caller planned with, for the out-of-memory message."""
    v = weight.shape[0]
    options = _options(ignore_index, label_smoothing, z_loss, softcap)
    step_plan = given_plan(plan)
    # The target check (inside the op: eager, and no checked copy needed) starts once the first chunk's GEMM is
    # queued, and is finished once the loop's kernels are: see _DeferredCheck.
    check = _DeferredCheck(target, v, ignore_index)
    with autocast_off(x.device), shard_oom_guard(0, 0, v, x.device, step_plan, memory_budget or None):
        store = _grad_store(weight, step_plan, keep_logits)
        stats, kept = shard_forward_stats(x, ResidentChunks(weight, bias, x.dtype), target, 0, options, step_plan,
                                          store=store, after_first=check.start)
        lse, target_logit, logit_sum = merge_row_stats([stats])
        loss = row_losses(lse, target_logit, logit_sum, target != ignore_index, v, options)
    check.finish()
    return loss, lse, (x.new_empty(0) if kept is None else kept), (weight.new_empty(0) if store is None else store)


_lce_forward = torch.library.custom_op("hugehead::linear_cross_entropy_forward", mutates_args=())(_lce_forward_impl)


class _DeferredCheck:
    """:func:`hugehead.options.start_target_check` started late: by the chunk loop once its first chunk's work is
    queued (:func:`hugehead.loop.run_steps`' ``after_first``), so that its host work (a pinned buffer, the copy,
    an event) and its device-to-host copy no longer stand between an eager step's start and its first GEMM,
    while the GPU idles. On CUDA the copy runs on the loop's side stream after an event recorded at the op's
    start (the targets as the caller left them), beside the GEMMs: on the current stream it would wait for the
    first chunk's work, and :meth:`finish` with it (at llama3_4k the whole forward, whose end the host then waits
    for before it queues the backward). The kernels queued before the check read the targets only as class ids
    compared with column ranges (as those queued before it finishes always did), and :meth:`finish` runs before
    the op's outputs are returned: a target out of range still raises the same ValueError, and nothing is
    corrupted."""

    __slots__ = ("target", "num_classes", "ignore_index", "ready", "finisher")

    def __init__(self, target: Tensor, num_classes: int, ignore_index: int):
        self.target, self.num_classes, self.ignore_index = target, num_classes, ignore_index
        self.finisher = None
        self.ready = None
        if target.is_cuda and target.numel():
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(target.device))  # (the targets' device, current or not)

    def start(self) -> None:
        if self.finisher is not None:
            return
        if self.ready is None:
            self.finisher = start_target_check(self.target, self.num_classes, self.ignore_index)
            return
        side = _side_stream(self.target.device)
        side.wait_event(self.ready)
        with torch.cuda.stream(side):
            self.finisher = start_target_check(self.target, self.num_classes, self.ignore_index)

    def finish(self) -> None:
        self.start()  # (the loop started it: a no-op here)
        self.finisher()


def _grad_store(weight: Tensor, plan: Plan, keep_logits: bool) -> Optional[Tensor]:
    """The weight gradient's buffer, allocated now to hold the plan's ``kept_in_grad`` chunks, or None."""
    if not (keep_logits and plan.keep_logits and plan.kept_in_grad > 0):
        return None
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


@_lce_forward.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget,
      keep_logits, plan=None):
    acc = ops.acc_dtype(x.dtype)
    step_plan = given_plan(plan)
    kept = x.new_empty(kept_shape(step_plan, x.shape[0])) if step_plan.keep_logits else x.new_empty(0)
    store = _grad_store(weight, step_plan, keep_logits)
    return (x.new_empty(x.shape[0], dtype=acc), x.new_empty(x.shape[0], dtype=acc), kept,
            weight.new_empty(0) if store is None else store)


def _lce_backward_impl(
    grad_loss: Tensor,
    grad_lse: Optional[Tensor],
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    lse: Tensor,
    kept: Tensor,
    store: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    memory_budget: int,
    need_x: bool,
    need_weight: bool,
    plan: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dX [N, D], dW [V, D], db [V])``; a gradient not asked for (or db without bias) is empty.
    Non-empty ``kept`` logits are overwritten by their gradient (no recompute). ``plan``: the forward's, encoded
    (never planned again here: the chunk widths, and with them the order of the dX sums, are the forward's). A non-empty
    ``store`` (the forward's fourth output, holding kept chunks) receives dW, and dW comes back empty."""
    acc = ops.acc_dtype(x.dtype)
    options = _options(ignore_index, label_smoothing, z_loss, softcap)
    keep = kept.numel() > 0
    step_plan = given_plan(plan)
    if store.numel() == 0:
        store = None
    if store is None and keep and step_plan.kept_in_grad:
        raise RuntimeError("hugehead: the forward kept logits in the weight gradient's buffer: pass it as `store`")
    with autocast_off(x.device), shard_oom_guard(0, 0, weight.shape[0], x.device, step_plan, memory_budget or None):
        grad_rows = torch.where(target != ignore_index, grad_loss.to(acc), torch.zeros((), dtype=acc, device=x.device))
        grad_x, grad_w, grad_b = whole_head_backward(
            x, weight, bias, target, lse, grad_rows, options, step_plan, need_x, need_weight, kept,
            None if grad_lse is None else grad_lse.to(acc).contiguous(), store=store)
    # dW went into the store: an op's output may not alias its inputs, so it comes back empty here
    return grad_x, (x.new_empty(0) if store is not None else grad_w), grad_b


_lce_backward = torch.library.custom_op("hugehead::linear_cross_entropy_backward",
                                        mutates_args=("kept", "store"))(_lce_backward_impl)


@_lce_backward.register_fake
def _(grad_loss, grad_lse, x, weight, bias, target, lse, kept, store, ignore_index, label_smoothing, z_loss, softcap,
      chunk_size, memory_budget, need_x, need_weight, plan=None):
    in_store = store.numel() > 0
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if (need_weight and not in_store)
        else x.new_empty(0),
        torch.empty_like(bias) if (need_weight and bias is not None) else x.new_empty(0),
    )


def _lce_setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget, keep_logits = (
        inputs[:11])
    _, lse, kept, store = output
    ctx.save_for_backward(x, weight, bias, target, lse)
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap, chunk_size, memory_budget)
    # The forward's plan goes with the saved inputs: the backward never plans again.
    ctx.plan = inputs[11] if len(inputs) > 11 else None
    ctx.mark_non_differentiable(kept, store)
    # Not saved for backward: the backward turns the kept logits into their gradient in place and drops
    # them, so a second backward (retain_graph=True) finds none and recomputes instead.
    # Under torch.compile nothing is kept (keep_logits is False there), so nothing rides on ctx.
    ctx.kept = kept if keep_logits else None
    # The weight gradient's buffer holding kept chunks rides the same way, and becomes the returned dW.
    ctx.store = store if (keep_logits and store.numel() > 0) else None
    # Outputs nobody differentiates (the kept logits always, lse unless returned) get None, not a
    # materialized zero tensor: for the kept logits that would be an [N, V]-sized allocation and fill.
    ctx.set_materialize_grads(False)


def _lce_backward_autograd(ctx, grad_loss, grad_lse, grad_kept, grad_store):
    x, weight, bias, target, lse = ctx.saved_tensors
    kept, ctx.kept = ctx.kept, None
    store, ctx.store = ctx.store, None
    if kept is None:
        kept = x.new_empty(0)
    if grad_loss is None:  # only the returned lse is differentiated
        grad_loss = torch.zeros_like(lse)
    need_x = ctx.needs_input_grad[0]
    need_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
    args = (grad_loss, grad_lse, x, weight, bias, target, lse, kept, weight.new_empty(0) if store is None else store,
            *ctx.options, need_x, need_weight, ctx.plan)
    if getattr(ctx, "eager", False):  # the eager twin (_LossFunction): the backward's body, below autograd as the op's
        with torch.no_grad():
            grad_x, grad_w, grad_b = _lce_backward_impl(*args)
    else:
        grad_x, grad_w, grad_b = torch.ops.hugehead.linear_cross_entropy_backward(*args)
    if store is not None:
        grad_w, store = store, None  # the buffer the backward wrote dW into: the one reference left
    grad_x, grad_w, grad_b = no_second_order("linear_cross_entropy", (x, weight, bias), (
        grad_x if need_x else None,
        grad_w if ctx.needs_input_grad[1] else None,
        grad_b if (bias is not None and ctx.needs_input_grad[2]) else None,
    ))
    return (grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None)


_lce_forward.register_autograd(_lce_backward_autograd, setup_context=_lce_setup_context)



_LossFunction = eager_twin("_LossFunction", _lce_forward_impl, _lce_setup_context, _lce_backward_autograd)


# --------------------------------------------------------------------------------------------------
# The rows plan's op: a scalar loss and its gradients in one pass (hugehead.plan.plan_rows)
# --------------------------------------------------------------------------------------------------
def rows_pass(x: Tensor, weight: Tensor, bias: Optional[Tensor], target, options: LossOptions, plan: Plan,
              grad_rows: Tensor, need_x: bool, need_weight: bool, row_losses_of=None, after_first=None
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The body of every rows-plan op: :func:`hugehead.loop.rows_steps` of a weight on ``x``'s device
    under the no-autocast and out-of-memory guards: ``(loss_rows [N], dX, dW, db)``, a gradient not asked
    for (or db without bias) a fresh empty tensor each (custom op outputs may not alias each other).
    ``after_first``: as :func:`hugehead.loop.run_steps`'."""
    with autocast_off(x.device), shard_oom_guard(0, 0, weight.shape[0], x.device, plan, None):
        loss_rows, grad_x, grad_w, grad_b = run_steps(rows_steps(
            x, ResidentChunks(weight, bias, x.dtype), target, options, plan, grad_rows, need_x, need_weight,
            row_losses_of), after_first)
    return (
        loss_rows,
        grad_x if grad_x is not None else x.new_empty(0),
        grad_w if grad_w is not None else x.new_empty(0),
        grad_b if grad_b is not None else x.new_empty(0),
    )


def rows_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], need_x: bool, need_weight: bool):
    """The fake outputs of a rows-plan op: ``(loss 0-d, dX, dW, db)``."""
    acc = ops.acc_dtype(x.dtype)
    return (
        x.new_empty((), dtype=acc),
        x.new_empty(x.shape) if need_x else x.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else x.new_empty(0),
        torch.empty_like(bias) if (need_weight and bias is not None) else x.new_empty(0),
    )


def register_rows_autograd(op, hold_index: int, impl=None) -> Optional[type]:
    """The autograd of a rows-plan op (inputs ``x, weight, bias, ...``, ``hold`` at ``hold_index``; outputs
    ``(loss, dX, dW, db)`` for an incoming gradient of 1): the backward scales the forward's gradients.
    With the op's Python body ``impl``, returns its :func:`eager_twin` (same autograd)."""
    def setup_context(ctx, inputs, output):
        bias = inputs[2]
        hold = inputs[hold_index]
        _, grad_x, grad_w, grad_b = output
        ctx.mark_non_differentiable(grad_x, grad_w, grad_b)
        ctx.hold = hold
        ctx.has_bias = bias is not None
        ctx.num_inputs = len(inputs)
        if hold:
            # Held on ctx (not saved for backward): the backward scales them in place and lets go of them, so
            # autograd can take them as the .grad tensors without a copy.
            ctx.grads = (grad_x, grad_w, grad_b)
        else:
            ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_loss, *unused):
        if ctx.hold:
            if ctx.grads is None:
                raise RuntimeError(
                    "hugehead: linear_cross_entropy's gradients were produced in its forward (the rows plan) and "
                    "were already used by a first backward; backpropagate through it once, or set HUGEHEAD_ROWS=0 "
                    "(the logits are then kept or recomputed) to call backward with retain_graph=True twice")
            grad_x, grad_w, grad_b = ctx.grads
            ctx.grads = None
        else:
            grad_x, grad_w, grad_b = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * ctx.num_inputs
        needs = ctx.needs_input_grad
        want = (needs[0], needs[1], ctx.has_bias and needs[2])
        # In place when held (eager): the forward's gradient tensors become the gradients, no copy; a 0-d
        # grad_loss keeps each gradient's dtype. ops.scale_, not g.mul_(grad_loss): on CUDA that runs ATen's
        # unvectorized kernel (3.4 ms for dW + dX at xc1M on an H200, ~0.9 TB/s).
        grads = [None if not wanted else (ops.scale_(g, grad_loss) if ctx.hold else g * grad_loss)
                 for g, wanted in zip((grad_x, grad_w, grad_b), want)]
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # create_graph=True: the gradients were made in the forward, without a graph; tie them to a node
            # whose backward raises, so differentiating them is a clear error, never a silent zero.
            anchor = torch.zeros((), device=grad_loss.device, requires_grad=True)
            grads = no_second_order("linear_cross_entropy", [anchor], grads)
        return (*grads, *(None,) * (ctx.num_inputs - 3))

    op.register_autograd(backward, setup_context=setup_context)
    return None if impl is None else eager_twin(impl.__name__.removesuffix("_impl") + "_function", impl,
                                                setup_context, backward)


def _lce_rows_impl(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    mean: bool,
    need_x: bool,
    need_weight: bool,
    hold: bool,
    plan: List[int],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The loss reduced to a scalar (``mean``: over the rows not ignored, else the sum; 0-d, accumulation
    dtype) and its gradients for an incoming gradient of 1: ``(dX [N, D] in x's dtype, dW [V, D] in the
    weight's dtype, db [V])`` (empty when not asked for), in one pass over row blocks of ``plan``
    (:meth:`hugehead.plan.Plan.encode`). For the "mean", the count of rows not ignored is taken on the device first:
    no host synchronization. ``hold``: the gradients ride on the autograd ctx (eager) instead of being saved
    for backward (torch.compile)."""
    acc = ops.acc_dtype(x.dtype)
    options = _options(ignore_index, label_smoothing, z_loss, softcap)
    # (inside the op: eager, no checked copy needed); started once the first block's GEMM is queued and finished
    # once the pass's kernels are (_DeferredCheck)
    check = _DeferredCheck(target, weight.shape[0], ignore_index)
    target = target.long().contiguous()
    valid = target != ignore_index
    count = valid.sum(dtype=acc)
    scale = 1.0 / count if mean else torch.ones((), dtype=acc, device=x.device)
    # 1 / 0 on an all-ignored "mean" is inf: where() keeps those rows' gradient at exactly 0, and the
    # loss is 0 / 0 = NaN as F.cross_entropy's.
    grad_rows = torch.where(valid, scale, torch.zeros((), dtype=acc, device=x.device))
    loss_rows, grad_x, grad_w, grad_b = rows_pass(x, weight, bias, target, options, Plan.decode(plan), grad_rows,
                                                  need_x, need_weight, after_first=check.start)
    loss = loss_rows.sum() / count if mean else loss_rows.sum()
    check.finish()
    return loss, grad_x, grad_w, grad_b


_lce_rows = torch.library.custom_op("hugehead::linear_cross_entropy_rows", mutates_args=())(_lce_rows_impl)


@_lce_rows.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, mean, need_x, need_weight, hold,
      plan):
    return rows_fake(x, weight, bias, need_x, need_weight)


_RowsFunction = register_rows_autograd(_lce_rows, hold_index=11, impl=_lce_rows_impl)

def loss_plan(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
              chunk_size: Optional[int] = None, memory_budget: Optional[int] = None, *, reduction: str = "mean",
              return_lse: bool = False, label_smoothing: float = 0.0, softcap: float = 0.0) -> Plan:
    """The plan :func:`linear_cross_entropy` takes for ``x [N, D]`` (in the compute dtype), ``weight``,
    class-id ``target [N]`` and ``bias`` on one device, under the current grad mode: kept logits and the rows
    plan need gradients wanted (and eager mode), the rows plan a scalar loss without a returned lse, and where
    the fused GEMMs take the chunks there is nothing to overlap on a side stream (see
    :func:`hugehead.plan.plan_chunks`). Where the weight itself wants its gradient, kept logits may also live
    in that gradient's buffer, allocated at the forward (``Plan.kept_in_grad``), and where the fused GEMMs can
    keep probabilities for the factored backward (bf16, no bias, softcap (``softcap``, the kernels' cap: 0 for
    none) or label smoothing, the fused GEMMs' layouts) the streamed chunks' workspace lives in the kept
    chunks' memory. Benchmarks report it as the step's plan."""
    wants_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    # Kept logits ride on the autograd ctx, outside the traced graph: eager only.
    keep = wants_grad and not torch.compiler.is_compiling()
    grad_store = keep and weight.requires_grad and weight.device == x.device
    operands = Operands.of_loss(x, bias, label_smoothing, softcap)
    # (where every chunk's operands suit the fused GEMMs' loads, the forward stores no logits outside the kept
    # chunks, and the backward's workspace can live in theirs: plan_chunks' kept_probs)
    kept_probs = (grad_store and operands.fused and bias is None and not label_smoothing and not softcap
                  and x.dtype == torch.bfloat16 and weight.dtype == x.dtype and _tma_ready(x) and _tma_ready(weight))
    return plan_loss(x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size, memory_budget,
                     weight_dtype=weight.dtype, allow_keep=keep, direct_dx=True,
                     allow_rows=wants_grad and not return_lse and reduction != "none", grad_store=grad_store,
                     kept_probs=kept_probs, operands=operands)


def class_id_loss(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], options: LossOptions,
                  chunk_size: Optional[int], memory_budget: Optional[int],
                  return_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """The single-device loss of checked inputs ``x [N, D]`` (in the compute dtype), ``target [N]`` class ids
    (range-checked inside the op): ``(loss, lse [N])`` (lse None when the rows plan ran, which only happens
    without ``return_lse``)."""
    target = target.long().contiguous()
    # The one plan of this step: the forward follows it, and it travels to the backward with the op's inputs.
    plan = loss_plan(x, weight, target, bias, chunk_size, memory_budget, reduction=options.reduction,
                     return_lse=return_lse, label_smoothing=options.label_smoothing, softcap=options.kernel_softcap)
    if plan.grad_in_forward:
        return _rows_op(x, weight, bias, target, options, plan), None
    forward = (_LossFunction.apply if eager_dispatch(x, weight, bias, target)
               else torch.ops.hugehead.linear_cross_entropy_forward)
    loss_rows, lse, _, _ = forward(
        x, weight, bias, target, options.ignore_index, options.label_smoothing, options.z_loss,
        options.kernel_softcap, int(chunk_size or 0), int(memory_budget or 0), plan.keep_logits,
        plan.encode(),
    )
    return reduce_loss(loss_rows, target != options.ignore_index, options.reduction), lse


def _rows_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, options: LossOptions,
             plan: Plan) -> Tensor:
    """The scalar loss of ``plan`` (a rows plan) through ``hugehead::linear_cross_entropy_rows``."""
    need_weight = weight.requires_grad or (bias is not None and bias.requires_grad)
    rows = (_RowsFunction.apply if eager_dispatch(x, weight, bias, target)
            else torch.ops.hugehead.linear_cross_entropy_rows)
    loss, _, _, _ = rows(
        x, weight, bias, target, options.ignore_index, options.label_smoothing, options.z_loss,
        options.kernel_softcap, options.reduction == "mean", x.requires_grad, need_weight,
        not torch.compiler.is_compiling(), plan.encode(),
    )
    return loss


def rows_loss(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], options: LossOptions,
              chunk_size: Optional[int] = None, memory_budget=None) -> Optional[Tensor]:
    """The scalar loss of checked inputs (``x [N, D]`` in the compute dtype, ``target [N]`` int64, all on
    one device; the weight in x's dtype, or float32 under autocast) through the rows plan when
    :func:`hugehead.plan.plan_loss` picks it for them — a ``"mean"``/``"sum"`` loss with gradients wanted —
    else None (the caller runs its own chunk loop). ``ChunkedClassifier`` asks this for a head of one local
    shard."""
    wants_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if not wants_grad or options.reduction == "none":
        return None
    plan = plan_loss(x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, chunk_size, memory_budget,
                     weight_dtype=weight.dtype, allow_keep=not torch.compiler.is_compiling(), direct_dx=True,
                     allow_rows=True, operands=Operands.of_loss(x, bias, options.label_smoothing,
                                                                 options.kernel_softcap))
    return _rows_op(x, weight, bias, target, options, plan) if plan.grad_in_forward else None


# Under torch.compile the sparse/weighted loss runs eagerly, as one graph break: its target preparation
# reads the data (checks, sizes that depend on it) and dynamo cannot carry a sparse tensor (a CsrTarget, from
# hugehead.csr_target, it can) across the
