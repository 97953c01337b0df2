"""Linear cross-entropy benchmark: hugehead against plain PyTorch (eager and torch.compile), a pure-PyTorch
vocabulary-chunked function, PyTorch's own F.linear_cross_entropy, Cut Cross-Entropy and Liger-Kernel on
the shapes of bench.common.SHAPES (bf16 on a GPU; fp32 on the CPU shapes), loss + exact dL/dx and dL/dW.

Cases run in child processes with a timeout each (``bench/lce_case.py``, ``bench/child.py``), because a
peer that faults (an illegal memory access poisons the CUDA context) or hangs must not take the other
cases down; per shape, the implementations that cannot break their process share one (inputs,
reference). The parent never touches CUDA; it collects one JSON per case and rewrites ``lce.json``,
``lce.md`` and ``lce.png`` after every process, so a run cut short still leaves its results. The
implementations are in ``bench/peers.py``; ``hugehead_eqmem`` (hugehead at torch.compile's memory) runs
after ``torch_compile`` with its measured peak as ``memory_budget``. A run cut short (``--budget``) is
continued with ``--resume``.

    python -m bench.bench_lce --out DIR [--shapes a,b] [--peers hugehead,torch,...] [--skip xc6M:liger] [--budget S]
    python -m bench.bench_lce --out DIR --resume DIR/lce.json [same options]   # continue a run cut short
    python -m bench.bench_lce @ARGS_FILE                 # the arguments one a line
    python -m bench.bench_lce --device cpu               # fp32 on the CPU shapes -> bench/results/cpu/
    python -m bench.bench_lce --cpu-smoke [--out DIR]    # the whole pipeline on tiny CPU shapes
    python -m bench.bench_lce --case IMPLS SHAPE --json-dir D  # cases in this process (what the parent runs)
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from bench import harness  # first: decides which hugehead is imported
from bench.child import run_child, tail
from bench.common import ALL_SHAPES, CPU_SHAPES, REPO_ROOT, SHAPES, SMOKE_SHAPES, Shape, find_shape
from bench.lce_case import budget_from_row as lce_budget_from_row, case_json as lce_case_json
from bench.lce_case import group_json as lce_group_json
from bench.peers import CPU_PEERS, DEFAULT_PEERS, IMPLS

import torch  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Per mode: (reps, warmup, case budget s, case timeout s, wait-idle s). The CPU shapes take seconds per
# step on 2 cores; a CPU peer slower than the timeout there is recorded as such.
MODE_DEFAULTS = {"cuda": (10, 2, 120.0, 300.0, 0.0), "cpu": (3, 1, 60.0, 100.0, 30.0),
                 "smoke": (10, 2, 120.0, 300.0, 0.0)}


# --------------------------------------------------------------------------------------------------
# The parent: child processes per shape
# --------------------------------------------------------------------------------------------------
def _args_for_child(opts) -> List[str]:
    """The options a case / probe process needs to measure the same way as this parent."""
    args = ["--device", opts.device, "--dtype", opts.dtype]
    if opts.cpu_smoke:
        args.append("--cpu-smoke")
    return args


BUDGET_SKIP = "skipped: bench budget of"  # the error of a case --budget left out (--resume runs it)
# What a resumed run must measure as the earlier part did: (meta key, option)
RESUME_SAME = (("dtype", "dtype"), ("reps", "reps"), ("warmup", "warmup"), ("case_budget_s", "case_budget"),
               ("seed", "seed"))


def _load_resume(path: str, opts, sha: str) -> dict:
    """--resume: the earlier part's lce.json, refused unless it measured this commit the way this run will."""
    try:
        earlier = json.loads(Path(path).read_text())
        meta, _ = earlier["meta"], earlier["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"bench_lce: --resume {path}: not a readable lce.json ({type(exc).__name__}: {exc})")
    diffs = [] if meta.get("git_sha") == sha else [f"git_sha {meta.get('git_sha')} (this tree: {sha})"]
    diffs += [f"{key} {meta.get(key)!r} (this run: {getattr(opts, attr)!r})"
              for key, attr in RESUME_SAME if meta.get(key) != getattr(opts, attr)]
    if diffs:
        raise SystemExit(f"bench_lce: refusing --resume {path}, it was measured differently: {'; '.join(diffs)}")
    return earlier


def _part(meta: dict) -> dict:
    """One part of a run continued with --resume, as lce.json's meta records it."""
    return {k: meta.get(k) for k in ("created_utc", "elapsed_s", "hostname", "command")}


def _skeleton(shape: Shape, impl: str, opts, status: str, error: Optional[str]) -> dict:
    return {"shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": opts.dtype,
            "impl": impl, "impl_exact": IMPLS[impl].exact, "status": status, "error": error,
            "stage": "startup", "done": status != "crash"}


def _dead_row(row: dict, rc: Optional[int], timed_out: bool, timeout: float, log: Path) -> dict:
    """The row of the case that was running when its process timed out or died."""
    stage = row.get("stage")
    if timed_out:
        row["status"] = "timeout"
        row["error"] = f"timed out after {timeout:.0f} s in stage {stage}"
    else:
        how = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"
        row["status"] = "crash"
        last = [ln for ln in tail(log, 4000).splitlines() if ln.strip() and not ln.startswith("$ ")][-1:]
        row["error"] = f"process died ({how}) in stage {stage}" + (f": {last[0][:300]}" if last else "")
    if stage in ("fwd_bwd", "fwd") and not row.get(f"{stage}_status"):
        row[f"{stage}_status"] = row["status"]
    return row


def _run_group(impls: List[str], shape: Shape, work: Path, opts, deadline: Optional[float]) -> List[dict]:
    """Run ``impls`` on ``shape`` in one child process (see lce_case.py) and return their rows. A case
    running longer than ``--case-timeout`` stops the process. The case a process died or was stopped in
    is recorded as such (all of them when it was in the shared inputs or reference) and the cases it had
    not started run again in a fresh process. A process the run's ``--budget`` stopped (``deadline``, on
    the ``time.perf_counter`` clock) leaves the cases it had not finished as budget-skipped rows, which
    ``--resume`` runs again."""
    rows: List[dict] = []
    pending = list(impls)
    attempt = 0
    group_file = lce_group_json(work, shape.name)

    def state() -> dict:
        try:
            return json.loads(group_file.read_text())
        except (OSError, ValueError):
            return {}

    def overdue() -> bool:
        st = state()
        return st.get("running") in pending and time.time() - float(st.get("since", time.time())) > opts.case_timeout

    def budget_skip(impl: str, how: str = "") -> dict:  # a case the run's --budget left out: --resume runs it
        return _skeleton(shape, impl, opts, "skipped", f"{BUDGET_SKIP} {opts.budget:.0f} s used up{how}")

    while pending:
        attempt += 1
        # one case timeout for the setup and reference, one per case
        timeout = opts.case_timeout * (len(pending) + 1)
        at_deadline = False  # whether the run's --budget, not the cases' timeout, bounds this process
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left < 1.0:
                rows += [budget_skip(impl) for impl in pending]
                break
            at_deadline = left <= timeout
            timeout = min(timeout, left)
        log = work / f"{shape.name}__{'+'.join(pending)}{'' if attempt == 1 else f'.{attempt}'}.log"
        paths = {i: lce_case_json(work, shape.name, i) for i in pending}
        for path in [*paths.values(), group_file]:
            path.unlink(missing_ok=True)  # a reused --work folder must not pass an old result off as new
        args = ["--case", ",".join(pending), shape.name, "--json-dir", str(work), "--reps", str(opts.reps),
                "--warmup", str(opts.warmup), "--case-budget", str(opts.case_budget), "--seed", str(opts.seed),
                *_args_for_child(opts)]
        if opts.ref_chunk:
            args += ["--ref-chunk", str(opts.ref_chunk)]
        rc, timed_out, wall = run_child(args, log, max(1.0, timeout), watch=overdue)
        running = state().get("running")
        shared_stage = running in (None, "inputs", "reference")
        # stopped because the run's time was up: what it was running is left out for --resume, not a timeout
        cut = timed_out and at_deadline and time.perf_counter() >= deadline - 1.0
        rerun = []
        for impl in pending:
            try:
                row = json.loads(paths[impl].read_text())
            except (OSError, ValueError):
                row = None
            if row is not None and row.get("done"):
                row.update(rc=rc, process_wall_s=round(wall, 1))
            elif cut and (running == impl or shared_stage):
                row = budget_skip(impl, f" (stopped in stage {(row or {}).get('stage') or running or 'startup'} "
                                        f"after {wall:.0f} s)")
                row["wall_s"] = round(wall, 1)
            elif running == impl or (shared_stage and (row is not None or len(pending) == 1)):
                limit = opts.case_timeout if running == impl else timeout
                row = _dead_row(row or _skeleton(shape, impl, opts, "crash", None), rc, timed_out, limit, log)
                if shared_stage:
                    row["error"] += f" (the process was in the shared stage {running or 'startup'})"
                row["wall_s"] = round(wall, 1)
            else:  # not started when another case broke the process: again, in a fresh one
                rerun.append(impl)
                continue
            if row.get("status") not in ("ok", "skipped"):
                row["log_tail"] = tail(log)
            row["log"] = log.name
            harness.write_json(paths[impl], row)  # as recorded: what a case at this one's memory reads
            rows.append(row)
        if rerun and cut:  # not started when the time ran out
            rows += [budget_skip(impl) for impl in rerun]
            break
        if len(rerun) == len(pending):  # no progress: stop rather than loop
            for impl in rerun:
                row = _dead_row(_skeleton(shape, impl, opts, "crash", None), rc, timed_out, timeout, log)
                rows.append(row)
            break
        pending = rerun
    order = {impl: k for k, impl in enumerate(impls)}
    return sorted(rows, key=lambda r: order[r["impl"]])


def _fmt_case(row: dict) -> str:
    def num(key, fmt):
        v = harness.as_float(row.get(key))
        return format(v, fmt) if v is not None else "-"

    compile_s = harness.as_float(row.get("fwd_bwd_compile_ms"))
    return (f"{row['status']:<12} fwd+bwd {num('fwd_bwd_ms', '9.2f')} ms  fwd {num('fwd_ms', '8.2f')} ms  "
            f"peak+ {num('fwd_bwd_peak_extra_gib', '6.2f')} GiB  loss rel {num('loss_rel_err', '.1e')}  "
            f"dW rel {num('grad_w_rel_err', '.1e')}  ({row.get('wall_s', 0):.0f} s"
            + (f", compile {compile_s / 1e3:.1f} s" if compile_s is not None else "") + ")"
            + (f"  memory_budget {row['memory_budget'] / 2**30:.2f} GiB" if row.get("memory_budget") else "")
            + (f"  plan {row['plan']}" if row.get("plan") else "")
            + (f"\n        {row['error']}" if row.get("error") else ""))


def _parse_list(text: Optional[str], known: Dict[str, object], default: List[str], what: str) -> List[str]:
    names = default if not text else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def _budget_order(impls: List[str]) -> List[str]:
    """``impls`` with each implementation that runs at another's measured memory (``Impl.budget_from``)
    moved right after that one (when both run), so that its measurement exists when it starts."""
    out = [i for i in impls if IMPLS[i].budget_from not in impls]
    for i in impls:
        source = IMPLS[i].budget_from
        if source in impls:
            k = out.index(source) + 1
            while k < len(out) and IMPLS[out[k]].budget_from == source:
                k += 1
            out.insert(k, i)
    return out


def _parse_skips(text: Optional[str]) -> List[Tuple[str, str, str]]:
    """``--skip 'xc6M*:liger=over 35 s a step,xc6M*:cce'`` -> [(shape pattern, impl pattern, reason)]
    (fnmatch patterns; the reason after ``=`` is optional and goes into the skipped row)."""
    skips = []
    for item in (text or "").split(","):
        if item.strip():
            shape, sep, rest = item.strip().partition(":")
            impl, _, reason = rest.partition("=")
            if not sep or not shape or not impl.strip():
                raise SystemExit(f"--skip wants SHAPE:IMPL[=REASON] items (patterns allowed), got {item!r}")
            skips.append((shape, impl.strip(), reason.strip()))
    return skips


def _skip_reason(skips: List[Tuple[str, str, str]], shape: str, impl: str) -> Optional[str]:
    """The skipped row's error for the first --skip item matching (shape, impl), or None."""
    for sp, ip, reason in skips:
        if fnmatch.fnmatchcase(shape, sp) and fnmatch.fnmatchcase(impl, ip):
            return f"skipped: --skip {sp}:{ip}" + (f": {reason}" if reason else "")
    return None


def _method(opts) -> str:
    if opts.device == "cuda":
        timing = "CUDA events"
        memory = ("peak extra: torch.cuda.max_memory_allocated during the timed steps minus the bytes of x, W, "
                  "targets and the returned gradients. ")
    else:
        timing = f"time.perf_counter, {torch.get_num_threads()} threads"
        memory = "peak memory is not measured on the CPU (the JSON has the case process's max RSS). "
    return (
        f"{opts.dtype} inputs x~N(0,1), W~N(0,1/D), uniform random targets, seeded identically for every "
        "implementation. fwd+bwd: loss then torch.autograd.grad for x and W (exact gradients). fwd: "
        "loss under torch.no_grad with inputs that do not require grad. Times: median of the timed "
        f"repetitions (up to {opts.reps}) after {opts.warmup} warm-up call(s) ({timing}; fewer repetitions only "
        "when one step takes longer than the case budget allows); torch.compile's compilation and first call "
        f"are timed apart and excluded. {memory}TFLOP/s on 8*N*D*V (fwd: 2*N*D*V). Errors relative to a float32 "
        "chunked reference with exact softmax, full-precision GEMMs (no TF32), from the same inputs."
    )


def run_all(opts) -> int:
    """Probe, run every case in a subprocess, write lce.json / lce.md / lce.png. Returns the exit code:
    0 when every hugehead case worked with plausible errors and the reference passed its self-check,
    1 otherwise (peers failing is data, not failure)."""
    from bench import report

    t_start = time.perf_counter()

    def stopped(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through _child, which stops the running case

    signal.signal(signal.SIGTERM, stopped)
    mode_shapes = SMOKE_SHAPES if opts.cpu_smoke else CPU_SHAPES if opts.device == "cpu" else SHAPES
    shapes = [ALL_SHAPES[s] for s in _parse_list(opts.shapes, ALL_SHAPES, list(mode_shapes), "shapes")]
    default_peers = CPU_PEERS if (opts.device == "cpu" and not opts.cpu_smoke) else DEFAULT_PEERS
    impls = _budget_order(_parse_list(opts.peers, IMPLS, default_peers, "implementations"))
    skips = _parse_skips(opts.skip)
    if opts.cpu_smoke and not opts.ref_chunk:
        opts.ref_chunk = 700  # several reference chunks, the last one partial, on the tiny shapes
    sha = harness.git_sha()
    earlier = _load_resume(opts.resume, opts, sha["git_sha"]) if opts.resume else None
    work = Path(opts.work or tempfile.mkdtemp(prefix="hugehead-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_lce: {len(shapes)} shapes x {len(impls)} implementations on {opts.device} ({opts.dtype}); "
          f"case logs in {work}", flush=True)

    probe_json = work / "probe.json"
    rc, timed_out, _ = run_child(["--probe", "--json-out", str(probe_json), *_args_for_child(opts)],
                              work / "probe.log", 300)
    try:
        probe = json.loads(probe_json.read_text())
    except (OSError, ValueError):
        print(f"bench_lce: the probe failed (rc={rc}, timed out={timed_out}):\n{tail(work / 'probe.log')}", flush=True)
        probe = {"environment": {}, "imports": {}, "probe_error": tail(work / "probe.log")}
    env = probe.get("environment", {})
    imports = probe.get("imports", {})
    selfcheck = probe.get("reference_selfcheck") or {}
    selfcheck_ok = bool(selfcheck) and all((harness.as_float(v) or 1.0) < 1e-5 for v in selfcheck.values())
    for name, st in imports.items():
        print(f"  import {name:<13} " + (f"ok {st.get('version')}" if st.get("ok") else f"FAILED {st.get('error')}"))
    print(f"  reference self-check vs float64: {selfcheck} -> {'ok' if selfcheck_ok else 'FAILED'}", flush=True)
    reused: Dict[Tuple[str, str], dict] = {}
    if earlier is not None:
        diffs = [f"{k} {earlier['meta'][k]!r} (here: {env.get(k)!r})" for k in ("device", "gpu_name", "machine")
                 if k in earlier["meta"] and earlier["meta"][k] != env.get(k)]
        if diffs:
            raise SystemExit(f"bench_lce: refusing --resume {opts.resume}, it ran on another device: "
                             f"{'; '.join(diffs)}")
        wanted = {(s.name, i) for s in shapes for i in impls}
        for row in earlier["rows"]:
            key = (row.get("shape"), row.get("impl"))
            if key in wanted and not (row.get("status") == "skipped" and str(row.get("error")).startswith(BUDGET_SKIP)):
                reused[key] = row
        left_out = sorted({f"{r.get('shape')}:{r.get('impl')}" for r in earlier["rows"]
                           if (r.get("shape"), r.get("impl")) not in wanted})
        print(f"bench_lce: resuming {opts.resume}: reusing {len(reused)} case(s) as recorded "
              f"({', '.join(f'{s}:{i}' for s, i in reused) or 'none'}); running the other "
              f"{len(wanted) - len(reused)}"
              + (f"; not in this run, left out: {', '.join(left_out)}" if left_out else ""),
              flush=True)

    if opts.out:
        out_dir = Path(opts.out)
    elif opts.cpu_smoke:
        out_dir = Path(tempfile.mkdtemp(prefix="hugehead-bench-smoke-"))
    else:
        out_dir = REPO_ROOT / "bench" / "results" / harness.gpu_slug(str(env.get("gpu_name", "unknown")))
    out_dir.mkdir(parents=True, exist_ok=True)

    doc = {
        "meta": {
            "benchmark": "linear_cross_entropy",
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": opts.command,
            **sha,
            **env,
            "dtype": opts.dtype,
            "imports": imports,
            "reference_selfcheck": selfcheck,
            "reference_selfcheck_ok": selfcheck_ok,
            "smoke": bool(opts.cpu_smoke),
            "options": {k: v for k, v in vars(opts).items()
                        if k not in ("case", "json_dir", "json_out", "probe", "command")},
            "reps": opts.reps, "warmup": opts.warmup, "case_budget_s": opts.case_budget, "seed": opts.seed,
            "case_timeout_s": opts.case_timeout, "wait_idle_s": opts.wait_idle,
            "skip": opts.skip,
            "shapes": {s.name: {"n": s.n, "d": s.d, "v": s.v, "note": s.note} for s in shapes},
            "implementations": {i: IMPLS[i].about for i in impls},
            "method": _method(opts),
        },
        "rows": list(reused.values()),  # from the start: --out may be where --resume's file is
    }
    if earlier is not None:
        # A peer an earlier part imported (and ran) stays importable in the header, though this part's machine
        # may lack it (a part that only runs the shapes it is skipped at needs no peer wheels).
        for name, status in (earlier["meta"].get("imports") or {}).items():
            if status.get("ok") and not imports.get(name, {}).get("ok"):
                doc["meta"]["imports"][name] = {**status, "in_earlier_part": True}
        doc["meta"]["resumed_from"] = _part(earlier["meta"])
        doc["meta"]["parts"] = [*(earlier["meta"].get("parts") or [_part(earlier["meta"])]), _part(doc["meta"])]

    def publish(record=False):
        doc["meta"]["elapsed_s"] = round(time.perf_counter() - t_start, 1)  # of this part when resumed
        if earlier is not None:
            doc["meta"]["parts"][-1]["elapsed_s"] = doc["meta"]["elapsed_s"]
        report.write_reports(doc, out_dir, record=record)

    publish()
    deadline = None if opts.budget is None else t_start + opts.budget
    done = 0
    for shape in shapes:
        runnable = []
        for impl in impls:
            probed = imports.get(impl, {})
            if (shape.name, impl) in reused:  # already in doc["rows"]
                done += 1
                print(f"[{done:2d}/{len(shapes) * len(impls)}] {shape.name:<9} {impl:<14} reused: "
                      f"{_fmt_case(reused[shape.name, impl])}", flush=True)
                continue
            skipped = _skip_reason(skips, shape.name, impl)
            if skipped:
                row = _skeleton(shape, impl, opts, "skipped", skipped)
            elif probed.get("unavailable"):  # known not to exist here: no process to start
                row = _skeleton(shape, impl, opts, "skipped", f"skipped: {probed.get('error')}")
            elif IMPLS[impl].needs_cuda and opts.device != "cuda":
                row = _skeleton(shape, impl, opts, "skipped", "skipped: needs CUDA")
            else:
                runnable.append(impl)
                continue
            doc["rows"].append(row)
            done += 1
            print(f"[{done:2d}/{len(shapes) * len(impls)}] {shape.name:<9} {impl:<14} {_fmt_case(row)}", flush=True)
        for impl in [i for i in runnable if IMPLS[i].budget_from]:
            # Its budget is the source's measured peak, read from the source's case JSON. A source that does
            # not run here (reused from the earlier part, skipped, not among the peers) has its row put there
            # now; without a measurement to match, the case is skipped without a process.
            source = IMPLS[impl].budget_from
            if source in runnable:
                continue
            source_row = next((r for r in doc["rows"] if r["shape"] == shape.name and r["impl"] == source), None)
            path = lce_case_json(work, shape.name, source)
            if source_row is None:
                path.unlink(missing_ok=True)  # never an older run's row from a reused --work folder
            else:
                harness.write_json(path, source_row)
            budget, why = lce_budget_from_row(source, source_row)
            if budget is None:
                runnable.remove(impl)
                row = _skeleton(shape, impl, opts, "skipped", why)
                doc["rows"].append(row)
                done += 1
                print(f"[{done:2d}/{len(shapes) * len(impls)}] {shape.name:<9} {impl:<14} {_fmt_case(row)}", flush=True)
        # the implementations that cannot break a process share one (inputs, reference); the others run alone,
        # and so does one that runs at an isolated implementation's memory (after it)
        alone = [i for i in runnable if IMPLS[i].isolate or (IMPLS[i].budget_from in runnable
                                                            and IMPLS[IMPLS[i].budget_from].isolate)]
        shared = [i for i in runnable if i not in alone]
        groups = ([shared] if shared and opts.share else [[i] for i in shared]) + [[i] for i in alone]
        for group in groups:
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining < opts.min_case_s:
                rows = [_skeleton(shape, i, opts, "skipped", f"{BUDGET_SKIP} {opts.budget:.0f} s used up")
                        for i in group]
            else:
                waited, busy = harness.wait_until_idle(opts.wait_idle) if opts.wait_idle > 0 else (0.0, None)
                rows = _run_group(group, shape, work, opts, deadline)
                if opts.wait_idle > 0:
                    for row in rows:
                        row.update(idle_wait_s=round(waited, 1), foreign_cpu_before=busy)
            for row in rows:
                # the case JSON holds the row as recorded (budget-skipped too): what a later case at this
                # one's memory reads, never an older run's file in a reused --work folder
                harness.write_json(lce_case_json(work, shape.name, row["impl"]), row)
                doc["rows"].append(row)
                done += 1
                print(f"[{done:2d}/{len(shapes) * len(impls)}] {shape.name:<9} {row['impl']:<14} {_fmt_case(row)}",
                      flush=True)
            publish()
    order = {(s.name, i): k for k, (s, i) in enumerate((s, i) for s in shapes for i in impls)}
    doc["rows"].sort(key=lambda r: order.get((r["shape"], r["impl"]), len(order)))
    publish(record=opts.record)  # the history gets the finished run only, once

    print(f"\nwrote {out_dir}/lce.json, lce.md" + ("" if doc["meta"].get("png_error") else ", lce.png")
          + f" in {time.perf_counter() - t_start:.0f} s", flush=True)
    if doc["meta"].get("png_error"):
        print(f"  (no plot: {doc['meta']['png_error']})")
    print()
    print(report.render_markdown(doc), flush=True)
    hugehead_rows = [r for r in doc["rows"] if r["impl"].startswith("hugehead")]
    # hugehead at another implementation's memory is skipped where that one has no measured peak
    hugehead_ok = all(r.get("status") == "ok" or (IMPLS[r["impl"]].budget_from and r.get("status") == "skipped")
                      for r in hugehead_rows if r["impl"] in IMPLS)
    limit = report.suspect_limit(opts.dtype)
    accurate = not any(report.suspect(harness.as_float(r.get(k)), opts.dtype) for r in hugehead_rows
                       for k in ("loss_rel_err", "grad_x_rel_err", "grad_w_rel_err"))
    if not accurate:
        print(f"bench_lce: a hugehead error is above {limit:g} relative (bold in the table)")
    return 0 if (hugehead_ok and accurate and selfcheck_ok) else 1


def _expand_arg_files(argv: List[str]) -> List[str]:
    """``@FILE`` -> the arguments in FILE, one a line (e.g. a ``--skip`` reason with spaces, through a shell
    that splits words)."""
    out: List[str] = []
    for arg in argv:
        if arg.startswith("@") and len(arg) > 1:
            try:
                out += [line for line in Path(arg[1:]).read_text().splitlines() if line.strip()]
            except OSError as exc:
                raise SystemExit(f"bench_lce: cannot read the arguments file {arg[1:]}: {exc}")
        else:
            out.append(arg)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results folder (default bench/results/<gpu or cpu>/; a temp folder for --cpu-smoke)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (default): the GPU shapes in bf16; cpu: the CPU shapes in fp32")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="input dtype (default bfloat16 on cuda and for --cpu-smoke, float32 for --device cpu)")
    p.add_argument("--shapes", help=f"comma list of shapes (default: the mode's: {','.join(SHAPES)} on cuda, "
                                    f"{','.join(CPU_SHAPES)} on cpu)")
    p.add_argument("--peers", help=f"comma list of implementations (default {','.join(DEFAULT_PEERS)}; on cpu "
                                   f"{','.join(CPU_PEERS)}; also: {','.join(i for i in IMPLS if i not in DEFAULT_PEERS)})")
    p.add_argument("--skip", help="comma list of SHAPE:IMPL[=REASON] fnmatch patterns recorded as skipped (with the "
                                  "reason) without running, e.g. 'xc6M*:liger=over 35 s a step,xc6M*:cce'")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU; CUDA-only peers are skipped")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (default 10; 3 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2, 1 on cpu; 1 for slow steps)")
    p.add_argument("--case-budget", type=float, default=None,
                   help="seconds the timed loops of one case may take: half for fwd+bwd, a quarter for fwd; "
                        "repetitions are cut to fit, never below one (default 120; 60 on cpu)")
    p.add_argument("--case-timeout", type=float, default=None, help="kill a case after this many seconds (default 300; 100 on cpu)")
    p.add_argument("--wait-idle", type=float, default=None,
                   help="before each case, wait up to this many seconds for other processes to leave the CPUs "
                        "idle (default 0; 30 on cpu, where others' work skews the timings)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run; cases that would start later are skipped")
    p.add_argument("--resume", metavar="FILE",
                   help="continue the run whose (partial) lce.json is FILE: keep its rows, run only the cases it has "
                        "no row for or that its --budget left out (same commit, device, dtype, reps, warmup, "
                        "case budget and seed, else refused); the rows of all parts go to --out")
    p.add_argument("--min-case-s", type=float, default=45.0,
                   help="with --budget: do not start a case with less than this left (default 45)")
    p.add_argument("--no-share", dest="share", action="store_false",
                   help="every case in a process of its own (default: a shape's implementations that cannot break "
                        "their process share one: one start, one set of inputs, one reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ref-chunk", type=int, default=0, help="reference chunk width (default: ~2 GiB of logits)")
    p.add_argument("--ref-cache", help=argparse.SUPPRESS)  # with --one on cpu: the parent's reference cache folder
    p.add_argument("--work", help="folder for per-case JSON and logs (default: a new temp folder)")
    p.add_argument("--list", action="store_true", help="print shapes and implementations, then exit")
    p.add_argument("--one", nargs=2, metavar=("IMPL", "SHAPE"), help="run one case in this process (--json-out F)")
    p.add_argument("--case", nargs=2, metavar=("IMPLS", "SHAPE"),
                   help="run the cases of a comma list of implementations in this process (--json-dir D)")
    harness.add_record_flag(p)
    p.add_argument("--json-dir", help="with --case: where each case's JSON goes")
    p.add_argument("--probe", action="store_true", help="write environment and import facts to --json-out")
    p.add_argument("--json-out", help="with --one / --probe: where the JSON goes")
    argv = _expand_arg_files(sys.argv[1:] if argv is None else list(argv))
    opts = p.parse_args(argv)
    opts.command = shlex.join([Path(sys.executable).name, "-m", "bench.bench_lce", *argv])

    if opts.list:
        for s in ALL_SHAPES.values():
            print(f"shape {s.name:<10} N={s.n:<6} D={s.d:<5} V={s.v:<8} {s.note}")
        for i in IMPLS.values():
            print(f"impl  {i.name:<20} {'CUDA ' if i.needs_cuda else '     '}{i.about}")
        return 0
    if opts.cpu_smoke:
        if opts.device == "cuda":
            p.error("--cpu-smoke runs on the CPU")
        opts.device = "cpu"
    opts.device = opts.device or "cuda"
    opts.dtype = opts.dtype or ("float32" if opts.device == "cpu" and not opts.cpu_smoke else "bfloat16")
    defaults = MODE_DEFAULTS["smoke" if opts.cpu_smoke else opts.device]
    for key, value in zip(("reps", "warmup", "case_budget", "case_timeout", "wait_idle"), defaults):
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    device, dtype = torch.device(opts.device), DTYPES[opts.dtype]
    if opts.probe or opts.one or opts.case:
        from bench.lce_case import run_cases, run_probe

        if device.type == "cuda" and not torch.cuda.is_available():
            print("bench_lce: CUDA is not available (use --device cpu on a machine without a GPU)", file=sys.stderr)
        if opts.probe:
            if not opts.json_out:
                p.error("--probe needs --json-out")
            run_probe(device if torch.cuda.is_available() or device.type == "cpu" else torch.device("cpu"),
                      Path(opts.json_out))
            return 0
        if opts.one and not opts.json_out or opts.case and not opts.json_dir:
            p.error("--one needs --json-out, --case needs --json-dir")
        names, shape = (opts.one[0], opts.one[1]) if opts.one else opts.case
        names = _parse_list(names, IMPLS, [], "implementations")
        json_dir = Path(opts.json_dir) if opts.json_dir else Path(opts.json_out).parent
        rows = run_cases(names, find_shape(shape), device, dtype, opts, json_dir,
                         json_out=Path(opts.json_out) if opts.one else None)
        for row in rows:
            print(f"{row['impl']:<14} {_fmt_case(row)}", flush=True)
        # os._exit: a CUDA context a peer has broken can hang in interpreter teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_lce: CUDA is not available here; run with --device cpu (or --cpu-smoke)", file=sys.stderr)
        return 2
    return run_all(opts)


if __name__ == "__main__":
    sys.exit(main())
