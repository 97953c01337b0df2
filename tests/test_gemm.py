"""The CUTLASS sm_90a logits GEMM with the statistics in its epilogue (hugehead::gemm_chunk_stats_, issue 21):
the op against float64 and against the cuBLAS + chunk_stats_ path it replaces, both schedules, and the whole
linear_cross_entropy on the fused GEMMs vs the cuBLAS fallback (Tuning.gemm). The GPU tests skip unless the build has the
CUTLASS GEMMs and the GPU is sm_90; the dispatch and fake-kernel tests run everywhere."""
import math

import pytest
import torch

import hugehead
from hugehead import ops

from hugehead.plan import plan_chunks

from conftest import HAS_CUDA_KERNELS, rel_err

HAS_FUSED = HAS_CUDA_KERNELS and ops.has_fused_gemm(torch.device("cuda"), torch.bfloat16)
requires_fused = pytest.mark.skipif(
    not HAS_FUSED, reason="needs a CUDA GPU of compute capability 9.0 and hugehead's CUTLASS GEMMs")
# The fused GEMMs' schedule follows the depth and the call (csrc/include/hugehead/gemm.h): below D = 2048
# pingpong_cluster_192 (128 x 192 tiles: the statistics without logit sums or softcap, the TMA-stored gradient),
# else pingpong_cluster; from D = 2048 cooperative (statistics) / pingpong_cluster (gradient). The shapes below
# reach each.
IGNORE = -100


def _without_kept_probs(monkeypatch):
    """The same step with its kept chunks holding logits, not probabilities: planned without the kept_probs
    budget rule and with Plan.kept_probs off (what the planner decides where the factored backward does not
    apply); the loop follows the plan."""
    import dataclasses

    from hugehead import lce_op, plan

    real, paths = lce_op.plan_loss, plan._paths
    monkeypatch.setattr(lce_op, "plan_loss", lambda *a, **k: real(*a, **{**k, "kept_probs": False}))
    monkeypatch.setattr(plan, "_paths", lambda *a, **k: dataclasses.replace(paths(*a, **k), kept_probs=False))


def _without_grad_store(monkeypatch):
    """The same step keeping no chunk in the weight gradient's buffer (planned with grad_store=False)."""
    from hugehead import lce_op

    real = lce_op.plan_loss
    monkeypatch.setattr(lce_op, "plan_loss", lambda *a, **k: real(*a, **{**k, "grad_store": False}))


def _inputs(n, c, d, dtype, *, bias, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (scale * torch.randn(c, d, generator=g) / math.sqrt(d) * 3).to(dtype)
    b = torch.randn(c, generator=g).to(dtype) if bias else None
    return x, w, b


def _start_state(n, seed):
    """Running statistics as after an earlier chunk (row 0 as at the very start)."""
    g = torch.Generator().manual_seed(seed + 1)
    row_max = torch.randn(n, generator=g)
    row_max[:1] = -math.inf
    row_sumexp = torch.rand(n, generator=g) + 0.5
    row_sumexp[:1] = 0.0
    return [row_max, row_sumexp, torch.randn(n, generator=g), torch.randn(n, generator=g)]


def _float64_stats(x, w, b, target, class_start, softcap, state):
    """The chunk_stats_ update computed in float64 (plain PyTorch, on the GPU for speed) from the same
    (rounded) inputs; returned on the CPU."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    z = x.double().to(dev) @ w.double().to(dev).t()
    if b is not None:
        z = z + b.double().to(dev)
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    m_old, s_old, t_old, sum_old = (t.double().to(dev) for t in state)
    target = target.to(dev)
    m_new = torch.maximum(m_old, z.max(dim=1).values)
    s_new = torch.where(m_old == -math.inf, 0.0, s_old * torch.exp(m_old - m_new)) + torch.exp(
        z - m_new[:, None]).sum(dim=1)
    local = target - class_start
    inside = (local >= 0) & (local < w.shape[0])
    picked = z.gather(1, local.clamp(0, w.shape[0] - 1)[:, None]).squeeze(1)
    return [t.cpu() for t in (m_new + s_new.log(), torch.where(inside, picked, t_old), sum_old + z.sum(dim=1))]


def _targets(n, c, class_start, v, seed):
    """Half the rows hit the chunk, the rest are elsewhere in [0, v) or ignored."""
    g = torch.Generator().manual_seed(seed + 2)
    target = torch.randint(0, v, (n,), generator=g)
    target[::2] = torch.randint(class_start, class_start + c, (n,), generator=g)[::2]
    target[1::5] = IGNORE
    return target


def _run(fn, x, w, b, target, class_start, softcap, state):
    dev = [t.cuda() for t in state]
    fn(x, w, b, target, class_start, softcap, dev)
    return [t.cpu() for t in dev]


def _fused_gemms_or_skip(tuned, device: str) -> None:
    """The fused CUTLASS GEMMs for a test on ``device`` ("cpu": their emulation; "cuda": skipped without an sm_90
    GPU and a CUTLASS build)."""
    if device == "cuda" and not (torch.cuda.is_available() and ops.has_fused_gemm(torch.device("cuda"),
                                                                                   torch.bfloat16)):
        pytest.skip("needs the fused GEMMs (an sm_90 GPU, a CUTLASS build)")
    tuned(gemm="cutlass")


def _fused(x, w, b, target, class_start, softcap, state, with_logit_sum=True):
    ops.gemm_chunk_stats_(x.cuda(), w.cuda(), None if b is None else b.cuda(), target.cuda(), class_start, softcap,
                          *state, with_logit_sum=with_logit_sum)


def _fused_plain(x, w, b, target, class_start, softcap, state):
    """Without the logit sums: what the loop asks without label smoothing (the 128 x 192 tiles' case)."""
    _fused(x, w, b, target, class_start, softcap, state, with_logit_sum=False)


def _cublas(x, w, b, target, class_start, softcap, state):
    xc, wc = x.cuda(), w.cuda()
    z = xc @ wc.t() if b is None else torch.addmm(b.cuda(), xc, wc.t())
    ops.chunk_stats_(z, target.cuda(), class_start, softcap, *state)


# (N, C, D, class_start, bias, softcap): N and C off the tiles (128 rows; 128 / 256 columns), one row,
# one column, the seed's D = 768, a chunk in the middle of the classes, more column tiles a row than the merge
# kernel's lanes load at once (128 partials a round), the last round partly.
SHAPES = [
    (1, 1, 8, 0, False, 0.0),
    (5, 300, 64, 0, True, 0.0),
    (130, 257, 128, 1000, False, 30.0),
    (257, 1000, 768, 500, True, 0.0),
    (1000, 3000, 768, 4096, True, 15.0),
    (300, 1000, 2048, 0, False, 0.0),  # cooperative
    (4096, 8192 + 17, 768, 64, False, 0.0),
    (64, 60000 + 17, 64, 0, False, 0.0),  # 313 / 469 column tiles a row: the merge's loads in several rounds
]


@requires_fused
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,c,d,class_start,bias,softcap", SHAPES)
def test_stats_match_float64_and_the_cublas_path(dtype, n, c, d, class_start, bias, softcap):
    seed = n * 7 + c
    x, w, b = _inputs(n, c, d, dtype, bias=bias, seed=seed)
    target = _targets(n, c, class_start, class_start + c + 100, seed)
    state = _start_state(n, seed)
    fused = _run(_fused, x, w, b, target, class_start, softcap, state)
    plain = _run(_fused_plain, x, w, b, target, class_start, softcap, state)
    cublas = _run(_cublas, x, w, b, target, class_start, softcap, state)
    ref_lse, ref_t, ref_sum = _float64_stats(x, w, b, target, class_start, softcap, state)

    def lse(s):
        return s[0].double() + s[1].double().log()

    eps = torch.finfo(dtype).eps
    # Without the logit sums (another schedule's tiles for pingpong_cluster_192): logit_sum is left alone,
    # lse and the target logits as close to float64 and the cuBLAS path as below.
    assert torch.equal(plain[3], state[3])
    for what, got, other, ref in (("lse", lse(plain), lse(cublas), ref_lse),
                                  ("target_logit", plain[2], cublas[2], ref_t)):
        diff = (got.double() - other.double()).abs()
        assert (diff <= 2 * eps * (1 + ref.abs())).all(), f"{what}: max |fused - cublas| {float(diff.max()):.3g}"
        assert rel_err(got, ref) <= 2 * rel_err(other, ref) + 1e-6, what

    # Both paths fold the same logits (acc + bias rounded once to the dtype) up to the GEMM's and the sums'
    # orders: elementwise within a couple of the dtype's epsilons of each other (a logit the two K orders
    # round apart moves by one ulp), and norm-wise as close to float64 as the cuBLAS path (2x, the rule).
    for what, got, other, ref in (("lse", lse(fused), lse(cublas), ref_lse), ("target_logit", fused[2], cublas[2], ref_t),
                                  ("logit_sum", fused[3], cublas[3], ref_sum)):
        assert torch.isfinite(got).all(), what
        scale = (1 + ref.abs()) if what != "logit_sum" else (c + ref.abs())
        diff = (got.double() - other.double()).abs()
        assert (diff <= 2 * eps * scale).all(), f"{what}: max |fused - cublas| {float(diff.max()):.3g}"
        err, err_cublas = rel_err(got, ref), rel_err(other, ref)
        assert err <= 2 * err_cublas + 1e-6, f"{what}: rel err {err:.3g} vs float64, cuBLAS path {err_cublas:.3g}"
    # rows whose target is outside the chunk keep their earlier target logit exactly
    outside = ~((target >= class_start) & (target < class_start + c))
    assert torch.equal(fused[2][outside], state[2][outside])
    # the running max is a max of values of this chunk or the earlier one: exactly the float32 one
    assert torch.all(fused[0] >= state[0])


@requires_fused
@pytest.mark.parametrize("n,c,d", [(257, 1000, 768), (4096, 20000, 768)])
def test_repeated_runs_are_bitwise_identical(n, c, d):
    x, w, b = _inputs(n, c, d, torch.bfloat16, bias=True, seed=3)
    target = _targets(n, c, 0, c, 3)
    state = _start_state(n, 3)
    for fn in (_fused, _fused_plain):
        first = _run(fn, x, w, b, target, 0, 0.0, state)
        for _ in range(3):
            again = _run(fn, x, w, b, target, 0, 0.0, state)
            for a, r in zip(again, first):
                assert torch.equal(a, r)


@requires_fused
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,c,d", [(1000, 3000, 768), (300, 20000 + 17, 768), (64, 60000 + 17, 64)])
def test_stats_without_logit_sums(bias, n, c, d):
    """with_logit_sum=False: logit_sum is left as it was, and max / sum-exp / target logit are the bits the
    default call gives (the same arithmetic, whole tiles and the checked edge tiles alike), though its partials
    are (max, sum) pairs of 8 bytes where the default's are 16 (and merged by another kernel instance). Partial
    tiles along both modes; the second shape has 157 column tiles a row, the third 469 (313 on 128 x 192 tiles:
    the merge's loads in several rounds)."""
    x, w, b = _inputs(n, c, d, torch.bfloat16, bias=bias, seed=41)
    xc, wc, bc = x.cuda(), w.cuda(), None if b is None else b.cuda()
    target = _targets(n, c, 0, c, 41).cuda()
    with_sum = [t.cuda() for t in _start_state(n, 41)]
    without = [t.cuda() for t in _start_state(n, 41)]
    before = without[3].clone()
    ops.gemm_chunk_stats_(xc, wc, bc, target, 0, 0.0, *with_sum)
    ops.gemm_chunk_stats_(xc, wc, bc, target, 0, 0.0, *without, with_logit_sum=False)
    if d < 2048:
        # below D = 2048 the call without logit sums runs pingpong_cluster_192 and the one with them 128-column
        # tiles: the max and target logits are the same values, the sums of exps grouped by other tiles
        assert torch.equal(with_sum[0], without[0]) and torch.equal(with_sum[2], without[2])
        torch.testing.assert_close(with_sum[1], without[1], rtol=2e-6, atol=0)
    else:
        for a, b_ in zip(with_sum[:3], without[:3]):
            assert torch.equal(a, b_)
    assert torch.equal(without[3], before)
    assert not torch.equal(with_sum[3], before)


# (N, C, D, class_start, bias): columns off the 128 / 256 column tiles (C a multiple of 8, as the TMA store
# needs), rows off the 128 row tiles, the seed's D.
STORE_SHAPES = [
    (5, 296, 64, 0, True),
    (257, 1000, 768, 500, True),
    (1000, 3000 + 8, 768, 4096, False),
    (4096, 8192 + 24, 768, 64, False),
]


@requires_fused
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_logit_sum", [True, False])
@pytest.mark.parametrize("n,c,d,class_start,bias", STORE_SHAPES)
def test_stats_with_stored_logits(dtype, with_logit_sum, n, c, d, class_start, bias):
    """logits=z (a kept chunk, the rows plan's block): the statistics are bitwise those of the GEMM that stores
    nothing (the same mainloop and fold), z holds exactly the values they were folded from (chunk_stats_ on z
    gives the same max and target logit bitwise, the same sum up to its order), z is as close to float64
    x Wᵀ + b as cuBLAS's stored logits (at most one ulp from them), and z may be a strided view into a wider
    buffer whose other columns stay untouched. They are stored by TMA from each schedule's own tile (128 x 192
    too, where pingpong_cluster_192 applies: without logit sums)."""
    seed = n + c + 17
    x, w, b = _inputs(n, c, d, dtype, bias=bias, seed=seed)
    xc, wc, bc = x.cuda(), w.cuda(), None if b is None else b.cuda()
    target = _targets(n, c, class_start, class_start + c + 100, seed).cuda()
    plain = [t.cuda() for t in _start_state(n, seed)]
    stored = [t.cuda() for t in _start_state(n, seed)]
    buf = torch.full((n, c + 40), float("nan"), dtype=dtype, device="cuda")
    z = buf[:, 16:16 + c]
    ops.gemm_chunk_stats_(xc, wc, bc, target, class_start, 0.0, *plain, with_logit_sum=with_logit_sum)
    ops.gemm_chunk_stats_(xc, wc, bc, target, class_start, 0.0, *stored, with_logit_sum=with_logit_sum, logits=z)
    for a, r in zip(stored, plain):
        assert torch.equal(a, r)
    assert torch.isnan(buf[:, :16]).all() and torch.isnan(buf[:, 16 + c:]).all()
    assert not torch.isnan(z).any()
    ref = xc.double() @ wc.double().t() + (0.0 if bc is None else bc.double())
    cublas = xc @ wc.t() if bc is None else torch.addmm(bc, xc, wc.t())
    eps = torch.finfo(dtype).eps
    assert ((z.double() - cublas.double()).abs() <= eps * ref.abs() + 1e-6).all()
    assert rel_err(z, ref) <= 2 * rel_err(cublas, ref) + 1e-7
    again = [t.cuda() for t in _start_state(n, seed)]
    ops.chunk_stats_(z, target, class_start, 0.0, *again)
    assert torch.equal(again[0], stored[0]) and torch.equal(again[2], stored[2])
    torch.testing.assert_close(again[1], stored[1], rtol=1e-5, atol=0)
    if with_logit_sum:
        torch.testing.assert_close(again[3], stored[3], rtol=1e-5, atol=1e-3)


# (N, C, D, class_start): ragged rows and columns against the 128 x 192 tiles, the seed's D = 768.
REF_SHAPES = [(5, 296, 64, 0), (257, 1000 + 8, 768, 500), (1000, 3000 + 8, 768, 4096), (4096, 8192 + 24, 768, 64)]


@requires_fused
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,c,d,class_start", REF_SHAPES)
@pytest.mark.parametrize("probs,stored", [(False, True), (True, True), (False, False)])
def test_stats_against_a_reference(dtype, n, c, d, class_start, probs, stored):
    """reference= each row's max so far (no bias, no logit sums): each (row, tile) folds against it -- with
    stored logits (a kept chunk the loop folds after the chunks it does not keep) stats_ref_gemm.cuh's TMA
    kernel, without them (every chunk after the forward's first) stats_gemm.cuh's fold_ref. The target logits
    are bitwise the fold's, and lse = row_max + log(row_sumexp) is float64's on the fold's stored logits within
    float32 rounding -- also for rows with no max yet (row 0: -inf) and rows whose max lies far below this
    chunk's logits (every 7th: flagged, folded again exactly by the merge kernel); the other rows keep row_max.
    The stored values are the fold's logits bitwise, or with probs=True (bf16) exp(min(z - ref, 80)) within
    bf16's rounding of float64's."""
    if probs and dtype != torch.bfloat16:
        pytest.skip("probabilities are kept in bf16 only")
    seed = n + c + 29
    x, w, _ = _inputs(n, c, d, dtype, bias=False, seed=seed)
    xc, wc = x.cuda(), w.cuda()
    target = _targets(n, c, class_start, class_start + c + 100, seed).cuda()
    start = _start_state(n, seed)
    far = torch.zeros(n, dtype=torch.bool)
    far[1::7] = True
    start[0][far] -= 80.0
    plain = [t.cuda() for t in start]
    ours = [t.cuda() for t in start]
    z_plain = torch.empty(n, c, dtype=dtype, device="cuda")
    z = torch.full_like(z_plain, float("nan")) if stored else None
    ops.gemm_chunk_stats_(xc, wc, None, target, class_start, 0.0, *plain, with_logit_sum=False, logits=z_plain)
    reference = start[0].cuda()
    ops.gemm_chunk_stats_(xc, wc, None, target, class_start, 0.0, *ours, with_logit_sum=False, logits=z,
                          reference=reference, probs=probs)
    zd = z_plain.double().cpu()
    # the flagged rows (every 7th and row 0) are folded again from logits of a float32 dot of another order,
    # each within one bf16 ulp of the GEMM's: float64's on the GEMM's logits within that
    again_rows = far.clone()
    again_rows[0] = True
    loose = (2 ** -8 * (1 + zd.abs().max(dim=1).values))[:, None]
    if probs:  # a flagged row's values against its own max, which becomes its reference
        moved = reference.cpu()
        assert torch.equal(moved[~again_rows], start[0][~again_rows])
        assert (moved[again_rows] == zd[again_rows].max(dim=1).values.float()).float().mean() > 0.9
        e = torch.exp((zd - moved.double()[:, None]).clamp(max=80.0))
        # A flagged row's values come from the fix kernel's own logits, each within one bf16 ulp of the GEMM's
        # (ulp(z) <= 2^-7 |z|: exp's relative error up to that, beside the output's rounding); `loose` is half
        # that ulp at the row's largest |z|, too tight for a flagged row at 4096 x 8216. The others are
        # the GEMM's own logits, so only the output's bf16 rounding (2^-9) and exp's float32 error remain.
        tol = torch.where(again_rows[:, None], 2 * loose + 2 ** -8, torch.full_like(loose, 2 ** -7)) * e + 1e-30
        assert ((z.double().cpu() - e).abs() <= tol).all()
    else:
        if stored:
            assert torch.equal(z, z_plain)
        assert torch.equal(reference.cpu(), start[0])
    assert torch.equal(ours[2], plain[2]) and torch.equal(ours[3], plain[3])
    m_old, s_old = start[0].double(), start[1].double()
    m_new = torch.maximum(m_old, zd.max(dim=1).values)
    s_new = torch.where(m_old == -math.inf, 0.0, s_old * torch.exp(m_old - m_new)) + torch.exp(
        zd - m_new[:, None]).sum(dim=1)
    expected = m_new + s_new.log()
    for state in (ours, plain):
        lse = state[0].double().cpu() + state[1].double().cpu().log()
        rows = ~again_rows if state is ours else slice(None)
        torch.testing.assert_close(lse[rows], expected[rows], rtol=3e-6, atol=3e-6)
        assert ((lse - expected).abs() <= loose[:, 0] * (1 + expected.abs())).all()
    kept = torch.isfinite(start[0]) & ~far
    assert torch.equal(ours[0].cpu()[kept], start[0][kept])
    again = [t.cuda() for t in start]
    z_again = torch.empty_like(z) if stored else None
    ops.gemm_chunk_stats_(xc, wc, None, target, class_start, 0.0, *again, with_logit_sum=False, logits=z_again,
                          reference=start[0].cuda(), probs=probs)
    for a, r in zip(again + ([z_again] if stored else []), ours + ([z] if stored else [])):
        assert torch.equal(a, r)


@requires_fused
def test_reference_applies_only_where_it_can():
    """A reference with a bias, with logit sums, without stored logits on a schedule other than
    pingpong_cluster_192 (fold_ref's only one: a depth of 2048 takes cooperative) runs the ordinary fold:
    bitwise the call without it; probs=True where that happens (or in fp16, or without a reference) raises,
    naming the problem."""
    n, c, d = 300, 1000, 128
    x, w, b = _inputs(n, c, d, torch.bfloat16, bias=True, seed=31)
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    target = _targets(n, c, 0, c, 31).cuda()
    cases = [dict(bias=bc, with_logit_sum=False, store=True), dict(bias=None, with_logit_sum=True, store=True),
             dict(bias=None, with_logit_sum=False, store=False, deep=True)]
    xd, wd, _ = _inputs(n, c, 2048, torch.bfloat16, bias=False, seed=32)
    for case in cases:
        xs, ws = (xd.cuda(), wd.cuda()) if case.get("deep") else (xc, wc)
        out = {}
        for reference in (None, _start_state(n, 31)[0].cuda()):
            state = [t.cuda() for t in _start_state(n, 31)]
            z = torch.empty(n, c, dtype=torch.bfloat16, device="cuda") if case["store"] else None
            ops.gemm_chunk_stats_(xs, ws, case["bias"], target, 0, 0.0, *state,
                                  with_logit_sum=case["with_logit_sum"], logits=z, reference=reference)
            out[reference is None] = state + ([z] if z is not None else [])
            if reference is not None:
                with pytest.raises(RuntimeError, match="probs"):
                    ops.gemm_chunk_stats_(xs, ws, case["bias"], target, 0, 0.0, *state,
                                          with_logit_sum=case["with_logit_sum"], logits=z, reference=reference,
                                          probs=True)
        for a, r in zip(out[False], out[True]):
            assert torch.equal(a, r), case
    state = [t.cuda() for t in _start_state(n, 31)]
    with pytest.raises(RuntimeError, match="probs"):
        ops.gemm_chunk_stats_(xc.half(), wc.half(), None, target, 0, 0.0, *state, with_logit_sum=False,
                              logits=torch.empty(n, c, dtype=torch.half, device="cuda"), reference=state[0].clone(),
                              probs=True)
    with pytest.raises(RuntimeError, match="probs"):
        ops.gemm_chunk_stats_(xc, wc, None, target, 0, 0.0, *state, with_logit_sum=False,
                              logits=torch.empty(n, c, dtype=torch.bfloat16, device="cuda"), probs=True)


@requires_fused
def test_stored_logits_refused_clearly():
    """Stored logits the TMA store cannot take, or with softcap (kept logits are stored uncapped), raise a
    RuntimeError that names the problem; nothing is written, and the context stays usable."""
    n, c, d = 64, 296, 64
    x, w, _ = _inputs(n, c, d, torch.bfloat16, bias=False, seed=8)
    xc, wc = x.cuda(), w.cuda()
    target = _targets(n, c, 0, c, 8).cuda()
    state = [t.cuda() for t in _start_state(n, 8)]
    before = [t.clone() for t in state]
    buf = torch.zeros(n, c + 16, dtype=torch.bfloat16, device="cuda")
    cases = [
        (dict(softcap=30.0, logits=buf[:, :c]), "softcap"),
        (dict(logits=buf[:, :c - 8]), "shape"),
        (dict(logits=buf[:, 1:1 + c]), "16-byte"),
        (dict(logits=torch.zeros(n, c, device="cuda")), "must be"),
    ]
    for kwargs, match in cases:
        softcap = kwargs.pop("softcap", 0.0)
        with pytest.raises(RuntimeError, match=match):
            ops.gemm_chunk_stats_(xc, wc, None, target, 0, softcap, *state, **kwargs)
    w_odd = wc[:292]  # 292 columns: not a multiple of 8
    with pytest.raises(RuntimeError, match="multiples of 8"):
        ops.gemm_chunk_stats_(xc, w_odd, None, target, 0, 0.0, *state,
                              logits=torch.zeros(n, 296, dtype=torch.bfloat16, device="cuda")[:, :292])
    for a, r in zip(state, before):
        assert torch.equal(a, r)
    assert torch.equal(buf, torch.zeros_like(buf))
    ops.gemm_chunk_stats_(xc, wc, None, target, 0, 0.0, *state, logits=buf[:, :c])
    torch.cuda.synchronize()  # the context is still usable


@requires_fused
def test_non_finite_inputs_propagate_like_chunk_stats():
    x, w, b = _inputs(64, 300, 64, torch.bfloat16, bias=False, seed=9)
    x[3, 0] = float("nan")
    x[5, :] = float("inf")  # +inf and -inf logits in one row: NaN, as F.cross_entropy
    target = torch.zeros(64, dtype=torch.long)
    state = [torch.full((64,), -math.inf), torch.zeros(64), torch.zeros(64), torch.zeros(64)]
    fused = _run(_fused, x, w, b, target, 0, 0.0, state)
    cublas = _run(_cublas, x, w, b, target, 0, 0.0, state)
    lse_f = fused[0] + fused[1].log()
    lse_c = cublas[0] + cublas[1].log()
    assert torch.equal(lse_f.isnan(), lse_c.isnan())
    assert lse_f[3].isnan() and lse_f[5].isnan() and torch.isfinite(lse_f[:3]).all()


@requires_fused
def test_bad_inputs_raise_before_any_kernel():
    x, w, b = _inputs(16, 64, 64, torch.bfloat16, bias=True, seed=1)
    x, w, b = x.cuda(), w.cuda(), b.cuda()
    target = torch.zeros(16, dtype=torch.long, device="cuda")
    state = [torch.full((16,), -math.inf, device="cuda")] + [torch.zeros(16, device="cuda") for _ in range(3)]
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        ops.gemm_chunk_stats_(x.float(), w.float(), None, target, 0, 0.0, *state)
    with pytest.raises(RuntimeError, match="features"):
        ops.gemm_chunk_stats_(x, w[:, :32], None, target, 0, 0.0, *state)
    with pytest.raises(RuntimeError, match="divisible by 8"):
        ops.gemm_chunk_stats_(x[:, :12], w[:, :12], None, target, 0, 0.0, *state)
    with pytest.raises(RuntimeError, match="bias"):
        ops.gemm_chunk_stats_(x, w, b[:10], target, 0, 0.0, *state)
    with pytest.raises(RuntimeError, match="row_max"):
        ops.gemm_chunk_stats_(x, w, b, target, 0, 0.0, state[0][:3], *state[1:])
    torch.cuda.synchronize()  # the context is still usable


@requires_fused
def test_opcheck():
    x, w, b = _inputs(40, 300, 64, torch.bfloat16, bias=True, seed=2)
    target = _targets(40, 300, 0, 300, 2).cuda()
    state = [t.cuda() for t in _start_state(40, 2)]
    torch.library.opcheck(torch.ops.hugehead.gemm_chunk_stats_.default,
                          (x.cuda(), w.cuda(), b.cuda(), target, 0, 0.0, *state))
    logits = torch.empty(40, 296, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.hugehead.gemm_chunk_stats_.default,
                          (x.cuda(), w[:296].cuda(), b[:296].cuda(), target.clamp(max=295), 0, 0.0, *state),
                          {"with_logit_sum": True, "logits": logits})


def _grad_inputs(n, c, seed, with_grad_lse):
    g = torch.Generator().manual_seed(seed + 3)
    lse = (torch.randn(n, generator=g) + 8.0).float()  # about the log-sum-exp of a few thousand N(0, 9) logits
    grad_rows = torch.rand(n, generator=g) / n
    grad_rows[1::5] = 0.0  # ignored rows
    grad_lse = (torch.randn(n, generator=g) / n) if with_grad_lse else None
    if grad_lse is not None:
        grad_lse[1::10] = 0.0  # some ignored rows get no lse gradient either: exact zeros
    return lse, grad_rows, grad_lse


def _float64_grad(x, w, b, target, class_start, num_classes, lse, grad_rows, eps, z_loss, softcap, grad_lse):
    """numerics.h's logit_grad in float64 on the exact logits (GPU for speed, returned on the CPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    z = x.double().to(dev) @ w.double().to(dev).t()
    if b is not None:
        z = z + b.double().to(dev)
    dcdz = torch.ones_like(z)
    if softcap > 0:
        t = torch.tanh(z / softcap)
        z, dcdz = softcap * t, 1 - t * t
    lse64, g = lse.double().to(dev)[:, None], grad_rows.double().to(dev)[:, None]
    p = torch.exp(z - lse64)
    d = p - eps / num_classes + p * 2 * z_loss * lse64
    local = (target - class_start).to(dev)
    inside = (local >= 0) & (local < w.shape[0])
    rows = torch.nonzero(inside).squeeze(1)
    d[rows, local[rows]] -= 1 - eps
    out = g * d
    if grad_lse is not None:
        out = out + grad_lse.double().to(dev)[:, None] * p
    return (out * dcdz).cpu()


# (N, C, D, class_start, bias, label_smoothing, z_loss, softcap, grad_lse, padded row stride)
GRAD_CASES = [
    (5, 300, 64, 0, False, 0.0, 0.0, 0.0, False, 0),
    (130, 257, 128, 1000, True, 0.1, 1e-3, 30.0, True, 0),  # odd C: scalar stores
    (257, 1000, 768, 500, True, 0.0, 0.0, 0.0, True, 6),    # a column slice of a wider buffer
    (1000, 3000 + 3, 768, 0, False, 0.1, 0.0, 15.0, False, 1),
    (1024, 4096, 768, 128, False, 0.1, 1e-3, 0.0, False, 0),  # whole tiles only: the fast path, no bias
    # The plain loss into a 16-byte aligned grad_logits: stored through shared memory by TMA (grad_tma_gemm.cuh)
    (1024, 4096, 768, 128, False, 0.1, 0.0, 0.0, False, 0),   # whole tiles
    (1000, 3008, 768, 0, False, 0.0, 0.0, 0.0, False, 8),     # partial tiles, a padded row stride
    (257, 1000, 768, 500, False, 0.1, 0.0, 0.0, False, 0),    # partial tiles along both modes
]


@requires_fused
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,c,d,class_start,bias,eps,z_loss,softcap,with_grad_lse,pad", GRAD_CASES)
def test_grad_matches_float64_and_the_cublas_path(dtype, n, c, d, class_start, bias, eps, z_loss,
                                                  softcap, with_grad_lse, pad):
    seed = n * 3 + c
    x, w, b = _inputs(n, c, d, dtype, bias=bias, seed=seed)
    num_classes = class_start + c + 100
    target = _targets(n, c, class_start, num_classes, seed)
    lse, grad_rows, grad_lse = _grad_inputs(n, c, seed, with_grad_lse)
    xc, wc, bc, tc = x.cuda(), w.cuda(), None if b is None else b.cuda(), target.cuda()
    lc, gc, glc = lse.cuda(), grad_rows.cuda(), None if grad_lse is None else grad_lse.cuda()
    wide = torch.full((n, c + pad), 7.0, dtype=dtype, device="cuda")  # canaries beside the slice
    fused = wide[:, :c]
    ops.gemm_chunk_grad_(xc, wc, bc, tc, class_start, num_classes, lc, gc, eps, z_loss, softcap, glc, fused)
    cublas = xc @ wc.t() if bc is None else torch.addmm(bc, xc, wc.t())
    ops.chunk_grad_(cublas, tc, class_start, num_classes, lc, gc, eps, z_loss, softcap, glc)
    ref = _float64_grad(x, w, b, target, class_start, num_classes, lse, grad_rows, eps, z_loss, softcap, grad_lse)
    assert torch.all(wide[:, c:] == 7.0), "wrote outside the chunk"
    got = fused.cpu()
    assert torch.isfinite(got.float()).all()
    err, err_cublas = rel_err(got, ref), rel_err(cublas, ref)
    assert err <= 2 * err_cublas + torch.finfo(dtype).eps, f"rel err {err:.3g} vs float64, cuBLAS path {err_cublas:.3g}"
    zero = (grad_rows == 0) & (grad_lse == 0 if grad_lse is not None else torch.ones_like(grad_rows, dtype=torch.bool))
    assert torch.all(got[zero] == 0), "ignored rows must be exact zeros"
    # and element by element the cuBLAS path's gradient up to rounding: a logit the two GEMMs' K orders round
    # apart moves p by one ulp of the logit (up to ~6% at |z| ~ 15 in bf16)
    torch.testing.assert_close(got.float(), cublas.cpu().float(), rtol=0.1, atol=1e-3 * float(ref.abs().max()))


@requires_fused
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_exact_logits_fold_and_gradient_against_float64(dtype, eps):
    """exact=True (gemm_chunk_stats_ / gemm_chunk_grad_): the float32 accumulator is the logit. The statistics
    (on the 128 x 192 fold; and folded against a reference;
    a row whose tile lies far above the fold's sampled max folded again exactly by the merge kernel)
    and the target logits are float64's on the unrounded logits within float32's sums' rounding -- far closer
    than the rounded fold, which is as far as a bf16 logit's rounding -- and the gradient from that lse is
    float64's within one rounding to the dtype (the TMA store, its g fold included without label smoothing,
    and the register epilogue a z-loss takes), no farther than the rounded logits' gradient; bitwise
    repeatable. exact with a bias, softcap, logit sums or stored logits raises."""
    n, c, d, class_start = 1000, 3008, 768, 64
    x, w, _ = _inputs(n, c, d, dtype, bias=False, seed=61)
    # row 3's logit at column 100 ~70: against its tile's first eight columns' max (the exact fold's m) its sum
    # passes kFlagSum, so the merge kernel folds that row again exactly
    w[100] = (x[3].float() * (70.0 / x[3].float().pow(2).sum())).to(dtype)
    xc, wc = x.cuda(), w.cuda()
    target = _targets(n, c, class_start, class_start + c + 100, 61)
    tc = target.cuda()
    state = _start_state(n, 61)
    ref_lse, ref_t, _ = _float64_stats(x, w, None, target, class_start, 0.0, state)
    outs = []
    for _ in range(2):
        got = [t.cuda() for t in state]
        ops.gemm_chunk_stats_(xc, wc, None, tc, class_start, 0.0, *got, with_logit_sum=False, exact=True)
        outs.append(got)
    assert all(torch.equal(a, r) for a, r in zip(outs[0], outs[1]))  # bitwise repeatable
    lse = outs[0][0].double().cpu() + outs[0][1].double().cpu().log()
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(outs[0][2].double().cpu(), ref_t, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[0][3].cpu(), state[3])  # no logit sums: left as they were
    folded = outs[0]
    if eps == 0:  # against a reference (fold_ref), no row far above it
        ref_state = [t.cuda() for t in state]
        ref_state[0].copy_(torch.where(torch.isfinite(ref_state[0]), ref_state[0] + 3.0, 0.0))
        m0 = ref_state[0].clone()
        ops.gemm_chunk_stats_(xc, wc, None, tc, class_start, 0.0, *ref_state, with_logit_sum=False,
                              reference=ref_state[0], exact=True)
        start = [m0.cpu()] + [t.clone() for t in state[1:]]
        want = _float64_stats(x, w, None, target, class_start, 0.0, start)[0]
        lse = ref_state[0].double().cpu() + ref_state[1].double().cpu().log()
        torch.testing.assert_close(lse, want, rtol=2e-6, atol=2e-6)
    with pytest.raises(RuntimeError, match="exact"):
        ops.gemm_chunk_stats_(xc, wc, wc[:, 0].contiguous(), tc, class_start, 0.0, *outs[1], exact=True)
    with pytest.raises(RuntimeError, match="exact"):  # logit sums (label smoothing's)
        ops.gemm_chunk_stats_(xc, wc, None, tc, class_start, 0.0, *outs[1], with_logit_sum=True, exact=True)
    with pytest.raises(RuntimeError, match="exact"):
        ops.gemm_chunk_stats_(xc, wc, None, tc, class_start, 0.0, *outs[1], with_logit_sum=False,
                              logits=torch.empty(n, c, dtype=dtype, device="cuda"), exact=True)
    # the gradient from the exact lse: float64's within one rounding to the dtype (z-loss: the register epilogue)
    _, grad_rows, _ = _grad_inputs(n, c, 61, False)
    lse = folded[0].cpu() + folded[1].cpu().log()
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    for z_loss in (0.0, 1e-3):
        grads = []
        for _ in range(2):
            g = torch.empty(n, c, dtype=dtype, device="cuda")
            ops.gemm_chunk_grad_(xc, wc, None, tc, class_start, class_start + c + 100, lse.cuda(), grad_rows.cuda(),
                                 eps, z_loss, 0.0, None, g, exact=True)
            grads.append(g)
        assert torch.equal(grads[0], grads[1])
        ref = _float64_grad(x, w, None, target, class_start, class_start + c + 100, lse, grad_rows, eps, z_loss, 0.0,
                            None)
        got = grads[0].double().cpu()
        # one rounding to the dtype (fp16: its subnormal step too, 2^-24, where g p lies below 6e-5)
        step = 2.0 ** -24 if dtype == torch.float16 else 0.0
        tol = torch.finfo(dtype).eps * ref.abs() + step + 2e-6 * ref.abs().max()
        assert ((got - ref).abs() <= tol).all(), float(((got - ref).abs() - tol).max())
        rounded = xc @ wc.t()  # the rounded logits' gradient (cuBLAS + chunk_grad_) is no closer to float64
        ops.chunk_grad_(rounded, tc, class_start, class_start + c + 100, lse.cuda(), grad_rows.cuda(), eps, z_loss,
                        0.0, None)
        assert rel_err(got, ref) <= rel_err(rounded.cpu(), ref) + 1e-7
    with pytest.raises(RuntimeError, match="exact"):
        ops.gemm_chunk_grad_(xc, wc, None, tc, class_start, c, lse.cuda(), grad_rows.cuda(), 0.0, 0.0, 30.0, None,
                             torch.empty(n, c, dtype=dtype, device="cuda"), exact=True)
    torch.cuda.synchronize()


@requires_fused
def test_grad_repeated_runs_are_bitwise_identical():
    n, c, d = 1000, 5000, 768
    x, w, b = (t.cuda() for t in _inputs(n, c, d, torch.bfloat16, bias=True, seed=4))
    target = _targets(n, c, 0, c, 4).cuda()
    lse, grad_rows, grad_lse = (t.cuda() for t in _grad_inputs(n, c, 4, True))
    outs = []
    for _ in range(3):
        out = torch.empty(n, c, dtype=torch.bfloat16, device="cuda")
        ops.gemm_chunk_grad_(x, w, b, target, 0, c, lse, grad_rows, 0.1, 1e-4, 0.0, grad_lse, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@requires_fused
def test_grad_opcheck_and_bad_inputs():
    n, c, d = 40, 300, 64
    x, w, b = (t.cuda() for t in _inputs(n, c, d, torch.bfloat16, bias=True, seed=6))
    target = _targets(n, c, 0, c, 6).cuda()
    lse, grad_rows, grad_lse = (t.cuda() for t in _grad_inputs(n, c, 6, True))
    out = torch.empty(n, c, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.hugehead.gemm_chunk_grad_.default,
                          (x, w, b, target, 0, c, lse, grad_rows, 0.1, 0.0, 0.0, grad_lse, out))
    with pytest.raises(RuntimeError, match="grad_logits must have shape"):
        ops.gemm_chunk_grad_(x, w, b, target, 0, c, lse, grad_rows, 0.0, 0.0, 0.0, None, out[:, :10])
    with pytest.raises(RuntimeError, match="grad_logits must be"):
        ops.gemm_chunk_grad_(x, w, b, target, 0, c, lse, grad_rows, 0.0, 0.0, 0.0, None, out.float())
    with pytest.raises(RuntimeError, match="lse"):
        ops.gemm_chunk_grad_(x, w, b, target, 0, c, lse[:5], grad_rows, 0.0, 0.0, 0.0, None, out)
    torch.cuda.synchronize()


def _count_fused_calls(monkeypatch):
    """Record the row count of every fused GEMM call the chunk loop makes: {"stats": [...], "grad": [...]}."""
    calls = {"stats": [], "grad": []}

    def counting(kind, real):
        def call(x, *args, **kwargs):
            calls[kind].append(x.shape[0])
            return real(x, *args, **kwargs)
        return call

    monkeypatch.setattr(ops, "gemm_chunk_stats_", counting("stats", ops.gemm_chunk_stats_))
    monkeypatch.setattr(ops, "gemm_chunk_grad_", counting("grad", ops.gemm_chunk_grad_))
    return calls


def _lce_grads(x, w, b, target, **opts):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_() if b is not None else None
    loss = hugehead.linear_cross_entropy(x, w, target, b, **opts)
    loss.backward()
    return [loss.detach()] + [t.grad for t in (x, w, b) if t is not None]


def _lce_float64(x, w, b, target, **opts):
    from hugehead import reference

    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    b64 = b.detach().double().cpu().requires_grad_() if b is not None else None
    opts = {k: v for k, v in opts.items() if k not in ("chunk_size", "memory_budget")}
    loss = reference.linear_cross_entropy(x64, w64, target.cpu(), b64, **opts)
    loss.backward()
    return [loss.detach()] + [t.grad for t in (x64, w64, b64) if t is not None]


@requires_fused
@pytest.mark.parametrize("opts", [
    dict(chunk_size=1024),
    dict(chunk_size=2048, label_smoothing=0.1, softcap=30.0, z_loss=1e-3),
    dict(),  # planned: all logits kept, so the cuBLAS path throughout
    dict(memory_budget=8 << 20),  # planned chunks, streamed (on a GPU, the overlapped loop for cuBLAS)
])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_cutlass_vs_cublas_vs_float64(monkeypatch, tuned, opts, bias):
    import hugehead.plan

    n, d, v = 1000, 768, 5000
    x, w, b = _inputs(n, v, d, torch.bfloat16, bias=bias, seed=11)
    x, w = x.cuda(), w.cuda()
    b = b.cuda() if b is not None else None
    target = _targets(n, v, 0, v, 11).cuda()
    plan = plan_chunks(n, d, v, torch.bfloat16, x.device, opts.get("chunk_size"), opts.get("memory_budget"))
    # chunks the planner keeps as stored logits never take the fused gradient GEMM (planned here: all kept);
    # without softcap the statistics GEMM stores them as it folds them
    streamed = not plan.keep_logits or plan.kept_chunks * plan.cols < v
    stored = plan.keep_logits and not opts.get("softcap") and d < hugehead.plan.FUSED_STORE_MAX_DEPTH
    results = {}
    for path in ("cublas", "cutlass"):
        tuned(gemm=path)
        assert ops.gemm_path(x.device, x.dtype) == path
        calls = _count_fused_calls(monkeypatch)
        results[path] = _lce_grads(x, w, b, target, **opts)
        assert (len(calls["stats"]) > 0) == (path == "cutlass" and (streamed or stored)), f"{path}: {calls}"
        assert (len(calls["grad"]) > 0) == (path == "cutlass" and streamed), f"{path}: {calls}"
    ref = _lce_float64(x, w, b, target, **opts)
    names = ["loss", "dx", "dw", "db"]
    for path in ("cutlass",):
        for what, ours, theirs, r in zip(names, results[path], results["cublas"], ref):
            err, err_cublas = rel_err(ours, r), rel_err(theirs, r)
            # the same logits up to the GEMMs' summation orders: within 2x the cuBLAS path's error (the
            # numerics rule), plus a bf16 epsilon floor
            assert err <= 2 * err_cublas + torch.finfo(torch.bfloat16).eps, \
                f"{path} {what}: {err:.3g} vs cublas {err_cublas:.3g}"
    # bitwise repeatable through the whole loss
    tuned(gemm="cutlass")
    again = _lce_grads(x, w, b, target, **opts)
    for a, r in zip(again, results["cutlass"]):
        assert torch.equal(a, r)


@requires_fused
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("kept", ["logits", "probs"])
def test_logits_kept_in_the_weight_gradient_through_the_fused_gemms(monkeypatch, tuned, label_smoothing, kept):
    """bf16 on the fused GEMMs with chunks kept in the weight gradient's buffer (the statistics GEMM stores them
    there; the backward's chunk_grad_ turns them into their gradient, and dW lands over consumed slots) and the
    rest recomputed by the gradient GEMM: loss, dX and dW within 2x the error of the same step keeping none there
    (planned with grad_store=False) against float64, bitwise repeatable. Without label smoothing the kept chunks
    fold against the row max of the others (the reference kernel); "probs" (the planner's choice there) keeps
    exp(z - ref) for the factored backward, "logits" the logits (the step planned and run without it)."""
    from hugehead.lce_op import loss_plan

    tuned(rows=False, gemm="cutlass")
    if kept == "logits":
        _without_kept_probs(monkeypatch)
    n, d, v = 1024, 128, 40000
    x, w, _ = _inputs(n, v, d, torch.bfloat16, bias=False, seed=17)
    x, w = x.cuda(), w.cuda()
    target = _targets(n, v, 0, v, 17).cuda()
    opts = dict(memory_budget=n * d * 6 + (4 << 20), label_smoothing=label_smoothing)
    plan = loss_plan(x.requires_grad_(), w.requires_grad_(), target, memory_budget=opts["memory_budget"])
    x, w = x.detach(), w.detach()
    chunks = -(-v // plan.cols)
    assert plan.kept_in_grad >= 2 and plan.kept_chunks < chunks, plan
    calls = _count_fused_calls(monkeypatch)
    ours = _lce_grads(x, w, None, target, **opts)
    assert len(calls["grad"]) == chunks - plan.kept_chunks, (plan, calls)
    again = _lce_grads(x, w, None, target, **opts)
    for a, r in zip(again, ours):
        assert torch.equal(a, r)
    _without_grad_store(monkeypatch)
    plain = _lce_grads(x, w, None, target, **opts)
    ref = _lce_float64(x, w, None, target, **opts)
    for what, a, p, r in zip(["loss", "dx", "dw"], ours, plain, ref):
        err, err_plain = rel_err(a, r), rel_err(p, r)
        assert err <= 2 * err_plain + torch.finfo(torch.bfloat16).eps, f"{what}: {err:.3g} vs {err_plain:.3g}"


@requires_fused
def test_row_split_plan_takes_the_fused_gemm(monkeypatch, tuned):
    """Rows split into blocks (a tiny budget): each block's chunk goes through the fused GEMM."""
    import hugehead.plan

    n, d, v, cols, split = 700, 128, 3000, 512, 128
    x, w, b = _inputs(n, v, d, torch.bfloat16, bias=True, seed=13)
    x, w, b = x.cuda(), w.cuda(), b.cuda()
    target = _targets(n, v, 0, v, 13).cuda()
    opts = dict(chunk_size=cols, memory_budget=split * (cols * 2 + d * (2 + 4)))
    plan = plan_chunks(n, d, v, torch.bfloat16, x.device, cols, opts["memory_budget"])
    assert plan.rows < n and plan.cols == cols
    results = {}
    for path in ("cublas", "cutlass"):
        tuned(gemm=path)
        calls = _count_fused_calls(monkeypatch)
        results[path] = _lce_grads(x, w, b, target, **opts)
        for kind in ("stats", "grad"):
            assert (len(calls[kind]) > 0) == (path == "cutlass")
            if path == "cutlass":  # every (chunk, row block) pair, no stored-logits chunk; the forward's
                # chunks are hugehead.plan.FUSED_STATS_WIDEN times wider (no logits workspace)
                width = cols * (hugehead.plan.FUSED_STATS_WIDEN if kind == "stats" else 1)
                assert len(calls[kind]) == math.ceil(v / width) * math.ceil(n / plan.rows)
                assert max(calls[kind]) <= plan.rows
    ref = _lce_float64(x, w, b, target, **opts)
    for ours, theirs, r in zip(results["cutlass"], results["cublas"], ref):
        assert rel_err(ours, r) <= 2 * rel_err(theirs, r) + torch.finfo(torch.bfloat16).eps


# -- everywhere (CI): the dispatch rules and the fake kernel ------------------------------------------------
def test_gemm_path_rules(tuned):
    tuned(gemm="cutlass")
    assert ops.gemm_path(torch.device("cpu"), torch.bfloat16) == "cublas"  # no CUTLASS on the CPU
    assert not ops.has_fused_gemm(torch.device("cpu"), torch.bfloat16)
    if torch.cuda.is_available():
        assert not ops.has_fused_gemm(torch.device("cuda"), torch.float32)
    tuned(gemm="cublas")
    if torch.cuda.is_available():
        assert ops.gemm_path(torch.device("cuda"), torch.bfloat16) == "cublas"
    with pytest.raises(ValueError, match="Tuning.gemm must be one of"):
        tuned(gemm="anything else")
    if not hugehead._C.cutlass_built():
        assert not hugehead.has_kernel("gemm_chunk_stats_", "CUDA")


def test_fake_kernel_checks_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, 64, dtype=torch.bfloat16)
        w = torch.empty(100, 64, dtype=torch.bfloat16)
        t = torch.empty(8, dtype=torch.long)
        state = [torch.empty(8) for _ in range(4)]
        torch.ops.hugehead.gemm_chunk_stats_.default(x, w, None, t, 0, 0.0, *state)
        with pytest.raises(Exception, match="feature count"):
            torch.ops.hugehead.gemm_chunk_stats_.default(x, w[:, :32], None, t, 0, 0.0, *state)
        out = torch.empty(8, 100, dtype=torch.bfloat16)
        torch.ops.hugehead.gemm_chunk_grad_.default(x, w, None, t, 0, 100, state[0], state[1], 0.0, 0.0, 0.0, None,
                                                    out)
        with pytest.raises(Exception, match="grad_logits"):
            torch.ops.hugehead.gemm_chunk_grad_.default(x, w, None, t, 0, 100, state[0], state[1], 0.0, 0.0, 0.0,
                                                        None, out[:, :10])


def _emulate_fused_ops(monkeypatch):
    """Run the chunk loop's fused branches on any device: the planner's fused_gemms says yes for class-id
    targets (so the plans take the fused paths) and the fused ops are emulated by addmm + chunk_stats_ /
    chunk_grad_ (the arithmetic of the cuBLAS path)."""
    from hugehead import plan

    monkeypatch.setattr(plan, "fused_gemms", lambda device, dtype, d, class_ids, traced=False: class_ids and not traced)

    def matmul(x, w, b):
        return x @ w.t() if b is None else torch.addmm(b, x, w.t())

    def stats(x, w, b, target, class_start, softcap, *state, with_logit_sum=True, logits=None, reference=None,
              probs=False, exact=False):
        before = state[3].clone()
        m0, s0 = state[0].clone(), state[1].clone()
        assert not exact or (b is None and not softcap and logits is None), "the op's rule for exact"
        z = x.float() @ w.float().t() if exact else matmul(x, w, b)  # (exact: the float32 logits, unrounded)
        if logits is not None:  # the logits stored as they are folded (kept chunks, the rows plan)
            assert softcap == 0.0, "stored logits are uncapped"
            z = logits.copy_(z)
        ops.chunk_stats_(z, target, class_start, softcap, *state)
        if reference is not None and b is None and not with_logit_sum:
            # the reference kernel's partials, (reference, sum exp(z - reference)), merged as lse_merge does;
            # flagged rows (past 2^80) keep chunk_stats_' exact fold, as the fix kernel's
            e = torch.exp((z.float() - reference[:, None]).clamp(max=80.0))
            total = e.sum(dim=1)
            ok = total <= 2.0 ** 80
            m = torch.maximum(m0, reference)
            s_new = torch.where(m0 == -math.inf, 0.0, s0 * torch.exp(m0 - m)) + total * torch.exp(reference - m)
            state[0].copy_(torch.where(ok, m, state[0]))
            state[1].copy_(torch.where(ok, s_new, state[1]))
            if probs:  # a flagged row's values against its own max, which becomes its reference
                reference.copy_(torch.where(ok, reference, z.float().max(dim=1).values))
                logits.copy_(torch.exp((z.float() - reference[:, None]).clamp(max=80.0)))
        else:
            assert not probs
        if not with_logit_sum:  # the fused op leaves it as it was
            state[3].copy_(before)

    def grad(x, w, b, target, class_start, num_classes, lse, grad_rows, eps, z_loss, softcap, grad_lse, out,
             exact=False):
        assert not exact or (b is None and not softcap), "the op's rule for exact"
        z = x.float() @ w.float().t() if exact else out.copy_(matmul(x, w, b))
        ops.chunk_grad_(z, target, class_start, num_classes, lse, grad_rows, eps, z_loss, softcap, grad_lse)
        if exact:
            out.copy_(z)

    monkeypatch.setattr(ops, "gemm_chunk_stats_", stats)
    monkeypatch.setattr(ops, "gemm_chunk_grad_", grad)


@pytest.mark.parametrize("widen", [2, 8])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_forward_takes_wider_chunks(monkeypatch, widen, eps):
    """With every chunk through the fused statistics GEMM (no kept logits), the forward takes chunks widen
    times the plan's width -- the backward keeps the plan's -- and the loss and gradients still match
    float64 as the cuBLAS path does (emulated fused ops on the CPU); the logit sums are asked for exactly
    when label smoothing reads them."""
    import hugehead.plan

    monkeypatch.setattr(hugehead.plan, "FUSED_STATS_WIDEN", widen)
    n, d, v, cols = 37, 16, 1000, 64
    x, w, b = _inputs(n, v, d, torch.float32, bias=True, seed=22)
    target = _targets(n, v, 0, v, 22)
    opts = dict(chunk_size=cols, label_smoothing=eps)
    plain = _lce_grads(x, w, b, target, **opts)
    _emulate_fused_ops(monkeypatch)
    asked = []
    emulated = ops.gemm_chunk_stats_
    monkeypatch.setattr(ops, "gemm_chunk_stats_",
                        lambda *a, with_logit_sum=True, **kw: asked.append(with_logit_sum) or emulated(
                            *a, with_logit_sum=with_logit_sum, **kw))
    calls = _count_fused_calls(monkeypatch)
    fused = _lce_grads(x, w, b, target, **opts)
    assert asked and all(s == (eps > 0) for s in asked), asked
    assert len(calls["stats"]) == math.ceil(v / (cols * widen)), calls
    assert len(calls["grad"]) == math.ceil(v / cols), calls
    ref = _lce_float64(x, w, b, target, **opts)
    for ours, theirs, r in zip(fused, plain, ref):
        assert rel_err(ours, r) <= 2 * rel_err(theirs, r) + 1e-7


@pytest.mark.parametrize("case", ["exact", "bias", "softcap", "smoothing", "kept"])
def test_exact_logits_asked_of_both_sides_alike(monkeypatch, case):
    """Every fused statistics call of a chunk not kept and every fused gradient call
    get exact=True together, and only without bias, softcap or label smoothing (kept chunks' stored logits
    never); otherwise all False. With the ops emulated on the CPU, loss and gradients match float64 as the cuBLAS
    path does."""
    import hugehead.plan

    monkeypatch.setattr(hugehead.plan, "FUSED_STATS_WIDEN", 2)
    n, d, v, cols = (256, 128, 40000, None) if case == "kept" else (37, 16, 1000, 64)
    x, w, b = _inputs(n, v, d, torch.float32, bias=case == "bias", seed=25)
    target = _targets(n, v, 0, v, 25)
    opts = dict(chunk_size=cols, label_smoothing=0.1 if case == "smoothing" else 0.0, z_loss=1e-3)
    if case == "softcap":
        opts["softcap"] = 20.0
    if case == "kept":  # chunks kept in the weight gradient's buffer, the rest recomputed (as the factored test)
        opts["memory_budget"] = n * d * 6 + (1 << 20)
    plain = _lce_grads(x, w, b, target, **opts)
    _emulate_fused_ops(monkeypatch)
    asked = {"stats": [], "stored": [], "grad": []}
    stats_op, grad_op = ops.gemm_chunk_stats_, ops.gemm_chunk_grad_

    def stats(*a, logits=None, exact=False, **kw):
        asked["stored" if logits is not None else "stats"].append(exact)
        return stats_op(*a, logits=logits, exact=exact, **kw)

    def grad(*a, exact=False):
        asked["grad"].append(exact)
        return grad_op(*a, exact=exact)

    monkeypatch.setattr(ops, "gemm_chunk_stats_", stats)
    monkeypatch.setattr(ops, "gemm_chunk_grad_", grad)
    fused = _lce_grads(x, w, b, target, **opts)
    want = case in ("exact", "kept")
    assert asked["stats"] and asked["grad"], asked
    assert all(e == want for e in asked["stats"] + asked["grad"]), asked
    assert not any(asked["stored"]), asked
    if case == "kept":
        assert asked["stored"], asked
    ref = _lce_float64(x, w, b, target, **opts)
    for ours, theirs, r in zip(fused, plain, ref):
        assert rel_err(ours, r) <= 2 * rel_err(theirs, r) + 1e-7


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("case", ["keep_all", "rows_plan"])
def test_stored_logits_branches_with_emulated_ops(monkeypatch, case, eps):
    """Chunks whose logits are kept (all of them here; the rows plan's blocks) go through the
    statistics GEMM with ``logits`` (no softcap), which stores them as it folds them: with emulated fused ops
    (cuBLAS's arithmetic, on the CPU) the loss and gradients are bitwise the cuBLAS path's, one such call
    per kept chunk (and row block), and the logit sums asked for only with label smoothing."""
    import hugehead.plan

    monkeypatch.setattr(hugehead.plan, "FUSED_STATS_WIDEN", 1)
    n, d, v = 96, 16, 296
    x, w, b = _inputs(n, v, d, torch.float32, bias=True, seed=23)
    target = _targets(n, v, 0, v, 23)
    opts = dict(label_smoothing=eps, z_loss=1e-3)
    if case == "rows_plan":
        from conftest import rows_budget

        opts.update(memory_budget=rows_budget(n, d, v, torch.float32, 32))  # 3 blocks
    plain = _lce_grads(x, w, b, target, **opts)
    _emulate_fused_ops(monkeypatch)
    stores = []
    emulated = ops.gemm_chunk_stats_
    monkeypatch.setattr(ops, "gemm_chunk_stats_", lambda *a, with_logit_sum=True, logits=None, **kw: (
        stores.append((logits is not None, with_logit_sum, a[0].shape[0])) or emulated(
            *a, with_logit_sum=with_logit_sum, logits=logits, **kw)))
    fused = _lce_grads(x, w, b, target, **opts)
    for a, r in zip(fused, plain):
        assert torch.equal(a, r)
    kept = [s for s in stores if s[0]]
    assert kept and all(s[1] == (eps > 0) for s in stores), stores
    if case == "keep_all":
        assert [s[2] for s in kept] == [n]
    else:  # every chunk of every block of 32 rows stores its logits
        assert len(kept) == len(stores) and sum(s[2] for s in kept) % n == 0 and max(s[2] for s in kept) == 32
    # softcap: kept logits are stored uncapped, so they take cuBLAS and chunk_stats_; so does a depth from
    # FUSED_STORE_MAX_DEPTH on (where the store costs more than the pass it saves)
    stores.clear()
    _lce_grads(x, w, b, target, softcap=20.0, **opts)
    assert not any(s[0] for s in stores), stores
    monkeypatch.setattr(hugehead.plan, "FUSED_STORE_MAX_DEPTH", d)
    again = _lce_grads(x, w, b, target, **opts)
    assert not any(s[0] for s in stores), stores
    for a, r in zip(again, plain):
        assert torch.equal(a, r)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case", ["plain", "z_loss", "flagged", "far_target", "near_far", "no_ignored", "logits"])
def test_kept_probabilities_factored_backward_with_emulated_ops(monkeypatch, tuned, case, device):
    """bf16 with chunks kept in the weight gradient's buffer and the fused ops emulated on the CPU: the forward
    folds the chunks it does not keep first, then keeps exp(z - ref) of the others (ref: each row's max so far;
    Plan.kept_probs), and the backward takes them without a pass (loop.probs._FactoredKept:
    dW = eᵀ (s x), dX = s (e W), the targets' gradients from the forward's target logits added apart). Loss, dX and dW within 2x the error
    of the same step keeping the logits (_without_kept_probs) against float64, plus bf16's eps, and the rows of
    dW at kept targets (most of dW's norm) within 1.5x that step's error there; "no_ignored": no ignored row, so
    g = 1/256 and the logits path's G_t = round(g (p_t - 1)) is ~exact, where G_t through the GEMMs as
    round(G_t / s) round(s x) erred 2.3x (5.3x at 200000 classes); "flagged": a kept
    class's logit far above the rest on some rows, whose kept values then take that chunk's own max as their
    reference; "far_target": those logits in a later kept chunk than the rows' targets, so the targets' chunks
    have the rows far below their lse (s = 0 there: the targets' gradients go apart, _FactoredKept.finish);
    "near_far": two rows' lse ~61 above the first kept chunk's reference (their max in the last kept chunk) while
    that chunk holds a logit ~55 above it, not flagged (a probability ~e^-6 there, which the backward must keep:
    FACTORED_DROP_GAP), those rows' dX checked on their own; "logits": that step itself, bitwise. On
    "cuda" the fused ops themselves run (an H200)."""
    from hugehead import loop
    from hugehead.lce_op import loss_plan

    _fused_gemms_or_skip(tuned, device)
    tuned(rows=False)
    n, d, v = 256, 128, 40000
    x, w, _ = _inputs(n, v, d, torch.bfloat16, bias=False, seed=41)
    target = _targets(n, v, 0, v, 41)
    if case == "no_ignored":
        target = torch.where(target < 0, torch.arange(n) * 7 + 3, target)
    x, w, target = x.to(device), w.to(device), target.to(device)
    opts = dict(memory_budget=n * d * 6 + (1 << 20), z_loss=1e-3 if case == "z_loss" else 0.0)
    plan = loss_plan(x.requires_grad_(), w.requires_grad_(), target, memory_budget=opts["memory_budget"])
    x, w = x.detach(), w.detach()
    chunks = -(-v // plan.cols)
    assert plan.kept_in_grad >= 2 and plan.kept_chunks < chunks, plan
    if case in ("flagged", "far_target"):  # rows 0 and 3: a kept class's logit 100, ~95 above any other of theirs
        w = w.clone()
        far = case == "far_target"
        for row, cls in ((0, 5), (3, 6)):
            cls += (plan.kept_chunks - 1) * plan.cols if far else 0
            w[cls] = (100 * x[row].float() / x[row].float().square().sum()).to(w.dtype)
        if far:  # their targets in the first two kept chunks, folded before the chunk with that logit
            target = target.clone()
            target[0], target[3] = 7, plan.cols + 9
    near_rows, dropped = (0, 3), None
    if case == "near_far":
        # Rows 0 and 3: a class of the first kept chunk at R + 55.0 and one of the last kept chunk at R + 60.7, R the
        # row's max over the chunks not kept (the first kept chunk's reference): its values reach e^55 < 2^80 (not
        # flagged), the rows' lse lies ~60.7 above that reference, and the first class holds p ~ e^-5.7. That
        # class's weight also has a long part orthogonal to x's rows 0 and 3 (along x's least singular direction,
        # so the other rows' logits stay moderate): dropping its p moves those rows' dX visibly.
        kept_classes = plan.kept_chunks * plan.cols
        xf = x.float()
        top = (xf @ w[kept_classes:].float().t()).max(dim=1).values
        side = torch.linalg.svd(xf, full_matrices=False).Vh[-1]
        basis = torch.linalg.qr(xf[list(near_rows)].t()).Q
        side = side - basis @ (basis.t() @ side)
        w = w.clone()
        for row, cls in zip(near_rows, (5, 6)):
            along = xf[row] / xf[row].square().sum()
            far_cls = cls + (plan.kept_chunks - 1) * plan.cols
            w[far_cls] = ((top[row] + 60.7) * along).to(w.dtype)
            w[cls] = ((top[row] + 55.0) * along + 5 * w[far_cls].float().norm() * side / side.norm()).to(w.dtype)
        z = xf @ w.float().t()
        rows = list(near_rows)
        lse = torch.logsumexp(z[rows].double(), dim=1)
        ref = (xf @ w[kept_classes:].float().t()).max(dim=1).values[rows].double()
        assert ((z[rows, :plan.cols].max(dim=1).values - ref) < 55.2).all()  # below the flag (ln 2^80 = 55.45)
        assert ((lse - ref > 60.4) & (lse - ref < 61.0)).all()  # ~61 above the reference, far inside the drop gap
        p = torch.exp(z[rows, :plan.cols].double() - lse[:, None])  # what dropping the first kept chunk would lose
        dropped = (p @ w[:plan.cols].double()).norm(dim=1) / ((torch.softmax(z[rows].double(), 1)
                                                              @ w.double()) - w[target[rows]].double()).norm(dim=1)
    if device == "cpu":
        _emulate_fused_ops(monkeypatch)
    made = []
    real = loop.streamed._FactoredKept
    monkeypatch.setattr(loop.streamed, "_FactoredKept", lambda *a, **kw: made.append(1) or real(*a, **kw))
    with pytest.MonkeyPatch.context() as logits_only:
        _without_kept_probs(logits_only)
        plain = _lce_grads(x, w, None, target, **opts)
    if case == "logits":
        _without_kept_probs(monkeypatch)
    ours = _lce_grads(x, w, None, target, **opts)
    assert len(made) == (case != "logits"), made
    if case == "logits":
        for a, r in zip(ours, plain):
            assert torch.equal(a, r)
        return
    ref = _lce_float64(x, w, None, target, **opts)
    for what, a, p, r in zip(["loss", "dx", "dw"], ours, plain, ref):
        err, err_plain = rel_err(a, r), rel_err(p, r)
        assert err <= 2 * err_plain + torch.finfo(torch.bfloat16).eps, f"{what}: {err:.3g} vs {err_plain:.3g}"
    # dW's rows at kept targets (the entries G_t ~ -g dominate them), relative to dW's norm
    kept_classes = plan.kept_chunks * plan.cols
    rows = torch.unique(target[(target >= 0) & (target < kept_classes)]).cpu()
    assert rows.numel() >= 8, rows
    dw_ref = ref[2].double()
    err, err_plain = [float((g[2].double().cpu()[rows] - dw_ref[rows]).norm() / dw_ref.norm()) for g in (ours, plain)]
    assert err <= 1.5 * err_plain + 1e-5, f"dW at kept targets: {err:.3g} vs {err_plain:.3g}"
    if case == "near_far":  # those rows' dX on their own, where dropping the first kept chunk would show
        for i, row in enumerate(near_rows):
            err, err_plain = rel_err(ours[1][row], ref[1][row]), rel_err(plain[1][row], ref[1][row])
            assert err <= 2 * err_plain + 1e-3, f"dx[{row}]: {err:.3g} vs {err_plain:.3g}"
            assert dropped[i] > 1.25 * (2 * err_plain + 1e-3), f"the case must be able to fail: {float(dropped[i]):.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_kept_probabilities_plan_keeps_a_chunk_in_the_workspaces_memory(monkeypatch, tuned, device):
    """Where the kept chunks hold probabilities (plan_chunks' kept_probs), the forward stores no logits outside
    them and the backward recomputes the streamed chunks into the kept tensor's memory (loop.kept._spare), so the plan
    keeps one chunk more in the same budget than the streaming rule (which leaves a workspace chunk free) and
    the plan without kept probabilities. Loss, dX and dW within 2x that plan's error against float64 (plus bf16's eps),
    the streamed chunks' workspace taken from the kept tensor, and on "cuda" (the fused ops themselves) the step's
    peak memory beyond its inputs and gradients within the budget."""
    from hugehead import loop
    from hugehead.lce_op import loss_plan
    from hugehead.plan import _MAX_COLS

    _fused_gemms_or_skip(tuned, device)
    tuned(rows=False)
    cols = _MAX_COLS[device]
    n, d = (256, 128) if device == "cuda" else (64, 32)
    v = 4 * cols + 123  # five chunks
    budget = n * d * 6 + int(2.5 * n * cols * 2)  # the dX buffers and two and a half chunks
    x, w, _ = _inputs(n, v, d, torch.bfloat16, bias=False, seed=23)
    target = _targets(n, v, 0, v, 23)
    x, w, target = x.to(device), w.to(device), target.to(device)
    if device == "cpu":
        _emulate_fused_ops(monkeypatch)
    opts = dict(memory_budget=budget, z_loss=1e-3)

    def plan_now():
        return loss_plan(x.clone().requires_grad_(), w.clone().requires_grad_(), target, memory_budget=budget)

    plan = plan_now()
    chunks = -(-v // plan.cols)
    assert plan.cols == cols and plan.kept_in_grad >= 1 and plan.kept_chunks < chunks, plan
    streaming = plan_chunks(n, d, v, torch.bfloat16, torch.device(device), None, budget, direct_dx=True,
                            side_stream=False, grad_store=True)
    assert plan.kept_chunks - plan.kept_in_grad == 2 and plan.kept_chunks == streaming.kept_chunks + 1, (plan,
                                                                                                         streaming)
    spares, made = [], []
    real_spare, real_factored = loop.kept._spare, loop.streamed._FactoredKept
    for where in (loop.streamed, loop.probs):  # the backward's workspace, the targets' temporaries
        monkeypatch.setattr(where, "_spare", lambda kept, numel: spares.append(
            (numel, real_spare(kept, numel) is not None)) or real_spare(kept, numel))
    monkeypatch.setattr(loop.streamed, "_FactoredKept",
                        lambda *a, **kw: made.append(real_factored(*a, **kw)) or made[-1])
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = hugehead.linear_cross_entropy(xl, wl, target, **opts)
    loss.backward()
    ours = [loss.detach(), xl.grad, wl.grad]
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - xl.grad.nbytes - wl.grad.nbytes
        assert peak <= budget, (peak, budget)
    assert (n * cols, True) in spares, spares  # the streamed chunks' workspace: the kept tensor's memory
    # The rows whose target is not kept add their zeros to dW at classes of their own (index_put_ sums a class's
    # rows one after another), the others at their targets.
    kept_classes = plan.kept_chunks * plan.cols
    inside = (target >= 0) & (target < kept_classes)
    cls = made[0].apart_cls
    assert 0 < int(inside.sum()) < n and torch.equal(cls[inside], target[inside]), cls
    assert cls[~inside].unique().numel() == int((~inside).sum()) and int(cls.max()) < kept_classes, cls
    _without_kept_probs(monkeypatch)
    assert plan_now().kept_chunks == streaming.kept_chunks
    plain = _lce_grads(x, w, None, target, **opts)
    ref = _lce_float64(x, w, None, target, **opts)
    for what, a, p, r in zip(["loss", "dx", "dw"], ours, plain, ref):
        err, err_plain = rel_err(a, r), rel_err(p, r)
        assert err <= 2 * err_plain + torch.finfo(torch.bfloat16).eps, f"{what}: {err:.3g} vs {err_plain:.3g}"


def test_kept_logits_put_rows_writes_one_entry_a_row_in_either_storage():
    """KeptLogits.put_rows (the factored backward's one scatter of the targets' entries): entry (i, col[i]) of
    kept chunk chunk[i] gets values[i] where asked, in the weight gradient's buffer's slots and in the kept
    tensor alike, and nothing else of either changes (the store's bytes outside the slots included)."""
    from hugehead.loop.kept import KeptLogits
    from hugehead.plan import Plan

    n, d, v, cols, kept_chunks, in_grad = 16, 8, 256, 32, 5, 3
    plan = Plan(rows=n, cols=cols, keep_logits=True, kept_chunks=kept_chunks, kept_in_grad=in_grad)
    gen = torch.Generator().manual_seed(5)
    store = torch.randn(v, d, generator=gen).to(torch.bfloat16)
    kept = torch.randn(kept_chunks - in_grad, n, cols, generator=gen).to(torch.bfloat16)
    slots = KeptLogits(plan, kept, store, n)
    expect = [slots.chunk(i, cols).clone() for i in range(kept_chunks)]
    chunk = torch.randint(0, kept_chunks, (n,), generator=gen)
    col = torch.randint(0, cols, (n,), generator=gen)
    where = torch.rand(n, generator=gen) < 0.7
    values = torch.randn(n, generator=gen)
    for r in range(n):
        if where[r]:
            expect[int(chunk[r])][r, int(col[r])] = values[r].to(torch.bfloat16)
    outside = store.clone().view(-1).view(torch.uint8)
    slots.put_rows(chunk, col, where, values)
    assert where.any() and (~where).any()
    for i in range(kept_chunks):
        assert torch.equal(slots.chunk(i, cols), expect[i]), i
    # the store's bytes that no slot covers are as they were
    raw, offset, stride = slots.slots
    covered = torch.zeros(raw.numel(), dtype=torch.bool)
    for i in range(in_grad):
        covered[offset + i * stride: offset + i * stride + n * cols * 2] = True
    assert torch.equal(raw[~covered], outside[~covered])


@pytest.mark.parametrize("budget", ["default", "rows", "keep_all"])
def test_loop_fused_branches_with_emulated_ops(monkeypatch, budget):
    """The loop's fused branches (forward and backward, row blocks, kept chunks) give bitwise the cuBLAS
    path's results when the fused ops compute what cuBLAS + our kernels do; they run on the CPU here. (At the
    plan's width: the widened forward chunks fold in another order, test_fused_forward_takes_wider_chunks.)"""
    import hugehead.plan

    monkeypatch.setattr(hugehead.plan, "FUSED_STATS_WIDEN", 1)
    n, d, v, cols = 37, 16, 300, 64
    x, w, b = _inputs(n, v, d, torch.float32, bias=True, seed=21)
    target = _targets(n, v, 0, v, 21)
    opts = dict(chunk_size=cols, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)
    if budget == "rows":  # rows split into blocks of 8
        opts["memory_budget"] = 8 * (cols * 4 + d * (4 + 4))
    elif budget == "keep_all":  # the planner keeps all logits as one chunk: nothing is recomputed
        opts["chunk_size"] = None
    plan = plan_chunks(n, d, v, torch.float32, x.device, opts["chunk_size"], opts.get("memory_budget"))
    assert (budget == "rows") == (plan.rows < n) and (budget == "keep_all") == plan.keep_logits
    plain = _lce_grads(x, w, b, target, **opts)
    _emulate_fused_ops(monkeypatch)
    calls = _count_fused_calls(monkeypatch)
    fused = _lce_grads(x, w, b, target, **opts)
    for a, r in zip(fused, plain):
        assert torch.equal(a, r)
    kept = plan.kept_chunks if plan.keep_logits else 0
    blocks = math.ceil(n / plan.rows)
    expected = (math.ceil(v / plan.cols) - kept) * blocks
    assert len(calls["stats"]) == expected, (plan, calls)
    assert len(calls["grad"]) == expected, (plan, calls)
