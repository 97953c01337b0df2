"""Post-training losses: per-token log-probs with the entropy, and distillation (forward KL, reverse KL, JSD),
forward + backward, against hugehead's own cross-entropy step of the same shape in the same run, and against
the peers where they run: verl's fused kernel (its files loaded by path, ``--verl-dir``), a TRL-style chunked
log-prob function (``--trl-fn module:function``) and Liger's fused linear JSD.

    python -m bench.bench_posttrain                             # one GPU, bf16: llama3_4k, gemma2, xc1M (+ xc6M)
    python -m bench.bench_posttrain --verl-dir /path/to/verl/utils/kernel --record
    python -m bench.bench_posttrain --cpu-smoke --out /tmp/pt   # the pipeline, tiny, hugehead only

Targets (GPU, ratios to ``ce_ms``): log-probs + entropy through both outputs <= 1.05x; forward and reverse KL
<= 1.6x (the floor is 1.5x: the teacher's logits twice beside the student's four GEMMs); JSD <= 2.1x; faster than
every peer that runs. The student and the teacher have the same shape; every call's upstream gradients are
random, never zeros.

Writes posttrain.json (rows: ``study`` (``logprob_entropy``, ``forward_kl``, ``reverse_kl``, ``jsd``), ``shape``,
``impl`` (hugehead, verl, trl, liger), ``ms``, ``ce_ms``, ``ratio``, ``peak_gib``, or ``skipped`` with the
reason), posttrain.md and posttrain.png to --out (default bench/results/<gpu>/ or bench/results/cpu/).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bench import harness  # first: decides which hugehead is imported
from bench import common
from bench.common import Shape

import torch

import hugehead

LOGPROB_SHAPES = ("llama3_4k", "gemma2", "xc1M")
DISTILL_SHAPES = ("llama3_4k", "gemma2", "xc1M", "xc6M")
SMOKE_SHAPES = {"tiny": Shape("tiny", 64, 32, 5003, "smoke")}
TARGETS = {"logprob_entropy": 1.05, "forward_kl": 1.6, "reverse_kl": 1.6, "jsd": 2.1}
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def load_verl(kernel_dir: Optional[str]):
    """verl's ``linear_cross_entropy`` from its ``utils/kernel`` folder, imported by path as a package of its own
    (``linear_cross_entropy.py`` and ``kernels.py`` need torch, triton and ``verl.utils.device``, a stub here), never
    ``import verl``."""
    if not kernel_dir:
        raise RuntimeError("no --verl-dir given")
    root = Path(kernel_dir)
    if not (root / "linear_cross_entropy.py").is_file():
        raise RuntimeError(f"no linear_cross_entropy.py in {root}")
    # kernels.py asks verl.utils.device which accelerator this is: answered here, for CUDA, without verl
    for name in ("verl", "verl.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    device = sys.modules.setdefault("verl.utils.device", types.ModuleType("verl.utils.device"))
    device.get_torch_device = lambda: torch.cuda
    device.get_device_name = lambda: "cuda"
    device.get_device_capability = lambda: torch.cuda.get_device_capability()
    device.is_cuda_available = torch.cuda.is_available()
    package = types.ModuleType("verl_kernel_by_path")
    package.__path__ = [str(root)]
    sys.modules[package.__name__] = package
    return importlib.import_module(f"{package.__name__}.linear_cross_entropy").linear_cross_entropy


def load_trl(spec: Optional[str]):
    """``module:function`` taking ``(hidden [N, D], weight [V, D], labels [N])`` and returning per-token log-probs."""
    if not spec:
        raise RuntimeError("no --trl-fn given (module:function of a chunked per-token log-prob function)")
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def load_liger_jsd(divergence: str):
    from liger_kernel.transformers import LigerFusedLinearJSD

    beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}[divergence]
    jsd = LigerFusedLinearJSD(jsd_beta=beta, temperature=1.0)
    return lambda xs, ws, xt, wt: jsd(xs, ws, xt, wt)


def _step(loss_fn: Callable[[], torch.Tensor], params: List[torch.Tensor]) -> Callable[[], object]:
    def step():
        for p in params:
            p.grad = None
        out = loss_fn()
        out.backward()
        return out.detach()
    return step


def _row(study, shape, impl, timing, ce_ms, dtype) -> dict:
    ratio = None if timing is None else timing.ms / ce_ms
    target = TARGETS[study] if impl == "hugehead" else None
    return dict(study=study, shape=shape.name, n=shape.n, d=shape.d, v=shape.v, impl=impl, dtype=dtype,
                ms=None if timing is None else timing.ms, ce_ms=ce_ms, ratio=ratio,
                peak_gib=None if timing is None else timing.peak_extra_gib, target_ratio=target,
                meets_target=None if target is None or ratio is None else ratio <= target,
                ms_all=None if timing is None else timing.ms_all)


def run(shapes: Dict[str, Shape], studies: List[str], device: torch.device, dtype: torch.dtype, args) -> List[dict]:
    rows: List[dict] = []
    for shape in shapes.values():
        rows += _run_shape(shape, studies, device, dtype, args)  # its inputs freed on return
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _run_shape(shape: Shape, studies: List[str], device: torch.device, dtype: torch.dtype, args) -> List[dict]:
    rows: List[dict] = []
    x, w, target = common.make_inputs(shape, device, dtype)
    xt, wt, _ = common.make_inputs(shape, device, dtype, seed=1)
    g = torch.Generator(device=device).manual_seed(2)
    up = torch.randn(2, shape.n, generator=g, device=device)
    x.requires_grad_(), w.requires_grad_()
    measure = lambda fn: harness.measure(_step(fn, [x, w]), device, reps=args.reps, warmup=args.warmup,  # noqa: E731
                                         input_bytes=harness.tensor_bytes(x, w, target, xt, wt) * 2)
    ce = measure(lambda: hugehead.linear_cross_entropy(x, w, target))
    print(f"{shape.name}: cross-entropy step {ce.ms:.2f} ms", flush=True)
    wanted = [s for s in studies if device.type == "cpu"  # the CPU's shapes take every study
              or shape.name in (LOGPROB_SHAPES if s == "logprob_entropy" else DISTILL_SHAPES)]
    for study in wanted:
        impls: Dict[str, Callable[[], Callable]] = {}
        if study == "logprob_entropy":
            def ours():
                logp, h = hugehead.linear_log_prob(x, w, target, return_entropy=True)
                return (logp * up[0] + h * up[1]).sum()
            impls["hugehead"] = lambda: ours
            impls["verl"] = lambda: _verl_step(load_verl(args.verl_dir), x, w, target, up)
            impls["trl"] = lambda: (lambda fn: (lambda: (fn(x, w, target) * up[0]).sum()))(load_trl(args.trl_fn))
        else:
            impls["hugehead"] = lambda study=study: (
                lambda: hugehead.linear_distill(x, w, xt, wt, divergence=study, beta=0.5))
            impls["liger"] = lambda study=study: (lambda fn: (lambda: fn(x, w, xt, wt)))(load_liger_jsd(study))
        for impl, load in impls.items():
            if device.type == "cpu" and impl != "hugehead":
                rows.append({**_row(study, shape, impl, None, ce.ms, str(dtype)), "skipped": "GPU peers only"})
                continue
            try:
                t = measure(load())
            except Exception as exc:  # noqa: BLE001  (a peer that cannot run is a row saying why)
                rows.append({**_row(study, shape, impl, None, ce.ms, str(dtype)),
                             "skipped": harness.error_text(exc, 300)})
                print(f"  {study} {impl}: skipped ({rows[-1]['skipped'][:120]})", flush=True)
                continue
            rows.append(_row(study, shape, impl, t, ce.ms, str(dtype).replace("torch.", "")))
            print(f"  {study} {impl}: {t.ms:.2f} ms = {t.ms / ce.ms:.2f}x the cross-entropy step", flush=True)
    return rows


def _verl_step(fn, x, w, target, up):
    return lambda: sum((out * u).sum() for out, u in zip(fn(x, w, target, 1.0, "none"), up))


def markdown(doc: dict) -> str:
    meta, rows = doc["meta"], doc["rows"]
    md = harness.header("Post-training losses against the cross-entropy step", meta)
    md += ("Forward + backward, median of the timed calls (CUDA events on a GPU); `ce ms` is hugehead's "
           "`linear_cross_entropy` step of the same shape in the same run. Targets: log-probs + entropy <= 1.05x, "
           "forward/reverse KL <= 1.6x, JSD <= 2.1x.\n\n")
    md += harness.md_table(
        ["study", "shape", "N × D × V", "impl", "ms", "ce ms", "ratio", "peak GiB", "target", "met", "note"],
        [[r["study"], *harness.shape_cells(r), r["impl"], harness.fmt(r["ms"]), harness.fmt(r["ce_ms"]),
          harness.fmt(r["ratio"]) + ("×" if r["ratio"] is not None else ""), harness.fmt(r["peak_gib"]),
          harness.fmt(r["target_ratio"]), harness.yes_no(r["meets_target"]), r.get("skipped", "")[:80]]
         for r in rows])
    return md + harness.footer(meta)


def plot(doc: dict, path: Path) -> None:
    rows = [r for r in doc["rows"] if r["ms"] is not None]
    cats = sorted({f"{r['study']} {r['shape']}" for r in rows})
    impls = sorted({r["impl"] for r in rows})
    series = {i: [next((r["ratio"] for r in rows if f"{r['study']} {r['shape']}" == c and r["impl"] == i), None)
                  for c in cats] for i in impls}
    harness.bar_chart(path, cats, harness.Panel("× the cross-entropy step", series), title="Post-training losses",
                      smoke=doc["meta"].get("smoke", False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the pipeline)")
    p.add_argument("--shapes", default=None, help="comma list (default: the studies' shapes)")
    p.add_argument("--studies", default="logprob_entropy," + ",".join(DIVERGENCES))
    p.add_argument("--verl-dir", default=None, help="verl's utils/kernel folder (from its wheel)")
    p.add_argument("--trl-fn", default=None, help="module:function of a chunked per-token log-prob function")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5 GPU, 2 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2 GPU, 1 CPU)")
    p.add_argument("--out", type=Path, help="output folder")
    harness.add_record_flag(p)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else args.device)
    gpu = device.type == "cuda"
    args.reps = args.reps or (5 if gpu else 2)
    args.warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    if args.cpu_smoke:
        shapes = SMOKE_SHAPES
    else:
        names = args.shapes.split(",") if args.shapes else list(dict.fromkeys(LOGPROB_SHAPES + DISTILL_SHAPES))
        shapes = {n: common.find_shape(n) for n in names}
    meta = harness.run_meta("posttrain", device, options=args, smoke=args.cpu_smoke, mode="gpu" if gpu else "cpu",
                            shapes={s.name: dict(n=s.n, d=s.d, v=s.v) for s in shapes.values()})
    start = time.perf_counter()
    rows = run(shapes, args.studies.split(","), device, torch.bfloat16 if gpu else torch.float32, args)
    meta["elapsed_s"] = time.perf_counter() - start
    doc = {"meta": meta, "rows": rows}
    out = args.out or harness.REPO_ROOT / "bench" / "results" / (
        harness.gpu_slug(str(meta["gpu_name"])) if gpu else "cpu")
    written = harness.write_report(out, "posttrain", doc, markdown, plot=lambda path: plot(doc, path),
                                   record=args.record)
    print("wrote", ", ".join(str(v) for v in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
