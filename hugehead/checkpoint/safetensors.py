"""The streamed safetensors writer: the header, then each tensor's bytes a block at a time from where
the tensor lives (a GPU tensor staged through two pinned host buffers), written atomically."""
from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import space
from .atomic import PathLike, atomic_path
from .verify import crc32

# Bytes of a tensor handled at a time: the host staging of a streamed safetensors write.
BLOCK_BYTES = 1 << 26
# The metadata entry holding the CRC-32 (8 hex digits) of the whole file, computed with this entry's value
# read as the placeholder.
DIGEST_KEY = "hugehead.crc32"
_PLACEHOLDER = "00000000"

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def _write_tensor_bytes(f, tensor: Tensor, block_bytes: int, staged: Optional[bool] = None) -> None:
    """Write ``tensor``'s bytes (row-major) a block of rows at a time. A CPU tensor is written from its
    own memory (a non-contiguous block is copied first); a GPU tensor is staged through two pinned host
    buffers, the copy of block b+1 (queued on the current stream of the tensor's device, after whatever
    wrote the tensor) overlapping the file write of block b. ``staged`` forces staging (tests)."""
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.numel() == 0:
        return
    rows = tensor.shape[0]
    row_bytes = tensor[:1].numel() * tensor.element_size()
    step = max(1, block_bytes // row_bytes)
    cuda = tensor.device.type == "cuda"

    def as_bytes(block: Tensor) -> memoryview:
        return memoryview(block.reshape(-1).view(torch.uint8).numpy())

    if not (cuda if staged is None else staged):
        for r in range(0, rows, step):
            f.write(as_bytes(tensor[r:r + step].contiguous()))
        return
    buffers = [torch.empty((min(step, rows), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=cuda)
               for _ in range(2)]
    pending: List[Tuple[Tensor, Any]] = []  # (block, event) copies queued, not yet written

    def write_oldest() -> None:
        block, event = pending.pop(0)
        if event is not None:
            event.synchronize()
        f.write(as_bytes(block))

    with torch.cuda.device(tensor.device) if cuda else contextlib.nullcontext():
        for i, r in enumerate(range(0, rows, step)):
            block = buffers[i % 2][:min(step, rows - r)]  # the other buffer's block was queued just before
            block.copy_(tensor[r:r + step], non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            pending.append((block, event))
            if len(pending) == 2:  # write the previous block while this one copies
                write_oldest()
        while pending:
            write_oldest()


class _Crc32Writer:
    """Writes through to ``f``, keeping the CRC-32 of every byte written."""

    def __init__(self, f, crc: int = 0):
        self.f, self.crc = f, crc

    def write(self, data) -> int:
        self.crc = crc32(data, self.crc)
        return self.f.write(data)

    def __getattr__(self, name: str):  # flush, fileno, ...: the file's own
        return getattr(self.f, name)


def write_safetensors(path: PathLike, tensors: Sequence[Tuple[str, Tensor]], metadata: Optional[Mapping[str, str]] = None,
                      *, block_bytes: int = BLOCK_BYTES, keep_previous: bool = True) -> None:
    """Write a safetensors file (readable by ``safetensors.safe_open`` / ``load_file``) without holding
    the tensors in host memory: the header first, then each tensor's bytes in blocks of at most
    ``block_bytes`` — host memory stays within two blocks whatever the size. The metadata also records
    the CRC-32 of the file (``hugehead.crc32``, computed as it is written), which
    :func:`check_safetensors` verifies. Written atomically
    (:func:`atomic_path`), after checking that the file system has room for the whole file beside the
    previous one.

    Args:
        tensors: ``(name, tensor)`` in file order, on any devices; any strides.
        metadata: string to string, stored as the file's ``__metadata__``.
        keep_previous: False: a previous file at ``path`` is removed *before* the new one is written, so
            the disk needs room for one file, not two. **Risk**: until the new file is complete there is
            none on disk; a crash or a failed write in that window loses it.
    Raises:
        TypeError: a dtype safetensors has no code for, or non-string metadata.
        CheckpointSpaceError (an ``OSError``, errno ENOSPC): not enough free space, found before writing
            (naming the directory, the bytes needed and free), or a write that ran out of space; the
            previous file is then unchanged (unless ``keep_previous=False`` removed it) and no temporary
            remains.
    """
    header: Dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"hugehead: safetensors cannot store {name!r} of dtype {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("hugehead: safetensors metadata must map strings to strings")
    # The data's digest, a fixed-width placeholder patched in once the data is written (no second pass).
    header["__metadata__"] = {**(metadata or {}), DIGEST_KEY: _PLACEHOLDER}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    digest_at = 8 + raw.index(json.dumps(_PLACEHOLDER).encode()) + 1
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    path = os.path.abspath(os.fspath(path))
    what = f"safetensors file {os.path.basename(path)}"
    needed = file_bytes(8 + len(raw) + offset)
    space.check_room(path, needed, what, removable=[] if keep_previous else [path])
    if not keep_previous and os.path.lexists(path):
        os.unlink(path)
    # Mapped once the temporary is gone (atomic_path removes it first): the free space reported is then
    # what this write had.
    with space.out_of_space_as_error(path, needed, what), atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            digesting = _Crc32Writer(f, crc32(struct.pack("<Q", len(raw)) + raw))
            for _, tensor in tensors:
                _write_tensor_bytes(digesting, tensor, block_bytes)
            f.seek(digest_at)
            f.write(f"{digesting.crc:08x}".encode())
            f.flush()
            os.fsync(f.fileno())


def file_bytes(nbytes: int) -> int:
    """What a file of ``nbytes`` takes on disk, rounded up to the file system's blocks (generously)."""
    return int(nbytes) + space.ITEM_OVERHEAD_BYTES


def check_safetensors(f, path: str, verify: bool = True) -> dict:
    """The header of the safetensors file open as ``f`` (binary, positioned anywhere), after checking the
    file is one: a sane header, data extents that end exactly at the file's end, and (``verify``, when
    the file records it) the CRC-32 of the whole file.

    Raises:
        CheckpointCorruptError: naming ``path`` and what is wrong.
    """
    from .verify import CheckpointCorruptError, _crc32_of

    fd = f.fileno()
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if n < 2 or 8 + n > size or n > 100 << 20:
        raise CheckpointCorruptError(path, f"is not a safetensors file ({size} bytes; header length "
                                     f"{n if n >= 0 else 'missing'})")
    try:
        header = json.loads(os.pread(fd, n, 8))
        end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"], default=0)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointCorruptError(path, f"has an unreadable safetensors header ({type(exc).__name__}: {exc})") from None
    if size != 8 + n + end:
        raise CheckpointCorruptError(path, f"is {size} bytes, its header says {8 + n + end} "
                                     f"({'truncated' if size < 8 + n + end else 'grown'})")
    stored = (header.get("__metadata__") or {}).get(DIGEST_KEY)
    if verify and stored is not None:
        raw = os.pread(fd, n, 8)
        entry = json.dumps(DIGEST_KEY).encode() + b":" + json.dumps(stored).encode()
        raw = raw.replace(entry, json.dumps(DIGEST_KEY).encode() + b":" + json.dumps(_PLACEHOLDER).encode(), 1)
        crc = _crc32_of(fd, end, 8 + n, crc32(head + raw))[0]
        if f"{crc:08x}" != stored:
            raise CheckpointCorruptError(path, f"fails its crc32 digest (stored {stored}, read {crc:08x}): its bytes "
                                         "changed since it was written")
    return header
