"""hugehead.linear_distill: forward KL, reverse KL and JSD between a teacher's and a student's tempered softmax,
values and student gradients under random upstream gradients, against float64 plain PyTorch written from the
formulas (full softmax, F.kl_div) for every option, heads given as weights or as ChunkedClassifiers in local
placements (other shard boundaries, the teacher in host memory), and a teacher given as its top-k."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hugehead
from hugehead import ops
from hugehead.engines import offload
from hugehead.ops import target_chunks

from conftest import DEVICES, rel_err, requires_cuda

N, DS, DT, V = 13, 6, 9, 61


def _inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, DS, generator=g, dtype=torch.float64)
    ws = torch.randn(V, DS, generator=g, dtype=torch.float64)
    bs = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    xt = torch.randn(N, DT, generator=g, dtype=torch.float64) * 1.5
    wt = torch.randn(V, DT, generator=g, dtype=torch.float64)
    bt = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    mask = torch.rand(N, generator=g) > 0.25
    up = torch.randn(N, generator=g, dtype=torch.float64)
    return xs, ws, bs, xt, wt, bt, mask, up


def reference(divergence, beta, temperature, xs, ws, bs, xt, wt, bt, mask, student_cap=None, teacher_cap=None):
    """Per-row divergences, float64, 0 outside the mask."""
    def logp(x, w, b, cap):
        z = F.linear(x, w, b)
        z = cap * torch.tanh(z / cap) if cap else z
        return torch.log_softmax(z / temperature, dim=-1)

    lp, lq = logp(xs, ws, bs, student_cap), logp(xt, wt, bt, teacher_cap)
    if divergence == "forward_kl":  # KL(q || p), as F.kl_div(input=log p, target=log q) sums it
        rows = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
    elif divergence == "reverse_kl":
        rows = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lq + math.log(beta), lp + math.log1p(-beta)]), dim=0)
        rows = (beta * F.kl_div(lm, lq, reduction="none", log_target=True).sum(-1)
                + (1 - beta) * F.kl_div(lm, lp, reduction="none", log_target=True).sum(-1))
    return torch.where(mask, rows, torch.zeros_like(rows))


CASES = [
    dict(divergence="forward_kl"),
    dict(divergence="forward_kl", temperature=0.6, chunk_size=16, bias=False),
    dict(divergence="reverse_kl"),
    dict(divergence="reverse_kl", temperature=1.7, chunk_size=7),
    dict(divergence="jsd", beta=0.5),
    dict(divergence="jsd", beta=0.2, temperature=0.8, chunk_size=10, bias=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_divergences_and_student_gradients_match_float64(case):
    case = dict(case)
    use_bias = case.pop("bias", True)
    xs, ws, bs, xt, wt, bt, mask, up = _inputs(bias=use_bias)
    student = [t.clone().requires_grad_() for t in (xs, ws, bs) if t is not None]
    sb = student[2] if use_bias else None
    teacher_w = wt.clone().requires_grad_()  # gets no gradient
    got = hugehead.linear_distill(student[0], student[1], xt, teacher_w, mask=mask, reduction="none",
                                  student_bias=sb, teacher_bias=bt, **case)
    ref = reference(case["divergence"], case.get("beta", 0.5), case.get("temperature", 1.0), *student[:2], sb,
                    xt, wt, bt, mask)
    assert got.dtype == torch.float64 and got.shape == (N,)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad((got * up).sum(), student, retain_graph=True)
    ref_grads = torch.autograd.grad((ref * up).sum(), student)
    for a, r in zip(grads, ref_grads):
        assert rel_err(a, r) < 1e-10
    assert teacher_w.grad is None and got.grad_fn is not None
    # the reductions: sum, and mean over the rows in the mask (batchmean)
    for reduction, expected in (("sum", ref.sum()), ("mean", ref.sum() / mask.sum())):
        out = hugehead.linear_distill(student[0], student[1], xt, wt, mask=mask, reduction=reduction,
                                      student_bias=sb, teacher_bias=bt, **case)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_kl_divergences_vanish_for_the_same_distribution():
    xs, ws, bs, *_ = _inputs()
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        rows = hugehead.linear_distill(xs, ws, xs, ws, student_bias=bs, teacher_bias=bs, divergence=divergence,
                                       reduction="none")
        assert rows.abs().max() < 1e-12


def _head(sizes, seed, d, **kwargs):
    torch.manual_seed(seed)
    return hugehead.ChunkedClassifier(d, V, True, devices=["cpu"] * len(sizes), shard_sizes=sizes,
                                      dtype=torch.float64, chunk_size=8, **kwargs)


def _logical(head):
    return (torch.cat([s.weight.detach() for s in head.shards]), torch.cat([s.bias.detach() for s in head.shards]))


@pytest.mark.parametrize("teacher_offloaded", [False, True])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_heads_as_student_and_teacher_with_other_shard_boundaries(divergence, teacher_offloaded, monkeypatch):
    monkeypatch.setattr(offload, "_ALLOW_CPU_COMPUTE", True)
    student = _head([30, 31], 1, DS, softcap=5.0)
    teacher = _head([10, 40, 11], 2, DT, offload=teacher_offloaded, softcap=3.0)
    xs, _, _, xt, _, _, mask, up = _inputs()
    xr = xs.clone().requires_grad_()
    got = hugehead.linear_distill(xr, student, xt, teacher, divergence=divergence, beta=0.4, temperature=0.9,
                                  mask=mask, reduction="none")
    ws, bs = (t.clone().requires_grad_() for t in _logical(student))
    wt, bt = _logical(teacher)
    ref = reference(divergence, 0.4, 0.9, xr, ws, bs, xt, wt, bt, mask, student_cap=5.0, teacher_cap=3.0)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    params = [xr] + [s.weight for s in student.shards] + [s.bias for s in student.shards]
    grads = torch.autograd.grad((got * up).sum(), params)
    ref_grads = torch.autograd.grad((ref * up).sum(), [xr, ws, bs])
    assert rel_err(grads[0], ref_grads[0]) < 1e-10
    assert rel_err(torch.cat(grads[1:3]), ref_grads[1]) < 1e-10
    assert rel_err(torch.cat(grads[3:5]), ref_grads[2]) < 1e-10
    assert all(s.weight.grad is None for s in teacher.shards)


def test_topk_teacher_is_the_truncated_forward_kl():
    xs, ws, bs, xt, wt, bt, mask, up = _inputs()
    lq = torch.log_softmax((xt @ wt.T + bt) / 2.0, -1)  # the teacher's own temperature
    top_lq, ids = lq.topk(7, dim=-1)
    xr = xs.clone().requires_grad_()
    got = hugehead.linear_distill(xr, ws, None, None, teacher_topk=(ids, top_lq), temperature=0.8, mask=mask,
                                  student_bias=bs, reduction="none")
    lp = torch.log_softmax((xr @ ws.T + bs) / 0.8, -1)
    ref = torch.where(mask, (top_lq.exp() * (top_lq - lp.gather(1, ids))).sum(-1), 0.0)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad((got * up).sum(), xr)
    (rg,) = torch.autograd.grad((ref * up).sum(), xr)
    assert rel_err(g, rg) < 1e-10


def test_bfloat16_error_within_twice_plain_pytorch():
    xs, ws, bs, xt, wt, bt, mask, up = _inputs(seed=4)
    ref = reference("reverse_kl", 0.5, 1.0, xs, ws, bs, xt, wt, bt, mask)
    b = [t.bfloat16() for t in (xs, ws, bs, xt, wt, bt)]
    got = hugehead.linear_distill(b[0], b[1], b[3], b[4], divergence="reverse_kl", mask=mask, reduction="none",
                                  student_bias=b[2], teacher_bias=b[5], chunk_size=16)
    lp = torch.log_softmax(F.linear(b[0], b[1], b[2]).float(), -1)
    lq = torch.log_softmax(F.linear(b[3], b[4], b[5]).float(), -1)
    plain = torch.where(mask, (lp.exp() * (lp - lq)).sum(-1), 0.0)
    assert got.dtype == torch.float32
    assert rel_err(got.double(), ref) <= 2 * rel_err(plain.double(), ref) + 1e-3


def test_bad_arguments_raise_naming_them():
    xs, ws, bs, xt, wt, bt, mask, _ = _inputs()
    with pytest.raises(ValueError, match="unknown divergence"):
        hugehead.linear_distill(xs, ws, xt, wt, divergence="kl")
    with pytest.raises(ValueError, match="beta must be in"):
        hugehead.linear_distill(xs, ws, xt, wt, divergence="jsd", beta=1.0)
    with pytest.raises(ValueError, match="same number of classes"):
        hugehead.linear_distill(xs, ws, xt, wt[:-1])
    with pytest.raises(ValueError, match="mask must be"):
        hugehead.linear_distill(xs, ws, xt, wt, mask=mask[:-1])
    with pytest.raises(ValueError, match="teacher_x must be"):
        hugehead.linear_distill(xs, ws, xt[:-1], wt)
    with pytest.raises(ValueError, match="reduction"):
        hugehead.linear_distill(xs, ws, xt, wt, reduction="batchmean")
    with pytest.raises(ValueError, match="top-k teacher takes divergence='forward_kl'"):
        hugehead.linear_distill(xs, ws, None, None, teacher_topk=(torch.zeros(N, 2, dtype=torch.long),
                                                                  torch.zeros(N, 2)), divergence="jsd")


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_compiles_with_fullgraph(divergence):
    xs, ws, bs, xt, wt, bt, mask, up = _inputs()
    fn = torch.compile(lambda x, w: hugehead.linear_distill(x, w, xt, wt, divergence=divergence, student_bias=bs,
                                                            teacher_bias=bt, mask=mask, chunk_size=16),
                       fullgraph=True, backend="aot_eager")
    params = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
    got = fn(*params)
    ref = reference(divergence, 0.5, 1.0, *params, bs, xt, wt, bt, mask).sum() / mask.sum()
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for a, r in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params)):
        assert rel_err(a, r) < 1e-10


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_divergences_on_cuda_match_float64(divergence):
    g = torch.Generator().manual_seed(12)
    xs, xt = (torch.randn(256, d, generator=g, dtype=torch.float64) for d in (128, 192))
    ws, wt = (torch.randn(30_000, d, generator=g, dtype=torch.float64) / d ** 0.5 for d in (128, 192))
    mask = torch.rand(256, generator=g) > 0.1
    up = torch.randn(256, generator=g, dtype=torch.float64)
    ref_params = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
    ref = reference(divergence, 0.3, 0.9, *ref_params, None, xt, wt, None, mask)
    ref_grads = torch.autograd.grad((ref * up).sum(), ref_params)
    params = [t.cuda().float().requires_grad_() for t in (xs, ws)]
    got = hugehead.linear_distill(params[0], params[1], xt.cuda().float(), wt.cuda().float(), divergence=divergence,
                                  beta=0.3, temperature=0.9, mask=mask.cuda(), reduction="none", chunk_size=4096)
    assert rel_err(got.double().cpu(), ref) < 1e-4
    for a, r in zip(torch.autograd.grad((got * up.cuda()).sum(), params), ref_grads):
        assert rel_err(a.double().cpu(), r) < 1e-4


# --------------------------------------------------------------------------------------------------
# The two kernels, against float64 formulas written out (full softmaxes over both chunks' classes).

def _divergence_rows(divergence, s, u, beta):
    """Per-row divergences (F.kl_div), float64, differentiable in the student's logits ``s``."""
    log_p, log_q = F.log_softmax(s, 1), F.log_softmax(u, 1)
    if divergence == "forward_kl":
        return F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(1)
    if divergence == "reverse_kl":
        return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(1)
    log_m = torch.log(beta * log_q.exp() + (1 - beta) * log_p.exp())
    return beta * F.kl_div(log_m, log_q, log_target=True, reduction="none").sum(1) + (1 - beta) * F.kl_div(
        log_m, log_p, log_target=True, reduction="none").sum(1)


def _kernel_sums(divergence, s, u, beta):
    """What distill_chunk_stats_ folds per row, float64: (the divergence's sum, the JSD's part)."""
    log_p, log_q = F.log_softmax(s, 1), F.log_softmax(u, 1)
    p, q = log_p.exp(), log_q.exp()
    if divergence == "forward_kl":
        return (q * (u - s)).sum(1), torch.zeros(s.shape[0], dtype=s.dtype)
    if divergence == "reverse_kl":
        return (p * (s - u)).sum(1), torch.zeros(s.shape[0], dtype=s.dtype)
    log_m = torch.log(beta * q + (1 - beta) * p)
    part = (p * (log_p - log_m)).sum(1)
    return beta * (q * (log_q - log_m)).sum(1) + (1 - beta) * part, part


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,teacher_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_distill_kernels_match_float64(divergence, dtype, teacher_dtype, device):
    g = torch.Generator().manual_seed(5)
    n, c, beta = 7, 300, 0.3
    z = (torch.randn(n, c, generator=g, dtype=torch.float64) * 3).to(dtype)
    u = (torch.randn(n, c, generator=g, dtype=torch.float64) * 3).to(teacher_dtype)
    up = torch.randn(n, generator=g, dtype=torch.float64)
    up[2] = 0  # a masked row: exact zeros
    code = target_chunks.DIVERGENCE_CODES[divergence]
    s64, u64 = z.double(), u.double()
    sums, part = _kernel_sums(divergence, s64, u64, beta)
    lse, t_lse64 = torch.logsumexp(s64, 1), torch.logsumexp(u64, 1)
    on = dict(device=device, dtype=ops.acc_dtype(dtype))
    t_lse = t_lse64.to(**on)
    row_max, sumexp, logit_sum = torch.full((n,), -math.inf, **on), torch.zeros(n, **on), torch.zeros(n, **on)
    # the KLs keep the teacher's running log-sum-exp in target_logit (from -inf), JSD a plain sum (from 0)
    target_logit = torch.zeros(n, **on) if code == 2 else torch.full((n,), -math.inf, **on)
    zd, ud = z.to(device), u.to(device)
    for a, b in [(0, 110), (110, 300)]:  # two chunks fold into the running statistics
        target_chunks.distill_chunk_stats_(zd[:, a:b], ud[:, a:b], code, beta, 0.0, 0.0,
                                           t_lse if code == 2 else None, lse.to(**on) if code == 2 else None,
                                           row_max, sumexp, logit_sum, target_logit)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err((row_max + sumexp.log()).double().cpu(), lse) < tol
    if code == 1:  # reverse KL's sum is scaled with the running max: over the sum of exps, the mean under p
        logit_sum = logit_sum / sumexp
    assert rel_err(logit_sum.double().cpu(), sums) < tol
    assert rel_err(target_logit.double().cpu(), part if code == 2 else t_lse64) < tol
    coef = None if code == 0 else (sums if code == 1 else (1 - beta) * part).to(**on)
    grad = zd.clone()
    target_chunks.distill_chunk_grad_(grad, ud, code, beta, 0.0, 0.0, lse.to(**on), t_lse, coef, up.to(**on))
    s = s64.clone().requires_grad_()
    (ref,) = torch.autograd.grad((_divergence_rows(divergence, s, u64, beta) * up).sum(), s)
    assert rel_err(grad.double().cpu(), ref) < (1e-12 if dtype == torch.float64 else 1e-2)
    assert torch.equal(grad[2].cpu(), torch.zeros(c, dtype=dtype))


def _sample_inputs_distill(device):
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        acc = ops.acc_dtype(dtype)
        n, c = 5, 23
        z, u = (torch.randn(n, c, generator=g).to(device=device, dtype=dtype) for _ in range(2))
        rows = [torch.rand(n, generator=g).to(device=device, dtype=acc) + 1 for _ in range(4)]
        stats = [torch.full((n,), -math.inf, dtype=acc, device=device)] + [
            torch.zeros(n, dtype=acc, device=device) for _ in range(3)]
        for code in (0, 1, 2):
            yield "distill_chunk_stats_", [z, u, code, 0.4, 3.0, 0.0, rows[0] if code == 2 else None,
                                           rows[1] if code == 2 else None, *stats]
            yield "distill_chunk_grad_", [z.clone(), u, code, 0.4, 0.0, 2.0, rows[0], rows[1],
                                          None if code == 0 else rows[2], rows[3]]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_distill_ops(device):
    for name, args in _sample_inputs_distill(device):
        torch.library.opcheck(getattr(torch.ops.hugehead, name).default, args)


def test_distill_ops_name_a_bad_argument():
    z, u = torch.randn(4, 6), torch.randn(4, 6)
    rows = [torch.zeros(4) for _ in range(4)]
    with pytest.raises(RuntimeError, match="teacher must have the logits' shape"):
        target_chunks.distill_chunk_stats_(z, u[:, :5], 0, 0.5, 0.0, 0.0, rows[0], None, *rows)
    with pytest.raises(RuntimeError, match="teacher must be Float like the Float logits, got Double"):
        target_chunks.distill_chunk_stats_(z, u.double(), 0, 0.5, 0.0, 0.0, rows[0], None, *rows)
    with pytest.raises(RuntimeError, match="the JSD needs teacher_lse and student_lse"):
        target_chunks.distill_chunk_stats_(z, u, 2, 0.5, 0.0, 0.0, rows[0], None, *rows)
    with pytest.raises(RuntimeError, match=r"beta must be in \(0, 1\)"):
        target_chunks.distill_chunk_grad_(z, u, 2, 1.0, 0.0, 0.0, rows[0], rows[1], rows[2], rows[3])
    with pytest.raises(RuntimeError, match="need coef"):
        target_chunks.distill_chunk_grad_(z, u, 1, 0.5, 0.0, 0.0, rows[0], rows[1], None, rows[3])
    with pytest.raises(RuntimeError, match="divergence must be 0"):
        target_chunks.distill_chunk_grad_(z, u, 3, 0.5, 0.0, 0.0, rows[0], rows[1], rows[2], rows[3])
    with pytest.raises(RuntimeError, match="must not share memory"):
        target_chunks.distill_chunk_grad_(z, z, 0, 0.5, 0.0, 0.0, rows[0], rows[1], None, rows[3])


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_float32_kls_of_large_logits_keep_float32_precision(divergence):
    """Logits of a few hundred, streamed in chunks over three shards: the KLs' shares of the running log-sum-exps
    are formed from differences of log-sum-exps, never from a rounded one, so the float32 rows keep float32
    precision (the float64 reference's relative error stays near plain float32 PyTorch's)."""
    g = torch.Generator().manual_seed(4)
    n, d, v = 16, 8, 3000
    xs, xt = (torch.randn(n, d, generator=g, dtype=torch.float64) * 30 for _ in range(2))
    ws, wt = (torch.randn(v, d, generator=g, dtype=torch.float64) for _ in range(2))
    lp, lq = F.log_softmax(xs @ ws.T, 1), F.log_softmax(xt @ wt.T, 1)
    pair = (lp, lq) if divergence == "forward_kl" else (lq, lp)
    ref = F.kl_div(*pair, log_target=True, reduction="none").sum(1)
    head = hugehead.ChunkedClassifier(d, v, False, devices=["cpu"] * 3, shard_sizes=[1000, 1200, 800],
                                      dtype=torch.float32, chunk_size=350)
    head.load_state_dict({"weight": ws.float()})
    got = hugehead.linear_distill(xs.float(), head, xt.float(), wt.float(), divergence=divergence,
                                  reduction="none", chunk_size=350)
    assert rel_err(got.detach().double(), ref) < 1e-6
