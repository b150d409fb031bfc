"""``StreamingDataset``: the four axes composed into a lazy ``IterableDataset``.

Construction reads only the manifest (a few KB per thousand shards). Nothing that holds
a file, a thread or a connection is created before iteration, and none of it is pickled:
each DataLoader worker opens the shards it needs itself, after fork or spawn.

One epoch in one worker, as a stream::

    detect world (rank, world_size, worker, num_workers)      -- at iteration time
    EpochPlan(shard_counts, world, Split(epoch, seed, ...))   -- pure, O(shards)
    resume point (stages, start item)                          -- load_state_dict, if any
    runs: (shard, [local indices])                             -- plan.runs(world, start)
      -> ShardSource.get(shard): storage.acquire -> reader     -- cache/read-ahead if remote
      -> format reader .iter_range / .get -> sample dicts      -- {"__key__", field: bytes}
      -> transform(sample)                                     -- optional, e.g. decode

A mixture of datasets (:class:`~streamload.streams.Stream`) or an ``epoch_size`` changes
only two steps: the plan's layout (:class:`~streamload.plan.MixLayout`: exact per-stream
counts, interleaved) and the readers (:class:`~streamload.streams.MixedSource`: one
``ShardSource`` per stream, global shard numbers); see ``docs/mixing.md``.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import torch
from torch.utils.data import IterableDataset

from ._errors import ConfigError, CorruptShardError, PlanError, SampleError, StreamloadError
from ._validate import check_epoch, check_samples_seen, dataset_args, parse_cache_mode, parse_stream_buffer
from .formats import Format, Sample, ShardReader
from .manifest import Manifest, ShardEntry
from .plan import (
    EpochPlan,
    Run,
    Split,
    Stage,
    World,
    default_window,
    detect_rank_world,
    detect_world,
    distributed_world,
    samples_per_rank,
)
from .plan.state import EpochState, WorkerPosition
from .shards import CacheMode, StorageConfig
from .storage import Storage
from .storage.ranges import DEFAULT_STREAM_BUFFER
from .streams import MixedSource, Mixture, StreamSource

__all__ = ["SkipCounts", "StreamingDataset"]

log = logging.getLogger("streamload")

#: Slots of the shared epoch counter: [base epoch, offset, iterations started by worker 0, 1, ...].
#: A worker's next epoch is base + offset + its slot: ``set_epoch`` sets base and clears the
#: rest; a worker restoring a saved state sets the offset; each iteration bumps its slot.
_MAX_WORKERS = 1024
_BASE, _OFFSET, _SLOTS = 0, 1, 2
#: Shard readers a worker keeps open at once, at least (a shuffle window spans a few shards).
_OPEN_READERS = 8
#: ... and at most (file descriptors).
_MAX_OPEN_READERS = 64
#: A mixture's readers per stream, at least (each stream is read shard after shard).
_STREAM_READERS = 2
#: Streaming mode: planned batches whose ranges are fetched ahead, at most (the byte
#: budget, ``stream_buffer``, usually binds first), and samples per prefetch unit when
#: samples are yielded one by one.
_MAX_BATCHES_AHEAD = 32
_SAMPLE_UNIT = 64

OnError = Literal["raise", "skip"]


class StreamingDataset(IterableDataset[Any]):
    """An iterable dataset over sharded samples in a local directory or fsspec URL.

    Every sample is read exactly once per epoch over all ranks and DataLoader workers;
    every rank yields ``len(dataset)`` samples (padding by repeating the fewest samples,
    or dropping the tail with ``drop_last=True``), so DDP never waits on an uneven epoch.

    Args:
        source: Dataset directory or URL prefix holding ``index.json`` and the shards; or a
            :class:`~streamload.streams.Stream`, or a list of streams (and URLs) to mix.
        epoch_size: Samples per epoch, all ranks (default: the dataset's size, or the
            streams' counts). Subsamples or upsamples a single dataset, or sets the size
            that the streams' weights share (see *Mixtures*).
        shuffle: Shuffle shard order and samples within a window each epoch.
        seed: Seed of the shuffle; the same (seed, epoch, world) gives the same order.
        drop_last: Drop the tail instead of padding so ranks get ``floor(N / world)``.
        shuffle_window: Shuffle window in samples (default: four times the largest shard).
        batch_size: The DataLoader's batch size, if any. Workers then take batch-sized
            chunks in turn, so batches leave the DataLoader in the planned order.
        transform: Function applied to each sample dict in the worker (e.g. a decoder from
            :mod:`streamload.decode`).
        collate: Make whole batches in the worker: called with each planned batch's
            samples (needs ``batch_size``; use ``DataLoader(batch_size=None)``). E.g.
            :class:`streamload.batch.RawCollate` (one ``uint8`` tensor per batch, read
            straight from the shards) or :class:`streamload.decode.DecodeBatch`.
        rank: Override the detected rank (default: torch.distributed, then ``RANK``).
        world_size: Override the detected world size.
        storage_options: Passed to fsspec for remote URLs (credentials, endpoint...).
        cache_dir: Local cache directory for remote shards.
        cache_limit: Cache size bound, bytes or a string like ``"20GB"`` (remote URLs;
            at least twice the largest shard; default: half of the space the cache could
            use, logged once; ``"unbounded"`` for no bound).
        read_ahead: At most this many shards each worker downloads ahead of its reads
            in background threads (remote URLs, cached mode; default 8; the depth adapts
            to the measured download and reading times within it and the cache room;
            0 turns read-ahead off).
        cache: How a remote dataset's shards are read. ``"shards"``: each shard is
            downloaded whole into the cache, verified, and read locally. ``"none"``
            (streaming mode, tar shards with sidecars only): only the sidecars are
            cached; each planned batch's samples are read straight from the bucket by
            coalesced ranged GETs, fetched several batches ahead, every sample's
            checksum checked; no shard is ever written to disk. ``"auto"`` (default):
            stream when the cache limit cannot hold the shards one shuffle window spans
            for every reader of the machine (or two of the largest shards), else cache.
            LMDB and HDF5 datasets are always cached (``"none"`` is a ``ConfigError``
            for them). See ``docs/remote.md``.
        stream_buffer: Streaming mode: bytes of ranges each worker fetches ahead of its
            reads (an int or a string like ``"256MB"``; default 64 MiB). At least one
            batch is always fetched whole.
        on_error: ``"raise"`` (default): a sample or shard that fails to read or
            transform raises an error naming the dataset URL, shard, key and field.
            ``"skip"``: it is counted (:attr:`skipped_samples`, shared with the workers),
            logged once per shard, and replaced by a repeat of the last good sample, so
            every rank still yields ``len(dataset)`` items and DDP cannot hang.

    Example:
        >>> ds = StreamingDataset("/data/imagenet-shards", shuffle=True, seed=1)  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=256, num_workers=8)  # doctest: +SKIP

    Mixtures:
        ``StreamingDataset([Stream("s3://a", weight=0.7), Stream("/data/b", weight=0.3)],
        epoch_size=1_000_000)`` reads both datasets (any formats and storages, each with its
        own storage settings) as one epoch. Each stream contributes an exact count per
        epoch (largest-remainder rounding of its weight, ``repeat`` or ``samples``; they sum
        to ``epoch_size``); a stream asked for fewer samples than it has reads a different
        subset each epoch (seed, epoch), each sample at most once; one asked for more reads
        whole passes plus a subset. The streams are interleaved sample by sample in
        proportion over the whole epoch (then shuffled within the window with
        ``shuffle=True``), so each batch reflects the weights. Every guarantee above holds
        for the mixture. Each sample dict gets ``"__source__"``: the stream's ``name``, else
        its index. ``epoch_size=`` alone subsamples or upsamples one dataset the same way.
        For a mixture, :attr:`manifest` and :attr:`format` describe the first stream; see
        :attr:`streams`.

    Epochs:
        ``set_epoch(n)`` makes the next iteration epoch ``n`` (it reaches persistent
        workers through shared memory); each further iteration without ``set_epoch``
        advances the epoch by one. An iteration counts once its first sample is asked for.

    Stop and resume:
        ``state_dict()`` returns a small plain dict (JSON- and ``torch.save``-safe): the
        epoch, the seed and the global number of samples consumed, independent of the
        number of ranks and workers. ``load_state_dict(state)`` makes the next iteration
        continue that epoch at the first unseen sample, without reading the seen ones;
        the following epoch is unchanged. With the same number of ranks the order is
        exactly the uninterrupted one; with a different number (same global batch) the
        unseen rest is re-split evenly over the new ranks. Two ways to use it:

        * ``torchdata.stateful_dataloader.StatefulDataLoader`` calls ``state_dict`` and
          ``load_state_dict`` in its workers; save and load the loader's state (same
          number of ranks and workers).
        * With a plain ``DataLoader`` (any workers; pass ``batch_size=`` to this dataset),
          the training loop supplies the global count::

              ckpt["data"] = ds.state_dict(samples_seen=step_in_epoch * global_batch)
              ds.load_state_dict(ckpt["data"])  # on restart, before iterating

          This is the elastic path: resume on any number of ranks and workers.
    """

    def __init__(
        self,
        source: StreamSource,
        *,
        epoch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        shuffle_window: int | None = None,
        batch_size: int | None = None,
        transform: Callable[[Sample], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        read_ahead: int | None = None,
        cache: CacheMode = "auto",
        stream_buffer: int | str | None = None,
        on_error: OnError = "raise",
    ) -> None:
        super().__init__()
        shuffle, seed, drop_last, shuffle_window, batch_size, rank, world_size, read_ahead = dataset_args(locals())
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={on_error!r} must be 'raise' or 'skip'")
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle_window = shuffle_window
        self.batch_size = batch_size
        self.transform = transform
        self.collate = collate
        if collate is not None and batch_size is None:
            raise ConfigError(f"collate={collate!r} needs batch_size= (the batches are made in the workers)")
        self.rank = rank
        self.world_size = world_size
        self.on_error: OnError = on_error
        self.storage_options = dict(storage_options or {})
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        self.read_ahead = read_ahead
        self.cache: CacheMode = parse_cache_mode(cache)  # type: ignore[assignment]
        self.stream_buffer = parse_stream_buffer(stream_buffer)
        Split(seed=seed, window=shuffle_window, chunk=batch_size)  # validate early
        config = StorageConfig(self.storage_options, cache_dir, cache_limit, read_ahead, self.cache, self.stream_buffer)
        #: The datasets read and each one's samples per epoch (one for a plain URL).
        self.streams: Mixture = Mixture.open(source, epoch_size, config)
        self.epoch_size = epoch_size
        self.source = self.streams.describe()  # the URL, or the streams' URLs and counts
        self._ref = self.streams.refs[0]
        self.manifest: Manifest = self._ref.manifest
        self.format: Format = self._ref.format
        # Shared across fork/spawn so set_epoch() reaches persistent workers.
        self._epochs = torch.zeros(_SLOTS + _MAX_WORKERS, dtype=torch.int64)
        self._epochs.share_memory_()  # type: ignore[no-untyped-call]
        #: The state given to load_state_dict (applies to iterations of its epoch).
        self._resume: EpochState | None = None
        #: This process's current (or last) iteration: where it stands.
        self._progress: _Progress | None = None
        #: (rank, world_size) of the process that pickled this dataset to a worker.
        self._inherited_world: tuple[int, int] | None = None
        self._storages: list[Storage] | None = None
        #: Skipped samples per worker id (shared memory, so the main process sees them).
        self._skipped = torch.zeros(_MAX_WORKERS, dtype=torch.int64)
        self._skipped.share_memory_()  # type: ignore[no-untyped-call]
        #: This process's counts of samples skipped under ``on_error="skip"``, in all and per shard.
        self.errors = SkipCounts()

    # -- sizes and epochs ----------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Samples in one epoch, all ranks: the dataset's size, or ``epoch_size``, or the streams' counts."""
        return self.streams.total

    def __len__(self) -> int:
        """Samples this rank yields per epoch (batches, with ``collate``); the world is detected now.

        This is a whole epoch's count; an epoch resumed by :meth:`load_state_dict` yields
        only its unseen rest.
        """
        _, world_size = detect_rank_world(self.rank, self.world_size, self._inherited_world)
        per_rank = samples_per_rank(self.num_samples, world_size, self.drop_last)
        if self.collate is not None and self.batch_size is not None:
            return -(-per_rank // self.batch_size)  # the planner's chunks are the batches
        return per_rank

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``; later ones advance from it by one.

        Works with ``persistent_workers=True``: the counter lives in shared memory.
        """
        epoch = check_epoch(epoch)
        self._epochs[_BASE] = epoch
        self._epochs[_OFFSET:] = 0

    def _peek_epoch(self, worker: int) -> int:
        if worker >= _MAX_WORKERS:
            raise ConfigError(f"num_workers must be <= {_MAX_WORKERS}, got worker id {worker}")
        return int(self._epochs[_BASE]) + int(self._epochs[_OFFSET]) + int(self._epochs[_SLOTS + worker])

    def _commit_epoch(self, worker: int) -> None:
        self._epochs[_SLOTS + worker] += 1

    @property
    def epoch(self) -> int:
        """The epoch of this process's current or last iteration, else the next one to run."""
        if self._progress is not None:
            return self._progress.epoch
        started = int(self._epochs[_SLOTS:].max())
        return int(self._epochs[_BASE]) + int(self._epochs[_OFFSET]) + max(started - 1, 0)

    @property
    def window(self) -> int:
        """The shuffle window in items (see :mod:`streamload.plan.planner`)."""
        return self.shuffle_window or default_window(self.streams.shard_counts)

    def plan(self, epoch: int, world_size: int, stages: tuple[Stage, ...] = ()) -> EpochPlan:
        """Return the :class:`EpochPlan` this dataset follows for ``epoch`` in a world of ``world_size``.

        ``stages`` are the earlier worlds of a resumed epoch (see :meth:`load_state_dict`).
        """
        split = Split(
            epoch=epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            window=self.shuffle_window,
            chunk=self.batch_size,
        )
        return EpochPlan(self.streams.shard_counts, world_size, split, stages, self.streams.layout(split))

    # -- stop and resume -----------------------------------------------------------

    def state_dict(self, samples_seen: int | None = None) -> dict[str, Any]:
        """Return where the epoch stands, as a small plain dict (no I/O).

        Args:
            samples_seen: Global samples consumed in the current epoch by all ranks
                (``steps * global_batch``). Required in a process whose DataLoader
                workers do the reading; without it, the count of this process's own
                iteration is used (``num_workers=0``) or, inside a DataLoader worker,
                that worker's position (the ``StatefulDataLoader`` protocol).

        Raises:
            PlanError: If the count cannot be known or is not a multiple of the world size.
        """
        world = detect_world(self.rank, self.world_size, self._inherited_world)
        progress = self._progress
        stages = progress.stages if progress is not None else self._stages_for(self.epoch)
        worker = None
        if samples_seen is None:
            if progress is None:
                if int(self._epochs[_SLOTS:].max()) > 0:
                    raise PlanError(
                        "this process has not read the dataset (DataLoader workers did): "
                        "pass samples_seen=steps * global_batch to state_dict()"
                    )
                samples_seen = 0
            else:
                worker = WorkerPosition(
                    world.rank,
                    world.world_size,
                    world.worker,
                    world.num_workers,
                    progress.chunk,
                    progress.next_item,
                    progress.first,
                )
                stage_start = stages[-1].samples_seen if stages else 0
                single = world.num_workers == 1
                samples_seen = stage_start + world.world_size * progress.next_item if single else None
        state = EpochState(
            self.epoch,
            self.seed,
            self.shuffle,
            self.drop_last,
            self.window,
            self.num_samples,
            world.world_size,
            samples_seen,
            stages,
            worker,
            self.streams.fingerprint,
        )
        self._check_samples_seen(state)
        return state.normalized([self.num_samples]).to_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict`` (from :meth:`state_dict`) at the next iteration.

        Sets the epoch to the saved one (the next one if it had finished); the iteration
        of that epoch starts at the first unseen sample. Call it before iterating.

        Raises:
            PlanError: If the state is malformed or belongs to a differently configured dataset.
        """
        state = EpochState.from_dict(state_dict)
        state.check_dataset(
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            window=self.window,
            num_samples=self.num_samples,
            mixture=self.streams.fingerprint,
        )
        self._check_samples_seen(state)
        state = state.normalized([self.num_samples])
        self._resume = state
        self._progress = None
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            self.set_epoch(state.epoch)
        else:  # a worker restored by StatefulDataLoader: shift this worker's epoch count
            base = int(self._epochs[_BASE]) + int(self._epochs[_SLOTS + info.id])
            self._epochs[_OFFSET] = state.epoch - base

    def _check_samples_seen(self, state: EpochState) -> None:
        """Refuse a global ``samples_seen`` past the end of its epoch (a wrong count, not a finished epoch)."""
        if state.samples_seen is not None:
            stage_total = self.plan(state.epoch, state.world_size, state.stages).stage_total
            check_samples_seen(state.samples_seen, state.stage_start, stage_total, state.world_size, self.batch_size)

    def _stages_for(self, epoch: int) -> tuple[Stage, ...]:
        resume = self._resume
        return resume.stages if resume is not None and resume.epoch == epoch else ()

    def _resume_point(self, world: World, epoch: int) -> tuple[tuple[Stage, ...], int, int]:
        """Return the stages, start item and first dealt chunk of ``epoch`` for ``world`` (fresh: none, 0, 0)."""
        resume = self._resume
        if resume is None or resume.epoch != epoch:
            return (), 0, 0
        saved_chunk = self.plan(epoch, world.world_size, resume.stages).chunk_size(world.num_workers)
        return resume.resume(world, saved_chunk)

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        world = detect_world(self.rank, self.world_size, self._inherited_world)
        epoch = self._peek_epoch(world.worker)  # committed when the first sample is asked for
        stages, start, first = self._resume_point(world, epoch)
        plan = self.plan(epoch, world.world_size, stages)
        progress = _Progress(epoch, stages, plan.chunk_size(world.num_workers), start, first)
        self._progress = progress
        return self._iter_plan(plan, world, progress)

    def _iter_plan(self, plan: EpochPlan, world: World, progress: _Progress) -> Iterator[Any]:
        self._commit_epoch(world.worker)
        storages = self._get_storages()
        readers = self.streams.source(storages, self._readers_needed(plan), self._streaming(plan, world, storages))
        start, first = progress.next_item, progress.first
        try:
            runs = readers.read_ahead(plan.runs(world, start, first), plan.worker_shards(world, start, first))
            if self.collate is not None:
                yield from self._read_batches(readers, runs, progress)
            elif readers.streaming:  # samples one by one, their ranges fetched a unit ahead
                from .batch import group_runs

                for unit in self._fetch_ahead(readers, group_runs(runs, min(progress.chunk, _SAMPLE_UNIT))):
                    for run in unit:
                        yield from self._read_run(readers, run, progress)
            else:
                for run in runs:
                    yield from self._read_run(readers, run, progress)
            yield from progress.substitute.finish()
        finally:
            readers.close()

    def _streaming(self, plan: EpochPlan, world: World, storages: list[Storage]) -> list[bool]:
        """Per stream: read its shards by ranged GETs (``cache="none"``, or ``"auto"`` when the cache is too small).

        ``"auto"`` compares the cache limit with the shards this machine's readers keep
        open at once: the shards one shuffle window spans (one without shuffling) times the
        DataLoader workers and the ranks of the node (``LOCAL_WORLD_SIZE``).
        """
        readers = max(1, world.num_workers) * _local_ranks()
        mix = self.streams
        out = []
        for ref, storage, count in zip(mix.refs, storages, mix.counts, strict=True):
            shards = ref.manifest.shards
            window = 1
            if self.shuffle and shards and mix.total:
                mean = max(1.0, ref.manifest.num_samples / len(shards))
                share = plan.window * count / mix.total
                window = min(_MAX_OPEN_READERS, math.ceil(share / mean) + 1)
            out.append(ref.streams(storage, readers * window))
        return out

    def _fetch_ahead(self, readers: MixedSource, batches: Iterator[list[Run]]) -> Iterator[list[Run]]:
        """Streaming mode: pass planned batches through, their byte ranges fetched ahead.

        Before a batch is yielded, the ranges of the batches after it are requested while
        the bytes fetched and not yet read stay under ``stream_buffer`` (the next batch is
        always requested; at most two more per batch yielded); a batch's ranges are
        dropped once the caller comes back for the next one.
        """
        if not readers.streaming:
            yield from batches
            return
        budget = self.stream_buffer or DEFAULT_STREAM_BUFFER
        ahead: deque[tuple[list[Run], Any]] = deque()
        more = True
        try:
            while True:
                # Two batches planned per batch read at most: the look-ahead grows to the budget
                # over the first batches (planning opens shards), so the first one is not delayed.
                planned = 0
                while more and (
                    not ahead or (planned < 2 and readers.fetching() < budget and len(ahead) < _MAX_BATCHES_AHEAD)
                ):
                    planned += 1
                    batch = next(batches, None)
                    if batch is None:
                        more = False
                        break
                    ahead.append((batch, readers.fetch_ahead(batch)))
                if not ahead:
                    return
                batch, tickets = ahead.popleft()
                yield batch
                readers.forget(tickets)
        finally:
            for _, tickets in ahead:
                readers.forget(tickets)

    def _read_batches(self, readers: MixedSource, runs: Iterator[Run], progress: _Progress) -> Iterator[Any]:
        """With ``collate``: one collated batch per planned batch (see :mod:`streamload.batch`).

        A :class:`~streamload.batch.BatchReader` collate reads the batch straight from the
        shard readers into one buffer, unless a per-sample ``transform`` or
        ``on_error="skip"`` needs the dicts.
        """
        from .batch import BatchReader, group_runs

        collate = self.collate
        assert collate is not None
        direct = isinstance(collate, BatchReader) and self.transform is None and self.on_error == "raise"
        for batch_runs in self._fetch_ahead(readers, group_runs(runs, progress.chunk)):
            if direct:
                assert isinstance(collate, BatchReader)
                parts = [(run.shard, run.locals) for run in batch_runs]
                try:
                    batch = collate.read_batch(readers.get, parts)
                except CorruptShardError as exc:  # a corrupt cached copy: read the batch again from fresh ones
                    shards = [shard for shard, _ in parts]
                    if not readers.recover_any(shards, exc):
                        raise
                    try:
                        batch = collate.read_batch(readers.get, parts)
                    except CorruptShardError as again:  # bad at the source: say so (recover_any raises)
                        readers.recover_any(shards, again)
                        raise
            else:
                batch = collate([s for run in batch_runs for s in self._read_run(readers, run, progress)])
            progress.next_item = int(batch_runs[-1].positions[-1]) + 1
            yield batch

    def _readers_needed(self, plan: EpochPlan) -> list[int]:
        """Shard readers to keep open per stream: enough for the shards one shuffle window spans.

        A mixture's window holds each stream's share of it; without shuffling each stream
        is read shard after shard.
        """
        mix = self.streams
        if mix.plain:
            if not self.shuffle or not self.manifest.shards:
                return [_OPEN_READERS]
            mean = max(1.0, self.num_samples / len(self.manifest.shards))
            return [min(_MAX_OPEN_READERS, max(_OPEN_READERS, math.ceil(plan.window / mean) + 2))]
        out = []
        for ref, count in zip(mix.refs, mix.counts, strict=True):
            shards = ref.manifest.shards
            if not self.shuffle or not shards or not mix.total:
                out.append(_STREAM_READERS)
                continue
            mean = max(1.0, ref.manifest.num_samples / len(shards))
            share = plan.window * count / mix.total
            out.append(min(_MAX_OPEN_READERS, max(_STREAM_READERS, math.ceil(share / mean) + 2)))
        return out

    def _read_run(self, readers: MixedSource, run: Run, progress: _Progress) -> Iterator[Any]:
        """Yield the run's samples (transformed).

        Under ``on_error="skip"`` a sample that cannot be read or transformed is counted
        and replaced by a repeat of the last good one, so every rank still yields
        ``len(dataset)`` items and DDP cannot hang.
        """
        info = readers.info(run.shard)
        entry, url, label = info.entry, info.url, info.label
        where = None if self.streams.plain else url  # a mixture names each stream's URL
        substitute = progress.substitute
        try:
            reader = readers.get(run.shard)
        except StreamloadError as exc:
            if self.on_error == "raise":
                _raise_located(exc, url, entry)
            progress.next_item = int(run.positions[-1]) + 1
            self._skip(entry, None, exc, count=len(run.locals), source=where)
            yield from substitute.fail(len(run.locals))
            return
        transform = self.transform
        samples = self._samples(readers, reader, run, entry, url)
        for position, sample in zip(run.positions.tolist(), samples, strict=True):
            progress.next_item = position + 1
            if isinstance(sample, _Failed):
                self._skip(entry, sample.key, sample.error, source=where)
                yield from substitute.fail(1)
                continue
            if label is not None:
                sample["__source__"] = label
            if transform is None:
                yield from substitute.good(sample)
                continue
            try:
                out = transform(sample)
            except Exception as exc:  # noqa: BLE001 - re-raised with context or counted
                if self.on_error == "raise":
                    if isinstance(exc, StreamloadError):
                        _raise_located(exc, url, entry)
                    raise SampleError(
                        f"{url}/{entry.name}: sample {sample.get('__key__')!r}: transform failed: {exc}"
                    ) from exc
                self._skip(entry, sample.get("__key__"), exc, source=where)
                yield from substitute.fail(1)
                continue
            yield from substitute.good(out)

    def _samples(
        self, readers: MixedSource, reader: ShardReader, run: Run, entry: ShardEntry, url: str
    ) -> Iterator[Sample | _Failed]:
        """Read the run's samples.

        A corrupt cached copy of a remote shard is read again from a fresh download, once
        (:meth:`ShardSource.recover`). Under ``on_error="skip"``, a bad sample becomes a
        :class:`_Failed` and reading goes on with the next one.
        """
        locals_ = run.locals.tolist()
        done = 0
        try:
            if run.contiguous:
                for sample in reader.iter_range(locals_[0], locals_[-1] + 1):
                    yield sample
                    done += 1
            else:
                for index in locals_:
                    yield reader.get(index)
                    done += 1
        except StreamloadError as exc:
            try:
                fresh = readers.recover(run.shard, exc)
            except StreamloadError as again:  # no fresh copy could be had
                fresh, exc = None, again
            if fresh is not None:
                rest = Run(run.shard, run.locals[done:], run.positions[done:])
                yield from self._samples(readers, fresh, rest, entry, url)
                return
            if self.on_error == "raise":
                _raise_located(exc, url, entry)
            yield _Failed(exc, None)
            for index in locals_[done + 1 :]:
                try:
                    yield reader.get(index)
                except StreamloadError as again:
                    yield _Failed(again, None)

    def _skip(
        self, entry: ShardEntry, key: str | None, exc: BaseException, count: int = 1, source: str | None = None
    ) -> None:
        """Count (and log once per shard) skipped samples; ``source``: a mixture's stream URL."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        self._skipped[0 if info is None else info.id] += count
        if self.errors.add(entry.name if source is None else f"{source}/{entry.name}", count):
            log.warning(
                "skipping %d sample(s) of %s/%s (first key %r): %s; later ones of this shard are counted",
                count,
                self.source if source is None else source,
                entry.name,
                key,
                exc,
            )

    @property
    def skipped_samples(self) -> int:
        """Samples skipped under ``on_error="skip"`` by this process and its DataLoader workers.

        Counted in shared memory, so the training loop sees its workers' skips; all-reduce
        it over ranks for the job's total.
        """
        return int(self._skipped.sum())

    # -- per-process resources -----------------------------------------------------

    def _get_storages(self) -> list[Storage]:
        """This process's storage of each stream (opened on first use)."""
        if self._storages is None:
            self._storages = self.streams.open_storages()
        return self._storages

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_storages"] = None  # opened again lazily in the receiving process
        state["_progress"] = None
        # A worker started with spawn has no torch.distributed: hand it this process's world.
        state["_inherited_world"] = distributed_world() or self._inherited_world
        return state

    def __repr__(self) -> str:
        mix = self.streams
        if len(mix.refs) > 1:
            return (
                f"StreamingDataset({len(mix.refs)} streams: {self.source}, samples={self.num_samples}, "
                f"shards={len(mix.shard_counts)}, shuffle={self.shuffle})"
            )
        return (
            f"StreamingDataset({self.source!r}, format={self.manifest.format!r}, "
            f"samples={self.num_samples}, shards={len(self.manifest.shards)}, shuffle={self.shuffle})"
        )


def _local_ranks() -> int:
    """Ranks of this node (``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 when unset or unreadable)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _raise_located(exc: StreamloadError, source: str, entry: ShardEntry) -> NoReturn:
    """Raise ``exc`` with the dataset URL and shard name in front, unless already there."""
    message = str(exc)
    if source not in message:
        try:
            located = type(exc)(f"{source}/{entry.name}: {message}")
        except TypeError:  # an error type with another constructor: keep it as it is
            raise exc from exc.__cause__
        raise located from exc
    raise exc


@dataclass
class SkipCounts:
    """Samples one process skipped under ``on_error="skip"`` (:attr:`StreamingDataset.errors`).

    Unlike :attr:`StreamingDataset.skipped_samples` (shared with the DataLoader workers),
    these counts are the calling process's own.

    Attributes:
        samples_skipped: Samples skipped in all.
        shards: Samples skipped per shard, by shard name (``<stream URL>/<shard>`` in a mixture).
    """

    samples_skipped: int = 0
    shards: dict[str, int] = field(default_factory=dict)

    def add(self, shard: str, count: int) -> bool:
        """Count ``count`` skipped samples of ``shard``; return True if they are its first."""
        before = self.shards.get(shard, 0)
        self.samples_skipped += count
        self.shards[shard] = before + count
        return before == 0


@dataclass
class _Progress:
    """Where this process's iteration stands (read by :meth:`StreamingDataset.state_dict`)."""

    epoch: int
    stages: tuple[Stage, ...]
    chunk: int
    #: Rank-order index of this worker's next item.
    next_item: int
    #: The chunk from which this iteration dealt chunks to the workers.
    first: int = 0
    #: Replaces skipped samples so the count per rank stays equal.
    substitute: _Substitute = field(default_factory=lambda: _Substitute())


@dataclass
class _Failed:
    """A sample that could not be read (under ``on_error="skip"``)."""

    error: StreamloadError
    key: str | None


class _Substitute:
    """Keeps the item count whole under ``on_error="skip"``.

    Each skipped item is replaced by a repeat of the last good one (owed until one exists).
    """

    def __init__(self) -> None:
        self.last: Any = None
        self.has_last = False
        self.owed = 0

    def good(self, item: Any) -> Iterator[Any]:
        self.last, self.has_last = item, True
        yield item
        owed, self.owed = self.owed, 0
        for _ in range(owed):
            yield item

    def fail(self, count: int) -> Iterator[Any]:
        if not self.has_last:
            self.owed += count
            return
        for _ in range(count):
            yield self.last

    def finish(self) -> Iterator[Any]:
        if self.owed and not self.has_last:
            raise StreamloadError(
                f"every one of the {self.owed} samples this worker had to read failed; nothing to substitute"
            )
        yield from ()
