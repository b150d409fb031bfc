"""Read-ahead: fetch the files a reader will need next, in background threads, as deep as needed.

The reader knows its future (the planner's order), so it names the next files; this
module keeps them in a *window* that each call replaces. Queued fetches that left the
window are forgotten, running ones are cancelled when the window is emptied (end of an
epoch), and every fetch pauses while some acquire is starved for cache room, so
read-ahead never takes the room a reader waits for. Threads exist only while there is
work: an idle reader holds none.

How deep the window is (:class:`AheadDepth`): deep enough that the next shard is cached
before the reader needs it. How long a file takes to arrive is the transport's link
model (:class:`~.parts.LinkModel`: ``latency + bytes / (rate x connections)``, fitted to
every GET of the process, whether its reader or its read-ahead made it); how long the
reader spends on a shard is measured here (the time between two shards started, less the
time it was blocked waiting for a download); both are smoothed (exponentially weighted,
so one slow GET does not swing them), and it keeps::

    depth = ceil(fetch time of a shard / time to read a shard + margin)

shards ahead, at least 1, at most the cap (``read_ahead=``) and at most the room the cache
leaves this reader (its share of the limit, less the shards it keeps open and the one it
opens next).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from .._files import FileEntry
from .cache import ShardCache
from .executor import io_executor
from .filler import Filler
from .parts import LinkModel

__all__ = ["AheadDepth", "AheadStats", "ProcessReadAhead", "ReadAhead"]

log = logging.getLogger("streamload")

#: Seconds read-ahead waits at most for a reader's first item from a cold shard.
FIRST_READ_HOLD = 1.0

#: ``fetch(entry, cancelled)`` brings ``entry`` into the cache, polling ``cancelled()``.
Fetch = Callable[[FileEntry, Callable[[], bool]], None]


#: Depth before the reader's pace is known (the first shard of an iteration).
START_DEPTH = 2
#: The shortest time per shard counted (a reader faster than this is "as fast as it gets").
_MIN_CONSUME = 1e-3


@dataclass(frozen=True)
class AheadStats:
    """What one process's read-ahead depth rule sees (a snapshot).

    Attributes:
        depth: Shards named ahead at the last shard change.
        peak: The deepest window named so far.
        cap: The most shards ahead (``read_ahead=``).
        room: Shards ahead the cache had room for at the last change (``None``: no bound).
        fetch_seconds: Estimated seconds to download the largest shard.
        consume_seconds: Estimated seconds the reader spends on a shard (``None``: not measured yet).
        latency: Estimated seconds from a request to the first byte of a file.
        seconds_per_byte: Estimated download time per byte past the latency.
        downloads: Downloads measured.
        shards: Shard changes measured.
    """

    depth: int
    peak: int
    cap: int
    room: int | None
    fetch_seconds: float
    consume_seconds: float | None
    latency: float
    seconds_per_byte: float
    downloads: int
    shards: int


class AheadDepth:
    """How many shards to keep ahead of the reader, from measured download and reading times.

    Not thread-safe by itself: :class:`~streamload.storage.remote.RemoteStorage` calls it
    under its lock.

    Args:
        cap: The most shards ahead (0: read-ahead is off, the depth is 0).
        start: The depth until the reader's pace is measured.
        margin: Shards of slack added to ``fetch / consume`` before rounding up, for
            jitter: a download that takes half a shard's reading time keeps one ahead.
        alpha: Weight of a new measurement in the exponentially weighted estimates.
        latency: First guess of the seconds to a file's first byte (a link of its own only).
        seconds_per_byte: First guess of the download time per byte (one 40 MB/s
            connection; a link of its own only).
        link: The transport's link model (``None``: one of its own, fed by :meth:`observe_fetch`).
        connections: How many connections a download of ``n`` bytes runs on at once (the
            transport's part planner; default one).
    """

    def __init__(
        self,
        cap: int,
        *,
        start: int = START_DEPTH,
        margin: float = 0.5,
        alpha: float = 0.3,
        latency: float = 0.05,
        seconds_per_byte: float = 1 / 40e6,
        link: LinkModel | None = None,
        connections: Callable[[int], int] | None = None,
    ) -> None:
        self.cap = cap
        self.start = start
        self.margin = margin
        self.alpha = alpha
        self.link = LinkModel(latency, 1 / seconds_per_byte, alpha) if link is None else link
        self._connections = connections or (lambda n: 1)
        self.consume: float | None = None
        self.downloads = 0
        self.shards = 0
        self.current = min(cap, start)
        self.peak = 0
        self.room: int | None = None
        self._largest = 0
        self._last: float | None = None  # when the reader started its current shard
        self._blocked_at_last = 0.0

    @property
    def latency(self) -> float:
        """Estimated seconds from a request to the first byte of a file (the link's)."""
        return self.link.latency

    @property
    def seconds_per_byte(self) -> float:
        """Estimated download time per byte of one connection past the latency (the link's)."""
        return 1 / self.link.rate

    def fetched(self) -> None:
        """Count one whole download (the link measured it already)."""
        self.downloads += 1

    def observe_fetch(self, nbytes: int, seconds: float) -> None:
        """Fold one whole download (``nbytes`` in ``seconds``) into the link model, and count it."""
        if seconds <= 0 or nbytes < 0:
            return
        self.downloads += 1
        self.link.observe(nbytes, seconds, self._connections(nbytes))

    def observe_shard(self, now: float, blocked: float) -> None:
        """The reader starts a new shard at ``now``; ``blocked`` is its total time spent waiting on downloads.

        The time since the previous shard started, less the time blocked meanwhile, is
        what reading that shard took.
        """
        if self._last is not None:
            sample = max(_MIN_CONSUME, now - self._last - (blocked - self._blocked_at_last))
            self.consume = sample if self.consume is None else self.consume + self.alpha * (sample - self.consume)
            self.shards += 1
        self._last, self._blocked_at_last = now, blocked

    def pause(self) -> None:
        """The reader stopped (end of an iteration): the gap until it starts again is no reading time."""
        self._last = None

    def fetch_seconds(self, nbytes: int) -> float:
        """Estimated seconds to download a file of ``nbytes`` (on its parts' connections at once)."""
        return self.link.seconds(nbytes, self._connections(nbytes))

    def depth(self, largest: int, room: int | None) -> int:
        """Shards to keep ahead now, for shards of up to ``largest`` bytes and ``room`` shards of cache room.

        Args:
            largest: The largest shard (with its sidecar) in bytes.
            room: Shards ahead the cache has room for (``None``: no bound); at least one
                is always allowed.
        """
        self._largest, self.room = largest, room
        if self.cap <= 0:
            return 0
        if self.consume is None:
            want = self.start
        else:
            want = math.ceil(self.fetch_seconds(largest) / max(self.consume, _MIN_CONSUME) + self.margin)
        bound = self.cap if room is None else min(self.cap, room)
        self.current = max(1, min(want, bound))
        self.peak = max(self.peak, self.current)
        return self.current

    def stats(self) -> AheadStats:
        """A snapshot of the estimates and the depth."""
        return AheadStats(
            depth=self.current,
            peak=self.peak,
            cap=self.cap,
            room=self.room,
            fetch_seconds=self.fetch_seconds(self._largest),
            consume_seconds=self.consume,
            latency=self.latency,
            seconds_per_byte=self.seconds_per_byte,
            downloads=self.downloads,
            shards=self.shards,
        )


@dataclass
class _Task:
    entry: FileEntry
    cancelled: bool = False


class ReadAhead:
    """Background fetches of a window of files, at most ``threads`` at once on the executor's ``ahead`` lane.

    Args:
        threads: Concurrent fetches at most (0: read-ahead is off); may be changed
            between calls (the owner sets it to the depth of the window).
        fetch: Brings one file into the cache; errors are left to the reader's own
            acquire, which will meet them again and report them.
    """

    def __init__(self, threads: int, fetch: Fetch) -> None:
        self.threads = threads
        self._fetch = fetch
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._queue: list[_Task] = []
        self._running: dict[str, _Task] = {}
        self._workers: list[Future[None]] = []
        self._starved: set[str] = set()

    def want(self, entries: Iterable[FileEntry], held: Iterable[str] = ()) -> None:
        """Make ``entries`` (in order of use) the window; files in ``held`` are not fetched.

        An empty ``entries`` cancels everything, including fetches under way.
        """
        if self.threads <= 0:
            return
        wanted = list(entries)
        names = {e.name for e in wanted}
        skip = set(held)
        with self._lock:
            for task in self._queue:
                task.cancelled = task.entry.name not in names
            self._queue = [t for t in self._queue if not t.cancelled]
            if not names:
                for task in self._running.values():
                    task.cancelled = True
            queued = {t.entry.name for t in self._queue} | set(self._running) | skip
            for entry in wanted:
                if entry.name not in queued:
                    self._queue.append(_Task(entry))
                    queued.add(entry.name)
            self._start_workers()

    def starve(self, name: str) -> None:
        """Pause every fetch while the acquire of ``name`` waits for cache room."""
        with self._lock:
            self._starved.add(name)

    def fed(self, name: str) -> None:
        """The acquire of ``name`` no longer waits: fetches may go on."""
        with self._lock:
            self._starved.discard(name)

    def stop(self, timeout: float = 30) -> None:
        """Stop every fetch (in-flight downloads stop at their next chunk) and join the threads."""
        self._stop.set()
        with self._lock:
            self._queue.clear()
            workers = list(self._workers)
        wait(workers, timeout=timeout)
        with self._lock:
            self._workers = []
        self._stop = threading.Event()

    def _start_workers(self) -> None:
        """Start loops up to ``threads`` (the caller holds the lock)."""
        self._workers = [f for f in self._workers if not f.done()]
        while self._queue and len(self._workers) < self.threads and not self._stop.is_set():
            self._workers.append(io_executor().submit("ahead", self._loop, self._stop))

    def _loop(self, stop: threading.Event) -> None:
        """Fetch queued files until the queue is empty, then return (no idle loop holds a thread)."""
        while not stop.is_set():
            with self._lock:
                if not self._queue:
                    return
                task = self._queue.pop(0)
                self._running[task.entry.name] = task

            def cancelled(task: _Task = task) -> bool:
                return task.cancelled or stop.is_set() or bool(self._starved)

            try:
                if not cancelled():
                    self._fetch(task.entry, cancelled)
            except Exception as exc:  # noqa: BLE001 - the reader's acquire meets it again and reports it
                log.debug("read-ahead of %s failed: %s", task.entry.name, exc)
            finally:
                with self._lock:
                    self._running.pop(task.entry.name, None)


class ProcessReadAhead:
    """One process's read-ahead of a :class:`~.remote.RemoteStorage`: the window, its depth, when it may start.

    What it needs it is given here: the cache and the filler that bring a file in, the
    transport's link model and part planner (for the depth). The storage tells it what
    only the storage knows, as arguments: the files pinned (never fetched ahead), the
    largest shard and the cache room (for the depth), the time its reader was blocked.

    Args:
        url: The dataset's URL (for messages).
        read_ahead: The most shards ahead (0: read-ahead is off).
        cache: The cache the files go into.
        filler: Brings a file into the cache (its download, its version).
        link: The transport's link model.
        connections: How many connections a download of ``n`` bytes runs on at once.
    """

    def __init__(
        self,
        url: str,
        read_ahead: int,
        cache: ShardCache,
        filler: Filler,
        link: LinkModel,
        connections: Callable[[int], int],
    ) -> None:
        self.url = url
        self.read_ahead = read_ahead
        self.cache = cache
        self.filler = filler
        self.lock = threading.Lock()
        self.stop = threading.Event()  # set by close(): downloads ahead stop at their next chunk
        # Clear while a reader makes its first item from a cold shard read early, and until
        # the process's first acquire (the reader names its first window just before):
        # nothing starts meanwhile (at most FIRST_READ_HOLD), so the first batch's bytes and
        # CPU do not go to other shards.
        self.first_read = threading.Event()
        self.together: set[str] = set()  # files the reader needs now (see fetch_ahead): never held
        self.blocked = 0.0  # seconds the process's acquires waited for a file to arrive
        self.depth = AheadDepth(read_ahead, link=link, connections=connections)
        self.window = ReadAhead(read_ahead, self._fetch_one)

    def stats(self) -> AheadStats:
        """The depth and the estimates it comes from."""
        with self.lock:
            return self.depth.stats()

    def fetched(self) -> None:
        """Count one whole download."""
        with self.lock:
            self.depth.fetched()

    def waited(self, seconds: float) -> None:
        """The reader waited ``seconds`` for a file to arrive (not reading time)."""
        with self.lock:
            self.blocked += seconds

    def ahead_depth(self, largest: int, room: int | None) -> int:
        """Shards to name ahead now, for shards of up to ``largest`` bytes and ``room`` shards of cache room.

        ``ceil(fetch time of a shard / reading time of a shard + margin)`` (see
        :class:`AheadDepth`), at least 1, at most ``read_ahead`` and ``room``.
        """
        if self.read_ahead <= 0:
            return 0
        with self.lock:
            before = self.depth.current
            depth = self.depth.depth(largest, room)
            stats = self.depth.stats() if depth != before else None
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

    def want(self, entries: Iterable[FileEntry], together: Iterable[str], held: Iterable[str]) -> None:
        """Make ``entries`` (in order of use) the window; ``held`` (pinned here) are not fetched.

        See :meth:`~.remote.RemoteStorage.fetch_ahead` (``together``: needed now, not held back).
        """
        wanted = list(entries)
        now = {e.name for e in wanted} & set(together)
        with self.lock:
            if not self.first_read.is_set():  # the cold start: what the first batch needs stays urgent
                now |= self.together & {e.name for e in wanted}
            self.together = now
            if wanted:
                self.depth.observe_shard(time.monotonic(), self.blocked)
                self.window.threads = min(self.read_ahead, max(1, self.depth.current, len(now)))
            else:
                self.depth.pause()
        self.window.want(wanted, held)

    def close(self) -> None:
        """Stop every fetch ahead (in-flight downloads stop at their next chunk)."""
        self.stop.set()
        self.window.stop()
        self.stop = threading.Event()

    def _fetch_one(self, entry: FileEntry, cancelled: Callable[[], bool]) -> None:
        with self.lock:
            now = entry.name in self.together
        if not now:
            self.first_read.wait(FIRST_READ_HOLD)  # the first batch's bytes first
        if cancelled():
            return
        pin = self.cache.pin(entry.name)
        log.debug("read-ahead %s: start", entry.name)
        try:
            entry = self.filler.versioned(entry)
            download = self.filler.downloader(entry, self.stop, urgent=False)
            self.cache.fill(entry, download, wait=False, cancelled=cancelled)
            log.debug("read-ahead %s: done", entry.name)
        finally:
            # Read-ahead files are not kept pinned: pins held by a reader that is not
            # reading (its DataLoader queue is full) would starve the others. A fresh file
            # is the most recently used, so it is evicted last.
            pin.close()
