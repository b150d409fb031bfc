"""Streaming mode: byte ranges of remote objects fetched ahead, coalesced, within a memory budget.

In streaming mode (``StorageConfig(cache="none")``) a shard is never downloaded whole:
its reader knows every sample's byte extent from the shard's index, so the bytes a planned
batch needs are fetched by ranged GETs, several batches ahead, and the reader's
positioned reads are served from them::

    plan a batch   [(name, size, [(start, end), ...]), ...]     -- from the shards' indexes
    coalesce       extents closer than ``gap`` merged, spans at most ``max_span`` long
    submit         one GET per span on the process's I/O executor (its ``ranges`` lane,
                   see .executor), each retried (RemoteFiles.call)
    read           bytes.StreamedFile.pread / preadv: copy from the fetched spans (waiting on a
                   span still in flight); a byte no span holds is fetched by a direct GET
    forget         once the batch was read its spans are dropped (the budget frees up)

The caller bounds memory: it plans batches ahead only while the bytes of the batches
planned and not yet forgotten stay under a budget (see :meth:`RangeFetcher.outstanding`).
Nothing here checks bytes: the reader checks each sample's checksum. Knows only names,
sizes and ranges (no format, no manifest).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

from .._errors import CorruptShardError
from .executor import LANES, io_executor
from .transport import RemoteFiles

__all__ = [
    "DEFAULT_STREAM_BUFFER",
    "FetchStats",
    "RangeFetcher",
    "Ticket",
    "coalesce",
]

_KIB = 1 << 10
_MIB = 1 << 20
#: Bytes of fetched ranges a process holds ahead of its reads by default.
DEFAULT_STREAM_BUFFER = 64 * _MIB
#: Concurrent GETs of one process (16: a far bucket's 50 ms turns need that many in flight to fill the link).
DEFAULT_THREADS = LANES["ranges"]
#: Smallest and largest gap merged into one request. The gap chosen is latency x rate
#: divided by the concurrent GETs: reading it on one connection costs about what one more
#: request costs while the other connections are busy; a larger one would read mostly
#: bytes nobody asked for (a shuffled batch takes a few samples from each shard).
MIN_GAP, MAX_GAP = 64 * _KIB, 1 * _MIB
#: Smallest and largest span one GET fetches: two latencies' worth of bytes at the
#: measured rate, so one batch's bytes are spread over several connections.
MIN_SPAN, MAX_SPAN = 1 * _MIB, 8 * _MIB


def coalesce(extents: Sequence[tuple[int, int]], gap: int, max_span: int = MAX_SPAN) -> list[tuple[int, int]]:
    """Merge ``[start, end)`` extents into spans: sorted, closer than ``gap`` joined, none longer than ``max_span``.

    Overlapping and repeated extents are merged; an extent longer than ``max_span`` is
    cut into pieces of at most ``max_span``. Empty extents are dropped.

    Example:
        >>> coalesce([(100, 200), (0, 50), (60, 90), (1000, 1100)], gap=10)
        [(0, 200), (1000, 1100)]
    """
    spans: list[tuple[int, int]] = []
    for start, end in sorted(e for e in extents if e[1] > e[0]):
        if spans:
            a, b = spans[-1]
            if start - b <= gap and max(b, end) - a <= max_span:
                spans[-1] = (a, max(b, end))
                continue
            if start < b:  # overlaps a full span: keep only the new part
                start = b
                if end <= start:
                    continue
        while end - start > max_span:
            spans.append((start, start + max_span))
            start += max_span
        spans.append((start, end))
    return spans


@dataclass
class FetchStats:
    """What one process's fetcher did (for tests and benchmarks).

    Attributes:
        requests: GETs made (spans fetched ahead plus direct reads).
        spans: Spans fetched ahead.
        misses: Reads no fetched span covered (each one direct GET per hole).
        bytes: Bytes received.
        wanted: Bytes of the samples' extents asked for ahead (``bytes / wanted`` is the
            read amplification of coalescing).
    """

    requests: int = 0
    spans: int = 0
    misses: int = 0
    bytes: int = 0
    wanted: int = 0


def _failed(data: Future[bytes]) -> bool:
    """A span's GET cancelled, or ended in an error (not shared: a later batch asks again)."""
    return data.cancelled() or (data.done() and data.exception() is not None)


@dataclass(eq=False)
class _Span:
    start: int
    end: int
    data: Future[bytes]
    #: The tickets holding it (a batch whose bytes an earlier batch's span holds shares it).
    refs: int = 1


@dataclass
class Ticket:
    """The spans fetched for one planned batch; :meth:`RangeFetcher.forget` drops them.

    Attributes:
        bytes: Bytes of the spans fetched for it (not those it shares with earlier batches).
    """

    spans: list[tuple[str, _Span]] = field(default_factory=list)
    bytes: int = 0


class RangeFetcher:
    """Ranges of the objects under one URL prefix, fetched ahead on the process's I/O executor.

    Args:
        files: The objects' prefix (its calls are retried).
        threads: Concurrent GETs assumed when choosing the gap (the executor's ``ranges`` lane runs them).
        gap: Gap merged into one request; ``None``: latency x rate of ``files``'
            measurements over ``threads``, between :data:`MIN_GAP` and :data:`MAX_GAP`.
        max_span: Longest single GET; ``None``: two latencies at the measured rate,
            between :data:`MIN_SPAN` and :data:`MAX_SPAN`.
    """

    def __init__(
        self,
        files: RemoteFiles,
        threads: int = DEFAULT_THREADS,
        gap: int | None = None,
        max_span: int | None = None,
    ) -> None:
        self.files = files
        self.threads = threads
        self._max_span = max_span
        self._gap = gap
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._spans: dict[str, list[_Span]] = {}  # name -> spans sorted by start
        self._starts: dict[str, list[int]] = {}  # name -> their starts (for bisect)
        self._outstanding = 0
        self._closed = False

    @property
    def gap(self) -> int:
        """Bytes between two extents below which they are fetched as one span."""
        if self._gap is not None:
            return self._gap
        planner = self.files.planner
        return int(min(MAX_GAP, max(MIN_GAP, planner.latency * planner.rate / self.threads)))

    @property
    def max_span(self) -> int:
        """Longest single GET."""
        if self._max_span is not None:
            return self._max_span
        planner = self.files.planner
        return int(min(MAX_SPAN, max(MIN_SPAN, 2 * planner.latency * planner.rate)))

    @property
    def outstanding(self) -> int:
        """Bytes of the spans planned and not forgotten yet."""
        return self._outstanding

    def run(self, calls: Sequence[Callable[[], object]]) -> None:
        """Run ``calls`` on the executor and wait for them (their errors are ignored: the caller meets them again)."""
        executor = io_executor()
        for future in [executor.submit("side", call) for call in calls]:
            try:
                future.result()
            except Exception:  # noqa: BLE001, S110 - the caller's own call raises it again
                pass

    def get(self, name: str, start: int, end: int) -> bytes:
        """One retried GET of ``[start, end)`` of ``name``.

        Raises:
            CorruptShardError: If the object holds fewer bytes there (it is shorter than its entry).
            RangeResponseError: If the server answered with more bytes than asked or ignored
                the range (no byte past the range is read into memory).
            ShardNotFoundError, StorageError: As :meth:`RemoteFiles.call`.
        """
        data = self.files.get_range(name, start, end)
        with self._lock:
            self.stats.requests += 1
            self.stats.bytes += len(data)
        if len(data) != end - start:
            raise CorruptShardError(
                f"{self.files.url_of(name)}: bytes {start}-{end} came back as {len(data)} bytes "
                "(the object is shorter than its entry says)"
            )
        return data

    def fetch(self, wanted: Sequence[tuple[str, int, Sequence[tuple[int, int]]]]) -> Ticket:
        """Start fetching ``(name, size, extents)`` (coalesced per object); return the batch's ticket.

        Extents are clipped to ``[0, size)``. An extent a span of a batch not yet
        forgotten holds whole is not fetched again: the ticket shares that span (a row
        group, or a span's gap, that two batches both read). The spans serve reads until
        every ticket holding them is forgotten (:meth:`forget`).
        """
        ticket = Ticket()
        if self._closed:
            return ticket
        gap, span_cap, executor = self.gap, self.max_span, io_executor()
        for name, size, extents in wanted:
            clipped = [(max(0, a), min(size, b)) for a, b in extents]
            fresh: list[tuple[int, int]] = []
            with self._lock:
                self.stats.wanted += sum(max(0, b - a) for a, b in clipped)
                shared = {id(span) for _, span in ticket.spans}
                for start, end in clipped:
                    span = self._covering_locked(name, start) if end > start else None
                    if span is None or span.end < end or _failed(span.data):
                        fresh.append((start, end))
                    elif id(span) not in shared:
                        span.refs += 1
                        shared.add(id(span))
                        ticket.spans.append((name, span))
            for start, end in coalesce(fresh, gap, span_cap):
                span = _Span(start, end, executor.submit("ranges", self.get, name, start, end))
                ticket.spans.append((name, span))
                ticket.bytes += end - start
                with self._lock:
                    starts = self._starts.setdefault(name, [])
                    at = bisect.bisect_right(starts, start)
                    starts.insert(at, start)
                    self._spans.setdefault(name, []).insert(at, span)
                    self.stats.spans += 1
                    self._outstanding += end - start
        return ticket

    def forget(self, ticket: Ticket) -> None:
        """Drop a batch's spans no other ticket holds (cancelled if not started); their bytes leave the budget."""
        with self._lock:
            for name, span in ticket.spans:
                span.refs -= 1
                if span.refs > 0:
                    continue
                self._outstanding -= span.end - span.start
                spans = self._spans.get(name)
                if spans is not None:
                    starts = self._starts[name]
                    i = bisect.bisect_left(starts, span.start)
                    while i < len(spans) and spans[i] is not span:
                        i += 1
                    if i < len(spans):
                        del spans[i], starts[i]
                    if not spans:
                        del self._spans[name], self._starts[name]
                span.data.cancel()
            ticket.spans, ticket.bytes = [], 0

    def drop(self, name: str) -> None:
        """Forget every span of ``name`` (a read of it failed its checksum: the next reads fetch it again)."""
        with self._lock:
            spans = self._spans.pop(name, [])
            self._starts.pop(name, None)
        for span in spans:
            span.data.cancel()

    def _covering(self, name: str, offset: int) -> _Span | None:
        """The fetched span holding byte ``offset`` of ``name``, if any (the one reaching furthest)."""
        with self._lock:
            return self._covering_locked(name, offset)

    def _covering_locked(self, name: str, offset: int) -> _Span | None:
        spans = self._spans.get(name)
        if not spans:
            return None
        i = bisect.bisect_right(self._starts[name], offset)
        best: _Span | None = None
        for span in reversed(spans[max(0, i - 8) : i]):  # overlaps are rare: look a few back
            if span.start <= offset < span.end and (best is None or span.end > best.end):
                best = span
        return best

    def span_bytes(self, name: str, start: int, end: int) -> memoryview | None:
        """The bytes ``[start, end)`` of ``name`` if one fetched span holds them all (waiting for it), else ``None``."""
        span = self._covering(name, start)
        if span is None or span.end < end:
            return None
        try:
            data = span.data.result()
        except CancelledError:  # forgotten meanwhile: the caller reads directly
            return None
        return memoryview(data)[start - span.start : end - span.start]

    def read_into(self, name: str, size: int, view: memoryview, offset: int) -> int:
        """Fill ``view`` with the bytes of ``name`` at ``offset`` (fewer only past ``size``); return the count.

        Served from fetched spans (waiting for one in flight); every hole is one direct GET.
        """
        want = max(0, min(len(view), size - offset))
        done = 0
        while done < want:
            at = offset + done
            span = self._covering(name, at)
            if span is not None:
                try:
                    data = span.data.result()
                except CancelledError:  # forgotten meanwhile: fetch directly
                    span = None
                else:
                    take = min(span.end - at, want - done)
                    view[done : done + take] = memoryview(data)[at - span.start : at - span.start + take]
                    done += take
                    continue
            # A hole: fetch up to the next span's start (or the end of the read).
            stop = offset + want
            with self._lock:
                starts = self._starts.get(name, [])
                later = bisect.bisect_right(starts, at)
                if later < len(starts):
                    stop = min(stop, starts[later])
            with self._lock:
                self.stats.misses += 1
            data = self.get(name, at, stop)
            view[done : done + len(data)] = data
            done += len(data)
        return done

    def close(self) -> None:
        """Cancel every pending GET and drop every span; later fetches do nothing."""
        self._closed = True
        with self._lock:
            spans = [s for held in self._spans.values() for s in held]
            self._spans.clear()
            self._starts.clear()
            self._outstanding = 0
        for span in spans:
            span.data.cancel()
