"""The sidecar index of a tar shard (``<shard>.idx``): built while a shard is written or scanned, checked when opened.

The layout is in :mod:`streamload.formats.tar`. Opening checks it whole, with vectorised
checks over its tables, so a hostile index cannot point outside the shard: monotonic
offsets starting at 0, every member inside the file (compared as uint64, so nothing wraps
around 2**64), members in file order without overlap (so the bytes of any batch are at
most the shard's size), valid and unique field names, no field twice in a sample, keys of
at most ``MAX_KEY_BYTES``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._errors import CorruptShardError
from ..manifest import ShardEntry, algorithm_of, new_hasher
from ._record import check_field_names
from .base import MAX_KEY_BYTES, unsafe_keys

__all__ = ["MAX_MEMBER_BYTES", "IndexBuilder", "TarIndex", "check_sidecar_hash", "check_tar_field", "load_index"]

_MAGIC = b"SLTARIX2"
_HEAD = struct.Struct("<8s6Q")
#: A member larger than this is treated as hostile (64 GiB).
MAX_MEMBER_BYTES = 1 << 36


def _pad8(n: int) -> int:
    return (-n) % 8


class IndexBuilder:
    """Accumulates the sidecar tables while a shard is written or scanned."""

    def __init__(self) -> None:
        self.sample_start: list[int] = []
        self.sample_member: list[int] = []
        self.key_offset: list[int] = [0]
        self.keys = bytearray()
        self.member_offset: list[int] = []
        self.member_size: list[int] = []
        self.member_field: list[int] = []
        self.member_hash: list[int] = []
        self.names: dict[str, int] = {}

    def start_sample(self, key: str, offset: int) -> None:
        """A sample ``key`` starts at byte ``offset`` (its first header)."""
        self.sample_start.append(offset)
        self.sample_member.append(len(self.member_offset))
        self.keys += key.encode("utf-8", "surrogateescape")
        self.key_offset.append(len(self.keys))

    def add_member(self, field: str, offset: int, size: int, digest: int) -> None:
        """The current sample's ``field`` lies at ``offset`` (its data), ``size`` bytes, xxh3_64 ``digest``."""
        self.member_field.append(self.names.setdefault(field, len(self.names)))
        self.member_offset.append(offset)
        self.member_size.append(size)
        self.member_hash.append(digest)

    def to_bytes(self, end: int) -> bytes:
        """The sidecar's bytes, ``end`` being where the last sample's data ends."""
        n, m = len(self.sample_start), len(self.member_offset)
        names = "\n".join(self.names).encode()
        parts = [
            _HEAD.pack(_MAGIC, n, m, len(self.names), len(names), len(self.keys), 0),
            names + bytes(_pad8(len(names))),
            np.asarray([*self.sample_start, end], dtype="<u8").tobytes(),
            np.asarray([*self.sample_member, m], dtype="<u8").tobytes(),
            np.asarray(self.key_offset, dtype="<u8").tobytes(),
            np.asarray(self.member_offset, dtype="<u8").tobytes(),
            np.asarray(self.member_size, dtype="<u8").tobytes(),
            _padded(np.asarray(self.member_field, dtype="<u4").tobytes()),
            np.asarray(self.member_hash, dtype="<u8").tobytes(),
            bytes(self.keys),
        ]
        return b"".join(parts)

    @property
    def fields(self) -> list[str]:
        """The field names seen, sorted."""
        return sorted(self.names)


def check_tar_field(field: str, where: str) -> None:
    """A field name must be valid for every reader and fit the sidecar's newline-separated name list."""
    if "\n" in field:
        raise CorruptShardError(f"{where}: invalid field name {field!r} (a newline)")
    check_field_names([field], where)


def _padded(data: bytes) -> bytes:
    return data + bytes(_pad8(len(data)))


def check_sidecar_hash(raw: bytes, entry: ShardEntry) -> None:
    """Check the sidecar against its manifest digest (cheap: it is small, and it steers every read)."""
    sidecar = entry.sidecar
    if sidecar is None or sidecar.hash is None:
        return
    hasher = new_hasher(sidecar.algorithm or algorithm_of(sidecar.hash))
    hasher.update(raw)
    if hasher.hexdigest() != sidecar.hash:
        raise CorruptShardError(f"{entry.name}: sidecar {sidecar.name} does not match its manifest hash")


@dataclass(frozen=True)
class TarIndex:
    """A tar shard's sidecar tables, checked (views into the sidecar's bytes)."""

    #: Per sample (and one past the last), the offset of its first header.
    start: memoryview
    #: Per sample (and one past the last), its first member.
    member: memoryview
    #: Per sample (and one past the last), where its key starts in ``keys``.
    key_off: memoryview
    #: Per member: its data's offset, size, field (index into ``names``) and xxh3_64.
    offset: memoryview
    size: memoryview
    field: memoryview
    hash: memoryview
    keys: bytes
    names: list[str]
    #: Samples whose keys break the tar member name rules (refused when read, by index).
    unsafe_keys: dict[int, str]


def load_index(raw: bytes, entry: ShardEntry, file_size: int) -> TarIndex:
    """Parse and check the sidecar ``raw`` of shard ``entry``, whose file has ``file_size`` bytes.

    Raises:
        CorruptShardError: Naming the shard, if the sidecar is damaged, hostile or another shard's.
    """
    name = entry.name
    if len(raw) < _HEAD.size:
        raise CorruptShardError(f"{name}: sidecar index is truncated ({len(raw)} bytes)")
    magic, n, m, n_fields, names_len, keys_len, _ = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        raise CorruptShardError(f"{name}: sidecar index has bad magic {magic!r}")
    if n != entry.num_samples:
        raise CorruptShardError(f"{name}: sidecar holds {n} samples, manifest says {entry.num_samples}")
    m4 = 4 * m + _pad8(4 * m)
    expected = _HEAD.size + names_len + _pad8(names_len) + 3 * 8 * (n + 1) + 3 * 8 * m + m4 + keys_len
    if len(raw) != expected:
        raise CorruptShardError(f"{name}: sidecar index is {len(raw)} bytes, expected {expected}")
    pos = _HEAD.size
    names = raw[pos : pos + names_len].decode("utf-8", "replace").split("\n") if names_len else []
    if len(names) != n_fields:
        raise CorruptShardError(f"{name}: sidecar lists {len(names)} field names, header says {n_fields}")
    check_field_names(names, f"{name}: sidecar index")
    pos += names_len + _pad8(names_len)
    view = memoryview(raw)

    def take(count: int, width: int) -> memoryview:
        nonlocal pos
        out = view[pos : pos + count * width].cast("Q" if width == 8 else "I")
        pos += count * width + _pad8(count * width)
        return out

    start, member, key_off = take(n + 1, 8), take(n + 1, 8), take(n + 1, 8)
    offset, size, field, digest = take(m, 8), take(m, 8), take(m, 4), take(m, 8)
    keys = raw[pos : pos + keys_len]
    _validate(name, file_size, (start, member, key_off, offset, size), field, n_fields, keys_len)
    return TarIndex(start, member, key_off, offset, size, field, digest, keys, names, unsafe_keys(keys, key_off))


def _validate(
    name: str,
    file_size: int,
    tables: tuple[memoryview, memoryview, memoryview, memoryview, memoryview],
    field: memoryview,
    n_fields: int,
    keys_len: int,
) -> None:
    """The vectorised checks of the sidecar's tables (see the module)."""
    u8 = np.uint64
    starts, members, key_offs, offsets, sizes = (np.frombuffer(v, dtype=np.uint64) for v in tables)
    field_ids = np.frombuffer(field, dtype=np.uint32)
    m, fsize = len(offsets), u8(file_size)

    def increasing(a: np.ndarray) -> bool:  # compared as uint64: nothing wraps
        return bool(np.all(a[1:] >= a[:-1]))

    def extents() -> bool:
        # Each member inside the file (offset <= size, then size <= size - offset: no
        # wrap-around), and members in file order without overlap, so the bytes of
        # all members together, and of any batch, are at most the shard's size.
        if not (np.all(offsets <= fsize) and np.all(sizes <= fsize - offsets)):
            return False
        return bool(np.all(offsets[1:] >= offsets[:-1] + sizes[:-1]))

    checks: list[tuple[Callable[[], bool], str]] = [
        (lambda: increasing(starts) and starts[-1] <= fsize, "sample offsets"),
        (lambda: members[0] == 0 and increasing(members) and members[-1] == m, "member ranges"),
        (lambda: key_offs[0] == 0 and increasing(key_offs) and key_offs[-1] == keys_len, "key offsets"),
        (lambda: bool(np.all(np.diff(key_offs) <= MAX_KEY_BYTES)), "key lengths"),
        (lambda: bool(np.all(sizes <= MAX_MEMBER_BYTES)) and extents(), "member extents"),
        (lambda: bool(np.all(field_ids < n_fields)), "field ids"),
    ]
    for ok, what in checks:
        if not ok():
            raise CorruptShardError(f"{name}: sidecar index has inconsistent {what}")
    if m:
        # A field twice in one sample would hide one of them: (sample, field) pairs are unique.
        sample_of = np.repeat(np.arange(len(members) - 1, dtype=np.int64), np.diff(members).astype(np.int64))
        pairs = sample_of * n_fields + field_ids
        # Increasing pairs (each sample's fields in order, as streamload writes them) are
        # unique without a sort, which lets go of the GIL (a wait beside a Python thread).
        if not bool(np.all(pairs[1:] > pairs[:-1])):
            pairs = np.sort(pairs)
        if np.any(pairs[1:] == pairs[:-1]):
            raise CorruptShardError(f"{name}: sidecar index lists a field twice in one sample")
