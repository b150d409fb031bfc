"""The split planner: which samples each (rank, worker) reads in an epoch, and in which order.

Pure functions of the manifest's per-shard sample counts and a small description of the
epoch and the world; nothing here reads a shard or launches a process.

The epoch, step by step (N samples, R ranks, W workers per rank)::

    shards            s0 s1 s2 s3 ...                 (manifest order)
    shard order       s2 s0 s3 s1 ...                 (permuted when shuffling; seed, epoch)
    epoch sequence    positions 0..N-1 over the shards in that order
    padded sequence   positions 0..P*R-1, position p reads sample (p mod N)
                      P = ceil(N/R), or floor(N/R) with drop_last (the per-rank count)
    rank r            the contiguous block [r*P, (r+1)*P) of the padded sequence
    rank order        identity, or when shuffling a permutation inside each window of
                      `window` consecutive items of the block (seed, epoch, rank, window)
    worker w          items of the rank order cut into chunks of `chunk` items; chunk c
                      goes to worker c mod W (so with chunk = the DataLoader's batch size,
                      the rank's batches come out of the workers in rank order)

Every sample of the epoch sequence lies in exactly one rank block (exactly once), every
rank gets P items (equal per rank), padding repeats the first P*R-N positions of the
epoch sequence (the fewest repeats possible), and the split is at sample granularity so a
single shard is shared by any number of ranks and workers. Without shuffling, a worker's
items are contiguous runs of the epoch sequence, so reads stay sequential.

Cost per worker: O(number of shards) to set up, then O(chunk) or O(window) memory while
iterating; nothing is O(N).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import PlanError
from .world import World

__all__ = ["EpochPlan", "Run", "Split", "samples_per_rank"]

#: Largest number of items materialised at once while iterating a worker's plan.
_SLICE = 1 << 16


@dataclass(frozen=True)
class Split:
    """How an epoch is ordered and split.

    Attributes:
        epoch: Epoch number (changes the shuffle).
        seed: Shuffle seed.
        shuffle: Permute shard order and shuffle samples within windows.
        drop_last: Drop the tail so each rank gets ``floor(N / world_size)`` samples,
            instead of padding to ``ceil(N / world_size)`` by repeating samples.
        window: Shuffle window in samples; ``None`` picks four times the largest shard
            (always wider than one shard).
        chunk: Items of a rank's order handed to a worker at a time; ``None`` gives each
            worker one contiguous block. Set it to the DataLoader batch size so batches
            leave the workers in the rank's order (needed for exact resume).
    """

    epoch: int = 0
    seed: int = 0
    shuffle: bool = False
    drop_last: bool = False
    window: int | None = None
    chunk: int | None = None

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise PlanError(f"epoch={self.epoch} must be >= 0")
        if self.window is not None and self.window < 1:
            raise PlanError(f"window={self.window} must be >= 1")
        if self.chunk is not None and self.chunk < 1:
            raise PlanError(f"chunk={self.chunk} must be >= 1")


@dataclass(frozen=True)
class Run:
    """Samples a worker reads in one go: ``locals`` of shard ``shard``, in this order.

    ``positions`` are the matching rank-order item indices (for progress and resume).
    """

    shard: int
    locals: np.ndarray
    positions: np.ndarray

    @property
    def contiguous(self) -> bool:
        """True if ``locals`` is an ascending run of consecutive indices."""
        n = len(self.locals)
        return n > 0 and int(self.locals[-1]) - int(self.locals[0]) == n - 1 and (
            n < 3 or bool(np.all(np.diff(self.locals) == 1))
        )


def samples_per_rank(total: int, world_size: int, drop_last: bool) -> int:
    """Return the number of samples every rank yields per epoch."""
    if world_size < 1:
        raise PlanError(f"world_size={world_size} must be >= 1")
    return total // world_size if drop_last else -(-total // world_size)


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([w & 0xFFFFFFFFFFFFFFFF for w in words]))


class EpochPlan:
    """The order and split of one epoch for a whole world (see the module docstring)."""

    def __init__(self, shard_counts: Sequence[int], world_size: int, split: Split) -> None:
        counts = np.asarray(shard_counts, dtype=np.int64)
        if counts.ndim != 1 or (counts < 0).any():
            raise PlanError("shard_counts must be a list of non-negative integers")
        self.split = split
        self.world_size = world_size
        self.total = int(counts.sum())
        self.per_rank = samples_per_rank(self.total, world_size, split.drop_last)
        if split.shuffle:
            self.shard_order = _rng(split.seed, split.epoch, 0x5A4D).permutation(len(counts))
        else:
            self.shard_order = np.arange(len(counts))
        ordered = counts[self.shard_order]
        self._cum = np.concatenate([[0], np.cumsum(ordered)])
        biggest = int(counts.max()) if len(counts) else 1
        self.window = split.window or max(4 * biggest, 1)

    # -- positions -----------------------------------------------------------------

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map padded-sequence positions to ``(shard index, index within shard)`` arrays."""
        if self.total == 0:
            raise PlanError("cannot locate samples of an empty dataset")
        p = positions % self.total
        j = np.searchsorted(self._cum, p, side="right") - 1
        return self.shard_order[j], p - self._cum[j]

    def rank_positions(self, rank: int, begin: int, end: int) -> np.ndarray:
        """Padded-sequence positions of rank ``rank``'s items ``begin..end-1`` (rank order)."""
        if not 0 <= begin <= end <= self.per_rank:
            raise PlanError(f"items [{begin}, {end}) outside rank block of {self.per_rank}")
        base = rank * self.per_rank
        if not self.split.shuffle:
            return base + np.arange(begin, end, dtype=np.int64)
        out = np.empty(end - begin, dtype=np.int64)
        filled = 0
        while begin + filled < end:
            item = begin + filled
            w = item // self.window
            w_start = w * self.window
            w_len = min(self.window, self.per_rank - w_start)
            perm = self._window_perm(rank, w, w_len)
            take = min(end - item, w_start + w_len - item)
            out[filled : filled + take] = base + w_start + perm[item - w_start : item - w_start + take]
            filled += take
        return out

    def _window_perm(self, rank: int, window: int, length: int) -> np.ndarray:
        cached = getattr(self, "_perm_cache", None)
        if cached is not None and cached[0] == (rank, window):
            return cached[1]  # type: ignore[no-any-return]
        perm = _rng(self.split.seed, self.split.epoch, rank, window, 0x57494E).permutation(length)
        self._perm_cache = ((rank, window), perm)
        return perm

    # -- the worker's view ---------------------------------------------------------

    def chunk_size(self, num_workers: int) -> int:
        """Items per chunk handed to a worker."""
        if self.split.chunk is not None:
            return self.split.chunk
        return max(1, math.ceil(self.per_rank / num_workers))

    def worker_items(self, world: World, start: int = 0) -> Iterator[tuple[int, int]]:
        """Yield the ``[begin, end)`` rank-order item ranges of ``world``'s worker, in order.

        Items before ``start`` (already consumed by the rank) are left out.
        """
        chunk = self.chunk_size(world.num_workers)
        first = world.worker
        c = first + max(0, (start // chunk - first + world.num_workers - 1) // world.num_workers) * world.num_workers
        while c * chunk < self.per_rank:
            begin, end = c * chunk, min((c + 1) * chunk, self.per_rank)
            begin = max(begin, start)
            if begin < end:
                yield begin, end
            c += world.num_workers

    def worker_len(self, world: World, start: int = 0) -> int:
        """Number of items ``world``'s worker yields from rank item ``start`` on."""
        return sum(end - begin for begin, end in self.worker_items(world, start))

    def runs(self, world: World, start: int = 0) -> Iterator[Run]:
        """Yield the worker's reads as runs within one shard, in reading order."""
        for begin, end in self.worker_items(world, start):
            for lo in range(begin, end, _SLICE):
                hi = min(lo + _SLICE, end)
                positions = self.rank_positions(world.rank, lo, hi)
                shards, locals_ = self.locate(positions)
                cuts = np.flatnonzero(np.diff(shards)) + 1
                bounds = [0, *cuts.tolist(), len(shards)]
                items = np.arange(lo, hi, dtype=np.int64)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                    yield Run(int(shards[a]), locals_[a:b], items[a:b])

    def worker_shards(self, world: World, start: int = 0) -> Iterator[int]:
        """Yield the shards the worker will open, in order of use (consecutive repeats merged)."""
        last = -1
        for run in self.runs(world, start):
            if run.shard != last:
                yield run.shard
                last = run.shard
