"""``python -m hugehead.demo``: the main job. Trains a small MLP backbone plus a
:class:`hugehead.ChunkedClassifier` with hundreds of thousands (CPU) or millions (GPUs) of classes on
synthetic data that is actually learnable, then reports held-out accuracy against two chance levels,
peak memory per device and what plain ``nn.Linear`` + ``F.cross_entropy`` logits would have needed.

The data: class ``c`` has a prototype ``p_c`` in ``R^{D_in}`` derived from ``c`` by an integer hash (no
``V × D_in`` table, so 6M classes cost nothing to store); a sample of class ``c`` is ``p_c + noise``.
Classes are drawn from a Zipf law over a fixed permutation of the class ids, so a short run sees the
frequent classes many times (and they land on every shard), while the rare ones are seen rarely or
never, as in real extreme classification.

Where it lives: :mod:`.cli` (the command line and its defaults), :mod:`.fit` (will it fit: the memory
estimate and ``--offload auto``), :mod:`.data` (the synthetic data), :mod:`.model` (backbone, optimizer,
evaluation), :mod:`.train` (the run itself), :mod:`.report` (peak memory and the plot).
"""
import time

_START = time.perf_counter()  # `python -m hugehead.demo`: the time budget counts the demo's imports too

from .cli import parse_args, resolve_devices  # noqa: E402
from .data import ZipfPrototypes  # noqa: E402
from .fit import available_bytes, balanced_shard_sizes, check_fits, estimate_bytes_per_device  # noqa: E402
from .model import Backbone, evaluate, evaluate_multilabel  # noqa: E402
from .report import peak_memory  # noqa: E402
from .train import main  # noqa: E402

__all__ = ["main", "parse_args", "resolve_devices", "ZipfPrototypes", "Backbone", "estimate_bytes_per_device",
           "check_fits", "available_bytes", "balanced_shard_sizes", "evaluate", "evaluate_multilabel",
           "peak_memory"]
