"""A sample as one binary record, for formats that store a whole sample as one value (LMDB).

Layout, little-endian, no pickle::

    u32 n_fields    u32 key_len
    n_fields x (u32 name_len, u64 size)     field table, fields in sorted name order
    key             UTF-8
    names           UTF-8, concatenated in table order
    data            the fields' bytes, concatenated in table order

A record is decoded only after its lengths add up to exactly its size, so a damaged
value gives :class:`~streamload.CorruptShardError` instead of a wrong sample.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .._errors import CorruptShardError
from .base import MAX_KEY_BYTES, Sample

__all__ = ["decode_record", "encode_record", "record_field", "record_payload_size"]

_HEAD = struct.Struct("<II")
_FIELD = struct.Struct("<IQ")
#: Longest field name accepted when decoding (a larger length is damage, not data).
_MAX_NAME_BYTES = 4096


def encode_record(key: str, fields: list[tuple[str, bytes]]) -> bytes:
    """Return the record of a sample; ``fields`` come from :func:`~.base.check_sample`."""
    key_raw = key.encode("utf-8", "surrogateescape")
    names = [name.encode("utf-8", "surrogateescape") for name, _ in fields]
    table = b"".join(_FIELD.pack(len(n), len(data)) for n, (_, data) in zip(names, fields, strict=True))
    return b"".join([_HEAD.pack(len(fields), len(key_raw)), table, key_raw, *names, *(d for _, d in fields)])


def _table(view: memoryview, where: str) -> tuple[int, list[tuple[int, int]], int]:
    """Parse and check the head and field table; return (key_len, [(name_len, size)], data start)."""
    total = len(view)
    if total < _HEAD.size:
        raise CorruptShardError(f"{where}: record of {total} bytes is shorter than its header")
    n_fields, key_len = _HEAD.unpack_from(view)
    if key_len > MAX_KEY_BYTES or _HEAD.size + n_fields * _FIELD.size > total:
        raise CorruptShardError(f"{where}: record header is damaged ({n_fields=}, {key_len=})")
    pos = _HEAD.size
    table = []
    used = _HEAD.size + n_fields * _FIELD.size + key_len
    for _ in range(n_fields):
        name_len, size = _FIELD.unpack_from(view, pos)
        pos += _FIELD.size
        if name_len > _MAX_NAME_BYTES:
            raise CorruptShardError(f"{where}: record field table is damaged ({name_len=})")
        table.append((name_len, size))
        used += name_len + size
    if used != total:
        raise CorruptShardError(f"{where}: record lengths add up to {used} bytes, the record has {total}")
    return key_len, table, pos


def decode_record(value: bytes | memoryview, where: str) -> Sample:
    """Return the sample held by a record; ``where`` names shard and sample in errors.

    Raises:
        CorruptShardError: If the record's lengths do not add up to its size.
    """
    view = memoryview(value)
    key_len, table, pos = _table(view, where)
    try:
        key = str(view[pos : pos + key_len], "utf-8", "surrogateescape")
        pos += key_len
        names = []
        for name_len, _ in table:
            names.append(str(view[pos : pos + name_len], "utf-8", "surrogateescape"))
            pos += name_len
    except UnicodeDecodeError as exc:  # pragma: no cover - surrogateescape decodes any bytes
        raise CorruptShardError(f"{where}: record key or field name is not UTF-8") from exc
    sample: Sample = {"__key__": key}
    for name, (_, size) in zip(names, table, strict=True):
        sample[name] = bytes(view[pos : pos + size])  # the one copy out of the map
        pos += size
    return sample


def record_payload_size(value: bytes | memoryview, where: str) -> int:
    """Return the payload bytes (sum of field sizes) of a record without copying its data."""
    _, table, _ = _table(memoryview(value), where)
    return sum(size for _, size in table)


def record_field(value: bytes | memoryview, fields: Sequence[str], where: str) -> tuple[str, memoryview | None]:
    """Return the record's key and a view of its first present field of ``fields`` (None if none).

    Nothing is copied: the view points into ``value``.
    """
    view = memoryview(value)
    key_len, table, pos = _table(view, where)
    key = str(view[pos : pos + key_len], "utf-8", "surrogateescape")
    pos += key_len
    names = []
    for name_len, _ in table:
        names.append(str(view[pos : pos + name_len], "utf-8", "surrogateescape"))
        pos += name_len
    starts = {}
    for name, (_, size) in zip(names, table, strict=True):
        starts[name] = (pos, size)
        pos += size
    for name in fields:
        if name in starts:
            at, size = starts[name]
            return key, view[at : at + size]
    return key, None
