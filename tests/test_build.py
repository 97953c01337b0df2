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


# --------------------------------------------------------------------------------------------------
# A CMake tree configured for another Python or torch is configured again (setup.py)
# --------------------------------------------------------------------------------------------------
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _setup_module(monkeypatch):
    """setup.py as a module, without running setup()."""
    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    spec = importlib.util.spec_from_file_location("hugehead_setup_py", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _configured_tree(path: Path, cache: str = "") -> Path:
    path.mkdir(parents=True)
    (path / "build.ninja").write_text("# a configured tree\n")
    if cache:
        (path / "CMakeCache.txt").write_text(cache)
    return path


def test_build_dir_of_another_torch_or_python_is_removed(monkeypatch, tmp_path):
    setup_py = _setup_module(monkeypatch)
    key = setup_py.build_key()
    assert key["torch_dir"] == str(Path(torch.__file__).resolve().parent) and key["python_executable"] == sys.executable
    logged = []

    # the same environment: kept (an incremental rebuild), stamped
    tree = _configured_tree(tmp_path / "same")
    assert not setup_py.fresh_build_dir(tree, key, logged.append)
    assert (tree / "build.ninja").exists() and json.loads((tree / setup_py.STAMP).read_text()) == key
    assert not setup_py.fresh_build_dir(tree, key, logged.append) and not logged

    # stamped by another torch (a deleted or other virtual environment): removed, stamped anew
    other = {**key, "torch_dir": "/gone/venv/lib/python3.11/site-packages/torch", "torch_version": "2.12.0"}
    (tree / setup_py.STAMP).write_text(json.dumps(other))
    assert setup_py.fresh_build_dir(tree, key, logged.append)
    assert not (tree / "build.ninja").exists() and json.loads((tree / setup_py.STAMP).read_text()) == key
    assert "torch_dir: /gone/venv/lib/python3.11/site-packages/torch ->" in logged[-1] and "torch_version" in logged[-1]

    # configured before stamps existed: its CMakeCache.txt decides
    torch_cmake = Path(key["torch_dir"]) / "share" / "cmake" / "Torch"
    mine = f"Python_EXECUTABLE:UNINITIALIZED={sys.executable}\nTorch_DIR:PATH={torch_cmake}\n"
    old = _configured_tree(tmp_path / "old_same", mine)
    assert not setup_py.fresh_build_dir(old, key, logged.append) and (old / "build.ninja").exists()
    for name, cache in [("old_python", f"Python_EXECUTABLE:UNINITIALIZED=/gone/venv/bin/python\nTorch_DIR:PATH={torch_cmake}\n"),
                        ("old_torch", f"Python_EXECUTABLE:UNINITIALIZED={sys.executable}\n"
                                      "Torch_DIR:PATH=/gone/venv/lib/python3.11/site-packages/torch/share/cmake/Torch\n")]:
        tree = _configured_tree(tmp_path / name, cache)
        assert setup_py.fresh_build_dir(tree, key, logged.append), name
        assert not (tree / "build.ninja").exists() and not (tree / "CMakeCache.txt").exists()
        assert "/gone/venv" in logged[-1]


def test_build_checks_its_tree_before_configuring(monkeypatch, tmp_path):
    """The build wiring that the slow venv test runs end to end: build_ext stamps (or wipes) its CMake tree
    with this environment's key before it configures, and passes every switch each time (empty: the
    default), so a value cached by an earlier build never outlives its environment variable."""
    from setuptools import Distribution

    setup_py = _setup_module(monkeypatch)
    tree = _configured_tree(tmp_path / "tree")
    (tree / setup_py.STAMP).write_text(json.dumps({**setup_py.build_key(), "torch_dir": "/gone/venv/torch"}))
    calls = []
    monkeypatch.setattr(setup_py.subprocess, "check_call", lambda cmd: calls.append(cmd))
    monkeypatch.setattr(setup_py, "_find_cmake", lambda: "cmake")
    for name in ("HUGEHEAD_CUDA_ARCHS", "HUGEHEAD_CUTLASS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HUGEHEAD_BUILD_DIR", str(tree))
    command = setup_py.CMakeBuild(Distribution())
    monkeypatch.setattr(command, "get_ext_fullpath", lambda name: str(tmp_path / "out" / "_C.so"))
    command.build_extension(setup_py.CMakeExtension("hugehead._C"))
    assert not (tree / "build.ninja").exists()  # configured for another torch: removed
    assert json.loads((tree / setup_py.STAMP).read_text()) == setup_py.build_key()
    configure, build = calls
    assert configure[configure.index("-B") + 1] == str(tree) and build[:3] == ["cmake", "--build", str(tree)]
    assert "-DHUGEHEAD_CUDA_ARCHS=" in configure and "-DHUGEHEAD_CUTLASS_DIR=" in configure
    assert f"-DHUGEHEAD_OUTPUT_DIR={tmp_path / 'out'}" in configure


def _run(cmd, cwd, timeout, env=None):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{cmd} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def _copy_of_this_clone(dest: Path) -> Path:
    """The files git would give a clone (tracked and untracked-not-ignored), without build outputs."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _venv_with_torch(path: Path) -> Path:
    """A new virtual environment with torch of this process's version (pip takes it from its cache or the
    machine's wheel file: the point is another torch *location*) and the build tools."""
    _run([sys.executable, "-m", "venv", str(path)], path.parent, 120)
    python = path / "bin" / "python"
    version = torch.__version__.split("+")[0]
    # the README's command; the machine's pip configuration (its cache, a local wheel of torch) applies as
    # for a user
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={version}", "setuptools", "wheel",
                           "cmake", "ninja"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.skip(f"cannot install torch=={version} into a new venv here: {done.stderr[-500:]}")
    return python


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="venv layout and RUNPATH checks are Linux-specific")
def test_reinstall_into_a_new_venv_after_deleting_the_first(tmp_path):
    """The README's install into venv A, `rm -rf A`, the same install into venv B from the same clone: the
    build notices its tree was configured for A's torch, configures again, links B's torch and imports
    (before: `ninja: error: '.../A/.../torch/lib/libc10.so' missing`). Slow (two torch installs and two
    clean CPU builds); test_build_dir_of_another_torch_or_python_is_removed and
    test_build_checks_its_tree_before_configuring cover its logic in the default run."""
    clone = _copy_of_this_clone(tmp_path / "clone")
    env = {**os.environ, "MAX_JOBS": "2", "HUGEHEAD_CUDA": "OFF"}
    env.pop("PYTHONPATH", None)
    check = ("import hugehead, torch; x = torch.randn(4, 3, dtype=torch.float64); w = torch.randn(7, 3, dtype=torch.float64); "
             "t = torch.tensor([0, 6, 2, 3]); ref = torch.nn.functional.cross_entropy(x @ w.t(), t); "
             "got = hugehead.linear_cross_entropy(x, w, t); assert torch.allclose(got, ref), (got, ref); "
             "print(hugehead.__file__, torch.__file__)")
    outputs = {}
    for name in ("venv_a", "venv_b"):
        python = _venv_with_torch(tmp_path / name)
        # --no-deps: the runtime dependencies (matplotlib, ...) are not what this test is about
        log = _run([str(python), "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation", "-e", str(clone)],
                   clone, 900, env)
        outputs[name] = log
        printed = _run([str(python), "-c", check], tmp_path, 300, env).split()
        assert printed[0].startswith(str(clone)) and printed[1].startswith(str(tmp_path / name)), printed
        if name == "venv_a":
            shutil.rmtree(tmp_path / name)
    assert "configured for another environment" not in outputs["venv_a"]
    assert "configured for another environment" in outputs["venv_b"] and "venv_a" in outputs["venv_b"]
    (so,) = (clone / "hugehead").glob("_C*.so")
    if shutil.which("readelf"):
        dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, timeout=60).stdout
        assert str(tmp_path / "venv_b") in dynamic and str(tmp_path / "venv_a") not in dynamic


def _tree_without_extension(root: Path, source_tree: bool) -> Path:
    shutil.copytree(REPO / "hugehead", root / "hugehead", ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    if source_tree:
        shutil.copy2(REPO / "setup.py", root / "setup.py")
        (root / "csrc").mkdir()
    return root


@pytest.mark.parametrize("source_tree", [True, False])
def test_import_without_extension_says_why_and_the_ways_out(tmp_path, source_tree):
    """From a source tree without _C (the repository root after a plain `pip install .`): the error says the
    tree shadows the installed package and gives both ways out; a package folder that is not a source tree
    gets the rebuild command."""
    root = _tree_without_extension(tmp_path, source_tree)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # as after a plain (non-editable) install: no editable-install finder that would map hugehead._C to
    # the checkout this suite runs from
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            "import hugehead")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode != 0 and "ImportError" in result.stderr
    if source_tree:
        assert f"imported from the source tree {root / 'hugehead'}" in result.stderr
        assert "run from another directory" in result.stderr
        assert "pip install --no-build-isolation -e ." in result.stderr
    else:
        assert "hugehead._C is not built" in result.stderr and "pip install --no-build-isolation ." in result.stderr
