"""The offload placement engine: shards in pinned host memory, streamed through a compute GPU chunk by chunk.

It is the local engine (same ordering, same chunk loop of :mod:`hugehead.loop`) with two overrides: a
shard computes on the GPU it was assigned, and its weight chunks come from :class:`StreamedChunks`, a
source that copies them in from host memory on a copy stream while earlier chunks compute:

- **weights in** (forward and backward): a ring of ``depth`` device buffers. Chunk ``j`` is copied into
  slot ``j % depth`` on the device's *H2D stream*, which first waits until the compute stream has finished
  with chunk ``j - depth`` (event ``free``); the compute stream waits for the copy (event ``ready``)
  before it uses the chunk. A slot is freed one chunk late (the loop's overlapped backward still uses
  chunk ``j - 1`` after fetching chunk ``j``), so with ``depth = 4`` chunks ``j + 1`` and ``j + 2`` are in
  flight while ``j`` computes. Under autocast the float32 master chunk is cast on the compute stream into
  one of two buffers in the compute dtype, which frees its slot at once.
- **gradients out** (backward): ``dW`` and ``db`` of a chunk land in a device slot of a second ring, and
  the *D2H stream* copies them into the shard's host gradient (pinned, in the Parameters' dtype) once the
  compute stream's event ``grad_ready`` says they are written; the compute stream waits for that copy
  (event ``grad_copied``) before it writes the slot again.
- **the one host synchronization**: at the end of the backward the host waits for each device's copy
  streams, because autograd hands the host gradients to an optimizer that reads them (and writes the
  weights) on the CPU at once.
- **plan** (:mod:`hugehead.plan`): chunks at most 32768 classes and 256 MiB wide (``cap_plan``); with
  ``memory_budget=None`` the shards on a GPU may keep logits in up to half its free memory (the forward is
  copy-bound, and kept logits save the backward's recompute).

The host gradients are reused between steps (:class:`HostGradPool`): autograd keeps the tensor it is
given as ``.grad`` when the Parameter has none (``optimizer.zero_grad()``'s default), so after the first
step no gradient memory is allocated or pinned again.

Every stream operation goes through a small interface (:mod:`hugehead.engines.streams`: CUDA streams, or
inline copies for a CPU "compute device"): the CPU tests drive the whole engine through it and check the
recorded schedule for races.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import pinned
from ..budget import Budget, device_budgets, resolve_budget
from ..options import LossOptions
from ..loop.sources import WeightChunk
from ..plan import GRAD_RING_DEPTH, SLOT_BYTES, WEIGHT_RING_DEPTH, Plan, plan_streamed, stream_cols
from .local import LocalEngine, ShardTensors
from .streams import CudaStreams, InlineStreams

__all__ = ["OffloadEngine", "StreamedChunks", "HostGradPool", "chunk_bounds", "check_offload_devices"]

# Tests set this to let ChunkedClassifier(offload=True) compute on "cpu" devices (InlineStreams).
_ALLOW_CPU_COMPUTE = False


def check_offload_devices(devices: Sequence[torch.device]) -> List[torch.device]:
    """The compute devices of an offloaded head: every entry must be a CUDA device.

    Raises:
        ValueError: CUDA is not available, or an entry is not a CUDA device.
    """
    devices = list(devices)
    for device in devices:
        if device.type == "cuda" or (_ALLOW_CPU_COMPUTE and device.type == "cpu"):
            continue
        if not torch.cuda.is_available():
            raise ValueError(
                "hugehead: offload=True keeps the shards in pinned host memory and streams them to a CUDA GPU, "
                f"but CUDA is not available here (torch {torch.__version__}, torch.cuda.is_available() is "
                "False). Without a GPU, place the head in host memory directly: devices=['cpu'], offload=False"
            )
        raise ValueError(
            f"hugehead: offload=True streams each shard to a CUDA device, but devices has {device}; shards in "
            "host memory computing on the CPU are devices=['cpu'] with offload=False"
        )
    return devices


def chunk_bounds(num_rows: int, cols: int) -> List[Tuple[int, int]]:
    """``[(c0, c1)]``: the chunks ``[0, cols), [cols, 2 cols), …`` of ``num_rows`` rows (the last ragged)."""
    cols = max(1, int(cols))
    return [(c0, min(c0 + cols, num_rows)) for c0 in range(0, num_rows, cols)]


# --------------------------------------------------------------------------------------------------
# Host gradients, reused between steps
# --------------------------------------------------------------------------------------------------
def _storage_in_use(storage, param: Tensor) -> bool:
    """Whether a pooled gradient storage is referenced by any tensor (``.grad``, a user's reference)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is not None:
        return use_count(storage._cdata) > 1  # the pool's own storage object holds one reference
    grad = param.grad
    return grad is not None and grad.untyped_storage().data_ptr() == storage.data_ptr()


class HostGradPool:
    """Host gradient buffers of offloaded Parameters, up to two per Parameter, reused between backward
    passes.

    A buffer is handed out (as a new tensor over its storage) only while no tensor references it: after
    ``optimizer.zero_grad()`` (``set_to_none=True``, the default) the ``.grad`` autograd kept from the
    previous step is gone and the same pinned memory serves again. While ``.grad`` holds one (gradient
    accumulation), a second buffer receives the new gradient and autograd adds it into ``.grad`` on the
    host. Beyond two busy buffers a fresh one is allocated and not kept.

    Args:
        allocate: ``(shape, dtype, what=...) -> Tensor``, e.g. :func:`hugehead.pinned.empty_pinned`.
    """

    def __init__(self, allocate: Callable[..., Tensor], keep: int = 2):
        self.allocate = allocate
        self.keep = keep
        self._buffers: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
        self.allocated_bytes = 0
        self.allocation_seconds = 0.0

    def take(self, param: Tensor, what: str) -> Tensor:
        """A host tensor shaped and typed like ``param`` for its gradient (contents undefined)."""
        shape, dtype = tuple(param.shape), param.dtype
        buffers = self._buffers.setdefault(param, [])
        buffers[:] = [b for b in buffers if (b[1], b[2]) == (shape, dtype) or _storage_in_use(b[0], param)]
        for storage, b_shape, b_dtype in buffers:
            if (b_shape, b_dtype) == (shape, dtype) and not _storage_in_use(storage, param):
                return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        t0 = time.perf_counter()
        fresh = self.allocate(shape, dtype, what=what)
        self.allocation_seconds += time.perf_counter() - t0
        self.allocated_bytes += fresh.numel() * fresh.element_size()
        if len(buffers) < self.keep:
            storage = fresh.untyped_storage()
            buffers.append((storage, shape, dtype))
            del fresh
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        return fresh


# --------------------------------------------------------------------------------------------------
# The weight-chunk source
# --------------------------------------------------------------------------------------------------
class StreamedChunks:
    """The weight-chunk source (and gradient sink) of a shard in host memory computing on ``device``: the
    interface of :class:`hugehead.loop.sources.ResidentChunks`, with chunks copied in on the H2D stream into a
    ring of device buffers and ``dW``/``db`` chunks copied out on the D2H stream into host gradients.

    A yielded chunk's tensors stay valid until the chunk after the next one is requested (``lookahead``).

    Args:
        weight: ``[V_k, D]`` host Parameter (pinned); bias: ``[V_k]`` or None; compute_dtype: of ``x``.
        device: the compute device. streams: :class:`CudaStreams` or :class:`InlineStreams`.
        grads: where host gradients come from. depth, grad_depth: ring sizes. slot_bytes: caps the width
            of a chunk.
    """

    def __init__(self, weight: Tensor, bias: Optional[Tensor], compute_dtype: torch.dtype, device: torch.device,
                 streams, grads: Optional[HostGradPool] = None, depth: int = WEIGHT_RING_DEPTH,
                 grad_depth: int = GRAD_RING_DEPTH, slot_bytes: int = SLOT_BYTES):
        self.weight = weight
        self.bias = bias
        self.compute_dtype = compute_dtype
        self._device = device
        self.streams = streams
        self.grads = grads
        self.depth = max(2, int(depth))
        self.grad_depth = max(1, int(grad_depth))
        self.slot_bytes = slot_bytes
        self._width = 0
        self._grad_w: Optional[Tensor] = None
        self._grad_b: Optional[Tensor] = None
        self._grad_ring: Optional[List[Tuple[Tensor, Optional[Tensor]]]] = None
        self._grad_events: List[Tuple[object, object]] = []
        self._grad_count = 0
        self._grad_open: Optional[Tuple[int, int]] = None  # (c0, slot) of the chunk whose dW is being written

    # Chunk j - 1 stays valid while chunk j is fetched (see chunks()).
    lookahead = True

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.weight.dtype

    def _empty(self, rows: int, *tail: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(rows, *tail, dtype=dtype, device=self._device)

    def chunks(self, cols: int) -> Iterator[WeightChunk]:
        """Chunks of the shard in the compute dtype on the compute device, ``cols`` wide (at most the slot
        cap; the offload engine plans within it), each copied in while earlier ones compute.

        ``lookahead``: chunk ``j - 1`` stays valid while chunk ``j`` is fetched (the overlapped backward
        queues chunk ``j - 1``'s dX and dW GEMMs after chunk ``j``'s logits), so a weight slot is handed
        back to the copy stream only when chunk ``j + 1`` is requested: by then every use of chunk ``j - 1``
        is queued. With a ring of ``depth`` slots, ``depth - 2`` chunks are in flight ahead of the one in
        use. A cast chunk (autocast) frees its slot as soon as it is cast, into one of two buffers that
        alternate, so the previous chunk's cast stays valid.
        """
        d = self.weight.shape[1]
        width = min(stream_cols(cols, d, self.weight.element_size(), self.slot_bytes), max(self.num_rows, 1))
        bounds = chunk_bounds(self.num_rows, width)
        self._width = width
        if not bounds:
            return
        ops, dev = self.streams, self._device
        compute, h2d = ops.compute(dev), ops.h2d(dev)
        depth = min(self.depth, len(bounds))
        # The ring comes from the compute stream's allocator and is written on the H2D stream: lend it (its
        # memory is not reused before those copies end) ...
        ring_w = [self._empty(width, d, dtype=self.stored_dtype) for _ in range(depth)]
        ring_b = [self._empty(width, dtype=self.bias.dtype) for _ in range(depth)] if self.bias is not None else None
        for t in ring_w + (ring_b or []):
            ops.lend(t, h2d)
        # ... and the allocator may have handed out memory that work queued earlier on the compute stream
        # (a previous pass, whose last chunks may not have run yet) still reads: the first copies wait for
        # that work.
        start = ops.event()
        ops.record(start, compute)
        ops.wait(h2d, start)
        cast = self.stored_dtype != self.compute_dtype
        cast_w = [self._empty(width, d, dtype=self.compute_dtype) for _ in range(2)] if cast else None
        cast_b = [self._empty(width, dtype=self.compute_dtype) for _ in range(2)] if cast and ring_b else None
        ready = [ops.event() for _ in range(depth)]
        free = [ops.event() for _ in range(depth)]

        def fetch(j: int) -> None:
            # H2D stream: wait until the compute stream is done with the chunk that used this slot before.
            s = j % depth
            c0, c1 = bounds[j]
            ops.wait(h2d, free[s])
            ops.copy(ring_w[s][: c1 - c0], self.weight[c0:c1], h2d)
            if ring_b is not None:
                ops.copy(ring_b[s][: c1 - c0], self.bias[c0:c1], h2d)
            ops.record(ready[s], h2d)

        def release(j: int) -> None:
            # Every use of chunk j's slot is queued on the compute stream: the copy stream may refill it.
            s = j % depth
            ops.use(compute, ring_w[s])
            if ring_b is not None:
                ops.use(compute, ring_b[s])
            ops.record(free[s], compute)
            if j + depth < len(bounds):
                fetch(j + depth)

        for j in range(depth):
            fetch(j)
        for j, (c0, c1) in enumerate(bounds):
            s, n = j % depth, c1 - c0
            if j >= 2:
                # The consumer asks for chunk j: its work on chunk j - 2 is all queued.
                if cast:
                    ops.use(compute, cast_w[j % 2])
                    if cast_b is not None:
                        ops.use(compute, cast_b[j % 2])
                else:
                    release(j - 2)
            ops.wait(compute, ready[s])
            w = ring_w[s][:n]
            b = None if ring_b is None else ring_b[s][:n]
            if cast:
                # Autocast: the float32 master chunk becomes the compute dtype here, on the GPU; the slot is
                # free again as soon as the cast has run.
                ops.copy(cast_w[j % 2][:n], w, compute)
                w = cast_w[j % 2][:n]
                if b is not None:
                    ops.copy(cast_b[j % 2][:n], b, compute)
                    b = cast_b[j % 2][:n]
                release(j)
            yield WeightChunk(c0, c1, w, b)

    # Gradient sink ---------------------------------------------------------------------------------
    def start_grads(self, need_bias: bool) -> None:
        if self.grads is None:
            raise RuntimeError("hugehead: this StreamedChunks has no gradient pool")
        what = f"the gradient of an offloaded shard ({self.num_rows:,} classes)"
        self._grad_w = self.grads.take(self.weight, what)
        self._grad_b = self.grads.take(self.bias, what) if (need_bias and self.bias is not None) else None
        self._grad_ring = None
        self._grad_count = 0
        self._grad_open = None

    def _open_slot(self, c0: int) -> int:
        """The gradient slot of the chunk starting at ``c0``; the compute stream waits until the slot's
        previous contents have been copied out."""
        if self._grad_open is not None and self._grad_open[0] == c0:
            return self._grad_open[1]
        ops, dev = self.streams, self._device
        if self._grad_ring is None:
            width, d = max(self._width, 1), self.weight.shape[1]
            d2h = ops.d2h(dev)
            self._grad_ring = []
            for _ in range(self.grad_depth):
                gw = self._empty(width, d, dtype=self.stored_dtype)
                gb = self._empty(width, dtype=self._grad_b.dtype) if self._grad_b is not None else None
                for t in (gw, gb):
                    if t is not None:
                        ops.lend(t, d2h)
                self._grad_ring.append((gw, gb))
            self._grad_events = [(ops.event(), ops.event()) for _ in range(self.grad_depth)]
        s = self._grad_count % self.grad_depth
        self._grad_count += 1
        ops.wait(ops.compute(dev), self._grad_events[s][1])  # grad_copied of the chunk before
        self._grad_open = (c0, s)
        return s

    def grad_weight_out(self, c0: int, c1: int, dtype: torch.dtype) -> Optional[Tensor]:
        """A device slot where ``dW`` of the chunk, computed in ``dtype``, is written directly when that is
        the Parameters' dtype (else None: :meth:`put_grad` casts it into the slot)."""
        if dtype != self.stored_dtype:
            return None
        s = self._open_slot(c0)
        return self._grad_ring[s][0][: c1 - c0]

    def put_grad(self, c0: int, c1: int, grad_weight: Optional[Tensor], grad_bias: Optional[Tensor]) -> None:
        """Finish chunk ``[c0, c1)``'s gradients in their device slot (casting on the compute stream) and
        queue their copy to the host gradients on the D2H stream."""
        ops, dev = self.streams, self._device
        s = self._open_slot(c0)
        n = c1 - c0
        gw, gb = self._grad_ring[s]
        compute, d2h = ops.compute(dev), ops.d2h(dev)
        if grad_weight is not None:
            ops.copy(gw[:n], grad_weight, compute)
        if gb is not None and grad_bias is not None:
            ops.copy(gb[:n], grad_bias, compute)
        ops.use(compute, gw, write=True)  # the dW GEMM wrote the slot (or the copy above did)
        grad_ready, grad_copied = self._grad_events[s]
        ops.record(grad_ready, compute)
        ops.wait(d2h, grad_ready)
        ops.copy(self._grad_w[c0:c1], gw[:n], d2h)
        if gb is not None and self._grad_b is not None:
            ops.copy(self._grad_b[c0:c1], gb[:n], d2h)
        ops.record(grad_copied, d2h)
        self._grad_open = None

    def finish_grads(self) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """The host gradients ``(dW [V_k, D], db [V_k] or None)``. Their copies may still be in flight:
        :meth:`OffloadEngine.backward` waits for them before autograd sees them."""
        out = self._grad_w, self._grad_b
        self._grad_w = self._grad_b = None
        self._grad_ring = None
        return out


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------
class OffloadEngine(LocalEngine):
    """The local engine for shards in pinned host memory: each shard computes on its assigned GPU, its
    weight streamed in by :class:`StreamedChunks`; gradients land in pinned host tensors.

    Args:
        compute_devices: the compute device of each shard, by the shard's first class id.
        chunk_size, memory_budget: as for :class:`LocalEngine`. With ``memory_budget=None`` a shard may keep
            its logits between forward and backward in up to half its GPU's free memory (the weight is not
            there, and a copy-bound forward leaves time to spare; the backward then skips the recompute).
        streams: :class:`CudaStreams` (default for CUDA devices) or :class:`InlineStreams` (CPU devices).
        allocate_host: ``(shape, dtype, what=...) -> Tensor`` for host gradients (default: pinned, exact size;
            pageable for CPU compute devices).
        depth, grad_depth: ring sizes (weights in, gradients out).
    """

    name = "offload"

    def __init__(self, compute_devices: Mapping[int, torch.device], chunk_size: Optional[int] = None,
                 memory_budget: Optional[int] = None, *, streams=None,
                 allocate_host: Optional[Callable[..., Tensor]] = None, depth: int = WEIGHT_RING_DEPTH,
                 grad_depth: int = GRAD_RING_DEPTH):
        super().__init__(chunk_size, memory_budget)
        self.devices: Dict[int, torch.device] = {int(k): torch.device(v) for k, v in compute_devices.items()}
        types = {d.type for d in self.devices.values()}
        if len(types) > 1:
            raise ValueError(f"hugehead: offload compute devices must be all CUDA (or all CPU in tests), got {types}")
        on_cpu = types == {"cpu"}
        self.streams = streams if streams is not None else (InlineStreams() if on_cpu else CudaStreams())
        if allocate_host is None:
            allocate_host = pinned.empty_host if on_cpu else pinned.empty_pinned
        self.allocate_host = allocate_host
        self.grad_pool = HostGradPool(allocate_host)
        self.depth = depth
        self.grad_depth = grad_depth

    def compute_device(self, shard: ShardTensors) -> torch.device:
        return self.devices[shard.start]

    def cast_parameter(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """Cast into pinned host memory again (``t.to`` would land in pageable memory)."""
        return self.allocate_host(t.shape, dtype, what="a cast offloaded shard").copy_(t)

    def source(self, shard: ShardTensors, compute_dtype: torch.dtype) -> StreamedChunks:
        return StreamedChunks(shard.weight, shard.bias, compute_dtype, self.compute_device(shard), self.streams,
                              self.grad_pool, self.depth, self.grad_depth)

    def budgets(self, shards: Sequence[ShardTensors], keep: bool) -> Dict[torch.device, Budget]:
        """The planner's budgets with the offload default for kept logits (see the class)."""
        return device_budgets(self.memory_budget, [self.compute_device(s) for s in shards], streamed_keep=keep)

    def plan(self, x: Tensor, shard: ShardTensors, keep: bool, budget: Optional[Budget] = None,
             options: Optional[LossOptions] = None, class_ids: bool = True) -> Plan:
        """The plan of a streamed shard (:func:`hugehead.plan.plan_streamed`: chunks capped to a ring slot)."""
        device = self.compute_device(shard)
        if budget is None:
            budget = resolve_budget(self.memory_budget, device, streamed_keep=keep)
        v, d = shard.weight.shape
        return plan_streamed(x.shape[0], d, v, x.dtype, shard.weight.dtype, device, self.chunk_size, budget, keep,
                             self.operands(x, shard, options, class_ids))

    def backward(self, placed, shards, num_classes, lse, grad_rows, options, need_x, need_weight, x_like,
                 grad_lse=None, row_terms=None):
        """:meth:`LocalEngine.backward`, then the step's one host synchronization: autograd hands the host
        gradients to whatever reads them next on the CPU (the optimizer, which then writes the weights the
        backward's copies read), so the host waits here, once all shards' work is queued, for each compute
        device's copies to finish."""
        out = super().backward(placed, shards, num_classes, lse, grad_rows, options, need_x, need_weight, x_like,
                               grad_lse=grad_lse, row_terms=row_terms)
        active = [s for s, need in zip(shards, need_weight) if need or need_x]
        for device in sorted({self.compute_device(s) for s in active}, key=str):
            self.streams.host_wait(device)
        return out

    def stats(self) -> Dict[str, float]:
        """Host gradient memory this engine allocated (bytes) and the seconds that took."""
        return {"grad_bytes": self.grad_pool.allocated_bytes, "grad_alloc_seconds": self.grad_pool.allocation_seconds}
