"""The demo's backbone, its optimizer, and held-out evaluation of backbone + head."""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor, nn

from .data import ZipfPrototypes

class Backbone(nn.Sequential):
    """``[N, input_dim] -> [N, dim]``: a two-hidden-layer GELU MLP with a final LayerNorm."""

    def __init__(self, input_dim: int, hidden: int, dim: int):
        super().__init__(
            nn.Linear(input_dim, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
            nn.Linear(hidden, dim), nn.LayerNorm(dim),
        )


def make_optimizer(backbone: nn.Module, head: nn.Module, lr: float, head_dtype: torch.dtype) -> torch.optim.Optimizer:
    """Adam over the backbone and every shard, fused (no parameter-sized temporaries: matters for
    multi-GiB shards) where supported. A float16 head gets ``eps=1e-4``: its second moments underflow
    float16, and ``1e-8`` is 0 there."""
    groups = [dict(params=list(backbone.parameters())),
              dict(params=list(head.parameters()), eps=1e-4 if head_dtype == torch.float16 else 1e-8)]
    try:
        return torch.optim.Adam(groups, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(groups, lr=lr, foreach=False)


@torch.no_grad()
def evaluate(backbone: nn.Module, head: nn.Module, x: Tensor, target: Tensor, batch: int,
             dtype: torch.dtype, autocast: str = "off") -> Tuple[float, float]:
    """Held-out ``(mean loss, top-1 accuracy)``, ``batch`` rows at a time."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[0], batch):
        t = target[i:i + batch]
        with autocast_context(autocast, x.device):
            feats = head_features(backbone, x[i:i + batch], dtype, autocast)
            loss_sum += head(feats, t).double() * t.shape[0]
            _, top = head.topk(feats, 1)
        correct += (top[:, 0].to(t.device) == t).sum()
    n = x.shape[0]
    return float(loss_sum) / n, int(correct) / n


@torch.no_grad()
def evaluate_multilabel(backbone: nn.Module, head: nn.Module, data: "ZipfPrototypes", x: Tensor, labels: Tensor,
                        batch: int, dtype: torch.dtype, loss_kind: str, autocast: str = "off") -> Dict[str, float]:
    """Held-out mean loss, precision@1/@5 and nDCG@5 (:mod:`hugehead.metrics`) of a multi-label task."""
    from .. import metrics

    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    tops = []
    for i in range(0, x.shape[0], batch):
        lab = labels[i:i + batch]
        with autocast_context(autocast, x.device):
            feats = head_features(backbone, x[i:i + batch], dtype, autocast)
            loss_sum += head(feats, data.label_target(lab, loss_kind)).double() * lab.shape[0]
            tops.append(head.topk(feats, min(5, data.num_classes))[1].to(x.device))
    top = torch.cat(tops)
    label_lists = [row.unique() for row in labels]
    p = metrics.precision_at_k(top, label_lists, [1, 5] if top.shape[1] >= 5 else [1])
    ndcg = metrics.ndcg_at_k(top, label_lists, min(5, top.shape[1]))
    return dict(loss=float(loss_sum) / x.shape[0], p1=float(p[0]), p5=float(p[-1]), ndcg5=float(ndcg.reshape(-1)[0]))


def autocast_context(mode: str, device: torch.device):
    """``torch.autocast`` in bfloat16 on ``device``'s type for ``--autocast bfloat16``, else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bfloat16")


def head_features(backbone: nn.Module, x: Tensor, dtype: torch.dtype, autocast: str) -> Tensor:
    """The backbone's features for the head: cast to the head's dtype, except under autocast, where the
    head casts them itself (float32 master weights, compute in the autocast dtype)."""
    feats = backbone(x)
    return feats if autocast != "off" else feats.to(dtype)
