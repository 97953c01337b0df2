"""Shared test helpers: device/dtype parametrization, markers that skip without the hardware (asking the
dispatcher whether CUDA kernels were built, not guessing from the environment), float64 references."""
import gc
import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

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
    # A slow test runs only where the -m expression names the marker (python -m pytest -m slow tests); every
    # other run, CI's and the GPU machine's -m cuda included, skips it with the command that runs it.
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip_slow = pytest.mark.skip(reason="slow: python -m pytest -m slow tests runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def pytest_collection_finish(session):
    # What collecting imported and built (torch, hugehead, hypothesis, the test modules) lives to the end of
    # the run: moved out of the garbage collector's reach, so that a full collection (the benchmarks'
    # gc.collect() before each measurement, and Python's own) scans only what the tests create.
    gc.collect()
    gc.freeze()


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str, module_name: str = None):
    """``examples/<name>.py`` imported as a module (its ``main`` and helpers callable from a test)."""
    spec = importlib.util.spec_from_file_location(module_name or name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fail_next_mm(monkeypatch, message: str = "out of memory (simulated)"):
    """The next ``torch.mm`` (the chunk loop's first GEMM) raises ``torch.OutOfMemoryError(message)``; later
    ones run. Returns a function that arms it again."""
    real_mm, calls = torch.mm, {"n": 0}

    def failing_mm(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError(message)
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", failing_mm)
    return lambda: calls.update(n=0)


def host_syncs_of_step(forward):
    """``loss = forward()`` then ``loss.backward()`` under ``torch.cuda.set_sync_debug_mode("warn")``:
    ``(synchronizations in the forward, the messages of all of them)``. Only the "called a synchronizing
    CUDA operation" warnings count (torch also warns once that the debug mode itself is a prototype)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = forward()
            forward_syncs = sum("called a synchronizing" in str(w.message) for w in caught)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return forward_syncs, [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


def rows_budget(n: int, d: int, v: int, dtype: torch.dtype, block_rows: int) -> int:
    """A memory_budget whose rows plan (hugehead.plan.plan_rows) has blocks of ``block_rows`` rows: one
    block's ``block_rows × V`` logits beside the ``N × D`` dX."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return block_rows * v * itemsize + n * d * itemsize


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ in float64 (NaN if either has NaN)."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref.norm()
    return float((a - ref).norm() / (denom if denom > 0 else 1.0))


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def tuned():
    """``tuned(**changes)``: ``hugehead.tuning.override(**changes)`` until the test ends (nested calls stack)."""
    import contextlib

    from hugehead import tuning

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tuning.override(**changes))


@pytest.fixture
def planned_with(monkeypatch):
    """``planned_with(**args)``: every later single-device loss call plans with these keyword arguments of
    :func:`hugehead.plan.plan_loss` in place of its own (``side_stream=False``: one workspace, no overlap;
    ``grad_store=False``: no chunk kept in the weight gradient's buffer). The loop executes whatever plan it is
    handed, so a test reaches a strategy without a switch in the library, and the plan stays one that fits."""
    import hugehead.lce_op

    real = hugehead.lce_op.plan_loss

    def plan_with(**args):
        monkeypatch.setattr(hugehead.lce_op, "plan_loss", lambda *a, **k: real(*a, **{**k, **args}))
    return plan_with


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the OS picks it), for a process group's rendezvous."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# Example scripts run as their docstrings launch them, in processes of their own
# --------------------------------------------------------------------------------------------------
EXAMPLE_TIMEOUT_S = 300  # a hang guard, not a speed limit


def start_example(args, cwd, nice: int = 0):
    """``python *args`` in ``cwd`` (created), importing the hugehead these tests imported, with stdout and stderr
    captured; ``nice``: its scheduling niceness (and its children's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(hugehead.__file__).parents[1]), env.get("PYTHONPATH", "")])
    os.makedirs(cwd, exist_ok=True)
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)


def finish_example(args, proc) -> str:
    """The output (stdout, then stderr: Lightning's rank-zero messages go there) of a run that must succeed."""
    try:
        stdout, stderr = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
    finally:
        kill_examples([proc])
    assert proc.returncode == 0, f"{args} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return stdout + stderr


def run_example(args, cwd) -> str:
    return finish_example(args, start_example(args, cwd))


def kill_examples(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="session")
def examples(request, tmp_path_factory):
    """The example runs that the selected tests check, by name (each test module that asks for this fixture
    names its runs in ``example_runs(out)``), all started together once: ``examples(name)`` waits for one and
    gives its output; their files lie under ``examples.out``. They run niced, on the cores the in-process
    tests leave idle, and share nothing with each other."""
    out = tmp_path_factory.mktemp("examples")
    runs = {}
    for module in {item.module for item in request.session.items if "examples" in item.fixturenames}:
        runs.update(module.example_runs(out))
    procs = {name: start_example(args, out / name, nice=10) for name, args in runs.items()}

    def output(name):
        return finish_example(runs[name], procs.pop(name))
    output.out = out
    yield output
    kill_examples(procs.values())


@pytest.fixture(scope="session", autouse=True)
def _examples_from_the_start(request):
    """Start the example runs when the session starts, where any selected test checks one."""
    if any("examples" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("examples")
