"""What the demo reports: peak memory per device, byte counts for people, the training plot."""
from __future__ import annotations

import math
import resource
import sys
from pathlib import Path
from typing import Dict, Sequence

import torch

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


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def plot_history(path: Path, history: dict, chance: float, majority: float, metric: str) -> None:
    """Write the loss and held-out ``metric`` (e.g. ``"top-1 accuracy"``, ``"P@1"``) curves to ``path``."""
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
                label=f"held-out {metric}")
    ax_acc.axhline(100 * majority, color="C3", ls="--", label=f"always the most frequent class ({100 * majority:.1f}%)")
    ax_acc.axhline(100 * chance, color="gray", ls=":", label=f"uniform chance ({100 * chance:.2g}%)")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel(f"{metric} (%)")
    ax_acc.set_ylim(0, 100)
    ax_acc.legend(loc="upper left")
    ax_acc.set_title(f"held-out {metric}")
    fig.suptitle(f"hugehead demo: {history['num_classes']:,} classes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
