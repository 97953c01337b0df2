"""hugehead.predict_topk / predict_topk_chunks: a DataLoader ranked batch by batch, every batch's chunk the
float64 dense ranking (value descending, ties to the lower class id) of its rows, in the loader's order,
with the batch's targets carried along; heads in several placements, plain (weight, bias) heads and
callables; the loader is consumed lazily (at most one batch ahead of the caller)."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hugehead
from conftest import requires_cuda, requires_multigpu

D, V, K = 3, 29, 6


def dense_topk(x, w, b=None, softcap=None, k=K):
    """float64 logits ranked by (value descending, class id ascending): ``(values, indices)``."""
    z = x.double() @ w.double().T + (0 if b is None else b.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    rows = [sorted(range(z.shape[1]), key=lambda c: (-row[c], c))[:k] for row in z.tolist()]
    idx = torch.tensor(rows, dtype=torch.int64)
    return z.gather(1, idx), idx


def integer_data(n=50, seed=0):
    """Integer-valued features and weights: float32 logits are exact, so ties are real."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, D), generator=g).float()
    w = torch.randint(-2, 3, (V, D), generator=g).float()
    b = torch.randint(-1, 2, (V,), generator=g).float()
    y = torch.randint(0, V, (n,), generator=g)
    return x, w, b, y


def make_head(w, b, devices, **kw):
    head = hugehead.ChunkedClassifier(D, V, devices=devices, chunk_size=4, **kw)
    with torch.no_grad():
        for s in head.shards:
            s.weight.copy_(w[s.start:s.stop])
            s.bias.copy_(b[s.start:s.stop])
    return head


def test_chunks_are_each_batchs_dense_ranking_in_order():
    x, w, b, y = integer_data()
    head = make_head(w, b, ["cpu", "cpu"])
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    chunks = list(hugehead.predict_topk_chunks(head, loader, K, progress=False))
    assert [c.indices.shape for c in chunks] == [(16, K), (16, K), (16, K), (2, K)]
    values, indices = dense_topk(x, w, b)
    assert torch.equal(torch.cat([c.indices for c in chunks]), indices)
    assert torch.equal(torch.cat([c.values for c in chunks]).double(), values)
    assert torch.equal(torch.cat([c.target for c in chunks]), y)
    assert all(c.indices.dtype == torch.int64 and c.indices.device.type == "cpu" for c in chunks)
    whole = hugehead.predict_topk(head, loader, K, progress=False)
    assert torch.equal(whole.indices, indices) and torch.equal(whole.target, y)
    # The metrics take the result as it comes.
    acc = hugehead.metrics.accuracy_at_k(whole.indices, whole.target, [1, 5])
    expected = [(indices[:, :k] == y[:, None]).any(1).double().mean() for k in (1, 5)]
    assert acc.tolist() == pytest.approx([float(e) for e in expected])


def test_plain_weight_and_bias_with_softcap_and_chunk_options():
    x, w, b, _ = integer_data(seed=1)
    loader = DataLoader(x, batch_size=7)  # batches are bare feature tensors: no target
    got = hugehead.predict_topk((w, b), loader, K, softcap=2.5, chunk_size=5, progress=False)
    values, indices = dense_topk(x, w, b, softcap=2.5)
    assert got.target is None
    # softcap's tanh is not exact in float32: values close; the ranking of exact ties still by class id.
    assert torch.allclose(got.values.double(), values, rtol=1e-6, atol=1e-6)
    plain = hugehead.predict_topk(w, loader, K, progress=False)
    assert torch.equal(plain.indices, dense_topk(x, w)[1])
    linear = torch.nn.Linear(D, V).to(torch.bfloat16)  # its dtype: the float32 features are cast to it
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    got = hugehead.predict_topk(linear, loader, K, progress=False)
    assert got.values.dtype == torch.bfloat16 and torch.equal(got.indices, dense_topk(x, w, b)[1])


def test_features_and_target_functions_dict_batches_and_callables():
    x, w, b, y = integer_data(seed=2)
    head = make_head(w, b, ["cpu"])
    batches = [{"inputs": x[i:i + 8] / 2, "labels": y[i:i + 8]} for i in range(0, x.shape[0], 8)]
    got = hugehead.predict_topk(head, batches, K, features=lambda bt: bt["inputs"] * 2,
                                target=lambda bt: bt["labels"], progress=False)
    assert torch.equal(got.indices, dense_topk(x, w, b)[1]) and torch.equal(got.target, y)
    mapping = [{"features": x[i:i + 8], "target": y[i:i + 8]} for i in range(0, x.shape[0], 8)]
    assert torch.equal(hugehead.predict_topk(head, mapping, K, progress=False).target, y)
    # A callable ranker (here the dense float64 ranking itself) and list-of-tensor targets joined.
    labels = [[torch.tensor([int(t)])] for t in y]
    pairs = [(x[i:i + 10], [l[0] for l in labels[i:i + 10]]) for i in range(0, x.shape[0], 10)]
    got = hugehead.predict_topk(lambda xb, k: dense_topk(xb, w, b, k=k), pairs, 3, progress=False)
    assert torch.equal(got.indices, dense_topk(x, w, b, k=3)[1])
    assert isinstance(got.target, list) and len(got.target) == x.shape[0]
    precision = hugehead.metrics.precision_at_k(got.indices, got.target, 1)
    assert precision == hugehead.metrics.accuracy_at_k(got.indices, y, 1)


def test_sparse_targets_are_joined():
    x, w, b, _ = integer_data(n=12, seed=3)
    labels = torch.zeros(12, V)
    labels[torch.arange(12), torch.arange(12)] = 1
    for layout in (torch.sparse_coo, torch.sparse_csr):
        batches = [(x[:5], labels[:5].to_sparse(layout=layout)), (x[5:], labels[5:].to_sparse(layout=layout))]
        got = hugehead.predict_topk((w, b), batches, 2, progress=False)
        assert got.target.layout == layout and torch.equal(got.target.to_dense(), labels)


def test_the_loader_is_consumed_one_batch_ahead_at_most():
    x, w, b, y = integer_data()
    seen = []

    def loader():
        for i in range(0, x.shape[0], 10):
            seen.append(i)
            yield x[i:i + 10], y[i:i + 10]

    it = hugehead.predict_topk_chunks((w, b), loader(), K, progress=False)
    first = next(it)
    assert first.indices.shape == (10, K) and len(seen) <= 2
    second = next(it)
    assert len(seen) <= 3 and torch.equal(second.target, y[10:20])
    it.close()


def test_progress_bar_counts_batches_and_rows(capsys):
    x, w, b, y = integer_data(n=30)
    hugehead.predict_topk((w, b), DataLoader(TensorDataset(x, y), batch_size=10), 2, desc="ranking")
    err = capsys.readouterr().err
    assert "ranking" in err and "3/3" in err and "rows=30" in err
    hugehead.predict_topk((w, b), DataLoader(TensorDataset(x, y), batch_size=10), 2, progress=False)
    assert capsys.readouterr().err == ""


def test_bad_arguments_raise():
    x, w, b, y = integer_data()
    head = make_head(w, b, ["cpu"])
    with pytest.raises(TypeError, match="softcap, chunk_size and memory_budget"):
        list(hugehead.predict_topk_chunks(head, [x], K, softcap=2.0, progress=False))
    with pytest.raises(TypeError, match="cannot find the features"):
        list(hugehead.predict_topk_chunks(head, [{"inputs": x}], K, progress=False))
    with pytest.raises(TypeError, match="model must be"):
        list(hugehead.predict_topk_chunks(3, [x], K, progress=False))
    with pytest.raises(ValueError, match="k must be"):
        list(hugehead.predict_topk_chunks(head, [x], V + 1, progress=False))
    with pytest.raises(ValueError, match="k must be"):
        list(hugehead.predict_topk_chunks((w, b), [x], V + 1, progress=False))
    with pytest.raises(ValueError, match="no batches"):
        hugehead.predict_topk(head, [], K, progress=False)


def test_features_are_cast_to_the_heads_dtype_or_autocast():
    x, w, b, y = integer_data(seed=4)
    head = make_head(w, b, ["cpu", "cpu"]).to(torch.bfloat16)
    got = hugehead.predict_topk(head, [(x.double(), y)], K, progress=False)  # float64 features cast to bf16
    assert got.values.dtype == torch.bfloat16 and torch.equal(got.indices, dense_topk(x, w, b)[1])
    head32 = make_head(w, b, ["cpu"])
    got = hugehead.predict_topk(head32, [(x, y)], K, autocast=torch.bfloat16, progress=False)
    assert got.values.dtype == torch.bfloat16 and torch.equal(got.indices, dense_topk(x, w, b)[1])


@requires_cuda
def test_cuda_head_results_come_back_pinned_on_the_host():
    x, w, b, y = integer_data(n=300)
    head = make_head(w, b, ["cuda"])
    chunks = list(hugehead.predict_topk_chunks(head, DataLoader(TensorDataset(x, y), batch_size=64), K,
                                               progress=False))
    assert all(c.indices.device.type == "cpu" and c.indices.is_pinned() for c in chunks)
    assert torch.equal(torch.cat([c.indices for c in chunks]), dense_topk(x, w, b)[1])
    plain = hugehead.predict_topk((w.cuda(), b.cuda()), DataLoader(x, batch_size=64), K, progress=False)
    assert torch.equal(plain.indices, dense_topk(x, w, b)[1])


@requires_cuda
def test_offloaded_head():
    x, w, b, y = integer_data(n=200)
    head = make_head(w, b, ["cuda"], offload=True)
    got = hugehead.predict_topk(head, DataLoader(TensorDataset(x, y), batch_size=64), K, progress=False)
    assert torch.equal(got.indices, dense_topk(x, w, b)[1])


@requires_multigpu
def test_head_over_two_gpus():
    x, w, b, y = integer_data(n=200)
    head = make_head(w, b, ["cuda:0", "cuda:1"])
    got = hugehead.predict_topk(head, DataLoader(TensorDataset(x, y), batch_size=64), K, progress=False)
    assert torch.equal(got.indices, dense_topk(x, w, b)[1])


def test_bench_predict_smoke_writes_records(tmp_path):
    """bench/bench_predict.py's pipeline, tiny, on the CPU: one record per k, the prediction's ids equal to
    the bare top-k's."""
    import json

    from bench import bench_predict

    bench_predict.main(["--cpu-smoke", "--out", str(tmp_path), "--k", "5", "--batches", "2", "--reps", "1",
                        "--warmup", "0"])
    doc = json.loads((tmp_path / "predict.json").read_text())
    assert doc["meta"]["smoke"] and [r["k"] for r in doc["rows"]] == [5]
    row = doc["rows"][0]
    assert row["same_indices"] and row["batches"] == 2 and row["topk_ms"] > 0 and row["predict_ms"] > 0
    assert (tmp_path / "predict.md").read_text().count("| tiny |") == 1
