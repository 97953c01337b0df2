"""Learnable synthetic data for the demo: Zipf-distributed classes whose prototypes are recomputed from
the class ids by an integer hash (no ``V × D_in`` table), single-label or multi-label."""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a well-mixing 32-bit odd multiplier (from a public integer-hash search)


def _coprime_multiplier(n: int, gen: torch.Generator) -> int:
    while True:
        a = int(torch.randint(1, 1 << 31, (1,), generator=gen))
        if math.gcd(a, n) == 1:
            return a


class ZipfPrototypes:
    """Learnable synthetic classification data with Zipf-distributed classes, generated on ``device``.

    ``sample(n)`` returns ``x [n, input_dim]`` float32 and ``target [n]`` int64: the class's prototype (a
    deterministic hash of the class id, unit variance per coordinate) plus Gaussian noise of std
    ``noise``. The class of Zipf rank ``r`` (probability ∝ ``(r+1)^-exponent``) is ``(a r + b) mod V``.
    """

    def __init__(self, num_classes: int, input_dim: int, exponent: float, noise: float, seed: int,
                 device: torch.device):
        gen = torch.Generator().manual_seed(seed)
        self.num_classes, self.input_dim, self.noise, self.device = num_classes, input_dim, noise, device
        self.perm_mult = _coprime_multiplier(num_classes, gen)
        self.perm_add = int(torch.randint(0, num_classes, (1,), generator=gen))
        self.hash_mult = (torch.randint(0, 1 << 31, (input_dim,), generator=gen) * 2 + 1).to(device)
        self.hash_add = torch.randint(0, 1 << 31, (input_dim,), generator=gen).to(device)
        probs = torch.arange(1, num_classes + 1, dtype=torch.float64, device=device).pow_(-exponent)
        self.rank_probs = probs / probs.sum()
        self.cdf = torch.cumsum(self.rank_probs, 0)

    def class_of_rank(self, rank: Tensor) -> Tensor:
        return (rank * self.perm_mult + self.perm_add) % self.num_classes

    @property
    def most_frequent_class(self) -> int:
        return self.perm_add  # rank 0

    def most_frequent_share(self, k: int = 1) -> float:
        """The expected share of samples of ``k`` labels (``sample_labels``; ``k = 1``: ``sample``) whose
        labels hold the most frequent class: ``1 - (1 - p_0)^k``, since the ``k`` draws are independent."""
        return 1.0 - (1.0 - float(self.rank_probs[0])) ** k

    def prototypes(self, cls: Tensor) -> Tensor:
        """``[n, input_dim]`` float32 prototypes of class ids ``cls [n]``, recomputed from the ids."""
        h = (cls[:, None] * self.hash_mult + self.hash_add) & _MASK32
        for _ in range(2):
            h = h ^ (h >> 16)
            h = (h * _MIX) & _MASK32
        h = h ^ (h >> 16)
        u = (h.to(torch.float64) + 0.5) * (1.0 / (1 << 32))
        return ((u - 0.5) * math.sqrt(12.0)).to(torch.float32)

    def sample_labels(self, n: int, k: int, gen: torch.Generator) -> Tuple[Tensor, Tensor]:
        """A multi-label sample: ``x [n, input_dim]``, the mean of the prototypes of ``k`` labels drawn from
        the Zipf distribution (a label drawn twice counts once) plus noise, and ``labels [n, k]`` int64."""
        u = torch.rand(n, k, dtype=torch.float64, device=self.device, generator=gen)
        labels = self.class_of_rank(torch.searchsorted(self.cdf, u).clamp_(max=self.num_classes - 1))
        x = self.prototypes(labels.reshape(-1)).view(n, k, -1).mean(dim=1)
        if self.noise:
            x.add_(torch.randn(x.shape, device=self.device, generator=gen), alpha=self.noise / math.sqrt(k))
        return x, labels

    def label_target(self, labels: Tensor, loss: str) -> Tensor:
        """The sparse ``[n, V]`` target of label sets ``[n, k]``: 1 per label for one-vs-all, the set's
        share (1/k per draw, a label drawn twice counts twice) for the softmax."""
        n, k = labels.shape
        rows = torch.arange(n, device=labels.device).repeat_interleave(k)
        value = 1.0 / k if loss == "softmax" else 1.0
        t = torch.sparse_coo_tensor(torch.stack([rows, labels.reshape(-1)]),
                                    torch.full((n * k,), value, device=labels.device), (n, self.num_classes))
        t = t.coalesce()
        if loss != "softmax":  # a label drawn twice is still one positive
            t = torch.sparse_coo_tensor(t.indices(), t.values().clamp(max=1.0), t.shape).coalesce()
        return t

    def sample(self, n: int, gen: torch.Generator) -> Tuple[Tensor, Tensor]:
        u = torch.rand(n, dtype=torch.float64, device=self.device, generator=gen)
        rank = torch.searchsorted(self.cdf, u).clamp_(max=self.num_classes - 1)
        target = self.class_of_rank(rank)
        x = self.prototypes(target)
        if self.noise:
            x.add_(torch.randn(x.shape, device=self.device, generator=gen), alpha=self.noise)
        return x, target
