"""How one file comes into the cache: its download attempts, checked, shown as they land.

:class:`Filler` is what :class:`~.remote.RemoteStorage` calls for a file it has pinned::

    fill(entry, landing=None)   -> ShardCache.fill with a downloader: the file's parts are
                                   written into a part file, handed to ``landing`` (a reader
                                   of this process reading them as they land, see
                                   .bytes.Landing) and shown to the other processes of the
                                   machine (ShardCache.publish_landing); a copy that fails
                                   its check is fetched once more (DOWNLOAD_REFETCHES), then
                                   it is bad at its source (CorruptShardError naming its URL)
    versioned(entry)            -> a file the manifest gives no hash is keyed by its version
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from .._errors import CorruptShardError
from .._files import FileEntry
from .bytes import Landing
from .cache import ShardCache
from .parts import FIRST_PART, merge_range
from .transport import RemoteFiles

__all__ = ["DOWNLOAD_REFETCHES", "Filler"]

log = logging.getLogger("streamload")

#: A download that fails its size or hash check is fetched whole this many times more (the
#: bytes may have been damaged in transit, by a faulty middlebox or NIC); then the file is
#: bad at its source.
DOWNLOAD_REFETCHES = 1
#: A download shows its progress to the other processes each time this many more bytes landed.
_SHOW_EVERY = 1 << 20


class _Shown:
    """The ranges of one download attempt written so far, shown to the other processes."""

    def __init__(self, cache: ShardCache, name: str, part: str, attempt: int) -> None:
        self._cache, self._name, self._part, self._attempt = cache, name, part, attempt
        self._landed: list[tuple[int, int]] = []
        self._unshown = 0
        self._lock = threading.Lock()

    def land(self, start: int, end: int) -> None:
        with self._lock:
            self._landed = merge_range(self._landed, start, end)
            self._unshown += end - start
            if self._unshown < _SHOW_EVERY:
                return  # a follower sees the rest at the next step, or the whole file
            self._unshown = 0
            self._cache.publish_landing(self._name, self._part, self._attempt, self._landed)


class Filler:
    """Brings files into one cache from one transport.

    Args:
        cache: The cache.
        remote: The files' transport.
        fetched: Called after each whole download that came complete (the read-ahead depth counts them).
    """

    def __init__(self, cache: ShardCache, remote: RemoteFiles, fetched: Callable[[], None]) -> None:
        self.cache = cache
        self.remote = remote
        self._fetched = fetched
        #: Downloads fetched again after failing their check (see DOWNLOAD_REFETCHES).
        self.refetched = 0

    def fill(
        self,
        entry: FileEntry,
        stop: threading.Event,
        landing: Landing | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> str:
        """Bring ``entry`` into the cache (the caller holds its pin); return its path.

        Raises:
            CorruptShardError: Every copy failed its check: the message names the URL.
        """
        url = self.remote.url_of(entry.name)
        entry = self.versioned(entry)
        for attempt in range(1 + DOWNLOAD_REFETCHES):
            try:
                follow = None if landing is None else self._follower(entry, landing)
                path = self.cache.fill(entry, self.downloader(entry, stop, landing), on_wait=on_wait, follow=follow)
                assert path is not None
                return path
            except CorruptShardError as exc:
                if attempt == DOWNLOAD_REFETCHES:
                    raise CorruptShardError(
                        f"{url}: {exc} (downloaded {attempt + 1} times, each copy failed its check: the file "
                        "is bad at its source)"
                    ) from exc
                self.refetched += 1
                log.warning("%s: %s (bytes damaged in transit?); downloading it again", url, exc)
        raise AssertionError("unreachable")

    def versioned(self, entry: FileEntry) -> FileEntry:
        """``entry``, or for a file the manifest gives no hash, the same with its object version as "hash".

        A dataset written without hashes and rewritten at the same URL may have files of the
        same names and sizes but other bytes: with nothing to check them against, a cached
        copy is served only while the object's version (ETag, generation, or mtime and
        inode) is the one it was downloaded at. It costs one metadata request per file
        opened; the version is never checked as a digest (no algorithm).
        """
        if entry.hash is not None:
            return entry
        version = self.remote.version(entry.name)
        return entry if version is None else FileEntry(entry.name, entry.num_bytes, f"version-{version}")

    def downloader(
        self, entry: FileEntry, stop: threading.Event, landing: Landing | None = None, *, urgent: bool = True
    ) -> Callable[[str, Callable[[], bool]], None]:
        """What :meth:`ShardCache.fill` calls to download ``entry`` into a part file (once per attempt).

        The bytes written are handed to ``landing`` (a reader of this process) and shown
        to the other processes of the machine (:meth:`ShardCache.publish_landing`).
        """
        attempts = 0

        def download(part: str, cancelled: Callable[[], bool]) -> None:
            nonlocal attempts
            attempts += 1
            if landing is not None:
                landing.begin(part)
            shown = _Shown(self.cache, entry.name, part, attempts)

            def landed(start: int, end: int) -> None:
                if landing is not None:
                    landing.land(start, end)
                shown.land(start, end)

            try:
                done = self.remote.download(
                    entry.name,
                    part,
                    cancelled,
                    stop,
                    max_bytes=entry.num_bytes,
                    landed=landed,
                    first_part=None if landing is None else FIRST_PART,
                    urgent=urgent,
                )
            finally:
                self.cache.clear_landing(entry.name)
            if done == entry.num_bytes and not cancelled():
                self._fetched()

        return download

    def _follower(self, entry: FileEntry, landing: Landing) -> Callable[[], None]:
        """While another process downloads ``entry``: hand what it shows as landed to ``landing``.

        So a reader whose first shard another worker of the machine is downloading reads
        its samples as they land there, not after the whole file (each checked by its own
        digest as always).
        """
        seen: tuple[str, int] | None = None

        def follow() -> None:
            nonlocal seen
            shown = self.cache.read_landing(entry.name)
            if shown is None:
                return
            part, attempt, ranges = shown
            if (part, attempt) != seen:
                try:
                    # Another user's part file, or one others could write, is never read
                    # early (tmp/ is a trusted folder: the file checked is the one opened).
                    if not self.cache.folder.trusted(os.lstat(part)):
                        return  # the whole file is waited for, and checked, as before
                    landing.begin(part)
                except OSError:
                    return  # renamed into place or gone: the wait for the lock ends soon
                seen = (part, attempt)
            for start, end in ranges:
                landing.land(start, end)

        return follow
