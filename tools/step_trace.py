"""Each step of one bench_lce case on its own line: its time, how long the host took to queue it, what the CUDA
caching allocator did in it, and the SM clock and power-cap flag nvidia-smi saw while it ran.

bench_lce keeps only a case's median. Some steps stand out at fixed positions (at xc6M on an H200,
the 5th and the 9th of 10 timed steps, by several milliseconds). Either
the power controller clamps the clock then, or the step waits on the host (a device synchronization, e.g. a
cudaMalloc / cudaFree by the caching allocator, leaves the GPU idle while the host queues the rest). This tells
them apart: a power clamp shows as a lower clock with the SW power-cap flag (0x4) and no allocator event; a host
stall as a host time near the step time, or an allocator retry / device allocation in that step.

    python -m tools.step_trace --shape xc6M [--impl hugehead] [--steps 20] [--warmup 2] [--out DIR]

The step is bench_lce's: ``loss_fn(x, weight, target)`` then ``torch.autograd.grad`` for x and W on the same
seeded inputs, the previous step's result dropped first, CUDA events around the call from an idle GPU. The clock
comes from ``nvidia-smi -lms`` (every 20 ms by default; its power.draw is a moving average, so the flag and the
clock say more than the watts). On the CPU (``--device cpu``, tests) the step times and host times are kept and
the allocator and clock columns are empty.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from bench import harness  # first: decides which hugehead is imported
from bench.common import ALL_SHAPES, make_inputs
from bench.peers import IMPLS

import torch  # noqa: E402

# torch.cuda.memory_stats() counters whose change within a step is reported (events that can stall the host)
ALLOCATOR_KEYS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                  "segment.all.allocated", "segment.all.freed")
SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
SW_POWER_CAP = 0x4


def smi_samples(text: str) -> List[dict]:
    """nvidia-smi's ``--query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader,
    nounits`` lines as ``{"t": seconds since the epoch, "mhz", "w", "reasons"}``; a line that does not parse is
    dropped. nvidia-smi writes local time, as ``datetime.fromtimestamp`` reads it."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            t = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append({"t": t, "mhz": float(parts[1]), "w": float(parts[2]), "reasons": int(parts[3], 16)})
        except ValueError:
            continue
    return out


def clock_during(samples: Sequence[dict], t0: float, t1: float) -> dict:
    """The samples taken in ``[t0, t1]`` (seconds since the epoch): their count, lowest and median SM clock, and
    how many had the SW power-cap flag set."""
    inside = [s for s in samples if t0 <= s["t"] <= t1]
    if not inside:
        return {"samples": 0, "mhz_min": None, "mhz_median": None, "power_capped": None}
    mhz = [s["mhz"] for s in inside]
    return {"samples": len(inside), "mhz_min": min(mhz), "mhz_median": statistics.median(mhz),
            "power_capped": sum(1 for s in inside if s["reasons"] & SW_POWER_CAP)}


def allocator_counters(device: torch.device) -> Dict[str, int]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_KEYS}


def trace_steps(step, device: torch.device, steps: int, warmup: int) -> List[dict]:
    """Run ``step`` ``warmup`` times untimed, then ``steps`` times, each from an idle device: per step its
    wall-clock start and end (seconds since the epoch), its time (CUDA events on CUDA, else the host clock), the
    host's time to return from ``step()`` (the queueing; on CUDA the GPU may still be running), and the
    allocator counters' change."""
    cuda = device.type == "cuda"
    out = None
    for _ in range(warmup):
        out = None
        out = step()
    if cuda:
        torch.cuda.synchronize(device)
    rows = []
    for i in range(steps):
        out = None  # the previous result is freed before the next call, as bench_lce's measure does
        before = allocator_counters(device)
        wall0 = time.time()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        h0 = time.perf_counter()
        out = step()
        host_ms = (time.perf_counter() - h0) * 1e3
        if cuda:
            end.record()
            end.synchronize()
            ms = float(start.elapsed_time(end))
        else:
            ms = host_ms
        wall1 = time.time()
        after = allocator_counters(device)
        rows.append({"step": i + 1, "t0": wall0, "t1": wall1, "ms": ms, "host_ms": host_ms,
                     "allocator": {k: after[k] - before[k] for k in after if after[k] != before[k]}})
    return rows


def markdown(rows: List[dict], meta: dict) -> str:
    med = statistics.median(r["ms"] for r in rows)
    lines = [f"# Step by step: {meta['impl']} at {meta['shape']} on {meta['device_name']}", "",
             f"git `{(meta.get('git_sha') or '?')[:12]}` · {meta['created_utc']} · {meta['warmup']} warm-up step(s), "
             f"then {len(rows)} · median {med:.2f} ms · nvidia-smi every {meta['smi_ms']} ms", "",
             "| step | ms | vs median | host ms | SM MHz min / median | power-capped samples | allocator events |",
             "|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        c = r.get("clock") or {}
        mhz = "-" if not c.get("samples") else f"{c['mhz_min']:.0f} / {c['mhz_median']:.0f}"
        capped = "-" if not c.get("samples") else f"{c['power_capped']} of {c['samples']}"
        alloc = ", ".join(f"{k} +{v}" for k, v in r["allocator"].items()) or "-"
        lines.append(f"| {r['step']} | {r['ms']:.2f} | {r['ms'] / med:.3f} | {r['host_ms']:.2f} | {mhz} | {capped} | "
                     f"{alloc} |")
    lines += ["", "host ms: from the call to its return (the step's queueing; the GPU may still be running). A step "
              "whose host ms is near its ms, or that has allocator events, waited on the host; one with a lower "
              "clock and power-capped samples and neither, on the power controller."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="xc6M", choices=sorted(ALL_SHAPES))
    p.add_argument("--impl", default="hugehead", choices=sorted(IMPLS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32 (default on cpu)")
    p.add_argument("--smi-ms", type=int, default=20)
    p.add_argument("--out", default=None, help="folder for step_trace_<shape>_<impl>.{json,md} and nvidia-smi's CSV")
    opts = p.parse_args(argv)

    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = ALL_SHAPES[opts.shape]
    loss_fn, version = IMPLS[opts.impl].load()
    x, weight, target = make_inputs(shape, device, dtype)
    x.requires_grad_(True)
    weight.requires_grad_(True)

    def step():
        loss = loss_fn(x, weight, target)
        gx, gw = torch.autograd.grad(loss, (x, weight))
        return loss.detach(), gx, gw

    smi = None
    if device.type == "cuda":
        try:
            smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                                    "-lms", str(opts.smi_ms), "-i", str(device.index or 0)],
                                   stdout=subprocess.PIPE, text=True)
        except OSError as exc:
            print(f"step_trace: no nvidia-smi ({exc}): no clock column", file=sys.stderr)
    try:
        rows = trace_steps(step, device, opts.steps, opts.warmup)
    finally:
        smi_text = ""
        if smi is not None:
            time.sleep(2 * opts.smi_ms / 1e3)
            smi.terminate()
            smi_text, _ = smi.communicate(timeout=10)
    samples = smi_samples(smi_text)
    for r in rows:
        r["clock"] = clock_during(samples, r["t0"], r["t1"])
    meta = harness.run_meta("step_trace", device, options=opts, shape=opts.shape, impl=opts.impl,
                            impl_version=version, warmup=opts.warmup, smi_ms=opts.smi_ms, smi_samples=len(samples),
                            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    md = markdown(rows, meta)
    print(md)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"step_trace_{opts.shape}_{opts.impl}"
        harness.write_report(out, stem, {"meta": meta, "steps": rows}, md)
        if smi_text:
            (out / f"{stem}_smi.csv").write_text(smi_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
