"""The local shard cache: bounded, least-recently-used, shared by every process on a node.

Every DataLoader worker of every rank on a machine opens the same cache directory; they
coordinate with ``flock(2)`` locks on files and atomic renames only. Nothing lives in
named shared memory, and every lock dies with the process holding it, so a crash
(even SIGKILL) leaves nothing behind that blocks the others.

Layout, one directory per dataset (``<cache_dir>/<hash of the dataset URL>/``)::

    .lock                 exclusive while a process counts bytes / reserves / evicts
    data/<name>           complete, verified files; mtime = last use (the LRU clock)
    pins/<name>           shared flock = "in use"; exclusive flock = "being evicted"
    pins/<name>.dl        exclusive flock = "being downloaded" (one downloader per file)
    tmp/<name>.<size>.<pid>.<random>.part
                          a download in progress, flocked by its writer; its name
                          carries the bytes it reserves against the limit
    meta/<name>           "<hash> <size> <inode>" of the verified download now in
                          data/<name> (written under .lock just before the rename)

Names are checked to be plain file names (see
:func:`~streamload._files.check_file_name`), so no path built here leaves the cache.

Invariants:

* The bytes in ``data/`` plus the bytes reserved by ``tmp/`` never exceed ``limit``:
  room is made, and a download reserved, under ``.lock``.
* A file with a shared lock on its pin is never deleted: eviction takes the pin's lock
  exclusively *without waiting* and skips the file if that fails.
* ``data/<name>`` only ever appears complete and verified (size, and hash when known):
  it is renamed into place from ``tmp/``. A partial file whose writer died is unlocked;
  the next process that makes room deletes it.
* A cached file is served only for the manifest entry it was verified against: the
  directory is keyed by URL, and a dataset re-written at the same URL may have files of
  the same names *and sizes* (tar shards are multiples of 512 bytes) but other bytes.
  :meth:`ShardCache.lookup` compares the entry's hash with ``meta/<name>`` (and the
  record's inode with the file's, so a record left by a crash between writing it and the
  rename never vouches for an older file); a mismatch is a miss, and the download
  replaces the stale file.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .._errors import CacheError, CorruptShardError
from .._files import FileEntry, check_file_name, new_hasher
from .._units import format_bytes

__all__ = ["CacheStats", "Pin", "ShardCache"]

#: How long an acquire waits for room held by other readers before giving up.
DEFAULT_WAIT_TIMEOUT = 300.0
_CHUNK = 8 << 20


@dataclass
class CacheStats:
    """What one process's cache did (per process; the server counts for everyone)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0


class Pin:
    """A shared lock on one cached file: while held, the file is not evicted."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name

    def close(self) -> None:
        """Release the pin (closing the descriptor drops the lock)."""
        if self.fd >= 0:
            _close_fd(self.fd)
            self.fd = -1


# -- lock descriptors and fork ---------------------------------------------------------
#
# A flock belongs to the open file, which a forked child shares. A lock some thread holds
# while another thread forks (a DataLoader starting its workers) would stay held by the
# child's copy for the child's whole life, and every process would wait on it. So every
# descriptor this module opens is recorded, and a forked child closes its copies at once:
# the parent's locks are unaffected, and the child never holds a lock it did not take.

_FDS: set[int] = set()
_FDS_LOCK = threading.Lock()


def _open_fd(path: str, flags: int) -> int:
    with _FDS_LOCK:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        _FDS.add(fd)
    return fd


def _close_fd(fd: int) -> None:
    """Close ``fd`` if this process opened it (a child's inherited copies are already closed)."""
    with _FDS_LOCK:
        if fd not in _FDS:
            return
        _FDS.discard(fd)
        os.close(fd)


def _hold_fds_for_fork() -> None:
    # No fork between an os.open and its recording (nor a close and its forgetting): the
    # child would keep an unrecorded copy of a descriptor the parent locks next, and a
    # flock taken through the parent's descriptor is then also held by the child's copy,
    # until the child exits (a cache lock held for a whole DataLoader epoch).
    _FDS_LOCK.acquire()


def _release_fds_after_fork() -> None:
    _FDS_LOCK.release()


def _close_inherited_fds() -> None:
    global _FDS_LOCK
    _FDS_LOCK = threading.Lock()
    for fd in _FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _FDS.clear()


os.register_at_fork(
    before=_hold_fds_for_fork, after_in_parent=_release_fds_after_fork, after_in_child=_close_inherited_fds
)


def _lock(fd: int, flags: int) -> bool:
    """Take a flock; False if ``LOCK_NB`` was given and someone else holds it."""
    try:
        fcntl.flock(fd, flags)
        return True
    except BlockingIOError:
        return False


class ShardCache:
    """One dataset's cache directory (see the module docstring for its layout).

    Args:
        root: The dataset's cache directory (created).
        limit: Most bytes the cache may hold (``None``: no bound).
        verify_hash: Check downloads against the manifest hash (size is always checked).
        wait_timeout: Seconds an acquire waits for other readers to free room.
    """

    def __init__(
        self,
        root: str,
        limit: int | None,
        *,
        verify_hash: bool = True,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        self.root = root
        self.limit = limit
        self.verify_hash = verify_hash
        self.wait_timeout = wait_timeout
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        for sub in ("data", "pins", "tmp", "meta"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)

    # -- paths -----------------------------------------------------------------------

    def data_path(self, name: str) -> str:
        """Return where the complete file ``name`` lives in the cache."""
        return os.path.join(self.root, "data", check_file_name(name, "cached file name"))

    def _pin_path(self, name: str, suffix: str = "") -> str:
        return os.path.join(self.root, "pins", check_file_name(name, "cached file name") + suffix)

    def _meta_path(self, name: str) -> str:
        return os.path.join(self.root, "meta", check_file_name(name, "cached file name"))

    def _open_lock(self, path: str) -> int:
        return _open_fd(path, os.O_RDWR | os.O_CREAT)

    # -- pins --------------------------------------------------------------------------

    def pin(self, name: str) -> Pin:
        """Take a shared lock on ``name``'s pin (waits out an eviction in progress)."""
        fd = self._open_lock(self._pin_path(name))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            _close_fd(fd)
            raise
        return Pin(fd, name)

    def lookup(self, entry: FileEntry) -> str | None:
        """Return the cached path of ``entry`` if present and verified for it (caller pins).

        A file of the right size but verified against another hash (a dataset re-written
        at the same URL), or with no record of its verification, is a miss.
        """
        path = self.data_path(entry.name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if st.st_size != entry.num_bytes:
            return None  # a stale file of another version; replaced by the next download
        if self._checks_hash(entry) and self._read_record(entry.name) != (entry.hash, entry.num_bytes, st.st_ino):
            return None  # same size, other bytes (or unverified): replaced by the next download
        try:
            os.utime(path)  # the LRU clock
        except FileNotFoundError:
            return None
        with self._stats_lock:
            self.stats.hits += 1
        return path

    @staticmethod
    def _checks_hash(entry: FileEntry) -> bool:
        # Not a hash computation: which manifest entry the file was downloaded for, so it
        # applies with verify_hash=False too.
        return entry.hash is not None

    def _read_record(self, name: str) -> tuple[str, int, int] | None:
        """The ``(hash, size, inode)`` recorded for the download renamed into ``data/<name>``."""
        try:
            with open(self._meta_path(name), encoding="ascii") as f:
                digest, size, inode = f.read().split()
            return digest, int(size), int(inode)
        except (OSError, ValueError):
            return None

    def _write_record(self, entry: FileEntry, part: str) -> None:
        """Record what ``part`` was verified against (caller holds the cache lock)."""
        meta = self._meta_path(entry.name)
        if entry.hash is None:
            _unlink(meta)
            return
        tmp = f"{meta}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(f"{entry.hash} {entry.num_bytes} {os.stat(part).st_ino}\n")
        os.replace(tmp, meta)

    # -- filling -------------------------------------------------------------------

    def fill(
        self,
        entry: FileEntry,
        download: Callable[[str, Callable[[], bool]], None],
        *,
        wait: bool = True,
        on_wait: Callable[[], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> str | None:
        """Make sure ``entry`` is in the cache; the caller must hold its pin.

        Args:
            entry: The file to fetch: its size, and its digest with the digest's algorithm
                (checked unless ``verify_hash`` is off or the entry has none).
            download: ``download(part_path, cancelled)`` writes the remote bytes to
                ``part_path`` (retrying transient errors itself).
            wait: Wait for room (acquire) or give up at once when the cache is full of
                files in use (read-ahead).
            on_wait: Called once before waiting for room (e.g. to drop read-ahead pins).
            cancelled: Polled during the download; if it turns true the download stops.

        Returns:
            The cached path, or ``None`` if ``wait`` is false and there was no room, or
            the download was cancelled.
        """
        path = self.lookup(entry)
        if path is not None:
            return path
        dl_fd = self._open_lock(self._pin_path(entry.name, ".dl"))
        try:
            if not self._lock_download(dl_fd, wait, entry):
                return None
            path = self.lookup(entry)  # someone else downloaded it meanwhile
            if path is not None:
                return path
            with self._reservation(entry, wait, on_wait) as part:
                if part is None:
                    return None
                download(part, cancelled)
                if cancelled():
                    return None
                self._verify(part, entry)
                final = self.data_path(entry.name)
                with self._cache_lock():  # so a count under the lock never sees it twice
                    self._write_record(entry, part)
                    os.replace(part, final)
            with self._stats_lock:
                self.stats.downloads += 1
                self.stats.bytes_downloaded += entry.num_bytes
            return final
        finally:
            _close_fd(dl_fd)

    def _lock_download(self, fd: int, wait: bool, entry: FileEntry) -> bool:
        if not wait:
            return _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_EX)  # the holder's download is bounded by its retry policy
        return True

    def _verify(self, part: str, entry: FileEntry) -> None:
        size = os.stat(part).st_size
        if size != entry.num_bytes:
            raise CorruptShardError(f"{entry.name}: downloaded {size} bytes, the manifest says {entry.num_bytes}")
        hash_algorithm = entry.algorithm
        if not self.verify_hash or hash_algorithm is None or entry.hash is None:
            return
        hasher = new_hasher(hash_algorithm)
        with open(part, "rb") as f:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
        problem = entry.digest_problem(hasher.hexdigest(), hash_algorithm)
        if problem is not None:
            raise CorruptShardError(f"{entry.name}: downloaded bytes do not match the manifest: {problem}")

    # -- room ------------------------------------------------------------------------

    @contextmanager
    def _reservation(self, entry: FileEntry, wait: bool, on_wait: Callable[[], None] | None) -> Iterator[str | None]:
        """Reserve ``entry.num_bytes`` as a locked ``tmp/`` part file; yield its path.

        Yields ``None`` if ``wait`` is false and no room can be made now. The part file is
        deleted on exit unless it was renamed into ``data/``.
        """
        deadline = time.monotonic() + self.wait_timeout
        delay = 0.05
        waited = False
        while True:
            reserved = self._try_reserve(entry)
            if reserved is not None:
                break
            if not wait:
                yield None
                return
            if on_wait is not None:
                on_wait()  # every time: read-ahead may have pinned something meanwhile
                if not waited:
                    waited = True
                    continue
            if time.monotonic() > deadline:
                raise CacheError(
                    f"{self.root}: no room for {entry.name} ({format_bytes(entry.num_bytes)}) within "
                    f"cache_limit={format_bytes(self.limit or 0)} after {self.wait_timeout:.0f} s: every "
                    "cached file is in use by a reader; raise cache_limit (at least (readers + 1) x the "
                    "largest shard on this machine)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        part, fd = reserved
        try:
            yield part
        finally:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass  # renamed into data/
            _close_fd(fd)

    def _try_reserve(self, entry: FileEntry) -> tuple[str, int] | None:
        """Under the cache lock: evict until ``entry`` fits, then create its part file."""
        with self._cache_lock():
            if self.limit is not None:
                used = self._used_bytes()
                if used + entry.num_bytes > self.limit:
                    used -= self._evict(used + entry.num_bytes - self.limit)
                if used + entry.num_bytes > self.limit:
                    return None
            token = secrets.token_hex(4)
            part = os.path.join(self.root, "tmp", f"{entry.name}.{entry.num_bytes}.{os.getpid()}.{token}.part")
            fd = _open_fd(part, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fcntl.flock(fd, fcntl.LOCK_EX)  # before the cache lock drops: never seen unlocked
            return part, fd

    @contextmanager
    def _cache_lock(self) -> Iterator[None]:
        fd = self._open_lock(os.path.join(self.root, ".lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close_fd(fd)

    def _used_bytes(self) -> int:
        """Bytes in ``data/`` plus bytes reserved by live parts; deletes dead parts."""
        total = 0
        with os.scandir(os.path.join(self.root, "data")) as it:
            for item in it:
                try:
                    total += item.stat().st_size
                except FileNotFoundError:
                    continue
        tmp = os.path.join(self.root, "tmp")
        with os.scandir(tmp) as it:
            for item in it:
                reserved = _reserved_bytes(item.name)
                if reserved is None or not self._part_is_live(item.path):
                    _unlink(item.path)  # a crashed downloader's leftover
                    continue
                try:
                    total += max(reserved, item.stat().st_size)
                except FileNotFoundError:
                    continue
        return total

    def _part_is_live(self, path: str) -> bool:
        try:
            fd = _open_fd(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return not _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            _close_fd(fd)

    def _evict(self, needed: int) -> int:
        """Delete unpinned files, least recently used first, until ``needed`` bytes are freed.

        Returns the bytes freed (maybe less, if the rest is pinned). Caller holds the cache lock.
        """
        candidates: list[tuple[float, str, int]] = []
        with os.scandir(os.path.join(self.root, "data")) as it:
            for item in it:
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue
                candidates.append((st.st_mtime, item.name, st.st_size))
        freed = 0
        for _, name, size in sorted(candidates):
            if freed >= needed:
                break
            if self._evict_one(name):
                freed += size
        return freed

    def _evict_one(self, name: str) -> bool:
        try:
            check_file_name(name, "cached file name")
        except ValueError:
            _unlink(os.path.join(self.root, "data", os.path.basename(name)))
            return True
        fd = self._open_lock(self._pin_path(name))
        try:
            if not _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                return False  # in use (or being read ahead) by some process
            _unlink(self.data_path(name))
            _unlink(self._meta_path(name))
        finally:
            _close_fd(fd)
        with self._stats_lock:
            self.stats.evictions += 1
        return True

    def usage(self) -> int:
        """Return the bytes the cache holds and reserves now."""
        with self._cache_lock():
            return self._used_bytes()


def _reserved_bytes(part_name: str) -> int | None:
    """The reservation encoded in a part file's name, or ``None`` if it is not one."""
    pieces = part_name.split(".")
    if len(pieces) < 5 or pieces[-1] != "part" or not pieces[-4].isdigit():
        return None
    return int(pieces[-4])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
