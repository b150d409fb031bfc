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
    meta/<name>           "<hash or -> <size> <inode> <generation>" of the verified
                          download now in data/<name> (written under .lock just before
                          the rename; the generation is a random token of that download)
    readers/<pid>.<random>
                          one per process reading through the cache, exclusively
                          flocked while it reads (see "Admission" below)

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
  replaces the stale file (which is deleted first, so it holds no room the download needs).

Corrupt copies. A copy can go bad on local disk after it was verified (a flipped bit, a
restore from a bad backup); its size and record still match, so :meth:`ShardCache.lookup`
serves it, and the format reader's per-sample checksum finds it. The reader's storage then
calls :meth:`ShardCache.discard`: if ``data/<name>`` is still the copy it read (the same
download generation: not an inode, which a fresh file may reuse) and does not hash to its
entry (or the entry has no hash to tell), the copy is deleted (its name only: processes
reading it keep their descriptors), so the next acquire downloads it again. A copy that
does hash to its entry is kept: the shard is bad at its source, and a download would
bring the same bytes. Deleting skips the pin's exclusive lock (a reader may keep a bad
copy open for long); a process that looked the file up just before then meets a missing
file when it opens it, and looks it up again (see ``streamload.shards``).

Admission. Every reader needs room for the shard it reads, pinned, and a DataLoader hands
out samples in order, so a reader waiting for room held by the others' pins can wait for
ever: the others stop when their queues are full, and keep their pins. So each process
that reads registers in ``readers/`` (:meth:`ShardCache.register`, an exclusive flock held
while it reads: a crash unregisters it) and counts the live registrations
(:meth:`ShardCache.readers`). :class:`~streamload.storage.remote.RemoteStorage` refuses at
once a reader that would make the readers' shards outgrow the limit, and shares the limit
among the registered readers when it tells each how many shards it may keep open. A wait
for room that does happen (another process's download holds it) logs a line every
``log_every`` seconds until it ends or ``wait_timeout`` runs out.
"""

from __future__ import annotations

import fcntl
import logging
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

__all__ = ["CacheStats", "Pin", "Registration", "ShardCache"]

log = logging.getLogger("streamload")

#: How long an acquire waits for room held by other readers before giving up.
DEFAULT_WAIT_TIMEOUT = 300.0
#: Seconds between the log lines of an acquire waiting for room.
DEFAULT_LOG_EVERY = 10.0
#: Longest sleep between two tries to make room (room is mostly freed by a download ending).
_MAX_POLL = 0.25
#: A registration being created (``readers/.<name>``) left by a crash is deleted after this long.
_STALE_NEW_REGISTRATION = 60.0
_CHUNK = 8 << 20
_SUBDIRS = ("data", "pins", "tmp", "meta", "readers")


@dataclass
class CacheStats:
    """What one process's cache did (per process; the server counts for everyone)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    #: Cached copies found corrupt and deleted, to be downloaded again.
    discarded: int = 0


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


class Registration:
    """A process's registration as a reader of a cache (see :meth:`ShardCache.register`)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def close(self) -> None:
        """Unregister: delete the file, then drop its lock."""
        if self.fd >= 0:
            _unlink(self.path)
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
        log_every: Seconds between the log lines of an acquire waiting for room.
    """

    def __init__(
        self,
        root: str,
        limit: int | None,
        *,
        verify_hash: bool = True,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        log_every: float = DEFAULT_LOG_EVERY,
    ) -> None:
        self.root = root
        self.limit = limit
        self.verify_hash = verify_hash
        self.wait_timeout = wait_timeout
        self.log_every = log_every
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._make_dirs()

    def _make_dirs(self) -> None:
        """Create the cache's directories (again, if someone deleted them under a running job)."""
        for sub in _SUBDIRS:
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)

    def _create(self, path: str, flags: int) -> int:
        """Open (creating) ``path`` in the cache; its directory is made again if it was deleted."""
        try:
            return _open_fd(path, flags)
        except FileNotFoundError:
            self._make_dirs()
            return _open_fd(path, flags)

    def _scan(self, sub: str) -> list[os.DirEntry[str]]:
        """The entries of ``<root>/<sub>`` (none, and the directory made again, if it was deleted)."""
        try:
            with os.scandir(os.path.join(self.root, sub)) as it:
                return list(it)
        except FileNotFoundError:
            self._make_dirs()
            return []

    # -- paths -----------------------------------------------------------------------

    def data_path(self, name: str) -> str:
        """Return where the complete file ``name`` lives in the cache."""
        return os.path.join(self.root, "data", check_file_name(name, "cached file name"))

    def _pin_path(self, name: str, suffix: str = "") -> str:
        return os.path.join(self.root, "pins", check_file_name(name, "cached file name") + suffix)

    def _meta_path(self, name: str) -> str:
        return os.path.join(self.root, "meta", check_file_name(name, "cached file name"))

    def _open_lock(self, path: str) -> int:
        return self._create(path, os.O_RDWR | os.O_CREAT)

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
        if self._checks_hash(entry):
            record = self._read_record(entry.name)
            if record is None or record[:3] != (entry.hash, entry.num_bytes, st.st_ino):
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

    def _read_record(self, name: str) -> tuple[str, int, int, str] | None:
        """The ``(hash, size, inode, generation)`` recorded for the download renamed into ``data/<name>``.

        A record written before generations existed has none (``""``).
        """
        try:
            with open(self._meta_path(name), encoding="ascii") as f:
                fields = f.read().split()
            digest, size, inode = fields[:3]
            return digest, int(size), int(inode), fields[3] if len(fields) > 3 else ""
        except (OSError, ValueError):
            return None

    def generation(self, name: str) -> str | None:
        """The generation of the copy now in ``data/<name>`` (``None`` if it has no record of one)."""
        record = self._read_record(name)
        try:
            inode = os.stat(self.data_path(name)).st_ino
        except FileNotFoundError:
            return None
        if record is None or record[2] != inode or not record[3]:
            return None
        return record[3]

    def _write_record(self, entry: FileEntry, part: str) -> None:
        """Record what ``part`` was verified against (caller holds the cache lock)."""
        meta = self._meta_path(entry.name)
        tmp = f"{meta}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            f = open(tmp, "w", encoding="ascii")
        except FileNotFoundError:
            self._make_dirs()
            f = open(tmp, "w", encoding="ascii")
        with f:
            f.write(f"{entry.hash or '-'} {entry.num_bytes} {os.stat(part).st_ino} {secrets.token_hex(8)}\n")
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
            self._drop(entry.name)  # a stale or damaged copy: it must not hold room the download needs
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
                    with self._stats_lock:  # counted before it shows: a reader that finds it sees it counted
                        self.stats.downloads += 1
                        self.stats.bytes_downloaded += entry.num_bytes
                    try:
                        os.replace(part, final)
                    except FileNotFoundError as exc:
                        raise CacheError(
                            f"{self.root}: the cache directory was deleted while {entry.name} was downloaded "
                            "into it; the next read downloads it again"
                        ) from exc
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

    # -- corrupt copies --------------------------------------------------------------

    def discard(self, entry: FileEntry, generation: str | None) -> bool:
        """Delete the cached copy of ``entry`` a reader found corrupt, so that it is downloaded again.

        Args:
            entry: The file, as the manifest says it must be.
            generation: The :meth:`generation` of the copy the reader read (``None``:
                unknown; whatever is cached now is judged).

        Returns:
            True if the next acquire gets another copy (this one was deleted, or another
            process already replaced or deleted it); False if the copy hashes to the
            entry: it is faithful, and a download would bring the same bytes.
        """
        fd = self._open_lock(self._pin_path(entry.name, ".dl"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # no download of this file meanwhile (bounded by its retries)
            path = self.data_path(entry.name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return True
            if generation is not None and self.generation(entry.name) != generation:
                return True  # already replaced by another reader that found it corrupt
            if st.st_size == entry.num_bytes and self._hashes_to(path, entry):
                return False
            with self._cache_lock():
                self._drop_locked(entry.name, st.st_ino)
            with self._stats_lock:
                self.stats.discarded += 1
            return True
        finally:
            _close_fd(fd)

    @staticmethod
    def _hashes_to(path: str, entry: FileEntry) -> bool:
        """True if the file at ``path`` hashes to ``entry``'s digest (False if it has none)."""
        if entry.hash is None or entry.algorithm is None:
            return False
        hasher = new_hasher(entry.algorithm)
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
        return entry.digest_problem(hasher.hexdigest(), entry.algorithm) is None

    def _drop(self, name: str) -> None:
        """Delete ``data/<name>`` (a stale copy, about to be replaced) and its record."""
        try:
            inode = os.stat(self.data_path(name)).st_ino
        except FileNotFoundError:
            return
        with self._cache_lock():
            self._drop_locked(name, inode)

    def _drop_locked(self, name: str, inode: int) -> None:
        """Delete ``data/<name>`` if it is still ``inode``, and its record (caller holds the cache lock)."""
        path = self.data_path(name)
        try:
            if os.stat(path).st_ino != inode:
                return
        except FileNotFoundError:
            return
        _unlink(path)
        _unlink(self._meta_path(name))

    # -- readers -----------------------------------------------------------------------

    def register(self) -> Registration:
        """Register this process as a reader of the cache until the registration is closed.

        The file appears in ``readers/`` already locked (it is locked under a dot-name,
        then renamed), so a live registration is never taken for a dead one.
        """
        readers = os.path.join(self.root, "readers")
        name = f"{os.getpid()}.{secrets.token_hex(6)}"
        new = os.path.join(readers, f".{name}")
        fd = self._create(new, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = os.path.join(readers, name)
            os.rename(new, path)
        except BaseException:
            _unlink(new)
            _close_fd(fd)
            raise
        return Registration(fd, path)

    def readers(self) -> int:
        """Count the live registrations; delete those of dead processes."""
        count = 0
        for item in self._scan("readers"):
            if item.name.startswith("."):
                self._forget_stale_new(item.path)
                continue
            try:
                fd = _open_fd(item.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                # A shared probe: two processes probing a dead registration both see it dead.
                if _lock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB):
                    _unlink(item.path)  # its process died (its lock with it)
                else:
                    count += 1
            finally:
                _close_fd(fd)
        return count

    @staticmethod
    def _forget_stale_new(path: str) -> None:
        try:
            if time.time() - os.stat(path).st_mtime > _STALE_NEW_REGISTRATION:
                _unlink(path)  # a crash between creating and renaming a registration
        except FileNotFoundError:
            pass

    # -- room ------------------------------------------------------------------------

    @contextmanager
    def _reservation(self, entry: FileEntry, wait: bool, on_wait: Callable[[], None] | None) -> Iterator[str | None]:
        """Reserve ``entry.num_bytes`` as a locked ``tmp/`` part file; yield its path.

        Yields ``None`` if ``wait`` is false and no room can be made now. The part file is
        deleted on exit unless it was renamed into ``data/``.
        """
        started = time.monotonic()
        deadline = started + self.wait_timeout
        next_log = started + min(self.log_every, self.wait_timeout)
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
            now = time.monotonic()
            if now > deadline:
                raise CacheError(
                    f"{self.root}: no room for {entry.name} ({format_bytes(entry.num_bytes)}) within "
                    f"cache_limit={format_bytes(self.limit or 0)} after {self.wait_timeout:.0f} s: every "
                    f"cached file is in use by a reader ({self.readers()} registered); raise cache_limit "
                    "(at least (readers + 1) x the largest shard on this machine)"
                )
            if now >= next_log:
                next_log = now + self.log_every
                log.warning(
                    "%s: waiting for room for %s (%s) within cache_limit=%s: %.0f s of %.0f s; "
                    "%d reader(s) registered, %s used",
                    self.root,
                    entry.name,
                    format_bytes(entry.num_bytes),
                    format_bytes(self.limit or 0),
                    now - started,
                    self.wait_timeout,
                    self.readers(),
                    format_bytes(self.usage()),
                )
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL)
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
            fd = self._create(part, os.O_RDWR | os.O_CREAT | os.O_EXCL)
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
        for item in self._scan("data"):
            try:
                total += item.stat().st_size
            except FileNotFoundError:
                continue
        for item in self._scan("tmp"):
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
        for item in self._scan("data"):
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
