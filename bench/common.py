"""What every benchmark shares: the benchmark shapes, seeded inputs, timing, the float32 chunked
reference of linear cross-entropy (never ``[N, V]``), error classification, environment facts and JSON.

Importing this module also decides which ``hugehead`` the benchmark measures (see
:func:`select_hugehead`), so import it before ``hugehead``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------------
# Which hugehead is measured
# --------------------------------------------------------------------------------------------------
def _is_repo_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == REPO_ROOT
    except OSError:
        return False


def select_hugehead() -> str:
    """Make ``import hugehead`` find the build we mean to measure; returns "tree" or "installed".

    ``python -m bench.<x>`` puts the repository root first on ``sys.path``, and after a plain
    ``pip install .`` the source tree's ``hugehead/`` has no compiled ``_C`` (or a stale one from an
    earlier in-place build). ``HUGEHEAD_BENCH_IMPORT=installed`` drops the repository root from
    ``sys.path`` so the installed package is used; ``tree`` keeps the source tree; ``auto`` (default)
    uses the tree only when it holds a compiled ``_C``. The ``bench`` package itself is already
    imported by then, so its submodules still load.
    """
    mode = os.environ.get("HUGEHEAD_BENCH_IMPORT", "auto").lower()
    tree_built = any((REPO_ROOT / "hugehead").glob("_C*.so")) or any((REPO_ROOT / "hugehead").glob("_C*.pyd"))
    if mode == "tree" or (mode == "auto" and tree_built):
        return "tree"
    sys.path[:] = [p for p in sys.path if not _is_repo_root(p)]
    return "installed"


HUGEHEAD_SOURCE = select_hugehead()

import torch  # noqa: E402  (after select_hugehead, which only edits sys.path)


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


# DESIGN.md "Benchmark shapes", in the order they are run (cheapest first).
SHAPES: Dict[str, Shape] = {
    s.name: s
    for s in [
        Shape("llama3_4k", 4096, 4096, 128256, "LLM head"),
        Shape("llama3", 8192, 4096, 128256, "LLM head"),
        Shape("gemma2", 8192, 2304, 256000, "LLM head"),
        Shape("xc1M", 8192, 768, 1_000_000, "extreme classification"),
        Shape("xc6M", 4096, 768, 6_000_000, "the seed's BERT + 6M classes"),
        Shape("xc6M_16k", 16384, 768, 6_000_000, "large batch"),
    ]
}

# --cpu-smoke: tiny problems that still cross chunk boundaries (odd sizes, V not a multiple of 256).
SMOKE_SHAPES: Dict[str, Shape] = {
    s.name: s
    for s in [
        Shape("tiny", 64, 32, 1000, "smoke"),
        Shape("tiny_odd", 37, 48, 5003, "smoke"),
    ]
}


# --device cpu: float32 problems a 2-core machine runs in seconds per step (issue 12's CPU table).
CPU_SHAPES: Dict[str, Shape] = {
    s.name: s
    for s in [
        Shape("cpu_100k", 1024, 256, 100_000, "CPU"),
        Shape("cpu_200k", 4096, 128, 200_000, "CPU"),
        Shape("cpu_1M", 256, 64, 1_000_000, "CPU"),
    ]
}

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


def tensor_bytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# --------------------------------------------------------------------------------------------------
# Timing and memory
# --------------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call_ms(fn: Callable[[], object], device: torch.device) -> Tuple[float, object]:
    """Run ``fn`` once; milliseconds by CUDA events on a GPU (``time.perf_counter`` on CPU) and its
    result. The events bracket everything ``fn`` queues, host-side work and syncs included."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), out
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def memory_baseline(device: torch.device) -> Optional[int]:
    """Reset the peak counter and return the bytes allocated now (None on CPU: not measured)."""
    if device.type != "cuda":
        return None
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def memory_peak(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def cpu_busy_seconds() -> Tuple[Optional[float], float]:
    """(CPU seconds all processes of this machine have been busy, from /proc/stat; CPU seconds of this
    process). Their deltas around a timed CPU step tell how much of the machine others used meanwhile."""
    own = sum(os.times()[:2])
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None, own
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields) - idle) / hz, own


def foreign_cpu_fraction(before: Tuple[Optional[float], float], after: Tuple[Optional[float], float],
                         wall_s: float) -> Optional[float]:
    """The share of this machine's CPUs that other processes kept busy between two
    :func:`cpu_busy_seconds` readings (0: the measurement had the machine to itself)."""
    if before[0] is None or after[0] is None or wall_s <= 0:
        return None
    foreign = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, foreign / (wall_s * (os.cpu_count() or 1)))


def wait_until_idle(max_wait_s: float, busy_limit: float = 0.1, window_s: float = 2.0) -> Tuple[float, Optional[float]]:
    """Wait (up to ``max_wait_s``) until other processes use less than ``busy_limit`` of the CPUs over a
    ``window_s`` window (this process sleeping meanwhile). Returns (seconds waited, last busy share)."""
    t0 = time.perf_counter()
    share = None
    while True:
        before = cpu_busy_seconds()
        time.sleep(window_s)
        share = foreign_cpu_fraction(before, cpu_busy_seconds(), window_s)
        waited = time.perf_counter() - t0
        if share is None or share < busy_limit or waited >= max_wait_s:
            return waited, share


def median(values: List[float]) -> float:
    s = sorted(values)
    k = len(s) // 2
    return s[k] if len(s) % 2 else 0.5 * (s[k - 1] + s[k])


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
def error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


# --------------------------------------------------------------------------------------------------
# Environment facts
# --------------------------------------------------------------------------------------------------
def git_sha() -> Dict[str, object]:
    """The ``HUGEHEAD_GIT_SHA`` environment variable when set (the GPU machine's copy of the tree may
    carry a stale ``.git``: the caller names the commit it sent), else ``git rev-parse HEAD`` of the
    repository (and whether tracked files differ), else "unknown"."""
    env = os.environ.get("HUGEHEAD_GIT_SHA")
    if env:
        return {"git_sha": env, "git_dirty": None, "git_sha_source": "env HUGEHEAD_GIT_SHA"}
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=20,
        ).stdout.rstrip("\n")
        # which tracked files differ from the commit (others' work in progress is measured too)
        files = [line[3:] for line in dirty.splitlines() if line.strip()][:40]
        return {"git_sha": sha, "git_dirty": bool(dirty), "git_dirty_files": files, "git_sha_source": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": "unknown", "git_dirty": None, "git_sha_source": "none"}


def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200": the results folder name of a device."""
    slug = re.sub(r"^nvidia\s+", "", name.strip().lower())
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-")
    return slug or "unknown"


def package_version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> Dict[str, object]:
    """Facts that qualify every number: GPU, driver, torch/CUDA/triton, hugehead build, Python."""
    info: Dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "device": str(device),
        "hugehead_source": HUGEHEAD_SOURCE,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu_name=props.name,
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_count=torch.cuda.device_count(),
        )
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            ).stdout.strip().splitlines()
            info["nvidia_smi"] = out[0] if out else None
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = error_text(exc)
    else:
        info.update(gpu_name="cpu", gpu_capability=None, gpu_memory_gib=None, gpu_count=0)
    info["cpu_model"] = cpu_model()
    info["niceness"] = os.nice(0) if hasattr(os, "nice") else None  # CPU runs may raise their priority
    info["torch_threads"] = torch.get_num_threads()
    info["machine"] = (
        info["gpu_name"] if device.type == "cuda" else f"{info['cpu_model']}, {os.cpu_count()} cores"
    )
    try:
        import hugehead

        info.update(
            hugehead_version=hugehead.__version__,
            hugehead_file=str(Path(hugehead.__file__).parent),
            hugehead_cuda_built=hugehead.cuda_built(),
            hugehead_cuda_kernels=hugehead.has_kernel("chunk_stats_", "CUDA"),
        )
    except Exception as exc:  # noqa: BLE001  (recorded; the hugehead rows will say the same)
        info["hugehead_error"] = error_text(exc)
    return info


# --------------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------------
def jsonable(obj):
    """Plain JSON: non-finite floats become the strings "nan"/"inf"/"-inf", tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Shape):
        return asdict(obj)
    return obj


def write_json(path: Path, obj) -> None:
    """Write atomically (a killed process leaves the previous file or the new one, never half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(obj), indent=1) + "\n")
    os.replace(tmp, path)


def as_float(value) -> Optional[float]:
    """A JSON number or "nan"/"inf" string back to float; None stays None."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
