"""Reading a dataset at any fsspec URL through the shared local cache: :class:`RemoteStorage`.

Per process::

    read_bytes("index.json")          -> one GET, retried, size-bounded; never cached
    acquire(entry)                    -> pin in the shared cache (see .cache)
      hit:  data/<name>, mtime bumped  -> local path, no remote call
      miss: reserve room (evict LRU unpinned), download to tmp/ (retried, resumed at
            the byte it stopped), verify size + hash, rename into data/ (see .filler)
    open_bytes(entry, early=True)     -> acquire, but a miss returns at once: a Landing that
                                         serves the ranges whose parts have landed while the
                                         download goes on (.bytes.Landing), on the I/O
                                         executor's ``side`` lane (.executor)
    open_ranges()                     -> streaming mode's range fetcher over this transport (.ranges)
    ahead_depth()                     -> how many shards the reader should name ahead now:
                                         from the link model and the reading time, at most
                                         `read_ahead` and the cache room (.readahead, .limit)
    fetch_ahead([next files])         -> the same as acquire, on the executor's ``ahead``
                                         lane, never waiting for room (nor pinning: an idle
                                         reader's pins would starve the others); their parts
                                         run on a lane of their own, the reader's download's
                                         parts never queue behind them; see .readahead
    release(entry)                    -> drop the pin: the file becomes evictable
    discard(entry)                    -> a reader found the copy it read corrupt: delete
                                         it (unless it hashes to the entry), so the next
                                         acquire downloads it again (see .cache)
    register_reader(largest)          -> admission: count the processes reading through
                                         the cache; refuse one the limit cannot hold

The storage is told what each file must be (:class:`~streamload._files.FileEntry`: size,
digest, algorithm) by its caller; it never reads a manifest. The bound and its sharing:
see .limit. What a process holds (pins, read-ahead, its registration) lives in a
:class:`~streamload._fork.ProcessLocal`: a forked worker starts with none of its parent's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from functools import partial
from typing import Any

from .._errors import CacheError, StorageError
from .._files import FileEntry
from .._fork import ProcessLocal
from .._validate import MAX_READ_AHEAD, UNBOUNDED, check_int, parse_cache_limit
from .admission import Admission
from .base import Storage
from .bytes import FileBytes, Landing, ShardBytes
from .cache import DEFAULT_LOCK_TIMEOUT, DEFAULT_WAIT_TIMEOUT, CacheStats, Pin, ShardCache
from .cachedir import dataset_cache_key, default_cache_dir
from .executor import io_executor
from .filler import DOWNLOAD_REFETCHES, Filler
from .limit import DEFAULT_CACHE_FRACTION, MIN_CACHE_SHARDS, CacheLimit
from .ranges import RangeFetcher
from .readahead import AheadDepth, ReadAhead, RemoteReadAhead
from .retry import RetryPolicy
from .transport import open_transport

__all__ = [
    "DEFAULT_CACHE_FRACTION",
    "DEFAULT_READ_AHEAD",
    "DOWNLOAD_REFETCHES",
    "MIN_CACHE_SHARDS",
    "RemoteStorage",
    "dataset_cache_key",
    "default_cache_dir",
]

log = logging.getLogger("streamload")

#: The most shards each process downloads ahead of the one it reads (the depth adapts below it).
DEFAULT_READ_AHEAD = 8
#: The "generation" of a file handed out early (its parts, before its hash was checked).
_EARLY = "\0early"


class _Process:
    """What one process of a :class:`RemoteStorage` holds: pins, read-ahead, its registration."""

    def __init__(self, storage: RemoteStorage) -> None:
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pins: dict[str, tuple[Pin, int]] = {}  # name -> (pin, acquire count)
        self.served: dict[str, str | None] = {}  # name -> generation of the copy last handed out
        self.stale: set[str] = set()  # pinned here, but discarded: the next acquire fetches again
        self.landings: dict[str, Landing] = {}  # name -> the download handed out early
        self.early: list[Future[None]] = []  # their downloads: close() lets them finish
        # Clear while a reader makes its first item from a cold shard read early (set by
        # started()), and until this process's first acquire (the reader names its first
        # read-ahead window just before): read-ahead starts nothing meanwhile (at most
        # FIRST_READ_HOLD), so the first batch's bytes and CPU do not go to other shards.
        self.first_read = threading.Event()
        self.together: set[str] = set()  # read-ahead files the reader needs now (see fetch_ahead): never held
        self.ahead = ReadAhead(storage.read_ahead, storage._fetch_one_ahead)
        remote = storage._remote
        self.depth = AheadDepth(storage.read_ahead, link=remote.link, connections=remote.planner.concurrency)
        self.blocked = 0.0  # seconds this process's acquires waited for a file to arrive
        self.largest = 0  # the largest shard (with its sidecar) its readers read
        self.admission = Admission(storage.cache, storage.url)

    def forget(self) -> None:
        """In a forked child: close this process's copies of the parent's pin descriptors.

        The parent's locks are unaffected (a flock belongs to the open file, which the
        parent still holds), nor is its registration (see .admission).
        """
        for pin, _ in self.pins.values():
            pin.close()
        self.admission.forget_parent()


class RemoteStorage(CacheLimit, RemoteReadAhead, Storage):
    """A dataset at a remote fsspec URL, read through a bounded, shared local cache.

    Args:
        url: The dataset's URL prefix (``s3://bucket/prefix``...).
        storage_options: Passed to the URL's backend (credentials, ``client_kwargs``,
            ``anon``...). Without them, fsspec's usual sources apply (``AWS_*`` variables,
            ``~/.aws/credentials``, ``GOOGLE_APPLICATION_CREDENTIALS``...).
        cache_dir: The machine's cache directory (default: :func:`default_cache_dir`).
        cache_limit: Byte bound of this dataset's cache (int or ``"20GB"``); ``None``: the
            default bound (see .limit); ``"unbounded"``: none. Must hold at least two of the
            largest shards (with its sidecar), and one per reader on the machine (more are
            refused at once); allow ``(readers + 1)`` for downloads ahead.
        read_ahead: The most shards each process downloads ahead (0: none; see .readahead).
        verify_hash: Hash every download against its entry (size is always checked).
        retry: How transient errors are retried (default: up to 120 s per call) and the
            read timeout (its ``inactivity_timeout``).
        wait_timeout: Seconds an acquire waits for other readers to free cache room.
        lock_timeout: Most seconds a wait for one of the cache's locks lasts.
        s3_direct: S3 ranged reads on botocore directly (``None``: ``$STREAMLOAD_S3_DIRECT``).
        cache_shared: A cache directory other users may share (``None``: ``$STREAMLOAD_CACHE_SHARED``).
    """

    cached = True

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
        lock_timeout: float | None = None,
        s3_direct: bool | None = None,
        cache_shared: bool | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.read_ahead = check_int("read_ahead", read_ahead, low=0, high=MAX_READ_AHEAD)
        limit = parse_cache_limit(cache_limit)
        self._remote = open_transport(self.url, storage_options, retry=retry, s3_direct=s3_direct)
        base = os.path.expanduser(os.fspath(cache_dir if cache_dir is not None else default_cache_dir()))
        self.cache_root = os.path.join(base, dataset_cache_key(self.url, storage_options))
        try:
            self.cache = ShardCache(
                self.cache_root,
                None,
                verify_hash=verify_hash,
                wait_timeout=wait_timeout if lock_timeout is None else min(wait_timeout, lock_timeout),  # every wait
                lock_timeout=DEFAULT_LOCK_TIMEOUT if lock_timeout is None else lock_timeout,
                shared=cache_shared,
            )
            #: The bound this storage chose itself when no ``cache_limit`` was given, else ``None``.
            self.default_limit = self._default_limit() if limit is None else None
        except OSError as exc:
            raise CacheError(f"cannot create the cache directory {self.cache_root} for {self.url}: {exc}") from exc
        self.limit = self.default_limit if limit is None else None if limit == UNBOUNDED else int(limit)
        self.cache.limit = self.limit
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._filler = Filler(self.cache, self._remote, self._fetched)
        self._last: _Process | None = None
        self._proc: ProcessLocal[_Process] = ProcessLocal(self._new_process)

    def _new_process(self) -> _Process:
        old, self._last = self._last, None
        if old is not None:  # made before a fork: the parent's (or closed already)
            old.forget()
        self._last = _Process(self)
        return self._last

    def _fetched(self) -> None:
        proc = self._proc.get()
        with proc.lock:
            proc.depth.fetched()

    @property
    def refetched(self) -> int:
        """Downloads fetched again after failing their check (see :data:`DOWNLOAD_REFETCHES`)."""
        return self._filler.refetched

    @property
    def stats(self) -> CacheStats:
        """Hits, downloads and bytes downloaded by this process."""
        return self.cache.stats

    def _registered(self) -> int:
        return self._proc.get().admission.registered()

    def _largest_read(self, largest: int = 0) -> int:
        proc = self._proc.get()
        proc.largest = max(proc.largest, largest)
        return proc.largest

    # -- Storage interface -----------------------------------------------------------

    def read_bytes(self, name: str, max_bytes: int | None = None, *, not_found: str | None = None) -> bytes:
        """Return file ``name`` from the remote, retried, not cached (small files: the manifest)."""
        log.debug("read %s: start", name)  # the DEBUG lines of this module are a timeline of the I/O
        data = self._remote.cat(name, max_bytes=max_bytes, not_found=not_found)
        log.debug("read %s: done", name)
        return data

    def register_reader(self, largest: int) -> None:
        """A reader of shards of up to ``largest`` bytes starts in this process: register it (see .admission).

        Raises:
            CacheError: If the registered readers need more room than the limit holds.
        """
        self._proc.get().admission.register(largest, self.limit)
        self._largest_read(largest)

    def unregister_reader(self) -> None:
        """A reader of this process ended; the last one unregisters the process."""
        self._proc.get().admission.unregister()

    def acquire(self, entry: FileEntry) -> str:
        """Pin ``entry`` in the cache, downloading it first if needed; return its local path.

        Raises:
            ShardNotFoundError: The object does not exist.
            StorageError: Access denied, or the storage stayed unavailable past the retry budget.
            CorruptShardError: The bytes do not match the entry, again when downloaded once more.
            CacheError: No room could be made within ``wait_timeout``.
        """
        proc = self._proc.get()
        if not proc.first_read.is_set() and not proc.landings:
            proc.first_read.set()  # a whole-file acquire, not a cold start read early: no hold
        with proc.lock:
            held, landing = proc.pins.get(entry.name), proc.landings.get(entry.name)
            fresh = held is not None and entry.name not in proc.stale
            if held is not None and fresh:
                proc.pins[entry.name] = (held[0], held[1] + 1)
        if fresh:  # pinned here already (by another thread's early download: its path once cached)
            return self.cache.data_path(entry.name) if landing is None else _landed(self, entry, landing)
        if held is not None:  # discarded while pinned here: fetch it again under the same pin
            path = self._fill(proc, entry)
            with proc.lock:
                proc.stale.discard(entry.name)
                proc.pins[entry.name] = (held[0], held[1] + 1)
                proc.served[entry.name] = self.cache.generation(entry.name)
            return path
        self._check_fits(entry, self._remote.url_of(entry.name))
        pin = self.cache.pin(entry.name)
        try:
            path = self._fill(proc, entry)
        except BaseException:
            pin.close()
            raise
        if _count_pin(proc, entry.name, pin):
            with proc.lock:
                proc.served[entry.name] = self.cache.generation(entry.name)
        return path

    def open_bytes(self, entry: FileEntry, *, early: bool = False, ranges: RangeFetcher | None = None) -> ShardBytes:
        """``entry``'s bytes, pinned until :meth:`release`; with ``early``, a miss is its download in progress.

        Pinned at once, downloaded on the executor's ``side`` lane (first part small): the
        :class:`~.bytes.Landing` serves the ranges whose parts have landed, then all of it
        once verified. A cached file (or one pinned here) comes as a :class:`~.bytes.FileBytes`.
        """
        if ranges is not None or not early:
            return super().open_bytes(entry, ranges=ranges)
        proc = self._proc.get()
        with proc.lock:
            held = entry.name in proc.pins and entry.name not in proc.stale
        if held or self.cache.lookup(entry) is not None:
            return super().open_bytes(entry)
        self._check_fits(entry, self._remote.url_of(entry.name))
        pin = self.cache.pin(entry.name)
        if not _count_pin(proc, entry.name, pin):  # another thread pinned it meanwhile: wait for the file
            try:
                path = self._fill(proc, entry)
            except BaseException:
                self.release(entry)
                raise
            return _open_pinned(self, entry, path)
        landing = Landing(entry.name, entry.num_bytes, partial(self._remote.get_range, entry.name))
        proc.first_read.clear()
        with proc.lock:
            proc.served[entry.name] = _EARLY
            proc.landings[entry.name] = landing
            proc.early = [f for f in proc.early if not f.done()]
            proc.early.append(io_executor().submit("side", self._land, proc, entry, landing))
        return landing

    def open_ranges(self) -> RangeFetcher:
        """A new fetcher of byte ranges of this dataset's objects (streaming mode; its owner closes it)."""
        return RangeFetcher(self._remote)

    def _land(self, proc: _Process, entry: FileEntry, landing: Landing) -> None:
        try:
            path = self._fill(proc, entry, landing)
        except BaseException as exc:  # noqa: BLE001 - the reader meets it at its next read
            landing.fail(exc)
            return
        finally:
            proc.first_read.set()
        landing.finish(path)

    def _fill(self, proc: _Process, entry: FileEntry, landing: Landing | None = None) -> str:
        """Bring ``entry`` into the cache (the caller holds its pin); the time it takes counts as the reader blocked."""
        began = time.monotonic()
        log.debug("acquire %s: start", entry.name)
        starve = lambda: proc.ahead.starve(entry.name)  # noqa: E731
        try:
            return self._filler.fill(entry, proc.stop, landing, on_wait=starve)
        finally:
            log.debug("acquire %s: done", entry.name)
            proc.ahead.fed(entry.name)
            with proc.lock:
                proc.blocked += time.monotonic() - began

    def release(self, entry: FileEntry) -> None:
        """Unpin ``entry``: it stays cached until evicted."""
        proc = self._proc.get()
        with proc.lock:
            held = proc.pins.get(entry.name)
            if held is None:
                return
            pin, count = held
            if count > 1:
                proc.pins[entry.name] = (pin, count - 1)
                return
            del proc.pins[entry.name]
            proc.stale.discard(entry.name)
            proc.landings.pop(entry.name, None)
        pin.close()

    def discard(self, entry: FileEntry) -> bool:
        """A reader found the copy of ``entry`` it read corrupt: delete it so that it is downloaded again.

        Returns:
            True if the next :meth:`acquire` brings another copy; False if the copy
            hashes to the entry (the file is bad at its source: a download would not help).
        """
        proc = self._proc.get()
        with proc.lock:
            generation = proc.served.get(entry.name)
            landing = proc.landings.get(entry.name)
        if generation == _EARLY and landing is not None:
            # The reader read parts of a download before its hash was checked. If that
            # download was verified at its first attempt, those were the cached file's
            # bytes: judge the cached copy as usual. If a copy failed its check and was
            # fetched again, or reads came by GETs of their own, the bytes read may have been
            # damaged in transit: the next acquire brings the verified file, nothing to delete.
            try:
                landing.wait_done()
            except Exception:  # noqa: BLE001 - the download failed: the next acquire tries again
                pass
            with proc.lock:
                proc.served[entry.name] = generation = self.cache.generation(entry.name)
                if landing.attempts > 1 or landing.wanted_reads or not landing.done:
                    if entry.name in proc.pins:
                        proc.stale.add(entry.name)
                    return True
        fresh = self.cache.discard(entry, generation)
        if fresh:
            with proc.lock:
                if entry.name in proc.pins:
                    proc.stale.add(entry.name)
        return fresh

    def close(self) -> None:
        """Stop read-ahead (in-flight downloads stop at their next chunk) and drop all pins.

        Downloads whose parts a reader read early (:meth:`open_bytes`) are let finish
        first (bounded by their retry policy): the reader had what it needed, and the
        file goes into the cache for the next epoch.
        """
        proc = self._proc.get()
        with proc.lock:
            early, proc.early = proc.early, []
        for future in early:
            future.exception()
        proc.stop.set()
        proc.ahead.stop()
        with proc.lock:
            pins = [p for p, _ in proc.pins.values()]
            proc.pins.clear()
        for pin in pins:
            pin.close()
        proc.admission.close()
        proc.stop = threading.Event()

    def describe(self) -> str:
        """The URL and the cache directory."""
        return f"{self.url} (cache {self.cache_root})"

    def __getstate__(self) -> dict[str, Any]:
        keep = ("url", "read_ahead", "limit", "default_limit", "_space", "_remote", "cache_root", "cache")
        return {k: v for k, v in self.__dict__.items() if k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()


def _count_pin(proc: _Process, name: str, pin: Pin) -> bool:
    """Keep ``pin`` as this process's pin of ``name``; False (``pin`` closed) if another thread's came first.

    One pin per name, counted: a second one would be dropped by the first release, and
    the file evicted under the reader still using it.
    """
    with proc.lock:
        other = proc.pins.get(name)
        proc.pins[name] = (pin, 1) if other is None else (other[0], other[1] + 1)
    if other is not None:
        pin.close()
    return other is None


def _open_pinned(storage: Storage, entry: FileEntry, path: str) -> ShardBytes:
    """``path`` (``entry``, pinned in ``storage``) opened for reads; the pin is released if it cannot be."""
    try:
        return FileBytes(os.open(path, os.O_RDONLY))
    except OSError as exc:
        storage.release(entry)
        raise StorageError(f"cannot open {path}: {exc}") from exc


def _landed(storage: Storage, entry: FileEntry, landing: Landing) -> str:
    """The path of ``entry`` once its early download is cached; its pin here is released if the download fails."""
    try:
        return landing.wait_done()
    except BaseException:
        storage.release(entry)
        raise
