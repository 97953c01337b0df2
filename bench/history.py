"""bench/results/history.csv: one row per measured (study, shape, implementation), appended by a
benchmark run only when it is asked to (``--record``), and read back by ``bench/report.py --history``.

The canonical ``bench/results/<gpu>/<study>.json`` files are overwritten by each run; this file keeps
every recorded number with the commit it was measured at, so a claim made from an older run can always
name its commit. Each study's results document has its own layout: ``rows_of`` turns one into the
flat rows, one small extractor per study.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
HISTORY = REPO_ROOT / "bench" / "results" / "history.csv"
COLUMNS = ("sha", "date", "gpu", "torch", "study", "shape", "impl", "median_ms", "peak_gib")
GIB = float(1 << 30)


def _facts(doc: Mapping[str, object]) -> Dict[str, object]:
    """sha / date / gpu / torch of a results document: newer ones keep them in ``meta``, older
    ones in ``git`` / ``env`` / ``date``."""
    meta = doc.get("meta") or {}
    git = doc.get("git") or {}
    env = doc.get("env") or {}
    sha = meta.get("git_sha") or git.get("git_sha") or "unknown"
    gpu = meta.get("gpu_name") or env.get("gpu_name") or ("cpu" if (meta.get("device") or env.get("device")) == "cpu" else None)
    return {"sha": str(sha)[:12], "date": meta.get("created_utc") or doc.get("date") or "",
            "gpu": gpu or meta.get("machine") or "cpu", "torch": meta.get("torch") or env.get("torch") or ""}


def _shape(row: Mapping[str, object]) -> str:
    if row.get("shape"):
        return str(row["shape"])
    dims = [row.get(k) for k in ("n", "d", "v")]
    return "x".join(str(x) for x in dims) if all(dims) else ""


def _num(value) -> Optional[float]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value else None


def _lce(doc):
    for r in doc.get("rows", []):
        if r.get("status") != "ok":
            continue
        yield _shape(r), r["impl"], r.get("fwd_bwd_ms"), r.get("fwd_bwd_peak_extra_gib")
        yield _shape(r), f"{r['impl']} fwd", r.get("fwd_ms"), r.get("fwd_peak_extra_gib")


def _topk(doc):
    seen = set()
    for r in doc.get("rows", []):
        yield _shape(r), f"topk k={r['k']}", r.get("topk_ms"), r.get("topk_peak_extra_gib")
        if r.get("torch_topk_ms") is not None:
            yield _shape(r), f"torch.topk k={r['k']}", r.get("torch_topk_ms"), None
        if r.get("fwd_ms") is not None and _shape(r) not in seen:
            seen.add(_shape(r))
            yield _shape(r), "loss fwd", r["fwd_ms"], None


def _multilabel(doc):
    for r in doc.get("rows", []):
        for part in ("single", "multi", "ova", "multi_no_rows"):
            if r.get(f"{part}_ms") is not None:
                yield _shape(r), part, r[f"{part}_ms"], r.get(f"{part}_peak_extra_gib")


def _amp(doc):
    fb = doc.get("fwd_bwd") or {}
    for name in ("bf16_head", "fp32_head_autocast"):
        if isinstance(fb.get(name), dict) and fb[name].get("status") == "ok":
            yield _shape(fb), name, fb[name].get("ms"), fb[name].get("extra_beyond_inputs_and_grads_gib")
    for i, step in enumerate(doc.get("train_step") or []):
        if step.get("status") == "ok":
            yield _shape(step), f"train step {step.get('optimizer')} x on {step.get('x_device')} #{i}", step.get("ms"), None


def _offload(doc):
    for r in doc.get("rows", []):
        if r.get("status") == "ok":
            peak = r.get("gpu_peak_bytes")
            yield _shape(r), f"{r['impl']} {r.get('variant', '')}".strip(), r.get("fwd_bwd_ms"), peak / GIB if peak else None


def _checkpoint(doc):
    for r in doc.get("rows", []):
        threads = f"io_threads={r.get('io_threads')}"
        yield f"{doc.get('classes', '')} classes", f"save {threads}", (r.get("save_s") or 0) * 1e3, None
        yield f"{doc.get('classes', '')} classes", f"load {threads}", (r.get("load_s") or 0) * 1e3, None


def _transformers(doc):
    for model in ("llama", "bert_6m"):
        for r in doc.get(model) or []:
            if r.get("status") == "ok":
                yield model, r["impl"], r.get("step_ms"), r.get("peak_extra_gib")


def _placement(doc):
    for r in doc.get("scaling") or []:
        yield _shape(r), "devices " + "+".join(r["devices"]), r.get("fwd_bwd_ms"), None
    huge = doc.get("huge") or {}
    if huge.get("step_ms") is not None:
        yield _shape(huge), "train step devices " + "+".join(huge.get("devices", [])), huge["step_ms"], None


def _dist(doc):
    for r in doc.get("records") or []:
        yield _shape(r), r.get("name", f"{r.get('world_size')} ranks"), r.get("fwd_bwd_ms"), r.get("peak_gib")


def _split(doc):
    """tools/split_lce.py: the step (default, no overlap, 256 MiB) and each stage's share of it."""
    for r in doc.get("results") or []:
        for name in ("step", "step_no_overlap", "step_256mib"):
            if isinstance(r.get(name), dict):
                yield _shape(r), name, r[name].get("ms"), r[name].get("peak_extra_gib")
        for stage, t in (r.get("stages") or {}).items():
            yield _shape(r), f"stage: {stage}", t.get("ms"), None


def _timed_runs(doc):
    """resume, training: a list of named operations, each with its seconds (and, in a summary of
    several runs, its own commit)."""
    shape = doc.get("shape") or _shape(doc.get("config") or {})
    for r in doc.get("runs") or []:
        if r.get("seconds") is not None:
            impl = " ".join(str(r[k]) for k in ("name", "op") if r.get(k))
            yield (r.get("shape") or shape, impl, r["seconds"] * 1e3, r.get("host_peak_gib", r.get("peak_gib")),
                   r.get("sha"))


def _posttrain(doc):
    for r in doc.get("rows", []):
        yield _shape(r), f"{r['study']} {r['impl']}", r.get("ms"), r.get("peak_gib")
        if r["impl"] == "hugehead":
            yield _shape(r), f"{r['study']} ce step", r.get("ce_ms"), None


EXTRACTORS: Dict[str, Callable[[Mapping[str, object]], Iterable[tuple]]] = {
    "lce": _lce, "topk": _topk, "multilabel": _multilabel, "amp": _amp, "offload": _offload,
    "checkpoint": _checkpoint, "transformers": _transformers, "placement": _placement, "dist": _dist,
    "resume": _timed_runs, "training": _timed_runs, "split": _split, "posttrain": _posttrain,
}


def rows_of(study: str, doc: Mapping[str, object]) -> List[Dict[str, object]]:
    """The history rows of one results document (``study`` is its file stem); [] for a study
    without an extractor. A row without a time is left out."""
    extract = EXTRACTORS.get(study)
    if extract is None:
        return []
    facts = _facts(doc)
    rows = []
    for shape, impl, ms, peak, *sha in extract(doc):
        ms = _num(ms)
        if ms is None:
            continue
        peak = _num(peak)
        own = {"sha": str(sha[0])[:12]} if sha and sha[0] else {}
        rows.append({**facts, **own, "study": study, "shape": shape, "impl": impl, "median_ms": f"{ms:.3f}",
                     "peak_gib": "" if peak is None else f"{peak:.2f}"})
    return rows


def append(rows: Iterable[Mapping[str, object]], path: Path = HISTORY) -> int:
    """Append ``rows`` to the CSV at ``path`` (its header written when the file is new). Returns
    how many were written."""
    rows = list(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def read(path: Path = HISTORY) -> List[Dict[str, str]]:
    with Path(path).open(newline="") as fh:
        return list(csv.DictReader(fh))
