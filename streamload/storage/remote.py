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
from collections.abc import Iterable
from concurrent.futures import Future
from functools import partial
from typing import Any

from .._errors import CacheError, StorageError
from .._files import FileEntry
from .._fork import ProcessLocal
from .admission import Admission
from .base import Storage
from .bytes import FileBytes, Landing, ShardBytes
from .cache import DEFAULT_WAIT_TIMEOUT, CacheStats, Pin, ShardCache
from .cachedir import dataset_cache_key
from .executor import io_executor
from .filler import DOWNLOAD_REFETCHES, Filler
from .limit import DEFAULT_CACHE_FRACTION, MIN_CACHE_SHARDS, CacheLimit
from .ranges import RangeFetcher
from .readahead import AheadStats, ProcessReadAhead
from .retry import RetryPolicy
from .settings import DEFAULT_READ_AHEAD, StorageSettings
from .transport import open_transport

__all__ = [
    "DEFAULT_CACHE_FRACTION",
    "DEFAULT_READ_AHEAD",
    "DOWNLOAD_REFETCHES",
    "MIN_CACHE_SHARDS",
    "RemoteStorage",
    "dataset_cache_key",
]

log = logging.getLogger("streamload")

#: The "generation" of a file handed out early (its parts, before its hash was checked).
_EARLY = "\0early"


class _Process:
    """What one process of a :class:`RemoteStorage` holds: pins, read-ahead, its registration."""

    def __init__(self, url: str, cache: ShardCache, filler: Filler, ahead: ProcessReadAhead) -> None:
        self.filler = filler
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pins: dict[str, tuple[Pin, int]] = {}  # name -> (pin, acquire count)
        self.served: dict[str, str | None] = {}  # name -> generation of the copy last handed out
        self.stale: set[str] = set()  # pinned here, but discarded: the next acquire fetches again
        self.landings: dict[str, Landing] = {}  # name -> the download handed out early
        self.early: list[Future[None]] = []  # their downloads: close() lets them finish
        self.ahead = ahead
        self.largest = 0  # the largest shard (with its sidecar) its readers read
        self.admission = Admission(cache, url)

    def forget(self) -> None:
        """In a forked child: close this process's copies of the parent's pin descriptors.

        The parent's locks are unaffected (a flock belongs to the open file, which the
        parent still holds), nor is its registration (see .admission).
        """
        for pin, _ in self.pins.values():
            pin.close()
        self.admission.forget_parent()

    def fill(self, entry: FileEntry, landing: Landing | None = None) -> str:
        """Bring ``entry`` into the cache (the caller holds its pin); the time it takes counts as the reader blocked."""
        began = time.monotonic()
        log.debug("acquire %s: start", entry.name)
        starve = lambda: self.ahead.window.starve(entry.name)  # noqa: E731
        try:
            return self.filler.fill(entry, self.stop, landing, on_wait=starve)
        finally:
            log.debug("acquire %s: done", entry.name)
            self.ahead.window.fed(entry.name)
            self.ahead.waited(time.monotonic() - began)

    def land(self, entry: FileEntry, landing: Landing) -> None:
        """Download ``entry`` into the cache while ``landing`` serves what has landed (a cold start read early)."""
        try:
            path = self.fill(entry, landing)
        except BaseException as exc:  # noqa: BLE001 - the reader meets it at its next read
            landing.fail(exc)
            return
        finally:
            self.ahead.first_read.set()
        landing.finish(path)

    def served_copy(self, name: str, cache: ShardCache) -> tuple[str | None, bool]:
        """The generation of the copy of ``name`` last handed out, and whether what was read may be damaged in transit.

        A reader that read parts of a download before its hash was checked: if that
        download was verified at its first attempt, those were the cached file's bytes
        (judged as usual). If a copy failed its check and was fetched again, or reads came
        by GETs of their own, the bytes read may have been damaged in transit (then the
        name is marked stale here).
        """
        with self.lock:
            generation = self.served.get(name)
            landing = self.landings.get(name)
        if generation != _EARLY or landing is None:
            return generation, False
        try:
            landing.wait_done()
        except Exception:  # noqa: BLE001 - the download failed: the next acquire tries again
            pass
        with self.lock:
            self.served[name] = generation = cache.generation(name)
            if landing.attempts > 1 or landing.wanted_reads or not landing.done:
                self.mark_stale(name)
                return generation, True
        return generation, False

    def note_largest(self, largest: int = 0) -> int:
        """The largest shard (with its sidecar) this process's readers read, noting ``largest``."""
        self.largest = max(self.largest, largest)
        return self.largest

    def mark_stale(self, name: str) -> None:
        """``name`` was discarded: if pinned here, the next acquire fetches it again (the caller holds the lock)."""
        if name in self.pins:
            self.stale.add(name)

    def unpin(self, name: str) -> Pin | None:
        """Count one release of ``name``; its pin to close once the last is released, else ``None``."""
        with self.lock:
            held = self.pins.get(name)
            if held is None:
                return None
            pin, count = held
            if count > 1:
                self.pins[name] = (pin, count - 1)
                return None
            del self.pins[name]
            self.stale.discard(name)
            self.landings.pop(name, None)
        return pin

    def close(self) -> None:
        """Let early downloads finish, stop read-ahead and the reader's downloads, drop every pin, unregister."""
        with self.lock:
            early, self.early = self.early, []
        for future in early:
            future.exception()
        self.stop.set()
        self.ahead.close()
        with self.lock:
            pins = [p for p, _ in self.pins.values()]
            self.pins.clear()
        for pin in pins:
            pin.close()
        self.admission.close()
        self.stop = threading.Event()


class RemoteStorage(Storage):
    """A dataset at a remote fsspec URL, read through a bounded, shared local cache.

    Made of parts that are each given what they need: the transport (.transport), the
    cache (.cache), its bound (:class:`~.limit.CacheLimit`), the filler (.filler) and, per
    process, the read-ahead (:class:`~.readahead.ProcessReadAhead`).

    Args:
        url: The dataset's URL prefix (``s3://bucket/prefix``...).
        settings: The resolved settings (:meth:`streamload.StorageConfig.resolve`): the
            cache directory, ``storage_options`` (credentials, ``client_kwargs``,
            ``anon``...; without them fsspec's usual sources apply), the cache bound (at
            least two of the largest shards with its sidecar, and one per reader on the
            machine; allow ``(readers + 1)`` for downloads ahead), read-ahead, timeouts.
        verify_hash: Hash every download against its entry (size is always checked).
        retry: How transient errors are retried, instead of the settings' timeouts.
        wait_timeout: Seconds an acquire waits for other readers to free cache room.
    """

    cached = True

    def __init__(
        self,
        url: str,
        settings: StorageSettings,
        *,
        verify_hash: bool = True,
        retry: RetryPolicy | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        self.url = url.rstrip("/")
        self.read_ahead = settings.read_ahead
        options = settings.storage_options
        self._remote = open_transport(self.url, settings, retry=retry)
        base = os.path.expanduser(os.fspath(settings.cache_dir))
        self.cache_root = os.path.join(base, dataset_cache_key(self.url, options))
        try:
            self.cache = ShardCache(
                self.cache_root,
                None,
                verify_hash=verify_hash,
                wait_timeout=min(wait_timeout, settings.lock_timeout),  # every wait
                lock_timeout=settings.lock_timeout,
                shared=settings.cache_shared,
            )
            self.bound = CacheLimit(self.url, self.cache_root, self.cache, settings.cache_limit)
        except OSError as exc:
            raise CacheError(f"cannot create the cache directory {self.cache_root} for {self.url}: {exc}") from exc
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._filler = Filler(self.cache, self._remote, lambda: self._proc.get().ahead.fetched())
        self._last: _Process | None = None
        self._proc: ProcessLocal[_Process] = ProcessLocal(self._new_process)

    def _new_process(self) -> _Process:
        old, self._last = self._last, None
        if old is not None:  # made before a fork: the parent's (or closed already)
            old.forget()
        link, connections = self._remote.link, self._remote.planner.concurrency
        ahead = ProcessReadAhead(self.url, self.read_ahead, self.cache, self._filler, link, connections)
        self._last = _Process(self.url, self.cache, self._filler, ahead)
        return self._last

    @property
    def limit(self) -> int | None:
        """The cache bound in bytes (``None``: unbounded): its :class:`~.limit.CacheLimit`'s."""
        return self.bound.limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        self.bound.limit = self.cache.limit = value

    @property
    def default_limit(self) -> int | None:
        """The bound this storage chose itself when no ``cache_limit`` was given, else ``None``."""
        return self.bound.default_limit

    @default_limit.setter
    def default_limit(self, value: int | None) -> None:
        self.bound.default_limit = value

    @property
    def refetched(self) -> int:
        """Downloads fetched again after failing their check (see :data:`DOWNLOAD_REFETCHES`)."""
        return self._filler.refetched

    @property
    def stats(self) -> CacheStats:
        """Hits, downloads and bytes downloaded by this process."""
        return self.cache.stats

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
        self._proc.get().note_largest(largest)

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
        if not proc.ahead.first_read.is_set() and not proc.landings:
            proc.ahead.first_read.set()  # a whole-file acquire, not a cold start read early: no hold
        with proc.lock:
            held, landing = proc.pins.get(entry.name), proc.landings.get(entry.name)
            fresh = held is not None and entry.name not in proc.stale
            if held is not None and fresh:
                proc.pins[entry.name] = (held[0], held[1] + 1)
        if fresh:  # pinned here already (by another thread's early download: its path once cached)
            return self.cache.data_path(entry.name) if landing is None else _landed(self, entry, landing)
        if held is not None:  # discarded while pinned here: fetch it again under the same pin
            path = proc.fill(entry)
            with proc.lock:
                proc.stale.discard(entry.name)
                proc.pins[entry.name] = (held[0], held[1] + 1)
                proc.served[entry.name] = self.cache.generation(entry.name)
            return path
        self.bound.check_fits(entry, self._remote.url_of(entry.name))
        pin = self.cache.pin(entry.name)
        try:
            path = proc.fill(entry)
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
        self.bound.check_fits(entry, self._remote.url_of(entry.name))
        pin = self.cache.pin(entry.name)
        if not _count_pin(proc, entry.name, pin):  # another thread pinned it meanwhile: wait for the file
            try:
                path = proc.fill(entry)
            except BaseException:
                self.release(entry)
                raise
            return _open_pinned(self, entry, path)
        landing = Landing(entry.name, entry.num_bytes, partial(self._remote.get_range, entry.name))
        proc.ahead.first_read.clear()
        with proc.lock:
            proc.served[entry.name] = _EARLY
            proc.landings[entry.name] = landing
            proc.early = [f for f in proc.early if not f.done()]
            proc.early.append(io_executor().submit("side", proc.land, entry, landing))
        return landing

    def open_ranges(self) -> RangeFetcher:
        """A new fetcher of byte ranges of this dataset's objects (streaming mode; its owner closes it)."""
        return RangeFetcher(self._remote)

    def release(self, entry: FileEntry) -> None:
        """Unpin ``entry``: it stays cached until evicted."""
        pin = self._proc.get().unpin(entry.name)
        if pin is not None:
            pin.close()

    def discard(self, entry: FileEntry) -> bool:
        """A reader found the copy of ``entry`` it read corrupt: delete it so that it is downloaded again.

        Returns:
            True if the next :meth:`acquire` brings another copy; False if the copy
            hashes to the entry (the file is bad at its source: a download would not help).
        """
        proc = self._proc.get()
        generation, in_transit = proc.served_copy(entry.name, self.cache)
        if in_transit:  # the next acquire brings the verified file: nothing to delete
            return True
        fresh = self.cache.discard(entry, generation)
        if fresh:
            with proc.lock:
                proc.mark_stale(entry.name)
        return fresh

    def close(self) -> None:
        """Stop read-ahead (in-flight downloads stop at their next chunk) and drop all pins.

        Downloads whose parts a reader read early (:meth:`open_bytes`) are let finish
        first (bounded by their retry policy): the reader had what it needed, and the
        file goes into the cache for the next epoch.
        """
        self._proc.get().close()

    def describe(self) -> str:
        """The URL and the cache directory."""
        return f"{self.url} (cache {self.cache_root})"

    def __getstate__(self) -> dict[str, Any]:
        keep = ("url", "read_ahead", "bound", "_remote", "cache_root", "cache")
        return {k: v for k, v in self.__dict__.items() if k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    # -- the cache bound and read-ahead (see .limit and .readahead) --------------------

    def check_capacity(self, largest: int) -> None:
        """Check the cache can hold two files of ``largest`` bytes (see :meth:`.limit.CacheLimit.check_capacity`).

        Raises:
            CacheError: If ``cache_limit`` is below that.
        """
        self.bound.check_capacity(largest)

    def max_open(self, largest: int) -> int | None:
        """How many shards of ``largest`` bytes one reader should keep open (pinned) at once.

        The limit is shared among the registered readers (see :meth:`register_reader`);
        half of a reader's share is left for downloads ahead.
        """
        if self.bound.limit is None or largest <= 0:
            return None
        proc = self._proc.get()
        return self.bound.max_open(proc.note_largest(largest), proc.admission.registered())

    def _ahead_room(self) -> int | None:
        """Shards ahead this process's share of the limit leaves room for (``None``: no bound)."""
        proc = self._proc.get()
        return self.bound.ahead_room(proc.note_largest(), proc.admission.registered())

    @property
    def ahead_stats(self) -> AheadStats:
        """This process's read-ahead depth and the estimates it comes from."""
        return self._proc.get().ahead.stats()

    def ahead_depth(self) -> int:
        """Shards the reader should name to :meth:`fetch_ahead` now (0: read-ahead is off).

        From this process's measurements (see :class:`~.readahead.AheadDepth`), at least
        1, at most ``read_ahead`` and the room the cache leaves this reader.
        """
        if self.read_ahead <= 0:
            return 0
        room = self._ahead_room()
        proc = self._proc.get()
        return proc.ahead.ahead_depth(proc.note_largest(), room)

    def started(self) -> None:
        """The reader made its first item: read-ahead may start."""
        self._proc.get().ahead.first_read.set()

    def fetch_ahead(self, entries: Iterable[FileEntry], together: Iterable[str] = ()) -> None:
        """Make ``entries`` (in order of use) the read-ahead window; an empty one cancels read-ahead.

        A reader calls it as it starts each shard it had not open (see
        :meth:`ahead_depth`): the time between two calls, less the time its acquires
        waited meanwhile, is how long it spent reading a shard. The files named in
        ``together`` are needed with the shard it opens (a shuffled reader's first batches
        draw on all of them): their downloads start at once, side by side, not held back
        until the reader's first item. Files pinned here are not fetched.
        """
        proc = self._proc.get()
        with proc.lock:
            held = set(proc.pins)
        proc.ahead.want(entries, together, held)


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
