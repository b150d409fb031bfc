"""Parquet tables: a block is a batch of a row group; the digest is the file's footer."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .blocks import Block, BlockReader

__all__ = ["ParquetBlocks", "is_image_type"]


def is_image_type(t: Any) -> bool:
    """True if the Arrow type ``t`` holds image bytes: binary, or a struct with a binary ``bytes`` field."""
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if "bytes" in names:
            inner = t.field("bytes").type
            return bool(pa.types.is_binary(inner) or pa.types.is_large_binary(inner))
    return False


class ParquetBlocks(BlockReader):
    """Reads a Parquet table by row groups, ``batch_rows`` rows decoded at a time."""

    kind = "parquet"
    extensions = (".parquet", ".pq")

    def read_columns(self) -> dict[str, Any]:
        """The schema's names and types."""
        import pyarrow.parquet as pq

        with self.open() as f:
            schema = pq.ParquetFile(f).schema_arrow
        self.check_unique(schema.names)
        self.schema = schema
        return {name: schema.field(name).type for name in schema.names}

    def class_names(self, column: str) -> tuple[str, ...] | None:
        """The names of ``column``'s Hugging Face ``ClassLabel`` (after :meth:`read_columns`), else ``None``."""
        from streamload.formats.parquet import class_label_names

        schema = getattr(self, "schema", None)
        return class_label_names(schema, column, self.url) if schema is not None and column else None

    def image_column(self, columns: Mapping[str, Any]) -> str | None:
        """The first column of image bytes (see :func:`is_image_type`)."""
        return next((name for name, t in columns.items() if is_image_type(t)), None)

    def read_blocks(
        self, columns: Sequence[str], position: int | None, position_row: int, hasher: Any
    ) -> Iterator[Block]:
        """Yield the batches of each row group from row group ``position`` on."""
        import pyarrow.parquet as pq

        with self.open() as f:
            pf = pq.ParquetFile(f)
            row = position_row
            for g in range(position or 0, pf.num_row_groups):
                group_row = row
                for batch in pf.iter_batches(
                    batch_size=self.batch_rows, row_groups=[g], columns=list(columns), use_threads=False
                ):
                    yield g, group_row, row, {c: batch.column(c) for c in columns}
                    row += batch.num_rows

    def block_index(self) -> np.ndarray[Any, Any]:
        """``(row group, first row)`` of every row group, from the footer."""
        import pyarrow.parquet as pq

        try:
            with self.open() as f:
                md = pq.ParquetFile(f).metadata
        except OSError as exc:
            raise self.fail(exc) from exc
        counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        return np.stack([np.arange(len(counts)), np.cumsum([0, *counts])[:-1]], axis=1).astype(np.int64)

    def digest(self, hasher: Any) -> str:
        """A SHA-256 of the footer (schema, column chunks' sizes and statistics) and the file's size."""
        try:
            with self.open() as f:
                size = f.seek(0, 2)
                f.seek(size - 8)
                tail = f.read(8)
                length = int.from_bytes(tail[:4], "little")
                f.seek(max(size - 8 - length, 0))
                footer = f.read(length)
        except OSError as exc:
            raise self.fail(exc) from exc
        return hashlib.sha256(footer + size.to_bytes(8, "little")).hexdigest()
