"""Checkpoint and resume (hugehead.checkpoint, hugehead.lightning): optimizer state kept on each shard's
device (the misplaced-state failure simulated on CPU with the meta device), resume bitwise equal to an
uninterrupted run (plain PyTorch and Lightning, Adam and SGD with momentum, several shards), sharded
torch.distributed.checkpoint round trips across placements, the streamed safetensors writer (readable by
safetensors; host memory measured), and atomic writes (exceptions, and writers killed with SIGKILL)."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hugehead
from hugehead import checkpoint as ck

D, V = 8, 37
REPO = Path(__file__).resolve().parents[1]


def make_head(sizes, *, dtype=torch.float64, bias=True, seed=0):
    torch.manual_seed(seed)
    return hugehead.ChunkedClassifier(D, sum(sizes), bias, devices=["cpu"] * len(sizes), shard_sizes=sizes,
                                      dtype=dtype, chunk_size=4)


def logical(head):
    return {k: v.clone() for k, v in head.state_dict().items()}


def this_tree_env():
    """The environment of a child Python that imports this tree's hugehead (not an installed one)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def no_temporaries(directory):
    return [n for n in os.listdir(directory) if ".hugehead-tmp." in n] == []


# --------------------------------------------------------------------------------------------------
# Optimizer state on each parameter's device. On CPU the "other device" is meta: a parameter there with
# its state left on the CPU is what Lightning's restore does to a shard on cuda:1 (state on cuda:0).
# --------------------------------------------------------------------------------------------------
def misplace_state(optimizer, device):
    """What Lightning's ``_optimizer_to_device(optimizer, root)`` does (values are irrelevant on meta)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step":
                state[key] = torch.empty_like(value, device=device)


def cpu_and_meta_params():
    on_cpu = nn.Parameter(torch.randn(4, 3))
    on_meta = nn.Parameter(torch.empty(5, 3, device="meta"))
    on_cpu.grad, on_meta.grad = torch.ones_like(on_cpu), torch.ones_like(on_meta)
    return on_cpu, on_meta


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for_loop"])
def test_misplaced_adam_state_fails_and_placement_fixes_it(foreach):
    on_cpu, on_meta = cpu_and_meta_params()
    opt = torch.optim.Adam([on_cpu, on_meta], lr=0.1, foreach=foreach)
    opt.step()
    misplace_state(opt, "cpu")
    with pytest.raises(RuntimeError, match="device"):
        opt.step()  # the failure of issue 14, in miniature
    assert hugehead.place_optimizer_state(opt) == 2  # exp_avg, exp_avg_sq of the meta parameter
    assert {k: v.device.type for k, v in opt.state[on_meta].items()} == {"step": "cpu", "exp_avg": "meta",
                                                                         "exp_avg_sq": "meta"}
    assert all(v.device.type == "cpu" for v in opt.state[on_cpu].values())
    opt.step()
    assert hugehead.place_optimizer_state(opt) == 0


def test_sgd_momentum_state_is_placed():
    on_cpu, on_meta = cpu_and_meta_params()
    opt = torch.optim.SGD([on_cpu, on_meta], lr=0.1, momentum=0.9)
    opt.step()
    misplace_state(opt, "cpu")
    assert hugehead.place_optimizer_state(opt) == 1
    assert opt.state[on_meta]["momentum_buffer"].device.type == "meta"
    assert opt.state[on_cpu]["momentum_buffer"].device.type == "cpu"


def test_step_follows_torch_rule_for_fused_and_plain_groups():
    # fused/capturable: step on the parameter's device (torch's load_state_dict rule); else left on the CPU.
    fused = nn.Parameter(torch.empty(5, 3, device="meta"))
    plain = nn.Parameter(torch.empty(5, 3, device="meta"))
    opt = torch.optim.Adam([{"params": [fused], "fused": True}, {"params": [plain]}], lr=0.1)
    for p in (fused, plain):
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5, 3), "exp_avg_sq": torch.zeros(5, 3)}
    assert hugehead.place_optimizer_state(opt) == 5
    assert opt.state[fused]["step"].device.type == "meta"
    assert opt.state[plain]["step"].device.type == "cpu"
    assert opt.state[plain]["exp_avg"].device.type == "meta"


def test_keep_on_shards_places_before_every_step_and_is_idempotent():
    on_cpu, on_meta = cpu_and_meta_params()
    opt = torch.optim.Adam([on_cpu, on_meta], lr=0.1)
    opt.step()
    handle = hugehead.keep_optimizer_state_on_shards(opt)
    assert hugehead.keep_optimizer_state_on_shards(opt) is handle and len(opt._optimizer_step_pre_hooks) == 1
    for _ in range(2):
        misplace_state(opt, "cpu")  # e.g. Lightning's teardown, then another fit
        opt.step()
        assert opt.state[on_meta]["exp_avg"].device.type == "meta"
    handle.remove()
    misplace_state(opt, "cpu")
    with pytest.raises(RuntimeError, match="device"):
        opt.step()


# --------------------------------------------------------------------------------------------------
# Plain PyTorch: resume equals an uninterrupted run, bitwise
# --------------------------------------------------------------------------------------------------
class Model(nn.Module):
    def __init__(self, sizes, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = nn.Linear(6, D, dtype=torch.float64)
        self.head = make_head(sizes, seed=seed)

    def forward(self, x, target):
        return self.head(torch.tanh(self.backbone(x)), target)


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def batches(n):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randint(0, V, (16,), generator=g))
            for _ in range(n)]


def train(model, optimizer, data):
    for x, target in data:
        optimizer.zero_grad()
        model(x, target).backward()
        optimizer.step()


@pytest.mark.parametrize("fmt", ["torch_save", "dcp"])
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_plain_pytorch_resume_is_bitwise(tmp_path, opt_name, fmt):
    sizes, data = [5, 20, 12], batches(6)
    full = Model(sizes, seed=1)
    full_opt = OPTIMIZERS[opt_name](full.parameters())
    train(full, full_opt, data)

    first = Model(sizes, seed=1)
    first_opt = OPTIMIZERS[opt_name](first.parameters())
    train(first, first_opt, data[:3])
    path = tmp_path / "ckpt"
    if fmt == "torch_save":
        torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, path)
    else:
        ck.save_checkpoint(path, first, first_opt, extra={"step": 3}, block_bytes=256)  # many blocks per shard

    resumed = Model(sizes, seed=2)  # other initial values: everything must come from the checkpoint
    resumed_opt = OPTIMIZERS[opt_name](resumed.parameters())
    hugehead.keep_optimizer_state_on_shards(resumed_opt)
    if fmt == "torch_save":
        state = torch.load(path)
        resumed.load_state_dict(state["model"])
        resumed_opt.load_state_dict(state["optimizer"])
    else:
        assert ck.load_checkpoint(path, resumed, resumed_opt) == {"step": 3}
    train(resumed, resumed_opt, data[3:])

    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(full_opt.state_dict()["state"].values(), resumed_opt.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint, one process, no process group
# --------------------------------------------------------------------------------------------------
def test_sharded_state_dict_is_the_shards_without_copies():
    head = make_head([5, 20, 12])
    state = head.sharded_state_dict()
    assert list(state) == ["weight", "bias"]
    weight = state["weight"]
    assert isinstance(weight, ck.ShardedRows) and weight.shape == (V, D) and weight.dtype == torch.float64
    assert [(s, t.data_ptr()) for s, t in weight.pieces] == [(sh.start, sh.weight.data_ptr()) for sh in head.shards]
    model = nn.ModuleDict({"enc": nn.Linear(2, 2), "head": head})
    assert set(ck.sharded_state_dict(model)) == {"enc.weight", "enc.bias", "head.weight", "head.bias"}
    assert isinstance(model.state_dict()["head.weight"], torch.Tensor)  # outside: the gathered tensor
    assert not isinstance(model.state_dict()["head.weight"], ck.ShardedRows)


@pytest.mark.parametrize("src,dst", [([37], [5, 20, 12]), ([5, 20, 12], [37]), ([5, 20, 12], [30, 7])],
                         ids=["1to3", "3to1", "3to2"])
@pytest.mark.parametrize("bias", [True, False])
def test_dcp_round_trip_across_placements(tmp_path, src, dst, bias):
    import torch.distributed.checkpoint as dcp

    a = make_head(src, bias=bias, seed=3)
    b = make_head(dst, bias=bias, seed=4)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(a.sharded_state_dict(for_save=True), checkpoint_id=str(tmp_path / "raw"))
    state = b.sharded_state_dict()
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=str(tmp_path / "raw"))  # in place, into b's shards
    b.load_state_dict(state)
    expected = logical(a)
    assert all(torch.equal(b.state_dict()[k], expected[k]) for k in expected)

    # The same through save_checkpoint / load_checkpoint, with blocks far smaller than a shard.
    c = make_head(dst, bias=bias, seed=5)
    model_a, model_c = nn.ModuleDict({"head": a}), nn.ModuleDict({"head": c})
    ck.save_checkpoint(tmp_path / "dir", model_a, block_bytes=3 * D * 8)
    assert ck.is_checkpoint_dir(tmp_path / "dir")
    ck.load_checkpoint(tmp_path / "dir", model_c)
    assert all(torch.equal(c.state_dict()[k], expected[k]) for k in expected)


def test_saves_hand_dcp_host_copies_of_pieces_off_the_cpu():
    # DCP's copy-ahead of a GPU tensor waits on the current GPU's stream only: for a save, each piece not on
    # the CPU is copied to the host by us, when DCP asks for it. Meta stands in for "another GPU" here.
    from torch.distributed.checkpoint.metadata import MetadataIndex

    on_cpu, elsewhere = torch.zeros(4, 3), torch.empty(4, 3, device="meta")
    rows = ck.ShardedRows([(0, on_cpu), (4, elsewhere)], 8)
    assert rows.__get_tensor_shard__(MetadataIndex("w", torch.Size([4, 0]))) is elsewhere  # a load target
    staged = ck._for_dcp(rows, 1 << 20, saving=True)
    assert staged.__get_tensor_shard__(MetadataIndex("w", torch.Size([0, 0]))).data_ptr() == on_cpu.data_ptr()
    # A row block of a CPU shard is handed over as its own memory with a storage of exactly its bytes, so
    # DCP's writer does not copy it (it copies a tensor whose storage is larger).
    shard = torch.arange(40.0).reshape(10, 4)
    blocks = ck._for_dcp(ck.ShardedRows([(0, shard)], 10), 3 * 4 * 4, saving=True)
    for start, _ in blocks.pieces:
        handed = blocks.__get_tensor_shard__(MetadataIndex("w", torch.Size([start, 0])))
        assert handed.data_ptr() == shard[start].data_ptr() and torch.equal(handed, shard[start:start + 3])
        assert handed.untyped_storage().nbytes() == handed.numel() * 4
    with pytest.raises(NotImplementedError, match="meta"):  # i.e. it tried piece.to("cpu")
        staged.__get_tensor_shard__(MetadataIndex("w", torch.Size([4, 0])))
    plain = ck._for_dcp(torch.empty(5, device="meta"), 1 << 20, saving=True)
    assert isinstance(plain, ck.ShardedRows) and plain._stage_to_host
    assert ck._for_dcp(torch.zeros(5), 1 << 20, saving=True).device.type == "cpu"  # CPU tensors as they are


def test_local_sharded_rows_are_a_rank_s_part_of_the_logical_tensor(tmp_path):
    """local=True (a head spanning ranks): pieces inside [0, R) without overlap, not covering it; rows are
    materialized only where this process has them."""
    a, b = torch.arange(6.0).view(3, 2), torch.arange(6.0, 10.0).view(2, 2)
    part = ck.ShardedRows([(7, b), (2, a)], 12, local=True)
    assert part.shape == (12, 2) and [s for s, _ in part.pieces] == [2, 7] and "local" in repr(part)
    assert part.rows(7, 9) is b
    torch.testing.assert_close(part.rows(3, 5), a[1:3], rtol=0, atol=0)
    assert [s for s, _ in part.blocks(8).pieces] == [2, 3, 4, 7, 8]  # one 8-byte row per block, still local
    with pytest.raises(ValueError, match=r"rows \[4, 8\) are not all in this process's pieces"):
        part.rows(4, 8)
    with pytest.raises(ValueError, match="starts at row 3, expected at least 5"):
        ck.ShardedRows([(2, a), (3, b)], 12, local=True)
    with pytest.raises(ValueError, match="cover 13 rows, not 12"):
        ck.ShardedRows([(10, a)], 12, local=True)
    with pytest.raises(ValueError, match="starts at row 2, expected 0"):
        ck.ShardedRows([(2, a)], 12)  # without local the pieces must tile [0, R)
    # Some rows live in other ranks: a one-process checkpoint of it would be incomplete.
    with pytest.raises(ValueError, match="spans ranks: pass its process_group to save_checkpoint"):
        ck.save_checkpoint(tmp_path / "ckpt", {"weight": part})
    assert not os.listdir(tmp_path)
    whole = ck.ShardedRows([(0, torch.zeros(2, 2)), (2, a)], 5, local=True)  # a world of one rank
    ck.save_checkpoint(tmp_path / "ckpt", {"weight": whole})
    assert ck.is_checkpoint_dir(tmp_path / "ckpt")


def test_load_state_dict_takes_sharded_rows_of_another_placement():
    a, b = make_head([5, 20, 12], seed=3), make_head([30, 7], seed=4)
    b.load_state_dict(a.sharded_state_dict())
    assert all(torch.equal(b.state_dict()[k], v) for k, v in logical(a).items())


@pytest.mark.parametrize("placement", [[37], [5, 20, 12]], ids=["one_shard", "three_shards"])
def test_state_dict_of_the_wrong_size_names_the_shape_expected(placement):
    head = make_head(placement)
    before = logical(head)
    wrong = make_head([40]).state_dict()  # 40 classes into a head of 37
    with pytest.raises(RuntimeError) as info:
        head.load_state_dict(wrong)
    message = str(info.value)
    assert "size mismatch for weight: copying a param with shape (40, 8) from checkpoint, the shape in current " \
           "model is (37, 8)" in message
    assert "size mismatch for bias" in message and "(37,)" in message
    assert "Missing key" not in message  # the keys were there, with the wrong shape
    # Wrong features, inside a model (prefixed keys), strict=False: still a size mismatch, never silent.
    model = nn.ModuleDict({"head": make_head(placement)})
    wide = {"head.weight": torch.zeros(37, 9, dtype=torch.float64), "head.bias": torch.zeros(37, dtype=torch.float64)}
    with pytest.raises(RuntimeError, match=r"size mismatch for head\.weight: .*shape \(37, 9\).* is \(37, 8\)"):
        model.load_state_dict(wide, strict=False)
    # A key that really is missing is still reported as the logical key.
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "bias"'):
        head.load_state_dict({"weight": before["weight"]})
    assert all(torch.equal(head.state_dict()[k], v) for k, v in before.items())  # the failed loads changed nothing


def test_checkpoint_errors(tmp_path):
    model = Model([5, 20, 12], seed=1)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, batches(1))
    ck.save_checkpoint(tmp_path / "c", model, opt)
    other = Model([30, 7], seed=1)  # weights load into any placement ...
    ck.load_checkpoint(tmp_path / "c", other)
    with pytest.raises(ValueError, match="same placement only"):  # ... optimizer state does not
        ck.load_checkpoint(tmp_path / "c", other, torch.optim.Adam(other.parameters()))
    same_count = Model([10, 15, 12], seed=1)
    with pytest.raises(ValueError, match=r"has shape \(5, 8\), the parameter has \(10, 8\)"):
        ck.load_checkpoint(tmp_path / "c", same_count, torch.optim.Adam(same_count.parameters()))
    with pytest.raises(RuntimeError, match="unexpected keys"):
        ck.load_checkpoint(tmp_path / "c", nn.ModuleDict({"head": make_head([37])}))
    ck.save_checkpoint(tmp_path / "weights", model)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        ck.load_checkpoint(tmp_path / "weights", model, opt)
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        ck.load_checkpoint(tmp_path, model)
    rows = model.head.sharded_state_dict()["weight"]
    with pytest.raises(TypeError, match="supports no operations"):
        rows.sum()
    with pytest.raises(TypeError, match="cannot be pickled"):
        torch.save(rows, tmp_path / "x.pt")


# --------------------------------------------------------------------------------------------------
# safetensors, streamed
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_safetensors_is_a_safetensors_file(tmp_path, dtype):
    from safetensors import safe_open
    from safetensors.torch import load_file

    head = make_head([5, 20, 12], dtype=dtype)
    path = tmp_path / "head.safetensors"
    head.save_safetensors(str(path))
    loaded = load_file(str(path))
    assert list(loaded) == ["weight.0", "bias.0", "weight.1", "bias.1", "weight.2", "bias.2"]
    for k, shard in enumerate(head.shards):
        assert torch.equal(loaded[f"weight.{k}"], shard.weight.detach())
        assert torch.equal(loaded[f"bias.{k}"], shard.bias.detach())
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["hugehead.class_ranges"]) == [[0, 5], [5, 25], [25, 37]]
    back = make_head([37], dtype=dtype, seed=9)
    back.load_safetensors(str(path))
    assert torch.equal(back.state_dict()["weight"], head.state_dict()["weight"])

    # Any tensors, any strides, blocks smaller than a row, 0-d and empty tensors.
    odd = {"t": torch.randn(7, 5).t(), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
           "flags": torch.tensor([True, False, True]), "i64": torch.arange(10)}
    ck.write_safetensors(tmp_path / "odd.safetensors", list(odd.items()), {"a": "b"}, block_bytes=8)
    back = load_file(str(tmp_path / "odd.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in odd.items())
    assert no_temporaries(tmp_path)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13])
def test_staged_block_writer_writes_every_block_in_order(tmp_path, rows):
    # The double-buffered path a GPU tensor takes (pinned buffers, copy b+1 while writing b), run on CPU.
    tensor = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    for block_bytes in (1, 12, 24, 36, 10**6):  # block of 1 row (at least), 2, 3 rows, everything
        path = tmp_path / f"{rows}_{block_bytes}.bin"
        with open(path, "wb") as f:
            ck._write_tensor_bytes(f, tensor.t().contiguous().t(), block_bytes, staged=True)
        assert path.read_bytes() == tensor.numpy().tobytes()


HOST_PEAK_SCRIPT = r"""
import json, re, sys, torch
import hugehead
hugehead.ChunkedClassifier.reset_parameters = lambda self: None  # values do not matter; fill below
head = hugehead.ChunkedClassifier(256, 200_000, devices=["cpu"] * 3, dtype=torch.float32)
with torch.no_grad():
    for p in head.parameters():
        p.fill_(0.5)  # resident before the measurement starts

def peak_kib_during(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    rss = int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))
    fn()
    hwm = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))
    return hwm - rss

out = sys.argv[1]
streamed = peak_kib_during(lambda: head.save_safetensors(out + "/streamed.safetensors"))
gathered = peak_kib_during(lambda: torch.save(head.state_dict(), out + "/gathered.pt"))
print(json.dumps({"streamed_kib": streamed, "gathered_kib": gathered,
                  "head_bytes": sum(p.numel() * 4 for p in head.parameters())}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
def test_safetensors_save_host_memory_stays_within_blocks(tmp_path):
    script = tmp_path / "peak.py"
    script.write_text(HOST_PEAK_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                            env=this_tree_env())
    assert result.returncode == 0, result.stderr
    peak = json.loads(result.stdout.strip().splitlines()[-1])
    head_mib = peak["head_bytes"] / 2**20
    streamed_mib, gathered_mib = peak["streamed_kib"] / 1024, peak["gathered_kib"] / 1024
    # Streamed: two 64 MiB blocks at most (a CPU shard is written from its own memory: ~nothing).
    assert streamed_mib <= 2 * ck.BLOCK_BYTES / 2**20 + 16, (streamed_mib, head_mib)
    # The measurement does see a whole-head copy: torch.save(state_dict()) gathers the logical weight.
    assert gathered_mib >= 0.9 * head_mib, (gathered_mib, head_mib)


# --------------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------------
def test_failed_saves_leave_previous_checkpoint_and_no_temporaries(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    old, new = make_head([5, 20, 12], seed=1), make_head([5, 20, 12], seed=2)
    old.save_safetensors(str(tmp_path / "h.safetensors"))
    ck.save_checkpoint(tmp_path / "h.dcp", old)
    before = sorted(os.listdir(tmp_path))

    calls = {"n": 0}
    real = ck.safetensors._write_tensor_bytes

    def fail_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ck.safetensors, "_write_tensor_bytes", fail_on_third)
    with pytest.raises(OSError, match="simulated"):
        new.save_safetensors(str(tmp_path / "h.safetensors"))
    real_write_item = dcp_fs._write_item

    def fail_write_item(*args, **kwargs):
        real_write_item(*args, **kwargs)
        raise OSError(5, "I/O error (simulated)")

    monkeypatch.setattr(dcp_fs, "_write_item", fail_write_item)
    with pytest.raises(OSError, match="simulated"):  # DCP's CheckpointException unwrapped
        ck.save_checkpoint(tmp_path / "h.dcp", new)
    assert sorted(os.listdir(tmp_path)) == before  # no temporaries
    check = make_head([37], seed=9)
    check.load_safetensors(str(tmp_path / "h.safetensors"))
    assert torch.equal(check.state_dict()["weight"], logical(old)["weight"])
    ck.load_checkpoint(tmp_path / "h.dcp", check)
    assert torch.equal(check.state_dict()["bias"], logical(old)["bias"])


def test_directory_swap_without_renameat2(tmp_path, monkeypatch):
    monkeypatch.setattr(ck.atomic, "_exchange", lambda a, b: False)
    for seed in (1, 2):
        ck.save_checkpoint(tmp_path / "c", make_head([5, 32], seed=seed))
    back = make_head([37], seed=9)
    ck.load_checkpoint(tmp_path / "c", back)
    assert torch.equal(back.state_dict()["weight"], logical(make_head([5, 32], seed=2))["weight"])
    assert sorted(os.listdir(tmp_path)) == ["c"]


KILL_DRIVER = r"""
import os, random, signal, sys, time
import torch
torch.set_num_threads(1)  # no thread pools: this process forks its writers
import hugehead
from hugehead import checkpoint as ck
import torch.distributed.checkpoint.filesystem as dcp_fs

fmt, root, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
path = os.path.join(root, "ckpt")

def head_of(version):  # every value of version v is v: a torn checkpoint mixes versions
    head = hugehead.ChunkedClassifier(16, 3000, devices=["cpu"] * 3, dtype=torch.float32)
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(float(version))
    return head

def save(head):
    if fmt == "safetensors":
        head.save_safetensors(path)
    else:
        ck.save_checkpoint(path, head, block_bytes=1 << 13)

def version_on_disk():
    head = head_of(-1)
    if fmt == "safetensors":
        head.load_safetensors(path)
    else:
        ck.load_checkpoint(path, head)
    values = torch.cat([p.detach().reshape(-1) for p in head.parameters()]).unique()
    assert values.numel() == 1, f"torn checkpoint: {values.tolist()}"
    return int(values.item())

def run_child(body):
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(0)
    return pid

def kill_on_call(module, name, n):
    real, count = getattr(module, name), [0]
    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(module, name, wrapper)

heads = [head_of(v) for v in range(40)]
start = time.perf_counter()
save(heads[0])
save(heads[0])
seconds_per_save = (time.perf_counter() - start) / 2
current = 0
# 1. Deterministic kill points: mid-data, before the fsync, before the rename, after the rename (and, for
#    a directory, after the swap but before the previous checkpoint is deleted).
if fmt == "safetensors":
    points = [(ck.safetensors, "_write_tensor_bytes", 3), (ck.atomic, "_fsync_path", 1), (ck.atomic, "_commit", 1),
              (ck.atomic, "_fsync_dir", 1)]
else:  # _fsync_path fsyncs the directory itself first: the parent's fsync is the second _fsync_dir
    points = [(ck.atomic, "_remove_path", 1), (dcp_fs, "_write_item", 5), (ck.atomic, "_fsync_path", 1),
              (ck.atomic, "_commit", 1), (ck.atomic, "_fsync_dir", 2)]
for i, (module, name, n) in enumerate(points):
    version = 1 + i
    pid = run_child(lambda: (kill_on_call(module, name, n), save(heads[version]), sys.stdout.flush()))
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (name, status)
    found = version_on_disk()
    assert found in (current, version), (name, found)
    current = found
    print(f"kill at {name}#{n}: checkpoint holds version {found}")
# 2. Random moments while saving versions back to back.
for round_ in range(8):
    first = 10 + 3 * round_
    def loop(first=first):
        for v in range(first, first + 3):
            save(heads[v])
    pid = run_child(loop)
    time.sleep(rng.uniform(0.0, 3 * seconds_per_save))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    found = version_on_disk()
    assert found == current or first <= found < first + 3, found
    current = found
    print(f"random kill {round_}: checkpoint holds version {found}")
save(heads[39])  # a later save removes what killed writers left behind
assert version_on_disk() == 39
leftovers = [n for n in os.listdir(root) if n != "ckpt"]
assert leftovers == [], leftovers
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill test forks its writers")
def test_killed_saves_leave_a_complete_checkpoint(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER)
    procs = {}
    for fmt in ("safetensors", "dcp"):
        (tmp_path / fmt).mkdir()
        procs[fmt] = subprocess.Popen([sys.executable, str(driver), fmt, str(tmp_path / fmt), "0"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=this_tree_env())
    for fmt, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip().endswith("ok"), f"{fmt}:\n{out}\n{err}"


# --------------------------------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------------------------------
# Resuming without the ModelCheckpoint that wrote the checkpoint is what these tests mean to do.
def lightning_quiet(test):
    test = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")(test)
    return pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")(test)


def _lightning_module_class():
    L = pytest.importorskip("lightning")

    class TinyModule(L.LightningModule):
        def __init__(self, sizes, seed):
            super().__init__()
            self.model = Model(sizes, seed)

        def training_step(self, batch, batch_idx):
            return self.model(*batch)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.model(*batch))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    return L, TinyModule


def _trainer(L, epochs, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _loader():
    from torch.utils.data import DataLoader, TensorDataset

    data = batches(3)
    return DataLoader(TensorDataset(torch.cat([x for x, _ in data]), torch.cat([t for _, t in data])), batch_size=16)


@lightning_quiet
@pytest.mark.parametrize("how", ["ckpt_file_and_callback", "sharded_strategy"])
def test_lightning_resume_is_bitwise(tmp_path, how):
    L, TinyModule = _lightning_module_class()
    from lightning.pytorch.callbacks import ModelCheckpoint
    from hugehead.lightning import ShardedHeadStrategy, ShardPlacementCallback

    def extra():
        if how == "sharded_strategy":
            return dict(strategy=ShardedHeadStrategy())
        return dict(callbacks=[ShardPlacementCallback()])

    full = TinyModule([5, 20, 12], seed=1)
    _trainer(L, 2, enable_checkpointing=False).fit(full, _loader())

    first = TinyModule([5, 20, 12], seed=1)
    kwargs = extra()
    kwargs["callbacks"] = kwargs.get("callbacks", []) + [ModelCheckpoint(dirpath=tmp_path, save_last=True)]
    _trainer(L, 1, **kwargs).fit(first, _loader())
    last = tmp_path / "last.ckpt"
    assert last.is_dir() == (how == "sharded_strategy")

    resumed = TinyModule([5, 20, 12], seed=2)
    trainer = _trainer(L, 2, enable_checkpointing=False, **extra())
    trainer.fit(resumed, _loader(), ckpt_path=str(last))
    assert trainer.global_step == 6
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    full_state, resumed_state = (m.trainer.optimizers[0].state_dict()["state"] for m in (full, resumed))
    assert all(torch.equal(full_state[i][k], resumed_state[i][k]) for i in full_state for k in full_state[i])


@lightning_quiet
def test_lightning_callback_places_state_after_restore_and_before_first_step(tmp_path, monkeypatch):
    L, TinyModule = _lightning_module_class()
    import lightning.pytorch.strategies.strategy as pl_strategy
    import hugehead.lightning as hl

    _trainer(L, 1, callbacks=[hl.ShardPlacementCallback()], default_root_dir=tmp_path).fit(
        TinyModule([5, 20, 12], seed=1), _loader())
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt"))

    events = []
    real_move, real_keep = pl_strategy._optimizer_to_device, hl.keep_optimizer_state_on_shards
    monkeypatch.setattr(pl_strategy, "_optimizer_to_device",
                        lambda opt, device: (events.append(f"lightning moved state to {device}"), real_move(opt, device)))
    monkeypatch.setattr(hl, "keep_optimizer_state_on_shards", lambda opt: (events.append("hugehead placed"), real_keep(opt)))
    module = TinyModule([5, 20, 12], seed=2)
    module.on_train_batch_start = lambda batch, i: events.append("step")
    _trainer(L, 2, callbacks=[hl.ShardPlacementCallback()], enable_checkpointing=False).fit(
        module, _loader(), ckpt_path=str(ckpt))
    assert events[:3] == ["lightning moved state to cpu", "hugehead placed", "step"]


@lightning_quiet
def test_sharded_strategy_tests_from_a_checkpoint_into_another_placement(tmp_path, monkeypatch):
    L, TinyModule = _lightning_module_class()
    import hugehead.lightning as hl

    reads = []
    real_read = hl.read_checkpoint
    monkeypatch.setattr(hl, "read_checkpoint", lambda path, state, optimizers, **kw: (
        reads.append(optimizers), real_read(path, state, optimizers, **kw))[1])
    trained = TinyModule([5, 20, 12], seed=1)
    trainer = _trainer(L, 1, strategy=hl.ShardedHeadStrategy(), enable_checkpointing=False)
    trainer.fit(trained, _loader())
    trainer.save_checkpoint(tmp_path / "ckpt")
    assert ck.is_checkpoint_dir(tmp_path / "ckpt")
    trainer.test(trained, _loader(), ckpt_path=str(tmp_path / "ckpt"), verbose=False)
    assert reads == [None]  # a test reads no optimizer state, though the strategy still holds the optimizer

    other = TinyModule([37], seed=2)  # one shard: the weights reshard on load
    metrics = _trainer(L, 1, strategy=hl.ShardedHeadStrategy()).test(other, _loader(), ckpt_path=str(tmp_path / "ckpt"),
                                                                     verbose=False)
    assert torch.equal(other.model.head.state_dict()["weight"], trained.model.head.state_dict()["weight"])
    assert torch.equal(other.model.backbone.weight, trained.model.backbone.weight)
    with torch.no_grad():
        expected = float(torch.stack([trained.model(x, t) for x, t in batches(3)]).mean())
    assert metrics[0]["test_loss"] == pytest.approx(expected, rel=1e-12)


def test_hugehead_imports_without_lightning():
    code = ("import sys; sys.modules['lightning'] = None; import hugehead, hugehead.checkpoint; "
            "assert 'lightning.pytorch' not in sys.modules; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr


def test_bench_resume_cpu_smoke(tmp_path):
    from bench import bench_resume

    out, work = tmp_path / "out", tmp_path / "work"
    assert bench_resume.main(["--cpu-smoke", "--skip-lightning-baseline", "--out", str(out), "--dir", str(work)]) == 0
    doc = json.loads((out / "resume.json").read_text())
    assert [(r["name"], r["op"]) for r in doc["runs"]] == [
        ("safetensors", "save"), ("safetensors", "load"), ("dcp (io_threads=1)", "save"),
        ("dcp (io_threads=1)", "load"), ("dcp -> one device", "load"), ("torch.save(state_dict)", "save"),
        ("torch.save(state_dict)", "load")]
    assert doc["all_loads_match"] and doc["target_host_peak"]["met"]
    assert doc["disk"]["write_gbps"] > 0 and doc["meta"]["git_sha"]
    assert (out / "resume.md").read_text().startswith("# Checkpoint save / load")
    assert not work.exists()


# --------------------------------------------------------------------------------------------------
# A small file system: a checkpoint that fits once but not beside the previous one. On a real tmpfs where
# this machine lets us mount one (root), else a simulated one: shutil.disk_usage patched to a capacity,
# and the writes failing as a full disk makes them fail (torch.save's short-write RuntimeError inside
# DCP, ENOSPC in the safetensors writer) once the directory holds more than that capacity.
# --------------------------------------------------------------------------------------------------
FS_BYTES = 64 << 20
# float32 head + AdamW moments: ~37 MB a checkpoint (one fits in 64 MiB, two do not); a 41 MB safetensors file.
CKPT_CLASSES, ST_CLASSES, FS_D = 48_000, 160_000, 64


class SimulatedFS:
    def __init__(self, root, monkeypatch):
        import shutil
        import torch.distributed.checkpoint.filesystem as dcp_fs

        self.root = str(root)
        real_usage, real_item, real_bytes = shutil.disk_usage, dcp_fs._write_item, ck.safetensors._write_tensor_bytes

        def disk_usage(path):
            if not os.path.abspath(os.fspath(path)).startswith(self.root):
                return real_usage(path)
            used = self.used()
            return shutil._ntuple_diskusage(FS_BYTES, used, max(0, FS_BYTES - used))

        def write_item(transforms, stream, *args, **kwargs):
            result = real_item(transforms, stream, *args, **kwargs)
            stream.flush()
            if self.used() > FS_BYTES:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            return result

        def write_bytes(f, *args, **kwargs):
            real_bytes(f, *args, **kwargs)
            f.flush()
            if self.used() > FS_BYTES:
                raise OSError(28, "No space left on device")

        monkeypatch.setattr(shutil, "disk_usage", disk_usage)
        monkeypatch.setattr(dcp_fs, "_write_item", write_item)
        monkeypatch.setattr(ck.safetensors, "_write_tensor_bytes", write_bytes)

    def used(self):
        return ck.space.path_bytes(self.root)


@pytest.fixture(params=["tmpfs", "simulated"])
def small_fs(request, tmp_path, monkeypatch):
    root = tmp_path / "fs"
    root.mkdir()
    if request.param == "simulated":
        SimulatedFS(root, monkeypatch)
        yield root
        return
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(root)],
                                 capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root); the simulated file system covers the same cases")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=30)


def trained_head(classes, seed, opt=True):
    torch.manual_seed(seed)
    head = hugehead.ChunkedClassifier(FS_D, classes, devices=["cpu"] * 2, dtype=torch.float32)
    optimizer = torch.optim.AdamW(head.parameters(), lr=0.01) if opt else None
    if opt:
        head(torch.randn(16, FS_D), torch.randint(0, classes, (16,))).backward()
        optimizer.step()  # the moments exist now: a checkpoint holds weights + 2 moments
    return head, optimizer


def snapshot(head, optimizer):
    tensors = {f"model.{k}": v.clone() for k, v in head.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        tensors.update({f"opt.{i}.{k}": v.clone() for k, v in state.items()})
    return tensors


def assert_checkpoint_holds(path, expected):
    head, optimizer = trained_head(CKPT_CLASSES, seed=99)
    ck.load_checkpoint(path, head, optimizer)
    got = snapshot(head, optimizer)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def count_dcp_writes(monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    calls, real = [], dcp_fs._write_item
    monkeypatch.setattr(dcp_fs, "_write_item", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def test_space_error_is_a_clear_oserror():
    error = ck.CheckpointSpaceError("/ckpts", 3 * 10**9, 10**9, "checkpoint c")
    assert isinstance(error, OSError) and error.errno == 28 and error.filename == "/ckpts"
    assert "/ckpts" in str(error) and "3.00 GB (3,000,000,000 bytes)" in str(error) and "1.00 GB" in str(error)
    import pickle

    back = pickle.loads(pickle.dumps(error))  # crosses ranks this way
    assert (back.directory, back.needed, back.free, str(back)) == (error.directory, error.needed, error.free, str(error))


def test_checkpoint_that_does_not_fit_beside_the_previous_fails_before_writing(small_fs, monkeypatch):
    first, first_opt = trained_head(CKPT_CLASSES, seed=1)
    ck.save_checkpoint(small_fs / "ckpt", first, first_opt)
    expected = snapshot(first, first_opt)
    size = ck.space.path_bytes(small_fs / "ckpt")
    assert FS_BYTES / 2 < size < FS_BYTES  # fits once, not twice
    second, second_opt = trained_head(CKPT_CLASSES, seed=2)
    writes = count_dcp_writes(monkeypatch)
    for name in ("ckpt", "epoch=1.ckpt"):  # over the previous one, and beside it (ModelCheckpoint's names)
        with pytest.raises(ck.CheckpointSpaceError) as info:
            ck.save_checkpoint(small_fs / name, second, second_opt)
        error = info.value
        assert error.directory == str(small_fs) and error.needed >= size > error.free
        assert str(small_fs) in str(error) and f"{error.needed:,} bytes" in str(error) and "free" in str(error)
    assert writes == []  # refused before writing any byte
    assert sorted(os.listdir(small_fs)) == ["ckpt"]  # no temporary
    assert_checkpoint_holds(small_fs / "ckpt", expected)

    # Opt-in: the previous checkpoint is removed first, so one fits.
    ck.save_checkpoint(small_fs / "ckpt", second, second_opt, keep_previous=False)
    assert sorted(os.listdir(small_fs)) == ["ckpt"]
    assert_checkpoint_holds(small_fs / "ckpt", snapshot(second, second_opt))
    ck.save_checkpoint(small_fs / "epoch=2.ckpt", first, first_opt, keep_previous=False, previous=small_fs / "ckpt")
    assert sorted(os.listdir(small_fs)) == ["epoch=2.ckpt"]
    assert_checkpoint_holds(small_fs / "epoch=2.ckpt", expected)


def test_checkpoint_write_that_runs_out_of_space_raises_the_same_error(small_fs, monkeypatch):
    first, first_opt = trained_head(CKPT_CLASSES, seed=1)
    ck.save_checkpoint(small_fs / "ckpt", first, first_opt)
    expected = snapshot(first, first_opt)
    second, second_opt = trained_head(CKPT_CLASSES, seed=2)
    monkeypatch.setattr(ck.space, "check_room", lambda *a, **k: None)  # the estimate misses: the disk fills up
    for threads in (1, 4):
        with pytest.raises(ck.CheckpointSpaceError, match="ran out of space") as info:
            ck.save_checkpoint(small_fs / "ckpt", second, second_opt, io_threads=threads)
        cause = info.value.__cause__
        assert isinstance(cause, (OSError, RuntimeError)) and (
            getattr(cause, "errno", None) == 28 or "unexpected pos" in str(cause)), cause
        assert sorted(os.listdir(small_fs)) == ["ckpt"]
    assert_checkpoint_holds(small_fs / "ckpt", expected)


def test_safetensors_that_does_not_fit_beside_the_previous(small_fs, monkeypatch):
    first, _ = trained_head(ST_CLASSES, seed=1, opt=False)
    path = small_fs / "head.safetensors"
    first.save_safetensors(str(path))
    second, _ = trained_head(ST_CLASSES, seed=2, opt=False)

    def assert_file_holds(head):
        back, _ = trained_head(ST_CLASSES, seed=9, opt=False)
        back.load_safetensors(str(path))
        assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())

    with pytest.raises(ck.CheckpointSpaceError, match="safetensors file head.safetensors") as info:
        second.save_safetensors(str(path))
    assert info.value.directory == str(small_fs) and info.value.needed > info.value.free
    assert sorted(os.listdir(small_fs)) == ["head.safetensors"]
    assert_file_holds(first)
    real_check = ck.space.check_room
    monkeypatch.setattr(ck.space, "check_room", lambda *a, **k: None)  # the write itself runs out
    with pytest.raises(ck.CheckpointSpaceError, match="ran out of space") as info:
        second.save_safetensors(str(path))
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == 28
    assert sorted(os.listdir(small_fs)) == ["head.safetensors"]
    assert_file_holds(first)
    monkeypatch.setattr(ck.space, "check_room", real_check)
    second.save_safetensors(str(path), keep_previous=False)
    assert sorted(os.listdir(small_fs)) == ["head.safetensors"]
    assert_file_holds(second)


def _big_lightning_module_class():
    L = pytest.importorskip("lightning")

    class BigHeadModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.head = hugehead.ChunkedClassifier(FS_D, CKPT_CLASSES, devices=["cpu"] * 2, dtype=torch.float32)

        def training_step(self, batch, batch_idx):
            return self.head(*batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    def loader():
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(5)
        return DataLoader(TensorDataset(torch.randn(64, FS_D, generator=g), torch.randint(0, CKPT_CLASSES, (64,), generator=g)),
                          batch_size=16)

    return L, BigHeadModule, loader


@lightning_quiet
def test_lightning_checkpoint_that_does_not_fit_warns_at_fit_start_and_fails_before_writing(small_fs):
    L, BigHeadModule, loader = _big_lightning_module_class()
    from lightning.pytorch.callbacks import ModelCheckpoint
    from hugehead.lightning import ShardedHeadStrategy

    def trainer(steps, strategy, **kwargs):
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, strategy=strategy,
                         default_root_dir=small_fs, **kwargs)

    reference = BigHeadModule()
    trainer(1, ShardedHeadStrategy(), enable_checkpointing=False).fit(reference, loader())
    module = BigHeadModule()
    every_step = ModelCheckpoint(dirpath=small_fs, every_n_train_steps=1)
    with pytest.warns(RuntimeWarning, match=r"has .* free, but a checkpoint .* takes about .* 2 of them must fit"):
        with pytest.raises(ck.CheckpointSpaceError, match="epoch=0-step=2.ckpt"):
            trainer(3, ShardedHeadStrategy(), callbacks=[every_step]).fit(module, loader())
    assert sorted(os.listdir(small_fs)) == ["epoch=0-step=1.ckpt"]  # the first, and no temporary
    back = BigHeadModule()
    extra = ck.load_checkpoint(small_fs / "epoch=0-step=1.ckpt", back)
    assert extra["global_step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), back.parameters()))

    # Opt-in, resuming from it: one checkpoint on disk, the previous (first: the one resumed from) removed
    # before each save; room for two is no longer needed, so no warning.
    import warnings

    resumed = BigHeadModule()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer(3, ShardedHeadStrategy(keep_previous=False), callbacks=[ModelCheckpoint(
            dirpath=small_fs, every_n_train_steps=1)]).fit(resumed, loader(), ckpt_path=str(small_fs / "epoch=0-step=1.ckpt"))
    assert sorted(os.listdir(small_fs)) == ["epoch=0-step=3.ckpt"]
    back = BigHeadModule()
    assert ck.load_checkpoint(small_fs / "epoch=0-step=3.ckpt", back)["global_step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), back.parameters()))


def test_bench_checkpoint_cpu_smoke(tmp_path):
    from bench import bench_checkpoint

    out, work, history = tmp_path / "out", tmp_path / "work", tmp_path / "history.csv"
    assert bench_checkpoint.main(["--cpu-smoke", "--out", str(out), "--dir", str(work), "--record", str(history)]) == 0
    doc = json.loads((out / "checkpoint.json").read_text())
    rows = history.read_text().splitlines()  # the header, then a save and a load row per io_threads
    assert len(rows) == 1 + 2 * 2 and all(",checkpoint,20000 classes," in r for r in rows[1:]), rows
    assert [(r["io_threads"], r["files"]) for r in doc["rows"]] == [(1, 1), (4, 4)]  # a file per writer thread
    assert all(r["exact"] and r["bytes"] > 3 * 20_000 * 64 * 4 for r in doc["rows"])
    assert all(r["digests"] and r["plain_write_gbps"] > 0 and r["load_warm_vs_plain"] > 0 and r["load_cold_vs_plain"] > 0
               for r in doc["rows"])
    assert doc["disk"]["write_gbps"] > 0 and doc["meta"]["smoke"] and not work.exists()
    assert (out / "checkpoint.md").read_text().startswith("# Checkpoint save and load speed")


def test_a_tensor_is_read_straight_into_its_target_only_when_its_bytes_are_one_run(tmp_path):
    from types import SimpleNamespace

    from hugehead.checkpoint.threads import _read_tensor_into

    stored = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    path = tmp_path / "items"
    with open(path, "wb") as f:
        f.write(b"x" * 37)  # the record sits at an offset of its file, as in a DCP file
        offset = f.tell()
        torch.save(stored, f)
        length = f.tell() - offset
        torch.save(stored.t(), f)  # a transposed record: not one run in row order
        t_length = f.tell() - offset - length

    def read(target, starts, sizes, at=offset, n=length):
        with open(path, "rb") as stream:
            return _read_tensor_into(stream, at, n, SimpleNamespace(storage_offsets=starts, lengths=sizes), target)

    whole = torch.full((6, 5), -1.0)
    assert read(whole, (0, 0), (6, 5)) and torch.equal(whole, stored)
    rows = torch.full((2, 5), -1.0)
    assert read(rows, (3, 0), (2, 5)) and torch.equal(rows, stored[3:5])
    for target, starts, sizes, where in [(torch.full((6, 2), -1.0), (0, 1), (6, 2), {}),            # columns
                                         (torch.full((6, 5), -1.0, dtype=torch.float64), (0, 0), (6, 5), {}),
                                         (torch.full((5, 6), -1.0), (0, 0), (5, 6), dict(at=offset + length, n=t_length))]:
        assert not read(target, starts, sizes, **where)
        assert bool((target == -1).all())  # nothing read into it: DCP's own reader takes it


def test_load_dcp_reads_views_of_other_layouts_and_dtypes(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    saved = {"t": torch.randn(7, 3).t(), "bf16": torch.randn(5, 4).bfloat16(), "rows": torch.randn(9, 4),
             "step": torch.tensor(3.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v.clone() if k != "t" else v for k, v in saved.items()}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    targets = {k: torch.full_like(v.contiguous(), 7.0) for k, v in saved.items()}
    ck.load_dcp(targets, tmp_path / "c", io_threads=1)
    for k, v in saved.items():
        assert torch.equal(targets[k], v), k


def test_a_save_leaves_torch_saves_crc32_option_as_it_found_it(tmp_path):
    head = hugehead.ChunkedClassifier(8, 50, devices=["cpu"])
    for option in (True, False):
        torch.serialization.set_crc32_options(option)
        try:
            ck.save_checkpoint(tmp_path / f"c{option}", head, io_threads=2)
            assert torch.serialization.get_crc32_options() is option
        finally:
            torch.serialization.set_crc32_options(True)
    loaded = hugehead.ChunkedClassifier(8, 50, devices=["cpu"])
    ck.load_checkpoint(tmp_path / "cFalse", loaded)
    assert torch.equal(loaded.shards[0].weight, head.shards[0].weight)
