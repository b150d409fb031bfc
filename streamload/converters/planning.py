"""Cutting items into shards: the one rule, for a whole list or streamed a block at a time.

A shard holds at most ``max_samples`` items when that is given; otherwise at most
``max_bytes`` payload bytes, except that an item larger than ``max_bytes`` gets a shard
alone (a shard is never empty). With neither limit everything is one shard.
:class:`ShardCutter` applies this rule to items fed in blocks, remembering only the open
shard's count and size, so a listing of any length is cut in O(1) memory; :func:`plan_shards`
and :func:`cuts` apply it to a whole list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = ["ShardCutter", "Weighed", "cuts", "plan_shards"]


class Weighed(Protocol):
    """Anything with a payload size (a source's :class:`~.source.Item`)."""

    @property
    def nbytes(self) -> int:
        """Payload bytes."""
        ...


W = TypeVar("W", bound=Weighed)


class ShardCutter:
    """Decide where shards start, for item sizes fed a block at a time.

    Args:
        max_bytes: Payload bytes per shard at most (``None``: no byte limit).
        max_samples: Items per shard at most (``None``: cut by bytes); it wins over
            ``max_bytes``.
    """

    def __init__(self, max_bytes: int | None, max_samples: int | None) -> None:
        self.max_bytes = None if max_samples is not None else max_bytes
        self.max_samples = max_samples
        self._count = 0  # items in the open shard (0: the next item opens one)
        self._size = 0  # its payload bytes

    def feed(self, sizes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Feed the next items' payload sizes; return the positions (in ``sizes``) of the items that open a shard.

        The cost is O(len(sizes)) in NumPy and O(shards opened) in Python.
        """
        n = len(sizes)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if self.max_samples is not None:
            m = self.max_samples
            starts = np.arange((m - self._count) % m, n, m, dtype=np.int64)
            self._count = (self._count + n) % m
            return starts
        if self.max_bytes is None:  # one shard of everything
            first = self._count == 0
            self._count += n
            return np.zeros(1 if first else 0, dtype=np.int64)
        limit = self.max_bytes
        total = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.asarray(sizes, dtype=np.int64), out=total[1:])
        out: list[int] = []
        i = 0
        while i < n:
            if self._count == 0:  # an empty shard takes the next item, however large
                out.append(i)
                self._count, self._size = 1, int(total[i + 1] - total[i])
                i += 1
                continue
            # the items that still fit: total[end] - total[i] <= limit - size
            end = int(np.searchsorted(total, total[i] + (limit - self._size), side="right")) - 1
            end = max(end, i)
            self._count += end - i
            self._size += int(total[end] - total[i])
            i = end
            if i < n:  # item i does not fit: it opens the next shard
                self._count = 0
        return np.array(out, dtype=np.int64)


def cuts(sizes: Sequence[int] | np.ndarray[Any, Any], max_bytes: int | None, max_samples: int | None) -> list[int]:
    """Return the shard boundaries (``0``, ..., ``len(sizes)``) of items of these payload sizes."""
    n = len(sizes)
    if n == 0:
        return [0]
    starts = ShardCutter(max_bytes, max_samples).feed(np.asarray(sizes, dtype=np.int64))
    return [*starts.tolist(), n]


def plan_shards(items: Sequence[W], max_bytes: int | None, max_samples: int | None) -> list[list[W]]:
    """Cut ``items`` into consecutive shards by sample count or payload bytes.

    A shard holds at most ``max_samples`` items (if given), else at most ``max_bytes``
    payload bytes; an item larger than ``max_bytes`` gets a shard alone.
    """
    bounds = cuts([item.nbytes for item in items], max_bytes, max_samples)
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
