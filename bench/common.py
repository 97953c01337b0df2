"""The linear cross-entropy problem every benchmark shares: the benchmark shapes, seeded inputs, the
float32 chunked reference (never ``[N, V]``) and error classification. Timing, environment facts and the
results writer are in :mod:`bench.harness` (imported first here: it decides which ``hugehead`` is measured).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional, Tuple

from bench import harness  # noqa: F401  (first: decides which hugehead is imported)
# Kept importable from here for scripts written before bench/harness.py; new code imports bench.harness.
from bench.harness import (  # noqa: F401
    HUGEHEAD_SOURCE, REPO_ROOT, as_float, environment, error_text, git_sha, gpu_slug, median, tensor_bytes,
    write_json,
)

import torch  # noqa: E402


# --------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """One benchmark problem: ``x [N, D]``, ``weight [V, D]``, ``target [N]``."""

    name: str
    n: int
    d: int
    v: int
    note: str = ""

    @property
    def fwd_bwd_flops(self) -> float:
        """Nominal FLOPs of loss + exact gradients with the logits recomputed: ``8·N·D·V``."""
        return 8.0 * self.n * self.d * self.v

    @property
    def fwd_flops(self) -> float:
        return 2.0 * self.n * self.d * self.v


def _by_name(*shapes: Shape) -> Dict[str, Shape]:
    return {s.name: s for s in shapes}


# The benchmark shapes, in the order they are run (cheapest first).
SHAPES = _by_name(
    Shape("llama3_4k", 4096, 4096, 128256, "LLM head"),
    Shape("llama3", 8192, 4096, 128256, "LLM head"),
    Shape("gemma2", 8192, 2304, 256000, "LLM head"),
    Shape("xc1M", 8192, 768, 1_000_000, "extreme classification"),
    Shape("xc6M", 4096, 768, 6_000_000, "the seed's BERT + 6M classes"),
    Shape("xc6M_16k", 16384, 768, 6_000_000, "large batch"),
)

# --cpu-smoke: tiny problems that still cross chunk boundaries (odd sizes, V not a multiple of 256).
SMOKE_SHAPES = _by_name(
    Shape("tiny", 64, 32, 1000, "smoke"),
    Shape("tiny_odd", 37, 48, 5003, "smoke"),
)


# --device cpu: float32 problems a 2-core machine runs in seconds per step.
CPU_SHAPES = _by_name(
    Shape("cpu_100k", 1024, 256, 100_000, "CPU"),
    Shape("cpu_200k", 4096, 128, 200_000, "CPU"),
    Shape("cpu_1M", 256, 64, 1_000_000, "CPU"),
)

ALL_SHAPES: Dict[str, Shape] = {**SHAPES, **CPU_SHAPES, **SMOKE_SHAPES}


def find_shape(name: str) -> Shape:
    if name in ALL_SHAPES:
        return ALL_SHAPES[name]
    raise KeyError(f"unknown shape {name!r}; known: {', '.join(ALL_SHAPES)}")


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------
def make_inputs(
    shape: Shape, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded inputs scaled like a trained head: ``x ~ N(0, 1)``, ``weight ~ N(0, 1/D)`` (so logits are
    about N(0, 1)), targets uniform in ``[0, V)``. The same seed gives the same tensors on the same device
    and torch build, in every process. Returns leaf tensors ``(x, weight, target)``, without grad."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.n, shape.d, generator=g, device=device, dtype=dtype)
    weight = torch.randn(shape.v, shape.d, generator=g, device=device, dtype=dtype)
    weight.mul_(1.0 / math.sqrt(shape.d))
    target = torch.randint(0, shape.v, (shape.n,), generator=g, device=device, dtype=torch.int64)
    return x, weight, target


# --------------------------------------------------------------------------------------------------
# The reference: float32, chunked over the vocabulary, exact softmax and gradients
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def exact_float32_matmul():
    """float32 GEMMs in full precision (no TF32) inside the block; restores the previous setting."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class ReferenceResult(NamedTuple):
    loss: float  # mean over non-ignored rows, summed in float64
    lse: torch.Tensor  # [N] float32
    grad_x: Optional[torch.Tensor]  # [N, D] float32


REFERENCE_CHUNK_BYTES = 2 << 30


def reference_chunk_cols(n: int, v: int, chunk_bytes: int = REFERENCE_CHUNK_BYTES) -> int:
    """Classes per reference chunk so one ``[N, C]`` float32 logits chunk takes about ``chunk_bytes``."""
    return int(max(1, min(v, max(256, chunk_bytes // (4 * max(n, 1))))))


@torch.no_grad()
def reference_lce(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_cols: Optional[int] = None,
    grad_weight_sink: Optional[Callable[[int, int, torch.Tensor], None]] = None,
    with_grads: bool = True,
) -> ReferenceResult:
    """``F.cross_entropy(F.linear(x, weight), target)`` ("mean") and its exact gradients, in float32
    with full-precision GEMMs, streamed over ``[C]``-wide vocabulary chunks: never builds ``[N, V]``.

    Pass 1 folds each chunk ``Z_c = x W_cᵀ`` into a running (max, sum-exp) and picks the target logit;
    pass 2 recomputes ``Z_c`` and forms ``G_c = (softmax - onehot) / n_valid``, adds ``G_c W_c`` into
    ``grad_x`` and hands ``dW_c = G_cᵀ x`` ``[c1-c0, D]`` to ``grad_weight_sink(c0, c1, dW_c)`` (so the
    caller can compare it chunk by chunk without a ``[V, D]`` float32 copy). ``with_grads=False`` skips
    pass 2 (``grad_x`` is then None).

    Args:
        x: ``[N, D]``; weight: ``[V, D]``; target: ``[N]`` int64 in ``[0, V)`` or ``ignore_index``.
    Returns:
        :class:`ReferenceResult` on ``x``'s device. The loss is NaN when every row is ignored.
    """
    n, d = x.shape
    v = weight.shape[0]
    cols = int(chunk_cols or reference_chunk_cols(n, v))
    dev = x.device
    with exact_float32_matmul():
        x32 = x.detach().to(torch.float32)
        valid = target != ignore_index
        n_valid = int(valid.sum())
        tgt = torch.where(valid, target, torch.zeros_like(target))
        row_max = torch.full((n,), -math.inf, dtype=torch.float32, device=dev)
        row_sum = torch.zeros(n, dtype=torch.float32, device=dev)
        target_logit = torch.zeros(n, dtype=torch.float32, device=dev)
        for c0 in range(0, v, cols):
            c1 = min(c0 + cols, v)
            z = x32 @ weight[c0:c1].detach().to(torch.float32).t()  # [N, C]
            inside = (tgt >= c0) & (tgt < c1)
            picked = z.gather(1, (tgt - c0).clamp(0, c1 - c0 - 1)[:, None]).squeeze(1)
            target_logit += torch.where(inside, picked, torch.zeros_like(picked))
            new_max = torch.maximum(row_max, z.max(dim=1).values)
            row_sum = row_sum * torch.exp(row_max - new_max) + z.sub_(new_max[:, None]).exp_().sum(dim=1)
            row_max = new_max
            del z
        lse = row_max + row_sum.log()
        row_loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
        loss = float(row_loss.double().sum()) / n_valid if n_valid else float("nan")
        if not with_grads:
            return ReferenceResult(loss, lse, None)

        grad_rows = valid.to(torch.float32) / max(n_valid, 1)  # d loss / d row_loss
        grad_x = torch.zeros(n, d, dtype=torch.float32, device=dev)
        for c0 in range(0, v, cols):
            c1 = min(c0 + cols, v)
            w32 = weight[c0:c1].detach().to(torch.float32)
            g = (x32 @ w32.t()).sub_(lse[:, None]).exp_()  # softmax [N, C]
            rows = torch.nonzero((tgt >= c0) & (tgt < c1) & valid).squeeze(1)
            g.index_put_((rows, tgt[rows] - c0), torch.full_like(rows, -1.0, dtype=torch.float32), accumulate=True)
            g.mul_(grad_rows[:, None])
            grad_x.addmm_(g, w32)
            if grad_weight_sink is not None:
                grad_weight_sink(c0, c1, g.t() @ x32)
            del g, w32
    return ReferenceResult(loss, lse, grad_x)


class ChunkedRelErr:
    """Accumulates ``‖actual − ref‖`` and ``‖ref‖`` over row chunks of a ``[V, D]`` gradient, as a
    :func:`reference_lce` ``grad_weight_sink``."""

    def __init__(self, actual: torch.Tensor):
        self.actual = actual
        self.diff_sq = 0.0
        self.ref_sq = 0.0
        self.actual_sq = 0.0

    def __call__(self, c0: int, c1: int, ref_chunk: torch.Tensor) -> None:
        a = self.actual[c0:c1].to(device=ref_chunk.device, dtype=torch.float32)  # actual may sit in host memory
        self.diff_sq += float(torch.linalg.vector_norm(a - ref_chunk)) ** 2
        self.ref_sq += float(torch.linalg.vector_norm(ref_chunk)) ** 2
        self.actual_sq += float(torch.linalg.vector_norm(a)) ** 2

    @property
    def rel_err(self) -> float:
        return math.sqrt(self.diff_sq) / math.sqrt(self.ref_sq) if self.ref_sq > 0 else math.sqrt(self.diff_sq)


def rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖actual − ref‖ / ‖ref‖`` with both in float32 (NaN propagates)."""
    a, r = actual.detach().to(torch.float32), ref.detach().to(torch.float32)
    denom = float(torch.linalg.vector_norm(r))
    return float(torch.linalg.vector_norm(a - r)) / (denom if denom > 0 else 1.0)


def reference_selfcheck(seed: int = 0) -> Dict[str, float]:
    """Relative errors of :func:`reference_lce` (several chunks, ignored rows) against dense float64
    autograd on CPU; all should be below 1e-5."""
    g = torch.Generator().manual_seed(seed)
    n, d, v = 33, 20, 1111
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss64 = torch.nn.functional.cross_entropy(xr @ wr.t(), t, ignore_index=-100)
    gx64, gw64 = torch.autograd.grad(loss64, (xr, wr))
    loss64 = float(loss64.detach())
    gw = ChunkedRelErr(gw64.to(torch.float32))
    ref = reference_lce(x.float(), w.float(), t, chunk_cols=100, grad_weight_sink=gw)
    return {
        "loss_rel_err": abs(ref.loss - loss64) / abs(loss64),
        "grad_x_rel_err": rel_err(ref.grad_x, gx64),
        "grad_w_rel_err": gw.rel_err,
    }


# --------------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------------
def classify_error(exc: BaseException) -> str:
    """"oom", "cuda-error" (the CUDA context may be unusable afterwards) or "error"."""
    msg = str(exc).lower()
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in msg or "can't allocate memory" in msg:
        return "oom"
    if (
        "cuda error" in msg
        or "illegal memory access" in msg
        or "device-side assert" in msg
        or "cuda driver error" in msg
        or "misaligned address" in msg
        or "unspecified launch failure" in msg
    ):
        return "cuda-error"
    return "error"


def cuda_context_ok(device: torch.device) -> bool:
    """False when the CUDA context no longer runs work (e.g. after an illegal memory access)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return float(torch.ones(1, device=device).add_(1).item()) == 2.0
    except Exception:  # noqa: BLE001  (any failure here means the context is gone)
        return False
