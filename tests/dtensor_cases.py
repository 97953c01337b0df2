"""What the ranks of tests/test_dtensor.py and tests/test_dist_faults.py run: spawned gloo CPU processes
(one per rank) work through a list of jobs and save each job's results per rank; the test process compares
them with single-process float64 references built from the same seeded inputs. Imported by the spawned
ranks, so it needs no pytest.

:func:`spawn_world` bounds every world by a wall-clock limit (ranks still alive then are killed and the
test fails) and returns every rank's exit code, so a test may also let a rank die on purpose."""
from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dist_cases

D = 5

# Loss cases. layout: "fsdp" (rows differ per rank, weight Shard(0)), "tp" (x a Replicate() DTensor, the
# same rows on every rank, weight Shard(0)), "replicate" (weight Replicate(), rows differ per rank).
LOSS_CASES: Dict[str, dict] = {
    # V = 23: uneven over 2 (12, 11) and 3 (8, 8, 7) ranks; streamed in chunks of 4; ignored rows.
    "fsdp_mean_streamed": dict(layout="fsdp", v=23, rows=[7, 4, 5], bias=True, reduction="mean", chunk_size=4),
    # Every option, per-row losses and the lse differentiated, a rank without rows; logits kept.
    "fsdp_options_lse": dict(layout="fsdp", v=29, rows=[6, 0, 9], bias=False, reduction="none", return_lse=True,
                             label_smoothing=0.1, z_loss=0.02, softcap=2.5, ignore_index=3),
    # V = 4 over 3 ranks: torch.chunk gives (2, 2, 0): the last rank holds no classes at all.
    "fsdp_rank_without_classes": dict(layout="fsdp", v=4, rows=[5, 3, 4], bias=True, reduction="sum", chunk_size=1),
    "tp_mean_streamed": dict(layout="tp", v=23, rows=[9], bias=True, reduction="mean", chunk_size=5),
    "tp_options_lse": dict(layout="tp", v=31, rows=[8], bias=True, reduction="none", return_lse=True,
                           label_smoothing=0.05, z_loss=0.1, softcap=1.5),
    "tp_rank_without_classes": dict(layout="tp", v=4, rows=[6], bias=False, reduction="sum", chunk_size=1),
    "replicate": dict(layout="replicate", v=17, rows=[5, 7, 3], bias=True, reduction="mean", label_smoothing=0.2,
                      chunk_size=6),
    # x and target Shard(0) DTensors of the rows (sequence-parallel style): the data-parallel path.
    "fsdp_sharded_x": dict(layout="fsdp", v=23, rows=[4, 4, 4], bias=True, reduction="mean", chunk_size=5,
                           sharded_x=True),
    # float32 tensors under CPU autocast: the head computes in bfloat16, float32 gradients and loss.
    "fsdp_autocast_bf16": dict(layout="fsdp", v=23, rows=[7, 4, 5], bias=True, reduction="mean", chunk_size=4,
                               autocast=True),
    "tp_autocast_bf16": dict(layout="tp", v=23, rows=[9], bias=True, reduction="mean", autocast=True),
    # hugehead.linear_log_prob with the entropy: log p as the "loss" (c on it), the entropy as the "lse" (e on it).
    "fsdp_log_prob_entropy": dict(layout="fsdp", v=23, rows=[7, 4, 5], bias=True, reduction="none", entropy=True,
                                  temperature=0.7, softcap=2.0, chunk_size=4),
    "tp_log_prob_entropy": dict(layout="tp", v=31, rows=[8], bias=False, reduction="none", entropy=True,
                                temperature=1.3),
    "replicate_log_prob_entropy": dict(layout="replicate", v=17, rows=[5, 7, 3], bias=True, reduction="none",
                                       entropy=True, temperature=0.9, chunk_size=6),
}


def case_weights(case: dict):
    """The logical weight ``[V, D]`` and bias ``[V]`` (or None) of a case, float64 (as tests/dist_cases.py's)."""
    return dist_cases.case_weights(case, D)


def case_inputs(case: dict, rank: int):
    """Rank ``rank``'s ``x [N_r, D]``, ``target [N_r]`` and its objective's coefficients ``c`` (on the
    loss) and ``e`` (``[N_r]``, on the lse), drawn as tests/dist_cases.py draws them. With layout "tp"
    every rank has rank 0's rows."""
    return dist_cases.case_inputs(case, 0 if case["layout"] == "tp" else rank, D)


def loss_options(case: dict) -> dict:
    keys = ("reduction", "label_smoothing", "z_loss", "softcap", "chunk_size", "ignore_index", "return_lse")
    return {k: case[k] for k in keys if k in case}


def _mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ctx["world"],))


# --------------------------------------------------------------------------------------------------
# Jobs (run on every rank, in the same order)
# --------------------------------------------------------------------------------------------------
def job_loss(ctx, name: str) -> dict:
    """hugehead.linear_cross_entropy of a DTensor weight; returns the local loss, lse and gradients."""
    import hugehead
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    case = LOSS_CASES[name]
    mesh = _mesh(ctx)
    placement = Replicate() if case["layout"] == "replicate" else Shard(0)
    w, b = case_weights(case)
    dtype = torch.float32 if case.get("autocast") else torch.float64
    w, b = w.to(dtype), None if b is None else b.to(dtype)
    weight = distribute_tensor(w, mesh, [placement]).requires_grad_()
    bias = None if b is None else distribute_tensor(b, mesh, [placement]).requires_grad_()
    x, target, c, e = case_inputs(case, ctx["rank"])
    x = x.to(dtype)
    if case["layout"] == "tp":
        x = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    elif case.get("sharded_x"):
        from torch.distributed.tensor import DTensor

        x = DTensor.from_local(x, mesh, [Shard(0)], run_check=False).requires_grad_()
        target = DTensor.from_local(target, mesh, [Shard(0)], run_check=False)
    else:
        x = x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(case.get("autocast"))):
        if case.get("entropy"):
            out = hugehead.linear_log_prob(x, weight, target, bias=bias, temperature=case["temperature"],
                                           softcap=case.get("softcap"), chunk_size=case.get("chunk_size"),
                                           return_entropy=True)
        else:
            out = hugehead.linear_cross_entropy(x, weight, target, bias, **loss_options(case))
    loss, lse = out if case.get("return_lse") or case.get("entropy") else (out, None)
    objective = (loss * c).sum()
    if lse is not None:
        objective = objective + (lse * e).sum()
    objective.backward()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return dict(
        loss=loss.detach(), lse=None if lse is None else lse.detach(), loss_type=type(loss).__name__,
        grad_x=local(x.grad), grad_x_type=type(x.grad).__name__,
        grad_w=weight.grad.to_local(), grad_w_placements=tuple(str(p) for p in weight.grad.placements),
        grad_b=None if bias is None else bias.grad.to_local(),
    )


def job_errors(ctx) -> dict:
    """What a placement hugehead does not take says so, on every rank."""
    import hugehead
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = _mesh(ctx)
    w = torch.randn(12, D, dtype=torch.float64)
    x, target = torch.randn(3, D, dtype=torch.float64), torch.tensor([0, 1, 2])
    errors = {}
    attempts = {
        "shard1": lambda: hugehead.linear_cross_entropy(x, distribute_tensor(w, mesh, [Shard(1)]), target),
        "partial": lambda: hugehead.linear_cross_entropy(
            x, DTensor.from_local(w, mesh, [Partial()], run_check=False), target),
        "plain_bias": lambda: hugehead.linear_cross_entropy(
            x, distribute_tensor(w, mesh, [Shard(0)]), target, torch.zeros(12, dtype=torch.float64)),
        "x_shard1": lambda: hugehead.linear_cross_entropy(
            distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Shard(0)]), target),
    }
    # Rank 1 alone has a target out of range: every rank raises, none waits in a collective.
    bad = torch.tensor([0, 12 if ctx["rank"] == 1 else 1, 2])
    for layout in ("fsdp", "tp"):
        rows = distribute_tensor(x, mesh, [Replicate()]) if layout == "tp" else x
        attempts[f"bad_target_{layout}"] = lambda rows=rows: hugehead.linear_cross_entropy(
            rows, distribute_tensor(w, mesh, [Shard(0)]), bad)
    for key, attempt in attempts.items():
        try:
            attempt()
        except (ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
        else:
            errors[key] = None
    return errors


COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
               "reduce_scatter_single", "reduce_scatter", "all_reduce", "all_to_all_single", "all_to_all",
               "broadcast", "scatter", "gather", "send", "recv", "isend", "irecv")


class CollectiveLog:
    """Records every ``torch.distributed`` collective (name, bytes of its tensor arguments) while active,
    wherever the function was bound (hugehead's modules keep aliases of some), and fails on any DTensor
    method that would gather or move a DTensor (``full_tensor``, ``redistribute``)."""

    def __init__(self):
        import sys

        self.calls: List[tuple] = []
        self._patches = []
        originals = {getattr(dist, n): n for n in COLLECTIVES if getattr(dist, n, None) is not None}
        modules = [dist] + [m for name, m in list(sys.modules.items()) if name.startswith("hugehead") and m]
        for module in modules:
            for attr, value in list(vars(module).items()):
                if callable(value) and value in originals:
                    self._patches.append((module, attr, value, self._wrap(originals[value], value)))

    @staticmethod
    def _kind(name: str) -> str:
        # torch 2.13's all_gather_single is 2.11's all_gather_into_tensor: one kind of collective.
        for suffix in ("_into_tensor", "_tensor", "_single"):
            name = name.replace(suffix, "")
        return name

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            self.calls.append((self._kind(name), sum(t.numel() * t.element_size() for t in tensors)))
            return fn(*args, **kwargs)
        return counted

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        for module, attr, _, wrapped in self._patches:
            setattr(module, attr, wrapped)
        self._dtensor = {n: getattr(DTensor, n) for n in ("full_tensor", "redistribute")}

        def refuse(name):
            def method(*args, **kwargs):
                raise AssertionError(f"DTensor.{name} called: the weight would move")
            return method

        for n in self._dtensor:
            setattr(DTensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor

        for module, attr, original, _ in self._patches:
            setattr(module, attr, original)
        for n, m in self._dtensor.items():
            setattr(DTensor, n, m)


BYTES_CASE = dict(v=3001, n=[6, 4, 5], d=8)


def job_bytes(ctx) -> dict:
    """The collectives of one forward + backward on a head much larger than the rows (3001 x 8 against a
    few rows of 8): their sizes, for FSDP-style and tensor-parallel rows."""
    import hugehead
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(ctx)
    g = torch.Generator().manual_seed(3)
    v, d = BYTES_CASE["v"], BYTES_CASE["d"]
    weight = distribute_tensor(torch.randn(v, d, generator=g), mesh, [Shard(0)]).requires_grad_()
    bias = distribute_tensor(torch.randn(v, generator=g), mesh, [Shard(0)]).requires_grad_()
    out = {}
    for layout in ("fsdp", "tp"):
        n = BYTES_CASE["n"][ctx["rank"] if layout == "fsdp" else 0]
        x = torch.randn(n, d, generator=torch.Generator().manual_seed(ctx["rank"] if layout == "fsdp" else 0))
        target = torch.arange(n) * 7 % v
        if layout == "tp":
            x = distribute_tensor(x, mesh, [Replicate()])
        x.requires_grad_()
        with CollectiveLog() as log:
            hugehead.linear_cross_entropy(x, weight, target, bias, chunk_size=256).backward()
        out[layout] = dict(calls=log.calls, local_weight_bytes=weight.to_local().numel() * 4)
    return out


# --------------------------------------------------------------------------------------------------
# The FSDP2 recipe: a model whose head is huge, trained with fully_shard
# --------------------------------------------------------------------------------------------------
TRAIN = dict(v=23, d_in=4, rows=12, steps=4, lr=0.05, saved_after=3)
TRAIN_VARIANTS = ("sharded", "gathered", "classifier", "accumulated")


def train_init():
    """The model's initial float64 parameters, by name."""
    g = torch.Generator().manual_seed(11)
    v, d_in = TRAIN["v"], TRAIN["d_in"]
    shapes = {"body.0.weight": (D, d_in), "body.0.bias": (D,), "body.2.weight": (D, D), "body.2.bias": (D,),
              "head.weight": (v, D), "head.bias": (v,)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def train_batch(step: int):
    """The global batch of ``step``: ``TRAIN["rows"]`` rows, split evenly over the ranks of any world."""
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(TRAIN["rows"], TRAIN["d_in"], generator=g, dtype=torch.float64),
            torch.randint(0, TRAIN["v"], (TRAIN["rows"],), generator=g))


class TrainNet(nn.Module):
    """A small backbone and a linear head; ``forward`` returns the loss through hugehead. With a
    :class:`hugehead.ChunkedClassifier` as ``head`` the loss is the head's own."""

    def __init__(self, head: Optional[nn.Module] = None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(TRAIN["d_in"], D), nn.Tanh(), nn.Linear(D, D), nn.Tanh())
        self.head = head if head is not None else nn.Linear(D, TRAIN["v"])
        self.to(torch.float64)

    def forward(self, inputs, target):
        import hugehead

        features = self.body(inputs)
        self.head_weight_seen = type(getattr(self.head, "weight", None)).__name__
        if isinstance(self.head, hugehead.ChunkedClassifier):
            return self.head(features, target)
        # Inside fully_shard's forward: a DTensor (Shard(0)) when the head is its own FSDP unit (never
        # called, so never gathered), the gathered weight when it belongs to the root's unit.
        return hugehead.linear_cross_entropy(features, self.head.weight, target, self.head.bias)


def build_fsdp_net(variant: str, params: Dict[str, torch.Tensor]):
    """The recipe of each variant, from the logical ``params``:

    - sharded / accumulated: ``fully_shard`` on every backbone layer, on the head (its own unit, never
      called: its weight stays a Shard(0) DTensor that hugehead uses where it lies) and on the root.
    - gathered: the head inside the root's unit: FSDP2 all-gathers its weight for every forward.
    - classifier: a ``ChunkedClassifier(process_group=...)`` head left out of FSDP2 (``ignored_params``).
    """
    import hugehead
    from torch.distributed.fsdp import fully_shard

    head = None
    if variant == "classifier":
        head = hugehead.ChunkedClassifier(D, TRAIN["v"], dtype=torch.float64, devices=["cpu"],
                                          process_group=dist.group.WORLD)
        head.load_state_dict({"weight": params["head.weight"], "bias": params["head.bias"]})
    net = TrainNet(head)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name in params:
                p.copy_(params[name])
    fully_shard(net.body[0])
    fully_shard(net.body[2])
    if variant in ("sharded", "accumulated"):
        fully_shard(net.head)
    fully_shard(net, ignored_params=set(net.head.parameters()) if variant == "classifier" else None)
    return net


def full_params(net) -> Dict[str, torch.Tensor]:
    """Every logical parameter by name (collective: DTensors gathered, a distributed head's state dict)."""
    out = {}
    for name, p in net.named_parameters():
        if not name.startswith("head.shards."):
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    if not any(k.startswith("head.") for k in out):
        out.update({f"head.{k}": v for k, v in net.head.state_dict().items()})
    return out


def fsdp_step(net, opt, step: int, ctx, micro_batches: int = 1) -> float:
    """One optimizer step on this rank's rows of the step's global batch; the loss is the mean over them
    (with ``micro_batches``, the mean of the micro-batches' means, gradient sync only on the last)."""
    inputs, target = train_batch(step)
    rows = TRAIN["rows"] // ctx["world"]
    lo = ctx["rank"] * rows
    inputs, target = inputs[lo:lo + rows], target[lo:lo + rows]
    opt.zero_grad()
    total = 0.0
    for m, (xs, ts) in enumerate(zip(inputs.chunk(micro_batches), target.chunk(micro_batches))):
        net.set_requires_gradient_sync(m == micro_batches - 1)
        loss = net(xs, ts) / micro_batches
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


def job_train(ctx, variant: str) -> dict:
    """``TRAIN["steps"]`` AdamW steps of a variant; the sharded one also writes a torch.distributed.checkpoint
    of the model and optimizer after step ``saved_after`` (``w<world>.dcp``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net = build_fsdp_net(variant, train_init())
    opt = torch.optim.AdamW(net.parameters(), lr=TRAIN["lr"])
    losses, saved, saved_exp_avg = [], None, None
    for step in range(TRAIN["steps"]):
        losses.append(fsdp_step(net, opt, step, ctx, micro_batches=2 if variant == "accumulated" else 1))
        if variant == "sharded" and step + 1 == TRAIN["saved_after"]:
            model_state, optim_state = get_state_dict(net, opt)
            dcp.save({"model": model_state, "optim": optim_state},
                     checkpoint_id=os.path.join(ctx["out"], f"w{ctx['world']}.dcp"))
            saved = full_params(net)
            saved_exp_avg = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in net.named_parameters()}
    return dict(losses=losses, params=full_params(net), saved=saved, saved_exp_avg=saved_exp_avg, head_weight_seen=net.head_weight_seen)


def job_resume(ctx, source: str) -> dict:
    """The sharded recipe with another initialization, loaded from ``<source>.dcp`` (written by another
    world size), then its remaining steps: the same model and optimizer state as the saving run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(5)
    net = build_fsdp_net("sharded", {k: torch.randn_like(v) for k, v in train_init().items()})
    opt = torch.optim.AdamW(net.parameters(), lr=TRAIN["lr"])
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(ctx["out"], f"{source}.dcp"))
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_params(net)
    exp_avg = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in net.named_parameters()}
    for step in range(TRAIN["saved_after"], TRAIN["steps"]):
        fsdp_step(net, opt, step, ctx)
    return dict(loaded=loaded, exp_avg=exp_avg, params=full_params(net))


# --------------------------------------------------------------------------------------------------
# hugehead.integrations.transformers.patch on an FSDP2-wrapped causal LM
# --------------------------------------------------------------------------------------------------
HF = dict(vocab=67, hidden=16, layers=2, seq=7, batch=2)
HF_VARIANTS = ("head_unit", "root_unit")


def hf_model():
    """A tiny Llama (float64, untied lm_head of 67 classes: uneven over 2 and 3 ranks), the same on every
    rank and in the test process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(21)
    config = LlamaConfig(vocab_size=HF["vocab"], hidden_size=HF["hidden"], intermediate_size=2 * HF["hidden"],
                         num_hidden_layers=HF["layers"], num_attention_heads=2, num_key_value_heads=2,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config).to(torch.float64)


def hf_batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + rank)
    ids = torch.randint(0, HF["vocab"], (HF["batch"], HF["seq"]), generator=g)
    return ids


def job_hf(ctx, variant: str) -> dict:
    """fully_shard on every decoder layer and the root (``head_unit``: lm_head its own unit too), then
    ``patch``; one forward with labels and backward. Returns the loss and every parameter's gathered
    gradient."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("hugehead.integrations") is None:
        return dict(skipped="needs transformers and hugehead.integrations.transformers")
    from torch.distributed.fsdp import fully_shard

    from hugehead.integrations.transformers import patch

    model = hf_model()
    for layer in model.model.layers:
        fully_shard(layer)
    if variant == "head_unit":
        fully_shard(model.lm_head)
    fully_shard(model)
    patch(model)
    seen = []
    import hugehead.integrations.transformers as hf_integration

    real = hf_integration.linear_cross_entropy

    def recording(x, weight, *args, **kwargs):
        seen.append(type(weight).__name__)
        return real(x, weight, *args, **kwargs)

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    real_unshard, unsharded = FSDPParamGroup.unshard, []

    def unshard(group, *args, **kwargs):  # which FSDP2 units gather their weights during the step
        unsharded.append(group._module_fqn)
        return real_unshard(group, *args, **kwargs)

    hf_integration.linear_cross_entropy = recording
    FSDPParamGroup.unshard = unshard
    try:
        ids = hf_batch(ctx["rank"])
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        hf_integration.linear_cross_entropy = real
        FSDPParamGroup.unshard = real_unshard
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
             for n, p in model.named_parameters()}
    return dict(loss=out.loss.detach(), logits=out.logits, grads=grads, weight_seen=seen, unsharded=unsharded)


# --------------------------------------------------------------------------------------------------
# Distributed faults: a rank of a process_group= head dies mid-step
# --------------------------------------------------------------------------------------------------
FAULT = dict(v=19, d_in=4, steps=6, save_every=2, die_at=4, victim=1, exit_code=17, lr=0.05)


class FaultNet(nn.Module):
    def __init__(self, seed: int):
        import hugehead

        super().__init__()
        torch.manual_seed(seed)  # the same backbone on every rank; the head's initialization is rank 0's
        self.backbone = nn.Linear(FAULT["d_in"], D, dtype=torch.float64)
        self.head = hugehead.ChunkedClassifier(D, FAULT["v"], dtype=torch.float64, devices=["cpu"], chunk_size=4,
                                               process_group=dist.group.WORLD)

    def forward(self, inputs, target):
        return self.head(torch.tanh(self.backbone(inputs)), target)


def fault_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = 3 + rank
    return torch.randn(n, FAULT["d_in"], generator=g, dtype=torch.float64), torch.randint(0, FAULT["v"], (n,), generator=g)


def fault_train(ctx, net, opt, first_step: int, checkpoint: Optional[str], die_at: Optional[int] = None) -> int:
    """Train from ``first_step`` to ``FAULT["steps"]``, a checkpoint every ``save_every`` steps; at step
    ``die_at`` the victim rank dies (``os._exit``) inside the head's backward, between its all-gather and
    its reduce-scatter, while the other ranks are in the same step's collectives."""
    from hugehead import checkpoint as ck

    for step in range(first_step, FAULT["steps"]):
        ctx["step"] = step
        if step == die_at and ctx["rank"] == FAULT["victim"]:
            local = net.head.engine.local

            def die(*args, **kwargs):
                os._exit(FAULT["exit_code"])

            local.backward = die
        inputs, target = fault_batch(step, ctx["rank"])
        opt.zero_grad()
        net(inputs, target).backward()
        for p in net.backbone.parameters():  # as DDP would: the backbone's gradients averaged
            dist.all_reduce(p.grad)
            p.grad /= ctx["world"]
        opt.step()
        if checkpoint is not None and (step + 1) % FAULT["save_every"] == 0:
            ck.save_checkpoint(checkpoint, net, opt, extra={"step": step + 1}, process_group=dist.group.WORLD)
    return FAULT["steps"]


def _fault_state(net) -> dict:
    return dict(shards=[(s.start, s.stop, s.weight.detach().clone(), s.bias.detach().clone()) for s in net.head.shards],
                backbone=[p.detach().clone() for p in net.backbone.parameters()])


def job_fault_dies(ctx) -> dict:
    """The victim dies at step ``die_at``; every other rank must raise (not hang) and report what it saw."""
    net = FaultNet(seed=3)
    opt = torch.optim.AdamW(net.parameters(), lr=FAULT["lr"])
    start = time.monotonic()
    try:
        fault_train(ctx, net, opt, 0, os.path.join(ctx["out"], "fault.ckpt"), die_at=FAULT["die_at"])
    except Exception as exc:  # noqa: BLE001 - what the surviving ranks see is the result
        return dict(error=f"{type(exc).__name__}: {exc}", step=ctx["step"], seconds=time.monotonic() - start)
    return dict(error=None, step=ctx["step"])


def job_fault_resume(ctx) -> dict:
    """A new run (another initialization) resumed from the last checkpoint the interrupted run wrote."""
    from hugehead import checkpoint as ck

    net = FaultNet(seed=8)
    opt = torch.optim.AdamW(net.parameters(), lr=FAULT["lr"])
    extra = ck.load_checkpoint(os.path.join(ctx["out"], "fault.ckpt"), net, opt, process_group=dist.group.WORLD)
    fault_train(ctx, net, opt, extra["step"], None)
    return dict(resumed_at=extra["step"], **_fault_state(net))


def job_fault_straight(ctx) -> dict:
    """The same run, uninterrupted."""
    net = FaultNet(seed=3)
    opt = torch.optim.AdamW(net.parameters(), lr=FAULT["lr"])
    fault_train(ctx, net, opt, 0, None)
    return _fault_state(net)


JOBS = {
    **{f"loss:{name}": (job_loss, (name,)) for name in LOSS_CASES},
    "errors": (job_errors, ()),
    "bytes": (job_bytes, ()),
    **{f"train:{v}": (job_train, (v,)) for v in TRAIN_VARIANTS},
    "resume:w2": (job_resume, ("w2",)),
    **{f"hf:{v}": (job_hf, (v,)) for v in HF_VARIANTS},
    "fault:dies": (job_fault_dies, ()),
    "fault:resume": (job_fault_resume, ()),
    "fault:straight": (job_fault_straight, ()),
}


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------
def result_path(out: str, job: str, rank: int) -> str:
    return os.path.join(out, f"{job.replace(':', '-').replace('/', '_')}.{rank}.pt")


def _rank_main(rank: int, world: int, store_path: str, out: str, jobs: List[str], pg_timeout_s: float) -> None:
    torch.set_num_threads(1)  # the ranks share a few cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    ctx = dict(rank=rank, world=world, out=out)
    try:
        for name in jobs:
            fn, args = JOBS[name]
            torch.save(fn(ctx, *args), result_path(out, name, rank))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: see tests/dist_cases.py


def spawn_world(world: int, jobs: List[str], out: str, timeout_s: float = 300, pg_timeout_s: float = 60,
                target=_rank_main, args: tuple = ()) -> List[Optional[int]]:
    """Run ``jobs`` on ``world`` spawned gloo ranks; returns each rank's exit code, or None for a rank still
    running after ``timeout_s`` (it is then killed)."""
    os.makedirs(out, exist_ok=True)
    store = os.path.join(out, f"store.{world}.{time.monotonic_ns()}")
    context = mp.get_context("spawn")
    procs = [context.Process(target=target, args=(rank, world, store, out, jobs, pg_timeout_s, *args))
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    codes: List[Optional[int]] = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        codes.append(p.exitcode)
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    return codes


def run_world(world: int, jobs: List[str], out: str, timeout_s: float = 300) -> Dict[str, List[dict]]:
    """``{job: [result of rank 0, rank 1, ...]}``; raises if a rank failed or ran past ``timeout_s``."""
    codes = spawn_world(world, jobs, out, timeout_s)
    if codes != [0] * world:
        raise RuntimeError(f"ranks of a {world}-process world ended with exit codes {codes} (None: killed after "
                           f"{timeout_s} s); their tracebacks are in the captured stderr")
    return {name: [torch.load(result_path(out, name, r), weights_only=False) for r in range(world)]
            for name in jobs}
