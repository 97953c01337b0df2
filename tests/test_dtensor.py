"""hugehead.linear_cross_entropy of a DTensor weight (hugehead/dtensor.py) against a single-process float64
computation with the gathered weight: every rank's loss and lse, dX and its shard of the weight's gradient,
for FSDP-style rows (Shard(0), rows per rank), tensor parallelism (Shard(0), replicated rows) and
Replicate(); the collectives moved nothing of the weight; and the FSDP2 recipe (fully_shard, optimizer
steps, gradient accumulation, torch.distributed.checkpoint across world sizes). gloo, 2 and 3 spawned CPU
processes, each world spawned once for all its jobs (tests/dtensor_cases.py), each bounded in time."""
import re
from pathlib import Path

import pytest
import torch

from hugehead import reference
from hugehead.dtensor import shard_class_ranges

import dtensor_cases
from conftest import rel_err, run_example
from dtensor_cases import LOSS_CASES, case_inputs, case_weights

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

CLOSE = dict(rtol=1e-10, atol=1e-12)
COMMON_JOBS = ([f"loss:{name}" for name in LOSS_CASES] + ["errors", "bytes"]
               + [f"train:{variant}" for variant in dtensor_cases.TRAIN_VARIANTS])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dtensor"))


@pytest.fixture(scope="module")
def gloo2(workdir):
    # transformers.patch on FSDP2 only here: importing transformers costs seconds per process.
    return dtensor_cases.run_world(2, COMMON_JOBS + [f"hf:{v}" for v in dtensor_cases.HF_VARIANTS], workdir)


@pytest.fixture(scope="module")
def gloo3(workdir, gloo2):
    # After gloo2: world 3 resumes from the checkpoint that world 2 wrote.
    return dtensor_cases.run_world(3, COMMON_JOBS + ["resume:w2"], workdir)


def world_results(request, world):
    return request.getfixturevalue(f"gloo{world}")


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------
def reference_loss_case(name, world):
    """Per rank ``(loss, lse, dX, dW, db)`` with the gathered weight in one process, float64. dW and db are
    logical (all classes): for "fsdp" those of the mean over ranks of their objectives (FSDP2's average of
    the gathered weight's gradients), for "tp" those of the one objective all ranks share, for
    "replicate" each rank's own."""
    case = LOSS_CASES[name]
    options = {k: case[k] for k in ("reduction", "label_smoothing", "z_loss", "softcap", "ignore_index") if k in case}
    per_rank = []
    for rank in range(world):
        w, b = case_weights(case)
        w.requires_grad_()
        if b is not None:
            b.requires_grad_()
        x, target, c, e = case_inputs(case, rank)
        x.requires_grad_()
        if case.get("entropy"):  # log p and the entropy in the loss's and the lse's places
            logp_all = torch.log_softmax(reference.logits(x, w, b, case.get("softcap")) / case["temperature"], -1)
            valid = target != -100
            loss = torch.where(valid, logp_all.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
            lse = torch.where(valid, torch.special.entr(logp_all.exp()).sum(-1), 0.0)
        else:
            loss = reference.linear_cross_entropy(x, w, target, b, **options)
            lse = torch.logsumexp(reference.logits(x, w, b, case.get("softcap")), dim=-1)
        objective = (loss * c).sum()
        if case.get("return_lse") or case.get("entropy"):
            objective = objective + (lse * e).sum()
        objective.backward()
        per_rank.append([loss.detach(), lse.detach(), x.grad, w.grad, None if b is None else b.grad])
    if case["layout"] == "fsdp":
        for i in (3, 4):
            if per_rank[0][i] is not None:
                mean = sum(r[i] for r in per_rank) / world
                for r in per_rank:
                    r[i] = mean
    return per_rank


@pytest.mark.parametrize("name", list(LOSS_CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_loss_and_gradients_match_one_process_with_the_gathered_weight(request, world, name):
    case = LOSS_CASES[name]
    got = world_results(request, world)[f"loss:{name}"]
    ranges = shard_class_ranges(case["v"], world)
    for rank, (loss, lse, grad_x, grad_w, grad_b) in enumerate(reference_loss_case(name, world)):
        r = got[rank]
        lo, hi = ranges[rank] if case["layout"] != "replicate" else (0, case["v"])
        if case.get("autocast"):
            # bfloat16 GEMMs (a few 1e-3 of relative error); the loss and every gradient float32.
            assert r["loss"].dtype == r["grad_x"].dtype == r["grad_w"].dtype == r["grad_b"].dtype == torch.float32
            pairs = [(r["loss"], loss), (r["grad_x"], grad_x), (r["grad_w"], grad_w[lo:hi]), (r["grad_b"], grad_b[lo:hi])]
            assert all(rel_err(a, b) < 2e-2 for a, b in pairs), [rel_err(a, b) for a, b in pairs]
            assert rel_err(r["grad_w"], grad_w[lo:hi]) > 1e-5  # it did compute in bfloat16, not float32
        else:
            torch.testing.assert_close(r["loss"], loss, **CLOSE)
            if case.get("return_lse") or case.get("entropy"):
                torch.testing.assert_close(r["lse"], lse, **CLOSE)
            torch.testing.assert_close(r["grad_x"], grad_x, **CLOSE)
            torch.testing.assert_close(r["grad_w"], grad_w[lo:hi], **CLOSE)
            if grad_b is not None:
                torch.testing.assert_close(r["grad_b"], grad_b[lo:hi], **CLOSE)
        # Gradients come back as the inputs were given: the weight's a DTensor of its placement, x's a
        # DTensor where x was one (tensor parallelism); the loss is a plain tensor.
        assert r["grad_w_placements"] == (("R",) if case["layout"] == "replicate" else ("S(0)",))
        assert r["grad_x_type"] == ("DTensor" if case["layout"] == "tp" or case.get("sharded_x") else "Tensor")
        assert r["loss_type"] == "Tensor"


def test_shard_class_ranges_follow_torch_chunk():
    for v, world in ((23, 2), (23, 3), (4, 3), (10, 4), (5, 4), (12, 3)):
        sizes = [hi - lo for lo, hi in shard_class_ranges(v, world)]
        chunks = [len(c) for c in torch.arange(v).chunk(world)]
        assert sizes == chunks + [0] * (world - len(chunks)), (v, world)


@pytest.mark.parametrize("world", [2, 3])
def test_unsupported_placements_raise_naming_them(request, world):
    for errors in world_results(request, world)["errors"]:
        assert "got Shard(dim=1)" in errors["shard1"] and errors["shard1"].startswith("ValueError")
        assert "got Partial(sum)" in errors["partial"]
        assert errors["plain_bias"].startswith("TypeError") and "bias must be a DTensor" in errors["plain_bias"]
        assert "a DTensor x must be Replicate() (tensor parallelism) or Shard(0)" in errors["x_shard1"]
    for rank, errors in enumerate(world_results(request, world)["errors"]):
        for layout in ("fsdp", "tp"):  # raised on every rank; the bad rank names its row
            expected = ("target 12 at row 1 is out of range for 12 classes" if rank == 1
                        else "a target out of range for 12 classes on rank(s) [1]")
            assert errors[f"bad_target_{layout}"].startswith("ValueError") and expected in errors[f"bad_target_{layout}"]


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_move_rows_and_statistics_never_the_weight(request, world):
    """The head (3001 x 8) is far larger than the rows (<= 6 x 8): every collective of a step, summed, moves
    less than a tenth of one rank's weight shard; only the rows, targets, per-row statistics and dX move.
    With replicated rows (tensor parallelism) no rows move at all: one all-gather of 3 statistics per row,
    one all-reduce of dX (and, on both paths, one all-gather of a flag per rank: targets in range). (DTensor.full_tensor and redistribute raise inside the measured step.)"""
    case = dtensor_cases.BYTES_CASE
    d = case["d"]
    for rank, result in enumerate(world_results(request, world)["bytes"]):
        fsdp, tp = result["fsdp"], result["tp"]
        for layout in (fsdp, tp):
            assert sum(b for _, b in layout["calls"]) < layout["local_weight_bytes"] / 10, layout
        n = max(case["n"][:world])
        # Forward: the targets-in-range flags, row counts, x, targets, statistics to the owners; backward:
        # lse/grads/flags, dX partials.
        flags = ("all_gather", (1 + world) * 8)
        assert [name for name, _ in fsdp["calls"]] == ["all_gather"] * 4 + ["all_to_all", "all_gather",
                                                                          "reduce_scatter"]
        assert fsdp["calls"][0] == flags
        assert fsdp["calls"][2][1] == (1 + world) * n * d * 4  # x: this rank's padded rows in, all ranks' out
        n_tp = case["n"][0]
        assert tp["calls"] == [flags, ("all_gather", (1 + world) * 3 * n_tp * 4), ("all_reduce", n_tp * d * 4)]


# --------------------------------------------------------------------------------------------------
# The FSDP2 recipe
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_training():
    """The model of dtensor_cases.TrainNet in one process, float64, plain PyTorch: AdamW on the mean loss
    of each step's global batch. Returns the parameters after every step."""
    params = {k: v.clone().requires_grad_() for k, v in dtensor_cases.train_init().items()}
    opt = torch.optim.AdamW(params.values(), lr=dtensor_cases.TRAIN["lr"])
    after, losses = [], []
    for step in range(dtensor_cases.TRAIN["steps"]):
        inputs, target = dtensor_cases.train_batch(step)
        h = torch.tanh(inputs @ params["body.0.weight"].T + params["body.0.bias"])
        h = torch.tanh(h @ params["body.2.weight"].T + params["body.2.bias"])
        loss = reference.linear_cross_entropy(h, params["head.weight"], target, params["head.bias"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        after.append({k: v.detach().clone() for k, v in params.items()})
    return after, losses


@pytest.mark.parametrize("variant", dtensor_cases.TRAIN_VARIANTS)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_training_matches_one_process(request, reference_training, world, variant):
    """Four AdamW steps of a fully_shard-ed model, each rank its share of the global batch: the head as its
    own never-called unit (hugehead on the Shard(0) DTensor), inside the root's unit (gathered by FSDP2),
    a ChunkedClassifier(process_group=) left out of FSDP2, and the first with two micro-batches per step
    (gradient sync off for the first): every parameter equal to one process's training."""
    after, losses = reference_training
    results = world_results(request, world)[f"train:{variant}"]
    for rank, result in enumerate(results):
        assert set(result["params"]) == set(after[-1])
        for name, value in after[-1].items():
            torch.testing.assert_close(result["params"][name], value, **CLOSE, msg=f"{variant} rank {rank} {name}")
        # Rank r's loss is the mean over its own rows; their mean over ranks is the global batch's.
        assert len(result["losses"]) == len(losses)
    for step, loss in enumerate(losses):
        assert abs(sum(r["losses"][step] for r in results) / world - loss) < 1e-10
    # What hugehead saw as the head's weight inside the forward: the DTensor shard, never the whole weight,
    # unless FSDP2 gathered it (the head in the root's unit).
    seen = {"sharded": "DTensor", "accumulated": "DTensor", "gathered": "Parameter", "classifier": "NoneType"}
    assert {r["head_weight_seen"] for r in results} == {seen[variant]}


def test_fsdp2_checkpoint_loads_into_another_world_size(gloo2, gloo3, reference_training):
    """torch.distributed.checkpoint of the sharded recipe (model and AdamW state) written by 2 ranks after
    step 3, loaded by 3 ranks into a model initialized otherwise: the same parameters, and its last step
    ends where one process's uninterrupted training does."""
    after, _ = reference_training
    saved = gloo2["train:sharded"][0]
    for rank, result in enumerate(gloo3["resume:w2"]):
        for name, value in after[dtensor_cases.TRAIN["saved_after"] - 1].items():
            torch.testing.assert_close(result["loaded"][name], value, **CLOSE, msg=f"rank {rank} loaded {name}")
        for name, value in after[-1].items():
            torch.testing.assert_close(result["params"][name], value, **CLOSE, msg=f"rank {rank} resumed {name}")
        for name, value in saved["saved_exp_avg"].items():  # the optimizer state, bit for bit
            torch.testing.assert_close(result["exp_avg"][name], value, rtol=0, atol=0, msg=f"rank {rank} {name}")
        assert set(result["exp_avg"]) == set(after[-1])


@pytest.mark.parametrize("variant", dtensor_cases.HF_VARIANTS)
def test_transformers_patch_on_an_fsdp2_model_matches_the_unpatched_model(gloo2, variant):
    """A tiny Llama under fully_shard (every decoder layer and the root; lm_head its own unit or in the
    root's), then hugehead.integrations.transformers.patch: every rank's loss and every parameter's
    gradient equal the unpatched model's in one process (float64), gradients averaged over the ranks as
    FSDP2 does. With lm_head its own unit hugehead computes on its Shard(0) DTensor weight and FSDP2 never
    gathers it."""
    results = gloo2[f"hf:{variant}"]
    if "skipped" in results[0]:
        pytest.skip(results[0]["skipped"])
    world = len(results)
    model = dtensor_cases.hf_model()
    losses = []
    for rank in range(world):
        ids = dtensor_cases.hf_batch(rank)
        # transformers' own loss upcasts to float32: the same shifted cross-entropy, in float64.
        logits = model(input_ids=ids).logits
        losses.append(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    (sum(losses) / world).backward()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"], losses[rank].detach(), **CLOSE)
        assert result["logits"] is None  # no [tokens, V] logits
        for name, p in model.named_parameters():
            torch.testing.assert_close(result["grads"][name], p.grad, **CLOSE, msg=f"rank {rank} {name}")
        assert result["weight_seen"] == (["DTensor"] if variant == "head_unit" else ["Parameter"])
        # lm_head its own unit: FSDP2 never gathers it (patch calls a stand-in, not the sharded module).
        assert "lm_head" not in result["unsharded"], result["unsharded"]
        assert set(result["unsharded"]) >= {"model.layers.0", "model.layers.1"}


# --------------------------------------------------------------------------------------------------
# examples/fsdp2_train.py, tiny, as its docstring launches it (gloo)
# --------------------------------------------------------------------------------------------------
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_train.py"


def example_runs(out: Path):
    """The example runs this module's tests check (the session's ``examples`` fixture starts them)."""
    return {"fsdp2": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(EXAMPLE),
                      "--backend", "gloo", "--steps", "12", "--accumulate", "2", "--ckpt", str(out / "fsdp2_ckpt")]}


def test_fsdp2_example_trains_both_head_modes_and_resumes_in_another_world_size(examples, tmp_path):
    ckpt = examples.out / "fsdp2_ckpt"
    out = examples("fsdp2")
    # (what hugehead got, up to "local rows": the ranks share stdout, so a line is matched by its own words)
    line = r"rank 0: head (\w+): step [\d.]+ ms .*?; loss ([\d.]+ -> [\d.]+); hugehead got a (\w+ with [\d,]+ local rows)"
    modes = {mode: (loss, seen) for mode, loss, seen in re.findall(line, out)}
    assert set(modes) == {"sharded", "gathered"}, out
    # The sharded mode hands hugehead rank 0's 1001 rows of the 2001-class head; the gathered one all of them.
    assert modes["sharded"][1] == "DTensor with 1,001 local rows", out
    assert modes["gathered"][1] == "Parameter with 2,001 local rows", out
    for loss, _ in modes.values():
        first, last = map(float, loss.split(" -> "))
        assert last < first - 2, out  # it learned (2001 classes: log V = 7.6)
    s, g = map(float, re.search(r"first-step loss ([\d.]+) vs ([\d.]+)", out).groups())
    assert abs(s - g) <= 1e-5 * g, out  # the same model, the same first batch: the same loss
    # The two-rank checkpoint loads into one process and continues from where it was.
    resumed = run_example([str(EXAMPLE), "--backend", "gloo", "--head", "sharded", "--steps", "2", "--warmup", "0",
                            "--resume", str(ckpt)], tmp_path)
    first = float(re.search(r"rank 0: head sharded: .*?; loss ([\d.]+) ->", resumed).group(1))
    fresh = float(modes["sharded"][0].split(" -> ")[0])
    assert first < fresh - 2 and "DTensor with 2,001 local rows" in resumed, resumed
