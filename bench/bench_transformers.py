"""Hugging Face transformers models patched by ``hugehead.integrations.transformers.patch``.

    python -m bench.bench_transformers            # one H200, about 2 minutes: bench/results/h200/transformers.{json,md}
    python -m bench.bench_transformers --cpu-smoke --out /tmp/tf/transformers.json   # tiny, the same pipeline

(a) ``llama``: a 2-layer random ``LlamaForCausalLM`` with LLaMA-3-8B's widths (hidden 4096, intermediate
    14336, 32 heads / 8 KV heads, vocab 128,256), bfloat16 parameters, 8 sequences x 2048 tokens, every
    token a label. One training step = ``model(input_ids, labels=labels).loss.backward()`` (gradients set to
    None after each). Models from the same seed: unpatched (transformers' own ``lm_head`` + float32
    cross-entropy), ``patch(model)`` (the default 4 GiB budget: the 16384 x 128256 bf16 logits are kept for
    the backward, three GEMMs), ``hugehead_<X>gib`` for each ``--budgets`` entry (default 1: the rows plan,
    every gradient computed in the forward over 6 blocks of 2752 rows, a sixth of the logits' memory, three
    GEMMs), ``hugehead_recompute_<X>gib`` (``memory_budget`` X GiB without the rows plan,
    ``HUGEHEAD_ROWS=0``: chunks recomputed, four GEMMs), and Liger-Kernel's
    ``apply_liger_kernel_to_llama`` with only its fused
    linear cross-entropy on (``rope``/``rms_norm``/``swiglu`` off, so that the rows differ in the loss
    alone); a Liger that cannot be imported is recorded as such.
(b) ``bert_6m``: ``BertForSequenceClassification`` (BERT-base, random init) with 6,000,000 labels, float32
    parameters, one step = forward with labels under ``torch.autocast(bfloat16)`` (Lightning's
    bf16-mixed), backward, fused AdamW, zero_grad. Patched (the head a ChunkedClassifier on cuda:0) beside unpatched
    (the 6M x 768 Linear, its [N, 6M] logits and AdamW state: expected to run out of memory, recorded).

Times and memory through ``bench.harness.measure``: CUDA events, median of ``--reps`` after ``--warmup``
untimed steps; peak memory is ``torch.cuda.max_memory_allocated`` during the timed steps minus what was
allocated before them (the parameters, and for (b) the AdamW state from the warm-up). The losses of each row
are recorded (same inputs and initial weights within a section).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bench import harness  # first: decides which hugehead is imported
from bench.harness import error_text

import torch  # noqa: E402

GIB = float(1 << 30)
FULL = dict(
    llama=dict(hidden=4096, intermediate=14336, layers=2, heads=32, kv_heads=8, vocab=128256, batch=8, seq=2048),
    bert=dict(hidden=768, layers=12, heads=12, intermediate=3072, labels=6_000_000, batch=4096, seq=32,
              token_vocab=30522),
)
SMOKE = dict(
    llama=dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=1000, batch=2, seq=32),
    bert=dict(hidden=32, layers=2, heads=4, intermediate=64, labels=5000, batch=16, seq=8, token_vocab=500),
)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measured(name: str, build: Callable[[], Callable[[], torch.Tensor]], device, args,
              input_bytes: Optional[int] = None) -> Dict[str, object]:
    """One row: ``build()`` returns the step (a function returning the loss); failures become the row's
    status (``oom`` for an out-of-memory error), never a number."""
    row: Dict[str, object] = {"impl": name}
    try:
        step = build()
        t = harness.measure(step, device, reps=args.reps, warmup=args.warmup, input_bytes=input_bytes)
        row.update(status="ok", loss=float(t.result), step_ms=t.ms, step_ms_min=t.ms_min, step_ms_all=t.ms_all,
                   peak_extra_gib=None if t.peak_extra_bytes is None else t.peak_extra_bytes / GIB,
                   peak_gib=None if t.peak_bytes is None else t.peak_bytes / GIB,
                   baseline_gib=None if t.baseline_bytes is None else t.baseline_bytes / GIB)
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="oom", error=error_text(exc, 300))
    except Exception as exc:  # noqa: BLE001  (recorded in the row; the other rows still run)
        row.update(status="error", error=error_text(exc))
    step = None  # noqa: F841  (drop the model before the next row)
    _free(device)
    print(f"  {name}: {row.get('status')} {harness.fmt(row.get('step_ms'), '.1f')} ms, "
          f"peak +{harness.fmt(row.get('peak_extra_gib'), '.2f')} GiB {row.get('error', '')}", flush=True)
    return row


# --------------------------------------------------------------------------------------------------
# (a) LLaMA-3-8B-shaped head on a 2-layer LlamaForCausalLM
# --------------------------------------------------------------------------------------------------
def _llama(s, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], max_position_embeddings=max(2048, s["seq"]),
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).train()


def _liger_llama():
    """Liger's fused linear cross-entropy on LlamaForCausalLM (class-level, as Liger patches), nothing else."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                fused_linear_cross_entropy=True)


def _budget_of(kind: str) -> Optional[int]:
    """``hugehead_<X>gib`` / ``hugehead_recompute_<X>gib``: memory_budget X GiB; other kinds: the default."""
    tail = kind.rsplit("_", 1)[-1]
    return int(float(tail[:-len("gib")]) * (1 << 30)) if tail.endswith("gib") else None


def _rows_allowed(kind: str) -> bool:
    # hugehead_recompute_<X>gib: the planner without its rows plan (HUGEHEAD_ROWS=0), i.e. the plan of
    # before it at that budget, for the A/B in the same run.
    return not kind.startswith("hugehead_recompute_")


def _llama_plan(s, device, dtype, kind) -> Dict[str, object]:
    """The plan linear_cross_entropy makes for this row's loss (every token a row: the shifted labels are
    padded), as the planner is asked inside the step."""
    from hugehead.plan import plan_loss

    n = s["batch"] * s["seq"]
    plan = plan_loss(n, s["hidden"], s["vocab"], dtype, device, None, _budget_of(kind), allow_rows=True,
                     direct_dx=True)
    return dict(kind=plan.kind, rows=plan.rows, cols=plan.cols, blocks=-(-n // plan.rows),
                kept_chunks=plan.kept_chunks, budget=plan.budget, reason=plan.reason)


def run_llama(s, device, dtype, args) -> List[Dict[str, object]]:
    from hugehead.integrations.transformers import patch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)

    def build(kind):
        def make():
            if kind.startswith("hugehead") and not _rows_allowed(kind):
                os.environ["HUGEHEAD_ROWS"] = "0"
            else:
                os.environ.pop("HUGEHEAD_ROWS", None)
            if kind == "liger":
                _liger_llama()
            model = _llama(s, device, dtype)
            if kind.startswith("hugehead"):
                patch(model, memory_budget=_budget_of(kind))

            def step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                for p in model.parameters():  # at the end: the measured peak holds the gradients, the baseline not
                    p.grad = None
                return loss.detach()

            return step
        return make

    rows = []
    budgets = [f"hugehead_{b.strip()}gib" for b in args.budgets.split(",") if b.strip()]
    recompute = [f"hugehead_recompute_{b.strip()}gib" for b in args.recompute_budgets.split(",") if b.strip()]
    # Liger last: it patches the class for good.
    for kind in ("unpatched", "hugehead", *budgets, *recompute, "liger"):
        row = _measured(kind, build(kind), device, args)
        if kind.startswith("hugehead"):
            with _rows_env(kind):
                row["plan"] = _llama_plan(s, device, dtype, kind)
        rows.append(row)
    os.environ.pop("HUGEHEAD_ROWS", None)
    return rows


class _rows_env:
    """HUGEHEAD_ROWS as the row ``kind`` ran with, while its plan is asked again for the report."""

    def __init__(self, kind: str):
        self.allowed = _rows_allowed(kind)

    def __enter__(self):
        if self.allowed:
            os.environ.pop("HUGEHEAD_ROWS", None)
        else:
            os.environ["HUGEHEAD_ROWS"] = "0"

    def __exit__(self, *exc):
        os.environ.pop("HUGEHEAD_ROWS", None)


# --------------------------------------------------------------------------------------------------
# (b) BERT-base with 6M labels, bf16 autocast, AdamW
# --------------------------------------------------------------------------------------------------
def run_bert(s, device, args) -> List[Dict[str, object]]:
    from transformers import BertConfig, BertForSequenceClassification

    from hugehead.integrations.transformers import patch

    t0 = time.perf_counter()
    config = BertConfig(vocab_size=s["token_vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                        num_attention_heads=s["heads"], intermediate_size=s["intermediate"], num_labels=s["labels"],
                        problem_type="single_label_classification", attn_implementation="sdpa")
    # transformers keeps num_labels as an id2label dict and type-checks every entry: seconds at 6M labels.
    config_s = time.perf_counter() - t0
    print(f"  BertConfig(num_labels={s['labels']:,}): {config_s:.1f} s", flush=True)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, s["token_vocab"], (s["batch"], s["seq"]), generator=g).to(device)
    labels = torch.randint(0, s["labels"], (s["batch"],), generator=g).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def build(kind):
        def make():
            torch.manual_seed(0)
            with torch.device(device):  # the 6M x 768 Linear is initialized on the GPU, not the host
                model = BertForSequenceClassification(config).train()
            if kind == "hugehead":
                patch(model, devices=[device])
            try:
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            except (RuntimeError, TypeError, ValueError):
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

            def step():
                with autocast:
                    loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)  # at the end: the baseline holds no gradients
                return loss.detach()

            return step
        return make

    # hugehead first: a failed unpatched step cannot then leave memory behind for it.
    rows = [_measured(kind, build(kind), device, args) for kind in ("hugehead", "unpatched")]
    for row in rows:
        row["config_s"] = config_s
    return rows


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def _table(rows, baseline: str) -> str:
    base = next((r for r in rows if r["impl"] == baseline and r.get("status") == "ok"), None)
    out = []
    for r in rows:
        speed = (f"{base['step_ms'] / r['step_ms']:.2f}x" if base is not None and r.get("status") == "ok" else "-")
        status = r.get("status") if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error', '')[:160]}"
        plan = r.get("plan") or {}
        plan_text = "-" if not plan else (
            f"rows: {plan['blocks']} x {plan['rows']}" if plan["kind"] == "rows" else plan["kind"])
        out.append([r["impl"], plan_text, harness.fmt(r.get("step_ms"), ".1f"), speed,
                    harness.fmt(r.get("peak_extra_gib"), ".2f"), harness.fmt(r.get("peak_gib"), ".2f"),
                    harness.fmt(r.get("loss"), ".5f"), status])
    return harness.md_table(["impl", "hugehead plan", "step ms", f"speed vs {baseline}", "peak beyond model GiB",
                             "peak GiB", "loss", "status"], out)


def render_markdown(doc) -> str:
    meta = doc["meta"]
    s = meta["shapes"]
    lines = [harness.header("Hugging Face transformers models patched by hugehead", meta)]
    if "llama" in doc:
        ls = s["llama"]
        lines += [f"## (a) LlamaForCausalLM, {ls['layers']} layers, hidden {ls['hidden']}, vocab {ls['vocab']:,}, "
                  f"{ls['batch']} x {ls['seq']} tokens, bf16: forward with labels + backward", "",
                  _table(doc["llama"], "unpatched"), "",
                  "Liger: `apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)` with its other kernels off, "
                  "so the rows differ only in the loss. hugehead_<X>gib: `patch(model, memory_budget=X GiB)`. "
                  "hugehead_recompute_<X>gib: the same without the rows plan (`HUGEHEAD_ROWS=0`). "
                  "hugehead plan: the plan's kind (`rows`: gradients in the forward over blocks x rows; `kept`: all "
                  "logits kept for the backward; `recompute`: chunks recomputed in the backward). "
                  "Peak beyond model: over the bf16 parameters (their gradients, "
                  "activations, logits or their chunks).", ""]
    if "bert_6m" in doc:
        bs = s["bert"]
        lines += [f"## (b) BertForSequenceClassification, {bs['layers']} layers, hidden {bs['hidden']}, "
                  f"{bs['labels']:,} labels, batch {bs['batch']} x {bs['seq']} tokens: bf16 autocast, "
                  f"fused AdamW step", "", _table(doc["bert_6m"], "hugehead"), "",
                  "Peak beyond model: over the float32 parameters and AdamW state (allocated in the warm-up). "
                  f"Building the `BertConfig` alone took {harness.fmt(doc['bert_6m'][0].get('config_s'), '.1f')} s "
                  "(transformers stores num_labels as an id2label dict and type-checks each entry).", ""]
    return "\n".join(lines) + harness.footer(meta)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/<gpu>/transformers.json); the "
                                             "markdown goes next to it")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (checks the pipeline)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--parts", default="llama,bert", help="comma list of llama, bert")
    p.add_argument("--budgets", default="1", help="comma list of GiB: a patched-Llama row at each memory_budget "
                   "(1: the rows plan, the setting comparable with Liger's)")
    p.add_argument("--recompute-budgets", default="1.5",
                   help="comma list of GiB: a patched-Llama row at each memory_budget without the rows plan "
                        "(HUGEHEAD_ROWS=0: chunks recomputed, the low-memory setting before it)")
    harness.add_record_flag(p)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if args.cpu_smoke:
        sizes, device, dtype = SMOKE, torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            print("bench_transformers needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
            return 2
        sizes, device, dtype = FULL, torch.device("cuda", 0), torch.bfloat16
    import transformers

    meta = harness.run_meta("transformers", device, options=args, smoke=args.cpu_smoke, shapes=sizes,
                            transformers=transformers.__version__, liger_kernel=harness.package_version("liger-kernel"),
                            command="python -m bench.bench_transformers "
                            + " ".join(argv if argv is not None else sys.argv[1:]))
    out = args.out or harness.REPO_ROOT / "bench" / "results" / harness.gpu_slug(meta["gpu_name"]) / "transformers.json"
    doc: Dict[str, object] = dict(meta=meta)

    def publish():
        meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        harness.write_report(out.parent, out.stem, doc, render_markdown, record=args.record, study="transformers")

    parts = set(args.parts.split(","))
    if "bert" in parts:  # first: the 6M head wants the GPU to itself
        print("(b) BERT 6M", flush=True)
        doc["bert_6m"] = run_bert(sizes["bert"], device, args)
        publish()
    if "llama" in parts:
        print("(a) Llama", flush=True)
        doc["llama"] = run_llama(sizes["llama"], device, dtype, args)
        publish()
    print(render_markdown(doc))
    failed = [f"{section} {r['impl']}" for section in ("llama", "bert_6m") for r in doc.get(section, [])
              if r["impl"] == "hugehead" and r.get("status") != "ok"]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
