"""The implementations the linear cross-entropy benchmark measures: hugehead (with the default budget, and
at torch.compile's measured memory) and its peers (plain PyTorch, torch.compile, a pure-PyTorch
vocabulary-chunked function, PyTorch's own F.linear_cross_entropy, Cut Cross-Entropy, Liger-Kernel) and the
harness self-tests. Each loads lazily: a peer that does not import
or does not exist in the installed torch is a result, not a crash.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from bench import harness  # first: decides which hugehead is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]
PlanFn = Callable[..., dict]  # (n, d, v, dtype, device[, memory_budget=]) -> dict


class PeerUnavailable(RuntimeError):
    """The peer does not exist here (e.g. a torch without ``F.linear_cross_entropy``): its cases are
    recorded as ``skipped`` with this message."""


@dataclass(frozen=True)
class Impl:
    name: str
    needs_cuda: bool
    load: Callable[..., Tuple[LossFn, Optional[str]]]  # ([memory_budget=]) -> (loss_fn(x, weight, target), version)
    about: str
    exact: bool = True  # computes the exact gradients (False: skips terms, e.g. CCE's gradient filter)
    compiles: bool = False  # its first call compiles: timed separately, excluded from the medians
    plan: Optional[PlanFn] = None  # (n, d, v, dtype, device) -> the chunking it will use, for the record
    isolate: bool = False  # may break its process (illegal memory access, hang): runs in a process of its own
    # Runs with memory_budget = this implementation's measured fwd+bwd peak extra memory at the same shape
    # (load and plan then take memory_budget=...); it runs after that one, and is skipped where that
    # one has no measured peak (lce_case.budget_from_row).
    budget_from: Optional[str] = None


def _plain(obj) -> dict:
    """A dataclass / NamedTuple / object as a JSON-friendly dict (dtypes and devices as strings)."""
    if dataclasses.is_dataclass(obj):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    elif hasattr(obj, "_asdict"):
        fields = obj._asdict()
    elif isinstance(obj, dict):
        fields = obj
    else:
        return {"repr": repr(obj)}
    return {k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v) for k, v in fields.items()}


# --------------------------------------------------------------------------------------------------
# hugehead
# --------------------------------------------------------------------------------------------------
def _load_hugehead(memory_budget: Optional[int] = None):
    import hugehead

    if memory_budget is None:  # the defaults, as a user calls it
        return (lambda x, w, t: hugehead.linear_cross_entropy(x, w, t)), hugehead.__version__
    return (lambda x, w, t: hugehead.linear_cross_entropy(x, w, t, memory_budget=memory_budget)), hugehead.__version__


def _hugehead_plan(n, d, v, dtype, device, memory_budget: Optional[int] = None) -> dict:
    """What ``hugehead.linear_cross_entropy`` plans with ``memory_budget`` (None: the default) for forward +
    backward of the mean loss (whatever fields ``Plan`` has, and its ``kind``: ``rows``, ``kept`` or
    ``recompute``), and, where the planner can be told that nothing will be kept (``allow_keep``), for the
    forward alone (prefixed ``fwd_``). An older hugehead without ``loss_plan`` is asked through ``plan_loss``,
    one without that through ``plan_chunks``."""
    import inspect

    try:  # where the single-device loss plans its step (in older trees: hugehead.functional)
        from hugehead import lce_op as functional
    except ImportError:
        from hugehead import functional

    planner = getattr(functional, "plan_loss", None)
    if hasattr(functional, "loss_plan"):  # the plan of the call itself (it also asks whether the GEMMs are fused)
        with torch.enable_grad():
            x = torch.empty(n, d, dtype=dtype, device=device, requires_grad=True)
            w = torch.empty(1, d, dtype=dtype, device=device, requires_grad=True).expand(v, d)  # shapes only
            chosen = functional.loss_plan(x, w, torch.zeros(n, dtype=torch.long, device=device), None, None,
                                          memory_budget)
    elif planner is not None:  # the functional's own planner: kept logits, rows, or recomputed chunks
        chosen = planner(n, d, v, dtype, device, None, memory_budget, allow_rows=True, direct_dx=True)
    else:
        params = inspect.signature(functional.plan_chunks).parameters
        # linear_cross_entropy plans with direct_dx=True (its dX of a one-chunk plan is one GEMM)
        chosen = functional.plan_chunks(n, d, v, dtype, device, None, memory_budget,
                                        **({"direct_dx": True} if "direct_dx" in params else {}))
    plan = _plain(chosen)
    if hasattr(chosen, "kind"):
        plan["kind"] = chosen.kind
    params = inspect.signature(functional.plan_chunks).parameters
    if "allow_keep" in params:
        fwd = _plain(functional.plan_chunks(n, d, v, dtype, device, None, memory_budget, allow_keep=False))
        plan.update({f"fwd_{k}": val for k, val in fwd.items() if k not in ("keep_logits", "reason")})
    return plan


# --------------------------------------------------------------------------------------------------
# PyTorch: eager, compiled, chunked by hand, and its own F.linear_cross_entropy
# --------------------------------------------------------------------------------------------------
def _plain_torch_loss(x, w, t):
    return F.cross_entropy(F.linear(x, w), t)


def _load_torch():
    return _plain_torch_loss, torch.__version__


def _load_torch_compile():
    if not hasattr(torch, "compile"):
        raise PeerUnavailable(f"torch {torch.__version__} has no torch.compile")
    # Default mode and settings, as a user would call it; fresh compiled function per case process.
    return torch.compile(_plain_torch_loss), torch.__version__


def _load_torch_chunked():
    from bench.torch_chunked import torch_chunked_linear_cross_entropy

    return (lambda x, w, t: torch_chunked_linear_cross_entropy(x, w, t)), torch.__version__


def _torch_chunked_plan(n, d, v, dtype, device) -> dict:
    from bench.torch_chunked import DEFAULT_CHUNK_BYTES, chunk_cols

    return {"cols": chunk_cols(n, v), "chunk_bytes": DEFAULT_CHUNK_BYTES}


def _has_torch_lce() -> bool:
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def _load_torch_lce():
    if not _has_torch_lce():
        raise PeerUnavailable(f"torch {torch.__version__} has no F.linear_cross_entropy with "
                              "torch.nn.LinearCrossEntropyOptions (PyTorch 2.13 has them)")
    options = torch.nn.LinearCrossEntropyOptions()
    # options=...: the chunked path (options=None is the reference path, i.e. plain PyTorch).
    return (lambda x, w, t: F.linear_cross_entropy(x, w, t, options=options)), torch.__version__


def _torch_lce_plan(n, d, v, dtype, device) -> dict:
    """The options the ``"auto"`` defaults resolve to (a private torch method: best effort)."""
    if not _has_torch_lce():
        return {}
    options = torch.nn.LinearCrossEntropyOptions()
    return _plain(options._adjust(num_batches=n, in_features=d, num_classes=v, dtype=dtype, device=device))


# --------------------------------------------------------------------------------------------------
# Cut Cross-Entropy, Liger-Kernel (CUDA only)
# --------------------------------------------------------------------------------------------------
def _load_cce(filter_eps=None):
    def load():
        from cut_cross_entropy import linear_cross_entropy

        # filter_eps=None: exact gradients (the library's default "high" skips small softmax entries).
        return (
            lambda x, w, t: linear_cross_entropy(x, w, t, filter_eps=filter_eps),
            harness.package_version("cut-cross-entropy"),
        )

    return load


def _load_liger(accum_dtype=None):
    def load():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        head = LigerFusedLinearCrossEntropyLoss(reduction="mean", accum_dtype=accum_dtype)

        def loss_fn(x, w, t):
            out = head(w, x, t)
            return out if isinstance(out, Tensor) else out.loss

        return loss_fn, harness.package_version("liger-kernel") or harness.package_version("liger_kernel")

    return load


# --------------------------------------------------------------------------------------------------
# Harness self-tests
# --------------------------------------------------------------------------------------------------
def _selftest(kind: str):
    """Failure modes for checking the harness itself (--cpu-smoke runs them through subprocesses)."""

    def load():
        if kind == "unavailable":
            raise PeerUnavailable("selftest: this peer does not exist here")

        def loss_fn(x, w, t):
            if kind == "crash":
                os.abort()
            if kind == "hang":
                time.sleep(3600)
            if kind == "oom":
                raise torch.OutOfMemoryError("selftest: pretend the device is out of memory")
            raise RuntimeError(f"selftest: {kind}")

        return loss_fn, None

    return load


IMPLS: Dict[str, Impl] = {
    i.name: i
    for i in [
        Impl("hugehead", False, _load_hugehead, "hugehead.linear_cross_entropy (planned chunks)", plan=_hugehead_plan),
        # hugehead and torch.compile compared at equal memory
        Impl("hugehead_eqmem", False, _load_hugehead,
             "hugehead.linear_cross_entropy with memory_budget = torch_compile's measured fwd+bwd peak extra "
             "memory at the same shape", plan=_hugehead_plan, budget_from="torch_compile"),
        Impl("torch", False, _load_torch, "F.cross_entropy(F.linear(x, W), t), eager"),
        Impl("torch_compile", False, _load_torch_compile,
             "torch.compile of F.cross_entropy(F.linear(x, W), t), default mode; compile time reported apart",
             compiles=True),
        Impl("torch_chunked", False, _load_torch_chunked,
             "bench/torch_chunked.py: vocab-chunked autograd.Function in plain PyTorch (online lse, recompute)",
             plan=_torch_chunked_plan),
        Impl("torch_lce", False, _load_torch_lce,
             "F.linear_cross_entropy(x, W, t, options=torch.nn.LinearCrossEntropyOptions()) (batch-chunked)",
             plan=_torch_lce_plan),
        # CCE faults (illegal memory access) when V·D >= 2^31; Liger runs its own Triton kernels: both isolated.
        Impl("cce", True, _load_cce(None), "cut_cross_entropy.linear_cross_entropy, filter_eps=None (exact)",
             isolate=True),
        Impl("liger", True, _load_liger(None), "LigerFusedLinearCrossEntropyLoss, defaults (bf16 dW accumulation)",
             isolate=True),
        Impl("cce_filter", True, _load_cce("high"), "cut_cross_entropy with its default gradient filter (inexact)",
             exact=False, isolate=True),
        Impl("liger_fp32acc", True, _load_liger(torch.float32), "Liger with accum_dtype=torch.float32", isolate=True),
        Impl("selftest_crash", False, _selftest("crash"), "harness check: the case process aborts", exact=False,
             isolate=True),
        Impl("selftest_hang", False, _selftest("hang"), "harness check: the case process hangs", exact=False,
             isolate=True),
        Impl("selftest_crash_shared", False, _selftest("crash"),
             "harness check: aborts a process it shares with others (they are rerun)", exact=False),
        Impl("selftest_oom", False, _selftest("oom"), "harness check: OutOfMemoryError", exact=False),
        Impl("selftest_error", False, _selftest("error"), "harness check: an exception", exact=False),
        Impl("selftest_unavailable", False, _selftest("unavailable"), "harness check: a peer that does not exist",
             exact=False),
    ]
}
DEFAULT_PEERS: List[str] = ["hugehead", "torch", "torch_compile", "hugehead_eqmem", "torch_chunked", "torch_lce",
                            "cce", "liger"]
CPU_PEERS: List[str] = ["hugehead", "torch", "torch_chunked", "torch_lce"]  # --device cpu (fp32)
PROBED: List[str] = ["hugehead", "torch_compile", "torch_lce", "cce", "liger"]  # imports reported in the meta
