"""Batch prediction: rank every row of a ``DataLoader`` against all classes with a head's streaming top-k,
one batch at a time, and hand the results back on the host in ``[rows, k]`` chunks.

It sits above the head (``ChunkedClassifier.topk``) and the functional top-k, and below the examples and
integrations: it owns only the dataset loop (batch -> features -> top-k -> host), so every placement, and
any ranking callable, gets the same loop.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .topk import linear_topk

__all__ = ["TopK", "predict_topk", "predict_topk_chunks"]

Ranker = Union["torch.nn.Module", Tensor, Tuple[Tensor, ...], Callable[[Tensor, int], Tuple[Tensor, Tensor]]]


class TopK(NamedTuple):
    """Top-k predictions of some rows: ``values [rows, k]`` (the head's output dtype), ``indices [rows, k]``
    int64 class ids, best first (ties to the lower class id), and ``target``: the batches' targets as the
    loader gave them (moved to the output device), or None when the batches carry none."""

    values: Tensor
    indices: Tensor
    target: Any = None


def _split_batch(batch: Any) -> Tuple[Any, Any]:
    """``(features, target)`` of a batch by the usual layouts: a tensor (features only), a tuple/list
    ``(features, target, ...)``, or a mapping with ``"features"`` (and ``"target"``)."""
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0], _default_target(batch)
    if isinstance(batch, Mapping) and "features" in batch:
        return batch["features"], _default_target(batch)
    raise TypeError(
        f"hugehead.predict: cannot find the features in a batch of type {type(batch).__name__}; pass "
        "features=lambda batch: ... (and target=...) to say where they are")


def _default_target(batch: Any) -> Any:
    """The target of a batch in the layouts of :func:`_split_batch`, or None."""
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        return batch[1]
    return batch.get("target") if isinstance(batch, Mapping) else None


def _to(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors of a target (a tensor, sparse or dense, or a list/tuple of them) moved to ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device, non_blocking) for o in obj)
    return obj


def _ranker(model: Ranker, softcap: Optional[float], chunk_size: Optional[int], memory_budget: Optional[int],
            ) -> Tuple[Callable[[Tensor, int], Tuple[Tensor, Tensor]], Optional[torch.device], Optional[torch.dtype]]:
    """``(rank(x, k) -> (values, indices), default device, dtype that x must have or None)``."""
    weight_options = dict(softcap=softcap, chunk_size=chunk_size, memory_budget=memory_budget)
    if isinstance(model, torch.nn.Linear):
        model = (model.weight, model.bias)
    if isinstance(model, Tensor) or (isinstance(model, tuple) and model and isinstance(model[0], Tensor)):
        if isinstance(model, tuple) and len(model) > 2:
            raise TypeError("hugehead.predict: a plain head is weight or (weight, bias), got a tuple of "
                            f"{len(model)} items")
        weight, bias = (model, None) if isinstance(model, Tensor) else (model[0], model[1] if len(model) > 1 else None)
        return (lambda x, k: linear_topk(x, weight, k, bias, **weight_options)), weight.device, weight.dtype
    if any(v is not None for v in weight_options.values()):
        raise TypeError("hugehead.predict: softcap, chunk_size and memory_budget apply to a plain (weight, bias) "
                        "head; a ChunkedClassifier or a callable carries its own")
    topk = getattr(model, "topk", None)
    if callable(topk):  # a ChunkedClassifier, or anything with its topk(x, k)
        shards = getattr(model, "shards", None)
        device = shards[0].compute_device if shards else None
        return topk, device, getattr(model, "dtype", None)
    if callable(model):
        return model, None, None
    raise TypeError(
        "hugehead.predict: model must be a ChunkedClassifier (or any object with topk(x, k)), a weight tensor "
        f"or (weight, bias), or a callable (x, k) -> (values, indices); got {type(model).__name__}")


def predict_topk_chunks(
    model: Ranker,
    loader: Iterable,
    k: int,
    *,
    features: Optional[Callable[[Any], Tensor]] = None,
    target: Optional[Callable[[Any], Any]] = None,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    autocast: Optional[torch.dtype] = None,
    out_device: Union[str, torch.device] = "cpu",
    progress: bool = True,
    desc: str = "top-k",
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Iterator[TopK]:
    """Rank every row of ``loader`` against all classes: one :class:`TopK` of ``[rows, k]`` per batch, on
    ``out_device`` (the host by default), in the loader's order.

    Only one batch's top-k runs at a time (the head streams its classes in chunks: no ``[rows, V]``
    logits); while the caller holds chunk ``i``, batch ``i + 1`` is already queued on the device and chunk
    ``i``'s copy to pinned host memory ran behind it, so the device does not wait for the host.

    Args:
        model: a :class:`hugehead.ChunkedClassifier` in any placement (devices, offload, distributed), or
            any object with ``topk(x, k) -> (values, indices)``; a plain weight ``[V, D]``, ``(weight,
            bias)`` or an ``nn.Linear`` (ranked by :func:`hugehead.linear_topk`, which gets ``softcap``,
            ``chunk_size`` and ``memory_budget``); or a callable ``(x [rows, D], k) -> (values, indices)``. A distributed head is
            collective: every rank must iterate over the same number of batches.
        loader: any iterable of batches (a ``DataLoader``): tensors of features, ``(features, target,
            ...)`` tuples, or mappings with ``"features"`` (and ``"target"``).
        k: classes per row.
        features: ``batch -> [rows, D]`` features (e.g. running a backbone) when the batch is not one of
            the layouts above; it sees the batch as the loader yields it.
        target: ``batch -> target`` to carry along in each chunk (default: the layouts' target, or None).
        device: where the features go (default: the head's first shard's compute device, a plain weight's
            device, or the features' own device for a callable).
        dtype: cast the features to it (default: the head's or weight's dtype, unless ``autocast`` is set).
        autocast: run ``features`` and each top-k under ``torch.autocast(device.type, dtype=autocast)``
            (float32 parameters, 16-bit compute).
        out_device: where the chunks go. progress, desc: a tqdm progress bar over the batches.
    Yields:
        :class:`TopK` per batch: ``values [rows, k]``, ``indices [rows, k]`` int64, the batch's target.
    Raises:
        TypeError: an unknown model kind, a batch without recognisable features, softcap/chunk options with
            a ChunkedClassifier; the head's own errors (bad k, D mismatch) on the first batch.
    """
    from tqdm.auto import tqdm

    rank, default_device, head_dtype = _ranker(model, softcap, chunk_size, memory_budget)
    device = torch.device(device) if device is not None else default_device
    if dtype is None and autocast is None:
        dtype = head_dtype
    out_device = torch.device(out_device)
    try:
        total = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    bar = tqdm(loader, total=total, desc=desc, unit="batch", disable=not progress, dynamic_ncols=True)
    pending: Optional[Tuple[TopK, Optional[torch.cuda.Event]]] = None
    rows = 0
    try:
        for batch in bar:
            # Under autocast (if asked) from the features on: a features function running a backbone
            # computes in the same precision as the head.
            with torch.no_grad(), _autocast(autocast, device):
                if features is None:
                    x, batch_target = _split_batch(batch)
                else:
                    x, batch_target = features(batch), _default_target(batch)
                if target is not None:
                    batch_target = target(batch)
                if not isinstance(x, Tensor):
                    raise TypeError(f"hugehead.predict: features must be a tensor, got {type(x).__name__}")
                x = x.to(device or x.device, dtype=dtype) if dtype is not None else x.to(device or x.device)
                values, indices = rank(x, k)
            chunk = _to_out(TopK(values, indices, batch_target), out_device)
            rows += values.shape[0]
            bar.set_postfix(rows=rows, refresh=False)
            if pending is not None:
                yield _ready(pending)
            pending = chunk
        if pending is not None:
            yield _ready(pending)
    finally:
        bar.close()


def _autocast(dtype: Optional[torch.dtype], device: Optional[torch.device]) -> contextlib.ExitStack:
    """``torch.autocast`` to ``dtype`` on ``device``'s type (on the CPU and, where there is one, CUDA when
    the device is not known before the features are); nothing for ``dtype=None``."""
    stack = contextlib.ExitStack()
    if dtype is not None:
        types = [device.type] if device is not None else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device_type in types:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
    return stack


def _to_out(chunk: TopK, out_device: torch.device) -> Tuple[TopK, Optional[torch.cuda.Event]]:
    """Start copying ``chunk`` to ``out_device``; from a GPU to the host the copy goes into pinned memory
    on the current stream (behind the top-k that produced it) and an event marks its end."""
    values, indices = chunk.values, chunk.indices
    if values.device.type == "cuda" and out_device.type == "cpu":
        host_values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host_indices = torch.empty(indices.shape, dtype=indices.dtype, pin_memory=True)
        host_values.copy_(values, non_blocking=True)
        host_indices.copy_(indices, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(values.device))
        return TopK(host_values, host_indices, _to(chunk.target, out_device)), done
    return TopK(values.to(out_device), indices.to(out_device), _to(chunk.target, out_device)), None


def _ready(pending: Tuple[TopK, Optional[torch.cuda.Event]]) -> TopK:
    chunk, done = pending
    if done is not None:
        done.synchronize()
    return chunk


def _cat_targets(targets: List[Any]) -> Any:
    """One target from the chunks' targets: dense or sparse tensors concatenated along rows, sequences
    (e.g. lists of label-id tensors) joined, None if none; otherwise the list of the batches' targets."""
    if all(t is None for t in targets):
        return None
    if all(isinstance(t, Tensor) for t in targets):
        if all(t.layout == torch.strided for t in targets):
            return torch.cat(targets)
        if all(t.layout == torch.sparse_csr for t in targets):
            return torch.cat([t.to_sparse_coo() for t in targets]).to_sparse_csr()
        return torch.cat([t.to_sparse_coo() if t.layout != torch.sparse_coo else t for t in targets])
    if all(isinstance(t, (list, tuple)) for t in targets):
        return [item for t in targets for item in t]
    return targets


def predict_topk(model: Ranker, loader: Iterable, k: int, **kwargs) -> TopK:
    """:func:`predict_topk_chunks` concatenated: one :class:`TopK` with ``values [N, k]``, ``indices [N,
    k]`` over every row of ``loader`` and the targets joined (tensors concatenated, lists of label tensors
    joined). Same arguments and errors; the results of all rows are held on ``out_device``.
    """
    chunks = list(predict_topk_chunks(model, loader, k, **kwargs))
    if not chunks:
        raise ValueError("hugehead.predict: the loader yielded no batches")
    return TopK(torch.cat([c.values for c in chunks]), torch.cat([c.indices for c in chunks]),
                _cat_targets([c.target for c in chunks]))
