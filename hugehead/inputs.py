"""The loss's front door: what :func:`hugehead.linear_cross_entropy` and ``ChunkedClassifier.forward`` do to
``x`` and ``target`` before any loss runs — check them, flatten ``[..., D]`` rows to ``[N, D]``, cast ``x``
to the compute dtype, check the class ids — and the shape the per-row results view back to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from .dtensor import is_dtensor
from .options import LossOptions, check_target_tensor, check_targets
from .sparse import is_sparse_target

__all__ = ["Prepared", "prepare_inputs"]


@dataclass(frozen=True)
class Prepared:
    """A loss's checked inputs. ``x``: ``[N, D]`` in the compute dtype (a differentiable cast; a DTensor ``x``
    as given: its rows are the mesh's). ``target``: ``[N]`` int64 class ids, contiguous, or the sparse
    ``[N, V]`` target as given. ``shape``: the rows' leading shape, which ``"none"`` losses and the lse take
    back (:meth:`restore`; None where they are ``[N]`` already: a sparse target, or a DTensor ``x``, whose rows
    are this rank's). ``compute``: the autocast dtype, or None where the inputs' dtype decides."""

    x: Tensor
    target: Tensor
    shape: Optional[Tuple[int, ...]]
    compute: Optional[torch.dtype]
    sparse: bool

    def restore(self, loss: Tensor, lse: Optional[Tensor], reduction: str,
                return_lse: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """``loss`` (and, with ``return_lse``, ``lse``) viewed back to the rows' shape."""
        if self.shape is None:
            return (loss, lse) if return_lse else loss
        if reduction == "none":
            loss = loss.view(self.shape)
        return (loss, lse.view(self.shape)) if return_lse else loss


def prepare_inputs(x: Tensor, target, options: LossOptions, check_x: Callable[[Tensor], Optional[torch.dtype]],
                   num_classes: Optional[int] = None) -> Prepared:
    """Check and shape one loss call's ``x [..., D]`` and ``target`` (``[...]`` class ids, or a sparse ``[N, V]``
    target, which takes ``x [N, D]``).

    ``check_x(x)`` checks ``x`` against the parameters (the function's weight and bias, or the head) and returns
    the compute dtype (None: the inputs' dtype). ``num_classes``: range-check the class ids against it here (the
    step's one host synchronization); None where the op checks them itself.

    Raises:
        TypeError, ValueError: as ``check_x``, :func:`hugehead.options.check_target_tensor` and
            :func:`hugehead.options.check_targets`; a sparse target beside an ``x`` that is not ``[N, D]``.
    """
    sparse = is_sparse_target(target)
    if sparse and isinstance(x, Tensor) and x.dim() != 2:
        raise ValueError(f"hugehead: with a sparse [N, V] target x must be [N, D], got shape {tuple(x.shape)}")
    compute = check_x(x)
    if sparse:
        return Prepared(_cast(x, compute), target, None, compute, True)
    shape = tuple(x.shape[:-1])
    if is_dtensor(x) or is_dtensor(target):  # rows and targets as the mesh holds them (hugehead.dtensor)
        check_target_tensor(target, x)
        return Prepared(x, target, None, compute, False)
    target = check_target_tensor(target, x)
    x = _cast(x.reshape(-1, x.shape[-1]), compute)
    if num_classes is not None:
        target = check_targets(target, num_classes, options.ignore_index)
    return Prepared(x, target, shape, compute, False)


def _cast(x: Tensor, compute: Optional[torch.dtype]) -> Tensor:
    # Differentiable: x.grad comes back in x's own dtype.
    return x if compute is None or x.dtype == compute else x.to(compute)
