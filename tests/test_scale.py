"""hugehead::scale_ (self *= a 0-d device tensor, in place): bit for bit the product in float32 (float64 for
float64 self) with the whole scale, rounded once — CPU ATen's ``self.mul_(scale)`` — for every floating dtype,
odd sizes, views that start mid-pack and strided views (only the view written); within rounding of a float64
reference; opcheck; its argument checks (raised before anything is written); on CUDA the same bits, no host
synchronization, and the backwards of the rows plan and of the fused one-vs-all loss going through it."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hugehead
from conftest import DEVICES, rel_err, requires_cuda, rows_budget
from hugehead import ops
from hugehead import plan as planner
from hugehead.plan import plan_loss

ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SIZES = [1, 7, 1000003]
SCALES = [1 / 3, -0.37, 2.0**-20 * 3.1, 1.0]  # not representable in 16 bits (but the last)


def _values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values spread over many binades (small and large magnitudes, signs, zeros)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-12, 12, (n,), generator=g))
    v[::97] = 0.0
    return v.to(dtype)


def _expected(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The op's arithmetic written with plain PyTorch: the product in float32 (float64 for float64 x) of
    x and the scale, the scale rounded to that dtype first, then rounded once to x's dtype."""
    op = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(op) * scale.to(op)).to(x.dtype)


# (name, base shape, view): every layout the op takes: dense ones go to the kernel (contiguous, starting
# mid-pack, transposed), the others (gaps between elements) to the fallback.
VIEWS = [
    ("contiguous", (1000003,), lambda t: t),
    ("from element 1", (1000003,), lambda t: t[1:]),
    ("from element 3, length 8k + 5", (8 * 1000 + 9,), lambda t: t[3:3 + 8 * 1000 + 5]),
    ("transposed", (301, 7), lambda t: t.t()),
    ("every other row", (40, 33), lambda t: t[::2]),
    ("column slice", (50, 29), lambda t: t[:, 3:20]),
    ("0-d", (), lambda t: t),
]


def _scale_view(device, dtype, shape, view, scale_value, scale_dtype=torch.float32, op=ops.scale_):
    """(the whole base after ``op(view(base), scale)``, the base before): so writes outside the view show."""
    base = _values(int(torch.Size(shape).numel()), dtype, seed=len(shape)).reshape(shape).to(device)
    before = base.clone()
    scale = torch.tensor(scale_value, dtype=scale_dtype, device=device)
    op(view(base), scale)
    return base, before, scale


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale_value", SCALES)
def test_cpu_bitwise_equal_to_mul_(dtype, n, scale_value):
    x = _values(n, dtype)
    scale = torch.tensor(scale_value, dtype=torch.float32)
    ours = ops.scale_(x.clone(), scale)
    assert torch.equal(ours, x.clone().mul_(scale))
    assert torch.equal(ours, _expected(x, scale))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("name,shape,view", VIEWS, ids=[v[0] for v in VIEWS])
def test_cpu_views_bitwise_equal_to_mul_(dtype, name, shape, view):
    ours, before, scale = _scale_view("cpu", dtype, shape, view, 1 / 3)
    theirs, _, _ = _scale_view("cpu", dtype, shape, view, 1 / 3, op=lambda t, s: t.mul_(s))
    assert torch.equal(ours, theirs)
    expected = before.clone()
    view(expected).copy_(_expected(view(before), scale))
    assert torch.equal(ours, expected)  # the view scaled, everything beside it untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float64])
def test_within_rounding_of_float64(device, dtype, scale_dtype):
    x = _values(100_003, dtype).to(device)
    scale = torch.tensor(-0.123456789123, dtype=scale_dtype, device=device)
    ours = ops.scale_(x.clone(), scale).double().cpu()
    ref = x.double().cpu() * float(scale)
    eps = torch.finfo(dtype).eps
    # One rounding to x's dtype (half an ulp), plus the float32 product's and, for a float64 scale on a
    # float32-or-narrower x, the scale's rounding to float32.
    slack = 0.0 if (dtype == torch.float64 and scale_dtype == torch.float64) else 2 * torch.finfo(torch.float32).eps
    tiny = torch.finfo(dtype).tiny * eps  # the subnormal spacing
    assert ((ours - ref).abs() <= (eps / 2 + slack) * ref.abs() + tiny).all()
    assert rel_err(ours, ref) <= eps / 2


@pytest.mark.parametrize("device", DEVICES)
def test_float64_scale_on_16bit_is_rounded_to_float32_first(device):
    x = _values(4099, torch.bfloat16).to(device)
    s64 = torch.tensor(1 + 2.0**-30, dtype=torch.float64, device=device)  # 1 as float32
    assert torch.equal(ops.scale_(x.clone(), s64), x)
    if device == "cpu":
        assert torch.equal(x.clone().mul_(s64), x)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_propagate(device):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, 3e38], device=device)
    for dtype in ALL_DTYPES:
        t = x.to(dtype)
        for s in (2.0, -0.0, float("inf"), float("nan"), 1.0):
            scale = torch.tensor(s, device=device)
            torch.testing.assert_close(ops.scale_(t.clone(), scale), _expected(t, scale), rtol=0, atol=0,
                                       equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_returns_self_and_one_element_scale_shapes(device):
    x = _values(33, torch.float32).to(device).reshape(3, 11)
    for shape in ((), (1,), (1, 1)):
        y = x.clone()
        scale = torch.full(shape, 0.75, device=device)
        assert ops.scale_(y, scale) is y
        assert torch.equal(y, _expected(x, scale.reshape(())))
    empty = torch.empty(0, 5, device=device)
    ops.scale_(empty, torch.tensor(2.0, device=device))
    assert empty.shape == (0, 5)


# --------------------------------------------------------------------------------------------------
# Argument checks: raised before anything is written
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise_before_writing(device):
    x = _values(10, torch.float32).to(device)
    before = x.clone()
    cases = [
        (x, torch.tensor([1.0, 2.0], device=device), "0-d"),
        (x, torch.ones(0, device=device), "0-d"),
        (x, torch.tensor(2, device=device), "float32 or float64"),
        (x, torch.tensor(2.0, dtype=torch.bfloat16, device=device), "float32 or float64"),
        (x, torch.tensor(2.0, dtype=torch.float16, device=device), "float32 or float64"),
        (torch.arange(4, device=device), torch.tensor(2.0, device=device), "float16, bfloat16, float32 or float64"),
        (torch.ones(4, dtype=torch.int32, device=device), torch.tensor(2.0, device=device), "float32 or float64 self"),
        (torch.ones(4, dtype=torch.bool, device=device), torch.tensor(2.0, device=device), "got Bool"),
        (torch.ones(4, dtype=torch.complex64, device=device), torch.tensor(2.0, device=device), "got ComplexFloat"),
        (torch.ones(1, device=device).expand(5), torch.tensor(2.0, device=device), "share memory"),
        (x, x[3], "must not share memory with self"),
    ]
    for self_, scale, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.scale_(self_, scale)
    assert torch.equal(x, before)


@requires_cuda
def test_cuda_scale_on_another_device_raises():
    x = torch.ones(8, device="cuda")
    with pytest.raises(RuntimeError, match="scale is on cpu but self is on cuda"):
        ops.scale_(x, torch.tensor(2.0))
    with pytest.raises(RuntimeError, match="scale is on cuda:0 but self is on cpu"):
        ops.scale_(torch.ones(8), torch.tensor(2.0, device="cuda"))
    assert torch.equal(x, torch.ones(8, device="cuda"))


# --------------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------------
def sample_inputs_scale(device):
    for dtype in ALL_DTYPES:
        for n in (1, 7, 1000):
            yield [_values(n, dtype).to(device), torch.tensor(0.3, device=device)]
        yield [_values(40 * 33, dtype).to(device).reshape(40, 33)[::2, 1:], torch.tensor(-2.5, device=device)]
        yield [_values(31, dtype).to(device)[1:], torch.tensor(0.7, dtype=torch.float64, device=device)]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in sample_inputs_scale(device):
        torch.library.opcheck(torch.ops.hugehead.scale_.default, args)


def test_fake_kernel_checks_the_scale():
    x = torch.empty(4, 4, device="meta", dtype=torch.bfloat16)
    ops.scale_(x, torch.empty((), device="meta"))
    with pytest.raises(RuntimeError, match="one element"):
        ops.scale_(x, torch.empty(2, device="meta"))


# --------------------------------------------------------------------------------------------------
# CUDA: the vectorized kernel
# --------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 17, 255, 4096 * 8 + 3, 1000003, 4 * 2**20 + 1])
def test_cuda_bitwise_equal_to_the_float32_product(dtype, n):
    x = _values(n, dtype).cuda()
    for s in SCALES:
        scale = torch.tensor(s, device="cuda")
        ours = ops.scale_(x.clone(), scale)
        assert torch.equal(ours, _expected(x, scale))
        assert torch.equal(ours.cpu(), ops.scale_(x.cpu(), scale.cpu()))  # CPU and CUDA agree


@requires_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("name,shape,view", VIEWS, ids=[v[0] for v in VIEWS])
def test_cuda_views_bitwise_and_nothing_outside_written(dtype, name, shape, view):
    for offset in range(8) if name == "from element 1" else (0,):
        def view_at(t, offset=offset):
            return view(t)[offset:] if t.dim() else t
        ours, before, scale = _scale_view("cuda", dtype, shape, view_at, -0.37)
        expected = before.clone()
        view_at(expected).copy_(_expected(view_at(before), scale))
        assert torch.equal(ours, expected), (name, offset)


@requires_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_cuda_bitwise_equal_to_mul_where_mul_takes_the_whole_scale(dtype):
    # CUDA's mul_ rounds a float32 0-d scale to a 16-bit self's dtype before the product: with a scale
    # that rounding leaves alone (1, powers of two: GradScaler's), and for float32/float64 self with any
    # scale, the two agree bit for bit.
    x = _values(1000003, dtype).cuda()
    # (2**16 is beyond float16's range: mul_ rounds it to inf first, scale_ does not)
    scales = (1.0, 0.5, -2.0, 1024.0, 2.0**-14) if dtype in (torch.bfloat16, torch.float16) else SCALES
    for s in scales:
        scale = torch.tensor(s, device="cuda")
        assert torch.equal(ops.scale_(x.clone(), scale), x.clone().mul_(scale))
        assert torch.equal(ops.scale_(x[1:-2].clone(), scale), x[1:-2].clone().mul_(scale))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_16bit_closer_to_float64_than_mul_(dtype):
    x = _values(1000003, dtype).cuda()
    scale = torch.tensor(1 / 3, device="cuda")
    ref = x.double() * float(scale)
    err_ours = (ops.scale_(x.clone(), scale).double() - ref).abs().sum()
    err_mul = (x.clone().mul_(scale).double() - ref).abs().sum()
    assert err_ours < err_mul


@requires_cuda
def test_cuda_no_host_sync_and_the_current_stream():
    x = _values(1 << 22, torch.bfloat16).cuda()
    expected = _expected(x, torch.tensor(0.3, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Queued behind a long kernel on the side stream: a launch on another stream would read x first.
        scale = torch.full((), 0.3, device="cuda")
        y = x.clone()
        torch.cuda._sleep(50_000_000)
        torch.cuda.set_sync_debug_mode("error")
        try:
            ops.scale_(y, scale)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y, expected)


@requires_cuda
def test_cuda_more_than_2_31_elements():
    n = 2**31 + 37
    if torch.cuda.mem_get_info()[0] < 3 * n * 2:
        pytest.skip("needs ~13 GB of free GPU memory")
    x = torch.full((n,), 1.5, dtype=torch.bfloat16, device="cuda")
    x[-5:] = 3.0
    ops.scale_(x, torch.tensor(-2.0, device="cuda"))
    assert bool((x[:-5] == -3.0).all()) and bool((x[-5:] == -6.0).all())


# --------------------------------------------------------------------------------------------------
# The backwards that scale the gradients their forward made go through scale_
# --------------------------------------------------------------------------------------------------
class _CountScale(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.hugehead.scale_.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_plan_backward_scales_through_scale_(device, dtype, monkeypatch):
    if device == "cuda":  # the tests' few rows get the rows plan on a GPU too (as in test_rows.py)
        monkeypatch.setitem(planner.ROWS_MIN_SPLIT_ROWS, "cuda", planner.ROWS_MIN_SPLIT_ROWS["cpu"])
    n, d, v = 96, 16, 45
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / d**0.5
    b, target = torch.randn(v, generator=g) * 0.1, torch.randint(0, v, (n,), generator=g)
    budget = rows_budget(n, d, v, dtype, 32)
    assert plan_loss(n, d, v, dtype, torch.device(device), None, budget, allow_rows=True, direct_dx=True).kind == "rows"
    xs, ws, bs = (_leaf(t.to(device, dtype)) for t in (x, w, b))
    counter = _CountScale()
    loss = hugehead.linear_cross_entropy(xs, ws, target.to(device), bs, memory_budget=budget)
    with counter:
        (loss * -0.37).backward()
    assert counter.calls == 3  # dX, dW, db
    xr, wr, br = (_leaf(t.to(dtype).double()) for t in (x, w, b))
    (torch.nn.functional.cross_entropy(xr @ wr.t() + br, target) * -0.37).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for ours, ref in ((xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
        assert ours.dtype == dtype and rel_err(ours, ref) <= tol


@pytest.mark.parametrize("device", DEVICES)
def test_fused_binary_cross_entropy_backward_scales_through_scale_(device):
    n, d, v = 24, 8, 30
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / d**0.5, torch.randn(v, generator=g)
    dense = (torch.rand(n, v, generator=g) < 0.1).double() * torch.rand(n, v, generator=g, dtype=torch.float64)
    xs, ws, bs = (_leaf(t.to(device)) for t in (x, w, b))
    counter = _CountScale()
    loss = hugehead.linear_binary_cross_entropy(xs, ws, dense.float().to_sparse_csr().to(device), bs)
    with counter:
        (loss * 1.7).backward()
    assert counter.calls == 3
    xr, wr, br = (_leaf(t.double()) for t in (x, w, b))
    (torch.nn.functional.binary_cross_entropy_with_logits(xr @ wr.t() + br, dense) * 1.7).backward()
    for ours, ref in ((xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
        assert rel_err(ours, ref) <= 1e-5


def test_bench_scale_smoke_writes_its_report(tmp_path):
    import json

    from bench import bench_scale

    assert bench_scale.main(["--cpu-smoke", "--reps", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["tiny", "tiny fp32"] and doc["meta"]["smoke"]
    assert all(r["scale__ms"] > 0 and r["mul__ms"] > 0 for r in doc["rows"])
    assert (tmp_path / "scale.md").read_text().startswith("# In-place scaling")


# --------------------------------------------------------------------------------------------------
# hugehead::row_scale (out = x * scale[:, None], the factored backward's s x)
# --------------------------------------------------------------------------------------------------
def _row_case(device, dtype, rows, cols, seed=0):
    x = _values(rows * cols, dtype, seed=seed).reshape(rows, cols).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = (torch.randn(rows, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-10, 1, (rows,), generator=g))).to(acc).to(device)  # float16 stays finite
    scale[::5] = 0.0
    return x, scale


# (name, x view, out view) over bases [rows, cols + 40]: packed rows, rows starting mid-pack, odd widths, x
# transposed (a column stride: ATen's fallback), in place.
ROW_LAYOUTS = [
    ("contiguous", lambda b: b[:, :-40], lambda b: b[:, :-40]),
    ("column slices from 8", lambda b: b[:, 8:-32], lambda b: b[:, 8:-32]),
    ("column slices from 3, odd width", lambda b: b[:, 3:-38], lambda b: b[:, 3:-38]),
    ("x mid-pack, out packed", lambda b: b[:, 1:-39], lambda b: b[:, :-40]),
    ("every other row", lambda b: b[::2, :-40], lambda b: b[::2, :-40]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("name", [r[0] for r in ROW_LAYOUTS])
@pytest.mark.parametrize("rows, cols", [(1, 8), (7, 1), (33, 768), (130, 1003)])
def test_row_scale_bitwise_equal_to_torch_mul_and_writes_only_out(device, dtype, name, rows, cols):
    """``ops.row_scale(out, x, s)`` is ``torch.mul(x, s[:, None], out=out)`` bit for bit on the same device (the
    product in the accumulation dtype, rounded once), within half an ulp of the float64 product, and writes
    nothing of out's base outside out."""
    _, x_view, out_view = next(r for r in ROW_LAYOUTS if r[0] == name)
    x_base, scale = _row_case(device, dtype, 2 * rows if name == "every other row" else rows, cols + 40)
    scale = scale[::2] if name == "every other row" else scale
    x = x_view(x_base)
    out_base = torch.full((x_base.shape[0], cols + 40), 7.0, dtype=dtype, device=device)
    out = out_view(out_base)
    assert out.shape == x.shape
    before = out_base.clone()
    assert ops.row_scale(out, x, scale) is out
    ref = torch.empty_like(out)
    torch.mul(x, scale[:, None], out=ref)
    assert torch.equal(out, ref)
    exact = x.double() * scale.double()[:, None]
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool(((out.double() - exact).abs() <= ulp).all())
    mask = torch.ones_like(out_base, dtype=torch.bool)
    out_view(mask).fill_(False)
    assert torch.equal(out_base[mask], before[mask])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_scale_in_place_and_transposed_x(device, dtype):
    """In place (out is x) and a transposed x (column stride 1000: the fallback through ATen), the same bits as
    torch.mul."""
    x, scale = _row_case(device, dtype, 64, 1000, seed=3)
    ref = torch.mul(x, scale[:, None])
    y = x.clone()
    ops.row_scale(y, y, scale)
    assert torch.equal(y, ref.to(dtype))
    xt = x.t().contiguous().t()  # [64, 1000] with strides (1, 64)
    out = torch.empty_like(x)
    ops.row_scale(out, xt, scale)
    assert torch.equal(out, ref.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_row_scale_bad_arguments_raise_before_writing(device):
    x, scale = _row_case(device, torch.bfloat16, 6, 16)
    out = torch.zeros_like(x)
    cases = [
        (out, x, scale.double(), "must be Float for BFloat16"),
        (out, x, scale[:5], r"shape \[6\]"),
        (out, x, scale[:, None], r"shape \[6\]"),
        (out.float(), x, scale, "out must be BFloat16"),
        (out[:, :8], x, scale, "shaped like x"),
        (torch.zeros(6, 16, dtype=torch.int32, device=device), x.to(torch.int32), scale, "float16, bfloat16"),
        (x[:, 1:9], x[:, :8], scale, "overlaps x without being x"),
        (torch.zeros(1, 16, dtype=torch.bfloat16, device=device).expand(6, 16), x, scale, "share memory"),
    ]
    for args in cases:
        *ops_args, message = args
        before = [a.clone() for a in ops_args]
        with pytest.raises(RuntimeError, match=message):
            ops.row_scale(*ops_args)
        for a, b in zip(ops_args, before):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_row_scale_opcheck(device):
    for dtype in ALL_DTYPES:
        x, scale = _row_case(device, dtype, 9, 40)
        torch.library.opcheck(torch.ops.hugehead.row_scale.default, [torch.empty_like(x), x, scale])
        torch.library.opcheck(torch.ops.hugehead.row_scale.default, [torch.empty_like(x[:, 3:]), x[:, 3:], scale])
