"""hugehead.linear_cross_entropy with sparse probability targets and class weights, and
hugehead.linear_binary_cross_entropy, against float64 dense PyTorch (F.cross_entropy with a dense
probability target / weight=, F.binary_cross_entropy_with_logits): every reduction and option, values and
gradients of x, weight and bias, empty rows, a row with every label, unsorted duplicate-free COO input,
ignored rows with class weights; the streamed, kept-logits and gradient-in-forward paths; bad inputs;
autocast; torch.compile; opcheck of the registered ops."""
import pytest
import torch
import torch.nn.functional as F

import hugehead
from hugehead import multilabel

from conftest import rel_err, requires_cuda, requires_multigpu

N, D, V = 13, 16, 700


def make_inputs(device, dtype=torch.float64, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    return [None if t is None else t.to(device, dtype).requires_grad_() for t in (x, w, b)]


def make_target(seed=0, binary=False):
    """Dense float64 ``[N, V]``: sparse random rows, row 0 empty, row 1 every label."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(N, V, generator=g) < 0.01).double() * torch.rand(N, V, generator=g, dtype=torch.float64)
    t[0] = 0
    t[1] = torch.rand(V, generator=g, dtype=torch.float64)
    t[4, [3, 4]] = 1.0 if binary else 2.5  # rows need not sum to 1
    if binary:
        t[5, 10] = 1.0
    return t


def unsorted_coo(t: torch.Tensor, device) -> torch.Tensor:
    """A duplicate-free COO tensor of ``t`` whose entries are shuffled (not coalesced)."""
    idx = t.nonzero().t()
    perm = torch.randperm(idx.shape[1], generator=torch.Generator().manual_seed(3))
    idx = idx[:, perm]
    return torch.sparse_coo_tensor(idx, t[idx[0], idx[1]], t.shape).to(device)


def grads(loss, params):
    params = [p for p in params if p is not None]
    return torch.autograd.grad(loss, params)


def assert_matches(loss, ref, params, ref_params, tol):
    assert rel_err(loss, ref) <= tol, (float(loss), float(ref))
    for got, want in zip(grads(loss.sum(), params), grads(ref.sum(), ref_params)):
        assert rel_err(got, want) <= tol


def reference_softmax(x, w, b, t, *, class_weight=None, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                      softcap=None):
    z = F.linear(x, w, b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, weight=class_weight, reduction="none", label_smoothing=label_smoothing)
    loss = loss + z_loss * torch.logsumexp(z, 1) ** 2
    return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / loss.shape[0]}[reduction]


# --------------------------------------------------------------------------------------------------
# Softmax with sparse probability targets
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [
    {}, {"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 5.0},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0},
])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 128])
def test_sparse_probability_target_matches_dense_pytorch(device, reduction, options, weighted, chunk_size):
    x, w, b = make_inputs(device)
    t = make_target()
    cw = (torch.rand(V, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5) if weighted else None
    loss = hugehead.linear_cross_entropy(x, w, unsorted_coo(t, device), b, reduction=reduction, chunk_size=chunk_size,
                                         class_weight=None if cw is None else cw.to(device), **options)
    xr, wr, br = (p.detach().cpu().requires_grad_() for p in (x, w, b))
    ref = reference_softmax(xr, wr, br, t, class_weight=cw, reduction=reduction, **options)
    assert loss.dtype == torch.float64
    assert_matches(loss, ref, [x, w, b], [xr, wr, br], 1e-10)


def test_sparse_target_csr_and_return_lse(device):
    x, w, b = make_inputs(device)
    t = make_target()
    loss, lse = hugehead.linear_cross_entropy(x, w, t.to_sparse_csr().to(device), b, return_lse=True,
                                              reduction="none")
    xr, wr, br = (p.detach().cpu().requires_grad_() for p in (x, w, b))
    z = F.linear(xr, wr, br)
    ref, ref_lse = F.cross_entropy(z, t, reduction="none"), torch.logsumexp(z, 1)
    gl = torch.linspace(-1, 1, N, dtype=torch.float64)
    got = grads((loss.sum() + (lse * gl.to(device)).sum()), [x, w, b])
    want = grads(ref.sum() + (ref_lse * gl).sum(), [xr, wr, br])
    assert rel_err(loss, ref) <= 1e-10 and rel_err(lse, ref_lse) <= 1e-12
    for a, r in zip(got, want):
        assert rel_err(a, r) <= 1e-10


def test_sparse_target_without_bias_and_one_entry_rows_equal_index_targets(device):
    """One entry of value 1 per row is the single-label loss: the sparse path and the index path agree."""
    x, w, _ = make_inputs(device, bias=False)
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    onehot = torch.sparse_coo_tensor(torch.stack([torch.arange(N), y]), torch.ones(N, dtype=torch.float64), (N, V))
    a = hugehead.linear_cross_entropy(x, w, onehot.to(device), label_smoothing=0.1)
    b = hugehead.linear_cross_entropy(x, w, y.to(device), label_smoothing=0.1)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------------
# Class weights with index targets
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("chunk_size", [None, 128])
def test_class_weight_index_targets_with_ignored_rows(device, reduction, label_smoothing, chunk_size):
    x, w, b = make_inputs(device)
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    y[[2, 7]] = -100
    cw = torch.rand(V, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
    loss = hugehead.linear_cross_entropy(x, w, y.to(device), b, class_weight=cw.to(device), reduction=reduction,
                                         label_smoothing=label_smoothing, chunk_size=chunk_size)
    xr, wr, br = (p.detach().cpu().requires_grad_() for p in (x, w, b))
    ref = F.cross_entropy(F.linear(xr, wr, br), y, weight=cw, reduction=reduction, label_smoothing=label_smoothing)
    assert_matches(loss, ref, [x, w, b], [xr, wr, br], 1e-10)
    if reduction == "none":
        assert loss[2] == 0 and loss[7] == 0


def test_class_weight_all_rows_ignored_mean_is_nan(device):
    x, w, b = make_inputs(device)
    y = torch.full((N,), -100, device=device)
    loss = hugehead.linear_cross_entropy(x, w, y, b, class_weight=torch.ones(V, dtype=torch.float64, device=device))
    assert torch.isnan(loss)


# --------------------------------------------------------------------------------------------------
# One-vs-all binary cross-entropy
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("pos_weight", [None, "vector", "scalar"])
@pytest.mark.parametrize("path", ["planned", "streamed", "no_grad_weight"])
def test_binary_cross_entropy_matches_dense_pytorch(device, reduction, pos_weight, path):
    x, w, b = make_inputs(device)
    t = make_target(binary=True).clamp(max=1.0)
    t[1] = 1.0  # a row with every label
    pw = {None: None, "vector": torch.rand(V, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3,
          "scalar": torch.tensor([2.5], dtype=torch.float64)}[pos_weight]
    if path == "no_grad_weight":
        w.requires_grad_(False)
    chunk_size = None if path == "planned" else 128  # planned: logits kept; streamed: gradient in the forward
    loss = hugehead.linear_binary_cross_entropy(x, w, unsorted_coo(t, device), b, reduction=reduction,
                                                pos_weight=None if pw is None else pw.to(device), chunk_size=chunk_size)
    xr, br = (p.detach().cpu().requires_grad_() for p in (x, b))
    wr = w.detach().cpu().requires_grad_(w.requires_grad)
    ref = F.binary_cross_entropy_with_logits(F.linear(xr, wr, br), t, pos_weight=pw,
                                             reduction="none" if reduction == "none" else reduction)
    if reduction == "none":
        ref = ref.sum(1)  # hugehead returns the per-row sums
    params = [p for p in (x, w, b) if p.requires_grad]
    ref_params = [p for p in (xr, wr, br) if p.requires_grad]
    assert_matches(loss, ref, params, ref_params, 1e-10)


def test_binary_cross_entropy_in_eval_and_empty_target(device):
    x, w, b = make_inputs(device)
    t = torch.zeros(N, V, dtype=torch.float64)
    with torch.no_grad():
        loss = hugehead.linear_binary_cross_entropy(x, w, t.to_sparse_csr().to(device), b, chunk_size=100)
    ref = F.binary_cross_entropy_with_logits(F.linear(x.detach().cpu(), w.detach().cpu(), b.detach().cpu()), t)
    assert rel_err(loss, ref) <= 1e-12


def test_binary_cross_entropy_gradient_in_forward_is_scaled_by_the_incoming_gradient(device):
    x, w, b = make_inputs(device)
    t = make_target(binary=True).clamp(max=1.0)
    loss = hugehead.linear_binary_cross_entropy(x, w, t.to_sparse_coo().to(device), b, chunk_size=200)
    (loss * 3.0).backward()
    xr, wr, br = (p.detach().cpu().requires_grad_() for p in (x, w, b))
    (F.binary_cross_entropy_with_logits(F.linear(xr, wr, br), t) * 3.0).backward()
    for got, want in zip((x.grad, w.grad, b.grad), (xr.grad, wr.grad, br.grad)):
        assert rel_err(got, want) <= 1e-10
    with pytest.raises(RuntimeError):
        loss.backward()  # the graph was freed, as for any op


# --------------------------------------------------------------------------------------------------
# Bad inputs: clear errors before any kernel
# --------------------------------------------------------------------------------------------------
def _coo(idx, val, shape=(N, V)):
    return torch.sparse_coo_tensor(torch.tensor(idx), torch.tensor(val, dtype=torch.float64), shape,
                                   check_invariants=False)


@pytest.mark.parametrize("fn", ["softmax", "binary"])
@pytest.mark.parametrize("target,error,match", [
    (lambda: _coo([[0], [V]], [0.5]), ValueError, "out of range"),
    (lambda: _coo([[0], [3]], [-0.5]), ValueError, None),
    (lambda: _coo([[0], [3]], [0.5], shape=(N + 1, V)), ValueError, r"\[N, V\]"),
    (lambda: _coo([[0], [3]], [0.5], shape=(N, V + 1)), ValueError, r"\[N, V\]"),
    (lambda: torch.zeros(N, V, dtype=torch.float64), None, None),
])
def test_bad_sparse_targets_raise(fn, target, error, match):
    x, w, b = make_inputs("cpu")
    t = target()
    call = (lambda: hugehead.linear_cross_entropy(x, w, t, b)) if fn == "softmax" else (
        lambda: hugehead.linear_binary_cross_entropy(x, w, t, b))
    if error is None:  # a dense [N, V] target: softmax rejects its shape, BCE its layout
        error = ValueError if fn == "softmax" else TypeError
    with pytest.raises(error, match=match):
        call()


def test_binary_targets_above_one_and_bad_weights_raise():
    x, w, b = make_inputs("cpu")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        hugehead.linear_binary_cross_entropy(x, w, _coo([[1], [2]], [1.5]), b)
    with pytest.raises(ValueError, match="pos_weight"):
        hugehead.linear_binary_cross_entropy(x, w, _coo([[1], [2]], [0.5]), b, pos_weight=torch.ones(3))
    with pytest.raises(ValueError, match="class_weight"):
        hugehead.linear_cross_entropy(x, w, torch.zeros(N, dtype=torch.int64), b, class_weight=torch.ones(V - 1))
    with pytest.raises(TypeError, match="class_weight"):
        hugehead.linear_cross_entropy(x, w, torch.zeros(N, dtype=torch.int64), b,
                                      class_weight=torch.ones(V, dtype=torch.int64))
    with pytest.raises(ValueError, match="out of range"):
        hugehead.linear_cross_entropy(x, w, torch.full((N,), V), b, class_weight=torch.ones(V, dtype=torch.float64))
    with pytest.raises(ValueError, match="reduction"):
        hugehead.linear_binary_cross_entropy(x, w, _coo([[1], [2]], [0.5]), b, reduction="avg")


@requires_cuda
def test_bad_sparse_target_leaves_cuda_usable():
    x, w, b = make_inputs("cuda", torch.float32)
    with pytest.raises(ValueError):
        hugehead.linear_cross_entropy(x, w, _coo([[0], [V + 5]], [1.0]).float().cuda(), b)
    t = make_target().float()
    loss = hugehead.linear_cross_entropy(x, w, t.to_sparse_csr().cuda(), b)
    ref = F.cross_entropy(F.linear(x.double(), w.double(), b.double()).cpu(), t.double())
    assert rel_err(loss, ref) < 1e-5


# --------------------------------------------------------------------------------------------------
# Low precision, autocast, torch.compile
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_error_within_twice_plain_pytorch(device, dtype):
    x64, w64, b64 = make_inputs("cpu")
    t = make_target()
    tb = t.clamp(max=1.0)
    x, w, b = (p.detach().to(device, dtype).requires_grad_() for p in (x64, w64, b64))
    for fn, ref_fn, tt in (
        (lambda: hugehead.linear_cross_entropy(x, w, t.to_sparse_coo().to(device), b),
         lambda xx, ww, bb: F.cross_entropy(F.linear(xx, ww, bb).float(), t.to(xx.device).float()), t),
        (lambda: hugehead.linear_binary_cross_entropy(x, w, tb.to_sparse_coo().to(device), b, chunk_size=256),
         lambda xx, ww, bb: F.binary_cross_entropy_with_logits(F.linear(xx, ww, bb).float(), tb.to(xx.device).float()), tb),
    ):
        loss = fn()
        assert loss.dtype == torch.float32
        got = grads(loss, [x, w, b])
        xs, ws, bs = (p.detach().clone().requires_grad_() for p in (x, w, b))
        plain = ref_fn(xs, ws, bs)
        plain_g = grads(plain, [xs, ws, bs])
        exact = ref_fn(x64, w64, b64).double() if tt is not None else None
        exact_g = grads(exact, [x64, w64, b64])
        floor = 1e-6 if dtype == torch.float32 else 1e-3
        assert rel_err(loss, exact) <= 2 * rel_err(plain, exact) + floor
        for a, p, e in zip(got, plain_g, exact_g):
            assert rel_err(a, e) <= 2 * rel_err(p, e) + floor


def test_autocast_cpu_bfloat16_keeps_float32_grads():
    x, w, b = make_inputs("cpu", torch.float32)
    t = make_target().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = hugehead.linear_cross_entropy(x, w, t.to_sparse_csr(), b)
        loss_b = hugehead.linear_binary_cross_entropy(x, w, t.clamp(max=1).to_sparse_csr(), b, chunk_size=128)
    (loss + loss_b).backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    xr, wr, br = (p.detach().double().requires_grad_() for p in (x, w, b))
    ref = F.cross_entropy(F.linear(xr, wr, br), t.double()) + F.binary_cross_entropy_with_logits(
        F.linear(xr, wr, br), t.double().clamp(max=1))
    ref.backward()
    assert rel_err(loss + loss_b, ref) < 2e-2 and rel_err(w.grad, wr.grad) < 3e-2


def test_torch_compile_sparse_and_binary(device):
    x, w, b = make_inputs(device, torch.float32)
    t = make_target().float()
    tc, tb = t.to_sparse_csr().to(device), t.clamp(max=1).to_sparse_csr().to(device)

    def step(x, w, b):
        return (hugehead.linear_cross_entropy(x, w, tc, b, label_smoothing=0.1)
                + hugehead.linear_binary_cross_entropy(x, w, tb, b))

    compiled = torch.compile(step, fullgraph=False)
    loss = compiled(x, w, b)
    got = grads(loss, [x, w, b])
    xr, wr, br = (p.detach().clone().requires_grad_() for p in (x, w, b))
    ref = step(xr, wr, br)
    want = grads(ref, [xr, wr, br])
    assert rel_err(loss, ref) < 1e-5
    for a, r in zip(got, want):
        assert rel_err(a, r) < 1e-5


# --------------------------------------------------------------------------------------------------
# opcheck of the registered ops
# --------------------------------------------------------------------------------------------------
def test_opcheck_multilabel_ops(device):
    x, w, b = (p.detach().float() for p in make_inputs(device))
    t = make_target().float()
    target, rows = multilabel.softmax_target(t.to_sparse_coo().to(device), N, V, class_weight=None,
                                             label_smoothing=0.1, ignore_index=-100, dtype=torch.float32,
                                             device=x.device)
    s = target.stats
    fwd = (x, w, b, s.crow, s.col, s.row, s.val, target.grad_val, target.mass, rows.row_weight, rows.weight_sum,
           None, None, 0.1, 0.0, 0.0, 128, 0, False)
    torch.library.opcheck(torch.ops.hugehead.linear_softmax_csr_forward.default, fwd)
    _, lse, kept = torch.ops.hugehead.linear_softmax_csr_forward(*fwd)
    bwd = (torch.ones(N, device=device), None, x, w, b, s.crow, s.col, s.row, s.val, target.grad_val, target.mass,
           None, None, lse, kept, 0.1, 0.0, 0.0, 128, 0, True, True)
    torch.library.opcheck(torch.ops.hugehead.linear_softmax_csr_backward.default, bwd)
    bt = multilabel.binary_target(t.clamp(max=1).to_sparse_coo().to(device), N, V, None, torch.float32, x.device)
    c = bt.target
    args = (x, w, b, c.crow, c.col, c.row, c.val, None)
    torch.library.opcheck(torch.ops.hugehead.linear_bce_csr_forward.default, (*args, 128, 0, False))
    torch.library.opcheck(torch.ops.hugehead.linear_bce_csr_fused.default, (*args, 1.0 / (N * V), 128, 0, True, True))
    row_loss, kept = torch.ops.hugehead.linear_bce_csr_forward(*args, 128, 0, False)
    torch.library.opcheck(torch.ops.hugehead.linear_bce_csr_backward.default,
                          (torch.ones(N, device=device), *args[:3], *args[3:], kept, 128, 0, True, True))


# --------------------------------------------------------------------------------------------------
# ChunkedClassifier(loss=..., class_weight=...) in every placement
# --------------------------------------------------------------------------------------------------
def _placements():
    out = [pytest.param(dict(devices=["cpu"]), id="cpu"), pytest.param(dict(devices=["cpu", "cpu"]), id="cpu_x2")]
    out += [pytest.param(dict(devices=["cuda"]), id="cuda", marks=requires_cuda),
            pytest.param(dict(devices=["cuda:0", "cpu"]), id="cuda_cpu", marks=requires_cuda),
            pytest.param(dict(devices=["cuda:0", "cuda:1"]), id="cuda_x2", marks=requires_multigpu),
            pytest.param(dict(devices=["cuda"], offload=True), id="offload", marks=requires_cuda)]
    return out


def _logical(head):
    w = torch.cat([s.weight.detach().cpu() for s in head.shards])
    b = torch.cat([s.bias.detach().cpu() for s in head.shards]) if head.shards[0].bias is not None else None
    return w, b


def _head_grads(head):
    w = torch.cat([s.weight.grad.cpu() for s in head.shards])
    b = torch.cat([s.bias.grad.cpu() for s in head.shards]) if head.shards[0].bias is not None else None
    return w, b


@pytest.mark.parametrize("placement", _placements())
@pytest.mark.parametrize("kind", ["sparse", "sparse_weighted", "index_weighted", "binary"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_head_multilabel_losses_match_dense_pytorch(placement, kind, reduction):
    device = torch.device(placement["devices"][0])
    kwargs = dict(reduction=reduction, chunk_size=64)
    cw = torch.rand(V, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
    if kind == "binary":
        kwargs["loss"] = "binary_cross_entropy"
    else:
        kwargs.update(label_smoothing=0.1)
        if kind != "sparse":
            kwargs["class_weight"] = cw
        if kind == "sparse":
            kwargs["z_loss"] = 1e-3
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(D, V, dtype=torch.float64, **placement, **kwargs)
    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    t = make_target(binary=kind == "binary")
    if kind == "binary":
        t = t.clamp(max=1.0)
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    y[[3, 8]] = -100
    target = y.to(device) if kind == "index_weighted" else unsorted_coo(t, device)
    loss = head(x, target)
    (loss * torch.linspace(0.5, 1.5, N, dtype=torch.float64, device=device) if reduction == "none" else loss).sum().backward()

    w, b = (p.requires_grad_() for p in _logical(head))
    xr = x.detach().cpu().requires_grad_()
    z = F.linear(xr, w, b)
    if kind == "binary":
        ref = F.binary_cross_entropy_with_logits(z, t, reduction=reduction)
        ref = ref.sum(1) if reduction == "none" else ref
    elif kind == "index_weighted":
        ref = F.cross_entropy(z, y, weight=cw, label_smoothing=0.1, reduction=reduction)
    else:
        ref = reference_softmax(xr, w, b, t, class_weight=None if kind == "sparse" else cw, reduction=reduction,
                                label_smoothing=0.1, z_loss=kwargs.get("z_loss", 0.0))
    (ref * torch.linspace(0.5, 1.5, N, dtype=torch.float64) if reduction == "none" else ref).sum().backward()
    assert rel_err(loss, ref) <= 1e-10
    gw, gb = _head_grads(head)
    for got, want in ((x.grad, xr.grad), (gw, w.grad), (gb, b.grad)):
        assert rel_err(got, want) <= 1e-10


def test_head_rejects_bad_loss_options():
    with pytest.raises(ValueError, match="unknown loss"):
        hugehead.ChunkedClassifier(D, V, loss="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        hugehead.ChunkedClassifier(D, V, loss="binary_cross_entropy", label_smoothing=0.1)
    with pytest.raises(ValueError, match="class_weight"):
        hugehead.ChunkedClassifier(D, V, class_weight=torch.ones(V - 1))
    with pytest.raises(TypeError, match="class_weight"):
        hugehead.ChunkedClassifier(D, V, class_weight=torch.ones(V, dtype=torch.int64))
    head = hugehead.ChunkedClassifier(D, V, dtype=torch.float64, loss="binary_cross_entropy", devices=["cpu"])
    x = torch.randn(N, D, dtype=torch.float64)
    with pytest.raises(TypeError, match="sparse"):
        head(x, torch.zeros(N, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        head(x, _coo([[0], [1]], [2.0]))


def test_head_autocast_and_compile_with_sparse_target():
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(D, V, devices=["cpu", "cpu"], chunk_size=100)
    x = torch.randn(N, D, requires_grad=True)
    t = make_target().float().to_sparse_csr()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head(x, t)
    loss.backward()
    assert loss.dtype == torch.float32 and head.shards[0].weight.grad.dtype == torch.float32
    w, b = (p.double().requires_grad_() for p in _logical(head))
    ref = F.cross_entropy(F.linear(x.detach().double(), w, b), make_target())
    assert rel_err(loss, ref) < 2e-2

    head.zero_grad()
    compiled = torch.compile(lambda x, t: head(x, t))
    loss_c = compiled(x, t)
    loss_c.backward()
    eager_w = head.shards[0].weight.grad.clone()
    head.zero_grad()
    head(x, t).backward()
    assert rel_err(loss_c, ref) < 1e-5 and rel_err(eager_w, head.shards[0].weight.grad) < 1e-6


# --------------------------------------------------------------------------------------------------
# The demo's multi-label option
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["softmax", "ova"])
def test_demo_multilabel_trains_and_reports_precision(tmp_path, loss):
    import json

    from hugehead import demo

    args = ["--devices", "cpu,cpu", "--classes", "3000", "--dim", "16", "--input-dim", "16", "--hidden", "32",
            "--batch", "64", "--steps", "40", "--epochs", "1", "--eval-size", "128", "--labels", "3",
            "--multilabel-loss", loss, "--no-progress", "--out", str(tmp_path)]
    assert demo.main(args) == 0
    final = json.loads((tmp_path / "summary.json").read_text())["final"]
    assert final["labels"] == 3 and final["multilabel_loss"] == loss
    for key in ("eval_precision_at_1", "eval_precision_at_5", "eval_ndcg_at_5"):
        assert 0.0 <= final[key] <= 1.0
    if loss == "softmax":  # learned within 40 steps: above always-most-frequent at precision@1
        assert final["eval_precision_at_1"] > final["chance_most_frequent"]
