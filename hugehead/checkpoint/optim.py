"""Optimizer state on each parameter's device: Lightning and ``optimizer_to(device)`` move it to one
root device; a shard on another device then steps with misplaced state."""
from __future__ import annotations

import torch
from torch import Tensor

def place_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Move every state tensor of ``optimizer`` to its parameter's device, in place.

    Lightning restores optimizer state onto its root device and moves it to the CPU after ``fit``; a
    shard on ``cuda:1`` then has its Adam moments on ``cuda:0`` and a fused or foreach step fails. This
    undoes that. The scalar ``step`` follows PyTorch's own rule (``Optimizer.load_state_dict``): moved to
    the parameter's device in groups with ``fused`` or ``capturable``, else left where it is (the CPU,
    where Lightning leaves it too). Dtypes are never changed.

    Returns:
        The number of tensors moved (0 when everything already was in place).
    """
    moved = 0
    for group in optimizer.param_groups:
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not isinstance(state, dict):
                continue
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    continue
                if key == "step" and not step_on_device:
                    continue
                if value.device != param.device:
                    state[key] = value.to(param.device)
                    moved += 1
    return moved


def _place_before_step(optimizer, args, kwargs):
    place_optimizer_state(optimizer)


def keep_optimizer_state_on_shards(optimizer: torch.optim.Optimizer):
    """Place ``optimizer``'s state now (:func:`place_optimizer_state`) and again before every ``step()``
    (a step pre-hook), so whatever moved it in between — a Lightning restore or teardown, a user's
    ``optimizer_to(device)`` — the step finds each shard's state on that shard's device. The check
    costs a loop over the state's tensors per step; nothing moves when all is in place.

    Idempotent per optimizer. Returns the hook's handle (``.remove()`` stops it).
    """
    place_optimizer_state(optimizer)
    handle = getattr(optimizer, "_hugehead_placement_hook", None)
    if handle is None or handle.id not in optimizer._optimizer_step_pre_hooks:
        handle = optimizer.register_step_pre_hook(_place_before_step)
        optimizer._hugehead_placement_hook = handle
    return handle



# Per-parameter state tensors of the same size as the parameter that torch's optimizers keep, for a
# parameter that has no state yet (before the first step).
_MOMENTS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Adagrad": 1, "Rprop": 2,
            "ASGD": 1}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``optimizer``'s state tensors: those it holds, and for a parameter without state yet (no
    step taken) what torch's optimizers allocate at the first step (Adam: two moments of the
    parameter's size; SGD: one with momentum; an unknown optimizer: two)."""
    total = 0
    for group in optimizer.param_groups:
        name = type(optimizer).__name__
        if name == "SGD":
            moments = int(bool(group.get("momentum", 0)))
        elif name == "RMSprop":
            moments = 1 + int(bool(group.get("momentum", 0))) + int(bool(group.get("centered", False)))
        else:
            moments = _MOMENTS.get(name, 2) + int(bool(group.get("amsgrad", False)))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))
            else:
                total += moments * param.numel() * param.element_size()
    return total
