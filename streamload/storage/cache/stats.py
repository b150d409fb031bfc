"""What one process's cache did: hits, downloads, evictions, copies discarded."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..._fork import ProcessLocal

__all__ = ["CacheStats", "StatsCounter"]


@dataclass
class CacheStats:
    """What one process's cache did (per process; the server counts for everyone)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    #: Cached copies found corrupt and deleted, to be downloaded again.
    discarded: int = 0


class StatsCounter:
    """Counts into one :class:`CacheStats` from any thread of the process.

    A forked child goes on from the parent's counts, with a lock of its own (one a
    parent's thread held at the fork would never be released in the child).
    """

    def __init__(self) -> None:
        self.stats = CacheStats()
        self._lock: ProcessLocal[threading.Lock] = ProcessLocal(threading.Lock)

    def hit(self) -> None:
        """A lookup found a verified copy."""
        with self._lock.get():
            self.stats.hits += 1

    def downloaded(self, num_bytes: int) -> None:
        """A download of ``num_bytes`` was verified (counted before it shows in ``data/``)."""
        with self._lock.get():
            self.stats.downloads += 1
            self.stats.bytes_downloaded += num_bytes

    def evicted(self) -> None:
        """An unpinned copy was deleted to make room."""
        with self._lock.get():
            self.stats.evictions += 1

    def discarded(self) -> None:
        """A copy a reader found corrupt was deleted."""
        with self._lock.get():
            self.stats.discarded += 1
