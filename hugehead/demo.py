"""``python -m hugehead.demo``: the main job. Trains a small MLP backbone plus a
:class:`hugehead.ChunkedClassifier` with hundreds of thousands (CPU) or millions (GPUs) of classes on
synthetic data that is actually learnable, then reports held-out accuracy against two chance levels,
peak memory per device and what plain ``nn.Linear`` + ``F.cross_entropy`` logits would have needed.

The data: class ``c`` has a prototype ``p_c`` in ``R^{D_in}`` derived from ``c`` by an integer hash (no
``V × D_in`` table, so 6M classes cost nothing to store); a sample of class ``c`` is ``p_c + noise``.
Classes are drawn from a Zipf law over a fixed permutation of the class ids, so a short run sees the
frequent classes many times (and they land on every shard), while the rare ones are seen rarely or
never, as in real extreme classification.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

_START = time.perf_counter()  # `python -m hugehead.demo`: the time budget counts the imports too

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import hugehead  # noqa: E402
from .plan import workspace_bytes  # noqa: E402

__all__ = ["main", "parse_args", "resolve_devices", "ZipfPrototypes", "Backbone", "estimate_bytes_per_device"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_GiB = float(1 << 30)

# Defaults per machine kind. CPU: steps=None means "as many as fit --time-budget", measured after a few
# steps, so the whole run (startup included) stays under two minutes on 2 cores. GPU: the seed issue's
# 6M-class head at BERT width.
_DEFAULTS = {
    "cpu": dict(classes=200_000, dim=64, input_dim=64, hidden=256, batch=256, steps=None, epochs=4,
                eval_size=1024, dtype="float32", lr=3e-3, time_budget=100.0),
    "cuda": dict(classes=6_000_000, dim=768, input_dim=128, hidden=1024, batch=4096, steps=400, epochs=4,
                 eval_size=16384, dtype="bfloat16", lr=3e-3, time_budget=None),
}
# Steps timed (after a first, warm-up step) before an automatic step count is chosen; a cap on that count.
_CALIBRATION_STEPS = 3
_MAX_AUTO_STEPS = 100_000
# Seconds kept free at the end of a time budget for the report, the plot and the summary.
_RESERVE_SECONDS = 6.0
# Bytes per head parameter element kept per device while training: the weight, its gradient and
# Adam's two moments, all in the head's dtype.
_COPIES_PER_PARAM = 4
# The head's chunk-loop workspace budget when the demo plans it (bytes per device).
_WORKSPACE_BUDGET = 1 << 30


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def _dtype_arg(text: str) -> torch.dtype:
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unsupported dtype {text!r}; choose float32, bfloat16 or float16"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text.replace("_", ""))
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _steps_arg(text: str):
    return "auto" if text.strip().lower() == "auto" else _positive_int(text)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hugehead.demo",
        description="Train a backbone + hugehead.ChunkedClassifier with a huge number of classes on "
        "learnable synthetic data. Defaults adapt to the machine: CPU-only runs 200k classes in under "
        "two minutes; with GPUs, 6M classes (D=768, bfloat16) over all visible GPUs.",
    )
    p.add_argument("--classes", type=_positive_int, help="number of classes V (CPU 200000, GPU 6000000)")
    p.add_argument("--dim", type=_positive_int, help="feature width D into the head (CPU 64, GPU 768)")
    p.add_argument("--input-dim", type=_positive_int, help="width of the synthetic inputs (CPU 64, GPU 128)")
    p.add_argument("--hidden", type=_positive_int, help="backbone MLP hidden width (CPU 256, GPU 1024)")
    p.add_argument("--batch", type=_positive_int, help="rows per step N (CPU 256, GPU 4096)")
    p.add_argument("--steps", type=_steps_arg, help="training steps in total, or 'auto': as many as fit "
                   "--time-budget (CPU auto, GPU 400)")
    p.add_argument("--epochs", type=_positive_int, help="evaluations on held-out data, spread over the steps (4)")
    p.add_argument("--eval-size", type=_positive_int, help="held-out samples (CPU 1024, GPU 16384)")
    p.add_argument("--devices", help="head placement: 'cuda:0,cuda:1', 'cpu', 'cpu,cpu', or a GPU count "
                   "like '2' (default: all visible GPUs, else cpu). The backbone runs on the first one.")
    p.add_argument("--offload", choices=["auto", "on", "off"], default="auto",
                   help="keep the head in pinned host memory and stream it through the --devices GPUs "
                   "(ChunkedClassifier(offload=True)); auto (default): only when the head does not fit the GPUs "
                   "but fits the host's RAM")
    p.add_argument("--dtype", type=_dtype_arg, help="head dtype: float32, bfloat16 or float16 "
                   "(CPU float32, GPU bfloat16); the backbone trains in float32")
    p.add_argument("--autocast", choices=["off", "bfloat16"], default="off",
                   help="train and evaluate under torch.autocast(bfloat16), as Lightning's bf16-mixed does; with "
                   "--dtype float32 the head keeps float32 master weights and computes in bfloat16 (off)")
    p.add_argument("--time-budget", type=float, help="seconds for the whole run, startup included; with "
                   "--steps auto it sets the step count, with a number of steps it only stops training early "
                   "(CPU 100, GPU none)")
    p.add_argument("--lr", type=float, help="Adam learning rate (3e-3)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the class frequencies (1.1)")
    p.add_argument("--noise", type=float, default=1.0, help="noise std around each prototype (1.0)")
    p.add_argument("--out", type=Path, default=Path("hugehead_demo"), help="output folder (./hugehead_demo/)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--labels", type=_positive_int, default=1,
                   help="labels per sample: 1 (single-label, default) or more: a multi-label task whose label "
                        "sets are Zipf-distributed, trained from a sparse target, evaluated with P@k / nDCG@k")
    p.add_argument("--multilabel-loss", choices=["softmax", "ova"], default="softmax",
                   help="with --labels > 1: softmax cross-entropy against the label set (1/k each), or one-vs-all "
                        "binary cross-entropy (default softmax)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def resolve_devices(spec: Optional[str]) -> List[torch.device]:
    """Parse ``--devices`` into a list of devices (repeats allowed).

    ``None``: every visible GPU when hugehead's CUDA kernels are built, else ``[cpu]``. An integer
    ``k``: ``cuda:0 .. cuda:k-1``. Otherwise a comma-separated list of device strings.

    Raises:
        ValueError: a malformed entry, more GPUs than visible, or CUDA without hugehead's CUDA kernels.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec is None:
        if gpus and hugehead.has_kernel("chunk_stats_", "CUDA"):
            return [torch.device("cuda", i) for i in range(gpus)]
        return [torch.device("cpu")]
    spec = spec.strip()
    if spec.isdigit():
        count = int(spec)
        if count < 1:
            raise ValueError(f"--devices {spec}: need at least one GPU (or pass --devices cpu)")
        if count > gpus:
            raise ValueError(f"--devices {spec}: {count} GPUs requested but {gpus} visible")
        devices = [torch.device("cuda", i) for i in range(count)]
    else:
        devices = []
        for item in spec.split(","):
            item = item.strip()
            try:
                dev = torch.device(item)
            except RuntimeError:
                raise ValueError(f"--devices: {item!r} is not a device (expected e.g. cpu, cuda:0, cuda:1)") from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"--devices: {item!r}: only cpu and cuda devices are supported")
            if dev.type == "cuda":
                if gpus == 0:
                    raise ValueError(f"--devices: {item} requested but no CUDA GPU is visible "
                                     f"(torch {torch.__version__}, cuda available: {torch.cuda.is_available()})")
                index = torch.cuda.current_device() if dev.index is None else dev.index
                if index >= gpus:
                    raise ValueError(f"--devices: {item} requested but only {gpus} CUDA GPU(s) are visible "
                                     f"(cuda:0..cuda:{gpus - 1})")
                dev = torch.device("cuda", index)
            devices.append(dev)
        if not devices:
            raise ValueError("--devices: empty list")
    if any(d.type == "cuda" for d in devices) and not hugehead.has_kernel("chunk_stats_", "CUDA"):
        raise ValueError("--devices: GPUs requested but this hugehead build has no CUDA kernels; rebuild with "
                         "HUGEHEAD_CUDA=ON pip install --no-build-isolation . or pass --devices cpu")
    return devices


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and complete the command line: machine-dependent defaults filled in, devices resolved.
    Impossible requests exit through ``argparse`` with a message (status 2)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        args.devices = resolve_devices(args.devices)
    except ValueError as exc:
        parser.error(str(exc))
    kind = "cuda" if any(d.type == "cuda" for d in args.devices) else "cpu"
    budget_given = args.time_budget is not None
    for key, value in _DEFAULTS[kind].items():
        if getattr(args, key) is None:
            setattr(args, key, _DTYPES[value] if key == "dtype" else value)
    if args.steps == "auto":
        args.steps = None  # None from here on: chosen from the time budget
    if args.steps is None and args.time_budget is None:
        parser.error("--steps auto needs a --time-budget (seconds)")
    if args.steps is not None and not budget_given:
        args.time_budget = None  # a fixed step count runs to the end unless a budget was asked for
    if args.time_budget is not None and not (args.time_budget > 0 and math.isfinite(args.time_budget)):
        parser.error(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if args.steps is not None and args.epochs > args.steps:
        args.epochs = args.steps
    if not (args.zipf > 0 and math.isfinite(args.zipf)):
        parser.error(f"--zipf must be a positive number, got {args.zipf}")
    if not (args.noise >= 0 and math.isfinite(args.noise)):
        parser.error(f"--noise must be >= 0, got {args.noise}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    if args.labels > 1 and args.labels > args.classes:
        parser.error(f"--labels {args.labels} is more than --classes {args.classes}")
    if args.classes < len(args.devices):
        parser.error(f"--classes {args.classes} is fewer than the {len(args.devices)} head devices")
    if args.dtype != torch.float32:
        for dev in sorted({d for d in args.devices if d.type == "cpu"}, key=str)[:1]:
            if not _dtype_works(args.dtype, dev):
                parser.error(f"--dtype {_dtype_name(args.dtype)} is not supported by hugehead on {dev}; "
                             "use --dtype float32")
    return args


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype_works(dtype: torch.dtype, device: torch.device) -> bool:
    """One tiny forward + backward of the loss in ``dtype`` on ``device``: does this build support it?"""
    try:
        x = torch.randn(4, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(300, 8, device=device, dtype=dtype, requires_grad=True)
        loss = hugehead.linear_cross_entropy(x, w, torch.arange(4, device=device))
        loss.backward()
        return bool(torch.isfinite(loss.float()))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


# --------------------------------------------------------------------------------------------------
# Will it fit?
# --------------------------------------------------------------------------------------------------
def balanced_shard_sizes(num_classes: int, shards: int) -> List[int]:
    """Classes per shard when ``num_classes`` are split evenly over ``shards`` (the first get one more)."""
    base, extra = divmod(num_classes, shards)
    return [base + (i < extra) for i in range(shards)]


def estimate_bytes_per_device(args: argparse.Namespace) -> Dict[torch.device, int]:
    """Bytes each device needs while training: per shard the weight and bias with their gradient and
    Adam's two moments, plus the chunk workspace; on the first device also the backbone (with its
    gradient and Adam state), the class-frequency tables and one batch of activations. With
    ``args.offload is True`` the parameters, gradients and Adam state are counted in host memory (``cpu``)
    and each GPU holds the workspace and the offload engine's rings of weight and gradient chunks."""
    itemsize = torch.empty((), dtype=args.dtype).element_size()
    offloaded = getattr(args, "offload", False) is True
    host = torch.device("cpu")
    need: Dict[torch.device, int] = {}
    on_device: Dict[torch.device, List[int]] = {}
    for dev, v in zip(args.devices, balanced_shard_sizes(args.classes, len(args.devices))):
        params = v * (args.dim + 1) * itemsize * _COPIES_PER_PARAM
        where = host if offloaded else dev
        need[where] = need.get(where, 0) + params
        on_device.setdefault(dev, []).append(v)
    # The chunk loops' workspace, kept logits and (offloaded) rings: what the planner will choose.
    for dev, sizes in on_device.items():
        need[dev] = need.get(dev, 0) + workspace_bytes(args.batch, args.dim, sizes, args.dtype, dev,
                                                       memory_budget=_WORKSPACE_BUDGET, offload=offloaded)
    first = args.devices[0]
    backbone_params = args.input_dim * args.hidden + args.hidden * args.hidden + args.hidden * args.dim
    activations = args.batch * (args.input_dim + 2 * args.hidden + 2 * args.dim) * 4 * 3
    need[first] = need.get(first, 0) + backbone_params * 4 * 4 + activations + args.classes * 8 * 3
    return need


def available_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, or the memory the OS reports as available for a CPU process."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def _shortfall(args: argparse.Namespace) -> Optional[Tuple[torch.device, int, int]]:
    """The first device whose estimated need exceeds 92% of what it has available: (device, need, have)."""
    for dev, need in estimate_bytes_per_device(args).items():
        have = available_bytes(dev)
        if need > 0.92 * have:
            return dev, need, have
    return None


def check_fits(args: argparse.Namespace) -> None:
    """Decide ``--offload auto`` (sets ``args.offload`` to a bool: offload when the head does not fit the
    GPUs but fits the host's RAM), then raise ``SystemExit`` with a message when the estimate exceeds
    what a device has available."""
    gpus = any(d.type == "cuda" for d in args.devices)
    choice = getattr(args, "offload", "auto")
    if choice in ("on", True) and not gpus:
        raise SystemExit("hugehead.demo: error: --offload on streams the head to GPUs; none are in --devices")
    args.offload = choice in ("on", True)
    short = _shortfall(args)
    resident_short = None
    if choice == "auto" and gpus and short is not None:
        resident_short = short
        args.offload = True
        short = _shortfall(args)
        if short is None:
            dev, need, have = resident_short
            print(f"hugehead.demo: the head needs about {need / _GiB:.1f} GiB on {dev}, which has "
                  f"{have / _GiB:.1f} GiB free: keeping it in pinned host memory instead (--offload auto)",
                  flush=True)
        else:
            args.offload = False
            short = resident_short
    if short is not None:
        dev, need, have = short
        where = "available RAM" if dev.type == "cpu" else "free memory"
        smaller_dtype = " or a 2-byte --dtype (bfloat16)" if args.dtype.itemsize > 2 else ""
        offload_text = ""
        if resident_short is not None:
            args.offload = True
            host = estimate_bytes_per_device(args).get(torch.device("cpu"), 0)
            args.offload = False
            offload_text = (f" Offloading the head to host memory would need about {host / _GiB:.1f} GiB of RAM, "
                            f"and {available_bytes(torch.device('cpu')) / _GiB:.1f} GiB are available.")
        raise SystemExit(
            f"hugehead.demo: error: {args.classes:,} classes × {args.dim} features in "
            f"{_dtype_name(args.dtype)} on {len(args.devices)} device(s) need about {need / _GiB:.1f} GiB "
            f"on {dev} (weights, gradients, Adam state and workspace) but it has {have / _GiB:.1f} GiB "
            f"{where}.{offload_text} Use more --devices, fewer --classes, a smaller --dim{smaller_dtype}."
        )


# --------------------------------------------------------------------------------------------------
# Data and backbone
# --------------------------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a well-mixing 32-bit odd multiplier (from a public integer-hash search)


def _coprime_multiplier(n: int, gen: torch.Generator) -> int:
    while True:
        a = int(torch.randint(1, 1 << 31, (1,), generator=gen))
        if math.gcd(a, n) == 1:
            return a


class ZipfPrototypes:
    """Learnable synthetic classification data with Zipf-distributed classes, generated on ``device``.

    ``sample(n)`` returns ``x [n, input_dim]`` float32 and ``target [n]`` int64: the class's prototype (a
    deterministic hash of the class id, unit variance per coordinate) plus Gaussian noise of std
    ``noise``. The class of Zipf rank ``r`` (probability ∝ ``(r+1)^-exponent``) is ``(a r + b) mod V``.
    """

    def __init__(self, num_classes: int, input_dim: int, exponent: float, noise: float, seed: int,
                 device: torch.device):
        gen = torch.Generator().manual_seed(seed)
        self.num_classes, self.input_dim, self.noise, self.device = num_classes, input_dim, noise, device
        self.perm_mult = _coprime_multiplier(num_classes, gen)
        self.perm_add = int(torch.randint(0, num_classes, (1,), generator=gen))
        self.hash_mult = (torch.randint(0, 1 << 31, (input_dim,), generator=gen) * 2 + 1).to(device)
        self.hash_add = torch.randint(0, 1 << 31, (input_dim,), generator=gen).to(device)
        probs = torch.arange(1, num_classes + 1, dtype=torch.float64, device=device).pow_(-exponent)
        self.rank_probs = probs / probs.sum()
        self.cdf = torch.cumsum(self.rank_probs, 0)

    def class_of_rank(self, rank: Tensor) -> Tensor:
        return (rank * self.perm_mult + self.perm_add) % self.num_classes

    @property
    def most_frequent_class(self) -> int:
        return self.perm_add  # rank 0

    def prototypes(self, cls: Tensor) -> Tensor:
        """``[n, input_dim]`` float32 prototypes of class ids ``cls [n]``, recomputed from the ids."""
        h = (cls[:, None] * self.hash_mult + self.hash_add) & _MASK32
        for _ in range(2):
            h = h ^ (h >> 16)
            h = (h * _MIX) & _MASK32
        h = h ^ (h >> 16)
        u = (h.to(torch.float64) + 0.5) * (1.0 / (1 << 32))
        return ((u - 0.5) * math.sqrt(12.0)).to(torch.float32)

    def sample_labels(self, n: int, k: int, gen: torch.Generator) -> Tuple[Tensor, Tensor]:
        """A multi-label sample: ``x [n, input_dim]``, the mean of the prototypes of ``k`` labels drawn from
        the Zipf distribution (a label drawn twice counts once) plus noise, and ``labels [n, k]`` int64."""
        u = torch.rand(n, k, dtype=torch.float64, device=self.device, generator=gen)
        labels = self.class_of_rank(torch.searchsorted(self.cdf, u).clamp_(max=self.num_classes - 1))
        x = self.prototypes(labels.reshape(-1)).view(n, k, -1).mean(dim=1)
        if self.noise:
            x.add_(torch.randn(x.shape, device=self.device, generator=gen), alpha=self.noise / math.sqrt(k))
        return x, labels

    def label_target(self, labels: Tensor, loss: str) -> Tensor:
        """The sparse ``[n, V]`` target of label sets ``[n, k]``: 1 per label for one-vs-all, the set's
        share (1/k per draw, a label drawn twice counts twice) for the softmax."""
        n, k = labels.shape
        rows = torch.arange(n, device=labels.device).repeat_interleave(k)
        value = 1.0 / k if loss == "softmax" else 1.0
        t = torch.sparse_coo_tensor(torch.stack([rows, labels.reshape(-1)]),
                                    torch.full((n * k,), value, device=labels.device), (n, self.num_classes))
        t = t.coalesce()
        if loss != "softmax":  # a label drawn twice is still one positive
            t = torch.sparse_coo_tensor(t.indices(), t.values().clamp(max=1.0), t.shape).coalesce()
        return t

    def sample(self, n: int, gen: torch.Generator) -> Tuple[Tensor, Tensor]:
        u = torch.rand(n, dtype=torch.float64, device=self.device, generator=gen)
        rank = torch.searchsorted(self.cdf, u).clamp_(max=self.num_classes - 1)
        target = self.class_of_rank(rank)
        x = self.prototypes(target)
        if self.noise:
            x.add_(torch.randn(x.shape, device=self.device, generator=gen), alpha=self.noise)
        return x, target


class Backbone(nn.Sequential):
    """``[N, input_dim] -> [N, dim]``: a two-hidden-layer GELU MLP with a final LayerNorm."""

    def __init__(self, input_dim: int, hidden: int, dim: int):
        super().__init__(
            nn.Linear(input_dim, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
            nn.Linear(hidden, dim), nn.LayerNorm(dim),
        )


def _adam(backbone: nn.Module, head: nn.Module, lr: float, head_dtype: torch.dtype) -> torch.optim.Optimizer:
    """Adam over the backbone and every shard, fused (no parameter-sized temporaries: matters for
    multi-GiB shards) where supported. A float16 head gets ``eps=1e-4``: its second moments underflow
    float16, and ``1e-8`` is 0 there."""
    groups = [dict(params=list(backbone.parameters())),
              dict(params=list(head.parameters()), eps=1e-4 if head_dtype == torch.float16 else 1e-8)]
    try:
        return torch.optim.Adam(groups, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(groups, lr=lr, foreach=False)


# --------------------------------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(backbone: nn.Module, head: nn.Module, x: Tensor, target: Tensor, batch: int,
             dtype: torch.dtype, autocast: str = "off") -> Tuple[float, float]:
    """Held-out ``(mean loss, top-1 accuracy)``, ``batch`` rows at a time."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[0], batch):
        t = target[i:i + batch]
        with _autocast(autocast, x.device):
            feats = _features(backbone, x[i:i + batch], dtype, autocast)
            loss_sum += head(feats, t).double() * t.shape[0]
            _, top = head.topk(feats, 1)
        correct += (top[:, 0].to(t.device) == t).sum()
    n = x.shape[0]
    return float(loss_sum) / n, int(correct) / n


@torch.no_grad()
def evaluate_multilabel(backbone: nn.Module, head: nn.Module, data: "ZipfPrototypes", x: Tensor, labels: Tensor,
                        batch: int, dtype: torch.dtype, loss_kind: str, autocast: str = "off") -> Dict[str, float]:
    """Held-out mean loss, precision@1/@5 and nDCG@5 (:mod:`hugehead.metrics`) of a multi-label task."""
    from . import metrics

    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    tops = []
    for i in range(0, x.shape[0], batch):
        lab = labels[i:i + batch]
        with _autocast(autocast, x.device):
            feats = _features(backbone, x[i:i + batch], dtype, autocast)
            loss_sum += head(feats, data.label_target(lab, loss_kind)).double() * lab.shape[0]
            tops.append(head.topk(feats, min(5, data.num_classes))[1].to(x.device))
    top = torch.cat(tops)
    label_lists = [row.unique() for row in labels]
    p = metrics.precision_at_k(top, label_lists, [1, 5] if top.shape[1] >= 5 else [1])
    ndcg = metrics.ndcg_at_k(top, label_lists, min(5, top.shape[1]))
    return dict(loss=float(loss_sum) / x.shape[0], p1=float(p[0]), p5=float(p[-1]), ndcg5=float(ndcg.reshape(-1)[0]))


def _autocast(mode: str, device: torch.device):
    """``torch.autocast`` in bfloat16 on ``device``'s type for ``--autocast bfloat16``, else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bfloat16")


def _features(backbone: nn.Module, x: Tensor, dtype: torch.dtype, autocast: str) -> Tensor:
    """The backbone's features for the head: cast to the head's dtype, except under autocast, where the
    head casts them itself (float32 master weights, compute in the autocast dtype)."""
    feats = backbone(x)
    return feats if autocast != "off" else feats.to(dtype)


def _sync(devices: Sequence[torch.device]) -> None:
    for dev in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(dev)


def peak_memory(devices: Sequence[torch.device]) -> Dict[str, int]:
    """Peak bytes per device: ``torch.cuda.max_memory_allocated`` per GPU, peak RSS of this process for CPU."""
    peaks: Dict[str, int] = {}
    for dev in devices:
        if dev.type == "cuda":
            peaks[str(dev)] = int(torch.cuda.max_memory_allocated(dev))
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peaks["cpu"] = int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux
    return peaks


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _plot(path: Path, history: dict, chance: float, majority: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps = list(range(1, len(history["step_loss"]) + 1))
    ax_loss.plot(steps, history["step_loss"], lw=0.6, alpha=0.5, label="train (per step)")
    ax_loss.plot(history["epoch_end_step"], history["train_loss"], "o-", label="train (epoch mean)")
    ax_loss.plot(history["eval_step"], history["eval_loss"], "s-", label="held-out")
    ax_loss.axhline(math.log(history["num_classes"]), color="gray", ls=":", label="ln V (uniform guess)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.legend()
    ax_loss.set_title("loss")
    ax_acc.plot(history["eval_step"], [100 * a for a in history["eval_accuracy"]], "s-", color="C2",
                label="held-out top-1")
    ax_acc.axhline(100 * majority, color="C3", ls="--", label=f"always the most frequent class ({100 * majority:.1f}%)")
    ax_acc.axhline(100 * chance, color="gray", ls=":", label=f"uniform chance ({100 * chance:.2g}%)")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.set_ylim(0, 100)
    ax_acc.legend(loc="upper left")
    ax_acc.set_title("held-out accuracy")
    fig.suptitle(f"hugehead demo: {history['num_classes']:,} classes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _epoch_ends(total: int, epochs: int, done: int) -> List[int]:
    """Steps after which to evaluate: ``epochs`` even splits of ``total``, none before step ``done``."""
    return sorted({max(done, round(total * (e + 1) / epochs)) for e in range(epochs)} - {0})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo; returns 0. See ``python -m hugehead.demo --help``.

    Raises:
        SystemExit: with a message for an impossible request (devices, dtype, a size that cannot fit).
    """
    start = _START if __name__ == "__main__" else time.perf_counter()
    args = parse_args(argv)
    check_fits(args)
    torch.manual_seed(args.seed)
    devices, first, dtype = args.devices, args.devices[0], args.dtype
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but the demo should still run without it
        tqdm = None

    data = ZipfPrototypes(args.classes, args.input_dim, args.zipf, args.noise, args.seed, first)
    train_gen = torch.Generator(device=first).manual_seed(args.seed + 1)
    eval_gen = torch.Generator(device=first).manual_seed(args.seed + 2)
    multilabel = args.labels > 1
    if multilabel:  # y_eval: the rows' first labels (for the always-most-frequent baseline's share)
        x_eval, labels_eval = data.sample_labels(args.eval_size, args.labels, eval_gen)
        y_eval = labels_eval[:, 0]
    else:
        x_eval, y_eval = data.sample(args.eval_size, eval_gen)
    head_loss = "binary_cross_entropy" if multilabel and args.multilabel_loss == "ova" else "cross_entropy"

    backbone = Backbone(args.input_dim, args.hidden, args.dim).to(first)
    head = hugehead.ChunkedClassifier(args.dim, args.classes, devices=[str(d) for d in devices], dtype=dtype,
                                      memory_budget=_WORKSPACE_BUDGET, offload=args.offload, loss=head_loss)
    optimizer = _adam(backbone, head, args.lr, dtype)
    shard_info = [dict(device=str(s.device), start=int(s.start), stop=int(s.stop)) for s in head.shards]
    if args.offload:
        for info, s in zip(shard_info, head.shards):
            info["device"] = f"{s.device}->{s.compute_device}"  # lives in pinned host memory, computes there

    chance = 1.0 / args.classes
    majority = float((y_eval == data.most_frequent_class).double().mean())
    if multilabel:  # P@1 of always predicting the most frequent class
        majority = float((labels_eval == data.most_frequent_class).any(dim=1).double().mean())
    expected_majority = float(data.rank_probs[0])
    steps_text = f"{args.steps} steps" if args.steps else f"steps to fit {args.time_budget:.0f} s"
    print(f"hugehead.demo: {args.classes:,} classes, D={args.dim}, {_dtype_name(dtype)}, batch {args.batch}, "
          f"{steps_text}; head shards{' (offloaded: pinned host memory)' if args.offload else ''}: "
          + ", ".join(f"{s['device']}[{s['start']:,}:{s['stop']:,})" for s in shard_info), flush=True)

    history = dict(num_classes=args.classes, step_loss=[], train_loss=[], epoch_end_step=[], epoch_seconds=[],
                   eval_step=[], eval_loss=[], eval_accuracy=[], eval_p5=[], eval_ndcg5=[])

    def run_eval(step: int) -> float:
        t0 = time.perf_counter()
        if multilabel:  # "accuracy" is precision@1 here
            r = evaluate_multilabel(backbone, head, data, x_eval, labels_eval, args.batch, dtype,
                                    args.multilabel_loss, args.autocast)
            loss, acc = r["loss"], r["p1"]
            history["eval_p5"].append(r["p5"])
            history["eval_ndcg5"].append(r["ndcg5"])
        else:
            loss, acc = evaluate(backbone, head, x_eval, y_eval, args.batch, dtype, args.autocast)
        history["eval_step"].append(step)
        history["eval_loss"].append(loss)
        history["eval_accuracy"].append(acc)
        return time.perf_counter() - t0

    # Step 0: the untrained model (at chance); also times one evaluation for the budget.
    eval_seconds = run_eval(0)
    deadline = None if args.time_budget is None else start + args.time_budget
    total = args.steps
    ends = _epoch_ends(total, args.epochs, 0) if total else []
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, disable=args.no_progress) if tqdm else None
    write = bar.write if bar is not None else print
    step, epoch_losses, stopped_early = 0, [], False
    train_seconds, t_epoch = 0.0, time.perf_counter()
    t_train = t_epoch
    while total is None or step < total:
        if multilabel:
            x, labels = data.sample_labels(args.batch, args.labels, train_gen)
            target = data.label_target(labels, args.multilabel_loss)
        else:
            x, target = data.sample(args.batch, train_gen)
        with _autocast(args.autocast, x.device):
            loss = head(_features(backbone, x, dtype, args.autocast), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        epoch_losses.append(loss.detach())
        step += 1
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        evals_left = args.epochs - len(history["epoch_end_step"])
        if total is None and step == 1:
            _sync(devices)
            t_warm = time.perf_counter()
        if total is None and step == 1 + _CALIBRATION_STEPS:
            _sync(devices)
            per_step = (time.perf_counter() - t_warm) / _CALIBRATION_STEPS
            left = deadline - time.perf_counter() - evals_left * 1.2 * eval_seconds - _RESERVE_SECONDS
            total = min(_MAX_AUTO_STEPS, max(step, args.epochs, step + int(left / per_step)))
            ends = _epoch_ends(total, args.epochs, step)
            if bar is not None:
                bar.total = total
                bar.refresh()
            write(f"auto: {total} steps fit the {args.time_budget:.0f} s budget "
                  f"({per_step:.2f} s/step, {eval_seconds:.1f} s per evaluation)")
        late = (deadline is not None and step not in ends
                and time.perf_counter() + evals_left * 1.2 * eval_seconds + _RESERVE_SECONDS > deadline)
        if step in ends or late:
            losses = torch.stack(epoch_losses).float().cpu().tolist()
            _sync(devices)
            train_seconds += time.perf_counter() - t_epoch
            eval_seconds = run_eval(step)
            history["step_loss"].extend(losses)
            history["train_loss"].append(sum(losses) / len(losses))
            history["epoch_end_step"].append(step)
            history["epoch_seconds"].append(time.perf_counter() - t_epoch)
            write(f"epoch {len(history['epoch_end_step'])}/{len(ends)} (step {step}): train loss "
                  f"{history['train_loss'][-1]:.3f}  held-out loss {history['eval_loss'][-1]:.3f}  "
                  f"held-out {'P@1' if multilabel else 'accuracy'} {100 * history['eval_accuracy'][-1]:.2f}%")
            epoch_losses, t_epoch = [], time.perf_counter()
            if late:
                stopped_early = True
                write(f"stopping at step {step} to stay within --time-budget {args.time_budget:.0f} s")
                break
    if bar is not None:
        bar.close()
    steps_done = step

    itemsize = torch.empty((), dtype=dtype).element_size()
    logits_bytes = args.batch * args.classes * itemsize
    peaks = peak_memory(list(devices) + ([torch.device("cpu")] if args.offload else []))
    final_acc = history["eval_accuracy"][-1]
    print()
    what = "held-out precision@1  " if multilabel else "held-out top-1 accuracy"
    print(f"{what}   {100 * final_acc:.2f}%   on {args.eval_size:,} samples "
          f"(untrained: {100 * history['eval_accuracy'][0]:.2f}%)")
    if multilabel:
        print(f"held-out precision@5     {100 * history['eval_p5'][-1]:.2f}%   nDCG@5 {100 * history['eval_ndcg5'][-1]:.2f}%"
              f"   ({args.labels} Zipf-drawn labels per sample, {head_loss})")
    print(f"  always-most-frequent    {100 * majority:.2f}%   (expected {100 * expected_majority:.2f}%)")
    print(f"  uniform chance 1/V      {100 * chance:.5f}%")
    print(f"train: {steps_done} steps in {train_seconds:.1f} s "
          f"({steps_done * args.batch / train_seconds:,.0f} samples/s); wall time so far "
          f"{time.perf_counter() - start:.1f} s")
    print("peak memory per device:")
    for dev, b in peaks.items():
        what = "process peak RSS" if dev == "cpu" else "torch.cuda.max_memory_allocated"
        print(f"  {dev:8s} {_fmt_bytes(b):>12s}  ({what})")
    print(f"plain nn.Linear + F.cross_entropy at N={args.batch}, V={args.classes:,}, {_dtype_name(dtype)} "
          f"would need {_fmt_bytes(2 * logits_bytes)} for the logits alone "
          f"({_fmt_bytes(logits_bytes)} + {_fmt_bytes(logits_bytes)} for their gradient), on one device")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    _plot(out / "training.png", history, chance, majority)
    summary = dict(
        hugehead_version=hugehead.__version__, torch_version=torch.__version__, python=platform.python_version(),
        argv=list(sys.argv[1:] if argv is None else argv),
        config=dict(classes=args.classes, dim=args.dim, input_dim=args.input_dim, hidden=args.hidden,
                    batch=args.batch, steps=steps_done, steps_requested=args.steps or "auto",
                    epochs=args.epochs, eval_size=args.eval_size, dtype=_dtype_name(dtype), lr=args.lr,
                    zipf=args.zipf, noise=args.noise, seed=args.seed, time_budget=args.time_budget,
                    devices=[str(d) for d in devices], offload=args.offload, autocast=args.autocast,
                    offload_stats=head.offload_stats),
        shards=shard_info,
        final=dict(eval_accuracy=final_acc, eval_loss=history["eval_loss"][-1],
                   untrained_eval_accuracy=history["eval_accuracy"][0],
                   chance_uniform=chance, chance_most_frequent=majority,
                   chance_most_frequent_expected=expected_majority,
                   accuracy_over_most_frequent=final_acc / majority if majority else None,
                   stopped_early=stopped_early,
                   **(dict(labels=args.labels, multilabel_loss=args.multilabel_loss,
                           eval_precision_at_1=final_acc, eval_precision_at_5=history["eval_p5"][-1],
                           eval_ndcg_at_5=history["eval_ndcg5"][-1]) if multilabel else {})),
        epochs=[dict(epoch=i + 1, end_step=s, train_loss=tl, eval_loss=el, eval_accuracy=ea, seconds=sec)
                for i, (s, tl, el, ea, sec) in enumerate(zip(history["epoch_end_step"], history["train_loss"],
                                                             history["eval_loss"][1:], history["eval_accuracy"][1:],
                                                             history["epoch_seconds"]))],
        step_loss=history["step_loss"],
        timing=dict(train_seconds=train_seconds, loop_seconds=time.perf_counter() - t_train,
                    samples_per_second=steps_done * args.batch / train_seconds,
                    wall_seconds=time.perf_counter() - start),
        memory=dict(peak_bytes=peaks,
                    peak_kind={d: ("process_peak_rss" if d == "cpu" else "cuda_max_memory_allocated") for d in peaks},
                    estimated_bytes={str(d): b for d, b in estimate_bytes_per_device(args).items()},
                    plain_logits_bytes=logits_bytes, plain_logits_grad_bytes=logits_bytes,
                    plain_logits_total_bytes=2 * logits_bytes),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'training.png'} and {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
