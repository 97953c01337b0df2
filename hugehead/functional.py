"""linear_cross_entropy: the public function, a thin dispatcher over the op modules below it — class ids
on one device (:mod:`hugehead.lce_op`), sparse or weighted targets (:mod:`hugehead.multilabel`), DTensor
weights (:mod:`hugehead.dtensor`) — behind the front door it shares with ``ChunkedClassifier``
(:func:`hugehead.inputs.prepare_inputs`).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import dtensor
from .inputs import prepare_inputs
from .lce_op import class_id_loss
from .multilabel import linear_softmax_csr
from .options import LossOptions, check_chunk_size, check_inputs, check_memory_budget, check_targets
from .sparse import is_sparse_target

__all__ = ["linear_cross_entropy"]


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
        x: ``[N, D]`` (or ``[..., D]``, e.g. ``[batch, tokens, D]``) float16, bfloat16, float32 or float64;
            any strides.
        weight: ``[V, D]``, same device as ``x``; same dtype outside ``torch.autocast``. bias: ``[V]`` or None.
            A ``DTensor`` weight (and bias) on a 1-D mesh — ``Shard(0)`` (FSDP2, ``ColwiseParallel``) or
            ``Replicate()`` — is used where it lies, never gathered: see :mod:`hugehead.dtensor`.
        target: ``[N]`` (``x``'s leading shape) int64 or int32 class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index, reduction, label_smoothing: as in :func:`torch.nn.functional.cross_entropy`
            ("mean" divides by the number of non-ignored rows).
        z_loss: adds ``z_loss * lse**2`` per non-ignored row (PaLM).
        softcap: maps logits (bias included) through ``softcap * tanh(z / softcap)`` first (Gemma 2).
        chunk_size: classes per chunk; None plans it from the shapes and ``memory_budget`` (and keeps the
            ``N × V`` logits between forward and backward when they fit it: no recompute).
        memory_budget: bytes of workspace the planner may use (default: 4 GiB, at most a quarter of the
            device's free memory, or of the host's available memory on the CPU; :mod:`hugehead.plan`).
        return_lse: also return the per-row log-sum-exp of the (softcapped) logits.
        class_weight: ``[V]`` floating weights of the classes, as ``F.cross_entropy``'s ``weight`` (for
            index targets ``"mean"`` divides by the weights of the rows not ignored; for sparse targets
            each term ``t_ij log p_ij`` is weighted by ``w_j`` and ``"mean"`` divides by N).

    ``target`` may also be a sparse ``[N, V]`` tensor (``torch.sparse_csr`` or ``torch.sparse_coo``) of
    non-negative probabilities: ``F.cross_entropy(F.linear(x, weight, bias), target.to_dense(), ...)``
    (label smoothing as PyTorch applies it to probability targets, ``"mean"`` over N rows, rows need not
    sum to 1; ``ignore_index`` does not apply; ``x`` must be ``[N, D]``), or that target converted by
    :func:`hugehead.csr_target` (the form ``torch.compile`` can carry, where it does not take sparse
    tensors). With a sparse target or class weights the loss runs eagerly under ``torch.compile``, one
    graph break: its target preparation reads the data. See :mod:`hugehead.sparse`.

    Under ``torch.autocast`` (CUDA or CPU) the GEMMs run in the autocast dtype: ``x`` is cast once and
    the weight and bias a chunk at a time (never a full low-precision copy); ``weight.grad`` has the
    weight's dtype and ``x.grad`` ``x``'s dtype, as with ``F.linear`` under autocast.

    Returns:
        The loss — float32 for float16/bfloat16/float32 computations, float64 for float64 — a scalar, or
        ``target``'s shape for ``reduction="none"``; with ``return_lse``, ``(loss, lse)`` where ``lse``
        (target's shape, same dtype as the loss) is differentiable, for a z-loss or distillation term of
        your own. First-order gradients only: differentiating the gradients raises ``RuntimeError``.
    Raises:
        ValueError: shape or device mismatch, a target out of range, an option out of range.
        TypeError: unsupported or mismatched dtypes, an option of the wrong type (``softcap="2"``,
            ``chunk_size=2.5`` is a ValueError, ``chunk_size=True`` a TypeError).
    """
    options = LossOptions(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                          z_loss=z_loss, softcap=softcap)
    chunk_size = check_chunk_size(chunk_size)
    memory_budget = check_memory_budget(memory_budget)
    if is_sparse_target(target) or class_weight is not None:
        return _linear_cross_entropy_weighted(x, weight, target, bias, options, chunk_size, memory_budget, return_lse,
                                              class_weight)
    # The class ids are range-checked inside the op (or, for DTensors, on every rank at once).
    prepared = prepare_inputs(x, target, options, lambda x: check_inputs(x, weight, None, bias))
    if dtensor.is_dtensor(weight) or dtensor.is_dtensor(prepared.x):  # FSDP2 / tensor parallelism: used where it lies
        out = dtensor.linear_cross_entropy(
            prepared.x, weight, prepared.target, bias, compute_dtype=prepared.compute, options=options,
            chunk_size=chunk_size, memory_budget=memory_budget, return_lse=return_lse)
        loss, lse = out if return_lse else (out, None)
    else:
        loss, lse = class_id_loss(prepared.x, weight, prepared.target, bias, options, chunk_size, memory_budget,
                                  return_lse)
    return prepared.restore(loss, lse, options.reduction, return_lse)


# Under torch.compile the sparse/weighted loss runs eagerly, as one graph break: its target preparation
# reads the data (checks, sizes that depend on it) and dynamo cannot carry a sparse tensor (a CsrTarget, from
# hugehead.csr_target, it can) across the breaks that would cause. The registered ops inside it are the same
# either way.
@torch.compiler.disable
def _linear_cross_entropy_weighted(x, weight, target, bias, options: LossOptions, chunk_size, memory_budget,
                                   return_lse, class_weight):
    """:func:`linear_cross_entropy` with a sparse target or class weights (:mod:`hugehead.multilabel`)."""
    prepared = prepare_inputs(x, target, options, lambda x: check_inputs(x, weight, None, bias))
    target = prepared.target if prepared.sparse else check_targets(prepared.target, weight.shape[0],
                                                                   options.ignore_index)
    out = linear_softmax_csr(
        prepared.x, weight, target, bias, class_weight=class_weight, ignore_index=options.ignore_index,
        reduction=options.reduction, label_smoothing=options.label_smoothing, z_loss=options.z_loss,
        softcap=options.kernel_softcap, chunk_size=chunk_size, memory_budget=memory_budget, return_lse=return_lse)
    loss, lse = out if return_lse else (out, None)
    return prepared.restore(loss, lse, options.reduction, return_lse)
