"""examples/lightning_6m.py in its CPU smoke mode: fit and test (with only a test dataloader) both run,
the test reports accuracy@1 and @5 from the head's top-k (checked against the float64 dense ranking of the
trained model) beside the always-most-frequent baseline, the head keeps its two shards, Lightning-style moves of the module leave the head's shards in place, the
precisions build the head in the right dtype, and a fit resumed from a checkpoint (sharded directory or
Lightning file) ends bitwise where an uninterrupted fit does."""
import math
import os
import re

import pytest
import torch

from conftest import load_example

pytest.importorskip("lightning", reason="examples/lightning_6m.py needs PyTorch Lightning (pip install lightning)")

# Lightning's own deprecation warning, raised inside its loops.
pytestmark = pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")


@pytest.fixture(scope="module")
def example():
    return load_example("lightning_6m")


def test_cpu_smoke_fit_then_test(example, capsys):
    steps = 25
    args = ["--cpu", "--classes", "3000", "--dim", "32", "--steps", str(steps), "--batch", "64", "--test-size", "256",
            "--no-progress"]
    result = example.main(args)
    out = capsys.readouterr().out
    trainer, model, metrics = result["trainer"], result["model"], result["test_metrics"]
    assert trainer.global_step == steps  # fit ran every step
    assert set(metrics) == {"test_loss", "test_acc@1", "test_acc@5"}  # test ran, with only a test dataloader
    assert math.isfinite(metrics["test_loss"])
    assert metrics["test_loss"] < math.log(3000)  # it learned something
    assert [str(s.device) for s in model.head.shards] == ["cpu", "cpu"]
    assert [(s.start, s.stop) for s in model.head.shards] == [(0, 1500), (1500, 3000)]

    # The accuracies are those of the trained model's dense float64 ranking (value descending, ties to the
    # lower class id) on the test set, and the baseline that of the k most frequent training classes.
    args_ns = example.parse_args(args)
    test = example.synthetic_sequences(256, 3000, args_ns.seq_len, args_ns.token_vocab, args_ns.zipf,
                                       args_ns.corrupt, seed=args_ns.seed + 2)
    train = example.synthetic_sequences(steps * 64, 3000, args_ns.seq_len, args_ns.token_vocab, args_ns.zipf,
                                        args_ns.corrupt, seed=args_ns.seed + 1)
    tokens, target = test.tensors
    with torch.no_grad():
        features = model.backbone(tokens).double()
    weight = torch.cat([s.weight.detach() for s in model.head.shards]).double()
    bias = torch.cat([s.bias.detach() for s in model.head.shards]).double()
    logits = features @ weight.T + bias
    order = torch.stack([torch.tensor(sorted(range(3000), key=lambda c, row=row: (-row[c], c))[:5])
                         for row in logits.tolist()])
    for k in (1, 5):
        expected = float((order[:, :k] == target[:, None]).any(1).double().mean())
        assert metrics[f"test_acc@{k}"] == pytest.approx(expected, abs=1.5 / 256), k  # float32 vs float64 near-ties
    counts = torch.bincount(train.tensors[1], minlength=3000).tolist()
    frequent = sorted(range(3000), key=lambda c: (-counts[c], c))[:5]
    baseline = {k: sum(int(t) in frequent[:k] for t in target) / 256 for k in (1, 5)}
    assert result["baseline"] == pytest.approx(baseline) and result["chance_most_frequent"] == baseline[1]
    line = re.search(r"test accuracy @1 ([\d.]+), @5 ([\d.]+); always-most-frequent @1 ([\d.]+), @5 ([\d.]+)", out)
    assert line, out
    acc1, acc5, base1, base5 = map(float, line.groups())
    assert (acc1, acc5) == (round(metrics["test_acc@1"], 4), round(metrics["test_acc@5"], 4))
    assert (base1, base5) == (round(baseline[1], 4), round(baseline[5], 4))
    assert acc5 >= acc1 and base5 >= base1


def test_lightning_style_moves_leave_the_head_in_place(example):
    # Lightning calls model.to(root_device) before fit/test and model.cpu() after fit.
    model = example.HugeHeadModule(500, 16, 64, 8, ["cpu", "cpu"], torch.float32, lr=1e-3, heads=2)
    model.to("meta")
    assert model.backbone.tokens.weight.device.type == "meta"
    assert all(s.weight.device.type == "cpu" and s.bias.device.type == "cpu" for s in model.head.shards)
    # The head belongs to the module: its Parameters are trained and checkpointed with it.
    names = {n for n, _ in model.named_parameters()}
    assert {"head.shards.0.weight", "head.shards.1.bias"} <= names
    assert "head.weight" in model.state_dict()


TINY = ["--cpu", "--classes", "500", "--dim", "16", "--batch", "16", "--test-size", "64", "--no-progress"]


@pytest.mark.parametrize("precision,param_dtype", [("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16)])
def test_cpu_precisions(example, precision, param_dtype):
    result = example.main(TINY + ["--steps", "8", "--precision", precision])
    model, metrics = result["model"], result["test_metrics"]
    assert result["trainer"].precision == precision
    # bf16-mixed: float32 master weights (the head computes in bf16 under autocast); bf16-true: bf16 weights.
    assert {p.dtype for p in model.head.parameters()} == {param_dtype}
    assert model.backbone.tokens.weight.dtype == param_dtype
    assert math.isfinite(metrics["test_loss"]) and metrics["test_loss"] < math.log(500)


@pytest.fixture(scope="module")
def uninterrupted(example):
    """10 steps over two epochs of 5 batches, no checkpoints."""
    return example.main(TINY + ["--train-size", "80", "--steps", "10"])


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("fmt", ["dcp", "lightning"])
def test_cpu_resume_matches_uninterrupted_fit(example, uninterrupted, tmp_path, fmt):
    args = TINY + ["--train-size", "80", "--ckpt-format", fmt, "--ckpt-dir", str(tmp_path)]
    first = example.main(args + ["--steps", "5"])  # stops at an epoch boundary, saves last.ckpt
    last = tmp_path / "last.ckpt"
    assert first["last_checkpoint"] == str(last) and last.is_dir() == (fmt == "dcp")
    resumed = example.main(args + ["--steps", "10", "--ckpt-path", str(last)])
    assert resumed["trainer"].global_step == 10
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # rewritten in place, no temporaries
    expected = dict(uninterrupted["model"].named_parameters())
    for name, param in resumed["model"].named_parameters():
        assert torch.equal(param, expected[name]), name
    # The test ran on the weights read back from last.ckpt, which the resumed fit rewrote at step 10.
    assert resumed["test_metrics"] == uninterrupted["test_metrics"]
