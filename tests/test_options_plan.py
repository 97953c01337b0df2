"""The loss's rules (hugehead/options.py) and the workspace plan (hugehead/plan.py): option checks by
type and range, the budget rule (per device, bounded by the host's memory on the CPU, recorded in the
plan), one plan per step (the backward follows the forward's plan whatever the memory did in between),
``[..., D]`` inputs, second-order gradients refused."""
from __future__ import annotations

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch.nn.functional as F

import hugehead
from hugehead import budget as budget_rule
from hugehead import grad_store
from hugehead.demo.fit import workspace_bytes
from hugehead import plan as planner
from hugehead.options import LossOptions

from conftest import DEVICES, fail_next_mm, host_syncs_of_step, requires_cuda


# --------------------------------------------------------------------------------------------------
# Options: types and ranges
# --------------------------------------------------------------------------------------------------
BAD_OPTIONS = {
    "softcap_string": (dict(softcap="2"), TypeError, r"softcap must be a finite positive number or None, got str"),
    "softcap_bool": (dict(softcap=True), TypeError, r"softcap"),
    "chunk_size_fraction": (dict(chunk_size=2.5), ValueError, r"chunk_size must be an integer, got 2.5"),
    "chunk_size_bool": (dict(chunk_size=True), TypeError, r"chunk_size must be an integer, got bool"),
    "chunk_size_string": (dict(chunk_size="64"), TypeError, r"chunk_size must be an integer, got str"),
    "memory_budget_fraction": (dict(memory_budget=1e3 + 0.5), ValueError, r"memory_budget must be an integer"),
    "memory_budget_bool": (dict(memory_budget=False), TypeError, r"memory_budget must be an integer, got bool"),
    "memory_budget_zero": (dict(memory_budget=0), ValueError, r"memory_budget must be >= 1 byte"),
    "label_smoothing_string": (dict(label_smoothing="0.1"), TypeError, r"label_smoothing must be a real number"),
    "z_loss_nan": (dict(z_loss=float("nan")), ValueError, r"z_loss must be finite"),
    "ignore_index_fraction": (dict(ignore_index=1.5), ValueError, r"ignore_index must be an integer"),
    "reduction_none_object": (dict(reduction=None), TypeError, r"reduction must be a string"),
}


def _small(dtype=torch.float64, n=6, d=5, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype)
    target = torch.randint(0, v, (n,), generator=g)
    return x, w, target


@pytest.mark.parametrize("name", sorted(BAD_OPTIONS))
def test_bad_option_types_and_ranges_raise_naming_the_option(name):
    kwargs, exc, match = BAD_OPTIONS[name]
    x, w, target = _small()
    with pytest.raises(exc, match=match):
        hugehead.linear_cross_entropy(x, w, target, **kwargs)
    with pytest.raises(exc, match=match):
        hugehead.ChunkedClassifier(5, 40, devices=["cpu"], dtype=torch.float64, **kwargs)


def test_integral_floats_are_accepted_and_options_are_normalized():
    x, w, target = _small()
    want = F.cross_entropy(x @ w.t(), target)
    got = hugehead.linear_cross_entropy(x, w, target, chunk_size=16.0, memory_budget=float(1 << 20))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    options = LossOptions(ignore_index=7, label_smoothing=1, z_loss=0, softcap=2)
    assert (options.ignore_index, options.label_smoothing, options.softcap, options.kernel_softcap) == (7, 1.0, 2.0, 2.0)
    assert type(options.label_smoothing) is float and LossOptions().kernel_softcap == 0.0
    with pytest.raises(ValueError, match="label_smoothing"):
        options.replace(label_smoothing=2.0)


# --------------------------------------------------------------------------------------------------
# The budget rule
# --------------------------------------------------------------------------------------------------
def test_cpu_default_budget_is_bounded_by_available_host_memory(monkeypatch):
    monkeypatch.setattr(hugehead.pinned, "available_host_memory", lambda: 64 << 20)
    budget = budget_rule.resolve_budget(None, torch.device("cpu"))
    assert budget.bytes == 16 << 20 and "1/4" in budget.reason and "cpu" in budget.reason
    # 1024 x 64 x 1M classes (4 GiB of float32 logits) is no longer kept whole on a small host.
    plan = planner.plan_chunks(1024, 64, 1_000_000, torch.float32, torch.device("cpu"))
    assert not plan.keep_logits and plan.budget == 16 << 20
    assert 1024 * plan.cols * 4 + 1024 * 64 * 8 <= plan.budget
    monkeypatch.setattr(hugehead.pinned, "available_host_memory", lambda: 1 << 40)
    assert budget_rule.resolve_budget(None, torch.device("cpu")).bytes == budget_rule.DEFAULT_MEMORY_BUDGET
    monkeypatch.setattr(hugehead.pinned, "available_host_memory", lambda: None)  # unknown: the default
    assert budget_rule.resolve_budget(None, torch.device("cpu")).bytes == budget_rule.DEFAULT_MEMORY_BUDGET


def test_cuda_free_memory_of_the_default_budget_is_reused_only_where_it_cannot_change_it(monkeypatch):
    """The driver's free-memory answer (cudaMemGetInfo, a driver call per loss call) is asked again every call
    for the offload budget and below 32 GiB free; above, the default budget (then its 4 GiB cap) reuses it for
    up to _FREE_REUSE_S seconds. The CUDA branch runs here on the CPU with the driver call and the clock
    replaced."""
    answers, clock, calls = {"free": 100 << 30}, {"now": 1000.0}, []

    def driver_free(index):
        calls.append(index)
        return answers["free"]

    monkeypatch.setattr(budget_rule, "_cuda_free", driver_free)
    monkeypatch.setattr(budget_rule.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(budget_rule, "_FREE_SEEN", {})
    cuda0 = torch.device("cuda", 0)
    for _ in range(3):
        budget = budget_rule.resolve_budget(None, cuda0)
        assert budget.bytes == budget_rule.DEFAULT_MEMORY_BUDGET and "100.00 GiB free" in budget.reason
    assert calls == [0]
    clock["now"] += budget_rule._FREE_REUSE_S + 0.1  # stale: asked again, and the new answer is used
    answers["free"] = 40 << 30
    assert "40.00 GiB free" in budget_rule.resolve_budget(None, cuda0).reason and calls == [0, 0]
    answers["free"] = 20 << 30  # not seen yet: the reused 40 GiB still stands within the window
    assert "40.00 GiB free" in budget_rule.resolve_budget(None, cuda0).reason and len(calls) == 2
    clock["now"] += budget_rule._FREE_REUSE_S + 0.1
    assert budget_rule.resolve_budget(None, cuda0).bytes == budget_rule.DEFAULT_MEMORY_BUDGET and len(calls) == 3
    for _ in range(2):  # 20 GiB < 32 GiB: asked every call, so a drop below 16 GiB shows at once
        budget_rule.resolve_budget(None, cuda0)
    assert len(calls) == 5
    answers["free"] = 8 << 30
    assert budget_rule.resolve_budget(None, cuda0).bytes == 2 << 30 and len(calls) == 6
    # The offload default (half of any figure) and explicit budgets: asked every call / never.
    answers["free"] = 100 << 30
    budget_rule.resolve_budget(None, cuda0)
    count = len(calls)
    assert budget_rule.resolve_budget(None, cuda0, streamed_keep=True).bytes == 50 << 30 and len(calls) == count + 1
    assert budget_rule.resolve_budget(1 << 30, cuda0).bytes == 1 << 30 and len(calls) == count + 1
    assert budget_rule.free_memory(cuda0) == 100 << 30 and len(calls) == count + 2


def test_shards_on_one_device_share_its_budget_and_the_plan_records_it(monkeypatch):
    monkeypatch.setattr(hugehead.pinned, "available_host_memory", lambda: 1 << 40)
    head = hugehead.ChunkedClassifier(8, 3000, devices=["cpu", "cpu", "cpu"], dtype=torch.float32,
                                      memory_budget=3 << 20)
    shards = [hugehead.engines.ShardTensors(s.weight, s.bias, s.start) for s in head.shards]
    budgets = head.engine.budgets(shards, keep=True)
    assert list(budgets) == [torch.device("cpu")]
    assert budgets[torch.device("cpu")].bytes == 1 << 20
    assert "memory_budget=3145728 bytes (given), shared by 3 shards on cpu" == budgets[torch.device("cpu")].reason
    default = hugehead.ChunkedClassifier(8, 3000, devices=["cpu", "cpu"], dtype=torch.float32).engine
    assert default.budgets(shards[:2], keep=True)[torch.device("cpu")].bytes == budget_rule.DEFAULT_MEMORY_BUDGET // 2
    x = torch.randn(16, 8)
    plan = head.engine.plan(x, shards[0], True, budgets[torch.device("cpu")])
    assert plan.budget == 1 << 20 and "shared by 3 shards" in plan.budget_reason
    # The budget is not part of the plan's identity: two plans with the same shape are equal.
    assert plan == planner.Plan(plan.rows, plan.cols, plan.keep_logits, plan.kept_chunks, plan.overlap)


def test_fused_loop_spends_the_overlap_workspace_on_one_more_kept_chunk():
    """Where the fused GEMMs take the chunks (side_stream=False) there is nothing to overlap: the planner
    reserves no second workspace, and the same budget keeps one more chunk of logits (xc6M's shape, 4 GiB)."""
    cuda = torch.device("cuda")  # planned only: no GPU is touched
    n, d, v, budget = 4096, 768, 6_000_000, 4 << 30
    both = planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget)
    fused = planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, side_stream=False)
    assert both.overlap and not fused.overlap
    assert (both.cols, both.rows) == (fused.cols, fused.rows) == (65536, n)
    assert both.keep_logits and fused.kept_chunks == both.kept_chunks + 1
    chunk = n * fused.cols * 2
    assert n * d * 6 + (fused.kept_chunks + 1) * chunk <= budget < n * d * 6 + (fused.kept_chunks + 2) * chunk
    # The CPU has no side stream either way; a plan that keeps everything is unchanged.
    cpu = torch.device("cpu")
    assert planner.plan_chunks(64, 8, 3000, torch.float32, cpu, None, 1 << 20, side_stream=False) == \
        planner.plan_chunks(64, 8, 3000, torch.float32, cpu, None, 1 << 20)
    assert planner.plan_chunks(64, 8, 3000, torch.float32, cuda, None, 64 << 20, side_stream=False).kept_chunks == 1


@given(n=st.integers(1, 5000), d=st.integers(1, 3000), v=st.integers(1, 10**7), cols=st.integers(1, 70000),
       itemsize=st.sampled_from([2, 4, 8]), grad_itemsize=st.sampled_from([2, 4, 8]))
def test_grad_store_layout_puts_each_dw_write_over_consumed_slots(n, d, v, cols, itemsize, grad_itemsize):
    """grad_store_layout's slots fit in the weight gradient's buffer, are aligned, and the backward's write of
    chunk i's dW (taken in order, while it reads slot i) ends at or before slot i's start."""
    offset, stride, slots = grad_store.grad_store_layout(n, d, v, cols, itemsize, grad_itemsize)
    if slots == 0:
        return
    assert n * itemsize >= d * grad_itemsize  # only where a chunk's logits are at least its dW
    assert offset % 256 == 0 and stride % 256 == 0 and stride >= n * cols * itemsize
    assert offset + (slots - 1) * stride + n * cols * itemsize <= v * d * grad_itemsize
    for i in range(min(slots, 50)):
        assert (i + 1) * cols * d * grad_itemsize <= offset + i * stride


def test_plan_keeps_chunks_in_the_weight_gradients_buffer():
    """xc6M's shape at the default 4 GiB: the six chunks the budget keeps, and sixteen more in the 9.2 GB
    bf16 weight gradient (allocated at the forward instead of the backward); float32 master weights hold twice
    as many; grad_store=False keeps none there; the encoded plan carries them."""
    cuda = torch.device("cuda")  # planned only: no GPU is touched
    n, d, v, budget = 4096, 768, 6_000_000, 4 << 30
    base = planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, side_stream=False)
    plan = planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, side_stream=False, grad_store=True)
    assert (base.kept_chunks, base.kept_in_grad) == (6, 0)
    assert (plan.cols, plan.kept_chunks, plan.kept_in_grad) == (65536, 22, 16)
    assert planner.kept_shape(plan, n) == (6, n, 65536)
    assert planner.Plan.decode(plan.encode()) == plan
    fp32 = planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, weight_dtype=torch.float32,
                               side_stream=False, grad_store=True)
    assert fp32.kept_in_grad == grad_store.grad_store_layout(n, d, v, fp32.cols, 2, 4)[2] > 2 * 16 - 2
    # Fewer rows than features (a chunk's logits smaller than its dW): none there.
    assert planner.plan_chunks(512, 1024, v, torch.bfloat16, cuda, None, budget, side_stream=False,
                               grad_store=True).kept_in_grad == 0


def test_kept_probabilities_plans_keep_the_workspaces_chunk():
    """Where the kept chunks hold probabilities (kept_probs: the backward's workspace lives in the kept tensor),
    the budget keeps one chunk more at xc6M and xc6M_16k (7 against 6, beside 16 / 17 in the gradient's buffer),
    counting dX's float32 sums, the factored buffers and the widened forward's partials beside them; not with
    a weight in another dtype, no chunk in the gradient's buffer, or a budget that holds no chunk beside those
    buffers."""
    cuda = torch.device("cuda")  # planned only: no GPU is touched
    args = dict(direct_dx=True, side_stream=False, grad_store=True)
    for n, cols, in_grad in ((4096, 65536, 16), (16384, 16384, 17)):
        d, v, budget = 768, 6_000_000, 4 << 30
        old = planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, **args)
        new = planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, kept_probs=True, **args)
        assert (old.cols, old.kept_chunks, old.kept_in_grad) == (cols, 6 + in_grad, in_grad), old
        assert (new.cols, new.kept_chunks, new.kept_in_grad) == (cols, 7 + in_grad, in_grad), new
        chunk = n * cols * 2
        held = 2 * n * d * 6 + n * (cols * planner.FUSED_STATS_WIDEN // 128) * 8
        assert held + 7 * chunk <= budget < held + 8 * chunk
        fp32 = dict(args, weight_dtype=torch.float32)
        assert planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, kept_probs=True, **fp32) == \
            planner.plan_chunks(n, d, v, torch.bfloat16, cuda, None, budget, **fp32)
    offset, _, slots = grad_store.grad_store_layout(4096, 768, 6_000_000, 65536, 2, 2)
    assert planner.probs_kept_chunks(4096, 768, 65536, 92, 4 << 30, 2, offset, slots) == 7
    assert planner.probs_kept_chunks(4096, 768, 65536, 92, 4 << 30, 2, offset, 0) == 0  # no gradient buffer slot
    assert planner.probs_kept_chunks(4096, 768, 65536, 92, 4 << 30, 2, 100, slots) == 0  # no room for references
    assert planner.probs_kept_chunks(4096, 768, 65536, 92, 600 << 20, 2, offset, slots) == 0  # no chunk beside
    assert planner.probs_kept_chunks(4096, 768, 65536, 5, 4 << 30, 2, offset, slots) == 4  # all but one chunk


def test_planned_width_is_a_multiple_of_256_columns():
    """The planned width is rounded down to a multiple of 256 columns (aligned rows, whole 128-column tiles);
    a width pinned by chunk_size, or all the classes, is left alone."""
    cuda = torch.device("cuda")  # planned only: no GPU is touched
    assert planner.plan_chunks(16384, 768, 6_000_000, torch.bfloat16, cuda, None, 4 << 30).cols == 16384
    # (256 MiB - 3000 x 768 x 6 bytes of dX buffers) / (3000 rows x 2 bytes) = 42435 columns, rounded down
    plan = planner.plan_chunks(3000, 768, 6_000_000, torch.bfloat16, cuda, None, 256 << 20, side_stream=False)
    assert (plan.cols, plan.rows, plan.keep_logits) == (42240, 3000, False), plan
    assert planner.plan_chunks(16384, 768, 6_000_000, torch.bfloat16, cuda, 1000, 4 << 30).cols == 1000
    assert planner.plan_chunks(64, 8, 3000, torch.float32, cuda, None, 64 << 20).cols == 3000


def test_workspace_estimate_is_what_the_planner_plans():
    """hugehead.demo's "will it fit" asks the planner: two CPU shards of 3000 classes sharing 1 MiB stream
    their own plans' workspaces; a budget that holds every logit keeps them all."""
    cpu = torch.device("cpu")
    n, d, budget = 64, 16, 1 << 20
    plan = planner.plan_chunks(n, d, 3000, torch.float32, cpu, None,
                               budget_rule.resolve_budget(budget, cpu, shards_on_device=2))
    assert not plan.keep_logits or plan.kept_chunks * plan.cols < 3000
    kept = (plan.kept_chunks if plan.keep_logits else 0) * n * plan.cols * 4
    want = n * d * 8 + 2 * (kept + plan.rows * plan.cols * 4)
    assert workspace_bytes(n, d, [3000, 3000], torch.float32, cpu, memory_budget=budget) == want
    all_kept = workspace_bytes(n, d, [3000], torch.float32, cpu, memory_budget=64 << 20)
    assert all_kept == n * d * 8 + n * 3000 * 4


def test_out_of_memory_message_states_the_budget_used(monkeypatch):
    monkeypatch.setattr(hugehead.pinned, "available_host_memory", lambda: 40 << 20)
    x, w, target = _small()
    fail_next_mm(monkeypatch)
    head = hugehead.ChunkedClassifier(5, 40, bias=False, devices=["cpu", "cpu"], dtype=torch.float64, chunk_size=8)
    with pytest.raises(torch.OutOfMemoryError,
                       match=r"memory_budget=None, 10485760 bytes \(the default: min\(4 GiB, 1/4 of cpu's 0.04 GiB "
                             r"available\)\), shared by 2 shards on cpu"):
        head(x, target)


# --------------------------------------------------------------------------------------------------
# One plan per step
# --------------------------------------------------------------------------------------------------
def _grads(run):
    x, w, target = _small(torch.float32, n=48, d=24, v=6000, seed=3)
    x.requires_grad_()
    loss = run(x, w, target)
    loss.backward()
    return loss.detach(), x.grad


def test_module_backward_follows_the_forward_plan_when_the_budget_changes_in_between():
    """Forward with one budget, then a budget that would plan other chunk widths (and split the rows)
    before the backward: dX and dW are bitwise those of an undisturbed step."""
    def make():
        torch.manual_seed(0)
        return hugehead.ChunkedClassifier(24, 6000, bias=True, devices=["cpu", "cpu"], dtype=torch.float32,
                                          memory_budget=2 * (48 * 1024 * 4 + 48 * 24 * 8))

    results = []
    for disturb in (False, True):
        head = make()
        x, _, target = _small(torch.float32, n=48, d=24, v=6000, seed=3)
        x.requires_grad_()
        loss = head(x, target, return_lse=True)[0]
        if disturb:  # what a planner asked again now would see
            head.engine.memory_budget = 2 * (8 * 256 * 4 + 8 * 24 * 8)
        loss.backward()
        results.append((loss.detach(), x.grad, [p.grad for p in head.parameters()]))
    (loss0, dx0, dw0), (loss1, dx1, dw1) = results
    assert torch.equal(loss0, loss1)
    assert torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(dw0, dw1))


@pytest.mark.parametrize("where", ["functional", "module"])
def test_backward_follows_the_forward_plan_when_free_memory_changes_in_between(monkeypatch, where):
    """The free-memory query the planner sees changes between forward and backward (memory_budget=None):
    dX and dW are bitwise those of an undisturbed step."""
    free = {"bytes": 4 * (48 * 2048 * 4 + 48 * 24 * 8)}
    monkeypatch.setattr(budget_rule, "free_memory", lambda device, exact_below=None: free["bytes"])
    results = []
    for disturb in (False, True):
        free["bytes"] = 4 * (48 * 2048 * 4 + 48 * 24 * 8)  # a quarter of it: 2048-wide chunks, nothing kept
        x, w, target = _small(torch.float32, n=48, d=24, v=6000, seed=3)
        x.requires_grad_()
        w.requires_grad_()
        if where == "functional":
            loss = hugehead.linear_cross_entropy(x, w, target)
            params = [w]
        else:
            torch.manual_seed(0)
            head = hugehead.ChunkedClassifier(24, 6000, devices=["cpu"], dtype=torch.float32)
            loss = head(x, target)
            params = list(head.parameters())
        if disturb:
            free["bytes"] = 4 * (8 * 256 * 4 + 8 * 24 * 8)  # 256-wide chunks of 8 rows, were it asked again
        loss.backward()
        results.append((x.grad, [p.grad for p in params]))
    (dx0, dw0), (dx1, dw1) = results
    assert torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(dw0, dw1))


def test_functional_plans_once_per_training_step(monkeypatch):
    calls = []
    real = planner.plan_chunks

    def counting(*args, **kwargs):
        calls.append(args[:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_chunks", counting)
    monkeypatch.setattr(hugehead.lce_op, "plan_chunks", counting)
    x, w, target = _small()
    x.requires_grad_()
    hugehead.linear_cross_entropy(x, w, target, chunk_size=8).backward()
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------------
# [..., D] inputs, second-order gradients
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("where", ["functional", "module"])
def test_leading_dimensions_follow_cross_entropy(where, reduction):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (3, 4), generator=g)
    target[1, 2] = -100
    if where == "functional":
        w = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
        loss, lse = hugehead.linear_cross_entropy(x, w, target, reduction=reduction, chunk_size=16, return_lse=True)
        weight = w
    else:
        torch.manual_seed(1)
        head = hugehead.ChunkedClassifier(8, 37, bias=False, devices=["cpu", "cpu"], dtype=torch.float64,
                                          chunk_size=16, reduction=reduction)
        loss, lse = head(x, target, return_lse=True)
        weight = torch.cat([s.weight for s in head.shards])
    ref_x = x.detach().clone().requires_grad_()
    logits = ref_x @ weight.detach().t()
    ref = F.cross_entropy(logits.view(-1, 37), target.view(-1), reduction=reduction)
    if reduction == "none":
        ref = ref.view(3, 4)
    assert loss.shape == ref.shape and lse.shape == (3, 4)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1).detach(), rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"x must be \[N, D\] with target \[N\], or \[\.\.\., D\]"):
        (hugehead.linear_cross_entropy(x, weight, target.view(-1)) if where == "functional" else
         head(x, target.view(-1)))


@pytest.mark.parametrize("where", ["functional", "module"])
def test_second_order_gradients_raise_not_supported(where):
    x, w, target = _small()
    x.requires_grad_()
    if where == "functional":
        w.requires_grad_()
        loss = hugehead.linear_cross_entropy(x, w, target)
    else:
        loss = hugehead.ChunkedClassifier(5, 40, devices=["cpu", "cpu"], dtype=torch.float64)(x, target)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"second-order gradients .* are not supported"):
        gx.sum().backward()
    # First-order gradients under create_graph=True are still right.
    (plain,) = torch.autograd.grad(loss, x, retain_graph=True)
    torch.testing.assert_close(gx.detach(), plain, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) of a model holding a head
# --------------------------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        torch.manual_seed(2)
        self.backbone = torch.nn.Linear(6, 8, dtype=torch.float64, device=device)
        self.head = hugehead.ChunkedClassifier(8, 50, devices=[device] * 3, dtype=torch.float64,
                                               chunk_size=8, label_smoothing=0.1, softcap=4.0)

    def forward(self, x, target):
        return self.head(torch.tanh(self.backbone(x)), target)


def test_compile_fullgraph_of_a_model_with_a_chunked_head_matches_eager(device):
    """Three shards (on the CPU, or on one GPU: the multi-stream overlap is an eager-only plan)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64).to(device)
    target = torch.randint(0, 50, (10,), generator=g).to(device)
    target[3] = -100
    eager, compiled_model = _Model(str(device)), _Model(str(device))
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    want = eager(x, target)
    want.backward()
    got = compiled(x, target)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-13, msg=name)
    # The range check still runs inside the compiled graph.
    bad = target.clone()
    bad[0] = 50
    with pytest.raises((ValueError, RuntimeError), match=r"out of range for 50 classes"):
        compiled(x, bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_checked_targets_exempts_ignore_index_anywhere_and_names_the_first_bad_row(device, dtype):
    v = 10
    for ignore_index in (-100, 15, 3, None):
        ok = torch.tensor([0, 9, 4, -100 if ignore_index is None else ignore_index, 2], dtype=dtype, device=device)
        if ignore_index is None:
            ok[3] = 5
        out = hugehead.options.check_targets(ok, v, ignore_index)
        assert out.dtype == torch.int64 and out.is_contiguous() and torch.equal(out.cpu(), ok.long().cpu())
        assert out.data_ptr() != ok.data_ptr()
        for bad_rows, bad_value in (([4, 1], 10), ([2, 3], -1), ([0], -101), ([3, 0], 16)):
            bad = ok.clone()
            bad[torch.tensor(bad_rows, device=device)] = bad_value
            if bad_value == ignore_index:
                continue
            with pytest.raises(ValueError, match=rf"target {bad_value} at row {min(bad_rows)} is out of range "
                                                 rf"for 10 classes \(valid: 0..9"):
                hugehead.options.check_targets(bad, v, ignore_index)
    empty = hugehead.options.check_targets(torch.empty(0, dtype=dtype, device=device), v, -100)
    assert empty.shape == (0,) and empty.dtype == torch.int64


@requires_cuda
@pytest.mark.parametrize("case", ["forward", "recompute", "rows"])
def test_cuda_step_does_not_synchronize(case, monkeypatch):
    """No synchronizing CUDA call in the whole step: the target check waits on its own event once the loop's
    kernels are queued (start_target_check), planning reads no free memory, the loop and the backward none."""
    if case == "rows":  # a few hundred rows get the rows plan on a GPU too (as in test_rows.py)
        monkeypatch.setitem(planner.ROWS_MIN_SPLIT_ROWS, "cuda", planner.ROWS_MIN_SPLIT_ROWS["cpu"])
    n, d, v = 256, 64, 5000
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=case != "forward")
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, requires_grad=case != "forward")
    target = torch.randint(0, v, (n,), device="cuda")
    target[::7] = -100
    budget = {"forward": None, "recompute": n * 1024 * 2 + n * d * 6, "rows": 64 * v * 2 + n * d * 2}[case]
    hugehead.linear_cross_entropy(x, w, target, memory_budget=budget)  # warm-up (allocator, kernels' first launch)
    if case == "forward":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.no_grad():
                    hugehead.linear_cross_entropy(x, w, target)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(c.message) for c in caught if "called a synchronizing" in str(c.message)]
        assert not syncs, syncs
        return
    plan = planner.plan_loss(n, d, v, torch.bfloat16, torch.device("cuda"), None, budget, allow_rows=True,
                             direct_dx=True)
    assert plan.kind == case, plan
    forward_syncs, syncs = host_syncs_of_step(lambda: hugehead.linear_cross_entropy(x, w, target,
                                                                                    memory_budget=budget))
    assert forward_syncs == 0 and not syncs, syncs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["host copy", "device reduction"])
def test_start_target_check_raises_in_its_finisher_on_cuda_and_at_once_elsewhere(device, where, monkeypatch):
    """On CUDA the check is queued (a copy of the targets, or past HOST_CHECK_MAX_ROWS rows a reduction's two
    values) and raises in its finisher, with the same message either way; elsewhere at once."""
    if where == "device reduction":
        monkeypatch.setattr(hugehead.options, "HOST_CHECK_MAX_ROWS", 2)
    good = torch.tensor([0, 9, -100, 4], device=device)
    hugehead.options.start_target_check(good, 10, -100)()  # nothing to raise
    bad = torch.tensor([0, 9, 12, 4, -1], device=device)
    message = r"target 12 at row 2 is out of range for 10 classes \(valid: 0..9, or ignore_index=-100\)"
    if device == "cuda":
        finish = hugehead.options.start_target_check(bad, 10, -100)  # queued: does not raise yet
        with pytest.raises(ValueError, match=message):
            finish()
        torch.cuda.synchronize()  # the context is fine
    else:
        with pytest.raises(ValueError, match=message):
            hugehead.options.start_target_check(bad, 10, -100)
    assert hugehead.options.start_target_check(bad[:0], 10, None)() is None


@pytest.mark.parametrize("case", ["chunks", "rows"])
def test_target_check_starts_once_the_first_gemm_is_queued(case, monkeypatch):
    """The single-device ops start the target check (on CUDA a pinned buffer, a copy and an event) once the loop
    has queued its first chunk's GEMM, not before it (an eager step's GPU idles until that launch): once a call,
    and a bad id still raises the same ValueError, from the forward."""
    from hugehead import lce_op, loop

    calls = []
    real_check, real_logits = lce_op.start_target_check, loop.chunks._logits_into
    monkeypatch.setattr(lce_op, "start_target_check", lambda *a: calls.append("check") or real_check(*a))
    # where each path's logits GEMM is looked up: the streamed chunks', the rows plan's stored blocks'
    where = {"chunks": loop.streamed, "rows": loop.fused}[case]
    monkeypatch.setattr(where, "_logits_into", lambda *a: calls.append("gemm") or real_logits(*a))
    n, d, v = 64, 16, 700
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=case == "rows")
    w = torch.randn(v, d, dtype=torch.float64, requires_grad=case == "rows")
    target = torch.randint(0, v, (n,))
    target[::5] = -100
    budget = {"chunks": 256 * n * 8 + n * d * 16, "rows": 32 * v * 8 + n * d * 8}[case]
    plan = planner.plan_loss(n, d, v, torch.float64, x.device, None, budget, allow_rows=case == "rows",
                             direct_dx=True)
    assert plan.kind == {"chunks": "recompute", "rows": "rows"}[case] and (plan.cols < v or plan.rows < n), plan
    with torch.set_grad_enabled(case == "rows"):
        loss = hugehead.linear_cross_entropy(x, w, target, memory_budget=budget)
    assert calls.count("check") == 1 and calls[0] == "gemm" and calls.count("gemm") >= 2, calls
    ref = F.cross_entropy(x @ w.T, target)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    target[9] = v
    with pytest.raises(ValueError, match=rf"target {v} at row 9 is out of range for {v} classes"):
        hugehead.linear_cross_entropy(x, w, target, memory_budget=budget)


@requires_cuda
@pytest.mark.parametrize("case", ["forward", "rows"])
def test_cuda_out_of_range_target_raises_after_the_queued_loop_and_leaves_the_context_usable(case, monkeypatch):
    """The loop's kernels run on the bad ids before the deferred check raises: they read nothing out of bounds
    (compute-sanitizer's memcheck covers the kernels; here the context stays usable and the next call exact)."""
    if case == "rows":
        monkeypatch.setitem(planner.ROWS_MIN_SPLIT_ROWS, "cuda", planner.ROWS_MIN_SPLIT_ROWS["cpu"])
    n, d, v = 256, 64, 5000
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=case == "rows")
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, requires_grad=case == "rows")
    budget = 64 * v * 2 + n * d * 2 if case == "rows" else None
    for bad_value in (v, 1 << 40, -5):
        target = torch.randint(0, v, (n,), device="cuda")
        target[77] = bad_value
        with pytest.raises(ValueError, match=rf"target {bad_value} at row 77 is out of range for {v} classes"):
            hugehead.linear_cross_entropy(x, w, target, memory_budget=budget)
    target[77] = 3
    loss = hugehead.linear_cross_entropy(x, w, target, memory_budget=budget)
    ref = torch.nn.functional.cross_entropy(x.double() @ w.double().T, target)
    assert abs(loss.item() - ref.item()) <= 2e-2 * abs(ref.item())


def test_opcheck_checked_targets():
    target = torch.tensor([3, -100, 0, 9])
    for ignore_index in (-100, None):
        args = (target if ignore_index is not None else target.clamp(min=0), 10, ignore_index, "target")
        torch.library.opcheck(torch.ops.hugehead.checked_targets.default, args)
    with pytest.raises(ValueError, match=r"target -100 at row 1 is out of range for 10 classes \(valid: 0..9\)"):
        hugehead.options.check_targets(target, 10, None)
    out = hugehead.options.check_targets(target.int(), 10, -100)
    assert out.dtype == torch.int64 and torch.equal(out, target)
