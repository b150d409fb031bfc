"""LMDB environments of one process: one per shard file, shared by the readers of that file.

LMDB (and py-lmdb's guard) forbid opening one environment twice in a process, so the
readers of a shard in one process share its environment (:func:`acquire_env`), each with
its own read transaction. A forked child drops what it inherited from the table (the
parent's: :func:`~streamload._fork.on_fork`), closes its copies when it first opens an
environment, and opens its own.

The map is opened without read-ahead (random access must not read pages nobody needs);
:meth:`SharedEnv.prefetch` asks the kernel for a run's bytes in large reads instead, and
:func:`resident` (``mincore``) says whether a batch's pages are in the page cache already.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
from typing import Any

import lmdb
import numpy as np

from .._errors import CorruptShardError, ShardNotFoundError, UnsafeShardError
from .._fork import on_fork
from ._lmdb_check import check_lmdb_file

__all__ = ["ADVISE_CHUNK", "PROBE_BYTES", "SharedEnv", "acquire_env", "address", "page_size", "release_env", "resident"]

#: Reader slots; unused with ``lock=False`` (no lock file), set high in case a user reopens with locks.
_MAX_READERS = 2048
#: Bytes per ``posix_fadvise(WILLNEED)`` call when a run of samples is read in order.
ADVISE_CHUNK = 2 << 20
#: Bytes of a batch's span whose residency is looked at before asking the kernel for it.
PROBE_BYTES = 64 << 10


def page_size() -> int:
    """LMDB's page size: the OS page size, capped at 64 KiB."""
    return min(os.sysconf("SC_PAGE_SIZE"), 1 << 16)


class SharedEnv:
    """An open environment shared by the readers of one shard file in this process."""

    def __init__(self, env: Any, path: str, st: os.stat_result) -> None:
        self.env = env
        self.refs = 0
        self.size = st.st_size
        self.fd = os.open(path, os.O_RDONLY)  # for posix_fadvise only
        self.base = _map_base(st)

    def prefetch(self, first: Any, last: Any) -> None:
        """Ask the kernel to read the file bytes from value ``first`` to the end of value ``last``.

        The map is opened without read-ahead (random access must not read pages nobody
        needs), so a run of samples read in order would fault one page at a time; this
        asks for exactly the run's bytes in large requests instead.
        """
        if self.base is None:
            return
        lo = address(first) - self.base
        hi = address(last) + len(last) - self.base
        if 0 <= lo < hi <= self.size:
            # One call reads at most the device's read-ahead limit (a few MiB): ask in chunks.
            for at in range(lo, hi, ADVISE_CHUNK):
                os.posix_fadvise(self.fd, at, min(ADVISE_CHUNK, hi - at), os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        """Close the environment and the descriptor (the readers' transactions are ended first)."""
        self.env.close()
        os.close(self.fd)


def address(value: Any) -> int:
    """Where a value read from the map lies in this process's memory."""
    return int(np.frombuffer(value, dtype=np.uint8).ctypes.data)


def _mincore() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, TypeError, AttributeError):  # no libc symbols here: never prefetch
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return fn


_MINCORE = _mincore()


def resident(address: int, length: int) -> bool:
    """Return True if the mapped pages of ``address .. address + length`` are in the page cache (``mincore``)."""
    if _MINCORE is None:
        return True
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    pages = max(1, (address + length - start + page - 1) // page)
    vec = (ctypes.c_ubyte * pages)()
    if _MINCORE(start, pages * page, vec) != 0:
        return False  # unknown: ask for them
    return all(byte & 1 for byte in vec)


def _map_base(st: os.stat_result) -> int | None:
    """Return where this process mapped the file at offset 0 (Linux ``/proc/self/maps``), or None."""
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) >= 5 and parts[4] == str(st.st_ino) and parts[3] == device and int(parts[2], 16) == 0:
                    return int(parts[0].split("-")[0], 16)
    except (OSError, ValueError):
        pass
    return None


_ENVS: dict[tuple[int, int], SharedEnv] = {}  # (st_dev, st_ino) -> the open environment
_ENVS_LOCK = threading.Lock()
#: Environments a forked child inherited: its copies, closed when it first opens one of its own.
_INHERITED: list[SharedEnv] = []


@on_fork
def _forget_in_child() -> None:
    global _ENVS, _ENVS_LOCK
    _INHERITED.extend(_ENVS.values())
    _ENVS, _ENVS_LOCK = {}, threading.Lock()


def acquire_env(path: str, name: str) -> tuple[tuple[int, int], SharedEnv]:
    """Return ``(file id, environment)`` for ``path`` in this process, opening it if needed.

    Raises:
        ShardNotFoundError: If there is no such file.
        UnsafeShardError: If it is not a regular file.
        CorruptShardError: If its structure is damaged (checked before LMDB opens it).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"{name}: {path} does not exist") from exc
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block LMDB's open forever
        raise UnsafeShardError(f"{name}: {path} is not a regular file (mode {stat.filemode(st.st_mode)})")
    env_id = (st.st_dev, st.st_ino)
    with _ENVS_LOCK:
        while _INHERITED:  # this process's copies of its parent's environments
            _INHERITED.pop().close()
        shared = _ENVS.get(env_id)
        if shared is None:
            shared = _ENVS[env_id] = SharedEnv(_open_env(path, name, st.st_size), path, st)
        shared.refs += 1
        return env_id, shared


def release_env(env_id: tuple[int, int], shared: SharedEnv) -> None:
    """A reader is done with ``shared``: the last one closes it."""
    with _ENVS_LOCK:
        if _ENVS.get(env_id) is not shared:
            return
        shared.refs -= 1
        if shared.refs == 0:
            del _ENVS[env_id]
            shared.close()


def _open_env(path: str, name: str, file_size: int) -> Any:
    """Check a shard's structure, then open it read-only, lock-free, without read-ahead."""
    check_lmdb_file(path, name)
    try:
        env = lmdb.open(
            path,
            subdir=False,
            readonly=True,
            lock=False,
            readahead=False,
            create=False,
            max_dbs=0,
            max_readers=_MAX_READERS,
            map_size=max(file_size, page_size()),
        )
    except lmdb.Error as exc:
        raise CorruptShardError(f"{name}: not a valid LMDB environment ({exc})") from exc
    try:
        end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    except lmdb.Error as exc:
        env.close()
        raise CorruptShardError(f"{name}: LMDB header unreadable ({exc})") from exc
    if end > file_size:
        env.close()
        raise CorruptShardError(f"{name}: LMDB file is truncated ({file_size} bytes, its pages need {end})")
    return env
