"""``streamload.watch``: is the training loop waiting on data, and which stage is to blame?

Wrap the loader the loop iterates; the batches are the same ones::

    watched = streamload.watch(loader)       # a DataLoader, a thread loader, any iterable
    for batch in watched:
        step(batch)
    report = watched.report()
    print(report)                            # a small table with percentages
    report.verdict                           # one sentence: input-bound?, the stage, the knob

Two things are measured, apart:

* **The wait**, in the loop's own thread: the time each ``next()`` of the loader takes
  (the first batch, start-up, is reported apart as ``first_batch_s``). Of the loop's wall
  time after the first batch, ``wait_fraction`` is the share spent waiting.
* **The stages**, in whoever reads: DataLoader workers, or the main process's threads.
  Each reader times its own fetch, read, transform and collate (see
  :mod:`streamload.timing`) into a row of a small table; a worker's row is shared
  memory made when the loader is watched, so nothing is sent per sample or per batch.

Under ``torch.distributed``, ``report(all_ranks=True)`` gathers every rank's figures (a
collective: call it on every rank) and names the slowest rank. The Lightning data module
watches its training loader and logs the figures (:class:`streamload.lightning.DataWatchCallback`).
"""

from __future__ import annotations

import os
import weakref
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Generic, TypeVar

import numpy as np

from ._errors import ConfigError
from ._gil import GilProbe, contention
from .dataset import StreamingDataset
from .timing import FIELDS, LOADER_COLLATE, STAGES, StageTable, stage_seconds
from .watch_report import DataReport, percent, verdict

__all__ = ["DataReport", "Mark", "Watch", "attached_watch", "watch"]

T = TypeVar("T")


@dataclass(frozen=True)
class Mark:
    """A point of a watched run; ``watch.report(since=mark)`` covers what came after it."""

    steps: int
    waits: int
    wait_s: float
    wall_s: float
    fields: tuple[tuple[float, ...], ...]
    device: tuple[tuple[str, float], ...] = ()
    gil_probes: int = 0


class Watch(Generic[T]):
    """An iterable of the loader's batches that measures the loop's waits and the readers' stages.

    Made by :func:`watch`. Iterating it iterates the loader (each ``iter()`` an epoch);
    :meth:`report` can be asked at any time, from the loop or after it.

    Attributes:
        loader: The watched loader; with ``attach=True`` its timed twin, the loader to hand
            to the framework (see :func:`watch`).
        settings: What the verdict knows of the loader (workers, prefetch, storage...).
    """

    def __init__(self, loader: Iterable[T], attach: bool = False) -> None:
        self.loader = loader = _twin(loader, self) if attach else loader
        datasets = _datasets(loader)
        self.settings = _settings(loader, datasets)
        started = _workers_started(loader)
        self._tables = [_table(ds, _workers(loader, ds)) for ds in datasets]
        self._base = tuple(tuple(t.fields()) for t in self._tables)
        self._device_base = tuple(device_stages(loader).items())
        self._measured = bool(self._tables) and not started
        if self._tables:
            for dl in _dataloaders(loader):
                table = next((t for ds, t in zip(datasets, self._tables, strict=True) if dl.dataset is ds), None)
                if table is not None and not isinstance(dl.collate_fn, _TimedCollate):
                    dl.collate_fn = _TimedCollate(dl.collate_fn, table)
        self._steps = 0
        self._first: float | None = None
        self._at_first = self._base
        self._waits = array("d")
        self._wait_s = 0.0
        self._wall_closed = 0.0
        self._open: weakref.WeakSet[_Timed[T]] = weakref.WeakSet()
        self._attached = attach
        self._gil = _gil_probe(loader, self)

    def __iter__(self) -> Iterator[T]:
        if self._attached:  # the loader's own iterators are timed already
            return iter(self.loader)
        return self.timed(lambda: iter(self.loader))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def timed(self, make: Callable[[], Iterator[T]]) -> Iterator[T]:
        """Return the iterator ``make()`` returns, each of its ``next()`` timed into this watch.

        The hook for a loader iterated by someone else (``attach=True``): the time
        ``make()`` takes (workers started) counts with the first batch.
        """
        start = perf_counter()
        inner = make()
        timed = _Timed(inner, start, perf_counter() - start, self._batch, self._end)
        self._open.add(timed)
        return timed

    # -- bookkeeping, called by the iterators ---------------------------------------

    def _batch(self, timed: _Timed[T], waited: float, now: float) -> None:
        self._steps += 1
        if self._first is None:
            self._first = waited
            timed.wall_start = now  # the loop's time is counted from its first batch
            self._at_first = tuple(tuple(t.fields()) for t in self._tables)  # the readers' busy share starts here
            return
        if timed.wall_start is None:
            timed.wall_start = timed.started
        self._waits.append(waited)
        self._wait_s += waited

    def _end(self, timed: _Timed[T], at: float) -> None:
        if timed.wall_start is not None:
            self._wall_closed += max(0.0, at - timed.wall_start)
            timed.wall_start = None
        self._open.discard(timed)

    def _wall(self, now: float) -> float:
        return self._wall_closed + sum(now - t.wall_start for t in list(self._open) if t.wall_start is not None)

    # -- reports --------------------------------------------------------------------

    def mark(self) -> Mark:
        """The run so far, for a later ``report(since=...)`` over what comes after it."""
        return Mark(
            self._steps,
            len(self._waits),
            self._wait_s,
            self._wall(perf_counter()),
            tuple(tuple(t.fields()) for t in self._tables),
            tuple(device_stages(self.loader).items()),
            0 if self._gil is None else self._gil.count(),
        )

    def report(self, all_ranks: bool = False, since: Mark | None = None) -> DataReport:
        """The figures of the run so far (or since ``since``) and their verdict.

        Args:
            all_ranks: Gather every rank's figures (``torch.distributed``; a collective:
                every rank must call it) into :attr:`DataReport.ranks` and name the
                slowest rank in :attr:`DataReport.slowest_rank` and the verdict.
            since: Only what came after this :meth:`mark` (e.g. since the last log).
        """
        wall = self._wall(perf_counter())
        waits = np.frombuffer(self._waits, dtype=np.float64) if len(self._waits) else np.zeros(0)
        base = self._base if since is None else since.fields
        if since is not None:
            waits = waits[since.waits :]
            wall -= since.wall_s
        wait_s = float(waits.sum())
        stages = stage_seconds(self._fields_since(base)) if self._measured else dict.fromkeys(STAGES, 0.0)
        readers = sum(t.readers() for t in self._tables) if self._measured else 0
        first = self._first if since is None else None
        workers = self.settings.get("num_workers")
        slots = workers if isinstance(workers, int) and workers > 0 else readers  # idle workers count too
        # The readers' share of the loop's time after the first batch (start-up is no stage time).
        after = stage_seconds(self._fields_since(self._at_first if since is None else since.fields))
        busy = sum(after.values()) / (slots * wall) if self._measured and slots and wall > 0 else None
        p50, p95, p99 = (float(x) * 1e3 for x in np.percentile(waits, [50, 95, 99])) if len(waits) else (0.0,) * 3
        report = DataReport(
            steps=self._steps - (since.steps if since is not None else 0),
            first_batch_s=first,
            wall_s=wall,
            wait_s=wait_s,
            wait_fraction=min(1.0, wait_s / wall) if wall > 0 else 0.0,
            wait_p50_ms=p50,
            wait_p95_ms=p95,
            wait_p99_ms=p99,
            stages=stages,
            readers=readers,
            busy_fraction=None if busy is None else min(1.0, busy),
            settings=dict(self.settings),
            rank=_rank(),
            waits_ms=(waits * 1e3).tolist(),
            device_stages=_since(device_stages(self.loader), self._device_base if since is None else since.device),
        )
        _gil_figures(report, self._gil, since)
        report.verdict = verdict(report)
        return _gathered(report) if all_ranks else report

    def _fields_since(self, base: tuple[tuple[float, ...], ...]) -> list[float]:
        """Every table's fields summed, less ``base`` (the same tables' fields at an earlier point)."""
        summed = [0.0] * FIELDS
        for table, before in zip(self._tables, base, strict=True):
            for i, (now, then) in enumerate(zip(table.fields(), before, strict=True)):
                summed[i] += now - then
        return summed

    def __repr__(self) -> str:
        return f"Watch({self.loader!r}, steps={self._steps})"


def watch(loader: Iterable[T], *, attach: bool = False) -> Watch[T]:
    """Watch a loader: iterate the result as the loader, then ask it for a :class:`DataReport`.

    Works with any iterable of batches: a ``DataLoader`` (or ``StatefulDataLoader``) over a
    :class:`~streamload.StreamingDataset`, a loader whose readers are threads, a
    Lightning ``CombinedLoader``, or the dataset itself. The stage times are measured for
    the :class:`~streamload.StreamingDataset` behind it; other loaders get the waits only.
    Watch a loader before its persistent workers start (its first ``iter()``): workers
    already running cannot be given the stage table, and the report says so.

    Args:
        loader: The iterable the training loop reads.
        attach: For a framework that iterates the loader it is given, as Lightning does:
            the returned watch's :attr:`Watch.loader` is then a twin of ``loader`` (an
            instance of a subclass of its class, sharing its attributes, whose own
            iterations are timed) to hand to the framework in its place; ``loader``
            itself is left as it was. The :class:`Watch` then only reports. Watching the
            twin again returns the same watch (:func:`attached_watch`).

    Example:
        >>> watched = watch(DataLoader(ds, batch_size=None, num_workers=4))  # doctest: +SKIP
        >>> for batch in watched: ...  # doctest: +SKIP
        >>> print(watched.report())  # doctest: +SKIP
    """
    if attach:
        existing = attached_watch(loader)
        if existing is not None:
            return existing
    return Watch(loader, attach=attach)


def attached_watch(loader: object) -> Watch[Any] | None:
    """The watch whose timed twin ``loader`` is (``watch(..., attach=True).loader``), else ``None``."""
    found = getattr(type(loader), "streamload_watch", None)
    return found if isinstance(found, Watch) else None


class _Timed(Generic[T]):
    """One iteration of a watched loader: each ``next()`` timed."""

    __slots__ = ("__weakref__", "_inner", "_on_batch", "_on_end", "_pending", "started", "wall_start")

    def __init__(
        self,
        inner: Iterator[T],
        started: float,
        opening: float,
        on_batch: Callable[[_Timed[T], float, float], None],
        on_end: Callable[[_Timed[T], float], None],
    ) -> None:
        self._on_batch = on_batch  # the owning watch's bookkeeping: (iterator, waited, now)
        self._on_end = on_end  # and at the iteration's end: (iterator, at)
        self._inner = inner
        self._pending = opening  # the time iter() took (workers started) counts with the first batch
        self.started = started
        self.wall_start: float | None = None

    def __iter__(self) -> _Timed[T]:
        return self

    def __next__(self) -> T:
        start = perf_counter()
        try:
            batch = next(self._inner)
        except StopIteration:
            self._on_end(self, start)
            raise
        now = perf_counter()
        self._on_batch(self, now - start + self._pending, now)
        self._pending = 0.0
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # the inner iterator's own attributes
        if name in _Timed.__slots__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __del__(self) -> None:
        try:
            self._on_end(self, perf_counter())
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


class _TimedCollate:
    """A DataLoader's ``collate_fn``, its time charged to the ``collate`` stage of the reader running it."""

    def __init__(self, fn: Any, table: StageTable) -> None:
        self.fn = fn
        self.table = table

    def __call__(self, batch: Any) -> Any:
        return self.table.clock().collate(self.fn, batch, LOADER_COLLATE)

    def __repr__(self) -> str:
        return f"_TimedCollate({self.fn!r})"


# -- the loader: its datasets, settings, attaching --------------------------------------


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, Mapping):
        return list(obj.values())
    if isinstance(obj, list | tuple):
        return list(obj)
    flattened = getattr(obj, "flattened", None)  # Lightning's CombinedLoader
    if isinstance(flattened, list):
        return flattened
    out = []
    for name in ("dataset", "loader"):  # a DataLoader or a thread loader; a DevicePrefetcher, a Watch
        child = getattr(obj, name, None)
        if child is not None:
            out.append(child)
    return out


def _walk(obj: Any, depth: int = 0) -> Iterator[Any]:
    yield obj
    if depth < 4 and not isinstance(obj, StreamingDataset):
        for child in _children(obj):
            yield from _walk(child, depth + 1)


def _datasets(loader: Any) -> list[StreamingDataset]:
    out: list[StreamingDataset] = []
    for obj in _walk(loader):
        if isinstance(obj, StreamingDataset) and all(obj is not d for d in out):
            out.append(obj)
    return out


def _dataloaders(loader: Any) -> list[Any]:
    from torch.utils.data import DataLoader

    return [obj for obj in _walk(loader) if isinstance(obj, DataLoader)]


def _owner(loader: Any, dataset: StreamingDataset) -> Any:
    """The DataLoader that reads ``dataset``, if any."""
    return next((dl for dl in _dataloaders(loader) if dl.dataset is dataset), None)


def _workers(loader: Any, dataset: StreamingDataset) -> int:
    dl = _owner(loader, dataset)
    return int(dl.num_workers) if dl is not None else 0


def _workers_started(loader: Any) -> bool:
    """True if a DataLoader's persistent workers are running already (they cannot get the stage table)."""
    for dl in _dataloaders(loader):
        running = dl.num_workers > 0 and getattr(dl, "_iterator", None) is not None
        if running and isinstance(dl.dataset, StreamingDataset) and dl.dataset.stage_table is None:
            return True
    return False


def _table(dataset: StreamingDataset, workers: int) -> StageTable:
    table = dataset.stage_table
    if table is None or (workers > 0 and table.rows < workers):
        table = dataset.stage_table = StageTable(workers)
    return table


def _settings(loader: Any, datasets: list[StreamingDataset]) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    out: dict[str, Any] = {"loader": type(loader).__name__, "cpus": os.cpu_count() or 1}
    dl = next((d for d in _dataloaders(loader)), None)
    if isinstance(dl, DataLoader):
        out["num_workers"] = int(dl.num_workers)
        out["prefetch_factor"] = dl.prefetch_factor if dl.num_workers else None
        out["persistent_workers"] = bool(dl.persistent_workers)
        out["pin_memory"] = bool(dl.pin_memory)
        out["loader_batches"] = dl.batch_size is not None  # the DataLoader collates samples
    else:
        out["num_workers"] = None  # a loader of threads, or the dataset itself
    if datasets:
        ds = datasets[0]
        out["transform"] = None if ds.transform is None else type(ds.transform).__name__
        out["collate"] = None if ds.collate is None else type(ds.collate).__name__
        url = ds.streams.refs[0].data_url
        out["remote"] = "://" in url and not url.startswith("file://")
        out["cache"] = ds.storage.cache
        out["read_ahead"] = ds.storage.read_ahead
        out["stream_buffer"] = ds.storage.stream_buffer
    return out


def _twin(loader: Any, owner: Watch[Any]) -> Any:
    """A twin of ``loader`` whose own iterations report to ``owner``; ``loader`` is not changed.

    The twin is an instance of a subclass of the loader's class (so a framework treats it
    as it treats the loader) made without ``__init__``, sharing the loader's attributes
    (its dataset, its settings) as they are now; only ``__iter__`` differs. The subclass
    names the watch (``streamload_watch``, see :func:`attached_watch`).
    """
    cls = type(loader)
    attributes = getattr(loader, "__dict__", None)
    if attributes is None or getattr(cls, "__slots__", None):
        raise ConfigError(f"watch(attach=True) cannot time a {cls.__name__}: wrap it instead")

    sub: Any = None  # the subclass, made below

    def __iter__(self: Any) -> Any:  # noqa: N807 - the twin's iterator
        return owner.timed(super(sub, self).__iter__)

    body = {"__iter__": __iter__, "__slots__": (), "__module__": cls.__module__, "streamload_watch": owner}
    sub = type(cls.__name__, (cls,), body)
    sub.__qualname__ = cls.__qualname__  # pickled, the twin is the loader's class again
    try:
        twin = sub.__new__(sub)
    except TypeError as exc:  # a __new__ that wants arguments
        raise ConfigError(f"watch(attach=True) cannot time a {cls.__name__}: wrap it instead") from exc
    vars(twin).update(attributes)
    return twin


# -- stages on the training device ---------------------------------------------------------


def device_stages(loader: Any) -> dict[str, float]:
    """Seconds of the stages the training process runs on its device, found in the loader's tree.

    An object there with a ``device_stage_seconds()`` method (``DeviceDecode.iterate(...)``,
    whose ``"decode"`` is timed with CUDA events on a GPU) reports them; summed by name.
    """
    out: dict[str, float] = {}
    seen: set[int] = set()
    for obj in _walk(loader):
        timing = getattr(type(obj), "device_stage_seconds", None)
        if timing is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        for name, seconds in obj.device_stage_seconds().items():
            out[name] = out.get(name, 0.0) + float(seconds)
    return out


def _since(now: dict[str, float], base: tuple[tuple[str, float], ...]) -> dict[str, float]:
    before = dict(base)
    return {name: max(0.0, seconds - before.get(name, 0.0)) for name, seconds in now.items()}


# -- the GIL --------------------------------------------------------------------------------


def _gil_probe(loader: Any, owner: Watch[Any]) -> GilProbe | None:
    """A GIL probe when the loader's readers are threads of this process (they and the loop share the GIL)."""
    threads = next(
        (
            obj.threads
            for obj in _walk(loader)
            if type(obj).__name__ == "Loader" and type(obj).__module__ == "streamload.loader"
        ),
        None,
    )
    if threads is None:
        return None
    owner.settings["threads"] = int(threads)
    return GilProbe(owner)


def _gil_figures(report: DataReport, probe: GilProbe | None, since: Mark | None) -> None:
    """Put the probe's figures (since ``since``) into ``report``."""
    if probe is None:
        return
    delays, loop_cpu = probe.since(0 if since is None else since.gil_probes)
    report.gil_wait_p50_ms, report.gil_busy = contention(delays, probe.switch_s)
    report.loop_cpu_share = None if loop_cpu is None else min(1.0, loop_cpu)


# -- ranks --------------------------------------------------------------------------------


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gathered(report: DataReport) -> DataReport:
    """Every rank's report (all_gather_object), the slowest named; returned on every rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, report.to_dict())
        ranks = [DataReport.from_dict(row) for row in rows]
    else:
        ranks = [DataReport.from_dict(report.to_dict())]
    slowest = max(ranks, key=lambda r: (r.wait_s, r.wait_fraction))
    report.ranks = ranks
    report.slowest_rank = slowest.rank
    others = [r.wait_fraction for r in ranks if r.rank != slowest.rank]
    if others:
        report.verdict = (
            f"Rank {slowest.rank} is the slowest: it waits {percent(slowest.wait_fraction)} of its time for data "
            f"(the others at most {percent(max(others))}), and the job runs at its pace. On rank {slowest.rank}: "
            f"{slowest.verdict}"
        )
    return report
