"""Batch prediction benchmark: what ranking a whole DataLoader with :func:`hugehead.predict_topk_chunks`
costs beyond the head's top-k alone, and how much device memory it holds.

    python -m bench.bench_predict                               # one GPU, bf16: xc1M and xc6M, k = 5, 100 (~2 min)
    python -m bench.bench_predict --cpu-smoke --out /tmp/pred   # the pipeline, tiny, on the CPU

Per shape (``N`` rows a batch, ``D``, ``V`` classes, no bias) and k, over ``--batches`` batches of bf16
features held in pinned host memory by a ``DataLoader(pin_memory=True)``:

- ``topk_ms``: ``head.topk(x, k)`` per batch with the features already on the device (the floor);
- ``predict_ms``: per batch of ``predict_topk_chunks(head, loader, k)`` run to its end, host clock: the
  loader, the features' copy to the device, the top-k, the results' copy into pinned host memory and the
  wait for the last one; ``overhead`` = ``predict_ms / topk_ms`` (1.0: the dataset loop is free);
- ``peak_extra_gib``: the device's peak allocation during prediction beyond the head's weight (one batch's
  workspace and features, independent of the number of batches);
- ``metric_ms``: :class:`hugehead.metrics.AccuracyAtK` updates over every chunk, per batch.

Writes predict.json, predict.md and predict.png to --out (default bench/results/<gpu>/).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

from bench import harness  # first: decides which hugehead is imported
from bench.common import SHAPES, Shape

import torch
from torch.utils.data import DataLoader, TensorDataset

import hugehead
from hugehead.metrics import AccuracyAtK

GPU_SHAPES = {s: SHAPES[s] for s in ("xc1M", "xc6M")}
SMOKE_SHAPES = {"tiny": Shape("tiny", 64, 32, 5003, "smoke")}


def run(shapes, ks: List[int], device: torch.device, dtype: torch.dtype, args) -> List[dict]:
    rows = []
    for shape in shapes.values():
        head = hugehead.ChunkedClassifier(shape.d, shape.v, bias=False, devices=[device], dtype=dtype)
        weight_bytes = harness.tensor_bytes(*[s.weight for s in head.shards])
        g = torch.Generator().manual_seed(0)
        features = torch.randn(args.batches * shape.n, shape.d, generator=g).to(dtype)
        target = torch.randint(0, shape.v, (features.shape[0],), generator=g)
        loader = DataLoader(TensorDataset(features, target), batch_size=shape.n,
                            pin_memory=device.type == "cuda")
        on_device = [features[i:i + shape.n].to(device) for i in range(0, features.shape[0], shape.n)]
        for k in ks:
            def bare():
                return [head.topk(x, k) for x in on_device]

            def predict():
                return list(hugehead.predict_topk_chunks(head, loader, k, progress=False))

            t_bare = harness.measure(bare, device, reps=args.reps, warmup=args.warmup, clock="host")
            t_pred = harness.measure(predict, device, reps=args.reps, warmup=args.warmup, clock="host",
                                     input_bytes=weight_bytes + harness.tensor_bytes(*on_device))
            chunks = t_pred.result
            same = all(torch.equal(c.indices, i.cpu()) for c, (_, i) in zip(chunks, t_bare.result))

            def metric():
                acc = AccuracyAtK(min(5, k))
                for c in chunks:
                    acc.update(c.indices, c.target)
                return acc.compute()

            t_metric = harness.measure(metric, torch.device("cpu"), reps=args.reps, warmup=1, clock="host")
            per = 1.0 / args.batches
            rows.append(dict(shape=shape.name, n=shape.n, d=shape.d, v=shape.v, k=k, batches=args.batches,
                             dtype=str(dtype).replace("torch.", ""), topk_ms=t_bare.ms * per,
                             predict_ms=t_pred.ms * per, overhead=t_pred.ms / t_bare.ms,
                             peak_extra_gib=t_pred.peak_extra_gib, metric_ms=t_metric.ms * per,
                             same_indices=same, pinned=all(c.indices.is_pinned() for c in chunks)
                             if device.type == "cuda" else None,
                             topk_all_ms=t_bare.ms_all, predict_all_ms=t_pred.ms_all))
            print(f"{shape.name} k={k}: top-k {rows[-1]['topk_ms']:.1f} ms/batch, predict {rows[-1]['predict_ms']:.1f} "
                  f"ms/batch ({rows[-1]['overhead']:.3f}x), peak beyond the weight "
                  f"{harness.fmt(t_pred.peak_extra_gib, '.2f')} GiB, metric {rows[-1]['metric_ms']:.2f} ms/batch, "
                  f"same indices {same}", flush=True)
        del head, on_device
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(doc: dict) -> str:
    meta, rows = doc["meta"], doc["rows"]
    md = harness.header("Batch prediction over a DataLoader vs the head's top-k alone", meta)
    md += (f"`hugehead.predict_topk_chunks(head, loader, k)` over {meta['options']['batches']} batches of pinned "
           "host features (host clock, loader + copies + top-k + results into pinned host memory) against "
           "`head.topk(x, k)` on device-resident features; per batch, median of "
           f"{meta['options']['reps']}. Peak: device memory beyond the head's weight during prediction.\n\n")
    md += harness.md_table(
        ["shape", "N × D × V", "k", "top-k ms", "predict ms", "overhead", "peak extra GiB", "metric ms", "same ids"],
        [[*harness.shape_cells(r), r["k"], harness.fmt(r["topk_ms"], ".1f"),
          harness.fmt(r["predict_ms"], ".1f"), harness.fmt(r["overhead"], ".3f") + "×",
          harness.fmt(r["peak_extra_gib"], ".2f"), harness.fmt(r["metric_ms"], ".2f"),
          harness.yes_no(bool(r["same_indices"]))] for r in rows])
    return md + harness.footer(meta)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", help=f"default: {' '.join(GPU_SHAPES)}")
    p.add_argument("--k", type=int, nargs="*", default=[5, 100])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny, on the CPU (float32): the pipeline only")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        device, dtype, shapes = torch.device("cpu"), torch.float32, SMOKE_SHAPES
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (or --cpu-smoke)")
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        shapes = {s: SHAPES[s] for s in args.shapes} if args.shapes else GPU_SHAPES
    meta = harness.run_meta("predict", device, options=args, smoke=args.cpu_smoke,
                            shapes={name: dict(n=s.n, d=s.d, v=s.v) for name, s in shapes.items()})
    rows = run(shapes, args.k, device, dtype, args)
    out = args.out or (harness.REPO_ROOT / "bench" / "results"
                       / (harness.gpu_slug(str(meta.get("gpu_name"))) if device.type == "cuda" else "cpu"))
    doc = {"meta": meta, "rows": rows}
    names = [f"{r['shape']} k={r['k']}" for r in rows]
    harness.write_report(out, "predict", doc, markdown, plot=lambda path: harness.bar_chart(
        path, names, harness.Panel("ms per batch", {"head.topk": [r["topk_ms"] for r in rows],
                                                    "predict_topk_chunks": [r["predict_ms"] for r in rows]})))
    print(f"wrote {out}/predict.{{json,md,png}}")
    return doc


if __name__ == "__main__":
    main()
