"""examples/hf_bert_6m.py in its CPU smoke mode: a patched BertForSequenceClassification fits in Lightning
(the loss falls), the head keeps its two CPU shards, and the test's accuracy@k equals top-k of the full
logits of the trained model."""
import math

import pytest
import torch

from conftest import load_example

pytest.importorskip("lightning")
pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")


def test_cpu_smoke_fit_then_test_with_accuracy_at_k():
    example = load_example("hf_bert_6m")
    argv = ["--cpu", "--classes", "500", "--dim", "32", "--steps", "12", "--batch", "32", "--test-size", "96",
            "--head-lr", "1e-2", "--no-progress"]
    result = example.main(argv)
    model, metrics = result["model"], result["test_metrics"]
    assert result["trainer"].global_step == 12
    assert set(metrics) == {"test_loss", "test_acc@1", "test_acc@5", "test_acc@10"}
    assert math.isfinite(metrics["test_loss"]) and result["last_loss"] < result["first_loss"]
    assert 0.0 < result["baseline"][1] <= result["baseline"][10] < 1.0
    assert [str(s.device) for s in model.classifier.shards] == ["cpu", "cpu"]

    # The same test set, scored from the full logits of the trained (unpatched-equivalent) head.
    args = example.parse_args(argv)
    test = example.synthetic_sequences(args.test_size, args.classes, args.seq_len, args.token_vocab, args.zipf,
                                       args.corrupt, seed=args.seed + 2)
    tokens, target = test.tensors
    model.eval()
    with torch.no_grad():
        logits = model.classifier.logits(example.head_inputs(model, input_ids=tokens))
    top = logits.topk(10).indices
    for k in (1, 5, 10):
        expected = float((top[:, :k] == target[:, None]).any(dim=1).double().mean())
        assert metrics[f"test_acc@{k}"] == pytest.approx(expected, abs=1e-6), k


@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
def test_bench_transformers_cpu_smoke(tmp_path):
    """bench/bench_transformers.py's pipeline on tiny shapes: every hugehead row measured, the patched and
    unpatched models' losses equal (same seed, same inputs), the JSON and markdown written."""
    import json

    from bench import bench_transformers

    out = tmp_path / "transformers.json"
    # 0.00014 GiB: the tiny Llama's 64 rows go through the rows plan in 2 blocks (gradients in the forward).
    assert bench_transformers.main(["--cpu-smoke", "--out", str(out), "--reps", "1", "--warmup", "0",
                                    "--budgets", "0.00014"]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["smoke"] and doc["meta"]["transformers"] == __import__("transformers").__version__
    for section in ("llama", "bert_6m"):
        rows = {r["impl"]: r for r in doc[section]}
        assert rows["hugehead"]["status"] == rows["unpatched"]["status"] == "ok"
        assert rows["hugehead"]["loss"] == pytest.approx(rows["unpatched"]["loss"], rel=1e-5 if section == "llama" else 5e-3)
        assert rows["hugehead"]["step_ms"] > 0
    llama = {r["impl"]: r for r in doc["llama"]}
    assert set(llama) == {"unpatched", "hugehead", "hugehead_0.00014gib", "hugehead_recompute_1.5gib", "liger"}
    # Each hugehead row records its plan's kind; the tiny budget's is the rows plan, and its loss is the same.
    assert llama["hugehead_0.00014gib"]["plan"]["kind"] == "rows" and llama["hugehead_0.00014gib"]["plan"]["blocks"] > 1
    assert llama["hugehead"]["plan"]["kind"] == "kept"  # the default budget holds the tiny model's logits
    assert llama["hugehead_0.00014gib"]["loss"] == pytest.approx(llama["unpatched"]["loss"], rel=1e-5)
    assert "LlamaForCausalLM" in (tmp_path / "transformers.md").read_text()
