"""``StreamingDataset``: the four axes composed into a lazy ``IterableDataset``.

Construction reads only the manifest (a few KB per thousand shards). Nothing that holds
a file, a thread or a connection is created before iteration, and none of it is pickled:
each DataLoader worker opens the shards it needs itself, after fork or spawn.

One epoch in one worker, as a stream::

    detect world (rank, world_size, worker, num_workers)      -- at iteration time
    EpochPlan(shard_counts, world, Split(epoch, seed, ...))   -- pure, O(shards)
    runs: (shard, [local indices])                             -- plan.runs(world)
      -> storage.acquire(shard) -> local path                  -- cache/read-ahead if remote
      -> format reader .iter_range / .get -> sample dicts      -- {"__key__", field: bytes}
      -> transform(sample)                                     -- optional, e.g. decode
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch.utils.data import IterableDataset

from ._errors import ConfigError, SampleError, ShardError, StreamloadError
from .formats import Format, Sample, ShardReader, get_format
from .manifest import MANIFEST_NAME, Manifest, ShardEntry
from .plan import EpochPlan, Run, Split, World, detect_rank_world, detect_world, samples_per_rank
from .storage import Storage, open_storage

__all__ = ["StreamingDataset"]

log = logging.getLogger("streamload")

#: Slots of the shared epoch counter: [base epoch, iterations started by worker 0, 1, ...].
_MAX_WORKERS = 1024
#: Shard readers a worker keeps open at once (a shuffle window spans a few shards).
_OPEN_READERS = 8

OnError = Literal["raise", "skip"]


class StreamingDataset(IterableDataset[Any]):
    """An iterable dataset over sharded samples in a local directory or fsspec URL.

    Every sample is read exactly once per epoch over all ranks and DataLoader workers;
    every rank yields ``len(dataset)`` samples (padding by repeating the fewest samples,
    or dropping the tail with ``drop_last=True``), so DDP never waits on an uneven epoch.

    Args:
        source: Dataset directory or URL prefix holding ``index.json`` and the shards.
        shuffle: Shuffle shard order and samples within a window each epoch.
        seed: Seed of the shuffle; the same (seed, epoch, world) gives the same order.
        drop_last: Drop the tail instead of padding so ranks get ``floor(N / world)``.
        shuffle_window: Shuffle window in samples (default: four times the largest shard).
        batch_size: The DataLoader's batch size, if any. Workers then take batch-sized
            chunks in turn, so batches leave the DataLoader in the planned order.
        transform: Function applied to each sample dict in the worker (e.g. a decoder from
            :mod:`streamload.decode`).
        rank: Override the detected rank (default: torch.distributed, then ``RANK``).
        world_size: Override the detected world size.
        storage_options: Passed to fsspec for remote URLs (credentials, endpoint...).
        cache_dir: Local cache directory for remote shards.
        cache_limit: Cache size bound, bytes or a string like ``"20GB"``.
        on_error: ``"raise"`` (default) or ``"skip"`` samples that fail to read or
            transform; skips are counted in :attr:`errors` and logged once per shard.

    Example:
        >>> ds = StreamingDataset("/data/imagenet-shards", shuffle=True, seed=1)  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=256, num_workers=8)  # doctest: +SKIP
    """

    def __init__(
        self,
        source: str,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        shuffle_window: int | None = None,
        batch_size: int | None = None,
        transform: Callable[[Sample], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        on_error: OnError = "raise",
    ) -> None:
        super().__init__()
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={on_error!r} must be 'raise' or 'skip'")
        self.source = str(source)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle_window = shuffle_window
        self.batch_size = batch_size
        self.transform = transform
        self.rank = rank
        self.world_size = world_size
        self.on_error: OnError = on_error
        self.storage_options = dict(storage_options or {})
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        Split(seed=seed, window=shuffle_window, chunk=batch_size)  # validate early
        storage = self._open_storage()
        try:
            self.manifest = Manifest.loads(storage.read_bytes(MANIFEST_NAME), where=f"{self.source}/{MANIFEST_NAME}")
        finally:
            storage.close()
        self.format: Format = get_format(self.manifest.format)
        # Shared across fork/spawn so set_epoch() reaches persistent workers.
        self._epochs = torch.zeros(1 + _MAX_WORKERS, dtype=torch.int64).share_memory_()
        self._storage: Storage | None = None
        #: Per-process counts of skipped samples/shards under ``on_error="skip"``.
        self.errors: dict[str, int] = {"samples_skipped": 0}

    # -- sizes and epochs ----------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (all ranks)."""
        return self.manifest.num_samples

    def __len__(self) -> int:
        """Samples this rank yields per epoch (the world is detected now)."""
        _, world_size = detect_rank_world(self.rank, self.world_size)
        return samples_per_rank(self.num_samples, world_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``; later ones advance from it by one.

        Works with ``persistent_workers=True``: the counter lives in shared memory.
        """
        if epoch < 0:
            raise ConfigError(f"epoch={epoch} must be >= 0")
        self._epochs[0] = epoch
        self._epochs[1:] = 0

    def _next_epoch(self, worker: int) -> int:
        if worker >= _MAX_WORKERS:
            raise ConfigError(f"num_workers must be < {_MAX_WORKERS}")
        slot = 1 + worker
        epoch = int(self._epochs[0]) + int(self._epochs[slot])
        self._epochs[slot] += 1
        return epoch

    def plan(self, epoch: int, world_size: int) -> EpochPlan:
        """Return the :class:`EpochPlan` this dataset follows for ``epoch`` in a world of ``world_size``."""
        split = Split(
            epoch=epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            window=self.shuffle_window,
            chunk=self.batch_size,
        )
        return EpochPlan(self.manifest.shard_counts, world_size, split)

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        world = detect_world(self.rank, self.world_size)
        epoch = self._next_epoch(world.worker)
        return self._iter_plan(self.plan(epoch, world.world_size), world)

    def _iter_plan(self, plan: EpochPlan, world: World, start: int = 0) -> Iterator[Any]:
        storage = self._get_storage()
        readers = _ReaderCache(self, storage)
        ahead = plan.worker_shards(world, start)
        try:
            for run in plan.runs(world, start):
                if storage.prefetches and run.shard not in readers:
                    storage.prefetch(self.manifest.shards[s] for s in _take_after(ahead, run.shard, 4))
                for sample in self._read_run(readers, run):
                    yield sample
        finally:
            readers.close()

    def _read_run(self, readers: _ReaderCache, run: Run) -> Iterator[Any]:
        entry = self.manifest.shards[run.shard]
        try:
            reader = readers.get(run.shard)
        except ShardError as exc:
            if self.on_error == "raise":
                raise
            self._skip(entry, None, exc, count=len(run.locals))
            return
        if run.contiguous:
            samples: Iterator[Sample] = reader.iter_range(int(run.locals[0]), int(run.locals[-1]) + 1)
        else:
            samples = (reader.get(int(i)) for i in run.locals)
        transform = self.transform
        for sample in samples:
            if transform is None:
                yield sample
                continue
            try:
                yield transform(sample)
            except Exception as exc:  # noqa: BLE001 - re-raised with context or counted
                if self.on_error == "raise":
                    if isinstance(exc, StreamloadError):
                        raise
                    raise SampleError(
                        f"{self.source}/{entry.name}: sample {sample.get('__key__')!r}: transform failed: {exc}"
                    ) from exc
                self._skip(entry, sample.get("__key__"), exc)

    def _skip(self, entry: ShardEntry, key: str | None, exc: BaseException, count: int = 1) -> None:
        self.errors["samples_skipped"] += count
        logged = self.errors.setdefault(f"shard:{entry.name}", 0)
        self.errors[f"shard:{entry.name}"] = logged + count
        if not logged:
            log.warning("skipping %d sample(s) of %s (first key %r): %s", count, entry.name, key, exc)

    # -- per-process resources -----------------------------------------------------

    def _open_storage(self) -> Storage:
        return open_storage(self.source, self.storage_options, self.cache_dir, self.cache_limit)

    def _get_storage(self) -> Storage:
        if self._storage is None:
            self._storage = self._open_storage()
        return self._storage

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_storage"] = None  # opened again lazily in the receiving process
        return state

    def __repr__(self) -> str:
        return (
            f"StreamingDataset({self.source!r}, format={self.manifest.format!r}, "
            f"samples={self.num_samples}, shards={len(self.manifest.shards)}, shuffle={self.shuffle})"
        )


def _take_after(ahead: Iterator[int], current: int, count: int) -> list[int]:
    """Advance ``ahead`` past ``current`` and return up to ``count`` following shards."""
    out: list[int] = []
    for shard in ahead:
        if shard == current:
            break
    for shard in ahead:
        out.append(shard)
        if len(out) == count:
            break
    return out


class _ReaderCache:
    """The shard readers one worker has open, least recently used closed first."""

    def __init__(self, dataset: StreamingDataset, storage: Storage) -> None:
        self._dataset = dataset
        self._storage = storage
        self._open: OrderedDict[int, ShardReader] = OrderedDict()

    def __contains__(self, shard: int) -> bool:
        return shard in self._open

    def get(self, shard: int) -> ShardReader:
        reader = self._open.get(shard)
        if reader is not None:
            self._open.move_to_end(shard)
            return reader
        entry = self._dataset.manifest.shards[shard]
        path = self._storage.acquire(entry)
        sidecar = self._storage.acquire(entry.sidecar) if entry.sidecar else None
        try:
            reader = self._dataset.format.reader(path, entry, sidecar)
        except BaseException:
            self._release(entry)
            raise
        self._open[shard] = reader
        while len(self._open) > _OPEN_READERS:
            old_shard, old = self._open.popitem(last=False)
            old.close()
            self._release(self._dataset.manifest.shards[old_shard])
        return reader

    def _release(self, entry: ShardEntry) -> None:
        self._storage.release(entry)
        if entry.sidecar:
            self._storage.release(entry.sidecar)

    def close(self) -> None:
        while self._open:
            shard, reader = self._open.popitem()
            reader.close()
            self._release(self._dataset.manifest.shards[shard])
