"""The softmax against a sparse probability target (and class ids with class weights) through the "rows" plan
(hugehead.plan.plan_rows, op hugehead::linear_softmax_csr_rows): loss, dX, dW and db against float64 dense
PyTorch (F.cross_entropy with target.to_dense() / weight=) for "mean" and "sum" with every option, empty rows,
a row with every label and ignored rows; 16-bit within 2x plain PyTorch's error; CPU autocast with the weight
cast chunk by chunk; the plan is taken exactly where the class-id loss takes it (Tuning(rows=False), "none",
return_lse, a pinned chunk_size, no gradients, a head of several shards: not); the incoming gradient's
scale; a second backward refused clearly; torch.compile; opcheck. Every test that claims the rows plan
checks that the rows op ran with the planned blocks."""
import pytest
import torch
import torch.nn.functional as F

import hugehead
from hugehead import tuning
from conftest import DEVICES, rel_err, requires_cuda, rows_budget
from hugehead import multilabel, target_prep
from hugehead import plan as planner
from hugehead.budget import resolve_budget
from hugehead.plan import ROWS_BLOCKS, plan_loss

OPTION_SETS = [
    dict(),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(softcap=4.0),
    dict(label_smoothing=0.2, z_loss=1e-3, softcap=5.0),
]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # Shapes of a few hundred rows: on a GPU the planner does not split rows into blocks under
    # ROWS_MIN_SPLIT_ROWS["cuda"] (1024); give it the CPU's floor so the CUDA runs take the rows plan too.
    monkeypatch.setitem(planner.ROWS_MIN_SPLIT_ROWS, "cuda", planner.ROWS_MIN_SPLIT_ROWS["cpu"])


@pytest.fixture
def rows_calls(monkeypatch):
    """The plans (decoded from the op's plan argument) of every call of the rows op."""
    calls = []
    op = torch.ops.hugehead.linear_softmax_csr_rows

    def spy(*args):
        calls.append(planner.Plan.decode(args[-1]))
        return op(*args)

    monkeypatch.setattr(torch.ops.hugehead, "linear_softmax_csr_rows", spy)
    return calls


def _inputs(n, d, v, dtype, device, bias, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * scale / d ** 0.5
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.1 if bias else None
    return [None if t is None else t.to(device, dtype) for t in (x, w, b)]


def _dense_target(n, v, seed=0, positives=None):
    """Dense float64 ``[n, v]``: random sparse rows (``positives`` entries each, or ~5%), row 0 empty, row 1
    every label, row 4 summing to 5 (rows need not sum to 1)."""
    g = torch.Generator().manual_seed(seed)
    if positives is None:
        t = (torch.rand(n, v, generator=g) < 0.05).double() * torch.rand(n, v, generator=g, dtype=torch.float64)
    else:
        t = torch.zeros(n, v, dtype=torch.float64)
        # distinct classes per row: sorted draws from [0, v - k + 1) made distinct by adding their rank
        cols = torch.randint(0, v - positives + 1, (n, positives), generator=g).sort(dim=1).values
        t.scatter_(1, cols + torch.arange(positives), 1.0 / positives)
    t[0] = 0
    t[1] = torch.rand(v, generator=g, dtype=torch.float64)
    t[4] = 0
    t[4, [3, 4]] = 2.5
    return t


def _unsorted_coo(t, device):
    """A duplicate-free COO tensor of ``t`` with its entries shuffled (not coalesced)."""
    idx = t.nonzero().t()
    idx = idx[:, torch.randperm(idx.shape[1], generator=torch.Generator().manual_seed(3))]
    return torch.sparse_coo_tensor(idx, t[idx[0], idx[1]], t.shape).to(device)


def _class_weight(v, seed=5):
    return torch.rand(v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5


def _run(fn, x, w, b, grad_out=1.0):
    """``(loss, dx, dw, db)`` of ``fn(x, w, b)`` on leaf copies, backpropagated with ``grad_out``."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    loss = fn(x, w, b)
    (loss * grad_out).backward()
    return loss.detach(), x.grad, w.grad, None if b is None else b.grad


def _plain(x, w, b, target, class_weight=None, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Dense PyTorch, hugehead's documented loss: F.cross_entropy's per-row losses of the (softcapped)
    logits (float32 for 16-bit ones), + ``z_loss lse²`` per row not ignored, reduced as F.cross_entropy
    reduces (``"mean"``: over N for probability targets, over ``Σ w_y`` of the rows not ignored for ids)."""
    z = F.linear(x, w, b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if z.dtype in (torch.bfloat16, torch.float16):
        z = z.float()
    cw = None if class_weight is None else class_weight.to(z.device, z.dtype)
    loss = F.cross_entropy(z, target, weight=cw, reduction="none", label_smoothing=label_smoothing)
    valid = None if target.is_floating_point() else target != -100
    if z_loss:
        lse2 = torch.logsumexp(z, 1).square()
        loss = loss + z_loss * (lse2 if valid is None else torch.where(valid, lse2, torch.zeros_like(lse2)))
    if reduction != "mean":
        return loss.sum() if reduction == "sum" else loss
    if valid is None:
        return loss.sum() / loss.shape[0]
    safe = target.clamp(min=0)
    return loss.sum() / (valid.to(z.dtype) if cw is None else torch.where(valid, cw[safe], 0.0)).sum()


def _reference(x, w, b, target, grad_out=1.0, **opts):
    cast = [None if t is None else t.detach().double().cpu() for t in (x, w, b)]
    target = target.cpu()
    if target.is_floating_point():
        target = target.double()
    return _run(lambda x_, w_, b_: _plain(x_, w_, b_, target, **opts), *cast, grad_out=grad_out)


def _check(ours, ref, tol):
    for a, r, name in zip(ours, ref, ("loss", "dX", "dW", "db")):
        if r is not None:
            assert rel_err(a, r) <= tol, (name, rel_err(a, r))


def _assert_rows(calls, n, block_rows, plans=1):
    assert len(calls) == plans, calls
    assert all(c.kind == "rows" and c.rows == block_rows for c in calls) and -(-n // block_rows) > 1, calls


# --------------------------------------------------------------------------------------------------
# Correctness against float64 dense PyTorch
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opt_index", range(len(OPTION_SETS)))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_sparse_target_rows_plan_matches_dense_float64(device, reduction, opt_index, weighted, bias, rows_calls):
    n, d, v = 220, 24, 77  # 7 blocks of 32 rows, the last one short
    x, w, b = _inputs(n, d, v, torch.float64, device, bias, seed=opt_index, scale=3.0)
    t = _dense_target(n, v, seed=opt_index)
    cw = _class_weight(v) if weighted else None
    opts = dict(reduction=reduction, class_weight=cw, **OPTION_SETS[opt_index])
    budget = rows_budget(n, d, v, torch.float64, 32)
    ours = _run(lambda x_, w_, b_: hugehead.linear_cross_entropy(
        x_, w_, _unsorted_coo(t, device), b_, memory_budget=budget,
        **{**opts, "class_weight": None if cw is None else cw.to(device)}), x, w, b, grad_out=1.5)
    _assert_rows(rows_calls, n, 32)
    ref = _reference(x, w, b, t, grad_out=1.5, **opts)
    assert ours[0].dtype == torch.float64 and ours[0].dim() == 0
    _check(ours, ref, 1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
def test_class_weight_index_targets_with_ignored_rows_rows_plan(device, reduction, label_smoothing, rows_calls):
    n, d, v = 160, 16, 90  # 4 blocks of 40 rows
    x, w, b = _inputs(n, d, v, torch.float64, device, True, seed=7, scale=2.0)
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(2))
    y[::7] = -100
    cw = _class_weight(v)
    ours = _run(lambda x_, w_, b_: hugehead.linear_cross_entropy(
        x_, w_, y.to(device), b_, class_weight=cw.to(device), reduction=reduction, label_smoothing=label_smoothing,
        z_loss=1e-3, memory_budget=rows_budget(n, d, v, torch.float64, 40)), x, w, b)
    _assert_rows(rows_calls, n, 40)
    _check(ours, _reference(x, w, b, y, class_weight=cw, reduction=reduction, label_smoothing=label_smoothing,
                            z_loss=1e-3), 1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_rows_mean_is_nan_with_zero_gradients(device, rows_calls):
    n, d, v = 96, 8, 30
    x, w, b = _inputs(n, d, v, torch.float64, device, True)
    y = torch.full((n,), -100, device=device)
    loss, dx, dw, db = _run(lambda x_, w_, b_: hugehead.linear_cross_entropy(
        x_, w_, y, b_, class_weight=_class_weight(v).to(device), memory_budget=rows_budget(n, d, v, torch.float64, 32)),
        x, w, b)
    _assert_rows(rows_calls, n, 32)
    assert torch.isnan(loss)  # 0 / 0, as F.cross_entropy(..., weight=...)
    assert not dx.any() and not dw.any() and not db.any()


def _assert_within_2x_plain(ours, plain, ref, dtype):
    for a, p, r, name in zip(ours, plain, ref, ("loss", "dX", "dW", "db")):
        if r is None:
            continue
        assert a.dtype == (torch.float32 if name == "loss" else dtype), name
        err, err_plain = rel_err(a, r), rel_err(p, r)
        assert err <= 2.0 * err_plain + torch.finfo(dtype).eps, (name, err, err_plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_16bit_within_2x_of_plain_pytorch(device, dtype, reduction, rows_calls):
    n, d, v = 64 * ROWS_BLOCKS, 64, 384
    x, w, b = _inputs(n, d, v, dtype, device, True, seed=11, scale=2.0)
    t = _dense_target(n, v, seed=3, positives=5)
    opts = dict(reduction=reduction, label_smoothing=0.1, class_weight=_class_weight(v))
    ours = _run(lambda x_, w_, b_: hugehead.linear_cross_entropy(
        x_, w_, t.to_sparse_csr().to(device), b_, memory_budget=rows_budget(n, d, v, dtype, 64),
        **{**opts, "class_weight": opts["class_weight"].to(device)}), x, w, b)
    _assert_rows(rows_calls, n, 64)
    plain = _run(lambda x_, w_, b_: _plain(x_, w_, b_, t.to(device).float(), **opts), x, w, b)
    _assert_within_2x_plain(ours, plain, _reference(x, w, b, t, **opts), dtype)


@pytest.mark.parametrize("api", ["functional", "module"])
def test_cpu_bf16_autocast_casts_the_weight_chunk_by_chunk(api, rows_calls, monkeypatch):
    from hugehead.loop.sources import ResidentChunks

    n, d, v = 96, 16, 9000  # 2 chunks of 8192 classes (CPU) per block, 3 blocks of 32 rows
    x, w, b = _inputs(n, d, v, torch.float32, "cpu", True, seed=4, scale=3.0)
    t = _dense_target(n, v, seed=2, positives=5)
    itemsize, cols = 2, 8192
    budget = 32 * (v * itemsize + d * (4 + itemsize)) + n * d * itemsize + 3 * cols * d * itemsize
    widest = []
    chunks = ResidentChunks.chunks

    def spy(self, width):  # every cast weight chunk is at most the plan's width: never a whole bf16 copy
        for chunk in chunks(self, width):
            widest.append(chunk.c1 - chunk.c0)
            yield chunk

    monkeypatch.setattr(ResidentChunks, "chunks", spy)
    opts = dict(label_smoothing=0.1)
    if api == "functional":
        def fn(x_, w_, b_):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return hugehead.linear_cross_entropy(x_, w_, t.to_sparse_csr(), b_, memory_budget=budget, **opts)
        ours = _run(fn, x, w, b)
    else:
        head = hugehead.ChunkedClassifier(d, v, bias=True, devices=["cpu"], memory_budget=budget, **opts)
        with torch.no_grad():
            head.shards[0].weight.copy_(w)
            head.shards[0].bias.copy_(b)
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = head(xg, t.to_sparse_csr())
        loss.backward()
        ours = (loss.detach(), xg.grad, head.shards[0].weight.grad, head.shards[0].bias.grad)
    assert [(c.kind, c.rows, c.cols, c.budget) for c in rows_calls] == [("rows", 32, cols, budget)], rows_calls
    assert widest and max(widest) <= cols

    def plain(x_, w_, b_):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(F.linear(x_, w_, b_).float(), t.float(), **opts)

    plain_out = _run(plain, x, w, b)
    ref = _reference(x, w, b, t, **opts)
    for a, p, r, name in zip(ours, plain_out, ref, ("loss", "dX", "dW", "db")):
        assert a.dtype == torch.float32, name  # float32 x and Parameters get float32 gradients
        err, err_plain = rel_err(a, r), rel_err(p, r)
        assert err <= 2.0 * err_plain + torch.finfo(torch.bfloat16).eps, (name, err, err_plain)


# --------------------------------------------------------------------------------------------------
# Where the plan applies: exactly where the class-id loss takes it
# --------------------------------------------------------------------------------------------------
def test_rows_plan_is_the_class_id_plan():
    n, d, v = 96, 8, 21
    x, w, b = (t.requires_grad_() for t in _inputs(n, d, v, torch.float32, "cpu", True))
    for budget in (rows_budget(n, d, v, torch.float32, 32), 1 << 30, 4096):
        for kwargs in (dict(), dict(return_lse=True), dict(reduction="none"), dict(chunk_size=8)):
            ids = plan_loss(n, d, v, torch.float32, x.device, kwargs.get("chunk_size"), budget, allow_rows=(
                "return_lse" not in kwargs and kwargs.get("reduction") != "none"), direct_dx=True)
            ours = multilabel.plan_softmax(x, w, b, reduction=kwargs.get("reduction", "mean"),
                                           return_lse=kwargs.get("return_lse", False),
                                           chunk_size=kwargs.get("chunk_size"), memory_budget=budget)
            assert ours == ids, (budget, kwargs)
    assert multilabel.plan_softmax(x, w, b, reduction="sum", return_lse=False, chunk_size=None,
                                   memory_budget=rows_budget(n, d, v, torch.float32, 32)).kind == "rows"


def test_functional_uses_the_rows_plan_only_where_it_applies(rows_calls, monkeypatch):
    n, d, v = 96, 8, 21
    x, w, b = _inputs(n, d, v, torch.float64, "cpu", True)
    t = _dense_target(n, v)
    budget = rows_budget(n, d, v, torch.float64, 32)
    for kwargs, grad, allowed, used in [
        (dict(), True, True, True),
        (dict(reduction="sum"), True, True, True),
        (dict(), True, False, False),  # Tuning(rows=False) turns it off
        (dict(reduction="none"), True, True, False),
        (dict(return_lse=True), True, True, False),
        (dict(chunk_size=4), True, True, False),
        (dict(memory_budget=None), True, True, False),  # the default budget keeps all logits: faster
        (dict(), False, True, False),
    ]:
        rows_calls.clear()
        xg = x.clone().requires_grad_(grad)
        with tuning.override(rows=allowed):
            out = hugehead.linear_cross_entropy(xg, w, t.to_sparse_csr(), b, **{"memory_budget": budget, **kwargs})
        loss = out[0] if isinstance(out, tuple) else out
        ref = _plain(x, w, b, t, reduction=kwargs.get("reduction", "mean"))
        assert rel_err(loss, ref) <= 1e-12, kwargs
        assert bool(rows_calls) == used, kwargs
        if grad:
            loss.sum().backward()
            xr = x.clone().requires_grad_()
            _plain(xr, w, b, t, reduction=kwargs.get("reduction", "mean")).sum().backward()
            assert rel_err(xg.grad, xr.grad) <= 1e-12, kwargs


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
@pytest.mark.parametrize("kind", ["sparse", "index_weighted"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_classifier_one_local_shard_uses_rows(devices, kind, reduction, rows_calls):
    n, d, v = 96, 8, 40
    budget = rows_budget(n, d, v, torch.float64, 32) // len(devices)
    cw = _class_weight(v) if kind == "index_weighted" else None
    torch.manual_seed(2)
    head = hugehead.ChunkedClassifier(d, v, bias=True, devices=devices, memory_budget=budget, reduction=reduction,
                                      label_smoothing=0.1, z_loss=1e-3, softcap=5.0, class_weight=cw,
                                      dtype=torch.float64)
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, v, (n,))
    y[::9] = -100
    t = _dense_target(n, v)
    target = y if kind == "index_weighted" else _unsorted_coo(t, "cpu")
    loss = head(x, target)
    (loss.sum() * 1.5).backward()
    if len(devices) == 1 and reduction != "none":
        _assert_rows(rows_calls, n, 32)
    else:
        assert not rows_calls
    w = torch.cat([s.weight for s in head.shards]).detach().requires_grad_()
    b = torch.cat([s.bias for s in head.shards]).detach().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref = _plain(xr, w, b, y if kind == "index_weighted" else t, class_weight=cw, reduction=reduction,
                 label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    (ref.sum() * 1.5).backward()
    assert rel_err(loss, ref) <= 1e-10
    assert rel_err(x.grad, xr.grad) <= 1e-10
    assert rel_err(torch.cat([s.weight.grad for s in head.shards]), w.grad) <= 1e-10
    assert rel_err(torch.cat([s.bias.grad for s in head.shards]), b.grad) <= 1e-10


# --------------------------------------------------------------------------------------------------
# The backward: twice, second order; torch.compile; opcheck
# --------------------------------------------------------------------------------------------------
def test_second_backward_and_second_order_raise_clearly(rows_calls):
    n, d, v = 96, 8, 21
    x, w, b = (t.requires_grad_() for t in _inputs(n, d, v, torch.float32, "cpu", True))
    t = _dense_target(n, v).float().to_sparse_csr()
    budget = rows_budget(n, d, v, torch.float32, 32)
    loss = hugehead.linear_cross_entropy(x, w, t, b, memory_budget=budget)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already used by a first backward"):
        loss.backward()
    loss = hugehead.linear_cross_entropy(x, w, t, b, memory_budget=budget)
    (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
    with pytest.raises(RuntimeError, match="second-order gradients"):
        gx.sum().backward()
    assert len(rows_calls) == 2


def test_compiled_function_matches_eager(monkeypatch):
    from hugehead import lce_op
    from hugehead.targets import SoftmaxCsrTarget

    # A spy on the loop, not on torch.ops.hugehead (the compiler's decomposition tables read every op there).
    calls = []
    steps = lce_op.rows_steps

    def spy(x, source, target, options, plan, *args):
        calls.append((type(target), plan.rows))
        return steps(x, source, target, options, plan, *args)

    monkeypatch.setattr(lce_op, "rows_steps", spy)
    torch._dynamo.reset()
    n, d, v = 96, 8, 21
    x, w, b = (t.requires_grad_() for t in _inputs(n, d, v, torch.float64, "cpu", True))
    tc = hugehead.csr_target(_dense_target(n, v).to_sparse_coo())
    budget = rows_budget(n, d, v, torch.float64, 32)

    def step(x, w, b):
        h = torch.tanh(x) * 1.5
        return hugehead.linear_cross_entropy(h, w, tc, b, label_smoothing=0.1, memory_budget=budget) + h.square().mean()

    got = step(x, w, b)
    want = torch.autograd.grad(got, [x, w, b])
    ref = torch.compile(step, backend="aot_eager")(x, w, b)
    assert calls == [(SoftmaxCsrTarget, 32)] * 2, calls
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    for a, r in zip(want, torch.autograd.grad(ref, [x, w, b])):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sparse", "index_weighted"])
def test_opcheck_rows_op(device, kind):
    n, d, v = 12, 5, 9
    x, w, b = _inputs(n, d, v, torch.float32, device, True)
    if kind == "sparse":
        target, cw = _dense_target(n, v).float().to_sparse_coo().to(device), None
    else:
        target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1)).to(device)
        target[::4] = -100
        cw = _class_weight(v).float().to(device)
    chunk, rows = target_prep.softmax_target(target, n, v, class_weight=cw, label_smoothing=0.1, ignore_index=-100,
                                            dtype=torch.float32, device=x.device)
    s = chunk.stats
    for mean in (True, False):
        args = (x, w, b, s.crow, s.col, s.row, s.val, chunk.grad_val, chunk.mass, rows.row_weight, rows.weight_sum,
                rows.valid, chunk.class_weight, 0.1, 1e-3, 3.0, mean, True, True, True,
                planner.Plan(rows=4, cols=v, grad_in_forward=True).encode())
        torch.library.opcheck(torch.ops.hugehead.linear_softmax_csr_rows.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# --------------------------------------------------------------------------------------------------
# CUDA: the sizes of a GPU's blocks (its own floor of 1024 rows a block)
# --------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_plan_matches_float64_at_gpu_block_sizes(dtype, rows_calls, monkeypatch):
    monkeypatch.setitem(planner.ROWS_MIN_SPLIT_ROWS, "cuda", 1024)
    n, d, v = 4000, 128, 32_768
    x, w, b = _inputs(n, d, v, dtype, "cuda", True, scale=4.0)
    t = _dense_target(n, v, seed=1, positives=5)
    opts = dict(label_smoothing=0.1, softcap=20.0, class_weight=_class_weight(v))
    ours = _run(lambda x_, w_, b_: hugehead.linear_cross_entropy(
        x_, w_, t.to_sparse_coo().to("cuda"), b_, memory_budget=rows_budget(n, d, v, dtype, 1024),
        **{**opts, "class_weight": opts["class_weight"].to("cuda")}), x, w, b, grad_out=0.5)
    _assert_rows(rows_calls, n, 1024)
    ref = _reference(x, w, b, t, grad_out=0.5, **opts)
    if dtype == torch.float32:
        _check(ours, ref, 1e-5)
    else:
        plain = _run(lambda x_, w_, b_: _plain(x_, w_, b_, t.to("cuda").float(), **opts), x, w, b, grad_out=0.5)
        _assert_within_2x_plain(ours, plain, ref, dtype)


@requires_cuda
def test_cuda_default_budget_at_xc1m_like_rows_takes_the_rows_plan_like_class_ids():
    """At xc1M's shape (N 8192, D 768, V 1M, bf16) the single-label step takes the rows plan at the default
    budget; the multi-label softmax's plan is the same one (the shape's inputs are not allocated)."""
    class Meta:  # plan_softmax reads shapes, dtypes, the device and requires_grad only
        def __init__(self, *shape):
            self.shape, self.dtype, self.device, self.requires_grad = shape, torch.bfloat16, torch.device("cuda"), True

    x, w = Meta(8192, 768), Meta(1_000_000, 768)
    ids = plan_loss(8192, 768, 1_000_000, torch.bfloat16, torch.device("cuda"), None, None, allow_rows=True,
                    direct_dx=True)
    ours = multilabel.plan_softmax(x, w, None, reduction="mean", return_lse=False, chunk_size=None,
                                   memory_budget=None)
    assert ours == ids
    if resolve_budget(None, torch.device("cuda")).bytes >= 4 << 30:
        assert ours.kind == "rows", ours


# --------------------------------------------------------------------------------------------------
# bench/bench_multilabel.py records each softmax case's plan
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
def test_bench_multilabel_smoke_records_the_plans(tmp_path):
    import json
    import sys
    from pathlib import Path

    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's bench package
    from bench import bench_multilabel

    smoke = ["--smoke", "--reps", "1", "--warmup", "1"]
    paths = bench_multilabel.main([*smoke, "--out", str(tmp_path / "default")])
    (row,) = json.loads(Path(paths["json"]).read_text())["rows"]
    assert row["single_plan"] == row["multi_plan"] == "kept"  # tiny logits fit the default budget
    assert row["multi_vs_single_rel"] <= 1e-6 and "multi_ms" in row and "multi_no_rows_ms" not in row
    assert "kept / kept" in Path(paths["md"]).read_text()
    # A budget of two blocks of 32 rows (smoke: 64 x 32 x 4096, float32): the rows plan, and its A/B.
    budget = 32 * 4096 * 4 + 64 * 32 * 4
    paths = bench_multilabel.main([*smoke, "--memory-budget", str(budget), "--out", str(tmp_path / "rows")])
    (row,) = json.loads(Path(paths["json"]).read_text())["rows"]
    assert row["single_plan"] == row["multi_plan"] == "rows"
    assert row["multi_no_rows_ms"] > 0 and abs(row["multi_no_rows_loss"] - row["multi_loss"]) <= 1e-5 * row["multi_loss"]
    assert "rows / rows" in Path(paths["md"]).read_text()
