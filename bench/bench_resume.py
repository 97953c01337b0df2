"""Checkpoint and resume at the head's scale: a 6,000,000 x 768 bf16 ChunkedClassifier with
fused Adam over cuda:0 and cuda:1 — save and load times against the disk's own bandwidth, host memory.

    python -m bench.bench_resume --out bench/results/h200x2 --dir /tmp/hh_resume    # 2+ GPUs
    python -m bench.bench_resume --cpu-smoke --out /tmp/r --dir /tmp/r/tmp          # same pipeline, tiny, CPU

Measured, all on the file system of --dir (emptied and removed at the end):
1. disk: a --disk-gib GiB file written in 64 MiB blocks then fsynced, and read back cold (its pages dropped
   from the page cache with posix_fadvise(DONTNEED) first; no root needed); ``dd`` with O_DIRECT too, for
   reference.
2. ``head.save_safetensors`` (weights; streamed from each GPU in 64 MiB blocks) and ``load_safetensors``.
3. ``hugehead.checkpoint.save_checkpoint`` (torch.distributed.checkpoint; weights + Adam state, never
   gathered) and ``load_checkpoint`` into the same placement (weights and Adam state straight onto each
   shard's GPU), for each --io-threads; then the weights alone into another placement (one GPU).
4. baselines: ``torch.save({"model": head.state_dict(), "optimizer": opt.state_dict()})`` (the logical
   weight gathered on the host, as Lightning's ``.ckpt`` has it), and Lightning's own ``_atomic_save``
   (which also serializes the whole checkpoint into host memory first) when Lightning is installed.

Every load is cold (the checkpoint's pages dropped first) and checked bitwise against a copy of the
state taken before saving. Host peak: VmHWM reset through /proc/self/clear_refs before each operation,
reported as the peak minus the resident size at its start. The target: host peak during a
save <= one shard + 1 GiB. Writes resume.json and resume.md to --out (default
bench/results/<gpu>x<count>/).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bench import harness  # first: decides which hugehead is imported

import torch

GIB = 2**30


# --------------------------------------------------------------------------------------------------
# Host memory, page cache, disk
# --------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> Optional[int]:
    try:
        match = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) if match else None


class HostPeak:
    """Peak resident memory of this process while the block runs, minus the resident size at its start:
    VmHWM after resetting it (/proc/self/clear_refs), or else the max of 2 ms RSS samples."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.start_kib = _status_kib("VmRSS") or 0
        self.samples = [self.start_kib]
        self.stop = threading.Event()
        if not self.hwm:
            def sample():
                while not self.stop.wait(0.002):
                    self.samples.append(_status_kib("VmRSS") or 0)
            self.thread = threading.Thread(target=sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.hwm:
            self.peak_kib = _status_kib("VmHWM") or 0
        else:
            self.thread.join()
            self.peak_kib = max(self.samples)
        self.delta_gib = max(0, self.peak_kib - self.start_kib) / 2**20
        return False


def drop_page_cache(path: Path) -> None:
    """Evict ``path``'s (a file's or a tree's) clean pages from the page cache, so the next read hits the disk."""
    paths = [path] if path.is_file() else [Path(r) / n for r, _, files in os.walk(path) for n in files]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum((Path(r) / n).stat().st_size for r, _, files in os.walk(path) for n in files)


def disk_bandwidth(directory: Path, gib: float) -> Dict[str, object]:
    """Write ``gib`` GiB (64 MiB blocks of random bytes, then fsync) and read it back cold; ``dd`` too."""
    block_bytes = min(64 * 2**20, max(2**20, int(gib * GIB)))
    block = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8).numpy().tobytes()
    count = max(1, int(gib * GIB) // len(block))
    path = directory / "disk_probe.bin"

    def write():
        with open(path, "wb", buffering=0) as f:
            for _ in range(count):
                f.write(block)
            os.fsync(f.fileno())

    buf = bytearray(len(block))

    def read():
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    write_s = harness.time_call_ms(write, clock="host")[0] / 1e3
    nbytes = count * len(block)
    drop_page_cache(path)
    read_s = harness.time_call_ms(read, clock="host")[0] / 1e3
    path.unlink()
    out: Dict[str, object] = dict(bytes=nbytes, write_s=write_s, write_gbps=nbytes / write_s / 1e9,
                                  read_s=read_s, read_gbps=nbytes / read_s / 1e9)
    if shutil.which("dd"):
        dd_path = directory / "dd_probe.bin"
        for name, cmd in (("dd_write", ["dd", "if=/dev/zero", f"of={dd_path}", f"bs={block_bytes}", f"count={count}",
                                        "oflag=direct", "conv=fsync"]),
                          ("dd_read", ["dd", f"if={dd_path}", "of=/dev/null", f"bs={block_bytes}", "iflag=direct"])):
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                out[name] = (result.stderr.strip().splitlines() or [""])[-1]
            except (OSError, subprocess.SubprocessError) as exc:
                out[name] = f"failed: {exc}"
        dd_path.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------------------------------
# The head, its optimizer, and checks
# --------------------------------------------------------------------------------------------------
def sync_all() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def build(classes: int, dim: int, devices: List[str], dtype: torch.dtype, batch: int):
    import hugehead

    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(dim, classes, devices=devices, dtype=dtype)
    fused = all(d.startswith("cuda") for d in devices)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-4, fused=fused)
    x = torch.randn(batch, dim, device=devices[0], dtype=dtype)
    target = torch.randint(0, classes, (batch,), device=devices[0])
    head(x, target).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync_all()
    return head, optimizer


def snapshot(head, optimizer) -> Dict[str, torch.Tensor]:
    """Copies (on each tensor's device) of every parameter and optimizer state tensor."""
    out = {f"param.{i}": p.detach().clone() for i, p in enumerate(head.parameters())}
    for i, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"state.{i}.{key}"] = value.clone()
    return out


def matches(head, optimizer, reference: Dict[str, torch.Tensor]) -> bool:
    now = snapshot(head, optimizer) if optimizer is not None else {
        f"param.{i}": p.detach() for i, p in enumerate(head.parameters())}
    keys = [k for k in reference if optimizer is not None or k.startswith("param.")]
    return all(k in now and now[k].device == reference[k].device and torch.equal(now[k], reference[k]) for k in keys)


def scramble(head, optimizer=None) -> None:
    """Overwrite what a load must restore (so a load that does nothing cannot pass)."""
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(0.25)
    if optimizer is not None:
        optimizer.state.clear()


def timed(fn: Callable[[], object]) -> Dict[str, float]:
    """One call (a save or a load is measured once, cold): host clock with every GPU synchronized around
    it, and the host memory peak beyond the resident size at its start."""
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    harness.synchronize(gpus)
    with HostPeak() as peak:
        ms, _ = harness.time_call_ms(fn, gpus, clock="host")
    return dict(seconds=ms / 1e3, host_peak_gib=peak.delta_gib)


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------
def run(args, work: Path, doc: Dict[str, object]) -> None:
    """Fill ``doc`` (written to resume.json after every measurement)."""
    import hugehead
    from hugehead import checkpoint as ck

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    devices = args.devices.split(",")
    build_ms, (head, optimizer) = harness.time_call_ms(lambda: build(args.classes, args.dim, devices, dtype, args.batch),
                                                       clock="host")
    build_s = build_ms / 1e3
    reference = snapshot(head, optimizer)
    weight_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    state_bytes = sum(v.numel() * v.element_size() for k, v in reference.items() if k.startswith("state."))
    shard_bytes = max(s.weight.numel() * s.weight.element_size() for s in head.shards)
    doc.update(
        config=dict(classes=args.classes, dim=args.dim, dtype=args.dtype, devices=devices, optimizer="Adam",
                    shards=[[s.start, s.stop] for s in head.shards], weight_bytes=weight_bytes,
                    optimizer_state_bytes=state_bytes, shard_weight_bytes=shard_bytes, build_and_step_s=build_s),
        disk=disk_bandwidth(work, args.disk_gib),
        runs=[],
    )
    disk = doc["disk"]
    print(f"disk: write {disk['write_gbps']:.2f} GB/s, cold read {disk['read_gbps']:.2f} GB/s "
          f"({disk['bytes'] / 1e9:.1f} GB); dd: {disk.get('dd_write')} | {disk.get('dd_read')}", flush=True)

    def record(name: str, op: str, path: Path, result: Dict[str, float], ok: Optional[bool], note: str = ""):
        nbytes = tree_bytes(path) if path.exists() else None
        row = dict(name=name, op=op, bytes=nbytes, ok=ok, note=note, **result)
        if nbytes:
            row["gbps"] = nbytes / result["seconds"] / 1e9
            row["vs_disk"] = row["gbps"] / (disk["write_gbps"] if op == "save" else disk["read_gbps"])
        doc["runs"].append(row)
        print(f"{name:>28} {op:>4}: {result['seconds']:7.2f} s  {(nbytes or 0) / 1e9:7.2f} GB  "
              f"{row.get('gbps', 0):6.2f} GB/s ({row.get('vs_disk', 0):.2f} of disk)  host peak "
              f"{result['host_peak_gib']:.2f} GiB  {'' if ok is None else ('ok' if ok else 'MISMATCH')} {note}",
              flush=True)
        harness.write_json(args.out / "resume.json", doc)

    # safetensors: weights only
    path = work / "head.safetensors"
    record("safetensors", "save", path, timed(lambda: head.save_safetensors(str(path))), None)
    drop_page_cache(path)
    scramble(head)
    result = timed(lambda: head.load_safetensors(str(path)))
    record("safetensors", "load", path, result, matches(head, None, reference))
    path.unlink()

    # torch.distributed.checkpoint: weights + Adam, never gathered
    for threads in [int(t) for t in args.io_threads.split(",")]:
        path = work / f"dcp_t{threads}"
        result = timed(lambda: ck.save_checkpoint(path, head, optimizer, io_threads=threads))
        record(f"dcp (io_threads={threads})", "save", path, result, None)
        drop_page_cache(path)
        scramble(head, optimizer)
        result = timed(lambda: ck.load_checkpoint(path, head, optimizer))
        record(f"dcp (io_threads={threads})", "load", path, result, matches(head, optimizer, reference),
               "weights + Adam onto each shard's device")
        if threads == int(args.io_threads.split(",")[-1]):
            # The weights alone into another placement: one shard on the first device.
            other = hugehead.ChunkedClassifier(args.dim, args.classes, devices=devices[:1], dtype=dtype)
            drop_page_cache(path)
            result = timed(lambda: ck.load_checkpoint(path, other))
            index = {id(p): i for i, p in enumerate(head.parameters())}
            ok = all(torch.equal(other.shards[0].weight[s.start:s.stop],
                                 reference[f"param.{index[id(s.weight)]}"].to(other.shards[0].device))
                     for s in head.shards)
            record("dcp -> one device", "load", path, result, bool(ok), f"weights into {devices[:1]}")
            del other
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        shutil.rmtree(path)

    # Baselines: the gathered logical state dict
    path = work / "baseline.pt"
    state = lambda: {"model": head.state_dict(), "optimizer": optimizer.state_dict()}  # noqa: E731
    record("torch.save(state_dict)", "save", path, timed(lambda: torch.save(state(), path)), None,
           "logical weight gathered on the host")
    drop_page_cache(path)
    scramble(head, optimizer)

    def load_baseline():
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        head.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])

    record("torch.save(state_dict)", "load", path, timed(load_baseline), matches(head, optimizer, reference),
           "mmap, then load_state_dict")
    path.unlink()
    _atomic_save = None
    if not args.skip_lightning_baseline:
        try:
            from lightning.fabric.utilities.cloud_io import _atomic_save
        except ImportError:
            pass
    if _atomic_save is not None:
        path = work / "lightning.ckpt"
        record("lightning _atomic_save", "save", path, timed(lambda: _atomic_save(state(), path)), None,
               "Lightning's default .ckpt write (whole checkpoint in a BytesIO)")
        path.unlink()

    saves = [r for r in doc["runs"] if r["op"] == "save" and r["name"].startswith(("safetensors", "dcp"))]
    limit_gib = shard_bytes / GIB + 1.0
    worst = max(r["host_peak_gib"] for r in saves)
    doc["target_host_peak"] = dict(limit_gib=limit_gib, worst_hugehead_save_gib=worst, met=worst <= limit_gib)
    doc["all_loads_match"] = all(r["ok"] for r in doc["runs"] if r["op"] == "load")


def render_markdown(doc: Dict[str, object]) -> str:
    cfg, disk, meta = doc["config"], doc["disk"], doc["meta"]
    rows = [[r["name"], r["op"], f"{r['seconds']:.2f}", f"{(r['bytes'] or 0) / 1e9:.2f}", f"{r.get('gbps', 0):.2f}",
             f"{r.get('vs_disk', 0):.2f}", f"{r['host_peak_gib']:.2f}",
             "" if r["ok"] is None else ("bitwise" if r["ok"] else "MISMATCH"), r["note"]] for r in doc["runs"]]
    lines = [
        harness.header("Checkpoint save / load at the head's scale", meta),
        f"{cfg['classes']:,} x {cfg['dim']} {cfg['dtype']} head over {', '.join(cfg['devices'])} with Adam: weights "
        f"{cfg['weight_bytes'] / 1e9:.2f} GB, Adam state {cfg['optimizer_state_bytes'] / 1e9:.2f} GB.",
        "",
        f"Disk (same file system): write {disk['write_gbps']:.2f} GB/s (64 MiB blocks + fsync), cold read "
        f"{disk['read_gbps']:.2f} GB/s; dd: `{disk.get('dd_write', '-')}` / `{disk.get('dd_read', '-')}`.",
        "",
        harness.md_table(["format", "op", "seconds", "GB", "GB/s", "of disk", "host peak GiB", "check", "note"], rows,
                         "llrrrrrll"),
    ]
    t = doc.get("target_host_peak")
    if t:
        lines += [f"Target: host peak during a hugehead save <= one shard + 1 GiB = {t['limit_gib']:.2f} GiB; "
                  f"worst {t['worst_hugehead_save_gib']:.2f} GiB: {'met' if t['met'] else 'NOT met'}."]
    return "\n".join(lines) + "\n" + harness.footer(meta)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=6_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument("--devices", default=None, help="head placement (default: cuda:0,cuda:1)")
    p.add_argument("--batch", type=int, default=4096, help="rows of the one training step that creates the Adam state")
    p.add_argument("--disk-gib", type=float, default=16.0, help="size of the disk probe file (--cpu-smoke: 1/64)")
    p.add_argument("--io-threads", default="1", help="comma list of DCP writer thread counts to measure")
    p.add_argument("--skip-lightning-baseline", action="store_true")
    p.add_argument("--dir", type=Path, help="scratch directory on the disk to measure (default: <out>/resume_tmp)")
    p.add_argument("--out", type=Path)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on two CPU shards (checks the pipeline)")
    harness.add_record_flag(p)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.classes, args.dim, args.dtype, args.batch = 20_000, 64, "fp32", 64
        args.disk_gib = min(args.disk_gib, 1 / 64)
        args.devices = args.devices or "cpu,cpu"
        device = torch.device("cpu")
    else:
        if torch.cuda.device_count() < 2 and args.devices is None:
            print("bench_resume needs two GPUs (or --devices, or --cpu-smoke)", file=sys.stderr)
            return 2
        args.devices = args.devices or "cuda:0,cuda:1"
        device = torch.device(args.devices.split(",")[0])
    meta = harness.run_meta(
        "resume", device, options=args, smoke=args.cpu_smoke,
        shapes={"head": dict(v=args.classes, d=args.dim, n=args.batch, dtype=args.dtype)},
        command="python -m bench.bench_resume " + " ".join(argv if argv is not None else sys.argv[1:]))
    args.out = args.out or (harness.REPO_ROOT / "bench" / "results"
                            / f"{harness.gpu_slug(meta['gpu_name'])}x{max(1, meta['gpu_count'])}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.dir or args.out / "resume_tmp"
    work.mkdir(parents=True, exist_ok=True)
    try:
        doc = dict(meta=meta)
        run(args, work, doc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    harness.write_report(args.out, "resume", doc, render_markdown, record=args.record)
    print(render_markdown(doc))
    return 0 if doc["all_loads_match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
