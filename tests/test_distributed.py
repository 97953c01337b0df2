"""A ChunkedClassifier spanning the ranks of a process group (hugehead/engines/distributed.py) against a
single-process float64 reference: every rank's loss and lse, every rank's dX, every shard's gradient
(of the mean over ranks of their losses), top-k and log_prob, checkpoints across world sizes, one DDP
step. gloo with 2 and 3 spawned CPU processes (each world spawned once for all its jobs, see
tests/dist_cases.py); the same jobs on NCCL with 2 GPUs where there are two."""
import importlib.util
import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import hugehead
from hugehead import reference
from hugehead import checkpoint as ck
from hugehead.checkpoint import sharded_state_dict
from hugehead.engines.distributed import rank_class_ranges

import dist_cases
from dist_cases import D, LOSS_CASES, TOPK_V, case_inputs, case_weights, ddp_case, ddp_inputs
from conftest import load_example, rel_err, requires_multigpu, run_example

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

CLOSE = dict(rtol=1e-10, atol=1e-12)
COMMON_JOBS = [f"loss:{name}" for name in LOSS_CASES] + ["topk", "mismatch"]


# --------------------------------------------------------------------------------------------------
# The worlds: spawned once per module
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def gloo2(workdir):
    # DDP only here: its constructor imports torch._dynamo, seconds per process.
    return dist_cases.run_world(2, COMMON_JOBS + ["save", "ddp", "bf16", "ckpt_atomic"], workdir)


@pytest.fixture(scope="module")
def one_process_files(workdir):
    """A one-process head (seed 123, two shards) written as a state dict and a safetensors file."""
    torch.manual_seed(123)
    head = hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=["cpu", "cpu"])
    torch.save(head.state_dict(), os.path.join(workdir, "one.pt"))
    head.save_safetensors(os.path.join(workdir, "one.safetensors"))
    dcp.save(sharded_state_dict(dist_cases._Net(head, seed=5), for_save=True),
             checkpoint_id=os.path.join(workdir, "one.dcp"), no_dist=True)
    return head.state_dict()


def _backbone(seed=5):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(4, D, dtype=torch.float64)
    return lin.weight.detach(), lin.bias.detach()


@pytest.fixture(scope="module")
def gloo3(workdir, gloo2, one_process_files):
    # After gloo2: world 3 loads what world 2 saved.
    return dist_cases.run_world(3, COMMON_JOBS + ["save", "load:w2", "load:one"], workdir)


def world_results(request, world):
    return request.getfixturevalue(f"gloo{world}")


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------
def reference_loss_case(name, world):
    """Per rank ``(loss, lse, dX)`` and the logical ``(dW, db)`` of the mean of the ranks' objectives."""
    case = LOSS_CASES[name]
    w, b = case_weights(case)
    w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    options = {k: case[k] for k in ("reduction", "label_smoothing", "z_loss", "softcap", "ignore_index") if k in case}
    total, per_rank = 0.0, []
    for rank in range(world):
        x, target, c, e = case_inputs(case, rank)
        x.requires_grad_()
        kind = case.get("target_kind")
        if kind is None:
            loss = reference.linear_cross_entropy(x, w, target, b, **options)
        elif kind == "binary":  # reduction "none": hugehead's per-row sums
            loss = F.binary_cross_entropy_with_logits(F.linear(x, w, b), target, pos_weight=dist_cases.case_pos_weight(case),
                                                      reduction=case["reduction"])
            loss = loss.sum(1) if case["reduction"] == "none" else loss
        else:  # F.cross_entropy with class weights (index or dense probability targets), plus the z-loss
            z = F.linear(x, w, b)
            loss = F.cross_entropy(z, target, weight=dist_cases.case_class_weight(case),
                                   label_smoothing=case.get("label_smoothing", 0.0),
                                   ignore_index=case.get("ignore_index", -100), reduction=case["reduction"])
            if case.get("z_loss"):
                loss = loss + case["z_loss"] * (torch.logsumexp(z, 1) ** 2).sum() / max(len(z), 1)
        lse = torch.logsumexp(reference.logits(x, w, b, case.get("softcap")), dim=-1)
        objective = (loss * c).sum()
        if case.get("return_lse"):
            objective = objective + (lse * e).sum()
        total = total + objective
        per_rank.append((loss, lse, x))
    total.backward()
    ranks = [(loss.detach(), lse.detach(), x.grad) for loss, lse, x in per_rank]
    return ranks, w.grad / world, None if b is None else b.grad / world


def logical_from_pieces(pieces, num_classes):
    """Concatenate ``(start, stop, tensor)`` pieces of all ranks, checking they tile ``[0, V)``."""
    pieces = sorted(pieces, key=lambda p: p[0])
    assert [p[0] for p in pieces] == [0] + [p[1] for p in pieces[:-1]] and pieces[-1][1] == num_classes
    return torch.cat([p[2] for p in pieces])


def check_loss_case(results, name, world, job="loss"):
    case = LOSS_CASES[name]
    ranks, grad_w, grad_b = reference_loss_case(name, world)
    got = results[f"{job}:{name}"]
    for rank, (loss, lse, grad_x) in enumerate(ranks):
        torch.testing.assert_close(got[rank]["loss"], loss, **CLOSE)
        if case.get("return_lse"):
            torch.testing.assert_close(got[rank]["lse"], lse, **CLOSE)
        torch.testing.assert_close(got[rank]["grad_x"], grad_x, **CLOSE)
    shards = [s for r in got for s in r["shards"]]
    torch.testing.assert_close(logical_from_pieces([(a, b, gw) for a, b, gw, _ in shards], case["v"]), grad_w, **CLOSE)
    if grad_b is not None:
        torch.testing.assert_close(logical_from_pieces([(a, b, gb) for a, b, _, gb in shards], case["v"]), grad_b,
                                   **CLOSE)


def check_topk(results, world):
    case = dict(v=TOPK_V, rows=[5, 0, 7], bias=True, reduction="mean")
    w, b = case_weights(case)
    for rank in range(world):
        x, target, _, _ = case_inputs(case, rank)
        got = results["topk"][rank]
        for softcap in (None, 1.5):
            z = reference.logits(x, w, b, softcap)
            for k in (0, 1, 7, TOPK_V):
                values, indices = got[(softcap, k)]
                ref_values, ref_indices = torch.topk(z, k, dim=1)
                torch.testing.assert_close(values, ref_values, **CLOSE)
                assert torch.equal(indices, ref_indices)
            log_prob, target = got[(softcap, "log_prob")]
            torch.testing.assert_close(log_prob, torch.log_softmax(z, 1).gather(1, target[:, None])[:, 0], **CLOSE)
    for softcap in (None, 1.5):
        check_log_prob_entropy(results, world, w, b, softcap)
    check_verl_tensor_parallel(results, world)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        check_distill(results, world, divergence)


def check_distill(results, world, divergence):
    """A student head across ranks distilled from a teacher head across them in host memory: each rank's rows and
    dX, and the student's shard gradients of the mean over ranks of their objectives."""
    (ws, wt), (bs, bt), _ = dist_cases.distill_heads(world)
    ws, bs = ws.clone().requires_grad_(), bs.clone().requires_grad_()
    total = 0.0
    for rank in range(world):
        xs, xt, mask, up = dist_cases.distill_inputs(rank)
        got = results["topk"][rank][("distill", divergence)]
        xs = xs.requires_grad_()
        lp = torch.log_softmax((xs @ ws.T + bs) / 0.8, -1)
        lq = torch.log_softmax((xt @ wt.T + bt) / 0.8, -1)
        if divergence == "forward_kl":
            rows = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
        elif divergence == "reverse_kl":
            rows = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
        else:
            lm = torch.logsumexp(torch.stack([lq + math.log(0.3), lp + math.log(0.7)]), dim=0)
            rows = (0.3 * F.kl_div(lm, lq, reduction="none", log_target=True).sum(-1)
                    + 0.7 * F.kl_div(lm, lp, reduction="none", log_target=True).sum(-1))
        rows = torch.where(mask, rows, 0.0)
        torch.testing.assert_close(got["rows"], rows.detach(), **CLOSE)
        objective = (rows * up).sum()
        if xs.shape[0]:
            (grad_x,) = torch.autograd.grad(objective, xs, retain_graph=True)
            torch.testing.assert_close(got["grad_x"], grad_x, **CLOSE)
        total = total + objective / world
    grad_w, grad_b = torch.autograd.grad(total, [ws, bs])
    shards = [s for r in range(world) for s in results["topk"][r][("distill", divergence)]["shards"]]
    torch.testing.assert_close(logical_from_pieces([(a, c, gw) for a, c, gw, _ in shards], TOPK_V), grad_w, **CLOSE)
    torch.testing.assert_close(logical_from_pieces([(a, c, gb) for a, c, _, gb in shards], TOPK_V), grad_b, **CLOSE)


def check_verl_tensor_parallel(results, world):
    """verl's signature with a vocabulary split over the ranks: every rank the log-probs, entropies and dX of the
    whole vocabulary, its own rows of dW."""
    hidden, labels, weight, up = dist_cases.verl_inputs()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    lp = torch.log_softmax(hidden.reshape(-1, D) @ weight.T / 0.9, -1)
    logprobs = lp.gather(1, labels.reshape(-1, 1))[:, 0]
    entropy = torch.special.entr(lp.exp()).sum(1)
    grad_hidden, grad_weight = torch.autograd.grad((logprobs * up[0] + entropy * up[1]).sum(), [hidden, weight])
    rows = dist_cases.VERL_V // world
    for rank in range(world):
        got = results["topk"][rank]["verl"]
        torch.testing.assert_close(got["logprobs"], logprobs.detach(), **CLOSE)
        torch.testing.assert_close(got["entropy"], entropy.detach(), **CLOSE)
        torch.testing.assert_close(got["grad_hidden"], grad_hidden, **CLOSE)
        torch.testing.assert_close(got["grad_weight"], grad_weight[rank * rows:(rank + 1) * rows], **CLOSE)


def check_log_prob_entropy(results, world, w, b, softcap):
    """Each rank's log p and entropy, its dX, and the shards' gradients of the mean over ranks of their objectives
    (the distributed engine's rule) against float64 one-process autograd."""
    case = dict(v=TOPK_V, rows=[5, 0, 7], bias=True, reduction="mean")
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    total = 0.0
    for rank in range(world):
        x, target, _, _ = case_inputs(case, rank)
        got = results["topk"][rank][(softcap, "entropy")]
        xr = x.clone().requires_grad_()
        lp = torch.log_softmax(reference.logits(xr, wr, br, softcap) / 0.8, 1)
        valid = target != -100
        logp = torch.where(valid, lp.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
        entropy = torch.where(valid, torch.special.entr(lp.exp()).sum(1), 0.0)
        torch.testing.assert_close(got["logp"], logp.detach(), **CLOSE)
        torch.testing.assert_close(got["entropy"], entropy.detach(), **CLOSE)
        up = dist_cases.entropy_upstream(x.shape[0], rank)
        objective = (logp * up[0] + entropy * up[1]).sum()
        if x.shape[0]:
            (grad_x,) = torch.autograd.grad(objective, xr, retain_graph=True)
            torch.testing.assert_close(got["grad_x"], grad_x, **CLOSE)
        total = total + objective / world
    grad_w, grad_b = torch.autograd.grad(total, [wr, br])
    shards = [s for r in range(world) for s in results["topk"][r][(softcap, "entropy")]["shards"]]
    torch.testing.assert_close(logical_from_pieces([(a, c, gw) for a, c, gw, _ in shards], TOPK_V), grad_w, **CLOSE)
    torch.testing.assert_close(logical_from_pieces([(a, c, gb) for a, c, _, gb in shards], TOPK_V), grad_b, **CLOSE)


def check_ddp(results, world):
    case = ddp_case()
    params = {"backbone.weight": case["backbone_w"], "backbone.bias": case["backbone_b"],
              "head.weight": case["head_w"], "head.bias": case["head_b"]}
    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    losses = []
    for rank in range(world):
        inputs, target = ddp_inputs(rank)
        features = torch.tanh(inputs @ params["backbone.weight"].T + params["backbone.bias"])
        losses.append(reference.linear_cross_entropy(features, params["head.weight"], target, params["head.bias"]))
    (sum(losses) / world).backward()
    for rank in range(world):
        got = results["ddp"][rank]
        assert got["ignored"] == ["head.shards.0.weight", "head.shards.0.bias"]
        torch.testing.assert_close(got["loss"], losses[rank].detach(), **CLOSE)
        for key, p in params.items():  # one SGD step, lr 0.5: the same model on every rank
            torch.testing.assert_close(got["state"][key], (p - 0.5 * p.grad).detach(), **CLOSE)


def check_bf16(results, device):
    """bfloat16 errors against float64 at most 2x those of plain PyTorch in bfloat16 (DESIGN.md)."""
    w64 = dist_cases.bf16_weight()
    errors = {}
    for name, dtype, where in (("f64", torch.float64, "cpu"), ("plain", torch.bfloat16, device)):
        w = w64.to(where, dtype, copy=True).requires_grad_()
        losses, xs = [], []
        for rank in range(2):
            x, target = dist_cases.bf16_inputs(rank)
            x = x.to(where, dtype).requires_grad_()
            losses.append(reference.linear_cross_entropy(x, w, target.to(where)))
            xs.append(x)
        sum(l.float() for l in losses).backward()  # dX_r = dL_r/dx_r; dW of the mean of the ranks' losses
        errors[name] = ([l.detach() for l in losses], [x.grad for x in xs], w.grad / 2)
    (ref_loss, ref_dx, ref_dw), (plain_loss, plain_dx, plain_dw) = errors["f64"], errors["plain"]
    got = results["bf16"]
    dw = logical_from_pieces([s for r in got for s in r["shards"]], dist_cases.BF16_CASE["v"])
    assert rel_err(dw, ref_dw) <= 2 * rel_err(plain_dw, ref_dw)
    for rank in range(2):
        assert got[rank]["loss"].dtype == torch.float32
        assert rel_err(got[rank]["loss"], ref_loss[rank]) <= 2 * max(rel_err(plain_loss[rank], ref_loss[rank]), 1e-6)
        assert rel_err(got[rank]["grad_x"], ref_dx[rank]) <= 2 * rel_err(plain_dx[rank], ref_dx[rank])


# --------------------------------------------------------------------------------------------------
# gloo, 2 and 3 processes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LOSS_CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_loss_and_gradients_match_one_process(request, world, name):
    check_loss_case(world_results(request, world), name, world)


@pytest.mark.parametrize("world", [2, 3])
def test_topk_and_log_prob_match_one_process(request, world):
    check_topk(world_results(request, world), world)


def test_ddp_step_with_ignored_head_matches_one_process(gloo2):
    check_ddp(gloo2, 2)


def test_bfloat16_errors_within_twice_plain_pytorch(gloo2):
    check_bf16(gloo2, "cpu")


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_on_the_head_all_raise(request, world):
    results = world_results(request, world)["mismatch"]
    size, split = zip(*(r["errors"] for r in results))
    assert all(e is not None and "rank 1 of the process group built a different head" in e for e in size + split)
    assert all("num_classes=21 (rank 0: 20)" in e for e in size)
    assert all("its classes start at 6, after rank 0's end at 5" in e for e in split)


def test_checkpoint_directory_over_ranks_is_atomic_and_resumes(gloo2):
    """save_checkpoint/load_checkpoint with process_group (gloo, 2 ranks): a write failing on rank 1 raises
    on both ranks, leaves the previous checkpoint loadable and no temporary; the load restores every
    rank's shard, the backbone and that rank's own Adam state."""
    errors = [result["error"] for result in gloo2["ckpt_atomic"]]
    # Out of space: CheckpointSpaceError on both ranks, rank 1 with its own error, rank 0 naming rank 1's.
    assert all(e.startswith("CheckpointSpaceError: hugehead: not enough disk space for checkpoint ") for e in errors), errors
    assert "(the write ran out of space: OSError: [Errno 28] No space left on device (injected))" in errors[1], errors
    assert "torch.distributed.checkpoint failed on another rank (rank 1: OSError: [Errno 28] No space left on " \
           "device (injected))" in errors[0], errors
    for rank, result in enumerate(gloo2["ckpt_atomic"]):
        assert result["leftovers"] == [], result
        assert result["extra"] == {"step": 1} and result["loaded"] == [True] and result["backbone"], result
        assert result["same_opt"], result


def _one_process_head(seed=999):
    torch.manual_seed(seed)
    return hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=["cpu", "cpu", "cpu"])


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoints_load_into_one_process(request, workdir, world):
    check_saved(world_results(request, world), workdir, world)


def check_saved(results, workdir, world):
    saved = results["save"]
    # Rank 0's seed (0) decides the initialization on every rank: the weight of a one-process head seeded so.
    torch.manual_seed(0)
    expected = hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=["cpu"]).state_dict()
    for rank in range(world):
        torch.testing.assert_close(saved[rank]["state"], expected, rtol=0, atol=0)
    assert [(s[0], s[1]) for s in saved[0]["shards"]] == ([(0, 4), (4, 7)] if world == 2 else [(0, 3), (3, 5)])
    for kind in ("pt", "safetensors", "dcp"):
        head = _one_process_head()
        path = os.path.join(workdir, f"w{world}.{kind}")
        if kind == "pt":
            head.load_state_dict(torch.load(path))
        elif kind == "safetensors":
            head.load_safetensors(path)
        else:  # written by every rank of the world, read by one process with three shards
            net = dist_cases._Net(head, seed=77)
            state = sharded_state_dict(net)
            dcp.load(state, checkpoint_id=path, no_dist=True)
            net.load_state_dict(state)
            for got, want in zip((net.backbone.weight, net.backbone.bias), _backbone()):
                torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
        torch.testing.assert_close({k: v.cpu() for k, v in head.state_dict().items()}, expected, rtol=0, atol=0)


def test_checkpoints_load_into_other_world_sizes(gloo3, one_process_files):
    torch.manual_seed(0)
    from_two_ranks = hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=["cpu"]).state_dict()
    for source, expected in (("w2", from_two_ranks), ("one", one_process_files)):
        for kind in ("pt", "safetensors", "dcp"):
            pieces = [s for rank in gloo3[f"load:{source}"] for s in rank[kind]]
            for i, name in ((2, "weight"), (3, "bias")):
                got = logical_from_pieces([(s[0], s[1], s[i]) for s in pieces], 13)
                torch.testing.assert_close(got, expected[name], rtol=0, atol=0)
        for rank in gloo3[f"load:{source}"]:  # the backbone written once, read by every rank
            for got, want in zip(rank["dcp_backbone"], _backbone()):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# The examples, tiny, as their docstrings launch them (gloo, 2 CPU processes)
# --------------------------------------------------------------------------------------------------
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


_LIGHTNING_TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       str(EXAMPLES / "lightning_ddp.py"), "--cpu", "--no-progress", "--epoch-steps", "3"]


def example_runs(out: Path):
    """The example runs the tests below check, by name: each a script's arguments, its outputs under ``out``."""
    runs = {"ddp_train": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(EXAMPLES / "ddp_train.py"), "--backend", "gloo", "--uneven", "--steps", "30",
                          "--save", str(out / "head.safetensors")]}
    if importlib.util.find_spec("lightning") is not None:
        runs.update({
            "lightning_launcher": [str(EXAMPLES / "lightning_ddp.py"), "--cpu", "--no-progress", "--steps", "30",
                                   "--checkpoint", str(out / "last.ckpt")],
            "lightning_first_half": _LIGHTNING_TORCHRUN + ["--steps", "3", "--ckpt-dir", str(out / "ckpt")],
            "lightning_uninterrupted": _LIGHTNING_TORCHRUN + ["--steps", "6", "--ckpt-dir", str(out / "straight")],
        })
    return runs


def test_ddp_train_example_with_torchrun_on_gloo(examples):
    saved = examples.out / "head.safetensors"
    out = examples("ddp_train")
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    acc1, acc5, base1, base5 = map(float, re.search(
        r"held-out top-1 ([\d.]+), held-out top-5 ([\d.]+) \(always-most-frequent top-1 ([\d.]+), top-5 ([\d.]+)",
        out).groups())
    # It learned (2000 classes: uniform chance 5e-4), beyond always answering the most frequent classes.
    assert last < first - 2 and acc1 > 0.2 and acc1 > base1 + 0.1, out
    assert acc5 >= acc1 and base5 >= base1 > 0, out
    assert "backbones identical on all ranks: True" in out and "cover [0, 2000): True" in out
    head = hugehead.ChunkedClassifier(32, 2000, devices=["cpu", "cpu", "cpu"])  # the file loads into one process
    head.load_safetensors(str(saved))


def test_lightning_ddp_example_fit_and_test_on_cpu(examples):
    pytest.importorskip("lightning", reason="examples/lightning_ddp.py needs PyTorch Lightning")
    checkpoint = examples.out / "last.ckpt"
    out = examples("lightning_launcher")
    assert re.search(r"fit: 30 steps in [\d.]+ s on 2 ranks", out), out
    loss, acc1, acc5, base1, base5 = map(float, re.search(
        r"test_loss=([\d.]+) test_acc@1=([\d.]+) test_acc@5=([\d.]+) \(always-most-frequent @1 ([\d.]+) @5 ([\d.]+)",
        out).groups())
    assert loss < math.log(2000) - 2 and acc1 > 0.2 and acc1 > base1 + 0.1 and acc5 >= acc1, out
    # The baseline: the test rows whose class is among the 1 (5) most frequent training classes.
    synthetic_batch = load_example("ddp_train", "ddp_train_example").synthetic_batch
    gen = torch.Generator().manual_seed(1)
    train = synthetic_batch(30 * 64 * 2, 2000, 64, 1.3, 0.5, gen, torch.device("cpu"))[1]
    test = synthetic_batch(512, 2000, 64, 1.3, 0.5, gen, torch.device("cpu"))[1]
    counts = torch.bincount(train, minlength=2000).tolist()
    frequent = sorted(range(2000), key=lambda c: (-counts[c], c))
    assert (base1, base5) == tuple(round(sum(int(t) in frequent[:k] for t in test) / 512, 4) for k in (1, 5)), out
    # The Lightning checkpoint holds the logical head gathered from both ranks: it loads into one process.
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    head = hugehead.ChunkedClassifier(32, 2000, devices=["cpu", "cpu"])
    head.load_state_dict({k[len("head."):]: v for k, v in state.items() if k.startswith("head.")})
    assert state["head.weight"].shape == (2000, 32)


def _shard_sums(out):
    return dict(re.findall(r"rank (\d): classes .*?; head shard sum (-?[\d.e+-]+)", out))


def test_lightning_ddp_sharded_checkpoint_resume_matches_uninterrupted_fit(examples):
    """ShardedHeadDDPStrategy: 3 steps, checkpoint (every rank writes its rows and Adam state), a new fit
    resumed from it to step 6 ends bitwise where an uninterrupted 6-step fit does (epoch boundary at 3),
    and the checkpoint directory loads into one process without gathering anything at save time. Launched
    by torchrun, as the docstring's cluster launch is: both ranks start at once, where Lightning's own launcher
    (run by the test above) starts rank 1 only once rank 0 has imported everything."""
    pytest.importorskip("lightning", reason="examples/lightning_ddp.py needs PyTorch Lightning")
    ckpt = examples.out / "ckpt"
    first, straight = examples("lightning_first_half"), examples("lightning_uninterrupted")
    assert "hugehead: saved sharded checkpoint" in first
    last = ckpt / "last.ckpt"
    assert ck.is_checkpoint_dir(last) and sorted(os.listdir(ckpt)) == ["last.ckpt"]
    # The weights alone load into a one-process head (three shards) and match what rank r held.
    one = hugehead.ChunkedClassifier(32, 2000, devices=["cpu", "cpu", "cpu"])
    state = {f"head.{k}": v for k, v in ck.sharded_state_dict(one).items()}  # the LightningModule's keys
    ck.read_checkpoint(last, state, strict=False)  # in place, into the three shards
    saved = {r: float(v) for r, v in _shard_sums(first).items()}
    weight = torch.cat([s.weight.detach() for s in one.shards]).double()
    for r, (lo, hi) in enumerate([(0, 1000), (1000, 2000)]):
        assert float(weight[lo:hi].sum()) == saved[str(r)]
    resumed = run_example(_LIGHTNING_TORCHRUN + ["--steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-path", str(last)],
                           examples.out / "resumed")
    assert "(weights and optimizer state)" in resumed and re.search(r"fit: 6 steps", resumed), resumed
    assert _shard_sums(resumed) == _shard_sums(straight) and len(_shard_sums(straight)) == 2, (resumed, straight)
    metrics = re.compile(r"test_loss=[\d.]+ test_acc@1=[\d.]+ test_acc@5=[\d.]+")
    assert metrics.search(resumed).group(0) == metrics.search(straight).group(0)
    # Optimizer state belongs to this world size: one process may read the weights, not resume the optimizer.
    opt = torch.optim.AdamW(one.parameters())
    with pytest.raises(ValueError, match="optimizer state of 2 rank"):
        ck.read_checkpoint(last, state, [opt], strict=False)


@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
def test_bench_dist_smoke_writes_records(tmp_path):
    """bench/bench_dist.py's pipeline on gloo, tiny: one JSON file with the one-rank and the two-rank rows."""
    import json

    run_example(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "bench.bench_dist",
                  "--cpu-smoke", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path / "out")],
                 Path(__file__).resolve().parents[1])
    doc = json.loads((tmp_path / "out" / "dist.json").read_text())
    assert doc["meta"]["git_sha"] and [r["world_size"] for r in doc["records"]] == [1, 2]
    for record in doc["records"]:
        assert {"n", "d", "v", "world_size", "fwd_bwd_ms"} <= set(record) and record["fwd_bwd_ms"] > 0
    assert all(v < 1e-5 for v in doc["checks"].values()), doc["checks"]  # float32: the same numbers as one process
    assert (tmp_path / "out" / "dist.md").exists()


def test_a_stuck_world_is_killed_at_its_timeout(tmp_path):
    """Every test that spawns ranks is bounded: a rank stuck outside any collective fails the test with a
    TimeoutError instead of hanging CI, and its processes are gone."""
    with pytest.raises(TimeoutError, match=r"2 gloo ranks running \['stuck'\] did not finish within 3 s"):
        dist_cases.run_world(2, ["stuck"], str(tmp_path), timeout_s=3)


# --------------------------------------------------------------------------------------------------
# No processes
# --------------------------------------------------------------------------------------------------
def test_rank_class_ranges():
    assert rank_class_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert rank_class_ranges(10, 2, [3, 7]) == [(0, 3), (3, 10)]
    with pytest.raises(ValueError, match="3 entries expected"):
        rank_class_ranges(10, 3, [5, 5])
    with pytest.raises(ValueError, match="sum to 9"):
        rank_class_ranges(10, 2, [4, 5])
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        rank_class_ranges(3, 4)


def test_process_group_needs_torch_distributed_initialized():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        hugehead.ChunkedClassifier(D, 13, process_group=object())


# --------------------------------------------------------------------------------------------------
# NCCL, 2 GPUs (one per rank), the same jobs in float64
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nccl_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nccl"))


@pytest.fixture(scope="module")
def nccl2(nccl_dir):
    return dist_cases.run_world(2, COMMON_JOBS + ["ddp", "bf16", "save"], nccl_dir, backend="nccl")


@pytest.mark.multigpu
@requires_multigpu
def test_nccl_two_gpus_match_one_process(nccl2, nccl_dir):
    for name in LOSS_CASES:
        check_loss_case(nccl2, name, 2)
    check_topk(nccl2, 2)
    check_ddp(nccl2, 2)
    check_bf16(nccl2, "cuda:0")
    check_saved(nccl2, nccl_dir, 2)


@pytest.mark.multigpu
@requires_multigpu
def test_nccl_two_gpus_offloaded_shards_match_one_process(tmp_path):
    jobs = [f"offload:{name}" for name in LOSS_CASES]
    results = dist_cases.run_world(2, jobs, str(tmp_path), backend="nccl")
    if any("skipped" in r for r in results[jobs[0]]):
        pytest.skip("this build has no offload engine")
    for name in LOSS_CASES:
        check_loss_case(results, name, 2, job="offload")
