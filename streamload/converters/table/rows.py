"""A planned shard's rows read back from the table.

A span is read block by block from its first; a list of rows by the blocks that hold them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from streamload._errors import SourceError

from .checks import pylist
from .spans import RowSpan, TableItem, row_key

__all__ = ["blocks_of", "list_items", "span_items"]


def span_items(reader: Any, columns: Sequence[str], prefix: str, span: RowSpan) -> Iterator[TableItem]:
    """The rows of ``span`` with the values of ``columns``, read from its block on, leaving its excluded rows out."""
    skip = set(span.excluded)
    for _, _, first_row, block in reader.blocks(columns, span.position, span.position_row):
        if first_row >= span.stop:
            break
        n = len(block[columns[0]])
        lo, hi = max(span.first - first_row, 0), min(span.stop - first_row, n)
        if lo >= hi:
            continue
        values = {c: pylist(block[c], lo, hi) for c in columns}
        for i in range(hi - lo):
            row = first_row + lo + i
            if row not in skip:
                yield TableItem(row_key(prefix, row), 0, row, {c: values[c][i] for c in columns})


def blocks_of(index: np.ndarray[Any, Any], rows: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
    """The ``(position, row)`` of each block holding one of ``rows`` (sorted).

    ``index`` has a row ``(position, first row)`` per block of the table.
    """
    which = np.unique(np.searchsorted(index[:, 1], rows, side="right") - 1)
    return [(int(index[k, 0]), int(index[k, 1])) for k in which.tolist() if k >= 0]


def list_items(
    reader: Any,
    columns: Sequence[str],
    prefix: str,
    order: np.ndarray[Any, Any],
    index: np.ndarray[Any, Any] | None,
    where: Callable[[int], str],
) -> Iterator[TableItem]:
    """The rows of ``order`` (in that order) with the values of ``columns``, read from the blocks that hold them.

    Args:
        reader: The table's block reader.
        columns: The columns read.
        prefix: The keys' prefix.
        order: The rows.
        index: ``(position, first row)`` of every block (``None``: read from the start).
        where: Names a row, for the messages.

    Raises:
        SourceError: If a row is not in the table (it changed since the scan).
    """
    wanted = np.unique(order)
    found: dict[int, dict[str, Any]] = {}
    indexed = index is not None and len(index) > 0
    blocks = blocks_of(index, wanted) if index is not None and indexed else [(reader.start, 0)]
    for position, position_row in blocks:
        for pos, _, first_row, block in reader.blocks(columns, position, position_row):
            if first_row > int(wanted[-1]) or (indexed and pos != position):
                break  # past the last row wanted, or (indexed) past the block at this position
            n = len(block[columns[0]])
            lo, hi = np.searchsorted(wanted, [first_row, first_row + n])
            if hi > lo:
                cols = {c: pylist(block[c]) for c in columns}
                for i in (wanted[lo:hi] - first_row).tolist():
                    found[first_row + i] = {c: cols[c][i] for c in columns}
            if indexed and reader.one_block_per_position:
                break  # the block of the index: exactly one
    for row in order.tolist():
        values = found.get(row)
        if values is None:
            raise SourceError(f"{where(row)}: the table has no such row (has it changed since the scan?)")
        yield TableItem(row_key(prefix, row), 0, row, values)
