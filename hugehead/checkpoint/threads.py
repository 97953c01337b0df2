"""The storage writer and reader of hugehead's DCP checkpoints: several threads, a file per writer thread,
the files read back in parallel (a single thread leaves a fast disk half idle), and every thread's error
raised to the caller."""
from __future__ import annotations

import functools
import math
import os
import threading
import zlib
from typing import Dict, List

import torch

from .verify import CheckpointCorruptError

__all__ = ["writer", "reader", "load_planner"]


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


class _DigestingStream:
    """A file being written that keeps the CRC-32 and count of the bytes written to it (its digest while
    nothing seeks in it: the writer threads compute the digests, no pass reads the files back)."""

    def __init__(self, f):
        self.f, self.crc, self.count, self.in_order = f, 0, 0, True

    def write(self, data) -> int:
        view = memoryview(data)
        n = self.f.write(view)
        self.in_order = self.in_order and n == view.nbytes
        self.crc = zlib.crc32(view, self.crc)
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

        def read_data(self, plan, planner):
            per_file: Dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            if threads <= 1 or len(per_file) <= 1:
                return super().read_data(plan, planner)
            read = super().read_data
            with ThreadPoolExecutor(max_workers=min(threads, len(per_file)), thread_name_prefix="hugehead-read") as pool:
                futures = [pool.submit(read, replace(plan, items=items), planner) for items in per_file.values()]
                wait(futures)
            for future in futures:
                future.result()  # re-raises the first failure
            return futures[-1].result()

    return ParallelReader()


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
