"""Reading a dataset at any fsspec URL through the shared local cache: :class:`RemoteStorage`.

Per process::

    read_bytes("index.json")          -> one GET, retried, size-bounded; never cached
    acquire(entry)                    -> pin in the shared cache (see .cache)
      hit:  data/<name>, mtime bumped  -> local path, no remote call
      miss: reserve room (evict LRU unpinned), download to tmp/ (retried, resumed at
            the byte it stopped), verify size + hash, rename into data/; a download
            that fails its check is fetched once more (damaged in transit), then
            it is bad at its source (CorruptShardError naming its URL)
    ahead_depth()                     -> how many shards the reader should name ahead now:
                                         from the measured download and reading times,
                                         at most `read_ahead` and the cache room (.readahead)
    prefetch([next files])            -> the same as acquire, in daemon threads (one per
                                         shard of the window), never waiting for room (nor
                                         pinning: an idle reader's pins would starve the
                                         others); their parts run beside the reader's own
                                         download, which takes free GET slots first
                                         (.parts.PartSlots); see .readahead
    acquire_early(entry)              -> acquire, but a miss returns at once: a Landing that
                                         serves the ranges whose parts have landed while the
                                         download goes on in a thread (see .parts)
    release(entry)                    -> drop the pin: the file becomes evictable
    discard(entry)                    -> a reader found the copy it read corrupt: delete
                                         it (unless it hashes to the entry), so the next
                                         acquire downloads it again (see .cache)
    register_reader(largest)          -> admission: count the processes reading through
                                         the cache; refuse one the limit cannot hold

The storage is told what each file must be (:class:`~streamload._files.FileEntry`: size,
digest, algorithm) by its caller; it never reads a manifest.

The bound. ``cache_limit`` bounds the bytes of one dataset's cache directory:

* ``None`` (the default): half of the space the cache could use when the storage is
  opened (the free space of its filesystem plus what this dataset's cache already holds),
  and at least :data:`MIN_CACHE_SHARDS` of the largest shards. It is logged once (INFO),
  and :class:`~streamload.shards.DatasetRef` hands the number it chose to every worker, so
  the processes of a job share one bound.
* ``"unbounded"``: no bound (the cache grows until every file is cached).
* bytes, or a string like ``"20GB"``: that bound; at least two of the largest shards.

Admission (see .admission): each process reading registers in the cache; more readers than
the limit can hold are refused at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._errors import CacheError, CorruptShardError
from .._files import FileEntry
from .._units import format_bytes
from .._validate import MAX_READ_AHEAD, UNBOUNDED, check_int, parse_cache_limit
from .admission import Admission
from .base import Storage
from .cache import DEFAULT_LOCK_TIMEOUT, DEFAULT_WAIT_TIMEOUT, CacheStats, Pin, ShardCache
from .cachedir import dataset_cache_key, default_cache_dir
from .parts import FIRST_PART, Landing, merge_range
from .readahead import AheadDepth, AheadStats, ReadAhead
from .retry import RetryPolicy
from .transport import RemoteFiles

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
#: Smallest workable cache: the shard being read plus the one being fetched.
MIN_CACHE_SHARDS = 2
#: Without ``cache_limit``: this fraction of the space the cache could use (free + its own).
DEFAULT_CACHE_FRACTION = 0.5
#: A download that fails its size or hash check is fetched whole this many times more (the
#: bytes may have been damaged in transit, by a faulty middlebox or NIC); then the file is
#: bad at its source.
DOWNLOAD_REFETCHES = 1
#: The "generation" of a file handed out by acquire_early (its parts, before its hash was checked).
_EARLY = "\0early"
#: Seconds read-ahead waits at most for a reader's first item from a cold shard.
_FIRST_READ_HOLD = 1.0
#: A download shows its progress to the other processes each time this many more bytes landed.
_SHOW_EVERY = 1 << 20
#: Cache directories whose default bound this process logged already.
_LOGGED_DEFAULTS: set[str] = set()


class _Shown:
    """The ranges of one download attempt written so far, shown to the other processes (see _downloader)."""

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


class RemoteStorage(Storage):
    """A dataset at a remote fsspec URL, read through a bounded, shared local cache.

    Args:
        url: The dataset's URL prefix (``s3://bucket/prefix``...).
        storage_options: Passed to the fsspec filesystem (credentials, ``client_kwargs``,
            ``anon``...). Without them, fsspec's usual sources apply (``AWS_*`` variables,
            ``~/.aws/credentials``, ``GOOGLE_APPLICATION_CREDENTIALS``...).
        cache_dir: Cache directory shared by all processes of the machine (default:
            :func:`default_cache_dir`); this dataset uses ``<cache_dir>/<hash of URL>``.
        cache_limit: Byte bound of this dataset's cache (int or ``"20GB"``); ``None``: the
            default bound (half of the space the cache could use, see the module
            docstring); ``"unbounded"``: none. Must hold at least two of the largest shards
            (with its sidecar), and one per reader on the machine (more are refused at
            once); allow ``(readers + 1)`` for downloads ahead.
        read_ahead: The most shards each process downloads ahead in background threads
            (0: none). The depth adapts below it: enough that the next shard is cached
            before the reader needs it, from the measured download time of a shard and
            the time the reader spends on one, within the cache room (see .readahead).
        verify_hash: Hash every download against its entry (size is always checked).
        retry: How transient errors are retried (default: up to 120 s per call).
        wait_timeout: Seconds an acquire waits for other readers to free cache room.
        lock_timeout: Most seconds a wait for one of the cache's locks lasts (``None``:
            :data:`~.cache.DEFAULT_LOCK_TIMEOUT`).
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
        lock_timeout: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.read_ahead = check_int("read_ahead", read_ahead, low=0, high=MAX_READ_AHEAD)
        limit = parse_cache_limit(cache_limit)
        self._remote = RemoteFiles(self.url, dict(storage_options or {}), retry or RetryPolicy())
        base = os.path.expanduser(os.fspath(cache_dir if cache_dir is not None else default_cache_dir()))
        self.cache_root = os.path.join(base, dataset_cache_key(self.url, storage_options))
        self._space = 0  # bytes the cache could use, measured for the default bound
        try:
            self.cache = ShardCache(
                self.cache_root,
                None,
                verify_hash=verify_hash,
                wait_timeout=wait_timeout,
                lock_timeout=DEFAULT_LOCK_TIMEOUT if lock_timeout is None else lock_timeout,
            )
            #: The bound this storage chose itself when no ``cache_limit`` was given, else ``None``.
            self.default_limit = self._default_limit() if limit is None else None
        except OSError as exc:
            raise CacheError(f"cannot create the cache directory {self.cache_root} for {self.url}: {exc}") from exc
        self.limit: int | None = self.default_limit if limit is None else None if limit == UNBOUNDED else int(limit)
        self.cache.limit = self.limit
        self._init_process_state()

    def _default_limit(self) -> int:
        """Half of the space the cache could use: its filesystem's free space plus what it holds."""
        self._space = shutil.disk_usage(self.cache_root).free + self.cache.usage()
        return int(DEFAULT_CACHE_FRACTION * self._space)

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pins: dict[str, tuple[Pin, int]] = {}  # name -> (pin, acquire count)
        self._served: dict[str, str | None] = {}  # name -> generation of the copy last handed out
        self._stale: set[str] = set()  # pinned here, but discarded: the next acquire fetches again
        self._landings: dict[str, Landing] = {}  # name -> the download acquire_early last handed out
        self._early: list[threading.Thread] = []  # their download threads: close() lets them finish
        # Clear while a reader makes its first item from a cold shard read early (acquire_early;
        # set by started()), and until this process's first acquire (the reader names its first
        # read-ahead window just before): read-ahead starts nothing meanwhile (at most
        # _FIRST_READ_HOLD), so the first batch's bytes and CPU do not go to other shards.
        self._first_read = threading.Event()
        self._together: set[str] = set()  # read-ahead files the reader needs now (see prefetch): never held
        self._ahead = ReadAhead(self.read_ahead, self._fetch_ahead)
        self._depth = AheadDepth(self.read_ahead)
        self._blocked = 0.0  # seconds this process's acquires waited for a file to arrive
        self._largest = 0  # the largest shard (with its sidecar) its readers read
        #: Downloads of this process fetched again after failing their check (see DOWNLOAD_REFETCHES).
        self.refetched = 0
        self._admission = Admission(self.cache, self.url)

    def _check_process(self) -> None:
        """After a fork, forget the parent's threads and pins.

        The child's copies of the parent's lock descriptors are closed; the parent's locks
        are unaffected (a flock belongs to the open file, which the parent still holds).
        """
        if self._pid != os.getpid():
            for pin, _ in self._pins.values():
                pin.close()
            self._admission.forget_parent()
            self._init_process_state()

    @property
    def stats(self) -> CacheStats:
        """Hits, downloads and bytes downloaded by this process."""
        return self.cache.stats

    @property
    def ahead_stats(self) -> AheadStats:
        """This process's read-ahead depth and the estimates it comes from."""
        with self._lock:
            return self._depth.stats()

    # -- Storage interface -----------------------------------------------------------

    def read_bytes(self, name: str, max_bytes: int | None = None, *, not_found: str | None = None) -> bytes:
        """Return file ``name`` from the remote, retried, not cached (small files: the manifest)."""
        self._check_process()
        log.debug("read %s: start", name)  # the DEBUG lines of this module are a timeline of the I/O
        data = self._remote.cat(name, max_bytes=max_bytes, not_found=not_found)
        log.debug("read %s: done", name)
        return data

    def check_capacity(self, largest: int) -> None:
        """Check the cache can hold :data:`MIN_CACHE_SHARDS` files of ``largest`` bytes.

        Raises:
            CacheError: If ``cache_limit`` is below that.
        """
        need = MIN_CACHE_SHARDS * largest
        if self.default_limit is not None and self.limit is not None:
            if self.limit < need:  # a small disk: the default still lets a reader work
                self.limit = self.cache.limit = self.default_limit = need
                if need > self._space:
                    log.warning(
                        "cache of %s in %s: its filesystem has room for %s, less than the %s two of the "
                        "largest shards need; downloads will fail when it is full (pass cache_dir= on a larger one)",
                        self.url,
                        self.cache_root,
                        format_bytes(self._space),
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

    def max_open(self, largest: int) -> int | None:
        """How many shards of ``largest`` bytes one reader should keep open (pinned) at once.

        The limit is shared among the registered readers (see :meth:`register_reader`);
        half of a reader's share is left for downloads ahead.
        """
        if self.limit is None or largest <= 0:
            return None
        self._largest = max(self._largest, largest)
        share = self.limit // largest // max(1, self._admission.registered())
        return max(1, share // 2 - 1)

    def _ahead_room(self) -> int | None:
        """Shards ahead this process's share of the limit leaves room for (``None``: no bound).

        The share (the limit divided among the registered readers) less the shards the
        reader keeps open (:meth:`max_open`) and the one it is about to open: the window
        is named before that shard is pinned, and a deeper window would make room by
        evicting it (the least recently used). At least one.
        """
        largest = self._largest
        if self.limit is None or largest <= 0:
            return None
        share = self.limit // largest // max(1, self._admission.registered())
        open_shards = self.max_open(largest) or 1
        return max(1, share - open_shards - 1)

    def ahead_depth(self) -> int:
        """Shards the reader should name to :meth:`prefetch` now (0: read-ahead is off).

        ``ceil(fetch time of a shard / reading time of a shard + margin)``, from this
        process's measurements (see :class:`~streamload.storage.readahead.AheadDepth`), at
        least 1, at most ``read_ahead`` and the room the cache leaves this reader.
        """
        self._check_process()
        if self.read_ahead <= 0:
            return 0
        room = self._ahead_room()
        with self._lock:
            before = self._depth.current
            depth = self._depth.depth(self._largest, room)
            stats = self._depth.stats() if depth != before else None
        if stats is not None:
            log.debug(
                "read-ahead of %s: %d shard(s) ahead (a shard takes %.3f s to download, %s s to read; room %s)",
                self.url,
                depth,
                stats.fetch_seconds,
                "?" if stats.consume_seconds is None else f"{stats.consume_seconds:.3f}",
                "unbounded" if room is None else room,
            )
        return depth

    # -- admission -------------------------------------------------------------------

    def register_reader(self, largest: int) -> None:
        """A reader of shards of up to ``largest`` bytes starts in this process: register it (see .admission).

        Raises:
            CacheError: If the registered readers need more room than the limit holds.
        """
        self._check_process()
        self._admission.register(largest, self.limit)
        self._largest = max(self._largest, largest)

    def unregister_reader(self) -> None:
        """A reader of this process ended; the last one unregisters the process."""
        self._check_process()
        self._admission.unregister()

    def acquire(self, entry: FileEntry) -> str:
        """Pin ``entry`` in the cache, downloading it first if needed; return its local path.

        Raises:
            ShardNotFoundError: The object does not exist.
            StorageError: Access denied, or the storage stayed unavailable past the retry budget.
            CorruptShardError: The downloaded bytes do not match the entry, again when
                downloaded once more (:data:`DOWNLOAD_REFETCHES`): the file is bad at its source.
            CacheError: No room could be made within ``wait_timeout``.
        """
        self._check_process()
        if not self._first_read.is_set() and not self._landings:
            self._first_read.set()  # a whole-file acquire, not a cold start read early: no hold
        with self._lock:
            held = self._pins.get(entry.name)
            if held is not None and entry.name not in self._stale:
                self._pins[entry.name] = (held[0], held[1] + 1)
                return self.cache.data_path(entry.name)
        if held is not None:  # discarded while pinned here: fetch it again under the same pin
            path = self._fill(entry)
            with self._lock:
                self._stale.discard(entry.name)
                self._pins[entry.name] = (held[0], held[1] + 1)
                self._served[entry.name] = self.cache.generation(entry.name)
            return path
        self._check_fits(entry)
        pin = self.cache.pin(entry.name)
        try:
            path = self._fill(entry)
        except BaseException:
            pin.close()
            raise
        with self._lock:
            self._pins[entry.name] = (pin, 1)
            self._served[entry.name] = self.cache.generation(entry.name)
        return path

    def acquire_early(self, entry: FileEntry) -> str | Landing:
        """Like :meth:`acquire`, but a file not cached yet is returned as its download in progress.

        The file is pinned at once, and downloaded in a thread of this process (the first
        part small, so the file's first bytes land early); the returned :class:`Landing`
        serves the byte ranges whose parts have landed, and everything once the file is
        verified and cached. Pair it with :meth:`release` as :meth:`acquire`. A cached
        file (or one pinned here already) is returned as its path.
        """
        self._check_process()
        with self._lock:
            held = entry.name in self._pins and entry.name not in self._stale
        if held or self.cache.lookup(entry) is not None:
            return self.acquire(entry)
        self._check_fits(entry)
        pin = self.cache.pin(entry.name)
        landing = Landing(entry.name, entry.num_bytes)
        self._first_read.clear()
        with self._lock:
            self._pins[entry.name] = (pin, 1)
            self._served[entry.name] = _EARLY
            self._landings[entry.name] = landing
        thread = threading.Thread(target=self._land, args=(entry, landing), name="streamload-early", daemon=True)
        with self._lock:
            self._early = [t for t in self._early if t.is_alive()] + [thread]
        thread.start()
        return landing

    def started(self) -> None:
        """The reader made its first item: read-ahead may start (see ``_first_read``)."""
        self._first_read.set()

    def _land(self, entry: FileEntry, landing: Landing) -> None:
        try:
            path = self._fill(entry, landing)
        except BaseException as exc:  # noqa: BLE001 - the reader meets it at its next read
            landing.fail(exc)
            return
        finally:
            self._first_read.set()
        landing.finish(path)

    def _fill(self, entry: FileEntry, landing: Landing | None = None) -> str:
        """Bring ``entry`` into the cache (the caller holds its pin); name its URL in a corruption error.

        The time it takes counts as the reader blocked (not reading), for the read-ahead depth.
        """
        began = time.monotonic()
        url = self._remote.url_of(entry.name)
        log.debug("acquire %s: start", entry.name)
        starve = lambda: self._ahead.starve(entry.name)  # noqa: E731
        try:
            entry = self._versioned(entry)
            for attempt in range(1 + DOWNLOAD_REFETCHES):
                try:
                    follow = None if landing is None else self._follower(entry, landing)
                    path = self.cache.fill(entry, self._downloader(entry, landing), on_wait=starve, follow=follow)
                    break
                except CorruptShardError as exc:
                    if attempt == DOWNLOAD_REFETCHES:
                        raise CorruptShardError(
                            f"{url}: {exc} (downloaded {attempt + 1} times, each copy failed its check: the file "
                            "is bad at its source)"
                        ) from exc
                    with self._lock:
                        self.refetched += 1
                    log.warning("%s: %s (bytes damaged in transit?); downloading it again", url, exc)
        finally:
            log.debug("acquire %s: done", entry.name)
            self._ahead.fed(entry.name)
            with self._lock:
                self._blocked += time.monotonic() - began
        assert path is not None
        return path

    def _versioned(self, entry: FileEntry) -> FileEntry:
        """``entry``, or for a file the manifest gives no hash, the same with its object version as "hash".

        A dataset written without hashes and rewritten at the same URL may have files of the
        same names and sizes but other bytes: with nothing to check them against, a cached
        copy is served only while the object's version (ETag, generation, or mtime and
        inode) is the one it was downloaded at. It costs one metadata request per file
        opened; the version is never checked as a digest (no algorithm).
        """
        if entry.hash is not None:
            return entry
        version = self._remote.version(entry.name)
        return entry if version is None else FileEntry(entry.name, entry.num_bytes, f"version-{version}")

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
            self._stale.discard(entry.name)
            self._landings.pop(entry.name, None)
        pin.close()

    def discard(self, entry: FileEntry) -> bool:
        """A reader found the copy of ``entry`` it read corrupt: delete it so that it is downloaded again.

        Returns:
            True if the next :meth:`acquire` brings another copy; False if the copy
            hashes to the entry (the file is bad at its source: a download would not help).
        """
        self._check_process()
        with self._lock:
            generation = self._served.get(entry.name)
            landing = self._landings.get(entry.name)
        if generation == _EARLY and landing is not None:
            # The reader read parts of a download before its hash was checked. If that
            # download was verified at its first attempt, those were the cached file's
            # bytes: judge the cached copy as usual. If a copy failed its check and was
            # fetched again, the bytes read may have been damaged in transit: the next
            # acquire brings the verified file, nothing to delete.
            try:
                landing.wait_done()
            except Exception:  # noqa: BLE001 - the download failed: the next acquire tries again
                pass
            with self._lock:
                self._served[entry.name] = generation = self.cache.generation(entry.name)
                if landing.attempts > 1 or not landing.done:
                    if entry.name in self._pins:
                        self._stale.add(entry.name)
                    return True
        fresh = self.cache.discard(entry, generation)
        if fresh:
            with self._lock:
                if entry.name in self._pins:
                    self._stale.add(entry.name)
        return fresh

    def prefetch(self, entries: Iterable[FileEntry], together: Iterable[str] = ()) -> None:
        """Make ``entries`` (in order of use) the read-ahead window; an empty one cancels read-ahead.

        A reader calls it as it starts each shard it had not open (see
        :meth:`ahead_depth`): the time between two calls, less the time its acquires
        waited meanwhile, is how long it spent reading a shard. The files named in
        ``together`` are needed with the shard it opens (a shuffled reader's first batches
        draw on all of them): their downloads start at once, side by side, not held back
        until the reader's first item.
        """
        self._check_process()
        wanted = list(entries)
        now = {e.name for e in wanted} & set(together)
        with self._lock:
            held = set(self._pins)
            if not self._first_read.is_set():  # the cold start: what the first batch needs stays urgent
                now |= self._together & {e.name for e in wanted}
            self._together = now
            if wanted:
                self._depth.observe_shard(time.monotonic(), self._blocked)
                self._ahead.threads = min(self.read_ahead, max(1, self._depth.current, len(now)))
            else:
                self._depth.pause()
        self._ahead.want(wanted, held)

    def _fetch_ahead(self, entry: FileEntry, cancelled: Callable[[], bool]) -> None:
        with self._lock:
            now = entry.name in self._together
        if not now:
            self._first_read.wait(_FIRST_READ_HOLD)  # the first batch's bytes first (see _init_process_state)
        if cancelled():
            return
        pin = self.cache.pin(entry.name)
        log.debug("read-ahead %s: start", entry.name)
        try:
            entry = self._versioned(entry)
            self.cache.fill(entry, self._downloader(entry, urgent=False), wait=False, cancelled=cancelled)
            log.debug("read-ahead %s: done", entry.name)
        finally:
            # Read-ahead files are not kept pinned: pins held by a reader that is not
            # reading (its DataLoader queue is full) would starve the others. A fresh file
            # is the most recently used, so it is evicted last.
            pin.close()

    def _downloader(
        self, entry: FileEntry, landing: Landing | None = None, *, urgent: bool = True
    ) -> Callable[[str, Callable[[], bool]], None]:
        """What :meth:`ShardCache.fill` calls to download ``entry`` into a part file (once per attempt).

        The bytes written are handed to ``landing`` (a reader of this process) and shown
        to the other processes of the machine (:meth:`ShardCache.publish_landing`).
        """
        attempts = 0

        def download(part: str, cancelled: Callable[[], bool]) -> None:
            nonlocal attempts
            attempts += 1
            began = time.monotonic()
            if landing is not None:
                landing.begin(part)
            shown = _Shown(self.cache, entry.name, part, attempts)

            def landed(start: int, end: int) -> None:
                if landing is not None:
                    landing.land(start, end)
                shown.land(start, end)

            try:
                done = self._remote.download(
                    entry.name,
                    part,
                    cancelled,
                    self._stop,
                    max_bytes=entry.num_bytes,
                    landed=landed,
                    first_part=None if landing is None else FIRST_PART,
                    urgent=urgent,
                )
            finally:
                self.cache.clear_landing(entry.name)
            if done == entry.num_bytes and not cancelled():
                with self._lock:
                    self._depth.observe_fetch(entry.num_bytes, time.monotonic() - began)

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
                    landing.begin(part)
                except OSError:
                    return  # renamed into place or gone: the wait for the lock ends soon
                seen = (part, attempt)
            for start, end in ranges:
                landing.land(start, end)

        return follow

    def close(self) -> None:
        """Stop read-ahead (in-flight downloads stop at their next chunk) and drop all pins.

        Downloads whose parts a reader read early (:meth:`acquire_early`) are let finish
        first (bounded by their retry policy): the reader had what it needed, and the
        file goes into the cache for the next epoch.
        """
        if self._pid != os.getpid():
            self._init_process_state()
            return
        with self._lock:
            early, self._early = self._early, []
        for thread in early:
            thread.join()
        self._stop.set()
        self._ahead.stop()
        with self._lock:
            pins = [p for p, _ in self._pins.values()]
            self._pins.clear()
        for pin in pins:
            pin.close()
        self._admission.close()
        self._stop = threading.Event()

    def describe(self) -> str:
        """The URL and the cache directory."""
        return f"{self.url} (cache {self.cache_root})"

    def __getstate__(self) -> dict[str, Any]:
        keep = ("url", "read_ahead", "limit", "default_limit", "_space", "_remote", "cache_root", "cache")
        return {k: v for k, v in self.__dict__.items() if k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()
