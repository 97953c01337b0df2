"""ChunkedClassifier: a ``Linear(in_features, num_classes)`` + cross-entropy head whose weight lives as
shards (contiguous class ranges) on several devices. It owns one pair of Parameters per shard and runs
its loss as one custom autograd op over all shards through a placement engine (``engines/``)."""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .checkpoint.head import load_state_dict_pre_hook, rename_missing_keys_hook, state_dict_hook
from .engines.distributed import ranks_agree
from .engines.local import LocalEngine
from .head_config import (LOSS_BUFFERS, BufferCopies, ClassShard, build_placement, check_loss_kind, engine_topk,
                          head_compute_dtype, missing_loss_buffers_hook, parse_devices)
from .init import hashed_uniform_
from .inputs import prepare_inputs
from .lce_op import rows_loss
from .logprob import check_temperature, sharded_log_prob
from .multilabel import prepared_rows_loss
from .ops import acc_dtype
from .options import FLOAT_DTYPES, LossOptions, check_chunk_size, check_memory_budget, reduce_loss
from .sharded_loss import LossSpec, ShardedLinearCrossEntropy
from .sparse import is_sparse_target
from .target_prep import prepare_target

__all__ = ["ChunkedClassifier", "ClassShard"]

DeviceLike = Union[str, int, torch.device]


class ChunkedClassifier(nn.Module):
    """``Linear(in_features, num_classes)`` followed by cross-entropy, never building ``[N, V]`` logits,
    with the weight split by class ranges into shards on one or several devices.

    Args:
        in_features: ``D``. num_classes: ``V``. bias: whether the logits have a bias.
        devices: where the shards go, one shard per entry (entries may repeat; ``"cpu"`` allowed).
            None: the current CUDA device if there is one, else the CPU. An explicit placement is
            pinned: ``.to(device)``, ``.cuda()`` and ``.cpu()`` on the head (or a model holding it)
            leave every shard where it is and only apply dtype casts; with ``devices=None`` the head
            moves like ``nn.Linear``.
        dtype: of the Parameters (default: ``torch.get_default_dtype()``); ``x`` must match it.
        chunk_size, memory_budget: classes per chunk and bytes of workspace per compute device (the
            shards computing on one device share it), as in :func:`hugehead.linear_cross_entropy` (None:
            planned; the default is bounded by the device's free memory, on the CPU by the host's
            available memory: :mod:`hugehead.plan`).
        ignore_index, reduction, label_smoothing, z_loss, softcap: the loss, exactly as in
            :func:`hugehead.linear_cross_entropy`.
        shard_sizes: classes per shard, in device order (default: balanced). With ``process_group``:
            classes per rank, in rank order, the same list on every rank (each rank splits its classes
            evenly over its own ``devices``).
        offload: keep every shard in pinned host memory (exact size; the host's available memory is
            checked first) and stream it through the shard's entry of ``devices`` (CUDA devices; None:
            the current one) chunk by chunk, gradients copied back into pinned host ``.grad`` tensors, so
            optimizers step the head on the CPU (``hugehead/engines/offload.py``). Needs CUDA.
        process_group: a ``torch.distributed`` process group (e.g. ``torch.distributed.group.WORLD``):
            the classes are split over its ranks, rank ``r`` holding the contiguous range
            ``[start_r, stop_r)`` on its own ``devices`` (``hugehead/engines/distributed.py``). Every rank
            passes its own rows (batch sizes may differ); rank ``r``'s loss is the reduction over its rows,
            ``x``'s gradient is ``dL_r/dx_r``, and each shard's gradient is that of the mean over ranks of
            their losses — the objective whose backbone gradients DDP averages. Forward, backward,
            :meth:`topk`, :meth:`log_prob`, ``state_dict()`` (the logical weight, gathered) and
            :meth:`save_safetensors` are collective: every rank calls them in the same order. Keep the
            head's Parameters out of DDP (:func:`hugehead.ignore_heads_in_ddp`).
            The same seed on rank 0 gives the same logical weight as any one-process placement.
        loss: ``"cross_entropy"`` (softmax; ``head(x, target)`` takes ``[N]`` class ids or a sparse ``[N, V]``
            probability target, as :func:`hugehead.linear_cross_entropy`) or ``"binary_cross_entropy"``
            (one-vs-all, a sparse ``[N, V]`` target in [0, 1], as :func:`hugehead.linear_binary_cross_entropy`;
            no label smoothing, z-loss, softcap or class weights).
        class_weight: ``[V]`` floating class weights for ``"cross_entropy"`` (``F.cross_entropy``'s
            ``weight``, for index and sparse targets).
        pos_weight: ``[V]`` (or one-element) floating weights of the positive term for
            ``"binary_cross_entropy"`` (``F.binary_cross_entropy_with_logits``'s ``pos_weight``).

        Both are buffers of that name (copied at construction; None when not given): in ``state_dict()``
        as ``class_weight`` / ``pos_weight`` beside the logical ``weight`` and ``bias``, so they load into
        any placement (and in :func:`hugehead.checkpoint.save_checkpoint`'s directory; not in
        :meth:`save_safetensors`'s file, which holds the weights); a checkpoint without them loads too
        (the head keeps its own). They live on the
        first shard's compute device (on every rank of a head spanning ranks) and are copied to ``x``'s
        device when it differs (once, until they change). Like ``nn.CrossEntropyLoss``'s ``weight``, they
        follow the head's dtype casts; an explicit placement keeps them on their device. Assigning a
        tensor to ``head.class_weight`` (or ``pos_weight``) between steps changes the loss.

    Parameters are initialized with ``nn.Linear``'s distribution (uniform in ``±1/sqrt(D)``), on each
    shard's own device from a hash of ``(seed, class, feature)``: under the same ``torch.manual_seed``,
    every placement gets the same logical weight (see :meth:`reset_parameters`).

    Attributes:
        shards: ``nn.ModuleList`` of :class:`ClassShard` in class order (``.weight``, ``.bias``,
            ``.start``, ``.stop``, ``.device``); ``parameters()`` are exactly their Parameters.

    Raises:
        ValueError: bad sizes, devices, shard_sizes or loss options; ``offload=True`` without CUDA or with
            a non-CUDA device.
        hugehead.pinned.HostMemoryError: ``offload=True`` and the host has less available memory than the
            parameters need (the message names both).
        RuntimeError, TypeError: ``process_group`` given without ``torch.distributed`` initialized, or not
            a process group. ValueError: the ranks built heads that differ (raised on every rank).
    """

    # state_dict() entries a checkpoint may lack (hugehead.checkpoint.optional_state_keys).
    optional_state_keys = LOSS_BUFFERS

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        *,
        devices: Optional[Sequence[DeviceLike]] = None,
        dtype: Optional[torch.dtype] = None,
        chunk_size: Optional[int] = None,
        memory_budget: Optional[int] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        shard_sizes: Optional[Sequence[int]] = None,
        offload: bool = False,
        process_group=None,
        loss: str = "cross_entropy",
        class_weight: Optional[Tensor] = None,
        pos_weight: Optional[Tensor] = None,
    ):
        super().__init__()
        group = None
        if process_group is not None:
            from .engines.distributed import resolve_group

            group = resolve_group(process_group)
        if int(in_features) != in_features or in_features < 1:
            raise ValueError(f"hugehead: in_features must be a positive integer, got {in_features}")
        if int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"hugehead: num_classes must be a positive integer, got {num_classes}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"hugehead: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        chunk_size = check_chunk_size(chunk_size)
        memory_budget = check_memory_budget(memory_budget)
        options = LossOptions(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                              z_loss=z_loss, softcap=softcap)
        self.loss = check_loss_kind(loss, class_weight, pos_weight, int(num_classes), options.label_smoothing,
                                     options.z_loss, options.softcap)
        self._loss_buffer_copies = BufferCopies()

        self.in_features = int(in_features)
        self.num_classes = int(num_classes)
        # The loss options stay plain attributes (a user may change one between steps); every call
        # checks them again as one LossOptions (loss_options()).
        self.ignore_index = options.ignore_index
        self.reduction = options.reduction
        self.label_smoothing = options.label_smoothing
        self.z_loss = options.z_loss
        self.softcap = softcap

        # Explicit placements are pinned: Module.to(device)/.cuda()/.cpu() (which Lightning and most training
        # loops call on the whole model) cast dtypes but leave each shard on its device. Offloaded shards
        # always stay in host memory.
        self.offload = bool(offload)
        self.placement_pinned = devices is not None or self.offload
        t0 = time.perf_counter()
        self.engine, shards = build_placement(parse_devices(devices), self.num_classes, self.in_features, bias, dtype,
                                              shard_sizes, self.offload, group, chunk_size, memory_budget)
        self.shards = nn.ModuleList(shards)
        self._pin_seconds = time.perf_counter() - t0
        self.reset_parameters()
        # Class weights and pos_weight are buffers: [V] (pos_weight: or one element) on the first shard's
        # compute device, the same tensor on every rank of a head spanning ranks (each rank prepares the
        # target of its own rows, which may name any class); the per-entry weights made from them travel
        # with the target's entries, so each shard and rank reads those of its columns only.
        home = self.shards[0].compute_device
        for name, value in (("class_weight", class_weight), ("pos_weight", pos_weight)):
            self.register_buffer(name, None if value is None else value.detach().to(home, copy=True))

        # Placement-independent state dicts: the logical weight [V, D] and bias [V] (checkpoint/head.py),
        # and the loss buffers as they are.
        self.register_state_dict_post_hook(state_dict_hook)
        self.register_load_state_dict_pre_hook(load_state_dict_pre_hook)
        self.register_load_state_dict_post_hook(rename_missing_keys_hook)
        self.register_load_state_dict_post_hook(missing_loss_buffers_hook)

    def _apply(self, fn, recurse=True):
        if not self.placement_pinned:
            return super()._apply(fn, recurse)

        loss_buffers = {id(b) for b in (self.class_weight, self.pos_weight) if b is not None}

        def keep_device(t: Tensor) -> Tensor:
            # What fn would make of a tensor like t tells the dtype it asks for; the device stays.
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if probe.dtype == t.dtype:
                return t
            if id(t) in loss_buffers:  # a small [V] tensor where it is, not the placement's parameter memory
                return t.to(dtype=probe.dtype)
            return self.engine.cast_parameter(t, probe.dtype)

        return super()._apply(keep_device, recurse)

    # ---------------------------------------------------------------------------------------------
    # Layout
    # ---------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].weight.dtype

    @property
    def has_bias(self) -> bool:
        return self.shards[0].bias is not None

    @property
    def shard_sizes(self) -> Tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.shards)

    @property
    def offload_stats(self) -> Dict[str, float]:
        """An offloaded head's host memory: ``weight_bytes`` (parameters, pinned at construction) and the
        ``pin_seconds`` that took, ``grad_bytes`` of pinned gradient buffers allocated so far and their
        ``grad_alloc_seconds``. Empty for other placements."""
        if not self.offload:
            return {}
        weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        return {"weight_bytes": weight_bytes, "pin_seconds": self._pin_seconds, **self.engine.stats()}

    def extra_repr(self) -> str:
        layout = ", ".join(f"{s.device} [{s.start}, {s.stop})" for s in self.shards)
        text = (
            f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.has_bias}, "
            f"dtype={self.dtype}, engine={self.engine.name}, shards=[{layout}]"
        )
        options = []
        if self.reduction != "mean":
            options.append(f"reduction={self.reduction!r}")
        if self.ignore_index != -100:
            options.append(f"ignore_index={self.ignore_index}")
        if self.label_smoothing:
            options.append(f"label_smoothing={self.label_smoothing}")
        if self.z_loss:
            options.append(f"z_loss={self.z_loss}")
        if self.softcap is not None:
            options.append(f"softcap={self.softcap}")
        if self.loss != "cross_entropy":
            options.append(f"loss={self.loss!r}")
        options += [f"{name}=[{getattr(self, name).numel()}]" for name in LOSS_BUFFERS
                    if getattr(self, name) is not None]
        return ", ".join([text, *options])

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize as ``nn.Linear`` does in distribution — weight and bias uniform in ``±1/sqrt(D)``
        (``kaiming_uniform_(a=sqrt(5))``) — on each shard's own device, a block of rows at a time.

        Values come from a counter-based hash of ``(seed, class, feature)`` (:func:`_hashed_uniform_`)
        in integer arithmetic, so every placement — any devices, shard count or CPU/GPU mix — draws the
        same logical weight, with no host round trip; the seed is drawn from torch's default generator,
        so ``torch.manual_seed`` makes it reproducible.
        """
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        seed = self.engine.agree_seed(seed)  # across ranks: rank 0's seed, one logical weight
        bound = 1.0 / math.sqrt(self.in_features)
        for shard in self.shards:
            # An offloaded shard's values are computed on its GPU (the same integer hash) and copied in.
            hashed_uniform_(shard.weight, seed, shard.start, bound, shard.compute_device)
            if shard.bias is not None:
                hashed_uniform_(shard.bias, seed ^ 0x5BD1E995, shard.start, bound, shard.compute_device)

    # ---------------------------------------------------------------------------------------------
    # Compute
    # ---------------------------------------------------------------------------------------------
    def _shard_params(self) -> List[Tensor]:
        params = [s.weight for s in self.shards]
        if self.has_bias:
            params += [s.bias for s in self.shards]
        return params

    def _check_x(self, x: Tensor) -> Tensor:
        """``x [N, D]`` checked (:func:`hugehead.head_config.head_compute_dtype`), in the compute dtype."""
        compute = head_compute_dtype(x, self.in_features, self.dtype)
        return x if compute is None or x.dtype == compute else x.to(compute)

    def _compute_dtype(self, x: Tensor) -> Optional[torch.dtype]:
        """The front door's check of ``x [..., D]`` (:func:`hugehead.inputs.prepare_inputs`)."""
        return head_compute_dtype(x, self.in_features, self.dtype, leading_dims=True)

    def loss_options(self) -> LossOptions:
        """The head's loss options, checked (raises as :class:`~hugehead.options.LossOptions`)."""
        return LossOptions(reduction=self.reduction, ignore_index=self.ignore_index,
                           label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap)

    def _one_local_shard_on(self, device: torch.device) -> bool:
        """One shard, resident on ``device``, under the local engine (not offloaded, not across ranks)."""
        return (type(self.engine) is LocalEngine and len(self.shards) == 1
                and self.shards[0].weight.device == device)

    def _spec(self) -> LossSpec:
        return LossSpec(self.engine, [s.start for s in self.shards], self.has_bias, self.num_classes,
                        self.loss_options())

    @ranks_agree("forward")
    def forward(self, x: Tensor, target: Tensor, *, return_lse: bool = False):
        """Cross-entropy of ``x Wᵀ + b`` against ``target`` over all shards.

        Args:
            x: ``[N, D]`` (or ``[..., D]``, e.g. ``[batch, tokens, D]``) on any CPU or CUDA device, in the
                head's dtype — or any float16/bfloat16/float32 dtype under ``torch.autocast`` on ``x``'s
                device type, which computes in the autocast dtype (``x`` cast once, each weight chunk cast
                in the loop; the Parameters keep their dtype and get gradients in it).
            target: ``[N]`` (``x``'s leading shape) int64 or int32 class ids in ``[0, V)`` or
                ``ignore_index``, on ``x``'s device; or (``x [N, D]``) a sparse ``[N, V]``
                ``torch.sparse_csr`` / ``torch.sparse_coo`` tensor of floating values on any device (or
                :func:`hugehead.csr_target` of one, which ``torch.compile`` can carry): probability
                targets (values ``>= 0``) for ``loss="cross_entropy"``, the one-vs-all target (values in
                ``[0, 1]``, the only target it takes) for ``loss="binary_cross_entropy"``.
            return_lse: also return the per-row log-sum-exp (differentiable; softmax heads).
        Returns:
            The loss on ``x``'s device — float32 (float64 for a float64 computation) — a scalar, or
            ``target``'s shape for ``reduction="none"`` (``[N]`` for a sparse target; for one-vs-all the
            per-row sums over the classes, not PyTorch's elementwise ``[N, V]``); with ``return_lse``,
            ``(loss, lse)`` (``lse`` in target's shape). First-order gradients only: differentiating them
            raises ``RuntimeError``.

        Under ``torch.compile``, index targets without class weights stay in the graph (``fullgraph=True``
        works); sparse targets, class weights and one-vs-all run eagerly as one graph break: dynamo does
        not take sparse tensors, and the target's preparation (checks, sort, per-row sums) reads its data.
        Raises:
            ValueError: wrong shapes or D, a target out of range, x on another device type, target on
                another device than x; a sparse target whose shape is not ``[N, V]``, with class ids outside
                ``[0, V)`` or values out of range (checked before any kernel). TypeError: dtype mismatch
                outside autocast, an option of the wrong type, a one-vs-all head given class ids.
        """
        if (self.loss != "cross_entropy" or self.class_weight is not None or self.pos_weight is not None
                or is_sparse_target(target)):
            return self._forward_prepared(x, target, return_lse)
        spec = self._spec()
        options = spec.options
        # The class ids are range-checked here: the step's one host synchronization.
        inputs = prepare_inputs(x, target, options, self._compute_dtype, self.num_classes)
        x, target = inputs.x, inputs.target
        if not return_lse and self._one_local_shard_on(x.device):
            # A scalar loss of one shard beside x: the functional's rows plan when the planner picks it.
            shard = self.shards[0]
            loss = rows_loss(x, shard.weight, target, shard.bias if self.has_bias else None, options,
                             self.engine.chunk_size, self.engine.memory_budget)
            if loss is not None:
                return loss
        loss_rows, lse = ShardedLinearCrossEntropy.apply(spec, x, target, *self._shard_params())
        loss = reduce_loss(loss_rows, target != options.ignore_index, options.reduction)
        return inputs.restore(loss, lse, options.reduction, return_lse)

    @torch.compiler.disable
    def _forward_prepared(self, x: Tensor, target: Tensor, return_lse: bool):
        """:meth:`forward` for a sparse target, class weights or one-vs-all (:mod:`hugehead.multilabel`).
        Under torch.compile it runs eagerly (one graph break): preparing the target reads the data."""
        if self.loss == "binary_cross_entropy":
            if not is_sparse_target(target):
                raise TypeError("hugehead: a one-vs-all head (loss='binary_cross_entropy') takes a sparse [N, V] "
                                "target (torch.sparse_csr or torch.sparse_coo)")
            if return_lse:
                raise ValueError("hugehead: return_lse needs a softmax head; one-vs-all has no log-sum-exp")
        # Buffers assigned after construction: the same rule as there.
        check_loss_kind(self.loss, self.class_weight, self.pos_weight, self.num_classes, self.label_smoothing,
                        self.z_loss, self.softcap)
        inputs = prepare_inputs(x, target, self.loss_options(), self._compute_dtype, self.num_classes)
        x, target = inputs.x, inputs.target
        if inputs.sparse and target.device != x.device:
            target = target.to(x.device)
        buffers = self._loss_buffer_copies
        prepared = prepare_target(
            target, x.shape[0], self.num_classes, loss=self.loss, label_smoothing=self.label_smoothing,
            class_weight=buffers.on(self.class_weight, "class_weight", x.device),
            pos_weight=buffers.on(self.pos_weight, "pos_weight", x.device),
            ignore_index=self.ignore_index, dtype=acc_dtype(x.dtype), device=x.device)
        if not return_lse and self._one_local_shard_on(x.device):
            # A scalar softmax loss of one shard beside x: the rows plan when the planner picks it (as for ids).
            shard = self.shards[0]
            loss = prepared_rows_loss(
                x, shard.weight, shard.bias if self.has_bias else None, prepared, reduction=self.reduction,
                label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                softcap=self.loss_options().kernel_softcap, chunk_size=self.engine.chunk_size,
                memory_budget=self.engine.memory_budget)
            if loss is not None:
                return loss
        loss_rows, lse = ShardedLinearCrossEntropy.apply(self._spec(), x, prepared, *self._shard_params())
        return inputs.restore(prepared.reduce(loss_rows, self.reduction), lse, self.reduction, return_lse)

    @ranks_agree("topk")
    @torch.no_grad()
    def topk(self, x: Tensor, k: int = 5) -> Tuple[Tensor, Tensor]:
        """The ``k`` largest logits (after softcap, if set) of each row over all classes, streamed chunk
        by chunk per shard: no ``[N, V]`` tensor.

        Args:
            x: ``[N, D]`` in the head's dtype, or any float16/bfloat16/float32 dtype under
                ``torch.autocast`` (computed in the autocast dtype). k: ``0 <= k <= num_classes``.
        Returns:
            ``(values [N, k]`` in ``x``'s dtype, ``indices [N, k]`` int64``)`` on ``x``'s device, sorted by
            value descending, ties broken by the lower class index.

        Under ``torch.compile``, a head of one shard on ``x``'s device stays in the graph
        (``fullgraph=True`` works, as for :func:`hugehead.linear_topk`); several shards, offload or ranks
        run eagerly as one graph break.
        Raises:
            ValueError: bad k, or the checks of :meth:`forward` on x.
        """
        x = self._check_x(x)
        if isinstance(k, bool) or int(k) != k or not 0 <= k <= self.num_classes:
            raise ValueError(f"hugehead: k must be an integer in [0, num_classes={self.num_classes}], got {k}")
        if self._one_local_shard_on(x.device):
            # One resident shard beside x: linear_topk's registered op, which torch.compile keeps in the
            # graph (fullgraph=True); the engines' multi-device path below runs eagerly.
            from .topk import linear_topk

            shard, cap = self.shards[0], self.loss_options().kernel_softcap
            return linear_topk(x, shard.weight, int(k), shard.bias if self.has_bias else None,
                               softcap=cap if cap > 0 else None, chunk_size=self.engine.chunk_size,
                               memory_budget=self.engine.memory_budget)
        spec = self._spec()
        shards = spec.shards(self._shard_params())
        return engine_topk(self.engine, x, shards, spec.options.kernel_softcap, int(k))

    @ranks_agree("log_prob")
    def log_prob(self, x: Tensor, target: Tensor, *, temperature: float = 1.0, return_entropy: bool = False):
        """Per-row ``log p(target | x)`` under ``softmax(softcap(x Wᵀ + b) / temperature)`` over every shard (no
        smoothing), and with ``return_entropy`` the entropy of that distribution: :func:`hugehead.linear_log_prob`
        for this head's placement, differentiable through both (first order).

        Args:
            x, target: as :meth:`forward` (class ids; ``ignore_index`` rows get 0 for both, and no gradient).
        Returns:
            ``log p`` in target's shape, float32 (float64 for a float64 computation) on ``x``'s device; with
            ``return_entropy``, ``(log p, entropy)``.
        Raises: ValueError, TypeError: the checks of :meth:`forward`; a temperature not finite and positive.
        """
        t = check_temperature(temperature)
        spec = self._spec()
        inputs = prepare_inputs(x, target, spec.options, self._compute_dtype, self.num_classes)
        out = sharded_log_prob(spec, inputs.x, inputs.target, [s.weight for s in self.shards],
                               [s.bias if self.has_bias else None for s in self.shards], t, return_entropy)
        return inputs.restore(*out, "none", True) if return_entropy else inputs.restore(out, None, "none", False)

    # ---------------------------------------------------------------------------------------------
    # Checkpoints (hugehead/checkpoint/head.py: one implementation for every placement)
    # ---------------------------------------------------------------------------------------------
    def save_safetensors(self, path: str, *, keep_previous: bool = True) -> None:
        """Write the head to a safetensors file, one tensor per shard (``weight.<k>``, ``bias.<k>``) with
        the class ranges in the file's metadata, streamed: each shard is written from where it lives a
        block of rows at a time (host memory within two blocks of 64 MiB, never a shard or the head), to a
        temporary file that is fsynced and renamed over ``path`` (an interrupted save leaves ``path`` as
        it was). Any placement reads the file back with :meth:`load_safetensors`. A head spanning ranks:
        collective; the logical weight is gathered to group rank 0, which writes one file.

        Before writing, the file system must have room for the new file beside the previous one.
        ``keep_previous=False`` removes the previous file first (room for one file; **risk**: no file on
        disk until the new one is complete, so a crash or failed write in that window loses it).

        Raises:
            hugehead.checkpoint.CheckpointSpaceError (an ``OSError``): no room, found before writing, or a
                write that ran out of space; the previous file is then unchanged and no temporary remains.
        """
        from .checkpoint.head import save_safetensors

        save_safetensors(self, path, keep_previous=keep_previous)

    def sharded_state_dict(self, *, for_save: bool = False) -> Dict[str, Tensor]:
        """Like :meth:`state_dict` (logical keys ``weight``, ``bias``), but each value is a
        :class:`hugehead.checkpoint.ShardedRows` over the shards' own tensors instead of a gathered copy:
        ``torch.distributed.checkpoint`` saves every shard where it lives, with its row offset
        (``dcp.save(head.sharded_state_dict(for_save=True), ...)``), and loads into any placement in place
        (``dcp.load(head.sharded_state_dict(), ...)``). For a whole model, and what ``for_save`` does, see
        :func:`hugehead.checkpoint.sharded_state_dict`."""
        from .checkpoint import sharded_state_dict

        return sharded_state_dict(self, for_save=for_save)

    def load_safetensors(self, path: str, strict: bool = True, *, dtype: Optional[torch.dtype] = None) -> None:
        """Copy a checkpoint into the shards, reading only the rows each shard needs, a block of rows at
        a time (``safe_open(...).get_slice``).

        Reads files written by :meth:`save_safetensors` from any placement, and plain files holding the
        logical ``weight [V, D]`` (and ``bias [V]``), e.g. ``save_file(head.state_dict(), path)``.

        The file is checked whole before any shard is written: its extents, its data's digest (files of
        this release) and its dtypes. A dtype that would be cast lossily into the head's (integers into
        floats, float32 into bfloat16) is refused unless ``dtype=`` names the file's dtype.

        Raises:
            ValueError: the file's classes or features differ from the head's, its pieces do not cover
                ``[0, V)``, or (``strict``) it has a bias the head lacks or lacks one the head has.
            TypeError: a lossy dtype cast not asked for. CheckpointCorruptError (``OSError``): truncated,
                not a safetensors file, or failing its digest (the head is then unchanged).
        """
        from .checkpoint.head import load_safetensors

        load_safetensors(self, path, strict, dtype)
