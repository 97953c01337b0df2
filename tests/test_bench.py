"""The benchmark harness (timing logic with a scripted clock, the writer), the placement benchmark's
pipeline on CPU shards, bench_lce's peers, cases, parent and report. No test here asserts a time: the
timing logic is checked against a fake clock, the pipelines for what they compute and write."""
import hashlib
import json
import sys
from pathlib import Path

import pytest

# `bench` is the repository's folder, not a package on the path under `python -P -m pytest` (the GPU
# machine's run, which must import the installed hugehead, not the source tree).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("matplotlib")
import torch  # noqa: E402

from bench import bench_placement, harness  # noqa: E402


# --------------------------------------------------------------------------------------------------
# bench/harness.py
# --------------------------------------------------------------------------------------------------
def _scripted_clock(monkeypatch, times):
    """harness.time_call_ms returns the given milliseconds in turn (and still calls the step)."""
    it = iter(times)

    def fake(fn, devices=None, clock="events"):
        return next(it), fn()

    monkeypatch.setattr(harness, "time_call_ms", fake)


def test_measure_medians_after_warmup(monkeypatch):
    calls = []
    _scripted_clock(monkeypatch, [50.0, 3.0, 1.0, 2.0, 9.0])
    t = harness.measure(lambda: calls.append(1) or len(calls), "cpu", reps=4, warmup=1)
    assert t.warmup_ms == [50.0] and t.ms_all == [3.0, 1.0, 2.0, 9.0] and t.reps == 4
    assert t.ms == 2.5 and t.ms_min == 1.0 and not t.first_call_only
    assert t.result == 5 and len(calls) == 5  # the last call's result; warm-up calls ran too
    assert t.peak_bytes is None and t.peak_extra_bytes is None  # not measured on the CPU
    fields = t.fields("fwd_bwd")
    assert fields["fwd_bwd_ms"] == 2.5 and fields["fwd_bwd_reps"] == 4 and "fwd_bwd_result" not in fields


def test_measure_budget_limits_repetitions_and_first_call_only(monkeypatch):
    _scripted_clock(monkeypatch, [400.0, 410.0, 390.0, 420.0])
    t = harness.measure(lambda: None, "cpu", reps=10, warmup=1, budget_s=1.0)  # 1000 ms // 400 ms = 2 reps
    assert t.reps == 2 and t.ms_all == [410.0, 390.0] and t.ms == 400.0
    _scripted_clock(monkeypatch, [6000.0])  # > slow_warmup_ms: the warm-up stops after one call
    t = harness.measure(lambda: None, "cpu", reps=10, warmup=2, budget_s=1.0)  # slower than the budget
    assert t.first_call_only and t.reps == 0 and t.ms_all == [6000.0]


def test_measure_before_runs_outside_and_reduce_replaces_times(monkeypatch):
    order = []
    _scripted_clock(monkeypatch, [1.0, 2.0, 4.0])
    t = harness.measure(lambda: order.append("step"), "cpu", reps=2, warmup=1, before=lambda: order.append("before"),
                        reduce=lambda times: [10 * v for v in times])
    assert order == ["before", "step"] * 3 and t.ms_all == [20.0, 40.0] and t.ms == 30.0
    _scripted_clock(monkeypatch, [1.0, 0.0])
    with pytest.raises(RuntimeError, match="non-positive step time"):
        harness.measure(lambda: None, "cpu", reps=1, warmup=1)
    with pytest.raises(ValueError, match="reps >= 1"):
        harness.measure(lambda: None, "cpu", reps=0)


def test_measure_on_the_cpu_really_calls_the_step():
    box = []
    t = harness.measure(lambda: box.append(len(box)), "cpu", reps=3, warmup=2)
    assert box == [0, 1, 2, 3, 4] and t.reps == 3 and len(t.ms_all) == 3 and t.clock == "host"
    assert all(v > 0 for v in t.ms_all) and t.ms in t.ms_all


def test_write_report_json_markdown_plot_and_smoke_note(tmp_path):
    meta = harness.run_meta("unit", "cpu", options={"reps": 3}, shapes={"tiny": {"n": 2}}, smoke=True,
                            command="python -m bench.unit")
    assert meta["git_sha"] and meta["torch"] == torch.__version__ and meta["options"] == {"reps": 3}
    md = harness.header("Unit", meta) + harness.md_table(["shape", "ms"], [["tiny", harness.fmt(1.234)],
                                                                            ["a|b", harness.fmt(None)]])
    assert harness.SMOKE_NOTE in md and "| tiny | 1.23 |" in md and "| a\\|b | - |" in md
    doc = {"meta": meta, "rows": [{"ms": float("nan"), "dtype": torch.float32}]}
    written = harness.write_report(tmp_path, "unit", doc, md, plot=lambda path: harness.bar_chart(
        path, ["tiny", "big"], harness.Panel("ms", {"a": [1.0, None], "b": [2.0, 3.0]}, {("a", "big"): "OOM"}),
        "unit", smoke=True))
    assert sorted(written) == ["json", "md", "png"] and (tmp_path / "unit.png").stat().st_size > 0
    back = json.loads((tmp_path / "unit.json").read_text())
    assert back["rows"] == [{"ms": "nan", "dtype": "torch.float32"}] and back["meta"]["smoke"] is True
    assert (tmp_path / "unit.md").read_text() == md
    # a plot that fails leaves the JSON and the table, and says why
    harness.write_report(tmp_path, "noplot", doc, md, plot=lambda path: 1 / 0)
    assert "ZeroDivisionError" in json.loads((tmp_path / "noplot.json").read_text())["meta"]["png_error"]
    assert harness.SMOKE_NOTE not in harness.header("Unit", {**meta, "smoke": False})
    with pytest.raises(ValueError, match="3 cells for 2 columns"):
        harness.md_table(["a", "b"], [[1, 2, 3]])


def test_posttrain_benchmark_cpu_smoke(tmp_path):
    from bench import bench_posttrain, history

    assert bench_posttrain.main(["--cpu-smoke", "--reps", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "posttrain.json").read_text())
    ours = [r for r in doc["rows"] if r["impl"] == "hugehead"]
    assert {r["study"] for r in ours} == {"logprob_entropy", "forward_kl", "reverse_kl", "jsd"}
    assert all(r["ms"] > 0 and r["ce_ms"] > 0 and r["ratio"] == r["ms"] / r["ce_ms"] for r in ours)
    assert all(r.get("skipped") for r in doc["rows"] if r["impl"] != "hugehead")  # peers: GPU only, said so
    assert len(history.rows_of("posttrain", doc)) == 8


@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
def test_placement_benchmark_cpu_smoke(tmp_path):
    assert bench_placement.main(["--cpu-smoke", "--repeats", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "placement.json").read_text())
    assert [r["shape"] for r in doc["scaling"]] == ["tiny", "tiny", "tiny_2n", "tiny_2n"]
    one, two = doc["scaling"][:2]
    assert one["devices"] == ["cpu"] and two["devices"] == ["cpu", "cpu"]
    assert two["top5_same_as_first"] and doc["scaling"][3]["top5_same_as_first"]
    # Same seed, same logical weight in every placement: the sharded head computes the same loss.
    assert two["loss_rel_diff_vs_first"] < 1e-6
    assert two["grad_x_norm_rel_diff_vs_first"] < 1e-5 and two["grad_w_norm_rel_diff_vs_first"] < 1e-5
    assert len(doc["huge"]["losses"]) >= 2 and all(l == l for l in doc["huge"]["losses"])
    assert (tmp_path / "placement.md").read_text().startswith("# ChunkedClassifier placements")
    assert harness.SMOKE_NOTE in (tmp_path / "placement.md").read_text()
    assert (tmp_path / "placement.png").stat().st_size > 0


def test_sanitizer_harness_covers_every_kernel_op_and_checks_them_on_cpu(capsys):
    """bench/sanitize_case.py (what compute-sanitizer runs on the GPU) has cases for every kernel op the
    dispatcher holds, and its float64 checks pass on the CPU kernels."""
    from tools import sanitize_case

    ops = sanitize_case.kernel_ops()
    assert {"chunk_stats_", "chunk_grad_"} <= set(ops) and not {"linear_cross_entropy_forward"} & set(ops)
    assert sanitize_case.main(["--list"]) == 0
    assert sanitize_case.main(["--device", "cpu", "-q"]) == 0
    assert "results within tolerance" in capsys.readouterr().out


def test_sanitizer_harness_refuses_an_op_without_cases(monkeypatch, capsys):
    from tools import sanitize_case

    monkeypatch.setattr(sanitize_case, "kernel_ops", lambda: ["chunk_stats_", "new_kernel_"])
    assert sanitize_case.main(["--device", "cpu"]) == 2
    assert '@kernel_case("new_kernel_")' in capsys.readouterr().out


def test_sanitizer_harness_reports_a_wrong_result(monkeypatch, capsys):
    """A kernel result off its float64 reference fails the run (exit 1), so garbage cannot pass silently."""
    from tools import sanitize_case

    real = sanitize_case.CASES["chunk_grad_"]

    def off_by_a_bit(device):
        for label, actual, expected, tol in real(device):
            yield label, actual.double() * 1.01, expected, tol

    monkeypatch.setitem(sanitize_case.CASES, "chunk_grad_", off_by_a_bit)
    assert sanitize_case.main(["--device", "cpu", "--ops", "chunk_grad_", "-q"]) == 1
    assert "BAD chunk_grad_" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# bench_lce's peers and report (tiny CPU problems; the GPU run uses the same code)
# --------------------------------------------------------------------------------------------------
import dataclasses  # noqa: E402
import time  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from bench import lce_case, report  # noqa: E402
from bench.common import Shape  # noqa: E402
from bench.torch_chunked import torch_chunked_linear_cross_entropy  # noqa: E402

HAS_TORCH_LCE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def _problem(n, d, v, dtype, seed=0, ignored_every=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    t = torch.randint(0, v, (n,), generator=g)
    if ignored_every:
        t[::ignored_every] = -100
    return x.to(dtype), w.to(dtype), t


def _loss_and_grads(fn, x, w, t):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w, t)
    gx, gw = torch.autograd.grad(loss, (x, w))
    return loss.detach(), gx, gw


def _float64_reference(x, w, t, reduction="mean"):
    return _loss_and_grads(lambda a, b, c: F.cross_entropy(a @ b.t(), c, reduction=reduction), x.double(), w.double(), t)


def _rel(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [7, 97, 256, 5000])
def test_torch_chunked_float64_is_exact(reduction, chunk_size):
    """Every chunking (many narrow chunks, a partial last chunk, one chunk) gives F.cross_entropy's loss
    and gradients, ignored rows included."""
    x, w, t = _problem(29, 12, 1003, torch.float64)
    got = _loss_and_grads(lambda a, b, c: torch_chunked_linear_cross_entropy(
        a, b, c, reduction=reduction, chunk_size=chunk_size), x, w, t)
    ref = _float64_reference(x, w, t, reduction)
    assert abs(float(got[0]) - float(ref[0])) <= 1e-12 * abs(float(ref[0]))
    assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12


def test_torch_chunked_gradcheck():
    x, w, t = _problem(7, 5, 41, torch.float64, ignored_every=3)
    x.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: torch_chunked_linear_cross_entropy(a, b, t, chunk_size=16), (x, w))


def test_torch_chunked_float32_within_1e5_of_float64():
    x, w, t = _problem(64, 32, 3000, torch.float32)
    loss, gx, gw = _loss_and_grads(torch_chunked_linear_cross_entropy, x, w, t)
    ref = _float64_reference(x, w, t)
    assert loss.dtype == torch.float32
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * abs(float(ref[0]))
    assert _rel(gx, ref[1]) < 1e-5 and _rel(gw, ref[2]) < 1e-5


def test_torch_chunked_bfloat16_at_most_twice_plain_torch_error():
    """bf16: the float32 loss and bf16 gradients are no further from float64 than 2x plain PyTorch's."""
    x, w, t = _problem(64, 32, 1000, torch.bfloat16, ignored_every=0)
    ref = _float64_reference(x, w, t)
    got = _loss_and_grads(lambda a, b, c: torch_chunked_linear_cross_entropy(a, b, c, chunk_size=256), x, w, t)
    plain = _loss_and_grads(lambda a, b, c: F.cross_entropy(F.linear(a, b), c), x, w, t)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    loss_err, plain_loss_err = (abs(float(v) - float(ref[0])) for v in (got[0], plain[0]))
    assert loss_err <= 2 * plain_loss_err + 1e-6
    for mine, theirs, r in zip(got[1:], plain[1:], ref[1:]):
        assert _rel(mine, r) <= 2 * _rel(theirs, r) + 1e-3


def _opts(**kw):
    # a budget no loaded machine exhausts: the cases then run exactly the repetitions asked for
    return SimpleNamespace(**{"reps": 2, "warmup": 1, "case_budget": 600.0, "seed": 0, "ref_chunk": 300, **kw})


TINY = Shape("tiny_test", 48, 16, 700, "test")
CPU = torch.device("cpu")


def test_cases_share_a_process_and_one_reference(tmp_path):
    """Several implementations in one process, measured one after the other on the same inputs, compared
    with one reference: timings, fp32 errors, the plans, one JSON per case."""
    impls = ["hugehead", "torch", "torch_chunked"] + (["torch_lce"] if HAS_TORCH_LCE else [])
    rows = lce_case.run_cases(impls, TINY, CPU, torch.float32, _opts(), tmp_path)
    assert [r["impl"] for r in rows] == impls
    for row in rows:
        assert row["status"] == "ok", (row["impl"], row.get("error"))
        assert row["dtype"] == "float32" and row["fwd_bwd_reps"] == 2 and row["fwd_ms"] > 0
        for key in ("loss_rel_err", "grad_x_rel_err", "grad_w_rel_err", "fwd_loss_rel_err"):
            assert row[key] < 1e-5, (row["impl"], key, row[key])
        assert row["ref_shared_by"] == len(impls) and row["loss_ref"] == rows[0]["loss_ref"]
        assert json.loads(lce_case.case_json(tmp_path, TINY.name, row["impl"]).read_text())["done"]
    plan = rows[0]["plan"]  # the planner's fields, whatever they are, for forward+backward and forward
    assert {"rows", "cols", "fwd_rows", "fwd_cols"} <= set(plan) and plan["rows"] == TINY.n
    if HAS_TORCH_LCE:
        assert rows[3]["plan"]["batch_chunk_size"] >= 1 and rows[3]["warnings"] == []  # no fallback warning


@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_case_torch_compile_reports_compile_time_apart(tmp_path):
    (row,) = lce_case.run_cases(["torch_compile"], TINY, CPU, torch.float32, _opts(reps=1), tmp_path)
    assert row["status"] == "ok", row.get("error")
    # compilation + first call are recorded on their own, not among the timed repetitions (no time is
    # compared: a loaded machine can make any call slow)
    assert row["fwd_bwd_compile_ms"] > 0 and row["fwd_compile_ms"] > 0
    assert row["fwd_bwd_reps"] == len(row["fwd_bwd_ms_all"]) == 1 and row["fwd_reps"] == len(row["fwd_ms_all"]) == 1
    assert row["loss_rel_err"] < 1e-5 and row["grad_w_rel_err"] < 1e-5


def test_missing_torch_lce_is_skipped_with_the_reason(tmp_path, monkeypatch):
    """A torch without F.linear_cross_entropy (2.11 on the GPU machine) gives a skipped row, not a crash."""
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    (row,) = lce_case.run_cases(["torch_lce"], TINY, CPU, torch.float32, _opts(), tmp_path)
    assert row["status"] == "skipped" and "has no F.linear_cross_entropy" in row["error"]


@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
def test_parent_reruns_after_a_crash_and_skips(tmp_path):
    """The parent: a case that kills the process it shares is recorded as a crash and the cases after it run
    in a fresh process; --skip and an unavailable peer become skipped rows; lce.md has the headline."""
    from bench import bench_lce

    rc = bench_lce.main(["--cpu-smoke", "--shapes", "tiny", "--out", str(tmp_path), "--work", str(tmp_path / "work"),
                         "--peers", "hugehead,selftest_crash_shared,torch,torch_chunked,selftest_unavailable",
                         "--skip", "tiny:torch_chunked", "--reps", "1", "--warmup", "1"])
    assert rc == 0
    doc = json.loads((tmp_path / "lce.json").read_text())
    rows = {r["impl"]: r for r in doc["rows"]}
    assert list(rows) == ["hugehead", "selftest_crash_shared", "torch", "torch_chunked", "selftest_unavailable"]
    # hugehead finished before the crash; torch had not started: it ran again in a process of its own
    assert rows["hugehead"]["status"] == "ok" and "selftest_crash_shared" in rows["hugehead"]["process_group"]
    assert rows["torch"]["status"] == "ok" and rows["torch"]["process_group"] == ["torch"]
    assert rows["selftest_crash_shared"]["status"] == "crash" and "SIGABRT" in rows["selftest_crash_shared"]["error"]
    assert rows["torch_chunked"]["status"] == "skipped" and "--skip" in rows["torch_chunked"]["error"]
    assert rows["selftest_unavailable"]["status"] == "skipped" and "does not exist" in rows["selftest_unavailable"]["error"]
    md = (tmp_path / "lce.md").read_text()
    assert "| shape | N×D×V | hugehead ms | best exact peer |" in md
    assert md.count(harness.SMOKE_NOTE) == 1 and doc["meta"]["smoke"]  # a smoke run's table says so, once


def _probe_in_this_process(monkeypatch):
    """bench_lce's probe (the environment and which peers import; no case) runs in the test's process, through
    the probe process's own entry point, instead of in a child of its own: a test of what --resume does with
    the cases needs the probe's answers, not another interpreter's start-up. The probe as a child process:
    test_parent_reruns_after_a_crash_and_skips."""
    from bench import bench_lce

    real = bench_lce.run_child

    def run_child(args, log, timeout, watch=None):
        if args[0] != "--probe":
            return real(args, log, timeout, watch=watch)
        log.write_text("$ bench_lce.main(" + " ".join(args) + ") in the test's process\n")
        return bench_lce.main(args), False, 0.0

    monkeypatch.setattr(bench_lce, "run_child", run_child)


@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
def test_resume_runs_only_what_the_earlier_part_left_out(tmp_path, monkeypatch, capsys):
    """--resume keeps the earlier part's rows as they are (ok, and skipped for a reason other than the
    budget), runs the cases its --budget left out or it has no row for, and records both parts; a file from
    another commit or measured with other options is refused before anything runs."""
    from bench import bench_lce

    monkeypatch.setenv("HUGEHEAD_GIT_SHA", "0123456789ab")
    _probe_in_this_process(monkeypatch)
    smoke = ["--cpu-smoke", "--shapes", "tiny", "--reps", "1", "--warmup", "1", "--out", str(tmp_path)]
    # part 1: the budget is used up before the first case (only the probe runs)
    assert bench_lce.main([*smoke, "--work", str(tmp_path / "work1"), "--budget", "0", "--skip", "tiny:selftest*",
                           "--peers", "hugehead,torch,selftest_unavailable"]) == 1
    part1 = json.loads((tmp_path / "lce.json").read_text())
    assert [(r["impl"], r["status"], r["error"][:24]) for r in part1["rows"]] == [
        ("hugehead", "skipped", "skipped: bench budget of"), ("torch", "skipped", "skipped: bench budget of"),
        ("selftest_unavailable", "skipped", "skipped: --skip tiny:sel")]
    # as if hugehead had run in part 1 (numbers no run here gives: a rerun would show)
    part1["rows"][0] = {**_row("tiny", "hugehead", 1.25, stage="done", done=True, log="tiny__hugehead.log"),
                        **{k: part1["rows"][0][k] for k in ("n", "d", "v", "dtype", "impl_exact")}}
    # and as if part 1's machine had a peer wheel this one lacks
    assert not part1["meta"]["imports"]["cce"]["ok"]
    part1["meta"]["imports"]["cce"] = {"ok": True, "version": "9.9.9"}
    _write(tmp_path, part1)

    # part 2, into the folder the earlier file is in: torch (budget-skipped) and torch_chunked (no row) run, in
    # one process; hugehead and selftest_unavailable are kept as they are
    rc = bench_lce.main([*smoke, "--work", str(tmp_path / "work2"), "--resume", str(tmp_path / "lce.json"),
                         "--peers", "hugehead,torch,torch_chunked,selftest_unavailable"])
    assert rc == 0
    assert "reusing 2 case(s) as recorded (tiny:hugehead, tiny:selftest_unavailable)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "lce.json").read_text())
    rows = {r["impl"]: r for r in doc["rows"]}
    assert list(rows) == ["hugehead", "torch", "torch_chunked", "selftest_unavailable"]
    assert rows["hugehead"] == part1["rows"][0] and rows["selftest_unavailable"] == part1["rows"][2]
    for impl in ("torch", "torch_chunked"):
        assert rows[impl]["status"] == "ok" and rows[impl]["process_group"] == ["torch", "torch_chunked"]
    meta = doc["meta"]
    assert meta["resumed_from"] == {k: part1["meta"][k] for k in ("created_utc", "elapsed_s", "hostname", "command")}
    assert len(meta["parts"]) == 2 and meta["parts"][1]["elapsed_s"] == meta["elapsed_s"]
    assert "Run in 2 parts (resumed with --resume): part 1 " in (tmp_path / "lce.md").read_text()
    # a peer part 1 imported stays importable in the combined header
    assert meta["imports"]["cce"] == {"ok": True, "version": "9.9.9", "in_earlier_part": True}
    assert "cce 9.9.9" in (tmp_path / "lce.md").read_text()

    for key, value in [("git_sha", "fedcba987654"), ("reps", 10)]:
        other = json.loads(json.dumps(part1))
        other["meta"][key] = value
        path = tmp_path / f"other_{key}.json"
        path.write_text(json.dumps(other))
        with pytest.raises(SystemExit, match=f"refusing --resume .*{key} {value}"):
            bench_lce.main([*smoke[:-1], str(tmp_path / "refused"), "--resume", str(path), "--peers", "hugehead"])
        assert not (tmp_path / "refused").exists()


def _row(shape, impl, ms, status="ok", **kw):
    r = {"shape": shape, "n": 8, "d": 4, "v": 100, "impl": impl, "status": status,
         "fwd_bwd_status": status, "fwd_status": status, "fwd_bwd_ms": ms, "fwd_ms": ms, "fwd_bwd_reps": 10,
         "fwd_reps": 10, "loss_rel_err": 1e-3, "grad_x_rel_err": 1e-3, "grad_w_rel_err": 1e-3}
    r.update(kw)
    return r


def test_headline_picks_the_fastest_exact_accurate_peer(tmp_path):
    doc = {"meta": {"dtype": "bfloat16", "machine": "GPU X", "git_sha": "abc"}, "rows": [
        _row("a", "hugehead", 10.0, plan={"rows": 8, "cols": 100, "keep_logits": True}),
        _row("a", "torch", 20.0),
        _row("a", "torch_chunked", 15.0, grad_w_rel_err=0.5),  # wrong gradients: not a contender
        _row("a", "cce_filter", 5.0, impl_exact=False),  # inexact: not a contender
        _row("a", "torch_compile", 12.0, fwd_bwd_compile_ms=30000.0, fwd_compile_ms=9000.0),
        _row("a", "torch_lce", None, status="oom", error="OutOfMemoryError"),
        _row("b", "hugehead", 40.0),
        _row("b", "torch", None, status="oom"),
        _row("b", "torch_lce", None, status="skipped", error="skipped: torch 2.11 has no F.linear_cross_entropy"),
    ]}
    a, b = report.headline_rows(doc)
    assert (a["best_peer"], a["best_peer_ms"], a["speedup"]) == ("torch_compile", 12.0, pytest.approx(1.2))
    assert a["not_run"] == ["torch_lce OOM"]
    assert b["best_peer"] is None and b["not_run"] == ["torch OOM"]
    text = report.render_headline(doc)
    assert "| a | 8×4×100 | 10.00 | torch_compile | 12.00 | 1.20× | torch_lce OOM |" in text
    assert "| b | 8×4×100 | 40.00 | none ran | - | only hugehead runs | torch OOM |" in text
    md = report.render_markdown(doc)
    assert "a / hugehead: rows=8, cols=100, keep_logits=True" in md
    assert "a / torch_compile: fwd+bwd 30.0 s, fwd 9.0 s" in md
    assert "**5.0e-01**" in md  # the wrong gradient is bold
    assert report.main(["--headline", str(_write(tmp_path, doc))]) == 0


def _write(tmp_path, doc):
    path = tmp_path / "lce.json"
    path.write_text(json.dumps(doc))
    return path


# --------------------------------------------------------------------------------------------------
# hugehead at torch.compile's memory (hugehead_eqmem, issue 21): the budget hand-off
# --------------------------------------------------------------------------------------------------
def test_budget_from_row_takes_the_measured_peak_and_never_makes_one_up():
    ok = {"done": True, "status": "ok", "fwd_bwd_status": "ok", "fwd_bwd_peak_extra_bytes": 3 * 2**30}
    assert lce_case.budget_from_row("torch_compile", ok) == (
        3 * 2**30, "torch_compile's fwd+bwd peak extra memory at this shape: 3.00 GiB")
    for source, why in [
        (None, "torch_compile has no row at this shape"),
        ({**ok, "done": False, "stage": "fwd_bwd"}, "did not finish (stage fwd_bwd)"),
        ({**ok, "status": "oom", "fwd_bwd_status": "oom", "fwd_bwd_error": "OutOfMemoryError: 183.11 GiB"},
         "torch_compile OOM at this shape, no peak memory to match (OutOfMemoryError: 183.11 GiB)"),
        ({"done": True, "status": "skipped", "error": "skipped: --skip xc6M*:torch_compile"},
         "torch_compile SKIPPED at this shape"),
        ({**ok, "fwd_bwd_peak_extra_bytes": None}, "peak memory was not measured here"),
        ({**ok, "fwd_bwd_peak_extra_bytes": 0}, "is 0 bytes"),
    ]:
        budget, text = lce_case.budget_from_row("torch_compile", source)
        assert budget is None and text.startswith("skipped: ") and why in text, (source, text)


def test_budget_order_puts_a_case_after_the_one_whose_memory_it_takes():
    from bench.bench_lce import _budget_order

    assert _budget_order(["hugehead_eqmem", "hugehead", "torch_compile", "torch"]) == [
        "hugehead", "torch_compile", "hugehead_eqmem", "torch"]
    assert _budget_order(["hugehead_eqmem", "torch"]) == ["hugehead_eqmem", "torch"]  # no source: left as is


def _fake_cpu_peak(monkeypatch, peak_bytes):
    """The CPU measures no peak memory: report ``peak_bytes`` beyond the inputs for every timed stage (the
    times stay real), as a GPU would."""
    real = lce_case.measure

    def measure(*args, **kwargs):
        t = real(*args, **kwargs)
        t.peak_extra_bytes = peak_bytes
        return t

    monkeypatch.setattr(lce_case, "measure", measure)


def _recorded_budgets(monkeypatch):
    """Every memory_budget hugehead.linear_cross_entropy is called with."""
    import hugehead

    real, seen = hugehead.linear_cross_entropy, []

    def lce(*args, memory_budget=None, **kwargs):
        seen.append(memory_budget)
        return real(*args, memory_budget=memory_budget, **kwargs)

    monkeypatch.setattr(hugehead, "linear_cross_entropy", lce)
    return seen


def test_eqmem_runs_at_the_peak_torch_compile_measured_before_it_in_the_process(tmp_path, monkeypatch):
    """torch_compile's case, then hugehead_eqmem's in the same process: hugehead is called (fwd+bwd and fwd)
    with memory_budget = torch_compile's recorded peak extra memory (a budget below its logits here, so its
    plan recomputes 256-class chunks where the default keeps all logits), and its numbers still match the
    reference."""
    from bench import peers

    # plain torch under torch_compile's name: the same hand-off without a C++ compile on the CPU
    monkeypatch.setitem(peers.IMPLS, "torch_compile", dataclasses.replace(
        peers.IMPLS["torch_compile"], load=peers._load_torch, compiles=False))
    grad_bytes = (TINY.n + TINY.v) * TINY.d * 4
    _fake_cpu_peak(monkeypatch, 60_000 + grad_bytes)
    seen = _recorded_budgets(monkeypatch)
    rows = lce_case.run_cases(["hugehead", "torch_compile", "hugehead_eqmem"], TINY, CPU, torch.float32, _opts(),
                              tmp_path)
    mine, theirs, eqmem = rows
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"], [r.get("error") for r in rows]
    assert theirs["fwd_bwd_peak_extra_bytes"] == 60_000
    assert eqmem["memory_budget"] == 60_000 and eqmem["memory_budget_from"]["impl"] == "torch_compile"
    assert eqmem["memory_budget_from"]["fwd_bwd_peak_extra_bytes"] == 60_000
    assert mine["plan"]["kind"] == "kept" and mine["plan"]["cols"] == TINY.v
    assert eqmem["plan"]["budget"] == 60_000 and (eqmem["plan"]["kind"], eqmem["plan"]["cols"]) == ("recompute", 256)
    # default budget for hugehead's calls, then 60 000 bytes for every one of hugehead_eqmem's (fwd+bwd and fwd)
    assert None in seen and seen[seen.index(60_000):] == [60_000] * len(seen[seen.index(60_000):])
    assert seen.count(60_000) == eqmem["fwd_bwd_reps"] + eqmem["fwd_reps"] + 2  # + one warm-up call each
    for key in ("loss_rel_err", "grad_x_rel_err", "grad_w_rel_err", "fwd_loss_rel_err"):
        assert eqmem[key] < 1e-5, (key, eqmem[key])


def test_eqmem_is_skipped_when_torch_compile_has_no_peak(tmp_path, monkeypatch):
    """A torch_compile that ran out of memory (its row in the case folder, as the parent leaves it) gives a
    skipped hugehead_eqmem row with the reason, and hugehead is never called."""
    seen = _recorded_budgets(monkeypatch)
    harness.write_json(lce_case.case_json(tmp_path, TINY.name, "torch_compile"), {
        "shape": TINY.name, "impl": "torch_compile", "done": True, "status": "oom", "fwd_bwd_status": "oom",
        "fwd_bwd_error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 183.11 GiB."})
    (row,) = lce_case.run_cases(["hugehead_eqmem"], TINY, CPU, torch.float32, _opts(), tmp_path)
    assert row["status"] == "skipped" and row.get("memory_budget") is None and seen == []
    assert row["error"].startswith("skipped: torch_compile OOM at this shape, no peak memory to match")


@pytest.mark.slow  # eqmem after a resume; eqmem itself: test_eqmem_runs_at_the_peak_torch_compile_measured_before_it_in_the_process
def test_resume_runs_eqmem_at_the_earlier_parts_torch_compile_peak(tmp_path, monkeypatch, capsys):
    """--resume with torch_compile measured in the earlier part: the parent hands its row to the
    hugehead_eqmem case process, which runs at its peak (recorded in the row, the plan and lce.md's
    equal-memory table); a torch_compile --skip'ed at a shape skips hugehead_eqmem there without a process."""
    from bench import bench_lce

    monkeypatch.setenv("HUGEHEAD_GIT_SHA", "0123456789ab")
    _probe_in_this_process(monkeypatch)
    smoke = ["--cpu-smoke", "--shapes", "tiny,tiny_odd", "--reps", "1", "--warmup", "1", "--out", str(tmp_path)]
    peers_arg = ["--peers", "hugehead,torch_compile,hugehead_eqmem"]
    assert bench_lce.main([*smoke, "--work", str(tmp_path / "work1"), "--budget", "0", *peers_arg]) == 1
    part1 = json.loads((tmp_path / "lce.json").read_text())
    assert [(r["shape"], r["impl"], r["status"]) for r in part1["rows"]] == [
        (s, i, "skipped") for s in ("tiny", "tiny_odd") for i in ("hugehead", "torch_compile", "hugehead_eqmem")]
    # as if part 1 had measured hugehead and torch_compile at "tiny" (torch_compile's peak: 70 000 bytes)
    # and torch_compile had been --skip'ed at "tiny_odd"
    keep = ("n", "d", "v", "dtype", "impl_exact")
    part1["rows"][0] = {**_row("tiny", "hugehead", 1.25, stage="done", done=True), **{k: part1["rows"][0][k] for k in keep}}
    part1["rows"][1] = {**_row("tiny", "torch_compile", 0.5, stage="done", done=True, fwd_bwd_peak_extra_bytes=70_000,
                               fwd_bwd_peak_extra_gib=70_000 / 2**30), **{k: part1["rows"][1][k] for k in keep}}
    part1["rows"][3] = {**_row("tiny_odd", "hugehead", 2.5, stage="done", done=True),
                        **{k: part1["rows"][3][k] for k in keep}}
    part1["rows"][4] = {**part1["rows"][4], "error": "skipped: --skip tiny_odd:torch_compile"}
    _write(tmp_path, part1)

    rc = bench_lce.main([*smoke, "--work", str(tmp_path / "work2"), "--resume", str(tmp_path / "lce.json"), *peers_arg])
    assert rc == 0
    doc = json.loads((tmp_path / "lce.json").read_text())
    rows = {(r["shape"], r["impl"]): r for r in doc["rows"]}
    eqmem = rows["tiny", "hugehead_eqmem"]
    assert eqmem["status"] == "ok" and eqmem["process_group"] == ["hugehead_eqmem"]
    assert eqmem["memory_budget"] == 70_000 and eqmem["plan"]["budget"] == 70_000
    assert eqmem["memory_budget_from"]["fwd_bwd_peak_extra_bytes"] == 70_000
    assert eqmem["loss_rel_err"] < 2e-2 and eqmem["grad_w_rel_err"] < 2e-2  # bf16 smoke inputs
    odd = rows["tiny_odd", "hugehead_eqmem"]
    assert odd["status"] == "skipped" and "log" not in odd  # no process
    assert odd["error"].startswith("skipped: torch_compile SKIPPED at this shape")
    assert rows["tiny", "torch_compile"] == part1["rows"][1]
    md = (tmp_path / "lce.md").read_text()
    # its peak is not measured on the CPU ("-"); 70 000 bytes are 0.00 GiB
    assert (f"| tiny | 64×32×1000 | 0.50 | 0.00 | {eqmem['fwd_bwd_ms']:.2f} | 0.00 | - | {eqmem['plan']['kind']} | "
            f"{eqmem['gemm']} | {0.5 / eqmem['fwd_bwd_ms']:.2f}× |") in md
    assert "| tiny_odd | 37×48×5003 | SKIPPED | - | SKIPPED | - | - | - | - | - |" in md
    assert "tiny / hugehead_eqmem: rows=" in md and "budget=70000" in md


def test_a_process_stopped_by_the_run_budget_leaves_its_cases_to_resume(tmp_path, monkeypatch):
    """A group process the run's --budget stops: the case that was running and the ones not started are
    budget-skipped rows (which --resume runs again), not timeouts; a case it had finished is kept."""
    from bench import bench_lce

    shape = bench_lce.ALL_SHAPES["tiny"]
    work = tmp_path
    calls = []

    def run_child(args, log, timeout, watch=None):  # the child: finishes hugehead, is stopped inside torch
        calls.append(timeout)
        log.write_text("$ fake\n")
        harness.write_json(lce_case.case_json(work, shape.name, "hugehead"),
                           _row(shape.name, "hugehead", 1.0, done=True, stage="done"))
        harness.write_json(lce_case.case_json(work, shape.name, "torch"),
                           {"shape": shape.name, "impl": "torch", "done": False, "stage": "fwd_bwd"})
        harness.write_json(lce_case.group_json(work, shape.name), {"running": "torch", "since": 0})
        time.sleep(timeout)
        return None, True, timeout

    monkeypatch.setattr(bench_lce, "run_child", run_child)
    opts = SimpleNamespace(case_timeout=300.0, budget=7.0, reps=1, warmup=1, case_budget=60.0, seed=0, ref_chunk=0,
                           device="cpu", dtype="float32", cpu_smoke=True)
    rows = bench_lce._run_group(["hugehead", "torch", "torch_chunked"], shape, work, opts,
                                deadline=time.perf_counter() + 1.5)
    assert len(calls) == 1 and calls[0] <= 1.5  # bounded by the deadline, not 4 case timeouts
    assert [(r["impl"], r["status"]) for r in rows] == [("hugehead", "ok"), ("torch", "skipped"),
                                                        ("torch_chunked", "skipped")]
    assert rows[1]["error"].startswith(f"{bench_lce.BUDGET_SKIP} 7 s used up (stopped in stage fwd_bwd after")
    assert rows[2]["error"] == f"{bench_lce.BUDGET_SKIP} 7 s used up"


def test_skip_items_carry_their_reason_into_the_row():
    from bench.bench_lce import _parse_skips, _skip_reason

    skips = _parse_skips("xc6M*:liger=over 35 s a step: Liger 0.8.5, xc6M*:cce")
    assert skips == [("xc6M*", "liger", "over 35 s a step: Liger 0.8.5"), ("xc6M*", "cce", "")]
    assert _skip_reason(skips, "xc6M_16k", "liger") == "skipped: --skip xc6M*:liger: over 35 s a step: Liger 0.8.5"
    assert _skip_reason(skips, "xc6M", "cce") == "skipped: --skip xc6M*:cce"
    assert _skip_reason(skips, "xc1M", "liger") is None
    with pytest.raises(SystemExit, match="SHAPE:IMPL"):
        _parse_skips("xc6M")


def test_profile_step_idle_gaps_between_kernels():
    """profile_step's gap analysis: kernels on other streams overlapping count as busy, a kernel nested in a
    longer one leaves no gap, and each gap names the kernel that ended last before it and the one after it."""
    from tools.profile_step import idle_gaps

    kernels = [("c", 50.0, 60.0), ("a", 0.0, 10.0), ("b", 5.0, 30.0), ("n", 12.0, 20.0), ("d", 65.0, 66.0),
               ("e", 100.0, 120.0)]
    total, gaps = idle_gaps(kernels, min_gap_us=10.0)
    assert total == (50.0 - 30.0) + (65.0 - 60.0) + (100.0 - 66.0)
    assert gaps == [(34.0, "d", "e"), (20.0, "b", "c")]  # the 5 us gap is below min_gap_us
    assert idle_gaps([]) == (0.0, [])


def test_profile_step_host_in_gaps_names_the_host_work_between_launches():
    """profile_step --trace: each GPU gap (and the wait from the step's start to its first kernel) lists the
    Python functions the host ran between the launch of the kernel that ended last before it and the launch of
    the one after, hugehead's first, the innermost first; a kernel on another stream overlapping leaves no gap."""
    from tools.profile_step import STEP_MARK, host_in_gaps

    def k(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2,
                "args": {"correlation": corr}}

    def py(name, ts, dur):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur}

    events = [{"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": 0, "dur": 2000},
              launch(100, 1), k("first", 110, 100, 1),
              launch(120, 2), k("side", 150, 400, 2),  # another stream: busy until 550
              launch(130, 3), k("after_side", 560, 10, 3),  # a 10 us gap: below min_gap_us
              py("hugehead/loop.py(10): _prologue", 140, 700), py("hugehead/plan.py(5): plan_chunks", 200, 500),
              py("threading.py(1): wait", 300, 50),
              launch(845, 4), k("gemm", 900, 100, 4)]
    lines = host_in_gaps({"traceEvents": events}, min_gap_us=50.0)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| gap")]
    assert len(rows) == 2, rows
    assert rows[0].startswith("| 330 | `after_side` -> `gemm` | 713 |"), rows[0]  # 900 - 570; host 132 -> 845
    assert "plan_chunks 500; loop.py(10): _prologue 700" in rows[0] and "threading" not in rows[0], rows[0]
    assert rows[1].startswith("| 110 | `step start` -> `first` | 100 |"), rows[1]


def test_profile_step_stage_split_attributes_kernels_to_loop_stages():
    """profile_step's stages: each kernel in the stage of the op that launched it (hugehead's ops by name, the
    statistics GEMM's merge apart; cuBLAS's GEMMs by their shapes: over the features a logits GEMM, rows by
    classes dX, classes by rows dW), FLOPs once per op call from its shapes, per step."""
    from types import SimpleNamespace as NS

    from tools.profile_step import gemm_flops, is_gemm_stage, stage_lines, stage_split

    cpu = torch.autograd.DeviceType.CPU
    n, d, c, r = 64, 16, 96, 48  # rows, features, a chunk's classes, a rows-plan block

    def op(name, shapes, kernels):
        return NS(name=name, device_type=cpu, input_shapes=shapes,
                  kernels=[NS(name=k, duration=us) for k, us in kernels])

    events = [
        op("hugehead::gemm_chunk_stats_", [[n, d], [c, d], [], [n]], [("device_kernel<Stats>", 100.0),
                                                                       ("merge_partials_kernel<false>", 10.0)]),
        op("hugehead::gemm_chunk_grad_", [[n, d], [c, d]], [("device_kernel<Grad>", 120.0)]),
        op("aten::addmm", [[n, d], [n, c], [c, d]], [("nvjet_dx", 90.0)]),  # dX into float32
        op("aten::mm", [[c, n], [n, d]], [("nvjet_dw", 80.0)]),  # dW
        op("aten::addmm_", [[c, d], [c, r], [r, d]], [("nvjet_dw_block", 20.0)]),  # a rows block's dW, added
        op("aten::mm", [[r, d], [d, c]], [("nvjet_logits", 70.0)]),  # a rows block's logits
        op("aten::mm", [[r, c], [c, d]], [("nvjet_block_dx", 60.0)]),  # its dX
        op("aten::mm", [[n, 8], [8, d]], [("nvjet_ragged_dx", 5.0)]),  # dX of a last chunk of 8 classes
        op("hugehead::chunk_grad_", [[n, c]], [("chunk_grad_kernel", 30.0)]),
        op("aten::fill_", [[n]], [("fill", 5.0)]),
        op("aten::mm", [[n, d], [d, c]], []),  # no kernel of its own: not counted
        NS(name="nvjet_dx", device_type=torch.autograd.DeviceType.CUDA, kernels=[]),  # the GPU row itself
    ]
    square = [op("aten::mm", [[c, n], [n, n]], [("nvjet_dw", 7.0)]),  # dW where D = N (llama3_4k: 4096)
              op("aten::mm", [[n, c], [c, n]], [("nvjet_dx", 3.0)]),  # dX where D = N
              op("aten::mm", [[n, n], [n, c]], [("nvjet_logits", 3.0)])]  # logits where D = N
    assert {k: v["calls"] for k, v in stage_split(square, steps=1, n=n, d=n).items()} == {
        "dW GEMM (cuBLAS)": 1, "dX GEMM (cuBLAS)": 1, "logits GEMM (cuBLAS)": 1}
    # A chunk of exactly N classes (xc6M_16k) gives dX and dW the same shapes: the recorded strides tell them apart
    # (dW's first operand is gᵀ), else the overloads: dX sums in float32 through out_dtype (a dtype input), dW is
    # written by mm(gᵀ, x, out=).
    strided = [NS(**vars(op("aten::mm", [[n, n], [n, d], [n, d]], [("nvjet_dw", 4.0)])),
                  structured_input_strides=[[1, n], [d, 1], [d, 1]]),
               NS(**vars(op("aten::mm", [[n, n], [n, d], [n, d]], [("nvjet_dx_cpu", 2.0)])),
                  structured_input_strides=[[n, 1], [d, 1], [d, 1]]),
               NS(**vars(op("aten::addmm", [[n, d], [n, n], [n, d], [], [], [], [n, d]], [("nvjet_dx", 3.0)])),
                  structured_input_strides=[[d, 1], [n, 1], [d, 1], [], [], [], [d, 1]])]
    assert {k: v["ms"] * 1e3 for k, v in stage_split(strided, steps=1, n=n, d=d).items()} == {
        "dW GEMM (cuBLAS)": pytest.approx(4.0), "dX GEMM (cuBLAS)": pytest.approx(5.0)}
    unstrided = [op("aten::mm", [[n, n], [n, d], [n, d]], [("nvjet_dw", 4.0)]),
                 op("aten::mm", [[n, n], [n, d], [], [n, d]], [("nvjet_dx_first", 1.0)]),
                 op("aten::addmm", [[n, d], [n, n], [n, d], [], [], [], [n, d]], [("nvjet_dx", 3.0)]),
                 op("aten::mm", [[n, n], [n, d]], [("nvjet_dx_direct", 2.0)])]
    assert {k: v["calls"] for k, v in stage_split(unstrided, steps=1, n=n, d=d).items()} == {
        "dW GEMM (cuBLAS)": 1, "dX GEMM (cuBLAS)": 3}
    stages = stage_split(events * 2, steps=2, n=n, d=d)  # two identical steps
    f = 2.0 * n * d * c
    fb = 2.0 * r * d * c
    expect = {"statistics GEMM (fused)": (0.100, 1, f), "partials' merge": (0.010, 0, 0.0),
              "gradient GEMM (fused)": (0.120, 1, f), "dX GEMM (cuBLAS)": (0.155, 3, f + fb + 2.0 * n * 8 * d),
              "dW GEMM (cuBLAS)": (0.100, 2, f + fb), "logits GEMM (cuBLAS)": (0.070, 1, fb),
              "chunk_grad_ (kept logits)": (0.030, 1, 0.0), "other": (0.005, 1, 0.0)}
    assert set(stages) == set(expect)
    for name, (ms, calls, flops) in expect.items():
        st = stages[name]
        assert st["ms"] == pytest.approx(ms) and st["calls"] == calls and st["flops"] == pytest.approx(flops), name
        assert st["tflops"] == (pytest.approx(flops / ms / 1e9) if flops else None)
    assert list(stages)[0] == "dX GEMM (cuBLAS)"  # largest first
    assert is_gemm_stage("dW GEMM (cuBLAS)") and not is_gemm_stage("partials' merge")
    assert gemm_flops("hugehead::gemm_chunk_grad_", [[n, d], [c, d], [], [n]]) == f
    assert gemm_flops("aten::addmm_", [[c, d], [c, n], [n, d]]) == f
    assert gemm_flops("aten::mm", []) == 0.0 and gemm_flops("aten::add_", [[n], [n]]) == 0.0
    table = stage_lines(stages, step_ms=1.0)
    assert table[2].startswith("| dX GEMM (cuBLAS) | 0.15 | 3 |") and table[2].endswith("| 15.5% |")


_AB_FAKE_BENCH = '''
import argparse, json, os, sys
from pathlib import Path
p = argparse.ArgumentParser()
for a in ("--peers", "--shapes", "--out", "--work"):
    p.add_argument(a)
o = p.parse_args()
tree = Path.cwd().name
log = Path(os.environ["AB_ORDER_LOG"])
k = len(log.read_text().splitlines()) if log.exists() else 0
log.write_text((log.read_text() if log.exists() else "") + tree + "\\n")
base = {"old": 20.0, "new": 19.0}[tree]
rows = []
for shape in o.shapes.split(","):
    for impl in o.peers.split(","):
        ms = (base if impl == "hugehead" else 21.0) + 0.5 * k + (10.0 if shape == "gemma2" else 0.0)
        rows.append({"shape": shape, "impl": impl, "fwd_bwd_ms": ms, "fwd_ms": ms / 3})
Path(o.out).mkdir(parents=True, exist_ok=True)
installed = os.environ.get("HUGEHEAD_BENCH_IMPORT") == "installed"
meta = {"hugehead_file": "/site-packages/hugehead" if installed else str(Path.cwd() / "hugehead"), "gpu_name": "Stand-in GPU", "git_sha": os.environ["HUGEHEAD_GIT_SHA"]}
(Path(o.out) / "lce.json").write_text(json.dumps({"meta": meta, "rows": rows}))
'''


def _ab_fake_tree(root):
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "__init__.py").write_text("")
    (root / "bench" / "bench_lce.py").write_text(_AB_FAKE_BENCH)
    (root / "setup.py").write_text("import os, sys\nassert sys.argv[1:] == ['build_ext', '--inplace'], sys.argv\n"
                                   "assert os.environ['HUGEHEAD_CUDA'] == os.environ['HUGEHEAD_CUTLASS'] == 'ON'\n"
                                   "open('built.txt', 'w').write('yes')\n")


def test_ab_commits_builds_the_old_tree_and_takes_turns(tmp_path, monkeypatch):
    """bench/ab_commits.py with two stand-in trees (the old one as a tar carrying its commit in the pax header,
    as git archive writes it): the old tree is unpacked and built in place, the runs take turns (old, new, new,
    old), each run's medians and each tree's means and ratios are the stand-in's numbers."""
    import tarfile

    from tools import ab_commits

    src = tmp_path / "src" / "old"
    _ab_fake_tree(src)
    tar_path = tmp_path / "old.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "ab" * 20}) as tar:
        for f in sorted(src.rglob("*")):
            tar.add(f, arcname=str(f.relative_to(src)), recursive=False)
    assert ab_commits.tar_commit(tar_path) == "ab" * 20
    new = tmp_path / "new"
    _ab_fake_tree(new)
    scratch = tmp_path / "scratch" / "old"
    monkeypatch.setenv("AB_ORDER_LOG", str(tmp_path / "order.log"))
    monkeypatch.setenv("HUGEHEAD_GIT_SHA", "cd" * 20)
    monkeypatch.setenv("HUGEHEAD_BENCH_IMPORT", "installed")  # as tools/gpu_check.sh runs its steps
    rc = ab_commits.main(["--old-tar", str(tar_path), "--out", str(tmp_path / "out"), "--scratch", str(scratch),
                          "--new-tree", str(new), "--shapes", "llama3_4k,gemma2", "--rounds", "2"])
    assert rc == 0
    assert (scratch / "built.txt").read_text() == "yes"
    assert (tmp_path / "order.log").read_text().split() == ["old", "new", "new", "old"]
    ab = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert ab["meta"]["old_sha"] == "ab" * 20 and ab["meta"]["new_sha"] == "cd" * 20
    assert ab["meta"]["gpu"] == "Stand-in GPU" and ab["meta"]["imports"]["old1"] == str(scratch / "hugehead")
    assert ab["meta"]["imports"]["new1"] == "/site-packages/hugehead" and set(ab["meta"]["rcs"].values()) == {0}
    assert [r["label"] for r in ab["runs"]][::4] == ["old1", "new1", "new2", "old2"]
    c = ab["per_shape"]["llama3_4k"]
    # run k (0..3) gives base + 0.5 k: old ran as k = 0 and 3, new as k = 1 and 2
    assert c["old_hugehead"] == pytest.approx(20.75) and c["new_hugehead"] == pytest.approx(19.75)
    assert c["old_torch_compile"] == pytest.approx(21.75) and c["new_torch_compile"] == pytest.approx(21.75)
    assert c["new_over_old"] == pytest.approx(19.75 / 20.75) and c["new_over_compile"] == pytest.approx(19.75 / 21.75)
    assert ab["per_shape"]["gemma2"]["old_hugehead"] == pytest.approx(30.75)
    md = (tmp_path / "out" / "ab.md").read_text()
    assert "| llama3_4k | 20.75 | 19.75 | 0.952 | 21.75 | 21.75 | 0.954 | 0.908 |" in md
    # an old run that imports the installed hugehead is an error, not a measurement of the old code
    assert ab_commits.imported_from_its_tree("old", "/site-packages/hugehead", scratch) is False
    assert ab_commits.imported_from_its_tree("new", str(scratch / "hugehead"), scratch) is False
    assert ab_commits.imported_from_its_tree("old", None, scratch) is False
    # a failed case (None) or a non-finite time (written as a string) is listed but left out of the means
    runs = [{"label": "old1", "tree": "old", "rows": [{"shape": "s", "impl": "hugehead", "fwd_bwd_ms": 10.0}]},
            {"label": "old2", "tree": "old", "rows": [{"shape": "s", "impl": "hugehead", "fwd_bwd_ms": "nan"}]},
            {"label": "new1", "tree": "new", "rows": [{"shape": "s", "impl": "hugehead", "fwd_bwd_ms": None}]}]
    cell = ab_commits.summarize(runs)["per_shape"]["s"]
    assert cell["old_hugehead"] == 10.0 and cell["old_hugehead_runs"] == 1 and cell["new_hugehead"] is None
    assert cell["new_over_old"] is None


@pytest.mark.skipif(shutil.which("git") is None or not (harness.REPO_ROOT / ".git").exists(),
                    reason="needs git and a git checkout")
def test_ab_commits_reads_the_commit_git_archive_wrote(tmp_path):
    import subprocess

    from tools import ab_commits

    head = subprocess.run(["git", "-C", str(harness.REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    tar_path = tmp_path / "head.tar"
    subprocess.run(["git", "-C", str(harness.REPO_ROOT), "archive", "--format=tar", "-o", str(tar_path), "HEAD"],
                   check=True)
    assert ab_commits.tar_commit(tar_path) == head


def test_step_trace_reads_nvidia_smi_and_places_samples_in_steps():
    """bench/step_trace.py: nvidia-smi's CSV lines (local time, hex event reasons) become samples; a step gets
    the samples inside its wall-clock span, their lowest and median clock and how many had the SW power-cap
    flag; a line of another shape is dropped."""
    import datetime as dt

    from tools import step_trace

    text = ("2026/12/06 09:38:30.645, 1965, 135.61, 0x0000000000000004\n"
            "2026/12/06 09:38:30.745, 1560, 195.13, 0x0000000000000004\n"
            "[N/A], 1515, 258.74, 0x0\n"
            "2026/12/06 09:38:30.846, 1515, 258.74, 0x0000000000000000\n"
            "2026/12/06 09:38:30.946, 1935, 272.22, 0x0000000000000001\n")
    samples = step_trace.smi_samples(text)
    assert [s["mhz"] for s in samples] == [1965.0, 1560.0, 1515.0, 1935.0]
    t0 = dt.datetime(2026, 12, 6, 9, 38, 30, 700000).timestamp()
    assert samples[1]["t"] == pytest.approx(t0 + 0.045, abs=1e-6)
    c = step_trace.clock_during(samples, t0, t0 + 0.2)
    assert c == {"samples": 2, "mhz_min": 1515.0, "mhz_median": pytest.approx(1537.5), "power_capped": 1}
    assert step_trace.clock_during(samples, t0 + 10, t0 + 11)["samples"] == 0


def test_step_trace_runs_a_step_by_step_case_on_the_cpu(tmp_path):
    """The CPU run end to end: one row per step, the step's time equal to the host's on the CPU, no allocator
    or clock columns, and the JSON's steps match the markdown's rows."""
    from tools import step_trace

    calls = []

    def step():
        calls.append(1)
        return sum(i * i for i in range(2000))

    rows = step_trace.trace_steps(step, torch.device("cpu"), steps=4, warmup=2)
    assert len(calls) == 6 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["ms"] == r["host_ms"] > 0 and r["allocator"] == {} and r["t1"] >= r["t0"] for r in rows)
    assert step_trace.main(["--shape", "tiny", "--steps", "3", "--warmup", "1", "--device", "cpu",
                            "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "step_trace_tiny_hugehead.json").read_text())
    assert doc["meta"]["benchmark"] == "step_trace" and doc["meta"]["shape"] == "tiny" and len(doc["steps"]) == 3
    md = (tmp_path / "step_trace_tiny_hugehead.md").read_text()
    for r in doc["steps"]:
        assert f"| {r['step']} | {r['ms']:.2f} |" in md


# --------------------------------------------------------------------------------------------------
# history.csv: rows appended only when asked, each with the run's commit
# --------------------------------------------------------------------------------------------------
def test_write_report_appends_history_rows_only_when_asked(tmp_path):
    from bench import history

    doc = {"meta": {"git_sha": "0123456789abcdef", "created_utc": "2026-01-01T00:00:00Z", "gpu_name": "Stand-in GPU",
                    "torch": "2.13.0"},
           "rows": [{"shape": "xc1M", "impl": "hugehead", "status": "ok", "fwd_bwd_ms": 68.44, "fwd_bwd_peak_extra_gib": 3.93,
                     "fwd_ms": 18.5, "fwd_peak_extra_gib": None},
                    {"shape": "xc6M", "impl": "torch", "status": "error", "fwd_bwd_ms": None}]}
    csv_path = tmp_path / "history.csv"
    harness.write_report(tmp_path / "a", "lce", doc, "# t\n")
    assert not csv_path.exists()
    written = harness.write_report(tmp_path / "a", "lce", doc, "# t\n", record=csv_path)
    harness.write_report(tmp_path / "a", "lce", doc, "# t\n", record=csv_path)
    assert written["history"] == csv_path
    rows = history.read(csv_path)
    assert len(rows) == 4 and list(rows[0]) == list(history.COLUMNS)
    assert rows[0] == {"sha": "0123456789ab", "date": "2026-01-01T00:00:00Z", "gpu": "Stand-in GPU", "torch": "2.13.0",
                       "study": "lce", "shape": "xc1M", "impl": "hugehead", "median_ms": "68.440", "peak_gib": "3.93"}
    assert rows[1]["impl"] == "hugehead fwd" and rows[1]["peak_gib"] == ""


def test_history_holds_a_sha_for_every_row_and_every_canonical_study():
    from bench import history

    rows = history.read(history.HISTORY)
    assert rows and all(r["sha"] not in ("", "unknown") and float(r["median_ms"]) >= 0 for r in rows)
    studies = {r["study"] for r in rows}
    assert {"lce", "topk", "multilabel", "amp", "offload", "checkpoint", "transformers", "placement", "dist",
            "resume"} <= studies
    # every canonical results file yields rows through its study's extractor
    for path in (history.REPO_ROOT / "bench" / "results").glob("*/*.json"):
        assert history.rows_of(path.stem, json.loads(path.read_text())), path


def test_report_plots_the_history(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "h.png"
    assert report.main(["--history", str(Path(__file__).resolve().parents[1] / "bench/results/history.csv"),
                        "--study", "lce", "--shape", "xc6M", "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
