"""python -m hugehead.info: what the build recorded and what runs here; the GEMM path and kernel image
each GPU would get, decided from the recorded build (checked on the CPU with made-up GPUs)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import hugehead
from hugehead import info
from hugehead._extension import _C

CUTLASS_BUILD = {"torch": "2.13.0+cu130", "torch_cuda": "13.0", "build_type": "Release", "cuda": True,
                 "nvcc": "13.0.88", "cuda_archs": ["80-real", "86-real", "90-real", "100-real", "120"],
                 "cutlass": True, "cutlass_why": "CUTLASS 4.2.0 headers at /x", "cutlass_archs": ["90a"]}


def test_build_info_is_what_the_extension_recorded():
    build = info.build_info()
    assert build == json.loads(_C.build_info())
    assert build["cuda"] is bool(_C.cuda_built()) and build["cutlass"] is bool(_C.cutlass_built())
    assert build["torch"] == torch.__version__  # built against the torch that runs these tests
    if not build["cuda"]:
        assert build["cuda_archs"] == [] and build["cutlass_why"] == "this build has no CUDA"


@pytest.mark.skipif(hugehead.cuda_built(), reason="the CPU build's report")
def test_cpu_build_report_says_cutlass_is_off_because_there_is_no_cuda():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "hugehead.info"], capture_output=True, text=True, timeout=120,
                         env=env, check=True).stdout.splitlines()
    assert out[0] == f"hugehead {hugehead.__version__}"
    assert out[1] == f"torch: {torch.__version__} (CUDA none)"
    assert out[2] == "CUDA kernels: off: this build has no CUDA (CPU kernels only)"
    assert out[3] == "CUTLASS GEMMs: off: this build has no CUDA"
    assert out[4] == "GPUs: none visible to torch"
    assert out[5].startswith("OpenMP threads: 1 ")
    assert info.summary().endswith("| CUTLASS off (this build has no CUDA) | no GPU | "
                                   f"{torch.get_num_threads()} CPU threads")


@pytest.mark.parametrize("capability, path, why", [
    ((9, 0), "fused CUTLASS", "sm_90a"),
    ((8, 0), "cuBLAS fallback", "this GPU is sm_80"),
    ((10, 0), "cuBLAS fallback", "this GPU is sm_100"),
])
def test_gemm_path_of_each_gpu(capability, path, why):
    got, reason = info.gemm_path_for(capability, CUTLASS_BUILD)
    assert got == path and why in reason
    no_cutlass = {**CUTLASS_BUILD, "cutlass": False, "cutlass_why": "no CUTLASS headers"}
    assert info.gemm_path_for(capability, no_cutlass) == (
        "cuBLAS fallback", "this build has no CUTLASS GEMMs (no CUTLASS headers)")


@pytest.mark.parametrize("capability, kernels", [
    ((8, 0), "sm_80 SASS"), ((8, 6), "sm_86 SASS"), ((8, 9), "sm_86 SASS"), ((9, 0), "sm_90 SASS"),
    ((10, 3), "sm_100 SASS"), ((12, 0), "sm_120 SASS"), ((12, 1), "sm_120 SASS"),
    ((13, 0), "compute_120 PTX (JIT compiled at first use)"), ((7, 5), None),
])
def test_kernel_image_of_each_gpu(capability, kernels):
    assert info.kernels_for(capability, CUTLASS_BUILD["cuda_archs"]) == kernels
    assert info.kernels_for(capability, ["90a-real"]) == ("sm_90 SASS" if capability == (9, 0) else None)
    assert info.kernels_for(capability, ["native"]) == "as CMake chose for native"


def test_report_of_a_cuda_build_with_an_a100_and_an_h100():
    gpus = [{"index": i, "name": name, "capability": list(cc), "fused": cc == (9, 0),
             "gemm_path": info.gemm_path_for(cc, CUTLASS_BUILD)[0], "why": info.gemm_path_for(cc, CUTLASS_BUILD)[1],
             "kernels": info.kernels_for(cc, CUTLASS_BUILD["cuda_archs"])}
            for i, (name, cc) in enumerate([("NVIDIA H100", (9, 0)), ("NVIDIA A100", (8, 0))])]
    state = {"hugehead": "0.2.0", "torch": "2.13.0+cu130", "torch_cuda": "13.0", "build": CUTLASS_BUILD,
             "gpus": gpus, "cpu_threads": 8}
    lines = info.format_report(state).splitlines()
    assert lines[2] == "CUDA kernels: on (nvcc 13.0.88; architectures 80-real;86-real;90-real;100-real;120)"
    assert lines[3] == "CUTLASS GEMMs: on (CUTLASS 4.2.0 headers at /x; sm_90a)"
    assert lines[4].startswith("GPU 0: NVIDIA H100 (sm_90): GEMM path fused CUTLASS: ")
    assert lines[5] == ("GPU 1: NVIDIA A100 (sm_80): GEMM path cuBLAS fallback: the fused GEMMs are sm_90a code "
                        "and this GPU is sm_80; generic kernels: sm_80 SASS")
    assert "note" not in "\n".join(lines)
    assert info.summary(state) == ("hugehead 0.2.0 | torch 2.13.0+cu130 | CUDA 80-real;86-real;90-real;100-real;120 "
                                   "| CUTLASS on | GPU 0 NVIDIA H100: fused CUTLASS | 8 CPU threads")
    stale = {**state, "torch": "2.14.0+cu130"}
    assert "built against torch 2.13.0+cu130 (CUDA 13.0): rebuild for this torch" in info.format_report(stale)
