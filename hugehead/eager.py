"""Eager twins of registered ops: a registered op's Python body and autograd as a plain
``torch.autograd.Function``, and the rule for when an eager call may take it instead of the op."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import tuning

__all__ = ["eager_twin", "eager_dispatch"]


def eager_twin(name: str, impl, setup_context, backward) -> type:
    """A ``torch.autograd.Function`` over a registered op's Python body ``impl`` with the op's own autograd
    (``setup_context(ctx, inputs, output)``, ``backward(ctx, *grads)``; ``ctx.eager`` is True there): what an
    eager call runs in place of the op (:func:`eager_dispatch`). Same body, same kernels, same bits; without
    the dispatcher's Python layers around a custom op (its autograd wrapper, redispatch, the alias check,
    dynamo's disable wrapper, the ADInplaceOrView step), which an eager step pays before its first kernel
    while the GPU waits (``tools/profile_step.py --trace`` shows that host time between launches)."""
    # The old form (forward takes ctx): a Function with a setup_context staticmethod binds its arguments
    # through inspect.signature at every apply (~75 us on a 2-core VM).
    def forward(ctx, *inputs):
        output = impl(*inputs)
        ctx.eager = True
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "__doc__": f"The eager twin of {impl.__name__} (see :func:`eager_twin`).",
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    })


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def eager_dispatch(*tensors: Optional[Tensor]) -> bool:
    """Whether a call on ``tensors`` may run a registered op's :func:`eager_twin` instead of the op: eager (not
    traced by torch.compile), plain tensors only (no subclass: fake, functional or DTensor ones take the op),
    no torch-function or dispatch mode and no functorch transform active, and ``hugehead.tuning``'s ``eager_op``
    (``False`` sends every call through the dispatcher)."""
    if torch.compiler.is_compiling():
        return False
    if any(t is not None and type(t) not in _PLAIN_TENSORS for t in tensors):
        return False
    if (torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    return tuning.current().eager_op
