"""``StreamingDataset``: the four axes composed into a lazy ``IterableDataset``.

Construction reads only the manifest (a few KB per thousand shards). Nothing that holds
a file, a thread or a connection is created before iteration, and none of it is pickled:
each DataLoader worker opens the shards it needs itself, after fork or spawn.

One epoch in one worker, as stages (:mod:`streamload.stages`)::

    detect world (rank, world_size, worker, num_workers)     -- at iteration time
    claim the epoch (shared by all readers of the iteration)  -- at the first sample (epochs)
    plan         EpochPlan(shard_counts, world, Split(epoch, seed, ...)), resume point (resume)
    shard runs   (shard, [local indices]) from plan.runs(world, start)
    fetch ahead  next shards to the storage's read-ahead, or a streamed batch's ranges (ahead)
    read         ShardSource.get(shard) -> format reader .iter_range / .get -> sample dicts
                 {"__key__", field: bytes, "__epoch__", "__position__"}  (corrupt copy: recovery)
    transform / collate                                        -- optional, e.g. decode
    skip / substitute                                          -- on_error="skip" (skips)

A mixture of datasets (:class:`~streamload.streams.Stream`) or an ``epoch_size`` changes
only two steps: the plan's layout (:class:`~streamload.plan.MixLayout`: exact per-stream
counts, interleaved) and the readers (:class:`~streamload.streams.MixedSource`: one
``ShardSource`` per stream, global shard numbers); see ``docs/mixing.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset

from ._atexit import close_at_exit
from ._errors import PlanError
from ._validate import DatasetArgs, check_epoch, dataset_args, warn_remote_only
from .formats import Format, Sample
from .iterations import Iterations, ThreadReaders
from .manifest import Manifest
from .plan import EpochPlan, Split, World, detect_rank_world, detect_world, distributed_world, rank_samples
from .plan_stage import Planner, Position
from .shardlist import open_shard_list
from .skips import MAX_NAMED_SKIPS, SkipCounts, SkipLog, SkippedSample
from .stages import OnError, Pipeline, Steps
from .storage import Storage
from .storage.ranges import DEFAULT_STREAM_BUFFER
from .storageconfig import StorageConfig, StorageKeywords, config_from_arguments
from .streams import Mixture, ReaderKeep, StreamSource
from .timing import StageTable

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11 (only read by type checkers here)

__all__ = ["MAX_NAMED_SKIPS", "SkipCounts", "SkippedSample", "StreamingDataset"]


class StreamingDataset(IterableDataset[Any]):
    """An iterable dataset over sharded samples in a local directory or fsspec URL.

    Every sample is read exactly once per epoch over all ranks and DataLoader workers;
    every rank yields ``len(dataset)`` samples (padding by repeating the fewest samples,
    or dropping the tail with ``drop_last=True``), so DDP never waits on an uneven epoch.

    Args:
        source: Dataset directory or URL prefix holding ``index.json`` and the shards; or a
            :class:`~streamload.streams.Stream`, or a list of streams (and URLs) to mix.
            Or tar shard files of one folder (a list, or ``"shards/{000..009}.tar"``), read in
            that order, indexed once into the cache directory (:mod:`streamload.shardlist`).
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
        epoch_size=1_000_000)`` reads both datasets (any formats and storages) as one epoch:
        each stream contributes an exact count per epoch (its weight, ``repeat`` or
        ``samples``), a different subset each epoch when asked for fewer samples than it
        has, interleaved sample by sample over the whole epoch. Every guarantee above holds
        for the mixture; each sample dict gets ``"__source__"`` (the stream's ``name``, else
        its index). :attr:`manifest` and :attr:`format` describe the first stream; see
        :attr:`streams` and ``docs/mixing.md``.

    Epochs:
        ``set_epoch(n)`` makes the next iteration epoch ``n`` (it reaches persistent
        workers through shared memory); each further iteration advances it by one. All
        readers of one iteration (every DataLoader worker of one ``iter(loader)``) agree
        on its epoch, counted once its first sample is asked for.

    Reproducibility:
        With ``shuffle=True`` and ``batch_size=b``, the samples of global step ``k`` depend
        only on the dataset, ``seed``, the epoch, the global batch ``b * world_size`` and
        ``partitions``, whatever the ranks and ``num_workers``. Every sample dict that
        ``transform`` or ``collate`` receives carries ``"__epoch__"`` and ``"__position__"``,
        the key of :func:`streamload.sample_generator`. See ``docs/reproducibility.md``.

    Stop and resume:
        ``state_dict()`` returns a small plain dict (JSON- and ``torch.save``-safe), the
        same on any number of ranks and workers; ``load_state_dict(state)`` makes the next
        iteration continue that epoch at the first unseen sample, exactly as the
        uninterrupted run on any world with the same global batch and ``partitions`` (on
        another, the unread rest, each sample once; a ``UserWarning`` says so). Use it
        through ``torchdata``'s ``StatefulDataLoader`` (same world), or with a plain
        ``DataLoader`` (any world) as ``ds.state_dict(samples_seen=step_in_epoch *
        global_batch)``. See ``docs/resume.md``.
    """

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
        config = config_from_arguments("StreamingDataset", storage, deprecated) or StorageConfig()
        args = dataset_args(locals())
        self.shuffle = args.shuffle
        self.seed = args.seed
        self.drop_last = args.drop_last
        self.pad = pad
        self.shuffle_window = args.shuffle_window
        self.batch_size = args.batch_size
        self.partitions = args.partitions
        self.transform = transform
        self.collate = collate
        self.rank = args.rank
        self.world_size = args.world_size
        self.on_error: OnError = on_error
        #: How the files are reached (``cache`` settled: ``"auto"`` unless given).
        self.storage: StorageConfig = config.with_cache("auto")
        given, source = open_shard_list(source, self.storage)  # tar shard files named one by one: indexed
        #: The datasets read and each one's samples per epoch (one for a plain URL).
        self.streams: Mixture = Mixture.open(source, epoch_size, self.storage)
        self.epoch_size = epoch_size
        self.source = self.streams.describe()  # the URL, or the streams' URLs and counts
        self._ref = self.streams.refs[0]
        warn_remote_only(given, self.storage.settings(), self._ref.data_url)
        self.manifest: Manifest = self._ref.manifest
        self.format: Format = self._ref.format
        #: The plan stage: each epoch's plan, and the state to resume from (resume goes through it).
        self.planner = Planner(self.streams, _split(args, pad))
        #: This process's iterations: their epochs and readers (shared memory: reaches every worker).
        self._iterations = Iterations(self.planner, self.source)
        #: (rank, world_size) of the process that pickled this dataset to a worker.
        self._inherited_world: tuple[int, int] | None = None
        self._storages: list[Storage] | None = None
        self._skips = SkipLog(self.source)
        #: This process's counts of samples skipped under ``on_error="skip"``, in all and per shard.
        self.errors: SkipCounts = self._skips.errors
        #: The readers' stage seconds, set by :func:`streamload.watch` before the readers start (else ``None``).
        self.stage_table: StageTable | None = None

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
        self._iterations.epochs.set_epoch(check_epoch(epoch))

    @property
    def epoch(self) -> int:
        """The epoch of this process's current or last iteration, else the last one claimed, else the next."""
        return self._iterations.epoch()

    def plan(self, epoch: int, world_size: int) -> EpochPlan:
        """Return the :class:`EpochPlan` this dataset follows for ``epoch`` in a world of ``world_size``.

        An epoch resumed from a state whose partitions were one per rank (unshuffled, or
        without a batch size) keeps the saving world's partitions, so its remaining global
        batches are those of the uninterrupted run on any world. One resumed with another
        global batch (or other canonical partitions) reads the rest of the epoch
        (:class:`~streamload.plan.Remainder`): every unread sample once, in the new
        world's global batches.
        """
        return self.planner.plan(epoch, world_size)

    @property
    def manifest_digest(self) -> str:
        """A short digest of the shards read (in :meth:`state_dict`: a state of another dataset is refused)."""
        return self.streams.digest

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
        plan = self.plan(self.epoch, world.world_size)
        seen = self.planner.epoch_state(
            world, plan, self._iterations.progress, samples_seen, self._iterations.claimed()
        )
        return seen.normalized().to_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict`` (from :meth:`state_dict`) at the next iteration.

        Sets the epoch to the saved one (the next one if it had finished); the iteration
        of that epoch starts at the first unseen sample. Call it before iterating. The
        world that continues must have the saved global batch and partition count
        (checked when it iterates, where the world is known).

        Raises:
            PlanError: If the state is malformed or belongs to a differently configured dataset.
        """
        self.planner.reset(state_dict)  # the plan node takes the state, checked
        self._iterations.progress = None
        # Every reader of the next iteration (this process, or each worker restored by
        # StatefulDataLoader before it iterates) gets the saved epoch.
        assert self.planner.resume is not None
        self.set_epoch(self.planner.resume.epoch)

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        world = detect_world(self.rank, self.world_size, self._inherited_world)
        return _reader(self._iterations, world, self._pipeline)

    def thread_readers(self, threads: int, keeps: Sequence[ReaderKeep] | None = None) -> ThreadReaders:
        """Start an iteration of this rank read by ``threads`` threads of this process (see :class:`ThreadReaders`).

        ``keeps``: a :class:`~streamload.streams.ReaderKeep` a thread (its open shards kept between epochs).

        Raises:
            ConfigError: If a DataLoader iterates this dataset now.
        """
        world = detect_rank_world(self.rank, self.world_size, self._inherited_world)
        return _thread_readers(self._iterations, *world, threads, self._pipeline, self._get_storages, keeps)

    def loaded_state(self) -> dict[str, Any] | None:
        """The state :meth:`load_state_dict` loaded, until an iteration starts; else ``None``."""
        return self.planner.state() if self._iterations.progress is None else None

    def _pipeline(self, plan: EpochPlan, world: World, progress: Position) -> Pipeline:
        """The stages of one reader's iteration (opened when its first item is asked for)."""
        budget, plain = self.storage.stream_buffer or DEFAULT_STREAM_BUFFER, self.streams.plain
        steps = Steps(self.transform, self.collate, self.on_error, self._skips, budget, plain, self.stage_table)
        return Pipeline(steps, self.streams, self._get_storages(), plan, world, progress)

    @property
    def skipped_samples(self) -> int:
        """Samples skipped under ``on_error="skip"`` by this process and its DataLoader workers.

        Counted in shared memory, so the training loop sees its workers' skips; all-reduce
        it over ranks for the job's total.
        """
        return self._skips.total()

    # -- per-process resources -----------------------------------------------------

    def _get_storages(self) -> list[Storage]:
        """This process's storage of each stream (opened on first use)."""
        self._storages = self._storages or self.streams.open_storages()
        return self._storages

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_storages"] = None  # opened again lazily in the receiving process
        # A worker started with spawn has no torch.distributed: hand it this process's world.
        state["_inherited_world"] = distributed_world() or self._inherited_world
        return state

    def __repr__(self) -> str:
        return f"StreamingDataset({self.streams.summary()}, shuffle={self.shuffle})"


def _split(args: DatasetArgs, pad: bool) -> Split:
    """The order settings of a dataset's checked arguments (``epoch`` left 0: set per plan)."""
    return Split(
        seed=args.seed,
        shuffle=args.shuffle,
        drop_last=args.drop_last,
        window=args.shuffle_window,
        batch_size=args.batch_size,
        partitions=args.partitions,
        pad=pad,
    )


#: One reader's stages over a plan (:meth:`StreamingDataset._pipeline`).
_Stages = Callable[[EpochPlan, World, Position], Iterable[Any]]


def _reader(iterations: Iterations, world: World, stages: _Stages) -> Iterator[Any]:
    """One reader's iteration (the dataset's ``__iter__``): planned now, its epoch claimed with its first sample."""
    try:
        key, plan, progress = iterations.prepare(world)
    except PlanError as exc:
        if world.num_workers == 1:
            raise
        # In a DataLoader worker, raise with the first sample: the loader then hands the error to
        # the main process at once (raised here, it kills the worker and is seen only after a timeout).
        return _refused(exc)
    iterator = _read(iterations, world, key, plan, progress, stages)
    close_at_exit(iterator)  # closed before the interpreter's teardown if still alive then
    return iterator


def _read(
    iterations: Iterations, world: World, key: int, plan: EpochPlan, progress: Position, stages: _Stages
) -> Generator[Any, None, None]:
    with iterations.running(world, key, plan, progress) as (plan, progress):
        yield from stages(plan, world, progress)


def _thread_readers(
    iterations: Iterations,
    rank: int,
    world_size: int,
    threads: int,
    stages: _Stages,
    open_storages: Callable[[], object],
    keeps: Sequence[ReaderKeep] | None = None,
) -> ThreadReaders:
    """:meth:`StreamingDataset.thread_readers`: a thread iteration registered, its readers planned.

    The storages are opened once (not by the readers at once), then the epoch claimed
    and a reader planned per thread; the iteration is unregistered if anything fails.
    """
    slot = iterations.enter_threads()
    try:
        open_storages()
        plan, starts = iterations.plan_threads(rank, world_size, threads)
        pipes = [stages(plan, world, position) for world, position in starts]
        for pipe, keep in zip(pipes, keeps or (), strict=False):
            if isinstance(pipe, Pipeline):
                pipe.keep = keep
        readers = [iter(pipe) for pipe in pipes]
    except BaseException:
        iterations.leave(slot)
        raise
    progress = iterations.progress
    assert progress is not None
    return ThreadReaders(plan, progress, readers, World(rank, world_size, 0, 1), iterations, slot)


def _refused(exc: PlanError) -> Iterator[Any]:
    """An iterator that raises ``exc`` when asked for its first item."""
    raise exc
    yield  # a generator
