"""What comes into the cache: one downloader per file, into a reserved part, verified, then renamed.

``downloads/<name>`` is held exclusively for the whole download (by one thread of one
process of the machine; the others wait on it, following its progress in ``landing/``).
The download goes to a part file in ``tmp/`` reserved against the limit
(:meth:`~streamload.storage.cache.room.Room.reservation`), is checked against the entry
(:meth:`~streamload.storage.cache.copies.Copies.verify`), and is renamed into ``data/``
under ``.lock`` just after its record is written to ``meta/``: ``data/<name>`` only ever
appears complete and verified. A full disk is a :class:`~streamload.CacheError`, never a
corrupt shard.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

from ..._errors import CacheError
from ..._files import FileEntry
from .copies import Copies, is_no_space
from .flocks import close_fd, try_lock, wait_lock
from .layout import CacheDir
from .room import Room
from .settings import CacheSettings
from .stats import StatsCounter

__all__ = ["Intake"]

#: ``download(part_path, cancelled)`` writes the remote bytes to ``part_path``.
Download = Callable[[str, Callable[[], bool]], None]


class Intake:
    """What comes into one cache directory: its downloads, each locked, reserved, verified and renamed in.

    Args:
        folder: The cache directory.
        settings: The cache's settings (``lock_timeout``).
        copies: The verified copies (looked up, checked, recorded).
        room: Where a download reserves its bytes.
        counter: Where downloads are counted.
    """

    def __init__(
        self, folder: CacheDir, settings: CacheSettings, copies: Copies, room: Room, counter: StatsCounter
    ) -> None:
        self.folder = folder
        self.settings = settings
        self.copies = copies
        self.room = room
        self.counter = counter

    def fill(
        self,
        entry: FileEntry,
        download: Download,
        *,
        wait: bool = True,
        on_wait: Callable[[], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        follow: Callable[[], None] | None = None,
    ) -> str | None:
        """Make sure ``entry`` is in the cache (see :meth:`~streamload.storage.cache.ShardCache.fill`)."""
        path = self.copies.lookup(entry)
        if path is not None:
            return path
        dl_fd = self.folder.open_lock(self.folder.download_lock_path(entry.name))
        try:
            if not self._lock_download(dl_fd, wait, entry, follow):
                return None
            path = self.copies.lookup(entry)  # someone else downloaded it meanwhile
            if path is not None:
                return path
            self.copies.drop(entry.name)  # a stale or damaged copy: it must not hold room the download needs
            with self.room.reservation(entry, wait, on_wait) as part:
                if part is None:
                    return None
                try:
                    download(part, cancelled)
                except OSError as exc:
                    if is_no_space(exc):
                        raise self.copies.no_space(exc, entry) from exc
                    raise
                if cancelled():
                    return None
                self.copies.verify(part, entry)
                return self._publish(entry, part)
        finally:
            close_fd(dl_fd)

    def _publish(self, entry: FileEntry, part: str) -> str:
        """Rename the verified ``part`` into ``data/``, its record written first."""
        final = self.folder.data_path(entry.name)
        with self.folder.cache_lock():  # so a count under the lock never sees it twice
            self.copies.write_record(entry, part)
            self.counter.downloaded(entry.num_bytes)  # before it shows: a reader that finds it sees it counted
            try:
                self.folder.check_dir(os.path.dirname(final), owner=False)
                os.replace(part, final)
            except FileNotFoundError as exc:
                raise CacheError(
                    f"{self.folder.root}: the cache directory was deleted while {entry.name} was downloaded "
                    "into it; the next read downloads it again"
                ) from exc
        return final

    def _lock_download(self, fd: int, wait: bool, entry: FileEntry, follow: Callable[[], None] | None) -> bool:
        if not wait:
            return try_lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The holder's download is bounded by its retry policy; the wait by lock_timeout.
        path = self.folder.download_lock_path(entry.name)
        wait_lock(fd, fcntl.LOCK_EX, path, self.settings.lock_timeout, f"downloading {entry.name}", follow)
        return True
