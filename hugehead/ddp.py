"""DistributedDataParallel with heads that span its ranks (``ChunkedClassifier(process_group=...)``):
DDP must leave those heads' Parameters alone (each rank holds other classes, and their gradients are
already those of the mean of the ranks' losses)."""
from __future__ import annotations

from typing import List

from torch import nn

__all__ = ["ignore_heads_in_ddp", "distributed_head_parameter_names"]


def distributed_head_parameter_names(model: nn.Module) -> List[str]:
    """Fully qualified names of the Parameters of every head in ``model`` that spans ranks."""
    names = []
    for prefix, module in model.named_modules():
        engine = getattr(module, "engine", None)
        if engine is not None and callable(getattr(engine, "checkpoint_group", None)) \
                and engine.checkpoint_group() is not None:
            names += [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters()]
    return names


def _distributed_head_buffer_names(model: nn.Module) -> List[str]:
    """Fully qualified names of the buffers (``class_weight``, ``pos_weight``) of every head that spans ranks."""
    names = []
    for prefix, module in model.named_modules():
        engine = getattr(module, "engine", None)
        if engine is not None and callable(getattr(engine, "checkpoint_group", None)) \
                and engine.checkpoint_group() is not None:
            names += [f"{prefix}.{n}" if prefix else n for n, _ in module.named_buffers()]
    return names


def ignore_heads_in_ddp(model: nn.Module) -> List[str]:
    """Make ``DistributedDataParallel(model)`` leave the Parameters of ``model``'s distributed heads
    alone: no broadcast from rank 0 at construction (each rank holds other classes) and no gradient
    all-reduce (the head's gradients are already those of the mean of the ranks' losses). Call it before
    wrapping ``model`` (with Lightning: in ``__init__`` or ``configure_model`` of the LightningModule).
    Their buffers (``class_weight`` / ``pos_weight``: the same ``[V]`` tensor on every rank) are ignored
    too, so DDP does not broadcast them at every forward.

    Returns:
        The names now ignored (added to any names ignored before).
    """
    from torch.nn.parallel import DistributedDataParallel

    names = distributed_head_parameter_names(model) + _distributed_head_buffer_names(model)
    before = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    ignored = before + [n for n in names if n not in before]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return ignored
