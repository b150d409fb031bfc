"""Room in the cache: pins, reservations, least-recently-used eviction, the limit.

The bytes in ``data/`` plus the bytes reserved by ``tmp/`` never exceed the limit: room is
made, and a download reserved, under ``.lock``. A file with a shared lock on its pin is
never deleted: eviction takes the pin's lock exclusively *without waiting* and skips the
file if that fails. A part file whose writer died is unlocked; the next process that makes
room deletes it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..._errors import CacheError
from ..._files import FileEntry, check_file_name
from ..._units import format_bytes
from .flocks import HeldFd, close_fd, open_fd, try_lock, wait_lock
from .layout import CacheDir, unlink
from .readers import Readers
from .settings import CacheSettings
from .stats import StatsCounter

__all__ = ["Pin", "Room"]

log = logging.getLogger("streamload")

#: Longest sleep between two tries to make room (room is mostly freed by a download ending).
_MAX_POLL = 0.25


class Pin(HeldFd):
    """A shared lock on one cached file: while held, the file is not evicted."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__(fd)
        self.name = name

    def close(self) -> None:
        """Release the pin (closing the descriptor drops the lock; in a forked child, nothing)."""
        self.release()


class Room:
    """The bytes one cache directory holds and reserves, within ``settings.limit``.

    Args:
        folder: The cache directory.
        settings: The cache's settings (``limit``, ``wait_timeout``, ``log_every``, ``lock_timeout``).
        counter: Where evictions are counted.
        readers: The registered readers (named when room is short).
    """

    def __init__(self, folder: CacheDir, settings: CacheSettings, counter: StatsCounter, readers: Readers) -> None:
        self.folder = folder
        self.settings = settings
        self.counter = counter
        self.readers = readers

    def pin(self, name: str) -> Pin:
        """Take a shared lock on ``name``'s pin (waits out an eviction in progress)."""
        path = self.folder.pin_path(name)
        fd = self.folder.open_lock(path)
        try:
            wait_lock(fd, fcntl.LOCK_SH, path, self.settings.lock_timeout, f"evicting {name}")
        except BaseException:
            close_fd(fd)
            raise
        return Pin(fd, name)

    @contextmanager
    def reservation(self, entry: FileEntry, wait: bool, on_wait: Callable[[], None] | None) -> Iterator[str | None]:
        """Reserve ``entry.num_bytes`` as a locked ``tmp/`` part file; yield its path.

        Yields ``None`` if ``wait`` is false and no room can be made now. The part file is
        deleted on exit unless it was renamed into ``data/``.

        Raises:
            CacheError: If no room was made within ``wait_timeout``.
        """
        settings = self.settings
        started = time.monotonic()
        deadline = started + settings.wait_timeout
        next_log = started + min(settings.log_every, settings.wait_timeout)
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
                    f"{self.folder.root}: no room for {entry.name} ({format_bytes(entry.num_bytes)}) within "
                    f"cache_limit={format_bytes(settings.limit or 0)} after {settings.wait_timeout:.0f} s: every "
                    f"cached file is in use by a reader ({self.readers.count()} registered); raise cache_limit "
                    "(at least (readers + 1) x the largest shard on this machine)"
                )
            if now >= next_log:
                next_log = now + settings.log_every
                log.warning(
                    "%s: waiting for room for %s (%s) within cache_limit=%s: %.0f s of %.0f s; "
                    "%d reader(s) registered, %s used",
                    self.folder.root,
                    entry.name,
                    format_bytes(entry.num_bytes),
                    format_bytes(settings.limit or 0),
                    now - started,
                    settings.wait_timeout,
                    self.readers.count(),
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
            close_fd(fd)

    def _try_reserve(self, entry: FileEntry) -> tuple[str, int] | None:
        """Under the cache lock: evict until ``entry`` fits, then create its part file."""
        with self.folder.cache_lock():
            limit = self.settings.limit
            if limit is not None:
                used = self._used_bytes()
                if used + entry.num_bytes > limit:
                    used -= self._evict(used + entry.num_bytes - limit)
                if used + entry.num_bytes > limit:
                    return None
            token = secrets.token_hex(4)
            name = f"{entry.name}.{entry.num_bytes}.{os.getpid()}.{token}.part"
            part = os.path.join(self.folder.root, "tmp", name)
            fd = self.folder.create(part, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: before the cache lock drops
            return part, fd

    def usage(self) -> int:
        """Return the bytes the cache holds and reserves now."""
        with self.folder.cache_lock():
            return self._used_bytes()

    def _used_bytes(self) -> int:
        """Bytes in ``data/`` plus bytes reserved by live parts; deletes dead parts (caller holds the cache lock)."""
        total = 0
        for item in self.folder.scan("data"):
            try:
                total += item.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
        for item in self.folder.scan("tmp"):
            reserved = reserved_bytes(item.name)
            if reserved is None or not _part_is_live(item.path):
                unlink(item.path)  # a crashed downloader's leftover
                continue
            try:
                total += max(reserved, item.stat(follow_symlinks=False).st_size)
            except FileNotFoundError:
                continue
        return total

    def _evict(self, needed: int) -> int:
        """Delete unpinned files, least recently used first, until ``needed`` bytes are freed.

        Returns the bytes freed (maybe less, if the rest is pinned). Caller holds the cache lock.
        """
        candidates: list[tuple[float, str, int]] = []
        for item in self.folder.scan("data"):
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
            unlink(os.path.join(self.folder.root, "data", os.path.basename(name)))
            return True
        fd = self.folder.open_lock(self.folder.pin_path(name))
        try:
            if not try_lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                return False  # in use (or being read ahead) by some process
            unlink(self.folder.data_path(name))
            unlink(self.folder.meta_path(name))
        finally:
            close_fd(fd)
        self.counter.evicted()
        return True


def _part_is_live(path: str) -> bool:
    """Whether the part file at ``path`` is locked by its writer (a download in progress)."""
    try:
        fd = open_fd(path, os.O_RDONLY)
    except (FileNotFoundError, CacheError):
        return False  # gone, or a link (deleting it deletes the link)
    try:
        return not try_lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        close_fd(fd)


def reserved_bytes(part_name: str) -> int | None:
    """The reservation encoded in a part file's name, or ``None`` if it is not one."""
    pieces = part_name.split(".")
    if len(pieces) < 5 or pieces[-1] != "part" or not pieces[-4].isdigit():
        return None
    return int(pieces[-4])
