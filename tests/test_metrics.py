"""hugehead.metrics against textbook references: scores computed densely in float64, ranked row by row
with the tie rule (value descending, ties to the lower class id), and each metric computed by its
definition in plain Python; the head's streaming top-k feeds the same metrics with the same answers; the
streaming (torchmetrics) versions accumulate batches to the values of the whole set; torchmetrics' dense
metrics agree where their tie handling cannot differ."""
import math
import os
import random

import pytest
import torch

import hugehead
from hugehead import metrics as M

pytest.importorskip("torchmetrics")


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------
def dense_ranking(scores: torch.Tensor, k: int):
    """Row-by-row ranking of float64 ``scores [N, V]`` by (value descending, class id ascending)."""
    return [sorted(range(len(row)), key=lambda c: (-row[c], c))[:k] for row in scores.double().tolist()]


def ref_accuracy(ranking, target, k, ignore_index=None):
    rows = [(r, t) for r, t in zip(ranking, target) if t != ignore_index]
    return sum(t in r[:k] for r, t in rows) / len(rows) if rows else math.nan


def ref_precision(ranking, labels, k):
    return sum(len(set(r[:k]) & y) / k for r, y in zip(ranking, labels)) / len(ranking)


def _dcg(gains):
    return sum(g / math.log2(j + 2) for j, g in enumerate(gains))


def ref_ndcg(ranking, labels, k):
    total = 0.0
    for r, y in zip(ranking, labels):
        if y:
            total += _dcg([c in y for c in r[:k]]) / _dcg([1] * min(k, len(y)))
    return total / len(ranking)


def ref_psp(ranking, labels, w, k, normalize):
    num = sum(sum(w[c] for c in r[:k] if c in y) / k for r, y in zip(ranking, labels))
    if not normalize:
        return num / len(ranking)
    best = sum(sum(sorted((w[c] for c in y), reverse=True)[:k]) / k for y in labels)
    return num / best


def ref_psndcg(ranking, labels, w, k):
    num = sum(_dcg([w[c] if c in y else 0.0 for c in r[:k]]) for r, y in zip(ranking, labels))
    best = sum(_dcg(sorted((w[c] for c in y), reverse=True)[:k]) for y in labels)
    return num / best


def ref_inverse_propensity(freq, n, a, b):
    c = (math.log(n) - 1) * (b + 1) ** a
    return [1.0 / (1.0 / (1 + c * math.exp(-a * math.log(f + b)))) for f in freq]


# --------------------------------------------------------------------------------------------------
# Data: scores with many exact ties (small integers), labels with empty rows
# --------------------------------------------------------------------------------------------------
N, V, K = 40, 23, 7


def tied_scores(seed=0, n=N, v=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n, v), generator=g).double()


def random_labels(seed=0, n=N, v=V):
    rnd = random.Random(seed)
    labels = [set(rnd.sample(range(v), rnd.choice([0, 1, 2, 3, 5, 9]))) for _ in range(n)]
    labels[0] = set()  # at least one row without labels
    return labels


def as_tensors(labels):
    return [torch.tensor(sorted(y), dtype=torch.int64) for y in labels]


def as_coo(labels, v=V):
    rows = [i for i, y in enumerate(labels) for _ in y]
    cols = [c for y in labels for c in sorted(y)]
    return torch.sparse_coo_tensor(torch.tensor([rows, cols], dtype=torch.int64).reshape(2, -1),
                                   torch.ones(len(rows)), (len(labels), v))


def ranking_tensor(ranking):
    return torch.tensor(ranking, dtype=torch.int64)


KS = [1, 3, 5, 7]


# --------------------------------------------------------------------------------------------------
# Functions vs the references
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_accuracy_at_k_matches_textbook(seed):
    scores = tied_scores(seed)
    ranking = dense_ranking(scores, K)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed + 7))
    target[:3] = torch.tensor(ranking)[:3, 0]  # some sure hits
    got = M.accuracy_at_k(ranking_tensor(ranking), target, KS)
    assert got.dtype == torch.float64 and got.shape == (len(KS),)
    assert got.tolist() == pytest.approx([ref_accuracy(ranking, target.tolist(), k) for k in KS], abs=1e-12)
    assert float(M.accuracy_at_k(ranking_tensor(ranking), target, 5)) == pytest.approx(
        ref_accuracy(ranking, target.tolist(), 5), abs=1e-12)
    target[5:9] = -100
    got = M.accuracy_at_k(ranking_tensor(ranking), target, KS, ignore_index=-100)
    assert got.tolist() == pytest.approx([ref_accuracy(ranking, target.tolist(), k, -100) for k in KS], abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_multilabel_metrics_match_textbook(seed):
    scores = tied_scores(seed)
    ranking = dense_ranking(scores, K)
    labels = random_labels(seed)
    idx = ranking_tensor(ranking)
    freq = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(seed))
    w = M.inverse_propensity(freq, 1000)
    wl = w.tolist()
    for fmt in (as_tensors(labels), as_coo(labels), as_coo(labels).to_sparse_csr()):
        assert M.precision_at_k(idx, fmt, KS).tolist() == pytest.approx(
            [ref_precision(ranking, labels, k) for k in KS], abs=1e-12)
        assert M.ndcg_at_k(idx, fmt, KS).tolist() == pytest.approx(
            [ref_ndcg(ranking, labels, k) for k in KS], abs=1e-12)
        for normalize in (False, True):
            assert M.psprecision_at_k(idx, fmt, w, KS, normalize=normalize).tolist() == pytest.approx(
                [ref_psp(ranking, labels, wl, k, normalize) for k in KS], abs=1e-12)
        assert M.psndcg_at_k(idx, fmt, w, KS).tolist() == pytest.approx(
            [ref_psndcg(ranking, labels, wl, k) for k in KS], abs=1e-12)
    # An int k gives a scalar; a perfect ranking has normalized PSP@k = PSnDCG@k = 1 when every row
    # has labels.
    assert M.precision_at_k(idx, as_tensors(labels), 3).shape == ()
    full = [y or {0} for y in labels]
    perfect = ranking_tensor([(sorted(y, key=lambda c: -wl[c]) + [c for c in range(V) if c not in y])[:K]
                              for y in full])
    assert M.psprecision_at_k(perfect, as_tensors(full), w, KS, normalize=True).tolist() == pytest.approx([1.0] * 4)
    assert M.psndcg_at_k(perfect, as_tensors(full), w, KS).tolist() == pytest.approx([1.0] * 4)


def test_label_formats_duplicates_and_explicit_zeros():
    """Uncoalesced COO with repeated entries and stored zeros, lists with repeats: a label counts once and
    a stored zero is no label."""
    ranking = dense_ranking(tied_scores(3), K)
    labels = random_labels(3)
    idx = ranking_tensor(ranking)
    expected = M.precision_at_k(idx, as_tensors(labels), KS)
    coo = as_coo(labels)
    rows, cols = coo._indices()
    # Stored zeros at classes that rank first in rows 1 and 2 but are not their labels.
    zeros = [(i, ranking[i][0]) for i in (1, 2) if ranking[i][0] not in labels[i]]
    assert zeros
    extra = torch.tensor(zeros).T
    messy = torch.sparse_coo_tensor(
        torch.stack([torch.cat([rows, rows, extra[0]]), torch.cat([cols, cols, extra[1]])]),
        torch.cat([torch.ones(2 * rows.numel()), torch.zeros(len(zeros))]), (N, V))
    assert not messy.is_coalesced()
    got = M.precision_at_k(idx, messy, KS)
    assert got.tolist() == pytest.approx([ref_precision(ranking, labels, k) for k in KS], abs=1e-12)
    assert torch.equal(got, expected)
    repeated = [torch.cat([t, t]) for t in as_tensors(labels)]
    assert torch.equal(M.ndcg_at_k(idx, repeated, KS), M.ndcg_at_k(idx, as_tensors(labels), KS))


def test_inverse_propensity_and_frequencies():
    labels = random_labels(4)
    freq = M.label_frequencies(as_coo(labels), V)
    assert freq.tolist() == [sum(c in y for y in labels) for c in range(V)]
    assert torch.equal(M.label_frequencies(as_tensors(labels), V), freq)
    assert torch.equal(M.label_frequencies([torch.cat([t, t]) for t in as_tensors(labels)], V), freq)
    single = torch.tensor([3, 3, 1, -100, 0, 3])
    assert M.label_frequencies(single, 5).tolist() == [1, 1, 0, 3, 0]
    for name, (a, b) in M.PROPENSITY_PARAMETERS.items():
        got = M.inverse_propensity(freq, len(labels), a, b)
        assert got.dtype == torch.float64
        assert got.tolist() == pytest.approx(ref_inverse_propensity(freq.tolist(), len(labels), a, b), rel=1e-12), name
    assert M.PROPENSITY_PARAMETERS["default"] == (0.55, 1.5)
    assert M.PROPENSITY_PARAMETERS["amazon"] == (0.6, 2.6) and M.PROPENSITY_PARAMETERS["wikipedia"] == (0.5, 0.4)
    # Rarer labels weigh more.
    w = M.inverse_propensity(torch.tensor([0, 1, 10, 1000]), 10_000)
    assert bool((w.diff() < 0).all()) and float(w[-1]) > 1


def test_most_frequent_topk_baseline():
    freq = torch.tensor([5, 9, 9, 0, 7, 9])
    idx = M.most_frequent_topk(freq, 4, rows=3)
    assert idx.shape == (3, 4) and idx.tolist() == [[1, 2, 5, 4]] * 3  # ties to the lower class id
    target = torch.tensor([1, 4, 0])
    assert M.accuracy_at_k(idx, target, [1, 4]).tolist() == pytest.approx([1 / 3, 2 / 3])


# --------------------------------------------------------------------------------------------------
# The head's streaming top-k feeds the metrics: same answers as the dense ranking
# --------------------------------------------------------------------------------------------------
def test_metrics_from_the_heads_topk_match_dense_ranking():
    """Integer-valued features and weights: float32 logits are exact, so ties are real and the head's
    ranking (two shards, chunks of 4 classes) must be the dense float64 one with the tie rule."""
    g = torch.Generator().manual_seed(11)
    d = 3
    x = torch.randint(-2, 3, (N, d), generator=g).float()
    w = torch.randint(-2, 3, (V, d), generator=g).float()
    b = torch.randint(-1, 2, (V,), generator=g).float()
    head = hugehead.ChunkedClassifier(d, V, devices=["cpu", "cpu"], chunk_size=4)
    with torch.no_grad():
        for s in head.shards:
            s.weight.copy_(w[s.start:s.stop])
            s.bias.copy_(b[s.start:s.stop])
    _, top = head.topk(x, K)
    ranking = dense_ranking(x.double() @ w.double().T + b.double(), K)
    assert top.tolist() == ranking
    target = torch.randint(0, V, (N,), generator=g)
    labels = random_labels(5)
    assert M.accuracy_at_k(top, target, KS).tolist() == pytest.approx(
        [ref_accuracy(ranking, target.tolist(), k) for k in KS], abs=1e-12)
    assert M.ndcg_at_k(top, as_coo(labels), KS).tolist() == pytest.approx(
        [ref_ndcg(ranking, labels, k) for k in KS], abs=1e-12)


# --------------------------------------------------------------------------------------------------
# torchmetrics' dense metrics agree (tie-free scores: their tie handling is not ours)
# --------------------------------------------------------------------------------------------------
def test_agrees_with_torchmetrics_dense_metrics_without_ties():
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.retrieval import RetrievalNormalizedDCG, RetrievalPrecision

    g = torch.Generator().manual_seed(2)
    # Positive scores: torchmetrics 1.9's retrieval_precision counts a hit only where the score is > 0.
    scores = torch.rand(N, V, generator=g, dtype=torch.float64) + 0.5
    idx = torch.topk(scores, K).indices
    target = torch.randint(0, V, (N,), generator=g)
    for k in (1, 5):
        acc = MulticlassAccuracy(num_classes=V, top_k=k, average="micro")(scores.float(), target)
        assert float(M.accuracy_at_k(idx, target, k)) == pytest.approx(float(acc), abs=1e-6)
    labels = random_labels(6)
    dense_labels = as_coo(labels).to_dense().bool()
    queries = torch.arange(N)[:, None].expand(N, V)
    for k in (1, 3, 7):
        prec = RetrievalPrecision(top_k=k, empty_target_action="neg")(scores.flatten(), dense_labels.flatten(),
                                                                      indexes=queries.flatten())
        ndcg = RetrievalNormalizedDCG(top_k=k, empty_target_action="neg")(scores.flatten(), dense_labels.flatten(),
                                                                          indexes=queries.flatten())
        assert float(M.precision_at_k(idx, as_coo(labels), k)) == pytest.approx(float(prec), abs=1e-6)
        assert float(M.ndcg_at_k(idx, as_coo(labels), k)) == pytest.approx(float(ndcg), abs=1e-6)


# --------------------------------------------------------------------------------------------------
# Streaming versions
# --------------------------------------------------------------------------------------------------
def test_streaming_metrics_accumulate_to_the_whole_set():
    ranking = dense_ranking(tied_scores(8), K)
    idx = ranking_tensor(ranking)
    labels = random_labels(8)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(8))
    target[:4] = -100
    w = M.inverse_propensity(M.label_frequencies(as_coo(labels), V), N)
    wl = w.tolist()
    made = {
        "acc": (M.AccuracyAtK(5, ignore_index=-100), ref_accuracy(ranking, target.tolist(), 5, -100)),
        "p": (M.PrecisionAtK(3), ref_precision(ranking, labels, 3)),
        "ndcg": (M.NDCGAtK(5), ref_ndcg(ranking, labels, 5)),
        "psp": (M.PSPrecisionAtK(5, w), ref_psp(ranking, labels, wl, 5, False)),
        "psp_norm": (M.PSPrecisionAtK(3, w, normalize=True), ref_psp(ranking, labels, wl, 3, True)),
        "psndcg": (M.PSNDCGAtK(7, w), ref_psndcg(ranking, labels, wl, 7)),
    }
    for lo, hi in [(0, 13), (13, 14), (14, 30), (30, N)]:  # unequal batches, a one-row batch
        coo = as_coo(labels[lo:hi])
        for name, (metric, _) in made.items():
            if name == "acc":
                metric.update(idx[lo:hi], target[lo:hi])
            else:
                metric.update(idx[lo:hi], coo.to_sparse_csr() if name == "p" else coo)
    for name, (metric, expected) in made.items():
        got = metric.compute()
        assert got.dtype == torch.float64 and got.shape == ()
        assert float(got) == pytest.approx(expected, abs=1e-12), name
    # States are sums: what a distributed reduction adds up. Two halves merged give the whole.
    first, second = M.PSPrecisionAtK(3, w, normalize=True), M.PSPrecisionAtK(3, w, normalize=True)
    first.update(idx[:25], as_tensors(labels[:25]))
    second.update(idx[25:], as_tensors(labels[25:]))
    first.merge_state(second)
    assert float(first.compute()) == pytest.approx(ref_psp(ranking, labels, wl, 3, True), abs=1e-12)
    # reset() starts over.
    metric = made["p"][0]
    metric.reset()
    metric.update(idx[:5], as_tensors(labels[:5]))
    assert float(metric.compute()) == pytest.approx(ref_precision(ranking[:5], labels[:5], 3), abs=1e-12)


def test_streaming_metrics_take_k_as_the_functions_do():
    """An int k gives a scalar, a sequence of ks a [len(k)] vector, as from the functions; each entry
    matches the textbook reference over unequal batches."""
    ranking = dense_ranking(tied_scores(10), K)
    idx = ranking_tensor(ranking)
    labels = random_labels(10)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(10))
    target[:3] = -100
    w = M.inverse_propensity(M.label_frequencies(as_coo(labels), V), N)
    wl = w.tolist()
    ks = (1, 3, 5)
    made = {
        "acc": (M.AccuracyAtK(ks, ignore_index=-100), [ref_accuracy(ranking, target.tolist(), k, -100) for k in ks]),
        "p": (M.PrecisionAtK(list(ks)), [ref_precision(ranking, labels, k) for k in ks]),
        "ndcg": (M.NDCGAtK(ks), [ref_ndcg(ranking, labels, k) for k in ks]),
        "psp": (M.PSPrecisionAtK(ks, w), [ref_psp(ranking, labels, wl, k, False) for k in ks]),
        "psp_norm": (M.PSPrecisionAtK(ks, w, normalize=True), [ref_psp(ranking, labels, wl, k, True) for k in ks]),
        "psndcg": (M.PSNDCGAtK(ks, w), [ref_psndcg(ranking, labels, wl, k) for k in ks]),
    }
    for lo, hi in [(0, 11), (11, 12), (12, N)]:
        for name, (metric, _) in made.items():
            metric.update(idx[lo:hi], target[lo:hi] if name == "acc" else as_coo(labels[lo:hi]))
    for name, (metric, expected) in made.items():
        got = metric.compute()
        assert got.dtype == torch.float64 and got.shape == (3,), name
        assert got.tolist() == pytest.approx(expected, abs=1e-12), name
    function = M.accuracy_at_k(idx, target, ks, ignore_index=-100)
    assert torch.equal(made["acc"][0].compute(), function)
    single = M.AccuracyAtK(3)
    single.update(idx, target)
    assert single.compute().shape == () and torch.equal(single.compute(), M.accuracy_at_k(idx, target, 3))
    with pytest.raises(ValueError, match="only 3 columns"):
        M.AccuracyAtK((1, 5)).update(idx[:, :3], target)
    for bad in (0, (), (1, 0), 1.5, True, "5"):
        with pytest.raises(ValueError, match="k must be"):
            M.NDCGAtK(bad)


def test_streaming_metrics_in_a_metric_collection():
    from torchmetrics import MetricCollection

    ranking = dense_ranking(tied_scores(9), K)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(9))
    coll = MetricCollection({"acc@1": M.AccuracyAtK(1), "acc@5": M.AccuracyAtK(5)})
    coll.update(ranking_tensor(ranking), target)
    got = {k: float(v) for k, v in coll.compute().items()}
    assert got == pytest.approx({"acc@1": ref_accuracy(ranking, target.tolist(), 1),
                                 "acc@5": ref_accuracy(ranking, target.tolist(), 5)})


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    idx = torch.tensor([[0, 1, 2], [2, 1, 0]])
    target = torch.tensor([0, 1])
    labels = [torch.tensor([0]), torch.tensor([1, 2])]
    with pytest.raises(ValueError, match="only 3 columns"):
        M.accuracy_at_k(idx, target, 5)
    with pytest.raises(ValueError, match="positive integer"):
        M.precision_at_k(idx, labels, 0)
    with pytest.raises(ValueError, match="indices must be"):
        M.accuracy_at_k(idx[0], target)
    with pytest.raises(TypeError, match="integer tensor"):
        M.accuracy_at_k(idx.float(), target)
    with pytest.raises(ValueError, match="negative class id"):
        M.accuracy_at_k(-idx - 1, target)
    with pytest.raises(ValueError, match="target has 3 rows but indices has 2"):
        M.accuracy_at_k(idx, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        M.accuracy_at_k(idx, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="sparse COO/CSR"):
        M.precision_at_k(idx, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="label lists for 2 rows"):
        M.ndcg_at_k(idx, labels[:1])
    with pytest.raises(ValueError, match="negative label id"):
        M.ndcg_at_k(idx, [torch.tensor([-1]), torch.tensor([1])])
    with pytest.raises(ValueError, match=r"must be \[N=2, V\]"):
        M.ndcg_at_k(idx, as_coo([{0}, {1}, {2}], 5))
    with pytest.raises(ValueError, match="no inverse propensity"):
        M.psprecision_at_k(idx, labels, torch.ones(2))
    with pytest.raises(ValueError, match="num_samples"):
        M.inverse_propensity(torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match="label id 7"):
        M.label_frequencies(torch.tensor([7]), 5)
    with pytest.raises(ValueError, match="k must be"):
        M.most_frequent_topk(torch.tensor([1, 2]), 3, rows=1)
    with pytest.raises(ValueError, match="positive integer"):
        M.AccuracyAtK(0)
    metric = M.AccuracyAtK(4)
    with pytest.raises(ValueError, match="only 3 columns"):
        metric.update(idx, target)


# --------------------------------------------------------------------------------------------------
# Over ranks: compute() adds the sums of every rank (what Lightning's DDP test loop relies on)
# --------------------------------------------------------------------------------------------------
def _rank_metrics(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ranking = ranking_tensor(dense_ranking(tied_scores(12), K))
        labels = random_labels(12)
        target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(12))
        w = M.inverse_propensity(M.label_frequencies(as_coo(labels), V), N)
        rows = slice(0, 15) if rank == 0 else slice(15, N)  # unequal shares
        acc, psp = M.AccuracyAtK(3), M.PSPrecisionAtK(5, w, normalize=True)
        acc.update(ranking[rows], target[rows])
        psp.update(ranking[rows], as_tensors(labels[rows]))
        torch.save({"acc": float(acc.compute()), "psp": float(psp.compute())}, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_streaming_metrics_sum_over_ranks(tmp_path):
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_metrics, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=2.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the two gloo ranks did not finish within 180 s")
    ranking = dense_ranking(tied_scores(12), K)
    labels = random_labels(12)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(12)).tolist()
    wl = M.inverse_propensity(M.label_frequencies(as_coo(labels), V), N).tolist()
    expected = {"acc": ref_accuracy(ranking, target, 3), "psp": ref_psp(ranking, labels, wl, 5, True)}
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got == pytest.approx(expected, abs=1e-12), rank
