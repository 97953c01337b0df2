"""Mixed precision (DESIGN.md "Mixed precision"): float32 parameters under torch.autocast, for
linear_cross_entropy and ChunkedClassifier on one and several shards, against a float64 reference built
from the autocast-cast inputs, within the low-precision rule of "Numerics and errors" (at most 2x the error
of plain PyTorch under the same autocast, plus a small floor); gradient dtypes; the weight cast a chunk at a
time (never a full low-precision copy); return_lse (gradcheck, values); float16 with GradScaler (scaled
losses, an injected overflow skips the step, training goes on); top-k and log_prob; torch.compile.
CPU everywhere; the CUDA and multi-GPU variants skip without the hardware."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hugehead
from hugehead import reference
from hugehead.loop.sources import ResidentChunks
from hugehead.plan import plan_chunks

from conftest import rel_err, requires_cuda, requires_multigpu
from test_functional import plain_loss, run_with_grads

BF16, FP16 = torch.bfloat16, torch.float16
# Floors of the low-precision rule (see assert_within_rule). The loss is float32 and its only rounding in
# 16 bits is that of the logits, which averages out over the classes and rows: 2**-12 (1/32 of a bfloat16
# ulp) still catches a loss that went through bfloat16 (issue 9: 16.125 for 16.1065). The gradients are
# handed back rounded to (or computed by GEMMs in) the compute dtype: half an epsilon of it.
LOSS_FLOOR = 2.0**-12
GRAD_FLOOR = {BF16: torch.finfo(BF16).eps / 2, FP16: torch.finfo(FP16).eps / 2}


# --------------------------------------------------------------------------------------------------
# Problems, references and the rule
# --------------------------------------------------------------------------------------------------
def make_problem(n, d, v, *, bias=True, seed=0, ignore_index=-100, scale=1.5, device="cpu"):
    """float32 ``(x [N, D], weight [V, D], bias [V] or None, target [N], grad_out [N])``: logits of
    about ``scale``, every fourth row ignored, row 1 on class 3 (the in-range ignore_index below)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * (scale / math.sqrt(d))
    b = torch.randn(v, generator=g) * scale if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[::4] = ignore_index
    if n > 1:
        target[1] = 3
    grad_out = torch.rand(n, generator=g) + 0.5
    to = (lambda t: None if t is None else t.to(device))
    return to(x), to(w), to(b), to(target), to(grad_out)


def through(t, dtype):
    """``t`` rounded to ``dtype`` as autocast rounds it, as a float64 CPU tensor (None stays None)."""
    return None if t is None else t.detach().to(dtype).double().cpu()


def assert_within_rule(actual, plain, exact, what, floor):
    """DESIGN.md, Numerics: relative error vs ``exact`` (float64) at most 2x that of the same computation
    in plain PyTorch under the same autocast, plus ``floor``: plain PyTorch rounds more often (e.g. the
    softcap's tanh in 16 bits) and those roundings sometimes cancel the logits' by luck, which would hold
    hugehead to a bound no answer in that precision can meet."""
    a, p, r = (t.detach().double().cpu() for t in (actual, plain, exact))
    assert a.shape == r.shape, f"{what}: shape {tuple(a.shape)} != {tuple(r.shape)}"
    assert torch.equal(a.isnan(), r.isnan()), f"{what}: NaN pattern differs"
    keep = ~r.isnan()
    err, err_plain = rel_err(a[keep], r[keep]), rel_err(p[keep], r[keep])
    assert err <= 2.0 * err_plain + floor, f"{what}: relative error {err:.3g} > 2 x plain {err_plain:.3g} + {floor:.2g}"


def loss_opts(opts):
    return {k: opts[k] for k in ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap") if k in opts}


def full_opts(opts):
    out = dict(ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None)
    out.update(loss_opts(opts))
    return out


def lse_reference(x, w, b, softcap):
    """Per-row log-sum-exp of the (softcapped) logits: plain PyTorch in ``x``'s dtype (under whatever
    autocast is active) with the reduction in float32, or float64 for float64 inputs."""
    z = reference.logits(x, w, b, softcap)
    return torch.logsumexp(z if z.dtype == torch.float64 else z.float(), dim=1)


def with_lse_term(loss, lse, reduction, grad_out, coef=0.05):
    """A scalar to backpropagate: the loss (weighted per row for "none") plus a z-loss-like term of the
    user's own on the returned lse, so every gradient also carries grad_lse."""
    main = (loss * grad_out.to(loss.dtype)).sum() if reduction == "none" else loss
    return main + coef * (lse.square() * grad_out.to(lse.dtype)).mean()


def run_case(fn, x, w, b, grad_out, reduction, *, autocast=None, device_type="cpu"):
    """``(loss, lse, dx, dw, db)`` of ``fn(x, w, b) -> (loss, lse)`` on fresh leaves, under
    ``torch.autocast(device_type, autocast)`` when ``autocast`` is a dtype."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_() if b is not None else None
    with torch.autocast(device_type, dtype=autocast or BF16, enabled=autocast is not None):
        loss, lse = fn(x, w, b)
        total = with_lse_term(loss, lse, reduction, grad_out)
    total.backward()
    return loss.detach(), lse.detach(), x.grad, w.grad, (None if b is None else b.grad)


def plain_with_lse(target, opts):
    def fn(x, w, b):
        return plain_loss(x, w, b, target, full_opts(opts)), lse_reference(x, w, b, opts.get("softcap"))
    return fn


def check_against_rule(ours, plain, exact, compute, what=""):
    names = ("loss", "lse", "grad x", "grad weight", "grad bias")
    floors = (LOSS_FLOOR, LOSS_FLOOR) + (GRAD_FLOOR[compute],) * 3
    for a, p, r, name, floor in zip(ours, plain, exact, names, floors):
        if r is not None:
            assert_within_rule(a, p, r, f"{what}{name}", floor)


# --------------------------------------------------------------------------------------------------
# linear_cross_entropy under autocast bfloat16 on the CPU, every option, kept logits and streaming
# --------------------------------------------------------------------------------------------------
# mode: "kept" (planned; the N x V logits fit the default budget and are kept between forward and
# backward), "partial" (planned within a budget that keeps only the first chunk(s)), "stream" (chunk_size
# pinned) or "rows" (chunk_size pinned and a budget that splits the rows).
CASES = {
    "plain-kept": dict(n=48, d=32, v=300, bias=True, mode="kept", opts={}),
    "nobias-sum-stream": dict(n=48, d=32, v=300, bias=False, mode="stream", chunk=64, opts=dict(reduction="sum")),
    "smooth-none-stream": dict(n=40, d=24, v=257, bias=True, mode="stream", chunk=50,
                               opts=dict(reduction="none", label_smoothing=0.1)),
    "zloss-softcap-kept": dict(n=48, d=32, v=300, bias=False, mode="kept",
                               opts=dict(z_loss=1e-3, softcap=5.0)),
    "ignore-in-range-none-kept": dict(n=33, d=16, v=200, bias=True, mode="kept",
                                      opts=dict(reduction="none", ignore_index=3, label_smoothing=0.2)),
    "all-options-rows": dict(n=48, d=32, v=300, bias=True, mode="rows", chunk=64,
                             opts=dict(label_smoothing=0.1, z_loss=1e-3, softcap=8.0, reduction="sum")),
    # V above the CPU's widest chunk (8192): the kept logits are filled from several cast weight chunks.
    "wide-kept": dict(n=12, d=16, v=9000, bias=True, mode="kept", opts=dict(label_smoothing=0.1, softcap=15.0)),
    "wide-stream": dict(n=12, d=16, v=9000, bias=False, mode="stream", chunk=2048, opts=dict(z_loss=1e-4)),
    # 1 of 3 chunks of 8192 classes kept, the rest streamed (the budget also holds 3 cast weight/dW chunks)
    "partial-kept": dict(n=8, d=16, v=20000, bias=True, mode="partial", budget=300_000 + 3 * 8192 * 16 * 2,
                         opts=dict(label_smoothing=0.1, z_loss=1e-4, reduction="none")),
}


def chunk_options(case, compute=BF16):
    """chunk_size / memory_budget for the case's mode, checked against the planner."""
    n, d, v = case["n"], case["d"], case["v"]
    opts = {}
    if case["mode"] in ("stream", "rows"):
        opts["chunk_size"] = case["chunk"]
    if case["mode"] == "rows":
        itemsize = torch.empty((), dtype=compute).element_size()
        opts["memory_budget"] = 10 * (case["chunk"] * itemsize + d * (itemsize + 4))
    if case["mode"] == "partial":
        opts["memory_budget"] = case["budget"]
    plan = plan_chunks(n, d, v, compute, torch.device("cpu"), opts.get("chunk_size"), opts.get("memory_budget"),
                       weight_dtype=torch.float32)
    assert plan.keep_logits == (case["mode"] in ("kept", "partial")), plan
    assert (plan.rows < n) == (case["mode"] == "rows"), plan
    if case["mode"] in ("kept", "partial") and v > 8192:
        assert plan.cols < v, plan  # several cast chunks fill the kept logits
    if case["mode"] == "partial":
        assert 1 <= plan.kept_chunks < -(-v // plan.cols), plan
    return opts


# Every case with a float32 x (x.grad float32), and two with a bfloat16 x (x.grad bfloat16).
FUNCTIONAL_CASES = [(name, torch.float32) for name in CASES] + [("all-options-rows", BF16), ("wide-kept", BF16)]


@pytest.mark.parametrize("name,x_dtype", FUNCTIONAL_CASES, ids=lambda v: str(v).replace("torch.", "x_"))
def test_functional_bf16_autocast_matches_float64(name, x_dtype):
    case = CASES[name]
    opts = full_opts(case["opts"])
    x, w, b, target, grad_out = make_problem(case["n"], case["d"], case["v"], bias=case["bias"],
                                             ignore_index=opts["ignore_index"])
    x = x.to(x_dtype)
    chunking = chunk_options(case)

    def ours_fn(x_, w_, b_):
        return hugehead.linear_cross_entropy(x_, w_, target, b_, return_lse=True, **opts, **chunking)

    ours = run_case(ours_fn, x, w, b, grad_out, opts["reduction"], autocast=BF16)
    plain = run_case(plain_with_lse(target, opts), x, w, b, grad_out, opts["reduction"], autocast=BF16)
    exact = run_case(plain_with_lse(target, opts), through(x, BF16), through(w, BF16), through(b, BF16),
                     grad_out.double(), opts["reduction"])
    loss, lse, dx, dw, db = ours
    assert loss.dtype == lse.dtype == torch.float32
    assert loss.shape == ((case["n"],) if opts["reduction"] == "none" else ())
    assert dx.dtype == x_dtype and dw.dtype == torch.float32
    assert db is None or db.dtype == torch.float32
    check_against_rule(ours, plain, exact, BF16)


# --------------------------------------------------------------------------------------------------
# ChunkedClassifier under autocast bfloat16: one and several CPU shards
# --------------------------------------------------------------------------------------------------
LAYOUTS = [[300], [100, 200], [50, 130, 120]]
MODULE_CASES = ["plain-kept", "nobias-sum-stream", "zloss-softcap-kept", "all-options-rows"]


def make_head(sizes, d, *, bias=True, dtype=torch.float32, device="cpu", seed=0, **kwargs):
    torch.manual_seed(seed)
    devices = device if isinstance(device, list) else [device] * len(sizes)
    return hugehead.ChunkedClassifier(d, sum(sizes), bias, devices=devices, shard_sizes=sizes, dtype=dtype,
                                      **kwargs)


def logical(head, name="weight"):
    parts = [getattr(s, name) for s in head.shards]
    return None if parts[0] is None else torch.cat([p.detach().cpu() for p in parts])


def head_grads(head):
    """Logical ``(dW, db)`` on the CPU, after checking each shard's gradient: on the shard's device, in
    its Parameters' dtype."""
    for s in head.shards:
        for p in (s.weight, s.bias):
            if p is not None:
                assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.device == p.device
    dw = torch.cat([s.weight.grad.cpu() for s in head.shards])
    db = torch.cat([s.bias.grad.cpu() for s in head.shards]) if head.has_bias else None
    return dw, db


def run_head(head, x, target, grad_out, reduction, compute, device_type="cpu"):
    head.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast(device_type, dtype=compute):
        loss, lse = head(x, target, return_lse=True)
        total = with_lse_term(loss, lse, reduction, grad_out)
    total.backward()
    return (loss.detach(), lse.detach(), x.grad, *head_grads(head))


@pytest.mark.parametrize("name", MODULE_CASES)
@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "x".join(map(str, s)))
def test_module_bf16_autocast_matches_float64(sizes, name):
    case = dict(CASES[name], v=sum(sizes))
    opts = full_opts(case["opts"])
    head = make_head(sizes, case["d"], bias=case["bias"], **opts, **chunk_options(case))
    x, _, _, target, grad_out = make_problem(case["n"], case["d"], case["v"], bias=False)
    w, b = logical(head), logical(head, "bias")

    ours = run_head(head, x, target, grad_out, opts["reduction"], BF16)
    plain = run_case(plain_with_lse(target, opts), x, w, b, grad_out, opts["reduction"], autocast=BF16)
    exact = run_case(plain_with_lse(target, opts), through(x, BF16), through(w, BF16), through(b, BF16),
                     grad_out.double(), opts["reduction"])
    assert ours[0].dtype == ours[1].dtype == torch.float32 and ours[2].dtype == torch.float32
    assert all(s.weight.dtype == torch.float32 for s in head.shards)  # the Parameters were not cast
    check_against_rule(ours, plain, exact, BF16)


def test_module_bf16_autocast_partially_kept_logits():
    """Two shards, each keeping its first chunk of logits and streaming the rest."""
    case = CASES["partial-kept"]
    opts = full_opts(case["opts"])
    sizes = [24000, 20000]
    head = make_head(sizes, case["d"], **opts, memory_budget=case["budget"])
    for size in sizes:
        plan = plan_chunks(case["n"], case["d"], size, BF16, torch.device("cpu"), None, case["budget"],
                           weight_dtype=torch.float32)
        assert plan.keep_logits and 1 <= plan.kept_chunks < -(-size // plan.cols), plan
    x, _, _, target, grad_out = make_problem(case["n"], case["d"], sum(sizes), bias=False)
    w, b = logical(head), logical(head, "bias")
    ours = run_head(head, x, target, grad_out, opts["reduction"], BF16)
    plain = run_case(plain_with_lse(target, opts), x, w, b, grad_out, opts["reduction"], autocast=BF16)
    exact = run_case(plain_with_lse(target, opts), through(x, BF16), through(w, BF16), through(b, BF16),
                     grad_out.double(), opts["reduction"])
    check_against_rule(ours, plain, exact, BF16)


def test_module_takes_bf16_x_and_returns_its_grad_in_bf16():
    head = make_head([20, 17], 8, label_smoothing=0.1)
    x, _, _, target, _ = make_problem(13, 8, 37)
    xb = x.to(BF16).requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        loss = head(xb, target)
    loss.backward()
    assert loss.dtype == torch.float32 and xb.grad.dtype == BF16
    assert all(s.weight.grad.dtype == torch.float32 for s in head.shards)
    # The same as the float32 x that rounds to it.
    x32 = xb.detach().float().requires_grad_()
    head.zero_grad()
    with torch.autocast("cpu", dtype=BF16):
        loss32 = head(x32, target)
    loss32.backward()
    assert torch.equal(loss, loss32) and torch.equal(xb.grad.float(), x32.grad)


def test_float64_is_left_alone_by_autocast():
    """As F.linear: autocast does not touch float64, which computes (and returns its loss) in float64."""
    x, w, b, target, _ = make_problem(9, 6, 29)
    x, w, b = x.double(), w.double(), b.double()
    with torch.autocast("cpu", dtype=BF16):
        loss = hugehead.linear_cross_entropy(x, w, target, b, chunk_size=8)
        head_loss = make_head([29], 6, dtype=torch.float64)(x, target)
    assert loss.dtype == head_loss.dtype == torch.float64
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(x, w, b), target), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# The weight is cast a chunk at a time, never as a whole
# --------------------------------------------------------------------------------------------------
N_BIG, D_BIG, SHARDS_BIG = 8, 16, [12000, 9000]  # every shard wider than the CPU's widest chunk (8192)


@pytest.fixture
def chunk_spy(monkeypatch):
    """Records each weight chunk the loop is handed: (source weight, c0, c1, chunk dtype, bias chunk dtype,
    bytes of the chunk's storage)."""
    seen = []
    original = ResidentChunks.chunks

    def chunks(self, cols):
        for chunk in original(self, cols):
            seen.append((self.weight, chunk.c0, chunk.c1, chunk.weight.dtype,
                         None if chunk.bias is None else chunk.bias.dtype,
                         chunk.weight.untyped_storage().nbytes()))
            yield chunk

    monkeypatch.setattr(ResidentChunks, "chunks", chunks)
    return seen


def _big_step(api, mode, weight_cast=None):
    """``(step, weights)``: ``step()`` runs forward + backward under autocast bf16 of a head of float32
    shards ``SHARDS_BIG`` (one shard for the functional API); ``weights`` are its float32 weights.
    ``weight_cast`` (a dtype) casts the whole weight first: the mistake the checks below must notice."""
    chunk = dict(chunk_size=3000) if mode == "stream" else {}
    x, _, _, target, _ = make_problem(N_BIG, D_BIG, sum(SHARDS_BIG), bias=False, seed=3)
    x.requires_grad_()
    if api == "module":
        head = make_head(SHARDS_BIG, D_BIG, **chunk)

        def step():
            with torch.autocast("cpu", dtype=BF16):
                head(x, target).backward()

        return step, [s.weight for s in head.shards]
    w = make_head([sum(SHARDS_BIG)], D_BIG).shards[0].weight.detach().requires_grad_()
    b = torch.zeros(sum(SHARDS_BIG), requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=BF16):
            ww = w if weight_cast is None else w.to(weight_cast)
            hugehead.linear_cross_entropy(x, ww, target, b, **chunk).backward()

    return step, [w]


@pytest.mark.parametrize("mode", ["kept", "stream"])
@pytest.mark.parametrize("api", ["functional", "module"])
def test_autocast_casts_weight_chunk_by_chunk(chunk_spy, api, mode):
    step, weights = _big_step(api, mode)
    step()
    for w in weights:
        # chunks sliced from the float32 Parameter's own storage, not from a copy
        mine = [s for s in chunk_spy if s[0].data_ptr() == w.data_ptr() and s[0].dtype == torch.float32]
        v = w.shape[0]
        # forward and backward each walk the whole shard in chunks narrower than it, cast to bf16
        assert len(mine) >= 4 and sum(c1 - c0 for _, c0, c1, *_ in mine) == 2 * v
        assert all(c1 - c0 <= 8192 < v for _, c0, c1, *_ in mine)
        assert all(dt == BF16 and bdt in (None, BF16) for *_, dt, bdt, _ in mine)
        # each cast chunk owns a chunk-sized buffer: not a slice of a cast copy of the whole weight
        assert all(nbytes == (c1 - c0) * D_BIG * 2 for _, c0, c1, _, _, nbytes in mine)
        assert w.dtype == torch.float32 and w.grad.dtype == torch.float32


def large_allocations(fn, min_bytes):
    """Bytes of every single allocation of at least ``min_bytes`` made while ``fn`` runs (forward and
    backward), from the CPU profiler's per-op memory records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted(e.self_cpu_memory_usage for e in prof.events()
                  if e.name != "[memory]" and e.self_cpu_memory_usage >= min_bytes)


@pytest.mark.parametrize("api,mode", [("functional", "kept"), ("module", "stream")])
def test_no_full_size_low_precision_copy_of_the_weight(api, mode):
    shards = SHARDS_BIG if api == "module" else [sum(SHARDS_BIG)]
    smallest_copy = min(shards) * D_BIG * 2  # a bf16 copy of the smallest shard
    allocations = large_allocations(_big_step(api, mode)[0], smallest_copy)
    # Only each shard's float32 weight gradient is that large (kept logits: N x V x 2 bytes, smaller).
    assert allocations == sorted(v * D_BIG * 4 for v in shards), allocations
    if api == "functional":  # the check sees a full bf16 copy when there is one
        copied = large_allocations(_big_step(api, mode, weight_cast=BF16)[0], smallest_copy)
        assert sum(s == shards[0] * D_BIG * 2 for s in copied) >= 1, copied


# --------------------------------------------------------------------------------------------------
# return_lse: gradcheck in float64, values under autocast
# --------------------------------------------------------------------------------------------------
LSE_TERMS = {
    "loss+zloss_term": lambda loss, lse, w: loss.sum() + 0.3 * (w * lse.square()).sum(),
    "lse_only": lambda loss, lse, w: (w * lse).sum(),
    "distill_like": lambda loss, lse, w: loss.sum() - (w * lse).sum() + 0.1 * lse.logsumexp(0),
}
LSE_OPTIONS = {  # one per term
    "all_options": dict(reduction="none", label_smoothing=0.2, z_loss=0.05, softcap=3.0, ignore_index=2),
    "mean": dict(reduction="mean"),
    "rows_split": dict(reduction="sum", softcap=2.0, memory_budget=3 * (4 * 8 + 3 * 12)),  # blocks of 3 rows
}


@pytest.mark.parametrize("term,opts", [pytest.param(t, o, id=f"{t}-{i}") for t, (i, o) in
                                       zip(LSE_TERMS, LSE_OPTIONS.items())])
@pytest.mark.parametrize("api", ["functional", "module"])
def test_return_lse_gradcheck(api, term, opts):
    g = torch.Generator().manual_seed(7)
    n, d, v = 7, 3, 11
    x = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    row_w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    target = torch.randint(0, v, (n,), generator=g)
    target[1] = opts.get("ignore_index", -100)  # an ignored row still has a differentiable lse
    opts = dict(opts, chunk_size=4)
    combine = LSE_TERMS[term]

    if api == "functional":
        def fn(x_, w_, b_):
            loss, lse = hugehead.linear_cross_entropy(x_, w_, target, b_, return_lse=True, **opts)
            assert lse.dtype == torch.float64 and lse.shape == (n,)
            return combine(loss, lse, row_w)
        assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-7, rtol=1e-5)
        return

    head = make_head([4, 7], d, dtype=torch.float64, **opts)
    names = [f"shards.{k}.{p}" for p in ("weight", "bias") for k in range(2)]
    params = [head.get_parameter(name).detach().clone().requires_grad_() for name in names]

    def fn(x_, *shard_params):
        # the shard Parameters replaced by gradcheck's (perturbed) inputs
        loss, lse = torch.func.functional_call(head, dict(zip(names, shard_params)), (x_, target),
                                               dict(return_lse=True))
        assert lse.dtype == torch.float64 and lse.shape == (n,)
        return combine(loss, lse, row_w)

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("api", ["functional", "module"])
def test_return_lse_under_autocast_matches_float64(api):
    opts = dict(softcap=6.0, label_smoothing=0.1)
    n, d, v = 40, 24, 257
    x, w, b, target, _ = make_problem(n, d, v, seed=11)
    if api == "module":
        head = make_head([100, 157], d, chunk_size=64, **opts)
        w, b = logical(head), logical(head, "bias")
        with torch.autocast("cpu", dtype=BF16):
            _, lse = head(x, target, return_lse=True)
    else:
        with torch.autocast("cpu", dtype=BF16):
            _, lse = hugehead.linear_cross_entropy(x, w, target, b, return_lse=True, chunk_size=64, **opts)
    assert lse.dtype == torch.float32 and lse.shape == (n,)
    with torch.autocast("cpu", dtype=BF16):
        plain = lse_reference(x, w, b, opts["softcap"])
    exact = lse_reference(through(x, BF16), through(w, BF16), through(b, BF16), opts["softcap"])
    assert_within_rule(lse, plain, exact, "lse", LOSS_FLOOR)  # every row, the ignored ones too


def test_return_lse_requires_grad_through_the_graph():
    x, w, b, target, _ = make_problem(9, 6, 29)
    w.requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        _, lse = hugehead.linear_cross_entropy(x, w, target, b, return_lse=True)
    assert lse.requires_grad and lse.dtype == torch.float32
    lse.sum().backward()  # only the lse: the softmax of every row (ignored rows too) times x
    with torch.autocast("cpu", dtype=BF16):
        z = F.linear(x, w.detach(), b).float()
    expected = torch.softmax(z, dim=1).t() @ x.to(BF16).float()
    assert rel_err(w.grad, expected) < 1e-2


# --------------------------------------------------------------------------------------------------
# float16 with torch.amp.GradScaler: scaled losses, an overflow skips the step, training goes on
# --------------------------------------------------------------------------------------------------
def cpu_grad_scaler_works() -> bool:
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale((p * 1.0).sum()).backward()
        scaler.step(opt)
        scaler.update()
        return scaler.is_enabled()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


HAS_CPU_GRAD_SCALER = cpu_grad_scaler_works()
STEPS, INJECT = 5, 2


def scaled_training(params, loss_fn, batches, *, device_type, dtype, use_amp, inject, lr=1e-2, fused=None):
    """AdamW steps under ``torch.autocast(device_type, dtype)`` with a GradScaler (``use_amp``), or
    plain steps (the float64 reference). Step ``INJECT`` overflows: the scale is set to 2**100 ("scale")
    or the batch is scaled up 1e4x ("huge_x"); the reference skips that step as the scaler must.

    Returns per step ``(loss, grads finite, parameters changed, scale after the step)``, and the first
    step's unscaled gradients."""
    first_grads = []
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=fused)
    scaler = torch.amp.GradScaler(device_type, init_scale=2.0**16, enabled=use_amp)
    log = []
    for step, (x, target) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if step == INJECT and inject == "scale" and use_amp:
            scaler.update(new_scale=2.0**100)
        if step == INJECT and inject == "huge_x":
            x = x * 1e4
        before = [p.detach().clone() for p in params]
        with torch.autocast(device_type, dtype=dtype, enabled=use_amp):
            loss = loss_fn(x, target)
        scaled = scaler.scale(loss)
        if use_amp and step == INJECT and inject == "scale":
            assert bool(torch.isfinite(scaled)), "the scaled float32 loss itself must not overflow"
        scaled.backward()
        if use_amp:
            scaler.unscale_(opt)  # as before gradient clipping; step() then does not unscale again
        finite = all(bool(p.grad.isfinite().all()) for p in params)
        if step == 0:
            first_grads.extend(p.grad.detach().cpu().clone() for p in params)
        scale = None
        if use_amp:
            scaler.step(opt)
            scaler.update()
            scale = scaler.get_scale()
            if step == INJECT and inject == "scale":
                scaler.update(new_scale=2.0**16)  # back to a usable scale, as after many backoffs
        elif step != INJECT:
            opt.step()
        changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, params))
        log.append((float(loss.detach()), finite, changed, scale))
    return log, first_grads


def amp_batches(n, d, v, device, steps=STEPS, seed=100):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        x = torch.randn(n, d, generator=g)
        target = torch.randint(0, v, (n,), generator=g)
        target[::7] = -100
        out.append((x.to(device), target.to(device)))
    return out


def rounded_float64_loss(w64, b64, dtype, opts):
    """A float64 loss whose logits come from ``dtype``-rounded x, weight and bias (what autocast
    multiplies), with the gradient of the unrounded parameters (rounding is the identity's gradient)."""
    def fn(x, target):
        w = w64 + (through(w64, dtype) - w64.detach())
        b = b64 + (through(b64, dtype) - b64.detach())
        return reference.linear_cross_entropy(through(x, dtype), w, target.cpu(), b, **opts)
    return fn


def check_scaled_training(ours_params, plain_params, w0, b0, batches, device_type, dtype, inject, head_opts,
                          ours_loss, plain_loss_fn, fused=None):
    """Runs hugehead and plain PyTorch through the same GradScaler steps and checks: the injected
    overflow is found in hugehead's shard gradients and skips that step (parameters unchanged, scale
    backed off) in both; every other step updates; the losses agree; the first step's unscaled gradients
    are within the low-precision rule against float64 on the rounded inputs. Returns the float64
    parameters after the same steps (the caller checks the updates against them)."""
    w64 = w0.detach().double().cpu().requires_grad_()
    b64 = b0.detach().double().cpu().requires_grad_()
    ours, ours_grads = scaled_training(ours_params, ours_loss, batches, device_type=device_type, dtype=dtype,
                                       use_amp=True, inject=inject, fused=fused)
    plain, plain_grads = scaled_training(plain_params, plain_loss_fn, batches, device_type=device_type,
                                         dtype=dtype, use_amp=True, inject=inject, fused=fused)
    exact, exact_grads = scaled_training([w64, b64], rounded_float64_loss(w64, b64, dtype, head_opts), batches,
                                         device_type="cpu", dtype=dtype, use_amp=False, inject=inject)
    for step, (o, p) in enumerate(zip(ours, plain)):
        skipped = step == INJECT
        assert o[1] == p[1] == (not skipped), (step, o, p)  # overflow found in the shard gradients
        assert o[2] == p[2] == (not skipped), (step, o, p)  # the step skipped, and only it
        assert o[3] == p[3], (step, o[3], p[3])  # same scale trajectory
        if not (skipped and inject == "huge_x"):
            assert abs(o[0] - p[0]) <= 1e-3 * abs(p[0]), (step, o[0], p[0])
    # the overflow backed the scale off (by GradScaler's default factor 0.5); the other steps kept it
    assert ours[INJECT][3] == (2.0**99 if inject == "scale" else 2.0**15)
    assert all(o[3] == 2.0**16 for step, o in enumerate(ours) if step < INJECT), ours
    # AdamW's update hardly depends on the gradients' scale: check the first step's unscaled gradients too.
    k = len(ours_grads) // 2
    ours_first = (torch.cat(ours_grads[:k]), torch.cat(ours_grads[k:]))
    for name, o, p, e in zip(("weight", "bias"), ours_first, plain_grads, exact_grads):
        assert_within_rule(o, p, e, f"first step's unscaled grad {name}", GRAD_FLOOR[dtype])
    return w64.detach(), b64.detach()


def shard_cat(params, k):
    return torch.cat([p.detach().cpu() for p in params[:k]]), torch.cat([p.detach().cpu() for p in params[k:]])


def amp_training_case(api, inject, device, dtype, devices=None, fused=None, n=32, d=16, sizes=(20, 30), chunk=10):
    """The whole GradScaler comparison for one API on ``device`` (shards on ``devices``)."""
    device_type = torch.device(device).type
    head_opts = dict(label_smoothing=0.1)
    v = sum(sizes)
    devices = devices or [device] * len(sizes)
    head = make_head(list(sizes), d, device=list(devices), chunk_size=chunk, **head_opts)
    w0, b0 = logical(head), logical(head, "bias")
    lin = nn.Linear(d, v, device=device)
    with torch.no_grad():
        lin.weight.copy_(w0)
        lin.bias.copy_(b0)
    batches = amp_batches(n, d, v, device)
    if api == "module":
        ours_params = [s.weight for s in head.shards] + [s.bias for s in head.shards]
        ours_loss = head
    else:
        w = nn.Parameter(w0.to(device, copy=True))
        b = nn.Parameter(b0.to(device, copy=True))
        ours_params = [w, b]

        def ours_loss(x, target):
            return hugehead.linear_cross_entropy(x, w, target, b, chunk_size=chunk, **head_opts)

    def plain_loss_fn(x, target):
        return F.cross_entropy(lin(x), target, **head_opts)

    w64, b64 = check_scaled_training(ours_params, list(lin.parameters()), w0, b0, batches, device_type, dtype,
                                     inject, head_opts, ours_loss, plain_loss_fn, fused=fused)
    k = len(ours_params) // 2
    w_ours, b_ours = shard_cat(ours_params, k)
    for name, o, p, e, init in (("weight", w_ours, lin.weight, w64, w0), ("bias", b_ours, lin.bias, b64, b0)):
        assert o.dtype == torch.float32
        assert_within_rule(o.double() - init.double(), p.detach().cpu().double() - init.double(), e - init.double(),
                           f"{name} update", GRAD_FLOOR[dtype])


@pytest.mark.skipif(not HAS_CPU_GRAD_SCALER, reason="torch.amp.GradScaler('cpu') is not usable in this torch")
@pytest.mark.parametrize("api,inject", [("functional", "scale"), ("module", "huge_x")])
def test_fp16_grad_scaler_cpu(api, inject):
    amp_training_case(api, inject, "cpu", FP16)


def test_fp16_autocast_cpu_matches_float64():
    opts = full_opts(dict(label_smoothing=0.1, z_loss=1e-3, reduction="none"))
    x, w, b, target, grad_out = make_problem(40, 24, 257, seed=5)

    def ours_fn(x_, w_, b_):
        return hugehead.linear_cross_entropy(x_, w_, target, b_, return_lse=True, chunk_size=64, **opts)

    ours = run_case(ours_fn, x, w, b, grad_out, "none", autocast=FP16)
    plain = run_case(plain_with_lse(target, opts), x, w, b, grad_out, "none", autocast=FP16)
    exact = run_case(plain_with_lse(target, opts), through(x, FP16), through(w, FP16), through(b, FP16),
                     grad_out.double(), "none")
    assert ours[0].dtype == torch.float32 and ours[3].dtype == torch.float32
    check_against_rule(ours, plain, exact, FP16)


# --------------------------------------------------------------------------------------------------
# top-k and log_prob follow autocast
# --------------------------------------------------------------------------------------------------
def integer_head(sizes, d, chunk_size, device="cpu"):
    """A float32 head whose logits are small integers (exact in bfloat16), with ties at every top-k
    boundary: weight rows copied from three distinct integer rows."""
    v = sum(sizes)
    head = make_head(sizes, d, chunk_size=chunk_size, device=device)
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-2, 3, (3, d), generator=g).float()[torch.randint(0, 3, (v,), generator=g)]
    b = torch.randint(-1, 2, (v,), generator=g).float()
    head.load_state_dict({"weight": w, "bias": b})
    x = torch.randint(-1, 2, (64, d), generator=g).float()
    return head, x.to(device), w, b


@pytest.mark.parametrize("sizes,chunk_size,k", [([37], 16, 1), ([5, 20, 12], None, 5), ([150, 350, 100], 64, 40)])
def test_topk_under_autocast_exact_on_integer_logits(sizes, chunk_size, k):
    head, x, w, b = integer_head(sizes, 8, chunk_size)
    z = F.linear(x.double(), w.double(), b.double())
    order = torch.sort(z, dim=1, descending=True, stable=True)
    with torch.autocast("cpu", dtype=BF16):
        values, indices = head.topk(x, k)
    assert values.dtype == BF16 and indices.dtype == torch.int64  # as F.linear's logits under autocast
    assert torch.equal(indices, order.indices[:, :k])
    assert torch.equal(values.double(), order.values[:, :k])


def test_topk_and_log_prob_under_autocast_match_float64():
    d, sizes = 24, [100, 157]
    head = make_head(sizes, d, chunk_size=64, softcap=6.0)
    x, _, _, _, _ = make_problem(40, d, sum(sizes), seed=12)
    target = torch.randint(0, sum(sizes), (40,), generator=torch.Generator().manual_seed(1))
    w, b = logical(head), logical(head, "bias")
    z64 = reference.logits(through(x, BF16), through(w, BF16), through(b, BF16), 6.0)
    with torch.autocast("cpu", dtype=BF16):
        values, indices = head.topk(x, k=5)
        logp = head.log_prob(x, target)
        z_plain = reference.logits(x, w, b, 6.0)
    assert values.dtype == BF16 and logp.dtype == torch.float32
    # The values are the logits at the returned classes, as accurate as plain PyTorch's bf16 logits (with
    # its bias added in bf16) there; the classes are the top 5 up to that rounding.
    assert_within_rule(values, z_plain.gather(1, indices), z64.gather(1, indices), "top-k values", GRAD_FLOOR[BF16])
    kth = torch.sort(z64, dim=1, descending=True).values[:, 4:5]
    assert bool((z64.gather(1, indices) >= kth - 2.0**-6 * (1 + kth.abs())).all())
    exact = torch.log_softmax(z64, dim=1).gather(1, target[:, None])[:, 0]
    plain = torch.log_softmax(z_plain.float(), dim=1).gather(1, target[:, None])[:, 0]
    assert_within_rule(logp, plain, exact, "log_prob", LOSS_FLOOR)


# --------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------
def _compile_case():
    x, w, b, target, _ = make_problem(14, 6, 29, seed=13)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0, chunk_size=8)

    def inside(x_, w_, b_):
        with torch.autocast("cpu", dtype=BF16):
            loss, lse = hugehead.linear_cross_entropy(x_, w_, target, b_, return_lse=True, **opts)
        return loss + 0.01 * lse.square().mean()

    def bare(x_, w_, b_):
        loss, lse = hugehead.linear_cross_entropy(x_, w_, target, b_, return_lse=True, **opts)
        return loss + 0.01 * lse.square().mean()

    return x, w, b, inside, bare


@pytest.mark.parametrize("where", ["autocast_inside", "autocast_outside"])
def test_compile_under_autocast_matches_eager(where):
    """fullgraph: the whole loss is one custom op. aot_eager traces what inductor would (CPU CI time;
    tests/test_functional.py compiles with inductor, and the CUDA variant below does too)."""
    torch._dynamo.reset()
    x, w, b, inside, bare = _compile_case()
    fn = inside if where == "autocast_inside" else bare
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=BF16, enabled=where == "autocast_outside"):
        eager = run_with_grads(fn, x, w, b, None, "mean")
        comp = run_with_grads(compiled, x, w, b, None, "mean")
    assert comp[0].dtype == torch.float32 and comp[2].dtype == torch.float32
    for a, e in zip(comp, eager):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    # and it really computed in bf16: not the float32 answer
    f32 = run_with_grads(bare, x, w, b, None, "mean")
    assert not torch.equal(comp[2], f32[2])


def test_compile_module_under_autocast_matches_eager():
    """The head's forward checks its targets on the host (one synchronization), so torch.compile breaks
    the graph there; the result must still be eager's."""
    torch._dynamo.reset()
    head = make_head([20, 17], 8, chunk_size=8, softcap=4.0)
    x, _, _, target, _ = make_problem(16, 8, 37, bias=False, seed=15)

    def fn(x_):
        with torch.autocast("cpu", dtype=BF16):
            loss, lse = head(x_, target, return_lse=True)
        return loss + 0.01 * lse.square().mean()

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager")):
        head.zero_grad(set_to_none=True)
        x_ = x.clone().requires_grad_()
        out = f(x_)
        out.backward()
        results.append([out.detach(), x_.grad, *head_grads(head)])
    for a, e in zip(*results[::-1]):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# CUDA: bf16 and fp16 autocast, no full copy (peak memory), GradScaler + AdamW against plain PyTorch
# --------------------------------------------------------------------------------------------------
CUDA_CASES = ["plain-kept", "all-options-rows", "wide-stream", "zloss-softcap-kept"]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_CASES)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("api", ["functional", "module"])
def test_cuda_autocast_matches_float64(api, dtype, name):
    case = CASES[name]
    opts = full_opts(case["opts"])
    chunking = {k: v for k, v in chunk_options(case, dtype).items()}
    x, w, b, target, grad_out = make_problem(case["n"], case["d"], case["v"], bias=case["bias"], device="cuda",
                                             ignore_index=opts["ignore_index"])
    if api == "module":
        head = make_head([case["v"] // 3, case["v"] - case["v"] // 3], case["d"], bias=case["bias"], device="cuda",
                         **opts, **chunking)
        w, b = logical(head).cuda(), None if not case["bias"] else logical(head, "bias").cuda()
        ours = run_head(head, x, target, grad_out, opts["reduction"], dtype, device_type="cuda")
    else:
        def ours_fn(x_, w_, b_):
            return hugehead.linear_cross_entropy(x_, w_, target, b_, return_lse=True, **opts, **chunking)
        ours = run_case(ours_fn, x, w, b, grad_out, opts["reduction"], autocast=dtype, device_type="cuda")
    plain = run_case(plain_with_lse(target, opts), x, w, b, grad_out, opts["reduction"], autocast=dtype,
                     device_type="cuda")
    exact = run_case(plain_with_lse(target.cpu(), opts), through(x, dtype), through(w, dtype), through(b, dtype),
                     grad_out.double().cpu(), opts["reduction"])
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert ours[2].dtype == torch.float32 and ours[3].dtype == torch.float32
    check_against_rule(ours, plain, exact, dtype, what=f"{api} ")


def _cuda_step_extra_bytes(step, leaves):
    """Peak bytes a forward + backward allocates beyond what was allocated before it (after a warm-up
    step; the leaves' gradients are dropped before the measured one)."""
    step()
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("api", ["functional", "module"])
def test_cuda_autocast_peak_memory_has_no_full_weight_copy(api):
    """A float32 1M x 512 weight (2 GiB) under bf16 autocast, against the same step with the weight
    already in bfloat16: the float32 master weight may add its larger gradient (+1 GiB) and a few cast
    chunks, not a bf16 copy of itself (+1 GiB more)."""
    n, d, v, budget = 1024, 512, 1 << 20, 256 << 20
    torch.manual_seed(0)
    x = torch.randn(n, d, device="cuda", requires_grad=True)
    target = torch.randint(0, v, (n,), device="cuda")
    extra = {}
    for dtype in (BF16, torch.float32):
        if api == "module":
            head = hugehead.ChunkedClassifier(d, v, bias=False, devices=["cuda"], memory_budget=budget, dtype=dtype)
            weight = head.shards[0].weight

            def step():
                with torch.autocast("cuda", dtype=BF16):
                    head(x, target).backward()
        else:
            weight = (torch.randn(v, d, device="cuda") / d**0.5).to(dtype).requires_grad_()

            def step():
                with torch.autocast("cuda", dtype=BF16):
                    hugehead.linear_cross_entropy(x, weight, target, memory_budget=budget).backward()

        extra[dtype] = _cuda_step_extra_bytes(step, [x, weight])
        assert weight.grad.dtype == dtype
        del step, weight
        if api == "module":
            del head
        torch.cuda.empty_cache()
    plan = plan_chunks(n, d, v, BF16, torch.device("cuda"), None, budget, weight_dtype=torch.float32)
    cast_chunks = 4 * plan.cols * d * 2  # cast weight chunks (a lookahead) and dW chunks in bf16
    bf16_copy = v * d * 2
    grad_growth = v * d * 2  # a float32 gradient instead of a bfloat16 one
    assert extra[torch.float32] <= extra[BF16] + grad_growth + cast_chunks + (32 << 20), (extra, plan)
    assert extra[torch.float32] < extra[BF16] + grad_growth + bf16_copy  # what a full copy would at least add
    assert extra[BF16] <= v * d * 2 + budget + cast_chunks + (32 << 20), (extra, plan)  # the budget holds


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("inject", ["scale", "huge_x"])
@pytest.mark.parametrize("api", ["functional", "module"])
def test_cuda_fp16_grad_scaler_adamw_matches_plain(api, inject):
    amp_training_case(api, inject, "cuda", FP16, fused=True, n=64, d=32, sizes=(300, 700), chunk=128)


@requires_cuda
@pytest.mark.cuda
def test_cuda_topk_under_autocast_exact_on_integer_logits():
    head, x, w, b = integer_head([150, 350, 100], 8, 64, device="cuda")
    z = F.linear(x.double().cpu(), w.double(), b.double())
    order = torch.sort(z, dim=1, descending=True, stable=True)
    with torch.autocast("cuda", dtype=BF16):
        values, indices = head.topk(x, 10)
        logp = head.log_prob(x, order.indices[:, 0].cuda())
    assert values.dtype == BF16 and logp.dtype == torch.float32
    assert torch.equal(indices.cpu(), order.indices[:, :10])
    assert torch.equal(values.double().cpu(), order.values[:, :10])
    expected = torch.log_softmax(z, 1).gather(1, order.indices[:, :1])[:, 0]
    torch.testing.assert_close(logp.double().cpu(), expected, rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.cuda
def test_cuda_compile_under_autocast_matches_eager():
    torch._dynamo.reset()
    x, w, b, target, _ = make_problem(64, 32, 1000, seed=14, device="cuda")

    def fn(x_, w_, b_):
        with torch.autocast("cuda", dtype=BF16):
            loss, lse = hugehead.linear_cross_entropy(x_, w_, target, b_, return_lse=True, chunk_size=256,
                                                      label_smoothing=0.1)
        return loss + 0.01 * lse.square().mean()

    eager = run_with_grads(fn, x, w, b, None, "mean")
    comp = run_with_grads(torch.compile(fn, fullgraph=True), x, w, b, None, "mean")
    for a, e in zip(comp, eager):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


@requires_multigpu
@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_multigpu_autocast_matches_float64(dtype):
    case = CASES["all-options-rows"]
    opts = full_opts(case["opts"])
    sizes = [120, 180]
    head = make_head(sizes, case["d"], device=["cuda:0", "cuda:1"], **opts, **chunk_options(case, dtype))
    x, _, _, target, grad_out = make_problem(case["n"], case["d"], sum(sizes), bias=False, device="cuda:0")
    w, b = logical(head).cuda(0), logical(head, "bias").cuda(0)
    ours = run_head(head, x, target, grad_out, opts["reduction"], dtype, device_type="cuda")
    assert [s.weight.grad.device for s in head.shards] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    plain = run_case(plain_with_lse(target, opts), x, w, b, grad_out, opts["reduction"], autocast=dtype,
                     device_type="cuda")
    exact = run_case(plain_with_lse(target.cpu(), opts), through(x, dtype), through(w, dtype), through(b, dtype),
                     grad_out.double().cpu(), opts["reduction"])
    check_against_rule(ours, plain, exact, dtype)


@requires_multigpu
@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("inject", ["scale", "huge_x"])
def test_multigpu_fp16_grad_scaler_adamw_matches_plain(inject):
    """Shards on two GPUs: GradScaler finds the overflow per device and the (foreach) AdamW skips the step
    on both. Not fused=True: with an overflow on two devices, GradScaler passes the fused kernels
    found_inf = 2.0 and they skip only on == 1 (a PyTorch bug; README)."""
    amp_training_case("module", inject, "cuda:0", FP16, devices=["cuda:0", "cuda:1"], fused=False, n=64, d=32,
                      sizes=(300, 700), chunk=128)


# --------------------------------------------------------------------------------------------------
# bench/bench_amp.py: the GPU benchmark's pipeline on tiny CPU problems
# --------------------------------------------------------------------------------------------------
def test_bench_amp_cpu_smoke(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # `bench` under python -P -m pytest
    from bench import bench_amp

    out = tmp_path / "amp.json"
    assert bench_amp.main(["--cpu-smoke", "--out", str(out), "--reps", "2", "--warmup", "1"]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["git_sha"] and doc["meta"]["torch"] == torch.__version__ and doc["meta"]["smoke"]
    fb = doc["fwd_bwd"]
    assert all(fb[k]["status"] == "ok" and fb[k]["ms"] > 0 and len(fb[k]["ms_all"]) == 2
               for k in ("bf16_head", "fp32_head_autocast"))
    assert fb["time_ratio"] > 0 and fb["fp32_head_autocast"]["weight_dtype"] == "torch.float32"
    same = fb["same_as_bf16_head"]  # a float32 W under autocast computes what its bf16 rounding does
    assert same["loss_equal"] and same["grad_x_equal"] and same["grad_w_equal_after_cast"]
    assert [r["devices"] for r in doc["train_step"]] == [["cpu"], ["cpu", "cpu"]]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["losses"][-1] < r["losses"][0] for r in doc["train_step"])
    gs = doc["grad_scaler_fp16"]
    assert gs["agreement"]["ok"] and [s["updated"] for s in gs["hugehead"]] == [True, True, False, True, True]
    assert out.with_suffix(".md").read_text().startswith("# Mixed precision")
