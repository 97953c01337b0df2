"""Streaming top-k: the chunk_topk_ op, hugehead.linear_topk and ChunkedClassifier.topk against a float64
reference with the documented order (value descending, NaN largest, -0 == +0, ties to the lower class id),
on rows built to stress it: many exact ties, runs of ties across chunk boundaries, NaN, +-inf, rising rows
(every chunk floods the running top-k), k from 1 to 1024 and up to V. CPU here, the same tests on CUDA
(skipped without a GPU). Also opcheck, torch.compile, autocast, input validation."""
import math

import numpy as np
import pytest
import torch

import hugehead
from hugehead import ops
from hugehead.topk import CUDA_MAX_K, merge_topk, topk_state

from conftest import DEVICES, requires_cuda

ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def reference_topk(z: torch.Tensor, k: int):
    """Top ``k`` of ``z [N, V]`` by (value descending, NaN first, -0 == +0, lower column first), in float64
    on the CPU, by two stable sorts (independent of the kernels)."""
    z = z.detach().double().cpu()
    nan = torch.isnan(z)
    key = torch.where(nan, torch.full_like(z, math.inf), z + 0.0)  # + 0.0 turns -0 into +0
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(nan.gather(1, order).to(torch.int8), dim=1, descending=True,
                                       stable=True).indices)
    return z.gather(1, order)[:, :k], order[:, :k]


def assert_topk_equal(values, indices, z, k):
    ref_values, ref_indices = reference_topk(z, k)
    assert indices.dtype == torch.int64
    assert torch.equal(indices.cpu(), ref_indices), (indices.cpu(), ref_indices)
    assert torch.equal(values.cpu().double().nan_to_num(7e300), ref_values.nan_to_num(7e300))


def hard_rows(n: int, v: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of kinds that stress the order and the kernel's paths, cycled over ``n`` rows: small integers
    (long tie runs), all equal, rising (each chunk beats the last), falling, NaN / +-inf / -0 sprinkled,
    every value NaN, every value -inf, random normal."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        kind = i % 8
        if kind == 0:
            r = torch.randint(-3, 4, (v,), generator=g).double()
        elif kind == 1:
            r = torch.full((v,), 2.0, dtype=torch.float64)
        elif kind == 2:
            r = torch.arange(v, dtype=torch.float64) // 3  # rising, ties in threes
        elif kind == 3:
            r = -torch.arange(v, dtype=torch.float64) // 5
        elif kind == 4:
            r = torch.randint(-2, 3, (v,), generator=g).double()
            r[torch.randint(0, v, (max(1, v // 10),), generator=g)] = math.nan
            r[torch.randint(0, v, (max(1, v // 10),), generator=g)] = math.inf
            r[torch.randint(0, v, (max(1, v // 10),), generator=g)] = -math.inf
            r[torch.randint(0, v, (max(1, v // 7),), generator=g)] = -0.0
        elif kind == 5:
            r = torch.full((v,), math.nan, dtype=torch.float64)
        elif kind == 6:
            r = torch.full((v,), -math.inf, dtype=torch.float64)
            r[v // 2] = -1e4
        else:
            r = torch.randn(v, generator=g, dtype=torch.float64)
        rows.append(r)
    return torch.stack(rows).to(dtype)


def fold(z: torch.Tensor, k: int, chunk: int, softcap: float = 0.0):
    """Run chunk_topk_ over ``z``'s columns in chunks of ``chunk``."""
    values, indices = topk_state(z.shape[0], k, z.dtype, z.device)
    for c0 in range(0, z.shape[1], chunk):
        ops.chunk_topk_(z[:, c0:c0 + chunk], None, c0, softcap, values, indices)
    return values, indices


# --------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------
# (rows, V, k, chunk): k of 1/5/100/1024 on chunks narrower and wider than the CUDA kernel's candidate
# buffer (1024 slots; 2048 for k = 1024), k above the chunk width, k = V, k > V (the row keeps empty slots).
OP_CASES = {
    "k1": (16, 3000, 1, 700),
    "k5-one-wide-chunk": (16, 5000, 5, 5000),
    "k5-many-chunks": (16, 4000, 5, 333),
    "k100": (16, 6000, 100, 1500),
    "k100-narrow": (16, 1000, 100, 37),
    "k1024": (8, 9000, 1024, 4096),
    "k1024-narrow": (8, 3000, 1024, 500),
    "k=V": (16, 300, 300, 64),
    "k>V": (8, 50, 64, 16),
}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES.keys())
def test_op_matches_reference(device, case, dtype):
    n, v, k, chunk = case
    z = hard_rows(n, v, dtype).to(device)
    values, indices = fold(z, k, chunk)
    kept = min(k, v)
    assert_topk_equal(values[:, :kept], indices[:, :kept], z, kept)
    assert (indices[:, kept:] == -1).all()


def test_op_random_chunk_boundaries(device):
    # Chunk boundaries fall anywhere inside the tie runs of integer rows.
    g = torch.Generator().manual_seed(5)
    for trial in range(6):
        n, v = 12, int(torch.randint(200, 3000, (1,), generator=g))
        k = int(torch.randint(1, 300, (1,), generator=g))
        z = torch.randint(-4, 5, (n, v), generator=g).float().to(device)
        values, indices = topk_state(n, k, z.dtype, z.device)
        c0 = 0
        while c0 < v:
            c1 = min(v, c0 + int(torch.randint(1, 900, (1,), generator=g)))
            ops.chunk_topk_(z[:, c0:c1], None, c0, 0.0, values, indices)
            c0 = c1
        kept = min(k, v)
        assert_topk_equal(values[:, :kept], indices[:, :kept], z, kept)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_op_bias(device, dtype):
    # The bias is added in the accumulation dtype and rounded once: the reference ranks the same sums.
    z = hard_rows(16, 2000, dtype, seed=9).to(device)
    b = torch.randint(-3, 4, (2000,)).to(dtype).to(device)
    values, indices = topk_state(16, 40, dtype, device)
    for c0 in range(0, 2000, 300):
        ops.chunk_topk_(z[:, c0:c0 + 300], b[c0:c0 + 300], c0, 0.0, values, indices)
    acc = ops.acc_dtype(dtype)
    assert_topk_equal(values, indices, (z.to(acc) + b.to(acc)).to(dtype), 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_op_softcap(device, dtype):
    # Distinct integers stay distinct after a softcap of 20 (|z| <= 30): the order is that of z, ties exact.
    g = torch.Generator().manual_seed(3)
    z = torch.randint(-30, 31, (24, 2500), generator=g).to(dtype).to(device)
    z[3, ::5] = math.nan
    values, indices = fold(z, 50, 600, softcap=20.0)
    ref_values, ref_indices = reference_topk(z, 50)
    assert torch.equal(indices.cpu(), ref_indices)
    capped = 20.0 * torch.tanh(ref_values / 20.0)
    torch.testing.assert_close(values.cpu().double(), capped, rtol=1e-6, atol=0, equal_nan=True)


def test_op_strided_and_offset_chunks(device):
    # A column block of a wider tensor (row stride > C, a misaligned start: the kernel's scalar head)
    # and class_start offsets.
    z = hard_rows(10, 1203, torch.bfloat16, seed=4).to(device)
    values, indices = topk_state(10, 20, z.dtype, z.device)
    for c0 in range(0, 1203, 401):
        ops.chunk_topk_(z[:, c0:c0 + 401], None, 1000 + c0, 0.0, values, indices)
    ref_values, ref_indices = reference_topk(z, 20)
    assert torch.equal(indices.cpu() - 1000, ref_indices)
    transposed = z[:, :300].t().contiguous().t()  # column stride != 1: the op reads a contiguous copy
    values, indices = topk_state(10, 7, z.dtype, z.device)
    ops.chunk_topk_(transposed, None, 0, 0.0, values, indices)
    assert_topk_equal(values, indices, z[:, :300], 7)


def test_op_rejects_bad_arguments():
    z = torch.randn(4, 10)
    values, indices = topk_state(4, 3, torch.float32, z.device)
    with pytest.raises(RuntimeError, match="values must be Float like the logits, got Double"):
        ops.chunk_topk_(z, None, 0, 0.0, values.double(), indices)
    with pytest.raises(RuntimeError, match="indices must be int64"):
        ops.chunk_topk_(z, None, 0, 0.0, values, indices.int())
    with pytest.raises(RuntimeError, match=r"values must have shape \[4, k >= 1\]"):
        ops.chunk_topk_(z, None, 0, 0.0, values[:3], indices[:3])
    with pytest.raises(RuntimeError, match="indices must have the shape of values"):
        ops.chunk_topk_(z, None, 0, 0.0, values, indices[:, :2])
    with pytest.raises(RuntimeError, match="class_start must be >= 0"):
        ops.chunk_topk_(z, None, -1, 0.0, values, indices)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.chunk_topk_(z, None, 0, 0.0, torch.empty(3, 4).t(), torch.empty(3, 4, dtype=torch.long).t())
    with pytest.raises(RuntimeError, match=r"bias must have shape \[10\]"):
        ops.chunk_topk_(z, torch.zeros(9), 0, 0.0, values, indices)
    with pytest.raises(RuntimeError, match="bias must be Float like the logits"):
        ops.chunk_topk_(z, torch.zeros(10, dtype=torch.float64), 0, 0.0, values, indices)


def sample_inputs_chunk_topk(device):
    """Argument lists for chunk_topk_: every dtype, softcap, fresh and half-filled states, empty chunks."""
    torch.manual_seed(2)
    for dtype in ALL_DTYPES:
        for softcap, class_start in ((0.0, 0), (5.0, 40)):
            z = torch.randn(9, 33, device=device, dtype=dtype)
            bias = torch.randn(33, device=device, dtype=dtype) if softcap else None
            yield [z, bias, class_start, softcap, *topk_state(9, 4, dtype, device)]
    values, indices = fold(torch.randn(5, 30, device=device), 8, 30)
    yield [torch.randn(5, 17, device=device), None, 30, 0.0, values, indices]
    yield [torch.randn(0, 7, device=device), None, 0, 0.0, *topk_state(0, 3, torch.float32, device)]


@pytest.mark.parametrize("args", list(sample_inputs_chunk_topk("cpu")), ids=lambda _: "")
def test_opcheck_chunk_topk_cpu(args):
    torch.library.opcheck(torch.ops.hugehead.chunk_topk_.default, args)


@requires_cuda
def test_opcheck_chunk_topk_cuda():
    for args in sample_inputs_chunk_topk("cuda"):
        torch.library.opcheck(torch.ops.hugehead.chunk_topk_.default, args)


# --------------------------------------------------------------------------------------------------
# linear_topk
# --------------------------------------------------------------------------------------------------
def integer_problem(n, d, v, dtype, device, seed=0, bias=True):
    """Small-integer x, W, b: every logit is exact in every dtype (|z| <= 2 * 2 * d + 3 <= 256), so the
    reference order is exact, with many ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, d), generator=g).to(dtype)
    w = torch.randint(-2, 3, (v, d), generator=g).to(dtype)
    b = torch.randint(-3, 4, (v,), generator=g).to(dtype) if bias else None
    z = x.double() @ w.double().t() + (0 if b is None else b.double())
    return x.to(device), w.to(device), (None if b is None else b.to(device)), z


LINEAR_CASES = {
    "k5-chunks": (37, 16, 3000, 5, dict(chunk_size=256)),
    "k100-planned": (37, 16, 3000, 100, {}),
    "k1024": (9, 8, 4000, 1024, dict(chunk_size=1500)),
    "k=V": (20, 8, 300, 300, dict(chunk_size=128)),
    "row-blocks": (64, 16, 2000, 10, dict(memory_budget=64 * 300 * 4)),
    "k1-no-bias": (30, 16, 5000, 1, dict(chunk_size=999, bias=False)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", LINEAR_CASES.values(), ids=LINEAR_CASES.keys())
def test_linear_topk_matches_reference(device, case, dtype):
    n, d, v, k, opts = case
    opts = dict(opts)
    x, w, b, z = integer_problem(n, d, v, dtype, device, bias=opts.pop("bias", True))
    values, indices = hugehead.linear_topk(x, w, k, b, **opts)
    assert values.dtype == dtype and values.device == x.device and values.shape == (n, k)
    assert_topk_equal(values, indices, z, k)


def test_linear_topk_softcap(device):
    x, w, b, z = integer_problem(40, 4, 1000, torch.float32, device)
    values, indices = hugehead.linear_topk(x, w, 30, b, softcap=15.0, chunk_size=300)
    ref_values, ref_indices = reference_topk(z, 30)
    assert torch.equal(indices.cpu(), ref_indices)
    torch.testing.assert_close(values.cpu().double(), 15.0 * torch.tanh(ref_values / 15.0), rtol=1e-6, atol=0)


def test_linear_topk_under_autocast(device):
    # float32 weights, bf16 compute: the values come back in bf16, exact on integer logits.
    x, w, b, z = integer_problem(33, 16, 2500, torch.float32, device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        values, indices = hugehead.linear_topk(x, w, 12, b, chunk_size=700)
    assert values.dtype == torch.bfloat16
    assert_topk_equal(values, indices, z, 12)


def test_linear_topk_compiles_fullgraph(device):
    x, w, b, z = integer_problem(20, 8, 1500, torch.float32, device)
    compiled = torch.compile(lambda x_, w_, b_: hugehead.linear_topk(x_, w_, 9, b_, chunk_size=400),
                             fullgraph=True, backend="aot_eager")
    values, indices = compiled(x, w, b)
    assert_topk_equal(values, indices, z, 9)


def test_opcheck_linear_topk(device):
    x, w, b, _ = integer_problem(6, 4, 50, torch.float32, device)
    for args in ([x, w, b, 5, 0.0, 16, 0], [x, w, None, 50, 3.0, 0, 0], [x[:0], w, b, 3, 0.0, 0, 0]):
        torch.library.opcheck(torch.ops.hugehead.linear_topk.default, args)


def test_linear_topk_rejects_bad_input():
    x, w, b, _ = integer_problem(5, 4, 30, torch.float32, "cpu")
    for k, err, match in ((-1, ValueError, r"k must be in \[0, num_classes=30\], got -1"), (31, ValueError, "got 31"),
                          (2.0, TypeError, "k must be an int, got float"), (True, TypeError, "k must be an int"),
                          (torch.tensor(3), TypeError, "k must be an int")):
        with pytest.raises(err, match=match):
            hugehead.linear_topk(x, w, k, b)
    assert hugehead.linear_topk(x, w, np.int64(3), b)[1].shape == (5, 3)  # any integral k
    with pytest.raises(ValueError, match=r"x must be \[N, D\]"):
        hugehead.linear_topk(x[0], w, 3)
    with pytest.raises(ValueError, match=r"weight must be \[V, D=x.shape\[1\]=4\]"):
        hugehead.linear_topk(x, w[:, :3], 3)
    with pytest.raises(ValueError, match=r"bias must be \[V\]=\[30\]"):
        hugehead.linear_topk(x, w, 3, b[:4])
    with pytest.raises(TypeError, match="weight dtype torch.float64 differs from x dtype torch.float32"):
        hugehead.linear_topk(x, w.double(), 3)
    with pytest.raises(TypeError, match="x must be float16, bfloat16, float32 or float64, got torch.int64"):
        hugehead.linear_topk(x.long(), w.long(), 3)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        hugehead.linear_topk(x, w.to("meta"), 3)
    with pytest.raises(ValueError, match="softcap must be a finite positive number"):
        hugehead.linear_topk(x, w, 3, softcap=0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        hugehead.linear_topk(x, w, 3, chunk_size=0)
    with pytest.raises(TypeError, match="x and weight must be tensors"):
        hugehead.linear_topk(x.numpy(), w, 3)


@requires_cuda
def test_cuda_k_limit_is_a_clear_error():
    x, w, b, _ = integer_problem(4, 4, CUDA_MAX_K + 10, torch.float32, "cuda")
    with pytest.raises(ValueError, match=f"k must be at most {CUDA_MAX_K} on CUDA"):
        hugehead.linear_topk(x, w, CUDA_MAX_K + 1, b)
    values, indices = hugehead.linear_topk(x, w, CUDA_MAX_K, b)
    assert indices.shape == (4, CUDA_MAX_K)


@requires_cuda
def test_cuda_no_n_by_v_tensor():
    # 2048 x 200k float32 logits would be 1.6 GB; a 64 MiB budget bounds the workspace.
    x, w, b, _ = integer_problem(2048, 16, 200_000, torch.float32, "cuda", bias=False)
    hugehead.linear_topk(x, w[:20_000], 100, memory_budget=64 << 20)  # cuBLAS's workspace, before the baseline
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    values, indices = hugehead.linear_topk(x, w, 100, memory_budget=64 << 20)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= (64 << 20) + 2 * values.numel() * 12
    z = x[:64].double() @ w.double().t()
    assert_topk_equal(values[:64], indices[:64], z, 100)


@requires_cuda
def test_cuda_64bit_offsets():
    # rows x row stride past 2^31 elements (4.3 GB of bf16): the last rows' entries must be right.
    n, c = (1 << 16) + 8, 1 << 15
    z = torch.zeros(n, c, dtype=torch.bfloat16, device="cuda")
    z[-3:, 12345] = 5.0
    z[-3:, 777] = 5.0
    values, indices = topk_state(n, 3, z.dtype, z.device)
    ops.chunk_topk_(z, None, 0, 0.0, values, indices)
    assert indices[-3:].tolist() == [[777, 12345, 0]] * 3
    assert indices[0].tolist() == [0, 1, 2]


# --------------------------------------------------------------------------------------------------
# The module's top-k in every placement available here; the merge across shards
# --------------------------------------------------------------------------------------------------
def test_merge_topk_by_candidates():
    # Three shards (one of a single class) folded on their own, then merged by their candidates.
    z = hard_rows(16, 90, torch.float32, seed=7)
    parts = []
    for a, b in ((0, 30), (30, 31), (31, 90)):
        values, indices = topk_state(16, min(10, b - a), z.dtype, z.device)
        for c0 in range(a, b, 7):
            ops.chunk_topk_(z[:, c0:min(b, c0 + 7)], None, c0, 0.0, values, indices)
        parts.append((values, indices))
    values, indices = merge_topk(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), 10)
    assert_topk_equal(values, indices, z, 10)


def _head(sizes, device, dtype=torch.float64, **kw):
    head = hugehead.ChunkedClassifier(8, sum(sizes), devices=[device] * len(sizes), shard_sizes=sizes,
                                      dtype=dtype, **kw)
    x, w, b, z = integer_problem(30, 8, sum(sizes), dtype, "cpu", seed=11)
    head.load_state_dict({"weight": w, "bias": b})
    return head, x.to(device), z


@pytest.mark.parametrize("sizes,k", [([700, 5, 1300], 5), ([600, 600, 800], 100), ([1200, 900], 1024),
                                     ([3, 4], 7)])
def test_module_topk_several_shards(device, sizes, k):
    head, x, z = _head(sizes, device, chunk_size=256)
    values, indices = head.topk(x, k)
    assert_topk_equal(values, indices, z, k)


@pytest.mark.parametrize("softcap", [None, 6.0])
def test_module_topk_of_one_shard_compiles_fullgraph(device, softcap):
    """One shard beside x: the registered op in the graph, the same answer as a head of two shards (the
    engines' path) and the float64 reference."""
    head, x, z = _head([2000], device, chunk_size=300, softcap=softcap)
    compiled = torch.compile(lambda x_: head.topk(x_, 17), fullgraph=True, backend="aot_eager")
    values, indices = compiled(x)
    two, _, _ = _head([900, 1100], device, chunk_size=300, softcap=softcap)
    two_values, two_indices = two.topk(x, 17)
    assert torch.equal(indices, two_indices) and torch.equal(values, two_values)
    if softcap is None:
        assert_topk_equal(values, indices, z, 17)
    else:
        capped = softcap * torch.tanh(z / softcap)
        assert torch.allclose(values.cpu(), capped.gather(1, indices.cpu()), rtol=0, atol=1e-12)
        assert torch.equal(values.cpu(), values.cpu().sort(dim=1, descending=True).values)
        assert torch.all(values.cpu()[:, -1:] >= capped.topk(17).values[:, -1:] - 1e-12)


@pytest.mark.parametrize("sizes", [[40], [15, 25]])
def test_module_topk_and_linear_topk_agree_on_k_zero(device, sizes):
    head, x, _ = _head(sizes, device)
    values, indices = head.topk(x, 0)
    w, b = torch.cat([s.weight for s in head.shards]).to(device), torch.cat([s.bias for s in head.shards]).to(device)
    ref_values, ref_indices = hugehead.linear_topk(x, w, 0, b)
    for got, ref in ((values, ref_values), (indices, ref_indices)):
        assert got.shape == ref.shape == (30, 0) and got.dtype == ref.dtype and got.device == ref.device


def test_module_topk_under_autocast_and_compile(device):
    head, x, z = _head([1000, 1000], device, dtype=torch.float32, chunk_size=300)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        values, indices = head.topk(x, 20)
    assert values.dtype == torch.bfloat16
    assert_topk_equal(values, indices, z, 20)
    values, indices = torch.compile(lambda x_: head.topk(x_, 20), backend="aot_eager")(x)
    assert_topk_equal(values, indices, z, 20)
