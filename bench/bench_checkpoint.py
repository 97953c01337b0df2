"""Checkpoint save and load speed against the disk's own: a ChunkedClassifier of --classes x --dim float32
master weights with AdamW state (made by one optimizer step) on one device, written with
``hugehead.checkpoint.save_checkpoint`` (torch.distributed.checkpoint, --io-threads writer threads, one
file each, CRC-32 digests of every file) and read back with ``load_checkpoint`` (sizes and digests of
every file checked first, then the files read in parallel straight into the head).

    python -m bench.bench_checkpoint --out bench/results/h200 --dir /tmp/hh_ckpt     # one GPU, 2M x 768
    python -m bench.bench_checkpoint --device cpu --classes 200000 --dir /tmp/hh_ckpt  # the CPU, a smaller head
    python -m bench.bench_checkpoint --cpu-smoke --out /tmp/r --dir /tmp/r/work        # same pipeline, tiny

Measured on the file system of --dir (emptied and removed at the end):
1. the disk: a --disk-gib GiB file written in 64 MiB blocks and fsynced, then read back cold; ``dd`` with
   O_DIRECT beside it, for reference (``disk``).
2. for each --io-threads: ``save_checkpoint`` (one save, host clock, GPU synchronized); ``load_checkpoint``
   warm (the pages just written) and cold (pages dropped: posix_fadvise per file, /proc/sys/vm/drop_caches
   where allowed), each into a scrambled head and optimizer and checked against float64 checksums of
   every tensor taken before the save; then a plain dd-style write of the same files' sizes (one thread,
   --block-bytes blocks through the page cache, fsync at each file's end) and its read warm and cold.
Targets: save >= 0.8 of the plain write; load >= 0.8 of the plain read warm, >= 0.45 cold.

When --dir's file system cannot hold a checkpoint beside its plain copy, --classes is scaled down to what
fits (recorded in the results) unless --no-fit-disk. Writes checkpoint.json and checkpoint.md to --out
(default bench/results/<gpu or cpu>/).
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


def build_without_grads(classes: int, dim: int, device: torch.device):
    """The head and the AdamW state one step leaves (step 1, both moments; random values), made without a
    backward: the weight's gradient would take another weight's memory, which the largest head that fits
    the host's memory does not have."""
    import hugehead

    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(dim, classes, devices=[device], dtype=torch.float32)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4, fused=device.type == "cuda")
    for p in head.parameters():
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p) * 1e-3,
                              "exp_avg_sq": torch.rand_like(p) * 1e-6}
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


def plain_write_s(sizes: List[int], directory: Path, block_bytes: int) -> float:
    """dd-style write: each file of ``sizes`` bytes written sequentially in ``block_bytes`` blocks through the
    page cache, fsynced at its end (as a checkpoint's files are); one thread, as dd."""
    block = memoryview(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8).numpy().tobytes())
    directory.mkdir()
    t0 = time.perf_counter()
    for i, size in enumerate(sizes):
        with open(directory / f"plain{i}", "wb", buffering=0) as f:
            for start in range(0, size, block_bytes):
                f.write(block[:min(block_bytes, size - start)])
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def plain_read_s(directory: Path, block_bytes: int) -> float:
    """dd-style read of every file of ``directory``: sequential, ``block_bytes`` at a time, one thread."""
    buf = bytearray(block_bytes)
    t0 = time.perf_counter()
    for name in sorted(os.listdir(directory)):
        with open(directory / name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def drop(path: Path) -> bool:
    """Drop ``path``'s pages (posix_fadvise per file) and, where allowed, every clean page: True if all were."""
    drop_page_cache(path)
    return drop_all_caches()


def run(args, work: Path, doc: Dict[str, object]) -> None:
    from hugehead import checkpoint as ck

    device = torch.device(args.device)
    rows: List[Dict[str, object]] = []
    doc["rows"] = rows
    doc["fs"] = file_system_of(work)
    doc["crc32"] = ck.verify.crc32.__module__  # ISA-L's or zlib's (same digest, other speed)

    disk = disk_bandwidth(work, args.disk_gib)  # deletes its probe files
    disk["drop_caches"] = drop_all_caches()
    doc["disk"] = disk
    print(f"disk: write {disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s", flush=True)

    classes = args.classes
    free = shutil.disk_usage(work).free
    # One checkpoint and its plain copy on disk at a time.
    want = 2 * ck.space.estimate(checkpoint_bytes(classes, args.dim), 64) + (256 << 20)
    if want > free and args.fit_disk:
        scale = (free - ck.space.FIXED_OVERHEAD_BYTES - (1 << 30)) / want
        classes = max(1000, int(classes * scale) // 1000 * 1000)
        print(f"{work} has {free / 1e9:.1f} GB free: --classes {args.classes} -> {classes} to fit a checkpoint "
              "and its plain copy", flush=True)
    doc["classes"] = classes
    head, optimizer = (build_without_grads(classes, args.dim, device) if args.no_backward
                       else build(classes, args.dim, device, args.batch))
    reference = checksums(head, optimizer)
    for threads in args.io_threads:
        path = work / f"ckpt_t{threads}"
        save_s = timed_s(lambda: ck.save_checkpoint(path, head, optimizer, io_threads=threads), device)
        nbytes = tree_bytes(path)
        sizes = [(path / name).stat().st_size for name in sorted(os.listdir(path))]
        files = sum(1 for name in os.listdir(path) if name.endswith(".distcp"))
        scramble(head, optimizer)  # the checkpoint's pages are in the page cache: just written
        warm_s = timed_s(lambda: ck.load_checkpoint(path, head, optimizer, io_threads=threads), device)
        exact_warm = checksums(head, optimizer) == reference
        dropped = drop(path)
        scramble(head, optimizer)
        load_s = timed_s(lambda: ck.load_checkpoint(path, head, optimizer, io_threads=threads), device)
        exact = exact_warm and checksums(head, optimizer) == reference
        shutil.rmtree(path)
        plain = work / "plain"
        write_s = plain_write_s(sizes, plain, args.block_bytes)
        read_warm_s = plain_read_s(plain, args.block_bytes)
        drop(plain)
        read_cold_s = plain_read_s(plain, args.block_bytes)
        shutil.rmtree(plain)
        gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
        row = dict(io_threads=threads, files=files, bytes=nbytes, digests=True, save_s=save_s, save_gbps=gbps(save_s),
                   load_s=load_s, load_gbps=gbps(load_s), exact=exact, caches_dropped=dropped,
                   save_vs_disk=gbps(save_s) / disk["write_gbps"], load_vs_disk=gbps(load_s) / disk["read_gbps"],
                   load_warm_s=warm_s, load_warm_gbps=gbps(warm_s),
                   plain_block_bytes=args.block_bytes, plain_write_gbps=gbps(write_s),
                   plain_read_warm_gbps=gbps(read_warm_s), plain_read_cold_gbps=gbps(read_cold_s),
                   save_vs_plain=write_s / save_s, load_warm_vs_plain=read_warm_s / warm_s,
                   load_cold_vs_plain=read_cold_s / load_s)
        rows.append(row)
        print(f"io_threads={threads}: {nbytes / 1e9:.2f} GB, save {row['save_gbps']:.2f} GB/s ({row['save_vs_plain']:.2f} "
              f"of a plain write), load warm {row['load_warm_gbps']:.2f} GB/s ({row['load_warm_vs_plain']:.2f} of a "
              f"plain read), cold {row['load_gbps']:.2f} GB/s ({row['load_cold_vs_plain']:.2f}; caches dropped: "
              f"{dropped}), exact={exact}", flush=True)


def render_markdown(doc: Dict[str, object]) -> str:
    meta, disk, fs = doc["meta"], doc.get("disk", {}), doc.get("fs", {})
    lines = [harness.header("Checkpoint save and load speed vs the disk", meta)]
    classes = doc.get("classes")
    lines.append(f"Head: {classes:,} x {meta['options'].get('dim')} float32 + bias on one "
                 f"{meta.get('gpu_name') or 'device'}, AdamW state "
                 f"({'made without a backward' if meta['options'].get('no_backward') else 'one step'}); "
                 "checkpoint = weights + 2 moments. "
                 f"Directory {meta['options'].get('dir')} on {fs.get('device')} ({fs.get('type')}, "
                 f"{(fs.get('total_bytes') or 0) / 1e9:.1f} GB, {(fs.get('free_bytes') or 0) / 1e9:.1f} GB free at start).\n"
                 if classes else "")
    if disk:
        lines.append(f"Disk ({disk['bytes'] / 1e9:.1f} GB, 64 MiB blocks, one thread): write + fsync "
                     f"**{disk['write_gbps']:.2f} GB/s**, cold read **{disk['read_gbps']:.2f} GB/s**"
                     f"{'' if disk.get('drop_caches') else ' (pages dropped per file; /proc/sys/vm/drop_caches refused)'}. "
                     f"dd O_DIRECT: write `{disk.get('dd_write', '-')}`, read `{disk.get('dd_read', '-')}`.\n")
    lines.append(harness.md_table(
        ["io threads", "files", "GB", "save GB/s", "plain write GB/s", "save / plain", "load warm GB/s",
         "plain read warm GB/s", "load warm / plain", "load cold GB/s", "plain read cold GB/s", "load cold / plain",
         "exact"],
        [[r["io_threads"], r["files"], harness.fmt(r["bytes"] / 1e9, ".2f"), harness.fmt(r["save_gbps"], ".2f"),
          harness.fmt(r["plain_write_gbps"], ".2f"), harness.fmt(r["save_vs_plain"], ".2f"),
          harness.fmt(r["load_warm_gbps"], ".2f"), harness.fmt(r["plain_read_warm_gbps"], ".2f"),
          harness.fmt(r["load_warm_vs_plain"], ".2f"), harness.fmt(r["load_gbps"], ".2f"),
          harness.fmt(r["plain_read_cold_gbps"], ".2f"), harness.fmt(r["load_cold_vs_plain"], ".2f"),
          "yes" if r["exact"] else "**NO**"]
         for r in doc.get("rows", [])]))
    dropped = all(r.get("caches_dropped") for r in doc.get("rows", []))
    lines.append(f"\nSave and load with CRC-32 digests on (computed by `{doc.get('crc32', 'zlib')}`; a load checks every file's size and digest before it "
                 "writes the model, then loads: two reads). Beside them, in the same run on the same disk, a plain "
                 "dd-style write and read of the same bytes (same files' sizes, one thread, the block size above, "
                 "through the page cache, fsync at the end of each file). Warm: the files in the page cache (just "
                 "written); cold: their pages dropped first"
                 f"{'' if dropped else ' (per file with posix_fadvise only: /proc/sys/vm/drop_caches refused, so cold may be partly warm)'}. "
                 "Targets: save >= 0.8 of the plain write; load >= 0.8 of the plain read warm, >= 0.45 cold. "
                 "Each load is checked against float64 checksums of every tensor.\n")
    if doc.get("error"):
        lines.append(f"\n**Stopped by an error**: `{doc['error']}`\n")
    lines.append(harness.footer(meta))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=2_000_000,
                        help="head rows (default 2M: a checkpoint and its plain copy fit a 64 GiB disk)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--no-backward", action="store_true",
                        help="make the AdamW state without a backward (no gradient: a head of 2/3 of the memory)")
    parser.add_argument("--io-threads", type=lambda s: [int(v) for v in s.split(",")], default=[8],
                        help="comma-separated writer/reader thread counts, one save + load each (default 8)")
    parser.add_argument("--disk-gib", type=float, default=4.0, help="size of the disk probe file")
    parser.add_argument("--block-bytes", type=int, default=8 << 20, help="block size of the plain read and write")
    parser.add_argument("--device", default=None, help="where the head lives (default: cuda when there is one)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hh_ckpt"),
                        help="work directory on the disk to measure (created, emptied and removed)")
    parser.add_argument("--no-fit-disk", dest="fit_disk", action="store_false",
                        help="keep --classes even when one checkpoint does not fit --dir's free space")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny head on the CPU: the pipeline, no results")
    harness.add_record_flag(parser)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.classes, args.dim, args.batch, args.disk_gib, args.device = 20_000, 64, 64, 0.02, "cpu"
        args.io_threads = args.io_threads if args.io_threads != [8] else [1, 4]
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(args.device)
    meta = harness.run_meta("checkpoint", device, options=args, smoke=args.cpu_smoke,
                            shapes={"head": dict(classes=args.classes, dim=args.dim, dtype="float32")},
                            method="per io_threads: one save, one warm and one cold load, a plain write and warm and "
                                   "cold read of the same bytes; host clock with the GPU synchronized")
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
        # (the history gets a finished run only)
        harness.write_report(out, "checkpoint", doc, render_markdown, record=False if "error" in doc else args.record)
        print(f"wrote {out / 'checkpoint.json'} and {out / 'checkpoint.md'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
