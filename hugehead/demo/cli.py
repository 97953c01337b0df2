"""The demo's command line: the parser, machine-dependent defaults, ``--devices`` and ``--dtype``."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import List, Optional, Sequence

import torch

import hugehead

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Defaults per machine kind. CPU: steps=None means "as many as fit --time-budget", measured after a few
# steps, so the whole run (startup included) stays under two minutes on 2 cores. GPU: the seed issue's
# 6M-class head at BERT width.
_DEFAULTS = {
    "cpu": dict(classes=200_000, dim=64, input_dim=64, hidden=256, batch=256, steps=None, epochs=4,
                eval_size=1024, dtype="float32", lr=3e-3, time_budget=100.0),
    "cuda": dict(classes=6_000_000, dim=768, input_dim=128, hidden=1024, batch=4096, steps=400, epochs=4,
                 eval_size=16384, dtype="bfloat16", lr=3e-3, time_budget=None),
}

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
                parser.error(f"--dtype {dtype_name(args.dtype)} is not supported by hugehead on {dev}; "
                             "use --dtype float32")
    return args


def dtype_name(dtype: torch.dtype) -> str:
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
