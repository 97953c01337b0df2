# Drives CMakeLists.txt (the one real build) with Ninja and puts hugehead/_C*.so inside the package.
# Build switches (environment): HUGEHEAD_CUDA=AUTO|ON|OFF, HUGEHEAD_CUDA_ARCHS (CMake style, e.g. "90"; unset:
# torch's architectures from sm_80 up),
# HUGEHEAD_CUTLASS=AUTO|ON|OFF (the sm_90a GEMMs of csrc/cuda/gemm/, CUDA builds only) with HUGEHEAD_CUTLASS_DIR
# (CUTLASS's include directory; default: the installed nvidia-cutlass package's cutlass_library/source/include),
# HUGEHEAD_BUILD_DIR (default build/cmake-<python tag>: kept, so a rebuild is incremental; wiped and
# configured again when it was configured for another Python or torch, see fresh_build_dir),
# MAX_JOBS (parallel compile jobs; default: all cores), HUGEHEAD_BUILD_TYPE (default Release).
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

INSTALL = ("pip install setuptools wheel cmake ninja && pip install --no-deps nvidia-cutlass==4.2.0.0 && "
           "pip install --no-build-isolation .")


# The oldest torch the test suite and the GPU runs use; pyproject.toml's dependency says the same.
MIN_TORCH = (2, 11)


def _require_torch() -> None:
    """Stop at once, with the command that works, when torch cannot be imported: hugehead compiles against
    the torch of the environment it installs into, and pip's default isolated build environment hides it
    (pyproject.toml's build requirements leave torch out, so an isolated build ends here in seconds). A torch
    older than MIN_TORCH stops here too: pip would upgrade it only after the build, leaving a module built
    against the old one."""
    try:
        import torch
    except ImportError as exc:
        sys.exit(
            f"hugehead: cannot import torch ({exc}). hugehead builds against the torch already installed in this "
            "environment, which pip hides when it builds in an isolated environment (its default). Install "
            f"torch first, then build without isolation:\n    {INSTALL}\n"
            "Extras go on the last command as usual, e.g. pip install --no-build-isolation \".[transformers]\"."
        )
    found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if found < MIN_TORCH:
        sys.exit(f"hugehead needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (the versions it is tested with); this "
                 f"environment has torch {torch.__version__}. Upgrade torch first, then: {INSTALL}")


_require_torch()


def _find_cmake() -> str:
    """cmake on PATH, else the one the pip 'cmake' package ships."""
    import shutil

    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake

        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError as exc:
        raise RuntimeError("hugehead's build needs CMake >= 3.18: pip install cmake") from exc


STAMP = "hugehead-build-stamp.json"


def build_key() -> dict:
    """What a configured CMake tree depends on outside this repository: the Python that builds (its
    executable, version, ABI tag) and the torch it compiles and links against (its location, version,
    CUDA). A tree configured with other values points at another environment's files (its torch's
    libc10.so may be gone with a deleted virtual environment, or silently be the wrong one)."""
    import torch

    return {
        "python_executable": sys.executable,  # not resolved: a venv's python links to the base one
        "python_prefix": sys.prefix,
        "python_version": sys.version.split()[0],
        "soabi": sysconfig.get_config_var("SOABI"),
        "torch_dir": str(Path(torch.__file__).resolve().parent),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


def _cache_mismatch(build_dir: Path, key: dict):
    """For a tree without a stamp (configured before stamps existed): what its CMakeCache.txt names that
    differs from ``key``, or None."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return None
    entries = {}
    for line in cache.read_text(errors="replace").splitlines():
        name, sep, value = line.partition("=")
        if sep and ":" in name and not line.startswith(("#", "//")):
            entries[name.split(":", 1)[0]] = value
    python = entries.get("Python_EXECUTABLE") or entries.get("_Python_EXECUTABLE")
    torch_dir = entries.get("Torch_DIR")
    if python and python != sys.executable:
        return f"Python {python} (building with {sys.executable})"
    if torch_dir and not os.path.realpath(torch_dir).startswith(os.path.realpath(key["torch_dir"]) + os.sep):
        return f"torch at {torch_dir} (building with torch at {key['torch_dir']})"
    return None


def fresh_build_dir(build_dir: Path, key: dict, log=print) -> bool:
    """Make ``build_dir`` safe to build in with ``key`` (:func:`build_key`): a tree configured for
    another Python or torch is removed (CMake keeps the old paths in its cache and Ninja would link the
    old torch, or fail on its missing files); the tree then gets ``key``'s stamp. Returns True when a tree
    was removed."""
    stamp = build_dir / STAMP
    why = None
    if stamp.exists():
        try:
            old = json.loads(stamp.read_text())
        except (OSError, ValueError):
            old = {}
        changed = [k for k in key if old.get(k) != key[k]]
        if changed:
            why = "; ".join(f"{k}: {old.get(k)} -> {key[k]}" for k in changed)
    else:
        why = _cache_mismatch(build_dir, key)
    if why:
        log(f"hugehead: {build_dir} was configured for another environment ({why}); removing it and configuring "
            "again (a full rebuild)")
        shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(key, indent=1) + "\n")
    return bool(why)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
        build_dir = Path(os.environ.get("HUGEHEAD_BUILD_DIR", ROOT / "build" / f"cmake-{tag}"))
        fresh_build_dir(build_dir, build_key())
        cmake = _find_cmake()
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('HUGEHEAD_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DHUGEHEAD_OUTPUT_DIR={out_dir}",
            f"-DHUGEHEAD_CUDA={os.environ.get('HUGEHEAD_CUDA', 'AUTO').upper()}",
        ]
        configure.append(f"-DHUGEHEAD_CUTLASS={os.environ.get('HUGEHEAD_CUTLASS', 'AUTO').upper()}")
        # Passed every time (empty: look for the package), so a cached directory never outlives the variable.
        configure.append(f"-DHUGEHEAD_CUTLASS_DIR={os.environ.get('HUGEHEAD_CUTLASS_DIR', '')}")
        # Empty: torch's architectures from sm_80 up (CMakeLists.txt); passed every time, as above.
        configure.append(f"-DHUGEHEAD_CUDA_ARCHS={os.environ.get('HUGEHEAD_CUDA_ARCHS', '')}")
        try:
            import ninja

            configure.append(f"-DCMAKE_MAKE_PROGRAM={Path(ninja.BIN_DIR) / 'ninja'}")
        except ImportError:
            pass  # a ninja on PATH
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call([cmake, "--build", str(build_dir), "--", f"-j{jobs}"])


setup(
    ext_modules=[CMakeExtension("hugehead._C")],
    cmdclass={"build_ext": CMakeBuild},
)
