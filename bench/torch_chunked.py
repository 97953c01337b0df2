"""A benchmark peer: linear cross-entropy chunked over the vocabulary in plain PyTorch, as a user could
write it without custom kernels (an ``autograd.Function``; forward streams the chunks with an online
log-sum-exp, backward recomputes them). Exact gradients; no ``[N, V]`` tensor is built.

    loss = torch_chunked_linear_cross_entropy(x, weight, target)   # same as F.cross_entropy(F.linear(x, weight), target)
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

DEFAULT_CHUNK_BYTES = 256 << 20  # one [N, C] accumulation-dtype logits chunk


def chunk_cols(n: int, v: int, acc_itemsize: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Classes per chunk so one ``[N, C]`` logits chunk takes about ``chunk_bytes`` (a multiple of 256,
    at least 256, at most V)."""
    cols = chunk_bytes // (acc_itemsize * max(n, 1))
    cols = max(256, cols // 256 * 256)
    return int(min(max(v, 1), cols))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(x @ weightᵀ, target, ignore_index, reduction)`` in vocabulary chunks.

    Forward: per chunk ``Z_c = x W_cᵀ`` (GEMM in the inputs' dtype), then in the accumulation dtype
    (float32 for 16-bit inputs) fold it into a running row max and sum-exp and pick the target logit.
    Backward: recompute ``Z_c``, form ``G_c = g·(softmax − onehot)`` and add ``G_c W_c`` into ``dx``
    (accumulation dtype) and write ``dW_c = G_cᵀ x`` once per chunk.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str,
                cols: int) -> Tensor:
        n, v = x.shape[0], weight.shape[0]
        acc = _acc_dtype(x.dtype)
        valid = target != ignore_index
        tgt = torch.where(valid, target, torch.zeros_like(target))
        row_max = torch.full((n,), -math.inf, dtype=acc, device=x.device)
        row_sum = torch.zeros(n, dtype=acc, device=x.device)
        target_logit = torch.zeros(n, dtype=acc, device=x.device)
        for c0 in range(0, v, cols):
            c1 = min(c0 + cols, v)
            z = (x @ weight[c0:c1].t()).to(acc)  # [N, C]
            inside = (tgt >= c0) & (tgt < c1)
            picked = z.gather(1, (tgt - c0).clamp(0, c1 - c0 - 1)[:, None]).squeeze(1)
            target_logit = torch.where(inside, picked, target_logit)
            new_max = torch.maximum(row_max, z.max(dim=1).values)
            row_sum = row_sum * (row_max - new_max).exp() + z.sub_(new_max[:, None]).exp_().sum(dim=1)
            row_max = new_max
            del z
        lse = row_max + row_sum.log()
        row_loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
        n_valid = valid.sum()
        loss = row_loss.sum() / n_valid if reduction == "mean" else row_loss.sum()
        ctx.save_for_backward(x, weight, tgt, valid, lse, n_valid)
        ctx.reduction, ctx.cols = reduction, cols
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        x, weight, tgt, valid, lse, n_valid = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        v, cols = weight.shape[0], ctx.cols
        acc = lse.dtype
        grad_rows = valid.to(acc) * grad_loss.to(acc)  # d loss / d row_loss, 0 on ignored rows
        if ctx.reduction == "mean":
            grad_rows = grad_rows / n_valid
        grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        for c0 in range(0, v, cols):
            c1 = min(c0 + cols, v)
            w = weight[c0:c1]
            g = (x @ w.t()).to(acc).sub_(lse[:, None]).exp_()  # softmax [N, C]
            # minus the one-hot of targets inside this chunk (scatter, not nonzero: no host sync per chunk)
            hit = ((tgt >= c0) & (tgt < c1) & valid).to(acc)
            g.scatter_add_(1, (tgt - c0).clamp(0, c1 - c0 - 1)[:, None], -hit[:, None])
            g = g.mul_(grad_rows[:, None]).to(x.dtype)
            if need_x and g.dtype == acc:
                grad_x.addmm_(g, w)
            elif need_x:
                grad_x += g @ w  # the GEMM in the inputs' dtype, the running sum in the accumulation dtype
            if need_w:
                torch.mm(g.t(), x, out=grad_w[c0:c1])
            del g
        return (grad_x.to(x.dtype) if need_x else None), grad_w, None, None, None, None


def torch_chunked_linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: Optional[int] = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(x, weight), target, ignore_index=..., reduction=...)`` without ``[N, V]``.

    Args:
        x: ``[N, D]``; weight: ``[V, D]`` (same dtype and device); target: ``[N]`` int64 in ``[0, V)``
            or ``ignore_index``.
        reduction: ``"mean"`` (over non-ignored rows; NaN when all are ignored) or ``"sum"``.
        chunk_size: classes per chunk; default :func:`chunk_cols` (a ~256 MiB float32 chunk).
    Returns:
        The scalar loss in the accumulation dtype (float32 for 16-bit inputs, else the inputs' dtype).
    Raises:
        ValueError: on a shape mismatch or an unsupported reduction.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [N, D] and weight [V, D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if target.shape != (x.shape[0],):
        raise ValueError(f"expected target [{x.shape[0]}], got {tuple(target.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    acc_itemsize = torch.empty((), dtype=_acc_dtype(x.dtype)).element_size()
    cols = int(chunk_size) if chunk_size else chunk_cols(x.shape[0], weight.shape[0], acc_itemsize)
    return ChunkedLinearCrossEntropy.apply(x, weight, target, ignore_index, reduction, max(1, cols))
