"""What a :class:`~hugehead.module.ChunkedClassifier` is built from and checks against: its shards
(:class:`ClassShard`), the parsing of its devices and shard sizes, its loss kind and per-class buffers, and
the check of an ``x`` against the head."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ._extension import require_kernels
from .engines.local import LocalEngine
from .options import FLOAT_DTYPES, autocast_dtype
from .sharded_loss import no_autocast
from .sparse import check_class_weight, check_pos_weight

__all__ = ["ClassShard", "LOSS_KINDS", "LOSS_BUFFERS", "parse_devices", "parse_shard_sizes", "check_loss_kind",
           "missing_loss_buffers_hook", "head_compute_dtype", "build_placement", "BufferCopies", "engine_topk"]

DeviceLike = Union[str, int, torch.device]


class ClassShard(nn.Module):
    """Classes ``[start, stop)`` of a :class:`ChunkedClassifier`: ``weight [stop - start, D]`` and
    ``bias [stop - start]`` (or None) on one device.

    An offloaded shard lives in pinned host memory (``device`` is the CPU; ``empty`` allocates it) and
    computes on ``compute_device``; otherwise ``compute_device`` is ``device``."""

    def __init__(self, start: int, stop: int, in_features: int, bias: bool, device: torch.device,
                 dtype: torch.dtype, *, compute_device: Optional[torch.device] = None, empty=None):
        super().__init__()
        self.start = start
        self.stop = stop
        self.compute_device = device if compute_device is None else compute_device
        if empty is None:
            def empty(shape, dtype, what):
                return torch.empty(shape, device=device, dtype=dtype)
        self.weight = nn.Parameter(empty((stop - start, in_features), dtype, what=f"shard [{start}, {stop}) weight"))
        if bias:
            self.bias = nn.Parameter(empty((stop - start,), dtype, what=f"shard [{start}, {stop}) bias"))
        else:
            self.register_parameter("bias", None)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def extra_repr(self) -> str:
        return f"classes=[{self.start}, {self.stop}), device={self.device}"


def parse_devices(devices) -> List[torch.device]:
    if devices is None:
        if torch.cuda.is_available():
            return [torch.device("cuda", torch.cuda.current_device())]
        return [torch.device("cpu")]
    if isinstance(devices, (str, int, torch.device)):
        devices = [devices]
    if not isinstance(devices, (list, tuple)) or len(devices) == 0:
        raise ValueError(f"hugehead: devices must be a non-empty list of devices, got {devices!r}")
    parsed = []
    for entry in devices:
        try:
            device = torch.device(entry)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"hugehead: devices entry {entry!r} is not a device: {exc}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"hugehead: devices entry {entry!r} asks for CUDA, which is not available here")
            index = torch.cuda.current_device() if device.index is None else device.index
            if not 0 <= index < torch.cuda.device_count():
                raise ValueError(
                    f"hugehead: devices entry {entry!r}: there are only {torch.cuda.device_count()} CUDA devices"
                )
            require_kernels(device)
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise ValueError(
                f"hugehead: devices entry {entry!r}: shards can live on 'cpu' or 'cuda', not {device.type!r}"
            )
        parsed.append(device)
    return parsed


def parse_shard_sizes(shard_sizes, num_classes: int, num_devices: int) -> List[int]:
    if shard_sizes is None:
        if num_classes < num_devices:
            raise ValueError(
                f"hugehead: {num_classes} classes cannot fill {num_devices} shards; pass fewer devices"
            )
        base, extra = divmod(num_classes, num_devices)
        return [base + (i < extra) for i in range(num_devices)]
    sizes = list(shard_sizes)
    if len(sizes) != num_devices:
        raise ValueError(f"hugehead: shard_sizes has {len(sizes)} entries but devices has {num_devices}")
    if any(isinstance(s, bool) or int(s) != s or s <= 0 for s in sizes):
        raise ValueError(f"hugehead: shard_sizes must be positive integers, got {sizes}")
    sizes = [int(s) for s in sizes]
    if sum(sizes) != num_classes:
        raise ValueError(f"hugehead: shard_sizes {sizes} sum to {sum(sizes)}, not num_classes={num_classes}")
    return sizes


LOSS_KINDS = ("cross_entropy", "binary_cross_entropy")


# The loss's per-class buffers: in state_dict() (placement-independent: the same [V] tensor whatever the
# shards), but optional when loading (checkpoints written before they were buffers have neither).
LOSS_BUFFERS = ("class_weight", "pos_weight")


def check_loss_kind(loss: str, class_weight: Optional[Tensor], pos_weight: Optional[Tensor], num_classes: int,
                     label_smoothing: float, z_loss: float, softcap: Optional[float]) -> str:
    """Check the head's ``loss`` against its options and per-class weights.

    Raises:
        ValueError: an unknown loss; options one-vs-all does not have (label smoothing, z-loss, softcap,
            class weights) or softmax does not have (pos_weight). TypeError/ValueError: a class_weight
            that is not a floating ``[V]`` tensor, a pos_weight that is not a floating ``[V]`` or
            one-element tensor.
    """
    if loss not in LOSS_KINDS:
        raise ValueError(f"hugehead: unknown loss {loss!r}; expected one of {LOSS_KINDS}")
    if loss == "binary_cross_entropy":
        extra = {"label_smoothing": label_smoothing, "z_loss": z_loss, "softcap": softcap}
        given = [k for k, v in extra.items() if v not in (None, 0, 0.0)]
        given += ["class_weight"] if class_weight is not None else []
        if given:
            raise ValueError(f"hugehead: loss='binary_cross_entropy' does not take {', '.join(given)}")
    elif pos_weight is not None:
        raise ValueError("hugehead: pos_weight is the positive term's weight of loss='binary_cross_entropy'; "
                         "loss='cross_entropy' takes class_weight")
    for name, value, check in (("class_weight", class_weight, check_class_weight),
                               ("pos_weight", pos_weight, check_pos_weight)):
        if value is not None:
            check(value, num_classes, value.device if isinstance(value, Tensor) else torch.device("cpu"))
    return loss


def missing_loss_buffers_hook(head, incompatible_keys) -> None:
    """Load-state-dict post-hook: a checkpoint without ``class_weight`` / ``pos_weight`` (written before
    they were buffers) loads, the head keeping its own (:func:`hugehead.checkpoint.optional_state_keys`
    tells ``load_checkpoint`` the same)."""
    prefix = getattr(head, "_load_prefix", "")
    optional = {prefix + name for name in head.optional_state_keys}
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in optional]


def head_compute_dtype(x: Tensor, in_features: int, dtype: torch.dtype, leading_dims: bool = False
                       ) -> Optional[torch.dtype]:
    """Check ``x`` against a head of ``in_features`` and parameter ``dtype``; returns the compute dtype: the
    autocast dtype under ``torch.autocast`` on ``x``'s device type, else None (``x``'s dtype, which must match
    the head's). ``leading_dims``: ``x`` may be ``[..., D]``.

    Raises:
        TypeError: not a tensor, an unsupported dtype, a dtype other than the head's outside autocast.
        ValueError: the shape, ``D``, a device that is not a CPU or CUDA device.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"hugehead: x must be a tensor, got {type(x).__name__}")
    if x.dim() < 2 or (x.dim() > 2 and not leading_dims):
        raise ValueError(f"hugehead: x must be [N, D] = [N, {in_features}], got shape {tuple(x.shape)}")
    if x.shape[-1] != in_features:
        raise ValueError(f"hugehead: x has D={x.shape[-1]} features but the head has in_features={in_features}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"hugehead: x is on {x.device}; ChunkedClassifier takes x on 'cpu' or 'cuda' devices")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hugehead: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    compute = autocast_dtype(x.device.type, x.dtype, dtype)
    if compute is None and x.dtype != dtype:
        raise TypeError(
            f"hugehead: x is {x.dtype} but the head's parameters are {dtype}; cast x, build (or "
            f".to()) the head in {x.dtype}, or run under torch.autocast (float32 parameters, "
            f"16-bit compute)"
        )
    return compute


def build_placement(placement: List[torch.device], num_classes: int, in_features: int, bias: bool, dtype: torch.dtype,
                    shard_sizes, offload: bool, group, chunk_size: Optional[int], memory_budget: Optional[int]):
    """The engine and the shards (:class:`ClassShard`, in class order, uninitialized) of a head on ``placement``
    (one shard per entry), in pinned host memory when ``offload``, this rank's classes of ``group``'s split
    when given.

    Raises:
        ValueError: as :func:`parse_shard_sizes` and the engines' checks of devices and ranks.
        hugehead.pinned.HostMemoryError: an offloaded head the host's available memory cannot hold.
    """
    first_class, stop_class = 0, num_classes
    if group is not None:  # this rank's classes [first_class, stop_class), split evenly over its devices
        from .engines.distributed import rank_class_ranges

        rank_ranges = rank_class_ranges(num_classes, group.size(), shard_sizes)
        first_class, stop_class = rank_ranges[group.rank()]
        shard_sizes = None
    sizes = parse_shard_sizes(shard_sizes, stop_class - first_class, len(placement))
    empty = None
    if offload:
        from .engines.offload import OffloadEngine, check_offload_devices
        from .pinned import check_host_memory

        placement = check_offload_devices(placement)
        starts = [first_class + sum(sizes[:k]) for k in range(len(sizes))]
        engine = OffloadEngine(dict(zip(starts, placement)), chunk_size, memory_budget)
        empty = engine.allocate_host
        itemsize = torch.empty((), dtype=dtype).element_size()
        host_bytes = sum(sizes) * (in_features + int(bool(bias))) * itemsize
        check_host_memory(host_bytes, f"the offloaded head's parameters ({sum(sizes):,} x "
                                      f"{in_features} {str(dtype).replace('torch.', '')})")
    else:
        engine = LocalEngine(chunk_size, memory_budget)
    shards, start = [], first_class
    for device, size in zip(placement, sizes):
        if offload:
            shards.append(ClassShard(start, start + size, in_features, bias, torch.device("cpu"), dtype,
                                     compute_device=device, empty=empty))
        else:
            shards.append(ClassShard(start, start + size, in_features, bias, device, dtype))
        start += size
    if group is not None:
        from .engines.distributed import DistributedEngine

        engine = DistributedEngine(engine, group, rank_ranges)
        engine.check_agreement(in_features, bias, dtype)
    return engine, shards


class BufferCopies:
    """Copies of a head's loss buffers (``class_weight`` / ``pos_weight``) on the devices ``x`` comes on: made
    once, and made again when the buffer is replaced or changed in place (``load_state_dict`` copies into it)."""

    def __init__(self):
        # (buffer name, device) -> (buffer, its version, its copy on that device)
        self.copies: Dict[Tuple[str, torch.device], Tuple[Tensor, int, Tensor]] = {}

    def on(self, buffer: Optional[Tensor], name: str, device: torch.device) -> Optional[Tensor]:
        """``buffer`` (the head's buffer ``name``) on ``device``: itself, or its copy there."""
        if buffer is None or buffer.device == device:
            return buffer
        key = (name, device)
        hit = self.copies.get(key)
        if hit is None or hit[0] is not buffer or hit[1] != buffer._version:
            hit = (buffer, buffer._version, buffer.detach().to(device))
            self.copies[key] = hit
        return hit[2]


@torch.compiler.disable
def engine_topk(engine, x: Tensor, shards, softcap: float, k: int) -> Tuple[Tensor, Tensor]:
    # The engines queue work on several devices and streams from Python: under torch.compile this runs
    # eagerly (a graph break), as the loss's host-side target check does.
    with no_autocast(x, shards):
        return engine.topk(x, shards, softcap, k)


