"""``python -m hugehead.info``: what this build of hugehead compiled and what will run on this machine.

What was built comes from the extension itself (``_C.build_info()``, a JSON string CMakeLists.txt writes at
configure time), never from the environment at run time: torch and CUDA versions it compiled against, the
CUDA architectures of the generic kernels, and whether the fused CUTLASS GEMMs are in and why (not). What
will run is asked of this process: the GPUs torch sees, which GEMM path each takes (the fused CUTLASS GEMMs
need a compute capability 9.0 GPU and the CUTLASS build; otherwise cuBLAS), and the CPU threads.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import __version__, ops
from ._extension import _C

__all__ = ["build_info", "collect", "format_report", "summary", "gemm_path_for", "kernels_for", "main"]


def build_info() -> Dict:
    """What the loaded ``hugehead._C`` was built with: ``torch`` / ``torch_cuda`` (the torch it compiled
    against), ``build_type``, ``cuda`` (bool), ``nvcc``, ``cuda_archs`` (CMake style, e.g. ``"80-real"``,
    ``"90"``), ``cutlass`` (bool), ``cutlass_why`` (why on or off), ``cutlass_archs``."""
    if not hasattr(_C, "build_info"):
        raise RuntimeError("hugehead: this hugehead._C was built before builds recorded what they compiled; "
                           "rebuild it: pip install --no-build-isolation .")
    return json.loads(_C.build_info())


def _arch_number(arch: str) -> Optional[Tuple[int, str]]:
    """``"86-real"`` -> ``(86, "real")``; ``"90"`` -> ``(90, "")`` (CMake: SASS and PTX); None for CMake's
    symbolic values (``native``, ``all``, ...)."""
    number, _, kind = arch.partition("-")
    number = number.rstrip("af")
    return (int(number), kind) if number.isdigit() else None


def kernels_for(capability: Tuple[int, int], archs: Sequence[str]) -> Optional[str]:
    """Which code of the generic kernels a GPU of ``capability`` runs, from the built ``archs``: SASS of the
    same major version at or below its minor (binary compatible), else PTX at or below it (JIT compiled at
    first use), else None (no kernel image runs there)."""
    cc = capability[0] * 10 + capability[1]
    parsed = [p for p in map(_arch_number, archs) if p is not None]
    if len(parsed) < len(archs):
        return f"as CMake chose for {';'.join(archs)}"
    sass = [n for n, kind in parsed if kind in ("", "real") and n // 10 == capability[0] and n <= cc]
    if sass:
        return f"sm_{max(sass)} SASS"
    ptx = [n for n, kind in parsed if kind in ("", "virtual") and n <= cc]
    if ptx:
        return f"compute_{max(ptx)} PTX (JIT compiled at first use)"
    return None


def gemm_path_for(capability: Tuple[int, int], build: Dict) -> Tuple[str, str]:
    """``("fused CUTLASS" | "cuBLAS fallback", why)`` for the logits GEMMs of bfloat16/float16 heads on a GPU
    of ``capability`` under ``build`` (:func:`build_info`). float32 and float64 heads always use cuBLAS."""
    if not build["cuda"]:
        return "cuBLAS fallback", "this build has no CUDA"
    if not build["cutlass"]:
        return "cuBLAS fallback", f"this build has no CUTLASS GEMMs ({build['cutlass_why']})"
    if tuple(capability) != (9, 0):
        return "cuBLAS fallback", (f"the fused GEMMs are sm_90a code and this GPU is "
                                   f"sm_{capability[0]}{capability[1]}")
    return "fused CUTLASS", "sm_90a GEMMs with fused epilogues (bfloat16/float16 heads)"


def _gpus(build: Dict) -> List[Dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        path, why = gemm_path_for(capability, build)
        # The dispatcher's own answer (what the loop asks at every chunk) must agree with the explanation.
        fused = ops.has_fused_gemm(torch.device("cuda", index), torch.bfloat16)
        out.append({"index": index, "name": torch.cuda.get_device_name(index), "capability": list(capability),
                    "gemm_path": path, "why": why, "fused": fused,
                    "kernels": kernels_for(capability, build["cuda_archs"]) if build["cuda"] else None})
    return out


def collect() -> Dict:
    """Everything :func:`format_report` prints, as a dict."""
    build = build_info()
    return {
        "hugehead": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "build": build,
        "gpus": _gpus(build),
        "cpu_threads": torch.get_num_threads(),
    }


def _cutlass_line(build: Dict) -> str:
    if build["cutlass"]:
        return f"on ({build['cutlass_why']}; {', '.join('sm_' + a for a in build['cutlass_archs'])})"
    return f"off: {build['cutlass_why']}"


def format_report(info: Optional[Dict] = None) -> str:
    """The report of ``python -m hugehead.info``, one fact a line."""
    info = collect() if info is None else info
    build = info["build"]
    lines = [f"hugehead {info['hugehead']}"]
    torch_line = f"torch: {info['torch']} (CUDA {info['torch_cuda'] or 'none'})"
    if build["torch"] != info["torch"] or (build["torch_cuda"] or None) != info["torch_cuda"]:
        torch_line += (f"; built against torch {build['torch']} (CUDA {build['torch_cuda'] or 'none'}): "
                       "rebuild for this torch")
    lines.append(torch_line)
    if build["cuda"]:
        lines.append(f"CUDA kernels: on (nvcc {build['nvcc']}; architectures {';'.join(build['cuda_archs'])})")
    else:
        lines.append("CUDA kernels: off: this build has no CUDA (CPU kernels only)")
    lines.append(f"CUTLASS GEMMs: {_cutlass_line(build)}")
    if not info["gpus"]:
        lines.append("GPUs: none visible to torch")
    for gpu in info["gpus"]:
        cc = gpu["capability"]
        kernels = gpu["kernels"] or "no kernel image for this GPU (rebuild with its architecture)"
        lines.append(f"GPU {gpu['index']}: {gpu['name']} (sm_{cc[0]}{cc[1]}): GEMM path {gpu['gemm_path']}: "
                     f"{gpu['why']}; generic kernels: {kernels if build['cuda'] else 'none'}")
        if gpu["fused"] != (gpu["gemm_path"] == "fused CUTLASS"):
            lines.append(f"  note: hugehead.ops.has_fused_gemm says {gpu['fused']} for this GPU")
    lines.append(f"OpenMP threads: {info['cpu_threads']} (torch.get_num_threads(); set OMP_NUM_THREADS to change)")
    return "\n".join(lines)


def summary(info: Optional[Dict] = None) -> str:
    """One line: versions, CUDA and CUTLASS on or off, the GEMM path of the first GPU (the demo prints it)."""
    info = collect() if info is None else info
    build = info["build"]
    cuda = f"CUDA {';'.join(build['cuda_archs'])}" if build["cuda"] else "CPU-only build"
    cutlass = "CUTLASS on" if build["cutlass"] else f"CUTLASS off ({build['cutlass_why']})"
    if info["gpus"]:
        gpu = info["gpus"][0]
        here = f"GPU 0 {gpu['name']}: {gpu['gemm_path']}"
    else:
        here = "no GPU"
    return (f"hugehead {info['hugehead']} | torch {info['torch']} | {cuda} | {cutlass} | {here} | "
            f"{info['cpu_threads']} CPU threads")


def main() -> None:
    print(format_report())


if __name__ == "__main__":
    main()
