"""examples/lightning_6m.py in its CPU smoke mode: fit and test (with only a test dataloader) both run,
the head keeps its two shards, and Lightning-style moves of the module leave the head's shards in place."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="examples/lightning_6m.py needs PyTorch Lightning (pip install lightning)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_6m.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("lightning_6m", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load_example()


def test_cpu_smoke_fit_then_test(example):
    steps = 25
    result = example.main(["--cpu", "--classes", "3000", "--dim", "32", "--steps", str(steps), "--batch", "64",
                           "--test-size", "256", "--no-progress"])
    trainer, model, metrics = result["trainer"], result["model"], result["test_metrics"]
    assert trainer.global_step == steps  # fit ran every step
    assert set(metrics) == {"test_loss", "test_acc"}  # test ran, with only a test dataloader
    assert math.isfinite(metrics["test_loss"])
    assert metrics["test_loss"] < math.log(3000)  # it learned something
    assert [str(s.device) for s in model.head.shards] == ["cpu", "cpu"]
    assert [(s.start, s.stop) for s in model.head.shards] == [(0, 1500), (1500, 3000)]


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
