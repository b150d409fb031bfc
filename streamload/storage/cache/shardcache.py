"""The facade of one dataset's cache directory, :class:`ShardCache`.

It is made of the parts in this package: layout, copies, room, readers, downloads,
landings and stats.
"""

from __future__ import annotations

from collections.abc import Callable

from ..._files import FileEntry
from .copies import Copies
from .intake import Download, Intake
from .landing import Landings
from .layout import CacheDir
from .readers import Readers, Registration
from .room import Pin, Room
from .settings import (
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_LOG_EVERY,
    DEFAULT_WAIT_TIMEOUT,
    CacheSettings,
    Setting,
)
from .stats import CacheStats, StatsCounter

__all__ = ["ShardCache"]


class ShardCache:
    """One dataset's cache directory (see :mod:`streamload.storage.cache` for its layout).

    Args:
        root: The dataset's cache directory (created).
        limit: Most bytes the cache may hold (``None``: no bound).
        verify_hash: Check downloads against the manifest hash (size is always checked).
        wait_timeout: Seconds an acquire waits for other readers to free room.
        log_every: Seconds between the log lines of an acquire waiting for room.
        lock_timeout: Most seconds any wait for one of the cache's locks lasts.
        shared: Accept a cache folder writable by its group or owned by another user
            (a storage's resolved ``cache_shared``).

    Raises:
        CacheError: If the directory cannot be made, or is not safe from other users.
    """

    limit = Setting[int | None]()
    verify_hash = Setting[bool]()
    wait_timeout = Setting[float]()
    log_every = Setting[float]()
    lock_timeout = Setting[float]()
    shared = Setting[bool]()

    def __init__(
        self,
        root: str,
        limit: int | None,
        *,
        verify_hash: bool = True,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        log_every: float = DEFAULT_LOG_EVERY,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        shared: bool = False,
    ) -> None:
        self.root = root
        #: The settings, shared with the parts (changing one here changes it for all).
        self.settings = CacheSettings(
            limit=limit,
            verify_hash=verify_hash,
            wait_timeout=wait_timeout,
            log_every=log_every,
            lock_timeout=lock_timeout,
            shared=shared,
        )
        self._counter = StatsCounter()
        #: The directory: its folders, paths, trust checks and the cache lock.
        self.folder = CacheDir(root, self.settings)
        self._copies = Copies(self.folder, self.settings, self._counter)
        self._readers = Readers(self.folder)
        self._room = Room(self.folder, self.settings, self._counter, self._readers)
        self._intake = Intake(self.folder, self.settings, self._copies, self._room, self._counter)
        self._landings = Landings(self.folder)

    @property
    def stats(self) -> CacheStats:
        """What this process's cache did (hits, downloads, evictions, copies discarded)."""
        return self._counter.stats

    def data_path(self, name: str) -> str:
        """Return where the complete file ``name`` lives in the cache (its folder checked: no link)."""
        return self.folder.data_path(name)

    # -- pins and room -------------------------------------------------------------------

    def pin(self, name: str) -> Pin:
        """Take a shared lock on ``name``'s pin (waits out an eviction in progress)."""
        return self._room.pin(name)

    def usage(self) -> int:
        """Return the bytes the cache holds and reserves now."""
        return self._room.usage()

    # -- copies --------------------------------------------------------------------------

    def lookup(self, entry: FileEntry) -> str | None:
        """Return the cached path of ``entry`` if present and verified for it (caller pins).

        A file of the right size but verified against another hash (a dataset re-written
        at the same URL), or with no record of its verification, is a miss.
        """
        return self._copies.lookup(entry)

    def generation(self, name: str) -> str | None:
        """The generation of the copy now in ``data/<name>`` (``None`` if it has no record of one)."""
        return self._copies.generation(name)

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
        return self._copies.discard(entry, generation)

    # -- filling -------------------------------------------------------------------------

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

        Raises:
            CacheError: No room within ``wait_timeout``, a lock held past ``lock_timeout``,
                a full disk, or a cache directory deleted or made unsafe meanwhile.
            CorruptShardError: If the downloaded bytes are not the entry's.
        """
        return self._intake.fill(entry, download, wait=wait, on_wait=on_wait, cancelled=cancelled, follow=follow)

    # -- a download in progress, seen from other processes ------------------------------

    def publish_landing(self, name: str, part: str, attempt: int, landed: list[tuple[int, int]]) -> None:
        """Say which byte ranges of the download of ``name`` into ``part`` have been written (atomically).

        Another process waiting for the same file reads them (:meth:`read_landing`) and
        serves those ranges from the part file before the file is complete.
        """
        self._landings.publish(name, part, attempt, landed)

    def clear_landing(self, name: str) -> None:
        """The download of ``name`` ended (done or failed): its progress is no longer shown."""
        self._landings.clear(name)

    def read_landing(self, name: str) -> tuple[str, int, list[tuple[int, int]]] | None:
        """``(part path, attempt, landed ranges)`` of another process's download of ``name``, if it shows one.

        The part path is always inside this cache's ``tmp/`` (a name that is not a part
        file of ``name`` is ignored).
        """
        return self._landings.read(name)

    # -- readers -------------------------------------------------------------------------

    def register(self) -> Registration:
        """Register this process as a reader of the cache until the registration is closed.

        The file appears in ``readers/`` already locked (it is locked under a dot-name,
        then renamed), so a live registration is never taken for a dead one.
        """
        return self._readers.register()

    def readers(self) -> int:
        """Count the live registrations; delete those of dead processes."""
        return self._readers.count()
