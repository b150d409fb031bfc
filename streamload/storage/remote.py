"""Reading a dataset at any fsspec URL through the shared local cache: :class:`RemoteStorage`.

Per process::

    read_bytes("index.json")          -> one GET, retried, size-bounded; never cached
    acquire(entry)                    -> pin in the shared cache (see .cache)
      hit:  data/<name>, mtime bumped  -> local path, no remote call
      miss: reserve room (evict LRU unpinned), download to tmp/ (retried, resumed at
            the byte it stopped), verify size + hash, rename into data/
    prefetch([next files])            -> the same, in `read_ahead` daemon threads, never
                                         waiting for room (nor pinning: an idle reader's
                                         pins would starve the others); see .readahead
    release(entry)                    -> drop the pin: the file becomes evictable

The storage is told what each file must be (:class:`~streamload._files.FileEntry`: size,
digest, algorithm) by its caller; it never reads a manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._errors import CacheError, ConfigError, CorruptShardError
from .._files import FileEntry
from .._units import format_bytes, parse_bytes
from .base import Storage
from .cache import DEFAULT_WAIT_TIMEOUT, CacheStats, Pin, ShardCache
from .readahead import ReadAhead
from .retry import RetryPolicy
from .transport import RemoteFiles

__all__ = ["DEFAULT_READ_AHEAD", "MIN_CACHE_SHARDS", "RemoteStorage", "dataset_cache_key", "default_cache_dir"]

#: Shards each worker downloads ahead of the one it reads.
DEFAULT_READ_AHEAD = 2
#: Smallest workable cache: the shard being read plus the one being fetched.
MIN_CACHE_SHARDS = 2


def default_cache_dir() -> str:
    """``$STREAMLOAD_CACHE`` if set, else ``$XDG_CACHE_HOME/streamload`` or ``~/.cache/streamload``."""
    env = os.environ.get("STREAMLOAD_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "streamload")


def dataset_cache_key(url: str, storage_options: Mapping[str, Any] | None) -> str:
    """Return a short hash naming a dataset's cache directory: of its URL and endpoint.

    The same ``s3://bucket/x`` on two servers must not share a cache.
    """
    client = (storage_options or {}).get("client_kwargs") or {}
    endpoint = client.get("endpoint_url") if isinstance(client, Mapping) else None
    endpoint = endpoint or (storage_options or {}).get("endpoint_url")
    text = json.dumps([url.rstrip("/"), endpoint])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class RemoteStorage(Storage):
    """A dataset at a remote fsspec URL, read through a bounded, shared local cache.

    Args:
        url: The dataset's URL prefix (``s3://bucket/prefix``...).
        storage_options: Passed to the fsspec filesystem (credentials, ``client_kwargs``,
            ``anon``...). Without them, fsspec's usual sources apply (``AWS_*`` variables,
            ``~/.aws/credentials``, ``GOOGLE_APPLICATION_CREDENTIALS``...).
        cache_dir: Cache directory shared by all processes of the machine (default:
            :func:`default_cache_dir`); this dataset uses ``<cache_dir>/<hash of URL>``.
        cache_limit: Byte bound of this dataset's cache (int or ``"20GB"``); ``None``: none.
            Must hold at least two of the largest shards (with its sidecar); allow
            ``(readers on the machine + 1)`` for them not to wait on each other.
        read_ahead: Shards each process downloads ahead in background threads.
        verify_hash: Hash every download against its entry (size is always checked).
        retry: How transient errors are retried (default: up to 120 s per call).
        wait_timeout: Seconds an acquire waits for other readers to free cache room.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        *,
        read_ahead: int = DEFAULT_READ_AHEAD,
        verify_hash: bool = True,
        retry: RetryPolicy | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        if read_ahead < 0:
            raise ConfigError(f"{read_ahead=} must be >= 0")
        self.url = url.rstrip("/")
        self.read_ahead = read_ahead
        self.limit = None if cache_limit is None else parse_bytes(cache_limit, name="cache_limit")
        if self.limit is not None and self.limit <= 0:
            raise CacheError(f"cache_limit={cache_limit!r} must be positive (cache for {self.url})")
        self._remote = RemoteFiles(self.url, dict(storage_options or {}), retry or RetryPolicy())
        base = cache_dir if cache_dir is not None else default_cache_dir()
        self.cache_root = os.path.join(os.path.expanduser(str(base)), dataset_cache_key(self.url, storage_options))
        try:
            self.cache = ShardCache(self.cache_root, self.limit, verify_hash=verify_hash, wait_timeout=wait_timeout)
        except OSError as exc:
            raise CacheError(f"cannot create the cache directory {self.cache_root} for {self.url}: {exc}") from exc
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pins: dict[str, tuple[Pin, int]] = {}  # name -> (pin, acquire count)
        self._ahead = ReadAhead(self.read_ahead, self._fetch_ahead)

    def _check_process(self) -> None:
        """After a fork, forget the parent's threads and pins.

        The child's copies of the parent's lock descriptors are closed; the parent's locks
        are unaffected (a flock belongs to the open file, which the parent still holds).
        """
        if self._pid != os.getpid():
            for pin, _ in self._pins.values():
                pin.close()
            self._init_process_state()

    @property
    def stats(self) -> CacheStats:
        """Hits, downloads and bytes downloaded by this process."""
        return self.cache.stats

    # -- Storage interface -----------------------------------------------------------

    def read_bytes(self, name: str, max_bytes: int | None = None, *, not_found: str | None = None) -> bytes:
        """Return file ``name`` from the remote, retried, not cached (small files: the manifest)."""
        self._check_process()
        return self._remote.cat(name, max_bytes=max_bytes, not_found=not_found)

    def check_capacity(self, largest: int) -> None:
        """Check the cache can hold :data:`MIN_CACHE_SHARDS` files of ``largest`` bytes.

        Raises:
            CacheError: If ``cache_limit`` is below that.
        """
        need = MIN_CACHE_SHARDS * largest
        if self.limit is not None and self.limit < need:
            raise CacheError(
                f"cache_limit={format_bytes(self.limit)} is too small for {self.url}: the largest shard "
                f"with its sidecar is {format_bytes(largest)}, and a reader needs at least "
                f"{MIN_CACHE_SHARDS} of them ({format_bytes(need)}) cached at once"
            )

    def max_open(self, largest: int) -> int | None:
        """How many shards of ``largest`` bytes one reader should keep open (pinned) at once."""
        if self.limit is None or largest <= 0:
            return None
        return max(1, self.limit // largest // 2 - 1)

    def acquire(self, entry: FileEntry) -> str:
        """Pin ``entry`` in the cache, downloading it first if needed; return its local path.

        Raises:
            ShardNotFoundError: The object does not exist.
            StorageError: Access denied, or the storage stayed unavailable past the retry budget.
            CorruptShardError: The downloaded bytes do not match the entry.
            CacheError: No room could be made within ``wait_timeout``.
        """
        self._check_process()
        with self._lock:
            held = self._pins.get(entry.name)
            if held is not None:
                self._pins[entry.name] = (held[0], held[1] + 1)
                return self.cache.data_path(entry.name)
        self._check_fits(entry)
        pin = self.cache.pin(entry.name)
        try:
            path = self.cache.fill(entry, self._downloader(entry), on_wait=lambda: self._ahead.starve(entry.name))
        except CorruptShardError as exc:
            pin.close()
            raise CorruptShardError(f"{self._remote.url_of(entry.name)}: {exc}") from exc
        except BaseException:
            pin.close()
            raise
        finally:
            self._ahead.fed(entry.name)
        assert path is not None
        with self._lock:
            self._pins[entry.name] = (pin, 1)
        return path

    def _check_fits(self, entry: FileEntry) -> None:
        if self.limit is not None and MIN_CACHE_SHARDS * entry.num_bytes > self.limit:
            raise CacheError(
                f"cache_limit={format_bytes(self.limit)} is too small for {self._remote.url_of(entry.name)} "
                f"({format_bytes(entry.num_bytes)}): it must hold at least {MIN_CACHE_SHARDS} such files"
            )

    def release(self, entry: FileEntry) -> None:
        """Unpin ``entry``: it stays cached until evicted."""
        self._check_process()
        with self._lock:
            held = self._pins.get(entry.name)
            if held is None:
                return
            pin, count = held
            if count > 1:
                self._pins[entry.name] = (pin, count - 1)
                return
            del self._pins[entry.name]
        pin.close()

    def prefetch(self, entries: Iterable[FileEntry]) -> None:
        """Make ``entries`` (in order of use) the read-ahead window; an empty one cancels read-ahead."""
        self._check_process()
        with self._lock:
            held = set(self._pins)
        self._ahead.want(entries, held)

    def _fetch_ahead(self, entry: FileEntry, cancelled: Callable[[], bool]) -> None:
        pin = self.cache.pin(entry.name)
        try:
            self.cache.fill(entry, self._downloader(entry), wait=False, cancelled=cancelled)
        finally:
            # Read-ahead files are not kept pinned: pins held by a reader that is not
            # reading (its DataLoader queue is full) would starve the others. A fresh file
            # is the most recently used, so it is evicted last.
            pin.close()

    def _downloader(self, entry: FileEntry) -> Callable[[str, Callable[[], bool]], None]:
        def download(part: str, cancelled: Callable[[], bool]) -> None:
            self._remote.download(entry.name, part, cancelled, self._stop, max_bytes=entry.num_bytes)

        return download

    def close(self) -> None:
        """Stop read-ahead (in-flight downloads stop at their next chunk) and drop all pins."""
        if self._pid != os.getpid():
            self._init_process_state()
            return
        self._stop.set()
        self._ahead.stop()
        with self._lock:
            pins = [p for p, _ in self._pins.values()]
            self._pins.clear()
        for pin in pins:
            pin.close()
        self._stop = threading.Event()

    def describe(self) -> str:
        """The URL and the cache directory."""
        return f"{self.url} (cache {self.cache_root})"

    def __getstate__(self) -> dict[str, Any]:
        keep = ("url", "read_ahead", "limit", "_remote", "cache_root", "cache")
        return {k: v for k, v in self.__dict__.items() if k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()
