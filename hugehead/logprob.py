"""The log-probability of each row's target and the entropy of its softmax, for post-training (RL policy
log-probs, the entropy bonus, reference-model log-probs): :func:`linear_log_prob`, and the head's
:meth:`hugehead.ChunkedClassifier.log_prob`, both differentiable through both outputs.

``log p`` alone is minus the per-row cross-entropy, so it takes the class-id loss and every plan and GEMM path
of it. With the entropy the statistics pass folds one more running sum per row
(:class:`hugehead.targets.EntropyTarget`: ``Σ exp(c - max) (c - max)``, rescaled with the max), shards and ranks
merge the entropies of their class ranges as a mixture's (:func:`hugehead.loop.chunks.merge_shares`), and the
gradient kernel adds ``-dH p (log p + H)`` to ``dlogp (onehot - p)``.

Temperature ``T`` divides the (softcapped) logits: ``softcap(x Wᵀ + b) / T``, the distribution a sampler at
temperature ``T`` draws from. It is folded into the inputs: ``x / T`` and ``b / T`` (in the compute dtype) and a
softcap of ``softcap / T``, since ``(c/T) tanh((z/T) / (c/T)) = c tanh(z/c) / T``.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import dtensor
from .engines.local import LocalEngine
from .functional import linear_cross_entropy
from .inputs import prepare_inputs
from .options import LossOptions, check_chunk_size, check_inputs, check_memory_budget, check_targets
from .sharded_loss import LossSpec, ShardedLinearCrossEntropy, backward_of_shards, save_for_shards, saved_rows
from .targets import EntropyTarget

__all__ = ["linear_log_prob", "sharded_log_prob", "check_temperature", "ShardedLogProb"]


def check_temperature(temperature) -> float:
    """``temperature`` as a float. Raises ``TypeError`` (not a real number) or ``ValueError`` (not finite and
    positive)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"hugehead: temperature must be a positive number, got {type(temperature).__name__}")
    t = float(temperature)
    if not (math.isfinite(t) and t > 0.0):
        raise ValueError(f"hugehead: temperature must be finite and positive, got {temperature}")
    return t


def _tempered(t: float, x: Tensor, biases: Sequence[Optional[Tensor]], softcap: Optional[float]):
    """``x / T``, each bias ``/ T`` and ``softcap / T`` (the module docstring: the logits divided by ``T``)."""
    if t == 1.0:
        return x, list(biases), softcap
    return x / t, [None if b is None else b / t for b in biases], None if softcap is None else softcap / t


class ShardedLogProb(torch.autograd.Function):
    """``(log p(target), entropy)`` ``[N]`` (accumulation dtype, 0 on ignored rows) of ``x`` against every
    shard of ``spec``; one node in the graph, whose backward takes gradients of both."""

    @staticmethod
    def forward(ctx, spec: LossSpec, x: Tensor, target: Tensor, *params: Tensor) -> Tuple[Tensor, Tensor]:
        shards = spec.shards(params)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            lse, target_logit, entropy, placed = spec.engine.row_stats(
                x, EntropyTarget(target), shards, spec.options, keep=any(ctx.needs_input_grad))
        valid = target != spec.options.ignore_index
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        logp = torch.where(valid, target_logit - lse, zero)
        entropy = torch.where(valid, entropy, zero)
        save_for_shards(ctx, spec, x, [target, lse, entropy], params, placed)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor]):
        target, lse, entropy = saved_rows(ctx)
        valid = target != ctx.spec.options.ignore_index
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        # The loss kernels differentiate -log p: dL/d(-log p) = -dL/dlog p.
        grad_rows = zero.expand(lse.shape) if grad_logp is None else torch.where(valid, -grad_logp.to(lse.dtype), zero)
        grad_h = zero.expand(lse.shape) if grad_entropy is None else torch.where(valid, grad_entropy.to(lse.dtype),
                                                                                 zero)
        grads = backward_of_shards(ctx, "log_prob", 1, 3, lse, grad_rows, row_terms=(grad_h.contiguous(), entropy))
        return (None, grads[0], None, *grads[1:])


def sharded_log_prob(spec: LossSpec, x: Tensor, target: Tensor, weights: Sequence[Tensor],
                     biases: Sequence[Optional[Tensor]], temperature: float,
                     return_entropy: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`linear_log_prob` over the shards of ``spec`` (whose options are the loss's: softcap and ignore_index;
    ``x [N, D]`` in the compute dtype, ``target [N]`` checked class ids): ``log p [N]`` or ``(log p, entropy)``."""
    x, biases, softcap = _tempered(temperature, x, biases, spec.options.softcap)
    options = LossOptions(reduction="none", ignore_index=spec.options.ignore_index, softcap=softcap)
    spec = LossSpec(spec.engine, spec.starts, spec.has_bias, spec.num_classes, options)
    params: List[Tensor] = [*weights, *(b for b in biases if b is not None)]
    if not return_entropy:
        loss_rows, _ = ShardedLinearCrossEntropy.apply(spec, x, target, *params)
        return -loss_rows
    return ShardedLogProb.apply(spec, x, target, *params)


def linear_log_prob(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-row ``log p(target | x)`` under ``softmax(softcap(x Wᵀ + b) / temperature)``, and with
    ``return_entropy`` the entropy ``H = -Σ_j p_j log p_j`` of that distribution — without the ``N × V`` logits.

    Both are differentiable (first order) with any upstream gradients. ``log p`` alone costs what the per-row
    cross-entropy costs (it is its negative); the entropy adds one running sum to the statistics pass and one
    term to the gradient.

    Args:
        x: ``[..., D]``; weight: ``[V, D]``; target: ``x``'s leading shape, int64/int32 class ids in ``[0, V)`` or
            ``ignore_index``; bias: ``[V]`` or None. Dtypes and devices as :func:`hugehead.linear_cross_entropy`
            (autocast included); DTensors as there (this rank's rows come back).
        temperature: divides the softcapped logits (as a sampler's temperature); folded into ``x / T``, ``b / T``.
        softcap: None, or a positive number: ``softcap * tanh(z / softcap)`` before the temperature.
        ignore_index: rows with this target get 0 for both, and no gradient.
        chunk_size, memory_budget: as :func:`hugehead.linear_cross_entropy`.
    Returns:
        ``log p`` in ``target``'s shape, float32 (float64 for float64 inputs); with ``return_entropy``,
        ``(log p, entropy)``.
    Raises:
        TypeError, ValueError: as :func:`hugehead.linear_cross_entropy`; a temperature that is not a finite
            positive number.
    """
    t = check_temperature(temperature)
    options = LossOptions(reduction="none", ignore_index=ignore_index, softcap=softcap)
    check_inputs(x, weight, None, bias)
    if not return_entropy:
        xt, (bt,), cap = _tempered(t, x, [bias], options.softcap)
        return -linear_cross_entropy(xt, weight, target, bt, ignore_index=options.ignore_index, reduction="none",
                                     softcap=cap, chunk_size=chunk_size, memory_budget=memory_budget)
    chunk_size = check_chunk_size(chunk_size)
    memory_budget = check_memory_budget(memory_budget)
    prepared = prepare_inputs(x, target, options, lambda x: check_inputs(x, weight, None, bias))
    if dtensor.is_dtensor(weight) or dtensor.is_dtensor(prepared.x):  # used where it lies, as the loss's weight
        spec, x, target, params = dtensor.mesh_head(prepared.x, weight, prepared.target, bias,
                                                    compute_dtype=prepared.compute, options=options,
                                                    chunk_size=chunk_size, memory_budget=memory_budget)
        return sharded_log_prob(spec, x, target, params[:1], params[1:] or [None], t, True)
    target = check_targets(prepared.target, weight.shape[0], options.ignore_index)
    spec = LossSpec(LocalEngine(chunk_size, memory_budget), [0], bias is not None, weight.shape[0], options)
    logp, entropy = sharded_log_prob(spec, prepared.x, target, [weight], [bias], t, True)
    if prepared.shape is not None:
        logp, entropy = logp.view(prepared.shape), entropy.view(prepared.shape)
    return logp, entropy
