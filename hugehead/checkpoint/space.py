"""Room on disk for a checkpoint: what a write will take, checked against the free space before any byte
is written, and a write that still runs out of space reported as the same clear error.

An atomic write (:mod:`.atomic`) writes the new checkpoint beside the previous one and swaps it in, so the
file system must hold both for a moment: the free space (which already excludes the previous checkpoint)
must hold the whole new one. With ``keep_previous=False`` the writers remove the previous checkpoint
first, so its bytes count as free.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Iterable, Iterator, Optional

from torch import Tensor

__all__ = ["CheckpointSpaceError", "free_bytes", "path_bytes", "check_room", "space_error_of", "format_bytes",
           "out_of_space_as_error"]

# What a checkpoint takes beyond its tensors' bytes: per stored item, torch.save's zip records and the
# file system's block rounding; per checkpoint, DCP's metadata, the small torch.save file, directories.
ITEM_OVERHEAD_BYTES = 8192
FIXED_OVERHEAD_BYTES = 1 << 20


def format_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB ({n:,} bytes)"


class CheckpointSpaceError(OSError):
    """The file system of a checkpoint has no room for it (``errno`` ENOSPC).

    Attributes:
        directory: where the checkpoint was to be written. needed: the bytes it needs there (the whole new
            checkpoint, written beside the previous one). free: the bytes free there when it was checked
            (plus those of the previous checkpoint when it is removed first). what: the checkpoint.
    """

    def __init__(self, directory: str, needed: int, free: int, what: str = "the checkpoint", detail: str = "",
                 previous_removed: bool = False):
        message = (f"hugehead: not enough disk space for {what} in {directory}: it needs {format_bytes(needed)}, "
                   f"{format_bytes(free)} free")
        if detail:
            message += f" ({detail})"
        message += ". Nothing was left behind and the previous checkpoint, if any, is unchanged. Free space there"
        message += " or write elsewhere" if previous_removed else (
            ", write elsewhere, or pass keep_previous=False to remove the previous checkpoint first (no checkpoint "
            "on disk while the new one is written)")
        super().__init__(errno.ENOSPC, message)
        self.filename = directory
        self.directory, self.needed, self.free, self.what, self.detail = directory, int(needed), int(free), what, detail
        self.previous_removed = previous_removed

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # crosses ranks (broadcast_object_list) with its numbers
        return (type(self), (self.directory, self.needed, self.free, self.what, self.detail, self.previous_removed))


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def free_bytes(path) -> int:
    """Bytes an unprivileged writer can still write on the file system of ``path`` (or of its nearest
    existing parent): ``shutil.disk_usage(...).free``."""
    return int(shutil.disk_usage(_existing_ancestor(os.fspath(path))).free)


def path_bytes(path) -> int:
    """Bytes the file or directory tree ``path`` occupies (0 when absent)."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return 0
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def estimate(data_bytes: int, items: int) -> int:
    """Bytes a checkpoint of ``items`` stored tensors holding ``data_bytes`` takes on disk, rounded up."""
    return int(data_bytes) + int(items) * ITEM_OVERHEAD_BYTES + FIXED_OVERHEAD_BYTES


def check_room(path, needed: int, what: str, *, removable: Iterable = ()) -> None:
    """Raise :class:`CheckpointSpaceError` unless ``needed`` bytes fit beside what is on disk now at
    ``path``'s file system; the bytes of the paths in ``removable`` (the previous checkpoint, removed
    before the write) count as free."""
    directory = os.path.dirname(os.path.abspath(os.fspath(path))) or "."
    free = free_bytes(directory)
    reclaimed = sum(path_bytes(p) for p in removable)
    if needed > free + reclaimed:
        detail = f"{format_bytes(reclaimed)} of it from the previous checkpoint, removed first" if reclaimed else ""
        raise CheckpointSpaceError(directory, needed, free + reclaimed, what, detail, previous_removed=bool(removable))


def _is_out_of_space(exc: BaseException) -> bool:
    if isinstance(exc, CheckpointSpaceError):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return True
    # torch.save inside DCP reports a short write of its zip writer this way, not as an OSError:
    # "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" or "... file write failed".
    # Another rank's failure arrives as a RuntimeError naming it ("rank 1: OSError: [Errno 28] No space ...").
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        ("inline_container" in text and ("unexpected pos" in text or "write failed" in text))
        or "No space left on device" in text)


def space_error_of(exc: BaseException, path, needed: int, what: str) -> Optional[CheckpointSpaceError]:
    """The :class:`CheckpointSpaceError` a failed write means when it ran out of space (ENOSPC, EDQUOT,
    or torch's short-write error from ``torch.save``), walking the exception's causes; else None. Call
    it once the temporary is removed: the free space reported is then what the write had."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _is_out_of_space(exc):
            directory = os.path.dirname(os.path.abspath(os.fspath(path))) or "."
            try:
                free = free_bytes(directory)
            except OSError:
                free = 0
            return CheckpointSpaceError(directory, needed, free, what,
                                        f"the write ran out of space: {type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def out_of_space_as_error(path, needed: int, what: str) -> Iterator[None]:
    """Re-raise an error of the block that means the disk ran out of space as :class:`CheckpointSpaceError`
    (chained to the original); any other error as it is."""
    try:
        yield
    except CheckpointSpaceError:
        raise
    except BaseException as exc:
        mapped = space_error_of(exc, path, needed, what)
        if mapped is None:
            raise
        raise mapped from exc
