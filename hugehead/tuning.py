"""The few knobs of hugehead that remain: one frozen :class:`Tuning`, read once from the environment.

Every other choice is the planner's (``hugehead.plan``) or a measured default. What is here selects a path a
user or a benchmark needs to force: the cuBLAS fallback of the fused GEMMs, the rows plan, and the eager twin of
the registered ops. Library code calls :func:`current`; tests and A/B runs change it with :func:`override`,
never through the environment, so a value cannot change in the middle of a step.
"""
import contextlib
import dataclasses
import os
import threading
from typing import Iterator, Mapping, Optional

__all__ = ["Tuning", "current", "override", "from_environment"]

_GEMM_PATHS = ("cutlass", "cublas")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """``gemm``: ``"cutlass"`` runs the fused sm_90a GEMMs where they apply (the default, every chunk they
    take), ``"cublas"`` the ATen GEMMs and the separate statistics/gradient kernels everywhere (the fallback
    that GPUs without the fused GEMMs take anyway; ``HUGEHEAD_GEMM``).
    ``rows``: whether the planner may choose the rows plan (gradients in the forward) where it fits; ``False``
    keeps the chunk loop, whose backward can run twice (``HUGEHEAD_ROWS=0``).
    ``eager_op``: whether an eager call on plain tensors runs the registered op's eager twin (the same kernels
    without the dispatcher's overhead); ``False`` sends every call through the registered op
    (``HUGEHEAD_EAGER_OP=0``)."""

    gemm: str = "cutlass"
    rows: bool = True
    eager_op: bool = True

    def __post_init__(self):
        if self.gemm not in _GEMM_PATHS:
            raise ValueError(f"Tuning.gemm must be one of {_GEMM_PATHS}, got {self.gemm!r}")
        for name in ("rows", "eager_op"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Tuning.{name} must be a bool, got {getattr(self, name)!r}")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name)
    if text is None or text == "":
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def from_environment(env: Optional[Mapping[str, str]] = None) -> Tuning:
    """The :class:`Tuning` that ``env`` (default ``os.environ``) asks for: ``HUGEHEAD_GEMM=cutlass|cublas``,
    ``HUGEHEAD_ROWS=0|1``, ``HUGEHEAD_EAGER_OP=0|1``; unset ones take the defaults. Raises ``ValueError`` naming
    the variable for a value it does not know."""
    env = os.environ if env is None else env
    return Tuning(gemm=(env.get("HUGEHEAD_GEMM") or "cutlass").lower(),
                  rows=_flag(env, "HUGEHEAD_ROWS", True),
                  eager_op=_flag(env, "HUGEHEAD_EAGER_OP", True))


# Read once at import: a process's benchmarks set the environment before they start, and a value cannot change
# between a step's forward and its backward. override() swaps it for a block (one value for every thread, as the
# environment was).
_lock = threading.Lock()
_current = from_environment()


def current() -> Tuning:
    """The :class:`Tuning` in force."""
    return _current


@contextlib.contextmanager
def override(**changes) -> Iterator[Tuning]:
    """Within the block, :func:`current` is today's :class:`Tuning` with ``changes`` (field names as keywords)
    applied; restored on exit. Raises ``TypeError`` for an unknown field."""
    global _current
    with _lock:
        before = _current
        _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        with _lock:
            _current = before
