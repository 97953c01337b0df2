"""The one benchmark harness: which hugehead is measured, timing (CUDA events on a GPU, the host clock on
the CPU; warm-up, medians, peak memory beyond the inputs, others' share of the CPU), the facts that
qualify a number (git SHA, GPU, torch version) and the one writer of results (JSON + markdown + plot).

Every script under ``bench/`` measures through :func:`measure` and writes through :func:`write_report`.
A new benchmark looks like this::

    from bench import harness            # first: decides which hugehead is imported
    import torch

    meta = harness.run_meta("mybench", device, options=args, shapes={"tiny": dict(n=8, d=4, v=100)},
                            smoke=args.cpu_smoke)
    t = harness.measure(step, device, reps=args.reps, warmup=args.warmup, input_bytes=harness.tensor_bytes(x, w))
    rows = [{"shape": "tiny", **t.fields("fwd_bwd")}]
    md = harness.header("My benchmark", meta) + harness.md_table(
        ["shape", "fwd+bwd ms"], [[r["shape"], harness.fmt(r["fwd_bwd_ms"], ".2f")] for r in rows])
    harness.write_report(out_dir, "mybench", {"meta": meta, "rows": rows}, md,
                         plot=lambda path: harness.bar_chart(path, ["tiny"], harness.Panel("ms", {"hugehead": [t.ms]})))

Results documents have one layout: ``{"meta": run_meta(...), ...}``; ``meta`` holds the git SHA, the
machine, torch, the options, the shapes and ``smoke``. A smoke run's markdown says so at the top.
"""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields as dataclass_fields, is_dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------------
# Which hugehead is measured (before torch and hugehead are imported)
# --------------------------------------------------------------------------------------------------
def _is_repo_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == REPO_ROOT
    except OSError:
        return False


def select_hugehead() -> str:
    """Make ``import hugehead`` find the build we mean to measure; returns "tree" or "installed".

    ``python -m bench.<x>`` puts the repository root first on ``sys.path``, and after a plain
    ``pip install .`` the source tree's ``hugehead/`` has no compiled ``_C`` (or a stale one from an
    earlier in-place build). ``HUGEHEAD_BENCH_IMPORT=installed`` drops the repository root from
    ``sys.path`` so the installed package is used; ``tree`` keeps the source tree; ``auto`` (default)
    uses the tree only when it holds a compiled ``_C``. The ``bench`` package itself is already
    imported by then, so its submodules still load.
    """
    mode = os.environ.get("HUGEHEAD_BENCH_IMPORT", "auto").lower()
    tree_built = any((REPO_ROOT / "hugehead").glob("_C*.so")) or any((REPO_ROOT / "hugehead").glob("_C*.pyd"))
    if mode == "tree" or (mode == "auto" and tree_built):
        return "tree"
    sys.path[:] = [p for p in sys.path if not _is_repo_root(p)]
    return "installed"


HUGEHEAD_SOURCE = select_hugehead()

import torch  # noqa: E402  (after select_hugehead, which only edits sys.path)

Devices = Union[torch.device, str, Sequence[Union[torch.device, str]], None]


def _devices(devices: Devices) -> List[torch.device]:
    if devices is None:
        return [torch.device("cpu")]
    if isinstance(devices, (torch.device, str)):
        devices = [devices]
    return list(dict.fromkeys(torch.device(d) for d in devices))


def _cuda(devices: Devices) -> List[torch.device]:
    return [d for d in _devices(devices) if d.type == "cuda"]


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------
def synchronize(devices: Devices = None) -> None:
    """Wait for every CUDA device in ``devices`` (all visible ones when None and CUDA is up)."""
    cuda = _cuda(devices) if devices is not None else (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_initialized() else [])
    for dev in cuda:
        torch.cuda.synchronize(dev)


def time_call_ms(fn: Callable[[], object], devices: Devices = None, clock: str = "events") -> Tuple[float, object]:
    """Run ``fn`` once: (milliseconds, its result).

    ``clock="events"`` (default): CUDA events recorded on the current stream of every CUDA device in
    ``devices`` around the call, the longest span counts; they bracket everything ``fn`` queues there,
    host-side work and syncs included. Without a CUDA device, or with ``clock="host"``,
    ``time.perf_counter`` around the call with every device synchronized before and after (for work on
    side streams or on devices the events would not see)."""
    cuda = _cuda(devices)
    if clock == "events" and cuda:
        events = []
        for dev in cuda:
            with torch.cuda.device(dev):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                events.append((dev, start, end))
        out = fn()
        for dev, _, end in events:
            with torch.cuda.device(dev):
                end.record()
        for _, _, end in events:
            end.synchronize()
        return max(float(start.elapsed_time(end)) for _, start, end in events), out
    if clock not in ("events", "host"):
        raise ValueError(f"clock must be 'events' or 'host', got {clock!r}")
    synchronize(cuda)
    t0 = time.perf_counter()
    out = fn()
    synchronize(cuda)
    return (time.perf_counter() - t0) * 1e3, out


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    if not s:
        raise ValueError("median of no values")
    k = len(s) // 2
    return s[k] if len(s) % 2 else 0.5 * (s[k - 1] + s[k])


def cpu_busy_seconds() -> Tuple[Optional[float], float]:
    """(CPU seconds all processes of this machine have been busy, from /proc/stat; CPU seconds of this
    process). Their deltas around a timed CPU step tell how much of the machine others used meanwhile."""
    own = sum(os.times()[:2])
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None, own
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields) - idle) / hz, own


def foreign_cpu_fraction(before: Tuple[Optional[float], float], after: Tuple[Optional[float], float],
                         wall_s: float) -> Optional[float]:
    """The share of this machine's CPUs that other processes kept busy between two
    :func:`cpu_busy_seconds` readings (0: the measurement had the machine to itself)."""
    if before[0] is None or after[0] is None or wall_s <= 0:
        return None
    foreign = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, foreign / (wall_s * (os.cpu_count() or 1)))


def wait_until_idle(max_wait_s: float, busy_limit: float = 0.1, window_s: float = 2.0) -> Tuple[float, Optional[float]]:
    """Wait (up to ``max_wait_s``) until other processes use less than ``busy_limit`` of the CPUs over a
    ``window_s`` window (this process sleeping meanwhile). Returns (seconds waited, last busy share)."""
    t0 = time.perf_counter()
    while True:
        before = cpu_busy_seconds()
        time.sleep(window_s)
        share = foreign_cpu_fraction(before, cpu_busy_seconds(), window_s)
        waited = time.perf_counter() - t0
        if share is None or share < busy_limit or waited >= max_wait_s:
            return waited, share


def tensor_bytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _reset_peaks(cuda: List[torch.device]) -> Dict[str, int]:
    gc.collect()
    base = {}
    for dev in cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base[str(dev)] = torch.cuda.memory_allocated(dev)
    return base


@dataclass
class Timing:
    """What :func:`measure` found. ``ms`` is the median of ``ms_all`` (the timed calls). Memory (CUDA
    only, None on the CPU): ``baseline_bytes`` allocated when the peak counters were reset (before the
    timed calls; the inputs are in it), ``peak_bytes`` the highest allocation during them, summed over the
    devices (``peak_bytes_per_device`` and ``baseline_bytes_per_device`` each), ``peak_extra_bytes`` the peak beyond the inputs:
    ``peak_bytes - input_bytes`` when the caller said how many bytes its inputs take, else
    ``peak_bytes - baseline_bytes``. ``foreign_cpu``: the share of the CPUs other processes used during the
    timed calls (CPU runs; above ~0.1 the times are pessimistic)."""

    ms: float
    ms_min: float
    ms_all: List[float]
    reps: int
    warmup_ms: List[float]
    clock: str
    first_call_only: bool = False
    baseline_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None
    peak_extra_bytes: Optional[int] = None
    peak_bytes_per_device: Dict[str, int] = field(default_factory=dict)
    baseline_bytes_per_device: Dict[str, int] = field(default_factory=dict)
    foreign_cpu: Optional[float] = None
    result: object = field(default=None, repr=False)

    @classmethod
    def of(cls, times: Sequence[float], warmup_ms: Sequence[float] = (), clock: str = "host") -> "Timing":
        """A Timing of calls the caller timed itself with :func:`time_call_ms` (for a step whose phases
        are timed apart, e.g. forward+backward and the optimizer); no memory figures."""
        times = [float(t) for t in times]
        return cls(ms=median(times), ms_min=min(times), ms_all=times, reps=len(times), warmup_ms=list(warmup_ms),
                   clock=clock)

    @property
    def peak_extra_gib(self) -> Optional[float]:
        return None if self.peak_extra_bytes is None else self.peak_extra_bytes / 2**30

    def fields(self, prefix: str = "") -> Dict[str, object]:
        """The numbers as flat JSON fields, ``{prefix}_ms``, ``{prefix}_reps``, … (no prefix: ``ms``, …)."""
        p = f"{prefix}_" if prefix else ""
        out = {f"{p}{f.name}": getattr(self, f.name) for f in dataclass_fields(self) if f.name != "result"}
        out[f"{p}peak_extra_gib"] = self.peak_extra_gib
        return out


def measure(
    fn: Callable[[], object],
    devices: Devices = None,
    *,
    reps: int,
    warmup: int = 1,
    budget_s: Optional[float] = None,
    before: Optional[Callable[[], object]] = None,
    input_bytes: Optional[int] = None,
    clock: str = "events",
    reduce: Optional[Callable[[List[float]], List[float]]] = None,
    slow_warmup_ms: float = 5000.0,
) -> Timing:
    """Time ``fn``: ``warmup`` untimed calls, then ``reps`` timed ones (:func:`time_call_ms`), the median.

    Args:
        fn: one step (e.g. loss + backward). Its last result is kept in ``Timing.result``; the previous
            result is dropped before each call, as in a training loop.
        devices: the device(s) the step runs on (CUDA events / peak memory on each CUDA one).
        budget_s: at most this long for the timed calls: fewer repetitions (at least one) when one warm-up
            call says they would not fit; a warm-up call that alone exceeds it is the measurement
            (``first_call_only``, ``reps`` 0).
        before: runs before each call, outside the timed region (e.g. resetting a buffer).
        input_bytes: bytes of the step's inputs (``peak_extra_bytes`` is the peak beyond them).
        clock: "events" or "host" (see :func:`time_call_ms`).
        reduce: maps the list of times to the one recorded (e.g. an all-reduce MAX over ranks, so that a
            step's time is the slowest rank's).
        slow_warmup_ms: a warm-up call slower than this ends the warm-up (one is enough).
    Raises:
        ValueError: ``reps < 1`` or ``warmup < 0``; RuntimeError: a non-positive time (the timer did not
        bracket the work).
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"measure needs reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    cuda = _cuda(devices)
    warm_ms: List[float] = []
    out = None

    def call():
        if before is not None:
            before()
        return time_call_ms(fn, devices, clock)

    base = _reset_peaks(cuda)  # a first-call-only measurement reads its peak from here
    for _ in range(warmup):
        out = None  # the previous result is freed before the next call, as in a training loop
        ms, out = call()
        warm_ms.append(ms)
        if ms > slow_warmup_ms:
            break
    first_only = budget_s is not None and bool(warm_ms) and warm_ms[-1] > budget_s * 1e3
    if first_only:
        times, n = [warm_ms[-1]], 0
        peaks = {str(d): torch.cuda.max_memory_allocated(d) for d in cuda}
        busy = None
    else:
        n = reps if budget_s is None or not warm_ms else max(1, min(reps, int(budget_s * 1e3 // max(warm_ms[-1], 1e-3))))
        base = _reset_peaks(cuda)
        times = []
        busy0, t0 = cpu_busy_seconds(), time.perf_counter()
        for _ in range(n):
            out = None
            ms, out = call()
            times.append(ms)
        busy = foreign_cpu_fraction(busy0, cpu_busy_seconds(), time.perf_counter() - t0)
        synchronize(cuda)
        peaks = {str(d): torch.cuda.max_memory_allocated(d) for d in cuda}
    if reduce is not None:
        times = [float(t) for t in reduce(times)]
    if not all(t > 0 for t in times):
        raise RuntimeError(f"non-positive step time in {times} ms: the timer did not bracket the work")
    peak = sum(peaks.values()) if cuda else None
    baseline = sum(base.values()) if cuda and base else None
    if peak is None:
        extra = None
    elif input_bytes is not None:
        extra = peak - input_bytes
    else:
        extra = None if baseline is None else peak - baseline
    return Timing(ms=median(times), ms_min=min(times), ms_all=times, reps=n, warmup_ms=warm_ms,
                  clock="events" if (clock == "events" and cuda) else "host", first_call_only=first_only,
                  baseline_bytes=baseline, peak_bytes=peak, peak_extra_bytes=extra, peak_bytes_per_device=peaks,
                  baseline_bytes_per_device=base,
                  foreign_cpu=busy if not cuda else None, result=out)


# --------------------------------------------------------------------------------------------------
# Facts that qualify every number
# --------------------------------------------------------------------------------------------------
def error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def git_sha() -> Dict[str, object]:
    """The ``HUGEHEAD_GIT_SHA`` environment variable when set (the GPU machine's copy of the tree may
    carry a stale ``.git``: the caller names the commit it sent), else ``git rev-parse HEAD`` of the
    repository (and whether tracked files differ), else "unknown"."""
    env = os.environ.get("HUGEHEAD_GIT_SHA")
    if env:
        return {"git_sha": env, "git_dirty": None, "git_sha_source": "env HUGEHEAD_GIT_SHA"}
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=20,
        ).stdout.rstrip("\n")
        # which tracked files differ from the commit (others' work in progress is measured too)
        files = [line[3:] for line in dirty.splitlines() if line.strip()][:40]
        return {"git_sha": sha, "git_dirty": bool(dirty), "git_dirty_files": files, "git_sha_source": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": "unknown", "git_dirty": None, "git_sha_source": "none"}


def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200": the results folder name of a device."""
    slug = re.sub(r"^nvidia\s+", "", name.strip().lower())
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-")
    return slug or "unknown"


def package_version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: Union[torch.device, str, None] = None) -> Dict[str, object]:
    """Facts that qualify every number: GPU, driver, torch/CUDA/triton, hugehead build, Python, CPU."""
    device = torch.device(device or "cpu")
    info: Dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "device": str(device),
        "hugehead_source": HUGEHEAD_SOURCE,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu_name=props.name, gpu_capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count())
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            ).stdout.strip().splitlines()
            info["nvidia_smi"] = out[0] if out else None
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = error_text(exc)
    else:
        info.update(gpu_name="cpu", gpu_capability=None, gpu_memory_gib=None, gpu_count=0)
    info["cpu_model"] = cpu_model()
    info["niceness"] = os.nice(0) if hasattr(os, "nice") else None  # CPU runs may raise their priority
    info["torch_threads"] = torch.get_num_threads()
    info["machine"] = (
        info["gpu_name"] if device.type == "cuda" else f"{info['cpu_model']}, {os.cpu_count()} cores"
    )
    try:
        import hugehead

        info.update(
            hugehead_version=hugehead.__version__,
            hugehead_file=str(Path(hugehead.__file__).parent),
            hugehead_cuda_built=hugehead.cuda_built(),
            hugehead_cuda_kernels=hugehead.has_kernel("chunk_stats_", "CUDA"),
        )
    except Exception as exc:  # noqa: BLE001  (recorded; the hugehead rows will say the same)
        info["hugehead_error"] = error_text(exc)
    return info


def run_meta(benchmark: str, device: Union[torch.device, str, None] = None, *, options=None,
             shapes: Optional[Mapping[str, object]] = None, smoke: bool = False, method: Optional[str] = None,
             command: Optional[str] = None, **extra) -> Dict[str, object]:
    """The ``meta`` of a results document: what ran (``benchmark``, ``command``, the options — an
    argparse namespace or a dict —, the shapes, whether it is a ``smoke`` run, the ``method``), when
    (``created_utc``), on what (:func:`git_sha` and :func:`environment` of ``device``), plus ``extra``."""
    if options is not None and not isinstance(options, Mapping):
        options = {k: v for k, v in vars(options).items() if not k.startswith("_")}
    return {
        "benchmark": benchmark,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command or " ".join([Path(sys.executable).name, *sys.argv]),
        "smoke": bool(smoke),
        **git_sha(),
        **environment(device),
        "options": dict(options) if options is not None else {},
        "shapes": dict(shapes) if shapes is not None else {},
        "method": method,
        **extra,
    }


# --------------------------------------------------------------------------------------------------
# The writer: JSON + markdown + plot
# --------------------------------------------------------------------------------------------------
def jsonable(obj):
    """Plain JSON: non-finite floats become the strings "nan"/"inf"/"-inf", tuples lists, dataclasses
    dicts, dtypes / devices / paths strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(asdict(obj))
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    return obj


def as_float(value) -> Optional[float]:
    """A JSON number or "nan"/"inf" string back to float; None stays None."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _atomic_write(path: Path, text: str) -> None:
    """A killed process leaves the previous file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    _atomic_write(Path(path), json.dumps(jsonable(obj), indent=1) + "\n")


SMOKE_NOTE = ("> **Smoke run** (`--cpu-smoke`): tiny problems that check the pipeline end to end. The times, "
              "ratios and speed-ups below are noise-dominated, not results.")


def is_smoke(meta: Mapping[str, object]) -> bool:
    return bool(meta.get("smoke") or meta.get("cpu_smoke"))


def short_sha(meta: Mapping[str, object]) -> str:
    sha = str(meta.get("git_sha", "unknown"))
    return sha if sha.startswith("mixed") else sha[:12]


def header(title: str, meta: Mapping[str, object]) -> str:
    """``# title``, one line of facts (git SHA, machine, torch, hugehead, when, how long), and for a smoke
    run the note that its numbers are not results."""
    dirty = " (dirty)" if meta.get("git_dirty") else ""
    facts = [f"git `{short_sha(meta)}`{dirty}", str(meta.get("machine") or meta.get("gpu_name") or "unknown device"),
             f"torch {meta.get('torch')}" + (f" (CUDA {meta['torch_cuda']})" if meta.get("torch_cuda") else "")]
    if meta.get("hugehead_version"):
        facts.append(f"hugehead {meta['hugehead_version']}")
    if meta.get("created_utc"):
        facts.append(str(meta["created_utc"]))
    if meta.get("elapsed_s") is not None:
        facts.append(f"{float(meta['elapsed_s']):.0f} s")
    lines = [f"# {title}", "", " · ".join(facts), ""]
    if is_smoke(meta):
        lines += [SMOKE_NOTE, ""]
    return "\n".join(lines) + "\n"


def footer(meta: Mapping[str, object]) -> str:
    return f"\nCommand: `{meta.get('command')}`\n" if meta.get("command") else ""


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    """``format(value, spec)``, or ``missing`` for None / a value that is not a number."""
    v = as_float(value) if not isinstance(value, (int, float)) else value
    if v is None:
        return missing
    return format(v, spec)


def shape_cells(row: Mapping[str, object]) -> List[str]:
    """A result row's first two table cells: its shape's name and ``N × D × V``."""
    return [row["shape"], f"{row['n']} × {row['d']} × {row['v']:,}"]


def yes_no(value: Optional[bool]) -> str:
    """A check's table cell: yes, **no** (bold, to be seen), or - when it was not made."""
    return {True: "yes", False: "**no**", None: "-"}[value]


def md_table(columns: Sequence[str], rows: Iterable[Sequence[object]], align: Optional[str] = None) -> str:
    """A markdown table. ``align``: one letter per column, "l" or "r" (default: left for the first
    column, right for the others)."""
    align = align or ("l" + "r" * (len(columns) - 1))
    if len(align) != len(columns):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(columns)} columns")
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if a == "l" else "--:" for a in align) + "|"]
    for row in rows:
        cells = [str(c).replace("|", "\\|").replace("\n", " ") for c in row]
        if len(cells) != len(columns):
            raise ValueError(f"row {cells} has {len(cells)} cells for {len(columns)} columns")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass
class Panel:
    """One panel of :func:`bar_chart`: ``series[name][i]`` is the bar of ``name`` in category ``i`` (None:
    no bar, labelled with ``missing[(name, category)]`` when given, e.g. "OOM")."""

    ylabel: str
    series: Mapping[str, Sequence[Optional[float]]]
    missing: Mapping[Tuple[str, str], str] = field(default_factory=dict)
    log: bool = True
    lines: Mapping[str, float] = field(default_factory=dict)  # horizontal reference lines: label -> value


def bar_chart(path: Path, categories: Sequence[str], panels: Union[Panel, Sequence[Panel]], title: str = "",
              smoke: bool = False) -> None:
    """Grouped bars, one group per category and one colour per series, one panel above the other (the
    x axis shared). A smoke run's title says it shows noise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [panels] if isinstance(panels, Panel) else list(panels)
    names = list(dict.fromkeys(n for p in panels for n in p.series))
    colors = {n: plt.get_cmap("tab10")(j % 10) for j, n in enumerate(names)}
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, sharex=True,
                             figsize=(max(6.0, 0.5 * len(categories) * max(1, len(names)) + 2), 3.8 * len(panels)))
    width = 0.8 / max(1, len(names))
    for ax, panel in zip(axes[:, 0], panels):
        values = [v for vs in panel.series.values() for v in vs if v is not None and v > 0]
        floor = (min(values) / 3 if values else 1e-3) if panel.log else 0.0
        for j, name in enumerate(names):
            xs, hs = [], []
            for i, cat in enumerate(categories):
                x = i - 0.4 + width * (j + 0.5)
                vs = panel.series.get(name, [])
                v = vs[i] if i < len(vs) else None
                if v is not None and v > 0:
                    xs.append(x)
                    hs.append(v)
                elif (name, cat) in panel.missing:
                    ax.text(x, floor * 1.15 if panel.log else 0.0, panel.missing[(name, cat)], rotation=90,
                            ha="center", va="bottom", fontsize=7, color=colors[name])
            ax.bar(xs, hs, width=width * 0.95, color=colors[name])
        for k, (label, value) in enumerate(panel.lines.items()):
            ax.axhline(value, color=plt.get_cmap("Dark2")(k % 8), ls="--", lw=1, label=label)
        if panel.lines:
            ax.legend(fontsize=7, loc="upper right")
        if panel.log and values:
            ax.set_yscale("log")
            ax.set_ylim(floor, max(values + list(panel.lines.values())) * 2)
        ax.set_ylabel(panel.ylabel)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0, 0].legend(handles=[Patch(color=colors[n], label=n) for n in names], ncol=min(4, max(1, len(names))),
                      fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.08), frameon=False)
    axes[-1, 0].set_xlim(-0.5, len(categories) - 0.5)
    axes[-1, 0].set_xticks(range(len(categories)))
    axes[-1, 0].set_xticklabels(categories, fontsize=8)
    axes[0, 0].set_title(("SMOKE RUN (noise, not results): " if smoke else "") + title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_record_flag(parser) -> None:
    """``--record [CSV]``: append this run's rows to ``bench/results/history.csv`` (or CSV)."""
    parser.add_argument("--record", nargs="?", const=True, default=False, metavar="CSV",
                        help="append this run's rows to bench/results/history.csv (or to CSV)")


def write_report(out_dir: Path, stem: str, doc: Dict[str, object], markdown: Union[str, Callable[[dict], str]],
                 plot: Optional[Callable[[Path], None]] = None, record: Union[bool, str, Path] = False,
                 study: Optional[str] = None) -> Dict[str, Path]:
    """Write ``<stem>.json`` (atomically), ``<stem>.md`` and, when ``plot`` is given, ``<stem>.png``
    (``plot(path)`` draws it) into ``out_dir``. ``markdown`` is the text or a function of ``doc``. A plot
    that fails (no matplotlib) is noted in ``doc["meta"]["png_error"]`` and the rest is still written.
    ``record``: True appends the document's rows (``bench.history.rows_of(study or stem, doc)``) to
    ``bench/results/history.csv``, a path to that CSV; False (the default) writes no history.
    Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = doc.setdefault("meta", {})
    meta.pop("png_error", None)
    written: Dict[str, Path] = {}
    if plot is not None:
        png = out_dir / f"{stem}.png"
        try:
            plot(png)
            written["png"] = png
        except Exception as exc:  # noqa: BLE001  (no matplotlib on the machine: the table still stands)
            meta["png_error"] = error_text(exc)
    text = markdown(doc) if callable(markdown) else markdown
    write_json(out_dir / f"{stem}.json", doc)
    _atomic_write(out_dir / f"{stem}.md", text)
    written.update(json=out_dir / f"{stem}.json", md=out_dir / f"{stem}.md")
    if record:
        from bench import history  # history imports nothing of the harness: no cycle

        path = history.HISTORY if record is True else Path(record)
        history.append(history.rows_of(study or stem, doc), path)
        written["history"] = path
    return written
