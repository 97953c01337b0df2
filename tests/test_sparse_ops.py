"""The sparse-target ops (torch.ops.hugehead.sparse_chunk_stats_ / sparse_chunk_grad_ / bce_chunk_) against
float64 dense PyTorch over several chunks (entries at chunk edges, empty rows, a row with every label, row
blocks of a larger target), their argument checks, and torch.library.opcheck; plus hugehead.sparse's
target preparation (COO/CSR, unsorted and duplicate entries, shard column slices, bad targets)."""
import math

import pytest
import torch
import torch.nn.functional as F

import hugehead  # noqa: F401  (registers torch.ops.hugehead.*)
from hugehead import ops, sparse
from hugehead.ops import target_chunks

from conftest import FLOAT_DTYPES, requires_cuda

ALL_DTYPES = FLOAT_DTYPES + [torch.float64]
SPLITS = (0, 211, 212, 530)  # chunks [0, 211), [211, 212) (one class) and [212, 530)


def make_target(n, v, seed=0, density=0.03):
    """Dense float64 ``[n, v]`` target: random entries, row 0 empty, row 1 every label, and entries at
    every chunk edge in row 2."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(n, v, generator=g, dtype=torch.float64) < density) * torch.rand(n, v, generator=g,
                                                                                      dtype=torch.float64)
    t[0] = 0
    t[1] = torch.rand(v, generator=g, dtype=torch.float64)
    t[2, [0, 210, 211, 212, v - 1]] = 0.5
    return t


def csr(t: torch.Tensor, dtype, device):
    """The kernels' CSR form of a dense target (through hugehead.sparse.prepare, from COO)."""
    return sparse.prepare(t.to_sparse_coo(), t.shape[0], t.shape[1], kind="probability", dtype=dtype,
                          device=torch.device(device))


def chunks(v):
    return [(a, b) for a, b in zip(SPLITS, SPLITS[1:]) if a < v]


def logits(n, v, dtype, device, scale=3.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


TOL = {torch.float64: 1e-11}


# --------------------------------------------------------------------------------------------------
# sparse_chunk_stats_
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_sparse_chunk_stats_matches_float64(device, dtype, softcap, weighted):
    n, v = 9, 530
    t = make_target(n, v)
    z = logits(n, v, dtype, device)
    acc = ops.acc_dtype(dtype)
    target = csr(t, acc, device)
    w = torch.rand(v, dtype=torch.float64) + 0.5
    stats = [torch.full((n,), -math.inf, dtype=acc, device=device)] + [torch.zeros(n, dtype=acc, device=device)
                                                                      for _ in range(3)]
    for a, b in chunks(v):
        cw = w[a:b].to(acc).to(device) if weighted else None
        target_chunks.sparse_chunk_stats_(z[:, a:b], target.crow, target.col, target.val, a, softcap, cw, *stats)
    c = z.double().cpu()
    if softcap:
        c = softcap * torch.tanh(c / softcap)
    tol = TOL.get(dtype, 3e-6)
    row_max, row_sumexp, target_dot, logit_sum = (s.double().cpu() for s in stats)
    torch.testing.assert_close(row_max + row_sumexp.log(), torch.logsumexp(c, 1), rtol=tol, atol=0)
    # Target values were rounded to the accumulation dtype; the reference uses the same values.
    tv = t.to(acc).double()
    scale = (tv * c).abs().sum(1) + 1
    assert ((target_dot - (tv * c).sum(1)).abs() <= tol * scale).all()
    ww = w.to(acc).double() if weighted else torch.ones(v, dtype=torch.float64)
    assert ((logit_sum - (ww * c).sum(1)).abs() <= tol * ((ww * c).abs().sum(1) + 1)).all()
    assert target_dot[0] == 0  # an empty row


def test_sparse_chunk_stats_row_block_of_larger_target(device):
    """A row block is a slice of crow (absolute offsets): rows 3..7 of the target, chunk [100, 300)."""
    n, v = 9, 530
    t = make_target(n, v)
    target = csr(t, torch.float32, device)
    z = logits(n, v, torch.float32, device)
    stats = [torch.full((4,), -math.inf, device=device)] + [torch.zeros(4, device=device) for _ in range(3)]
    block = target.rows(3, 7)
    target_chunks.sparse_chunk_stats_(z[3:7, 100:300], block.crow, block.col, block.val, 100, 0.0, None, *stats)
    expected = (t[3:7, 100:300].float().double() * z[3:7, 100:300].double().cpu()).sum(1)
    torch.testing.assert_close(stats[2].double().cpu(), expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# sparse_chunk_grad_
# --------------------------------------------------------------------------------------------------
def dense_prob_loss(c, t, w, eps, z_loss):
    """Per-row float64 loss of F.cross_entropy with probability targets (+ z-loss), from logits c."""
    rows = F.cross_entropy(c, t, weight=w, label_smoothing=eps, reduction="none")
    return rows + z_loss * torch.logsumexp(c, 1) ** 2


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("eps,z_loss,softcap,weighted", [
    (0.0, 0.0, 0.0, False), (0.1, 0.0, 0.0, False), (0.0, 1e-3, 0.0, False), (0.0, 0.0, 5.0, False),
    (0.2, 1e-3, 5.0, True), (0.1, 0.0, 0.0, True),
])
def test_sparse_chunk_grad_matches_autograd_of_float64(device, dtype, eps, z_loss, softcap, weighted):
    n, v = 9, 530
    t = make_target(n, v)
    z = logits(n, v, dtype, device)
    acc = ops.acc_dtype(dtype)
    w = torch.rand(v, dtype=torch.float64) + 0.5 if weighted else None
    target = csr(t, acc, device)
    tv = t.to(acc).double()  # the values the kernel sees
    wv = w.to(acc).double() if weighted else torch.ones(v, dtype=torch.float64)
    zr = z.double().cpu().requires_grad_()
    c = softcap * torch.tanh(zr / softcap) if softcap else zr
    g = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    g[4] = 0.0  # a row without gradient: exact zeros
    (dense_prob_loss(c, tv, wv if weighted else None, eps, z_loss) * g).sum().backward()
    lse = torch.logsumexp(c.detach(), 1)
    mass = (1 - eps) * (tv * wv).sum(1) + eps / v * wv.sum()
    weighted_val = target.val * torch.as_tensor(wv, dtype=acc, device=device)[target.col]
    out = z.clone()
    for a, b in chunks(v):
        cw = torch.as_tensor(wv[a:b], dtype=acc, device=device) if weighted else None
        target_chunks.sparse_chunk_grad_(out[:, a:b], target.crow, target.col, weighted_val, a, v,
                                         lse.to(acc).to(device), g.to(acc).to(device), mass.to(acc).to(device), eps,
                                         z_loss, softcap, cw)
    got = out.double().cpu()
    ref = zr.grad
    tol = {torch.float64: 1e-10, torch.float32: 2e-5}.get(dtype, 2e-2)
    assert ((got - ref).abs() <= tol * (ref.abs() + ref.abs().max() * 0.05)).all(), (got - ref).abs().max()
    assert (got[4] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_chunk_grad_entry_counts_around_the_stash(device, dtype):
    """Rows with 5, 1024 and 1025 entries in one chunk and a row with every label: the CUDA kernel stashes up
    to 4 x 256 entries' logits and writes them after the row (else it searches each pack's entries); both
    give the float64 gradient."""
    n, v = 5, 3000
    g0 = torch.Generator().manual_seed(7)
    t = torch.zeros(n, v, dtype=torch.float64)
    for r, count in ((0, 5), (1, 1024), (2, 1025), (3, v)):
        cols = torch.randperm(v, generator=g0)[:count]
        t[r, cols] = torch.rand(count, generator=g0, dtype=torch.float64) + 0.1
    z = logits(n, v, dtype, device)
    acc = ops.acc_dtype(dtype)
    target = csr(t, acc, device)
    tv = t.to(acc).double()
    zr = z.double().cpu().requires_grad_()
    g = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    eps = 0.1
    (dense_prob_loss(zr, tv, None, eps, 0.0) * g).sum().backward()
    lse = torch.logsumexp(zr.detach(), 1)
    mass = (1 - eps) * tv.sum(1) + eps
    out = z.clone()
    target_chunks.sparse_chunk_grad_(out, target.crow, target.col, target.val, 0, v, lse.to(acc).to(device),
                                     g.to(acc).to(device), mass.to(acc).to(device), eps, 0.0, 0.0, None)
    got, ref = out.double().cpu(), zr.grad
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert ((got - ref).abs() <= tol * (ref.abs() + ref.abs().max() * 0.05)).all(), (got - ref).abs().max()


def test_sparse_chunk_grad_with_grad_lse(device):
    n, v = 6, 300
    t = make_target(n, v)
    z = logits(n, v, torch.float64, device)
    target = csr(t, torch.float64, device)
    zr = z.cpu().clone().requires_grad_()
    gl = torch.linspace(-1, 1, n, dtype=torch.float64)
    (F.cross_entropy(zr, t, reduction="sum") + (torch.logsumexp(zr, 1) * gl).sum()).backward()
    out = z.clone()
    lse = torch.logsumexp(z, 1)
    target_chunks.sparse_chunk_grad_(out, target.crow, target.col, target.val, 0, v, lse,
                                     torch.ones(n, dtype=torch.float64, device=device), t.sum(1).to(device), 0.0, 0.0,
                                     0.0, None, gl.to(device))
    torch.testing.assert_close(out.cpu(), zr.grad, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# bce_chunk_
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("pos_weighted", [False, True])
@pytest.mark.parametrize("mode", ["loss", "grad", "both"])
def test_bce_chunk_matches_float64(device, dtype, pos_weighted, mode):
    n, v = 9, 530
    t = make_target(n, v)
    t[1] = 1.0  # a row with every label
    z = logits(n, v, dtype, device, scale=6.0)
    z[3, :8] = torch.tensor([30.0, -30.0, 80.0, -80.0, 0.0, 1e-3, -1e-3, 15.0], dtype=dtype)
    acc = ops.acc_dtype(dtype)
    target = sparse.prepare(t.to_sparse_csr(), n, v, kind="binary", dtype=acc, device=torch.device(device))
    tv = t.to(acc).double()
    pw = torch.rand(v, dtype=torch.float64) * 3 if pos_weighted else None
    entry_weight = None
    if pos_weighted:
        pwv = pw.to(acc).to(device)
        entry_weight = (1 + (pwv[target.col] - 1) * target.val).contiguous()
    zr = z.double().cpu().requires_grad_()
    ref_rows = F.binary_cross_entropy_with_logits(zr, tv, pos_weight=None if pw is None else pw.to(acc).double(),
                                                  reduction="none").sum(1)
    g = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    (ref_rows * g).sum().backward()
    row_loss = torch.zeros(n, dtype=acc, device=device) if mode != "grad" else None
    grad_rows = g.to(acc).to(device) if mode != "loss" else None
    out = z.clone()
    for a, b in chunks(v):
        target_chunks.bce_chunk_(out[:, a:b], target.crow, target.col, target.val, entry_weight, a, row_loss, grad_rows)
    tol = {torch.float64: 1e-11, torch.float32: 2e-6}.get(dtype, 2e-6)
    if row_loss is not None:
        torch.testing.assert_close(row_loss.double().cpu(), ref_rows.detach(), rtol=tol, atol=tol)
    if grad_rows is None:
        assert torch.equal(out, z)  # loss only: the chunk is read, not written
    else:
        gtol = {torch.float64: 1e-11, torch.float32: 2e-6}.get(dtype, 1e-2)
        torch.testing.assert_close(out.double().cpu(), zr.grad, rtol=gtol, atol=gtol)


def test_bce_chunk_confident_negatives_keep_their_loss(device):
    """A logit of -20 costs log1p(exp(-20)) ~ 2e-9: summed over many classes it must not round to 0."""
    n, v = 2, 4096
    z = torch.full((n, v), -20.0, device=device)
    empty = sparse.prepare(torch.zeros(n, v).to_sparse_csr(), n, v, kind="binary", dtype=torch.float32,
                           device=torch.device(device))
    row_loss = torch.zeros(n, device=device)
    target_chunks.bce_chunk_(z, empty.crow, empty.col, empty.val, None, 0, row_loss, None)
    torch.testing.assert_close(row_loss.double().cpu(), torch.full((n,), v * math.log1p(math.exp(-20.0)),
                                                                    dtype=torch.float64), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------------
# Argument checks and opcheck
# --------------------------------------------------------------------------------------------------
def _stats_args(device, n=4, v=16, dtype=torch.float32):
    t = torch.zeros(n, v)
    t[0, 3] = 1.0
    t[2, [0, 15]] = 0.5
    target = csr(t, ops.acc_dtype(dtype), device)
    acc = ops.acc_dtype(dtype)
    z = torch.randn(n, v, device=device).to(dtype)
    stats = [torch.full((n,), -math.inf, dtype=acc, device=device)] + [torch.zeros(n, dtype=acc, device=device)
                                                                      for _ in range(3)]
    return z, target, stats


def test_sparse_ops_reject_bad_arguments(device):
    z, target, stats = _stats_args(device)
    with pytest.raises(RuntimeError, match="crow must have shape"):
        target_chunks.sparse_chunk_stats_(z, target.crow[:-1], target.col, target.val, 0, 0.0, None, *stats)
    with pytest.raises(RuntimeError, match="val must be"):
        target_chunks.sparse_chunk_stats_(z, target.crow, target.col, target.val.double(), 0, 0.0, None, *stats)
    with pytest.raises(RuntimeError, match="class_weight must have shape"):
        target_chunks.sparse_chunk_stats_(z, target.crow, target.col, target.val, 0, 0.0, torch.ones(3, device=device),
                                          *stats)
    with pytest.raises(RuntimeError, match="target_mass must have shape"):
        target_chunks.sparse_chunk_grad_(z, target.crow, target.col, target.val, 0, 16, stats[0], stats[1],
                                         torch.ones(2, device=device), 0.0, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="entry_weight"):
        target_chunks.bce_chunk_(z, target.crow, target.col, target.val, torch.ones(1, device=device), 0, stats[0],
                                 None)


def _opcheck_cases(device):
    z, target, stats = _stats_args(device)
    acc = stats[0].dtype
    n, v = z.shape
    lse = torch.logsumexp(z.to(acc), 1)
    ones = torch.ones(n, dtype=acc, device=device)
    return [
        (torch.ops.hugehead.sparse_chunk_stats_.default,
         (z, target.crow, target.col, target.val, 0, 0.0, None, *stats)),
        (torch.ops.hugehead.sparse_chunk_stats_.default,
         (z, target.crow, target.col, target.val, 0, 2.0, torch.rand(v, dtype=acc, device=device), *stats)),
        (torch.ops.hugehead.sparse_chunk_grad_.default,
         (z.clone(), target.crow, target.col, target.val, 0, v, lse, ones, ones, 0.1, 1e-3, 0.0, None, None)),
        (torch.ops.hugehead.bce_chunk_.default,
         (z.clone(), target.crow, target.col, target.val, None, 0, torch.zeros(n, dtype=acc, device=device), ones)),
        (torch.ops.hugehead.bce_chunk_.default,
         (z.clone(), target.crow, target.col, target.val, target.val.clone(), 0, None, ones)),
    ]


def test_opcheck_sparse_ops_cpu():
    for op, args in _opcheck_cases("cpu"):
        torch.library.opcheck(op, args)


@requires_cuda
def test_opcheck_sparse_ops_cuda():
    for op, args in _opcheck_cases("cuda"):
        torch.library.opcheck(op, args)


# --------------------------------------------------------------------------------------------------
# hugehead.sparse: target preparation
# --------------------------------------------------------------------------------------------------
def test_prepare_coo_unsorted_with_duplicates_matches_to_dense():
    rows = torch.tensor([2, 0, 2, 1, 2, 0])
    cols = torch.tensor([5, 7, 1, 3, 5, 0])
    vals = torch.tensor([0.25, 1.0, 0.5, 2.0, 0.25, 0.125], dtype=torch.float64)
    coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (4, 8))  # not coalesced
    t = sparse.prepare(coo, 4, 8, kind="probability", dtype=torch.float32, device=torch.device("cpu"))
    assert t.crow.tolist() == [0, 2, 3, 5, 5]
    assert t.col.tolist() == [0, 7, 3, 1, 5]
    dense = torch.zeros(4, 8)
    dense[t.row, t.col] = t.val
    torch.testing.assert_close(dense, coo.to_dense().float())


def test_prepare_csr_with_unsorted_columns():
    crow = torch.tensor([0, 3, 3, 4])
    col = torch.tensor([6, 1, 4, 0])
    val = torch.tensor([0.1, 0.2, 0.3, 0.4])
    t = sparse.prepare(torch.sparse_csr_tensor(crow, col, val, (3, 8)), 3, 8, kind="binary",
                       dtype=torch.float32, device=torch.device("cpu"))
    assert t.col.tolist() == [1, 4, 6, 0] and t.val.tolist() == pytest.approx([0.2, 0.3, 0.1, 0.4])
    assert t.crow.tolist() == [0, 3, 3, 4]


def test_columns_slice_keeps_only_the_shard_entries():
    t = make_target(6, 530)
    target = csr(t, torch.float64, "cpu")
    part = target.columns(200, 400)
    dense = torch.zeros(6, 530, dtype=torch.float64)
    dense[part.row, part.col] = part.val
    expected = torch.zeros_like(t)
    expected[:, 200:400] = t[:, 200:400]
    torch.testing.assert_close(dense, expected)
    assert part.crow[-1] == part.col.numel() and (part.crow[1:] >= part.crow[:-1]).all()


@pytest.mark.parametrize("make,kind,error,match", [
    (lambda: torch.zeros(3, 8), "probability", TypeError, "sparse_csr or torch.sparse_coo"),
    (lambda: torch.zeros(3, 9).to_sparse_csr(), "probability", ValueError, r"\[N, V\]=\[3, 8\]"),
    (lambda: torch.zeros(3, 8, dtype=torch.int64).to_sparse_coo(), "probability", TypeError, "floating point"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[0], [8]]), torch.tensor([1.0]), (3, 8), check_invariants=False),
     "probability", ValueError, "out of range"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.tensor([-0.5]), (3, 8)), "probability",
     ValueError, ">= 0"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.tensor([1.5]), (3, 8)), "binary",
     ValueError, r"in \[0, 1\]"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[1, 1], [2, 2]]), torch.tensor([0.75, 0.75]), (3, 8)), "binary",
     ValueError, r"in \[0, 1\]"),  # duplicates summed past 1
    (lambda: torch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.tensor([-0.25]), (3, 8)), "binary",
     ValueError, r"in \[0, 1\]"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[0], [-1]]), torch.tensor([1.0]), (3, 8), check_invariants=False),
     "probability", ValueError, r"entry \(0, -1\) is out of range"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[3], [1]]), torch.tensor([1.0]), (3, 8), check_invariants=False),
     "binary", ValueError, r"entry \(3, 1\) is out of range"),
    (lambda: torch.sparse_csr_tensor(torch.tensor([0, 1, 1, 2]), torch.tensor([2, 9]), torch.tensor([0.5, 0.5]),
                                     (3, 8), check_invariants=False), "probability", ValueError,
     r"entry \(2, 9\) is out of range for \[N, V\]=\[3, 8\]"),
    (lambda: torch.sparse_csr_tensor(torch.tensor([0, 1, 1, 2]), torch.tensor([2, 5]), torch.tensor([0.5, -2.0]),
                                     (3, 8)), "probability", ValueError, ">= 0; got -2.0"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1, 2), (3, 8, 2)), "probability",
     ValueError, r"\[N, V\]"),
    (lambda: torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 8), (3, 8)), "probability",
     ValueError, "2 sparse dimensions"),
])
def test_prepare_rejects_bad_targets(make, kind, error, match):
    with pytest.raises(error, match=match):
        sparse.prepare(make(), 3, 8, kind=kind, dtype=torch.float32, device=torch.device("cpu"))


def _csr(crow, col, val):
    return torch.sparse_csr_tensor(torch.tensor(crow), torch.tensor(col), torch.tensor(val), (3, 8),
                                   check_invariants=False)


def _coo(rows, cols, vals):
    return torch.sparse_coo_tensor(torch.tensor([rows, cols]), torch.tensor(vals), (3, 8))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kind", ["probability", "binary"])
@pytest.mark.parametrize("make,message", [
    # A value the loss cannot use, named by its (row, class) in the [N, V] target, not its storage slot.
    (lambda: _coo([0, 2], [1, 6], [0.5, NAN]), "sparse target value at (row 2, class 6) is NaN; target values "
                                               "must be finite"),
    (lambda: _coo([0, 2], [1, 6], [INF, 0.5]), "sparse target value at (row 0, class 1) is inf; target values "
                                               "must be finite"),
    (lambda: _coo([1], [3], [-INF]), "sparse target value at (row 1, class 3) is -inf; target values must be finite"),
    (lambda: _csr([0, 1, 1, 3], [2, 0, 7], [0.5, 0.5, NAN]), "sparse target value at (row 2, class 7) is NaN"),
    (lambda: _coo([2, 0, 2], [7, 1, 4], [0.5, 0.5, -0.5]), "got -0.5 at (row 2, class 4)"),
    # Row pointers that do not delimit the entries: said before anything reads them.
    (lambda: _csr([0, 2, 1, 3], [0, 1, 2], [0.5, 0.5, 1.0]),
     "a CSR target's crow_indices must be [N + 1] non-decreasing offsets from 0 to its 3 entries; "
     "it falls from 2 to 1 after row 1"),
    (lambda: _csr([0, 1, 2, 2], [0, 1, 2], [1.0, 1.0, 1.0]), "its 3 entries; it ends at 2"),
    (lambda: _csr([1, 2, 3, 3], [0, 1, 2], [1.0, 1.0, 1.0]), "crow_indices must be [N + 1] non-decreasing offsets from 0 to its 3 entries; it starts at 1"),
    (lambda: _csr([0, 1, 2, 3], [0, 8, 2], [1.0, 1.0, 1.0]),
     "sparse target entry (1, 8) is out of range for [N, V]=[3, 8] (class ids must be in 0..7)"),
])
def test_prepare_names_the_bad_entry_or_pointer(make, message, kind):
    with pytest.raises(ValueError) as info:
        sparse.prepare(make(), 3, 8, kind=kind, dtype=torch.float32, device=torch.device("cpu"))
    assert message in str(info.value)


def test_binary_value_error_names_row_and_class_of_summed_duplicates():
    # Two 0.75 entries at (1, 5) sum past 1; the stored order puts other entries first.
    target = torch.sparse_coo_tensor(torch.tensor([[2, 1, 0, 1], [3, 5, 0, 5]]), torch.tensor([1.0, 0.75, 1.0, 0.75]),
                                     (3, 8))
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]; got 1\.5 at \(row 1, class 5\)"):
        sparse.prepare(target, 3, 8, kind="binary", dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("crow,message", [
    ([0, 2, 1, 3], "a CsrTarget's crow must be [N + 1] non-decreasing offsets from 0 to its 3 entries; it falls from 2 "
                   "to 1 after row 1"),
    ([0, 1, 2, 4], "a CsrTarget's crow must be [N + 1] non-decreasing offsets from 0 to its 3 entries; it ends at 4"),
])
def test_converted_target_with_bad_pointers_says_what_is_wrong(crow, message):
    good = sparse.csr_target(torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 3]]), torch.ones(3), (3, 8)))
    bad = sparse.CsrTarget(torch.tensor(crow), good.col, good.val, good.row, 8)
    with pytest.raises(ValueError) as info:
        sparse.prepare(bad, 3, 8, kind="probability", dtype=torch.float32, device=torch.device("cpu"))
    assert message in str(info.value)


def test_losses_reject_a_nan_sparse_target_and_stay_usable():
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    nan = _coo([0, 1], [2, 3], [0.5, NAN]).double()
    with pytest.raises(ValueError, match=r"\(row 1, class 3\) is NaN"):
        hugehead.linear_cross_entropy(x, w, nan)
    with pytest.raises(ValueError, match=r"\(row 1, class 3\) is NaN"):
        hugehead.linear_binary_cross_entropy(x, w, nan)
    good = _coo([0, 1], [2, 3], [0.5, 1.0]).double()
    expected = F.cross_entropy(x @ w.T, good.to_dense(), reduction="mean")
    torch.testing.assert_close(hugehead.linear_cross_entropy(x, w, good), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("weight,error,match", [
    (torch.ones(7), ValueError, r"\[V\]=\[8\]"),
    (torch.ones(8, dtype=torch.int64), TypeError, "floating point"),
    ([1.0] * 8, TypeError, "must be a tensor"),
])
def test_check_class_weight_rejects(weight, error, match):
    with pytest.raises(error, match=match):
        sparse.check_class_weight(weight, 8, torch.device("cpu"))


@pytest.mark.parametrize("weight,error,match", [
    (torch.ones(7), ValueError, r"pos_weight must be a dense \[V\]=\[8\]"),
    (torch.ones(2, 8), ValueError, r"pos_weight must be a dense \[V\]"),
    (torch.ones(8, dtype=torch.int32), TypeError, "pos_weight must be floating point"),
    (2.5, TypeError, "pos_weight must be a tensor"),
])
def test_check_pos_weight_rejects(weight, error, match):
    with pytest.raises(error, match=match):
        sparse.check_pos_weight(weight, 8, torch.device("cpu"))
    sparse.check_pos_weight(torch.ones(8), 8, torch.device("cpu"))  # [V] and one element are both fine
    sparse.check_pos_weight(torch.tensor([2.0]), 8, torch.device("cpu"))
