"""hugehead.ChunkedClassifier against float64 plain PyTorch on the concatenated (logical) weight: loss and
every shard's gradients over shard layouts, reductions and options; optimizer steps; initialization;
streaming top-k and log_prob; placement-independent state dicts and safetensors files; input errors.
CPU shards everywhere (devices may repeat); CUDA and multi-GPU variants skip without the hardware."""

import math

import pytest
import torch
from torch import nn

import hugehead
from hugehead import reference

from conftest import NUM_GPUS, host_syncs_of_step, rel_err, requires_cuda, requires_multigpu

D, V = 8, 37
LAYOUTS = [[37], [10, 27], [5, 20, 12]]
REDUCTIONS = ["mean", "sum", "none"]
OPTIONS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=0.05),
    "softcap": dict(softcap=2.0),
    "all_rows_split": dict(ignore_index=7, label_smoothing=0.2, z_loss=0.01, softcap=3.0, memory_budget=1500),
}
LOSS_OPTIONS = ("ignore_index", "label_smoothing", "z_loss", "softcap")


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------
def make_head(sizes, *, dtype=torch.float64, bias=True, devices=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("chunk_size", 4)  # several chunks per shard, ragged last chunk
    return hugehead.ChunkedClassifier(
        D, sum(sizes), bias, devices=devices or ["cpu"] * len(sizes), shard_sizes=sizes, dtype=dtype, **kwargs
    )


def logical(head, name="weight"):
    """The logical ``[V, D]`` weight (or ``[V]`` bias) as a float64 CPU leaf that requires grad."""
    parts = [getattr(s, name) for s in head.shards]
    if parts[0] is None:
        return None
    return torch.cat([p.detach().double().cpu() for p in parts]).requires_grad_()


def inputs(n=13, *, dtype=torch.float64, ignore_index=-100, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    target[::5] = ignore_index
    target[1] = 7  # the class ignored under ignore_index=7
    return x, target


def loss_options(opts):
    return {k: v for k, v in opts.items() if k in LOSS_OPTIONS}


# --------------------------------------------------------------------------------------------------
# Loss and gradients
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "x".join(map(str, s)))
def test_loss_and_grads_match_reference(sizes, reduction, opts):
    head = make_head(sizes, reduction=reduction, **opts)
    x, target = inputs(ignore_index=opts.get("ignore_index", -100))
    x_ref, w_ref, b_ref = x.clone().requires_grad_(), logical(head), logical(head, "bias")
    x.requires_grad_()

    loss = head(x, target)
    ref = reference.linear_cross_entropy(x_ref, w_ref, target, b_ref, reduction=reduction, **loss_options(opts))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)

    grad_out = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    (loss * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    for shard in head.shards:
        torch.testing.assert_close(shard.weight.grad, w_ref.grad[shard.start:shard.stop], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(shard.bias.grad, b_ref.grad[shard.start:shard.stop], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sizes", [[37], [20, 17]], ids=lambda s: "x".join(map(str, s)))
def test_without_bias_and_int32_targets(sizes):
    head = make_head(sizes, bias=False, chunk_size=None, softcap=5.0)
    x, target = inputs()
    x_ref, w_ref = x.clone().requires_grad_(), logical(head)
    x.requires_grad_()
    loss = head(x, target.int())
    ref = reference.linear_cross_entropy(x_ref, w_ref, target, softcap=5.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([s.weight.grad for s in head.shards]), w_ref.grad, rtol=1e-10, atol=1e-12)
    assert all(s.bias is None for s in head.shards)


def test_only_weights_or_only_x_need_grad():
    head = make_head([5, 20, 12])
    x, target = inputs()
    head.shards[1].weight.requires_grad_(False)
    head.shards[2].bias.requires_grad_(False)
    head(x, target).backward()  # x needs no grad
    assert head.shards[1].weight.grad is None and head.shards[2].bias.grad is None
    assert head.shards[1].bias.grad is not None and head.shards[0].weight.grad is not None

    head.requires_grad_(False)
    x.requires_grad_()
    x_ref, w_ref, b_ref = x.detach().clone().requires_grad_(), logical(head), logical(head, "bias")
    head(x, target).backward()
    reference.linear_cross_entropy(x_ref, w_ref, target, b_ref).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)


def test_all_rows_ignored_and_empty_batch_follow_cross_entropy():
    head = make_head([10, 27])
    x, _ = inputs()
    assert torch.isnan(head(x, torch.full((13,), -100)))  # mean over no rows, as F.cross_entropy
    head.reduction = "sum"
    empty = torch.zeros(0, D, dtype=torch.float64, requires_grad=True)
    loss = head(empty, torch.zeros(0, dtype=torch.int64))
    loss.backward()
    assert loss.item() == 0.0 and empty.grad.shape == (0, D)
    assert all(torch.equal(s.weight.grad, torch.zeros_like(s.weight)) for s in head.shards)


def test_bf16_error_within_twice_plain_pytorch():
    n, d, v = 96, 64, 600
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(d, v, devices=["cpu"] * 3, shard_sizes=[100, 350, 150],
                                      dtype=torch.bfloat16, chunk_size=64, z_loss=1e-3, label_smoothing=0.1)
    opts = dict(z_loss=1e-3, label_smoothing=0.1)
    x = torch.randn(n, d, dtype=torch.bfloat16)
    target = torch.randint(0, v, (n,))
    w, b = (torch.cat([getattr(s, p).detach() for s in head.shards]) for p in ("weight", "bias"))

    def run(fn, *tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    def plain_loss(x_, w_, b_):
        return reference.linear_cross_entropy(x_, w_, target, b_, **opts)

    exact = run(plain_loss, x.double(), w.double(), b.double())
    plain = run(plain_loss, x, w, b)
    x_leaf = x.clone().requires_grad_()
    loss = head(x_leaf, target)
    loss.backward()
    ours = [loss.detach(), x_leaf.grad, torch.cat([s.weight.grad for s in head.shards]),
            torch.cat([s.bias.grad for s in head.shards])]
    for name, a, p, e in zip(["loss", "x", "weight", "bias"], ours, plain, exact):
        assert a.dtype == (torch.float32 if name == "loss" else torch.bfloat16), name
        # 2x plain bf16's error, with a floor of bf16's half-ulp (plain bf16 can be exact by luck).
        assert rel_err(a, e) <= 2 * rel_err(p, e), (name, rel_err(a, e), rel_err(p, e))


@pytest.mark.parametrize("sizes", [[37], [5, 20, 12]], ids=lambda s: "x".join(map(str, s)))
def test_sgd_step_matches_reference(sizes):
    head = make_head(sizes, label_smoothing=0.1)
    w_ref, b_ref = logical(head), logical(head, "bias")
    opt = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9)
    opt_ref = torch.optim.SGD([w_ref, b_ref], lr=0.5, momentum=0.9)
    for step in range(3):
        x, target = inputs(seed=step)
        opt.zero_grad()
        head(x, target).backward()
        opt.step()
        opt_ref.zero_grad()
        reference.linear_cross_entropy(x, w_ref, target, b_ref, label_smoothing=0.1).backward()
        opt_ref.step()
    torch.testing.assert_close(logical(head), w_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logical(head, "bias"), b_ref, rtol=1e-10, atol=1e-12)


def test_parameters_are_the_shards():
    head = make_head([5, 20, 12])
    expected = [p for s in head.shards for p in (s.weight, s.bias)]
    assert {id(p) for p in head.parameters()} == {id(p) for p in expected}
    assert len(list(head.parameters())) == 6
    for shard, size, start in zip(head.shards, [5, 20, 12], [0, 5, 25]):
        assert (shard.start, shard.stop, shard.device) == (start, start + size, torch.device("cpu"))
        assert shard.weight.shape == (size, D) and shard.bias.shape == (size,)
    assert head.shard_sizes == (5, 20, 12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_init_is_placement_independent_with_nn_linear_distribution(dtype):
    heads = []
    for sizes in ([300], [1, 150, 149], [100, 100, 100]):
        torch.manual_seed(3)
        heads.append(hugehead.ChunkedClassifier(D, 300, devices=["cpu"] * len(sizes), shard_sizes=sizes, dtype=dtype))
    logical_w = [torch.cat([s.weight.detach() for s in h.shards]) for h in heads]
    logical_b = [torch.cat([s.bias.detach() for s in h.shards]) for h in heads]
    for w, b in zip(logical_w[1:], logical_b[1:]):
        assert torch.equal(w, logical_w[0]) and torch.equal(b, logical_b[0])
    # nn.Linear's distribution: uniform in [-1/sqrt(D), 1/sqrt(D)) for weight and bias, independent draws.
    bound = 1 / math.sqrt(D)
    w = logical_w[0].double()
    assert w.abs().max() <= bound and w.min() < -0.95 * bound and w.max() > 0.95 * bound
    assert abs(w.mean().item()) < 0.02 * bound
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.03 * bound
    assert not torch.equal(logical_b[0], logical_w[0][:, 0])
    # Another seed, other weights; the same seed again, the same weights.
    torch.manual_seed(4)
    assert not torch.equal(torch.cat([s.weight for s in hugehead.ChunkedClassifier(D, 300, dtype=dtype,
                                                                                  devices=["cpu"]).shards]), logical_w[0])


def test_default_split_balances_classes():
    head = hugehead.ChunkedClassifier(D, 11, devices=["cpu"] * 3, dtype=torch.float64)
    assert head.shard_sizes == (4, 4, 3)
    assert head.dtype == torch.float64
    if not torch.cuda.is_available():
        assert [s.device for s in hugehead.ChunkedClassifier(D, 11).shards] == [torch.device("cpu")]


def test_extra_repr_shows_layout():
    text = repr(make_head([5, 20, 12], softcap=2.0))
    assert "in_features=8, num_classes=37" in text
    assert "shards=[cpu [0, 5), cpu [5, 25), cpu [25, 37)]" in text
    assert "softcap=2.0" in text


# --------------------------------------------------------------------------------------------------
# Inference: top-k and log_prob
# --------------------------------------------------------------------------------------------------
def integer_head(sizes, bias, chunk_size, device="cpu"):
    """A head whose logits are exact small integers with ties at every top-k boundary: its weight rows
    are copies of three distinct rows, spread over all shards."""
    v = sum(sizes)
    head = make_head(sizes, bias=bias, chunk_size=chunk_size, devices=[device] * len(sizes))
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-2, 3, (3, D), generator=g).double()[torch.randint(0, 3, (v,), generator=g)]
    state = {"weight": w}
    if bias:
        state["bias"] = torch.randint(-1, 2, (v,), generator=g).double()
    head.load_state_dict(state)
    x = torch.randint(-1, 2, (64, D), generator=g).double()
    return head, x, w, state.get("bias")


TIE_CASES = {  # sizes, chunk_size, k, bias: chunks wider than k, so the selection inside a chunk matters
    "1shard-k1": ([37], 16, 1, True),
    "2shards-k5": ([10, 27], 16, 5, False),
    "3shards-k5": ([5, 20, 12], None, 5, True),
    "3shards-kV": ([5, 20, 12], 16, 37, True),
    "wide-k10": ([150, 350, 100], 64, 10, True),
    "wide-k40": ([150, 350, 100], None, 40, False),
}


def check_topk_ties(sizes, chunk_size, k, bias, device="cpu"):
    head, x, w, b = integer_head(sizes, bias, chunk_size, device)
    z = reference.logits(x, w, b)
    order = torch.sort(z, dim=1, descending=True, stable=True)
    values, indices = head.topk(x.to(device), k)
    assert torch.equal(indices.cpu(), order.indices[:, :k])
    assert torch.equal(values.cpu(), order.values[:, :k])
    assert indices.dtype == torch.int64 and values.dtype == torch.float64


@pytest.mark.parametrize("case", TIE_CASES.values(), ids=TIE_CASES.keys())
def test_topk_matches_stable_sort_with_ties(case):
    check_topk_ties(*case)


@pytest.mark.parametrize("memory_budget", [None, 300])
def test_topk_with_softcap(memory_budget):
    head = make_head([5, 20, 12], softcap=1.5, chunk_size=None, memory_budget=memory_budget)
    x, _ = inputs(n=9)
    z = reference.logits(x, logical(head).detach(), logical(head, "bias").detach(), softcap=1.5)
    ref_values, ref_indices = torch.sort(z, dim=1, descending=True, stable=True)
    values, indices = head.topk(x, k=7)
    assert torch.equal(indices, ref_indices[:, :7])
    torch.testing.assert_close(values, ref_values[:, :7], rtol=1e-14, atol=1e-14)
    assert head.topk(x, k=0)[0].shape == (9, 0)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_log_prob_matches_log_softmax(softcap):
    head = make_head([5, 20, 12], softcap=softcap, label_smoothing=0.3)  # smoothing does not enter
    x, _ = inputs()
    target = torch.randint(0, V, (13,))
    z = reference.logits(x, logical(head).detach(), logical(head, "bias").detach(), softcap=softcap)
    expected = torch.log_softmax(z, dim=1).gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(head.log_prob(x, target), expected, rtol=1e-12, atol=1e-12)
    ignored = head.log_prob(x, torch.where(torch.arange(13) == 2, -100, target))  # the head's ignore_index
    assert ignored[2].item() == 0.0
    torch.testing.assert_close(ignored[torch.arange(13) != 2], expected[torch.arange(13) != 2], rtol=1e-12,
                               atol=1e-12)
    with pytest.raises(ValueError, match=r"target 37 at row 0"):
        head.log_prob(x, torch.full((13,), V))


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------
def test_state_dict_is_logical():
    head = make_head([5, 20, 12])
    state = head.state_dict()
    assert list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], logical(head)) and torch.equal(state["bias"], logical(head, "bias"))
    one = make_head([37])
    assert one.state_dict()["weight"].data_ptr() == one.shards[0].weight.data_ptr()  # one shard: no copy
    nested = nn.ModuleDict({"head": head})
    assert list(nested.state_dict()) == ["head.weight", "head.bias"]


@pytest.mark.parametrize(
    "src,dst", [([37], [5, 20, 12]), ([5, 20, 12], [37]), ([5, 20, 12], [30, 7]), ([10, 27], [18, 1, 18])]
)
def test_state_dict_round_trip_across_placements(src, dst):
    a = make_head(src, seed=1)
    b = make_head(dst, seed=2)
    assert not torch.equal(logical(a), logical(b))
    b.load_state_dict(a.state_dict(), strict=True)
    assert torch.equal(logical(a), logical(b)) and torch.equal(logical(a, "bias"), logical(b, "bias"))
    x, target = inputs()
    assert torch.equal(a(x, target), a(x, target))
    torch.testing.assert_close(b(x, target), a(x, target), rtol=1e-13, atol=1e-13)
    # nested, with a prefix, and back into a third layout
    c = nn.ModuleDict({"head": make_head([37], seed=3)})
    c.load_state_dict(nn.ModuleDict({"head": b}).state_dict())
    assert torch.equal(logical(c["head"]), logical(a))


def test_load_state_dict_assign_keeps_placement():
    a, b = make_head([37], seed=1), make_head([5, 20, 12], seed=2)
    b.load_state_dict(a.state_dict(), assign=True)
    assert torch.equal(logical(b), logical(a))
    storages = {s.weight.untyped_storage().data_ptr() for s in b.shards}
    assert len(storages) == 3  # not views of one logical tensor
    assert all(isinstance(s.weight, nn.Parameter) and s.weight.shape == (s.stop - s.start, D) for s in b.shards)


def test_load_state_dict_errors_name_logical_keys():
    head = make_head([5, 20, 12])
    state = make_head([37]).state_dict()
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"bias\"\."):
        head.load_state_dict({"weight": state["weight"]})
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .*\(36, 8\)"):
        head.load_state_dict({"weight": state["weight"][:36], "bias": state["bias"]})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"bias\""):
        make_head([30, 7], bias=False).load_state_dict(state)
    no_bias = make_head([30, 7], bias=False)
    no_bias.load_state_dict(state, strict=False)
    assert torch.equal(logical(no_bias), state["weight"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_safetensors_round_trip_across_placements(tmp_path, dtype):
    from safetensors import safe_open
    from safetensors.torch import save_file

    a = make_head([5, 20, 12], dtype=dtype, seed=1)
    path = str(tmp_path / "head.safetensors")
    a.save_safetensors(path)
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == ["bias.0", "bias.1", "bias.2", "weight.0", "weight.1", "weight.2"]
        assert f.metadata()["hugehead.class_ranges"] == "[[0, 5], [5, 25], [25, 37]]"
    for sizes in ([37], [30, 7], [1, 35, 1]):
        b = make_head(sizes, dtype=dtype, seed=2)
        b.load_safetensors(path)
        assert torch.equal(logical(b), logical(a)) and torch.equal(logical(b, "bias"), logical(a, "bias"))
    # a plain logical file (e.g. a state dict) loads too
    plain = str(tmp_path / "plain.safetensors")
    save_file(make_head([37], dtype=dtype, seed=4).state_dict(), plain)
    b.load_safetensors(plain)
    assert torch.equal(logical(b), logical(make_head([37], dtype=dtype, seed=4)))


def test_safetensors_errors(tmp_path):
    path = str(tmp_path / "head.safetensors")
    make_head([5, 20, 12]).save_safetensors(path)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"weight.0 has shape \[5, 8\], but the head has in_features=9"):
        hugehead.ChunkedClassifier(9, 37, devices=["cpu"], dtype=torch.float64).load_safetensors(path)
    with pytest.raises(ValueError, match=r"holds 37 classes but the head has num_classes=36"):
        hugehead.ChunkedClassifier(D, 36, devices=["cpu"], dtype=torch.float64).load_safetensors(path)
    no_bias = make_head([37], bias=False)
    with pytest.raises(ValueError, match=r"has bias but the head has no bias"):
        no_bias.load_safetensors(path)
    no_bias.load_safetensors(path, strict=False)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    head = make_head([5, 20, 12])
    x, target = inputs()
    with pytest.raises(ValueError, match=r"x has D=5 features but the head has in_features=8"):
        head(x[:, :5], target)
    with pytest.raises(ValueError, match=r"target 37 at row 4 is out of range for 37 classes"):
        head(x, torch.where(torch.arange(13) == 4, V, target))
    with pytest.raises(ValueError, match=r"target -3 at row 0"):
        head(x, torch.full((13,), -3))
    with pytest.raises(TypeError, match=r"x is torch.float32 but the head's parameters are torch.float64"):
        head(x.float(), target)
    with pytest.raises(ValueError, match=r"x is on meta"):
        head(x.to("meta"), target.to("meta"))
    with pytest.raises(ValueError, match=r"target is on meta but x is on cpu"):
        head(x, target.to("meta"))
    with pytest.raises(ValueError, match=r"target must be \[N\] = \[13\]"):
        head(x, target[:5])
    with pytest.raises(TypeError, match=r"target must be int64 or int32"):
        head(x, target.float())
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, num_classes=37\]"):
        head.topk(x, k=38)
    head.reduction = "average"
    with pytest.raises(ValueError, match=r"unknown reduction 'average'"):
        head(x, target)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(devices=["tpu"]), ValueError, r"devices entry 'tpu'"),
        (dict(devices=[]), ValueError, r"non-empty list"),
        (dict(devices=["cpu", "meta"]), ValueError, r"'cpu' or 'cuda', not 'meta'"),
        (dict(devices=["cpu"] * 2, shard_sizes=[30, 6]), ValueError, r"sum to 36, not num_classes=37"),
        (dict(devices=["cpu"] * 2, shard_sizes=[38, -1]), ValueError, r"positive integers"),
        (dict(devices=["cpu"] * 2, shard_sizes=[37, 0]), ValueError, r"positive integers"),
        (dict(devices=["cpu"] * 2, shard_sizes=[37]), ValueError, r"1 entries but devices has 2"),
        (dict(devices=["cpu"] * 38), ValueError, r"37 classes cannot fill 38 shards"),
        (dict(offload=True, devices=["cpu"]), ValueError, r"offload=True .*(not available|CUDA device, but)"),
        (dict(process_group=object()), RuntimeError, r"process_group= needs torch.distributed initialized"),
        (dict(softcap=float("inf")), ValueError, r"softcap must be a finite positive number"),
        (dict(dtype=torch.int32), TypeError, r"dtype must be one of"),
        (dict(chunk_size=0), ValueError, r"chunk_size must be >= 1"),
    ],
)
def test_bad_construction_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        hugehead.ChunkedClassifier(D, V, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_raises():
    with pytest.raises(ValueError, match=r"asks for CUDA, which is not available"):
        hugehead.ChunkedClassifier(D, V, devices=["cpu", "cuda:0"])


# --------------------------------------------------------------------------------------------------
# CUDA: one GPU, several GPUs, GPUs mixed with the CPU
# --------------------------------------------------------------------------------------------------
def normalized(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_placement(devices, sizes, x_device, **opts):
    """Loss, every gradient, top-k and log_prob of a head on ``devices`` against float64 on the CPU."""
    head = make_head(sizes, devices=devices, chunk_size=None, **opts)
    x, target = inputs(n=33)
    x_ref, w_ref, b_ref = x.clone().requires_grad_(), logical(head), logical(head, "bias")
    xd = x.to(x_device).requires_grad_()
    loss = head(xd, target.to(x_device))
    assert loss.device == normalized(x_device)
    ref = reference.linear_cross_entropy(x_ref, w_ref, target, b_ref, **loss_options(opts))
    torch.testing.assert_close(loss.cpu(), ref, rtol=1e-10, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(xd.grad.cpu(), x_ref.grad, rtol=1e-9, atol=1e-12)
    for shard, device in zip(head.shards, devices):
        assert shard.weight.grad.device == shard.weight.device == normalized(device)
        torch.testing.assert_close(shard.weight.grad.cpu(), w_ref.grad[shard.start:shard.stop], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(shard.bias.grad.cpu(), b_ref.grad[shard.start:shard.stop], rtol=1e-9, atol=1e-12)
    z = reference.logits(x, w_ref.detach(), b_ref.detach(), opts.get("softcap"))
    values, indices = head.topk(x.to(x_device), k=4)
    assert torch.equal(indices.cpu(), torch.sort(z, dim=1, descending=True, stable=True).indices[:, :4])
    valid = torch.randint(0, V, (33,))
    torch.testing.assert_close(
        head.log_prob(x.to(x_device), valid.to(x_device)).cpu(),
        torch.log_softmax(z, 1).gather(1, valid[:, None]).squeeze(1), rtol=1e-10, atol=1e-12,
    )
    return head


def test_placement_check_on_cpu_shards():
    """The check the CUDA tests below run, on CPU shards (so it is exercised everywhere)."""
    check_placement(["cpu"] * 3, [5, 20, 12], "cpu", z_loss=1e-3, softcap=4.0)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("x_device", ["cuda", "cpu"])
def test_cuda_single_device(x_device):
    head = check_placement(["cuda"], [37], x_device, label_smoothing=0.1, softcap=3.0)
    state = head.state_dict()
    assert state["weight"].device.type == "cuda"
    back = make_head([5, 20, 12])
    back.load_state_dict(state)
    assert torch.equal(logical(back), logical(head))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", TIE_CASES.values(), ids=TIE_CASES.keys())
def test_cuda_topk_ties(case):
    check_topk_ties(*case, device="cuda")


@requires_cuda
@pytest.mark.cuda
def test_cuda_backward_has_no_host_sync():
    head = make_head([20, 17], devices=["cuda", "cuda"], chunk_size=None, dtype=torch.float32)
    x = torch.randn(64, D, device="cuda", requires_grad=True)
    target = torch.randint(0, V, (64,), device="cuda")
    forward_syncs, syncs = host_syncs_of_step(lambda: head(x, target))  # check_targets: the step's one sync
    assert forward_syncs <= 1 and len(syncs) == forward_syncs, syncs


@requires_multigpu
@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("x_device", ["cuda:1", "cuda:0", "cpu"])
def test_multigpu_shards(x_device, tmp_path):
    devices = ["cuda:0", "cuda:1", "cuda:0"] if NUM_GPUS < 3 else ["cuda:0", "cuda:1", "cuda:2"]
    head = check_placement(devices, [5, 20, 12], x_device, z_loss=1e-3, softcap=4.0)
    path = str(tmp_path / "head.safetensors")
    head.save_safetensors(path)
    back = make_head([30, 7], devices=["cuda:1", "cuda:0"], seed=9)
    back.load_safetensors(path)
    assert torch.equal(logical(back), logical(head))
    back.load_state_dict(make_head([37], seed=10).state_dict())
    assert torch.equal(logical(back), logical(make_head([37], seed=10)))


@requires_multigpu
@pytest.mark.cuda
@pytest.mark.multigpu
def test_multigpu_mixed_with_cpu_shard():
    check_placement(["cuda:1", "cpu", "cuda:0"], [10, 15, 12], "cuda:0", label_smoothing=0.2)


def test_explicit_placement_is_pinned_under_module_to():
    # Lightning and plain training loops call model.to(device) on the whole model: an explicitly placed
    # head must keep its shards where they are (only dtype casts apply); an unplaced head moves.
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(6, 11, devices=["cpu", "cpu"], dtype=torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), head)
    before = [s.weight.detach().clone() for s in head.shards]
    model.to("meta")
    assert model[0].weight.device.type == "meta"
    assert [s.weight.device.type for s in head.shards] == ["cpu", "cpu"]
    model.to(torch.float64)
    assert head.dtype == torch.float64
    for s, w in zip(head.shards, before):
        assert s.weight.device.type == "cpu"
        torch.testing.assert_close(s.weight, w.double(), rtol=0, atol=0)
    free = hugehead.ChunkedClassifier(6, 11, devices=None, dtype=torch.float32)
    free.to("meta")
    assert free.shards[0].weight.device.type == "meta"


# --------------------------------------------------------------------------------------------------
# The local engine's ordering (issue 8): every device's inputs first, then the GPU shards' chunk loops
# one chunk each in turn, then the CPU shards. Checked on the CPU with two shards dressed as GPUs: the
# engine is asked where each shard computes, and the copies and loop steps are logged.
# --------------------------------------------------------------------------------------------------
class _FakeGpuEngine(hugehead.engines.LocalEngine):
    """Shards 0 and 1 "compute on" fake GPUs (their tensors stay on the CPU); shard 2 on the CPU."""

    def compute_device(self, shard):
        index = {0: 0, 20: 1}.get(shard.start)
        return torch.device("cpu") if index is None else _FakeDevice(index)


class _FakeDevice:
    type = "fakegpu"

    def __init__(self, index):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, _FakeDevice) and other.index == self.index

    def __hash__(self):
        return hash(("fakegpu", self.index))

    def __repr__(self):
        return f"fakegpu:{self.index}"


@pytest.mark.parametrize("phase", ["forward", "backward", "topk"])
def test_local_engine_queues_every_input_before_any_loop_and_interleaves_gpu_loops(monkeypatch, phase):
    from hugehead.engines import local
    from hugehead import loop, topk

    events = []
    real_to = local._to

    def logging_to(t, device):
        if isinstance(device, _FakeDevice):
            events.append(("copy", repr(device)))
            return t
        return real_to(t, device)

    def logged(steps_fn):
        def wrapper(x, source, *args, **kwargs):
            name = f"shard@{source.weight.shape[0]}"
            gen = steps_fn(x, source, *args, **kwargs)
            try:
                while True:
                    next(gen)
                    events.append(("step", name))
                    yield
            except StopIteration as done:
                return done.value
        return wrapper

    monkeypatch.setattr(local, "_to", logging_to)
    monkeypatch.setattr(local, "forward_stats_steps", logged(loop.forward_stats_steps))
    monkeypatch.setattr(local, "backward_steps", logged(loop.backward_steps))
    monkeypatch.setattr(local, "topk_steps", logged(topk.topk_steps))

    head = make_head([20, 30, 10], chunk_size=5)
    head.engine = _FakeGpuEngine(chunk_size=5)
    expected = make_head([20, 30, 10], chunk_size=5)
    x, target = inputs()
    # The reference results first (its loops log too), then the logged run.
    want_topk = expected.topk(x, 3)
    ref_x = x.clone().requires_grad_()
    want_loss = expected(ref_x, target)
    want_loss.backward()
    x.requires_grad_()
    events.clear()
    if phase == "topk":
        assert torch.equal(head.topk(x.detach(), 3)[1], want_topk[1])
    else:
        loss = head(x, target)
        assert torch.allclose(loss, want_loss, rtol=1e-12)
        if phase == "backward":
            events.clear()
            loss.backward()
            assert torch.allclose(x.grad, ref_x.grad, rtol=1e-12, atol=1e-14)
    steps = [e for e in events if e[0] == "step"]
    copies = [i for i, e in enumerate(events) if e[0] == "copy"]
    first_step = events.index(steps[0])
    # Every copy to a (fake) GPU is queued before the first chunk of any loop.
    assert copies and max(copies) < first_step, events
    # The two GPU shards (20 and 30 classes, chunks of 5) advance in turn: 4 and 6 steps interleaved,
    # then the CPU shard (10 classes) runs last.
    names = [name for _, name in steps]
    assert names[:8] == ["shard@20", "shard@30"] * 4, names
    assert names[8:10] == ["shard@30", "shard@30"] and names[10:] == ["shard@10", "shard@10"], names
