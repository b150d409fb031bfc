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
sample, keys of at most ``MAX_KEY_BYTES``. The sidecar is built and checked in
:mod:`._tar_sidecar`; tar files written by other tools are scanned in :mod:`._tar_scan`.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from .._errors import CorruptShardError, SampleError
from .._pread import Gather, available, gather_all
from ..manifest import ShardEntry
from ..storage.bytes import MAX_GAP, FileBytes, gather
from ._record import open_regular_file
from ._tar_scan import BLOCK, HEADER_SIZE_LIMIT, ZERO_BLOCK, index_tar, iter_members, pad, parse_octal, split_name
from ._tar_sidecar import IndexBuilder, check_sidecar_hash, load_index
from .base import Format, PlacedGroup, Sample, ShardBytes, ShardReader, ShardWriter, check_sample, unsafe

__all__ = ["FORMAT", "TarShardReader", "TarShardWriter", "index_tar", "iter_members", "split_name"]

_RECORD = 20 * BLOCK
_MTIME = 0
_MODE = 0o444


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = _MTIME
    info.mode = _MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _read_regular_file(path: str, shard: str) -> bytes:
    """Return the whole content of a regular file (a FIFO or device is refused, not waited on)."""
    fd = open_regular_file(path, shard)
    try:
        with open(fd, "rb", closefd=False) as f:
            return f.read(os.fstat(fd).st_size)
    finally:
        os.close(fd)


class TarShardWriter(ShardWriter):
    """Writes a WebDataset-compatible tar shard and its ``.idx`` sidecar."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in finish/abort
        self._pos = 0
        self._index = IndexBuilder()

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample as adjacent ``key.field`` members, fields sorted."""
        key, fields = check_sample(sample)
        for name, _ in fields:
            if "\n" in name:
                raise SampleError(f"sample {key!r}: field name {name!r} has a newline (tar sidecars cannot hold it)")
            if name != name.lower():
                raise SampleError(
                    f"sample {key!r}: field name {name!r} has upper-case letters: a tar member's suffix is read "
                    f"lower-cased (webdataset, streamload index), so name it {name.lower()!r}"
                )
        self._index.start_sample(key, self._pos)
        for name, data in fields:
            header = _header(f"{key}.{name}", len(data))
            self._file.write(header)
            self._pos += len(header)
            self._index.add_member(name, self._pos, len(data), xxhash.xxh3_64_intdigest(data))
            self._file.write(data)
            self._file.write(bytes(pad(len(data))))
            self._pos += len(data) + pad(len(data))
        self.num_samples += 1

    def finish(self) -> str:
        """Write the end-of-archive blocks and the sidecar; return the sidecar path."""
        end = self._pos
        trailer = 2 * BLOCK
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


def _check_headers(name: str, source: ShardBytes | None, offset: Sequence[int], msize: Sequence[int]) -> None:
    """Check the tar headers of shard ``name``'s first and last members against its sidecar.

    Two 512-byte reads per opened shard (one call, holding the GIL when cached, for a local
    file) catch a shard that was overwritten, damaged at either end, or paired with another
    shard's sidecar.
    """
    m = len(offset)
    members = sorted({0, m - 1}) if m else []
    places = [offset[j] - BLOCK for j in members]
    if isinstance(source, FileBytes) and all(at >= 0 for at in places):
        blocks = source.pread_blocks(BLOCK, places)
    else:
        blocks = [source.pread(BLOCK, at) if at >= 0 and source is not None else b"" for at in places]
    for j, at, block in zip(members, places, blocks, strict=True):
        where = f"{name}: tar header at byte {at}"
        if len(block) != BLOCK or block == ZERO_BLOCK:
            raise CorruptShardError(f"{where} is missing: the shard does not match its sidecar index")
        if parse_octal(block[148:156], where) != sum(block[:148]) + 256 + sum(block[156:]):
            raise CorruptShardError(f"{where} is damaged (checksum mismatch)")
        size = parse_octal(block[124:136], where)
        if size != msize[j] and msize[j] < HEADER_SIZE_LIMIT:  # larger sizes live in PAX records
            raise CorruptShardError(f"{where} says {size} bytes, the sidecar index says {msize[j]}")


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
        sidecar: bytes | None = None,
    ) -> None:
        """Open a shard: ``source`` reads its bytes (default: the local file ``path``).

        ``check_headers=False`` skips reading the first and last tar headers when the
        shard opens (two round trips for a shard read by ranged GETs); a shard that does
        not match its sidecar still fails its samples' checksums on the first read.
        ``sidecar``: the sidecar's bytes, read by the caller (default: read from
        ``sidecar_path``); they are checked as the file's would be.
        """
        super().__init__(path, entry, sidecar_path)
        if sidecar_path is None:
            raise CorruptShardError(f"{entry.name}: tar shard has no sidecar index in the manifest")
        raw = _read_regular_file(sidecar_path, entry.name) if sidecar is None else sidecar
        # The shard's bytes: the local file, or (``source``) ranged reads of a remote object.
        self._bytes: ShardBytes | None = (
            source if source is not None else FileBytes(open_regular_file(path, entry.name))
        )
        try:
            self._size = self._bytes.size
            check_sidecar_hash(raw, entry)
            index = load_index(raw, entry, self._size)
            self._start, self._member, self._key_off = index.start, index.member, index.key_off
            self._offset, self._msize, self._field, self._hash = index.offset, index.size, index.field, index.hash
            self._keys, self._names = index.keys, index.names
            #: Samples whose keys break the tar member name rules (refused when read, by index).
            self._unsafe_keys = index.unsafe_keys
            if check_headers:
                _check_headers(entry.name, self._bytes, self._offset, self._msize)
        except BaseException:
            self.close()
            raise

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
        sizes = np.stack([np.asarray(sz, dtype=np.int64) for _, _, sz in groups], axis=1) if len(indices) else None
        starts = None
        if sizes is not None:
            starts = np.zeros_like(sizes)
            starts[1:] = np.cumsum(sizes[:-1], axis=0)  # where each member goes in its group's out
        self._read_groups(indices, groups, starts)

    def read_groups_at(
        self, indices: np.ndarray, groups: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray]]
    ) -> None:
        """:meth:`read_groups_into` with each sample's place in each group's ``out`` given (``PlacedReads``)."""
        if len(indices):
            starts = _places(self.entry.name, len(indices), groups)
            self._read_groups(indices, [(f, out, sz) for f, out, sz, _ in groups], starts)

    def _read_groups(
        self,
        indices: np.ndarray,
        groups: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray]],
        starts: np.ndarray | None,
    ) -> None:
        source = self._bytes
        if source is None:
            raise ValueError(f"{self.entry.name}: reader is closed")
        n, g = len(indices), len(groups)
        if n == 0 or starts is None:
            return
        # one call that lets go of the GIL once, where the extension is built
        plan = self.gather_plan(indices, [(f, out, sz, starts[:, j]) for j, (f, out, sz) in enumerate(groups)])
        if plan is not None and gather_all([plan]):
            return
        members, sizes, offsets = self._member_table(indices, [(f, sz) for f, _, sz in groups])
        # (after the gathered read, which needs neither: a numpy sort lets go of the GIL)
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

    def _member_table(self, indices: np.ndarray, groups: _FieldSizes) -> _MemberTable:
        """``int64[n, groups]`` each sample's member of each group's fields, its size and its offset in the shard."""
        members = np.stack([self._batch_members(indices, fields) for fields, _ in groups], axis=1)
        sizes = np.stack([np.asarray(sz, dtype=np.int64) for _, sz in groups], axis=1)
        offsets = np.frombuffer(self._offset, dtype=np.uint64)[members].astype(np.int64)
        return members, sizes, offsets

    def gather_plan(self, indices: np.ndarray, groups: Sequence[PlacedGroup]) -> Gather | None:
        """This shard's part of a batch's gathered read (:class:`~streamload._pread.Gather`), or ``None``.

        Every member of ``groups`` (``(fields, out, sizes, at)``, as :meth:`read_groups_at`
        takes them) to its place: one ``pread`` a member, all the batch's shards in one call
        (:func:`streamload._pread.gather_all`), since a shuffled batch's samples are scattered
        over its shards and a read a shard (or a sample) would take the GIL back once each.
        Where the system's xxHash is there, the same call hashes each member and the
        plan's check compares the digests. ``None`` when the shard is not a local file or
        the extension is not built: read it with :meth:`read_groups_at`.
        """
        source = self._bytes
        if source is None:
            raise ValueError(f"{self.entry.name}: reader is closed")
        if not isinstance(source, FileBytes) or not available():
            return None
        n, g = len(indices), len(groups)
        starts = _places(self.entry.name, n, groups)
        members, sizes, offsets = self._member_table(indices, [(f, sz) for f, _, sz, _ in groups])
        flat_offsets, flat_sizes = offsets.ravel(), sizes.ravel()
        digests = np.frombuffer(self._hash, dtype=np.uint64)[members].ravel()

        def check(got: np.ndarray, sums: np.ndarray | None) -> None:
            bad = np.flatnonzero(got != flat_sizes)
            if len(bad):
                first = int(bad[0])
                if got[first] < 0:
                    code = int(-got[first])
                    raise OSError(code, f"{os.strerror(code)}: reading shard {self.entry.name}", self.path)
                at = int(flat_offsets[first]) + int(got[first])
                raise CorruptShardError(f"{self.path}: shard {self.entry.name} is truncated at byte {at}")
            if sums is None:
                self._check_digests(indices, members, [(f, out, sz) for f, out, sz, _ in groups], starts)
                return
            wrong = np.flatnonzero(sums != digests)
            if len(wrong):
                k, j = divmod(int(wrong[0]), g)
                self._read_failed(int(indices[k]), int(members[k, j]))

        return Gather(
            fd=source.fd,
            offsets=flat_offsets,
            lengths=flat_sizes,
            outs=[out for _, out, _, _ in groups],
            which=np.tile(np.arange(g, dtype=np.int32), n),
            at=starts.ravel(),
            digests=digests,
            check=check,
            owner=source,
        )

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


#: ``(fields, sizes)`` of each group of a batch read; its members, sizes and offsets (``int64[n, groups]``).
_FieldSizes = Sequence[tuple[Sequence[str], np.ndarray]]
_MemberTable = tuple[np.ndarray, np.ndarray, np.ndarray]


def _places(
    name: str, n: int, groups: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray]]
) -> np.ndarray:
    """``int64[n, groups]``: the samples' places of ``read_groups_at``, each checked inside its ``out``."""
    for _, out, sz, at in groups:  # the reads write there
        size, place = np.asarray(sz, dtype=np.int64), np.asarray(at, dtype=np.int64)
        if len(place) != n or (n and (int(place.min()) < 0 or int((place + size).max()) > out.nbytes)):
            raise ValueError(f"{name}: a sample's place is outside its buffer")
    return np.stack([np.asarray(at, dtype=np.int64) for _, _, _, at in groups], axis=1)


FORMAT = Format(
    name="tar",
    extension=".tar",
    writer=TarShardWriter,
    reader=TarShardReader,
    sidecar_suffix=".idx",
    indexer=index_tar,
    ranged=True,
    takes_sidecar=True,
)
