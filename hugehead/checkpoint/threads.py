"""The storage writer and reader of hugehead's DCP checkpoints: several threads, a file per writer thread,
the files read back in parallel (a single thread leaves a fast disk half idle), and every thread's error
raised to the caller."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

__all__ = ["writer", "reader"]


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
    return ParallelWriter(path, sync_files=True, thread_count=1, per_thread_copy_ahead=0)


def reader(path: str, threads: int):
    """A DCP ``FileSystemReader`` that reads its files in ``threads`` threads at once (DCP's own reads
    them one after another): a checkpoint saved with several writer threads is several files."""
    from concurrent.futures import ThreadPoolExecutor, wait
    from dataclasses import replace

    import torch.distributed.checkpoint as dcp

    class ParallelReader(dcp.FileSystemReader):
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

    return ParallelReader(path)
