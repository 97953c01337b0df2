"""What the ranks of tests/test_distributed.py run: one spawned process per rank (gloo on CPU, or NCCL on
one GPU each) works through a list of jobs and saves each job's results per rank; the test process
compares them with a single-process float64 reference built from the same seeded inputs
(:func:`case_inputs`, :func:`case_weights`). Imported by the spawned ranks, so it needs no pytest."""
from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

import hugehead
from hugehead.checkpoint import sharded_state_dict
from hugehead import ignore_heads_in_ddp

D = 6

# Loss cases: per-rank rows (3 ranks; a 2-rank world takes the first two), options, per-rank devices.
LOSS_CASES: Dict[str, dict] = {
    # Streaming (several chunks per shard), unequal batches, ignored rows, mean per rank.
    "mean_streamed": dict(v=23, rows=[7, 4, 5], bias=True, reduction="mean", chunk_size=4),
    # Every option at once, logits kept between forward and backward (no chunk_size: they fit).
    "options_kept": dict(v=29, rows=[5, 8, 3], bias=False, reduction="sum", label_smoothing=0.15, z_loss=0.02,
                         softcap=2.5),
    # Per-row losses and the lse, both differentiated; two local shards per rank, unbalanced ranks.
    "none_lse_two_local_shards": dict(v=31, rows=[6, 6, 9], bias=True, reduction="none", return_lse=True,
                                      label_smoothing=0.05, local_shards=2, rank_sizes=[8, 16, 7],
                                      chunk_size=3, ignore_index=3),
    # A rank with no rows, one whose rows are all ignored.
    "empty_and_all_ignored": dict(v=17, rows=[0, 5, 4], bias=True, reduction="sum", all_ignored_rank=1,
                                  z_loss=0.1, chunk_size=5),
    # Multi-label and weighted heads (issue 22): a sparse probability target with class weights and
    # smoothing; index targets with class weights (and ignored rows); one-vs-all BCE.
    "sparse_weighted": dict(v=27, rows=[6, 5, 4], bias=True, reduction="mean", target_kind="sparse",
                            class_weight=True, label_smoothing=0.1, z_loss=0.01, chunk_size=4),
    "index_weighted": dict(v=19, rows=[5, 7, 3], bias=False, reduction="mean", target_kind="index",
                           class_weight=True, label_smoothing=0.2, chunk_size=5),
    "binary": dict(v=25, rows=[4, 6, 5], bias=True, reduction="mean", target_kind="binary", chunk_size=6),
    # The other reductions: per-row losses and the lse of a sparse target over two local shards per rank;
    # one-vs-all with pos_weight ([V], and one element) summed and per row (each rank's entries weighted by
    # the pos_weight of their columns).
    "sparse_none_lse": dict(v=26, rows=[5, 7, 4], bias=True, reduction="none", target_kind="sparse",
                            return_lse=True, local_shards=2, rank_sizes=[9, 6, 11], chunk_size=4),
    "binary_pos_weight_sum": dict(v=23, rows=[6, 3, 5], bias=True, reduction="sum", target_kind="binary",
                                  pos_weight="vector", local_shards=2, chunk_size=5),
    "binary_pos_weight_none": dict(v=21, rows=[4, 0, 6], bias=False, reduction="none", target_kind="binary",
                                   pos_weight="scalar", chunk_size=4),
}
TOPK_V = 19


def rank_sizes(case: dict, world: int) -> Optional[List[int]]:
    sizes = case.get("rank_sizes")
    if sizes is None:
        return None
    sizes = list(sizes[:world])
    sizes[-1] += case["v"] - sum(sizes)  # the last rank takes the rest
    return sizes


def case_weights(case: dict, d: int = D):
    """The logical weight ``[V, d]`` and bias ``[V]`` (or None) of a case, float64 (tests/dtensor_cases.py's
    cases too, with their own ``d``)."""
    g = torch.Generator().manual_seed(case["v"])
    w = torch.randn(case["v"], d, generator=g, dtype=torch.float64)
    b = torch.randn(case["v"], generator=g, dtype=torch.float64) if case.get("bias") else None
    return w, b


def case_inputs(case: dict, rank: int, d: int = D):
    """Rank ``rank``'s ``x [N_r, d]``, ``target [N_r]`` and the coefficients of its objective: ``c`` (on
    the loss: scalar, or ``[N_r]`` for reduction none) and ``e`` (``[N_r]``, on the lse)."""
    n = case["rows"][rank]
    g = torch.Generator().manual_seed(1000 * rank + case["v"])
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, case["v"], (n,), generator=g)
    ignore = case.get("ignore_index", -100)
    if case.get("all_ignored_rank") == rank:
        target[:] = ignore
    else:
        target[1::3] = ignore
    c = torch.rand(n if case["reduction"] == "none" else (), generator=g, dtype=torch.float64) + 0.5
    e = torch.randn(n, generator=g, dtype=torch.float64)
    if case.get("target_kind") in ("sparse", "binary"):  # a dense [N_r, V] target, sent as COO
        dense = (torch.rand(n, case["v"], generator=g) < 0.15).double() * torch.rand(n, case["v"], generator=g,
                                                                                     dtype=torch.float64)
        if n:
            dense[0] = 0.0  # an empty row
        target = dense
    return x, target, c, e


def case_class_weight(case: dict) -> Optional[torch.Tensor]:
    if not case.get("class_weight"):
        return None
    return torch.rand(case["v"], generator=torch.Generator().manual_seed(77), dtype=torch.float64) + 0.5


def case_pos_weight(case: dict) -> Optional[torch.Tensor]:
    kind = case.get("pos_weight")
    if kind is None:
        return None
    if kind == "scalar":
        return torch.tensor([2.5], dtype=torch.float64)
    return torch.rand(case["v"], generator=torch.Generator().manual_seed(78), dtype=torch.float64) * 3


def case_target(case: dict, target: torch.Tensor, device) -> torch.Tensor:
    """What a rank passes to the head: class ids, or the dense target as a (shuffled-free) COO tensor."""
    if case.get("target_kind") in ("sparse", "binary"):
        return target.to_sparse_coo().to(device)
    return target.to(device)


def head_kwargs(case: dict) -> dict:
    keys = ("reduction", "label_smoothing", "z_loss", "softcap", "chunk_size", "ignore_index")
    out = {k: case[k] for k in keys if k in case}
    if case.get("target_kind") == "binary":
        out["loss"] = "binary_cross_entropy"
    if case.get("class_weight"):
        out["class_weight"] = case_class_weight(case)
    if case.get("pos_weight"):
        out["pos_weight"] = case_pos_weight(case)
    return out


# --------------------------------------------------------------------------------------------------
# Jobs (run on every rank, in the same order)
# --------------------------------------------------------------------------------------------------
def _devices(ctx, count: int) -> List[str]:
    return [ctx["device"]] * count


def job_loss(ctx, name: str, offload: bool = False) -> dict:
    """``offload``: each rank's shards in pinned host memory, streamed through its GPU (the offload
    engine inside the distributed one); skipped where this build has no offload engine."""
    case = LOSS_CASES[name]
    rank, world = ctx["rank"], ctx["world"]
    device = ctx["device"]
    try:
        head = hugehead.ChunkedClassifier(
            D, case["v"], case.get("bias", True), dtype=torch.float64,
            devices=_devices(ctx, case.get("local_shards", 1)), process_group=dist.group.WORLD,
            shard_sizes=rank_sizes(case, world), **head_kwargs(case), **(dict(offload=True) if offload else {}),
        )
    except NotImplementedError as exc:
        return dict(skipped=str(exc))
    w, b = case_weights(case)
    head.load_state_dict({"weight": w, "bias": b} if b is not None else {"weight": w})
    x, target, c, e = case_inputs(case, rank)
    x = x.to(device).requires_grad_()
    out = head(x, case_target(case, target, device), return_lse=case.get("return_lse", False))
    loss, lse = out if case.get("return_lse") else (out, None)
    objective = (loss * c.to(device)).sum()
    if lse is not None:
        objective = objective + (lse * e.to(device)).sum()
    objective.backward()
    return dict(
        loss=loss.detach().cpu(), lse=None if lse is None else lse.detach().cpu(), grad_x=x.grad.cpu(),
        shards=[(s.start, s.stop, s.weight.grad.cpu(), None if s.bias is None else s.bias.grad.cpu())
                for s in head.shards],
    )


BF16_CASE = dict(v=4000, d=64, rows=[96, 64])


def bf16_inputs(rank: int):
    """float64 ``x [N_r, 64]`` and ``target`` of the bf16 accuracy job; the weight comes from seed 5."""
    g = torch.Generator().manual_seed(60 + rank)
    n = BF16_CASE["rows"][rank]
    return torch.randn(n, BF16_CASE["d"], generator=g, dtype=torch.float64), torch.randint(0, BF16_CASE["v"], (n,), generator=g)


def bf16_weight():
    g = torch.Generator().manual_seed(5)
    return torch.randn(BF16_CASE["v"], BF16_CASE["d"], generator=g, dtype=torch.float64) / BF16_CASE["d"] ** 0.5 * 3


def job_bf16(ctx) -> dict:
    """bfloat16 rows and head (no bias), mean per rank; every rank's loss and dX, this rank's dW."""
    head = hugehead.ChunkedClassifier(BF16_CASE["d"], BF16_CASE["v"], False, dtype=torch.bfloat16,
                                      devices=_devices(ctx, 1), process_group=dist.group.WORLD, chunk_size=768)
    head.load_state_dict({"weight": bf16_weight().to(torch.bfloat16)})
    x, target = bf16_inputs(ctx["rank"])
    x = x.to(ctx["device"], torch.bfloat16).requires_grad_()
    loss = head(x, target.to(ctx["device"]))
    loss.backward()
    return dict(loss=loss.detach().cpu(), grad_x=x.grad.cpu(),
                shards=[(s.start, s.stop, s.weight.grad.cpu()) for s in head.shards])


def job_topk(ctx) -> dict:
    rank = ctx["rank"]
    case = dict(v=TOPK_V, rows=[5, 0, 7], bias=True, reduction="mean")
    w, b = case_weights(case)
    out = {}
    for softcap in (None, 1.5):
        # Uneven ranks: k = 7 is more than the last rank's classes, V = 19 more than any rank's.
        head = hugehead.ChunkedClassifier(D, TOPK_V, dtype=torch.float64, devices=_devices(ctx, 1), chunk_size=4,
                                          softcap=softcap, process_group=dist.group.WORLD,
                                          shard_sizes={2: [14, 5], 3: [10, 6, 3]}[ctx["world"]])
        head.load_state_dict({"weight": w, "bias": b})
        x, target, _, _ = case_inputs(case, rank)
        x = x.to(ctx["device"])
        for k in (0, 1, 7, TOPK_V):
            values, indices = head.topk(x, k)
            out[(softcap, k)] = (values.cpu(), indices.cpu())
        out[(softcap, "entropy")] = _log_prob_entropy_grads(head, x, target.to(ctx["device"]), rank)
        target = target.clamp(min=0).to(ctx["device"])
        out[(softcap, "log_prob")] = (head.log_prob(x, target).cpu(), target.cpu())
    out["verl"] = _verl_tensor_parallel(ctx)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        out[("distill", divergence)] = _distill_across_ranks(ctx, divergence)
    return out


def distill_heads(world: int):
    """The student's and the teacher's (width D + 3) logical weights and biases, and their shard sizes per rank."""
    g = torch.Generator().manual_seed(99)
    weights = [torch.randn(TOPK_V, d, generator=g, dtype=torch.float64) for d in (D, D + 3)]
    biases = [torch.randn(TOPK_V, generator=g, dtype=torch.float64) for _ in range(2)]
    return weights, biases, {2: [12, 7], 3: [8, 5, 6]}[world]


def distill_inputs(rank: int):
    g = torch.Generator().manual_seed(500 + rank)
    n = [6, 0, 5][rank]
    return (torch.randn(n, D, generator=g, dtype=torch.float64), torch.randn(n, D + 3, generator=g, dtype=torch.float64),
            torch.rand(n, generator=g) > 0.3, torch.randn(n, generator=g, dtype=torch.float64))


def _distill_across_ranks(ctx, divergence: str) -> dict:
    """hugehead.linear_distill of a student head across the ranks against a teacher head across them, held in
    host memory (offloaded, computing on the CPU), with the same class ranges per rank."""
    from hugehead.engines import offload

    (ws, wt), (bs, bt), sizes = distill_heads(ctx["world"])
    allow, offload._ALLOW_CPU_COMPUTE = offload._ALLOW_CPU_COMPUTE, True
    try:
        student = hugehead.ChunkedClassifier(D, TOPK_V, dtype=torch.float64, process_group=dist.group.WORLD,
                                             shard_sizes=sizes, chunk_size=3, devices=_devices(ctx, 1))
        teacher = hugehead.ChunkedClassifier(D + 3, TOPK_V, dtype=torch.float64, process_group=dist.group.WORLD,
                                             shard_sizes=sizes, chunk_size=4, devices=_devices(ctx, 1), offload=True)
        student.load_state_dict({"weight": ws, "bias": bs})
        teacher.load_state_dict({"weight": wt, "bias": bt})
        xs, xt, mask, up = distill_inputs(ctx["rank"])
        xs = xs.requires_grad_()
        rows = hugehead.linear_distill(xs, student, xt, teacher, divergence=divergence, beta=0.3, temperature=0.8,
                                       mask=mask, reduction="none")
        (rows * up).sum().backward()
    finally:
        offload._ALLOW_CPU_COMPUTE = allow
    return dict(rows=rows.detach(), grad_x=xs.grad,
                shards=[(s.start, s.stop, s.weight.grad, s.bias.grad) for s in student.shards])


VERL_V = 24  # split evenly over 2 and 3 ranks, as verl's tensor-parallel vocabulary is


def verl_inputs():
    """The tokens ``[2, 5, D]`` every rank shares, their labels, the logical weight and the upstream gradients."""
    g = torch.Generator().manual_seed(4242)
    hidden = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VERL_V, (2, 5), generator=g)
    weight = torch.randn(VERL_V, D, generator=g, dtype=torch.float64)
    return hidden, labels, weight, torch.randn(2, 10, generator=g, dtype=torch.float64)


def _verl_tensor_parallel(ctx) -> dict:
    """hugehead.integrations.verl.linear_cross_entropy with this rank's rows of the vocabulary."""
    from hugehead.integrations.verl import linear_cross_entropy

    hidden, labels, weight, up = verl_inputs()
    rows = VERL_V // ctx["world"]
    local = weight[ctx["rank"] * rows:(ctx["rank"] + 1) * rows].clone().requires_grad_()
    hidden = hidden.requires_grad_()
    logprobs, entropy = linear_cross_entropy(hidden, local, labels, 0.9, "none", dist.group.WORLD)
    (logprobs * up[0] + entropy * up[1]).sum().backward()
    return dict(logprobs=logprobs.detach(), entropy=entropy.detach(), grad_hidden=hidden.grad, grad_weight=local.grad)


def entropy_upstream(n: int, rank: int) -> torch.Tensor:
    """The upstream gradients ``[2, n]`` (on log p, on the entropy) of a rank's log_prob job."""
    return torch.randn(2, n, generator=torch.Generator().manual_seed(77 + rank), dtype=torch.float64)


def _log_prob_entropy_grads(head, x, target, rank) -> dict:
    """log p and the entropy at temperature 0.8 (ignored rows included), and the gradients of
    ``Σ up_0 log p + up_1 H`` over x and the rank's shards."""
    head.zero_grad()
    xr = x.clone().requires_grad_()
    logp, entropy = head.log_prob(xr, target, temperature=0.8, return_entropy=True)
    up = entropy_upstream(x.shape[0], rank).to(x.device)
    (logp * up[0] + entropy * up[1]).sum().backward()
    return dict(logp=logp.detach().cpu(), entropy=entropy.detach().cpu(), grad_x=xr.grad.cpu(),
                shards=[(s.start, s.stop, s.weight.grad.cpu(), s.bias.grad.cpu()) for s in head.shards])


def job_save(ctx) -> dict:
    """A head initialized under a different seed on every rank (rank 0's wins), written as a state dict and
    a safetensors file; rank 0 has two local shards, the others one."""
    torch.manual_seed(ctx["rank"])
    head = hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=_devices(ctx, 2 if ctx["rank"] == 0 else 1),
                                      process_group=dist.group.WORLD)
    state = head.state_dict()
    prefix = os.path.join(ctx["out"], f"w{ctx['world']}")
    if ctx["rank"] == 0:
        torch.save(state, prefix + ".pt")
    head.save_safetensors(prefix + ".safetensors")
    # torch.distributed.checkpoint of a model holding the head: each rank writes its own rows (nothing
    # gathered); the backbone, the same on every rank, is written once.
    dcp.save(sharded_state_dict(_Net(head, seed=5), for_save=True), checkpoint_id=prefix + ".dcp")
    return dict(state=state, shards=[(s.start, s.stop, s.weight.detach().cpu(), s.bias.detach().cpu())
                                     for s in head.shards])


def job_load(ctx, source: str) -> dict:
    """Load ``<source>.pt`` (a logical state dict) and ``<source>.safetensors`` into heads of this world."""
    out = {}
    torch.manual_seed(999)  # another initialization than the file's: loading must overwrite it
    for kind in ("pt", "safetensors", "dcp"):
        head = hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=_devices(ctx, 1),
                                          process_group=dist.group.WORLD)
        path = os.path.join(ctx["out"], f"{source}.{kind}")
        if kind == "pt":
            head.load_state_dict(torch.load(path))
        elif kind == "safetensors":
            head.load_safetensors(path)
        else:  # in place: every rank reads only the rows of its shards, whatever layout wrote them
            net = _Net(head, seed=77)
            state = sharded_state_dict(net)
            dcp.load(state, checkpoint_id=path)
            net.load_state_dict(state)
            out["dcp_backbone"] = (net.backbone.weight.detach().clone(), net.backbone.bias.detach().clone())
        out[kind] = [(s.start, s.stop, s.weight.detach().cpu(), s.bias.detach().cpu()) for s in head.shards]
    return out


def _average_backbone_grads(net) -> None:
    for p in net.backbone.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def job_ckpt_atomic(ctx) -> dict:
    """hugehead.checkpoint.save_checkpoint over the ranks: a good checkpoint, then a save whose write fails
    on rank 1 only. Every rank must raise, the good checkpoint must stay loadable and no temporary may
    remain; load_checkpoint reads it back (weights and this rank's optimizer state)."""
    from hugehead import checkpoint as ck

    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=_devices(ctx, 1),
                                      process_group=dist.group.WORLD)
    net = _Net(head, seed=5)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    x, target = torch.randn(4 + ctx["rank"], 4, dtype=torch.float64), torch.arange(4 + ctx["rank"]) % 13
    net(x, target).backward()
    _average_backbone_grads(net)  # as DDP would: the backbone stays the same on every rank
    opt.step()
    path = os.path.join(ctx["out"], f"atomic{ctx['world']}")
    ck.save_checkpoint(path, net, opt, extra={"step": 1}, process_group=dist.group.WORLD)
    good = [s.weight.detach().clone() for s in head.shards]
    with torch.no_grad():
        for s in head.shards:
            s.weight.add_(1.0)
    real_write = dcp.FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device (injected)")
        return real_write(self, plan, planner)

    dcp.FileSystemWriter.write_data = failing_write
    error = None
    try:
        ck.save_checkpoint(path, net, opt, process_group=dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001 - what every rank sees is the result
        error = f"{type(exc).__name__}: {exc}"
    finally:
        dcp.FileSystemWriter.write_data = real_write
    dist.barrier()
    leftovers = sorted(n for n in os.listdir(ctx["out"]) if n.startswith(f".atomic{ctx['world']}"))
    torch.manual_seed(1)
    fresh_head = hugehead.ChunkedClassifier(D, 13, dtype=torch.float64, devices=_devices(ctx, 1),
                                            process_group=dist.group.WORLD)
    fresh = _Net(fresh_head, seed=9)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh(x, target).backward()
    _average_backbone_grads(fresh)
    fresh_opt.step()  # state exists, then is overwritten by the load
    extra = ck.load_checkpoint(path, fresh, fresh_opt, process_group=dist.group.WORLD)
    same_opt = all(torch.equal(a, b) for p, q in zip(net.parameters(), fresh.parameters())
                   for a, b in zip(opt.state[p].values(), fresh_opt.state[q].values()))
    return dict(error=error, leftovers=leftovers, extra=extra, same_opt=same_opt,
                loaded=[torch.equal(s.weight.detach(), g) for s, g in zip(fresh_head.shards, good)],
                backbone=torch.equal(fresh.backbone.weight, net.backbone.weight))


class _Net(nn.Module):
    def __init__(self, head, seed: Optional[int] = None):
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)  # the same backbone on every rank
        self.backbone = nn.Linear(4, D, dtype=torch.float64)
        self.head = head

    def forward(self, inputs, target):
        return self.head(torch.tanh(self.backbone(inputs)), target)


def ddp_case():
    g = torch.Generator().manual_seed(7)
    return dict(v=11, backbone_w=torch.randn(D, 4, generator=g, dtype=torch.float64),
                backbone_b=torch.randn(D, generator=g, dtype=torch.float64),
                head_w=torch.randn(11, D, generator=g, dtype=torch.float64),
                head_b=torch.randn(11, generator=g, dtype=torch.float64))


def ddp_inputs(rank: int):
    g = torch.Generator().manual_seed(50 + rank)
    n = 3 + 2 * rank
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 11, (n,), generator=g)


def job_ddp(ctx) -> dict:
    """One SGD step of a DDP-wrapped model whose head spans the ranks and is ignored by DDP."""
    from torch.nn.parallel import DistributedDataParallel

    case = ddp_case()
    head = hugehead.ChunkedClassifier(D, case["v"], dtype=torch.float64, devices=_devices(ctx, 1),
                                      process_group=dist.group.WORLD)
    net = _Net(head).to(ctx["device"])
    with torch.no_grad():
        net.backbone.weight.copy_(case["backbone_w"])
        net.backbone.bias.copy_(case["backbone_b"])
    head.load_state_dict({"weight": case["head_w"], "bias": case["head_b"]})
    ignored = ignore_heads_in_ddp(net)
    ddp = DistributedDataParallel(net, device_ids=None)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    inputs, target = ddp_inputs(ctx["rank"])
    loss = ddp(inputs.to(ctx["device"]), target.to(ctx["device"]))
    loss.backward()
    opt.step()
    state = net.state_dict()
    return dict(ignored=ignored, loss=loss.detach().cpu(), state={k: v.detach().cpu() for k, v in state.items()})


def job_mismatch(ctx) -> dict:
    """Ranks that disagree on the head all get the same error: rank 1 asks for 21 classes; then rank 1
    splits the 20 classes differently (``shard_sizes``)."""
    world, rank = ctx["world"], ctx["rank"]
    sizes = [5] * (world - 1) + [20 - 5 * (world - 1)]
    if rank == 1:
        sizes = [6] + sizes[1:-1] + [sizes[-1] - 1]
    errors = []
    for num_classes, shard_sizes in ((20 + (rank == 1), None), (20, sizes)):
        try:
            hugehead.ChunkedClassifier(D, num_classes, dtype=torch.float64, devices=_devices(ctx, 1),
                                       process_group=dist.group.WORLD, shard_sizes=shard_sizes)
        except ValueError as exc:
            errors.append(str(exc))
        else:
            errors.append(None)
    return dict(errors=errors)


def job_stuck(ctx):
    """Rank 1 waits forever outside any collective (what the world timeout is for)."""
    if ctx["rank"] == 1:
        while True:
            time.sleep(1)
    return {}


JOBS = {
    "stuck": (job_stuck, ()),
    **{f"loss:{name}": (job_loss, (name,)) for name in LOSS_CASES},
    **{f"offload:{name}": (job_loss, (name, True)) for name in LOSS_CASES},
    "topk": (job_topk, ()),
    "save": (job_save, ()),
    "ddp": (job_ddp, ()),
    "bf16": (job_bf16, ()),
    "mismatch": (job_mismatch, ()),
    "ckpt_atomic": (job_ckpt_atomic, ()),
}


def load_job(name: str):
    if name.startswith("load:"):
        return job_load, (name.split(":", 1)[1],)
    return JOBS[name]


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, backend: str, store_path: str, out: str, jobs: List[str]) -> None:
    torch.set_num_threads(1)  # the ranks share a few cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        device = "cpu"
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ctx = dict(rank=rank, world=world, device=device, out=out)
    try:
        for name in jobs:
            fn, args = load_job(name)
            result = fn(ctx, *args)
            torch.save(result, os.path.join(out, f"{name.replace(':', '-')}.{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        raise
    dist.destroy_process_group()
    # Skip the interpreter's teardown: after DDP has imported torch._dynamo, it intermittently aborts
    # ("terminate called without an active exception") once every result is already written.
    os._exit(0)


# A world that has not finished by then is stuck (a rank waiting outside any collective, which the
# process group's own 60 s timeout does not cover): its ranks are killed and the test fails. Generous,
# because CI may share its 2 cores with other work.
WORLD_TIMEOUT_S = float(os.environ.get("HUGEHEAD_TEST_WORLD_TIMEOUT", "900"))


def run_world(world: int, jobs: List[str], out: str, backend: str = "gloo",
              timeout_s: float = WORLD_TIMEOUT_S) -> Dict[str, List[dict]]:
    """Run ``jobs`` on ``world`` spawned ranks; returns ``{job: [result of rank 0, rank 1, ...]}``.
    Raises TimeoutError (after killing the ranks) when they have not all finished within ``timeout_s``."""
    os.makedirs(out, exist_ok=True)
    store = os.path.join(out, f"store.{world}.{backend}")
    if os.path.exists(store):
        os.unlink(store)
    ctx = mp.start_processes(_rank_main, args=(world, backend, store, out, jobs), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=min(5.0, max(0.5, deadline - time.monotonic()))):  # raises when a rank failed
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in ctx.processes:
                proc.join(30)
            raise TimeoutError(f"{world} {backend} ranks running {jobs} did not finish within {timeout_s:.0f} s")
    return {name: [torch.load(os.path.join(out, f"{name.replace(':', '-')}.{r}.pt"), weights_only=False)
                   for r in range(world)] for name in jobs}
