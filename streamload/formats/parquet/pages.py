"""One Parquet ``BYTE_ARRAY`` column chunk decoded straight from its pages, for image bytes.

pyarrow builds an arrow array of a row group (a copy of every value, dictionary values
gathered) at several times the cost of the chunk's decompression. Images need less: each
row's byte span. :func:`decode_chunk` reads the chunk's pages (Thrift compact headers),
decompresses each with :func:`pyarrow.decompress` into one buffer, and returns, per row,
the span of its value there: a PLAIN value where it lies, a dictionary-encoded one where
its dictionary entry lies (nothing gathered).

Only what it understands: data pages v1 and v2, PLAIN, PLAIN_DICTIONARY and
RLE_DICTIONARY values, definition levels (RLE), no repetition (not a list), the codecs
pyarrow decompresses. Anything else raises :class:`Unsupported` and the caller reads the
row group through pyarrow. A damaged chunk raises ``ValueError``; nothing here is trusted
either way: the caller checks every row against its digest.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "HEADER_PROBE",
    "ChunkPages",
    "Decoded",
    "Page",
    "Unsupported",
    "decode_chunk",
    "inflate",
    "walk",
]

#: Parquet compression codecs (footer names) and pyarrow's names for them.
_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "ZSTD": "zstd", "GZIP": "gzip", "BROTLI": "brotli"}
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
#: Largest page header accepted (bytes), and nesting of its structs.
_MAX_HEADER = 1 << 16
_MAX_DEPTH = 8


_U32 = struct.Struct("<I")


class Unsupported(Exception):
    """The chunk uses something this decoder does not read (the caller uses pyarrow)."""


class _Thrift:
    """A Thrift compact-protocol reader over ``buf`` from ``pos`` (structs as ``{field id: value}``)."""

    def __init__(self, buf: Any, pos: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, pos, end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise ValueError("page header runs past the column chunk")
        b = int(self.buf[self.pos])
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("varint too long in a page header")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int, depth: int) -> Any:
        if kind in (1, 2):  # booleans in a list: one byte each
            return kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            self.pos += 8
            return None
        if kind == 8:
            n = self.varint()
            self.pos += n
            if self.pos > self.end:
                raise ValueError("page header string runs past the column chunk")
            return None
        if kind in (9, 10):
            head = self.byte()
            n, inner = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            if n > _MAX_HEADER:
                raise ValueError("page header list too long")
            for _ in range(n):
                self.value(inner, depth + 1) if inner not in (1, 2) else self.byte()
            return None
        if kind == 11:
            n = self.varint()
            if n > _MAX_HEADER:
                raise ValueError("page header map too long")
            if n:
                types = self.byte()
                for _ in range(n):
                    self.value(types >> 4, depth + 1)
                    self.value(types & 0x0F, depth + 1)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        raise ValueError(f"unknown Thrift type {kind} in a page header")

    def struct(self, depth: int = 0) -> dict[int, Any]:
        if depth > _MAX_DEPTH:
            raise ValueError("page header nested too deep")
        out: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return out
            kind, delta = head & 0x0F, head >> 4
            fid = last + delta if delta else self.zigzag()
            out[fid] = self.value(kind, depth)
            last = fid


def _hybrid(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """Decode ``count`` values of the RLE/bit-packed hybrid encoding of bit width ``width``."""
    out = np.empty(count, dtype=np.int64)
    raw = buf.tobytes() if width else b""
    pos = done = 0
    step = (width + 7) // 8
    weights = (1 << np.arange(width, dtype=np.int64)) if width else None
    while done < count:
        if width == 0:
            out[done:] = 0
            break
        t = _Thrift(raw, pos, len(raw))
        header = t.varint()
        pos = t.pos
        if header & 1:  # bit-packed groups of 8 values
            groups = header >> 1
            nbytes = groups * width
            if pos + nbytes > len(raw):
                nbytes = len(raw) - pos  # the last group may be cut short
            bits = np.unpackbits(buf[pos : pos + nbytes], bitorder="little")
            n = min(len(bits) // width, groups * 8, count - done)
            assert weights is not None
            out[done : done + n] = bits[: n * width].reshape(n, width).astype(np.int64) @ weights
            pos += groups * width
            done += n
            if n == 0:
                raise ValueError("bit-packed run holds no values")
        else:
            n = min(header >> 1, count - done)
            if n <= 0 or pos + step > len(raw):
                raise ValueError("RLE run is empty or cut short")
            out[done : done + n] = int.from_bytes(raw[pos : pos + step], "little")
            pos += step
            done += n
    return out


def _plain_spans(data: Any, base: int, start: int, end: int, count: int) -> tuple[list[int], list[int]]:
    """Spans (offsets ``base`` + position in ``data``) of ``count`` PLAIN byte arrays in ``data[start:end]``."""
    lo: list[int] = []
    hi: list[int] = []
    add_lo, add_hi, unpack = lo.append, hi.append, _U32.unpack_from
    pos = start
    try:
        for _ in range(count):  # positions only grow: one bounds check at the end
            pos += 4
            add_lo(pos)
            pos += unpack(data, pos - 4)[0]
            add_hi(pos)
    except struct.error:
        raise ValueError("PLAIN values run past their page") from None
    if pos > end:
        raise ValueError("PLAIN value runs past its page")
    if base:
        return [base + p for p in lo], [base + p for p in hi]
    return lo, hi


#: Bytes read for a page header before reading more (pyarrow's headers are tens of bytes,
#: with page statistics a few KiB at most).
HEADER_PROBE = 1 << 10


@dataclass(frozen=True)
class Page:
    """One page of a column chunk, from its header: where its body lies and what it holds.

    ``at`` is the body's offset from the chunk's start; a data page holds rows
    ``first..first+count-1`` of its row group, a dictionary page ``count`` entries.
    """

    kind: int
    at: int
    stored: int
    size: int
    first: int
    count: int
    #: Value encoding; definition-level encoding (v1); v2: level bytes (repetition, definition), body compressed.
    encoding: int
    levels_encoding: int = _RLE
    level_bytes: tuple[int, int] | None = None
    compressed: bool = True


def _header(read: Callable[[int, int], Any], pos: int, length: int, probe: int) -> tuple[dict[int, Any], int]:
    """The page header at ``pos`` of a chunk of ``length`` bytes (read ``probe`` bytes first); and its end."""
    window = min(probe, length - pos)
    while True:
        buf = read(window, pos)
        reader = _Thrift(buf, 0, len(buf))
        try:
            return reader.struct(), pos + reader.pos
        except ValueError:
            whole = min(_MAX_HEADER, length - pos)
            if window >= whole or len(buf) < window:
                raise
            window = whole


def walk(read: Callable[[int, int], Any], length: int, rows: int, budget: int, probe: int = _MAX_HEADER) -> list[Page]:
    """The pages of a column chunk up to its last row, from their headers (bodies are not read).

    Args:
        read: ``read(n, offset)``: up to ``n`` bytes of the chunk at ``offset``.
        length: The chunk's stored size.
        rows: The rows its row group declares.
        budget: Decompressed bytes its pages may declare together (the footer's).
        probe: Bytes read for a header before reading more.

    Raises:
        Unsupported: A page this decoder does not read.
        ValueError: The headers do not describe the chunk.
    """
    pages: list[Page] = []
    pos = row = filled = 0
    while row < rows:
        if pos >= length:
            raise ValueError("page header runs past the column chunk")
        header, at = _header(read, pos, length, probe)
        kind, size, stored = header.get(1), header.get(2), header.get(3)
        if not isinstance(size, int) or not isinstance(stored, int) or size < 0 or stored < 0:
            raise ValueError("page header without sizes")
        if at + stored > length:
            raise ValueError("page runs past the column chunk")
        pos = at + stored
        if kind not in (_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2):
            continue  # index pages and the like carry no values
        filled += size
        if filled > budget:
            raise ValueError("pages decompress past the chunk's declared size")
        if kind == _DICTIONARY_PAGE:
            info = header.get(7) or {}
            count, encoding = info.get(1), info.get(2, _PLAIN)
            if encoding not in (_PLAIN, _PLAIN_DICTIONARY) or not isinstance(count, int) or count < 0:
                raise Unsupported(f"dictionary encoding {encoding}")
            if any(p.kind == _DICTIONARY_PAGE for p in pages):
                raise Unsupported("a second dictionary page")
            pages.append(Page(kind, at, stored, size, 0, count, _PLAIN))
            continue
        v2 = header.get(8) if kind == _DATA_PAGE_V2 else None
        info = v2 if v2 is not None else header.get(5)
        if not isinstance(info, dict):
            raise ValueError("data page without its header")
        count = info.get(1)
        if not isinstance(count, int) or count < 0 or row + count > rows:
            raise ValueError("data page holds more values than the row group's rows")
        if v2 is not None:
            levels = (int(v2.get(6, 0)), int(v2.get(5, 0)))  # repetition, definition
            if min(levels) < 0 or sum(levels) > min(size, stored):
                raise ValueError("page levels larger than the page")
            page = Page(
                kind, at, stored, size, row, count, int(info.get(4, -1)), _RLE, levels, v2.get(7, True) is not False
            )
        else:
            page = Page(kind, at, stored, size, row, count, int(info.get(2, -1)), int(info.get(3, _RLE)))
        pages.append(page)
        row += count
    return pages


def inflate(page: Page, body: Any, codec: str | None) -> Any:
    """A page's body decompressed (v2: its levels ahead, as stored); a view of ``body`` when stored as is."""
    levels = sum(page.level_bytes) if page.level_bytes is not None else 0
    if codec is not None and page.compressed:
        out = pa.decompress(body[levels:], decompressed_size=page.size - levels, codec=codec, asbytes=bool(levels))
        buf = bytes(body[:levels]) + out if levels else out
    else:
        buf = body
    if len(buf) != page.size:  # (a pyarrow Buffer, bytes or a view of the chunk)
        raise ValueError("page decompresses to another size than declared")
    return buf


def _present(page: Page, buf: Any, max_def: int) -> tuple[np.ndarray | None, int]:
    """Which of a data page's rows hold a value (``None``: all), and where its values start."""
    if max_def == 0:
        return None, 0
    width = int(max_def).bit_length()
    if page.level_bytes is not None:
        rep, span = page.level_bytes
        levels = _hybrid(np.frombuffer(buf, dtype=np.uint8, count=span, offset=rep), width, page.count)
        return levels == max_def, rep + span
    if page.levels_encoding != _RLE:
        raise Unsupported("definition levels not RLE")
    span = int.from_bytes(bytes(buf[0:4]), "little")
    if 4 + span > page.size:
        raise ValueError("definition levels run past their page")
    levels = _hybrid(np.frombuffer(buf, dtype=np.uint8, count=span, offset=4), width, page.count)
    return levels == max_def, 4 + span


#: Decoded pages of one row group: the buffers (the dictionary's first, empty until
#: needed), and per row its buffer and span there (buffer -1: its page not decoded yet).
Decoded = tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]

_EMPTY = np.zeros(0, dtype=np.uint8)


class ChunkPages:
    """A ``BYTE_ARRAY`` column chunk's pages, decoded on demand (a reader decodes only the pages it reads).

    Args:
        read: ``read(n, offset)``: up to ``n`` bytes of the chunk at ``offset``.
        column: Its pyarrow ``ColumnChunkMetaData`` (codec, declared sizes and values).
        max_def: The column's largest definition level (0: not nullable).
        max_rep: Its largest repetition level (only 0 is read).
        rows: The rows the row group declares.
        probe: Bytes read for a header before reading more.

    Raises:
        Unsupported: Something this decoder does not read.
        ValueError: The headers do not describe the chunk.
    """

    def __init__(
        self, read: Callable[[int, int], Any], column: Any, max_def: int, max_rep: int, rows: int, probe: int
    ) -> None:
        if max_rep != 0 or column.physical_type != "BYTE_ARRAY":
            raise Unsupported("not a flat BYTE_ARRAY column")
        if column.compression not in _CODECS:
            raise Unsupported(f"codec {column.compression}")
        self.codec = _CODECS[column.compression]
        self.max_def, self.rows = max_def, rows
        length = int(column.total_compressed_size)
        pages = walk(read, length, rows, int(column.total_uncompressed_size), probe)
        self.dictionary = next((p for p in pages if p.kind == _DICTIONARY_PAGE), None)
        self.data = [p for p in pages if p.kind != _DICTIONARY_PAGE]
        self.first = np.array([p.first for p in self.data] + [rows], dtype=np.int64)
        self._entries: tuple[np.ndarray, np.ndarray] | None = None  # the dictionary's spans

    def empty(self) -> Decoded:
        """A row group with no page decoded yet."""
        n = self.rows
        return [_EMPTY], np.full(n, -1, dtype=np.int32), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)

    def pages_of(self, rows: np.ndarray) -> list[int]:
        """The data pages holding ``rows`` (positions in the row group)."""
        return np.unique(np.searchsorted(self.first, rows, side="right") - 1).tolist()  # type: ignore[no-any-return]

    def decode(self, decoded: Decoded, pages: list[int], body: Callable[[Page], Any]) -> None:
        """Decode data pages ``pages`` into ``decoded`` (``body(page)``: its stored bytes)."""
        buffers, page_of, starts, ends = decoded
        for k in pages:
            page = self.data[k]
            buf = inflate(page, body(page), self.codec)
            present, at = _present(page, buf, self.max_def)
            values = page.count if present is None else int(np.count_nonzero(present))
            rows = (
                np.arange(page.first, page.first + page.count)
                if present is None
                else page.first + np.flatnonzero(present)
            )
            buffers.append(np.frombuffer(buf, dtype=np.uint8))
            page_of[page.first : page.first + page.count] = len(buffers) - 1  # a null row: an empty span here
            if page.encoding == _PLAIN:
                lo, hi = _plain_spans(buf, 0, at, page.size, values)
                starts[rows], ends[rows] = lo, hi
            elif page.encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
                entries = self._dictionary(buffers, body)
                if values:
                    if at >= page.size:
                        raise ValueError("dictionary indices missing")
                    width = int(buf[at])
                    if width > 32:
                        raise ValueError("dictionary index width past 32 bits")
                    idx = _hybrid(np.frombuffer(buf, dtype=np.uint8, offset=at + 1), width, values)
                    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(entries[0])):
                        raise ValueError("dictionary index out of range")
                    starts[rows], ends[rows] = entries[0][idx], entries[1][idx]
                    page_of[rows] = 0
            else:
                raise Unsupported(f"value encoding {page.encoding}")

    def _dictionary(self, buffers: list[np.ndarray], body: Callable[[Page], Any]) -> tuple[np.ndarray, np.ndarray]:
        """The dictionary's entry spans, its page decoded into ``buffers[0]`` if it is not yet."""
        page = self.dictionary
        if page is None:
            raise ValueError("dictionary-encoded page without a dictionary")
        if len(buffers[0]) != page.size:
            buf = inflate(page, body(page), self.codec)
            if self._entries is None:
                lo, hi = _plain_spans(buf, 0, 0, page.size, page.count)
                self._entries = (np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))
            buffers[0] = np.frombuffer(buf, dtype=np.uint8)
        assert self._entries is not None
        return self._entries


def decode_chunk(
    chunk: Any, column: Any, max_def: int, max_rep: int, rows: int
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Decode one whole ``BYTE_ARRAY`` column chunk's values to spans in its pages.

    Args:
        chunk: The chunk's bytes (from its dictionary page, or first data page, on).
        column: Its pyarrow ``ColumnChunkMetaData`` (codec, declared sizes and values).
        max_def: The column's largest definition level (0: not nullable).
        max_rep: Its largest repetition level (only 0 is read).
        rows: The rows the row group declares.

    Returns:
        ``(pages, page, starts, ends)``: the pages (decompressed, or views of ``chunk``;
        the dictionary's first, empty without one), and per row the page its value lies in
        and its span there (a null row: an empty span).

    Raises:
        Unsupported: Something this decoder does not read.
        ValueError: The chunk does not decode as declared.
    """
    view = memoryview(chunk).cast("B")
    if int(column.total_compressed_size) > len(view):
        raise ValueError("column chunk shorter than declared")
    pages = ChunkPages(lambda n, at: view[at : at + n], column, max_def, max_rep, rows, _MAX_HEADER)
    decoded = pages.empty()
    pages.decode(decoded, list(range(len(pages.data))), lambda page: view[page.at : page.at + page.stored])
    return decoded
