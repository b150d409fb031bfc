"""One reader's iteration, as small stages: plan -> shard runs -> fetch ahead -> read -> transform/collate -> skip.

::

    plan          Planner.plan(epoch, world) -> EpochPlan; Position: where this reader starts
    shard runs    plan.runs(world, start) -> Run(shard, [local indices], positions, items)
    fetch         FetchAhead: the cold start (a batch's shards opened over their downloads, its
                  samples' bytes asked for); cached shards named to read-ahead; streamed
                  batches' ranges fetched ahead
    read          Read.run / Read.batch: MixedSource.get(shard) -> format reader -> sample dicts
                  (a corrupt copy read again once: streamload.recovery)
    transform     the per-sample transform; collate: the dataset's per-batch collate
    skip          Substitute: under on_error="skip", a bad sample counted and replaced

Each stage keeps plain-data state (``state()``) and lets go of it (``reset()``), as
torchdata's nodes do; :meth:`Pipeline.state` gathers them. A :class:`Pipeline` is a
plain iterator: a DataLoader worker runs it in its process, a :class:`streamload.Loader`
runs one per thread. Stage boundaries are per run or per batch, never per sample. Each
stage calls only the ones below it: the pipeline's top tells the fetch node when the first
item is out (:meth:`FetchAhead.started`). A watched iteration (:func:`streamload.watch`)
times the stages with a :class:`~streamload.timing.Clock`: fetch (shard opens, ranged GETs),
read, transform, collate. The nodes time the calls they make below them in the clock's
fetch context (the fetch and read nodes' shard opens, the reads of streamed bytes through
:class:`TimedBytes`); nothing below them knows of a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple, cast

import numpy as np

from ._errors import CorruptShardError, SampleError, StreamloadError
from .ahead import FetchAhead, group_runs
from .formats import ShardBytes, ShardReader
from .plan import EpochPlan, Run, World
from .plan.world import local_ranks
from .plan_stage import Position
from .recovery import Failed, key_of, raise_located, recover_batch, recovering_samples, skippable
from .skips import SkipLog, Substitute, batch_errors
from .storage import Storage
from .streams import MixedSource, Mixture, ReaderKeep
from .timing import SAMPLE_EVERY, Clock, StageTable

__all__ = ["Pipeline", "Read", "Steps", "TimedBytes", "open_readers"]

#: Shard readers a worker keeps open at once, at least (a shuffle window spans a few shards).
_OPEN_READERS = 8
#: ... and at most (file descriptors).
_MAX_OPEN_READERS = 64
#: A mixture's readers per stream, at least (each stream is read shard after shard).
_STREAM_READERS = 2
#: Streaming mode, samples yielded one by one: samples per fetch-ahead unit.
_SAMPLE_UNIT = 64

OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class Steps:
    """What a dataset does to what it reads (the same for every iteration).

    Attributes:
        transform: Applied to each sample dict, if any.
        collate: Makes each planned batch, if any.
        on_error: ``"raise"`` or ``"skip"`` (see :class:`~streamload.StreamingDataset`).
        skips: Counts and names skipped samples.
        budget: Streaming: bytes of ranges fetched ahead (``stream_buffer``).
        plain: One dataset read once (its messages name no stream).
        table: The stage seconds of a watched dataset, else ``None``.
    """

    transform: Callable[[Any], Any] | None
    collate: Callable[[list[Any]], Any] | None
    on_error: OnError
    skips: SkipLog
    budget: int
    plain: bool
    table: StageTable | None


def open_readers(
    streams: Mixture, storages: list[Storage], plan: EpochPlan, world: World, keep: ReaderKeep | None = None
) -> MixedSource:
    """This reader's shard readers of every stream, sized to what ``plan`` keeps open; cached or streamed.

    ``keep``: the shards the previous epoch's reader of this place left open, taken if they fit.

    Each stream keeps the shards one shuffle window spans open (its share of the window in
    a mixture; without shuffling, shard after shard). ``cache="auto"`` streams a stream
    when its cache limit cannot hold that many shards for every reader of the machine (the
    DataLoader workers times the ranks of the node, ``LOCAL_WORLD_SIZE``).
    """
    spans = []
    for ref, count in zip(streams.refs, streams.counts, strict=True):
        shards = ref.manifest.shards
        if not shards or not streams.total:
            spans.append(1)
            continue
        mean = max(1.0, ref.manifest.num_samples / len(shards))
        spans.append(min(_MAX_OPEN_READERS, plan.open_shards(mean, count / streams.total)))
    least = _OPEN_READERS if streams.plain else _STREAM_READERS
    capacities = [min(_MAX_OPEN_READERS, max(least, n + 1)) for n in spans]
    machine = max(1, world.num_workers) * local_ranks()
    streaming = [
        ref.streams(storage, machine * n) for ref, storage, n in zip(streams.refs, storages, spans, strict=True)
    ]
    kept = None if keep is None else keep.take(storages, capacities, streaming)
    return kept if kept is not None else streams.source(storages, capacities, streaming)


class _Origin(NamedTuple):
    """Where an item handed to a collate came from (for a sample the collate reports bad)."""

    shard: str
    local: int
    key: str | None
    stream: str | None
    url: str
    where: str


def _batch_places(epoch: int, runs: list[Run]) -> np.ndarray:
    """``int64[B, 2]``: each sample's ``(epoch, item)`` of a planned batch, what its dict would carry."""
    items = np.concatenate([run.items for run in runs]) if len(runs) > 1 else runs[0].items
    where = np.empty((len(items), 2), dtype=np.int64)
    where[:, 0] = epoch
    where[:, 1] = items
    return where


class TimedBytes:
    """A streamed shard's bytes as its reader reads them, each read timed in ``timer`` (the fetch stage).

    The view a watched iteration puts over each streamed shard's ranged bytes
    (:attr:`ShardSource.view <streamload.shards.ShardSource.view>`): a read waits for
    the ranges fetched ahead, or makes its own ranged GET.

    Args:
        source: The ranged bytes.
        timer: The context each read runs in (a clock's ``fetch``).
    """

    def __init__(self, source: ShardBytes, timer: AbstractContextManager[Any]) -> None:
        self.source = source
        self.timer = timer
        self.size = source.size

    def pread(self, n: int, offset: int) -> bytes:
        """The source's ``pread``, timed."""
        with self.timer:
            return self.source.pread(n, offset)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """The source's ``preadv``, timed."""
        with self.timer:
            return self.source.preadv(buffers, offset)

    def close(self) -> None:
        """Close the source."""
        self.source.close()


class Read:
    """The read, transform and skip stages over one iteration's readers (per run or per batch).

    Args:
        steps: The dataset's transform, collate and error policy.
        readers: The iteration's shard readers.
        position: This reader's position (advanced as items are made).

    Attributes:
        clock: A watched iteration's clock (the transform and collate are timed in it), else ``None``.
        timer: The context its shard opens run in (a watched iteration's fetch clock), else ``None``.
    """

    def __init__(self, steps: Steps, readers: MixedSource, position: Position) -> None:
        self.steps = steps
        self.readers = readers
        self.position = position
        self.substitute = Substitute()
        self.clock: Clock | None = None
        self.timer: AbstractContextManager[Any] | None = None
        #: Items of the batch being made (and stand-ins kept for later ones), by id: their origin.
        self.origins: dict[int, _Origin] = {}

    def state(self) -> dict[str, Any]:
        """Plain data: shards opened and recovered per stream, and what the skip stage owes."""
        sources = self.readers.sources
        return {
            "opens": [src.opens for src in sources],
            "recovered": [sorted(src.recovered) for src in sources],
            "substitute": self.substitute.state(),
        }

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Forget the skip stage's stand-ins (the read node holds nothing else to take back)."""
        self.substitute.reset()

    def get(self, shard: int) -> ShardReader:
        """The reader of global ``shard`` from the readers' cache; an open (not a hit) runs in :attr:`timer`."""
        readers, timer = self.readers, self.timer
        if timer is None or shard in readers:
            return readers.get(shard)
        with timer:  # a watched iteration's fetch stage: the download or cache wait, and the open
            return readers.get(shard)

    def batch(self, runs: list[Run]) -> Any:
        """One collated batch of a planned batch's ``runs`` (see :mod:`streamload.batch`).

        A :class:`~streamload.batch.BatchReader` collate reads the batch straight from the
        shard readers into one buffer, unless a per-sample ``transform`` or
        ``on_error="skip"`` needs the dicts.
        """
        from .batch import BatchReader, wants_places

        steps, readers = self.steps, self.readers
        get = readers.get if self.timer is None else self.get  # watched: an open timed as fetch
        collate = steps.collate
        assert collate is not None
        if isinstance(collate, BatchReader) and steps.transform is None and steps.on_error == "raise":
            parts = [(run.shard, run.locals) for run in runs]
            shards = [s for s, _ in parts]
            where = _batch_places(self.position.epoch, runs) if wants_places(collate) else None
            with batch_errors(partial(self._read_failed, runs)):  # a sample the collate names: located
                for again in (False, True):  # a corrupt cached copy: dropped, the batch read again once
                    try:
                        if where is not None:  # each sample's (epoch, position) too
                            batch = cast(Any, collate).read_batch(get, parts, where)
                        else:
                            batch = collate.read_batch(get, parts)
                        break
                    except CorruptShardError as exc:
                        recover_batch(exc, shards, readers, again)
        else:
            kept = {id(item) for item in self.substitute.last.values()}
            self.origins = {k: v for k, v in self.origins.items() if k in kept}
            samples = [s for run in runs for s in self.run(run)]
            clock = self.clock
            with batch_errors(partial(self._sample_failed, samples, set())):
                batch = collate(samples) if clock is None else clock.collate(collate, samples)
        self.position.next_item = int(runs[-1].positions[-1]) + 1
        return batch

    def _read_failed(self, runs: list[Run], index: int, error: BaseException) -> bool:
        """A bad sample ``index`` of a batch read straight from the readers (``on_error="raise"``): raised located."""
        at = 0
        for run in runs:
            if index < at + len(run.locals):
                info = self.readers.info(run.shard)
                where = f"{info.url}/{info.entry.name}"
                if isinstance(error, StreamloadError):
                    raise_located(error, info.url, where)
                key = key_of(self.readers.get(run.shard), int(run.locals[index - at]))
                raise SampleError(f"{where}: sample {key!r}: collate failed: {error}") from error
            at += len(run.locals)
        return False

    def _sample_failed(self, samples: list[Any], skipped: set[int], index: int, error: BaseException) -> bool:
        """A collate's bad sample ``samples[index]``: counted and named under skip, else raised located.

        ``skipped``: the items of this batch already counted (a stand-in repeated in the
        batch is counted once). False for an item of unknown origin (the collate raises).
        """
        item = samples[index] if 0 <= index < len(samples) else None
        origin = self.origins.get(id(item))
        if origin is None:
            return False
        if self.steps.on_error != "skip" or not skippable(error):  # the storage's or the machine's fault: never a skip
            if isinstance(error, StreamloadError):
                raise_located(error, origin.url, origin.where)
            raise SampleError(f"{origin.where}: sample {origin.key!r}: collate failed: {error}") from error
        if id(item) not in skipped:
            skipped.add(id(item))
            self.steps.skips.skip(origin.shard, error, [origin.local], [origin.key], source=origin.stream)
        return True

    def run(self, run: Run) -> Iterator[Any]:
        """Yield the run's samples (transformed).

        Under ``on_error="skip"`` a sample that cannot be read or transformed is counted
        and replaced by a repeat of the last good one, so every rank still yields
        ``len(dataset)`` items and DDP cannot hang.
        """
        steps, readers, position = self.steps, self.readers, self.position
        info = readers.info(run.shard)
        entry, url, label = info.entry, info.url, info.label
        stream = None if steps.plain else url  # a mixture names each stream's URL
        substitute, skip = self.substitute, steps.on_error == "skip"
        where = f"{url}/{entry.name}"
        try:
            reader = self.get(run.shard)
        except StreamloadError as exc:
            if not skip or not skippable(exc):  # the storage's or the machine's fault: never a skip
                raise_located(exc, url, where)
            position.next_item = int(run.positions[-1]) + 1
            steps.skips.skip(entry.name, exc, run.locals.tolist(), [None] * len(run.locals), source=stream)
            yield from substitute.fail(len(run.locals), stream)
            return
        transform, clock = steps.transform, self.clock
        samples = recovering_samples(readers, reader, run, skip, url, where)
        epoch = position.epoch
        # What a transform or collate sees carries its place in the epoch (the key of
        # per-sample randomness); dicts yielded as they are stay the stored sample.
        placed = transform is not None or steps.collate is not None
        origins = self.origins if steps.collate is not None else None
        for pos, item, local, sample in zip(
            run.positions.tolist(), run.items.tolist(), run.locals.tolist(), samples, strict=True
        ):
            position.next_item = pos + 1
            if isinstance(sample, Failed):
                steps.skips.skip(entry.name, sample.error, [local], [sample.key], source=stream)
                yield from substitute.fail(1, stream)
                continue
            if placed:
                sample["__epoch__"] = epoch
                sample["__position__"] = item
            if label is not None:
                sample["__source__"] = label
            if transform is None:
                if origins is not None:
                    origins[id(sample)] = _Origin(entry.name, local, sample.get("__key__"), stream, url, where)
                yield from substitute.good(sample, stream)
                continue
            try:
                out = transform(sample) if clock is None else clock.transform(transform, sample)
            except Exception as exc:  # noqa: BLE001 - re-raised with context or counted
                if not skip:
                    if isinstance(exc, StreamloadError):
                        raise_located(exc, url, where)
                    raise SampleError(f"{where}: sample {sample.get('__key__')!r}: transform failed: {exc}") from exc
                steps.skips.skip(entry.name, exc, [local], [sample.get("__key__")], source=stream)
                yield from substitute.fail(1, stream)
                continue
            if origins is not None:
                origins[id(out)] = _Origin(entry.name, local, sample.get("__key__"), stream, url, where)
            yield from substitute.good(out, stream)


class Pipeline:
    """One reader's iteration of one epoch's plan: a plain iterator of samples (or batches).

    Nothing is opened before the first item is asked for; everything is closed when the
    iteration ends or is dropped.

    Args:
        steps: The dataset's transform, collate and error policy.
        streams: The datasets read.
        storages: This process's storage of each stream.
        plan: The epoch's plan.
        world: This reader's place (rank, worker or thread).
        position: Where it starts (advanced as items are made).
    """

    def __init__(
        self,
        steps: Steps,
        streams: Mixture,
        storages: list[Storage],
        plan: EpochPlan,
        world: World,
        position: Position,
    ) -> None:
        self.steps = steps
        self.streams = streams
        self.storages = storages
        self.plan = plan
        self.world = world
        self.position = position
        self.ahead: FetchAhead | None = None
        self.read: Read | None = None
        #: Where a thread's open shards are left at the end of its epoch for the next one (a
        #: :class:`~streamload.Loader`'s), else ``None``: closed.
        self.keep: ReaderKeep | None = None

    def state(self) -> dict[str, Any]:
        """The chain's state: its nodes' plain-data states under their names.

        ``plan``: this reader's position in the epoch's plan (where it resumes); ``fetch``
        and ``read`` (with the skip stage's), once started: what they hold ahead.
        """
        state: dict[str, Any] = {"plan": self.position.state()}
        if self.ahead is not None:
            state["fetch"] = self.ahead.state()
        if self.read is not None:
            state["read"] = self.read.state()
        return state

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Drop what the nodes hold ahead (ranges fetched, stand-ins); with ``state``, stand where it says.

        ``state`` (from :meth:`state`): its ``plan`` part puts this reader's position
        there (checked against this chain's plan), so a chain reset before it is iterated
        reads from that item on; the other nodes start empty.

        Raises:
            PlanError: If the state is not this chain's (another epoch or chunk size, a
                malformed position).
        """
        if self.ahead is not None:
            self.ahead.reset(None if state is None else state.get("fetch"))
        if self.read is not None:
            self.read.reset(None if state is None else state.get("read"))
        if state is not None:
            self.position.reset(state.get("plan"))

    def __iter__(self) -> Iterator[Any]:
        steps, plan, world, position = self.steps, self.plan, self.world, self.position
        keep = self.keep
        readers = open_readers(self.streams, self.storages, plan, world, keep)
        start, first = position.next_item, position.first
        finished = False
        self.ahead = ahead = FetchAhead(readers, steps.budget)
        try:
            self.read = read = Read(steps, readers, position)
            runs = ahead.runs(plan.runs(world, start, first), plan.worker_shards(world, start, first))
            items = self._items(read, ahead, runs)
            if steps.table is not None:  # watched: time the readers' stages (streamload.watch)
                read.clock = clock = steps.table.clock()
                ahead.timer = read.timer = clock.fetch
                for src in readers.sources:
                    if src.streaming:
                        src.view = partial(TimedBytes, timer=clock.fetch)
                items = clock.timed(items, 1 if steps.collate is not None else SAMPLE_EVERY)
            for item in items:
                yield item
                ahead.started()  # the first item is out: the cold start ends, read-ahead may share the link now
                yield from items
            finished = True
        finally:
            try:
                ahead.close()  # the read-ahead it named cancelled
            finally:
                if finished and keep is not None:
                    keep.give(readers)  # kept for the next epoch (a local dataset's), else closed
                else:
                    readers.close()

    def _items(self, read: Read, ahead: FetchAhead, runs: Iterator[Run]) -> Iterator[Any]:
        chunk = self.position.chunk_size
        if self.steps.collate is not None:
            for batch in ahead.batches(group_runs(runs, chunk)):
                yield read.batch(batch)
        elif read.readers.streaming:  # samples one by one, their ranges fetched a unit ahead
            for unit in ahead.batches(group_runs(runs, min(chunk, _SAMPLE_UNIT)), prepare=False):
                for run in ahead.prepared(unit):
                    yield from read.run(run)
        else:
            for run in ahead.prepared(runs):
                yield from read.run(run)
        yield from read.substitute.finish()
