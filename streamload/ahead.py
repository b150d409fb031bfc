"""The fetch node: bring what the plan reads next before the reader asks for it, and own the cold start.

:class:`FetchAhead` sits between the plan and the read node: it passes on the runs (or
planned batches) the read node reads, and is the one stage that opens shards ahead of the
read and asks the storage for bytes. Below it, :class:`~streamload.shards.ShardSource`
is the readers' cache (get, evict, close) and calls nothing above it.

The cold start (cached mode, until the reader's first item is out): a shard not cached
yet is opened over its download, and the samples of the batch (or run) about to be read
are asked for at once by ranged GETs (:meth:`FetchAhead.prepare`); at the first item
(:meth:`FetchAhead.started`) the cold start ends and each storage is told, through its
one call for it (:meth:`~streamload.storage.Storage.started`), that its read-ahead may
share the link now.

Fetch-ahead, two ways, by how a stream is read:

* cached (shards downloaded whole): as runs pass, the shards the plan comes to next are
  named to the storage's read-ahead (:class:`ShardsAhead`, one per stream); how many is
  asked of the storage at each shard opened (a remote storage adapts it to the measured
  download and reading times);
* streamed (ranged GETs): as planned batches pass, the byte ranges of the batches after
  them are fetched while what is fetched and not yet read stays under ``stream_buffer``
  (:meth:`FetchAhead.batches`; one stage boundary per batch, never per sample).

Both keep plain-data state (:meth:`FetchAhead.state`) and let go of everything in
:meth:`FetchAhead.reset`. The public knob is ``read_ahead`` (:class:`~streamload.StorageConfig`).

A watched iteration gives the node its clock's fetch context (:attr:`FetchAhead.timer`):
the shard opens it makes are timed as the fetch stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import numpy as np

from ._errors import StreamloadError
from ._files import FileEntry
from .formats import RangedReads, ShardReader
from .plan import Run
from .shards import ShardSource
from .storage import Storage
from .storage.executor import io_executor
from .storage.ranges import Ticket
from .streams import MixedSource

__all__ = ["FetchAhead", "ShardsAhead", "group_runs"]

#: How many shard changes ahead a reader looks for shards to name to the read-ahead.
_SCAN = 64
#: Streaming mode: planned batches whose ranges are fetched ahead, at most (the byte
#: budget, ``stream_buffer``, usually binds first).
_MAX_BATCHES_AHEAD = 32


class ShardsAhead:
    """Cached mode, one stream: pass runs through; when a run opens a shard, name the next shards to read-ahead.

    Args:
        source: The stream's readers (its storage does the fetching).
        ahead: One shard per change of shard in the runs to come (the same plan), so the
            two stay in step; what was read from it early waits in ``upcoming``.

    At the iteration's first shard, the shards the reader's plan comes back to before it
    leaves them (a shuffled reader's first batches draw on all of its partitions' shards:
    :meth:`_working_set`) are named too, in order of use, to be fetched at once and side by
    side: the first batch needs every one of them.
    """

    def __init__(self, source: ShardSource, ahead: Iterator[int]) -> None:
        self.source = source
        self.ahead = ahead
        self.upcoming: deque[int] = deque()
        self.current = -1
        self.first = True

    def state(self) -> dict[str, Any]:
        """Where it stands: the current shard, the shards read early from the plan, whether none was opened yet."""
        return {"current": self.current, "upcoming": list(self.upcoming), "first": self.first}

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Forget the shards read early, whatever ``state`` says (the plan's iterator is the caller's)."""
        self.upcoming.clear()
        self.current = -1
        self.first = True

    def fetch_ahead(self, runs: Iterable[Run]) -> Iterator[Run]:
        """Pass ``runs`` through, naming the next shards to the storage's read-ahead at each shard opened."""
        source, storage = self.source, self.source.storage
        enabled = storage.read_ahead > 0
        upcoming = self.upcoming
        for run in runs:
            if run.shard != self.current:
                self.current = run.shard
                if upcoming:
                    upcoming.popleft()  # == run.shard
                else:
                    next(self.ahead, None)
                if enabled and run.shard not in source:
                    together = self._working_set(source.capacity - 1) if self.first else []
                    wanted = self._next_shards(max(1, storage.ahead_depth(), len(together)))
                    if wanted:
                        shards = source.ref.manifest.shards
                        names = [f.name for s in together for f in shards[s].files]
                        storage.fetch_ahead([f for s in wanted for f in shards[s].files], names)
                self.first = False
            yield run

    def close(self) -> None:
        """Cancel the read-ahead named to the stream's storage (the epoch ended or was abandoned)."""
        storage = self.source.storage
        if storage.read_ahead:
            storage.fetch_ahead(())

    def _peek(self, index: int) -> int | None:
        """The plan's ``index``-th shard after the current one (read from it early), ``None`` past its end."""
        if index == len(self.upcoming):
            shard = next(self.ahead, None)
            if shard is None:
                return None
            self.upcoming.append(shard)
        return self.upcoming[index]

    def _working_set(self, most: int) -> list[int]:
        """The unopened shards read together with the current one, in order of first use; ``[]`` if none.

        The distinct shards after it up to the first the plan comes back to (one named
        already, or the current one itself): the reader holds them all open and reads them
        in turn, as a shuffled reader does with its partitions' shards. An unshuffled reader
        leaves each shard for good: nothing comes back, and nothing is named here. Nor when
        more than ``most`` shards come before the plan comes back (they could not all stay open).
        """
        seen = [self.current]
        for index in range(_SCAN):
            shard = self._peek(index)
            if shard is None:
                break
            if shard in seen:
                return [s for s in seen[1:] if s not in self.source]
            if len(seen) > most:
                break
            seen.append(shard)
        return []

    def _next_shards(self, count: int) -> list[int]:
        """Up to ``count`` distinct unopened shards that come after the current one, in order of first use."""
        out: list[int] = []
        for index in range(_SCAN):
            if len(out) >= count:
                break
            shard = self._peek(index)
            if shard is None:
                break
            if shard != self.current and shard not in out and shard not in self.source:
                out.append(shard)
        return out


def _warm_sidecars(source: ShardSource, shards: Iterable[int]) -> None:
    """Bring the sidecars of several shards about to open into the cache at once (one round trip, not one each).

    Each is acquired and released on the I/O executor's ``side`` lane (cached, unpinned:
    the reader's own acquire pins it); a failure is left to that acquire to meet again.
    """
    storage, entries = source.storage, source.ref.manifest.shards
    sidecars = [e.sidecar for e in (entries[s] for s in dict.fromkeys(shards)) if e.sidecar is not None]
    if len(sidecars) < 2:
        return
    executor = io_executor()
    for future in [executor.submit("side", _warm, storage, entry) for entry in sidecars]:
        future.exception()


def _warm(storage: Storage, entry: FileEntry) -> None:
    storage.acquire(entry)
    storage.release(entry)


class _Feed:
    """An iterator that yields what is pushed into it (a run at a time, never empty when asked)."""

    def __init__(self) -> None:
        self.items: deque[Run] = deque()

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> Run:
        return self.items.popleft()


class _AheadSplitter:
    """Split one plan's shard sequence into each stream's own (local numbers, repeats merged)."""

    def __init__(self, ahead: Iterator[int], locate: Callable[[int], tuple[int, int]], wanted: set[int]) -> None:
        self._ahead = ahead
        self._locate = locate
        self._queues: dict[int, deque[int]] = {s: deque() for s in wanted}
        self._last: dict[int, int] = {}

    def stream(self, s: int) -> Iterator[int]:
        queue = self._queues[s]
        while True:
            while not queue:
                shard = next(self._ahead, None)
                if shard is None:
                    return
                owner, local = self._locate(shard)
                if owner in self._queues and self._last.get(owner) != local:
                    self._queues[owner].append(local)
                    self._last[owner] = local
            yield queue.popleft()


class FetchAhead:
    """The fetch node of one iteration's readers (every stream of a :class:`~streamload.streams.MixedSource`).

    Args:
        readers: The iteration's readers.
        budget: Streaming: bytes of ranges fetched and not yet read, at most (``stream_buffer``).

    Attributes:
        cold: The cold start: the reader's first item is not out yet (see :meth:`started`).
        timer: The context its shard opens run in (a watched iteration's fetch clock), else ``None``.
    """

    def __init__(self, readers: MixedSource, budget: int) -> None:
        self.readers = readers
        self.budget = budget
        self.cold = True
        self.timer: AbstractContextManager[Any] | None = None
        self.shards: dict[int, ShardsAhead] = {}
        #: Streaming: the batches passed on whose ranges were requested, and their tickets.
        self._batches: deque[tuple[list[Run], list[tuple[int, Ticket | None]]]] = deque()

    def state(self) -> dict[str, Any]:
        """Plain data: each cached stream's shards ahead, and the streamed batches and bytes fetched ahead."""
        return {
            "cold": self.cold,
            "shards": [{"stream": s, **ahead.state()} for s, ahead in sorted(self.shards.items())],
            "batches": len(self._batches),
            "bytes": self.fetching(),
        }

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Drop the ranges fetched ahead and forget the shards read early, whatever ``state`` says.

        The fetch node holds only what it fetched ahead: a resumed chain fetches it again.
        """
        while self._batches:
            self.forget(self._batches.popleft()[1])
        for ahead in self.shards.values():
            ahead.reset()

    def close(self) -> None:
        """The iteration ended or was abandoned: each stream's read-ahead cancelled (before its readers close)."""
        for src in self.readers.sources:
            if src.storage.read_ahead:
                src.storage.fetch_ahead(())

    def started(self) -> None:
        """The reader's first item is out: the cold start ends, and each storage's read-ahead may share the link.

        No shard is opened over its download from now on (:attr:`ShardSource.early
        <streamload.shards.ShardSource.early>`); a cached stream's storage is told through
        :meth:`~streamload.storage.Storage.started` (once per stream).
        """
        if not self.cold:
            return
        self.cold = False
        for src in self.readers.sources:
            src.early = False
            if src.storage.cached:
                src.storage.started()

    def prepare(self, runs: Sequence[Run]) -> None:
        """A planned batch about to be read: its cold shards opened, its samples' bytes asked for now.

        In the cold start, the batch's first cold shard of each stream is opened, then the
        others' sidecars come together, then each of its shards is opened over its download
        while there is room. Every sample of the batch in a shard still landing is then asked
        for by ranged GETs, before the first is read (those in the download's lead too when
        the batch reads several shards, whose downloads' leads wait for each other's parts).
        A shard that cannot be opened is left to the read, which meets its error again as
        its error policy says.
        """
        try:
            if self.cold:
                self._open_cold(run.shard for run in runs)
            spread = len({run.shard for run in runs}) > 1
            for run in runs:
                self._want(run.shard, run.locals, spread)
        except StreamloadError:
            pass  # the read meets it again, as its error policy says

    def prepared(self, runs: Iterable[Run]) -> Iterator[Run]:
        """Pass ``runs`` through (read sample by sample), each made ready as it is passed on.

        In the cold start a run's shard is opened over its download; a run of a shard still
        landing has its samples' bytes asked for by ranged GETs before they are read.
        """
        for run in runs:
            try:
                self._want(run.shard, run.locals, False)
            except StreamloadError:
                pass  # the read meets it again, as its error policy says
            yield run

    def _open(self, src: ShardSource, shard: int) -> ShardReader:
        """``src.get(shard)``; an open (not a reader already open) in :attr:`timer`."""
        timer = self.timer
        if timer is None or shard in src:
            return src.get(shard)
        with timer:  # a watched iteration's fetch stage: the download or cache wait, and the open
            return src.get(shard)

    def _open_cold(self, shards: Iterable[int]) -> None:
        """A cold start's batch: its first cold shard opened, then the others' sidecars fetched together.

        A cold shard is opened over its download, after its sidecar (one GET each): one
        after another, a shuffled first batch over several shards waited for each in turn.
        The first is opened before the others' sidecars come, so that their acquires are
        not taken for a whole-file read that ends the cold start's hold on read-ahead.
        """
        readers = self.readers
        by_stream: dict[int, list[int]] = {}
        for shard in dict.fromkeys(shards):
            info = readers.info(shard)
            if info.local not in readers.sources[info.stream]:
                by_stream.setdefault(info.stream, []).append(info.local)
        for stream, locals_ in by_stream.items():
            src = readers.sources[stream]
            if src.opens_early and len(locals_) > 1:
                self._open(src, locals_[0])
                _warm_sidecars(src, locals_[1:])

    def _want(self, shard: int, indices: np.ndarray, spread: bool) -> None:
        """Samples ``indices`` of global ``shard`` about to be read: if it is read over its download, their bytes now.

        In the cold start a shard not open yet is opened first (over its download). A cold
        start's first batches take their samples from all over their shards: they come by
        ranged GETs in parallel rather than after the parts holding them
        (:meth:`~streamload.storage.bytes.Landing.want`; ``spread``: those in the
        download's lead too). Nothing for other shards.
        """
        info = self.readers.info(shard)
        src = self.readers.sources[info.stream]
        if self.cold and src.opens_early:
            self._open(src, info.local)
        landing = src.landing(info.local)
        if landing is not None:
            reader, download = landing
            download.want(map(tuple, reader.sample_extents(indices).tolist()), spread)

    def runs(self, runs: Iterator[Run], ahead: Iterator[int]) -> Iterator[Run]:
        """Pass ``runs`` through, naming each cached stream's next shards to its storage's read-ahead.

        ``ahead`` yields the plan's shards, one per change of shard in ``runs``; it is split
        per stream. Streams read by ranges download no shard ahead (:meth:`batches` fetches
        their batches' ranges instead).
        """
        readers = self.readers
        sources = readers.sources
        cached = {s for s, src in enumerate(sources) if src.storage.read_ahead > 0 and not src.streaming}
        if not cached:
            yield from runs
            return
        if len(sources) == 1:
            self.shards[0] = ShardsAhead(sources[0], ahead)
            yield from self.shards[0].fetch_ahead(runs)
            return
        splitter = _AheadSplitter(ahead, readers.locate, cached)
        feeds = {s: _Feed() for s in cached}
        self.shards = {s: ShardsAhead(sources[s], splitter.stream(s)) for s in cached}
        passes = {s: self.shards[s].fetch_ahead(feeds[s]) for s in cached}
        try:
            for run in runs:
                s, local = readers.locate(run.shard)
                if s in feeds:
                    feeds[s].items.append(Run(local, run.locals, run.positions, run.items))
                    next(passes[s])
                yield run
        finally:
            for gen in passes.values():
                if isinstance(gen, Generator):
                    gen.close()

    def fetching(self) -> int:
        """Bytes of ranges fetched ahead and not forgotten yet, all streams."""
        return sum(src.fetcher.outstanding for src in self.readers.sources if src.fetcher is not None)

    def batches(self, batches: Iterator[list[Run]], *, prepare: bool = True) -> Iterator[list[Run]]:
        """Pass planned batches on to be read: streaming, their byte ranges fetched ahead; each made ready.

        ``prepare``: each batch passed on is read as a whole (a collate's batch) and made
        ready first (:meth:`prepare`); else its runs are passed on one by one by
        :meth:`prepared`. Streaming, see :meth:`ranges_ahead`.
        """
        for batch in self.ranges_ahead(batches):
            if prepare:
                self.prepare(batch)  # a cold start: every sample's bytes asked for before the first is read
            yield batch

    def ranges_ahead(self, batches: Iterator[list[Run]]) -> Iterator[list[Run]]:
        """Streaming: pass planned batches through, their byte ranges fetched ahead.

        Before a batch is yielded, the ranges of the batches after it are requested while
        the bytes fetched and not yet read stay under the budget (the next batch is always
        requested; at most two more per batch yielded, so the look-ahead grows to the
        budget over the first batches and the first one is not delayed); a batch's ranges
        are dropped once the caller comes back for the next one.
        """
        if not self.readers.streaming:
            yield from batches
            return
        ahead = self._batches
        more = True
        try:
            while True:
                planned = 0
                while more and (
                    not ahead or (planned < 2 and self.fetching() < self.budget and len(ahead) < _MAX_BATCHES_AHEAD)
                ):
                    planned += 1
                    batch = next(batches, None)
                    if batch is None:
                        more = False
                        break
                    ahead.append((batch, self.fetch_ahead(batch)))
                if not ahead:
                    return
                batch, tickets = ahead.popleft()
                yield batch
                self.forget(tickets)
        finally:
            self.reset()

    def fetch_ahead(self, runs: Sequence[Run]) -> list[tuple[int, Ticket | None]]:
        """Streaming: start fetching the byte ranges of a planned batch's ``runs``; return the tickets to forget."""
        readers = self.readers
        by_stream: dict[int, list[tuple[int, Any]]] = {}
        for run in runs:
            s, local = readers.locate(run.shard)
            if readers.sources[s].streaming:
                by_stream.setdefault(s, []).append((local, run.locals))
        return [(s, self._fetch_ranges(readers.sources[s], parts)) for s, parts in by_stream.items()]

    def _fetch_ranges(self, source: ShardSource, parts: Iterable[tuple[int, np.ndarray]]) -> Ticket | None:
        """Streaming: start fetching the byte ranges of a planned batch's samples (``(shard, locals)``) of one stream.

        Opens the shards' readers (their sidecars) to learn the samples' extents. A shard
        that cannot be opened is left out: its error comes when the batch is read. Returns
        the ticket to forget once the batch was read (``None``: not streaming).
        """
        fetcher = source.fetcher
        if fetcher is None:
            return None
        by_shard: dict[int, list[np.ndarray]] = {}
        for shard, locals_ in parts:
            by_shard.setdefault(shard, []).append(np.asarray(locals_, dtype=np.int64))
        _warm_sidecars(source, [s for s in by_shard if s not in source])  # the shards about to open: at once
        wanted: list[tuple[str, int, list[tuple[int, int]]]] = []
        for shard, chunks in by_shard.items():
            try:
                reader = cast(RangedReads, self._open(source, shard))  # a ranged format's reader: it says the extents
            except StreamloadError:
                continue
            extents = reader.sample_extents(np.concatenate(chunks) if len(chunks) > 1 else chunks[0])
            entry = source.ref.manifest.shards[shard]
            wanted.append((entry.name, entry.num_bytes, [(int(a), int(b)) for a, b in extents.tolist()]))
        return fetcher.fetch(wanted)

    def forget(self, tickets: Iterable[tuple[int, Ticket | None]]) -> None:
        """Drop the ranges of a batch that was read."""
        for s, ticket in tickets:
            fetcher = self.readers.sources[s].fetcher
            if ticket is not None and fetcher is not None:
                fetcher.forget(ticket)


def group_runs(runs: Iterable[Run], chunk: int) -> Iterator[list[Run]]:
    """Cut a worker's plan runs at batch boundaries; yield each batch's runs, in order.

    A batch is the items whose rank position ``p`` share ``p // chunk``; the planner
    hands a worker whole chunks (``chunk == batch_size``), so this follows its batches
    exactly, including a partial first batch after a mid-batch resume.
    """
    parts: list[Run] = []
    current = -1
    for run in runs:
        batch_of = run.positions // chunk
        cuts = np.flatnonzero(np.diff(batch_of)) + 1
        bounds = [0, *cuts.tolist(), len(batch_of)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if a == b:
                continue
            batch = int(batch_of[a])
            if batch != current and parts:
                yield parts
                parts = []
            current = batch
            parts.append(Run(run.shard, run.locals[a:b], run.positions[a:b], run.items[a:b]))
    if parts:
        yield parts
