"""The epoch sequence and its partitions.

:class:`Layout` is which sample sits at each position of the epoch sequence (one
dataset's shards: :class:`ShardLayout`); :class:`Partitions` cuts the padded items into
partitions read in global batches, each shuffled window by window.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .._errors import PlanError
from .split import Split, seeded_rng

__all__ = ["Layout", "Partitions", "ShardLayout"]

#: Window permutations kept per partition (a worker's chunks touch one or two windows of each).
_PERM_CACHE = 2


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


class Partitions:
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
        groups = [first] if single else _distinct(keys)
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


#: Up to this many keys, :func:`_distinct` takes them in Python (a numpy sort lets go of the GIL).
_SMALL = 4096


def _distinct(keys: np.ndarray) -> list[int]:
    """The distinct values of ``keys``, in any order.

    A batch's few keys without ``np.unique``: its sort lets go of the GIL, and a thread that
    takes it back beside a training loop running Python waits up to the switch interval.
    """
    if len(keys) <= _SMALL:
        return list(dict.fromkeys(keys.tolist()))
    return np.unique(keys).tolist()  # type: ignore[no-any-return]
