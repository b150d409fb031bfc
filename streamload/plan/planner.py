"""The split planner: which samples each (rank, worker) reads in an epoch, and in which order.

Pure functions of the manifest's per-shard sample counts and a small description of the
epoch and the world; nothing here reads a shard or launches a process.

The epoch, step by step (N samples, R ranks of ``b`` items per batch, W workers per rank,
global batch ``B = b * R``; without a batch, ``b = 1``)::

    shards            s0 s1 s2 s3 ...                 (manifest order)
    shard order       s2 s0 s3 s1 ...                 (permuted when shuffling; seed, epoch)
    epoch sequence    positions 0..N-1 over the shards in that order
    padded sequence   items 0..T-1, item x reads epoch position (x mod N);
                      T = ceil(N/B)*B, or floor(N/B)*B with drop_last: K = T/B steps
    partitions        P contiguous runs of the padded sequence; partition p holds
                      K * s_p items, s_p = floor((p+1)B/P) - floor(pB/P)
    partition order   identity, or when shuffling a permutation inside each window of
                      ``window`` consecutive items (seed, epoch, partition, window)
    global batch k    s_0 items of partition 0 (its items k*s_0 ..), then s_1 of
                      partition 1, ...: B items, concatenated in partition order
    rank r            items r*b .. (r+1)*b - 1 of every global batch (its rank order)
    worker w          items of the rank order cut into chunks of ``chunk`` items; chunk c
                      goes to worker c mod W (so with chunk = the DataLoader's batch size,
                      the rank's batches come out of the workers in rank order; an
                      iteration resumed at chunk f deals from there: (c - f) mod W)

**The same training on any cluster shape.** With ``shuffle`` and a batch size
(``Split.batch_size``) the partitions are the *canonical* ones: ``P = min(partitions, B)``
(default :data:`DEFAULT_PARTITIONS`), a number that depends on the global batch only. So
the padded sequence, its partitions and their orders, and therefore every global batch,
are functions of (dataset, seed, epoch, global batch size, partitions, window): the same
for 1, 2, 4 or 64 ranks and any number of workers, as long as ``b * R`` is the same. The
world only decides which rank reads which slice of each global batch. Read locality comes
from the partitions: when ``R`` divides ``P``, rank r reads only its ``P/R`` partitions
(contiguous runs of the shard order, each a window at a time); when ``P`` divides ``R``,
``R/P`` ranks share a partition, each reading a contiguous part of its slices; any other
world keeps the same global batches but its ranks straddle partitions and open more shards
(a warning says so, :func:`locality_warning`). Without shuffling, or without a batch
size, there is one partition per rank (``P = R``, ``b = 1`` without a batch): each rank
reads one contiguous block of the padded sequence, as sequential as the data allows.

**Exactly once, equal per rank.** The padded sequence holds every epoch position once
(plus the ``T - N`` first ones again as padding: the fewest repeats that fill whole
global batches, the same for every world; or without its tail, with ``drop_last``); the
partitions cut it without overlap and the global batches take every partition item once;
every rank takes ``b`` items of every global batch, ``T / R`` in all.

**The shuffle window.** ``window`` is the span inside which a partition's items are
permuted (samples never move between windows, so the order is "locally uniform"). The
default (:func:`default_window`) is four times the largest shard, raised towards 4096
items for small shards (but to no more than 32 average shards) and capped at 2**20 items,
divided among the partitions so that together they span no more shards than that window
(:func:`partition_window`), but never below the largest shard: each partition reads a few
shards at a time, while every global batch draws from all ``P`` partitions, so a batch
mixes samples of at least ``P`` shards.

**Resume.** Because the global batches do not depend on the world, an epoch stopped after
``G`` samples (global count, all ranks) continues on any world with the same global batch
at global batch ``G / B``: rank r' of the new world starts at its item ``G / R'``. On the
same world any ``G`` that is a multiple of ``R`` continues each rank where it stopped. A
world of another global batch (or partition count) continues from the epoch's unread rest
instead (:class:`Remainder`): each unread sample once, in another order.

**Without padding** (``Split.pad=False``): the ``floor(N/B)`` whole global batches as
above, then the ``t = N mod B`` samples left as one short last global batch (the
:attr:`EpochPlan.tail`), rank r taking its part ``[floor(r t / R), floor((r+1) t / R))``
after its whole batches (:func:`tail_share`): every sample exactly once, rank counts
differing by at most one.

Cost per worker: O(number of shards) to set up, then O(chunk) or O(window) memory while
iterating; nothing is O(N).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from .._errors import PlanError
from .layout import Layout, Partitions, ShardLayout
from .split import (
    DEFAULT_PARTITIONS,
    DEFAULT_WINDOW_RANGE,
    Run,
    Split,
    default_window,
    global_batch,
    locality_warning,
    padded_total,
    partition_count,
    partition_window,
    rank_samples,
    samples_per_rank,
    seeded_rng,
    tail_share,
)
from .world import World

__all__ = [
    "DEFAULT_PARTITIONS",
    "DEFAULT_WINDOW_RANGE",
    "EpochPlan",
    "Layout",
    "Remainder",
    "Run",
    "ShardLayout",
    "Split",
    "default_window",
    "global_batch",
    "locality_warning",
    "padded_total",
    "partition_count",
    "partition_window",
    "rank_samples",
    "samples_per_rank",
    "seeded_rng",
    "tail_share",
]

#: Largest number of items materialised at once while iterating a worker's plan.
_SLICE = 1 << 16


class EpochPlan:
    """The order and split of one epoch for a whole world (see the module docstring).

    Args:
        shard_counts: Samples per shard, in manifest order (with a ``layout``: the shards
            the layout reads, which set the default window).
        world_size: Ranks reading the epoch now.
        split: Epoch, seed, shuffle, drop_last, window, chunk and partitions.
        layout: The epoch sequence (default: :class:`ShardLayout` of ``shard_counts``),
            e.g. a :class:`~streamload.plan.mixture.MixLayout` of several datasets.
    """

    def __init__(
        self,
        shard_counts: Sequence[int],
        world_size: int,
        split: Split,
        layout: Layout | None = None,
    ) -> None:
        counts = np.asarray(shard_counts, dtype=np.int64).reshape(-1)
        if (counts < 0).any():
            raise PlanError(f"shard_counts must be non-negative, got min {int(counts.min())}")
        self.split = split
        self.world_size = world_size
        #: The global batch ``B`` (the per-rank batch, or 1, times the ranks).
        self.global_batch = global_batch(world_size, split.batch_size)
        #: Partitions of the padded sequence (canonical, or one per rank).
        self.partitions = partition_count(split, world_size)
        self.layout: Layout = ShardLayout(counts, split) if layout is None else layout
        self.total = self.layout.total
        #: Items of the padded sequence: whole global batches (without ``pad``: the whole
        #: ones the epoch holds, then :attr:`tail`).
        self.padded = padded_total(self.total, self.global_batch, split.drop_last or not split.pad)
        #: Items of the short last global batch (``pad=False`` only), after the padded sequence.
        self.tail = 0 if split.pad or split.drop_last else self.total - self.padded
        self.window = split.window or partition_window(counts.tolist(), self.partitions)
        #: Items every rank yields in this epoch (before its share of :attr:`tail`).
        self.per_rank = self.padded // world_size
        #: Shuffle window of the epoch this plan continues (itself, unless it reads a :class:`Remainder`).
        self.base_window = self.layout.base_window if isinstance(self.layout, Remainder) else self.window
        self._tail_order: np.ndarray | None = None
        #: Earlier segments of a resumed epoch read with other global batches (see
        #: :mod:`streamload.plan.state`): ``(global_batch, partitions, samples_seen)``.
        self.segments: tuple[tuple[int, int, int], ...] = ()
        #: True if this plan starts a new segment (the world changed the global batch).
        self.reshaped = False
        self._rank_batch = split.batch_size or 1
        self._parts = Partitions(
            self.padded,
            self.global_batch,
            self.partitions,
            self.window if split.shuffle else None,
            (split.seed, split.epoch),
        )

    # -- positions -----------------------------------------------------------------

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map epoch-sequence positions to ``(shard index, index within shard)`` arrays."""
        if self.total == 0:
            raise PlanError("cannot locate samples of an empty dataset")
        return self.layout.locate(positions)

    def rank_count(self, rank: int) -> int:
        """Items rank ``rank`` yields in this epoch (the same on every rank unless ``pad=False``)."""
        begin, end = tail_share(self.tail, self.world_size, rank)
        return self.per_rank + end - begin

    def tail_items(self, t: np.ndarray) -> np.ndarray:
        """Padded-sequence items of the short last global batch's ``t``-th items (permuted when shuffling)."""
        if self.split.shuffle and self.tail > 1:
            if self._tail_order is None:
                self._tail_order = seeded_rng(self.split.seed, self.split.epoch, 0x5441494C).permutation(self.tail)
            t = self._tail_order[t]
        out: np.ndarray = self.padded + t
        return out

    def global_items(self, begin: int, end: int) -> np.ndarray:
        """Padded-sequence items of the global sequence's ``begin..end-1`` (global batch order, then the tail)."""
        if not 0 <= begin <= end <= self.padded + self.tail:
            raise PlanError(f"items [{begin}, {end}) outside the epoch's {self.padded + self.tail}")
        g = np.arange(begin, end, dtype=np.int64)
        if end <= self.padded:
            return self._parts.to_padded(g)
        out = np.empty_like(g)
        full = g < self.padded
        out[full] = self._parts.to_padded(g[full])
        out[~full] = self.tail_items(g[~full] - self.padded)
        return out

    def rank_items(self, rank: int, begin: int, end: int) -> np.ndarray:
        """Padded-sequence items of rank ``rank``'s items ``begin..end-1`` (rank order)."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"{rank=} outside world_size={self.world_size}")
        count = self.rank_count(rank)
        if not 0 <= begin <= end <= count:
            raise PlanError(f"items [{begin}, {end}) outside the rank's {count}")
        b = self._rank_batch
        i = np.arange(begin, end, dtype=np.int64)
        if end <= self.per_rank:
            return self._parts.to_padded((i // b) * self.global_batch + rank * b + i % b)
        out = np.empty_like(i)
        full = i < self.per_rank
        j = i[full]
        out[full] = self._parts.to_padded((j // b) * self.global_batch + rank * b + j % b)
        first, _ = tail_share(self.tail, self.world_size, rank)
        out[~full] = self.tail_items(first + i[~full] - self.per_rank)
        return out

    def to_epoch(self, items: np.ndarray) -> np.ndarray:
        """Map padded-sequence items to epoch-sequence positions (padding wraps to the start)."""
        if self.padded > self.total and self.total:
            return items % self.total
        return items

    def rank_positions(self, rank: int, begin: int, end: int) -> np.ndarray:
        """Epoch-sequence positions of rank ``rank``'s items ``begin..end-1`` (rank order)."""
        return self.to_epoch(self.rank_items(rank, begin, end))

    # -- the worker's view ---------------------------------------------------------

    def chunk_size(self, num_workers: int) -> int:
        """Items per chunk handed to a worker."""
        if self.split.batch_size is not None:
            return self.split.batch_size
        most = self.per_rank + -(-self.tail // self.world_size)
        return max(1, math.ceil(most / num_workers))

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
        count = self.rank_count(world.rank)
        lowest = max(0, start // chunk)
        c = lowest + (first + world.worker - lowest) % n
        while c * chunk < count:
            begin, end = max(c * chunk, start), min((c + 1) * chunk, count)
            if begin < end:
                yield begin, end
            c += n

    def worker_done(self, world: World, start: int, first: int, next_item: int) -> int | None:
        """Return the items ``world``'s worker has read when its next item is ``next_item``.

        The worker dealt from chunk ``first`` and started at ``start`` (see
        :meth:`worker_items`); ``None`` if it never stands at ``next_item`` (not the end of
        one of its items, nor ``start``). O(1).
        """
        if next_item == start:
            return 0
        chunk, n = self.chunk_size(world.num_workers), world.num_workers
        count = self.rank_count(world.rank)
        if not 0 <= start < next_item <= count:
            return None
        lowest = start // chunk
        c0 = lowest + (first + world.worker - lowest) % n
        b0, e0 = max(c0 * chunk, start), min((c0 + 1) * chunk, count)
        if b0 >= e0 or next_item <= b0:
            return None
        if next_item <= e0:
            return next_item - b0
        c = (next_item - 1) // chunk  # the chunk of the last item read
        if (c - c0) % n:
            return None
        return (e0 - b0) + ((c - c0) // n - 1) * chunk + next_item - c * chunk

    def runs(self, world: World, start: int = 0, first: int = 0) -> Iterator[Run]:
        """Yield the worker's reads as runs within one shard, in reading order (see :meth:`worker_items`)."""
        if world.world_size != self.world_size:
            raise PlanError(f"world.world_size={world.world_size} differs from the plan's {self.world_size}")
        for begin, end in self.worker_items(world, start, first):
            for lo in range(begin, end, _SLICE):
                hi = min(lo + _SLICE, end)
                items = self.rank_items(world.rank, lo, hi)
                if isinstance(self.layout, Remainder):  # keys: the epoch's own items (per-sample randomness)
                    shards, locals_, items = self.layout.locate_keys(self.to_epoch(items))
                else:
                    shards, locals_ = self.locate(self.to_epoch(items))
                breaks = shards[1:] != shards[:-1]
                if not self.split.shuffle:  # also where padding wraps around: runs stay ascending
                    breaks |= locals_[1:] <= locals_[:-1]
                cuts = np.flatnonzero(breaks) + 1
                bounds = [0, *cuts.tolist(), len(shards)]
                positions = np.arange(lo, hi, dtype=np.int64)
                heads: list[int] = shards[bounds[:-1]].tolist()
                for shard, a, b in zip(heads, bounds[:-1], bounds[1:], strict=True):
                    yield Run(shard, locals_[a:b], positions[a:b], items[a:b])

    def worker_shards(self, world: World, start: int = 0, first: int = 0) -> Iterator[int]:
        """Yield the shards the worker will open, in order of use (consecutive repeats merged)."""
        last = -1
        for run in self.runs(world, start, first):
            if run.shard != last:
                yield run.shard
                last = run.shard

    def open_shards(self, mean_shard: float, share: float = 1.0) -> int:
        """Shards a rank reads at once, about: the shards each of its partitions' windows spans.

        ``share``: the fraction of the epoch sequence that the shards of ``mean_shard``
        samples hold (a mixture's stream); 1 for a plain dataset. A plan over a
        :class:`Remainder` reads a contiguous part of it: the windows of about
        ``P / R + 1`` of the interrupted epoch's partitions.
        """
        if isinstance(self.layout, Remainder):
            base = self.layout.base
            mine = max(1, math.ceil(base.partitions / self.world_size) + 1)
            return mine * base.open_shards(mean_shard, share) // max(1, base.partitions)
        mine = max(1, math.ceil(self.partitions / self.world_size))
        if not self.split.shuffle:
            return mine
        return mine * (math.ceil(self.window * share / max(1.0, mean_shard)) + 1)


class Remainder:
    """The unread rest of an interrupted epoch, as a :class:`Layout` for a plan of another global batch.

    ``plan`` is the epoch as it was read (its global batch and partitions; any world of
    them reads the same global batches) and ``steps`` the global batches consumed. The
    rest is every item not yet read, each once: partition by partition, the suffix of
    each partition's order that its first ``steps`` slices did not take (the padding
    repeats left out), then the short last global batch of ``pad=False``. Position ``i``
    of the rest maps to an item of ``plan``; a new :class:`EpochPlan` (unshuffled: the
    rest is already in a shuffled order) cuts it into its own global batches, so each
    rank reads a contiguous part, a few of the old partitions. Memory: O(partitions),
    plus the windows that hold padding.
    """

    def __init__(self, plan: EpochPlan, steps: int) -> None:
        parts = plan._parts
        if not 0 <= steps <= parts.steps:
            raise PlanError(f"{steps=} global batches outside the epoch's {parts.steps}")
        self.plan = plan
        self.steps = steps
        widths = self._widths = np.diff(parts.bounds)
        self._begin = steps * widths  # first unread partition-order index of each partition
        left = (parts.steps - steps) * widths
        #: Per partition with padding: its unread padding's partition-order indices, sorted.
        self._pads: dict[int, np.ndarray] = {}
        if plan.padded > plan.total:
            first = int(np.searchsorted(parts.steps * parts.bounds, plan.total, side="right")) - 1
            for p in range(max(0, first), len(widths)):
                low, high = parts.steps * int(parts.bounds[p]), parts.steps * int(parts.bounds[p + 1])
                items = np.arange(max(low, plan.total), high, dtype=np.int64)
                order = np.sort(parts.order_index(p, items))
                order = order[order >= self._begin[p]]
                if len(order):
                    self._pads[p] = order
                    left[p] -= len(order)
        self._ends = np.cumsum(left)
        self._starts = self._ends - left
        self._in_parts = int(self._ends[-1]) if len(left) else 0
        self._total = self._in_parts + plan.tail

    @property
    def total(self) -> int:
        """Items of the rest of the epoch."""
        return self._total

    @property
    def base(self) -> EpochPlan:
        """The plan of the epoch as it started (before any change of global batch)."""
        return self.plan.layout.base if isinstance(self.plan.layout, Remainder) else self.plan

    @property
    def base_window(self) -> int:
        """The shuffle window of the epoch as it started."""
        return self.base.window

    def items(self, positions: np.ndarray) -> np.ndarray:
        """Map positions of the rest to ``plan``'s padded-sequence items (each a sample, never padding)."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= self._total):
            raise PlanError(f"positions outside the rest of the epoch ({self._total} items)")
        plan, parts = self.plan, self.plan._parts
        out = np.empty_like(positions)
        inner = positions < self._in_parts
        pos = positions[inner]
        p = np.searchsorted(self._ends, pos, side="right")
        j = self._begin[p] + pos - self._starts[p]
        for part, pads in self._pads.items():  # skip the padding: the i-th unread index that is not one
            mask = p == part
            if mask.any():
                before = pads - self._begin[part] - np.arange(len(pads))
                j[mask] += np.searchsorted(before, pos[mask] - self._starts[part], side="right")
        widths = self._widths[p]
        out[inner] = parts.to_padded((j // widths) * parts.batch + parts.bounds[p] + j % widths)
        out[~inner] = plan.tail_items(positions[~inner] - self._in_parts)
        return out

    def keys(self, positions: np.ndarray) -> np.ndarray:
        """Map positions of the rest to the items of the epoch as it started (per-sample randomness keys)."""
        items = self.items(positions)
        layout = self.plan.layout
        return layout.keys(items) if isinstance(layout, Remainder) else items

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map positions of the rest to ``(shard index, index within shard)`` arrays."""
        return self.plan.layout.locate(self.items(positions))

    def locate_keys(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`locate` and :meth:`keys` at once (one mapping through each level)."""
        items = self.items(positions)
        layout = self.plan.layout
        if isinstance(layout, Remainder):
            shards, locals_, keys = layout.locate_keys(items)
            return shards, locals_, keys
        shards, locals_ = layout.locate(items)
        return shards, locals_, items
