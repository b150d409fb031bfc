"""A sample as one binary record, for formats that store a whole sample as one value (LMDB).

Layout, little-endian, no pickle::

    u64 xxh3_64     of everything after it (the record is "sealed")
    u32 n_fields    u32 key_len
    n_fields x (u32 name_len, u64 size)     field table, fields in sorted name order
    key             UTF-8
    names           UTF-8, concatenated in table order
    data            the fields' bytes, concatenated in table order

Every read checks the checksum (xxh3 runs at tens of GB/s: about a microsecond for a
64 KB image) and that the lengths add up to exactly the record's size, so a damaged
value gives :class:`~streamload.CorruptShardError` naming the shard and sample, never a
wrong sample. :func:`seal` / :func:`unseal` give other values (metadata) the same check.

Also the checks every reader shares on untrusted files: :func:`open_regular_file` (a
FIFO or device in the dataset would block or never end) and :func:`check_field_names`.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Sequence

import xxhash

from .._errors import CorruptShardError, ShardError, ShardNotFoundError, UnsafeShardError
from .base import MAX_KEY_BYTES, Sample, key_problem

__all__ = [
    "check_field_names",
    "decode_record",
    "encode_record",
    "open_regular_file",
    "record_field",
    "record_spans",
    "seal",
    "unseal",
]

_SUM = struct.Struct("<Q")
_HEAD = struct.Struct("<II")
_FIELD = struct.Struct("<IQ")
#: Longest field name accepted when decoding (a larger length is damage, not data).
_MAX_NAME_BYTES = 4096


def open_regular_file(path: str, shard: str) -> int:
    """Open ``path`` read-only and return its descriptor, if it is a regular file.

    Opened non-blocking, so a FIFO put where a shard or sidecar should be cannot block
    the open (and a read from it never waits for a writer), then refused.

    Raises:
        ShardNotFoundError: If ``path`` does not exist.
        UnsafeShardError: If it is a FIFO, device, socket or directory.
        ShardError: If it cannot be opened (permissions...).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"{shard}: {path} does not exist") from exc
    except OSError as exc:
        raise ShardError(f"{shard}: cannot open {path} ({exc})") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeShardError(f"{shard}: {path} is not a regular file (mode {stat.filemode(mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_field_names(names: Sequence[str], where: str) -> None:
    """Check field names read from a shard: what :func:`~.base.check_sample` lets a writer store.

    A name is non-empty, at most 4096 bytes, has no ``/`` or NUL, does not start with
    ``__`` (so it can never replace ``__key__`` in a sample), and names are unique (a
    repeated name would silently hide a field).

    Raises:
        CorruptShardError: Naming ``where`` and the name.
    """
    for name in names:
        if (
            not name
            or name.startswith("__")
            or "/" in name
            or "\0" in name
            or len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES
        ):
            raise CorruptShardError(f"{where}: invalid field name {name!r}")
    if len(set(names)) != len(names):
        raise CorruptShardError(f"{where}: a field name appears twice in {list(names)!r}")


def seal(payload: bytes) -> bytes:
    """Return ``payload`` prefixed with its xxh3_64."""
    return _SUM.pack(xxhash.xxh3_64_intdigest(payload)) + payload


def unseal(value: bytes | memoryview, where: str) -> memoryview:
    """Return the payload of a sealed value after checking its checksum (no copy).

    Raises:
        CorruptShardError: Naming ``where``, if the value is damaged.
    """
    view = memoryview(value)
    if len(view) < _SUM.size:
        raise CorruptShardError(f"{where}: value of {len(view)} bytes is shorter than its checksum")
    payload = view[_SUM.size :]
    if xxhash.xxh3_64_intdigest(payload) != _SUM.unpack_from(view)[0]:
        raise CorruptShardError(f"{where}: does not match its checksum (corrupt bytes)")
    return payload


def encode_record(key: str, fields: list[tuple[str, bytes]]) -> bytes:
    """Return the sealed record of a sample; ``fields`` come from :func:`~.base.check_sample`."""
    key_raw = key.encode("utf-8", "surrogateescape")
    names = [name.encode("utf-8", "surrogateescape") for name, _ in fields]
    table = b"".join(_FIELD.pack(len(n), len(data)) for n, (_, data) in zip(names, fields, strict=True))
    return seal(b"".join([_HEAD.pack(len(fields), len(key_raw)), table, key_raw, *names, *(d for _, d in fields)]))


#: ``struct.Struct`` of a whole field table, by field count (records of one dataset share few counts).
_TABLES: dict[int, struct.Struct] = {}


def _table(n_fields: int) -> struct.Struct:
    table = _TABLES.get(n_fields)
    if table is None:
        table = struct.Struct("<" + "IQ" * n_fields)
        if n_fields <= 64:
            _TABLES[n_fields] = table
    return table


def _layout(
    value: bytes | memoryview, where: str, check: bool = True
) -> tuple[memoryview, int, int, list[tuple[str, int, int]]]:
    """Check a record; return its payload view, key offset and length, ``(name, data offset, size)`` per field.

    With ``check=False`` the checksum is not computed (only the lengths are checked); the
    caller must :func:`unseal` the value before it trusts a byte of it.
    """
    if check:
        view = unseal(value, where)
    else:
        view = memoryview(value)[_SUM.size :]
        if len(view) + _SUM.size != len(value):
            raise CorruptShardError(f"{where}: value of {len(value)} bytes is shorter than its checksum")
    total = len(view)
    if total < _HEAD.size:
        raise CorruptShardError(f"{where}: record of {total} bytes is shorter than its header")
    n_fields, key_len = _HEAD.unpack_from(view)
    pos = _HEAD.size + n_fields * _FIELD.size
    if key_len > MAX_KEY_BYTES or pos > total:
        raise CorruptShardError(f"{where}: record header is damaged ({n_fields=}, {key_len=})")
    flat = _table(n_fields).unpack_from(view, _HEAD.size)
    name_lens, sizes = flat[0::2], flat[1::2]
    used = pos + key_len + sum(name_lens) + sum(sizes)
    if used != total or any(name_len > _MAX_NAME_BYTES for name_len in name_lens):
        raise CorruptShardError(f"{where}: record lengths add up to {used} bytes, the record has {total}")
    key_at = pos
    pos += key_len
    names: list[str] = []
    for name_len in name_lens:
        name = str(view[pos : pos + name_len], "utf-8", "surrogateescape")
        # As the writer stores them: valid names (never "__key__"), strictly sorted (so unique).
        if not name or name.startswith("__") or "/" in name or "\0" in name or (names and name <= names[-1]):
            raise CorruptShardError(f"{where}: record has an invalid, repeated or unsorted field name {name!r}")
        names.append(name)
        pos += name_len
    fields = []
    for name, size in zip(names, sizes, strict=True):
        fields.append((name, pos, size))
        pos += size
    return view, key_at, key_len, fields


def _parse(value: bytes | memoryview, where: str) -> tuple[memoryview, str, list[tuple[str, int, int]]]:
    """Check a record; return its payload view, key and ``(name, data offset, size)`` per field."""
    view, key_at, key_len, fields = _layout(value, where)
    return view, str(view[key_at : key_at + key_len], "utf-8", "surrogateescape"), fields


def record_spans(
    value: bytes | memoryview, where: str, check: bool = True
) -> tuple[memoryview, dict[str, tuple[int, int]]]:
    """Parse a record once; return its payload view and ``{field: (offset, size)}`` into it.

    For batch reads: one parse per sample, then any number of fields copied straight out
    of the view. The key is not decoded (readers name a sample from their catalog).
    Raises :class:`~streamload.CorruptShardError` as :func:`decode_record`. With
    ``check=False`` only the lengths are checked (every span lies inside the value): the
    caller must :func:`unseal` the value before it uses the bytes.
    """
    view, _, _, fields = _layout(value, where, check)
    return view, {name: (at, size) for name, at, size in fields}


def decode_record(value: bytes | memoryview, where: str) -> Sample:
    """Return the sample held by a record; ``where`` names shard and sample in errors.

    Raises:
        CorruptShardError: If the record does not match its checksum or its lengths.
    """
    view, key, fields = _parse(value, where)
    problem = key_problem(key)  # the record's key, as tar member names are checked
    if problem is not None:
        raise UnsafeShardError(f"{where}: {problem}")
    sample: Sample = {"__key__": key}
    for name, at, size in fields:
        sample[name] = bytes(view[at : at + size])  # the one copy out of the map
    return sample


def record_field(value: bytes | memoryview, fields: Sequence[str], where: str) -> tuple[str, memoryview | None]:
    """Return the record's key and a view of its first present field of ``fields`` (None if none).

    The record is checked as by :func:`decode_record`; nothing is copied.
    """
    view, key, found = _parse(value, where)
    spans = {name: (at, size) for name, at, size in found}
    for name in fields:
        if name in spans:
            at, size = spans[name]
            return key, view[at : at + size]
    return key, None
