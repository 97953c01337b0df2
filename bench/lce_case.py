"""One case of the linear cross-entropy benchmark (one implementation on one shape), run in its own
process by ``bench_lce``: timed forward+backward and forward, the plan the implementation chose, and
the errors against the float32 chunked reference. Also the probe (environment, which peers import).
"""
from __future__ import annotations

import gc
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Optional

from bench import common  # first: decides which hugehead is imported
from bench.common import (
    ChunkedRelErr,
    Shape,
    classify_error,
    cuda_context_ok,
    error_text,
    make_inputs,
    median,
    memory_baseline,
    memory_peak,
    reference_chunk_cols,
    reference_lce,
    rel_err,
    synchronize,
    tensor_bytes,
    time_call_ms,
    write_json,
)
from bench.peers import IMPLS, PROBED, PeerUnavailable

import torch  # noqa: E402

SLOW_STEP_MS = 5000.0  # a step this slow is warmed up once only
REF_CACHE_MAX_BYTES = 1 << 30  # CPU runs keep the reference (dW included) on disk below this size


def _measure(step: Callable[[], object], device: torch.device, reps: int, warmup: int, budget_s: float):
    """Warm up, then time ``reps`` calls of ``step`` (fewer when they would exceed ``budget_s``; at least
    one) with the peak memory over the timed calls. A warm-up call that alone took more than ``budget_s``
    is the measurement (``first_call_only``; not repeated). Returns (stats, result of the last call)."""
    warm_ms, out = [], None
    base = memory_baseline(device)
    for _ in range(max(1, warmup)):
        out = None
        ms, out = time_call_ms(step, device)
        warm_ms.append(ms)
        if ms > SLOW_STEP_MS:
            break
    if warm_ms[-1] > budget_s * 1e3:
        stats = {"ms": warm_ms[-1], "ms_min": warm_ms[-1], "ms_all": [warm_ms[-1]], "reps": 0,
                 "first_call_only": True, "warmup_ms": warm_ms, "peak_bytes": memory_peak(device),
                 "baseline_bytes": base}
        return stats, out
    out = None
    n = max(1, min(reps, int(budget_s * 1e3 // max(warm_ms[-1], 1e-3))))
    base = memory_baseline(device)
    times = []
    for _ in range(n):
        out = None  # the previous result is freed before the next call, as in a training loop
        ms, out = time_call_ms(step, device)
        times.append(ms)
    peak = memory_peak(device)
    stats = {
        "ms": median(times),
        "ms_min": min(times),
        "ms_all": times,
        "reps": n,
        "warmup_ms": warm_ms,
        "peak_bytes": peak,
        "baseline_bytes": base,
    }
    return stats, out


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


def _reference(x, weight, target, gx, gw, cols: int, cache: Optional[Path]):
    """The reference loss and ``grad_x`` and the relative error of ``gw`` (chunk by chunk). With
    ``cache`` (a file path; CPU only), the full reference is loaded from there if present, else saved
    there: every implementation of a shape compares against the same tensors, computed once."""
    gw_err = ChunkedRelErr(gw)
    v = weight.shape[0]
    if cache is not None and cache.exists():
        saved = torch.load(cache)
        for c0 in range(0, v, cols):
            gw_err(c0, min(c0 + cols, v), saved["grad_w"][c0:c0 + cols])
        return saved["loss"], saved["grad_x"], gw_err, True
    full_gw = torch.empty(weight.shape, dtype=torch.float32) if cache is not None else None

    def sink(c0, c1, chunk):
        gw_err(c0, c1, chunk)
        if full_gw is not None:
            full_gw[c0:c1].copy_(chunk)

    ref = reference_lce(x, weight, target, chunk_cols=cols, grad_weight_sink=sink)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        torch.save({"loss": ref.loss, "grad_x": ref.grad_x, "grad_w": full_gw}, tmp)
        tmp.replace(cache)
    return ref.loss, ref.grad_x, gw_err, False


def run_case(impl_name: str, shape: Shape, device: torch.device, dtype: torch.dtype, opts, json_out: Path) -> dict:
    """Measure one implementation on one shape and write the row to ``json_out`` after every stage.

    ``opts`` carries ``reps``, ``warmup``, ``case_budget``, ``seed``, ``ref_chunk`` and ``ref_cache``
    (a folder for the CPU reference cache, or None)."""
    t_start = time.perf_counter()
    impl = IMPLS[impl_name]
    row: dict = {
        "shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": str(dtype).replace("torch.", ""),
        "impl": impl_name, "impl_about": impl.about, "impl_exact": impl.exact, "impl_version": None,
        "device": str(device), "seed": opts.seed, "status": "running", "error": None, "stage": "setup",
        "done": False, "fwd_bwd_status": None, "fwd_status": None, "warnings": [],
    }

    def save():
        row["wall_s"] = round(time.perf_counter() - t_start, 2)
        write_json(json_out, row)

    def finish(status=None):
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
        save()
        return row

    def fail_stage(stage: str, exc: BaseException) -> bool:
        """Record a stage's exception; False when the CUDA context is gone (stop the case)."""
        traceback.print_exc()
        row[f"{stage}_status"] = classify_error(exc)
        row[f"{stage}_error"] = error_text(exc)
        exc.__traceback__ = None  # its frames hold the failed step's tensors (e.g. the N x V logits)
        release()
        if not cuda_context_ok(device):
            row["context_lost"] = True
            return False
        return True

    def release():
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    save()
    if impl.needs_cuda and device.type != "cuda":
        row["error"] = "skipped: needs CUDA"
        return finish("skipped")
    try:
        loss_fn, row["impl_version"] = impl.load()
    except PeerUnavailable as exc:
        row["error"] = f"skipped: {exc}"
        return finish("skipped")
    except Exception as exc:  # noqa: BLE001  (a peer that does not import is a result)
        traceback.print_exc()
        row["error"] = error_text(exc)
        return finish("import-error")

    row["stage"] = "inputs"
    save()
    try:
        x, weight, target = make_inputs(shape, device, dtype=dtype, seed=opts.seed)
        synchronize(device)
    except Exception as exc:  # noqa: BLE001
        fail_stage("inputs", exc)
        row["error"] = row["inputs_error"]
        return finish(row["inputs_status"])
    row["input_bytes"] = tensor_bytes(x, weight, target)
    row["grad_bytes"] = tensor_bytes(x, weight)
    if impl.plan is not None:
        try:  # what the implementation's planner picks for this shape, now that the inputs are allocated
            row["plan"] = impl.plan(shape.n, shape.d, shape.v, dtype, device)
        except Exception as exc:  # noqa: BLE001  (a planner API change must not lose the measurement)
            row["plan_error"] = error_text(exc)
    x.requires_grad_(True)
    weight.requires_grad_(True)

    # ---- forward + backward: loss and exact dL/dx, dL/dW ----
    row["stage"] = "fwd_bwd"
    save()
    grads = None

    def fwd_bwd():
        loss = loss_fn(x, weight, target)
        gx, gw = torch.autograd.grad(loss, (x, weight))
        return loss.detach(), gx, gw

    try:
        with _recorded_warnings(row["warnings"]):
            if impl.compiles:  # compile + first call, excluded from the warm-up and the medians
                row["fwd_bwd_compile_ms"], _ = time_call_ms(fwd_bwd, device)
                _ = None
            stats, grads = _measure(fwd_bwd, device, opts.reps, opts.warmup, 0.5 * opts.case_budget)
        row["fwd_bwd_status"] = "ok"
        row.update({f"fwd_bwd_{k}": v for k, v in stats.items()})
        if stats["peak_bytes"] is not None:
            # everything but the inputs and the gradients handed back, including what the implementation
            # kept allocated between calls (it was already there when the peak counter was reset)
            extra = stats["peak_bytes"] - row["input_bytes"] - tensor_bytes(grads[1], grads[2])
            row["fwd_bwd_peak_extra_bytes"] = extra
            row["fwd_bwd_peak_extra_gib"] = extra / 2**30
        if device.type == "cpu":
            row["fwd_bwd_max_rss_bytes"] = _max_rss_bytes()  # the whole process so far, inputs included
        row["tflops"] = shape.fwd_bwd_flops / (stats["ms"] * 1e-3) / 1e12
        row["loss"] = float(grads[0].float())
    except Exception as exc:  # noqa: BLE001
        grads = None
        if not fail_stage("fwd_bwd", exc):
            return finish()
    if grads is None:
        release()
    save()

    # ---- accuracy against the float32 chunked reference ----
    if grads is not None:
        row["stage"] = "reference"
        save()
        try:
            _, gx, gw = grads
            if gx is None or gw is None or gx.shape != x.shape or gw.shape != weight.shape:
                raise RuntimeError(f"gradients missing or misshaped: dx {getattr(gx, 'shape', None)}, "
                                   f"dW {getattr(gw, 'shape', None)}")
            cols = opts.ref_chunk or reference_chunk_cols(shape.n, shape.v)
            cache = None
            if getattr(opts, "ref_cache", None) and device.type == "cpu" and 4 * shape.v * shape.d <= REF_CACHE_MAX_BYTES:
                cache = Path(opts.ref_cache) / f"ref_{shape.name}_{row['dtype']}_seed{opts.seed}_cols{cols}.pt"
            t0 = time.perf_counter()
            ref_loss, ref_gx, gw_err, cached = _reference(x.detach(), weight.detach(), target, gx, gw, cols, cache)
            synchronize(device)
            row.update(
                ref_s=round(time.perf_counter() - t0, 2), ref_chunk_cols=cols, ref_cached=cached, loss_ref=ref_loss,
                loss_rel_err=abs(row["loss"] - ref_loss) / abs(ref_loss),
                grad_x_rel_err=rel_err(gx, ref_gx), grad_w_rel_err=gw_err.rel_err,
                grad_x_norm=float(torch.linalg.vector_norm(gx.float())),
                grad_x_norm_ref=float(torch.linalg.vector_norm(ref_gx)),
                grad_w_norm=gw_err.actual_sq ** 0.5, grad_w_norm_ref=gw_err.ref_sq ** 0.5,
            )
            del ref_gx, gw_err
        except Exception as exc:  # noqa: BLE001
            if not fail_stage("ref", exc):
                return finish()
        grads = gx = gw = None
        gc.collect()
        save()

    # ---- forward only (inference: inputs without grad) ----
    row["stage"] = "fwd"
    save()
    xd, wd = x.detach(), weight.detach()

    def fwd():
        with torch.no_grad():
            return loss_fn(xd, wd, target)

    try:
        with _recorded_warnings(row["warnings"]):
            if impl.compiles:  # no_grad is a new graph: compiled again
                row["fwd_compile_ms"], _ = time_call_ms(fwd, device)
                _ = None
            stats, loss = _measure(fwd, device, opts.reps, opts.warmup, 0.25 * opts.case_budget)
        row["fwd_status"] = "ok"
        row.update({f"fwd_{k}": v for k, v in stats.items()})
        if stats["peak_bytes"] is not None:
            extra = stats["peak_bytes"] - row["input_bytes"]
            row["fwd_peak_extra_bytes"] = extra
            row["fwd_peak_extra_gib"] = extra / 2**30
        row["fwd_tflops"] = shape.fwd_flops / (stats["ms"] * 1e-3) / 1e12
        row["fwd_loss"] = float(loss.float())
        del loss
    except Exception as exc:  # noqa: BLE001
        if not fail_stage("fwd", exc):
            return finish()
        release()
    if row.get("fwd_status") == "ok" and row.get("loss_ref") is None:
        # forward worked but forward+backward did not (e.g. plain PyTorch OOM): still check the loss
        row["stage"] = "reference"
        save()
        try:
            ref = reference_lce(xd, wd, target, chunk_cols=opts.ref_chunk or None, with_grads=False)
            row.update(loss_ref=ref.loss, fwd_loss_rel_err=abs(row["fwd_loss"] - ref.loss) / abs(ref.loss))
        except Exception as exc:  # noqa: BLE001
            fail_stage("ref", exc)
    elif row.get("fwd_status") == "ok":
        row["fwd_loss_rel_err"] = abs(row["fwd_loss"] - row["loss_ref"]) / abs(row["loss_ref"])
    row["stage"] = "done"
    return finish()


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
