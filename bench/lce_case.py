"""The cases of the linear cross-entropy benchmark that ``bench_lce`` runs in one child process: one shape,
one or several implementations measured one after the other on the same inputs (timed forward+backward
and forward, the plan each chose, errors against the shape's float32 reference, computed once when
first needed and kept in host memory), each finished before the next starts. Also the probe
(environment, which peers import).

Several implementations share a process only when none is expected to break it (``Impl.isolate``):
they then share the process start, the inputs and the reference, which dominate short cases. Between
implementations the allocator cache is emptied, so each one's peak memory is measured from the same
baseline as in a process of its own.

An implementation with ``Impl.budget_from`` (``hugehead_eqmem``: hugehead at torch.compile's memory) takes
its ``memory_budget`` from that implementation's row at the same shape, read from its case JSON when its
turn comes: written by this process (the parent orders the source first) or, when the source ran in an
earlier process or an earlier part of a resumed run, put there by the parent.
"""
from __future__ import annotations

import gc
import json
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from bench import common  # first: decides which hugehead is imported
from bench.common import (
    ChunkedRelErr,
    Shape,
    classify_error,
    cuda_context_ok,
    make_inputs,
    reference_chunk_cols,
    reference_lce,
    rel_err,
)
from bench.harness import error_text, measure, synchronize, tensor_bytes, time_call_ms, write_json
from bench.peers import IMPLS, PROBED, PeerUnavailable

import torch  # noqa: E402

SLOW_STEP_MS = 5000.0  # a step this slow is warmed up once only


def case_json(json_dir: Path, shape_name: str, impl: str) -> Path:
    return Path(json_dir) / f"{shape_name}__{impl}.json"


def group_json(json_dir: Path, shape_name: str) -> Path:
    """Which implementation (or "reference") the group process is in: where to look if it dies."""
    return Path(json_dir) / f"{shape_name}__group.json"


def read_row(path: Path) -> Optional[dict]:
    """A case's row as its JSON holds it, or None when there is none (or it is unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def budget_from_row(source_impl: str, source: Optional[dict]) -> Tuple[Optional[int], str]:
    """The ``memory_budget`` of an implementation that runs at ``source_impl``'s memory (``Impl.budget_from``):
    ``(bytes, why)`` from ``source``, that implementation's row at the same shape — its measured
    forward+backward peak extra memory — or ``(None, the skip reason)`` when the row has no such
    measurement (no row, unfinished, failed, or not measured on this device): no number is made up."""
    if source is None:
        return None, f"skipped: {source_impl} has no row at this shape (not among the --peers, or not run)"
    if not source.get("done"):
        return None, f"skipped: {source_impl}'s case at this shape did not finish (stage {source.get('stage')})"
    status = source.get("fwd_bwd_status") or source.get("status")
    if status != "ok":
        why = str(source.get("fwd_bwd_error") or source.get("error") or "")[:200]
        return None, (f"skipped: {source_impl} {str(status).upper()} at this shape, no peak memory to match"
                      + (f" ({why})" if why else ""))
    peak = source.get("fwd_bwd_peak_extra_bytes")
    if not isinstance(peak, (int, float)) or isinstance(peak, bool):
        return None, f"skipped: {source_impl}'s peak memory was not measured here (measured on CUDA only)"
    if peak < 1:
        return None, f"skipped: {source_impl}'s measured peak extra memory is {peak} bytes (below 1)"
    return int(peak), f"{source_impl}'s fwd+bwd peak extra memory at this shape: {peak / 2**30:.2f} GiB"


def _measure(step: Callable[[], object], device: torch.device, reps: int, warmup: int, budget_s: float,
             input_bytes: int):
    """:func:`bench.harness.measure` with the case's budget (a warm-up call that alone exceeds it is the
    measurement). Returns (the row's fields for this stage, the result of the last call)."""
    t = measure(step, device, reps=reps, warmup=max(1, warmup), budget_s=budget_s, input_bytes=input_bytes,
                slow_warmup_ms=SLOW_STEP_MS)
    out, t.result = t.result, None
    return t.fields(), out


@contextmanager
def _recorded_warnings(sink: List[str], limit: int = 8):
    """Collect the distinct warnings raised inside the block into ``sink`` (and still print them): a
    peer that silently falls back to another path says so in a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        finally:
            for w in caught:
                text = f"{w.category.__name__}: {w.message}"[:400]
                if text not in sink and len(sink) < limit:
                    sink.append(text)
                    print("warning:", text, flush=True)


def _max_rss_bytes() -> Optional[int]:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except (ImportError, OSError):
        return None


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _Case:
    """One implementation's row: written to its JSON after every stage, so a dead process leaves it."""

    def __init__(self, impl_name: str, shape: Shape, device: torch.device, dtype: torch.dtype, opts, path: Path,
                 group: List[str]):
        self.t_start = time.perf_counter()
        self.impl = IMPLS[impl_name]
        self.device = device
        self.path = path
        self.row: dict = {
            "shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": str(dtype).replace("torch.", ""),
            "impl": impl_name, "impl_about": self.impl.about, "impl_exact": self.impl.exact, "impl_version": None,
            "device": str(device), "seed": opts.seed, "status": "running", "error": None, "stage": "setup",
            "done": False, "fwd_bwd_status": None, "fwd_status": None, "warnings": [], "process_group": group,
        }

    def start(self) -> None:
        self.t_start = time.perf_counter()

    def save(self, stage: Optional[str] = None) -> None:
        if stage is not None:
            self.row["stage"] = stage
        self.row["wall_s"] = round(time.perf_counter() - self.t_start, 2)
        write_json(self.path, self.row)

    def fail(self, stage: str, exc: BaseException) -> bool:
        """Record a stage's exception; False when the CUDA context is gone (nothing more can run)."""
        traceback.print_exc()
        self.row[f"{stage}_status"] = classify_error(exc)
        self.row[f"{stage}_error"] = error_text(exc)
        exc.__traceback__ = None  # its frames hold the failed step's tensors (e.g. the N x V logits)
        _release(self.device)
        if not cuda_context_ok(self.device):
            self.row["context_lost"] = True
            return False
        return True

    def finish(self, status: Optional[str] = None) -> dict:
        row = self.row
        fb, fw = row.get("fwd_bwd_status"), row.get("fwd_status")
        if status is None and row.get("context_lost"):
            status = "cuda-error"
        elif status is None:
            ref_ok = row.get("ref_status") in (None, "ok")
            status = fb if fb != "ok" else ("ok" if fw == "ok" and ref_ok else "partial")
        row["status"] = status
        if row["error"] is None:
            row["error"] = row.get("fwd_bwd_error") or row.get("ref_error") or row.get("fwd_error")
        row["done"] = True
        self.save("done")
        return row


def _measure_impl(case: _Case, loss_fn, shape: Shape, x, weight, target, dtype, opts,
                  reference: Callable[[], Optional[dict]]) -> bool:
    """fwd+bwd (compared with ``reference()``) then fwd of one implementation on the shared inputs.
    Returns False when the CUDA context is lost."""
    row, device, impl = case.row, case.device, case.impl
    if impl.plan is not None:
        try:  # what the implementation's planner picks for this shape, with the inputs allocated
            given = {"memory_budget": row["memory_budget"]} if impl.budget_from else {}
            row["plan"] = impl.plan(shape.n, shape.d, shape.v, dtype, device, **given)
        except Exception as exc:  # noqa: BLE001  (a planner API change must not lose the measurement)
            row["plan_error"] = error_text(exc)
    if impl.name.startswith("hugehead"):  # which logits GEMM its forward ran (hugehead.tuning's gemm)
        from hugehead import ops

        row["gemm"] = ops.gemm_path(device, dtype)
    case.save("fwd_bwd")

    def fwd_bwd():
        loss = loss_fn(x, weight, target)
        gx, gw = torch.autograd.grad(loss, (x, weight))
        return loss.detach(), gx, gw

    try:
        with _recorded_warnings(row["warnings"]):
            if impl.compiles:  # compile + first call, excluded from the warm-up and the medians
                row["fwd_bwd_compile_ms"], _ = time_call_ms(fwd_bwd, device)
                _ = None
            stats, out = _measure(fwd_bwd, device, opts.reps, opts.warmup, 0.5 * opts.case_budget,
                                  row["input_bytes"])
        row["fwd_bwd_status"] = "ok"
        row.update({f"fwd_bwd_{k}": v for k, v in stats.items()})
        loss, gx, gw = out
        out = None
        if stats["peak_extra_bytes"] is not None:
            # everything but the inputs and the gradients handed back, including what the implementation
            # kept allocated between calls (it was already there when the peak counter was reset)
            extra = stats["peak_extra_bytes"] - tensor_bytes(gx, gw)
            row["fwd_bwd_peak_extra_bytes"] = extra
            row["fwd_bwd_peak_extra_gib"] = extra / 2**30
        if device.type == "cpu":
            row["fwd_bwd_max_rss_bytes"] = _max_rss_bytes()  # the whole process so far, inputs included
        row["tflops"] = shape.fwd_bwd_flops / (stats["ms"] * 1e-3) / 1e12
        row["loss"] = float(loss.float())
        case.save("compare")
        _compare(case, reference(), gx, gw, x, weight)
        del loss, gx, gw
    except Exception as exc:  # noqa: BLE001
        if not case.fail("fwd_bwd", exc):
            return False
    _release(device)

    case.save("fwd")
    xd, wd = x.detach(), weight.detach()

    def fwd():
        with torch.no_grad():
            return loss_fn(xd, wd, target)

    try:
        with _recorded_warnings(row["warnings"]):
            if impl.compiles:  # no_grad is a new graph: compiled again
                row["fwd_compile_ms"], _ = time_call_ms(fwd, device)
                _ = None
            stats, loss = _measure(fwd, device, opts.reps, opts.warmup, 0.25 * opts.case_budget, row["input_bytes"])
        row["fwd_status"] = "ok"
        row.update({f"fwd_{k}": v for k, v in stats.items()})
        row["fwd_tflops"] = shape.fwd_flops / (stats["ms"] * 1e-3) / 1e12
        row["fwd_loss"] = float(loss.float())
        ref = reference()
        if ref is not None:
            row["loss_ref"] = ref["loss"]
            row["fwd_loss_rel_err"] = abs(row["fwd_loss"] - ref["loss"]) / abs(ref["loss"])
        del loss
    except Exception as exc:  # noqa: BLE001
        if not case.fail("fwd", exc):
            return False
    _release(device)
    return True


def _reference(shape: Shape, x, weight, target, device, opts) -> dict:
    """The float32 reference of the shape: loss, ``grad_x`` ``[N, D]`` and ``grad_w`` ``[V, D]`` float32 in
    host memory (the implementations' dW are compared with it chunk by chunk; it stays there,
    out of the way of the next implementation's memory measurement)."""
    cols = opts.ref_chunk or reference_chunk_cols(shape.n, shape.v)
    grad_w = torch.empty(weight.shape, dtype=torch.float32)  # host memory: the GPU is for the measurements

    def sink(c0, c1, chunk):
        grad_w[c0:c1].copy_(chunk)

    t0 = time.perf_counter()
    ref = reference_lce(x.detach(), weight.detach(), target, chunk_cols=cols, grad_weight_sink=sink)
    synchronize(device)
    return {"loss": ref.loss, "grad_x": ref.grad_x.cpu(), "grad_w": grad_w, "cols": cols,
            "seconds": round(time.perf_counter() - t0, 2)}


def _compare(case: _Case, ref: Optional[dict], gx, gw, x, weight) -> None:
    """Errors of one implementation's loss and gradients against the reference, recorded in its row."""
    row = case.row
    if ref is None:
        return
    row.update(loss_ref=ref["loss"], loss_rel_err=abs(row["loss"] - ref["loss"]) / abs(ref["loss"]),
               ref_s=ref["seconds"], ref_chunk_cols=ref["cols"])
    if gx is None or gw is None or gx.shape != x.shape or gw.shape != weight.shape:
        row["ref_status"], row["ref_error"] = "error", (
            f"gradients missing or misshaped: dx {getattr(gx, 'shape', None)}, dW {getattr(gw, 'shape', None)}")
        return
    try:
        gw_err = ChunkedRelErr(gw)
        v, cols = weight.shape[0], ref["cols"]
        for c0 in range(0, v, cols):
            gw_err(c0, min(c0 + cols, v), ref["grad_w"][c0:c0 + cols].to(gw.device))
        ref_gx = ref["grad_x"].to(gx.device)
        row.update(
            grad_x_rel_err=rel_err(gx, ref_gx), grad_w_rel_err=gw_err.rel_err,
            grad_x_norm=float(torch.linalg.vector_norm(gx.float())),
            grad_x_norm_ref=float(torch.linalg.vector_norm(ref["grad_x"])),
            grad_w_norm=gw_err.actual_sq ** 0.5, grad_w_norm_ref=gw_err.ref_sq ** 0.5, ref_status="ok",
        )
    except Exception as exc:  # noqa: BLE001
        case.fail("ref", exc)


def run_cases(impl_names: List[str], shape: Shape, device: torch.device, dtype: torch.dtype, opts,
              json_dir: Path, json_out: Optional[Path] = None) -> List[dict]:
    """Measure ``impl_names`` one after the other on one shape in this process, then compare all with one
    reference. Each row goes to ``case_json(json_dir, shape, impl)`` (or ``json_out`` for a single
    implementation) after every stage. ``opts`` carries ``reps``, ``warmup``, ``case_budget``, ``seed``
    and ``ref_chunk``."""
    group_file = group_json(json_dir, shape.name)

    def running(what: str) -> None:
        write_json(group_file, {"running": what, "impls": impl_names, "since": time.time()})

    cases: List[_Case] = []
    settled: List[dict] = []  # rows finished before measuring (skipped, import errors)
    loss_fns: Dict[str, object] = {}
    for name in impl_names:
        path = json_out if (json_out is not None and len(impl_names) == 1) else case_json(json_dir, shape.name, name)
        case = _Case(name, shape, device, dtype, opts, path, impl_names)
        case.save()
        if case.impl.needs_cuda and device.type != "cuda":
            case.row["error"] = "skipped: needs CUDA"
            settled.append(case.finish("skipped"))
            continue
        try:
            loss_fns[name], case.row["impl_version"] = case.impl.load()
        except PeerUnavailable as exc:
            case.row["error"] = f"skipped: {exc}"
            settled.append(case.finish("skipped"))
            continue
        except Exception as exc:  # noqa: BLE001  (a peer that does not import is a result)
            traceback.print_exc()
            case.row["error"] = error_text(exc)
            settled.append(case.finish("import-error"))
            continue
        cases.append(case)

    def in_order(rows: List[dict]) -> List[dict]:
        return sorted(settled + rows, key=lambda r: impl_names.index(r["impl"]))

    if not cases:
        return in_order([])

    running("inputs")
    try:
        x, weight, target = make_inputs(shape, device, dtype=dtype, seed=opts.seed)
        synchronize(device)
    except Exception as exc:  # noqa: BLE001
        for c in cases:
            c.fail("inputs", exc)
            c.row["error"] = c.row["inputs_error"]
            c.finish(c.row["inputs_status"])
        return in_order([c.row for c in cases])

    ref: dict = {}

    def reference() -> Optional[dict]:
        """Computed the first time a case needs it (a peer that crashes first costs no reference)."""
        if not ref:
            running("reference")
            try:
                ref["value"] = _reference(shape, x, weight, target, device, opts)
            except Exception as exc:  # noqa: BLE001  (the measurements still stand; each row says why no errors)
                ref["value"] = None
                for c in cases:
                    c.fail("ref", exc)
            running(current[0])
        return ref["value"]

    current = [""]
    x.requires_grad_(True)
    weight.requires_grad_(True)

    finished: List[dict] = []
    for case in cases:
        current[0] = case.impl.name
        running(case.impl.name)
        case.start()
        if case.impl.budget_from:  # its budget: the measured peak of a case run before it (this process or earlier)
            source_impl = case.impl.budget_from
            source = read_row(case_json(json_dir, shape.name, source_impl))
            budget, why = budget_from_row(source_impl, source)
            if budget is None:
                case.row["error"] = why
                finished.append(case.finish("skipped"))
                continue
            case.row.update(memory_budget=budget, memory_budget_gib=budget / 2**30, memory_budget_reason=why,
                            memory_budget_from={k: source.get(k) for k in (
                                "impl", "fwd_bwd_peak_extra_bytes", "fwd_bwd_ms", "process_group", "log")})
            try:
                loss_fns[case.impl.name], _ = case.impl.load(memory_budget=budget)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                case.row["error"] = error_text(exc)
                finished.append(case.finish("import-error"))
                continue
        case.row["input_bytes"] = tensor_bytes(x, weight, target)
        case.row["grad_bytes"] = tensor_bytes(x, weight)
        case.row["ref_shared_by"] = len(cases)
        alive = _measure_impl(case, loss_fns[case.impl.name], shape, x, weight, target, dtype, opts, reference)
        finished.append(case.finish())
        if not alive:  # the CUDA context is gone: the others get a fresh process from the parent
            break
    running("done")
    return in_order(finished)


def run_probe(device: torch.device, json_out: Path) -> None:
    """Environment facts, which implementations import (and their versions), the reference self-check."""
    info = {"environment": common.environment(device), "imports": {}}
    for name in PROBED:
        try:
            _, version = IMPLS[name].load()
            info["imports"][name] = {"ok": True, "version": version}
        except PeerUnavailable as exc:
            info["imports"][name] = {"ok": False, "unavailable": True, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001
            info["imports"][name] = {"ok": False, "error": error_text(exc)}
    info["reference_selfcheck"] = common.reference_selfcheck()
    write_json(json_out, info)
