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
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

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

Labels = Union[Tensor, Sequence[Tensor]]
Ks = Union[int, Sequence[int]]

# (A, B) of Jain et al. (2016), Sec. 3: 0.55, 1.5 by default; the paper's values for Amazon and Wikipedia.
PROPENSITY_PARAMETERS: Dict[str, Tuple[float, float]] = {
    "default": (0.55, 1.5),
    "amazon": (0.6, 2.6),
    "wikipedia": (0.5, 0.4),
}


# --------------------------------------------------------------------------------------------------
# Input checks and the label set
# --------------------------------------------------------------------------------------------------
def _check_ks(k: Ks, width: int) -> List[int]:
    ks = [k] if isinstance(k, int) and not isinstance(k, bool) else list(k)
    if not ks:
        raise ValueError("hugehead.metrics: k must be a positive integer or a non-empty sequence of them")
    for kk in ks:
        if isinstance(kk, bool) or not isinstance(kk, int) or kk < 1:
            raise ValueError(f"hugehead.metrics: k must be a positive integer, got {kk!r}")
        if kk > width:
            raise ValueError(f"hugehead.metrics: k={kk} but indices has only {width} columns per row; "
                             f"ask the head for at least k={kk} (e.g. head.topk(x, {kk}))")
    return ks


def _check_indices(indices: Tensor) -> Tensor:
    if not isinstance(indices, Tensor):
        raise TypeError(f"hugehead.metrics: indices must be a tensor, got {type(indices).__name__}")
    if indices.dim() != 2:
        raise ValueError(f"hugehead.metrics: indices must be [N, k], got shape {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"hugehead.metrics: indices must be an integer tensor, got {indices.dtype}")
    if indices.numel() and int(indices.min()) < 0:
        raise ValueError("hugehead.metrics: indices holds a negative class id")
    return indices.long()


def _result(values: Tensor, k: Ks) -> Tensor:
    return values[0] if isinstance(k, int) else values


class _LabelSet(NamedTuple):
    """Multi-label targets of ``n`` rows as sorted unique keys ``row * stride + label`` (so membership of
    any ``(row, class)`` pair is one binary search), with each key's row and label and each row's count."""

    keys: Tensor    # [nnz] int64, ascending
    rows: Tensor    # [nnz] int64
    labels: Tensor  # [nnz] int64
    counts: Tensor  # [n] int64: labels per row
    stride: int


def _label_pairs(labels: Labels, n: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """``(rows, labels)`` int64 of every stored label of ``labels`` (see the module doc), on ``device``."""
    if isinstance(labels, Tensor):
        if labels.layout == torch.sparse_coo:
            coo = labels.coalesce()
            rows, cols = coo.indices()
            keep = coo.values() != 0
        elif labels.layout == torch.sparse_csr:
            crow, cols = labels.crow_indices(), labels.col_indices()
            rows = torch.repeat_interleave(torch.arange(labels.shape[0], device=crow.device), crow.diff())
            keep = labels.values() != 0
        else:
            raise TypeError(
                "hugehead.metrics: multi-label targets must be a sparse COO/CSR [N, V] tensor or a list of "
                f"label-id tensors, got a {labels.layout} tensor (for single-label [N] targets use "
                "accuracy_at_k)")
        if labels.dim() != 2 or labels.shape[0] != n:
            raise ValueError(f"hugehead.metrics: labels must be [N={n}, V], got shape {tuple(labels.shape)}")
        rows, cols = rows[keep], cols[keep]
    else:
        labels = list(labels)
        if len(labels) != n:
            raise ValueError(f"hugehead.metrics: {len(labels)} label lists for {n} rows of indices")
        for i, row in enumerate(labels):
            if not isinstance(row, Tensor) or row.dim() != 1 or row.dtype.is_floating_point or row.dtype == torch.bool:
                raise TypeError(f"hugehead.metrics: labels[{i}] must be a 1-D integer tensor of label ids")
        lengths = torch.tensor([row.numel() for row in labels], dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(n), lengths)
        cols = torch.cat([row.to("cpu", torch.int64) for row in labels] or [torch.zeros(0, dtype=torch.int64)])
    rows, cols = rows.to(device, torch.int64), cols.to(device, torch.int64)
    if cols.numel() and int(cols.min()) < 0:
        raise ValueError("hugehead.metrics: labels holds a negative label id")
    return rows, cols


def _label_set(labels: Labels, n: int, device: torch.device, min_stride: int = 1) -> _LabelSet:
    rows, cols = _label_pairs(labels, n, device)
    stride = max(min_stride, 1 + int(cols.max()) if cols.numel() else 1)
    keys = torch.unique(rows * stride + cols)  # sorted; duplicates count once
    rows, cols = keys // stride, keys % stride
    return _LabelSet(keys, rows, cols, torch.bincount(rows, minlength=n), stride)


def _hits(indices: Tensor, label_set: _LabelSet) -> Tensor:
    """``[N, K]`` bool: whether ``indices[i, j]`` is one of row i's labels."""
    n = indices.shape[0]
    query = torch.arange(n, device=indices.device)[:, None] * label_set.stride + indices
    if label_set.keys.numel() == 0:
        return torch.zeros_like(query, dtype=torch.bool)
    pos = torch.searchsorted(label_set.keys, query).clamp_(max=label_set.keys.numel() - 1)
    return label_set.keys[pos] == query


def _discounts(k: int, device: torch.device) -> Tensor:
    """``1 / log2(j + 2)`` for ranks ``j = 0 .. k-1`` (float64)."""
    return 1.0 / torch.log2(torch.arange(k, device=device, dtype=torch.float64) + 2)


def _best_weights(label_set: _LabelSet, weights: Tensor, n: int, kmax: int) -> Tensor:
    """``[N, kmax]`` float64: each row's label weights sorted descending, zero-padded: the gains of the best
    possible ranking, for the normalizers of the propensity-scored metrics."""
    w = weights[label_set.labels]
    order = torch.argsort(w, descending=True, stable=True)
    order = order[torch.argsort(label_set.rows[order], stable=True)]  # grouped by row, heaviest first
    rows, w = label_set.rows[order], w[order]
    starts = torch.cumsum(label_set.counts, 0) - label_set.counts
    rank = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    keep = rank < kmax
    best = torch.zeros(n, kmax, dtype=torch.float64, device=weights.device)
    best[rows[keep], rank[keep]] = w[keep]
    return best


# --------------------------------------------------------------------------------------------------
# Per-row sums (what the streaming metrics accumulate)
# --------------------------------------------------------------------------------------------------
def _accuracy_counts(indices: Tensor, target: Tensor, ks: List[int],
                     ignore_index: Optional[int]) -> Tuple[Tensor, Tensor]:
    """``(correct [len(ks)] int64, rows int64)``."""
    indices = _check_indices(indices)
    if (not isinstance(target, Tensor) or target.dim() != 1 or target.dtype.is_floating_point
            or target.dtype == torch.bool):
        raise TypeError("hugehead.metrics: accuracy_at_k needs target as a 1-D integer tensor [N] of class ids")
    if target.shape[0] != indices.shape[0]:
        raise ValueError(f"hugehead.metrics: target has {target.shape[0]} rows but indices has {indices.shape[0]} rows")
    target = target.to(indices.device, torch.int64)
    match = indices[:, : max(ks)] == target[:, None]
    if ignore_index is not None:
        match = match[target != ignore_index]
    found = torch.cumsum(match, dim=1) > 0  # [i, j]: the target is within row i's first j + 1
    correct = torch.stack([found[:, k - 1].sum() for k in ks]).to(torch.int64)
    return correct, torch.tensor(match.shape[0], dtype=torch.int64, device=indices.device)


def _multilabel_sums(indices: Tensor, labels: Labels, ks: List[int], weights: Optional[Tensor] = None,
                     ) -> Dict[str, Tensor]:
    """Per-batch sums over rows, each ``[len(ks)]`` float64: ``hits`` (labels in the top k),
    ``ndcg`` (sum of per-row nDCG@k), and with ``weights [V]`` (inverse propensities) ``ps_gain`` /
    ``ps_best`` (weighted hits and their best achievable value) and ``ps_dcg`` / ``ps_idcg``."""
    indices = _check_indices(indices)
    n, kmax = indices.shape[0], max(ks)
    indices = indices[:, :kmax]
    label_set = _label_set(labels, n, indices.device, 1 + int(indices.max()) if indices.numel() else 1)
    hits = _hits(indices, label_set).double()
    disc = _discounts(kmax, indices.device)
    dcg = torch.cumsum(hits * disc, dim=1)
    ideal = torch.cumsum(disc, 0)  # ideal[j]: IDCG of a row with >= j + 1 labels at k = j + 1
    out = dict(hits=[], ndcg=[], ps_gain=[], ps_best=[], ps_dcg=[], ps_idcg=[])
    if weights is not None:
        if weights.dim() != 1:
            raise ValueError(f"hugehead.metrics: inv_propensity must be [V], got shape {tuple(weights.shape)}")
        top = max(int(label_set.labels.max()) if label_set.labels.numel() else -1,
                  int(indices.max()) if indices.numel() else -1)
        if top >= weights.shape[0]:
            raise ValueError(f"hugehead.metrics: class id {top} has no inverse propensity (inv_propensity has "
                             f"{weights.shape[0]} entries)")
        weights = weights.to(indices.device, torch.float64)
        gain = hits * weights[indices]
        best = _best_weights(label_set, weights, n, kmax)
        cum_gain, cum_best = torch.cumsum(gain, 1), torch.cumsum(best, 1)
        cum_dcg, cum_idcg = torch.cumsum(gain * disc, 1), torch.cumsum(best * disc, 1)
    for k in ks:
        out["hits"].append(hits[:, :k].sum())
        relevant = label_set.counts.clamp(max=k)
        idcg = ideal[(relevant - 1).clamp(min=0)]
        out["ndcg"].append(torch.where(relevant > 0, dcg[:, k - 1] / idcg, 0.0).sum())
        if weights is not None:
            out["ps_gain"].append(cum_gain[:, k - 1].sum())
            out["ps_best"].append(cum_best[:, k - 1].sum())
            out["ps_dcg"].append(cum_dcg[:, k - 1].sum())
            out["ps_idcg"].append(cum_idcg[:, k - 1].sum())
    return {name: torch.stack(v) for name, v in out.items() if v}


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
    ks = _check_ks(k, _check_indices(indices).shape[1])
    correct, rows = _accuracy_counts(indices, target, ks, ignore_index)
    return _result(correct.double() / rows.double(), k)


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
    ks = _check_ks(k, _check_indices(indices).shape[1])
    sums = _multilabel_sums(indices, labels, ks)
    denom = torch.tensor(ks, dtype=torch.float64, device=sums["hits"].device) * indices.shape[0]
    return _result(sums["hits"] / denom, k)


def ndcg_at_k(indices: Tensor, labels: Labels, k: Ks = 1) -> Tensor:
    """nDCG@k with binary gains: ``mean_i DCG@k_i / IDCG@k_i``, where ``DCG@k_i = Σ_{j<k} [idx_ij ∈ y_i] /
    log2(j + 2)`` and ``IDCG@k_i = Σ_{j < min(k, |y_i|)} 1 / log2(j + 2)`` (rows without labels score 0).

    Args, returns and raises: as :func:`precision_at_k`.
    """
    ks = _check_ks(k, _check_indices(indices).shape[1])
    return _result(_multilabel_sums(indices, labels, ks)["ndcg"] / indices.shape[0], k)


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
    ks = _check_ks(k, _check_indices(indices).shape[1])
    sums = _multilabel_sums(indices, labels, ks, inv_propensity)
    if normalize:
        return _result(sums["ps_gain"] / sums["ps_best"], k)
    denom = torch.tensor(ks, dtype=torch.float64, device=sums["ps_gain"].device) * indices.shape[0]
    return _result(sums["ps_gain"] / denom, k)


def psndcg_at_k(indices: Tensor, labels: Labels, inv_propensity: Tensor, k: Ks = 1) -> Tensor:
    """Propensity-scored nDCG@k as the Extreme Classification Repository (and pyxclib's ``psndcg``)
    report it: ``Σ_i PSDCG@k_i / Σ_i best PSDCG@k_i`` with ``PSDCG@k_i = Σ_{j<k} [idx_ij ∈ y_i] /
    (p_{idx_ij} log2(j + 2))`` and the best value from row i's labels sorted by ``1/p_l`` descending.

    Args, returns and raises: as :func:`psprecision_at_k` (always normalized).
    """
    ks = _check_ks(k, _check_indices(indices).shape[1])
    sums = _multilabel_sums(indices, labels, ks, inv_propensity)
    return _result(sums["ps_dcg"] / sums["ps_idcg"], k)


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
        cols = _label_set(labels, n, device).labels  # a label repeated in a row counts once
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
    """A metric at one ``k`` whose states are sums (``dist_reduce_fx="sum"``): ``update`` per batch, in any
    process, and ``compute`` gives the value over everything seen (torchmetrics syncs the sums across
    ranks when a process group is up)."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, k: int, **kwargs):
        if _Metric is None:
            raise ImportError(f"hugehead.metrics.{type(self).__name__} needs torchmetrics: pip install torchmetrics")
        super().__init__(**kwargs)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"hugehead.metrics: k must be a positive integer, got {k!r}")
        self.k = k

    def _sum_state(self, name: str, dtype: torch.dtype) -> None:
        self.add_state(name, torch.zeros((), dtype=dtype), dist_reduce_fx="sum")

    def extra_repr(self) -> str:
        return f"k={self.k}"


class AccuracyAtK(_MetricBase):
    """Streaming :func:`accuracy_at_k`: ``update(indices [N, K], target [N])``, ``compute()`` -> float64
    scalar (NaN before any counted row).

    In a LightningModule::

        self.acc1, self.acc5 = AccuracyAtK(1), AccuracyAtK(5)        # in __init__
        _, top = self.head.topk(features, 5)                          # in test_step
        self.acc1.update(top, target); self.acc5.update(top, target)
        self.log("test_acc@1", self.acc1); self.log("test_acc@5", self.acc5)
    """

    def __init__(self, k: int = 1, *, ignore_index: Optional[int] = None, **kwargs):
        super().__init__(k, **kwargs)
        self.ignore_index = ignore_index
        self._sum_state("correct", torch.int64)
        self._sum_state("total", torch.int64)

    def update(self, indices: Tensor, target: Tensor) -> None:
        ks = _check_ks(self.k, _check_indices(indices).shape[1])
        correct, rows = _accuracy_counts(indices, target, ks, self.ignore_index)
        self.correct += correct[0].to(self.correct.device)
        self.total += rows.to(self.total.device)

    def compute(self) -> Tensor:
        return self.correct.double() / self.total.double()


class _MultiLabelMetric(_MetricBase):
    """Shared ``update``: the batch's sums from :func:`_multilabel_sums` added to the states named by
    ``_sums`` (state name -> sum name)."""

    _sums: Dict[str, str] = {}

    def __init__(self, k: int, inv_propensity: Optional[Tensor] = None, **kwargs):
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
        self._sum_state("rows", torch.int64)

    def update(self, indices: Tensor, labels: Labels) -> None:
        ks = _check_ks(self.k, _check_indices(indices).shape[1])
        sums = _multilabel_sums(indices, labels, ks, self.inv_propensity)
        for state, name in self._sums.items():
            setattr(self, state, getattr(self, state) + sums[name][0].to(self.rows.device))
        self.rows += indices.shape[0]


class PrecisionAtK(_MultiLabelMetric):
    """Streaming :func:`precision_at_k`: ``update(indices [N, K], labels)``, ``compute()`` -> float64 scalar."""

    _sums = {"hits": "hits"}

    def __init__(self, k: int = 1, **kwargs):
        super().__init__(k, **kwargs)

    def compute(self) -> Tensor:
        return self.hits / (self.rows.double() * self.k)


class NDCGAtK(_MultiLabelMetric):
    """Streaming :func:`ndcg_at_k`: ``update(indices [N, K], labels)``, ``compute()`` -> float64 scalar."""

    _sums = {"ndcg": "ndcg"}

    def __init__(self, k: int = 1, **kwargs):
        super().__init__(k, **kwargs)

    def compute(self) -> Tensor:
        return self.ndcg / self.rows.double()


class PSPrecisionAtK(_MultiLabelMetric):
    """Streaming :func:`psprecision_at_k` (``normalize`` as there): ``PSPrecisionAtK(k, inv_propensity)``,
    ``update(indices [N, K], labels)``, ``compute()`` -> float64 scalar."""

    _sums = {"gain": "ps_gain", "best": "ps_best"}

    def __init__(self, k: int, inv_propensity: Tensor, *, normalize: bool = False, **kwargs):
        super().__init__(k, inv_propensity, **kwargs)
        self.normalize = normalize

    def compute(self) -> Tensor:
        return self.gain / self.best if self.normalize else self.gain / (self.rows.double() * self.k)


class PSNDCGAtK(_MultiLabelMetric):
    """Streaming :func:`psndcg_at_k`: ``PSNDCGAtK(k, inv_propensity)``, ``update(indices [N, K], labels)``,
    ``compute()`` -> float64 scalar."""

    _sums = {"dcg": "ps_dcg", "idcg": "ps_idcg"}

    def __init__(self, k: int, inv_propensity: Tensor, **kwargs):
        super().__init__(k, inv_propensity, **kwargs)

    def compute(self) -> Tensor:
        return self.dcg / self.idcg
