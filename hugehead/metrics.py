"""Ranking metrics computed from top-k class ids and the targets, never from ``[N, V]`` scores:
accuracy@k for single-label targets; precision@k, nDCG@k, propensity-scored precision@k and nDCG@k for
multi-label targets; as functions, and as streaming ``torchmetrics.Metric`` s for Lightning's
``test_step`` (and any loop, one process or several).

Why not torchmetrics' own metrics: ``MulticlassAccuracy(top_k=...)`` and the ``Retrieval*`` metrics take a
score for every (row, class) pair, which is the ``[N, V]`` tensor a 6M-class head never builds. Feeding the
retrieval metrics only each row's k candidates would be wrong for nDCG (its ideal DCG is built from the
relevant items it is given, so it forgets the labels that missed the top k), wrong for raw logits
(torchmetrics 1.9's ``retrieval_precision`` counts a hit only where the score is positive) and costly for
every one of them (their states keep every prediction until ``compute`` and gather them all across ranks).
The metrics here need only the ``[N, k]`` indices, the labels, and a few running sums per metric.

Conventions (those of the Extreme Classification Repository and its tools, e.g. pyxclib):

- ``indices [N, K]`` int: each row's predicted classes, best first, distinct within a row
  (:meth:`hugehead.ChunkedClassifier.topk` orders them by value descending, ties to the lower class id).
  A metric at ``k`` reads the first ``k`` columns; ``K >= k``.
- single-label ``target [N]`` int class ids (rows equal to ``ignore_index`` are left out).
- multi-label ``labels``: a sparse COO or CSR ``[N, V]`` tensor whose stored nonzero entries are the
  row's labels, or a sequence of ``N`` 1-D int tensors of label ids (duplicates count once).
- a row without labels scores 0 in every multi-label metric and still counts in the mean (as in
  pyxclib), so a test set with empty rows is not flattered.
- results are float64.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .ranking import (Ks, Labels, accuracy_counts, check_indices, check_ks, make_label_set, multilabel_sums,
                      result_for)

__all__ = [
    "accuracy_at_k",
    "precision_at_k",
    "ndcg_at_k",
    "psprecision_at_k",
    "psndcg_at_k",
    "label_frequencies",
    "inverse_propensity",
    "PROPENSITY_PARAMETERS",
    "most_frequent_topk",
    "AccuracyAtK",
    "PrecisionAtK",
    "NDCGAtK",
    "PSPrecisionAtK",
    "PSNDCGAtK",
]


# (A, B) of Jain et al. (2016), Sec. 3: 0.55, 1.5 by default; the paper's values for Amazon and Wikipedia.
PROPENSITY_PARAMETERS: Dict[str, Tuple[float, float]] = {
    "default": (0.55, 1.5),
    "amazon": (0.6, 2.6),
    "wikipedia": (0.5, 0.4),
}


# --------------------------------------------------------------------------------------------------
# Functions
# --------------------------------------------------------------------------------------------------
def accuracy_at_k(indices: Tensor, target: Tensor, k: Ks = 1, *, ignore_index: Optional[int] = None) -> Tensor:
    """Top-k accuracy (entity linking's recall@k / hits@k): the fraction of rows whose target is among
    their first ``k`` predicted classes.

    Args:
        indices: ``[N, K]`` int, best first (e.g. from ``head.topk(x, K)``); ``K >= k``.
        target: ``[N]`` int class ids. k: an int, or a sequence of them.
        ignore_index: rows whose target equals it are left out (None: every row counts).
    Returns:
        float64 on ``indices``' device: a scalar for an int ``k``, ``[len(k)]`` for a sequence; NaN when no
        row counts.
    Raises:
        TypeError / ValueError: non-integer or mis-shaped inputs, ``k`` outside ``[1, K]``.
    """
    ks = check_ks(k, check_indices(indices).shape[1])
    correct, rows = accuracy_counts(indices, target, ks, ignore_index)
    return result_for(correct.double() / rows.double(), k)


def precision_at_k(indices: Tensor, labels: Labels, k: Ks = 1) -> Tensor:
    """Precision@k: ``mean_i |top_k(i) ∩ y_i| / k`` (rows without labels score 0).

    Args:
        indices: ``[N, K]`` int, best first; ``K >= k``. labels: sparse COO/CSR ``[N, V]`` or ``N`` 1-D
            int tensors of label ids (see the module doc). k: an int or a sequence of them.
    Returns:
        float64 on ``indices``' device: a scalar for an int ``k``, ``[len(k)]`` for a sequence.
    Raises:
        TypeError / ValueError: bad layouts, shapes, negative ids, ``k`` outside ``[1, K]``.
    """
    ks = check_ks(k, check_indices(indices).shape[1])
    sums = multilabel_sums(indices, labels, ks)
    denom = torch.tensor(ks, dtype=torch.float64, device=sums["hits"].device) * indices.shape[0]
    return result_for(sums["hits"] / denom, k)


def ndcg_at_k(indices: Tensor, labels: Labels, k: Ks = 1) -> Tensor:
    """nDCG@k with binary gains: ``mean_i DCG@k_i / IDCG@k_i``, where ``DCG@k_i = Σ_{j<k} [idx_ij ∈ y_i] /
    log2(j + 2)`` and ``IDCG@k_i = Σ_{j < min(k, |y_i|)} 1 / log2(j + 2)`` (rows without labels score 0).

    Args, returns and raises: as :func:`precision_at_k`.
    """
    ks = check_ks(k, check_indices(indices).shape[1])
    return result_for(multilabel_sums(indices, labels, ks)["ndcg"] / indices.shape[0], k)


def psprecision_at_k(indices: Tensor, labels: Labels, inv_propensity: Tensor, k: Ks = 1, *,
                     normalize: bool = False) -> Tensor:
    """Propensity-scored precision@k (Jain et al., 2016): ``PSP@k = mean_i (1/k) Σ_{j<k} [idx_ij ∈ y_i] /
    p_{idx_ij}``, which credits a correct rare label more than a correct frequent one.

    ``normalize=True`` divides by the best achievable value on the same rows, ``mean_i (1/k) Σ_{j <
    min(k, |y_i|)}`` of row i's largest ``1/p_l``: the ratio of the two dataset sums, as the Extreme
    Classification Repository's tables and pyxclib (``psprecision``) report it (1.0 is a perfect ranker).
    ``normalize=False`` (the default) is the paper's unnormalized definition.

    Args:
        indices, labels, k: as :func:`precision_at_k`.
        inv_propensity: ``[V]`` float, ``1 / p_l`` per class (:func:`inverse_propensity`).
    Returns:
        float64 on ``indices``' device: a scalar for an int ``k``, ``[len(k)]`` for a sequence (NaN for
        ``normalize=True`` when no row has a label).
    Raises:
        TypeError / ValueError: as :func:`precision_at_k`, and a class id outside ``inv_propensity``.
    """
    ks = check_ks(k, check_indices(indices).shape[1])
    sums = multilabel_sums(indices, labels, ks, inv_propensity)
    if normalize:
        return result_for(sums["ps_gain"] / sums["ps_best"], k)
    denom = torch.tensor(ks, dtype=torch.float64, device=sums["ps_gain"].device) * indices.shape[0]
    return result_for(sums["ps_gain"] / denom, k)


def psndcg_at_k(indices: Tensor, labels: Labels, inv_propensity: Tensor, k: Ks = 1) -> Tensor:
    """Propensity-scored nDCG@k as the Extreme Classification Repository (and pyxclib's ``psndcg``)
    report it: ``Σ_i PSDCG@k_i / Σ_i best PSDCG@k_i`` with ``PSDCG@k_i = Σ_{j<k} [idx_ij ∈ y_i] /
    (p_{idx_ij} log2(j + 2))`` and the best value from row i's labels sorted by ``1/p_l`` descending.

    Args, returns and raises: as :func:`psprecision_at_k` (always normalized).
    """
    ks = check_ks(k, check_indices(indices).shape[1])
    sums = multilabel_sums(indices, labels, ks, inv_propensity)
    return result_for(sums["ps_dcg"] / sums["ps_idcg"], k)


def label_frequencies(labels: Labels, num_classes: int) -> Tensor:
    """``N_l``: the number of rows carrying each label, ``[num_classes]`` int64 (for
    :func:`inverse_propensity`, from the training set's labels). Accepts multi-label targets (see the module
    doc) and single-label ``[N]`` int class ids (negative ids, e.g. ``ignore_index``, are left out).

    Raises:
        ValueError: a label id ``>= num_classes``.
    """
    if isinstance(labels, Tensor) and labels.layout == torch.strided:
        if labels.dim() != 1 or labels.dtype.is_floating_point:
            raise TypeError("hugehead.metrics: dense labels must be a 1-D integer tensor of class ids")
        cols = labels[labels >= 0].long()
    else:
        n = labels.shape[0] if isinstance(labels, Tensor) else len(labels)
        device = labels.device if isinstance(labels, Tensor) else torch.device("cpu")
        cols = make_label_set(labels, n, device).labels  # a label repeated in a row counts once
    if cols.numel() and int(cols.max()) >= num_classes:
        raise ValueError(f"hugehead.metrics: label id {int(cols.max())} >= num_classes={num_classes}")
    return torch.bincount(cols, minlength=num_classes)


def inverse_propensity(frequencies: Tensor, num_samples: int, a: float = 0.55, b: float = 1.5) -> Tensor:
    """``1 / p_l`` of Jain et al. (2016): ``p_l = 1 / (1 + C e^{-A log(N_l + B)})``, ``C = (log N - 1)(B +
    1)^A``, i.e. ``1/p_l = 1 + C (N_l + B)^{-A}`` (natural log; pyxclib's ``compute_inv_propesity``).

    Args:
        frequencies: ``[V]`` ``N_l``, the training rows carrying label l (:func:`label_frequencies`).
        num_samples: ``N``, the number of training rows.
        a, b: the dataset's parameters: ``PROPENSITY_PARAMETERS`` holds the paper's (0.55, 1.5 by default;
            Amazon 0.6, 2.6; Wikipedia 0.5, 0.4).
    Returns:
        ``[V]`` float64 on ``frequencies``' device, each ``>= 1`` for ``N > e``.
    Raises:
        ValueError: ``num_samples < 1``, a negative frequency, or ``b <= 0`` with a zero frequency.
    """
    if num_samples < 1:
        raise ValueError(f"hugehead.metrics: num_samples must be >= 1, got {num_samples}")
    freq = frequencies.double()
    if freq.numel() and float(freq.min()) < 0:
        raise ValueError("hugehead.metrics: label frequencies must be >= 0")
    if b <= 0 and bool((freq == 0).any()):
        raise ValueError(f"hugehead.metrics: b={b} <= 0 with a label of frequency 0: (N_l + B)^-A is undefined")
    c = (math.log(num_samples) - 1) * (b + 1) ** a
    return 1.0 + c * (freq + b).pow(-a)


def most_frequent_topk(frequencies: Tensor, k: int, rows: int) -> Tensor:
    """The always-most-frequent baseline's predictions: the ``k`` most frequent classes (ties to the lower
    class id), the same for each of ``rows`` rows, as an ``[rows, k]`` int64 view (no copy) to feed the
    metrics here.

    Raises:
        ValueError: ``k`` outside ``[1, V]``.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= frequencies.numel():
        raise ValueError(f"hugehead.metrics: k must be an integer in [1, {frequencies.numel()}], got {k!r}")
    order = torch.argsort(frequencies, descending=True, stable=True)[:k]
    return order[None, :].expand(rows, k)


# --------------------------------------------------------------------------------------------------
# Streaming metrics (torchmetrics)
# --------------------------------------------------------------------------------------------------
try:
    from torchmetrics import Metric as _Metric
except ImportError:  # pragma: no cover - exercised only without torchmetrics
    _Metric = None


class _MetricBase(_Metric if _Metric is not None else object):
    """A metric at ``k`` (an int, or a sequence of ints as the functions take) whose states are sums
    (``dist_reduce_fx="sum"``), one per ``k``: ``update`` per batch, in any process, and ``compute`` gives
    the value over everything seen, a scalar for an int ``k`` and ``[len(k)]`` for a sequence, as the
    functions return (torchmetrics syncs the sums across ranks when a process group is up)."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, k: Ks, **kwargs):
        if _Metric is None:
            raise ImportError(f"hugehead.metrics.{type(self).__name__} needs torchmetrics: pip install torchmetrics")
        super().__init__(**kwargs)
        self.ks = check_ks(k, math.inf)
        self.k = k if isinstance(k, int) else tuple(self.ks)

    def _sum_state(self, name: str, dtype: torch.dtype) -> None:
        self.add_state(name, torch.zeros(len(self.ks), dtype=dtype), dist_reduce_fx="sum")

    def _ks_tensor(self) -> Tensor:
        return torch.tensor(self.ks, dtype=torch.float64, device=self.rows.device)

    def _result(self, values: Tensor) -> Tensor:
        return result_for(values, self.k)

    def extra_repr(self) -> str:
        return f"k={self.k}"


class AccuracyAtK(_MetricBase):
    """Streaming :func:`accuracy_at_k`: ``AccuracyAtK(k)`` (an int or a sequence of them),
    ``update(indices [N, K], target [N])``, ``compute()`` -> float64: a scalar for an int ``k``,
    ``[len(k)]`` for a sequence (NaN before any counted row).

    In a LightningModule::

        self.acc = AccuracyAtK((1, 5))                                # in __init__
        _, top = self.head.topk(features, 5)                          # in test_step
        self.acc.update(top, target)
        acc1, acc5 = self.acc.compute()                               # in on_test_epoch_end
    """

    def __init__(self, k: Ks = 1, *, ignore_index: Optional[int] = None, **kwargs):
        super().__init__(k, **kwargs)
        self.ignore_index = ignore_index
        self._sum_state("correct", torch.int64)
        self.add_state("total", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, indices: Tensor, target: Tensor) -> None:
        ks = check_ks(self.ks, check_indices(indices).shape[1])
        correct, rows = accuracy_counts(indices, target, ks, self.ignore_index)
        self.correct += correct.to(self.correct.device)
        self.total += rows.to(self.total.device)

    def compute(self) -> Tensor:
        return self._result(self.correct.double() / self.total.double())


class _MultiLabelMetric(_MetricBase):
    """Shared ``update``: the batch's sums from :func:`multilabel_sums` added to the states named by
    ``_sums`` (state name -> sum name)."""

    _sums: Dict[str, str] = {}

    def __init__(self, k: Ks, inv_propensity: Optional[Tensor] = None, **kwargs):
        super().__init__(k, **kwargs)
        if inv_propensity is not None:
            if not isinstance(inv_propensity, Tensor) or inv_propensity.dim() != 1:
                raise ValueError("hugehead.metrics: inv_propensity must be a [V] tensor")
            # A buffer, so that metric.to(device) moves it with the states; not part of the state_dict.
            self.register_buffer("inv_propensity", inv_propensity.detach().double(), persistent=False)
        else:
            self.inv_propensity = None
        for state in self._sums:
            self._sum_state(state, torch.float64)
        self.add_state("rows", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, indices: Tensor, labels: Labels) -> None:
        ks = check_ks(self.ks, check_indices(indices).shape[1])
        sums = multilabel_sums(indices, labels, ks, self.inv_propensity)
        for state, name in self._sums.items():
            setattr(self, state, getattr(self, state) + sums[name].to(self.rows.device))
        self.rows += indices.shape[0]


class PrecisionAtK(_MultiLabelMetric):
    """Streaming :func:`precision_at_k`: ``update(indices [N, K], labels)``, ``compute()`` -> float64, a
    scalar for an int ``k``, ``[len(k)]`` for a sequence."""

    _sums = {"hits": "hits"}

    def __init__(self, k: Ks = 1, **kwargs):
        super().__init__(k, **kwargs)

    def compute(self) -> Tensor:
        return self._result(self.hits / (self.rows.double() * self._ks_tensor()))


class NDCGAtK(_MultiLabelMetric):
    """Streaming :func:`ndcg_at_k`: ``update(indices [N, K], labels)``, ``compute()`` -> float64, a scalar
    for an int ``k``, ``[len(k)]`` for a sequence."""

    _sums = {"ndcg": "ndcg"}

    def __init__(self, k: Ks = 1, **kwargs):
        super().__init__(k, **kwargs)

    def compute(self) -> Tensor:
        return self._result(self.ndcg / self.rows.double())


class PSPrecisionAtK(_MultiLabelMetric):
    """Streaming :func:`psprecision_at_k` (``normalize`` as there): ``PSPrecisionAtK(k, inv_propensity)``,
    ``update(indices [N, K], labels)``, ``compute()`` -> float64, a scalar for an int ``k``, ``[len(k)]``
    for a sequence."""

    _sums = {"gain": "ps_gain", "best": "ps_best"}

    def __init__(self, k: Ks, inv_propensity: Tensor, *, normalize: bool = False, **kwargs):
        super().__init__(k, inv_propensity, **kwargs)
        self.normalize = normalize

    def compute(self) -> Tensor:
        if self.normalize:
            return self._result(self.gain / self.best)
        return self._result(self.gain / (self.rows.double() * self._ks_tensor()))


class PSNDCGAtK(_MultiLabelMetric):
    """Streaming :func:`psndcg_at_k`: ``PSNDCGAtK(k, inv_propensity)``, ``update(indices [N, K], labels)``,
    ``compute()`` -> float64, a scalar for an int ``k``, ``[len(k)]`` for a sequence."""

    _sums = {"dcg": "ps_dcg", "idcg": "ps_idcg"}

    def __init__(self, k: Ks, inv_propensity: Tensor, **kwargs):
        super().__init__(k, inv_propensity, **kwargs)

    def compute(self) -> Tensor:
        return self._result(self.dcg / self.idcg)
