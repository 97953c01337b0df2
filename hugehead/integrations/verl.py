"""A drop-in for verl's fused kernel ``verl.utils.kernel.linear_cross_entropy`` (verl 0.9.1): the same signature
and results — per-token log-probabilities of the labels and the entropy of the tempered softmax, both
differentiable — computed by :func:`hugehead.linear_log_prob`, on the CPU or any GPU, streamed over the vocabulary.

Use it where verl's actor calls its fused kernel, e.g. ``verl.utils.kernel.linear_cross_entropy =
hugehead.integrations.verl.linear_cross_entropy`` before the model is built (verl itself is not imported here).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..dtensor import TensorParallelEngine
from ..engines.local import LocalEngine
from ..inputs import prepare_inputs
from ..logprob import check_temperature, linear_log_prob, sharded_log_prob
from ..options import LossOptions, check_inputs, check_targets
from ..sharded_loss import LossSpec

__all__ = ["linear_cross_entropy"]


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: Optional[float] = 1.0,
                         reduction: Optional[str] = "none",
                         dist_process_group: Optional["torch.distributed.ProcessGroup"] = None) -> Tuple[Tensor, Tensor]:
    """``(logprobs, entropy)`` of ``softmax(hidden @ weight.T / temperature)``, as verl's kernel returns them.

    Args:
        hidden: ``[..., H]`` (verl: ``[batch, tokens, H]``); weight: ``[V, H]`` — with ``dist_process_group``, this
            rank's contiguous ``V / world`` rows of the vocabulary (rank ``r`` holds ``[r V_r, (r + 1) V_r)``) and
            the same ``hidden`` on every rank (tensor parallelism); labels: ``hidden``'s leading shape, class ids
            of the whole vocabulary.
        temperature: divides the logits (None: 1). reduction: ``"none"`` (per token), ``"sum"`` or ``"mean"``
            (over the tokens) of the log-probabilities; the entropy is always per token.
    Returns:
        ``logprobs`` (``[N]`` for ``"none"``, else a scalar) and ``entropy`` ``[N]``, ``N`` the flattened tokens,
        float32 (float64 for float64 inputs); gradients reach ``hidden`` (in its shape) and ``weight``.
    Raises:
        ValueError: an unknown reduction, a label outside the vocabulary; as :func:`hugehead.linear_log_prob`.
    """
    reduction = "none" if reduction is None else reduction
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"hugehead: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    t = check_temperature(1.0 if temperature is None else temperature)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if dist_process_group is None:
        logprobs, entropy = linear_log_prob(hidden, weight, labels, temperature=t, return_entropy=True)
    else:
        logprobs, entropy = _tensor_parallel(hidden, weight, labels, t, dist_process_group)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.sum() / max(labels.shape[0], 1)
    return logprobs, entropy


def _tensor_parallel(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, group):
    """Each rank its own rows of the vocabulary, every rank the same tokens: the tensor-parallel engine."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = weight.shape[0]
    options = LossOptions(reduction="none")
    prepared = prepare_inputs(hidden, labels, options, lambda x: check_inputs(x, weight, None, None))
    target = check_targets(prepared.target, rows * world, options.ignore_index)
    engine = TensorParallelEngine(LocalEngine(), group, [(r * rows, (r + 1) * rows) for r in range(world)])
    spec = LossSpec(engine, [rank * rows], False, rows * world, options)
    return sharded_log_prob(spec, prepared.x, target, [weight], [None], temperature, True)
