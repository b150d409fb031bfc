"""Timing: the clocks of the seconds each reader of a watched loader spends per stage of the pipeline.

Nothing here runs unless a loader is watched (:func:`streamload.watch` gives the dataset a
:class:`StageTable`); an unwatched dataset pays one ``is None`` test per sample.

Where the time goes, and who charges it::

    fetch      a shard opened by the fetch or read node: its download or cache wait,  -- exact
               its reader; the reads of streamed bytes (streaming mode: the ranged
               GETs and the waits), through the view the read node puts over them
    read       the dataset's iteration (time inside ``next()``), less the rest        -- sampled
    transform  the per-sample transform                                               -- sampled
    collate    the dataset's ``collate`` (DecodeBatch, RawCollate of dicts)          -- exact
               and the DataLoader's ``collate_fn`` in its worker                     -- exact

"Sampled": one sample in :data:`SAMPLE_EVERY` is timed and counted that many times, so a
per-sample pipeline pays two clock reads per 16 samples instead of four per sample; whole
batches (a dataset ``collate``) are all timed.

Where the seconds travel: inside a DataLoader worker each reader adds into its own row of
one small shared-memory table (``float64[workers, 5]``, made only when a loader with
workers is watched), so the main process reads every worker's figures without a message;
in the main process (``num_workers=0``, or a loader whose readers are threads) each
thread adds into a row of its own, in the process's memory. A row has one writer, so
no lock is taken.

Nothing below the read path's nodes knows of a clock: the nodes
(:class:`~streamload.ahead.FetchAhead`, :class:`~streamload.stages.Read`) wrap the calls
they make into the shards' cache and storage in the clock's :attr:`Clock.fetch` context,
which :class:`~streamload.stages.Pipeline` installs when the dataset is watched.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from ._fork import ProcessLocal
from ._shared import shared_zeros

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUSY",
    "COLLATE",
    "FETCH",
    "FIELDS",
    "LOADER_COLLATE",
    "SAMPLE_EVERY",
    "STAGES",
    "TRANSFORM",
    "Clock",
    "StageTable",
    "current",
    "stage_seconds",
]

T = TypeVar("T")
R = TypeVar("R")

#: The stages a report names, in pipeline order.
STAGES = ("fetch", "read", "transform", "collate")
#: A row's fields: fetch; time inside the dataset's ``next()`` less fetch; transform; the
#: dataset's collate (inside ``next()``); the DataLoader's ``collate_fn`` (outside it).
FETCH, BUSY, TRANSFORM, COLLATE, LOADER_COLLATE = range(5)
FIELDS = 5
#: One sample in this many is timed on per-sample paths.
SAMPLE_EVERY = 16


class Row(Protocol):
    """A reader's fields: a ``float64`` memoryview (of shared memory, or of the process's own)."""

    def __getitem__(self, index: int) -> float: ...

    def __setitem__(self, index: int, value: float) -> None: ...


_active = False  # a clock was made in this process: hooks on hot paths look further
_local = threading.local()


def stage_seconds(fields: list[float]) -> dict[str, float]:
    """Turn a row's (or a sum of rows') fields into seconds per stage of :data:`STAGES`."""
    inside = fields[TRANSFORM] + fields[COLLATE]
    return {
        "fetch": max(0.0, fields[FETCH]),
        "read": max(0.0, fields[BUSY] - inside),
        "transform": max(0.0, fields[TRANSFORM]),
        "collate": max(0.0, fields[COLLATE] + fields[LOADER_COLLATE]),
    }


class _Fetching:
    """The context of a fetch: charges its time to ``fetch`` (only the outermost of nested ones)."""

    __slots__ = ("_clock", "_depth", "_start")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._depth = 0
        self._start = 0.0

    def __enter__(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._start = perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._clock.row[FETCH] += perf_counter() - self._start


class Clock:
    """One reader's stage seconds (a row of a :class:`StageTable`); used by one thread only.

    Attributes:
        row: The fields (see :data:`FIELDS`), shared memory inside a DataLoader worker.
    """

    __slots__ = ("_left", "fetch", "row")

    def __init__(self, row: Row) -> None:
        self.row = row
        self._left = SAMPLE_EVERY
        #: The context of a fetch (``with clock.fetch: ...``).
        self.fetch = _Fetching(self)

    def timed(self, items: Iterator[T], every: int = 1) -> Iterator[T]:
        """Pass ``items`` through, timing one ``next()`` in ``every`` (as ``every`` of them).

        The time inside ``next()`` is the dataset's own work; fetches inside it are
        charged to ``fetch`` by their own contexts and left out here. While it runs,
        this clock is the thread's :func:`current` one (a collate that times its decode finds it).
        """
        row = self.row
        _local.clock = self
        try:
            left = every
            start = fetched = 0.0
            if left == 1:
                fetched, start = row[FETCH], perf_counter()
            for item in items:
                if left == 1:
                    row[BUSY] += (perf_counter() - start - (row[FETCH] - fetched)) * every
                    left = every + 1
                yield item
                left -= 1
                if left == 1:
                    fetched, start = row[FETCH], perf_counter()
        finally:
            if getattr(_local, "clock", None) is self:
                _local.clock = None

    def transform(self, fn: Callable[[Any], R], sample: Any) -> R:
        """Return ``fn(sample)``; one call in :data:`SAMPLE_EVERY` is timed (as that many)."""
        self._left -= 1
        if self._left:
            return fn(sample)
        self._left = SAMPLE_EVERY
        start = perf_counter()
        out = fn(sample)
        self.row[TRANSFORM] += (perf_counter() - start) * SAMPLE_EVERY
        return out

    def collate(self, fn: Callable[[Any], R], samples: Any, field: int = COLLATE) -> R:
        """Return ``fn(samples)``, its time charged to ``collate``."""
        start = perf_counter()
        out = fn(samples)
        self.row[field] += perf_counter() - start
        return out

    def charge(self, seconds: float, field: int = COLLATE) -> None:
        """Charge ``seconds`` measured elsewhere (inside another stage's call) to ``field``."""
        self.row[field] += seconds


def current() -> Clock | None:
    """The clock of the watched iteration running in this thread, if any."""
    if not _active:
        return None
    clock: Clock | None = getattr(_local, "clock", None)
    return clock


class StageTable:
    """The stage seconds of every reader of one dataset, readable from the main process.

    Args:
        workers: DataLoader worker processes that will read (0: the readers are the main
            process's threads, and no shared memory is made).
    """

    def __init__(self, workers: int) -> None:
        self.rows = max(1, workers)
        self._shared: torch.Tensor | None = None
        if workers > 0:
            import torch

            self._shared = shared_zeros((self.rows, FIELDS), torch.float64)
        self._reset()

    def _reset(self) -> None:
        #: This process's own rows and clocks (a forked worker starts without its parent's threads').
        self._mine: ProcessLocal[_Threads] = ProcessLocal(_Threads)

    def __getstate__(self) -> dict[str, Any]:
        return {"rows": self.rows, "_shared": self._shared}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.rows = state["rows"]
        self._shared = state["_shared"]
        self._reset()

    def clock(self) -> Clock:
        """The calling thread's clock (made on first use); it becomes the thread's :func:`current` one."""
        global _active
        clocks = self._mine.get().clocks
        ident = threading.get_ident()
        clock = clocks.get(ident)
        if clock is None:
            clock = Clock(self._row())
            clocks[ident] = clock
        _active = True
        _local.clock = clock
        return clock

    def _row(self) -> Row:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None and self._shared is not None and info.id < self.rows:
            return cast(Row, self._shared[info.id].numpy().data)
        row = array("d", bytes(8 * FIELDS))
        mine = self._mine.get()
        with mine.lock:
            mine.rows.append(row)
        return cast(Row, memoryview(row))

    def fields(self) -> list[float]:
        """Every reader's fields summed (the workers' from shared memory, this process's threads')."""
        total = [0.0] * FIELDS
        if self._shared is not None:
            total = [float(x) for x in self._shared.sum(0).tolist()]
        mine = self._mine.get()
        with mine.lock:
            rows = list(mine.rows)
        for row in rows:
            for i in range(FIELDS):
                total[i] += row[i]
        return total

    def readers(self) -> int:
        """Readers (worker rows and threads) that recorded any time so far."""
        count = 0
        if self._shared is not None:
            count += int((self._shared.sum(1) > 0).sum())
        mine = self._mine.get()
        with mine.lock:
            count += sum(1 for row in mine.rows if any(row))
        return count


class _Threads:
    """One process's readers of a :class:`StageTable`: a row and a clock per thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[array[float]] = []
        self.clocks: dict[int, Clock] = {}
