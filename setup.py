# Drives CMakeLists.txt (the one real build) with Ninja and puts hugehead/_C*.so inside the package.
# Build switches (environment): HUGEHEAD_CUDA=AUTO|ON|OFF, HUGEHEAD_CUDA_ARCHS="90" (CMake style),
# HUGEHEAD_BUILD_DIR (default build/cmake-<python tag>: kept, so a rebuild is incremental),
# MAX_JOBS (parallel compile jobs; default: all cores), HUGEHEAD_BUILD_TYPE (default Release).
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


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


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
        build_dir = Path(os.environ.get("HUGEHEAD_BUILD_DIR", ROOT / "build" / f"cmake-{tag}"))
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake = _find_cmake()
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('HUGEHEAD_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DHUGEHEAD_OUTPUT_DIR={out_dir}",
            f"-DHUGEHEAD_CUDA={os.environ.get('HUGEHEAD_CUDA', 'AUTO').upper()}",
        ]
        if "HUGEHEAD_CUDA_ARCHS" in os.environ:
            configure.append(f"-DHUGEHEAD_CUDA_ARCHS={os.environ['HUGEHEAD_CUDA_ARCHS']}")
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
