"""Tar shards, byte-compatible with WebDataset.

Layout of a shard: for each sample, one member ``<key>.<field>`` per field, fields in
sorted order, members of a sample adjacent; USTAR headers (PAX only for names that do
not fit), fixed mtime/uid/gid/mode so the bytes depend only on the samples; the usual
two zero blocks and padding to a 10 KiB record at the end. The ``webdataset`` package
reads it unchanged.

Random access comes from a sidecar ``<shard>.idx`` (little-endian, no pickle)::

    magic  b"SLTARIX2"
    u64 x 6   n_samples, n_members, n_fields, names_len, keys_len, reserved
    names     field names, UTF-8, newline-joined, padded to 8 bytes
    u64[n+1]  sample_start   byte offset of a sample's first header; [n] = end of data
    u64[n+1]  sample_member  index of a sample's first member;       [n] = n_members
    u64[n+1]  key_offset     offsets into the key blob
    u64[m]    member_offset  byte offset of a member's data
    u64[m]    member_size    byte size of a member's data
    u32[m]    member_field   index into names (padded to 8 bytes)
    u64[m]    member_hash    xxh3_64 of the member's data
    keys      the keys, UTF-8, concatenated

With it, reading sample ``i`` is one ``pread`` per field, checked against its xxh3_64
(about 1 µs per 64 KB, so every read is verified: a flipped byte raises an error naming
the shard, key and field): no header parsing and
no ``tarfile`` on the hot path. The sidecar is validated when a shard is opened, with
vectorised checks over its tables, so a hostile index cannot point outside the shard:
monotonic offsets starting at 0, every member inside the file (compared as uint64, so
nothing wraps around 2**64), members in file order without overlap (so the bytes of any
batch are at most the shard's size), valid and unique field names, no field twice in a
sample, keys of at most ``MAX_KEY_BYTES``.
"""

from __future__ import annotations

import os
import struct
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from .._errors import CorruptShardError, SampleError
from ..manifest import ShardEntry, algorithm_of, new_hasher
from ._bytes import MAX_GAP, FileBytes, ShardBytes, gather
from ._record import check_field_names, open_regular_file
from .base import MAX_KEY_BYTES, Format, Sample, ShardReader, ShardWriter, check_sample, unsafe, unsafe_keys

__all__ = ["FORMAT", "TarShardReader", "TarShardWriter", "index_tar"]

_BLOCK = 512
_RECORD = 20 * _BLOCK
_MAGIC = b"SLTARIX2"
_HEAD = struct.Struct("<8s6Q")
_MTIME = 0
_MODE = 0o444
_ZERO_BLOCK = bytes(_BLOCK)
#: Batch reads: largest gap read into scratch rather than split into two preadv calls,
#: and the most buffers one preadv takes (Linux IOV_MAX).
#: A member larger than this is treated as hostile (64 GiB).
MAX_MEMBER_BYTES = 1 << 36
#: A PAX or GNU long-name header larger than this is treated as hostile (they hold a name
#: and a few numbers).
MAX_EXTENDED_HEADER_BYTES = 1 << 20
#: Sizes from this on do not fit a tar header's octal field and are written in PAX records.
_HEADER_SIZE_LIMIT = 8**11
#: Members are hashed in pieces of this size when indexed.
_HASH_PIECE = 16 << 20


def _pad(n: int) -> int:
    return (-n) % _BLOCK


def _pad8(n: int) -> int:
    return (-n) % 8


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = _MTIME
    info.mode = _MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class _IndexBuilder:
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
        self.sample_start.append(offset)
        self.sample_member.append(len(self.member_offset))
        self.keys += key.encode("utf-8", "surrogateescape")
        self.key_offset.append(len(self.keys))

    def add_member(self, field: str, offset: int, size: int, digest: int) -> None:
        self.member_field.append(self.names.setdefault(field, len(self.names)))
        self.member_offset.append(offset)
        self.member_size.append(size)
        self.member_hash.append(digest)

    def to_bytes(self, end: int) -> bytes:
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
        return sorted(self.names)


def _read_regular_file(path: str, shard: str) -> bytes:
    """Return the whole content of a regular file (a FIFO or device is refused, not waited on)."""
    fd = open_regular_file(path, shard)
    try:
        with open(fd, "rb", closefd=False) as f:
            return f.read(os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _check_tar_field(field: str, where: str) -> None:
    """A field name must be valid for every reader and fit the sidecar's newline-separated name list."""
    if "\n" in field:
        raise CorruptShardError(f"{where}: invalid field name {field!r} (a newline)")
    check_field_names([field], where)


def _padded(data: bytes) -> bytes:
    return data + bytes(_pad8(len(data)))


class TarShardWriter(ShardWriter):
    """Writes a WebDataset-compatible tar shard and its ``.idx`` sidecar."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in finish/abort
        self._pos = 0
        self._index = _IndexBuilder()

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample as adjacent ``key.field`` members, fields sorted."""
        key, fields = check_sample(sample)
        for name, _ in fields:
            if "\n" in name:
                raise SampleError(f"sample {key!r}: field name {name!r} has a newline (tar sidecars cannot hold it)")
        self._index.start_sample(key, self._pos)
        for name, data in fields:
            header = _header(f"{key}.{name}", len(data))
            self._file.write(header)
            self._pos += len(header)
            self._index.add_member(name, self._pos, len(data), xxhash.xxh3_64_intdigest(data))
            self._file.write(data)
            self._file.write(bytes(_pad(len(data))))
            self._pos += len(data) + _pad(len(data))
        self.num_samples += 1

    def finish(self) -> str:
        """Write the end-of-archive blocks and the sidecar; return the sidecar path."""
        end = self._pos
        trailer = 2 * _BLOCK
        trailer += (-(self._pos + trailer)) % _RECORD
        self._file.write(bytes(trailer))
        self._file.close()
        sidecar = self.path + ".idx"
        with open(sidecar, "wb") as f:
            f.write(self._index.to_bytes(end))
        return sidecar

    def abort(self) -> None:
        """Close the file without finishing it."""
        self._file.close()


class TarShardReader(ShardReader):
    """Reads samples of a tar shard with ``pread`` at the offsets its sidecar gives."""

    def __init__(
        self,
        path: str,
        entry: ShardEntry,
        sidecar_path: str | None = None,
        *,
        source: ShardBytes | None = None,
        check_headers: bool = True,
    ) -> None:
        """Open a shard: ``source`` reads its bytes (default: the local file ``path``).

        ``check_headers=False`` skips reading the first and last tar headers when the
        shard opens (two round trips for a shard read by ranged GETs); a shard that does
        not match its sidecar still fails its samples' checksums on the first read.
        """
        super().__init__(path, entry, sidecar_path)
        if sidecar_path is None:
            raise CorruptShardError(f"{entry.name}: tar shard has no sidecar index in the manifest")
        raw = _read_regular_file(sidecar_path, entry.name)
        # The shard's bytes: the local file, or (``source``) ranged reads of a remote object.
        self._bytes: ShardBytes | None = (
            source if source is not None else FileBytes(open_regular_file(path, entry.name))
        )
        try:
            self._size = self._bytes.size
            self._check_sidecar_hash(raw)
            self._load_index(raw)
            if check_headers:
                self._check_headers()
        except BaseException:
            self.close()
            raise

    def _check_sidecar_hash(self, raw: bytes) -> None:
        """Check the sidecar against its manifest digest (cheap: it is small, and it steers every read)."""
        sidecar = self.entry.sidecar
        if sidecar is None or sidecar.hash is None:
            return
        hasher = new_hasher(sidecar.algorithm or algorithm_of(sidecar.hash))
        hasher.update(raw)
        if hasher.hexdigest() != sidecar.hash:
            raise CorruptShardError(f"{self.entry.name}: sidecar {sidecar.name} does not match its manifest hash")

    def _load_index(self, raw: bytes) -> None:
        name = self.entry.name
        if len(raw) < _HEAD.size:
            raise CorruptShardError(f"{name}: sidecar index is truncated ({len(raw)} bytes)")
        magic, n, m, n_fields, names_len, keys_len, _ = _HEAD.unpack_from(raw)
        if magic != _MAGIC:
            raise CorruptShardError(f"{name}: sidecar index has bad magic {magic!r}")
        if n != self.entry.num_samples:
            raise CorruptShardError(f"{name}: sidecar holds {n} samples, manifest says {self.entry.num_samples}")
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
        self._validate(start, member, key_off, offset, size, field, n_fields, keys_len)
        self._start, self._member, self._key_off = start, member, key_off
        self._offset, self._msize, self._field, self._hash = offset, size, field, digest
        self._keys, self._names = keys, names
        #: Samples whose keys break the tar member name rules (refused when read, by index).
        self._unsafe_keys = unsafe_keys(keys, key_off)

    def _validate(
        self,
        start: memoryview,
        member: memoryview,
        key_off: memoryview,
        offset: memoryview,
        size: memoryview,
        field: memoryview,
        n_fields: int,
        keys_len: int,
    ) -> None:
        name = self.entry.name
        u8 = np.uint64
        starts, members, key_offs, offsets, sizes = (
            np.frombuffer(v, dtype=np.uint64) for v in (start, member, key_off, offset, size)
        )
        field_ids = np.frombuffer(field, dtype=np.uint32)
        m, fsize = len(offsets), u8(self._size)

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
            pairs = np.sort(sample_of * n_fields + field_ids)
            if np.any(pairs[1:] == pairs[:-1]):
                raise CorruptShardError(f"{name}: sidecar index lists a field twice in one sample")

    def get(self, index: int) -> Sample:
        """Return sample ``index`` as ``{"__key__": str, field: bytes}``."""
        self._check_index(index)
        source = self._bytes
        if source is None:
            raise ValueError(f"{self.entry.name}: reader is closed")
        key = self._keys[self._key_off[index] : self._key_off[index + 1]].decode("utf-8", "surrogateescape")
        if self._unsafe_keys and index in self._unsafe_keys:  # the sidecar's keys, checked as tar names
            raise unsafe(self.entry.name, f"sample #{index}: {self._unsafe_keys[index]}")
        sample: Sample = {"__key__": key}
        offset, size, field, names = self._offset, self._msize, self._field, self._names
        for j in range(self._member[index], self._member[index + 1]):
            n = size[j]
            # pread, not mmap: one copy, and pages read do not count in this process's RSS.
            data = source.pread(n, offset[j])
            if len(data) != n or xxhash.xxh3_64_intdigest(data) != self._hash[j]:
                what = "is truncated" if len(data) != n else "does not match its checksum (corrupt bytes)"
                raise CorruptShardError(
                    f"{self.path}: shard {self.entry.name}, sample {key!r}, field {names[field[j]]!r} {what}"
                )
            sample[names[field[j]]] = data
        return sample

    def _check_headers(self) -> None:
        """Check the tar headers of the first and last members against the sidecar.

        Two 512-byte reads per opened shard catch a shard that was overwritten, damaged
        at either end, or paired with another shard's sidecar.
        """
        m = len(self._offset)
        for j in sorted({0, m - 1}) if m else ():
            at = self._offset[j] - _BLOCK
            block = self._bytes.pread(_BLOCK, at) if at >= 0 and self._bytes is not None else b""
            where = f"{self.entry.name}: tar header at byte {at}"
            if len(block) != _BLOCK or block == _ZERO_BLOCK:
                raise CorruptShardError(f"{where} is missing: the shard does not match its sidecar index")
            if _parse_octal(block[148:156], where) != sum(block[:148]) + 256 + sum(block[156:]):
                raise CorruptShardError(f"{where} is damaged (checksum mismatch)")
            size = _parse_octal(block[124:136], where)
            if size != self._msize[j] and self._msize[j] < _HEADER_SIZE_LIMIT:  # larger sizes live in PAX records
                raise CorruptShardError(f"{where} says {size} bytes, the sidecar index says {self._msize[j]}")

    def sample_extents(self, indices: np.ndarray) -> np.ndarray:
        """Return the ``[start, end)`` byte extents of samples ``indices`` in the shard, as ``int64[n, 2]``.

        A sample's extent runs from its first header to the next sample's first header (its
        headers, data and padding): every byte :meth:`get` or :meth:`read_groups_into` reads
        for it. Streaming mode fetches these ranges ahead of a batch.
        """
        index = np.asarray(indices, dtype=np.int64)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.entry.num_samples):
            raise IndexError(f"{self.entry.name}: sample indices out of range [0, {self.entry.num_samples})")
        starts = np.frombuffer(self._start, dtype=np.uint64).astype(np.int64)
        return np.stack([starts[index], starts[index + 1]], axis=1)

    def catalog(self) -> tuple[list[str], list[int]]:
        """Return keys and payload sizes from the sidecar index (no member is read)."""
        n = self.entry.num_samples
        bounds = np.frombuffer(self._key_off, dtype=np.uint64).tolist()
        keys = [self._keys[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogateescape") for i in range(n)]
        total = np.zeros(len(self._msize) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self._msize, dtype=np.uint64), out=total[1:])
        member = np.frombuffer(self._member, dtype=np.uint64).astype(np.int64)
        return keys, (total[member[1:]] - total[member[:-1]]).tolist()

    # -- batch reads straight into a caller's buffer (streamload.batch, BatchReads) -----

    def _members_of(self, fields: Sequence[str]) -> np.ndarray:
        """Per sample, the member holding its first present field of ``fields`` (-1: none).

        Computed once per reader and field tuple, vectorised over the sidecar (O(members)).
        """
        cache: dict[tuple[str, ...], np.ndarray] = self.__dict__.setdefault("_members_cache", {})
        key = tuple(fields)
        found = cache.get(key)
        if found is None:
            counts = np.diff(np.frombuffer(self._member, dtype=np.uint64).astype(np.int64))
            sample_of = np.repeat(np.arange(len(counts)), np.asarray(counts, dtype=np.int64))
            field_ids = np.frombuffer(self._field, dtype=np.uint32)
            found = np.full(len(counts), -1, dtype=np.int64)
            for name in reversed(key):  # earlier fields win
                if name in self._names:
                    hit = np.flatnonzero(field_ids == self._names.index(name))
                    found[sample_of[hit]] = hit
            cache[key] = found
        return found

    def _batch_members(self, indices: np.ndarray, fields: Sequence[str]) -> np.ndarray:
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.entry.num_samples):
            raise IndexError(f"{self.entry.name}: sample indices out of range [0, {self.entry.num_samples})")
        members: np.ndarray = self._members_of(fields)[indices]
        missing = np.flatnonzero(members < 0)
        if len(missing):
            key = self.keys_of(indices[missing[:1]])[0]
            raise SampleError(f"{self.entry.name}: sample {key!r} has none of the fields {tuple(fields)}")
        return members

    def field_sizes(self, indices: np.ndarray, fields: Sequence[str]) -> np.ndarray:
        """Return the sizes of each sample's first present field of ``fields``, from the sidecar."""
        members = self._batch_members(indices, fields)
        sizes: np.ndarray = np.frombuffer(self._msize, dtype=np.uint64)[members].astype(np.int64)
        return sizes

    def read_groups_into(
        self, indices: np.ndarray, groups: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray]]
    ) -> None:
        """Read several fields of each sample with as few ``preadv`` calls as possible.

        The wanted members of consecutive samples usually lie close together in the shard
        (e.g. ``cls`` data, a padding and a 512-byte header, ``jpg`` data, ...), so one
        ``preadv`` covers a whole run of samples: each wanted member lands in its place
        in its ``out`` array and the bytes between them (headers, padding, fields nobody
        asked for, up to 64 KiB) in a scratch buffer. Every member's checksum is checked.
        """
        source = self._bytes
        if source is None:
            raise ValueError(f"{self.entry.name}: reader is closed")
        n, g = len(indices), len(groups)
        if n == 0:
            return
        members = np.stack([self._batch_members(indices, fields) for fields, _, _ in groups], axis=1)
        sizes = np.stack([np.asarray(sz, dtype=np.int64) for _, _, sz in groups], axis=1)
        starts = np.zeros_like(sizes)
        starts[1:] = np.cumsum(sizes[:-1], axis=0)  # where each member goes in its group's out
        offsets = np.frombuffer(self._offset, dtype=np.uint64)[members].astype(np.int64)
        order = np.argsort(offsets, axis=1, kind="stable")  # file order within each sample
        take = np.arange(n)[:, None]
        seg_off = offsets[take, order].ravel().tolist()
        seg_size = sizes[take, order].ravel().tolist()
        seg_start = starts[take, order].ravel().tolist()
        seg_group = np.broadcast_to(np.arange(g), (n, g))[take, order].ravel().tolist()
        views = [out.data.cast("B") for _, out, _ in groups]
        scratch = self.__dict__.get("_scratch")
        if scratch is None:
            scratch = self.__dict__.setdefault("_scratch", memoryview(bytearray(MAX_GAP)))
        segments = (
            (off, size, views[group][start:])
            for off, size, start, group in zip(seg_off, seg_size, seg_start, seg_group, strict=True)
        )
        gather(segments, scratch, lambda iov, offset, expected: self._preadv(source, iov, offset, expected))
        self._check_digests(indices, members, groups, starts)

    def _preadv(self, source: ShardBytes, iov: list[memoryview], offset: int, expected: int) -> None:
        if source.preadv(iov, offset) != expected:
            raise CorruptShardError(f"{self.path}: shard {self.entry.name} is truncated at byte {offset}")

    def _check_digests(
        self,
        indices: np.ndarray,
        members: np.ndarray,
        groups: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray]],
        starts: np.ndarray,
    ) -> None:
        digests = np.frombuffer(self._hash, dtype=np.uint64)
        digest = xxhash.xxh3_64_intdigest
        for j, (_, out, sizes) in enumerate(groups):
            view = out.data.cast("B")
            expected = digests[members[:, j]].tolist()
            for k, (a, n) in enumerate(zip(starts[:, j].tolist(), np.asarray(sizes).tolist(), strict=True)):
                if digest(view[a : a + n]) != expected[k]:
                    self._read_failed(int(indices[k]), int(members[k, j]))

    def _read_failed(self, index: int, member: int) -> None:
        key = self.keys_of(np.array([index]))[0]
        raise CorruptShardError(
            f"{self.path}: shard {self.entry.name}, sample {key!r}, field "
            f"{self._names[self._field[member]]!r} is truncated or does not match its checksum"
        )

    def keys_of(self, indices: np.ndarray) -> list[str]:
        """Return the keys of samples ``indices`` from the sidecar."""
        bounds, keys = self._key_off, self._keys
        return [keys[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogateescape") for i in indices.tolist()]

    def close(self) -> None:
        """Close the shard's bytes (its file descriptor)."""
        source, self._bytes = getattr(self, "_bytes", None), None
        if source is not None:
            source.close()


# -- scanning tar files written by other tools -------------------------------------


def _parse_octal(field: bytes, where: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError as exc:
        raise CorruptShardError(f"{where}: bad numeric header field {field!r}") from exc


def _parse_pax(data: bytes, where: str) -> dict[str, str]:
    """Parse PAX records (``<length> <key>=<value>`` and a newline); anything malformed is corruption."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos:] == bytes(len(data) - pos):
            break  # NUL padding after the last record (some writers)
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() and digits.isascii() else 0  # at most 20 digits
        end = pos + length
        if length <= space + 1 - pos or end > len(data) or data[end - 1 : end] != b"\n":
            raise CorruptShardError(f"{where}: malformed PAX record at byte {pos} of its header")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not key or not eq:
            raise CorruptShardError(f"{where}: malformed PAX record at byte {pos} of its header")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _pax_size(value: str, where: str) -> int:
    """A PAX ``size`` value: decimal digits only (no sign, space or base prefix)."""
    if not (0 < len(value) <= 20 and value.isascii() and value.isdigit()):
        raise CorruptShardError(f"{where}: PAX size {value[:40]!r} is not a byte count")
    return int(value)


def _hash_range(fd: int, offset: int, size: int, where: str) -> int:
    """xxh3_64 of ``size`` bytes at ``offset``, read in pieces (a member may be larger than memory)."""
    if size <= _HASH_PIECE:
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise CorruptShardError(f"{where}: member is truncated")
        return xxhash.xxh3_64_intdigest(data)
    hasher = xxhash.xxh3_64()
    buf = bytearray(_HASH_PIECE)
    done = 0
    while done < size:
        view = memoryview(buf)[: min(_HASH_PIECE, size - done)]
        got = os.preadv(fd, [view], offset + done)
        if got != len(view):
            raise CorruptShardError(f"{where}: member is truncated")
        hasher.update(view)
        done += got
    return hasher.intdigest()


def iter_members(path: str, shard_name: str) -> Iterator[tuple[str, int, int, int]]:
    """Yield ``(name, header_offset, data_offset, size)`` for each regular member of a tar file.

    PAX (``x``, and global ``g``, applied to every later member as tar readers do) and
    GNU long-name (``L``) headers are folded into the member that follows; a PAX ``size``
    replaces the header's; directories are skipped. Links, device files, FIFOs, sparse
    members, names with NUL and extended headers over :data:`MAX_EXTENDED_HEADER_BYTES`
    raise :class:`UnsafeShardError` / :class:`CorruptShardError`; so does a shard that is
    not a regular file.
    """
    fd = open_regular_file(path, shard_name)
    try:
        yield from _members(fd, shard_name)
    finally:
        os.close(fd)


def _members(fd: int, shard_name: str) -> Iterator[tuple[str, int, int, int]]:
    total = os.fstat(fd).st_size
    pos = 0
    first_header: int | None = None
    pending: dict[str, str] = {}
    global_pax: dict[str, str] = {}
    while pos + _BLOCK <= total:
        block = os.pread(fd, _BLOCK, pos)
        if block == _ZERO_BLOCK:
            return
        where = f"{shard_name} at byte {pos}"
        stored = _parse_octal(block[148:156], where)
        if stored != sum(block[:148]) + 256 + sum(block[156:]):
            raise CorruptShardError(f"{where}: tar header checksum mismatch")
        name = block[:100].split(b"\0", 1)[0]
        if block[257:262] == b"ustar" and block[345:500].strip(b"\0"):
            name = block[345:500].split(b"\0", 1)[0] + b"/" + name
        size = _parse_octal(block[124:136], where)
        kind = block[156:157]
        extended = kind in (b"x", b"L", b"g")
        pax = {**global_pax, **pending}
        if not extended and "size" in pax:
            pax_size = _pax_size(pax["size"], where)
            # Tar writers put a size in PAX only when the header cannot hold it (and write
            # 0 there); a PAX size that disagrees with a header that could hold it is damage.
            if pax_size != size and (size or pax_size < _HEADER_SIZE_LIMIT):
                raise CorruptShardError(f"{where}: PAX size {pax_size} disagrees with the header's {size}")
            size = pax_size
        data_at = pos + _BLOCK
        if size > MAX_MEMBER_BYTES or size > total - data_at:
            raise CorruptShardError(f"{where}: member size {size} runs past the end of the file")
        if extended and size > MAX_EXTENDED_HEADER_BYTES:
            raise unsafe(
                shard_name, f"extended header of {size} bytes at byte {pos} (at most {MAX_EXTENDED_HEADER_BYTES})"
            )
        if first_header is None:
            first_header = pos
        pos = data_at + size + _pad(size)
        if extended:
            data = os.pread(fd, size, data_at)
            if kind == b"x":
                pending.update(_parse_pax(data, where))
            elif kind == b"g":
                global_pax.update(_parse_pax(data, where))
                first_header, pending = None, {}
            else:
                pending["path"] = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if kind == b"5":
            first_header, pending = None, {}
            continue
        if kind not in (b"0", b"\0", b"7"):
            raise unsafe(
                shard_name,
                f"member {name!r} at byte {data_at - _BLOCK} has type {kind!r} (links, devices and FIFOs are refused)",
            )
        if any(k.startswith("GNU.sparse.") for k in pax):
            raise CorruptShardError(f"{where}: sparse member {name!r} (not supported)")
        full = pax.get("path") or name.decode("utf-8", "surrogateescape")
        if "\0" in full:
            raise unsafe(shard_name, f"member name {full!r} at byte {data_at - _BLOCK} contains NUL")
        yield full, first_header, data_at, size
        first_header, pending = None, {}


def split_name(name: str) -> tuple[str, str] | None:
    """Split a member name into WebDataset ``(key, field)``.

    The field starts at the first dot of the last path component. Returns ``None`` if
    there is no such dot.
    """
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None
    return name[:dot], name[dot + 1 :]


def index_tar(path: str, shard_name: str, sidecar_out: str) -> tuple[int, list[str]]:
    """Build the sidecar for a tar shard written by another tool (e.g. webdataset).

    Returns:
        ``(num_samples, field_names)``; the sidecar is written to ``sidecar_out``.

    Raises:
        CorruptShardError: If a member has no extension, a sample's members are not
            adjacent, a field repeats within a sample, a key is longer than
            ``MAX_KEY_BYTES`` or a field name is one the readers refuse.
        UnsafeShardError: For absolute or ``..`` member names, links and device files.
    """
    builder = _IndexBuilder()
    seen: set[str] = set()
    current: str | None = None
    current_fields: set[str] = set()
    end = 0
    fd = open_regular_file(path, shard_name)
    try:
        for name, header_at, data_at, size in iter_members(path, shard_name):
            if name.startswith("/") or ".." in name.split("/"):
                raise unsafe(shard_name, f"member name {name!r} is absolute or contains '..'")
            parts = split_name(name)
            if parts is None:
                raise CorruptShardError(f"{shard_name}: member {name!r} has no extension, so no sample field")
            key, field = parts
            if key != current:
                if key in seen:
                    raise CorruptShardError(f"{shard_name}: members of sample {key!r} are not adjacent")
                if len(key.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
                    raise CorruptShardError(f"{shard_name}: key {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes")
                seen.add(key)
                current, current_fields = key, set()
                builder.start_sample(key, header_at)
            if field in current_fields:
                raise CorruptShardError(f"{shard_name}: sample {key!r} has field {field!r} twice")
            if field not in builder.names:
                _check_tar_field(field, f"{shard_name}: member {name!r}")
            current_fields.add(field)
            digest = _hash_range(fd, data_at, size, f"{shard_name}: member {name!r}")
            builder.add_member(field, data_at, size, digest)
            end = data_at + size + _pad(size)
    finally:
        os.close(fd)
    with open(sidecar_out, "wb") as out:
        out.write(builder.to_bytes(end))
    return len(builder.sample_start), builder.fields


FORMAT = Format(
    name="tar",
    extension=".tar",
    writer=TarShardWriter,
    reader=TarShardReader,
    sidecar_suffix=".idx",
    indexer=index_tar,
    ranged=True,
)
