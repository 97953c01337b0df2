"""hugehead: classification heads too big for one GPU or too wide to materialize.

``linear_cross_entropy`` computes ``F.cross_entropy(F.linear(x, W, b), target)`` in streamed vocabulary
chunks with our own kernels; ``ChunkedClassifier`` keeps the weight as shards on several devices.
"""
from ._extension import cuda_built, has_kernel
from . import ops
from .functional import linear_cross_entropy
from .logprob import linear_log_prob
from .onevsall import linear_binary_cross_entropy
from .sparse import CsrTarget, csr_target
from .topk import linear_topk
from .module import ChunkedClassifier
from .distill import linear_distill
from . import checkpoint
from .checkpoint import keep_optimizer_state_on_shards, place_optimizer_state
from .ddp import ignore_heads_in_ddp
from .predict import predict_topk, predict_topk_chunks

__version__ = "0.2.0"
__all__ = ["linear_cross_entropy", "linear_log_prob", "linear_distill", "linear_topk", "linear_binary_cross_entropy", "csr_target", "CsrTarget", "ChunkedClassifier", "ops", "cuda_built", "has_kernel", "__version__",
           "checkpoint", "keep_optimizer_state_on_shards", "place_optimizer_state", "ignore_heads_in_ddp",
           "predict_topk", "predict_topk_chunks", "metrics"]


def __getattr__(name):
    # hugehead.metrics imports torchmetrics (seconds): loaded on first use, not with the package.
    if name == "metrics":
        import importlib

        return importlib.import_module(".metrics", __name__)
    raise AttributeError(f"module 'hugehead' has no attribute {name!r}")
