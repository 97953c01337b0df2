"""The log-probability with the entropy (hugehead.logprob): the two kernels against float64 formulas and opcheck,
then linear_log_prob and ChunkedClassifier.log_prob — values and the gradients of both outputs under random upstream
gradients — against float64 plain PyTorch (F.log_softmax, torch.special.entr) for every option, plan and placement
this machine has (the head across ranks: tests/test_distributed.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hugehead
from hugehead import ops
from hugehead.ops import target_chunks
from hugehead.engines import offload

from conftest import DEVICES, load_example, rel_err, requires_cuda

D, V = 8, 53


def reference(x, weight, target, bias=None, temperature=1.0, softcap=None, ignore_index=-100):
    """float64 ``(log p(target), entropy)`` from the full tempered softmax; 0 on ignored rows."""
    z = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    valid = target != ignore_index
    logp = logp_all.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    entropy = torch.special.entr(logp_all.exp()).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)


def make_inputs(n=17, *, seed=0, scale=2.0, ignore_index=-100, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64) * scale
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    target = torch.randint(0, V, (n,), generator=g)
    target[::4] = ignore_index
    up = torch.randn(2, n, generator=g, dtype=torch.float64)  # dL/dlog p, dL/dH
    return x, w, b, target, up


def grads_of(outputs, up, params):
    logp, entropy = outputs
    return torch.autograd.grad((logp * up[0] + entropy * up[1]).sum(), params, retain_graph=True)


# --------------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------------
def _entropy_stats(z, target, softcap, width):
    n = z.shape[0]
    acc = ops.acc_dtype(z.dtype)
    m = torch.full((n,), float("-inf"), dtype=acc)
    s, tl, a = (torch.zeros(n, dtype=acc) for _ in range(3))
    for c0 in range(0, z.shape[1], width):
        target_chunks.entropy_chunk_stats_(z[:, c0:c0 + width], target, c0, softcap, m, s, tl, a)
    return m + s.log(), tl, s.log() - a / s


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("width", [V, 10, 1])
def test_entropy_stats_kernel_matches_float64(softcap, width):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(9, V, generator=g, dtype=torch.float64) * 4 + 300.0  # large logits: no cancellation in H
    z[2, :20] = float("-inf")
    target = torch.randint(0, V, (9,), generator=g)
    lse, tl, h = _entropy_stats(z, target, softcap, width)
    c = softcap * torch.tanh(z / softcap) if softcap else z
    p = torch.softmax(c, 1)
    torch.testing.assert_close(lse, torch.logsumexp(c, 1), rtol=1e-13, atol=0)
    torch.testing.assert_close(tl, c.gather(1, target[:, None])[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(h, torch.special.entr(p).sum(1), rtol=1e-11, atol=1e-12)


def test_float32_kernels_vectorized_path_matches_float64():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, 3000, generator=g, dtype=torch.float64) * 5
    z[1, ::3] = float("-inf")
    target = torch.randint(0, 3000, (6,), generator=g)
    lse, tl, h = _entropy_stats(z.float(), target, 0.0, 1024)
    lp = torch.log_softmax(z.float().double(), 1)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z.float().double(), 1), rtol=1e-6, atol=0)
    torch.testing.assert_close(h.double(), torch.special.entr(lp.exp()).sum(1), rtol=1e-5, atol=1e-6)
    up = torch.randn(2, 6, generator=g, dtype=torch.float64)
    grad = z.float().clone()
    target_chunks.entropy_chunk_grad_(grad, target, 0, 0.0, lse, -up[0].float(), up[1].float(), h)
    masked = z == float("-inf")  # no probability, no gradient
    # -1e4 in place of -inf: the same distribution, whose -Σ p log p autograd differentiates without 0 * inf
    zr = torch.where(masked, -1e4, z.float().double()).requires_grad_()
    lpr = torch.log_softmax(zr, 1)
    ((lpr.gather(1, target[:, None])[:, 0] * up[0]).sum() - ((lpr.exp() * lpr).sum(1) * up[1]).sum()).backward()
    assert torch.equal(grad[masked], torch.zeros_like(grad[masked]))
    assert rel_err(grad.double()[~masked], zr.grad[~masked]) < 1e-5


def test_entropy_stats_kernel_nan_and_all_inf_rows():
    z = torch.randn(3, 12, dtype=torch.float64)
    z[0, 5] = float("nan")
    z[1] = float("-inf")
    lse, _, h = _entropy_stats(z, torch.zeros(3, dtype=torch.long), 0.0, 4)
    assert lse[0].isnan() and h[0].isnan()  # a NaN logit reaches both, as F.log_softmax
    assert lse[1] == float("-inf")
    torch.testing.assert_close(h[2], torch.special.entr(torch.softmax(z[2], 0)).sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_entropy_grad_kernel_matches_autograd(softcap):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(7, V, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, V, (7,), generator=g)
    up = torch.randn(2, 7, generator=g, dtype=torch.float64)
    up[:, 3] = 0.0  # a row without gradient: exact zeros
    zr = z.clone().requires_grad_()
    c = softcap * torch.tanh(zr / softcap) if softcap else zr
    lp = torch.log_softmax(c, 1)
    ((lp.gather(1, target[:, None])[:, 0] * up[0]).sum() + (torch.special.entr(lp.exp()).sum(1) * up[1]).sum()).backward()
    grad = z.clone()
    for c0 in range(0, V, 16):  # chunk by chunk, as the loop does
        target_chunks.entropy_chunk_grad_(grad[:, c0:c0 + 16], target, c0, softcap, torch.logsumexp(c, 1).detach(),
                                          -up[0], up[1], torch.special.entr(lp.exp()).sum(1).detach())
    torch.testing.assert_close(grad, zr.grad, rtol=1e-12, atol=1e-14)
    assert torch.equal(grad[3], torch.zeros(V, dtype=torch.float64))


def sample_inputs_entropy(device):
    torch.manual_seed(3)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        acc = ops.acc_dtype(dtype)
        n, c = 6, 29
        z = torch.randn(n, c, device=device, dtype=dtype)
        target = torch.randint(-3, c + 3, (n,), device=device)
        stats = [torch.full((n,), float("-inf"), dtype=acc, device=device)] + [
            torch.zeros(n, dtype=acc, device=device) for _ in range(3)]
        yield "entropy_chunk_stats_", [z, target, 5, 2.0, *stats]
        rows = [torch.rand(n, dtype=acc, device=device) + 1 for _ in range(4)]
        yield "entropy_chunk_grad_", [z.clone(), target, 5, 0.0, *rows]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_entropy_ops(device):
    for name, args in sample_inputs_entropy(device):
        torch.library.opcheck(getattr(torch.ops.hugehead, name).default, args)


def test_entropy_ops_name_a_bad_argument():
    z = torch.randn(4, 6)
    rows = [torch.zeros(4) for _ in range(4)]
    with pytest.raises(RuntimeError, match=r"grad_entropy must have shape \[4\]"):
        target_chunks.entropy_chunk_grad_(z, torch.zeros(4, dtype=torch.long), 0, 0.0, rows[0], rows[1], torch.zeros(3),
                                          rows[3])
    with pytest.raises(RuntimeError, match=r"logit_sum must be Float"):
        target_chunks.entropy_chunk_stats_(z, torch.zeros(4, dtype=torch.long), 0, 0.0, *rows[:3],
                                           torch.zeros(4).double())


# --------------------------------------------------------------------------------------------------
# linear_log_prob
# --------------------------------------------------------------------------------------------------
OPTIONS = [
    dict(),
    dict(temperature=0.7, chunk_size=16),
    dict(temperature=1.6, softcap=3.0, chunk_size=5),
    dict(softcap=1.5, ignore_index=7, bias=False),
    dict(temperature=0.9, memory_budget=17 * 8 * 8 + 17 * D * 16),  # a budget that keeps no logits: recompute
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_linear_log_prob_and_entropy_match_float64(opts):
    opts = dict(opts)
    use_bias = opts.pop("bias", True)
    ignore_index = opts.get("ignore_index", -100)
    x, w, b, target, up = make_inputs(ignore_index=ignore_index, bias=use_bias)
    params = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    bias = params[2] if use_bias else None
    got = hugehead.linear_log_prob(params[0], params[1], target, bias=bias, return_entropy=True, **opts)
    ref_opts = {k: opts[k] for k in ("temperature", "softcap", "ignore_index") if k in opts}
    ref = reference(*params[:2], target, bias, **ref_opts)
    for a, r in zip(got, ref):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    for a, r in zip(grads_of(got, up, params), grads_of(ref, up, params)):
        assert rel_err(a, r) < 1e-10
    # log p alone (the per-row cross-entropy's path) is the same number, with the same gradient
    alone = hugehead.linear_log_prob(params[0], params[1], target, bias=bias, **opts)
    torch.testing.assert_close(alone, ref[0], rtol=1e-10, atol=1e-12)
    for a, r in zip(torch.autograd.grad((alone * up[0]).sum(), params),
                    torch.autograd.grad((ref[0] * up[0]).sum(), params)):
        assert rel_err(a, r) < 1e-10


def test_ignored_rows_get_zero_and_no_gradient():
    x, w, b, target, up = make_inputs()
    target[:] = -100
    xr = x.clone().requires_grad_()
    logp, entropy = hugehead.linear_log_prob(xr, w, target, bias=b, return_entropy=True)
    assert torch.equal(logp, torch.zeros_like(logp)) and torch.equal(entropy, torch.zeros_like(entropy))
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(xr.grad, torch.zeros_like(x))


def test_leading_dims_and_one_output_differentiated():
    x, w, b, target, up = make_inputs(n=12)
    xr = x.view(3, 4, D).clone().requires_grad_()
    logp, entropy = hugehead.linear_log_prob(xr, w, target.view(3, 4), bias=b, return_entropy=True)
    assert logp.shape == entropy.shape == (3, 4)
    (grad,) = torch.autograd.grad(entropy.sum(), xr)  # dlog p never materialized: None reaches the backward
    xf = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(reference(xf, w, target, b)[1].sum(), xf)
    assert rel_err(grad.view(12, D), ref) < 1e-10


def test_bfloat16_error_within_twice_plain_pytorch():
    x, w, b, target, up = make_inputs(n=64, scale=1.0)
    ref = reference(x, w, target, b, temperature=0.8)
    xb, wb, bb = (t.bfloat16() for t in (x, w, b))
    got = hugehead.linear_log_prob(xb, wb, target, bias=bb, temperature=0.8, return_entropy=True, chunk_size=16)
    z = F.linear(xb, wb, bb).float() / 0.8  # plain PyTorch in bfloat16: the logits rounded, softmax in float32
    lp = torch.log_softmax(z, -1)
    valid = target != -100
    plain = (torch.where(valid, lp.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0),
             torch.where(valid, torch.special.entr(lp.exp()).sum(-1), 0.0))
    for a, p, r in zip(got, plain, ref):
        assert a.dtype == torch.float32
        assert rel_err(a.double(), r) <= 2 * rel_err(p.double(), r) + 1e-3


def test_temperature_is_checked():
    x, w, b, target, _ = make_inputs()
    for bad, error in ((0.0, ValueError), (float("inf"), ValueError), (-1.0, ValueError), ("1", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="temperature"):
            hugehead.linear_log_prob(x, w, target, temperature=bad, return_entropy=True)


def test_second_order_is_a_clear_error():
    x, w, b, target, up = make_inputs()
    xr = x.clone().requires_grad_()
    logp, entropy = hugehead.linear_log_prob(xr, w, target, bias=b, return_entropy=True)
    (g,) = torch.autograd.grad(entropy.sum(), xr, create_graph=True)
    with pytest.raises(RuntimeError, match="second-order"):
        g.sum().backward()


def test_compiles_with_fullgraph():
    x, w, b, target, up = make_inputs()
    fn = torch.compile(lambda x, w, b: hugehead.linear_log_prob(x, w, target, bias=b, temperature=0.9,
                                                                return_entropy=True, chunk_size=16),
                       fullgraph=True, backend="aot_eager")
    params = [t.clone().requires_grad_() for t in (x, w, b)]
    got = fn(*params)
    ref = reference(*params[:2], target, params[2], temperature=0.9)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    for a, r in zip(grads_of(got, up, params), grads_of(ref, up, params)):
        assert rel_err(a, r) < 1e-10


# --------------------------------------------------------------------------------------------------
# ChunkedClassifier.log_prob on every local placement
# --------------------------------------------------------------------------------------------------
def _head(sizes, devices, **kwargs):
    torch.manual_seed(5)
    return hugehead.ChunkedClassifier(D, V, True, devices=devices, shard_sizes=sizes, dtype=torch.float64,
                                      chunk_size=6, **kwargs)


def _logical(head):
    w = torch.cat([s.weight.detach().cpu() for s in head.shards])
    return w, torch.cat([s.bias.detach().cpu() for s in head.shards])


@pytest.mark.parametrize("placement", ["one", "three_shards", "offload", pytest.param(
    "cuda_and_cpu", marks=[requires_cuda, pytest.mark.cuda])])
def test_head_log_prob_with_entropy_matches_float64(placement, monkeypatch):
    sizes = {"one": None, "three_shards": [20, 13, 20], "offload": [30, 23], "cuda_and_cpu": [25, 28]}[placement]
    devices = {"one": None, "three_shards": ["cpu"] * 3, "offload": ["cpu", "cpu"],
               "cuda_and_cpu": ["cuda", "cpu"]}[placement]
    if placement == "offload":
        monkeypatch.setattr(offload, "_ALLOW_CPU_COMPUTE", True)
    head = _head(sizes, devices, softcap=4.0, offload=placement == "offload")
    x, _, _, target, up = make_inputs()
    w, b = _logical(head)
    xr = x.clone().requires_grad_()
    got = head.log_prob(xr, target, temperature=0.75, return_entropy=True)
    ref_params = [xr, w.clone().requires_grad_(), b.clone().requires_grad_()]
    ref = reference(*ref_params[:2], target, ref_params[2], temperature=0.75, softcap=4.0)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    grads = grads_of(got, up, [xr, *(s.weight for s in head.shards), *(s.bias for s in head.shards)])
    ref_grads = grads_of(ref, up, ref_params)
    assert rel_err(grads[0], ref_grads[0]) < 1e-10
    k = len(head.shards)
    assert rel_err(torch.cat([g.cpu() for g in grads[1:1 + k]]), ref_grads[1]) < 1e-10
    assert rel_err(torch.cat([g.cpu() for g in grads[1 + k:]]), ref_grads[2]) < 1e-10
    with torch.no_grad():  # reference-model log-probs: no graph, the same numbers
        torch.testing.assert_close(head.log_prob(x, target, temperature=0.75), ref[0], rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# examples/grpo_cpu.py: a GRPO-style update with the policy's log-probs, entropy and a reference head
# --------------------------------------------------------------------------------------------------
def test_grpo_example_learns_and_its_log_probs_are_plain_pytorchs(capsys):
    example = load_example("grpo_cpu")
    history = example.main(["--steps", "20", "--seed", "3"])
    assert "reward" in capsys.readouterr().out
    assert all(math.isfinite(v) for values in history.values() for v in values)
    assert sum(history["reward"][-3:]) / 3 > sum(history["reward"][:3]) / 3 + 0.1  # it learned the good set
    # the loss it optimized: hugehead's log p and entropy of a policy are those of its full softmax
    torch.manual_seed(0)
    policy = example.Policy(4, 3, 8, 97)
    prompt, tokens = torch.arange(4), torch.randint(0, 97, (4, 3))
    feats = policy.features(prompt)
    logp, entropy = policy.head.log_prob(feats, tokens, temperature=0.7, return_entropy=True)
    w = torch.cat([s.weight for s in policy.head.shards])
    b = torch.cat([s.bias for s in policy.head.shards])
    ref = torch.log_softmax((feats.double() @ w.double().T + b.double()) / 0.7, -1)
    torch.testing.assert_close(logp.double(), ref.gather(-1, tokens[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), torch.special.entr(ref.exp()).sum(-1), rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_log_prob_on_cuda_matches_float64(dtype):
    """The CUDA kernels (and, for log p alone, the class-id loss's fused GEMMs on sm_90) against float64."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(512, 256, generator=g, dtype=torch.float64)
    w = torch.randn(40_000, 256, generator=g, dtype=torch.float64) / 16
    target = torch.randint(0, 40_000, (512,), generator=g)
    target[::9] = -100
    up = torch.randn(2, 512, generator=g, dtype=torch.float64)
    ref_params = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    ref = reference(*ref_params, target, temperature=0.8, softcap=20.0)
    ref_grads = grads_of(ref, up, ref_params)
    params = [t.to("cuda", dtype).requires_grad_() for t in (x, w)]
    got = hugehead.linear_log_prob(*params, target.cuda(), temperature=0.8, softcap=20.0, return_entropy=True,
                                   chunk_size=8192)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, r in zip(got, ref):
        assert rel_err(a.double().cpu(), r) < tol
    for a, r in zip(grads_of(got, up.cuda(), params), ref_grads):
        assert rel_err(a.double().cpu(), r) < tol * 5
    alone = hugehead.linear_log_prob(*params, target.cuda(), temperature=0.8, softcap=20.0)
    assert rel_err(alone.double().cpu(), ref[0]) < tol
