"""What the examples share: the frame of their command lines (GPU or CPU-smoke defaults, the head's
devices, the synthetic sequences' options) and the fused-optimizer fallback. Their synthetic data lives in
the examples that first needed it (``ddp_train.synthetic_batch``, ``lightning_6m.synthetic_sequences``)."""
from __future__ import annotations

import argparse
from typing import Dict, Iterable, List, Optional

import torch

import hugehead


def example_parser(doc: str) -> argparse.ArgumentParser:
    """An example's parser: the first paragraph of its docstring as the description, the rest kept as written."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)


def add_sequence_args(p: argparse.ArgumentParser) -> None:
    """The options of ``lightning_6m.synthetic_sequences``, the token sequences the Lightning examples learn."""
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--token-vocab", type=int, default=4096)
    p.add_argument("--corrupt", type=float, default=0.25, help="fraction of tokens replaced at random")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the class frequencies")


def add_size_args(p: argparse.ArgumentParser, what: Dict[str, str], gpu: Dict[str, object],
                  smoke: Dict[str, object], smoke_name: str = "--cpu") -> None:
    """Integer options ``--classes``, ``--dim``, ... (``what``: option -> description), left None on the
    command line so that :func:`fill_defaults` gives them the GPU or the smoke-run size; the help names both."""
    for key, text in what.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"{text} (GPU {gpu[key]}, {smoke_name} {smoke[key]})")


def fill_defaults(args: argparse.Namespace, defaults: Dict[str, object]) -> argparse.Namespace:
    """Every option left at None takes its value from ``defaults`` (the GPU or the CPU-smoke sizes)."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def require_gpu_unless_cpu(p: argparse.ArgumentParser, cpu: bool) -> None:
    """Exit with a message (not a traceback deep in Lightning) when a GPU run finds no usable GPU."""
    if not cpu and not (torch.cuda.is_available() and hugehead.has_kernel("chunk_stats_", "CUDA")):
        p.error("no CUDA GPU (or hugehead was built without CUDA kernels); pass --cpu for the CPU smoke run")


def require_positive(p: argparse.ArgumentParser, args: argparse.Namespace, keys: Iterable[str]) -> None:
    for key in keys:
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")


def head_devices(spec: Optional[str], cpu: bool) -> List[str]:
    """``--head-devices``: a comma list, or by default two CPU shards (``--cpu``) or every visible GPU."""
    if spec is None:
        return ["cpu", "cpu"] if cpu else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [d.strip() for d in spec.split(",") if d.strip()]


def fused_optimizer(optimizer_class, params, **kwargs) -> torch.optim.Optimizer:
    """``optimizer_class(params, fused=True)`` where supported (no parameter-sized temporaries: it matters for
    multi-GiB shards), else the per-parameter loop."""
    try:
        return optimizer_class(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return optimizer_class(params, foreach=False, **kwargs)
