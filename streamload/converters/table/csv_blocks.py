"""CSV tables: blocks cut at line ends, each parsed with the header line before it.

CSV follows pyarrow's default of no line breaks inside values (``newlines_in_values``
off); CRLF line ends, quoting and blank lines are fine. The column types are inferred
once, from the first block, and fixed for every block (path and label columns as text).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from streamload._errors import SourceError

from ..source import printable
from .blocks import TextBlocks

__all__ = ["CsvBlocks"]


class CsvBlocks(TextBlocks):
    """Reads a CSV table; keeps its header line, where its data starts and its column types."""

    kind = "csv"
    extensions = (".csv",)

    def __init__(self, url: str, open_table: Callable[[], Any], block_bytes: int, batch_rows: int) -> None:
        super().__init__(url, open_table, block_bytes, batch_rows)
        self.header = b""  # the header line, parsed before each block
        self.start = 0  # the byte offset of the first line after it
        self.types: dict[str, Any] = {}  # column types, inferred once from the first block

    def read_columns(self) -> dict[str, Any]:
        """Find the header line and read the column names and inferred types."""
        import pyarrow.csv as pcsv

        with self.open() as f:
            offset = 0
            for line in f:
                offset += len(line)
                if line.strip(b"\r\n"):
                    self.header = line if line.endswith(b"\n") else line + b"\n"
                    break
            self.start = offset
            f.seek(0)
            reader = pcsv.open_csv(f, read_options=pcsv.ReadOptions(block_size=1 << 20))
            schema = reader.schema
            reader.close()  # before the file closes: its reading thread must not outlive it
        self.check_unique(schema.names)
        return {name: schema.field(name).type for name in schema.names}

    def fix_types(self, columns: Mapping[str, Any], strings: set[str]) -> None:
        """Read ``strings`` (the path and label columns) and columns of no known type as text."""
        import pyarrow as pa

        self.types = {name: pa.string() if name in strings or pa.types.is_null(t) else t for name, t in columns.items()}

    def hash_prelude(self, hasher: Any) -> None:
        """The header line is part of the digest."""
        hasher.update(self.header)

    def parse(self, data: bytes, columns: Sequence[str], offset: int, first_row: int) -> dict[str, Any]:
        """Parse a block with the header line before it."""
        import pyarrow as pa
        import pyarrow.csv as pcsv

        text = self.header + data
        try:
            table = pcsv.read_csv(
                pa.BufferReader(text),
                read_options=pcsv.ReadOptions(use_threads=False, block_size=min(len(text) + 1, 2**31 - 1)),
                convert_options=pcsv.ConvertOptions(
                    column_types={c: self.types[c] for c in columns if c in self.types},
                    include_columns=list(columns),
                ),
            )
        except (ValueError, pa.ArrowException) as exc:
            raise SourceError(f"{self.url}: cannot read the CSV block at byte {offset}: {printable(str(exc))}") from exc
        return {c: table.column(c) for c in columns}
