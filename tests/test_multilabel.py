"""hugehead.linear_cross_entropy with sparse probability targets and class weights, and
hugehead.linear_binary_cross_entropy, against float64 dense PyTorch (F.cross_entropy with a dense
probability target / weight=, F.binary_cross_entropy_with_logits): every reduction and option, values and
gradients of x, weight and bias, empty rows, a row with every label, unsorted duplicate-free COO input,
ignored rows with class weights; the streamed, kept-logits and gradient-in-forward paths; bad inputs;
autocast; torch.compile; opcheck of the registered ops."""
import math

import pytest
import torch
import torch.nn.functional as F

import hugehead
from hugehead import target_prep

from conftest import load_example, rel_err, requires_cuda, requires_multigpu

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
    target, rows = target_prep.softmax_target(t.to_sparse_coo().to(device), N, V, class_weight=None,
                                             label_smoothing=0.1, ignore_index=-100, dtype=torch.float32,
                                             device=x.device)
    s = target.stats
    plan = hugehead.lce_op.op_plan(x, w, 0, 0, True)
    assert plan.keep_logits
    fwd = (x, w, b, s.crow, s.col, s.row, s.val, target.grad_val, target.mass, rows.row_weight, rows.weight_sum,
           None, None, 0.1, 0.0, 0.0, plan.encode())
    torch.library.opcheck(torch.ops.hugehead.linear_softmax_csr_forward.default, fwd)
    _, lse, kept = torch.ops.hugehead.linear_softmax_csr_forward(*fwd)
    assert kept.numel() > 0
    bwd = (torch.ones(N, device=device), None, x, w, b, s.crow, s.col, s.row, s.val, target.grad_val, target.mass,
           None, None, lse, kept, 0.1, 0.0, 0.0, plan.encode(), True, True)
    torch.library.opcheck(torch.ops.hugehead.linear_softmax_csr_backward.default, bwd)
    bt = target_prep.binary_target(t.clamp(max=1).to_sparse_coo().to(device), N, V, None, torch.float32, x.device)
    c = bt.target
    args = (x, w, b, c.crow, c.col, c.row, c.val, None)
    streamed = hugehead.lce_op.op_plan(x, w, 128, 0, False).encode()
    torch.library.opcheck(torch.ops.hugehead.linear_bce_csr_forward.default, (*args, streamed))
    torch.library.opcheck(torch.ops.hugehead.linear_bce_csr_fused.default, (*args, 1.0 / (N * V), streamed, True, True))
    row_loss, kept = torch.ops.hugehead.linear_bce_csr_forward(*args, streamed)
    torch.library.opcheck(torch.ops.hugehead.linear_bce_csr_backward.default,
                          (torch.ones(N, device=device), *args[:3], *args[3:], kept, streamed, True, True))


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


POS_WEIGHT = torch.rand(V, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3


@pytest.mark.parametrize("placement", _placements())
@pytest.mark.parametrize("kind", ["sparse", "sparse_weighted", "index_weighted", "binary", "binary_pos_weight"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_head_multilabel_losses_match_dense_pytorch(placement, kind, reduction):
    device = torch.device(placement["devices"][0])
    kwargs = dict(reduction=reduction, chunk_size=64)
    cw = torch.rand(V, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
    binary = kind.startswith("binary")
    pw = POS_WEIGHT if kind == "binary_pos_weight" else None
    if binary:
        kwargs["loss"] = "binary_cross_entropy"
        kwargs["pos_weight"] = pw
    else:
        kwargs.update(label_smoothing=0.1)
        if kind != "sparse":
            kwargs["class_weight"] = cw
        if kind == "sparse":
            kwargs.update(z_loss=1e-3, softcap=5.0)
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(D, V, dtype=torch.float64, **placement, **kwargs)
    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    t = make_target(binary=binary)
    if binary:
        t = t.clamp(max=1.0)
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    y[[3, 8]] = -100
    target = y.to(device) if kind == "index_weighted" else unsorted_coo(t, device)
    loss = head(x, target)
    (loss * torch.linspace(0.5, 1.5, N, dtype=torch.float64, device=device) if reduction == "none" else loss).sum().backward()

    w, b = (p.requires_grad_() for p in _logical(head))
    xr = x.detach().cpu().requires_grad_()
    z = F.linear(xr, w, b)
    if binary:
        ref = F.binary_cross_entropy_with_logits(z, t, pos_weight=pw, reduction=reduction)
        ref = ref.sum(1) if reduction == "none" else ref
    elif kind == "index_weighted":
        ref = F.cross_entropy(z, y, weight=cw, label_smoothing=0.1, reduction=reduction)
    else:
        ref = reference_softmax(xr, w, b, t, class_weight=None if kind == "sparse" else cw, reduction=reduction,
                                label_smoothing=0.1, z_loss=kwargs.get("z_loss", 0.0), softcap=kwargs.get("softcap"))
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


def test_head_one_vs_all_under_cpu_autocast():
    """bf16 compute from float32 parameters, float32 loss and gradients, close to float64."""
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(D, V, devices=["cpu", "cpu"], chunk_size=100, loss="binary_cross_entropy",
                                      pos_weight=POS_WEIGHT.float())
    x = torch.randn(N, D, requires_grad=True)
    t = make_target(binary=True).clamp(max=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head(x, t.float().to_sparse_coo())
    loss.backward()
    assert loss.dtype == torch.float32 and head.shards[1].weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32
    w, b = (p.double().requires_grad_() for p in _logical(head))
    xr = x.detach().double().requires_grad_()
    ref = F.binary_cross_entropy_with_logits(F.linear(xr, w, b), t, pos_weight=POS_WEIGHT)
    ref.backward()
    gw, _ = _head_grads(head)
    assert rel_err(loss, ref) < 1e-2 and rel_err(gw, w.grad) < 3e-2 and rel_err(x.grad, xr.grad) < 3e-2


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


# --------------------------------------------------------------------------------------------------
# The loss buffers (class_weight, pos_weight): state_dict in every placement, old checkpoints, casts
# --------------------------------------------------------------------------------------------------
def _loss_head(kind, devices, shard_sizes=None, weights=True, **kwargs):
    torch.manual_seed(0)
    if kind == "binary":
        kwargs.update(loss="binary_cross_entropy", pos_weight=POS_WEIGHT.clone() if weights else None)
    else:
        kwargs.update(class_weight=(torch.rand(V, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
                                    + 0.5) if weights else None)
    return hugehead.ChunkedClassifier(D, V, dtype=torch.float64, devices=devices, shard_sizes=shard_sizes,
                                      chunk_size=64, **kwargs)


def _loss_of(head, kind, seed=1):
    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    t = make_target(binary=kind == "binary")
    return head(x, (t.clamp(max=1.0) if kind == "binary" else t).to_sparse_csr())


@pytest.mark.parametrize("kind", ["softmax", "binary"])
def test_loss_buffers_are_in_state_dict_and_load_into_another_placement(kind, tmp_path):
    name = "pos_weight" if kind == "binary" else "class_weight"
    src = _loss_head(kind, ["cpu"])
    state = src.state_dict()
    assert set(state) == {"weight", "bias", name}
    torch.testing.assert_close(state[name], getattr(src, name), rtol=0, atol=0)
    # Another placement, other shard sizes, other initial weights: everything comes from the state dict.
    dst = _loss_head(kind, ["cpu"] * 3, shard_sizes=[100, 350, 250], weights=False)
    setattr(dst, name, torch.ones(V, dtype=torch.float64))
    torch.save(state, tmp_path / "head.pt")
    assert not dst.load_state_dict(torch.load(tmp_path / "head.pt")).missing_keys
    torch.testing.assert_close(getattr(dst, name), getattr(src, name), rtol=0, atol=0)
    torch.testing.assert_close(_loss_of(dst, kind), _loss_of(src, kind), rtol=1e-12, atol=0)
    # Through the checkpoint directory (DCP) too.
    from hugehead.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path / "ckpt", src)
    other = _loss_head(kind, ["cpu", "cpu"], weights=False)
    setattr(other, name, torch.zeros(V, dtype=torch.float64))
    load_checkpoint(tmp_path / "ckpt", other)
    torch.testing.assert_close(getattr(other, name), getattr(src, name), rtol=0, atol=0)
    torch.testing.assert_close(_loss_of(other, kind), _loss_of(src, kind), rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["softmax", "binary"])
def test_checkpoints_without_loss_buffers_still_load(kind, tmp_path):
    """A checkpoint written before class_weight / pos_weight were buffers (a head without them): loads
    strictly, by load_state_dict and load_checkpoint; the head keeps its own weights."""
    name = "pos_weight" if kind == "binary" else "class_weight"
    old = _loss_head(kind, ["cpu"], weights=False)
    state = old.state_dict()
    assert set(state) == {"weight", "bias"}
    head = _loss_head(kind, ["cpu", "cpu"])
    mine = getattr(head, name).clone()
    result = head.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(getattr(head, name), mine, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s.weight for s in head.shards]), state["weight"], rtol=0, atol=0)

    from hugehead.checkpoint import load_checkpoint, save_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(3, D, dtype=torch.float64), old)
    save_checkpoint(tmp_path / "old", model)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, D, dtype=torch.float64), _loss_head(kind, ["cpu"]))
    load_checkpoint(tmp_path / "old", fresh)
    torch.testing.assert_close(getattr(fresh[1], name), mine, rtol=0, atol=0)
    torch.testing.assert_close(fresh[1].shards[0].weight, state["weight"], rtol=0, atol=0)
    # Still strict about what is truly missing, and about a weight the head does not have (as PyTorch).
    with pytest.raises(RuntimeError, match="Missing key"):
        head.load_state_dict({"bias": state["bias"]})
    with pytest.raises(RuntimeError, match=f"Unexpected key.*{name}"):
        old.load_state_dict(head.state_dict())


def test_loss_buffers_follow_dtype_casts_and_stay_with_a_pinned_placement():
    head = _loss_head("softmax", ["cpu", "cpu"])
    head.float()
    assert head.class_weight.dtype == torch.float32 and head.class_weight.device.type == "cpu"
    head.double()
    x = torch.randn(N, D, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    w, b = _logical(head)
    ref = F.cross_entropy(F.linear(x, w, b), y, weight=head.class_weight)
    torch.testing.assert_close(head(x, y), ref, rtol=1e-12, atol=0)
    # A tensor assigned to the buffer changes the loss; a bad one is refused before any kernel.
    head.class_weight = torch.ones(V, dtype=torch.float64) * 2
    torch.testing.assert_close(head(x, y), F.cross_entropy(F.linear(x, w, b), y), rtol=1e-12, atol=0)
    head.class_weight = torch.ones(V - 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"class_weight must be a dense \[V\]"):
        head(x, y)
    assert "class_weight=[699]" in repr(head)
    head.class_weight = None
    torch.testing.assert_close(head(x, y), F.cross_entropy(F.linear(x, w, b), y), rtol=1e-12, atol=0)


@requires_cuda
def test_cuda_loss_buffer_copies_follow_changes():
    """Buffers on the first shard's device (cuda:0) with x on the CPU: copied once, again after a change."""
    torch.manual_seed(0)
    cw = torch.rand(V, dtype=torch.float64) + 0.5
    head = hugehead.ChunkedClassifier(D, V, dtype=torch.float64, devices=["cuda:0", "cpu"], class_weight=cw)
    assert head.class_weight.device.type == "cuda"
    x = torch.randn(N, D, dtype=torch.float64)
    y = torch.randint(0, V, (N,))
    w, b = _logical(head)
    torch.testing.assert_close(head(x, y), F.cross_entropy(F.linear(x, w, b), y, weight=cw), rtol=1e-12, atol=0)
    head.load_state_dict({"weight": w, "bias": b, "class_weight": cw * 0 + 1})  # copied in place
    torch.testing.assert_close(head(x, y), F.cross_entropy(F.linear(x, w, b), y), rtol=1e-12, atol=0)


def test_head_pos_weight_scalar_and_bad_loss_buffers():
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(D, V, dtype=torch.float64, devices=["cpu", "cpu"], loss="binary_cross_entropy",
                                      pos_weight=torch.tensor([2.5], dtype=torch.float64), reduction="sum")
    x = torch.randn(N, D, dtype=torch.float64)
    t = make_target(binary=True).clamp(max=1.0)
    w, b = _logical(head)
    ref = F.binary_cross_entropy_with_logits(F.linear(x, w, b), t, pos_weight=torch.tensor([2.5],
                                             dtype=torch.float64), reduction="sum")
    assert rel_err(head(x, unsorted_coo(t, "cpu")), ref) <= 1e-12
    bce = dict(loss="binary_cross_entropy")
    for kwargs, error, match in [
        (dict(pos_weight=torch.ones(V - 1), **bce), ValueError, r"pos_weight must be a dense \[V\]"),
        (dict(pos_weight=torch.ones(V, dtype=torch.int64), **bce), TypeError, "pos_weight must be floating"),
        (dict(pos_weight=[1.0] * V, **bce), TypeError, "pos_weight must be a tensor"),
        (dict(pos_weight=torch.ones(V)), ValueError, "pos_weight is the positive term's weight"),
        (dict(class_weight=torch.ones(V), **bce), ValueError, "does not take class_weight"),
        (dict(class_weight=torch.ones(V, 1)), ValueError, r"class_weight must be a dense \[V\]"),
    ]:
        with pytest.raises(error, match=match):
            hugehead.ChunkedClassifier(D, V, devices=["cpu"], **kwargs)


# --------------------------------------------------------------------------------------------------
# torch.compile of a model holding a multi-label / weighted / one-vs-all head
# --------------------------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self, **head_kwargs):
        super().__init__()
        torch.manual_seed(3)
        self.backbone = torch.nn.Linear(6, D, dtype=torch.float64)
        self.head = hugehead.ChunkedClassifier(D, V, dtype=torch.float64, devices=["cpu", "cpu"], chunk_size=64,
                                               **head_kwargs)

    def forward(self, x, target):
        return self.head(torch.tanh(self.backbone(x)), target) * 2.0


def _compile_case(kind):
    """Head options and the target (``csr``: pre-converted with hugehead.csr_target; ``sparse``: the sparse
    tensor itself, which dynamo does not take)."""
    t = make_target(binary=kind.startswith("binary"))
    if kind.startswith("binary"):
        t = t.clamp(max=1.0)
        options = dict(loss="binary_cross_entropy", pos_weight=POS_WEIGHT, reduction="sum")
    else:
        options = dict(class_weight=torch.rand(V, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) + 0.5,
                       label_smoothing=0.1)
    if kind == "index_weighted":
        y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
        y[3] = -100
        return options, y
    return options, hugehead.csr_target(unsorted_coo(t, "cpu")) if kind.endswith("csr") else unsorted_coo(t, "cpu")


@pytest.mark.parametrize("kind,backend", [
    ("sparse_csr", "aot_eager"), ("index_weighted", "aot_eager"), ("binary_csr", "aot_eager"),
    ("sparse", "aot_eager"), ("binary_csr", "inductor"),
])
def test_compiled_model_with_multilabel_head_matches_eager(kind, backend):
    """Forward and backward of torch.compile(model) equal eager's (loss, dX, the backbone's and every shard's
    gradients). With a CsrTarget or class ids the backbone compiles and the head's loss is the one graph
    break; with a sparse tensor dynamo cannot wrap the input, so the model runs eagerly, still right."""
    torch._dynamo.reset()
    options, target = _compile_case(kind)
    x = torch.randn(N, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    results = []
    for compiled in (False, True):
        model = _Model(**options)
        run = torch.compile(model, backend=backend) if compiled else model
        xx = x.clone().requires_grad_()
        loss = run(xx, target)
        loss.backward()
        results.append([loss.detach(), xx.grad, *(p.grad for p in model.parameters())])
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    explained = torch._dynamo.explain(_Model(**options))(x, target)
    if kind == "sparse":
        assert explained.graph_count == 0  # "Attempted to wrap sparse Tensor": the frame runs eagerly
    else:
        assert (explained.graph_count, explained.graph_break_count) == (2, 1), explained.break_reasons


def test_functional_losses_under_compile_take_a_csr_target():
    """hugehead.linear_cross_entropy / linear_binary_cross_entropy with a CsrTarget inside a compiled
    function: the losses run eagerly between graphs; values and gradients as eager."""
    torch._dynamo.reset()
    x, w, b = make_inputs("cpu")
    t = make_target()
    tc, tb = hugehead.csr_target(t.to_sparse_coo()), hugehead.csr_target(t.clamp(max=1).to_sparse_csr())

    def step(x, w, b):
        h = torch.tanh(x) * 1.5
        return (hugehead.linear_cross_entropy(h, w, tc, b, label_smoothing=0.1)
                + hugehead.linear_binary_cross_entropy(h, w, tb, b, pos_weight=POS_WEIGHT) + h.square().mean())

    got = step(x, w, b)
    ref = torch.compile(step, backend="aot_eager")(x, w, b)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    for a, r in zip(grads(got, [x, w, b]), grads(ref, [x, w, b])):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-15)
    # The dense work around the losses compiles (with the sparse tensors themselves, nothing would).
    assert torch._dynamo.explain(step)(x, w, b).graph_count >= 2


def test_csr_target_matches_the_sparse_tensor_and_is_checked_again(device):
    x, w, b = make_inputs(device)
    t = make_target()
    coo = unsorted_coo(t, "cpu")
    converted = hugehead.csr_target(coo, device=device)
    assert isinstance(converted, hugehead.CsrTarget) and converted.val.dtype == torch.float64
    assert converted.device.type == torch.device(device).type
    assert converted.crow.tolist() == t.to_sparse_csr().crow_indices().tolist()
    assert hugehead.csr_target(coo).device.type == "cpu"  # a CPU CsrTarget with x elsewhere is copied over
    # float64: the same entries in the same order; on CUDA the row sums may round in another order (H200:
    # 2e-16 apart).
    torch.testing.assert_close(hugehead.linear_cross_entropy(x, w, hugehead.csr_target(coo), b),
                               hugehead.linear_cross_entropy(x, w, coo, b), rtol=1e-14, atol=0)
    torch.testing.assert_close(hugehead.linear_cross_entropy(x, w, converted, b),
                               hugehead.linear_cross_entropy(x, w, coo, b), rtol=1e-14, atol=0)
    # Values are checked by the loss that reads them; the row pointers and shapes by any.
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        hugehead.linear_binary_cross_entropy(x, w, converted, b)
    neg = converted.with_values(-converted.val)
    with pytest.raises(ValueError, match=">= 0"):
        hugehead.linear_cross_entropy(x, w, neg, b)
    bad = hugehead.CsrTarget(converted.crow.flip(0), converted.col, converted.val, converted.row, V)
    with pytest.raises(ValueError, match="crow must be"):
        hugehead.linear_cross_entropy(x, w, bad, b)
    wide = hugehead.CsrTarget(converted.crow, converted.col, converted.val, converted.row, V + 1)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        hugehead.linear_cross_entropy(x, w, wide, b)
    out = hugehead.CsrTarget(converted.crow, converted.col + V, converted.val, converted.row, V)
    with pytest.raises(ValueError, match="out of range"):
        hugehead.linear_cross_entropy(x, w, out, b)
    with pytest.raises(TypeError, match="csr_target takes"):
        hugehead.csr_target(t)


# --------------------------------------------------------------------------------------------------
# The Lightning example's multi-label option (CPU smoke): its precision@k / nDCG@k are those of the
# trained model's dense float64 ranking
# --------------------------------------------------------------------------------------------------
def _reference_ranking_metrics(order, label_sets, ks):
    """precision@k and nDCG@k (pyxclib's conventions) from ``order [N, K]`` and lists of label ids."""
    out = {}
    for k in ks:
        p, ndcg = [], []
        for top, labels in zip(order.tolist(), label_sets):
            hits = [c in labels for c in top[:k]]
            p.append(sum(hits) / k)
            dcg = sum(1 / math.log2(i + 2) for i, h in enumerate(hits) if h)
            ndcg.append(dcg / sum(1 / math.log2(i + 2) for i in range(min(k, len(labels)))))
        out[f"test_p@{k}"] = sum(p) / len(p)
        if k > 1:
            out[f"test_ndcg@{k}"] = sum(ndcg) / len(ndcg)
    return out


@pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")
@pytest.mark.parametrize("loss,steps", [("cross_entropy", 15), ("binary_cross_entropy", 2)])
def test_lightning_example_multilabel_reports_precision_and_ndcg(loss, steps, capsys):
    pytest.importorskip("lightning", reason="examples/lightning_6m.py needs PyTorch Lightning")
    example = load_example("lightning_6m", "lightning_6m_multilabel")
    v, n_test = 3000, 256
    argv = ["--cpu", "--classes", str(v), "--dim", "32", "--steps", str(steps), "--batch", "64", "--test-size",
            str(n_test), "--no-progress", "--labels", "3", "--multilabel-loss", loss]
    result = example.main(argv)
    model, metrics = result["model"], result["test_metrics"]
    assert model.head.loss == loss and result["trainer"].global_step == steps
    assert set(metrics) == {"test_loss", "test_p@1", "test_p@5", "test_ndcg@5"}

    args = example.parse_args(argv)
    tokens, labels = example.synthetic_sequences(n_test, v, args.seq_len, args.token_vocab, args.zipf, args.corrupt,
                                                 seed=args.seed + 2, labels=3).tensors
    with torch.no_grad():
        features = model.backbone(tokens).double()
    w, b = (t.double() for t in _logical(model.head))
    logits = features @ w.T + b
    order = torch.stack([torch.tensor(sorted(range(v), key=lambda c, row=row: (-row[c], c))[:5])
                         for row in logits.tolist()])
    label_sets = [set(row.tolist()) for row in labels]
    for key, want in _reference_ranking_metrics(order, label_sets, (1, 5)).items():
        assert metrics[key] == pytest.approx(want, abs=1.5 / n_test), key  # float32 vs float64 near-ties
    # The test loss: the head's loss against the label sets' sparse target, dense float64.
    dense = torch.zeros(n_test, v, dtype=torch.float64)
    for i, row in enumerate(labels.tolist()):
        for c in row:
            dense[i, c] = 1.0 if loss == "binary_cross_entropy" else dense[i, c] + 1.0 / 3
    ref = (F.binary_cross_entropy_with_logits(logits, dense) if loss == "binary_cross_entropy"
           else F.cross_entropy(logits, dense))
    assert metrics["test_loss"] == pytest.approx(float(ref), rel=1e-4)
    if loss == "cross_entropy":  # it learned: above chance (3 labels of 3000) at precision@1
        assert metrics["test_p@1"] > 0.05
    assert "test_p@1=" in capsys.readouterr().out


def test_ignore_heads_in_ddp_lists_a_distributed_heads_loss_buffers():
    """A head spanning ranks (its engine names a process group) holds the same class_weight on every rank:
    DDP must not broadcast it each step. (The spawned-world DDP step is in tests/test_distributed.py.)"""
    head = hugehead.ChunkedClassifier(D, V, devices=["cpu"], class_weight=torch.ones(V))
    model = torch.nn.Sequential(torch.nn.Linear(3, D), head)
    assert hugehead.ignore_heads_in_ddp(model) == []  # one process: nothing to ignore
    head.engine.checkpoint_group = lambda: "a group"
    assert hugehead.ignore_heads_in_ddp(model) == ["1.shards.0.weight", "1.shards.0.bias", "1.class_weight"]
