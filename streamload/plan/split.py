"""What an epoch is asked to be (:class:`Split`) and what a worker reads in one go (:class:`Run`).

With them, the arithmetic of global batches, partitions and shuffle windows.

Pure functions of sample counts and the split; :mod:`.planner` builds the epoch's order on
them (its module docstring tells the whole walk, from shards to a worker's chunks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import PlanError

__all__ = [
    "DEFAULT_PARTITIONS",
    "DEFAULT_WINDOW_RANGE",
    "Run",
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

#: Bounds of the default shuffle window, in items.
DEFAULT_WINDOW_RANGE = (4096, 1 << 20)
#: Canonical partitions of a shuffled, batched epoch (ranks 1, 2, 4, 8 each read their own).
DEFAULT_PARTITIONS = 8
#: Most average-sized shards the raised minimum window may span (shards open per worker).
_MAX_WINDOW_SHARDS = 32


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
        batch_size: The per-rank batch size ``b``: items of a rank's order handed to a worker
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
    batch_size: int | None = None
    partitions: int | None = None
    pad: bool = True

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise PlanError(f"epoch={self.epoch} must be >= 0")
        if self.window is not None and self.window < 1:
            raise PlanError(f"window={self.window} must be >= 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise PlanError(f"batch_size={self.batch_size} must be >= 1")
        if self.partitions is not None and self.partitions < 1:
            raise PlanError(f"partitions={self.partitions} must be >= 1")

    @property
    def canonical(self) -> bool:
        """True if the epoch follows the world-independent order (shuffled and batched)."""
        return self.shuffle and self.batch_size is not None


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
    batch = global_batch(world_size, split.batch_size)
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
