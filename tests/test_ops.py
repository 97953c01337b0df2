"""The op contract: torch.ops.hugehead.chunk_stats_ / chunk_grad_ against a hand-written float64
computation (running statistics over two chunks, targets outside the chunk, softcap, strided chunks),
their argument checks, and torch.library.opcheck on them and on the single-device forward/backward ops."""
import dataclasses
import math

import pytest
import torch

import hugehead  # noqa: F401  (registers torch.ops.hugehead.*)
from hugehead import ops
from hugehead.lce_op import op_plan

from conftest import FLOAT_DTYPES, rel_err, requires_cuda

ALL_DTYPES = FLOAT_DTYPES + [torch.float64]
# Accumulation is float32 (float64 for float64 logits); the inputs are the same rounded values, so only
# the accumulation's rounding separates kernel and float64 reference.
STATS_TOL = {torch.float64: 1e-12}
STATS_TOL_DEFAULT = 2e-6


def fresh_stats(n, dtype, device):
    acc = ops.acc_dtype(dtype)
    return [
        torch.full((n,), -math.inf, dtype=acc, device=device),
        torch.zeros(n, dtype=acc, device=device),
        torch.zeros(n, dtype=acc, device=device),
        torch.zeros(n, dtype=acc, device=device),
    ]


def softcapped(z: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(z / softcap) if softcap > 0 else z


def hand_row_loss(z: torch.Tensor, target: torch.Tensor, label_smoothing: float, z_loss: float,
                  softcap: float) -> torch.Tensor:
    """Per-row loss of full ``[N, V]`` float64 logits, written out from the formula (targets in range)."""
    c = softcapped(z, softcap)
    lse = torch.logsumexp(c, dim=1)
    c_y = c.gather(1, target[:, None])[:, 0]
    return (lse - (1 - label_smoothing) * c_y - label_smoothing * c.mean(dim=1) + z_loss * lse**2), lse


# --------------------------------------------------------------------------------------------------
# chunk_stats_
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_chunk_stats_two_chunks_match_float64(device, dtype, softcap):
    torch.manual_seed(0)
    n, v, split = 37, 530, 211  # chunks [0, 211) and [211, 530): neither a multiple of a vector width
    z = (torch.randn(n, v, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, v, (n,))
    target[:5] = torch.tensor([0, split - 1, split, v - 1, -100])  # chunk edges, and one outside both
    target[5] = v + 7
    stats = fresh_stats(n, dtype, device)
    stats[2].fill_(123.0)  # target_logit of rows whose target is in no chunk must stay untouched
    zd, td = z.to(device), target.to(device)
    # Column slices of the [N, V] buffer: row stride V, and the second chunk starts mid-vector.
    torch.ops.hugehead.chunk_stats_(zd[:, :split], td, 0, softcap, *stats)
    torch.ops.hugehead.chunk_stats_(zd[:, split:], td, split, softcap, *stats)
    row_max, row_sumexp, target_logit, logit_sum = (s.double().cpu() for s in stats)

    c = softcapped(z.double(), softcap)
    tol = STATS_TOL.get(dtype, STATS_TOL_DEFAULT)
    torch.testing.assert_close(row_max, c.max(dim=1).values, rtol=tol, atol=0)
    torch.testing.assert_close(row_max + row_sumexp.log(), torch.logsumexp(c, dim=1), rtol=tol, atol=0)
    torch.testing.assert_close(logit_sum, c.sum(dim=1), rtol=tol, atol=tol * c.abs().sum(dim=1).max().item())
    inside = (target >= 0) & (target < v)
    expected = torch.where(inside, c.gather(1, target.clamp(0, v - 1)[:, None])[:, 0], torch.full((n,), 123.0))
    torch.testing.assert_close(target_logit, expected, rtol=tol, atol=0)
    assert target_logit[4] == 123.0 and target_logit[5] == 123.0


def test_chunk_stats_target_outside_chunk_and_offset(device):
    """A chunk holding classes [100, 104): targets below and above it are skipped, inside it picked."""
    z = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4, device=device)
    target = torch.tensor([99, 100, 103, 104], device=device)
    stats = fresh_stats(4, torch.float32, device)
    stats[2].fill_(-7.0)
    torch.ops.hugehead.chunk_stats_(z, target, 100, 0.0, *stats)
    assert stats[2].tolist() == [-7.0, 1.0, 4.0, -7.0]
    assert stats[0].tolist() == [4.0] * 4
    torch.testing.assert_close(stats[1].cpu(), torch.full((4,), sum(math.exp(k - 4.0) for k in range(1, 5))))
    assert stats[3].tolist() == [10.0] * 4


def test_chunk_stats_running_merge_rescales(device):
    """A later chunk with a larger max rescales the earlier sum; a smaller one adds into it."""
    target = torch.tensor([0], device=device)
    stats = fresh_stats(1, torch.float64, device)
    for start, chunk in ((0, [0.0, 1.0]), (2, [5.0]), (3, [-2.0, 2.0])):
        torch.ops.hugehead.chunk_stats_(torch.tensor([chunk], dtype=torch.float64, device=device), target, start,
                                        0.0, *stats)
    all_logits = torch.tensor([0.0, 1.0, 5.0, -2.0, 2.0], dtype=torch.float64)
    assert stats[0].item() == 5.0
    torch.testing.assert_close(stats[0].cpu() + stats[1].cpu().log(), torch.logsumexp(all_logits, 0)[None],
                               rtol=1e-14, atol=0)
    assert stats[2].item() == 0.0 and stats[3].item() == 6.0


def test_chunk_stats_strided_chunk_and_non_finite(device):
    """A column slice of a wider buffer (row stride > C) reads only its columns; -inf logits count as
    exp(-inf) = 0 (an all -inf row keeps a zero sum), NaN propagates to the sum."""
    buf = torch.randn(3, 10, dtype=torch.float64, device=device)
    buf[0, 2:6] = -math.inf
    buf[1, 4] = math.nan
    chunk = buf[:, 2:6]
    assert chunk.stride() == (10, 1)
    stats = fresh_stats(3, torch.float64, device)
    torch.ops.hugehead.chunk_stats_(chunk, torch.tensor([0, 1, 3], device=device), 0, 0.0, *stats)
    assert stats[0][0].item() == -math.inf and stats[1][0].item() == 0.0
    assert math.isnan(stats[1][1].item())
    torch.testing.assert_close(stats[0][2] + stats[1][2].log(), torch.logsumexp(chunk[2], 0), rtol=1e-14, atol=0)
    torch.testing.assert_close(stats[3][2], chunk[2].sum(), rtol=1e-14, atol=1e-13)
    assert stats[2][2].item() == chunk[2, 3].item()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_chunk_stats_non_finite_inside_vector_packs(device, dtype):
    """Rows long enough for the CUDA kernel's 16-byte packs (and its scalar head and tail): a NaN among
    -inf values still makes the sum NaN, an all -inf row keeps a zero sum, -inf among finite values
    counts as 0, and a +inf logit gives a NaN sum as F.cross_entropy's log_softmax does; the finite row
    matches float64."""
    n, c = 4, 1000
    z = torch.randn(n, c + 3, dtype=torch.float64)
    z[0] = -math.inf
    z[0, 517] = math.nan
    z[1] = -math.inf
    z[2, 100:700:3] = -math.inf
    z[3, 640] = math.inf
    buf = z.to(dtype).to(device)
    chunk = buf[:, 3:]  # starts mid-pack: scalar head, vector body, scalar tail
    stats = fresh_stats(n, dtype, device)
    torch.ops.hugehead.chunk_stats_(chunk, torch.tensor([5, 6, 7, 8], device=device), 0, 0.0, *stats)
    m, s = stats[0].cpu().double(), stats[1].cpu().double()
    assert math.isnan(s[0].item())
    assert m[1].item() == -math.inf and s[1].item() == 0.0
    ref = torch.logsumexp(chunk[2].double().cpu(), 0)
    assert abs((m[2] + s[2].log()).item() - ref.item()) <= STATS_TOL_DEFAULT * abs(ref.item()) + 1e-6
    assert math.isnan((m[3] + s[3].log()).item())
    assert stats[2][2].item() == chunk[2, 7].float().item()


# --------------------------------------------------------------------------------------------------
# chunk_grad_
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    "label_smoothing,z_loss,softcap", [(0.0, 0.0, 0.0), (0.2, 0.0, 0.0), (0.0, 0.01, 0.0), (0.0, 0.0, 2.5),
                                       (0.1, 0.02, 4.0)]
)
def test_chunk_grad_matches_autograd_of_float64_loss(device, dtype, label_smoothing, z_loss, softcap):
    torch.manual_seed(1)
    n, v, split = 29, 301, 120
    z = (torch.randn(n, v, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, v, (n,))
    target[:3] = torch.tensor([0, split - 1, split])
    grad_rows = torch.rand(n, dtype=torch.float64) + 0.5
    grad_rows[7] = 0.0  # an ignored row

    z64 = z.double().requires_grad_()
    loss, lse = hand_row_loss(z64, target, label_smoothing, z_loss, softcap)
    (loss * grad_rows).sum().backward()
    expected = z64.grad

    acc = ops.acc_dtype(dtype)
    buf = z.clone().to(device)
    td, lse_d, g_d = target.to(device), lse.detach().to(acc).to(device), grad_rows.to(acc).to(device)
    torch.ops.hugehead.chunk_grad_(buf[:, :split], td, 0, v, lse_d, g_d, label_smoothing, z_loss, softcap)
    torch.ops.hugehead.chunk_grad_(buf[:, split:], td, split, v, lse_d, g_d, label_smoothing, z_loss, softcap)
    got = buf.double().cpu()
    assert bool((got[7] == 0).all())
    # Each element is one rounding of a float32 (float64) value into dtype, at most half an epsilon of
    # dtype relative; float32 accumulation (lse rounded to float32, exp, tanh) adds a few 1e-7.
    tol = 1e-12 if dtype == torch.float64 else torch.finfo(dtype).eps / 2 + 2e-6
    assert rel_err(got, expected) <= tol


def test_chunk_grad_ignored_rows_are_exact_zeros_even_with_nan(device):
    z = torch.randn(3, 8, device=device)
    z[1] = math.nan
    z[2, 0] = math.inf
    lse = torch.logsumexp(z, dim=1)
    grad_rows = torch.tensor([1.0, 0.0, 0.0], device=device)
    torch.ops.hugehead.chunk_grad_(z, torch.tensor([2, -100, 3], device=device), 0, 8, lse, grad_rows, 0.1, 0.0, 0.0)
    assert bool((z[1:] == 0).all()) and not bool((z[0] == 0).all())


def test_chunk_grad_strided_chunk_writes_only_its_columns(device):
    buf = torch.randn(4, 12, dtype=torch.float64, device=device)
    before = buf.clone()
    target = torch.tensor([3, 5, 0, 11], device=device)
    lse = torch.logsumexp(buf, dim=1)
    grad_rows = torch.ones(4, dtype=torch.float64, device=device)
    torch.ops.hugehead.chunk_grad_(buf[:, 3:7], target, 3, 12, lse, grad_rows, 0.0, 0.0, 0.0)
    assert torch.equal(buf[:, :3], before[:, :3]) and torch.equal(buf[:, 7:], before[:, 7:])
    expected = before[:, 3:7].sub(lse[:, None]).exp()
    expected[0, 0] -= 1.0  # target 3 is column 0 of the chunk
    expected[1, 2] -= 1.0  # target 5 is column 2
    torch.testing.assert_close(buf[:, 3:7], expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_long_rows_from_mid_pack_match_float64(device, dtype, label_smoothing):
    """Rows long enough for the CUDA kernels' body of four 16-byte packs in flight per thread, beside their
    scalar head and tail (the chunk starts 3 columns into its row): chunk_stats_'s log-sum-exp and
    chunk_grad_'s gradient against float64, for the plain loss (16-bit logits: the SFU exponential) and with
    label smoothing (the general formula); the 3 columns before the chunk are not written."""
    torch.manual_seed(3)
    n, v = 5, 70001
    full = (torch.randn(n, v + 3, dtype=torch.float64) * 3).to(dtype)
    z = full[:, 3:]
    target = torch.randint(0, v, (n,))
    grad_rows = torch.rand(n, dtype=torch.float64) + 0.5
    z64 = z.double().requires_grad_()
    loss, lse = hand_row_loss(z64, target, label_smoothing, 0.0, 0.0)
    (loss * grad_rows).sum().backward()

    acc = ops.acc_dtype(dtype)
    buf = full.clone().to(device)
    td = target.to(device)
    stats = fresh_stats(n, acc, device)
    torch.ops.hugehead.chunk_stats_(buf[:, 3:], td, 0, 0.0, *stats)
    got_lse = (stats[0].double() + stats[1].double().log()).cpu()
    # The CPU's 16-bit path sums a row's exps one after another in float32: an error that grows with the row
    # (5.4e-6 of lse at 70001 columns); the CUDA kernel's block tree and the CPU's float32 SIMD lanes do not.
    stats_tol = 1e-5 if device.type == "cpu" and dtype != torch.float32 else STATS_TOL_DEFAULT
    assert (got_lse - lse.detach()).abs().max().item() <= stats_tol * lse.detach().abs().max().item()
    assert torch.equal(stats[2].double().cpu(), z.double()[torch.arange(n), target])

    lse_d, g_d = lse.detach().to(acc).to(device), grad_rows.to(acc).to(device)
    torch.ops.hugehead.chunk_grad_(buf[:, 3:], td, 0, v, lse_d, g_d, label_smoothing, 0.0, 0.0)
    assert torch.equal(buf[:, :3].cpu(), full[:, :3])
    tol = torch.finfo(dtype).eps / 2 + 2e-6
    assert rel_err(buf[:, 3:].double().cpu(), z64.grad) <= tol


@pytest.mark.parametrize("dtype,label_smoothing", [(torch.bfloat16, 0.0), (torch.float32, 0.1)])
def test_chunk_grad_across_column_segments_matches_float64(device, dtype, label_smoothing):
    """Rows of several CUDA segments (16384 columns a block; 65536 and 131072 are edges of 65536-column ones
    too): targets on both sides of segment edges and in the short last segment, an ignored row (zeros in
    every segment), the chunk 5 columns into a row of a strided buffer, whose other columns stay as they were."""
    torch.manual_seed(4)
    n, v, off = 7, 140003, 5
    full = (torch.randn(n, v + off + 2, dtype=torch.float64) * 3).to(dtype)
    z = full[:, off:off + v]
    target = torch.tensor([65535, 65536, 65537, 131071, 131072, v - 1, 0])
    grad_rows = torch.rand(n, dtype=torch.float64) + 0.5
    grad_rows[6] = 0.0
    z64 = z.double().requires_grad_()
    loss, lse = hand_row_loss(z64, target, label_smoothing, 0.0, 0.0)
    (loss * grad_rows).sum().backward()
    acc = ops.acc_dtype(dtype)
    buf = full.clone().to(device)
    torch.ops.hugehead.chunk_grad_(buf[:, off:off + v], target.to(device), 0, v, lse.detach().to(acc).to(device),
                                   grad_rows.to(acc).to(device), label_smoothing, 0.0, 0.0)
    got = buf.double().cpu()
    before = full.double()
    assert torch.equal(got[:, :off], before[:, :off]) and torch.equal(got[:, off + v:], before[:, off + v:])
    assert bool((got[6, off:off + v] == 0).all())
    rows = torch.arange(6)
    assert torch.all((got[rows, off + target[:6]] - z64.grad[rows, target[:6]]).abs()
                     <= torch.finfo(dtype).eps * z64.grad[rows, target[:6]].abs())  # each target's own term
    assert rel_err(got[:, off:off + v], z64.grad) <= torch.finfo(dtype).eps / 2 + 2e-6


# --------------------------------------------------------------------------------------------------
# Argument checks of the kernels
# --------------------------------------------------------------------------------------------------
def _stats_args(device, n=4, c=6):
    return [torch.randn(n, c, device=device), torch.zeros(n, dtype=torch.long, device=device), 0, 0.0,
            *fresh_stats(n, torch.float32, device)]


def _grad_args(device, n=4, c=6):
    return [torch.randn(n, c, device=device), torch.zeros(n, dtype=torch.long, device=device), 0, c,
            torch.zeros(n, device=device), torch.ones(n, device=device), 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "index,value,match",
    [
        (0, lambda a: a[0][:, None], r"logits must have 2 dims"),
        (1, lambda a: a[1].int(), r"target must be Long"),
        (1, lambda a: a[1][:3], r"target.size\(0\) must be 4"),
        (4, lambda a: a[4].double(), r"row_max must be Float"),
        (5, lambda a: a[5][:2], r"row_sumexp must have shape \[4\]"),
        (7, lambda a: torch.zeros(8, device=a[7].device)[::2], r"logit_sum must be contiguous"),
    ],
)
def test_chunk_stats_rejects_bad_arguments(device, index, value, match):
    args = _stats_args(device)
    args[index] = value(args)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.hugehead.chunk_stats_(*args)


@pytest.mark.parametrize(
    "index,value,match",
    [
        (0, lambda a: a[0].t().contiguous().t(), r"unit column stride"),
        (3, lambda a: 0, r"num_classes must be positive"),
        (4, lambda a: a[4].half(), r"lse must be Float"),
        (5, lambda a: a[5][:1], r"grad_rows must have shape \[4\]"),
        (1, lambda a: a[1].float(), r"target must be Long"),
    ],
)
def test_chunk_grad_rejects_bad_arguments(device, index, value, match):
    args = _grad_args(device)
    args[index] = value(args)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.hugehead.chunk_grad_(*args)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op", ["chunk_stats_", "chunk_grad_"])
def test_kernels_reject_mixed_devices(op):
    args = _stats_args("cuda") if op == "chunk_stats_" else _grad_args("cuda")
    args[1] = args[1].cpu()
    with pytest.raises(RuntimeError, match=r"target is on cpu but logits is on cuda"):
        getattr(torch.ops.hugehead, op)(*args)


# --------------------------------------------------------------------------------------------------
# opcheck: schema, fake kernels, autograd registration, AOT dispatch
# --------------------------------------------------------------------------------------------------
def sample_inputs_chunk_stats(device):
    """Argument lists for chunk_stats_: dtypes, softcap, chunk offsets, strided and empty chunks."""
    torch.manual_seed(2)
    for dtype in ALL_DTYPES:
        for softcap, class_start in ((0.0, 0), (5.0, 40)):
            n, c = 9, 33
            logits = torch.randn(n, c, device=device, dtype=dtype)
            target = torch.randint(class_start - 5, class_start + c + 5, (n,), device=device)
            yield [logits, target, class_start, softcap, *fresh_stats(n, dtype, device)]
    wide = torch.randn(5, 20, device=device)
    yield [wide[:, 3:11], torch.arange(5, device=device), 3, 0.0, *fresh_stats(5, torch.float32, device)]
    transposed = torch.randn(8, 5, device=device).t()  # column stride 5: the op reads a contiguous copy
    yield [transposed, torch.arange(5, device=device), 0, 2.0, *fresh_stats(5, torch.float32, device)]
    yield [torch.randn(0, 7, device=device), torch.zeros(0, dtype=torch.long, device=device), 0, 0.0,
           *fresh_stats(0, torch.float32, device)]


def sample_inputs_chunk_grad(device):
    """Argument lists for chunk_grad_: dtypes, every option, chunk offsets, ignored rows, strided chunks."""
    torch.manual_seed(3)
    for dtype in ALL_DTYPES:
        acc = ops.acc_dtype(dtype)
        for ls, zl, softcap, class_start in ((0.0, 0.0, 0.0, 0), (0.1, 1e-3, 5.0, 40)):
            n, c = 9, 33
            logits = torch.randn(n, c, device=device, dtype=dtype)
            target = torch.randint(class_start, class_start + c, (n,), device=device)
            lse = torch.logsumexp(logits.to(acc), dim=1) + 1.0
            grad_rows = torch.rand(n, device=device, dtype=acc)
            grad_rows[0] = 0.0
            yield [logits, target, class_start, 200, lse, grad_rows, ls, zl, softcap]
    wide = torch.randn(5, 20, device=device)
    yield [wide[:, 3:11], torch.arange(5, device=device), 3, 20, torch.logsumexp(wide, 1), torch.ones(5, device=device),
           0.0, 0.0, 0.0]


@pytest.mark.parametrize("args", list(sample_inputs_chunk_stats("cpu")), ids=lambda _: "")
def test_opcheck_chunk_stats_cpu(args):
    torch.library.opcheck(torch.ops.hugehead.chunk_stats_.default, args)


@pytest.mark.parametrize("args", list(sample_inputs_chunk_grad("cpu")), ids=lambda _: "")
def test_opcheck_chunk_grad_cpu(args):
    torch.library.opcheck(torch.ops.hugehead.chunk_grad_.default, args)


@requires_cuda
@pytest.mark.cuda
def test_opcheck_kernels_cuda():
    for args in sample_inputs_chunk_stats("cuda"):
        torch.library.opcheck(torch.ops.hugehead.chunk_stats_.default, args)
    for args in sample_inputs_chunk_grad("cuda"):
        torch.library.opcheck(torch.ops.hugehead.chunk_grad_.default, args)


def sample_inputs_lce(device, dtype=torch.float32):
    """(forward args, backward args) pairs of the single-device ops: with and without bias, every
    option, pinned and planned chunks, rows split, one gradient asked for or both."""
    torch.manual_seed(4)
    n, d, v = 10, 6, 37
    configs = [
        dict(bias=True, ignore_index=-100, ls=0.0, zl=0.0, cap=0.0, chunk=8, budget=0, need=(True, True)),
        dict(bias=False, ignore_index=3, ls=0.1, zl=1e-3, cap=5.0, chunk=0, budget=0, need=(True, False)),
        dict(bias=True, ignore_index=-1, ls=0.2, zl=0.0, cap=2.0, chunk=8, budget=3 * (8 * 4 + 6 * 8),
             need=(False, True)),
        # Logits kept between forward and backward, a returned lse's gradient, a weight stored in float32
        # under a bfloat16 computation (autocast).
        dict(bias=True, ignore_index=-100, ls=0.1, zl=1e-3, cap=0.0, chunk=0, budget=0, need=(True, True),
             keep=True, grad_lse=True),
        dict(bias=True, ignore_index=-100, ls=0.0, zl=0.0, cap=0.0, chunk=0, budget=0, need=(True, True),
             keep=True, x_dtype=torch.bfloat16),
    ]
    for cfg in configs:
        x = torch.randn(n, d, device=device, dtype=cfg.get("x_dtype", dtype), requires_grad=True)
        w = torch.randn(v, d, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(v, device=device, dtype=dtype, requires_grad=True) if cfg["bias"] else None
        target = torch.randint(0, v, (n,), device=device)
        target[2] = cfg["ignore_index"]
        opts = [cfg["ignore_index"], cfg["ls"], cfg["zl"], cfg["cap"], cfg["chunk"], cfg["budget"]]
        keep = cfg.get("keep", False)
        plan = op_plan(x, w, cfg["chunk"], cfg["budget"], keep).encode()  # the caller's plan, as loss_plan's
        fwd = [x, w, b, target, *opts, keep, plan]
        _, lse, kept, store = torch.ops.hugehead.linear_cross_entropy_forward(*fwd)
        assert kept.dim() == 3 and kept.shape[1] == n if keep else kept.shape == (0,)
        assert store.shape == (0,)  # planned inside the op: nothing kept in the weight gradient's buffer
        acc = ops.acc_dtype(x.dtype)
        grad_loss = torch.rand(n, device=device, dtype=acc)
        grad_lse = torch.rand(n, device=device, dtype=acc) if cfg.get("grad_lse") else None
        bwd = [grad_loss, grad_lse, x.detach(), w.detach(), None if b is None else b.detach(), target, lse.detach(),
               kept.detach(), store, *opts, *cfg["need"], plan]
        yield fwd, bwd, keep


def test_opcheck_linear_cross_entropy_ops_keeping_logits_in_the_gradients_buffer(device, tuned):
    """The ops with a plan that keeps a chunk in the weight gradient's buffer (the forward's fourth output, the
    backward's mutated ``store``): schema, autograd registration and fake tensors agree with the real ops, and
    the backward's dW is the store (its own dW output empty) and matches the plan without it."""
    from hugehead.lce_op import loss_plan
    from hugehead.plan import _MAX_COLS

    tuned(rows=False)
    cols = _MAX_COLS[device.type]
    n, d, v = 12, 5, 4 * cols - 100
    budget = n * d * 12 + int(2.5 * n * cols * 8)
    x = torch.randn(n, d, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, device=device, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, v, (n,), device=device)
    plan = loss_plan(x, w, target, memory_budget=budget)
    assert plan.kept_in_grad == 1, plan
    opts = [-100, 0.0, 0.0, 0.0, 0, budget]
    fwd = [x, w, None, target, *opts, True, plan.encode()]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.hugehead.linear_cross_entropy_forward.default, fwd, test_utils=utils)
    _, lse, kept, store = torch.ops.hugehead.linear_cross_entropy_forward(*fwd)
    assert store.shape == w.shape and store.dtype == w.dtype
    grad_loss = torch.rand(n, device=device, dtype=torch.float64)
    common = [grad_loss, None, x.detach(), w.detach(), None, target, lse.detach()]
    bwd = [*common, kept, store, *opts, True, True, plan.encode()]
    torch.library.opcheck(torch.ops.hugehead.linear_cross_entropy_backward.default, bwd, test_utils=utils)
    _, lse, kept, store = torch.ops.hugehead.linear_cross_entropy_forward(*fwd)
    dx, dw, _ = torch.ops.hugehead.linear_cross_entropy_backward(*common, kept, store, *opts, True, True,
                                                                  plan.encode())
    assert dw.shape == (0,)
    recompute = dataclasses.replace(plan, keep_logits=False, kept_chunks=0, kept_in_grad=0)  # nothing kept
    ref_dx, ref_dw, _ = torch.ops.hugehead.linear_cross_entropy_backward(*common, x.new_empty(0), w.new_empty(0),
                                                                          *opts, True, True, recompute.encode())
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=0)
    torch.testing.assert_close(store, ref_dw, rtol=1e-12, atol=1e-300)


def test_opcheck_linear_cross_entropy_ops(device):
    for fwd, bwd, keep in sample_inputs_lce(device):
        # Kept logits are an eager-only path (linear_cross_entropy never keeps them under torch.compile:
        # they ride on the autograd ctx, not through the traced graph), so AOT dispatch is not checked.
        utils = ("test_schema", "test_autograd_registration", "test_faketensor")
        kwargs = {"test_utils": utils} if keep else {}
        torch.library.opcheck(torch.ops.hugehead.linear_cross_entropy_forward.default, fwd, **kwargs)
        torch.library.opcheck(torch.ops.hugehead.linear_cross_entropy_backward.default, bwd)
