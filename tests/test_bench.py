"""The placement benchmark's pipeline on CPU shards: one vs two shards agree on loss and gradient norms,
and it writes its JSON, table and plot (the GPU run uses the same code at xc6M and 50M classes)."""
import json

import pytest

pytest.importorskip("matplotlib")
from bench import bench_placement  # noqa: E402


def test_placement_benchmark_cpu_smoke(tmp_path):
    assert bench_placement.main(["--cpu-smoke", "--repeats", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "placement.json").read_text())
    one, two = doc["scaling"]
    assert one["devices"] == ["cpu"] and two["devices"] == ["cpu", "cpu"]
    # Same seed, same logical weight in every placement: the sharded head computes the same loss.
    assert two["loss_rel_diff_vs_first"] < 1e-6
    assert two["grad_x_norm_rel_diff_vs_first"] < 1e-5 and two["grad_w_norm_rel_diff_vs_first"] < 1e-5
    assert len(doc["huge"]["losses"]) >= 2 and all(l == l for l in doc["huge"]["losses"])
    assert (tmp_path / "placement.md").read_text().startswith("# ChunkedClassifier placements")
    assert (tmp_path / "placement.png").stat().st_size > 0
