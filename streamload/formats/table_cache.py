"""Decoded row groups of tables read in place (Parquet), kept per process within a byte budget.

A shuffle window reads its files' row groups in random order: when they fit in the budget
each is decoded once per window, otherwise again for most samples. A reader reading in
row order drops its row groups behind it and keeps one. The cache belongs to one process:
a forked child starts empty (its readers are its own).

The budget is a parameter: :func:`set_row_group_cache_bytes` (what
``StorageConfig(parquet_cache=)`` sets in each reading process); unset, it is the
default, :data:`ROW_GROUP_CACHE_BYTES` unless :func:`set_row_group_cache_default` chose
another (what a :class:`~streamload.StorageConfig` without ``parquet_cache`` sets in each
process that opens a dataset: ``STREAMLOAD_PARQUET_CACHE``, e.g. ``"2GB"``, read there).
This module reads no environment and imports no table library, so setting the budget
costs nothing where no table is read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._fork import on_fork
from .._units import parse_bytes

__all__ = [
    "CACHE",
    "ROW_GROUP_CACHE_BYTES",
    "Group",
    "RowGroupCache",
    "set_row_group_cache_bytes",
    "set_row_group_cache_default",
]

#: Bytes of decoded row groups one process keeps by default, over all its readers.
ROW_GROUP_CACHE_BYTES = 1 << 30

#: A decoded row group: its image bytes (pages), per row its page and span there (starts,
#: ends), its json texts.
Group = tuple["list[np.ndarray]", np.ndarray, np.ndarray, np.ndarray, "list[bytes] | None"]


class RowGroupCache:
    """Decoded row groups of one process, keyed by ``(reader token, row group)``, least recently used dropped first.

    Args:
        budget: Bytes kept at most (one row group is kept whatever its size); ``None``:
            :attr:`default`.
        default: The budget when none is set.
    """

    def __init__(self, budget: int | None = None, default: int = ROW_GROUP_CACHE_BYTES) -> None:
        self.items: OrderedDict[tuple[int, int], tuple[Group, int]] = OrderedDict()
        self.total = 0
        self._budget = budget
        self.default = default

    @property
    def budget(self) -> int:
        """The bytes kept at most."""
        return self.default if self._budget is None else self._budget

    def set_budget(self, budget: int | None) -> None:
        """Keep at most ``budget`` bytes from now on (``None``: the default); drops what is over it."""
        self._budget = budget
        self._trim()

    def set_default(self, default: int) -> None:
        """Make ``default`` the budget when none is set; drops what is over the budget."""
        self.default = default
        self._trim()

    def get(self, key: tuple[int, int]) -> Group | None:
        """Row group ``key`` if held (it becomes the most recently used), else ``None``."""
        kept = self.items.get(key)
        if kept is None:
            return None
        self.items.move_to_end(key)
        return kept[0]

    def put(self, key: tuple[int, int], group: Group) -> None:
        """Hold row group ``key``, dropping the least recently used ones over the budget."""
        texts = group[4]
        nbytes = sum(int(a.nbytes) for a in (*group[0], group[1], group[2], group[3]))
        nbytes += sum(map(len, texts)) if texts else 0
        old = self.items.pop(key, None)  # held already (decoded further since): counted anew
        if old is not None:
            self.total -= old[1]
        self.items[key] = (group, nbytes)
        self.total += nbytes
        self._trim()

    def _trim(self) -> None:
        budget = self.budget
        while self.total > budget and len(self.items) > 1:
            _, (_, dropped) = self.items.popitem(last=False)
            self.total -= dropped

    def discard(self, key: tuple[int, int]) -> None:
        """Drop row group ``key`` if held."""
        old = self.items.pop(key, None)
        if old is not None:
            self.total -= old[1]

    def drop(self, reader: int, below: int | None = None) -> None:
        """Drop ``reader``'s row groups (only those before row group ``below`` if given)."""
        for key in [k for k in self.items if k[0] == reader and (below is None or k[1] < below)]:
            self.total -= self.items.pop(key)[1]

    def held(self, reader: int) -> list[int]:
        """The row groups of ``reader`` held now, least recently used first."""
        return [g for r, g in self.items if r == reader]

    def forget(self) -> None:
        """Hold nothing (a forked child: its budget stays its parent's)."""
        self.items = OrderedDict()
        self.total = 0


#: This process's cache, shared by every reader.
CACHE = RowGroupCache()


def set_row_group_cache_bytes(budget: Any) -> None:
    """Set the bytes of decoded row groups this process keeps, over all its Parquet readers.

    Args:
        budget: A size in bytes (an int, or a string with units: ``"2GB"``), or ``None``
            for the default (1 GiB, or what :func:`set_row_group_cache_default` chose:
            ``STREAMLOAD_PARQUET_CACHE`` once a dataset is opened). A forked child keeps
            the budget its parent set; a spawned one sets its own.

    Raises:
        ConfigError: If ``budget`` is not a size.
    """
    if budget is None:
        CACHE.set_budget(None)
        return
    if isinstance(budget, str):
        budget = parse_bytes(budget, name="parquet_cache")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"parquet_cache={budget!r} must be a number of bytes >= 0 (or None for the default)")
    CACHE.set_budget(budget)


def set_row_group_cache_default(budget: int) -> None:
    """Set the budget this process's row-group cache keeps when none was set (bytes).

    :meth:`streamload.StorageConfig.open` sets it, in each process that opens a dataset,
    from ``STREAMLOAD_PARQUET_CACHE`` (else 1 GiB); :func:`set_row_group_cache_bytes`
    still wins over it.
    """
    CACHE.set_default(budget)


@on_fork
def _forget_in_child() -> None:
    CACHE.forget()
