"""Linear cross-entropy benchmark: hugehead against plain PyTorch, Cut Cross-Entropy and Liger-Kernel on
the DESIGN.md shapes (bf16, loss + exact dL/dx and dL/dW).

Every (implementation, shape) case runs in its own subprocess with a timeout, because a peer that
faults (an illegal memory access poisons the CUDA context) or hangs must not take the other cases
down. The parent never touches CUDA; it collects one JSON per case and rewrites ``lce.json``,
``lce.md`` and ``lce.png`` after every case, so a run cut short still leaves its results.

    python -m bench.bench_lce --out DIR [--shapes a,b] [--peers hugehead,torch,cce,liger] [--budget S]
    python -m bench.bench_lce --cpu-smoke [--out DIR]      # the whole pipeline on tiny CPU shapes
    python -m bench.bench_lce --one IMPL SHAPE --json-out F  # one case in this process (what the parent runs)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from bench import common  # first: decides which hugehead is imported
from bench.common import (
    REPO_ROOT,
    SHAPES,
    SMOKE_SHAPES,
    ChunkedRelErr,
    Shape,
    classify_error,
    cuda_context_ok,
    error_text,
    find_shape,
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------------------------------
# Implementations: each loads lazily (a failed import is a result, not a crash)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Impl:
    name: str
    needs_cuda: bool
    load: Callable[[], Tuple[LossFn, Optional[str]]]  # -> (loss_fn(x, weight, target), version)
    about: str


def _load_hugehead():
    import hugehead

    return (lambda x, w, t: hugehead.linear_cross_entropy(x, w, t)), hugehead.__version__


def _load_torch():
    return (lambda x, w, t: F.cross_entropy(F.linear(x, w), t)), torch.__version__


def _load_cce(filter_eps=None):
    def load():
        from cut_cross_entropy import linear_cross_entropy

        # filter_eps=None: exact gradients (the library's default "high" skips small softmax entries).
        return (
            lambda x, w, t: linear_cross_entropy(x, w, t, filter_eps=filter_eps),
            common.package_version("cut-cross-entropy"),
        )

    return load


def _load_liger(accum_dtype=None):
    def load():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        head = LigerFusedLinearCrossEntropyLoss(reduction="mean", accum_dtype=accum_dtype)

        def loss_fn(x, w, t):
            out = head(w, x, t)
            return out if isinstance(out, Tensor) else out.loss

        return loss_fn, common.package_version("liger-kernel") or common.package_version("liger_kernel")

    return load


def _selftest(kind: str):
    """Failure modes for checking the harness itself (--cpu-smoke runs them through subprocesses)."""

    def load():
        def loss_fn(x, w, t):
            if kind == "crash":
                os.abort()
            if kind == "hang":
                time.sleep(3600)
            if kind == "oom":
                raise torch.OutOfMemoryError("selftest: pretend the device is out of memory")
            raise RuntimeError(f"selftest: {kind}")

        return loss_fn, None

    return load


IMPLS: Dict[str, Impl] = {
    i.name: i
    for i in [
        Impl("hugehead", False, _load_hugehead, "hugehead.linear_cross_entropy (planned chunks)"),
        Impl("torch", False, _load_torch, "F.cross_entropy(F.linear(x, W), t) in bf16, eager"),
        Impl("cce", True, _load_cce(None), "cut_cross_entropy.linear_cross_entropy, filter_eps=None (exact)"),
        Impl("liger", True, _load_liger(None), "LigerFusedLinearCrossEntropyLoss, defaults (bf16 dW accumulation)"),
        Impl("cce_filter", True, _load_cce("high"), "cut_cross_entropy with its default gradient filter"),
        Impl("liger_fp32acc", True, _load_liger(torch.float32), "Liger with accum_dtype=torch.float32"),
        Impl("selftest_crash", False, _selftest("crash"), "harness check: the case process aborts"),
        Impl("selftest_hang", False, _selftest("hang"), "harness check: the case process hangs"),
        Impl("selftest_oom", False, _selftest("oom"), "harness check: OutOfMemoryError"),
        Impl("selftest_error", False, _selftest("error"), "harness check: an exception"),
    ]
}
DEFAULT_PEERS = ["hugehead", "torch", "cce", "liger"]
PROBED = ["hugehead", "cce", "liger"]  # imports reported in lce.json's meta

SLOW_STEP_MS = 5000.0  # a step this slow is warmed up once only (its first call already compiled)


# --------------------------------------------------------------------------------------------------
# One case (runs in a subprocess of the parent)
# --------------------------------------------------------------------------------------------------
def _measure(step: Callable[[], object], device: torch.device, reps: int, warmup: int, budget_s: float):
    """Warm up, then time ``reps`` calls of ``step`` (fewer when they would exceed ``budget_s``; at least
    one) with the peak memory over the timed calls. Returns (stats, result of the last call)."""
    warm_ms = []
    for _ in range(max(1, warmup)):
        ms, out = time_call_ms(step, device)
        del out
        warm_ms.append(ms)
        if ms > SLOW_STEP_MS:
            break
    n = max(1, min(reps, int(budget_s * 1e3 // max(warm_ms[-1], 1e-3))))
    base = memory_baseline(device)
    times, out = [], None
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


def run_case(impl_name: str, shape: Shape, device: torch.device, opts, json_out: Path) -> dict:
    """Measure one implementation on one shape and write the row to ``json_out`` after every stage."""
    t_start = time.perf_counter()
    impl = IMPLS[impl_name]
    row: dict = {
        "shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": "bfloat16",
        "impl": impl_name, "impl_about": impl.about, "impl_version": None, "device": str(device),
        "seed": opts.seed, "status": "running", "error": None, "stage": "setup", "done": False,
        "fwd_bwd_status": None, "fwd_status": None,
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
    except Exception as exc:  # noqa: BLE001  (a peer that does not import is a result)
        traceback.print_exc()
        row["error"] = error_text(exc)
        return finish("import-error")

    row["stage"] = "inputs"
    save()
    try:
        x, weight, target = make_inputs(shape, device, seed=opts.seed)
        synchronize(device)
    except Exception as exc:  # noqa: BLE001
        fail_stage("inputs", exc)
        row["error"] = row["inputs_error"]
        return finish(row["inputs_status"])
    row["input_bytes"] = tensor_bytes(x, weight, target)
    row["grad_bytes"] = tensor_bytes(x, weight)
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
        stats, grads = _measure(fwd_bwd, device, opts.reps, opts.warmup, 0.5 * opts.case_budget)
        row["fwd_bwd_status"] = "ok"
        row.update({f"fwd_bwd_{k}": v for k, v in stats.items()})
        if stats["peak_bytes"] is not None:
            # everything but the inputs and the gradients handed back, including what the implementation
            # kept allocated between calls (it was already there when the peak counter was reset)
            extra = stats["peak_bytes"] - row["input_bytes"] - tensor_bytes(grads[1], grads[2])
            row["fwd_bwd_peak_extra_bytes"] = extra
            row["fwd_bwd_peak_extra_gib"] = extra / 2**30
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
            gw_err = ChunkedRelErr(gw)
            t0 = time.perf_counter()
            ref = reference_lce(x.detach(), weight.detach(), target, chunk_cols=cols, grad_weight_sink=gw_err)
            synchronize(device)
            row.update(
                ref_s=round(time.perf_counter() - t0, 2), ref_chunk_cols=cols, loss_ref=ref.loss,
                loss_rel_err=abs(row["loss"] - ref.loss) / abs(ref.loss),
                grad_x_rel_err=rel_err(gx, ref.grad_x), grad_w_rel_err=gw_err.rel_err,
                grad_x_norm=float(torch.linalg.vector_norm(gx.float())),
                grad_x_norm_ref=float(torch.linalg.vector_norm(ref.grad_x)),
                grad_w_norm=gw_err.actual_sq ** 0.5, grad_w_norm_ref=gw_err.ref_sq ** 0.5,
            )
            del ref
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
        except Exception as exc:  # noqa: BLE001
            info["imports"][name] = {"ok": False, "error": error_text(exc)}
    info["reference_selfcheck"] = common.reference_selfcheck()
    write_json(json_out, info)


# --------------------------------------------------------------------------------------------------
# The parent: one subprocess per case
# --------------------------------------------------------------------------------------------------
def _child(args: List[str], log: Path, timeout: float) -> Tuple[Optional[int], bool, float]:
    """Run ``python -m bench.bench_lce ARGS`` in its own process group; returns (rc, timed_out, wall s)."""
    cmd = [sys.executable, "-m", "bench.bench_lce", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout)), False, time.perf_counter() - t0
        except subprocess.TimeoutExpired:
            _stop(proc)
            return None, True, time.perf_counter() - t0
        finally:  # also when this parent is being stopped (SIGTERM -> SystemExit): no orphan on the GPU
            if proc.poll() is None:
                _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
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


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]


def _case_row(impl: str, shape: Shape, work: Path, opts, timeout: float) -> dict:
    stem = f"{shape.name}__{impl}"
    json_out, log = work / f"{stem}.json", work / f"{stem}.log"
    args = ["--one", impl, shape.name, "--json-out", str(json_out), "--reps", str(opts.reps),
            "--warmup", str(opts.warmup), "--case-budget", str(opts.case_budget), "--seed", str(opts.seed)]
    if opts.ref_chunk:
        args += ["--ref-chunk", str(opts.ref_chunk)]
    if opts.cpu_smoke:
        args.append("--cpu-smoke")
    json_out.unlink(missing_ok=True)  # a reused --work folder must not pass an old result off as new
    rc, timed_out, wall = _child(args, log, timeout)
    try:
        row = json.loads(json_out.read_text())
    except (OSError, ValueError):
        row = {"shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": "bfloat16",
               "impl": impl, "status": "crash", "error": None, "stage": "startup", "done": False}
    row["rc"] = rc
    row["wall_s"] = round(wall, 1)
    stage = row.get("stage")
    if timed_out:
        row["status"] = "timeout"
        row["error"] = f"timed out after {timeout:.0f} s in stage {stage}"
        if stage in ("fwd_bwd", "fwd") and not row.get(f"{stage}_status"):
            row[f"{stage}_status"] = "timeout"
    elif not row.get("done"):
        how = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"
        row["status"] = "crash"
        last = [ln for ln in _tail(log, 4000).splitlines() if ln.strip() and not ln.startswith("$ ")][-1:]
        row["error"] = f"process died ({how}) in stage {stage}" + (f": {last[0][:300]}" if last else "")
        if stage in ("fwd_bwd", "fwd") and not row.get(f"{stage}_status"):
            row[f"{stage}_status"] = "crash"
    if row.get("status") != "ok":
        row["log_tail"] = _tail(log)
    return row


def _fmt_case(row: dict) -> str:
    def num(key, fmt):
        v = common.as_float(row.get(key))
        return format(v, fmt) if v is not None else "-"

    return (f"{row['status']:<12} fwd+bwd {num('fwd_bwd_ms', '9.2f')} ms  fwd {num('fwd_ms', '8.2f')} ms  "
            f"peak+ {num('fwd_bwd_peak_extra_gib', '6.2f')} GiB  loss rel {num('loss_rel_err', '.1e')}  "
            f"dW rel {num('grad_w_rel_err', '.1e')}  ({row.get('wall_s', 0):.0f} s)"
            + (f"\n        {row['error']}" if row.get("error") else ""))


def _parse_list(text: Optional[str], known: Dict[str, object], default: List[str], what: str) -> List[str]:
    names = default if not text else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def run_all(opts) -> int:
    """Probe, run every case in a subprocess, write lce.json / lce.md / lce.png. Returns the exit code:
    0 when every hugehead case worked with plausible errors and the reference passed its self-check,
    1 otherwise (peers failing is data, not failure)."""
    from bench import report

    t_start = time.perf_counter()

    def stopped(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through _child, which stops the running case

    signal.signal(signal.SIGTERM, stopped)
    shape_table = SMOKE_SHAPES if opts.cpu_smoke else SHAPES
    shapes = [shape_table[s] for s in _parse_list(opts.shapes, shape_table, list(shape_table), "shapes")]
    impls = _parse_list(opts.peers, IMPLS, DEFAULT_PEERS, "implementations")
    if opts.cpu_smoke and not opts.ref_chunk:
        opts.ref_chunk = 700  # several reference chunks, the last one partial, on the tiny shapes
    work = Path(opts.work or tempfile.mkdtemp(prefix="hugehead-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_lce: {len(shapes)} shapes x {len(impls)} implementations; case logs in {work}", flush=True)

    probe_json = work / "probe.json"
    rc, timed_out, _ = _child(["--probe", "--json-out", str(probe_json)] + (["--cpu-smoke"] if opts.cpu_smoke else []),
                              work / "probe.log", 300)
    try:
        probe = json.loads(probe_json.read_text())
    except (OSError, ValueError):
        print(f"bench_lce: the probe failed (rc={rc}, timed out={timed_out}):\n{_tail(work / 'probe.log')}", flush=True)
        probe = {"environment": {}, "imports": {}, "probe_error": _tail(work / "probe.log")}
    env = probe.get("environment", {})
    selfcheck = probe.get("reference_selfcheck") or {}
    selfcheck_ok = bool(selfcheck) and all((common.as_float(v) or 1.0) < 1e-5 for v in selfcheck.values())
    for name, st in probe.get("imports", {}).items():
        print(f"  import {name:<9} " + (f"ok {st.get('version')}" if st.get("ok") else f"FAILED {st.get('error')}"))
    print(f"  reference self-check vs float64: {selfcheck} -> {'ok' if selfcheck_ok else 'FAILED'}", flush=True)

    if opts.out:
        out_dir = Path(opts.out)
    elif opts.cpu_smoke:
        out_dir = Path(tempfile.mkdtemp(prefix="hugehead-bench-smoke-"))
    else:
        out_dir = REPO_ROOT / "bench" / "results" / common.gpu_slug(str(env.get("gpu_name", "unknown")))
    out_dir.mkdir(parents=True, exist_ok=True)

    doc = {
        "meta": {
            "benchmark": "linear_cross_entropy",
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.executable).name, "-m", "bench.bench_lce", *sys.argv[1:]]),
            **common.git_sha(),
            **env,
            "imports": probe.get("imports", {}),
            "reference_selfcheck": selfcheck,
            "reference_selfcheck_ok": selfcheck_ok,
            "cpu_smoke": bool(opts.cpu_smoke),
            "reps": opts.reps, "warmup": opts.warmup, "case_budget_s": opts.case_budget, "seed": opts.seed,
            "shapes": {s.name: {"n": s.n, "d": s.d, "v": s.v, "note": s.note} for s in shapes},
            "implementations": {i: IMPLS[i].about for i in impls},
            "method": (
                "bf16 inputs x~N(0,1), W~N(0,1/D), uniform random targets, seeded identically for every "
                "implementation. fwd+bwd: loss then torch.autograd.grad for x and W (exact gradients). fwd: "
                "loss under torch.no_grad with inputs that do not require grad. Times: median of the timed "
                "repetitions after warm-up (CUDA events; fewer repetitions only when one step takes longer "
                "than the case budget allows). peak extra: torch.cuda.max_memory_allocated during the timed "
                "steps minus the bytes of x, W, targets and the returned gradients. TFLOP/s "
                "on 8*N*D*V (fwd: 2*N*D*V). Errors relative to a float32 chunked reference with exact "
                "softmax, full-precision GEMMs (no TF32), computed in the case's process from the same inputs."
            ),
        },
        "rows": [],
    }

    def publish():
        doc["meta"]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        report.write_reports(doc, out_dir)

    publish()
    cases = [(s, i) for s in shapes for i in impls]
    for k, (shape, impl) in enumerate(cases, 1):
        remaining = None if opts.budget is None else opts.budget - (time.perf_counter() - t_start)
        print(f"[{k:2d}/{len(cases)}] {shape.name:<9} {impl:<14} ", end="", flush=True)
        if remaining is not None and remaining < opts.min_case_s:
            row = {"shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": "bfloat16",
                   "impl": impl, "status": "skipped",
                   "error": f"skipped: bench budget of {opts.budget:.0f} s used up"}
        else:
            timeout = opts.case_timeout if remaining is None else min(opts.case_timeout, remaining)
            row = _case_row(impl, shape, work, opts, timeout)
        doc["rows"].append(row)
        print(_fmt_case(row), flush=True)
        publish()

    print(f"\nwrote {out_dir}/lce.json, lce.md" + ("" if doc["meta"].get("png_error") else ", lce.png")
          + f" in {time.perf_counter() - t_start:.0f} s", flush=True)
    if doc["meta"].get("png_error"):
        print(f"  (no plot: {doc['meta']['png_error']})")
    print()
    print(report.render_markdown(doc), flush=True)
    hugehead_rows = [r for r in doc["rows"] if r["impl"] == "hugehead"]
    hugehead_ok = all(r.get("status") == "ok" for r in hugehead_rows)
    accurate = not any(report.suspect(common.as_float(r.get(k))) for r in hugehead_rows
                       for k in ("loss_rel_err", "grad_x_rel_err", "grad_w_rel_err"))
    if not accurate:
        print(f"bench_lce: a hugehead error is above {report.SUSPECT_REL_ERR:g} relative (bold in the table)")
    return 0 if (hugehead_ok and accurate and selfcheck_ok) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results folder (default bench/results/<gpu>/; a temp folder for --cpu-smoke)")
    p.add_argument("--shapes", help=f"comma list of shapes (default all: {','.join(SHAPES)})")
    p.add_argument("--peers", help=f"comma list of implementations (default {','.join(DEFAULT_PEERS)}; "
                                   f"also: {','.join(i for i in IMPLS if i not in DEFAULT_PEERS)})")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU; CUDA-only peers are skipped")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2; 1 for slow steps)")
    p.add_argument("--case-budget", type=float, default=120.0,
                   help="seconds the timed loops of one case may take: half for fwd+bwd, a quarter for fwd; "
                        "repetitions are cut to fit, never below one (default 120)")
    p.add_argument("--case-timeout", type=float, default=300.0, help="kill a case after this many seconds")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run; cases that would start later are skipped")
    p.add_argument("--min-case-s", type=float, default=45.0,
                   help="with --budget: do not start a case with less than this left (default 45)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ref-chunk", type=int, default=0, help="reference chunk width (default: ~2 GiB of logits)")
    p.add_argument("--work", help="folder for per-case JSON and logs (default: a new temp folder)")
    p.add_argument("--list", action="store_true", help="print shapes and implementations, then exit")
    p.add_argument("--one", nargs=2, metavar=("IMPL", "SHAPE"), help="run one case in this process")
    p.add_argument("--probe", action="store_true", help="write environment and import facts to --json-out")
    p.add_argument("--json-out", help="with --one / --probe: where the JSON goes")
    opts = p.parse_args(argv)

    if opts.list:
        for s in [*SHAPES.values(), *SMOKE_SHAPES.values()]:
            print(f"shape {s.name:<10} N={s.n:<6} D={s.d:<5} V={s.v:<8} {s.note}")
        for i in IMPLS.values():
            print(f"impl  {i.name:<14} {'CUDA ' if i.needs_cuda else '     '}{i.about}")
        return 0
    device = torch.device("cpu" if opts.cpu_smoke else "cuda")
    if opts.probe or opts.one:
        if not opts.json_out:
            p.error("--one and --probe need --json-out")
        if device.type == "cuda" and not torch.cuda.is_available():
            print("bench_lce: CUDA is not available (use --cpu-smoke on a machine without a GPU)", file=sys.stderr)
        if opts.probe:
            run_probe(device if torch.cuda.is_available() or device.type == "cpu" else torch.device("cpu"),
                      Path(opts.json_out))
            return 0
        impl, shape = opts.one
        if impl not in IMPLS:
            p.error(f"unknown implementation {impl}")
        row = run_case(impl, find_shape(shape), device, opts, Path(opts.json_out))
        print(_fmt_case(row), flush=True)
        # os._exit: a CUDA context a peer has broken can hang in interpreter teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if not opts.cpu_smoke and not torch.cuda.is_available():
        print("bench_lce: CUDA is not available here; run with --cpu-smoke to check the pipeline", file=sys.stderr)
        return 2
    return run_all(opts)


if __name__ == "__main__":
    sys.exit(main())
