"""What a load may trust: the files of one checkpoint version, opened once through one handle on its
directory (a save that swaps in a new version meanwhile is never mixed in); their sizes checked before
any byte reaches the model, their CRC-32 digests in a reading pass before the loading pass; DCP's
``.metadata`` unpickled through an allow-list of DCP's own metadata classes (no code runs from a
checkpoint unless the caller passes ``weights_only=False``)."""
from __future__ import annotations

import errno
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, Mapping

import torch

__all__ = ["crc32", "CheckpointCorruptError", "PinnedDir", "file_table", "check_files", "check_extents", "load_dcp_metadata"]

try:  # ISA-L's CRC-32 is zlib's (same polynomial, same values) several times faster: digests are I/O-bound
    from isal.isal_zlib import crc32
except ImportError:  # the standard library's, for an install without isal
    from zlib import crc32

DIGEST = "crc32"  # zlib's CRC-32 (Btrfs checksums alike)
_READ_BLOCK = 8 << 20
# The digesting pass reads a file through a buffer this small: it stays in the core's L2 cache between the copy
# from the page cache and the CRC over it, which then read no main memory (an 8 MiB buffer made the pass a
# quarter slower).
_DIGEST_BLOCK = 256 << 10


class CheckpointCorruptError(OSError):
    """A checkpoint file is missing, truncated, of another kind, or fails its digest. Raised before
    anything was written into the model or the optimizers. ``filename`` names the file."""

    def __init__(self, filename: str, problem: str):
        super().__init__(errno.EIO, f"hugehead: checkpoint file {filename} {problem}")
        self.filename = filename

    def __str__(self) -> str:  # the message names the file already
        return self.strerror


def _crc32_of(fd: int, size: int, start: int = 0, crc: int = 0) -> "tuple[int, int]":
    """``(crc32, bytes read)`` of ``size`` bytes of ``fd`` from ``start``, continuing ``crc`` (positional
    reads: no shared offset, so threads may digest one file)."""
    done = 0
    buf = memoryview(bytearray(min(_DIGEST_BLOCK, max(size, 1))))
    while done < size:
        want = buf[:min(len(buf), size - done)]
        n = os.preadv(fd, [want], start + done) if hasattr(os, "preadv") else len(_pread_into(fd, want, start + done))
        if n == 0:
            break
        crc = crc32(want[:n], crc)
        done += n
    return crc, done


def _pread_into(fd: int, view: memoryview, offset: int) -> bytes:
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return data


def _digest_all(jobs: Iterable, threads: int) -> list:
    jobs = list(jobs)
    if threads <= 1 or len(jobs) <= 1:
        return [_crc32_of(fd, size) for fd, size in jobs]
    # The CRC-32 and the reads release the GIL: files are digested in parallel.
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="hugehead-digest") as pool:
        return list(pool.map(lambda job: _crc32_of(*job), jobs))


def file_table(directory: str, skip: Iterable[str] = (), threads: int = 8,
               known: Mapping[str, Mapping[str, int]] = {}) -> Dict[str, Dict[str, int]]:
    """``{name: {"bytes": n, "crc32": c}}`` of every file of ``directory`` but ``skip``: from ``known`` (the
    digests the writer computed) where its size matches the file's, else read back (page cache)."""
    table: Dict[str, Dict[str, int]] = {}
    todo = []
    for name in sorted(n for n in os.listdir(directory) if n not in set(skip)):
        size = os.stat(os.path.join(directory, name)).st_size
        if name in known and known[name]["bytes"] == size:
            table[name] = {"bytes": size, DIGEST: known[name][DIGEST]}
        else:
            todo.append((name, size))
    fds = [os.open(os.path.join(directory, n), os.O_RDONLY) for n, _ in todo]
    try:
        digests = _digest_all(zip(fds, [size for _, size in todo]), threads)
    finally:
        for fd in fds:
            os.close(fd)
    table.update({n: {"bytes": size, DIGEST: d[0]} for (n, size), d in zip(todo, digests)})
    return dict(sorted(table.items()))


class PinnedDir:
    """One version of a checkpoint directory: the directory opened once, every file opened through that
    handle and held open. A save that swaps a new directory in (or removes this one) meanwhile changes
    nothing read here: open files stay readable after they are unlinked. :meth:`replaced` says whether
    the path names another directory now (a file that vanished before it was opened: read again)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            raise FileNotFoundError(f"hugehead: no checkpoint directory at {path}") from None
        except NotADirectoryError:
            raise NotADirectoryError(f"hugehead: {path} is a file, not a checkpoint directory") from None
        self._files: Dict[str, int] = {}

    def __enter__(self) -> "PinnedDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files = {}
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def replaced(self) -> bool:
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        mine = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino)

    def names(self) -> list:
        return os.listdir(self.fd)

    def open(self, name: str) -> int:
        """The held descriptor of ``name``; FileNotFoundError naming it when this version lacks it."""
        if name not in self._files:
            try:
                self._files[name] = os.open(name, os.O_RDONLY, dir_fd=self.fd)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"hugehead: checkpoint file {name} is missing from "
                                        f"{self.path}", os.path.join(self.path, name)) from None
        return self._files[name]

    def size(self, name: str) -> int:
        return os.fstat(self.open(name)).st_size

    def read(self, name: str) -> bytes:
        fd, out = self.open(name), io.BytesIO()
        while True:
            data = os.pread(fd, _READ_BLOCK, out.tell())
            if not data:
                return out.getvalue()
            out.write(data)

    def stream(self, name: str):
        """A file object of ``name`` with its own offset (one per reading thread)."""
        fd = self.open(name)
        if os.path.isdir("/proc/self/fd"):  # reopens the same inode, even once unlinked
            return open(f"/proc/self/fd/{fd}", "rb")
        f = os.fdopen(os.dup(fd), "rb")  # shares the offset: DCP reads each file from one thread
        f.seek(0)
        return f


def check_files(pinned: PinnedDir, table: Mapping[str, Mapping[str, int]], threads: int) -> None:
    """Every file of ``table`` present with its size (all checked before any is read), then its digest.

    Raises:
        CheckpointCorruptError: naming the first file missing, of another size, or of another digest.
    """
    sizes = {}
    for name, entry in table.items():
        try:
            sizes[name] = pinned.size(name)
        except FileNotFoundError:
            raise CheckpointCorruptError(os.path.join(pinned.path, name), "is missing") from None
        if sizes[name] != entry["bytes"]:
            raise CheckpointCorruptError(os.path.join(pinned.path, name), f"is {sizes[name]} bytes, expected "
                                         f"{entry['bytes']} ({'truncated' if sizes[name] < entry['bytes'] else 'grown'})")
    names = list(table)
    digests = _digest_all(((pinned.open(n), sizes[n]) for n in names), threads)
    for name, (crc, done) in zip(names, digests):
        if done != sizes[name] or crc != table[name][DIGEST]:
            raise CheckpointCorruptError(os.path.join(pinned.path, name), f"fails its {DIGEST} digest (stored "
                                         f"{table[name][DIGEST]:08x}, read {crc:08x}): its bytes changed since it was written")


def _allowed_globals() -> Dict[str, set]:
    import torch.distributed.checkpoint.metadata as md

    allowed = {
        md.__name__: {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                      "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
        "builtins": {"set", "frozenset", "slice", "complex"},
    }
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Plain containers and DCP's metadata classes only: any other global (a function a ``__reduce__``
    would call) is refused before it is looked up."""

    def __init__(self, file, filename: str):
        super().__init__(file)
        self.filename = filename
        self.allowed = _allowed_globals()

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self.allowed.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"hugehead: {self.filename} refers to {module}.{name}, which is not a DCP metadata class: refusing to "
            "unpickle it (it could run code). Pass weights_only=False only for a checkpoint you trust")


def load_dcp_metadata(data: bytes, filename: str, weights_only: bool = True):
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file (allow-listed unless ``weights_only=False``).

    Raises:
        pickle.UnpicklingError: a global outside the allow-list. CheckpointCorruptError: not a DCP metadata
            file (truncated or of another kind).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = pickle.loads(data) if not weights_only else _MetadataUnpickler(io.BytesIO(data), filename).load()
    except pickle.UnpicklingError as exc:
        if "refusing to unpickle" in str(exc):
            raise
        raise CheckpointCorruptError(filename, f"is not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise CheckpointCorruptError(filename, f"is not a DCP metadata file (truncated or of another kind: "
                                     f"{type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(filename, f"holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def check_extents(pinned: PinnedDir, metadata) -> None:
    """Every file the DCP ``metadata`` places data in is there and long enough (any checkpoint, digests or
    not). Raises CheckpointCorruptError naming the file."""
    ends: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        full = os.path.join(pinned.path, name)
        try:
            size = pinned.size(name)
        except FileNotFoundError:
            raise CheckpointCorruptError(full, "is missing (its .metadata lists it)") from None
        if size < end:
            raise CheckpointCorruptError(full, f"is {size} bytes, but its .metadata places data up to byte {end} "
                                         "(truncated)")
