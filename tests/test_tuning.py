"""hugehead.tuning's Tuning (read once, overridden for a block) and the plan that one step executes: the backward
runs the forward's plan (no planner call), and a Tuning override changes the plan, which the loop then follows."""
import dataclasses

import pytest
import torch

import hugehead
import hugehead.lce_op
from hugehead import reference, tuning
from hugehead.plan import Plan

from conftest import rel_err, rows_budget


def test_from_environment_reads_the_three_knobs_and_names_a_bad_value():
    assert tuning.from_environment({}) == tuning.Tuning()
    got = tuning.from_environment({"HUGEHEAD_GEMM": "CUBLAS", "HUGEHEAD_ROWS": "0", "HUGEHEAD_EAGER_OP": "0"})
    assert got == tuning.Tuning(gemm="cublas", rows=False, eager_op=False)
    with pytest.raises(ValueError, match="HUGEHEAD_ROWS must be 0 or 1"):
        tuning.from_environment({"HUGEHEAD_ROWS": "yes"})
    with pytest.raises(ValueError, match="Tuning.gemm must be one of"):
        tuning.from_environment({"HUGEHEAD_GEMM": "cutlass_forward"})


def test_override_applies_for_its_block_and_restores():
    before = tuning.current()
    with tuning.override(rows=False) as inside:
        assert tuning.current() is inside and not inside.rows and inside.gemm == before.gemm
        with tuning.override(gemm="cublas"):
            assert tuning.current() == dataclasses.replace(before, rows=False, gemm="cublas")
        assert tuning.current() is inside
    assert tuning.current() is before
    with pytest.raises(TypeError):
        with tuning.override(chunk_multiple=768):
            pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.rows = False
    assert tuning.current() is before


def test_plan_encode_decode_round_trip():
    for plan in (Plan(rows=7, cols=256, keep_logits=True, kept_chunks=3, overlap=True, kept_in_grad=2, budget=99),
                 Plan(rows=32, cols=21, grad_in_forward=True, fused=True, fused_store=True, budget=1 << 20),
                 Plan(rows=9, cols=512, keep_logits=True, kept_chunks=2, kept_in_grad=1, fused=True, fused_cols=4096,
                      fused_store=True, exact=True, kept_probs=True),
                 Plan(rows=5, cols=9)):
        back = Plan.decode(plan.encode())
        assert back == plan and back.budget == plan.budget and back.kind == plan.kind
    assert Plan.decode([]) is None and Plan.decode(None) is None
    with pytest.raises(ValueError, match="12 entries"):
        Plan.decode([1, 2, 3])


@pytest.mark.parametrize("budget", ["kept", "streamed"])
def test_backward_executes_the_forwards_plan_without_asking_the_planner(monkeypatch, budget):
    """The forward's plan travels through the op to the backward, which decodes it and runs it: the planner is not
    called again (here it raises once the forward is done), and the backward's plan equals the forward's."""
    torch.manual_seed(3)
    n, d, v = 24, 8, 3000
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, v, (n,))
    memory_budget = None if budget == "kept" else n * d * 12 + 2 * n * 512 * 8
    planned, executed = [], []
    real_plan, real_backward = hugehead.lce_op.loss_plan, hugehead.lce_op.whole_head_backward
    monkeypatch.setattr(hugehead.lce_op, "loss_plan",
                        lambda *a, **k: planned.append(real_plan(*a, **k)) or planned[-1])
    monkeypatch.setattr(hugehead.lce_op, "whole_head_backward",
                        lambda *a, **k: executed.append(a[7]) or real_backward(*a, **k))
    with tuning.override(rows=False):
        loss = hugehead.linear_cross_entropy(x, w, target, memory_budget=memory_budget)

    def refuse(*a, **k):
        raise AssertionError("the backward asked the planner")
    for name in ("loss_plan", "plan_chunks", "plan_loss", "op_plan"):
        monkeypatch.setattr(hugehead.lce_op, name, refuse)
    for name in ("plan_chunks", "plan_loss", "plan_rows", "fused_gemms", "_paths"):
        monkeypatch.setattr(hugehead.plan, name, refuse)
    monkeypatch.setattr(hugehead.ops, "gemm_path", refuse)
    loss.backward()
    assert len(planned) == 1 and executed == planned, (planned, executed)
    assert planned[0].keep_logits == (budget == "kept") or planned[0].kept_chunks < -(-v // planned[0].cols)
    x64, w64 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = reference.linear_cross_entropy(x64, w64, target)
    ref.backward()
    assert rel_err(loss.detach(), ref.detach()) <= 1e-12
    assert rel_err(x.grad, x64.grad) <= 1e-12 and rel_err(w.grad, w64.grad) <= 1e-12


@pytest.mark.parametrize("loss", ["sparse_softmax", "one_vs_all_rows"])
def test_sparse_target_backwards_execute_the_forwards_plan(monkeypatch, loss):
    """The ops over a CSR target (softmax against sparse probabilities; one-vs-all with per-row losses) take
    the plan their caller made, encoded, in the forward and in the backward: after the forward every planner
    raises, and the gradients are still float64's."""
    import torch.nn.functional as F

    import hugehead.multilabel
    import hugehead.onevsall
    import hugehead.plan

    torch.manual_seed(5)
    n, d, v = 12, 8, 700
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    dense = torch.rand(n, v, dtype=torch.float64) * (torch.rand(n, v) < 0.01)
    dense[:, 0] += 0.5  # every row has a positive entry
    if loss == "sparse_softmax":
        dense = dense / dense.sum(dim=1, keepdim=True)
    with tuning.override(rows=False):
        if loss == "sparse_softmax":
            out = hugehead.linear_cross_entropy(x, w, dense.to_sparse_csr(), chunk_size=128)  # streamed
        else:
            out = hugehead.linear_binary_cross_entropy(x, w, dense.to_sparse_csr(), reduction="none",
                                                       chunk_size=128).sum()

    def refuse(*a, **k):
        raise AssertionError("the backward asked the planner")
    for module, name in ((hugehead.plan, "plan_chunks"), (hugehead.plan, "plan_loss"), (hugehead.lce_op, "op_plan"),
                         (hugehead.lce_op, "plan_chunks"), (hugehead.multilabel, "plan_loss"),
                         (hugehead.multilabel, "plan_softmax"), (hugehead.onevsall, "op_plan")):
        monkeypatch.setattr(module, name, refuse)
    out.backward()
    x64, w64 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = x64 @ w64.T
    if loss == "sparse_softmax":
        ref = F.cross_entropy(logits, dense)
    else:
        ref = F.binary_cross_entropy_with_logits(logits, dense, reduction="sum")
    ref.backward()
    assert rel_err(out.detach(), ref.detach()) <= 1e-10
    assert rel_err(x.grad, x64.grad) <= 1e-10 and rel_err(w.grad, w64.grad) <= 1e-10


def test_a_tuning_override_changes_the_plan_and_the_loop_follows_it(monkeypatch):
    """Tuning(rows=False) turns a rows plan into the chunk loop's: the planner's answer changes, the loop runs the
    strategy that answer names (the rows pass or not), and the loss and gradients are float64's either way."""
    n, d, v = 96, 8, 21
    torch.manual_seed(4)
    x = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    target = torch.randint(0, v, (n,))
    budget = rows_budget(n, d, v, torch.float32, 32)
    rows_runs = []
    real_rows = hugehead.lce_op.rows_pass
    monkeypatch.setattr(hugehead.lce_op, "rows_pass", lambda *a, **k: rows_runs.append(a[5]) or real_rows(*a, **k))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference.linear_cross_entropy(x64, w64, target)
    ref.backward()
    for allowed in (True, False):
        with tuning.override(rows=allowed):
            plan = hugehead.lce_op.loss_plan(x, w, target, memory_budget=budget)
            rows_runs.clear()
            x.grad = w.grad = None
            loss = hugehead.linear_cross_entropy(x, w, target, memory_budget=budget)
            loss.backward()
        assert (plan.kind == "rows") == allowed, plan
        assert rows_runs == ([plan] if allowed else []), rows_runs
        assert rel_err(loss.detach(), ref.detach()) <= 1e-5
        assert rel_err(x.grad, x64.grad) <= 1e-4 and rel_err(w.grad, w64.grad) <= 1e-4


def test_the_gemm_paths_are_fields_of_the_plan(monkeypatch):
    """Which GEMMs a step takes is the planner's answer, not the loop's: planned only (no GPU is touched) for
    xc6M's shape on an sm_90 CUTLASS build, the plan holds the fused path, its widened statistics chunks, exact
    logits, kept probabilities and no side stream; Tuning(gemm="cublas") turns them all off (and the side stream
    on) in the plan; a softcap, a bias, label smoothing, a traced loop or an offloaded shard change the fields
    that depend on them, and the encoded plan carries every field to the backward."""
    import dataclasses

    from hugehead import ops, plan as planner
    from hugehead.budget import Budget

    monkeypatch.setattr(ops, "has_fused_gemm", lambda device, dtype: device.type == "cuda" and dtype.itemsize == 2)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    n, d, v, budget = 4096, 768, 6_000_000, 4 << 30

    def planned(**operands):
        traced = operands.pop("traced", False)
        o = dataclasses.replace(planner.Operands(fused=planner.fused_gemms(cuda, bf16, d, True, traced),
                                                 traced=traced), **operands)
        return planner.plan_chunks(n, d, v, bf16, cuda, None, budget, direct_dx=True, grad_store=True,
                                   kept_probs=o.fused, operands=o)

    fused = planned()
    assert (fused.fused, fused.exact, fused.fused_store, fused.kept_probs, fused.overlap) == (
        True, True, True, True, False), fused
    assert fused.fused_cols == fused.cols * planner.FUSED_STATS_WIDEN and fused.stats_cols == fused.fused_cols
    assert Plan.decode(fused.encode()) == fused
    with tuning.override(gemm="cublas"):
        plain = planned()
    assert not (plain.fused or plain.exact or plain.fused_store or plain.kept_probs) and plain.overlap, plain
    assert plain.stats_cols == plain.cols
    capped = planned(softcap=True)
    assert capped.fused and not (capped.exact or capped.fused_store or capped.kept_probs), capped
    biased = planned(bias=True)
    assert biased.fused_store and not (biased.exact or biased.kept_probs), biased
    smooth = planned(smoothing=True)
    assert smooth.fused_store and not (smooth.exact or smooth.kept_probs), smooth
    traced = planned(traced=True)
    assert not (traced.fused or traced.overlap), traced
    streamed = planner.plan_streamed(n, d, v, bf16, bf16, cuda, None, Budget(budget, "4 GiB"), True,
                                     planner.Operands(fused=True))
    assert streamed.fused and streamed.fused_cols == streamed.cols and not streamed.kept_probs, streamed
