"""The local shard cache: bounded, least-recently-used, shared by every process on a node.

Every DataLoader worker of every rank on a machine opens the same cache directory; they
coordinate with ``flock(2)`` locks on files and atomic renames only. Nothing lives in
named shared memory, and every lock dies with the process holding it, so a crash
(even SIGKILL) leaves nothing behind that blocks the others.

Layout, one directory per dataset (``<cache_dir>/<hash of the dataset URL>/``)::

    .lock                 exclusive while a process counts bytes / reserves / evicts
    data/<name>           complete, verified files; mtime = last use (the LRU clock)
    pins/<name>           shared flock = "in use"; exclusive flock = "being evicted"
    downloads/<name>      exclusive flock = "being downloaded" (one downloader per file)
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
:func:`~streamload._files.check_file_name`), so no path built here leaves the cache. No
bookkeeping name can be a shard's: each kind of lock has a folder of its own (a shard named
``s.tar.dl`` and one named ``s.tar`` once shared ``pins/s.tar.dl``, and reading the second
while the first was open waited for ever on its own lock), and the cache's own temporary
names start with a dot, which no plain name does. Every lock wait is bounded
(``lock_timeout``) and ends in a :class:`~streamload.CacheError` naming the lock file and
the process holding it; a wait of more than a few seconds (:data:`LOCK_NOTICE`) is logged
once, naming them too (a warning when the holder is a stopped process).

Links. A cache directory may sit where others can write (a node-wide ``STREAMLOAD_CACHE``),
so the cache never follows a link it did not make: its folders must be real directories
(checked with ``lstat`` whenever one is listed), every file is opened with
``O_NOFOLLOW``, a cached file is served only if it is a regular file, and sizes are counted
without following links. Deleting a link deletes the link, never its target. The dataset's
cache folder must belong to the user and not be writable by group or others (a
:class:`~streamload.CacheError` says so), unless ``STREAMLOAD_CACHE_SHARED=1`` allows a
folder shared by a group of users (then a link planted there is refused, never followed).

A full disk. A download that meets ``ENOSPC`` (or a quota) ends in a
:class:`~streamload.CacheError` naming the cache directory and the bytes it needed: it is
not the shard's fault, so it is never a corrupt shard and never a skipped sample.

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

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .. import _env
from .._errors import CacheError, CorruptShardError
from .._files import FileEntry, check_file_name, new_hasher
from .._units import format_bytes

__all__ = ["CacheStats", "Pin", "Registration", "ShardCache"]

log = logging.getLogger("streamload")

#: How long an acquire waits for room held by other readers before giving up.
DEFAULT_WAIT_TIMEOUT = 300.0
#: Seconds between the log lines of an acquire waiting for room.
DEFAULT_LOG_EVERY = 10.0
#: Longest wait for one of the cache's locks (another process's download of the same file
#: holds its lock for that download, which its retry policy bounds) before a CacheError.
DEFAULT_LOCK_TIMEOUT = 600.0
#: Seconds a wait for one of the cache's locks lasts before it is logged (once).
LOCK_NOTICE = 5.0
#: The environment variable that allows a cache folder writable by its group (and owned by
#: another user of it): a cache shared by several users.
SHARED_ENV = _env.CACHE_SHARED
#: Longest sleep between two tries to make room (room is mostly freed by a download ending).
_MAX_POLL = 0.25
#: A registration being created (``readers/.<name>``) left by a crash is deleted after this long.
_STALE_NEW_REGISTRATION = 60.0
_CHUNK = 8 << 20
_SUBDIRS = ("data", "pins", "downloads", "tmp", "meta", "readers", "landing")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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
    """Open ``path`` (never through a link: ``O_NOFOLLOW``) and record the descriptor."""
    with _FDS_LOCK:
        try:
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CacheError(
                    f"{path} is a symbolic link; the cache never follows a link it did not make "
                    "(someone else can write the cache directory: use one only you can write)"
                ) from exc
            raise
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


def _wait_lock(
    fd: int, flags: int, path: str, timeout: float, why: str, tick: Callable[[], None] | None = None
) -> None:
    """Take a flock, waiting at most ``timeout`` seconds; else a :class:`CacheError` naming ``path``.

    ``tick`` is called between tries (at most every 50 ms) while the lock is held elsewhere.
    A wait longer than :data:`LOCK_NOTICE` seconds (or half the timeout, if shorter) is
    logged once, naming the lock and the processes holding it (a warning when one of them
    is stopped: it will not let go before it is continued).
    """
    if _lock(fd, flags | fcntl.LOCK_NB):
        return
    began = time.monotonic()
    deadline = began + timeout
    notice: float | None = began + min(LOCK_NOTICE, timeout / 2)
    delay = 0.001
    while True:
        time.sleep(delay)
        if _lock(fd, flags | fcntl.LOCK_NB):
            return
        if tick is not None:
            tick()
        now = time.monotonic()
        if notice is not None and now > notice:
            notice = None
            holders, stopped = _describe_holders(fd)
            level = logging.WARNING if stopped else logging.INFO
            log.log(
                level,
                "waiting for %s (%s), held by %s, for %.0f s so far; giving up after %.0f s (lock_timeout)",
                path,
                why,
                holders,
                now - began,
                timeout,
            )
        if now > deadline:
            holders, _ = _describe_holders(fd)
            raise CacheError(
                f"{path}: still locked by {holders} after {timeout:.0f} s ({why}); "
                "if no other process of this machine is reading this dataset, delete the cache directory"
            )
        delay = min(delay * 2, 0.05)


def lock_holders(fd: int) -> list[int]:
    """The process ids holding a ``flock`` on the file open as ``fd`` (from ``/proc/locks``; ``[]`` elsewhere)."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids: list[int] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue  # "->": a process blocked waiting, not a holder
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if key == want and pid not in pids:
            pids.append(pid)
    return pids


def _describe_holders(fd: int) -> tuple[str, bool]:
    """``("pid 123 (stopped)", True)``: who holds the lock on ``fd``, and whether one of them is stopped."""
    pids = lock_holders(fd)
    if not pids:
        return "another process (its pid is not known here)", False
    described, stopped = [], False
    for pid in pids:
        state = _process_state(pid)
        if state in ("T", "t"):
            stopped = True
            described.append(f"pid {pid} (stopped)")
        else:
            described.append(f"pid {pid}" + (" (this process)" if pid == os.getpid() else ""))
    return ", ".join(described), stopped


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``; ``""`` if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    rest = text.rpartition(")")[2].split()
    return rest[0] if rest else ""


class ShardCache:
    """One dataset's cache directory (see the module docstring for its layout).

    Args:
        root: The dataset's cache directory (created).
        limit: Most bytes the cache may hold (``None``: no bound).
        verify_hash: Check downloads against the manifest hash (size is always checked).
        wait_timeout: Seconds an acquire waits for other readers to free room.
        log_every: Seconds between the log lines of an acquire waiting for room.
        lock_timeout: Most seconds any wait for one of the cache's locks lasts.
        shared: Accept a cache folder writable by its group or owned by another user
            (default: ``STREAMLOAD_CACHE_SHARED=1`` in the environment).
    """

    def __init__(
        self,
        root: str,
        limit: int | None,
        *,
        verify_hash: bool = True,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        log_every: float = DEFAULT_LOG_EVERY,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        shared: bool | None = None,
    ) -> None:
        self.root = root
        self.limit = limit
        self.verify_hash = verify_hash
        self.wait_timeout = wait_timeout
        self.log_every = log_every
        self.lock_timeout = lock_timeout
        self.shared = _env.cache_shared() if shared is None else shared
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._make_dirs()

    def _make_dirs(self) -> None:
        """Create the cache's directories (again, if someone deleted them under a running job).

        Raises:
            CacheError: If the cache folder or one of its folders is a link or not a
                directory, or the cache folder is not safe from other users (see the
                module docstring).
        """
        try:
            # Explicit modes: a umask of 002 must not make the cache writable by a group.
            os.makedirs(self.root, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the cache directory {self.root}: {exc.strerror or exc}") from exc
        self._check_dir(self.root, owner=True)
        for sub in _SUBDIRS:
            path = os.path.join(self.root, sub)
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                pass
            except OSError as exc:
                raise CacheError(f"cannot create the cache directory {path}: {exc.strerror or exc}") from exc
            self._check_dir(path, owner=False)

    def _check_dir(self, path: str, *, owner: bool) -> None:
        """Refuse a cache folder that is a link or not a directory, or (``owner``) others could write."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # deleted under a running job: made again by the next write
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise CacheError(
                f"{path} is {kind}; the cache never follows a link it did not make nor writes outside its "
                "own folders (someone else can write the cache directory: use one only you can write)"
            )
        if not owner:
            if not self.shared and st.st_uid != os.geteuid():
                raise CacheError(
                    f"{path}: a folder of the cache belongs to another user; use a cache directory of your own, "
                    f"or set {SHARED_ENV}=1 if it is shared on purpose"
                )
            if st.st_mode & stat.S_IWOTH or (not self.shared and st.st_mode & stat.S_IWGRP):
                who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
                raise CacheError(
                    f"{path}: a folder of the cache is writable by {who} "
                    f"(mode {stat.S_IMODE(st.st_mode):o}); another user could plant or replace its files. "
                    f"chmod go-w {path} (after checking what it holds), or use a cache directory of your own"
                    + ("" if self.shared else f"; set {SHARED_ENV}=1 if a group shares it on purpose")
                )
            return
        if self.shared:
            if st.st_mode & stat.S_IWOTH:
                raise CacheError(
                    f"{path}: the cache folder is writable by every user (mode {stat.S_IMODE(st.st_mode):o}); "
                    f"even with {SHARED_ENV}=1 it may only be shared by a group"
                )
            return
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheError(
                f"{path}: the cache folder belongs to another user or others can write it (mode "
                f"{stat.S_IMODE(st.st_mode):o}); another user could make the cache delete or overwrite your "
                f"files. Use a cache directory of your own (or chmod go-w {path}), or set {SHARED_ENV}=1 if it is "
                "shared on purpose"
            )

    def _create(self, path: str, flags: int) -> int:
        """Open (creating) ``path`` in the cache; its directory is made again if it was deleted."""
        self._check_dir(os.path.dirname(path), owner=path == os.path.join(self.root, ".lock"))
        try:
            return _open_fd(path, flags)
        except FileNotFoundError:
            self._make_dirs()
            return _open_fd(path, flags)

    def _scan(self, sub: str) -> list[os.DirEntry[str]]:
        """The entries of ``<root>/<sub>`` (none, and the directory made again, if it was deleted).

        A folder replaced by a link is refused, never listed (its entries would be deleted).
        """
        path = os.path.join(self.root, sub)
        self._check_dir(path, owner=False)
        try:
            with os.scandir(path) as it:
                return list(it)
        except FileNotFoundError:
            self._make_dirs()
            return []

    # -- paths -----------------------------------------------------------------------

    def data_path(self, name: str) -> str:
        """Return where the complete file ``name`` lives in the cache (its folder checked: no link)."""
        folder = os.path.join(self.root, "data")
        self._check_dir(folder, owner=False)
        return os.path.join(folder, check_file_name(name, "cached file name"))

    def _pin_path(self, name: str) -> str:
        return os.path.join(self.root, "pins", check_file_name(name, "cached file name"))

    def _download_lock_path(self, name: str) -> str:
        return os.path.join(self.root, "downloads", check_file_name(name, "cached file name"))

    def _meta_path(self, name: str) -> str:
        folder = os.path.join(self.root, "meta")
        self._check_dir(folder, owner=False)
        return os.path.join(folder, check_file_name(name, "cached file name"))

    def _open_lock(self, path: str) -> int:
        return self._create(path, os.O_RDWR | os.O_CREAT)

    # -- pins --------------------------------------------------------------------------

    def pin(self, name: str) -> Pin:
        """Take a shared lock on ``name``'s pin (waits out an eviction in progress)."""
        path = self._pin_path(name)
        fd = self._open_lock(path)
        try:
            _wait_lock(fd, fcntl.LOCK_SH, path, self.lock_timeout, f"evicting {name}")
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
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None  # not a file this cache made (a planted link): replaced by the next download
        if not self._trusted(st):
            return None  # another user could have written it: replaced by the next download
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

    def _trusted(self, st: os.stat_result) -> bool:
        """Whether a cached file may be served: as the folders, no one else could have written it.

        Never writable by every user; unless the cache is shared, ours and not writable by
        the group either (the cache makes its files ``0o644``, owned by the reader).
        """
        if st.st_mode & stat.S_IWOTH:
            return False
        return self.shared or (st.st_uid == os.geteuid() and not st.st_mode & stat.S_IWGRP)

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
            fd = _open_fd(self._meta_path(name), os.O_RDONLY)
            try:
                fields = os.read(fd, 4096).decode("ascii").split()
            finally:
                _close_fd(fd)
            digest, size, inode = fields[:3]
            return digest, int(size), int(inode), fields[3] if len(fields) > 3 else ""
        except (OSError, ValueError, CacheError):
            return None

    def generation(self, name: str) -> str | None:
        """The generation of the copy now in ``data/<name>`` (``None`` if it has no record of one)."""
        record = self._read_record(name)
        try:
            inode = os.lstat(self.data_path(name)).st_ino
        except FileNotFoundError:
            return None
        if record is None or record[2] != inode or not record[3]:
            return None
        return record[3]

    def _write_record(self, entry: FileEntry, part: str) -> None:
        """Record what ``part`` was verified against (caller holds the cache lock)."""
        meta = self._meta_path(entry.name)
        # A leading dot: no plain name (no shard's record) can be this name.
        tmp = os.path.join(self.root, "meta", f".{entry.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = self._create(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            text = f"{entry.hash or '-'} {entry.num_bytes} {os.stat(part).st_ino} {secrets.token_hex(8)}\n"
            os.write(fd, text.encode("ascii"))
        except OSError as exc:
            _close_fd(fd)
            _unlink(tmp)
            raise self._no_space(exc, entry) from exc
        _close_fd(fd)
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
        follow: Callable[[], None] | None = None,
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
            follow: Called every few milliseconds while another process downloads the
                file (see :meth:`read_landing`).

        Returns:
            The cached path, or ``None`` if ``wait`` is false and there was no room, or
            the download was cancelled.
        """
        path = self.lookup(entry)
        if path is not None:
            return path
        dl_fd = self._open_lock(self._download_lock_path(entry.name))
        try:
            if not self._lock_download(dl_fd, wait, entry, follow):
                return None
            path = self.lookup(entry)  # someone else downloaded it meanwhile
            if path is not None:
                return path
            self._drop(entry.name)  # a stale or damaged copy: it must not hold room the download needs
            with self._reservation(entry, wait, on_wait) as part:
                if part is None:
                    return None
                try:
                    download(part, cancelled)
                except OSError as exc:
                    if _is_no_space(exc):
                        raise self._no_space(exc, entry) from exc
                    raise
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
                        self._check_dir(os.path.dirname(final), owner=False)
                        os.replace(part, final)
                    except FileNotFoundError as exc:
                        raise CacheError(
                            f"{self.root}: the cache directory was deleted while {entry.name} was downloaded "
                            "into it; the next read downloads it again"
                        ) from exc
            return final
        finally:
            _close_fd(dl_fd)

    def _lock_download(self, fd: int, wait: bool, entry: FileEntry, follow: Callable[[], None] | None = None) -> bool:
        if not wait:
            return _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The holder's download is bounded by its retry policy; the wait by lock_timeout.
        path = self._download_lock_path(entry.name)
        _wait_lock(fd, fcntl.LOCK_EX, path, self.lock_timeout, f"downloading {entry.name}", follow)
        return True

    # -- a download in progress, seen from other processes ------------------------------

    def _landing_path(self, name: str) -> str:
        return os.path.join(self.root, "landing", check_file_name(name, "cached file name"))

    def publish_landing(self, name: str, part: str, attempt: int, landed: list[tuple[int, int]]) -> None:
        """Say which byte ranges of the download of ``name`` into ``part`` have been written (atomically).

        Another process waiting for the same file reads them (:meth:`read_landing`) and
        serves those ranges from the part file before the file is complete.
        """
        record = {"part": os.path.basename(part), "attempt": attempt, "landed": landed}
        final = self._landing_path(name)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = self._create(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, json.dumps(record).encode())
            finally:
                _close_fd(fd)
            os.replace(tmp, final)
        except OSError:
            _unlink(tmp)  # progress not shown: the others wait for the whole file, as before

    def clear_landing(self, name: str) -> None:
        """The download of ``name`` ended (done or failed): its progress is no longer shown."""
        _unlink(self._landing_path(name))

    def read_landing(self, name: str) -> tuple[str, int, list[tuple[int, int]]] | None:
        """``(part path, attempt, landed ranges)`` of another process's download of ``name``, if it shows one.

        The part path is always inside this cache's ``tmp/`` (a name that is not a part
        file of ``name`` is ignored).
        """
        try:
            fd = _open_fd(self._landing_path(name), os.O_RDONLY)
        except (FileNotFoundError, CacheError):
            return None
        try:
            raw = os.read(fd, 1 << 16)
        finally:
            _close_fd(fd)
        try:
            record = json.loads(raw)
            part, attempt = str(record["part"]), int(record["attempt"])
            landed = [(int(a), int(b)) for a, b in record["landed"]]
        except (ValueError, KeyError, TypeError):
            return None
        if "/" in part or not part.startswith(f"{name}.") or not part.endswith(".part"):
            return None
        return os.path.join(self.root, "tmp", part), attempt, landed

    def _no_space(self, exc: BaseException, entry: FileEntry) -> BaseException:
        """The :class:`CacheError` for a full disk (``exc`` itself if it is not one)."""
        if not _is_no_space(exc):
            return exc
        try:
            free = format_bytes(shutil.disk_usage(self.root).free)
        except OSError:
            free = "unknown"
        return CacheError(
            f"{self.root}: no space left on the cache's disk for {entry.name} ({format_bytes(entry.num_bytes)} "
            f"needed, {free} free); free space there, or pass a smaller cache_limit or a cache_dir on a "
            "larger disk"
        )

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
        lock = self._download_lock_path(entry.name)
        fd = self._open_lock(lock)
        try:
            # No download of this file meanwhile (bounded by its retries).
            _wait_lock(fd, fcntl.LOCK_EX, lock, self.lock_timeout, f"downloading {entry.name}")
            path = self.data_path(entry.name)
            try:
                st = os.lstat(path)
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
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
        return entry.digest_problem(hasher.hexdigest(), entry.algorithm) is None

    def _drop(self, name: str) -> None:
        """Delete ``data/<name>`` (a stale copy, about to be replaced) and its record."""
        try:
            inode = os.lstat(self.data_path(name)).st_ino
        except FileNotFoundError:
            return
        with self._cache_lock():
            self._drop_locked(name, inode)

    def _drop_locked(self, name: str, inode: int) -> None:
        """Delete ``data/<name>`` if it is still ``inode``, and its record (caller holds the cache lock)."""
        path = self.data_path(name)
        try:
            if os.lstat(path).st_ino != inode:
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
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
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
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: before the cache lock drops
            return part, fd

    @contextmanager
    def _cache_lock(self) -> Iterator[None]:
        path = os.path.join(self.root, ".lock")
        fd = self._open_lock(path)
        try:
            _wait_lock(fd, fcntl.LOCK_EX, path, self.lock_timeout, "counting or evicting")
            yield
        finally:
            _close_fd(fd)

    def _used_bytes(self) -> int:
        """Bytes in ``data/`` plus bytes reserved by live parts; deletes dead parts."""
        total = 0
        for item in self._scan("data"):
            try:
                total += item.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
        for item in self._scan("tmp"):
            reserved = _reserved_bytes(item.name)
            if reserved is None or not self._part_is_live(item.path):
                _unlink(item.path)  # a crashed downloader's leftover
                continue
            try:
                total += max(reserved, item.stat(follow_symlinks=False).st_size)
            except FileNotFoundError:
                continue
        return total

    def _part_is_live(self, path: str) -> bool:
        try:
            fd = _open_fd(path, os.O_RDONLY)
        except (FileNotFoundError, CacheError):
            return False  # gone, or a link (deleting it deletes the link)
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
                st = item.stat(follow_symlinks=False)
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


def _is_no_space(exc: BaseException) -> bool:
    """True if ``exc`` (or a cause) is a full disk or an exhausted quota."""
    node: BaseException | None = exc
    for _ in range(8):
        if node is None:
            return False
        if isinstance(node, OSError) and node.errno in _NO_SPACE:
            return True
        node = node.__cause__ or node.__context__
    return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
