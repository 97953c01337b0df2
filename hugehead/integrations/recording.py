"""What :func:`hugehead.integrations.transformers.patch` learns from one forward of the model: hooks on the
head module record its input and hand back a small placeholder instead of ``[..., V]`` logits; what the
forward did to the placeholder is read back as a softcap or constant scale (causal LMs) or a selection of
rows (sequence classifiers), and anything else is refused."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch import Tensor, nn

__all__ = ["Recorder", "causal_placeholder", "row_placeholder", "logit_scale", "pooled_rows"]

# Values the causal-LM placeholder carries through the forward: two of opposite sign and different
# magnitude tell a softcap (non-linear) from a scale (linear) and from the identity.
_CAUSAL_PROBE = (3.0, -7.0)


class Recorder:
    """Hooks on the head module for the duration of one forward: record its input, hand the module an
    empty slice of it (so nothing ``[..., V]`` is computed) and return ``placeholder(x)`` in its place."""

    def __init__(self, module: nn.Module, placeholder: Callable[[Tensor], Tensor], who: str,
                 owner: Optional[nn.Module] = None, name: Optional[str] = None):
        self.module, self.placeholder, self.who = module, placeholder, who
        self.owner, self.name = owner, name  # where the model holds the head (owner.<name>)
        self.inputs: List[Tensor] = []

    def __enter__(self):
        self.handles = []
        if _is_fsdp2_unit(self.module) and self.owner is not None:
            # FSDP2's own pre-forward hook (always first) would all-gather the head's weight for the call;
            # the forward calls a stand-in instead, so the weight stays the Shard(0) DTensor hugehead uses.
            setattr(self.owner, self.name, _StandIn(self))
            return self
        self.handles = [
            self.module.register_forward_pre_hook(self._before, with_kwargs=True),
            self.module.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        if not self.handles and self.owner is not None:
            setattr(self.owner, self.name, self.module)
        return False

    def _before(self, module, args, kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], Tensor) or args[0].dim() < 2:
            raise NotImplementedError(
                f"hugehead: {self.who} calls its head with something other than one [..., D] tensor; "
                f"patch() cannot take the head's input from it"
            )
        if self.inputs:
            raise NotImplementedError(f"hugehead: {self.who} calls its head more than once in one forward")
        x = args[0]
        self.inputs.append(x)
        return (x.narrow(-2, 0, 0),), {}

    def _after(self, module, args, kwargs, output):
        return self.placeholder(self.inputs[-1])

    def input(self) -> Tensor:
        if len(self.inputs) != 1:
            raise NotImplementedError(f"hugehead: {self.who}'s forward never called its head")
        return self.inputs[0]


def _is_fsdp2_unit(module: nn.Module) -> bool:
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    return fsdp is not None and isinstance(module, fsdp)


class _StandIn(nn.Module):
    """What the forward calls in place of an FSDP2-sharded head while a :class:`Recorder` records."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.__dict__["recorder"] = recorder  # not a submodule: the head's Parameters stay out of it

    def forward(self, *args, **kwargs):
        recorder = self.recorder
        recorder._before(recorder.module, args, kwargs)
        return recorder._after(recorder.module, args, kwargs, None)


def causal_placeholder(x: Tensor) -> Tensor:
    # float64: a scale the forward applies (Granite) is read back to full precision.
    probe = torch.tensor(_CAUSAL_PROBE, dtype=torch.float64, device=x.device)
    return probe.expand(*x.shape[:-1], 2).contiguous()


def row_placeholder(x: Tensor) -> Tensor:
    # Row r of x (flattened) becomes (r + 1, (r + 1)^2): a selection of rows keeps every pair exact, while
    # averaging rows or transforming values breaks "second == first^2" (Jensen) or integrality.
    ids = torch.arange(1, x[..., 0].numel() + 1, dtype=torch.float64, device=x.device)
    return torch.stack([ids, ids * ids], dim=-1).reshape(*x.shape[:-1], 2)


def logit_scale(seen: Any, x: Tensor, softcap: Optional[float], who: str) -> float:
    """The constant the forward multiplies lm_head's output by (1.0 when none), after checking that the
    forward did only that, or only the config's softcap, to the placeholder."""
    if not isinstance(seen, Tensor) or tuple(seen.shape) != (*x.shape[:-1], 2):
        raise NotImplementedError(
            f"hugehead: {who}'s forward reshapes or drops lm_head's output (logits of shape "
            f"{tuple(seen.shape) if isinstance(seen, Tensor) else None} for hidden states {tuple(x.shape)}); "
            f"patch() cannot reproduce its loss"
        )
    if seen.numel() == 0:
        return 1.0
    seen = seen.reshape(-1, 2)[0].detach().double().cpu()
    probe = torch.tensor(_CAUSAL_PROBE, dtype=torch.float64)
    expected = probe if softcap is None else softcap * torch.tanh(probe / softcap)
    if torch.allclose(seen, expected, rtol=1e-5, atol=0.0):
        return 1.0
    ratio = seen / probe
    if softcap is None and float(ratio[0]) > 0 and torch.allclose(ratio[0], ratio[1], rtol=1e-9, atol=0.0):
        return float(ratio[0])
    raise NotImplementedError(
        f"hugehead: {who}'s forward maps lm_head's outputs {probe.tolist()} to {seen.tolist()}; hugehead "
        f"reproduces the config's final_logit_softcapping (here {softcap}) or a constant scale, not this"
    )


def pooled_rows(seen: Any, x: Tensor, who: str) -> Tensor:
    """The rows of ``x`` the forward selected from the row placeholder, ``[M, D]`` in the order of its
    output (``M`` = the output's leading elements)."""
    n = x[..., 0].numel()
    if not isinstance(seen, Tensor) or seen.dtype != torch.float64 or seen.dim() < 1 or seen.shape[-1] != 2:
        raise NotImplementedError(
            f"hugehead: {who}'s forward changes the head's output beyond selecting rows of it; patch() cannot "
            f"reproduce its loss"
        )
    ids, squares = seen.reshape(-1, 2).unbind(1)
    exact = (ids == ids.round()) & (ids >= 1) & (ids <= n) & (squares == ids * ids)
    if not bool(exact.all()):
        raise NotImplementedError(
            f"hugehead: {who}'s forward combines or transforms the head's outputs (it does more than select "
            f"one row per example); patch() cannot reproduce its loss"
        )
    return x.reshape(n, x.shape[-1]).index_select(0, ids.long().sub_(1).to(x.device))
