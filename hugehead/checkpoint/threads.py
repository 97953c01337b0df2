"""The storage writer and reader of hugehead's DCP checkpoints: several threads, a file per writer thread,
the files read back in parallel (a single thread leaves a fast disk half idle), and every thread's error
raised to the caller."""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
from typing import Dict, List

import torch

from .verify import CheckpointCorruptError, crc32

__all__ = ["writer", "reader", "load_planner", "empty_for_reading"]


def writer(path: str, threads: int):
    """A DCP ``FileSystemWriter`` (fsyncing its files) whose items are split by size over ``threads``
    threads, each writing its own file; an error in any thread is raised by ``dcp.save``. (DCP's own
    ``thread_count`` loses an exception raised in any thread but the first: the checkpoint would be
    committed without that thread's file.) Each thread stages a GPU block to the host when it reaches
    it (:meth:`ShardedRows.staged_to_host`), so one thread's copy overlaps the others' writes."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    def item_bytes(item) -> int:
        data = item.tensor_data
        if data is None:
            return 0
        return math.prod(data.chunk.sizes) * torch.empty((), dtype=data.properties.dtype).element_size()

    class ParallelWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            with _without_zip_crc32():
                return self.write_in_threads(plan, planner)

        def write_in_threads(self, plan, planner):
            if threads <= 1 or len(plan.items) <= 1:
                return super().write_data(plan, planner)
            buckets: List[list] = [[] for _ in range(min(threads, len(plan.items)))]
            loads = [0] * len(buckets)
            byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            for n, item in enumerate(byte_items):
                buckets[n % len(buckets)].append(item)
            for item in sorted((i for i in plan.items if i.type != WriteItemType.BYTE_IO), key=item_bytes, reverse=True):
                k = loads.index(min(loads))  # largest first into the least loaded thread
                buckets[k].append(item)
                loads[k] += item_bytes(item)
            prefix = plan.storage_data.prefix
            write = super().write_data
            with ThreadPoolExecutor(max_workers=len(buckets), thread_name_prefix="hugehead-write") as pool:
                futures = [pool.submit(write, replace(plan, items=items, storage_data=replace(plan.storage_data,
                                                                                               prefix=f"{prefix}t{k}_")),
                                       planner)
                           for k, items in enumerate(buckets) if items]
            results: list = []
            for future in futures:
                results += future.result().value()  # re-raises a thread's error
            out: torch.futures.Future = torch.futures.Future()
            out.set_result(results)
            return out

    # per_thread_copy_ahead=0: the serial loader (a GPU block is staged by ShardedRows when resolved; DCP's
    # overlapping loader would only add stream syncs per thread).
    out = ParallelWriter(path, sync_files=True, thread_count=1, per_thread_copy_ahead=0)
    out.fs = _digesting_files()()
    return out


_zip_crc32_lock = threading.Lock()
_zip_crc32_off = [0, True]  # saves writing now, torch.save's CRC-32 option before the first of them


@contextlib.contextmanager
def _without_zip_crc32():
    """``torch.save``'s CRC-32 of each zip record off while DCP writes: each file's own CRC-32, computed
    as it is written, covers every byte, and a second CRC pass over the same bytes halves the write speed.
    The option is process-wide, so overlapping saves count themselves and the last one restores it (a
    ``torch.save`` in another thread meanwhile writes records without CRC, which ``torch.load`` reads)."""
    with _zip_crc32_lock:
        if _zip_crc32_off[0] == 0:
            _zip_crc32_off[1] = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _zip_crc32_off[0] += 1
    try:
        yield
    finally:
        with _zip_crc32_lock:
            _zip_crc32_off[0] -= 1
            if _zip_crc32_off[0] == 0:
                torch.serialization.set_crc32_options(_zip_crc32_off[1])


class _DigestingStream:
    """A file being written that keeps the CRC-32 and count of the bytes written to it (its digest while
    nothing seeks in it: the writer threads compute the digests, no pass reads the files back)."""

    def __init__(self, f):
        self.f, self.crc, self.count, self.in_order = f, 0, 0, True

    def write(self, data) -> int:
        view = memoryview(data)
        n = self.f.write(view)
        self.in_order = self.in_order and n == view.nbytes
        self.crc = crc32(view, self.crc)
        self.count += view.nbytes
        return n

    def seek(self, *args):
        self.in_order = False
        return self.f.seek(*args)

    def __getattr__(self, name: str):  # tell, flush, fileno, close: the file's own
        return getattr(self.f, name)


@functools.lru_cache(maxsize=None)
def _digesting_files():
    """The class (made once: DCP is imported when a checkpoint is first written)."""
    from contextlib import contextmanager
    from pathlib import Path

    from torch.distributed.checkpoint.filesystem import FileSystem

    class DigestingFiles(FileSystem):
        """DCP's file system whose written files report their sizes and digests (:meth:`digests`)."""

        def __init__(self):
            super().__init__()
            self.streams: Dict[str, _DigestingStream] = {}
            self.lock = threading.Lock()

        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as f:
                if "w" not in mode:
                    yield f
                    return
                stream = _DigestingStream(f)
                yield stream
            with self.lock:
                self.streams[Path(path).name] = stream

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            with self.lock:
                if Path(path).name in self.streams:
                    self.streams[Path(new_path).name] = self.streams.pop(Path(path).name)

        def digests(self) -> Dict[str, Dict[str, int]]:
            """``{name: {"bytes", "crc32"}}`` of the files written in order (the others: none)."""
            return {name: {"bytes": s.count, "crc32": s.crc} for name, s in self.streams.items() if s.in_order}

    return DigestingFiles



def reader(path: str, threads: int, pinned=None, metadata=None, weights_only: bool = True):
    """A DCP ``FileSystemReader`` that reads its files in ``threads`` threads at once (DCP's own reads
    them one after another): a checkpoint saved with several writer threads is several files.

    ``pinned`` (a :class:`~hugehead.checkpoint.verify.PinnedDir`): every file is read through its held
    descriptors (one version); ``metadata``: DCP's ``Metadata`` already read from it. Without them, the
    directory is pinned here. ``.metadata`` is unpickled through an allow-list unless ``weights_only=False``;
    a missing or truncated file raises ``CheckpointCorruptError`` before anything is loaded."""
    from concurrent.futures import ThreadPoolExecutor, wait
    from contextlib import contextmanager
    from dataclasses import replace

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    from torch.distributed.checkpoint.planner import LoadItemType

    from .verify import PinnedDir, check_extents, load_dcp_metadata

    pinned = PinnedDir(str(path)) if pinned is None else pinned

    class PinnedFiles(FileSystem):
        @contextmanager
        def create_stream(self, file_path, mode):
            if "r" not in mode or "+" in mode:
                raise ValueError(f"hugehead: a checkpoint is read only here, not opened with mode {mode!r}")
            with pinned.stream(os.path.relpath(os.fspath(file_path), os.fspath(path))) as stream:
                yield stream

    class ParallelReader(dcp.FileSystemReader):
        def __init__(self):
            super().__init__(path)
            self.fs = PinnedFiles()

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            if metadata is not None and rank is None:
                md = metadata
            else:
                try:
                    data = pinned.read(name)
                except FileNotFoundError:
                    if rank is not None:  # a rank's own metadata is optional: DCP falls back to the global one
                        raise
                    raise CheckpointCorruptError(os.path.join(pinned.path, name), "is missing (every DCP checkpoint "
                                                 "has one)") from None
                md = load_dcp_metadata(data, os.path.join(pinned.path, name), weights_only)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def set_up_storage_reader(self, md, is_coordinator, *args, **kwargs):
            super().set_up_storage_reader(md, is_coordinator, *args, **kwargs)
            check_extents(pinned, md)  # before read_data writes anything

        def read_file(self, name: str, items: list, plan, planner) -> None:
            """One file's items, in file order: a tensor straight from the file into its target
            (:func:`_read_tensor_into`), any other item through DCP's own reader."""
            items = sorted(items, key=lambda item: self.storage_data[item.storage_index].offset)
            others = []
            with pinned.stream(name) as stream:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                        others.append(item)
                        continue
                    target = planner.resolve_tensor(item).detach()
                    if _read_tensor_into(stream, info.offset, info.length, item, target):
                        planner.commit_tensor(item, target)
                    else:
                        others.append(item)
            if others:
                super().read_data(replace(plan, items=others), planner)

        def read_data(self, plan, planner):
            per_file: Dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            jobs = [(name, items, plan, planner) for name, items in per_file.items()]
            if threads <= 1 or len(jobs) <= 1:
                for job in jobs:
                    self.read_file(*job)
            else:
                with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="hugehead-read") as pool:
                    futures = [pool.submit(self.read_file, *job) for job in jobs]
                    wait(futures)
                for future in futures:
                    future.result()  # re-raises the first failure
            out: torch.futures.Future = torch.futures.Future()
            out.set_result(None)
            return out

    return ParallelReader()


_MADV_HUGEPAGE = 14  # Linux's madvise advice for transparent huge pages


def empty_for_reading(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized tensor that a load reads into. On the host (Linux) its pages are advised as huge
    pages before anything touches them: the read's first touch of fresh memory faults every page in (and
    the kernel zeroes it), which at 4 KiB a page more than halves the copy's speed; 2 MiB pages fault 512
    times less often. Elsewhere (no libc madvise, transparent huge pages off) the advice does nothing."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < (4 << 20) or not sys.platform.startswith("linux"):
        return tensor
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + nbytes) // page * page
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    return tensor


def _read_tensor_into(stream, offset: int, length: int, item, target: torch.Tensor) -> bool:
    """Read the stored tensor that DCP's ``torch.save`` wrote at ``[offset, offset + length)`` of
    ``stream``'s file, narrowed to ``item``'s extent, straight into ``target`` with positional reads: one
    copy from the page cache into the target's memory (DCP's reader makes a tensor of the whole record,
    then copies it). The record's layout comes from its pickle alone (``map_location="meta"`` reads no
    data). False, having read nothing into ``target``, where the bytes are not one contiguous run of
    ``target``'s dtype and shape (the caller then reads it DCP's way)."""
    import ctypes

    from torch.distributed.checkpoint.utils import _create_file_view

    if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
        return False
    meta = torch.load(_create_file_view(stream, offset, length), map_location="meta", weights_only=True)
    record = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if not isinstance(meta, torch.Tensor) or record is None or meta.dtype != target.dtype:
        return False
    for dim, (start, size) in enumerate(zip(item.storage_offsets, item.lengths)):
        meta = meta.narrow(dim, start, size)
    if tuple(meta.shape) != tuple(target.shape) or not meta.is_contiguous():
        return False
    nbytes = target.numel() * target.element_size()
    start = offset + record + meta.storage_offset() * meta.element_size()
    if start + nbytes > offset + length:
        return False
    view = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
    fd, done = stream.fileno(), 0
    while done < nbytes:  # preadv releases the GIL: the reader threads copy in parallel
        n = os.preadv(fd, [view[done:]], start + done)
        if n == 0:
            raise CheckpointCorruptError(getattr(stream, "name", "?"), f"ends before byte {start + nbytes} (truncated)")
        done += n
    return True


def load_planner(weights_only: bool = True):
    """DCP's default load planner, but a non-tensor value (``BYTE_IO``) is unpickled by ``torch.load`` with
    ``weights_only`` (DCP's own uses ``weights_only=False``: a checkpoint's bytes could run code)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            obj = torch.load(value, weights_only=weights_only)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
