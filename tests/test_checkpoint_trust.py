"""Checkpoints a load can trust: nothing in a checkpoint runs code (weights_only left at its default),
a load reading a path that a save keeps replacing sees one whole version, a truncated, bit-flipped,
deleted or foreign file raises an error naming it with the model and optimizer unchanged, stale
temporaries of any name are removed, and checkpoints of hugehead 0.1.0 still load."""
import io
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import hugehead
from hugehead import checkpoint as ck
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "v0.1.0"


class _WritesMarker:
    """Unpickling this creates the marker file: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def make(seed=0, sizes=(2, 4)):
    torch.manual_seed(seed)
    head = hugehead.ChunkedClassifier(4, sum(sizes), shard_sizes=list(sizes), devices=["cpu"] * len(sizes),
                                      dtype=torch.float64)
    opt = torch.optim.AdamW(head.parameters(), lr=0.1)
    head(torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 5])).backward()
    opt.step()
    return head, opt


def snapshot(head, opt):
    return [t.detach().clone() for t in head.parameters()] + \
        [v.clone() for p in head.parameters() for v in opt.state[p].values()]


def unchanged(head, opt, before):
    return all(torch.equal(a, b) for a, b in zip(snapshot(head, opt), before))


def rewrite_meta(path, change):
    """Replace the meta file's content as someone who can write the directory would (digests updated)."""
    meta_path = os.path.join(path, "hugehead_checkpoint.pt")
    outer = torch.load(meta_path, weights_only=True)
    meta = torch.load(io.BytesIO(outer["meta"]), weights_only=True)
    change(meta)
    inner = io.BytesIO()
    torch.save(meta, inner)
    outer.update(meta=inner.getvalue(), crc32=zlib.crc32(inner.getbuffer()))
    torch.save(outer, meta_path)


# --------------------------------------------------------------------------------------------------
# No code from a checkpoint
# --------------------------------------------------------------------------------------------------
def _malicious(kind, path, marker):
    head, opt = make()
    if kind == "extra":
        ck.save_checkpoint(path, head, opt, extra={"callbacks": _WritesMarker(marker)})
        return
    ck.save_checkpoint(path, head, opt, extra={"step": 1})
    if kind == "metadata":  # DCP's index replaced, its size and digest in the meta updated to match
        metadata = os.path.join(path, ".metadata")
        with open(metadata, "wb") as f:
            pickle.dump(_WritesMarker(marker), f)
        data = open(metadata, "rb").read()
        rewrite_meta(path, lambda m: m["files"].update({".metadata": {"bytes": len(data), "crc32": zlib.crc32(data)}}))
    else:  # the meta file itself, whole
        torch.save({"format": "hugehead.checkpoint/1", "model_keys": _WritesMarker(marker)},
                   os.path.join(path, "hugehead_checkpoint.pt"))


def _load_with_lightning(path):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from hugehead.lightning import ShardedHeadStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = make()[0]

        def training_step(self, batch, batch_idx):
            return self.head(batch[0], batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(list(zip(torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3]))),
                                       batch_size=2)
    trainer = pl.Trainer(strategy=ShardedHeadStrategy(), max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Module(), data, ckpt_path=str(path))


def _load_with_fsdp2_example(path):
    sys.path.insert(0, str(REPO / "examples"))
    import torch.distributed as dist

    import fsdp2_train

    try:
        fsdp2_train.main(["--backend", "gloo", "--head", "sharded", "--steps", "1", "--warmup", "0",
                          "--resume", str(path)])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


LOADERS = {
    "load_checkpoint": lambda p: ck.load_checkpoint(p, *make(1)),
    "read_checkpoint": lambda p: ck.read_checkpoint(p, ck.sharded_state_dict(make(1)[0])),
    "load_dcp": lambda p: ck.load_dcp(ck.sharded_state_dict(make(1)[0]), p),
    "lightning": _load_with_lightning,
}


@pytest.mark.parametrize("kind", ["metadata", "meta_file", "extra"])
@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_malicious_checkpoint_runs_no_code(tmp_path, kind, loader):
    if loader == "load_dcp" and kind != "metadata":
        pytest.skip("load_dcp reads DCP's files only")
    marker = tmp_path / "marker"
    path = tmp_path / "evil.ckpt"
    _malicious(kind, path, marker)
    with pytest.raises((pickle.UnpicklingError, ck.CheckpointCorruptError), match="unpickle|[Ww]eights only"):
        LOADERS[loader](path)
    assert not marker.exists()


def test_the_fsdp2_example_resumes_without_running_code(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    marker = tmp_path / "marker"
    path = tmp_path / "evil"
    os.makedirs(path)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(_WritesMarker(marker), f)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        _load_with_fsdp2_example(path)
    assert not marker.exists()
    with pytest.raises(ck.CheckpointCorruptError, match=r"\.metadata is missing"):
        _load_with_fsdp2_example(tmp_path)  # a directory that is no DCP checkpoint: named, clear


def test_the_fsdp2_example_resumes_from_its_own_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    sys.path.insert(0, str(REPO / "examples"))
    import torch.distributed as dist

    import fsdp2_train

    args = ["--backend", "gloo", "--head", "sharded", "--steps", "1", "--warmup", "0"]
    try:
        first = fsdp2_train.main(args + ["--ckpt", str(tmp_path / "c")])
        resumed = fsdp2_train.main(args + ["--resume", str(tmp_path / "c")])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The same data on the resumed weights: its first loss is below the fresh run's first one.
    assert resumed["sharded"]["first"] < first["sharded"]["first"]


# --------------------------------------------------------------------------------------------------
# Corrupt, truncated, missing and foreign files: named, and nothing written into the model
# --------------------------------------------------------------------------------------------------
def _damage(path, how):
    if how == "delete":
        os.unlink(path)
        return
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[:len(data) // 2]
    elif how == "bitflip":
        data[len(data) // 2] ^= 0x10
    else:  # foreign: another kind of file under the name
        data = b"not a checkpoint file\n" * 4
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["truncate", "bitflip", "delete", "foreign"])
@pytest.mark.parametrize("which", ["hugehead_checkpoint.pt", ".metadata", "distcp"])
def test_damaged_checkpoint_files_are_named_and_leave_the_model_unchanged(tmp_path, which, how):
    head, opt = make()
    ck.save_checkpoint(tmp_path / "c", head, opt, io_threads=2)
    name = which if which != "distcp" else sorted(n for n in os.listdir(tmp_path / "c") if n.endswith(".distcp"))[-1]
    _damage(tmp_path / "c" / name, how)
    other, other_opt = make(seed=5)
    before = snapshot(other, other_opt)
    expected = FileNotFoundError if (how == "delete" and which == "hugehead_checkpoint.pt") else ck.CheckpointCorruptError
    with pytest.raises(expected) as info:
        ck.load_checkpoint(tmp_path / "c", other, other_opt)
    assert name in str(info.value), str(info.value)
    if expected is ck.CheckpointCorruptError:
        assert info.value.filename.endswith(name) and isinstance(info.value, OSError)
    assert unchanged(other, other_opt, before)


@pytest.mark.parametrize("how", ["truncate", "bitflip", "delete", "foreign", "header"])
def test_damaged_safetensors_files_are_named_and_leave_the_head_unchanged(tmp_path, how):
    head, _ = make()
    path = tmp_path / "h.safetensors"
    head.save_safetensors(path)
    if how == "header":  # a flipped bit in the header's JSON
        data = bytearray(open(path, "rb").read())
        data[12] ^= 0x01
        open(path, "wb").write(data)
    elif how == "bitflip":  # in the data: only the digest sees it
        data = bytearray(open(path, "rb").read())
        data[-9] ^= 0x01
        open(path, "wb").write(data)
    else:
        _damage(path, how)
    other = make(seed=5)[0]
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(FileNotFoundError if how == "delete" else ck.CheckpointCorruptError, match="h.safetensors"):
        other.load_safetensors(path)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), before))


def test_safetensors_refuses_a_lossy_cast_unless_asked(tmp_path):
    head, _ = make()  # float64
    path = tmp_path / "h.safetensors"
    head.save_safetensors(path)
    f32 = hugehead.ChunkedClassifier(4, 6, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"torch.float64; loading it into this torch.float32 head would cast it lossily"):
        f32.load_safetensors(path)
    f32.load_safetensors(path, dtype=torch.float64)
    assert torch.equal(f32.shards[0].weight, torch.cat([s.weight for s in head.shards]).float())
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(6, 4, dtype=torch.int64)}, str(tmp_path / "ints.safetensors"))
    with pytest.raises(TypeError, match="torch.int64"):
        f32.load_safetensors(tmp_path / "ints.safetensors", strict=False)
    f64 = hugehead.ChunkedClassifier(4, 6, dtype=torch.float64)
    save_file({"weight": torch.full((6, 4), 0.5), "bias": torch.zeros(6)}, str(tmp_path / "f32.safetensors"))
    f64.load_safetensors(tmp_path / "f32.safetensors")  # widening: exact, no dtype= needed
    assert torch.equal(f64.shards[0].weight, torch.full((6, 4), 0.5, dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# A load sees one version while another process keeps re-saving the path
# --------------------------------------------------------------------------------------------------
WRITER = r"""
import sys, torch, hugehead
from hugehead import checkpoint as ck
path, stop = sys.argv[1], sys.argv[2]
head = hugehead.ChunkedClassifier(16, 3000, shard_sizes=[1000, 2000], devices=["cpu", "cpu"], dtype=torch.float32)
v = 0
import os
while not os.path.exists(stop):
    v += 1
    with torch.no_grad():
        for s in head.shards:
            s.weight.fill_(v); s.bias.fill_(v)
    ck.save_checkpoint(path, head, extra={"version": v}, io_threads=4)
    hugehead.ChunkedClassifier.save_safetensors(head, path + ".safetensors")
"""


def test_loads_of_a_path_being_replaced_see_one_whole_version(tmp_path):
    path, stop = str(tmp_path / "live.ckpt"), str(tmp_path / "stop")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path, stop], env=env)
    try:
        head = hugehead.ChunkedClassifier(16, 3000, shard_sizes=[3000], devices=["cpu"], dtype=torch.float32)
        while not os.path.exists(path + ".safetensors"):
            assert writer.poll() is None, "the writer failed"
        versions = []
        for i in range(220):
            if i % 4 == 3:  # safetensors: values only
                head.load_safetensors(path + ".safetensors")
                v = head.shards[0].weight[0, 0].item()
            else:
                v = ck.load_checkpoint(path, head)["version"]
            w, b = head.shards[0].weight, head.shards[0].bias
            assert bool((w == v).all()) and bool((b == v).all()), (i, v, w.unique(), b.unique())
            versions.append(v)
    finally:
        open(stop, "w").close()
        writer.wait(60)
    assert len(set(versions)) > 5  # the writer did replace the path while it was read


# --------------------------------------------------------------------------------------------------
# Temporaries and the previous release's checkpoints
# --------------------------------------------------------------------------------------------------
def test_a_save_removes_stale_temporaries_of_any_name(tmp_path):
    head, opt = make()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a pid that has exited
    stale = [f".step1.safetensors.hugehead-tmp.{pid}.0badc0de", f".step1.ckpt.hugehead-tmp.{pid}.12345678"]
    os.makedirs(tmp_path / stale[1])
    (tmp_path / stale[0]).write_bytes(b"x" * 1000)
    live = f".other.ckpt.hugehead-tmp.{os.getpid()}.abcdef01"  # a running writer's: kept
    (tmp_path / live).write_bytes(b"y")
    mine = tmp_path / "unrelated.hugehead-tmp.txt"  # not of hugehead's naming: kept
    mine.write_bytes(b"z")
    head.save_safetensors(tmp_path / "step2.safetensors")
    assert sorted(os.listdir(tmp_path)) == sorted([live, mine.name, "step2.safetensors"])
    (tmp_path / stale[0]).write_bytes(b"x")
    ck.save_checkpoint(tmp_path / "step3.ckpt", head, opt)
    assert sorted(os.listdir(tmp_path)) == sorted([live, mine.name, "step2.safetensors", "step3.ckpt"])


def test_checkpoints_of_hugehead_0_1_0_still_load():
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    head = hugehead.ChunkedClassifier(4, 6, shard_sizes=[3, 3], devices=["cpu", "cpu"], dtype=torch.float32)
    assert ck.load_checkpoint(FIXTURE / "head.ckpt", head) == {"step": 1, "note": "v0.1.0"}
    assert torch.equal(torch.cat([s.weight for s in head.shards]), expected["weight"])
    assert torch.equal(torch.cat([s.bias for s in head.shards]), expected["bias"])
    same = hugehead.ChunkedClassifier(4, 6, shard_sizes=[2, 4], devices=["cpu", "cpu"], dtype=torch.float32)
    opt = torch.optim.AdamW(same.parameters(), lr=0.1)
    ck.load_checkpoint(FIXTURE / "head.ckpt", same, opt)
    for p, m, v in zip(same.parameters(), expected["exp_avg"], expected["exp_avg_sq"]):
        assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)
    one = hugehead.ChunkedClassifier(4, 6, dtype=torch.float32)
    one.load_safetensors(FIXTURE / "head.safetensors")
    assert torch.equal(one.shards[0].weight, expected["weight"])
