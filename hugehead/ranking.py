"""The counting kit behind :mod:`hugehead.metrics`: input checks, multi-label targets as a sorted label set,
hits of ``[N, k]`` predictions against it, and the per-batch sums every metric (function or streaming) is
computed from. The conventions (layouts, empty rows, float64) are those :mod:`hugehead.metrics` documents."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

Labels = Union[Tensor, Sequence[Tensor]]
Ks = Union[int, Sequence[int]]


# --------------------------------------------------------------------------------------------------
# Input checks and the label set
# --------------------------------------------------------------------------------------------------
def check_ks(k: Ks, width: float) -> List[int]:
    """``k`` (an int or a sequence of them) as a list, each in ``[1, width]``."""
    if isinstance(k, int) and not isinstance(k, bool):
        ks = [k]
    elif isinstance(k, (list, tuple, range)):
        ks = list(k)
    else:
        raise ValueError(f"hugehead.metrics: k must be a positive integer or a sequence of them, got {k!r}")
    if not ks:
        raise ValueError("hugehead.metrics: k must be a positive integer or a non-empty sequence of them")
    for kk in ks:
        if isinstance(kk, bool) or not isinstance(kk, int) or kk < 1:
            raise ValueError(f"hugehead.metrics: k must be a positive integer, got {kk!r}")
        if kk > width:
            raise ValueError(f"hugehead.metrics: k={kk} but indices has only {width} columns per row; "
                             f"ask the head for at least k={kk} (e.g. head.topk(x, {kk}))")
    return ks


def check_indices(indices: Tensor) -> Tensor:
    if not isinstance(indices, Tensor):
        raise TypeError(f"hugehead.metrics: indices must be a tensor, got {type(indices).__name__}")
    if indices.dim() != 2:
        raise ValueError(f"hugehead.metrics: indices must be [N, k], got shape {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"hugehead.metrics: indices must be an integer tensor, got {indices.dtype}")
    if indices.numel() and int(indices.min()) < 0:
        raise ValueError("hugehead.metrics: indices holds a negative class id")
    return indices.long()


def result_for(values: Tensor, k: Ks) -> Tensor:
    """``values [len(ks)]`` as the caller asked: a scalar for an int ``k``, the vector for a sequence."""
    return values[0] if isinstance(k, int) else values


class LabelSet(NamedTuple):
    """Multi-label targets of ``n`` rows as sorted unique keys ``row * stride + label`` (so membership of
    any ``(row, class)`` pair is one binary search), with each key's row and label and each row's count."""

    keys: Tensor    # [nnz] int64, ascending
    rows: Tensor    # [nnz] int64
    labels: Tensor  # [nnz] int64
    counts: Tensor  # [n] int64: labels per row
    stride: int


def label_pairs(labels: Labels, n: int, device: torch.device) -> Tuple[Tensor, Tensor]:
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


def make_label_set(labels: Labels, n: int, device: torch.device, min_stride: int = 1) -> LabelSet:
    rows, cols = label_pairs(labels, n, device)
    stride = max(min_stride, 1 + int(cols.max()) if cols.numel() else 1)
    keys = torch.unique(rows * stride + cols)  # sorted; duplicates count once
    rows, cols = keys // stride, keys % stride
    return LabelSet(keys, rows, cols, torch.bincount(rows, minlength=n), stride)


def hits_of(indices: Tensor, label_set: LabelSet) -> Tensor:
    """``[N, K]`` bool: whether ``indices[i, j]`` is one of row i's labels."""
    n = indices.shape[0]
    query = torch.arange(n, device=indices.device)[:, None] * label_set.stride + indices
    if label_set.keys.numel() == 0:
        return torch.zeros_like(query, dtype=torch.bool)
    pos = torch.searchsorted(label_set.keys, query).clamp_(max=label_set.keys.numel() - 1)
    return label_set.keys[pos] == query


def discounts(k: int, device: torch.device) -> Tensor:
    """``1 / log2(j + 2)`` for ranks ``j = 0 .. k-1`` (float64)."""
    return 1.0 / torch.log2(torch.arange(k, device=device, dtype=torch.float64) + 2)


def best_weights(label_set: LabelSet, weights: Tensor, n: int, kmax: int) -> Tensor:
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
def accuracy_counts(indices: Tensor, target: Tensor, ks: List[int],
                     ignore_index: Optional[int]) -> Tuple[Tensor, Tensor]:
    """``(correct [len(ks)] int64, rows int64)``."""
    indices = check_indices(indices)
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


def multilabel_sums(indices: Tensor, labels: Labels, ks: List[int], weights: Optional[Tensor] = None,
                     ) -> Dict[str, Tensor]:
    """Per-batch sums over rows, each ``[len(ks)]`` float64: ``hits`` (labels in the top k),
    ``ndcg`` (sum of per-row nDCG@k), and with ``weights [V]`` (inverse propensities) ``ps_gain`` /
    ``ps_best`` (weighted hits and their best achievable value) and ``ps_dcg`` / ``ps_idcg``."""
    indices = check_indices(indices)
    n, kmax = indices.shape[0], max(ks)
    indices = indices[:, :kmax]
    label_set = make_label_set(labels, n, indices.device, 1 + int(indices.max()) if indices.numel() else 1)
    hits = hits_of(indices, label_set).double()
    disc = discounts(kmax, indices.device)
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
        best = best_weights(label_set, weights, n, kmax)
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
