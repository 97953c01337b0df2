"""Pinned host memory at exact size, and the host-memory check that comes before it.

torch's pinned allocator (``pin_memory=True``) rounds every request up to a power of two: a 20 GiB head
would lock 32 GiB. Here a block is an anonymous private mapping of exactly the bytes asked for (rounded to
a page), pre-faulted by torch's parallel fill, then page-locked with ``cudaHostRegister`` (through
``torch.cuda.cudart()``). The tensor holds the mapping alive through ``torch.frombuffer``; when the last
tensor over it dies, the mapping is unregistered and unmapped.
"""
from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["HostMemoryError", "available_host_memory", "check_host_memory", "empty_pinned", "pinned_stats",
           "format_bytes"]

log = logging.getLogger("hugehead")

_GiB = float(1 << 30)
# cudaHostRegisterPortable: every CUDA context (each GPU's primary context) treats the block as pinned, so
# several compute GPUs can stream from one process's host shards with DMA.
_REGISTER_PORTABLE = 0x01


class HostMemoryError(MemoryError):
    """The host has less available memory than an offloaded head (or its gradients) needs."""


def format_bytes(n: float) -> str:
    return f"{n / _GiB:.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"


# --------------------------------------------------------------------------------------------------
# How much host memory is there?
# --------------------------------------------------------------------------------------------------
def parse_meminfo(text: str) -> Optional[int]:
    """``MemAvailable`` of a ``/proc/meminfo`` text in bytes, or None when absent."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            scale = 1024 if len(parts) > 2 and parts[2].lower() == "kb" else 1
            return int(parts[1]) * scale
    return None


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_headroom() -> Optional[int]:
    """Bytes this process's memory cgroup may still charge (limit minus usage), or None without a limit.
    In a container ``/proc/meminfo`` describes the whole host, so the cgroup limit can be the tighter one."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read(limit_path), _read(usage_path)
        if limit is None or usage is None:
            continue
        limit = limit.strip()
        if limit == "max" or not limit.isdigit() or int(limit) >= (1 << 60):
            return None
        return max(0, int(limit) - int(usage.strip() or 0))
    return None


def available_host_memory() -> Optional[int]:
    """Bytes of host memory available to this process: ``MemAvailable`` from ``/proc/meminfo``, capped by
    the memory cgroup's headroom when there is a limit (psutil where ``/proc`` is missing); None when
    unknown."""
    available = None
    text = _read("/proc/meminfo")
    if text is not None:
        available = parse_meminfo(text)
    if available is None:
        try:
            import psutil  # optional

            available = int(psutil.virtual_memory().available)
        except (ImportError, AttributeError, OSError):
            available = None
    headroom = _cgroup_headroom()
    if headroom is not None:
        available = headroom if available is None else min(available, headroom)
    return available


def check_host_memory(needed: int, what: str, available: Optional[int] = None) -> None:
    """Raise :class:`HostMemoryError` naming ``needed`` and available bytes when ``needed`` exceeds what
    the host has available (``available``: measured by :func:`available_host_memory` when None; an
    unknown amount passes)."""
    if available is None:
        available = available_host_memory()
    if available is not None and needed > available:
        raise HostMemoryError(
            f"hugehead: {what} need {needed:,} bytes ({format_bytes(needed)}) of pinned host memory, but the "
            f"host has only {available:,} bytes ({format_bytes(available)}) available (MemAvailable in "
            f"/proc/meminfo, capped by the memory cgroup). Use a 2-byte dtype (bfloat16), fewer classes, or a "
            f"machine with more RAM."
        )


# --------------------------------------------------------------------------------------------------
# Exact-size pinned blocks
# --------------------------------------------------------------------------------------------------
_stats_lock = threading.Lock()
_stats: Dict[str, float] = {"pinned_bytes": 0, "blocks": 0, "pin_seconds": 0.0, "peak_pinned_bytes": 0}


def pinned_stats() -> Dict[str, float]:
    """Totals of this process's exact-size pinned blocks: bytes pinned now, peak, live blocks, and the
    seconds spent pinning (faulting pages in and ``cudaHostRegister``)."""
    with _stats_lock:
        return dict(_stats)


def _account(nbytes: int, blocks: int, seconds: float = 0.0) -> None:
    with _stats_lock:
        _stats["pinned_bytes"] += nbytes
        _stats["blocks"] += blocks
        _stats["pin_seconds"] += seconds
        _stats["peak_pinned_bytes"] = max(_stats["peak_pinned_bytes"], _stats["pinned_bytes"])


def _cuda_register(ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE)
    if err != cudart.cudaError.success:
        raise RuntimeError(
            f"hugehead: cudaHostRegister of {format_bytes(nbytes)} failed: {cudart.cudaGetErrorString(err)}"
        )


def _cuda_unregister(ptr: int) -> None:
    # Copies that read or write the block may still be queued: let every device finish before the pages
    # are unlocked and unmapped (freeing a multi-GiB head is rare; a sync here is cheap by comparison).
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)
    torch.cuda.cudart().cudaHostUnregister(ptr)


class _Block(mmap.mmap):
    """An anonymous private mapping; ``unregister`` (when set) runs once, before the pages are unmapped,
    when the last tensor over the block dies."""

    unregister: Optional[Callable[[int], None]] = None
    ptr: int = 0
    size: int = 0

    def __del__(self):
        unregister, self.unregister = self.unregister, None
        if unregister is not None:
            try:
                unregister(self.ptr)
            except Exception:  # noqa: BLE001  (interpreter shutdown: CUDA may be gone; the OS reclaims all)
                pass
            _account(-self.size, -1)


def empty_pinned(
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    what: str = "a pinned buffer",
    register: Optional[Callable[[int, int], None]] = None,
    unregister: Optional[Callable[[int], None]] = None,
) -> Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` in page-locked host memory of exactly its size (rounded up
    to a page), zero-filled.

    Args:
        what: names the buffer in the host-memory error.
        register, unregister: how the block is page-locked and released (default: ``cudaHostRegister`` /
            ``cudaHostUnregister`` through ``torch.cuda.cudart()``). Tests pass no-ops.
    Raises:
        HostMemoryError: the host has less available memory than the tensor needs.
        RuntimeError: CUDA is not available (with the default registration), or registration failed.
    """
    shape = tuple(int(s) for s in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if register is None:
        if not torch.cuda.is_available():
            raise RuntimeError("hugehead: pinned host memory needs CUDA, which is not available here")
        torch.cuda.init()
        register, unregister = _cuda_register, _cuda_unregister
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    check_host_memory(nbytes, what)
    t0 = time.perf_counter()
    block = _Block(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20),
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        # Huge pages: 512x fewer faults and pages to lock. DONTFORK: DataLoader workers forked later must
        # not share (copy-on-write) pages the GPU's DMA engines address.
        if hasattr(mmap, advice):
            try:
                block.madvise(getattr(mmap, advice))
            except OSError:
                pass
    flat = torch.frombuffer(block, dtype=torch.uint8)  # holds the block: freed with the last tensor
    flat.zero_()  # faults the pages in, in parallel (torch's intra-op threads), before locking them
    ptr = flat.data_ptr()
    register(ptr, nbytes)
    block.ptr, block.size, block.unregister = ptr, nbytes, unregister
    seconds = time.perf_counter() - t0
    _account(nbytes, 1, seconds)
    log.info("hugehead: pinned %s (%s) in %.2f s", format_bytes(nbytes), what, seconds)
    del block
    return flat.view(dtype).view(shape)


def no_register(ptr: int, nbytes: int) -> None:
    """A registration that does nothing: host blocks for a CPU compute device (tests) stay pageable."""


def no_unregister(ptr: int) -> None:
    """The counterpart of :func:`no_register`."""


def empty_host(shape: Sequence[int], dtype: torch.dtype, *, what: str = "a host buffer") -> Tensor:
    """:func:`empty_pinned` without page-locking (the offload engine's buffers when it computes on the
    CPU, in tests)."""
    return empty_pinned(shape, dtype, what=what, register=no_register, unregister=no_unregister)
