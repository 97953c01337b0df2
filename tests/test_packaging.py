"""What a wheel built from this tree holds and what a build without torch says, checked without
compiling: setuptools' own package discovery (build_py copies exactly the modules a wheel gets) and
setup.py run where torch cannot be imported (pip's isolated build environment)."""
import os
import subprocess
import sys
from pathlib import Path

import hugehead

REPO = Path(__file__).resolve().parents[1]


def _setup_py(args, cwd, **kwargs):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env,
                          **kwargs)


def test_wheel_gets_every_module_under_hugehead(tmp_path):
    # egg_info and build_py write under tmp_path only: the tree stays as it is.
    result = _setup_py([str(REPO / "setup.py"), "-q", "egg_info", "--egg-base", str(tmp_path), "build_py",
                        "--build-lib", str(tmp_path / "lib")], REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    source = {p.relative_to(REPO).as_posix() for p in (REPO / "hugehead").rglob("*.py") if "__pycache__" not in p.parts}
    built = {p.relative_to(tmp_path / "lib").as_posix() for p in (tmp_path / "lib").rglob("*.py")}
    assert "hugehead/engines/local.py" in source and "hugehead/demo/cli.py" in source
    assert source - built == set(), f"modules a wheel would miss: {sorted(source - built)}"
    assert built - source == set()


def test_package_version_is_the_metadata_version():
    result = _setup_py([str(REPO / "setup.py"), "--version"], REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == hugehead.__version__ == "0.2.0"


def test_build_without_torch_stops_with_the_command_that_works(tmp_path):
    """As in pip's default isolated build: torch is not importable, so setup.py stops before any compile and
    prints the --no-build-isolation command."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', 'egg_info', '--egg-base', "
            f"{str(tmp_path)!r}]; runpy.run_path({str(REPO / 'setup.py')!r}, run_name='__main__')")
    result = _setup_py(["-c", code], tmp_path)
    assert result.returncode == 1
    assert "hugehead: cannot import torch" in result.stderr and "isolated environment" in result.stderr
    assert "pip install --no-deps nvidia-cutlass==4.2.0.0 && pip install --no-build-isolation ." in result.stderr
    assert 'pip install --no-build-isolation ".[transformers]"' in result.stderr
    assert not list(tmp_path.glob("*.egg-info"))  # stopped before setuptools ran


def test_build_with_an_untested_torch_stops_before_compiling(tmp_path):
    code = ("import runpy, sys, types; sys.modules['torch'] = types.SimpleNamespace(__version__='2.8.0+cu128'); "
            f"sys.argv = ['setup.py', '--version']; runpy.run_path({str(REPO / 'setup.py')!r}, run_name='__main__')")
    result = _setup_py(["-c", code], tmp_path)
    assert result.returncode == 1
    assert "hugehead needs torch >= 2.11" in result.stderr and "has torch 2.8.0+cu128" in result.stderr
