"""Checkpoint save and load speed against the disk's own (issue 25): a ChunkedClassifier of --classes x
--dim float32 master weights on one GPU with AdamW state (made by one optimizer step), written with
``hugehead.checkpoint.save_checkpoint`` (torch.distributed.checkpoint, --io-threads writer threads, one
file each, GPU blocks staged to the host by each thread as it reaches them) and read back cold with
``load_checkpoint`` (files read in parallel, straight onto the GPU).

    python -m bench.bench_checkpoint --out bench/results/h200 --dir /tmp/hh_ckpt     # one GPU, 6M x 768
    python -m bench.bench_checkpoint --cpu-smoke --out /tmp/r --dir /tmp/r/work        # same pipeline, tiny, CPU

Measured on the file system of --dir (emptied and removed at the end):
1. the disk: a --disk-gib GiB file written in 64 MiB blocks and fsynced, then read back cold (its pages
   dropped with posix_fadvise(DONTNEED), and /proc/sys/vm/drop_caches where allowed); ``dd`` with
   O_DIRECT beside it, for reference.
2. for each --io-threads: ``save_checkpoint`` GB/s (one save, host clock, GPU synchronized), the page
   cache dropped, ``load_checkpoint`` GB/s into the same head and optimizer (both overwritten first, so a
   load that does nothing cannot pass), checked against float64 checksums of every tensor taken before
   the save; then the checkpoint is deleted (the disk holds one at a time).
The target (issue 25): save and load >= 0.8 of the disk's measured write and read speed.

A 6M x 768 float32 head with two AdamW moments is a 55.3 GB checkpoint. When --dir's file system cannot
hold it (beside the probe file, which is deleted first), --classes is scaled down to what fits (recorded
in the results) unless --no-fit-disk. Writes checkpoint.json and checkpoint.md to --out (default
bench/results/<gpu>/).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional

from bench import harness  # first: decides which hugehead is imported

import torch

from bench.bench_resume import disk_bandwidth, drop_page_cache, tree_bytes

GIB = 2**30


def drop_all_caches() -> bool:
    """Ask the kernel to drop every clean page (root only); False where it refuses."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def file_system_of(path: Path) -> Dict[str, object]:
    """The mount holding ``path`` (/proc/mounts): device, type, mount point; and its size and free bytes."""
    best = ("?", "?", "/")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mount.rstrip("/") + "/") or str(path.resolve()) == mount:
                if len(mount) >= len(best[2]):
                    best = (device, fstype, mount)
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    return {"device": best[0], "type": best[1], "mount": best[2], "total_bytes": usage.total,
            "free_bytes": usage.free}


def checkpoint_bytes(classes: int, dim: int, itemsize: int = 4) -> int:
    """Bytes of the head's weight and bias and their two AdamW moments (what a checkpoint holds)."""
    return 3 * classes * (dim + 1) * itemsize


def build(classes: int, dim: int, device: torch.device, batch: int):
    import hugehead

    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(dim, classes, devices=[device], dtype=torch.float32)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randn(batch, dim, device=device)
    target = torch.randint(0, classes, (batch,), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = head(x, target)
    loss.backward()
    optimizer.step()  # the moments exist now
    optimizer.zero_grad(set_to_none=True)
    harness.synchronize(device)
    return head, optimizer


def checksums(head, optimizer) -> Dict[str, float]:
    """float64 sum and sum of squares of every parameter and optimizer state tensor (on its device)."""
    out = {}
    tensors = {f"param.{i}": p.detach() for i, p in enumerate(head.parameters())}
    for i, state in optimizer.state_dict()["state"].items():
        tensors.update({f"state.{i}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    for name, t in tensors.items():
        total = squares = torch.zeros((), dtype=torch.float64, device=t.device)
        for block in t.reshape(-1).split(1 << 26):  # 512 MiB of float64 at a time, not a copy of the head
            block = block.double()
            total, squares = total + block.sum(), squares + (block * block).sum()
        out[name] = (float(total), float(squares))
    return out


def scramble(head, optimizer) -> None:
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(0.25)
    optimizer.state.clear()  # frees the moments: the load allocates them again on the GPU


def timed_s(fn, device) -> float:
    harness.synchronize(device)
    t0 = time.perf_counter()
    fn()
    harness.synchronize(device)
    return time.perf_counter() - t0


def run(args, work: Path, doc: Dict[str, object]) -> None:
    from hugehead import checkpoint as ck

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    rows: List[Dict[str, object]] = []
    doc["rows"] = rows
    doc["fs"] = file_system_of(work)

    disk = disk_bandwidth(work, args.disk_gib)  # deletes its probe files
    disk["drop_caches"] = drop_all_caches()
    doc["disk"] = disk
    print(f"disk: write {disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s", flush=True)

    classes = args.classes
    free = shutil.disk_usage(work).free
    want = ck.space.estimate(checkpoint_bytes(classes, args.dim), 64) + (256 << 20)
    if want > free and args.fit_disk:
        scale = (free - ck.space.FIXED_OVERHEAD_BYTES - (1 << 30)) / want
        classes = max(1000, int(classes * scale) // 1000 * 1000)
        print(f"{work} has {free / 1e9:.1f} GB free: --classes {args.classes} -> {classes} to fit one checkpoint",
              flush=True)
    doc["classes"] = classes
    head, optimizer = build(classes, args.dim, device, args.batch)
    reference = checksums(head, optimizer)
    for threads in args.io_threads:
        path = work / f"ckpt_t{threads}"
        save_s = timed_s(lambda: ck.save_checkpoint(path, head, optimizer, io_threads=threads), device)
        nbytes = tree_bytes(path)
        files = sum(1 for name in os.listdir(path) if name.endswith(".distcp"))
        drop_page_cache(path)
        dropped = drop_all_caches()
        scramble(head, optimizer)
        load_s = timed_s(lambda: ck.load_checkpoint(path, head, optimizer, io_threads=threads), device)
        exact = checksums(head, optimizer) == reference
        shutil.rmtree(path)
        row = dict(io_threads=threads, files=files, bytes=nbytes, save_s=save_s, save_gbps=nbytes / save_s / 1e9,
                   load_s=load_s, load_gbps=nbytes / load_s / 1e9, exact=exact, caches_dropped=dropped,
                   save_vs_disk=nbytes / save_s / 1e9 / disk["write_gbps"],
                   load_vs_disk=nbytes / load_s / 1e9 / disk["read_gbps"])
        rows.append(row)
        print(f"io_threads={threads}: {nbytes / 1e9:.2f} GB, save {row['save_gbps']:.2f} GB/s "
              f"({row['save_vs_disk']:.2f} of the disk), load {row['load_gbps']:.2f} GB/s "
              f"({row['load_vs_disk']:.2f}), exact={exact}", flush=True)


def render_markdown(doc: Dict[str, object]) -> str:
    meta, disk, fs = doc["meta"], doc.get("disk", {}), doc.get("fs", {})
    lines = [harness.header("Checkpoint save and load speed vs the disk", meta)]
    classes = doc.get("classes")
    lines.append(f"Head: {classes:,} x {meta['options'].get('dim')} float32 + bias on one "
                 f"{meta.get('gpu_name') or 'device'}, AdamW state (one step); checkpoint = weights + 2 moments. "
                 f"Directory {meta['options'].get('dir')} on {fs.get('device')} ({fs.get('type')}, "
                 f"{(fs.get('total_bytes') or 0) / 1e9:.1f} GB, {(fs.get('free_bytes') or 0) / 1e9:.1f} GB free at start).\n"
                 if classes else "")
    if disk:
        lines.append(f"Disk ({disk['bytes'] / 1e9:.1f} GB, 64 MiB blocks, one thread): write + fsync "
                     f"**{disk['write_gbps']:.2f} GB/s**, cold read **{disk['read_gbps']:.2f} GB/s**"
                     f"{'' if disk.get('drop_caches') else ' (pages dropped per file; /proc/sys/vm/drop_caches refused)'}. "
                     f"dd O_DIRECT: write `{disk.get('dd_write', '-')}`, read `{disk.get('dd_read', '-')}`.\n")
    lines.append(harness.md_table(
        ["io threads", "files", "GB", "save s", "save GB/s", "save / disk write", "load s", "load GB/s",
         "load / disk read", "exact"],
        [[r["io_threads"], r["files"], harness.fmt(r["bytes"] / 1e9, ".2f"), harness.fmt(r["save_s"], ".1f"),
          harness.fmt(r["save_gbps"], ".2f"), harness.fmt(r["save_vs_disk"], ".2f"), harness.fmt(r["load_s"], ".1f"),
          harness.fmt(r["load_gbps"], ".2f"), harness.fmt(r["load_vs_disk"], ".2f"), "yes" if r["exact"] else "**NO**"]
         for r in doc.get("rows", [])]))
    lines.append("\nTarget (issue 25): save and load at >= 0.8 of the disk's write and read speed. A load is cold "
                 "(the checkpoint's pages dropped first) and checked against float64 checksums of every tensor.\n")
    if doc.get("error"):
        lines.append(f"\n**Stopped by an error**: `{doc['error']}`\n")
    lines.append(harness.footer(meta))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=6_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--io-threads", type=lambda s: [int(v) for v in s.split(",")], default=[8],
                        help="comma-separated writer/reader thread counts, one save + load each (default 8)")
    parser.add_argument("--disk-gib", type=float, default=4.0, help="size of the disk probe file")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hh_ckpt"),
                        help="work directory on the disk to measure (created, emptied and removed)")
    parser.add_argument("--no-fit-disk", dest="fit_disk", action="store_false",
                        help="keep --classes even when one checkpoint does not fit --dir's free space")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny head on the CPU: the pipeline, no results")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.classes, args.dim, args.batch, args.disk_gib = 20_000, 64, 64, 0.02
        args.io_threads = args.io_threads if args.io_threads != [8] else [1, 4]
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --cpu-smoke)")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    meta = harness.run_meta("checkpoint", device, options=args, smoke=args.cpu_smoke,
                            shapes={"head": dict(classes=args.classes, dim=args.dim, dtype="float32")},
                            method="one save and one cold load per io_threads, host clock with the GPU synchronized")
    out = args.out or harness.REPO_ROOT / "bench" / "results" / harness.gpu_slug(meta.get("gpu_name") or "cpu")
    work = args.dir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    doc: Dict[str, object] = {"meta": meta}
    t0 = time.perf_counter()
    status = 0
    try:
        run(args, work, doc)
    except Exception as exc:  # noqa: BLE001  (recorded: a partial run still writes what it measured)
        doc["error"] = harness.error_text(exc)
        status = 1
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        meta["elapsed_s"] = time.perf_counter() - t0
        harness.write_report(out, "checkpoint", doc, render_markdown)
        print(f"wrote {out / 'checkpoint.json'} and {out / 'checkpoint.md'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
