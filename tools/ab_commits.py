"""hugehead at an older commit against this tree's installed build, in one device call, the runs taking turns.

A step's time moves by a few percent between GPUs of one kind and between runs on one machine, so only two
commits measured on one machine, in alternating runs, tell a code change apart from the machine's. This does that.

    here:    git archive --format=tar -o .hh/old.tar OLD_COMMIT  # the commit id rides in the tar's pax header
    device:  python3 -m tools.ab_commits --old-tar .hh/old.tar --out $OUT/ab [--shapes llama3_4k,gemma2] [--rounds 2]
             (after this tree's hugehead is installed)

The old tree is unpacked into a scratch folder and built in place (its own ``setup.py build_ext --inplace``, CUDA
and CUTLASS on). Each round then runs ``python3 -m bench.bench_lce --peers hugehead,torch_compile --shapes ...``
once from the old tree (its own bench/, importing its own hugehead) and once from this tree (the installed
hugehead), the first tree alternating round by round (old, new, new, old, ...). torch.compile runs in every process
as the board's control. ``OUT/ab.{json,md}`` give each run's medians and, per shape, each tree's mean over its runs,
new / old, and each tree's hugehead / torch.compile.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path
from statistics import mean
from typing import Dict, List, Optional

from bench import child, harness
from bench.common import REPO_ROOT

PEERS = "hugehead,torch_compile"


def tar_commit(tar_path: Path) -> Optional[str]:
    """The commit id ``git archive`` writes into the tar's pax global header (None if absent)."""
    with tarfile.open(tar_path) as tar:
        return tar.pax_headers.get("comment")


def run_logged(cmd: List[str], cwd: Path, env: Dict[str, str], log: Path, timeout: float) -> int:
    """Run ``cmd`` in ``cwd`` (bench/child.py's runner: its own process group, stopped with whatever it started
    there on timeout), output into ``log``; the exit status, 124 on timeout."""
    rc, timed_out, _ = child.run_logged(cmd, log, timeout, cwd=cwd, env=env)
    return 124 if timed_out else rc


def build_old(tar_path: Path, dest: Path, log: Path, timeout: float) -> int:
    """Unpack the old tree into ``dest`` (emptied first) and build its extension in place."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    # CUTLASS ON: a commit with the fused GEMMs fails to build without their headers instead of falling back to
    # cuBLAS unnoticed (older trees ignore the variable).
    env = dict(os.environ, HUGEHEAD_CUDA=os.environ.get("HUGEHEAD_CUDA", "ON"),
               HUGEHEAD_CUTLASS=os.environ.get("HUGEHEAD_CUTLASS", "ON"))
    return run_logged([sys.executable, "setup.py", "build_ext", "--inplace"], dest, env, log, timeout)


def orders(rounds: int) -> List[List[str]]:
    """The trees' order in each round: old first in the odd rounds, new first in the even ones."""
    return [["old", "new"] if r % 2 == 0 else ["new", "old"] for r in range(rounds)]


def imported_from_its_tree(tree: str, hugehead_file: Optional[str], scratch: Path) -> bool:
    """Whether a run's hugehead came from its own tree: the old run's from the scratch folder, the new run's not."""
    if not hugehead_file:
        return False
    inside = Path(hugehead_file).resolve().is_relative_to(scratch.resolve())
    return inside if tree == "old" else not inside


def bench_cmd(shapes: str, out: Path, extra: List[str]) -> List[str]:
    return [sys.executable, "-m", "bench.bench_lce", "--peers", PEERS, "--shapes", shapes, "--out", str(out),
            "--work", str(out / "work"), *extra]


def summarize(runs: List[dict]) -> dict:
    """Per run (label, tree, lce.json's rows) the fwd+bwd and fwd medians; per shape each tree's mean over runs.

    ``runs``: ``[{"label": "old1", "tree": "old", "sha": ..., "rows": [lce.json rows]}, ...]``. A run or case
    that did not give a number is listed with None and left out of the means.
    """
    table = []
    for run in runs:
        for row in run["rows"]:
            table.append({"label": run["label"], "tree": run["tree"], "sha": run.get("sha"), "shape": row["shape"],
                          "impl": row["impl"], "fwd_bwd_ms": row.get("fwd_bwd_ms"), "fwd_ms": row.get("fwd_ms")})
    shapes = list(dict.fromkeys(r["shape"] for r in table))
    per_shape = {}
    for shape in shapes:
        cell = {}
        for tree in ("old", "new"):
            for impl in PEERS.split(","):
                vals = [r["fwd_bwd_ms"] for r in table
                        if r["shape"] == shape and r["tree"] == tree and r["impl"] == impl and _number(r["fwd_bwd_ms"])]
                cell[f"{tree}_{impl}"] = mean(vals) if vals else None
                cell[f"{tree}_{impl}_runs"] = len(vals)
        def ratio(a, b):
            return cell[a] / cell[b] if cell[a] and cell[b] else None
        cell["new_over_old"] = ratio("new_hugehead", "old_hugehead")
        cell["old_over_compile"] = ratio("old_hugehead", "old_torch_compile")
        cell["new_over_compile"] = ratio("new_hugehead", "new_torch_compile")
        per_shape[shape] = cell
    return {"runs": table, "per_shape": per_shape}


def _number(v) -> bool:
    """A measured time: a positive finite number (lce.json writes a failed or non-finite one as None or a string)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


def _ms(v) -> str:
    return f"{v:.2f}" if _number(v) else "-"


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# hugehead at {meta['old_sha'][:12]} (old) against {meta['new_sha'][:12]} (new), one device call",
             "", f"{meta.get('gpu', '?')} · {meta['created_utc']} · `python3 -m tools.ab_commits` "
             f"({meta['rounds']} rounds, the first tree alternating; each run one `bench_lce --peers {PEERS}` process)",
             "", "| run | tree | git | shape | impl | fwd+bwd ms | fwd ms |", "|---|---|---|---|---|--:|--:|"]
    for r in summary["runs"]:
        lines.append(f"| {r['label']} | {r['tree']} | `{(r['sha'] or '?')[:12]}` | {r['shape']} | {r['impl']} | "
                     f"{_ms(r['fwd_bwd_ms'])} | {_ms(r['fwd_ms'])} |")
    lines += ["", "Per shape, fwd+bwd ms, the mean over each tree's runs:", "",
              "| shape | old hugehead | new hugehead | new / old | old torch.compile | new torch.compile | "
              "old / its torch.compile | new / its torch.compile |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for shape, c in summary["per_shape"].items():
        lines.append(f"| {shape} | {_ms(c['old_hugehead'])} | {_ms(c['new_hugehead'])} | {_x(c['new_over_old'])} | "
                     f"{_ms(c['old_torch_compile'])} | {_ms(c['new_torch_compile'])} | {_x(c['old_over_compile'])} | "
                     f"{_x(c['new_over_compile'])} |")
    lines += ["", "new / old below 1.02: the new code is within 2% of the old on this board. torch.compile is the same "
              "code in both trees' processes; its spread between runs is the board's."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-tar", required=True, type=Path, help="git archive of the old commit (tar)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--shapes", default="llama3_4k,gemma2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scratch", type=Path, default=Path("/tmp/hugehead-ab-old"), help="where the old tree is built")
    p.add_argument("--build-timeout", type=float, default=300.0)
    p.add_argument("--run-timeout", type=float, default=240.0)
    p.add_argument("--bench-arg", action="append", default=[], help="more bench_lce arguments (e.g. --cpu-smoke)")
    p.add_argument("--no-build", action="store_true", help="the scratch tree is already unpacked and built")
    p.add_argument("--new-tree", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)  # tests: a stand-in tree
    opts = p.parse_args(argv)

    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    old_sha = tar_commit(opts.old_tar) or "unknown"
    new_sha = os.environ.get("HUGEHEAD_GIT_SHA") or "unknown"
    t0 = time.time()
    if not opts.no_build:
        rc = build_old(opts.old_tar, opts.scratch, out / "build_old.log", opts.build_timeout)
        print(f"ab_commits: built {old_sha[:12]} in {opts.scratch} (rc {rc}, {time.time() - t0:.0f} s)", flush=True)
        if rc != 0:
            print(f"ab_commits: the old tree's build failed; see {out / 'build_old.log'}", file=sys.stderr)
            return 1
    # The old tree's bench must import the old tree's hugehead (built in place), whatever the caller's environment
    # says (run it with HUGEHEAD_BENCH_IMPORT=installed).
    trees = {"old": (opts.scratch, old_sha, {"HUGEHEAD_BENCH_IMPORT": "tree"}),
             "new": (opts.new_tree, new_sha, {"HUGEHEAD_BENCH_IMPORT": "installed"})}
    runs = []
    for r, order in enumerate(orders(opts.rounds), start=1):
        for tree in order:
            cwd, sha, extra_env = trees[tree]
            label = f"{tree}{r}"
            env = dict(os.environ, HUGEHEAD_GIT_SHA=sha, **extra_env)
            rc = run_logged(bench_cmd(opts.shapes, out / label, opts.bench_arg), cwd, env, out / f"{label}.log",
                            opts.run_timeout)
            lce_path = out / label / "lce.json"
            lce = json.loads(lce_path.read_text()) if lce_path.exists() else {"meta": {}, "rows": []}
            runs.append({"label": label, "tree": tree, "sha": sha, "rc": rc, "rows": lce["rows"],
                         "hugehead_file": lce["meta"].get("hugehead_file"), "gpu": lce["meta"].get("gpu_name")})
            print(f"ab_commits: {label} rc {rc}, {len(lce['rows'])} rows, hugehead from {runs[-1]['hugehead_file']}",
                  flush=True)
            if not imported_from_its_tree(tree, runs[-1]["hugehead_file"], opts.scratch):
                runs[-1]["rc"] = runs[-1]["rc"] or 3
                print(f"ab_commits: {label} imported hugehead from {runs[-1]['hugehead_file']}, not from the {tree} "
                      f"tree (old: {opts.scratch})", file=sys.stderr, flush=True)
    summary = summarize(runs)
    gpu = next((run["gpu"] for run in runs if run["gpu"]), None)
    meta = {"old_sha": old_sha, "new_sha": new_sha, "rounds": opts.rounds, "shapes": opts.shapes, "gpu": gpu,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "elapsed_s": round(time.time() - t0, 1),
            "imports": {run["label"]: run["hugehead_file"] for run in runs}, "rcs": {run["label"]: run["rc"] for run in runs}}
    md = markdown(summary, meta)
    harness.write_report(out, "ab", {"meta": meta, **summary}, md)
    print(md)
    return 0 if all(run["rc"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
