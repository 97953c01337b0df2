"""Loads hugehead._C (which registers torch.ops.hugehead.*) with an actionable error when it is missing."""
import importlib
from pathlib import Path
from typing import Optional

_REBUILD = (
    "Rebuild it from the repository root with:\n"
    "    pip install --no-build-isolation .      (torch must already be installed)\n"
    "or, on a machine with nvcc and a CUDA torch, HUGEHEAD_CUDA=ON pip install --no-build-isolation ."
)


def _installed_copy(package_dir: Path) -> Optional[Path]:
    """Where pip installed hugehead (its package folder) when that is not ``package_dir``, else None."""
    try:
        from importlib import metadata

        dist = metadata.distribution("hugehead")
        located = Path(str(dist.locate_file("hugehead/__init__.py"))).resolve().parent
    except Exception:  # noqa: BLE001  (no installed distribution, or an unusual installer: say nothing)
        return None
    if located != package_dir and any(located.glob("_C*")):
        return located
    return None


def missing_extension_message(package_dir: Path) -> str:
    """What to say when hugehead._C is not next to ``package_dir``'s ``__init__.py``."""
    package_dir = Path(package_dir).resolve()
    source_tree = (package_dir.parent / "setup.py").exists() and (package_dir.parent / "csrc").is_dir()
    if not source_tree:
        return "hugehead's compiled extension hugehead._C is not built. " + _REBUILD
    installed = _installed_copy(package_dir)
    where = f" (it is at {installed})" if installed else ""
    return (
        f"hugehead was imported from the source tree {package_dir}, not from the installed package{where}: "
        "Python puts the current directory (or the script's) first on sys.path, and this tree has no compiled "
        "hugehead._C, because a plain `pip install .` builds _C into the installed copy only. Two ways out:\n"
        f"  1. run from another directory than {package_dir.parent} (the installed hugehead is then imported), or\n"
        "  2. build into this tree: pip install --no-build-isolation -e .   (editable; or python setup.py "
        "build_ext --inplace)"
    )


def load():
    """Import hugehead._C; raise ImportError saying what failed and how to get out of it."""
    try:
        return importlib.import_module("hugehead._C")
    except ModuleNotFoundError as exc:
        if exc.name != "hugehead._C":
            raise
        raise ImportError(missing_extension_message(Path(__file__).parent)) from exc
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


_KERNEL_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
# Registrations are fixed once _C is loaded: read them once, so the check is a plain dict lookup that
# torch.compile traces through (the dispatcher query itself is opaque to Dynamo).
_HAS_KERNELS = {key: has_kernel("chunk_stats_", key) for key in _KERNEL_KEYS.values()}


def require_kernels(device) -> None:
    """Raise a RuntimeError with the rebuild command when hugehead's kernels for ``device``'s type are
    not registered (e.g. a CPU-only build used with CUDA tensors), instead of the dispatcher's error."""
    key = _KERNEL_KEYS.get(device.type)
    if key is None:
        raise ValueError(f"hugehead: tensors on {device} are not supported; hugehead runs on 'cpu' and 'cuda'")
    if not _HAS_KERNELS[key]:
        raise RuntimeError(
            f"hugehead: this build has no {key} kernels (hugehead.cuda_built() is {cuda_built()}). Rebuild on a "
            "machine with nvcc and a CUDA torch with: HUGEHEAD_CUDA=ON pip install --no-build-isolation ."
        )
