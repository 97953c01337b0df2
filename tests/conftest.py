"""Shared test helpers: device/dtype parametrization, markers that skip without the hardware (asking the
dispatcher whether CUDA kernels were built, not guessing from the environment), float64 references."""
import os

import pytest
import torch
from hypothesis import settings

# CI runs the same examples every time (a red CI then means a regression, not a new random draw);
# locally every run explores new ones. HYPOTHESIS_PROFILE=explore forces the latter.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "explore"))

import hugehead

HAS_CUDA_KERNELS = torch.cuda.is_available() and hugehead.has_kernel("chunk_stats_", "CUDA")
NUM_GPUS = torch.cuda.device_count() if HAS_CUDA_KERNELS else 0

requires_cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and hugehead's CUDA kernels")
requires_multigpu = pytest.mark.skipif(NUM_GPUS < 2, reason="needs two or more CUDA GPUs")

DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pytest_collection_modifyitems(config, items):
    # A test gated by requires_cuda / requires_multigpu carries the matching marker, so the GPU machine
    # can select exactly the hardware tests with -m "cuda or multigpu" (CI runs the CPU ones).
    for item in items:
        reasons = [m.kwargs.get("reason", "") for m in item.iter_markers("skipif")]
        if any("needs a CUDA GPU" in r for r in reasons):
            item.add_marker(pytest.mark.cuda)
        if any("two or more CUDA GPUs" in r for r in reasons):
            item.add_marker(pytest.mark.multigpu)
    if os.environ.get("HUGEHEAD_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow: set HUGEHEAD_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ in float64 (NaN if either has NaN)."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref.norm()
    return float((a - ref).norm() / (denom if denom > 0 else 1.0))


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)
