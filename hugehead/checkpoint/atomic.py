"""Atomic writes for every checkpoint file and directory: a temporary sibling, fsync, then one rename
over the target (a directory swapped in with ``renameat2(RENAME_EXCHANGE)`` where Linux has it), and the
same for a directory that every rank of a process group writes into."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import uuid
from typing import Any, Callable, Iterator, List, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

_TMP_TAG = ".hugehead-tmp."
_RENAME_EXCHANGE = 2  # renameat2 flag (Linux >= 3.15): swap two paths atomically
_AT_FDCWD = -100


def _temp_sibling(path: str) -> str:
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}{_TMP_TAG}{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _fsync_path(path: str) -> None:
    """fsync a file, or a directory tree (its files, then each directory after its entries)."""
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                _fsync_path(os.path.join(root, name))
            _fsync_dir(root)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Any temporary of hugehead's naming: ".<name>.hugehead-tmp.<pid>.<hex>", whatever <name> is.
_STALE = re.compile(r"^\..+" + re.escape(_TMP_TAG) + r"(\d+)\.[0-9a-f]+$")


def _clean_stale_temps(path: str) -> None:
    """Remove every temporary a killed writer left in ``path``'s directory, whatever checkpoint it was
    writing (step-named checkpoints would otherwise pile up full-size temporaries): those of hugehead's
    naming whose writer's pid is gone."""
    parent = os.path.dirname(path)
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return
    for name in names:
        match = _STALE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_path(os.path.join(parent, name))


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where the OS cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: no exchange here; fall back
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _commit(tmp: str, path: str) -> None:
    if not os.path.isdir(tmp) and not os.path.isdir(path):
        os.replace(tmp, path)  # a file over a file: atomic by POSIX
    elif not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _remove_path(tmp)  # tmp now names the previous checkpoint
    else:
        # No atomic swap of a directory on this OS: two renames. Between them `path` is absent and the
        # previous checkpoint is the temporary; a killed writer leaves it there (load it by that name).
        old = _temp_sibling(path)
        os.rename(path, old)
        os.rename(tmp, path)
        _remove_path(old)
    _fsync_dir(os.path.dirname(path) or ".")


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """Write ``path`` (a file or a directory) all or nothing.

    Yields a temporary name in the same directory; the caller writes the file or directory there. When
    the block ends normally, the temporary is fsynced and renamed over ``path`` (a directory is swapped
    in with ``renameat2(RENAME_EXCHANGE)`` where Linux has it), then the parent directory is fsynced. A
    writer killed at any moment leaves ``path`` as it was (the previous checkpoint, or nothing); an
    exception removes the temporary and propagates. Temporaries of writers that were killed are removed by
    the next write to the same path.
    """
    path = os.path.abspath(os.fspath(path))
    _clean_stale_temps(path)
    tmp = _temp_sibling(path)
    try:
        yield tmp
        if not os.path.lexists(tmp):
            raise FileNotFoundError(f"hugehead: nothing was written to the temporary {tmp} for {path}")
        _fsync_path(tmp)
        _commit(tmp, path)
    except BaseException:
        _remove_path(tmp)
        raise


@contextlib.contextmanager
def _atomic_dir_across_ranks(path: PathLike, group, prepare: Optional[Callable[[], None]] = None) -> Iterator[str]:
    """:func:`atomic_path` for a directory that every rank of ``group`` writes into (a shared file
    system): group rank 0 names and creates the temporary, every rank writes its part, and rank 0 swaps it
    in only once the block ended normally on every rank. A failure on any rank removes the temporary and
    raises on every rank (the failing rank re-raises its own exception). ``prepare`` runs on rank 0
    before the temporary is created (a space check); an ``OSError`` it raises is raised on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0)
    path = os.path.abspath(os.fspath(path))
    name: List[Any] = [None]
    if rank == 0:
        try:
            _clean_stale_temps(path)
            if prepare is not None:
                prepare()
            name[0] = _temp_sibling(path)
            os.makedirs(name[0])
        except OSError as exc:  # every rank learns it (none waits for a directory that will not come)
            name[0] = exc
    dist.broadcast_object_list(name, src=src, group=group)
    if isinstance(name[0], BaseException):
        raise name[0]
    tmp = name[0]
    error: Optional[BaseException] = None
    try:
        yield tmp
    except BaseException as exc:  # reported to every rank below, then re-raised
        error = _as_rank_error(exc, rank)
    reports: List[Optional[str]] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(reports, None if error is None else f"rank {rank}: {type(error).__name__}: {error}",
                               group=group)
    except BaseException:
        # A peer is gone (its connection closed): no rank can commit, and any rank still alive may be the
        # one left to remove the temporary (rank 0 may be the one that died).
        _remove_path(tmp)
        if error is not None:
            raise error
        raise
    failures = [r for r in reports if r is not None]
    if rank == 0:
        if not failures:
            try:
                _fsync_path(tmp)
                _commit(tmp, path)
            except BaseException as exc:
                failures = [f"rank 0: {type(exc).__name__}: {exc}"]
        if failures:
            _remove_path(tmp)
    outcome = [failures]
    try:
        dist.broadcast_object_list(outcome, src=src, group=group)
    except BaseException:  # rank 0 is gone: after its commit, tmp is gone or names the previous checkpoint
        _remove_path(tmp)
        raise
    if error is not None:
        raise error
    if outcome[0]:
        raise RuntimeError(f"hugehead: checkpoint {path} was not written ({'; '.join(outcome[0])}); the previous "
                           "one, if any, is unchanged")


def _as_rank_error(exc: BaseException, rank: int) -> BaseException:
    """DCP raises a ``CheckpointException`` (a BaseException, not an Exception) on every rank when any rank
    failed: on a failing rank, its own original error instead; on the others, a RuntimeError naming the
    failing ranks and their errors. Anything else is returned as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return exc
    failures = dict(getattr(exc, "failures", {}) or {})
    own = failures.get(rank)
    own = own[0] if isinstance(own, tuple) else own
    if isinstance(own, BaseException):
        own.__cause__ = exc
        return own
    described = []
    for r, failure in sorted(failures.items()):
        original = failure[0] if isinstance(failure, tuple) else failure
        described.append(f"rank {r}: {type(original).__name__}: {original}")
    error = RuntimeError(f"hugehead: torch.distributed.checkpoint failed on another rank ({'; '.join(described)})")
    error.__cause__ = exc
    return error

