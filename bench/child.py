"""Running a benchmark case's child process: ``python -m bench.bench_lce ARGS`` in its own process group,
with a timeout and a watch, stopped (SIGTERM, then SIGKILL to the whole group) when it overstays, and
whatever it leaves behind in its group reaped when it exits.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from bench.common import REPO_ROOT


def run_child(args: List[str], log: Path, timeout: float,
           watch: Optional[Callable[[], bool]] = None) -> Tuple[Optional[int], bool, float]:
    """Run ``python -m bench.bench_lce ARGS`` in its own process group; returns (rc, timed_out, wall s).
    It is stopped after ``timeout`` seconds, or as soon as ``watch()`` (polled every second) says so."""
    return run_logged([sys.executable, "-m", "bench.bench_lce", *args], log, timeout, watch=watch)


def run_logged(cmd: List[str], log: Path, timeout: float, *, cwd: Path = REPO_ROOT,
               env: Optional[Dict[str, str]] = None,
               watch: Optional[Callable[[], bool]] = None) -> Tuple[Optional[int], bool, float]:
    """Run ``cmd`` in ``cwd`` in its own process group, its output into ``log``; returns (rc, timed_out, wall s).
    ``env`` (default this process's) gets PYTHONUNBUFFERED=1. Stopped as :func:`run_child` is, with whatever
    it started in its group."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=min(1.0, max(0.05, timeout - (time.perf_counter() - t0))))
                    reap_group(proc)
                    return rc, False, time.perf_counter() - t0
                except subprocess.TimeoutExpired:
                    if time.perf_counter() - t0 >= timeout or (watch is not None and watch()):
                        stop(proc)
                        return None, True, time.perf_counter() - t0
        finally:  # also when this parent is being stopped (SIGTERM -> SystemExit): no orphan on the GPU
            if proc.poll() is None:
                stop(proc)


def reap_group(proc: subprocess.Popen) -> None:
    """After a case exits: stop what it left in its own process group (e.g. torch.compile's worker pool,
    which the case's os._exit does not shut down)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the case's own process group (it may have compile workers)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, chars: int = 2500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]
