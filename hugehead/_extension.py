"""Loads hugehead._C (which registers torch.ops.hugehead.*) with an actionable error when it is missing."""
import importlib

_REBUILD = (
    "Rebuild it from the repository root with:\n"
    "    pip install --no-build-isolation .      (torch must already be installed)\n"
    "or, on a machine with nvcc and a CUDA torch, HUGEHEAD_CUDA=ON pip install --no-build-isolation ."
)


def load():
    """Import hugehead._C; raise ImportError saying what failed and how to rebuild."""
    try:
        return importlib.import_module("hugehead._C")
    except ModuleNotFoundError as exc:
        if exc.name != "hugehead._C":
            raise
        raise ImportError(
            "hugehead's compiled extension hugehead._C is not built (are you importing the source tree "
            "without installing it?). " + _REBUILD
        ) from exc
    except ImportError as exc:
        raise ImportError(
            f"hugehead._C exists but failed to load: {exc}. This usually means it was built against "
            "another torch version than the one installed now. " + _REBUILD
        ) from exc


_C = load()


def cuda_built() -> bool:
    """True when the loaded extension includes the CUDA kernels."""
    return bool(_C.cuda_built())


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Ask the dispatcher whether ``torch.ops.hugehead.<op>`` has a kernel for ``dispatch_key``."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(f"hugehead::{op}", dispatch_key)
