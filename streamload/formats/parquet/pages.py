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
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["Unsupported", "decode_chunk"]

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


def decode_chunk(
    chunk: Any, column: Any, max_def: int, max_rep: int, rows: int
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Decode one ``BYTE_ARRAY`` column chunk's values to spans in its pages.

    Args:
        chunk: The chunk's bytes (from its dictionary page, or first data page, on).
        column: Its pyarrow ``ColumnChunkMetaData`` (codec, declared sizes and values).
        max_def: The column's largest definition level (0: not nullable).
        max_rep: Its largest repetition level (only 0 is read).
        rows: The rows the row group declares.

    Returns:
        ``(pages, page, starts, ends)``: the pages (decompressed, or views of ``chunk``), and
        per row the page its value lies in and its span there (a null row: an empty span).

    Raises:
        Unsupported: Something this decoder does not read.
        ValueError: The chunk does not decode as declared.
    """
    if max_rep != 0 or column.physical_type != "BYTE_ARRAY":
        raise Unsupported("not a flat BYTE_ARRAY column")
    if column.compression not in _CODECS:
        raise Unsupported(f"codec {column.compression}")
    codec = _CODECS[column.compression]
    chunk = memoryview(chunk).cast("B")
    budget = int(column.total_uncompressed_size)
    pages: list[np.ndarray] = []
    filled = 0
    starts = np.zeros(rows, dtype=np.int64)
    ends = np.zeros(rows, dtype=np.int64)
    page_of = np.zeros(rows, dtype=np.int32)
    dictionary: tuple[int, np.ndarray, np.ndarray] | None = None
    row = pos = 0
    while row < rows:
        reader = _Thrift(chunk, pos, min(len(chunk), pos + _MAX_HEADER))
        header = reader.struct()
        pos = reader.pos
        kind, size, stored = header.get(1), header.get(2), header.get(3)
        if not isinstance(size, int) or not isinstance(stored, int) or size < 0 or stored < 0:
            raise ValueError("page header without sizes")
        if pos + stored > len(chunk):
            raise ValueError("page runs past the column chunk")
        body = chunk[pos : pos + stored]
        pos += stored
        if kind not in (_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2):
            continue  # index pages and the like carry no values
        v2 = header.get(8) if kind == _DATA_PAGE_V2 else None
        levels = 0
        if v2 is not None:  # levels stored uncompressed ahead of the values
            levels = int(v2.get(5, 0)) + int(v2.get(6, 0))
            if levels < 0 or levels > min(size, stored):
                raise ValueError("page levels larger than the page")
        compressed = codec is not None and (v2 is None or v2.get(7, True) is not False)
        if filled + size > budget:
            raise ValueError("pages decompress past the chunk's declared size")
        if compressed:
            out = pa.decompress(body[levels:], decompressed_size=size - levels, codec=codec, asbytes=bool(levels))
            page = bytes(body[:levels]) + out if levels else out
        else:
            page = body
        if len(page) != size:  # (a pyarrow Buffer, bytes or a view of the chunk)
            raise ValueError("page decompresses to another size than declared")
        filled += size
        base = 0
        pages.append(np.frombuffer(page, dtype=np.uint8))
        if kind == _DICTIONARY_PAGE:
            info = header.get(7) or {}
            count, encoding = info.get(1), info.get(2, _PLAIN)
            if encoding not in (_PLAIN, _PLAIN_DICTIONARY) or not isinstance(count, int) or count < 0:
                raise Unsupported(f"dictionary encoding {encoding}")
            lo, hi = _plain_spans(page, base, 0, size, count)
            dictionary = (len(pages) - 1, np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))
            continue
        info = v2 if v2 is not None else header.get(5)
        if not isinstance(info, dict):
            raise ValueError("data page without its header")
        count = info.get(1)
        encoding = info.get(4) if v2 is not None else info.get(2)
        if not isinstance(count, int) or count < 0 or row + count > rows:
            raise ValueError("data page holds more values than the row group's rows")
        at = 0
        if max_def == 0:
            present = np.ones(count, dtype=bool)
        else:
            width = int(max_def).bit_length()
            if v2 is not None:
                span = int(v2.get(5, 0))
                lv = _hybrid(np.frombuffer(page, dtype=np.uint8, count=span, offset=int(v2.get(6, 0))), width, count)
                at = levels
            else:
                if info.get(3, _RLE) != _RLE:
                    raise Unsupported("definition levels not RLE")
                span = int.from_bytes(page[0:4], "little")
                if 4 + span > size:
                    raise ValueError("definition levels run past their page")
                lv = _hybrid(np.frombuffer(page, dtype=np.uint8, count=span, offset=4), width, count)
                at = 4 + span
            present = lv == max_def
        values = int(np.count_nonzero(present))
        where = row + np.flatnonzero(present)
        if encoding == _PLAIN:
            lo, hi = _plain_spans(page, base, at, size, values)
            starts[where], ends[where] = lo, hi
            page_of[row : row + count] = len(pages) - 1
        elif encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
            if dictionary is None:
                raise ValueError("dictionary-encoded page without a dictionary")
            if values:
                if at >= size:
                    raise ValueError("dictionary indices missing")
                width = page[at]
                if width > 32:
                    raise ValueError("dictionary index width past 32 bits")
                idx = _hybrid(np.frombuffer(page, dtype=np.uint8, offset=at + 1), width, values)
                if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(dictionary[1])):
                    raise ValueError("dictionary index out of range")
                starts[where], ends[where] = dictionary[1][idx], dictionary[2][idx]
                page_of[where] = dictionary[0]
        else:
            raise Unsupported(f"value encoding {encoding}")
        row += count
    return pages, page_of, starts, ends
