"""Plain-PyTorch reference of the loss: materializes the full ``[N, V]`` logits. Used by the tests and
benchmarks as the ground truth (run it in float64) and by ``bench/`` as the "plain PyTorch" baseline."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def logits(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, softcap: Optional[float] = None) -> Tensor:
    """``[N, V]`` logits ``x Wᵀ + b``, then ``softcap * tanh(z / softcap)`` when softcap is given."""
    z = F.linear(x, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


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
) -> Tensor:
    """Same meaning as :func:`hugehead.linear_cross_entropy`, computed the plain way in the inputs' dtype
    (pass float64 tensors for a ground truth)."""
    z = logits(x, weight, bias, softcap)
    target = target.long()
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = target != ignore_index
    if z_loss:
        lse = torch.logsumexp(z.to(torch.float32) if z.dtype in (torch.float16, torch.bfloat16) else z, dim=-1)
        loss = loss + torch.where(valid, z_loss * lse.square(), torch.zeros_like(lse)).to(loss.dtype)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / valid.sum()
    raise ValueError(f"unknown reduction {reduction!r}")
