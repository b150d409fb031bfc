"""How a table kind is read a block at a time: the :class:`BlockReader` interface.

One reader per table kind (:mod:`.parquet_blocks`, :mod:`.csv_blocks`,
:mod:`.jsonl_blocks`), each keeping the state its kind needs (a CSV header, the column
types fixed once). A block is a dict of columns (Arrow arrays, or Python lists for JSONL)
and is found again by its *position*: a Parquet row group, or the byte offset of a text
block. :class:`TextBlocks` holds what CSV and JSONL share: blocks cut at line ends and a
digest of every byte read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import xxhash

from streamload._classes import repeated
from streamload._errors import SourceError, StreamloadError

from ..source import printable

__all__ = ["Block", "BlockReader", "TextBlocks"]

#: ``(position, position_row, first_row, columns)``: a block, where it is found and its first row.
Block = tuple[int, int, int, dict[str, Any]]


class BlockReader(ABC):
    """Reads one table kind a block at a time; picklable (a task reads its own blocks).

    Args:
        url: The table (a local path or an fsspec URL), for messages.
        open_table: Opens the table for binary reading (the source's: it knows where the table is).
        block_bytes: Bytes per block of a text table.
        batch_rows: Rows per batch of a Parquet row group.

    Both sizes are fixed when the source is made, so that every task cuts the table into
    the blocks the scan saw.
    """

    #: The kind's name, as the manifest records it (``source_table``).
    kind: ClassVar[str]
    #: The file extensions of the kind (lower case, with the dot).
    extensions: ClassVar[tuple[str, ...]]
    #: Where reading starts when no position is given (a text table's first data line).
    start: int = 0
    #: Whether a position holds one block (a text block's offset), not several (a row group's batches).
    one_block_per_position: ClassVar[bool] = False

    def __init__(self, url: str, open_table: Callable[[], Any], block_bytes: int, batch_rows: int) -> None:
        self.url = url
        self.open_table = open_table
        self.block_bytes = block_bytes
        self.batch_rows = batch_rows

    def open(self) -> Any:
        """Open the table for binary reading."""
        return self.open_table()

    def fail(self, exc: BaseException) -> SourceError:
        """The error that names the table for ``exc``, an error of reading it."""
        if isinstance(exc, FileNotFoundError):
            return SourceError(f"{self.url}: the table does not exist")
        return SourceError(f"{self.url}: cannot read the table: {printable(str(exc))}")

    def check_unique(self, names: Sequence[str]) -> None:
        """Refuse a header naming a column twice (which of the two would a row's value be?)."""
        twice = repeated(names)
        if twice:
            raise SourceError(
                f"{self.url}: the header names column(s) {', '.join(map(repr, map(printable, twice)))} more than once; "
                "give every column its own name"
            )

    def columns(self) -> dict[str, Any]:
        """Return the table's column names and (Arrow) types.

        Raises:
            SourceError: If the table cannot be read.
        """
        import pyarrow as pa

        try:
            return self.read_columns()
        except StreamloadError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise self.fail(exc) from exc

    def blocks(
        self, columns: Sequence[str], position: int | None = None, position_row: int = 0, hasher: Any = None
    ) -> Iterator[Block]:
        """Yield the blocks from ``position`` on (``None``: the start of the data).

        ``position_row`` is the row number at ``position``; ``hasher`` (from
        :meth:`new_hasher`) is fed what the digest covers.

        Raises:
            SourceError: If the table cannot be read.
        """
        import pyarrow as pa

        try:
            yield from self.read_blocks(columns, position, position_row, hasher)
        except StreamloadError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise self.fail(exc) from exc

    def class_names(self, column: str) -> tuple[str, ...] | None:
        """The class names the table's own schema gives ``column`` (a Hugging Face ``ClassLabel``), else ``None``."""
        return None

    @abstractmethod
    def read_columns(self) -> dict[str, Any]:
        """Read the column names and types (errors of reading are named by :meth:`columns`)."""

    @abstractmethod
    def read_blocks(
        self, columns: Sequence[str], position: int | None, position_row: int, hasher: Any
    ) -> Iterator[Block]:
        """Read the blocks (errors of reading are named by :meth:`blocks`)."""

    def fix_types(self, columns: Mapping[str, Any], strings: set[str]) -> None:
        """Fix how columns are read from now on (``strings``: read as text); most kinds need not."""
        return None

    def image_column(self, columns: Mapping[str, Any]) -> str | None:
        """The column that holds image bytes, if the kind's types tell (``None``: not known)."""
        return None

    def block_index(self) -> np.ndarray[Any, Any] | None:
        """``(position, row)`` of every block, if the kind knows it without a scan (``None``: it does not)."""
        return None

    def new_hasher(self) -> Any:
        """A hasher the scan feeds, or ``None`` when :meth:`digest` needs none."""
        return None

    @abstractmethod
    def digest(self, hasher: Any) -> str:
        """A digest of the table's content, after a scan fed ``hasher``."""


class TextBlocks(BlockReader):
    """A table of lines (CSV, JSONL): blocks of about ``block_bytes``, each ending at a line end."""

    one_block_per_position = True

    def raw_blocks(self, f: Any, offset: int, hasher: Any = None) -> Iterator[tuple[int, bytes]]:
        """Yield ``(offset, bytes)`` blocks of the file from ``offset``, each ending at a line end.

        A block ends at the first line end at or after ``offset + block_bytes - 1`` (or at
        the end of the file), so blocks depend only on where reading starts.
        """
        size = self.block_bytes
        f.seek(offset)
        buf = b""
        eof = False
        while True:
            cut = buf.find(b"\n", size - 1) if len(buf) >= size else -1
            while cut < 0 and not eof:
                chunk = f.read(size)
                if not chunk:
                    eof = True
                    break
                if hasher is not None:
                    hasher.update(chunk)
                buf += chunk
                if len(buf) >= size:
                    cut = buf.find(b"\n", size - 1)
            if not buf:
                return
            end = cut + 1 if cut >= 0 else len(buf)
            yield offset, buf[:end]
            offset += end
            buf = buf[end:]

    def new_hasher(self) -> Any:
        """An xxh3-128 of every byte the scan reads."""
        return xxhash.xxh3_128()

    def digest(self, hasher: Any) -> str:
        """The hex digest of every byte read."""
        return str(hasher.hexdigest())

    def read_blocks(
        self, columns: Sequence[str], position: int | None, position_row: int, hasher: Any
    ) -> Iterator[Block]:
        """Parse each text block from ``position`` (a byte offset) on."""
        with self.open() as f:
            start = self.start if position is None else position
            if hasher is not None:
                self.hash_prelude(hasher)
            row = position_row
            for offset, data in self.raw_blocks(f, start, hasher):
                block = self.parse(data, columns, offset, row)
                yield offset, row, row, block
                row += len(block[columns[0]])

    def hash_prelude(self, hasher: Any) -> None:
        """Feed ``hasher`` what precedes the blocks in the digest (CSV: its header)."""

    @abstractmethod
    def parse(self, data: bytes, columns: Sequence[str], offset: int, first_row: int) -> dict[str, Any]:
        """Parse one block of lines into columns."""
