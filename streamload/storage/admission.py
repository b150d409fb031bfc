"""Admission: how many processes read through one cache, and whether its limit holds them all.

Each process reading registers in the cache while it reads (a flock'd file in
``readers/``, gone when the process dies; see :class:`~streamload.storage.cache.ShardCache`);
a process with several readers (a :class:`streamload.Loader`'s threads) counts each of them.
A reader keeps one shard pinned while it reads it, and readers (DataLoader workers) may stop
for long with their pins held, so N registered readers need room for N of the largest
shards: a reader that would make them more than the limit holds fails at once with a
:class:`~streamload.CacheError` naming the count, the limit and what to raise it to, instead
of waiting for room. The limit is shared among the registered readers when each is told
how many shards it may keep open.
"""

from __future__ import annotations

import threading
import time

from .._errors import CacheError
from .._units import format_bytes
from .cache import Registration, ShardCache

__all__ = ["Admission"]

#: Seconds a count of the registered readers is reused (it is taken at every shard opened).
_READERS_TTL = 1.0


class Admission:
    """This process's registration in a cache, shared by all its readers.

    Args:
        cache: The cache directory.
        url: The dataset, named in messages.
    """

    def __init__(self, cache: ShardCache, url: str) -> None:
        self.cache = cache
        self.url = url
        self._lock = threading.Lock()
        self._registration: Registration | None = None
        self._readers = 0  # this process's open readers (one registration for all)
        self._counted = (0, -_READERS_TTL)  # (registered readers, when counted)

    def forget_parent(self) -> None:
        """In a forked child: the parent's registration is the parent's (its descriptor is closed here)."""
        if self._registration is not None:
            self._registration.fd = -1

    def register(self, largest: int, limit: int | None) -> None:
        """A reader of shards of up to ``largest`` bytes starts: register this process (once).

        Raises:
            CacheError: If the registered readers, this one included, need more room than
                ``limit``: each keeps one shard cached while it reads (waiting would stall
                the DataLoader, which hands out samples in order).
        """
        with self._lock:
            self._readers += 1
            first = self._registration is None
            if first:
                try:
                    self._registration = self.cache.register()
                except BaseException:
                    self._readers -= 1
                    raise
        if limit is None or largest <= 0:
            return
        readers = self.registered(fresh=first)  # another thread of this process: its own count is exact
        if readers * largest > limit:
            self.unregister()
            enough = (readers + 1) * largest
            raise CacheError(
                f"{readers} readers share the cache {self.cache.root} of {self.url} (DataLoader workers, Loader "
                "threads and ranks on this machine, this one included), "
                f"but cache_limit={format_bytes(limit)} holds only "
                f"{limit // largest} of its largest shards ({format_bytes(largest)} with the sidecar): each "
                "reader keeps the shard it reads cached, so they would wait on each other's room (for up to "
                f"{self.cache.wait_timeout:.0f} s); raise cache_limit to at least {format_bytes(enough)} "
                f"((readers + 1) x the largest shard) or use fewer readers"
            )

    def unregister(self) -> None:
        """A reader of this process ended; the last one unregisters the process."""
        with self._lock:
            self._readers = max(0, self._readers - 1)
            registration = self._registration if self._readers == 0 else None
            if registration is not None:
                self._registration = None
        if registration is not None:
            registration.close()

    def close(self) -> None:
        """Unregister this process, whatever its readers."""
        with self._lock:
            registration, self._registration, self._readers = self._registration, None, 0
        if registration is not None:
            registration.close()

    def registered(self, fresh: bool = False) -> int:
        """Readers of the cache: each reader of this process, and one per other registered process.

        A thread loader's threads count one each. The registrations are counted again at
        most every :data:`_READERS_TTL` s.
        """
        count, when = self._counted
        now = time.monotonic()
        if fresh or now - when >= _READERS_TTL:
            count = self.cache.readers()
            self._counted = (count, now)
        with self._lock:
            mine = self._readers if self._registration is not None else 0
        return count + max(0, mine - 1)
