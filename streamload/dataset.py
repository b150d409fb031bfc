"""``StreamingDataset``: the four axes composed into a lazy ``IterableDataset``.

Construction reads only the manifest (a few KB per thousand shards). Nothing that holds
a file, a thread or a connection is created before iteration, and none of it is pickled:
each DataLoader worker opens the shards it needs itself, after fork or spawn.

One epoch in one worker, as a stream::

    detect world (rank, world_size, worker, num_workers)      -- at iteration time
    claim the epoch (shared by all workers of the iteration)   -- at the first sample
    EpochPlan(shard_counts, world, Split(epoch, seed, ...))   -- pure, O(shards)
    resume point (start item)                                  -- load_state_dict, if any
    runs: (shard, [local indices])                             -- plan.runs(world, start)
      -> ShardSource.get(shard): storage.acquire -> reader     -- cache/read-ahead if remote
      -> format reader .iter_range / .get -> sample dicts      -- {"__key__", field: bytes,
                                                                     "__epoch__", "__position__"}
      -> transform(sample)                                     -- optional, e.g. decode

A mixture of datasets (:class:`~streamload.streams.Stream`) or an ``epoch_size`` changes
only two steps: the plan's layout (:class:`~streamload.plan.MixLayout`: exact per-stream
counts, interleaved) and the readers (:class:`~streamload.streams.MixedSource`: one
``ShardSource`` per stream, global shard numbers); see ``docs/mixing.md``.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import numpy as np
from torch.utils.data import IterableDataset

from ._atexit import close_at_exit
from ._errors import CacheError, ConfigError, CorruptShardError, PlanError, SampleError, StreamloadError
from ._shared import shared_block
from ._stages import SAMPLE_EVERY, Clock, StageTable
from ._validate import check_epoch, check_samples_seen, dataset_args, warn_remote_only
from .formats import Format, Sample, ShardReader
from .manifest import Manifest, ShardEntry
from .plan import (
    EpochPlan,
    Remainder,
    Run,
    Split,
    World,
    detect_rank_world,
    detect_world,
    distributed_world,
    locality_warning,
    partition_count,
    rank_samples,
)
from .plan.state import EpochState, WorkerPosition, manifest_fingerprint
from .shards import StorageConfig, StorageKeywords, storage_config
from .storage import Storage
from .storage.ranges import DEFAULT_STREAM_BUFFER
from .streams import MixedSource, Mixture, StreamSource

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11 (only read by type checkers here)

__all__ = ["MAX_NAMED_SKIPS", "SkipCounts", "SkippedSample", "StreamingDataset"]

log = logging.getLogger("streamload")

#: The shared epoch table: ``[base epoch, iterations claimed, (key, epoch, pid) * _CLAIMS]``.
#: Every iteration has a key that all of its readers share (the DataLoader iterator's base
#: seed and the worker process's iteration count; a fresh random key in the main process);
#: the first reader of an iteration to ask for a sample claims the next epoch for its key,
#: the others find it there. A claim counts only while its claimer lives: a new DataLoader
#: whose generator repeats an earlier one's seed has the same keys, but the earlier
#: iteration's workers are gone. ``set_epoch`` sets the base and clears the claims.
_MAX_WORKERS = 1024
_BASE, _CLAIMED, _TABLE = 0, 1, 2
_CLAIMS, _CLAIM = 64, 3
_KEY_MASK = (1 << 62) - 1
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
#: Who is iterating the dataset now: ``(pid, kind)`` slots in shared memory, so that a
#: :class:`streamload.Loader` (threads) and a DataLoader (processes) never read one dataset
#: at once (their epochs would collide). Kinds: the dataset's own iterator, a Loader's.
_USERS = 64
_ITERATOR, _LOADER = 1, 2

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
        pad: Fill the last global batch by repeating the fewest samples (default), so
            every rank yields the same count. ``pad=False`` (for evaluation): every sample
            exactly once, the last global batch short (``N mod (batch_size * world_size)``
            samples, shared among the ranks as evenly as possible), no repeats; ranks may
            then yield counts that differ by one sample, and one batch where the short
            batch has fewer samples than there are ranks. Under DDP, reduce sums and
            counts over ranks (``all_reduce``) once at the end, never a collective per
            batch (see ``docs/design.md``, *Evaluation without padding*).
        shuffle_window: Shuffle window in samples (default: four times the largest shard).
        batch_size: The DataLoader's batch size (per rank), if any. Workers then take
            batch-sized chunks in turn, so batches leave the DataLoader in the planned
            order; with ``shuffle=True`` the global batches (``batch_size * world_size``
            samples a step) are then the same on any number of ranks and workers (see
            *Reproducibility*).
        partitions: Canonical partitions of a shuffled, batched epoch (default 8): each
            global batch takes an equal slice of each, and each rank reads a contiguous
            group of them. Part of the order: keep it fixed to reproduce a run. World
            sizes that divide it or are multiples of it keep each rank on its own
            partitions; others get the same batches with less read locality (warned).
        transform: Function applied to each sample dict in the worker (e.g. a decoder from
            :mod:`streamload.decode`).
        collate: Make whole batches in the worker: called with each planned batch's
            samples (needs ``batch_size``; use ``DataLoader(batch_size=None)``). E.g.
            :class:`streamload.batch.RawCollate` (one ``uint8`` tensor per batch, read
            straight from the shards) or :class:`streamload.decode.DecodeBatch`.
        rank: Override the detected rank (default: torch.distributed, then ``RANK``).
        world_size: Override the detected world size.
        storage: How the dataset's files are reached: fsspec options, the cache, read-ahead,
            cached or streamed (a :class:`~streamload.StorageConfig`; default: none of
            them set). Its ``cache`` defaults to ``"auto"`` here: stream when the cache
            limit cannot hold the shards one shuffle window spans for every reader of the
            machine (or two of the largest shards), else cache. The keywords
            ``storage_options=``, ``cache_dir=``, ``cache_limit=``, ``read_ahead=``,
            ``cache=`` and ``stream_buffer=`` are deprecated (a ``DeprecationWarning``;
            they go in the next release): they are the fields of that object.
        on_error: ``"raise"`` (default): a sample or shard that fails to read or
            transform raises an error naming the dataset URL, shard, key and field.
            ``"skip"``: it is counted (:attr:`skipped_samples`, shared with the workers),
            named with its shard, key and reason in the log and in :attr:`errors`
            (``errors.samples``, the first :data:`MAX_NAMED_SKIPS` of a process), and
            replaced by a repeat of the last good sample, so every rank still yields
            ``len(dataset)`` items and DDP cannot hang.

    Example:
        >>> ds = StreamingDataset("/data/imagenet-shards", shuffle=True, seed=1)  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=256, num_workers=8)  # doctest: +SKIP
        >>> remote = StreamingDataset("s3://bucket/train", shuffle=True,
        ...                           storage=StorageConfig(cache_dir="/scratch", cache_limit="50GB"))  # doctest: +SKIP

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
        advances the epoch by one. An iteration counts once its first sample is asked for,
        and all readers of one iteration (every DataLoader worker of one ``iter(loader)``,
        persistent or not) agree on its epoch, whatever iterated the dataset before.

    Reproducibility:
        With ``shuffle=True`` and ``batch_size=b``, the samples of global step ``k`` (all
        ranks' ``k``-th batches, in rank order) depend only on the dataset, ``seed``, the
        epoch, the global batch ``b * world_size`` and ``partitions``: 1 GPU with
        ``batch_size=256`` and 8 GPUs with ``batch_size=32`` see the same steps, with any
        ``num_workers``, and so does a run resumed on another world. Every sample dict
        that ``transform`` or ``collate`` receives carries ``"__epoch__"`` and
        ``"__position__"`` (its place in the epoch, the same on every world), the key of
        :func:`streamload.sample_generator`, which
        :class:`~streamload.decode.DecodeBatch` uses for its random crops and flips. See
        ``docs/reproducibility.md``.

    Stop and resume:
        ``state_dict()`` returns a small plain dict (JSON- and ``torch.save``-safe): the
        epoch, the seed and the global number of samples consumed, independent of the
        number of ranks and workers. ``load_state_dict(state)`` makes the next iteration
        continue that epoch at the first unseen sample, without reading the seen ones;
        the following epoch is unchanged. The rest of the epoch is exactly the
        uninterrupted run's, on the same world or, for a count of whole global batches,
        on any world with the same global batch and ``partitions``. A world of another
        global batch (or ``partitions``) reads the epoch's unread rest, each sample once
        and equal per rank, in another order (one ``UserWarning`` says so). A state of
        another dataset, or a worker position outside its plan, is a
        :class:`~streamload.PlanError`. Two ways to use it:

        * ``torchdata.stateful_dataloader.StatefulDataLoader`` calls ``state_dict`` and
          ``load_state_dict`` in its workers; save and load the loader's state (same
          number of ranks and workers).
        * With a plain ``DataLoader`` (any workers; pass ``batch_size=`` to this dataset),
          the training loop supplies the global count::

              ckpt["data"] = ds.state_dict(samples_seen=step_in_epoch * global_batch)
              ds.load_state_dict(ckpt["data"])  # on restart, before iterating

          This is the elastic path: resume on any number of ranks and workers.
    """

    #: Stage seconds of the readers, for :func:`streamload.watch` (made only when a loader is watched).
    _stages: StageTable | None = None

    def __init__(
        self,
        source: StreamSource,
        *,
        epoch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        shuffle_window: int | None = None,
        batch_size: int | None = None,
        partitions: int | None = None,
        transform: Callable[[Sample], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage: StorageConfig | None = None,
        on_error: OnError = "raise",
        **deprecated: Unpack[StorageKeywords],
    ) -> None:
        super().__init__()
        config = storage_config("StreamingDataset", storage, deprecated) or StorageConfig()
        args = dataset_args(locals())
        self.shuffle = args.shuffle
        self.seed = args.seed
        self.drop_last = args.drop_last
        if not isinstance(pad, bool):
            raise ConfigError(f"pad={pad!r} must be True or False")
        self.pad = pad
        self.shuffle_window = args.shuffle_window
        self.batch_size = args.batch_size
        self.partitions = args.partitions
        self.transform = transform
        self.collate = collate
        if collate is not None and args.batch_size is None:
            raise ConfigError(f"collate={collate!r} needs batch_size= (the batches are made in the workers)")
        self.rank = args.rank
        self.world_size = args.world_size
        self.on_error: OnError = on_error
        #: How the files are reached (``cache`` settled: ``"auto"`` unless given).
        self.storage: StorageConfig = config.with_cache("auto")
        Split(seed=args.seed, window=args.shuffle_window, chunk=args.batch_size, partitions=args.partitions)
        #: The datasets read and each one's samples per epoch (one for a plain URL).
        self.streams: Mixture = Mixture.open(source, epoch_size, self.storage)
        self.epoch_size = epoch_size
        self.source = self.streams.describe()  # the URL, or the streams' URLs and counts
        self._ref = self.streams.refs[0]
        warn_remote_only(source, self.storage.settings(), self._ref.data_url)
        self.manifest: Manifest = self._ref.manifest
        self.format: Format = self._ref.format
        # Shared across fork/spawn so set_epoch() reaches persistent workers (a block of a
        # segment many datasets share: one file descriptor per arena, not two per dataset).
        self._epochs = shared_block(_TABLE + _CLAIM * _CLAIMS)
        #: (pid, iterations started) of this process: part of a DataLoader worker's key.
        self._iterations: tuple[int, int] = (os.getpid(), 0)
        #: Locality warnings already given by this process (once per world size).
        self._warned: set[int] = set()
        #: Digest of the shards read (in resume states), computed when first asked for.
        self._manifest_digest: str | None = None
        #: The state given to load_state_dict (applies to iterations of its epoch).
        self._resume: EpochState | None = None
        #: This process's current (or last) iteration: where it stands.
        self._progress: _Progress | None = None
        #: (rank, world_size) of the process that pickled this dataset to a worker.
        self._inherited_world: tuple[int, int] | None = None
        self._storages: list[Storage] | None = None
        #: Skipped samples per worker id (shared memory, so the main process sees them).
        self._skipped = shared_block(_MAX_WORKERS)
        #: This process's counts of samples skipped under ``on_error="skip"``, in all and per shard.
        self.errors = SkipCounts()
        #: Who iterates this dataset (pid, kind) per slot: a Loader and a DataLoader at once are refused.
        self._users = shared_block(_USERS)  # pid * 4 + kind: one word, so no half-written entry is seen

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
        rank, world_size = detect_rank_world(self.rank, self.world_size, self._inherited_world)
        per_rank = rank_samples(self.num_samples, world_size, rank, self.drop_last, self.batch_size, self.pad)
        if self.collate is not None and self.batch_size is not None:
            return -(-per_rank // self.batch_size)  # the planner's chunks are the batches
        return per_rank

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``; later ones advance from it by one.

        Works with ``persistent_workers=True``: the counter lives in shared memory.
        """
        epoch = check_epoch(epoch)
        self._epochs[_BASE] = epoch
        self._epochs[_CLAIMED] = 0

    def _iteration_key(self) -> int:
        """The key shared by every reader of this iteration (see ``_TABLE``); counts the iteration."""
        from torch.utils.data import get_worker_info

        pid, started = self._iterations
        if pid != os.getpid():  # a fresh worker process (fork copies the parent's count)
            started = 0
        self._iterations = (os.getpid(), started + 1)
        info = get_worker_info()
        if info is None:
            return secrets.randbits(62) | 1
        # Every worker of one DataLoader iterator has the same base seed (seed - id), and
        # persistent workers all start their k-th iteration together.
        base = (info.seed - info.id) & 0xFFFFFFFFFFFFFFFF
        return _mix(base, started) & _KEY_MASK | 1

    def _lookup(self, key: int) -> tuple[int | None, int]:
        """Return the epoch claimed for ``key`` (``None`` if none) and the number of claims."""
        table = self._epochs
        claimed = int(table[_CLAIMED])
        # Up to claim ``claimed`` itself: a sibling may have written it and not yet counted it.
        for i in range(max(0, claimed - _CLAIMS), claimed + 1):
            slot = _TABLE + _CLAIM * (i % _CLAIMS)
            if int(table[slot]) == key and _alive(int(table[slot + 2])):
                return int(table[slot + 1]), claimed
        return None, claimed

    def _find_epoch(self, key: int) -> int:
        """Return the epoch claimed for ``key``, else the epoch the next claim would get."""
        epoch, claimed = self._lookup(key)
        return self._next_epoch(claimed) if epoch is None else epoch

    def _claim_epoch(self, key: int) -> int:
        """Return the epoch of the iteration ``key``, claiming the next one if it has none yet.

        Readers of one iteration that race here compute the same claim from the same table
        (the previous claim's epoch + 1, or the base) and write the same values.
        """
        epoch, claimed = self._lookup(key)
        if epoch is not None:
            return epoch
        epoch = self._next_epoch(claimed)
        table, slot = self._epochs, _TABLE + _CLAIM * (claimed % _CLAIMS)
        table[slot + 1] = epoch
        table[slot + 2] = os.getpid()
        table[slot] = key
        table[_CLAIMED] = claimed + 1
        return epoch

    def _next_epoch(self, claimed: int) -> int:
        if claimed == 0:
            return int(self._epochs[_BASE])
        return int(self._epochs[_TABLE + _CLAIM * ((claimed - 1) % _CLAIMS) + 1]) + 1

    @property
    def epoch(self) -> int:
        """The epoch of this process's current or last iteration, else the last one claimed, else the next."""
        if self._progress is not None:
            return self._progress.epoch
        claimed = int(self._epochs[_CLAIMED])
        return self._next_epoch(claimed) - 1 if claimed else int(self._epochs[_BASE])

    def _split(self, epoch: int) -> Split:
        return Split(
            epoch=epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            window=self.shuffle_window,
            chunk=self.batch_size,
            partitions=self.partitions,
            pad=self.pad,
        )

    def plan(self, epoch: int, world_size: int) -> EpochPlan:
        """Return the :class:`EpochPlan` this dataset follows for ``epoch`` in a world of ``world_size``.

        An epoch resumed from a state whose partitions were one per rank (unshuffled, or
        without a batch size) keeps the saving world's partitions, so its remaining global
        batches are those of the uninterrupted run on any world. One resumed with another
        global batch (or other canonical partitions) reads the rest of the epoch
        (:class:`~streamload.plan.Remainder`): every unread sample once, in the new
        world's global batches.
        """
        split = self._split(epoch)
        counts = self.streams.shard_counts
        resume = self._resume
        if resume is None or resume.epoch != epoch:
            return EpochPlan(counts, world_size, split, self.streams.layout(split))
        batch = world_size * (split.chunk or 1)
        reshaped = resume.reshaped(batch, partition_count(split, world_size), split.canonical)
        segments = resume.segments + ((resume.new_segment(),) if reshaped else ())
        if not segments:
            if not split.canonical:
                split = replace(split, partitions=resume.partitions)
            return EpochPlan(counts, world_size, split, self.streams.layout(split))
        first_batch, first_parts, _ = segments[0]
        base = replace(split, chunk=first_batch, partitions=first_parts, window=resume.window)
        rest = Remainder(EpochPlan(counts, 1, base, self.streams.layout(base)), segments[0][2] // first_batch)
        plain = Split(epoch=epoch, seed=self.seed, drop_last=self.drop_last, pad=self.pad)
        for (_, _, begin), (batch_i, parts_i, end) in zip(segments, segments[1:], strict=False):
            part = replace(plain, chunk=batch_i, partitions=parts_i)
            rest = Remainder(EpochPlan(counts, 1, part, rest), (end - begin) // batch_i)
        final = replace(plain, chunk=split.chunk, partitions=None if reshaped else resume.partitions)
        plan = EpochPlan(counts, world_size, final, rest)
        if not reshaped and resume.rest != rest.total:
            raise PlanError(
                f"state rest={resume.rest} does not match the rest of the epoch its segments leave ({rest.total})"
            )
        plan.segments, plan.reshaped = segments, reshaped
        return plan

    @property
    def manifest_digest(self) -> str:
        """A short digest of the shards this dataset reads (names, sizes, sample counts, hashes).

        Stored in :meth:`state_dict`, so a state of another dataset of the same size is refused.
        """
        if self._manifest_digest is None:
            self._manifest_digest = manifest_fingerprint(
                [
                    [(e.name, e.num_bytes, e.num_samples, str(e.hash)) for e in ref.manifest.shards]
                    for ref in self.streams.refs
                ]
            )
        return self._manifest_digest

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
        worker = None
        plan = self.plan(self.epoch, world.world_size)
        if samples_seen is None:
            if progress is None:
                if int(self._epochs[_CLAIMED]) > 0:
                    raise PlanError(
                        "this process has not read the dataset (DataLoader workers did): "
                        "pass samples_seen=steps * global_batch to state_dict()"
                    )
                samples_seen = 0
            else:
                origin = progress.origin
                done = None if origin is None else plan.worker_done(world, origin, progress.first, progress.next_item)
                worker = WorkerPosition(
                    world.rank,
                    world.world_size,
                    world.worker,
                    world.num_workers,
                    progress.chunk,
                    progress.next_item,
                    progress.first,
                    None if done is None else origin,
                    done,
                )
                samples_seen = None
                if world.num_workers == 1 and (progress.next_item <= plan.per_rank or world.world_size == 1):
                    begun = plan.segments[-1][2] if plan.segments else 0
                    samples_seen = begun + world.world_size * progress.next_item
        state = EpochState(
            plan.split.epoch,
            self.seed,
            self.shuffle,
            self.drop_last,
            plan.base_window,
            self.num_samples,
            world.world_size,
            samples_seen,
            plan.global_batch,
            plan.partitions,
            worker,
            self.streams.fingerprint,
            pad=self.pad,
            manifest=self.manifest_digest,
            segments=plan.segments,
            rest=plan.total if plan.segments else None,
        )
        self._check_samples_seen(state)
        return state.normalized().to_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict`` (from :meth:`state_dict`) at the next iteration.

        Sets the epoch to the saved one (the next one if it had finished); the iteration
        of that epoch starts at the first unseen sample. Call it before iterating. The
        world that continues must have the saved global batch and partition count
        (checked when it iterates, where the world is known).

        Raises:
            PlanError: If the state is malformed or belongs to a differently configured dataset.
        """
        state = EpochState.from_dict(state_dict)
        state.check_dataset(
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            window=self.shuffle_window or state.window,
            num_samples=self.num_samples,
            mixture=self.streams.fingerprint,
            pad=self.pad,
            manifest=self.manifest_digest,
        )
        self._check_samples_seen(state)
        state = state.normalized()
        self._resume = state
        self._progress = None
        # Every reader of the next iteration (this process, or each worker restored by
        # StatefulDataLoader before it iterates) gets the saved epoch.
        self.set_epoch(state.epoch)

    def _check_samples_seen(self, state: EpochState) -> None:
        """Refuse a global ``samples_seen`` past the end of its epoch (a wrong count, not a finished epoch)."""
        if state.samples_seen is not None:
            check_samples_seen(state.samples_seen, state.padded, state.world_size, state.global_batch)

    def _resume_point(self, world: World, plan: EpochPlan) -> tuple[int, int, int | None]:
        """Return the start item, first dealt chunk and iteration start of ``plan`` for ``world`` (fresh: 0, 0, 0).

        A worker's own position is checked against the plan first (:meth:`WorkerPosition.check`).
        """
        resume = self._resume
        if resume is None or resume.epoch != plan.split.epoch or plan.reshaped:
            return 0, 0, 0  # a new segment is read from its start
        if self.shuffle and resume.window != plan.base_window:
            raise PlanError(
                f"state saved with window={resume.window} cannot resume with window={plan.base_window}: "
                "pass the saving run's shuffle_window="
            )
        chunk = plan.chunk_size(world.num_workers)
        if resume.worker is not None and resume.worker.matches(world, chunk):
            resume.worker.check(world, plan)
        start, first = resume.resume(world, chunk)
        origin, _ = resume.origin(world, chunk, start)
        return start, first, None if origin < 0 or _ < 0 else origin

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        world = detect_world(self.rank, self.world_size, self._inherited_world)
        key = self._iteration_key()
        try:
            plan, progress = self._start(world, self._find_epoch(key))  # state_dict() may ask before the first sample
        except PlanError as exc:
            if world.num_workers == 1:
                raise
            # In a DataLoader worker, raise with the first sample: the loader then hands the error to
            # the main process at once (raised here, it kills the worker and is seen only after a timeout).
            return _refused(exc)
        iterator = self._iterate(world, key, plan, progress)
        close_at_exit(iterator)  # closed before the interpreter's teardown if still alive then
        return iterator

    def _start(self, world: World, epoch: int) -> tuple[EpochPlan, _Progress]:
        plan = self.plan(epoch, world.world_size)
        start, first, origin = self._resume_point(world, plan)
        progress = _Progress(epoch, plan.chunk_size(world.num_workers), start, first, origin)
        self._progress = progress
        return plan, progress

    def _iterate(self, world: World, key: int, plan: EpochPlan, progress: _Progress) -> Generator[Any, None, None]:
        """One iteration: its epoch is claimed when its first sample is asked for.

        An iterator still alive at interpreter exit is closed after the modules' globals
        are gone: what its cleanup raises then is dropped, not printed.
        """
        finalizing = sys.is_finalizing  # bound now: the module's globals may be gone at exit
        slot = self._enter(_ITERATOR)
        try:
            epoch = self._claim_epoch(key)
            if epoch != progress.epoch:  # another iteration claimed in between
                plan, progress = self._start(world, epoch)
            self._warn_locality(plan, world)
            try:
                yield from self._iter_plan(plan, world, progress)
            except Exception:
                if not finalizing():
                    raise
        finally:
            try:
                self._leave(slot)
            except Exception:
                if not finalizing():
                    raise

    def _warn_locality(self, plan: EpochPlan, world: World) -> None:
        """Warn once per world size (in the first reader of rank 0) if its ranks straddle partitions.

        Also once per resumed epoch whose global batch changed: its order differs from
        the uninterrupted run's from the resume point on.
        """
        if world.rank or world.worker:
            return
        if plan.reshaped and -1 - plan.split.epoch not in self._warned:
            self._warned.add(-1 - plan.split.epoch)
            old_batch, old_parts, seen = plan.segments[-1]
            warnings.warn(
                f"resuming epoch {plan.split.epoch} after {seen} samples with global_batch={plan.global_batch} "
                f"(partitions={plan.partitions}); it was read with global_batch={old_batch} "
                f"(partitions={old_parts}): the rest of the epoch ({plan.total} samples) is read each once, "
                "equal per rank, in an order that differs from the uninterrupted run's",
                UserWarning,
                stacklevel=3,
            )
        if world.world_size in self._warned:
            return
        self._warned.add(world.world_size)
        message = locality_warning(plan.split, world.world_size)
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=3)

    def _iter_plan(self, plan: EpochPlan, world: World, progress: _Progress) -> Iterator[Any]:
        storages = self._get_storages()
        readers = self.streams.source(storages, self._readers_needed(plan), self._streaming(plan, world, storages))
        start, first = progress.next_item, progress.first
        try:
            runs = readers.read_ahead(plan.runs(world, start, first), plan.worker_shards(world, start, first))
            items = self._read_plan(readers, runs, progress)
            if self._stages is not None:  # watched: time the readers' stages (streamload.watch)
                progress.clock = self._stages.clock()
                items = progress.clock.timed(items, 1 if self.collate is not None else SAMPLE_EVERY)
            for item in items:
                yield item
                readers.started()  # the first item is out: read-ahead may share the link now
                yield from items
        finally:
            readers.close()

    def _read_plan(self, readers: MixedSource, runs: Iterator[Run], progress: _Progress) -> Iterator[Any]:
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

    def _streaming(self, plan: EpochPlan, world: World, storages: list[Storage]) -> list[bool]:
        """Per stream: read its shards by ranged GETs (``cache="none"``, or ``"auto"`` when the cache is too small).

        ``"auto"`` compares the cache limit with the shards this machine's readers keep
        open at once: the shards one shuffle window spans (one without shuffling) times the
        DataLoader workers and the ranks of the node (``LOCAL_WORLD_SIZE``).
        """
        readers = max(1, world.num_workers) * _local_ranks()
        spans = self._window_shards(plan)
        return [
            ref.streams(storage, readers * n)
            for ref, storage, n in zip(self.streams.refs, storages, spans, strict=True)
        ]

    def _window_shards(self, plan: EpochPlan) -> list[int]:
        """Per stream: the shards a reader of ``plan`` has open at once (its partitions' windows).

        A mixture's window holds each stream's share of it; without shuffling each stream
        is read shard after shard.
        """
        mix = self.streams
        out = []
        for ref, count in zip(mix.refs, mix.counts, strict=True):
            shards = ref.manifest.shards
            if not shards or not mix.total:
                out.append(1)
                continue
            mean = max(1.0, ref.manifest.num_samples / len(shards))
            out.append(min(_MAX_OPEN_READERS, plan.open_shards(mean, count / mix.total)))
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
        budget = self.storage.stream_buffer or DEFAULT_STREAM_BUFFER
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
                samples = [s for run in batch_runs for s in self._read_run(readers, run, progress)]
                batch = collate(samples) if progress.clock is None else progress.clock.collate(collate, samples)
            progress.next_item = int(batch_runs[-1].positions[-1]) + 1
            yield batch

    def _readers_needed(self, plan: EpochPlan) -> list[int]:
        """Shard readers to keep open per stream: enough for the shards one shuffle window spans.

        A mixture's window holds each stream's share of it; without shuffling each stream
        is read shard after shard.
        """
        least = _OPEN_READERS if self.streams.plain else _STREAM_READERS
        return [min(_MAX_OPEN_READERS, max(least, n + 1)) for n in self._window_shards(plan)]

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
            if self.on_error == "raise" or isinstance(exc, CacheError):  # the machine's fault: never a skip
                _raise_located(exc, url, entry)
            progress.next_item = int(run.positions[-1]) + 1
            self._skip(entry, exc, run.locals.tolist(), [None] * len(run.locals), source=where)
            yield from substitute.fail(len(run.locals), where)
            return
        transform, clock = self.transform, progress.clock
        samples = self._samples(readers, reader, run, entry, url)
        epoch = progress.epoch
        # What a transform or collate sees carries its place in the epoch (the key of
        # per-sample randomness); dicts yielded as they are stay the stored sample.
        placed = transform is not None or self.collate is not None
        for position, item, local, sample in zip(
            run.positions.tolist(), run.items.tolist(), run.locals.tolist(), samples, strict=True
        ):
            progress.next_item = position + 1
            if isinstance(sample, _Failed):
                self._skip(entry, sample.error, [local], [sample.key], source=where)
                yield from substitute.fail(1, where)
                continue
            if placed:
                sample["__epoch__"] = epoch
                sample["__position__"] = item
            if label is not None:
                sample["__source__"] = label
            if transform is None:
                yield from substitute.good(sample, where)
                continue
            try:
                out = transform(sample) if clock is None else clock.transform(transform, sample)
            except Exception as exc:  # noqa: BLE001 - re-raised with context or counted
                if self.on_error == "raise":
                    if isinstance(exc, StreamloadError):
                        _raise_located(exc, url, entry)
                    raise SampleError(
                        f"{url}/{entry.name}: sample {sample.get('__key__')!r}: transform failed: {exc}"
                    ) from exc
                self._skip(entry, exc, [local], [sample.get("__key__")], source=where)
                yield from substitute.fail(1, where)
                continue
            yield from substitute.good(out, where)

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
                rest = run.part(done)
                yield from self._samples(readers, fresh, rest, entry, url)
                return
            if self.on_error == "raise" or isinstance(exc, CacheError):  # the machine's fault: never a skip
                _raise_located(exc, url, entry)
            yield _Failed(exc, _key_of(reader, locals_[done]))
            for index in locals_[done + 1 :]:
                try:
                    yield reader.get(index)
                except StreamloadError as again:
                    yield _Failed(again, _key_of(reader, index))

    def _skip(
        self,
        entry: ShardEntry,
        exc: BaseException,
        indices: list[int],
        keys: list[str | None],
        source: str | None = None,
    ) -> None:
        """Count, name and log skipped samples (their indices in the shard and keys, ``None`` if unreadable).

        ``source``: a mixture's stream URL. Each sample is named in :attr:`errors` and the
        log, up to :data:`MAX_NAMED_SKIPS` per process; those past it are counted.
        """
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        count = len(indices)
        self._skipped[0 if info is None else info.id] += count
        shard = entry.name if source is None else f"{source}/{entry.name}"
        where = f"{self.source if source is None else source}/{entry.name}"
        reason = " ".join(str(exc).split()) or type(exc).__name__
        errors = self.errors
        room = max(0, MAX_NAMED_SKIPS - len(errors.samples))
        named = [SkippedSample(shard, i, k, reason) for i, k in zip(indices[:room], keys[:room], strict=True)]
        errors.add(shard, count, named)
        if named and all(k is None for k in keys):  # keys unreadable (the shard could not be opened)
            span = f"#{indices[0]}" if count == 1 else f"#{indices[0]}..#{indices[-1]}"
            log.warning("skipping %d sample(s) %s of %s (their keys could not be read): %s", count, span, where, reason)
        else:
            for sample in named:
                log.warning("skipping sample %r (#%d) of %s: %s", sample.key, sample.index, where, reason)
        if len(named) < count and room:
            log.warning(
                "more than %d samples skipped: further ones are counted (errors.samples_skipped), not named",
                MAX_NAMED_SKIPS,
            )

    @property
    def skipped_samples(self) -> int:
        """Samples skipped under ``on_error="skip"`` by this process and its DataLoader workers.

        Counted in shared memory, so the training loop sees its workers' skips; all-reduce
        it over ranks for the job's total.
        """
        return int(self._skipped.sum())

    # -- iteration on threads (streamload.Loader) -------------------------------------

    def _enter(self, kind: int) -> int:
        """Register this process as iterating the dataset as ``kind``; return its slot.

        Raises:
            ConfigError: If a reader of the other kind (a :class:`streamload.Loader`'s
                threads, or the dataset's own iterator in a DataLoader) is iterating it now.
        """
        users, pid = self._users, os.getpid()
        free = None
        for i in range(_USERS):
            slot = (pid + i) % _USERS
            word = int(users[slot])  # one aligned 64-bit word: written and read whole
            other, other_kind = word >> 2, word & 3
            if other and other_kind != kind and _alive(other):
                mine, theirs = ("a streamload.Loader", "a DataLoader (or a loop over it)")
                if kind == _LOADER:
                    mine, theirs = theirs, mine
                raise ConfigError(
                    f"{self.source}: this dataset is being iterated by {mine} (process {other}); "
                    f"{theirs} cannot read it at the same time (the two would read the same samples): "
                    "finish or delete the other iteration, or give each loader its own StreamingDataset"
                )
            if free is None and (not other or not _alive(other)):
                free = slot
        if free is None:  # every slot held by a live reader of this kind: not tracked
            return -1
        users[free] = (pid << 2) | kind
        return free

    def _enter_threads(self) -> int:
        """:meth:`_enter` for a :class:`streamload.Loader`'s iteration."""
        return self._enter(_LOADER)

    def _leave(self, slot: int) -> None:
        """Unregister the slot :meth:`_enter` returned."""
        if slot >= 0 and int(self._users[slot]) >> 2 == os.getpid():
            self._users[slot] = 0

    def _thread_iterations(self, threads: int) -> tuple[_Progress, list[Iterator[Any]]]:
        """One iteration read by ``threads`` readers of this process (:class:`streamload.Loader`).

        Claims the epoch now, and plans it as if this rank had ``threads`` DataLoader
        workers: reader ``w`` reads exactly what worker ``w`` would, so taking their
        batches in turn gives the DataLoader's batches for any number of workers. Returns
        the rank's progress (set as this process's, its ``next_item`` advanced by the
        caller as batches are consumed) and one lazy iterator per reader.
        """
        rank, world_size = detect_rank_world(self.rank, self.world_size, self._inherited_world)
        storages = self._get_storages()  # opened here, once, not by the readers at once
        del storages
        epoch = self._claim_epoch(secrets.randbits(62) | 1)
        plan = self.plan(epoch, world_size)
        readers: list[Iterator[Any]] = []
        start = first = 0
        origin: int | None = 0
        for worker in range(threads):
            world = World(rank, world_size, worker, threads)
            start, first, origin = self._resume_point(world, plan)
            if worker == 0:
                self._warn_locality(plan, world)
            progress = _Progress(epoch, plan.chunk_size(threads), start, first, origin)
            readers.append(self._iter_plan(plan, world, progress))
        self._progress = _Progress(epoch, plan.chunk_size(threads), start, first, origin)
        return self._progress, readers

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


def _refused(exc: StreamloadError) -> Iterator[Any]:
    """An iterator that raises ``exc`` when asked for its first item."""
    raise exc
    yield  # a generator


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


#: Skipped samples a process names one by one (in ``errors.samples`` and the log); more are counted.
MAX_NAMED_SKIPS = 1000


@dataclass(frozen=True)
class SkippedSample:
    """One sample skipped under ``on_error="skip"``.

    Attributes:
        shard: The shard's name (``<stream URL>/<shard>`` in a mixture).
        index: The sample's index within the shard.
        key: The sample's key, or ``None`` if the shard's index could not be read.
        reason: Why it was skipped (the error's message).
    """

    shard: str
    index: int
    key: str | None
    reason: str


_SKIP_LOCK = threading.Lock()


@dataclass
class SkipCounts:
    """Samples one process skipped under ``on_error="skip"`` (:attr:`StreamingDataset.errors`).

    Unlike :attr:`StreamingDataset.skipped_samples` (shared with the DataLoader workers),
    these counts are the calling process's own (a DataLoader worker names its skips in its
    own log lines).

    Attributes:
        samples_skipped: Samples skipped in all.
        shards: Samples skipped per shard, by shard name (``<stream URL>/<shard>`` in a mixture).
        samples: Each skipped sample, named (shard, index, key, reason), in the order they
            were skipped: the first :data:`MAX_NAMED_SKIPS`; ``samples_skipped`` counts
            them all. Not part of equality (which compares the counts).
    """

    samples_skipped: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    samples: list[SkippedSample] = field(default_factory=list, compare=False)

    def add(self, shard: str, count: int, named: list[SkippedSample] | None = None) -> bool:
        """Count ``count`` skipped samples of ``shard`` (naming ``named``); return True if they are its first.

        Safe to call from several threads (the readers of a :class:`streamload.Loader`).
        """
        with _SKIP_LOCK:
            before = self.shards.get(shard, 0)
            self.samples_skipped += count
            self.shards[shard] = before + count
            self.samples.extend(named or ())
        return before == 0


@dataclass
class _Progress:
    """Where this process's iteration stands (read by :meth:`StreamingDataset.state_dict`)."""

    epoch: int
    chunk: int
    #: Rank-order index of this worker's next item.
    next_item: int
    #: The chunk from which this iteration dealt chunks to the workers.
    first: int = 0
    #: The rank item this worker's iteration started from (``None``: unknown, an earlier state).
    origin: int | None = 0
    #: Replaces skipped samples so the count per rank stays equal.
    substitute: _Substitute = field(default_factory=lambda: _Substitute())
    #: The stage clock of a watched iteration (``streamload.watch``), else ``None``.
    clock: Clock | None = None


@dataclass
class _Failed:
    """A sample that could not be read (under ``on_error="skip"``)."""

    error: StreamloadError
    key: str | None


def _key_of(reader: ShardReader, index: int) -> str | None:
    """The key of sample ``index`` from the shard's index, if that can still be read."""
    try:
        return reader.keys_of(np.array([index], dtype=np.int64))[0]
    except Exception:  # noqa: BLE001 - the shard's index is damaged too: the sample is named by its index
        return None


class _Substitute:
    """Keeps the item count whole under ``on_error="skip"``.

    Each skipped item is replaced by a repeat of the last good one of the same stream (owed
    until one exists), so a mixture's shares hold: a stand-in for stream B's bad sample
    comes from stream B. An item still owed at the end comes from any stream.
    """

    def __init__(self) -> None:
        self.last: dict[object, Any] = {}
        self.owed: dict[object, int] = {}

    def good(self, item: Any, stream: object = None) -> Iterator[Any]:
        self.last[stream] = item
        yield item
        for _ in range(self.owed.pop(stream, 0)):
            yield item

    def fail(self, count: int, stream: object = None) -> Iterator[Any]:
        if stream not in self.last:
            self.owed[stream] = self.owed.get(stream, 0) + count
            return
        for _ in range(count):
            yield self.last[stream]

    def finish(self) -> Iterator[Any]:
        owed = sum(self.owed.values())
        if owed and not self.last:
            raise StreamloadError(
                f"every one of the {owed} samples this worker had to read failed; nothing to substitute"
            )
        self.owed.clear()
        stand_in = next(reversed(self.last.values()), None)
        for _ in range(owed):
            yield stand_in


def _mix(*words: int) -> int:
    """Hash 64-bit words into one (splitmix64 steps): keys that differ in any word differ."""
    h = 0x9E3779B97F4A7C15
    for word in words:
        h = (h ^ (word & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


def _alive(pid: int) -> bool:
    """True if process ``pid`` exists (a claim of a process that has exited no longer counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True
