"""Row-span planning: a table's planned shards, kept compact, and the pass that cuts them.

A planned shard is a :class:`RowSpan`: its rows ``[first, stop)``, the few rows inside
left out (broken, or already in the dataset an append adds to), and where its reading
starts (the row group, or the byte offset of the block holding ``first``). Planning keeps
the spans, the problems and nothing per row: O(shards + bad rows). A shuffled plan is a
global seeded permutation (:class:`RowList` shards): O(rows) by nature.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from streamload.manifest import SkippedInput

from ..planning import ShardCutter, cuts
from ..source import Item

__all__ = [
    "RowList",
    "RowSpan",
    "Rows",
    "ScannedBlock",
    "SpanBuilder",
    "TableItem",
    "TablePlan",
    "plan_blocks",
    "present_rows_of",
    "row_key",
]


def row_key(prefix: str, row: int) -> str:
    """The key of row ``row`` of a table whose keys start with ``prefix``."""
    return f"{prefix}/{row:010d}"


@dataclass(frozen=True)
class TableItem(Item):
    """One row of the table: its number and, once read by a task, its values (by column)."""

    row: int = 0
    values: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


class Rows(Sequence[Item]):
    """Rows of a table as items (made on access); subclasses say which rows."""

    prefix: str

    def rows(self) -> Iterator[int]:
        """Yield the row numbers, in shard order."""
        raise NotImplementedError

    def _item(self, row: int) -> TableItem:
        return TableItem(row_key(self.prefix, row), 0, row)

    def __iter__(self) -> Iterator[Item]:
        for row in self.rows():
            yield self._item(row)

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Item]: ...

    def __getitem__(self, index: int | slice) -> Item | Sequence[Item]:
        if isinstance(index, slice):
            return [self._item(self._row_at(i)) for i in range(len(self))[index]]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(index)
        return self._item(self._row_at(index % n))

    def _row_at(self, index: int) -> int:
        raise NotImplementedError


class RowSpan(Rows):
    """A planned shard of a table, compactly: rows ``[first, stop)`` minus ``excluded``.

    Args:
        prefix: Key prefix (the table's stem).
        first: Its first row.
        stop: One past its last row.
        excluded: Rows inside left out (sorted).
        position: Where its reading starts: the Parquet row group, or the byte offset of
            the CSV/JSONL block, holding ``first``.
        position_row: The row number at ``position``.
    """

    def __init__(
        self, prefix: str, first: int, stop: int, excluded: Sequence[int], position: int, position_row: int
    ) -> None:
        self.prefix = prefix
        self.first = first
        self.stop = stop
        self.excluded = tuple(excluded)
        self.position = position
        self.position_row = position_row

    def __len__(self) -> int:
        return self.stop - self.first - len(self.excluded)

    def rows(self) -> Iterator[int]:
        """Yield the row numbers of the span, in order."""
        skip = set(self.excluded)
        return (r for r in range(self.first, self.stop) if r not in skip)

    def _row_at(self, index: int) -> int:
        row = self.first + index
        for e in self.excluded:  # sorted: each one at or before the candidate pushes it on
            if e <= row:
                row += 1
        return row

    def fingerprint_bytes(self) -> bytes:
        """Return the bytes that identify this span (for the plan fingerprint)."""
        head = struct.pack("<5q", self.first, self.stop, self.position, self.position_row, len(self.excluded))
        return self.prefix.encode() + b"\0" + head + np.asarray(self.excluded, dtype="<i8").tobytes()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSpan) and self.__getstate__() == other.__getstate__()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"RowSpan({self.prefix!r}, first={self.first}, stop={self.stop}, excluded={self.excluded}, "
            f"position={self.position}, position_row={self.position_row})"
        )

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.prefix, self.first, self.stop, self.excluded, self.position, self.position_row)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.prefix, self.first, self.stop, self.excluded, self.position, self.position_row = state


class RowList(Rows):
    """A planned shard of a table as an explicit array of rows (a shuffled plan only).

    Args:
        prefix: Key prefix (the table's stem).
        rows: Row numbers, in shard order (int64).
    """

    def __init__(self, prefix: str, rows: np.ndarray[Any, Any]) -> None:
        self.prefix = prefix
        self.row_array = np.asarray(rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.row_array)

    def rows(self) -> Iterator[int]:
        """Yield the row numbers, in shard order."""
        return iter(self.row_array.tolist())

    def _row_at(self, index: int) -> int:
        return int(self.row_array[index])

    def fingerprint_bytes(self) -> bytes:
        """Return the bytes that identify these rows, in order (for the plan fingerprint)."""
        return self.prefix.encode() + b"\0" + self.row_array.astype("<i8").tobytes()


@dataclass
class TablePlan:
    """A table's streamed scan and plan.

    Attributes:
        shards: The planned shards, in order (:class:`RowSpan`, or :class:`RowList` when shuffled).
        problems: Broken rows, in row order.
        present: Rows left out because their keys are already in the destination (appending).
        samples: Rows planned.
        rows: Rows in the table.
    """

    shards: list[Sequence[Item]]
    problems: list[SkippedInput]
    present: list[SkippedInput]
    samples: int
    rows: int


@dataclass
class ScannedBlock:
    """One block of the scan: its rows' verdicts and sizes."""

    position: int
    position_row: int
    first_row: int
    ok: np.ndarray[Any, Any]
    sizes: np.ndarray[Any, Any]
    problems: list[tuple[int, SkippedInput]]


class SpanBuilder:
    """Turn the shard starts found while scanning into :class:`RowSpan` objects."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.spans: list[Sequence[Item]] = []
        self._open: tuple[int, int, int] | None = None  # first, position, position_row
        self._bad: list[int] = []  # left-out rows not yet given to a span, sorted
        self._head = 0
        self._last_good = -1

    def feed(self, block: ScannedBlock, ok: np.ndarray[Any, Any], starts: np.ndarray[Any, Any]) -> None:
        """Take a scanned block: its verdicts ``ok`` and the positions (among its good rows) that open shards."""
        good = np.flatnonzero(ok)
        self._bad.extend((block.first_row + np.flatnonzero(~ok)).tolist())
        for s in starts.tolist():
            self._start(block.first_row + int(good[s]), block.position, block.position_row)
        if len(good):
            self._last_good = block.first_row + int(good[-1])

    def _take_bad(self, stop: int) -> list[int]:
        end = bisect.bisect_left(self._bad, stop, self._head)
        taken = self._bad[self._head : end]
        self._head = end
        if self._head > 4096 and self._head * 2 > len(self._bad):
            del self._bad[: self._head]
            self._head = 0
        return taken

    def _start(self, row: int, position: int, position_row: int) -> None:
        excluded = self._take_bad(row)
        if self._open is not None:
            first, pos, pos_row = self._open
            self.spans.append(RowSpan(self.prefix, first, row, excluded, pos, pos_row))
        self._open = (row, position, position_row)

    def finish(self) -> list[Sequence[Item]]:
        """Close the open span and return every span, in order."""
        if self._open is not None:
            first, pos, pos_row = self._open
            stop = self._last_good + 1
            self.spans.append(RowSpan(self.prefix, first, stop, self._take_bad(stop), pos, pos_row))
            self._open = None
        return self.spans


def plan_blocks(
    blocks: Iterable[ScannedBlock],
    prefix: str,
    cut: tuple[int | None, int | None],
    shuffle: tuple[bool, int],
    present_rows: np.ndarray[Any, Any],
    present_problem: Callable[[int], SkippedInput],
) -> TablePlan:
    """Cut the scanned blocks into shards as they come (the engine's rule, see :mod:`..planning`).

    Args:
        blocks: The scan, a block at a time.
        prefix: Key prefix (the table's stem).
        cut: ``(max_bytes, max_samples)``, the shard limits.
        shuffle: ``(shuffle, seed)``: plan a seeded permutation of the rows instead of spans.
        present_rows: Rows whose keys are already in the destination (sorted): left out.
        present_problem: What to record for such a row.
    """
    max_bytes, max_samples = cut
    shuffled, seed = shuffle
    cutter = ShardCutter(max_bytes, max_samples)
    builder = SpanBuilder(prefix)
    keep_sizes = shuffled and max_samples is None and max_bytes is not None
    rows_kept: list[np.ndarray[Any, Any]] = []
    sizes_kept: list[np.ndarray[Any, Any]] = []
    problems: list[SkippedInput] = []
    dups: list[SkippedInput] = []
    samples = total = 0
    for block in blocks:
        n = len(block.ok)
        ok = block.ok
        if len(present_rows):
            lo, hi = np.searchsorted(present_rows, [block.first_row, block.first_row + n])
            if hi > lo:
                hit = np.zeros(n, dtype=bool)
                hit[present_rows[lo:hi] - block.first_row] = True
                hit &= ok
                dups.extend(present_problem(block.first_row + i) for i in np.flatnonzero(hit).tolist())
                ok = ok & ~hit
        problems.extend(p for _, p in block.problems)
        good = np.flatnonzero(ok)
        samples += len(good)
        total += n
        if shuffled:
            rows_kept.append(good + block.first_row)
            if keep_sizes:
                sizes_kept.append(block.sizes[good])
        else:
            builder.feed(block, ok, cutter.feed(block.sizes[good]))
    if not shuffled:
        return TablePlan(builder.finish(), problems, dups, samples, total)
    # A global permutation: O(rows) by nature (the one case that keeps an array of rows).
    rows = np.concatenate(rows_kept) if rows_kept else np.zeros(0, np.int64)
    order = np.random.default_rng(seed).permutation(len(rows))
    rows = rows[order]
    if keep_sizes:
        sizes = (np.concatenate(sizes_kept) if sizes_kept else np.zeros(0, np.int64))[order]
    else:
        sizes = np.zeros(len(rows), dtype=np.int64)  # only the count matters
    bounds = cuts(sizes, max_bytes, max_samples)
    shards: list[Sequence[Item]] = [RowList(prefix, rows[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return TablePlan(shards if len(rows) else [], problems, dups, samples, total)


def present_rows_of(prefix: str, present: set[str]) -> np.ndarray[Any, Any]:
    """The rows of a table whose keys (see :func:`row_key`) are in ``present`` (sorted)."""
    head = prefix + "/"
    rows = []
    for key in present:
        if key.startswith(head):
            tail = key[len(head) :]
            if tail.isascii() and tail.isdigit() and f"{int(tail):010d}" == tail:
                rows.append(int(tail))
    return np.unique(np.array(rows, dtype=np.int64))
