"""Turns a benchmark's lce.json into lce.md (a headline table, then the full table a person reads) and
lce.png (bars a person looks at), and merges several runs' JSON (e.g. one device call per group of
shapes) into one.

    python -m bench.report bench/results/h200/lce.json                 # rewrite lce.md / lce.png beside it
    python -m bench.report --out bench/results/h200 run1/lce.json run2/lce.json   # merge, later runs win
    python -m bench.report --headline bench/results/h200/lce.json      # print the headline table only
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

from bench import harness
from bench.common import ALL_SHAPES
from bench.harness import as_float, short_sha as _short_sha

SLOW_REPS = 5  # fewer timed repetitions than this are marked in the table
SUSPECT_REL_ERR = 2e-2  # bf16 results are ~1e-3 off the float32 reference; far more is shown in bold
SUSPECT_REL_ERR_FP32 = 1e-4  # float32 inputs: ~1e-6 off the float32 reference
IMPL_ORDER = ["hugehead", "torch", "torch_compile", "hugehead_eqmem", "torch_chunked", "torch_lce", "cce", "liger",
              "cce_filter", "liger_fp32acc"]
# hugehead at torch.compile's measured memory, compared with it in its own table
EQMEM, EQMEM_SOURCE = "hugehead_eqmem", "torch_compile"
INEXACT = {"cce_filter"}
CROWDED = 0.10  # CPU runs: others' share of the machine during a timing above which the table says so  # rows written before "impl_exact" existed


def suspect_limit(dtype: Optional[str] = None) -> float:
    return SUSPECT_REL_ERR_FP32 if dtype in ("float32", "float64") else SUSPECT_REL_ERR


def suspect(v: Optional[float], dtype: Optional[str] = None) -> bool:
    """A relative error that is non-finite or far above what rounding in ``dtype`` explains."""
    return v is not None and not (v <= suspect_limit(dtype))


def _num(row: dict, key: str) -> Optional[float]:
    return as_float(row.get(key))


def _status_word(status: Optional[str]) -> str:
    return (status or "n/a").upper()


def _sci(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1e}"


def _err(v: Optional[float], dtype: Optional[str] = None) -> str:
    return f"**{_sci(v)}**" if suspect(v, dtype) else _sci(v)


def _ordered(seen: List[str], preferred: List[str]) -> List[str]:
    return [x for x in preferred if x in seen] + [x for x in seen if x not in preferred]


def _shape_order(doc: dict) -> List[str]:
    """Shapes in bench.common.SHAPES order (cheapest first), then any others in the order they appear."""
    seen = list(dict.fromkeys(r["shape"] for r in doc["rows"]))
    return _ordered(seen, list(ALL_SHAPES))


def _impl_order(doc: dict) -> List[str]:
    seen = list(dict.fromkeys(r["impl"] for r in doc["rows"]))
    return _ordered(seen, IMPL_ORDER)


def _dtype(doc: dict, row: Optional[dict] = None) -> str:
    return (row or {}).get("dtype") or doc.get("meta", {}).get("dtype") or "bfloat16"


def _machine(meta: dict) -> str:
    return str(meta.get("machine") or meta.get("gpu_name") or "unknown device")


def _fb_ms(row: Optional[dict]) -> Optional[float]:
    return _num(row, "fwd_bwd_ms") if row and row.get("fwd_bwd_status") == "ok" else None


def _exact(row: dict) -> bool:
    return bool(row.get("impl_exact", row["impl"] not in INEXACT)) and not row["impl"].startswith("selftest")


def _accurate(doc: dict, row: dict) -> bool:
    return not any(suspect(_num(row, k), _dtype(doc, row)) for k in ("loss_rel_err", "grad_x_rel_err", "grad_w_rel_err"))


def headline_rows(doc: dict) -> List[dict]:
    """Per shape: hugehead's fwd+bwd ms, the fastest exact peer that ran with plausible errors, the
    speed-up (peer ms / hugehead ms), and what happened to the peers that did not run."""
    by_shape: Dict[str, List[dict]] = {}
    for r in doc["rows"]:
        by_shape.setdefault(r["shape"], []).append(r)
    out = []
    for shape in _shape_order(doc):
        rows = by_shape[shape]
        mine = next((r for r in rows if r["impl"] == "hugehead"), None)
        # hugehead at other settings (e.g. at torch.compile's memory) is not its own peer
        peers = [r for r in rows if not r["impl"].startswith("hugehead") and _exact(r)]
        timed = sorted((r for r in peers if _fb_ms(r) is not None and _accurate(doc, r)), key=_fb_ms)
        best = timed[0] if timed else None
        failed = [f"{r['impl']} {_status_word(r.get('fwd_bwd_status') or r.get('status'))}"
                  for r in peers if _fb_ms(r) is None and r.get("status") != "skipped"]
        ref = mine or rows[0]
        out.append({
            "shape": shape, "dims": f"{ref['n']}×{ref['d']}×{ref['v']}",
            "hugehead_ms": _fb_ms(mine), "hugehead_status": (mine or {}).get("fwd_bwd_status") or (mine or {}).get("status"),
            "best_peer": best["impl"] if best else None, "best_peer_ms": _fb_ms(best),
            "speedup": (_fb_ms(best) / _fb_ms(mine)) if best and _fb_ms(mine) else None,
            "not_run": failed,
        })
    return out


def render_headline(doc: dict) -> str:
    """The short table for the README: shape, hugehead, the best exact peer, the speed-up."""
    meta = doc.get("meta", {})
    lines = [harness.SMOKE_NOTE, ""] if harness.is_smoke(meta) else []
    lines += [
        f"{_machine(meta)}, {meta.get('dtype', 'bfloat16')}, forward + backward with exact gradients, median ms "
        f"(git `{_short_sha(meta)}`, torch {meta.get('torch')}):",
        "",
        "| shape | N×D×V | hugehead ms | best exact peer | peer ms | speed-up | peers that did not run |",
        "|---|---|--:|---|--:|--:|---|",
    ]
    for h in headline_rows(doc):
        mine = f"{h['hugehead_ms']:.2f}" if h["hugehead_ms"] is not None else _status_word(h["hugehead_status"])
        if h["best_peer"]:
            peer, peer_ms, speed = h["best_peer"], f"{h['best_peer_ms']:.2f}", (
                f"{h['speedup']:.2f}×" if h["speedup"] is not None else "-")
        else:
            peer, peer_ms, speed = "none ran", "-", ("only hugehead runs" if h["hugehead_ms"] is not None else "-")
        lines.append(f"| {h['shape']} | {h['dims']} | {mine} | {peer} | {peer_ms} | {speed} | "
                     f"{', '.join(h['not_run']) or '-'} |")
    lines += ["", "speed-up = best peer's time / hugehead's time (above 1: hugehead is faster)."]
    equal = render_equal_memory(doc)
    return "\n".join(lines) + "\n" + (f"\n{equal}" if equal else "")


def _gib(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / 2**30:.2f}"


def equal_memory_rows(doc: dict) -> List[dict]:
    """Per shape with a ``hugehead_eqmem`` row: torch.compile's fwd+bwd ms and peak extra bytes, hugehead's
    at that memory_budget (ms, peak, plan kind, the GEMM path), and the speed-up (torch.compile ms /
    hugehead ms); ``hugehead_status`` says why a row has no time (e.g. skipped: torch.compile OOM)."""
    by_key = {(r["shape"], r["impl"]): r for r in doc["rows"]}
    out = []
    for shape in _shape_order(doc):
        mine = by_key.get((shape, EQMEM))
        if mine is None:
            continue
        theirs = by_key.get((shape, EQMEM_SOURCE)) or {}
        plan = mine.get("plan") or {}
        mine_ms, their_ms = _fb_ms(mine), _fb_ms(theirs)
        out.append({
            "shape": shape, "dims": f"{mine['n']}×{mine['d']}×{mine['v']}",
            "compile_ms": their_ms,
            "compile_status": theirs.get("fwd_bwd_status") or theirs.get("status"),
            "compile_peak_bytes": _num(theirs, "fwd_bwd_peak_extra_bytes") if their_ms is not None else None,
            "budget_bytes": _num(mine, "memory_budget"),
            "hugehead_ms": mine_ms, "hugehead_status": mine.get("fwd_bwd_status") or mine.get("status"),
            "hugehead_peak_bytes": _num(mine, "fwd_bwd_peak_extra_bytes") if mine_ms is not None else None,
            "plan_kind": plan.get("kind"), "gemm": mine.get("gemm"),
            "speedup": their_ms / mine_ms if mine_ms and their_ms else None,
        })
    return out


def render_equal_memory(doc: dict) -> str:
    """The table comparing hugehead and torch.compile at equal memory ('' without hugehead_eqmem rows)."""
    rows = equal_memory_rows(doc)
    if not rows:
        return ""
    lines = [
        "At torch.compile's memory: hugehead with `memory_budget` = torch.compile's measured fwd+bwd peak extra "
        "memory at the same shape (in this run), fwd+bwd median ms:",
        "",
        "| shape | N×D×V | torch.compile ms | its peak extra GiB | hugehead ms | memory_budget GiB | hugehead peak "
        "extra GiB | plan | GEMM | speed-up |",
        "|---|---|--:|--:|--:|--:|--:|---|---|--:|",
    ]
    for h in rows:
        compile_ms = f"{h['compile_ms']:.2f}" if h["compile_ms"] is not None else _status_word(h["compile_status"])
        mine = f"{h['hugehead_ms']:.2f}" if h["hugehead_ms"] is not None else _status_word(h["hugehead_status"])
        speed = f"{h['speedup']:.2f}×" if h["speedup"] is not None else "-"
        lines.append(f"| {h['shape']} | {h['dims']} | {compile_ms} | {_gib(h['compile_peak_bytes'])} | {mine} | "
                     f"{_gib(h['budget_bytes'])} | {_gib(h['hugehead_peak_bytes'])} | {h['plan_kind'] or '-'} | "
                     f"{h['gemm'] or '-'} | {speed} |")
    lines += ["", "speed-up = torch.compile's time / hugehead's time at its memory (above 1: hugehead is faster)."]
    return "\n".join(lines) + "\n"


def _mark(row: dict, stage: str, asked_reps: int = SLOW_REPS) -> str:
    """‡: one (first) call only; †: fewer timed repetitions than asked for (or than SLOW_REPS)."""
    if row.get(f"{stage}_first_call_only"):
        return "‡"
    return "†" if (row.get(f"{stage}_reps") or 0) < min(SLOW_REPS, asked_reps) else ""


def render_markdown(doc: dict) -> str:
    """The results table with a header saying what was measured where, and a note per failed case."""
    meta = doc.get("meta", {})
    imports = meta.get("imports", {})
    peers = ", ".join(
        f"{name} {st.get('version')}" if st.get("ok") else f"{name}: not importable"
        for name, st in imports.items() if name != "hugehead"
    )
    headline = render_headline(doc)
    if harness.is_smoke(meta):  # the header already says it
        headline = headline.replace(harness.SMOKE_NOTE + "\n\n", "", 1)
    lines = [
        harness.header(f"Linear cross-entropy benchmark: {_machine(meta)} ({meta.get('dtype', 'bfloat16')})",
                       {k: v for k, v in meta.items() if k != "elapsed_s"}).rstrip("\n"),
        f"triton {meta.get('triton')} · {peers}",
        "",
        headline,
        "## All implementations",
        "",
        meta.get("method", ""),
        "",
        "| shape | N×D×V | impl | fwd+bwd ms | fwd ms | peak extra GiB | TFLOP/s | loss rel err | dx rel err "
        "| dW rel err | speedup vs torch |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    by_key = {(r["shape"], r["impl"]): r for r in doc["rows"]}
    notes, slow, plans, compiles, warned, crowded = [], set(), [], [], [], []
    asked = int(meta.get("reps") or SLOW_REPS)
    for shape in _shape_order(doc):
        torch_row = by_key.get((shape, "torch"))
        torch_ms = _num(torch_row, "fwd_bwd_ms") if torch_row and torch_row.get("fwd_bwd_status") == "ok" else None
        for impl in _impl_order(doc):
            r = by_key.get((shape, impl))
            if r is None:
                continue
            dims = f"{r['n']}×{r['d']}×{r['v']}"
            dtype = _dtype(doc, r)
            fb_ok = r.get("fwd_bwd_status") == "ok"
            fw_ok = r.get("fwd_status") == "ok"
            if fb_ok:
                mark = _mark(r, "fwd_bwd", asked)
                slow.add(mark)
                fb = f"{_num(r, 'fwd_bwd_ms'):.2f}{mark}"
            else:
                fb = _status_word(r.get("fwd_bwd_status") or r.get("status"))
            if fw_ok:
                mark = _mark(r, "fwd", asked)
                slow.add(mark)
                fw = f"{_num(r, 'fwd_ms'):.2f}{mark}"
            elif r.get("fwd_status"):
                fw = _status_word(r.get("fwd_status"))
            else:  # never reached: the case was skipped, or stopped earlier
                fw = _status_word(r.get("status")) if r.get("status") in ("skipped", "import-error") else "not run"
            mem = _num(r, "fwd_bwd_peak_extra_gib") if fb_ok else None
            tflops = _num(r, "tflops") if fb_ok else None
            if r.get("loss_rel_err") is not None:
                loss_err = _err(_num(r, "loss_rel_err"), dtype)
            elif r.get("fwd_loss_rel_err") is not None:
                loss_err = _err(_num(r, "fwd_loss_rel_err"), dtype) + " (fwd)"
            else:
                loss_err = "-"
            if impl == "torch":
                speedup = "1.00×" if torch_ms else "-"
            elif fb_ok and torch_ms:
                speedup = f"{torch_ms / _num(r, 'fwd_bwd_ms'):.2f}×"
            elif fb_ok and torch_row is not None:
                speedup = f"torch {_status_word(torch_row.get('fwd_bwd_status') or torch_row.get('status'))}"
            else:
                speedup = "-"
            lines.append(
                f"| {shape} | {dims} | {impl} | {fb} | {fw} | {'-' if mem is None else f'{mem:.2f}'} | "
                f"{'-' if tflops is None else f'{tflops:.3g}'} | {loss_err} | {_err(_num(r, 'grad_x_rel_err'), dtype)} | "
                f"{_err(_num(r, 'grad_w_rel_err'), dtype)} | {speedup} |"
            )
            if r.get("plan") or r.get("plan_error"):
                what = ", ".join(f"{k}={v}" for k, v in r["plan"].items()) if r.get("plan") else r["plan_error"]
                if r.get("gemm"):  # the forward's logits GEMM (HUGEHEAD_GEMM): cutlass (fused) or cublas
                    what += f", gemm={r['gemm']}"
                plans.append(f"- {shape} / {impl}: {what}")
            if r.get("fwd_bwd_compile_ms") is not None or r.get("fwd_compile_ms") is not None:
                cb, cf = _num(r, "fwd_bwd_compile_ms"), _num(r, "fwd_compile_ms")
                compiles.append(f"- {shape} / {impl}: fwd+bwd {'-' if cb is None else f'{cb / 1e3:.1f} s'}, "
                                f"fwd {'-' if cf is None else f'{cf / 1e3:.1f} s'}")
            for w in r.get("warnings") or []:
                warned.append(f"- {shape} / {impl}: {w}")
            others = [_num(r, "fwd_bwd_foreign_cpu"), _num(r, "fwd_foreign_cpu")]
            if any(o is not None and o > CROWDED for o in others):
                crowded.append(f"- {shape} / {impl}: " + " / ".join("-" if o is None else f"{100 * o:.0f}%" for o in others))
            if r.get("status") != "ok" and r.get("status") != "skipped" or r.get("ref_error"):
                err = r.get("error") or r.get("ref_error") or ""
                notes.append(f"- **{shape} / {impl}**: {r.get('status')}: {err}")
            elif r.get("status") == "skipped" and not harness.is_smoke(meta):
                notes.append(f"- **{shape} / {impl}**: {r.get('error')}")
    lines += ["", f"Relative errors above {suspect_limit(meta.get('dtype')):g} (far beyond {meta.get('dtype', 'bfloat16')} "
                  "rounding) are in bold."]
    if plans:
        lines += ["", "Chunking each planner chose (hugehead: `hugehead.lce_op.loss_plan` with the defaults, its `kind` "
                      "rows / kept / recompute; hugehead_eqmem: the same with its `memory_budget`; "
                      "torch_lce: the options `LinearCrossEntropyOptions()` resolves to; torch_chunked: its chunk width):",
                  *plans]
    if compiles:
        lines += ["", "torch.compile: compilation + first call, excluded from the times above:", *compiles]
    if warned:
        lines += ["", "Warnings raised during the timed steps:", *warned]
    if crowded:
        lines += ["", f"Other processes used more than {100 * CROWDED:.0f}% of the CPUs during these timed steps "
                      "(fwd+bwd / fwd; those times are pessimistic):", *crowded]
    if "‡" in slow:
        lines += ["", "‡ one call only: the first call alone took longer than the case budget, so it is the "
                      "measurement (not repeated, no separate warm-up)."]
    if "†" in slow:
        lines += ["", f"† fewer than {min(SLOW_REPS, asked)} timed repetitions (one step takes too long for the case budget); "
                      "see `*_reps` and `*_ms_all` in lce.json."]
    selfcheck = meta.get("reference_selfcheck")
    if selfcheck:
        state = "ok" if meta.get("reference_selfcheck_ok") else "**FAILED**"
        lines += ["", "Reference self-check against float64 autograd (CPU): "
                      + ", ".join(f"{k} {_sci(as_float(v))}" for k, v in selfcheck.items()) + f": {state}."]
    if notes:
        lines += ["", "Failures and skips:", *notes]
    if meta.get("merged_from"):
        lines += ["", "Merged from these runs (later ones replace earlier rows):",
                  *[f"- `{m.get('command')}` · git {str(m.get('git_sha'))[:12]} · {m.get('created_utc')}"
                    + (f" · nice {m['niceness']}" if m.get("niceness") else "")
                    for m in meta["merged_from"]]]
    elif meta.get("command"):
        lines += ["", f"Command: `{meta['command']}` · {meta.get('elapsed_s', '?')} s"]
    if meta.get("parts"):
        lines += ["", f"Run in {len(meta['parts'])} parts (resumed with --resume): " + ", ".join(
            f"part {k} {p.get('created_utc')} {p.get('elapsed_s', '?')} s on {p.get('hostname')}"
            for k, p in enumerate(meta["parts"], 1)) + "."]
    return "\n".join(lines) + "\n"


def render_png(doc: dict, path: Path) -> None:
    """Grouped bars per shape: fwd+bwd ms (log) and, where measured, peak extra GiB (log); a case that
    did not run is labelled with its status instead of a bar."""
    shapes, impls = _shape_order(doc), _impl_order(doc)
    by_key = {(r["shape"], r["impl"]): r for r in doc["rows"]}
    missing = {(impl, shape): _status_word(r.get("fwd_bwd_status") or r.get("status"))
               for (shape, impl), r in by_key.items() if r.get("fwd_bwd_status") != "ok"}

    def series(key: str) -> Dict[str, List[Optional[float]]]:
        return {impl: [_num(by_key[(s, impl)], key) if (s, impl) in by_key and
                       by_key[(s, impl)].get("fwd_bwd_status") == "ok" else None for s in shapes] for impl in impls}

    panels = [harness.Panel("forward + backward (ms, log)", series("fwd_bwd_ms"), missing)]
    if any(_num(r, "fwd_bwd_peak_extra_gib") is not None for r in doc["rows"]):
        panels.append(harness.Panel("peak extra memory (GiB, log)", series("fwd_bwd_peak_extra_gib"), missing))
    meta = doc.get("meta", {})
    sha = "mixed SHAs" if _short_sha(meta).startswith("mixed") else _short_sha(meta)[:8]
    harness.bar_chart(path, shapes, panels, f"linear cross-entropy, {meta.get('dtype', 'bf16')}, exact gradients: "
                      f"{_machine(meta)} (git {sha})", smoke=harness.is_smoke(meta))


def write_reports(doc: dict, out_dir: Path, record=False) -> None:
    """Write lce.json, lce.md and lce.png into ``out_dir``; a plotting failure is noted in the JSON.
    ``record``: as :func:`bench.harness.write_report`'s (append the rows to history.csv)."""
    harness.write_report(out_dir, "lce", doc, render_markdown,
                         plot=(lambda path: render_png(doc, path)) if doc["rows"] else None, record=record)


def plot_history(csv_path: Path, study: str, shape: str, out: Path, gpu: Optional[str] = None) -> int:
    """Plot ``median_ms`` of every implementation of ``study`` at ``shape`` over the recorded runs of
    ``csv_path`` (history.csv), one line per implementation, in the order they were recorded; on
    ``gpu`` only when given. Returns how many points were drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench import history

    rows = [r for r in history.read(csv_path) if r["study"] == study and r["shape"] == shape
            and (gpu is None or r["gpu"] == gpu)]
    runs: List[str] = []
    for r in rows:
        run = f"{r['date'][:10]} {r['sha'][:7]}"
        if run not in runs:
            runs.append(run)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(runs) + 3), 4))
    for impl in _ordered([r["impl"] for r in rows], []):
        points = [(runs.index(f"{r['date'][:10]} {r['sha'][:7]}"), float(r["median_ms"])) for r in rows if r["impl"] == impl]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
    ax.set_xticks(range(len(runs)), runs, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("median ms")
    ax.set_title(f"{study}, {shape}" + (f", {gpu}" if gpu else ""))
    if rows:
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return len(rows)


def merge(docs: List[dict]) -> dict:
    """One document from several runs: rows keyed by (shape, impl), later runs replacing earlier ones
    (except by a skipped row);
    the meta of the last run, with every run's git SHA, GPU and time listed under "merged_from"."""
    rows: Dict[tuple, dict] = {}
    for d in docs:
        for r in d["rows"]:
            key = (r["shape"], r["impl"])
            if r.get("status") == "skipped" and key in rows and rows[key].get("status") != "skipped":
                continue  # a run that skipped a case does not erase an earlier measurement of it
            rows.pop(key, None)
            rows[key] = r
    meta = dict(docs[-1].get("meta", {}))
    meta["merged_from"] = [
        {k: d.get("meta", {}).get(k) for k in ("git_sha", "gpu_name", "created_utc", "command", "niceness")} for d in docs
    ]
    shas = {d.get("meta", {}).get("git_sha") for d in docs}
    if len(shas) > 1:
        meta["git_sha"] = "mixed: " + ", ".join(sorted(str(s)[:12] for s in shas))
    return {"meta": meta, "rows": list(rows.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="*", help="lce.json files (several: merged in order)")
    p.add_argument("--history", metavar="CSV", help="plot history.csv instead: --study, --shape, --png (and --gpu)")
    p.add_argument("--study", default="lce")
    p.add_argument("--shape")
    p.add_argument("--gpu")
    p.add_argument("--png", help="where --history writes its plot")
    p.add_argument("--out", help="folder for the merged lce.json/md/png (default: beside the single input)")
    p.add_argument("--headline", action="store_true", help="print the headline table only (nothing written)")
    opts = p.parse_args(argv)
    if opts.history:
        if not (opts.shape and opts.png):
            p.error("--history needs --shape and --png")
        drawn = plot_history(Path(opts.history), opts.study, opts.shape, Path(opts.png), opts.gpu)
        print(f"{drawn} points of {opts.study} at {opts.shape} -> {opts.png}")
        return 0 if drawn else 1
    if not opts.json:
        p.error("give lce.json files, or --history")
    docs = [json.loads(Path(f).read_text()) for f in opts.json]
    if opts.headline:
        print(render_headline(merge(docs) if len(docs) > 1 else docs[0]), end="")
        return 0
    if len(docs) > 1 and not opts.out:
        p.error("merging several files needs --out")
    out = Path(opts.out) if opts.out else Path(opts.json[0]).parent
    doc = merge(docs) if len(docs) > 1 else docs[0]
    write_reports(doc, out)
    print(render_markdown(doc))
    if doc["meta"].get("png_error"):
        print(f"(no plot: {doc['meta']['png_error']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
