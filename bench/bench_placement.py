"""Placement benchmark of ChunkedClassifier: the multi-GPU scaling figure and the huge-head run.

    python -m bench.bench_placement --scaling --huge          # on a machine with 2+ GPUs
    python -m bench.bench_placement --cpu-smoke --out /tmp/p  # the same pipeline, tiny, on CPU

--scaling: xc6M (N=4096, D=768, V=6M, bf16, no bias) and xc6M_16k (N=16384), forward + backward, forward
only and top-5 of one head placed on cuda:0, on cuda:1 alone (the seed's layout: backbone and x on
cuda:0, the whole head on another GPU), then split over all visible GPUs; x and targets always on
cuda:0. Under the same seed every placement holds the same logical weight, so the loss and gradient
norms must agree; the ratio multi/one is the figure the issue asks for (target <= 0.52 on 2 GPUs).
Each row records the head's initialization time (on the GPUs, synchronized).
--huge: a V=50M, D=768 bf16 head (weights + gradients ~154 GB) over all visible GPUs, trained with SGD
for a few steps: step time and peak memory per GPU.

Timing (``bench.harness.measure``, ``clock="host"``): each step is bracketed by a synchronize of every
device and host clocks (CUDA events on one device would not see the other GPUs' work); median after
warm-up. Writes placement.json,
placement.md and placement.png to --out (default bench/results/<gpu>x<count>/).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional

from bench import harness  # first: decides which hugehead is imported

import torch


def _all_devices(devices: List[str]) -> List[torch.device]:
    """Every device of the placement plus every visible GPU (a step may touch any of them)."""
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return list(dict.fromkeys([torch.device(d) for d in devices] + gpus))


def _timed(fn, devices: List[str], repeats: int, warmup: int) -> "harness.Timing":
    return harness.measure(fn, _all_devices(devices), reps=repeats, warmup=warmup, clock="host")


def _peaks_gib(t: "harness.Timing", devices: List[str]) -> Dict[str, float]:
    wanted = {str(torch.device(d)) for d in devices}
    return {k: v / 2**30 for k, v in t.peak_bytes_per_device.items() if k in wanted}


def run_scaling(placements: List[List[str]], x_device: str, n: int, d: int, v: int, dtype: torch.dtype,
                repeats: int, warmup: int, shape: str) -> List[dict]:
    import hugehead

    rows = []
    for devices in placements:
        torch.manual_seed(0)
        init_ms, head = harness.time_call_ms(lambda: hugehead.ChunkedClassifier(
            d, v, bias=False, devices=devices, dtype=dtype), _all_devices(devices), clock="host")
        init_s = init_ms / 1e3
        gen = torch.Generator(device=x_device).manual_seed(1)
        x = torch.randn(n, d, device=x_device, dtype=dtype, generator=gen).requires_grad_()
        target = torch.randint(0, v, (n,), device=x_device, generator=gen)

        def step():
            x.grad = None
            for s in head.shards:
                s.weight.grad = None
            head(x, target).backward()

        t = _timed(step, devices, repeats, warmup)
        times = t.ms_all
        peaks = _peaks_gib(t, devices + [x_device])
        with torch.no_grad():
            fwd_times = _timed(lambda: head(x, target), devices, repeats, warmup).ms_all
            topk_times = _timed(lambda: head.topk(x, 5), devices, repeats, warmup).ms_all
            top_classes = head.topk(x[:64], 5)[1].cpu()
        loss = float(head(x, target).detach().float())
        grad_w_norm = math.sqrt(sum(float(s.weight.grad.double().square().sum()) for s in head.shards))
        rows.append(dict(
            shape=shape, devices=devices, x_device=x_device, n=n, d=d, v=v, dtype=str(dtype).replace("torch.", ""),
            init_s=init_s, fwd_bwd_ms=harness.median(times), fwd_ms=harness.median(fwd_times), topk_ms=harness.median(topk_times),
            all_fwd_bwd_ms=times, tflops=8 * n * d * v / harness.median(times) / 1e9, loss=loss,
            grad_x_norm=float(x.grad.double().norm()), grad_w_norm=grad_w_norm,
            top5_first_rows=top_classes.tolist()[:4], peak_gib_per_device=peaks,
        ))
        print(f"scaling {shape} {devices} (x on {x_device}): init {init_s:.2f} s, fwd+bwd {harness.median(times):.1f} ms, "
              f"fwd {harness.median(fwd_times):.1f} ms, topk {harness.median(topk_times):.1f} ms, loss {loss:.6g}, "
              f"|dx| {rows[-1]['grad_x_norm']:.6g}, |dW| {grad_w_norm:.6g}", flush=True)
        del head, x, target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = rows[0]
    for row in rows:
        for key in ("fwd_bwd_ms", "fwd_ms", "topk_ms"):
            row[key.replace("_ms", "_ratio_vs_first")] = row[key] / base[key]
        row["ratio_vs_first"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        row["loss_rel_diff_vs_first"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
        row["grad_x_norm_rel_diff_vs_first"] = abs(row["grad_x_norm"] - base["grad_x_norm"]) / base["grad_x_norm"]
        row["grad_w_norm_rel_diff_vs_first"] = abs(row["grad_w_norm"] - base["grad_w_norm"]) / base["grad_w_norm"]
        row["top5_same_as_first"] = row["top5_first_rows"] == base["top5_first_rows"]
    return rows


def run_huge(devices: List[str], n: int, d: int, v: int, dtype: torch.dtype, steps: int, warmup: int) -> dict:
    import hugehead

    torch.manual_seed(0)
    init_ms, head = harness.time_call_ms(lambda: hugehead.ChunkedClassifier(
        d, v, bias=False, devices=devices, dtype=dtype), _all_devices(devices), clock="host")
    init_s = init_ms / 1e3
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)  # no state: weights + grads fill the GPUs
    x_device = torch.device(devices[0])
    gen = torch.Generator(device=x_device).manual_seed(1)
    losses = []

    def step():
        x = torch.randn(n, d, device=x_device, dtype=dtype, generator=gen)
        target = torch.randint(0, v, (n,), device=x_device, generator=gen)
        optimizer.zero_grad(set_to_none=True)
        loss = head(x, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    t = _timed(step, devices, steps, warmup)
    times = t.ms_all
    row = dict(
        devices=devices, n=n, d=d, v=v, dtype=str(dtype).replace("torch.", ""), init_s=init_s,
        weight_gib=v * d * torch.empty((), dtype=dtype).element_size() / 2**30,
        step_ms=harness.median(times), all_step_ms=times, losses=[float(l.float()) for l in losses],
        shard_sizes=list(head.shard_sizes),
        peak_gib_per_device=_peaks_gib(t, devices),
    )
    print(f"huge {v:,} classes over {devices}: step {row['step_ms']:.0f} ms, peak GiB {row['peak_gib_per_device']}",
          flush=True)
    return row


def render_markdown(doc: dict) -> str:
    meta = doc["meta"]
    lines = [harness.header(f"ChunkedClassifier placements: {meta.get('gpu_name')} x{meta.get('gpu_count')}", meta)]
    if doc.get("scaling"):
        lines += ["## Scaling (x and targets on cuda:0; ratios vs the head on cuda:0 alone)", "",
                  "| shape | head devices | N×D×V | init s | fwd+bwd ms | fwd ms | top-5 ms | fwd+bwd / fwd / top-5 "
                  "vs first | TFLOP/s | peak GiB per device | loss | rel diff loss / dx / dW |",
                  "|---|---|---|--:|--:|--:|--:|---|--:|---|--:|---|"]
        for r in doc["scaling"]:
            peaks = ", ".join(f"{k} {v:.1f}" for k, v in r["peak_gib_per_device"].items()) or "-"
            lines.append(
                f"| {r.get('shape', '')} | {', '.join(r['devices'])} | {r['n']}×{r['d']}×{r['v']:,} | "
                f"{r['init_s']:.2f} | {r['fwd_bwd_ms']:.1f} | {r['fwd_ms']:.1f} | {r.get('topk_ms', float('nan')):.1f} | "
                f"{r['ratio_vs_first']:.3f}× / {r.get('fwd_ratio_vs_first', float('nan')):.3f}× / "
                f"{r.get('topk_ratio_vs_first', float('nan')):.3f}× | {r['tflops']:.0f} | {peaks} | {r['loss']:.6g} | "
                f"{r['loss_rel_diff_vs_first']:.1e} / {r['grad_x_norm_rel_diff_vs_first']:.1e} / "
                f"{r['grad_w_norm_rel_diff_vs_first']:.1e} |")
        lines.append("")
    if doc.get("huge"):
        h = doc["huge"]
        peaks = ", ".join(f"{k} {v:.1f}" for k, v in h["peak_gib_per_device"].items()) or "-"
        lines += ["## Huge head (SGD training steps)", "",
                  f"{h['v']:,} classes × D={h['d']} {h['dtype']} (weight {h['weight_gib']:.1f} GiB, the same again "
                  f"for its gradient) over {', '.join(h['devices'])} (shards {h['shard_sizes']}), N={h['n']}: "
                  f"step {h['step_ms']:.0f} ms (median of {len(h['all_step_ms'])}), init {h['init_s']:.0f} s, "
                  f"peak GiB per device: {peaks}; losses {['%.4g' % l for l in h['losses']]}.", ""]
    return "\n".join(lines) + "\n" + harness.footer(meta)


def render_png(doc: dict, path: Path) -> None:
    """fwd+bwd ms per shape, one bar per placement (the first, second, … placement of each shape)."""
    rows = doc.get("scaling") or []
    shapes = list(dict.fromkeys(r.get("shape", "") for r in rows))
    placements = list(dict.fromkeys(" + ".join(r["devices"]) for r in rows))
    series = {p: [next((r["fwd_bwd_ms"] for r in rows if r.get("shape", "") == s and " + ".join(r["devices"]) == p),
                       None) for s in shapes] for p in placements}
    harness.bar_chart(path, shapes, harness.Panel("fwd+bwd ms (median)", series, log=False),
                      "ChunkedClassifier placements, x on " + (rows[0].get("x_device", "") if rows else ""),
                      smoke=harness.is_smoke(doc["meta"]))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scaling", action="store_true", help="one GPU vs all GPUs at xc6M")
    p.add_argument("--huge", action="store_true", help="the 50M-class head over all GPUs")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU shards (checks the pipeline)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to split the head over (default: every visible one); the one-GPU and seed-layout "
                        "rows run too")
    p.add_argument("--huge-classes", type=int, default=50_000_000)
    p.add_argument("--shapes", default="xc6M,xc6M_16k", help="scaling shapes: xc6M (N=4096), xc6M_16k (N=16384)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    harness.add_record_flag(p)
    args = p.parse_args(argv)
    if not (args.scaling or args.huge):
        args.scaling = args.huge = True

    if args.cpu_smoke:
        placements = [["cpu"], ["cpu", "cpu"]]
        x_device = "cpu"
        n, d, v, huge_v, dtype, warmup = 64, 32, 20_000, 50_000, torch.float32, 1
        shapes = {"tiny": n, "tiny_2n": 2 * n}
        device = torch.device("cpu")
    else:
        gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
        if gpus > torch.cuda.device_count():
            print(f"bench_placement: --gpus {gpus} but only {torch.cuda.device_count()} are visible", file=sys.stderr)
            return 2
        if gpus < 2:
            print("bench_placement needs two or more GPUs (or --cpu-smoke)", file=sys.stderr)
            return 2
        # One GPU, the seed's layout (the whole head on another GPU than x), then all GPUs.
        placements = [["cuda:0"], ["cuda:1"], [f"cuda:{i}" for i in range(gpus)]]
        x_device = "cuda:0"
        n, d, v, huge_v, dtype, warmup = 4096, 768, 6_000_000, args.huge_classes, torch.bfloat16, 2
        shapes = {"xc6M": 4096, "xc6M_16k": 16384}
        device = torch.device("cuda", 0)
    meta = harness.run_meta(
        "placement", device, options=args, smoke=args.cpu_smoke,
        shapes={name: dict(n=rows, d=d, v=v) for name, rows in shapes.items()},
        command="python -m bench.bench_placement " + " ".join(argv if argv is not None else sys.argv[1:]))
    doc = dict(meta=meta)
    out = args.out or harness.REPO_ROOT / "bench" / "results" / f"{harness.gpu_slug(meta['gpu_name'])}x{max(1, meta['gpu_count'])}"

    def publish(plot: bool = False):  # after every part: a run cut short still leaves its results
        harness.write_report(out, "placement", doc, render_markdown,
                             plot=(lambda path: render_png(doc, path)) if plot and doc.get("scaling") else None, record=args.record)

    if args.scaling:
        doc["scaling"] = []
        for shape in args.shapes.split(",") if not args.cpu_smoke else shapes:
            doc["scaling"] += run_scaling(placements, x_device, shapes[shape], d, v, dtype, args.repeats, warmup,
                                          shape)
            publish()
    if args.huge:
        doc["huge"] = run_huge(placements[-1], 4096 if not args.cpu_smoke else n, d, huge_v, dtype, args.repeats,
                               warmup)
    publish(plot=True)
    if meta.get("png_error"):
        print(f"no plot: {meta['png_error']}", file=sys.stderr)
    print(render_markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
