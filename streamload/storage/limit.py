"""The bound of a remote dataset's cache, and how it is shared among the readers of a machine.

``cache_limit`` bounds the bytes of one dataset's cache directory:

* ``None`` (the default): half of the space the cache could use when the storage is
  opened (the free space of its filesystem plus what this dataset's cache already holds),
  and at least :data:`MIN_CACHE_SHARDS` of the largest shards. It is logged once (INFO),
  and :class:`~streamload.dataref.DatasetRef` hands the number it chose to every worker, so
  the processes of a job share one bound.
* ``"unbounded"``: no bound (the cache grows until every file is cached).
* bytes, or a string like ``"20GB"``: that bound; at least two of the largest shards.

The limit is shared among the readers registered in the cache (see .admission): each keeps
some shards open, and read-ahead uses what its share leaves.
"""

from __future__ import annotations

import logging
import shutil

from .._errors import CacheError
from .._files import FileEntry
from .._units import format_bytes
from .._validate import UNBOUNDED
from .cache import ShardCache

__all__ = ["DEFAULT_CACHE_FRACTION", "MIN_CACHE_SHARDS", "CacheLimit"]

log = logging.getLogger("streamload")

#: Smallest workable cache: the shard being read plus the one being fetched.
MIN_CACHE_SHARDS = 2
#: Without ``cache_limit``: this fraction of the space the cache could use (free + its own).
DEFAULT_CACHE_FRACTION = 0.5
#: Cache directories whose default bound this process logged already.
_LOGGED_DEFAULTS: set[str] = set()


class CacheLimit:
    """The bound of one dataset's cache: chosen or given, checked, and shared among the readers.

    Args:
        url: The dataset's URL (for messages).
        cache_root: The dataset's cache directory (for messages and the default bound).
        cache: The cache it bounds (its ``limit`` follows this one's).
        limit: The ``cache_limit`` setting, checked: bytes, ``None`` (the default bound,
            measured now), or ``"unbounded"``.
    """

    def __init__(self, url: str, cache_root: str, cache: ShardCache, limit: int | str | None) -> None:
        self.url = url
        self.cache_root = cache_root
        self.cache = cache
        self.space = 0  # bytes the cache could use, measured for the default bound
        #: The bound chosen here when no ``cache_limit`` was given, else ``None``.
        self.default_limit = self._default_limit() if limit is None else None
        #: The bound in bytes (``None``: unbounded).
        self.limit = self.default_limit if limit is None else None if limit == UNBOUNDED else int(limit)
        cache.limit = self.limit

    def _default_limit(self) -> int:
        """Half of the space the cache could use: its filesystem's free space plus what it holds."""
        self.space = shutil.disk_usage(self.cache_root).free + self.cache.usage()
        return int(DEFAULT_CACHE_FRACTION * self.space)

    def check_capacity(self, largest: int) -> None:
        """Check the cache can hold :data:`MIN_CACHE_SHARDS` files of ``largest`` bytes.

        Raises:
            CacheError: If ``cache_limit`` is below that.
        """
        need = MIN_CACHE_SHARDS * largest
        if self.default_limit is not None and self.limit is not None:
            if self.limit < need:  # a small disk: the default still lets a reader work
                self.limit = self.cache.limit = self.default_limit = need
                if need > self.space:
                    log.warning(
                        "cache of %s in %s: its filesystem has room for %s, less than the %s two of the "
                        "largest shards need; downloads will fail when it is full (pass cache_dir= on a larger one)",
                        self.url,
                        self.cache_root,
                        format_bytes(self.space),
                        format_bytes(need),
                    )
            self._log_default(largest)
        if self.limit is not None and self.limit < need:
            raise CacheError(
                f"cache_limit={format_bytes(self.limit)} is too small for {self.url}: the largest shard "
                f"with its sidecar is {format_bytes(largest)}, and a reader needs at least "
                f"{MIN_CACHE_SHARDS} of them ({format_bytes(need)}) cached at once"
            )

    def _log_default(self, largest: int) -> None:
        if self.cache_root in _LOGGED_DEFAULTS:
            return
        _LOGGED_DEFAULTS.add(self.cache_root)
        assert self.limit is not None
        log.info(
            "cache of %s in %s: no cache_limit given, so it holds at most %s (half of the free space of its "
            "filesystem and of what it holds already, at least %d x the largest shard, %s); pass "
            "cache_limit= to choose, or cache_limit=%r for no bound",
            self.url,
            self.cache_root,
            format_bytes(self.limit),
            MIN_CACHE_SHARDS,
            format_bytes(largest),
            UNBOUNDED,
        )

    def check_fits(self, entry: FileEntry, url: str) -> None:
        """Check the cache can hold :data:`MIN_CACHE_SHARDS` files of ``entry``'s size (``url`` names it).

        Raises:
            CacheError: If it cannot.
        """
        if self.limit is not None and MIN_CACHE_SHARDS * entry.num_bytes > self.limit:
            raise CacheError(
                f"cache_limit={format_bytes(self.limit)} is too small for {url} "
                f"({format_bytes(entry.num_bytes)}): it must hold at least {MIN_CACHE_SHARDS} such files"
            )

    def max_open(self, largest: int, readers: int) -> int | None:
        """How many shards of ``largest`` bytes one of ``readers`` registered readers should keep open at once.

        The limit is shared among the registered readers; half of a reader's share is
        left for downloads ahead.
        """
        if self.limit is None or largest <= 0:
            return None
        share = self.limit // largest // max(1, readers)
        return max(1, share // 2 - 1)

    def ahead_room(self, largest: int, readers: int) -> int | None:
        """Shards ahead one of ``readers`` registered readers has room for (``None``: no bound).

        Its share (the limit divided among the readers) less the shards it keeps open
        (:meth:`max_open`) and the one it is about to open: the window is named before
        that shard is pinned, and a deeper window would make room by evicting it (the
        least recently used). At least one.
        """
        if self.limit is None or largest <= 0:
            return None
        share = self.limit // largest // max(1, readers)
        open_shards = self.max_open(largest, readers) or 1
        return max(1, share - open_shards - 1)
