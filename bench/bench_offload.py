"""Offload benchmark: ChunkedClassifier(offload=True) on one GPU, weights in pinned host memory.

    python -m bench.bench_offload                           # one H200: about 3-4 minutes
    python -m bench.bench_offload --cpu-smoke --out /tmp/o  # the same pipeline, tiny, CPU "compute device"

Cases, in order (bf16 unless said; D=768; x and targets on cuda:0):
1. copy ceilings: a 1 GiB exact-size pinned block to/from the GPU, one direction and both at once.
2. xc6M (N=4096, V=6M) offloaded: forward+backward with the gradients landing in pinned host ``.grad``
   (the engine's default plan, which keeps the logits in GPU memory, and ``memory_budget=4 GiB``, which
   recomputes them), and forward only; then xc6M_16k (N=16384) on the same head.
3. the same two shapes with the head resident on the GPU (same seed, same logical weight): the ratio the
   issue's N=16384 target is about, and a check that both placements compute the same loss.
4. xc25M (N=4096, V=25M): a training step with SGD on the CPU (weights + gradients = 77 GB of pinned host
   memory in bf16; float32, or Adam's state, would not fit a 128 GiB host): step time split into
   forward+backward and optimizer, host memory, pinning time.
5. xc6M with float32 master weights under bf16 autocast (float32 streamed, cast per chunk on the GPU):
   the alternative a bfloat16 host copy would be measured against (the bf16 rows of case 2 are what
   such a copy would cost on the wire, before the CPU work of keeping it up to date).

Achieved GB/s counts the bytes a step must move: forward the weight in; backward the weight in and the
gradient out. The floor is the issue's: two weight passes at 55.4 GB/s. Writes offload.json (rows in the
record format of bench_lce: ``shape``, ``impl``, ``fwd_bwd_ms``; git SHA in ``meta``), offload.md and
offload.png to --out (default bench/results/<gpu>/).
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bench import harness  # first: decides which hugehead is imported
from bench import common
from bench.common import Shape

import torch

H2D_CEILING = 55.4e9  # pinned host-to-device copies measured on an H200 host
BOTH_CEILING = 101.6e9
GPU_SHAPES = {
    "xc6M": Shape("xc6M", 4096, 768, 6_000_000, "the seed's BERT + 6M classes"),
    "xc6M_16k": Shape("xc6M_16k", 16384, 768, 6_000_000, "large batch"),
    "xc25M": Shape("xc25M", 4096, 768, 25_000_000, "25M classes, weights on the host"),
}
SMOKE_SHAPES = {
    "xc6M": Shape("xc6M", 64, 32, 5000, "smoke"),
    "xc6M_16k": Shape("xc6M_16k", 256, 32, 5000, "smoke"),
    "xc25M": Shape("xc25M", 64, 32, 20000, "smoke"),
}
_GB = 1e9


def _sync(device: torch.device) -> None:
    harness.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _rss_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_ceilings(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> Dict[str, float]:
    """GB/s of copies between an exact-size pinned block and the GPU: H2D, D2H, and both at once."""
    from hugehead import pinned

    host_in = pinned.empty_pinned((nbytes,), torch.uint8, what="the H2D bandwidth probe")
    host_out = pinned.empty_pinned((nbytes,), torch.uint8, what="the D2H bandwidth probe")
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s_in, s_out = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def run(which: str) -> float:
        def copy():
            if which in ("h2d", "both"):
                with torch.cuda.stream(s_in):
                    dev_in.copy_(host_in, non_blocking=True)
            if which in ("d2h", "both"):
                with torch.cuda.stream(s_out):
                    host_out.copy_(dev_out, non_blocking=True)

        # host clock with the device synchronized around each call: the copies run on side streams
        t = harness.measure(copy, device, reps=reps, warmup=1, clock="host")
        moved = nbytes * (2 if which == "both" else 1)
        return moved / (t.ms * 1e-3) / _GB

    return {"h2d_gbps": run("h2d"), "d2h_gbps": run("d2h"), "both_gbps": run("both")}


def _inputs(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.n, shape.d, device=device, dtype=dtype, generator=g)
    target = torch.randint(0, shape.v, (shape.n,), device=device, generator=g)
    return x, target


def _row(shape: Shape, dtype: torch.dtype, placement: str, variant: str) -> dict:
    return {"shape": shape.name, "n": shape.n, "d": shape.d, "v": shape.v, "dtype": str(dtype).replace("torch.", ""),
            "impl": "hugehead-offload" if placement == "offload" else "hugehead", "placement": placement,
            "variant": variant, "status": "ok", "error": None}


def _step_stats(row: dict, timing: "harness.Timing", prefix: str = "fwd_bwd") -> None:
    fields = timing.fields(prefix)
    for k in ("ms", "ms_min", "ms_all", "reps", "clock", "peak_extra_bytes"):
        row[f"{prefix}_{k}"] = fields[f"{prefix}_{k}"]


def run_head_case(head, shape: Shape, dtype: torch.dtype, device: torch.device, placement: str, variant: str,
                  reps: int, warmup: int, autocast: Optional[torch.dtype] = None, fwd_only: bool = False,
                  x_dtype: Optional[torch.dtype] = None) -> dict:
    """Forward+backward (and optionally forward-only) timings of ``head`` at ``shape``."""
    row = _row(shape, dtype, placement, variant)
    x, target = _inputs(shape, device, x_dtype or dtype)
    x.requires_grad_()

    def fwd_bwd():
        x.grad = None
        head.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = head(x, target)
        loss.backward()
        return loss

    t = harness.measure(fwd_bwd, device, reps=reps, warmup=warmup)
    _step_stats(row, t)
    row["loss"] = float(t.result.detach())
    row["grad_x_norm"] = float(x.grad.float().norm())
    row["grad_w_norm"] = math.sqrt(sum(float(p.grad.float().norm()) ** 2 for p in head.parameters()))
    row["gpu_peak_bytes"] = t.peak_bytes
    if fwd_only:
        x_eval = x.detach()

        def fwd():
            with torch.no_grad():
                return head(x_eval, target)

        _step_stats(row, harness.measure(fwd, device, reps=reps, warmup=1), "fwd")
    param_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    row["param_bytes"] = param_bytes
    if placement == "offload":
        # forward: the weight in; backward: the weight in and its gradient (same dtype) out.
        row["bytes_moved"] = 3 * param_bytes
        row["achieved_gbps"] = 3 * param_bytes / (row["fwd_bwd_ms"] * 1e-3) / _GB
        row["floor_ms"] = 2 * param_bytes / H2D_CEILING * 1e3
        row["x_floor"] = row["fwd_bwd_ms"] / row["floor_ms"]
        if fwd_only:
            row["fwd_gbps"] = param_bytes / (row["fwd_ms"] * 1e-3) / _GB
        row.update({f"host_{k}": v for k, v in head.offload_stats.items()})
        row["plan"] = repr(head.engine.plan(x.detach(), _shard_tensors(head), True))
    return row


def _shard_tensors(head):
    from hugehead.engines.local import ShardTensors

    s = head.shards[0]
    return ShardTensors(s.weight, s.bias, s.start)


def _make_head(shape: Shape, dtype: torch.dtype, device: torch.device, offload: bool, **kwargs):
    import hugehead

    torch.manual_seed(0)
    ms, head = harness.time_call_ms(lambda: hugehead.ChunkedClassifier(
        shape.d, shape.v, devices=[str(device)], dtype=dtype, offload=offload, **kwargs), device, clock="host")
    return head, ms / 1e3


def run_train_step(shape: Shape, dtype: torch.dtype, device: torch.device, steps: int) -> dict:
    """A training step of an offloaded head: forward+backward (gradients to host) then SGD on the CPU."""
    from hugehead import pinned

    row = _row(shape, dtype, "offload", "train step (SGD, CPU)")
    row["host_available_before"] = pinned.available_host_memory()
    head, build_s = _make_head(shape, dtype, device, offload=True)
    row["build_seconds"] = build_s
    opt = torch.optim.SGD(head.parameters(), lr=0.1, foreach=True)
    x, target = _inputs(shape, device, dtype)
    fb, op, losses = [], [], []

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        loss = head(x, target)
        loss.backward()
        return loss.detach()

    # The two phases timed apart (the optimizer runs on the host); the first step also pins the gradient
    # buffers: it is the warm-up, reported as first_step_ms.
    for _ in range(steps + 1):
        ms, loss = harness.time_call_ms(fwd_bwd, device, clock="host")
        fb.append(ms)
        op.append(harness.time_call_ms(opt.step, device, clock="host")[0])
        losses.append(float(loss))
    row["first_step_ms"] = fb[0] + op[0]
    _step_stats(row, harness.Timing.of(fb[1:], fb[:1]))
    row["optimizer_ms"] = harness.median(op[1:])
    row["step_ms"] = row["fwd_bwd_ms"] + row["optimizer_ms"]
    row["losses"] = losses
    param_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    row["param_bytes"] = param_bytes
    row["achieved_gbps"] = 3 * param_bytes / (row["fwd_bwd_ms"] * 1e-3) / _GB
    row["floor_ms"] = 2 * param_bytes / H2D_CEILING * 1e3
    row["x_floor"] = row["fwd_bwd_ms"] / row["floor_ms"]
    row.update({f"host_{k}": v for k, v in head.offload_stats.items()})
    row["host_pinned_bytes"] = pinned.pinned_stats()["pinned_bytes"]
    row["host_rss_bytes"] = _rss_bytes()
    row["host_available_after"] = pinned.available_host_memory()
    if device.type == "cuda":
        row["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    del head, opt, x, target
    _free(device)
    return row


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
_fmt = harness.fmt


def render_markdown(doc: dict) -> str:
    meta = doc["meta"]
    ceil = meta.get("ceilings_measured") or {}
    resident = {r["shape"]: r.get("fwd_bwd_ms") for r in doc["rows"] if r.get("placement") == "resident"}
    rows = []
    for r in doc["rows"]:
        host = r.get("host_weight_bytes")
        host = None if host is None else (host + (r.get("host_grad_bytes") or 0)) / 2**30
        vs = None
        if r.get("placement") == "offload" and resident.get(r["shape"]) and r.get("fwd_bwd_ms"):
            vs = r["fwd_bwd_ms"] / resident[r["shape"]]
        gpu_peak = None if r.get("gpu_peak_bytes") is None else r["gpu_peak_bytes"] / 2**30
        rows.append([r["shape"], r["n"], f"{r['v']:,}", r["placement"], r["variant"], _fmt(r.get("fwd_bwd_ms"), ".1f"),
                     _fmt(r.get("fwd_ms"), ".1f"), _fmt(r.get("achieved_gbps"), ".1f"), _fmt(r.get("floor_ms"), ".0f"),
                     _fmt(r.get("x_floor"), ".2f"), _fmt(vs, ".2f"), _fmt(host, ".1f"), _fmt(gpu_peak, ".1f"),
                     r["status"] + (": " + r["error"] if r.get("error") else "")])
    lines = [
        harness.header("ChunkedClassifier(offload=True): weights in pinned host memory", meta),
        f"Copy ceilings measured here: H2D {_fmt(ceil.get('h2d_gbps'), '.1f')} GB/s, D2H "
        f"{_fmt(ceil.get('d2h_gbps'), '.1f')} GB/s, both at once {_fmt(ceil.get('both_gbps'), '.1f')} GB/s "
        "(an H200 host: 55.4 / 55.3 / 101.6).",
        "",
        harness.md_table(["shape", "N", "V", "placement", "variant", "fwd+bwd ms", "fwd ms", "GB/s moved", "floor ms",
                          "x floor", "x resident", "host GiB", "GPU peak GiB", "status"], rows, "lrrllrrrrrrrrl"),
    ]
    train = [r for r in doc["rows"] if r.get("variant") == "train step (SGD, CPU)" and r.get("status") == "ok"]
    for r in train:
        lines += [f"**{r['shape']} training step** ({r['v']:,} x {r['d']} {r['dtype']}, N={r['n']}): "
                  f"{r['step_ms']:.0f} ms = forward+backward {r['fwd_bwd_ms']:.0f} ms + SGD on the CPU "
                  f"{r['optimizer_ms']:.0f} ms (first step {r['first_step_ms']:.0f} ms, pins the gradients); pinned "
                  f"host memory {(r.get('host_pinned_bytes') or 0) / 2**30:.1f} GiB, process RSS "
                  f"{(r.get('host_rss_bytes') or 0) / 2**30:.1f} GiB; pinning the weights took "
                  f"{r.get('host_pin_seconds', 0):.1f} s and the gradients {r.get('host_grad_alloc_seconds', 0):.1f} s; "
                  f"losses {', '.join(f'{l:.4f}' for l in r['losses'])}.", ""]
    checks = meta.get("checks") or {}
    if checks:
        lines += ["Same loss offloaded and resident (relative difference): "
                  + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()) + ".", ""]
    lines += [meta.get("method", "")]
    return "\n".join(lines) + "\n" + harness.footer(meta)


def render_png(doc: dict, path: Path) -> None:
    rows = [r for r in doc["rows"] if r.get("status") == "ok" and r.get("fwd_bwd_ms")]
    off = [r for r in rows if r["placement"] == "offload"]
    resident = {r["shape"]: r["fwd_bwd_ms"] for r in rows if r["placement"] == "resident"}
    labels = [f"{r['shape']} {r['variant']}" for r in off]
    times = harness.Panel("forward + backward ms (log)", {
        "offloaded": [r["fwd_bwd_ms"] for r in off],
        "resident on the GPU": [resident.get(r["shape"]) for r in off],
        "floor: 2 weight passes at 55.4 GB/s": [r.get("floor_ms") for r in off]})
    traffic = harness.Panel("GB/s moved (weight in x2, grad out)", {"achieved": [r.get("achieved_gbps") for r in off]},
                            log=False, lines={"one direction 55.4 GB/s": H2D_CEILING / _GB,
                                              "both directions 101.6 GB/s": BOTH_CEILING / _GB})
    harness.bar_chart(path, labels, [times, traffic], f"hugehead offload on {doc['meta'].get('gpu_name')}",
                      smoke=harness.is_smoke(doc["meta"]))


METHOD = (
    "Timing (bench.harness.measure): CUDA events around each call (the backward includes its wait for the gradient copies to land in "
    "host memory), median of --reps after --warmup; the training step uses host clocks with a synchronize. "
    "Inputs x ~ N(0, 1), targets uniform; heads initialized by the same seed (the same logical weight in "
    "every placement). GB/s moved = 3 x parameter bytes per fwd+bwd (weight in twice, gradient out once). "
    "Host GiB = pinned weights + pinned gradients."
)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results folder (default bench/results/<gpu>/)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=2, help="timed training steps of the 25M head (2)")
    p.add_argument("--budget", type=float, default=220.0, help="seconds; later cases are skipped past it")
    p.add_argument("--skip", default="", help="comma list of cases to skip: ceilings,xc6M,resident,autocast,xc25M")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, CPU compute device (checks the pipeline)")
    harness.add_record_flag(p)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    from hugehead.engines import offload

    if args.cpu_smoke:
        offload._ALLOW_CPU_COMPUTE = True
        device, shapes = torch.device("cpu"), SMOKE_SHAPES
        skip.add("ceilings")
    else:
        if not torch.cuda.is_available():
            print("bench_offload needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
            return 2
        device, shapes = torch.device("cuda", 0), GPU_SHAPES
    bf16 = torch.bfloat16
    meta = harness.run_meta("offload", device, options=args, smoke=args.cpu_smoke,
                            shapes={k: vars(s) for k, s in shapes.items()}, method=METHOD,
                            command=" ".join([Path(sys.executable).name, "-m", "bench.bench_offload", *sys.argv[1:]]),
                            reps=args.reps, warmup=args.warmup, h2d_ceiling_gbps=H2D_CEILING / _GB,
                            both_ceiling_gbps=BOTH_CEILING / _GB, checks={})
    out = Path(args.out) if args.out else harness.REPO_ROOT / "bench" / "results" / harness.gpu_slug(str(meta["gpu_name"]))
    doc = {"meta": meta, "rows": []}

    def publish(plot: bool = False):
        # After every case (a run cut short still leaves its rows); the plot once, at the end.
        doc["meta"]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        harness.write_report(out, "offload", doc, render_markdown,
                             plot=(lambda path: render_png(doc, path)) if plot else None, record=args.record)

    def case(name: str, fn: Callable[[], List[dict]], need_s: float, shape: Shape, dtype, placement, variant):
        left = args.budget - (time.perf_counter() - t_start)
        if name in skip or left < need_s:
            why = f"skipped: --skip {name}" if name in skip else f"skipped: {left:.0f} s of --budget left"
            row = _row(shape, dtype, placement, variant)
            row.update(status="skipped", error=why)
            doc["rows"].append(row)
            print(f"{shape.name:9s} {placement:8s} {variant:24s} {why}", flush=True)
            publish()
            return []
        try:
            rows = fn()
        except Exception as exc:  # noqa: BLE001  (recorded; the next cases still run)
            row = _row(shape, dtype, placement, variant)
            row.update(status=common.classify_error(exc), error=harness.error_text(exc))
            rows = [row]
        _free(device)
        for row in rows:
            doc["rows"].append(row)
            print(f"{row['shape']:9s} {row['placement']:8s} {row['variant']:24s} {row['status']:6s} fwd+bwd "
                  f"{_fmt(row.get('fwd_bwd_ms'), '9.1f')} ms  fwd {_fmt(row.get('fwd_ms'), '8.1f')} ms  "
                  f"{_fmt(row.get('achieved_gbps'), '6.1f')} GB/s  x floor {_fmt(row.get('x_floor'), '.2f')}"
                  + (f"  {row['error']}" if row.get("error") else ""), flush=True)
        publish()
        return rows

    if "ceilings" not in skip:
        try:
            doc["meta"]["ceilings_measured"] = measure_ceilings(device)
            _free(device)
            print(f"copy ceilings: {doc['meta']['ceilings_measured']}", flush=True)
        except Exception as exc:  # noqa: BLE001
            doc["meta"]["ceilings_error"] = harness.error_text(exc)
    losses: Dict[str, float] = {}
    s6, s16, s25 = shapes["xc6M"], shapes["xc6M_16k"], shapes["xc25M"]

    def offloaded_6m() -> List[dict]:
        head, build_s = _make_head(s6, bf16, device, offload=True)
        rows = [run_head_case(head, s6, bf16, device, "offload", "kept logits", args.reps, args.warmup,
                              fwd_only=True)]
        head.engine.memory_budget = 4 << 30
        rows.append(run_head_case(head, s6, bf16, device, "offload", "budget 4 GiB", args.reps, args.warmup))
        head.engine.memory_budget = None
        rows.append(run_head_case(head, s16, bf16, device, "offload", "default", args.reps, args.warmup))
        for r in rows:
            r["build_seconds"] = build_s
        losses["xc6M"], losses["xc6M_16k"] = rows[0]["loss"], rows[2]["loss"]
        return rows

    def resident_6m() -> List[dict]:
        head, build_s = _make_head(s6, bf16, device, offload=False)
        rows = [run_head_case(head, s, bf16, device, "resident", "default", args.reps, args.warmup) for s in (s6, s16)]
        for r in rows:
            r["build_seconds"] = build_s
            if r["shape"] in losses:
                doc["meta"]["checks"][r["shape"]] = abs(r["loss"] - losses[r["shape"]]) / abs(r["loss"])
        return rows

    def autocast_6m() -> List[dict]:
        head, build_s = _make_head(s6, torch.float32, device, offload=True)
        row = run_head_case(head, s6, torch.float32, device, "offload", "fp32 masters+autocast", args.reps,
                            args.warmup, autocast=bf16, x_dtype=torch.float32)
        row["build_seconds"] = build_s
        return [row]

    big = device.type == "cuda"
    case("xc6M", offloaded_6m, 40 if big else 0, s6, bf16, "offload", "kept logits")
    case("resident", resident_6m, 30 if big else 0, s6, bf16, "resident", "default")
    case("xc25M", lambda: [run_train_step(s25, bf16, device, args.train_steps)], 70 if big else 0, s25, bf16,
         "offload", "train step (SGD, CPU)")
    case("autocast", autocast_6m, 40 if big else 0, s6, torch.float32, "offload", "fp32 masters+autocast")

    publish(plot=True)
    print(f"\nwrote {out}/offload.json, offload.md, offload.png in {time.perf_counter() - t_start:.0f} s\n")
    print(render_markdown(doc), flush=True)
    ok = all(r["status"] in ("ok", "skipped") for r in doc["rows"])
    same = all(v < 2e-2 for v in doc["meta"]["checks"].values())
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
