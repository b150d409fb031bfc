"""The bounds a Parquet file must keep before a byte of its data is read (hostile or broken files).

The footer's size and its Thrift containers are bounded; every column chunk must lie
inside the file; the column chunks one row-group read decompresses are bounded
(:data:`MAX_ROW_GROUP_BYTES`, at most :data:`MAX_EXPANSION` times their stored size: a
decompression bomb is refused before it is read); the row groups must hold the rows the
footer declares. Each breach is a :class:`~streamload.CorruptShardError` naming the file.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ..._errors import CorruptShardError
from ..base import ShardBytes
from .schema import THRIFT_STRING_LIMIT

__all__ = [
    "MAX_EXPANSION",
    "MAX_FOOTER_BYTES",
    "MAX_ROW_GROUP_BYTES",
    "SourceFile",
    "bad",
    "check_footer",
    "check_footer_size",
    "chunk_start",
    "open_parquet",
]

#: Decompressed bytes one row-group read may produce (the needed column chunks together).
MAX_ROW_GROUP_BYTES = 1 << 30
#: Largest ratio of decompressed to stored bytes of a row-group read (plus 1 MiB of slack).
MAX_EXPANSION = 1000
_SLACK = 1 << 20
#: Largest Parquet footer read (bytes), and Thrift limits while parsing it.
MAX_FOOTER_BYTES = 64 << 20
_THRIFT_CONTAINER_LIMIT = 1 << 20


def bad(name: str, detail: str) -> CorruptShardError:
    """A :class:`~streamload.CorruptShardError` naming the file ``name``."""
    return CorruptShardError(f"{name}: {detail}")


def open_parquet(source: Any, name: str, metadata: Any = None, pre_buffer: bool = True) -> Any:
    """A pyarrow ``ParquetFile`` over ``source``, its footer bounded; errors name ``name``."""
    try:
        return pq.ParquetFile(
            source,
            metadata=metadata,
            thrift_string_size_limit=THRIFT_STRING_LIMIT,
            thrift_container_size_limit=_THRIFT_CONTAINER_LIMIT,
            pre_buffer=pre_buffer,
        )
    except Exception as exc:  # ArrowInvalid, OSError...: a damaged footer or not Parquet at all
        raise bad(name, f"not a readable Parquet file ({type(exc).__name__}: {exc})") from exc


def check_footer(md: Any, size: int, name: str, columns: Sequence[str]) -> np.ndarray:
    """Check every row group's column chunks against the file and the bounds; return the needed extents.

    Returns:
        ``int64[row_groups, 2]``: per row group, the byte span of the chunks of ``columns``
        (leaf paths, or their parents).
    """
    extents = np.zeros((md.num_row_groups, 2), dtype=np.int64)
    rows = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows < 0:
            raise bad(name, f"row group {g} declares {rg.num_rows} rows")
        rows += rg.num_rows
        if rg.num_rows == 0:  # nothing is read from an empty row group (pyarrow writes its chunks at 0)
            continue
        lo, hi, stored, expanded = size, 0, 0, 0
        for j in range(rg.num_columns):
            col = rg.column(j)
            start = chunk_start(col)
            end = start + col.total_compressed_size
            if start < 4 or col.total_compressed_size < 0 or end > size:
                raise bad(
                    name,
                    f"row group {g} column {col.path_in_schema!r} lies at bytes {start}..{end}, "
                    f"outside the file of {size} bytes",
                )
            path = col.path_in_schema
            if any(path == c or path.startswith(c + ".") for c in columns):
                lo, hi = min(lo, start), max(hi, end)
                stored += col.total_compressed_size
                expanded += col.total_uncompressed_size
        if expanded > MAX_ROW_GROUP_BYTES or expanded > MAX_EXPANSION * stored + _SLACK:
            raise bad(
                name,
                f"row group {g} declares {expanded} decompressed bytes for {stored} stored ones "
                f"(a decompression bomb? at most {MAX_ROW_GROUP_BYTES} bytes and {MAX_EXPANSION}x)",
            )
        extents[g] = (lo, hi) if hi else (0, 0)
    if rows != md.num_rows:
        raise bad(name, f"row groups hold {rows} rows but the footer declares {md.num_rows}")
    return extents


def check_footer_size(path: str, size: int, name: str) -> None:
    """Refuse a file too short for Parquet, without its magic, or whose footer claims too much."""
    with open(path, "rb") as f:
        head = f.read(4)
        if size < 12:
            raise bad(name, f"not a Parquet file ({size} bytes)")
        f.seek(size - 8)
        tail = f.read(8)
    if head != b"PAR1" or tail[4:] != b"PAR1":
        raise bad(name, "not a Parquet file (no PAR1 magic at its start and end)")
    footer = int.from_bytes(tail[:4], "little")
    if footer > min(size - 12, MAX_FOOTER_BYTES):
        raise bad(name, f"its footer claims {footer} bytes (the file has {size}; at most {MAX_FOOTER_BYTES})")


class SourceFile(io.RawIOBase):
    """A read-only, seekable file over :class:`ShardBytes` (ranged reads), for pyarrow."""

    def __init__(self, source: ShardBytes) -> None:
        super().__init__()
        self.source = source
        self.pos = 0

    def readable(self) -> bool:
        """Always: it is read."""
        return True

    def seekable(self) -> bool:
        """Always: reads are positioned."""
        return True

    def tell(self) -> int:
        """The position."""
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move to ``offset`` from the start, the position or the end (``whence`` 0, 1, 2)."""
        base = {0: 0, 1: self.pos, 2: self.source.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` from the position (short only at the end); return the bytes read."""
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self.source.size - self.pos))
        if not want:
            return 0
        got = self.source.preadv([view[:want]], self.pos)
        self.pos += got
        return got


def chunk_start(col: Any) -> int:
    """Where column chunk ``col`` (footer metadata) starts: its dictionary page, else its first data page."""
    start = int(col.data_page_offset)
    if col.has_dictionary_page and col.dictionary_page_offset is not None and col.dictionary_page_offset > 0:
        start = min(start, int(col.dictionary_page_offset))
    return start
