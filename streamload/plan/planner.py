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
(``Split.chunk``) the partitions are the *canonical* ones: ``P = min(partitions, B)``
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
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .._errors import PlanError
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
    "partition_count",
    "rank_samples",
    "tail_share",
    "samples_per_rank",
    "seeded_rng",
]

#: Largest number of items materialised at once while iterating a worker's plan.
_SLICE = 1 << 16
#: Bounds of the default shuffle window, in items.
DEFAULT_WINDOW_RANGE = (4096, 1 << 20)
#: Canonical partitions of a shuffled, batched epoch (ranks 1, 2, 4, 8 each read their own).
DEFAULT_PARTITIONS = 8
#: Most average-sized shards the raised minimum window may span (shards open per worker).
_MAX_WINDOW_SHARDS = 32
#: Window permutations kept per partition (a worker's chunks touch one or two windows of each).
_PERM_CACHE = 2


@dataclass(frozen=True)
class Split:
    """How an epoch is ordered and split.

    Attributes:
        epoch: Epoch number (changes the shuffle).
        seed: Shuffle seed.
        shuffle: Permute shard order and shuffle samples within windows.
        drop_last: Drop the tail so the epoch holds whole global batches only, instead of
            padding to whole global batches by repeating the fewest samples.
        window: Shuffle window of each partition in items; ``None`` picks the default
            (see the module docstring).
        chunk: The per-rank batch size ``b``: items of a rank's order handed to a worker
            at a time (``None``: each worker gets one contiguous block). Set it to the
            DataLoader batch size so batches leave the workers in the rank's order, and
            so that a shuffled epoch follows the world-independent order.
        partitions: Canonical partitions of a shuffled, batched epoch (default
            :data:`DEFAULT_PARTITIONS`; at most the global batch is used). In any other
            epoch: the partitions instead of one per rank (a resumed epoch keeps those it
            started with).
    """

    epoch: int = 0
    seed: int = 0
    shuffle: bool = False
    drop_last: bool = False
    window: int | None = None
    chunk: int | None = None
    partitions: int | None = None
    pad: bool = True

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise PlanError(f"epoch={self.epoch} must be >= 0")
        if self.window is not None and self.window < 1:
            raise PlanError(f"window={self.window} must be >= 1")
        if self.chunk is not None and self.chunk < 1:
            raise PlanError(f"chunk={self.chunk} must be >= 1")
        if self.partitions is not None and self.partitions < 1:
            raise PlanError(f"partitions={self.partitions} must be >= 1")

    @property
    def canonical(self) -> bool:
        """True if the epoch follows the world-independent order (shuffled and batched)."""
        return self.shuffle and self.chunk is not None


@dataclass(frozen=True)
class Run:
    """Samples a worker reads in one go: ``locals`` of shard ``shard``, in this order.

    ``positions`` are the matching rank-order item indices (for progress and resume);
    ``items`` their indices in the epoch's padded sequence (the same on every world: the
    key of per-sample randomness, :func:`streamload.sample_generator`).
    """

    shard: int
    locals: np.ndarray
    positions: np.ndarray
    items: np.ndarray

    @property
    def contiguous(self) -> bool:
        """True if ``locals`` is an ascending run of consecutive indices."""
        n = len(self.locals)
        return (
            n > 0
            and int(self.locals[-1]) - int(self.locals[0]) == n - 1
            and (n < 3 or bool(np.all(np.diff(self.locals) == 1)))
        )

    def part(self, begin: int) -> Run:
        """Return the run from its ``begin``-th sample on."""
        return Run(self.shard, self.locals[begin:], self.positions[begin:], self.items[begin:])


def global_batch(world_size: int, chunk: int | None) -> int:
    """Return the global batch ``B``: the per-rank batch (1 without one) times the ranks."""
    if world_size < 1:
        raise PlanError(f"{world_size=} must be >= 1")
    return world_size * (chunk or 1)


def padded_total(total: int, batch: int, drop_last: bool) -> int:
    """Return the items of an epoch of ``total`` samples in whole global batches of ``batch``."""
    return (total // batch if drop_last else -(-total // batch)) * batch


def samples_per_rank(total: int, world_size: int, drop_last: bool, chunk: int | None = None) -> int:
    """Return the number of samples every rank yields per epoch (whole global batches)."""
    return padded_total(total, global_batch(world_size, chunk), drop_last) // world_size


def tail_share(tail: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return rank ``rank``'s part ``[begin, end)`` of a short last global batch of ``tail`` items.

    The parts are consecutive, in rank order, and differ in size by at most one.
    """
    return rank * tail // world_size, (rank + 1) * tail // world_size


def rank_samples(
    total: int, world_size: int, rank: int, drop_last: bool, chunk: int | None = None, pad: bool = True
) -> int:
    """Return the samples rank ``rank`` yields per epoch (equal on every rank unless ``pad=False``)."""
    batch = global_batch(world_size, chunk)
    if pad or drop_last:
        return padded_total(total, batch, drop_last) // world_size
    full = padded_total(total, batch, True)
    begin, end = tail_share(total - full, world_size, rank)
    return full // world_size + end - begin


def default_window(shard_counts: Sequence[int]) -> int:
    """Return the default shuffle window of the whole epoch in items (before partitioning).

    Four times the largest shard; for small shards at least ``DEFAULT_WINDOW_RANGE[0]``
    items or 32 average shards, whichever is smaller; at most ``DEFAULT_WINDOW_RANGE[1]``.
    """
    counts = [int(c) for c in shard_counts]
    biggest = max(counts, default=0)
    mean = sum(counts) / len(counts) if counts else 0.0
    low, high = DEFAULT_WINDOW_RANGE
    raised = min(low, math.ceil(_MAX_WINDOW_SHARDS * mean))
    return max(1, min(max(4 * biggest, raised), high))


def partition_window(shard_counts: Sequence[int], partitions: int) -> int:
    """Return the default window of each of ``partitions`` partitions.

    The whole epoch's :func:`default_window` shared among them so that together they span
    no more shards than it does (each window spans about ``window / mean + 1`` shards: the
    ``P - 1`` extra boundaries are taken off), but at least the largest shard (a
    partition then reads one or two shards at a time).
    """
    whole = default_window(shard_counts)
    counts = [int(c) for c in shard_counts]
    biggest = max(counts, default=1)
    mean = sum(counts) / len(counts) if counts else 1.0
    shared = int((whole - (partitions - 1) * mean) // partitions)
    return max(1, min(whole, max(biggest, shared)))


def partition_count(split: Split, world_size: int) -> int:
    """Return the partitions ``P`` of the epoch (see the module docstring).

    Canonical (shuffled and batched): ``min(partitions, B)``. Otherwise one per rank, unless
    ``split.partitions`` names the count (an epoch resumed on another world keeps the
    partitions it started with, so its remaining global batches are the uninterrupted ones).
    """
    batch = global_batch(world_size, split.chunk)
    if split.canonical:
        return min(split.partitions or DEFAULT_PARTITIONS, batch)
    return min(split.partitions or world_size, batch)


def locality_warning(split: Split, world_size: int) -> str | None:
    """Return why ``world_size`` ranks read the canonical order with less locality, or ``None``.

    The global batches are the same on every world; a world whose size neither divides nor
    is a multiple of the partition count makes ranks share partitions mid-slice (each
    opens the shards of more partitions).
    """
    if not split.canonical:
        return None
    parts = partition_count(split, world_size)
    if parts % world_size == 0 or world_size % parts == 0:
        return None
    good = [r for r in range(1, 2 * parts + 1) if parts % r == 0 or r % parts == 0]
    return (
        f"world_size={world_size} neither divides nor is a multiple of partitions={parts}: the global "
        f"batches are the same as on any other world, but each rank reads parts of several partitions "
        f"(more shards open per rank); world sizes {', '.join(map(str, good))}, ... keep each rank on its "
        f"own partitions (or choose partitions= a multiple of the world sizes you will use)"
    )


def seeded_rng(*words: int) -> np.random.Generator:
    """Return a numpy generator seeded by ``words`` (each taken modulo 2**64): the planner's one source of order."""
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
            self.shard_order = seeded_rng(split.seed, split.epoch, 0x5A4D).permutation(len(counts))
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


class _Partitions:
    """The padded sequence of ``padded`` items cut into partitions, read in global batches.

    ``bounds[p]`` is partition p's first offset inside a global batch (``bounds[P] = B``);
    partition p holds the padded items ``[steps * bounds[p], steps * bounds[p + 1])``.
    """

    def __init__(self, padded: int, batch: int, parts: int, window: int | None, seed_words: tuple[int, ...]) -> None:
        self.batch = batch
        self.steps = padded // batch if batch else 0
        self.bounds = np.array([p * batch // parts for p in range(parts + 1)], dtype=np.int64)
        self.window = window  # None: no shuffle
        self.seed_words = seed_words
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._perm_cache = _PERM_CACHE * parts + 2

    def to_padded(self, g: np.ndarray) -> np.ndarray:
        """Map global-sequence indices (``k * B + offset``) to padded-sequence items."""
        k, offset = np.divmod(g, self.batch)
        p = np.searchsorted(self.bounds, offset, side="right") - 1
        low = self.bounds[p]
        width = self.bounds[p + 1] - low
        j = k * width + (offset - low)
        if self.window is not None:
            j = self._permute(p, j, self.steps * width)
        out: np.ndarray = self.steps * low + j
        return out

    def order_index(self, part: int, items: np.ndarray) -> np.ndarray:
        """Return the partition-order indices of padded ``items`` of partition ``part`` (the inverse of the shuffle)."""
        low, width = int(self.bounds[part]), int(self.bounds[part + 1] - self.bounds[part])
        local = items - self.steps * low
        if self.window is None or len(local) == 0:
            return local
        size, out = self.window, np.empty_like(local)
        windows = local // size
        for w in np.unique(windows).tolist():
            mask = windows == w
            inverse = np.argsort(self._perm(part, w, self.steps * width))
            out[mask] = w * size + inverse[local[mask] - w * size]
        return out

    def _permute(self, parts: np.ndarray, items: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        assert self.window is not None
        if len(items) == 0:
            return items
        size = self.window
        windows = items // size
        keys = parts * (self.steps * self.batch // size + 1) + windows
        out = np.empty_like(items)
        first, last = int(keys[0]), int(keys[-1])
        single = first == last and (len(keys) < 3 or bool(np.all(keys == first)))
        groups = [first] if single else np.unique(keys).tolist()
        for key in groups:
            mask = slice(None) if single else keys == key
            part, w = int(parts[mask][0]), int(windows[mask][0])
            perm = self._perm(part, w, int(lengths[mask][0]))
            out[mask] = w * size + perm[items[mask] - w * size]
        return out

    def _perm(self, part: int, window: int, length: int) -> np.ndarray:
        key = (part, window)
        perm = self._perms.get(key)
        if perm is None:
            assert self.window is not None
            size = min(self.window, length - window * self.window)
            perm = seeded_rng(*self.seed_words, part, window, 0x57494E).permutation(size)
            self._perms[key] = perm
            while len(self._perms) > self._perm_cache:
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
        self.global_batch = global_batch(world_size, split.chunk)
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
        self._rank_batch = split.chunk or 1
        self._parts = _Partitions(
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
        if self.split.chunk is not None:
            return self.split.chunk
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
