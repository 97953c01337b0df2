"""Build hygiene of the compiled module: it must not export C++ standard library symbols (a statically
linked libstdc++ copy interposing on the process's one crashed torch on the H200 image), and the
dispatcher must hold a CPU kernel for every op (CUDA kernels too where the build has them)."""
import shutil
import subprocess

import pytest
import torch

import hugehead
from hugehead import _extension

OPS = ("chunk_stats_", "chunk_grad_")


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_module_exports_no_std_library_symbols():
    path = _extension._C.__file__
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    # Weak ("W") template instantiations from headers are normal; a strong ("T") definition of a
    # standard-library or C++-runtime function means a static copy of the runtime is being exported.
    runtime = ("_ZNSt", "_ZSt", "_ZNKSt", "__cxa_", "__gxx_", "_ZNSs", "_ZNSi", "_ZNSo")
    leaked = [
        line for line in out.splitlines()
        if len(line.split()) == 3 and line.split()[1] == "T" and line.split()[2].startswith(runtime)
    ]
    assert not leaked, f"{path} exports C++ runtime symbols:\n" + "\n".join(leaked[:20])


@pytest.mark.parametrize("op", OPS)
def test_dispatcher_has_kernels(op):
    assert hugehead.has_kernel(op, "CPU")
    if hugehead.cuda_built():
        assert hugehead.has_kernel(op, "CUDA")
    assert str(getattr(torch.ops.hugehead, op).default._schema).startswith(f"hugehead::{op}(")


def test_missing_backend_kernels_give_a_rebuild_message(monkeypatch):
    monkeypatch.setitem(_extension._HAS_KERNELS, "CUDA", False)
    with pytest.raises(RuntimeError, match=r"no CUDA kernels.*HUGEHEAD_CUDA=ON pip install --no-build-isolation"):
        _extension.require_kernels(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="tensors on meta are not supported"):
        _extension.require_kernels(torch.device("meta"))
    _extension.require_kernels(torch.device("cpu"))  # CPU kernels are always built
