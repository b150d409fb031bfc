"""The split planner: which samples each (rank, worker) reads in an epoch, and in which order.

Pure functions of the manifest's per-shard sample counts and a small description of the
epoch and the world; nothing here reads a shard or launches a process.

The epoch, step by step (N samples, R ranks, W workers per rank)::

    shards            s0 s1 s2 s3 ...                 (manifest order)
    shard order       s2 s0 s3 s1 ...                 (permuted when shuffling; seed, epoch)
    epoch sequence    positions 0..N-1 over the shards in that order
    padded sequence   items 0..P*R-1, item q reads epoch position (q mod N)
                      P = ceil(N/R), or floor(N/R) with drop_last (the per-rank count)
    rank r            the contiguous block [r*P, (r+1)*P) of the padded sequence
    rank order        identity, or when shuffling a permutation inside each window of
                      `window` consecutive items of the block (seed, epoch, rank, window)
    worker w          items of the rank order cut into chunks of `chunk` items; chunk c
                      goes to worker c mod W (so with chunk = the DataLoader's batch size,
                      the rank's batches come out of the workers in rank order; an
                      iteration resumed at chunk f deals from there: (c - f) mod W)

The epoch sequence comes from a :class:`Layout`: by default :class:`ShardLayout` (the
shards above, concatenated); a mixture of datasets, or one dataset with an epoch size,
uses :class:`~streamload.plan.mixture.MixLayout` (exact per-stream counts, interleaved).
Everything below works on positions ``0..N-1`` and applies to any layout.

Every sample of the epoch sequence lies in exactly one rank block (exactly once), every
rank gets P items (equal per rank), padding repeats the first P*R-N positions of the
epoch sequence (the fewest repeats possible: no sample is repeated twice before every
sample is repeated once), and the split is at sample granularity so a single shard is
shared by any number of ranks and workers. Without shuffling, a worker's items are
contiguous runs of the epoch sequence, so reads stay sequential.

**The shuffle window.** With ``shuffle=True`` the shard order changes every epoch and,
inside each rank's block, items are permuted within consecutive windows of ``window``
items. The default window (:func:`default_window`) is four times the largest shard,
raised towards 4096 items for small shards (but to no more than 32 average shards, the
files a worker then keeps open) and capped at 2**20 items (8 MB of permutation), so a
batch mixes samples of four or more shards while a worker keeps only the shards of one
window open. Samples never move between windows, so the
order is "locally uniform": two samples more than one window apart keep their order.

**Resumed epochs (stages).** An epoch interrupted after ``G`` samples (global count, all
ranks; each rank had consumed ``G / R`` items of its rank order) and continued on a world
of ``R'`` ranks is planned as a second *stage*: the unread suffixes of the old rank
orders, concatenated in rank order, form a sequence of ``M = R * (P - G/R)`` items that is
split into ``R'`` contiguous blocks of ``ceil(M / R')`` items, padded like the first stage
(resumed stages always pad, never drop, so no unseen sample is lost). Stages chain, so an
epoch can be interrupted and resumed on a new world any number of times; a stage costs
O(1) memory and nothing is O(N). With the same world no stage is added: the rank orders
simply continue, which reproduces the uninterrupted order exactly.

Cost per worker: O(number of shards) to set up, then O(chunk) or O(window) memory while
iterating; nothing is O(N).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .._errors import PlanError
from .world import World

__all__ = [
    "DEFAULT_WINDOW_RANGE",
    "EpochPlan",
    "Layout",
    "Run",
    "ShardLayout",
    "Split",
    "Stage",
    "default_window",
    "samples_per_rank",
]

#: Largest number of items materialised at once while iterating a worker's plan.
_SLICE = 1 << 16
#: Bounds of the default shuffle window, in items.
DEFAULT_WINDOW_RANGE = (4096, 1 << 20)
#: Most average-sized shards the raised minimum window may span (shards open per worker).
_MAX_WINDOW_SHARDS = 32
#: Window permutations kept per stage (a worker's chunks touch one or two windows at a time).
_PERM_CACHE = 4


@dataclass(frozen=True)
class Split:
    """How an epoch is ordered and split.

    Attributes:
        epoch: Epoch number (changes the shuffle).
        seed: Shuffle seed.
        shuffle: Permute shard order and shuffle samples within windows.
        drop_last: Drop the tail so each rank gets ``floor(N / world_size)`` samples,
            instead of padding to ``ceil(N / world_size)`` by repeating samples.
        window: Shuffle window in items; ``None`` picks :func:`default_window`.
        chunk: Items of a rank's order handed to a worker at a time; ``None`` gives each
            worker one contiguous block. Set it to the DataLoader batch size so batches
            leave the workers in the rank's order (needed to resume from a sample count).
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
class Stage:
    """An earlier world of an interrupted epoch.

    Attributes:
        world_size: Ranks that read this stage.
        samples_seen: Global samples of the epoch consumed when the stage stopped (all
            stages so far, all ranks); a multiple of ``world_size`` past the stage start.
    """

    world_size: int
    samples_seen: int


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
        return (
            n > 0
            and int(self.locals[-1]) - int(self.locals[0]) == n - 1
            and (n < 3 or bool(np.all(np.diff(self.locals) == 1)))
        )


def samples_per_rank(total: int, world_size: int, drop_last: bool) -> int:
    """Return the number of samples every rank yields per epoch."""
    if world_size < 1:
        raise PlanError(f"{world_size=} must be >= 1")
    return total // world_size if drop_last else -(-total // world_size)


def default_window(shard_counts: Sequence[int]) -> int:
    """Return the default shuffle window in items.

    Four times the largest shard; for small shards at least ``DEFAULT_WINDOW_RANGE[0]``
    items or 32 average shards, whichever is smaller; at most ``DEFAULT_WINDOW_RANGE[1]``.
    """
    counts = [int(c) for c in shard_counts]
    biggest = max(counts, default=0)
    mean = sum(counts) / len(counts) if counts else 0.0
    low, high = DEFAULT_WINDOW_RANGE
    raised = min(low, math.ceil(_MAX_WINDOW_SHARDS * mean))
    return max(1, min(max(4 * biggest, raised), high))


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([w & 0xFFFFFFFFFFFFFFFF for w in words]))


class Layout(Protocol):
    """The epoch sequence: which sample sits at each of its ``total`` positions.

    :class:`ShardLayout` (one dataset's shards, concatenated) is the default; a mixture of
    datasets uses :class:`~streamload.plan.mixture.MixLayout`. The rank blocks, windows,
    chunks and stages of :class:`EpochPlan` are built on top of any layout.
    """

    @property
    def total(self) -> int:
        """Positions in the epoch sequence."""

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map epoch-sequence positions to ``(shard index, index within shard)`` arrays."""


class ShardLayout:
    """One dataset's epoch sequence: its shards in (shuffled) order, concatenated.

    Args:
        shard_counts: Samples per shard, in manifest order.
        split: Epoch, seed and shuffle (the shard order is permuted when shuffling).
    """

    def __init__(self, shard_counts: Sequence[int] | np.ndarray, split: Split) -> None:
        counts = np.asarray(shard_counts, dtype=np.int64).reshape(-1)
        if (counts < 0).any():
            raise PlanError(f"shard_counts must be non-negative, got min {int(counts.min())}")
        if split.shuffle:
            self.shard_order = _rng(split.seed, split.epoch, 0x5A4D).permutation(len(counts))
        else:
            self.shard_order = np.arange(len(counts))
        self._cum = np.concatenate([[0], np.cumsum(counts[self.shard_order])])
        self._total = int(counts.sum())

    @property
    def total(self) -> int:
        """Samples of all shards."""
        return self._total

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map epoch-sequence positions to ``(shard index, index within shard)`` arrays."""
        j = np.searchsorted(self._cum, positions, side="right") - 1
        return self.shard_order[j], positions - self._cum[j]


class _RankSplit:
    """One world's split of a parent sequence of ``parent_len`` items into rank orders."""

    def __init__(
        self,
        parent_len: int,
        world_size: int,
        per_rank: int,
        window: int | None,
        seed_words: tuple[int, ...],
        consumed_below: int = 0,
    ) -> None:
        self.parent_len = parent_len
        #: Items per rank of the stage below consumed before this stage began; the parent
        #: sequence is the concatenation of the stage below's rank orders from there on.
        self.consumed_below = consumed_below
        self.world_size = world_size
        self.per_rank = per_rank
        self.window = window  # None: no shuffle
        self.seed_words = seed_words
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def to_parent(self, ranks: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Map rank-order ``items`` of ``ranks`` to indices of the parent sequence."""
        inner = items if self.window is None else self._permute(ranks, items)
        idx: np.ndarray = ranks * self.per_rank + inner
        if self.parent_len and self.world_size * self.per_rank > self.parent_len:
            idx %= self.parent_len  # padding wraps to the start of the parent sequence
        return idx

    def _permute(self, ranks: np.ndarray, items: np.ndarray) -> np.ndarray:
        assert self.window is not None
        if len(items) == 0:
            return items
        size = self.window
        windows = items // size
        keys = ranks * (self.per_rank // size + 1) + windows
        out = np.empty_like(items)
        first, last = int(keys[0]), int(keys[-1])
        groups = [first] if first == last and (len(keys) < 3 or bool(np.all(keys == first))) else np.unique(keys)
        for key in groups:
            mask = slice(None) if len(groups) == 1 else keys == key
            rank, w = int(ranks[mask][0]), int(windows[mask][0])
            perm = self._perm(rank, w)
            out[mask] = w * size + perm[items[mask] - w * size]
        return out

    def _perm(self, rank: int, window: int) -> np.ndarray:
        key = (rank, window)
        perm = self._perms.get(key)
        if perm is None:
            assert self.window is not None
            length = min(self.window, self.per_rank - window * self.window)
            perm = _rng(*self.seed_words, rank, window, 0x57494E).permutation(length)
            self._perms[key] = perm
            while len(self._perms) > _PERM_CACHE:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return perm


class EpochPlan:
    """The order and split of one epoch for a whole world (see the module docstring).

    Args:
        shard_counts: Samples per shard, in manifest order (with a ``layout``: the shards
            the layout reads, which set the default window).
        world_size: Ranks reading the epoch now.
        split: Epoch, seed, shuffle, drop_last, window and chunk.
        stages: Earlier worlds of this epoch when it was interrupted and resumed on a
            different number of ranks (oldest first); empty for a fresh epoch.
        layout: The epoch sequence (default: :class:`ShardLayout` of ``shard_counts``),
            e.g. a :class:`~streamload.plan.mixture.MixLayout` of several datasets.
    """

    def __init__(
        self,
        shard_counts: Sequence[int],
        world_size: int,
        split: Split,
        stages: Sequence[Stage] = (),
        layout: Layout | None = None,
    ) -> None:
        counts = np.asarray(shard_counts, dtype=np.int64).reshape(-1)
        if (counts < 0).any():
            raise PlanError(f"shard_counts must be non-negative, got min {int(counts.min())}")
        self.split = split
        self.world_size = world_size
        self.layout: Layout = ShardLayout(counts, split) if layout is None else layout
        self.total = self.layout.total
        self.stages = tuple(stages)
        self.window = split.window or default_window(counts.tolist())
        self._levels = self._build_levels()
        top = self._levels[-1]
        #: Items every rank yields in this (stage of the) epoch.
        self.per_rank = top.per_rank

    def _build_levels(self) -> list[_RankSplit]:
        split = self.split
        worlds = [s.world_size for s in self.stages] + [self.world_size]
        first = worlds[0]
        window = self.window if split.shuffle else None
        levels = [
            _RankSplit(
                self.total,
                first,
                samples_per_rank(self.total, first, split.drop_last),
                window,
                (split.seed, split.epoch),
            )
        ]
        previous_seen = 0
        for stage, world_size in zip(self.stages, worlds[1:], strict=True):
            prev = levels[-1]
            done, rest = self._stage_progress(prev, stage, previous_seen)
            remaining = prev.world_size * rest
            per_rank = samples_per_rank(remaining, world_size, False)
            levels.append(_RankSplit(remaining, world_size, per_rank, None, (), consumed_below=done))
            previous_seen = stage.samples_seen
        return levels

    @staticmethod
    def _stage_progress(prev: _RankSplit, stage: Stage, previous_seen: int) -> tuple[int, int]:
        seen = stage.samples_seen - previous_seen
        if seen < 0 or seen % prev.world_size:
            raise PlanError(
                f"stage samples_seen={stage.samples_seen} minus the earlier {previous_seen} must be a "
                f"non-negative multiple of its world_size={prev.world_size}"
            )
        done = seen // prev.world_size
        if done > prev.per_rank:
            raise PlanError(
                f"stage samples_seen={stage.samples_seen} is past the end of its stage "
                f"({previous_seen + prev.world_size * prev.per_rank})"
            )
        return done, prev.per_rank - done

    # -- positions -----------------------------------------------------------------

    @property
    def stage_total(self) -> int:
        """Items of all ranks in this stage: ``per_rank * world_size``."""
        return self.per_rank * self.world_size

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map epoch-sequence positions to ``(shard index, index within shard)`` arrays."""
        if self.total == 0:
            raise PlanError("cannot locate samples of an empty dataset")
        return self.layout.locate(positions)

    def rank_positions(self, rank: int, begin: int, end: int) -> np.ndarray:
        """Epoch-sequence positions of rank ``rank``'s items ``begin..end-1`` (rank order)."""
        if not 0 <= begin <= end <= self.per_rank:
            raise PlanError(f"items [{begin}, {end}) outside the rank block of per_rank={self.per_rank}")
        if not 0 <= rank < self.world_size:
            raise PlanError(f"{rank=} outside world_size={self.world_size}")
        items = np.arange(begin, end, dtype=np.int64)
        ranks = np.full_like(items, rank)
        for k in range(len(self._levels) - 1, 0, -1):
            level, below = self._levels[k], self._levels[k - 1]
            idx = level.to_parent(ranks, items)
            rest = below.per_rank - level.consumed_below
            ranks, items = idx // rest, level.consumed_below + idx % rest
        return self._levels[0].to_parent(ranks, items)

    # -- the worker's view ---------------------------------------------------------

    def chunk_size(self, num_workers: int) -> int:
        """Items per chunk handed to a worker."""
        if self.split.chunk is not None:
            return self.split.chunk
        return max(1, math.ceil(self.per_rank / num_workers))

    def worker_items(self, world: World, start: int = 0, first: int = 0) -> Iterator[tuple[int, int]]:
        """Yield the ``[begin, end)`` rank-order item ranges of ``world``'s worker, in order.

        Items before ``start`` are left out: the rank's consumed items (resume from a
        sample count) or this worker's own consumed items (resume of one worker).
        Chunks are dealt round-robin from chunk ``first`` on: chunk ``c`` goes to worker
        ``(c - first) mod num_workers``. A DataLoader asks its workers in turn from worker
        0, so an iteration that resumes at rank item ``start`` deals from
        ``first = start // chunk`` and its batches leave in the uninterrupted order.
        """
        chunk = self.chunk_size(world.num_workers)
        n = world.num_workers
        lowest = max(0, start // chunk)
        c = lowest + (first + world.worker - lowest) % n
        while c * chunk < self.per_rank:
            begin, end = max(c * chunk, start), min((c + 1) * chunk, self.per_rank)
            if begin < end:
                yield begin, end
            c += n

    def worker_len(self, world: World, start: int = 0, first: int = 0) -> int:
        """Number of items ``world``'s worker yields from rank item ``start`` on."""
        return sum(end - begin for begin, end in self.worker_items(world, start, first))

    def runs(self, world: World, start: int = 0, first: int = 0) -> Iterator[Run]:
        """Yield the worker's reads as runs within one shard, in reading order (see :meth:`worker_items`)."""
        if world.world_size != self.world_size:
            raise PlanError(f"world.world_size={world.world_size} differs from the plan's {self.world_size}")
        for begin, end in self.worker_items(world, start, first):
            for lo in range(begin, end, _SLICE):
                hi = min(lo + _SLICE, end)
                shards, locals_ = self.locate(self.rank_positions(world.rank, lo, hi))
                breaks = shards[1:] != shards[:-1]
                if not self.split.shuffle:  # also where padding wraps around: runs stay ascending
                    breaks |= locals_[1:] <= locals_[:-1]
                cuts = np.flatnonzero(breaks) + 1
                bounds = [0, *cuts.tolist(), len(shards)]
                positions = np.arange(lo, hi, dtype=np.int64)
                heads: list[int] = shards[bounds[:-1]].tolist()
                for shard, a, b in zip(heads, bounds[:-1], bounds[1:], strict=True):
                    yield Run(shard, locals_[a:b], positions[a:b])

    def worker_shards(self, world: World, start: int = 0, first: int = 0) -> Iterator[int]:
        """Yield the shards the worker will open, in order of use (consecutive repeats merged)."""
        last = -1
        for run in self.runs(world, start, first):
            if run.shard != last:
                yield run.shard
                last = run.shard
