"""The memory budget of a step's loops: one rule, per device, offload included.

The rule (:func:`resolve_budget`): ``memory_budget`` when given, else 4 GiB bounded by what the
device has: a quarter of a CUDA device's free memory, a quarter of the host's available memory
(``MemAvailable``, capped by the memory cgroup) on the CPU. An offloaded shard that may keep its logits
gets half its GPU's free memory instead (the weight is not there, and a copy-bound forward leaves time
to spare). The budget is per device: the shards computing on one device share it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Hashable, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch

from . import pinned

__all__ = ["DEFAULT_MEMORY_BUDGET", "Budget", "free_memory", "resolve_budget", "device_budgets", "shard_oom_guard"]

DEFAULT_MEMORY_BUDGET = 4 << 30
# Fraction of a device's free (CUDA) or available (host) memory the default budget may take.
_FREE_FRACTION = 4


class Budget(NamedTuple):
    """Bytes of workspace a shard's loop may use, and why (for the plan and the out-of-memory message)."""

    bytes: int
    reason: str


@torch.compiler.assume_constant_result
def _cuda_free(index: int) -> int:
    return int(torch.cuda.mem_get_info(index)[0])


@torch.compiler.assume_constant_result
def _host_available() -> int:
    available = pinned.available_host_memory()
    return -1 if available is None else int(available)


# -- host work: cudaMemGetInfo is a driver call in every default-budget loss call, seen taking
# ~8 ms a call on a CUDA 13.0 / driver 580 machine (sglang#25225; ~5-10 us elsewhere). The default budget
# reads it only below 4 x 4 GiB free, so a CUDA answer of at least exact_below bytes is reused for up to
# _FREE_REUSE_S seconds; a smaller one is asked again every call.
_FREE_REUSE_S = 1.0
_FREE_SEEN: Dict[int, Tuple[float, int]] = {}  # CUDA device index -> (time.monotonic() of the query, bytes free)


def free_memory(device: torch.device, exact_below: Optional[int] = None) -> Optional[int]:
    """Bytes free on a CUDA device, or available to this process on the host; None when unknown (other
    device types). The one memory query of the planner (tests replace it). Under ``torch.compile`` the
    answer is taken once, at trace time, as a constant. ``exact_below``: the caller needs the figure exactly
    only below this many bytes; a CUDA answer at least that large from the last :data:`_FREE_REUSE_S`
    seconds is returned again instead of asking the driver."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if exact_below is None or torch.compiler.is_compiling():
            return _cuda_free(index)
        now = time.monotonic()
        seen = _FREE_SEEN.get(index)
        if seen is not None and seen[1] >= exact_below and now - seen[0] <= _FREE_REUSE_S:
            return seen[1]
        free = _cuda_free(index)
        _FREE_SEEN[index] = (now, free)
        return free
    if device.type == "cpu":
        available = _host_available()
        return None if available < 0 else available
    return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def resolve_budget(memory_budget: Optional[int], device: torch.device, *, shards_on_device: int = 1,
                   streamed_keep: bool = False) -> Budget:
    """The budget of one shard's loop on ``device`` (see the module docstring for the rule).

    Args:
        memory_budget: bytes for the device, or None for the default.
        shards_on_device: shards computing on ``device`` in this step; they share its budget equally.
        streamed_keep: the shard is offloaded (weight in host memory) and may keep its logits.
    """
    shards = max(1, int(shards_on_device))
    share = "" if shards == 1 else f", shared by {shards} shards on {device}"
    if memory_budget is not None:
        total = int(memory_budget)
        return Budget(max(1, total // shards), f"memory_budget={total} bytes (given){share}")
    # The default is its 4 GiB cap from 4 x 4 GiB free on: the figure matters exactly only below (twice that,
    # for what other processes may have taken since); the offload default halves any figure.
    free = free_memory(device) if streamed_keep else free_memory(
        device, exact_below=2 * _FREE_FRACTION * DEFAULT_MEMORY_BUDGET)
    if free is None:
        total, why = DEFAULT_MEMORY_BUDGET, f"the default {_gib(DEFAULT_MEMORY_BUDGET)}"
    elif streamed_keep and device.type == "cuda":
        total = free // 2
        why = f"the offload default: half of {device}'s {_gib(free)} free"
    else:
        total = min(DEFAULT_MEMORY_BUDGET, free // _FREE_FRACTION)
        what = "free" if device.type == "cuda" else "available"
        why = f"the default: min(4 GiB, 1/{_FREE_FRACTION} of {device}'s {_gib(free)} {what})"
    total = max(1, int(total))
    return Budget(max(1, total // shards), f"memory_budget=None, {total} bytes ({why}){share}")


def device_budgets(memory_budget: Optional[int], devices: Sequence[Hashable], *, streamed_keep: bool = False
                   ) -> Dict[Hashable, Budget]:
    """One :class:`Budget` per shard's compute device (``devices``: one entry per shard, repeats for shards
    that share a device): each device's budget split among its shards. Asked once per step."""
    counts: Dict[Hashable, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    return {device: resolve_budget(memory_budget, device, shards_on_device=n, streamed_keep=streamed_keep)
            for device, n in counts.items()}


# --------------------------------------------------------------------------------------------------
# Out of memory
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def shard_oom_guard(index: int, start: int, stop: int, device: torch.device, plan,
                    memory_budget: Optional[int] = None) -> Iterator[None]:
    """Turn an out-of-memory error inside a shard's chunk loop into one that names the shard, its device,
    the plan and the budget it was made within, and suggests ``memory_budget``. The original exception
    (and with it the frames that hold the loop's workspaces) is dropped before the new one is raised, so
    the memory is free for the next step.

    ``memory_budget``: what the caller passed, for a plan-less failure (None: the default)."""
    message = None
    try:
        yield
    except torch.OutOfMemoryError as exc:
        message = str(exc).splitlines()[0] if str(exc) else "out of memory"
    if message is not None:
        if plan is not None and plan.budget_reason:
            budget = plan.budget_reason
        else:
            budget = "None (the default)" if memory_budget is None else f"{memory_budget} bytes"
            budget = f"memory_budget={budget}"
        workspace = "" if plan is None else (
            f" (workspace {plan.rows} rows x {plan.cols} classes{', logits kept' if plan.keep_logits else ''})")
        raise torch.OutOfMemoryError(
            f"hugehead: out of memory in shard {index} (classes [{start}, {stop})) on {device}{workspace} "
            f"with {budget}; pass a smaller memory_budget= (or chunk_size=) to "
            f"ChunkedClassifier / linear_cross_entropy, or free memory on {device}. Cause: {message}"
        )
