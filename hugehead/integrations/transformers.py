"""Hugging Face transformers: :func:`patch` puts hugehead under a causal LM's loss, or turns a
``*ForSequenceClassification`` head into a :class:`ClassifierHead` (a :class:`~hugehead.ChunkedClassifier`).

One mechanism for every architecture, no per-class forward: the model's forward is wrapped on the
instance. A call with ``labels`` runs the model's own forward with ``labels=None`` while hooks on the head
module record the head's input and hand back a small placeholder instead of ``[..., V]`` logits. Whatever
the forward does to the logits after the head (Gemma 2's softcap, Granite's scaling, a classifier's
pooling of one token per sequence) it does to the placeholder, which is read back: hugehead reproduces a
softcap named by the config, a constant scale and row selection, and refuses anything else rather than
compute a different loss. The loss then comes from the recorded hidden states and the head's own weights.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional import linear_cross_entropy
from ..module import ChunkedClassifier
from .recording import Recorder, causal_placeholder, logit_scale, pooled_rows, row_placeholder

__all__ = ["patch", "head_inputs", "ClassifierHead", "LOGITS_MAX_CLASSES"]

# A patched sequence classifier returns logits (``return_logits=None``) when it has at most this many
# classes: below it a [rows, V] tensor is what nn.Linear would have made anyway; above it (extreme
# classification) use ``head.topk(head_inputs(model, ...))``.
LOGITS_MAX_CLASSES = 65536

_PATCH_ATTR = "_hugehead_patch"


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "hugehead.integrations.transformers needs Hugging Face transformers: pip install 'hugehead[transformers]'"
        ) from exc


def _is_peft(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def _device_guard(device: torch.device):
    # A head on a GPU that is not the current one: every launch of the loss goes to the head's device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------
# The head of a patched sequence classifier
# --------------------------------------------------------------------------------------------------
class ClassifierHead(ChunkedClassifier):
    """The :class:`~hugehead.ChunkedClassifier` that :func:`patch` puts where a sequence classifier's
    ``nn.Linear`` was. ``head(x, target)`` is the loss, as for ChunkedClassifier; ``head(x)`` returns the
    logits ``x Wᵀ + b`` as the Linear did (gathered from every shard onto ``x``'s device: use it for
    small heads; :meth:`topk` streams). Its ``state_dict()`` keeps the Linear's keys (``weight [V, D]``,
    ``bias [V]``), so checkpoints load into the unpatched model."""

    def forward(self, x: Tensor, target: Optional[Tensor] = None, *, return_lse: bool = False):
        if target is not None:
            return super().forward(x, target, return_lse=return_lse)
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        """``F.linear(x, W, b)`` over all shards: ``x [..., D]`` -> ``[..., V]`` on ``x``'s device, in the
        dtype ``F.linear`` gives (the autocast dtype under autocast).

        Raises:
            ValueError: ``x`` is not ``[..., D]``. NotImplementedError: a head split over ranks
                (``process_group``), whose logits no single rank holds.
        """
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"hugehead: x must be [..., D] = [..., {self.in_features}], got {shape}")
        if not self.engine.holds_every_class():
            raise NotImplementedError(
                "hugehead: a head split over ranks (process_group) returns no logits; use head.topk or the loss"
            )
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_zeros((*x.shape[:-1], self.num_classes))
        pieces = []
        for shard in self.shards:
            device = shard.compute_device  # an offloaded shard is copied to its GPU for this
            bias = None if shard.bias is None else shard.bias.to(device)
            pieces.append(F.linear(rows.to(device), shard.weight.to(device), bias).to(x.device))
        return torch.cat(pieces, dim=-1).reshape(*x.shape[:-1], self.num_classes)


# --------------------------------------------------------------------------------------------------
# The patch
# --------------------------------------------------------------------------------------------------
@dataclass
class _Patch:
    kind: str  # "causal_lm" | "sequence_classification"
    head_path: str
    head: nn.Module
    signature: inspect.Signature
    chunk_size: Optional[int]
    memory_budget: Optional[int]
    return_logits: Optional[bool]


class _PatchedForward:
    """The instance's ``forward`` after :func:`patch` (a module-level class, so the model still pickles
    and deep-copies: a copy's forward runs the copy). ``inspect.signature`` sees the original forward's,
    which ``generate`` and ``Trainer`` read (``logits_to_keep``, ``num_items_in_batch``)."""

    def __init__(self, model: nn.Module, previous: Optional[Callable]):
        self.model = model
        self.previous = previous  # an instance-level forward that was there before (e.g. accelerate's)
        self.__signature__ = inspect.signature(previous if previous is not None else model.forward)

    def original(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        state: _Patch = getattr(self.model, _PATCH_ATTR)
        features_only = kwargs.pop("_hugehead_features", False)  # set by head_inputs()
        forward = _causal_lm_forward if state.kind == "causal_lm" else _classifier_forward
        return forward(self.model, state, self.original, args, kwargs, features_only)


def _bind(state: _Patch, args, kwargs) -> Tuple[inspect.BoundArguments, dict]:
    """The call's arguments (raising the TypeError the forward would) and a flat view of them."""
    bound = state.signature.bind_partial(*args, **kwargs)
    flat = dict(bound.arguments)
    for name, param in state.signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            flat.update(flat.pop(name, {}))
    return bound, flat


def _set_argument(state: _Patch, bound: inspect.BoundArguments, name: str, value) -> None:
    params = state.signature.parameters
    if name in params and params[name].kind is not inspect.Parameter.VAR_KEYWORD:
        bound.arguments[name] = value
        return
    var_kw = next((p for p, v in params.items() if v.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var_kw is not None:
        bound.arguments.setdefault(var_kw, {})[name] = value


def _check_head(model: nn.Module, state: _Patch) -> None:
    current = model.get_submodule(state.head_path)
    if current is not state.head:
        what = "a PEFT adapter or modules_to_save wrapper" if _is_peft(current) else "another module"
        raise RuntimeError(
            f"hugehead: the patched head at {state.head_path!r} has been replaced by {type(current).__name__} "
            f"({what}). hugehead computes the loss from the patched head's own weights, so that module would "
            f"never be trained: keep the head out of the adapter (PEFT target_modules / modules_to_save)."
        )


def _call(model, state, original, args, kwargs, recorder_placeholder) -> Tuple[Any, Tensor, dict, bool]:
    """Run the original forward with ``labels=None`` and the head recorded; returns ``(output, head input,
    flat arguments, whether the caller asked for a tuple)``."""
    bound, flat = _bind(state, args, kwargs)
    _check_head(model, state)
    return_dict = flat.get("return_dict")
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    _set_argument(state, bound, "labels", None)
    _set_argument(state, bound, "return_dict", True)
    who = type(model).__name__
    owner_path, _, name = state.head_path.rpartition(".")
    with Recorder(state.head, recorder_placeholder, who, model.get_submodule(owner_path), name) as recorder:
        output = original(*bound.args, **bound.kwargs)
    if not hasattr(output, "logits") or not hasattr(output, "to_tuple"):
        raise NotImplementedError(f"hugehead: {who}'s forward returned {type(output).__name__}, not a ModelOutput")
    return output, recorder.input(), flat, not return_dict


def _replace_output(output, loss: Optional[Tensor], logits: Optional[Tensor], as_tuple: bool):
    # A ModelOutput keeps a field set to None in its dict: build a new one without the placeholder.
    fields = {k: v for k, v in output.items() if k not in ("loss", "logits")}
    if loss is not None:
        fields["loss"] = loss
    if logits is not None:
        fields["logits"] = logits
    result = type(output)(**fields)
    return result.to_tuple() if as_tuple else result


def _causal_lm_forward(model, state: _Patch, original, args, kwargs, features_only: bool):
    labels = _bind(state, args, kwargs)[1].get("labels")
    if labels is None and not features_only:
        return original(*args, **kwargs)  # evaluation, generate: exactly as before
    output, x, flat, as_tuple = _call(model, state, original, args, kwargs, causal_placeholder)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    scale = logit_scale(output.logits, x, softcap, type(model).__name__)
    if features_only:
        return x
    ignore_index = int(flat.get("ignore_index", -100))
    target = flat.get("shift_labels")
    if target is None:  # as transformers' ForCausalLMLoss: tokens < n predict n
        target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"hugehead: the shifted labels have shape {tuple(target.shape)} but lm_head saw hidden states "
            f"{tuple(x.shape)} (logits_to_keep slices the hidden states: pass shift_labels of the kept length)"
        )
    head: nn.Linear = state.head
    weight, bias = head.weight, head.bias
    if weight.is_meta:
        raise NotImplementedError(
            f"hugehead: {type(model).__name__}'s {state.head_path}.weight is on the meta device outside its forward "
            f"(offloaded by accelerate's device_map?); patch() needs the head's weight resident on a device"
        )
    x = x.to(weight.device)
    if scale != 1.0:  # s * (x Wᵀ + b) = (s x) Wᵀ + s b
        x = x * scale
        bias = None if bias is None else bias * scale
    num_items = flat.get("num_items_in_batch")
    with _device_guard(weight.device):
        # Rows flattened here: the DTensor path of linear_cross_entropy (an FSDP2-sharded lm_head) takes [N, D].
        loss = linear_cross_entropy(
            x.reshape(-1, x.shape[-1]), weight, target.reshape(-1).to(weight.device), bias,
            ignore_index=ignore_index, reduction="mean" if num_items is None else "sum", softcap=softcap,
            chunk_size=state.chunk_size, memory_budget=state.memory_budget,
        )
    if num_items is not None:  # transformers' gradient-accumulation normalization: sum / tokens in the step
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return _replace_output(output, loss, None, as_tuple)


def _problem_type(config, labels: Tensor) -> str:
    # As the unpatched forwards decide it (and record it on the config, as they do).
    if config.problem_type is None:
        if config.num_labels > 1 and labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "regression" if config.num_labels == 1 else "multi_label_classification"
    return config.problem_type


def _classifier_forward(model, state: _Patch, original, args, kwargs, features_only: bool):
    output, x, flat, as_tuple = _call(model, state, original, args, kwargs, row_placeholder)
    who = type(model).__name__
    rows = pooled_rows(output.logits, x, who)
    if features_only:
        return rows
    head: ClassifierHead = state.head
    labels = flat.get("labels")
    loss = None
    if labels is not None:
        problem = _problem_type(model.config, labels)
        if problem != "single_label_classification":
            raise NotImplementedError(
                f"hugehead: a patched {who} computes single-label cross-entropy only; problem_type={problem!r} "
                f"(labels of dtype {labels.dtype}) is not supported yet"
            )
        target = labels.reshape(-1)
        if target.shape[0] != rows.shape[0]:
            raise ValueError(f"hugehead: labels has {target.shape[0]} entries for {rows.shape[0]} pooled rows")
        loss = head(rows, target.to(rows.device))
    want = state.return_logits
    if want is None:
        want = head.num_classes <= LOGITS_MAX_CLASSES and head.engine.holds_every_class()
    logits = head.logits(rows).reshape(*output.logits.shape[:-1], head.num_classes) if want else None
    return _replace_output(output, loss, logits, as_tuple)


def head_inputs(model: nn.Module, *args, **kwargs) -> Tensor:
    """What the patched head sees for these inputs: a sequence classifier's pooled rows ``[M, D]`` (one
    per example, after the forward's pooling and dropout), or a causal LM's final hidden states
    ``[B, T, D]`` (after ``logits_to_keep``). Use it with ``model.<head>.topk(...)`` where logits are
    too large to return. Takes the model's forward arguments; ``labels`` are ignored.

    Raises:
        ValueError: the model was not patched.
    """
    base = _peft_base(model)
    if getattr(base, _PATCH_ATTR, None) is None:
        raise ValueError("hugehead: head_inputs needs a model patched with hugehead.integrations.transformers.patch")
    return base.forward(*args, _hugehead_features=True, **kwargs)


def _peft_base(model: nn.Module) -> nn.Module:
    if _is_peft(model) and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def _module_path(root: nn.Module, module: nn.Module) -> str:
    for name, candidate in root.named_modules():
        if candidate is module:
            return name
    raise ValueError("hugehead: the model's output embeddings are not one of its submodules")


def _refuse_peft_head(module: nn.Module, path: str) -> None:
    for name, sub in module.named_modules():
        if _is_peft(sub):
            raise ValueError(
                f"hugehead: the head {path!r} carries a PEFT module ({type(sub).__name__} at "
                f"{'.'.join(filter(None, [path, name]))}). hugehead computes the loss from the head's base "
                f"weights, so an adapter on it would never be trained: keep the head out of the adapter "
                f"(PEFT target_modules / modules_to_save) before patch()."
            )


def _find_classifier(model: nn.Module) -> Tuple[str, nn.Linear]:
    num_labels = model.config.num_labels
    for name in ("classifier", "score"):
        module = getattr(model, name, None)
        if not isinstance(module, nn.Module):
            continue
        _refuse_peft_head(module, name)
        if isinstance(module, nn.Linear):
            if module.out_features != num_labels:
                break
            return name, module
        linears = [(n, m) for n, m in module.named_modules()
                   if isinstance(m, nn.Linear) and m.out_features == num_labels]
        if len(linears) > 1:
            linears = [(n, m) for n, m in linears if n.split(".")[-1] == "out_proj"]
        if len(linears) == 1:
            return f"{name}.{linears[0][0]}", linears[0][1]
        break
    raise NotImplementedError(
        f"hugehead: {type(model).__name__} has no classification Linear patch() knows: it looks for a Linear with "
        f"num_labels={num_labels} outputs at 'classifier' or 'score', or one such Linear inside them "
        f"(e.g. RoBERTa's classifier.out_proj)"
    )


def patch(
    model: nn.Module,
    *,
    devices=None,
    offload: bool = False,
    process_group=None,
    memory_budget: Optional[int] = None,
    chunk_size: Optional[int] = None,
    return_logits: Optional[bool] = None,
) -> nn.Module:
    """Make a transformers model compute its loss with hugehead, in place; returns ``model``.

    **Causal LMs** — a decoder-only ``*ForCausalLM`` / ``*LMHeadModel`` whose output embeddings are an
    ``nn.Linear`` (``lm_head``) and whose loss is transformers' ``ForCausalLMLoss``: a forward with
    ``labels`` computes that loss with :func:`hugehead.linear_cross_entropy` from the final hidden states
    and ``lm_head.weight`` (and bias) — the same shift (or ``shift_labels``), ``ignore_index=-100``,
    ``num_items_in_batch`` normalization (``sum / num_items_in_batch``, as under gradient accumulation),
    the config's ``final_logit_softcapping`` (Gemma 2), a constant logit scale the forward applies
    (Granite); a tied ``lm_head.weight`` is the embedding's Parameter, so it gets both gradients. Its
    ``logits`` are None (no ``[tokens, V]`` tensor). Without ``labels`` (evaluation, ``generate``) the
    model runs exactly as before. ``lm_head`` stays where it is (the placement options do not apply).

    **Sequence classifiers** — a ``*ForSequenceClassification`` whose head is a Linear with
    ``num_labels`` outputs at ``classifier`` or ``score``, or one such Linear inside them (RoBERTa's
    ``classifier.out_proj``): that Linear becomes a :class:`ClassifierHead` with the same weights, placed
    by ``devices``/``offload``/``process_group`` (default: where the Linear was, moving with the model).
    The forward's pooling (BERT's pooler, the last non-padding token for ``score`` heads) is kept, only
    the selected rows reach the head; the loss is hugehead's single-label cross-entropy (mean, as
    the unpatched model). ``logits`` are returned when ``return_logits`` is True, or when it is None and
    the head has at most :data:`LOGITS_MAX_CLASSES` classes (and is not split over ranks); otherwise
    None: use ``model.<head>.topk(head_inputs(model, **inputs), k)``. ``state_dict()`` /
    ``save_pretrained`` keep the Linear's keys (``classifier.weight [V, D]``, ``classifier.bias``): the
    unpatched class loads a patched model's checkpoint, and ``patch`` applies to a loaded model. Build
    the optimizer after ``patch`` (the head's Parameters are new).

    Args:
        model: a ``transformers.PreTrainedModel`` (or a PEFT model around one, without an adapter on the head).
        devices, offload, process_group, memory_budget, chunk_size: as for :class:`hugehead.ChunkedClassifier`
            (a causal LM takes ``memory_budget`` and ``chunk_size`` only).
        return_logits: sequence classifiers only, see above.
    Raises:
        TypeError: a model of another kind (neither of the above). ValueError: already patched; placement
            options for a causal LM; a PEFT adapter on the head; a custom ``loss_function``.
        NotImplementedError: a multi-label or regression classifier; a head layout not listed above; at
            forward time, a forward that transforms the head's output in a way hugehead cannot reproduce.
        RuntimeError: at forward time, when the head has been wrapped since (e.g. by PEFT).
    """
    _require_transformers()
    from transformers import PreTrainedModel

    base = _peft_base(model)
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"hugehead: patch() takes a transformers PreTrainedModel, got {type(base).__name__}")
    if getattr(base, _PATCH_ATTR, None) is not None:
        raise ValueError(f"hugehead: this {type(base).__name__} is already patched")
    name, config = type(base).__name__, base.config
    signature = inspect.signature(base.forward)
    causal = name.endswith(("ForCausalLM", "LMHeadModel")) and not getattr(config, "is_encoder_decoder", False)
    if not causal and not name.endswith("ForSequenceClassification"):
        raise TypeError(
            f"hugehead: patch() supports decoder-only causal LMs (*ForCausalLM, *LMHeadModel) and "
            f"*ForSequenceClassification models, not {name}"
        )
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if "labels" not in signature.parameters and not takes_any:
        raise TypeError(f"hugehead: {name}.forward takes no labels; patch() has no loss to compute")
    make = _patch_causal_lm if causal else _patch_classifier
    state = make(base, signature, devices, offload, process_group, memory_budget, chunk_size, return_logits)
    setattr(base, _PATCH_ATTR, state)
    base.forward = _PatchedForward(base, base.__dict__.get("forward"))
    return model


def _patch_causal_lm(base, signature, devices, offload, process_group, memory_budget, chunk_size,
                     return_logits) -> _Patch:
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(base).__name__
    if devices is not None or offload or process_group is not None:
        raise ValueError(
            f"hugehead: devices/offload/process_group place a sequence classifier's head; {name}'s lm_head "
            f"stays where the model put it (its weight may be tied to the input embeddings)"
        )
    if return_logits:
        raise ValueError("hugehead: a patched causal LM returns no logits with labels; call it without labels")
    head = base.get_output_embeddings()
    if not isinstance(head, nn.Module):
        raise TypeError(f"hugehead: {name} has no output embeddings (lm_head)")
    path = _module_path(base, head)
    _refuse_peft_head(head, path)
    if not isinstance(head, nn.Linear):
        raise NotImplementedError(f"hugehead: {name}'s {path} is a {type(head).__name__}, not an nn.Linear")
    custom = base.__dict__.get("_loss_function")
    if custom is not None and custom is not ForCausalLMLoss:
        raise ValueError(
            f"hugehead: {name}.loss_function was replaced; patch() computes transformers' ForCausalLMLoss only"
        )
    return _Patch("causal_lm", path, head, signature, chunk_size, memory_budget, None)


def _patch_classifier(base, signature, devices, offload, process_group, memory_budget, chunk_size,
                      return_logits) -> _Patch:
    name, config = type(base).__name__, base.config
    if config.problem_type == "multi_label_classification":
        raise NotImplementedError(
            f"hugehead: {name} has problem_type='multi_label_classification'; patch() supports single-label "
            f"classification only (multi-label heads come with hugehead's multi-label losses)"
        )
    if config.problem_type == "regression" or config.num_labels == 1:
        raise NotImplementedError(f"hugehead: {name} is a regression model (num_labels=1); there is no "
                                  f"classification head to patch")
    path, linear = _find_classifier(base)
    placed = devices is not None or offload or process_group is not None
    head = ClassifierHead(
        linear.in_features, linear.out_features, bias=linear.bias is not None,
        devices=devices if placed else [linear.weight.device], dtype=linear.weight.dtype,
        chunk_size=chunk_size, memory_budget=memory_budget, offload=offload, process_group=process_group,
    )
    if not placed:  # where the Linear was, moving with the model as the Linear did
        head.placement_pinned = False
    with torch.no_grad():
        state = {"weight": linear.weight.detach()}
        if linear.bias is not None:
            state["bias"] = linear.bias.detach()
        head.load_state_dict(state)
    head.train(linear.training)
    parent, _, attr = path.rpartition(".")
    setattr(base.get_submodule(parent) if parent else base, attr, head)
    return _Patch("sequence_classification", path, head, signature, chunk_size, memory_budget, return_logits)
