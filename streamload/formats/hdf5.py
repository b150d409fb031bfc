"""HDF5 shards: every field's bytes in one flat ``uint8`` dataset with an ``int64`` offsets dataset.

Layout of a shard (no variable-length data: HDF5 filters skip vlen data and vlen reads
are slow)::

    /                       attribute "streamload": JSON {"format": "streamload-hdf5",
                            "version": 1, "num_samples": n, "fields": [name, ...],
                            "tables_xxh3": hex}; attribute "streamload_xxh3": its hex xxh3_64
    /keys/data              uint8[...]   the keys, UTF-8, concatenated
    /keys/offsets           int64[n + 1] key i is data[offsets[i]:offsets[i + 1]]
    /keys/xxh3              uint64[n]    xxh3_64 of each key
    /fields/<j>/data        uint8[...]   field j's bytes of every sample, concatenated
    /fields/<j>/offsets     int64[n + 1]
    /fields/<j>/present     uint8[n]     1 if sample i has field j (an empty field is
                                         present with zero bytes; a missing one is 0)
    /fields/<j>/xxh3        uint64[n]    xxh3_64 of each sample's bytes of field j

``tables_xxh3`` covers every offsets, present and xxh3 table (keys, then fields in
order), so the metadata is checked when a shard opens and every field read is checked
against its own xxh3_64: damaged bytes raise an error naming shard, sample and field.

Fields are numbered in sorted name order (``fields[j]`` is the name), so any field name
is a valid HDF5 path. Datasets are contiguous and unfiltered, object headers carry no
timestamps, so the same samples give the same bytes.

Reading: the file is opened on first use in the reading process (reopened after a fork;
never pickled). The small tables (offsets, presence, keys) are read into memory once;
then reading a field is one ``os.pread`` at the dataset's file offset plus the sample's
offset, with no HDF5 call on the hot path (several times faster than an h5py slice, see
``benchmarks/bench_formats.py``). A dataset that is chunked and gzip-compressed (our
layout written by another tool) is read with h5py slices instead.

Untrusted shards: before any data is read, every group and dataset is checked
(``_Layout``): reached by hard links only (a soft or external link, or a virtual dataset,
could make HDF5 read any file on the machine), no external storage (raw data kept in
another file, possibly a FIFO that blocks forever), the layout's dtypes and shapes,
contiguous storage inside the file, or chunks with the deflate/shuffle/fletcher32
filters only, bounded chunk size and expansion (no decompression bombs, no data made of
fill value), every chunk inside the file. Tables are checked (monotonic offsets from 0 to
the data's length, presence 0/1 and empty when absent, key lengths, field names) so every
size handed to a batch read is bounded by the shard's data.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import xxhash
from h5py import h5d, h5z

from .._errors import CorruptShardError, SampleError, ShardError, UnsafeShardError
from .._fork import ProcessLocal
from ..manifest import ShardEntry
from ._record import check_field_names, open_regular_file
from .base import (
    MAX_KEY_BYTES,
    FieldGroup,
    Format,
    Sample,
    ShardReader,
    ShardWriter,
    check_sample,
    unsafe,
    unsafe_keys,
)

__all__ = ["FORMAT", "Hdf5ShardReader", "Hdf5ShardWriter"]

_MAGIC = "streamload-hdf5"
_VERSION = 1
_ATTR = "streamload"


class _Column:
    """One field's bytes and per-sample bounds, accumulated while a shard is written."""

    def __init__(self, samples_before: int) -> None:
        self.data = bytearray()
        self.ends = [0] * samples_before
        self.present = [0] * samples_before
        self.hashes = [0] * samples_before

    def add(self, value: bytes | None) -> None:
        if value is not None:
            self.data += value
        self.ends.append(len(self.data))
        self.present.append(0 if value is None else 1)
        self.hashes.append(0 if value is None else xxhash.xxh3_64_intdigest(value))

    def tables(self, presence: bool) -> dict[str, np.ndarray[Any, Any]]:
        """The column's small tables, in the order :func:`_tables_digest` hashes them."""
        out = {"offsets": np.asarray([0, *self.ends], dtype="<i8")}
        if presence:
            out["present"] = np.asarray(self.present, dtype=np.uint8)
        out["xxh3"] = np.asarray(self.hashes, dtype="<u8")
        return out


def _tables_digest(tables: list[np.ndarray[Any, Any]]) -> str:
    """Hex xxh3_64 over the tables' little-endian bytes, in order."""
    hasher = xxhash.xxh3_64()
    for table in tables:
        hasher.update(np.ascontiguousarray(table).tobytes())
    return f"{hasher.intdigest():016x}"


def _create(group: h5py.Group, name: str, data: np.ndarray[Any, Any]) -> None:
    group.create_dataset(name, data=data, track_times=False)


class Hdf5ShardWriter(ShardWriter):
    """Writes one HDF5 shard; columns are kept in memory and written by :meth:`finish`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._keys = _Column(0)
        self._columns: dict[str, _Column] = {}

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample to the columns."""
        key, fields = check_sample(sample)
        values = dict(fields)
        for name in values:
            if name not in self._columns:
                self._columns[name] = _Column(self.num_samples)
        for name, column in self._columns.items():
            column.add(values.get(name))
        self._keys.add(key.encode("utf-8", "surrogateescape"))
        self.num_samples += 1

    def finish(self) -> None:
        """Write the shard file; no sidecar."""
        names = sorted(self._columns)
        columns = [("keys", self._keys, self._keys.tables(presence=False))]
        columns += [
            (f"fields/{j}", self._columns[name], self._columns[name].tables(presence=True))
            for j, name in enumerate(names)
        ]
        meta = {
            "format": _MAGIC,
            "version": _VERSION,
            "num_samples": self.num_samples,
            "fields": names,
            "tables_xxh3": _tables_digest([t for _, _, tables in columns for t in tables.values()]),
        }
        text = json.dumps(meta, sort_keys=True)
        with h5py.File(self.path, "w", libver="earliest") as f:
            f.attrs[_ATTR] = text
            f.attrs[_ATTR + "_xxh3"] = f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"
            for path, column, tables in columns:
                group = f.create_group(path)
                _create(group, "data", np.frombuffer(column.data, dtype=np.uint8))  # no copy of the bytes
                for table_name, table in tables.items():
                    _create(group, table_name, table)
        self._columns = {}
        return None


#: The datasets of a field's group (the keys group has no ``present``), and their dtypes.
_FIELD_TABLES = ("data", "offsets", "present", "xxh3")
_DTYPES: dict[str, np.dtype[Any]] = {
    "data": np.dtype("u1"),
    "offsets": np.dtype("<i8"),
    "present": np.dtype("u1"),
    "xxh3": np.dtype("<u8"),
}
#: Filters a chunked dataset may use. Our writer uses none (contiguous datasets); a shard
#: with our layout written by another tool may be chunked and gzip-compressed. Any other
#: filter (a plugin, szip, ...) is refused.
_ALLOWED_FILTERS = {h5z.FILTER_DEFLATE: "deflate", h5z.FILTER_SHUFFLE: "shuffle", h5z.FILTER_FLETCHER32: "fletcher32"}
#: A chunked dataset may hold at most this many times its stored bytes, plus
#: :data:`_EXPANSION_SLACK`: more is a decompression bomb (gzip expands up to 1032x).
MAX_EXPANSION = 64
_EXPANSION_SLACK = 64 << 10
#: Largest chunk of a chunked dataset (each read decompresses whole chunks).
MAX_CHUNK_BYTES = 16 << 20


class _Layout:
    """Checks the objects of a shard before any of their data is read.

    Only what a streamload shard is made of is accepted: groups and datasets reached by
    hard links from the root (no soft, external or user-defined link), one-dimensional
    datasets of the layout's dtypes, stored contiguously inside the file, or chunked
    with known filters, a bounded chunk size and a bounded expansion, every chunk inside
    the file. External storage (raw data in other files, FIFOs included), virtual
    datasets (mapping other files), compact layouts and data with no storage (a fill
    value of any size) are refused with :class:`UnsafeShardError` or
    :class:`CorruptShardError` naming the shard and the object.
    """

    def __init__(self, shard: str, file_size: int) -> None:
        self.shard, self.file_size = shard, file_size

    def corrupt(self, path: str, detail: str) -> CorruptShardError:
        return CorruptShardError(f"{self.shard}: HDF5 object /{path} {detail}")

    def unsafe(self, path: str, detail: str) -> UnsafeShardError:
        return unsafe(self.shard, f"HDF5 object /{path} {detail}")

    def member(self, group: Any, name: str, path: str) -> Any:
        """Return ``group[name]`` after checking it is a hard link (nothing outside is followed)."""
        link = group.get(name, getlink=True)
        if link is None:
            raise self.corrupt(path, "is missing")
        if isinstance(link, h5py.SoftLink):
            raise self.unsafe(path, f"is a soft link to {link.path!r} (only hard links are read)")
        if isinstance(link, h5py.ExternalLink):
            raise self.unsafe(path, f"is an external link to {link.filename!r} (only hard links are read)")
        if not isinstance(link, h5py.HardLink):
            raise self.unsafe(path, f"is a {type(link).__name__} (only hard links are read)")
        return group[name]

    def column(self, h5: Any, group_path: tuple[str, ...], names: tuple[str, ...]) -> dict[str, Any]:
        """Check a column's group and datasets; return them by name, and ``data_offset``."""
        group = h5
        for k, part in enumerate(group_path):
            group = self.member(group, part, "/".join(group_path[: k + 1]))
            if not isinstance(group, h5py.Group):
                raise self.corrupt("/".join(group_path[: k + 1]), "is not a group")
        out: dict[str, Any] = {}
        for name in names:
            path = "/".join((*group_path, name))
            dset = self.member(group, name, path)
            if not isinstance(dset, h5py.Dataset):
                raise self.corrupt(path, "is not a dataset")
            offset = self.dataset(dset, path, _DTYPES[name])
            out[name] = dset
            if name == "data":
                out["data_offset"] = offset
        return out

    def dataset(self, dset: Any, path: str, dtype: np.dtype[Any]) -> int | None:
        """Check one dataset's storage; return its file offset if contiguous and not empty."""
        plist = dset.id.get_create_plist()
        layout = plist.get_layout()
        if layout == h5d.VIRTUAL or dset.is_virtual:
            raise self.unsafe(path, "is a virtual dataset (it maps other files)")
        if plist.get_external_count():
            raise self.unsafe(path, f"has external storage in {plist.get_external(0)[0]!r} (outside the shard)")
        if dset.dtype != dtype or len(dset.shape) != 1:
            raise self.corrupt(path, f"is {dset.dtype}{list(dset.shape)}, expected a flat {dtype} dataset")
        nbytes = int(dset.shape[0]) * dtype.itemsize
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        storage = int(dset.id.get_storage_size())
        if layout == h5d.CONTIGUOUS and not filters:
            if not nbytes:
                return None
            offset = dset.id.get_offset()
            if offset is None or storage != nbytes:
                raise self.corrupt(path, f"has {storage} bytes of storage for its {nbytes} bytes")
            if offset + nbytes > self.file_size:
                raise self.corrupt(
                    path, f"lies outside the file (bytes {offset}..{offset + nbytes} of {self.file_size})"
                )
            return int(offset)
        if layout != h5d.CHUNKED:
            raise self.unsafe(path, f"has HDF5 storage layout {layout} (only contiguous or chunked data is read)")
        unknown = [f for f in filters if f not in _ALLOWED_FILTERS]
        if unknown:
            raise self.unsafe(path, f"uses HDF5 filters {unknown} (only {sorted(_ALLOWED_FILTERS.values())} are read)")
        chunk = dset.chunks
        if chunk is None or len(chunk) != 1 or chunk[0] * dtype.itemsize > MAX_CHUNK_BYTES:
            raise self.unsafe(path, f"has chunks of {chunk} items (at most {MAX_CHUNK_BYTES} bytes are read)")
        if nbytes > MAX_EXPANSION * storage + _EXPANSION_SLACK:
            raise self.unsafe(
                path,
                f"expands {storage} stored bytes to {nbytes} bytes (a decompression bomb; at most {MAX_EXPANSION}x)",
            )
        self.chunks_inside(dset, path)
        return None

    def chunks_inside(self, dset: Any, path: str) -> None:
        """Check every allocated chunk of a chunked dataset lies inside the file."""
        extents: list[tuple[int, int]] = []

        def visit(info: Any) -> None:
            extents.append((int(info.byte_offset), int(info.size)))

        try:
            dset.id.chunk_iter(visit)
        except (AttributeError, NotImplementedError):  # pragma: no cover - HDF5 < 1.14: one call per chunk
            extents = [
                (int(c.byte_offset), int(c.size)) for c in map(dset.id.get_chunk_info, range(dset.id.get_num_chunks()))
            ]
        for offset, size in extents:
            if offset < 0 or offset + size > self.file_size:
                raise self.corrupt(
                    path, f"has a chunk outside the file (bytes {offset}..{offset + size} of {self.file_size})"
                )


@dataclass
class _Field:
    """A field of an open shard: its tables, and where its bytes are."""

    name: str
    offsets: np.ndarray[Any, Any]
    present: np.ndarray[Any, Any]
    hashes: list[int]
    file_offset: int | None  # contiguous, unfiltered data at this byte of the file
    dataset: Any  # the h5py dataset when file_offset is None


class _Opened:
    """A shard opened and checked in one process: its descriptor, its HDF5 handle (if chunked), its tables.

    Every object is checked before a byte of data is read: hard links only, our dtypes,
    contiguous (or chunked with known filters, bounded), inside the file.
    """

    def __init__(self, path: str, entry: ShardEntry) -> None:
        self.path, self.entry = path, entry
        self.h5: Any = None
        self.fields: list[_Field] = []
        self.key_blob = b""
        self.key_bounds: list[int] = []
        #: Samples whose keys break the tar member name rules (refused when read, by index).
        self.unsafe_keys: dict[int, str] = {}
        self.fd = open_regular_file(path, entry.name)
        try:
            self._load(os.fstat(self.fd))
        except BaseException:
            self.close()
            raise

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        """Close the file descriptor and any open HDF5 handle.

        ``os.close`` is bound at definition: at interpreter exit this may run after the
        module's globals are gone.
        """
        fd, h5 = self.fd, self.h5
        self.fd, self.h5 = -1, None
        try:
            if h5 is not None:
                h5.close()
        finally:
            if fd >= 0:
                _close(fd)

    def _load(self, st: os.stat_result) -> None:
        name = self.entry.name
        try:
            h5 = h5py.File(self.path, "r", locking=False)  # read-only: no lock (NFS, Lustre, many readers)
        except Exception as exc:  # h5py raises OSError, RuntimeError... for a damaged file
            raise CorruptShardError(f"{name}: not a readable HDF5 file ({exc})") from exc
        try:
            self._check_same_file(h5, st)
            meta = self._check_meta(h5.attrs.get(_ATTR), h5.attrs.get(_ATTR + "_xxh3"))
            # Every object is checked before a byte of data is read: hard links only, our
            # dtypes, contiguous (or chunked with known filters, bounded), inside the file.
            layout = _Layout(self.entry.name, st.st_size)
            keys = layout.column(h5, ("keys",), ("data", "offsets", "xxh3"))
            columns = [layout.column(h5, ("fields", str(j)), _FIELD_TABLES) for j in range(len(meta["fields"]))]
            tables: list[np.ndarray[Any, Any]] = []  # in the order the writer hashed them
            keys_blob, key_bounds = self._read_keys(keys, tables)
            fields = [self._read_field(col, field, tables) for col, field in zip(columns, meta["fields"], strict=True)]
            if _tables_digest(tables) != meta.get("tables_xxh3"):
                raise CorruptShardError(f"{name}: HDF5 offsets, presence or checksum tables are damaged")
            self._check_keys(keys_blob, key_bounds, tables[1])
        except Exception as exc:  # whatever h5py raises on a damaged layout: KeyError, OSError...
            h5.close()
            if isinstance(exc, ShardError):
                raise
            raise CorruptShardError(f"{name}: HDF5 shard layout is damaged ({type(exc).__name__}: {exc})") from exc
        except BaseException:
            h5.close()
            raise
        self.key_blob, self.key_bounds, self.fields = keys_blob, key_bounds, fields
        self.unsafe_keys = unsafe_keys(keys_blob, key_bounds)
        if all(f.file_offset is not None for f in fields):
            h5.close()  # the hot path needs only the fd
        else:
            self.h5 = h5

    def _check_same_file(self, h5: Any, st: os.stat_result) -> None:
        """HDF5 opened the path again: check it is the file checked through our descriptor."""
        try:
            other = os.fstat(h5.id.get_vfd_handle())
        except (OSError, ValueError, TypeError):  # pragma: no cover - not the sec2 driver
            return
        if (other.st_dev, other.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafeShardError(f"{self.entry.name}: {self.path} was replaced while it was opened")

    def _check_meta(self, raw: Any, digest: Any) -> dict[str, Any]:
        name, n = self.entry.name, self.entry.num_samples
        if not isinstance(raw, str):
            raise CorruptShardError(f"{name}: not a streamload HDF5 shard (no {_ATTR!r} attribute)")
        if digest != f"{xxhash.xxh3_64_intdigest(raw.encode()):016x}":
            raise CorruptShardError(f"{name}: HDF5 attribute {_ATTR!r} does not match its checksum")
        meta = json.loads(raw)
        if not isinstance(meta, dict) or meta.get("format") != _MAGIC:
            raise CorruptShardError(f"{name}: not a streamload HDF5 shard (attribute {_ATTR!r})")
        if meta.get("version") != _VERSION:
            raise CorruptShardError(f"{name}: HDF5 shard version {meta.get('version')!r}, expected {_VERSION}")
        if meta.get("num_samples") != n:
            raise CorruptShardError(f"{name}: HDF5 shard holds {meta.get('num_samples')!r} samples, manifest says {n}")
        fields = meta.get("fields")
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise CorruptShardError(f"{name}: HDF5 shard field list is damaged")
        check_field_names(fields, f"{name}: HDF5 shard")
        return meta

    def _table(self, dset: Any, length: int, what: str) -> np.ndarray[Any, Any]:
        """Read a checked table whose length is known; its shape is checked first."""
        if dset.shape != (length,):
            raise CorruptShardError(
                f"{self.entry.name}: HDF5 {dset.name} table of {what} has {dset.shape[0]} entries, expected {length}"
            )
        return np.asarray(dset[()])

    def _offsets(self, col: dict[str, Any], what: str) -> np.ndarray[Any, Any]:
        offsets = self._table(col["offsets"], self.entry.num_samples + 1, what)
        data_len = col["data"].shape[0]
        if offsets[0] != 0 or offsets[-1] != data_len or np.any(offsets[1:] < offsets[:-1]):
            raise CorruptShardError(f"{self.entry.name}: HDF5 offsets of {what} are inconsistent")
        return offsets

    def _read_keys(self, col: dict[str, Any], tables: list[np.ndarray[Any, Any]]) -> tuple[bytes, list[int]]:
        offsets = self._offsets(col, "keys")
        if np.any(np.diff(offsets) > MAX_KEY_BYTES):
            raise CorruptShardError(f"{self.entry.name}: HDF5 keys longer than {MAX_KEY_BYTES} bytes")
        tables += [offsets, self._table(col["xxh3"], self.entry.num_samples, "keys")]
        return np.asarray(col["data"][()], dtype=np.uint8).tobytes(), offsets.tolist()

    def _check_keys(self, blob: bytes, bounds: list[int], hashes: np.ndarray[Any, Any]) -> None:
        digest = xxhash.xxh3_64_intdigest
        for i, expected in enumerate(hashes.tolist()):
            if digest(blob[bounds[i] : bounds[i + 1]]) != expected:
                raise CorruptShardError(f"{self.entry.name}: HDF5 key of sample {i} does not match its checksum")

    def _read_field(self, col: dict[str, Any], field: str, tables: list[np.ndarray[Any, Any]]) -> _Field:
        n, what = self.entry.num_samples, f"field {field!r}"
        offsets = self._offsets(col, what)
        present = self._table(col["present"], n, what)
        hashes = self._table(col["xxh3"], n, what)
        tables += [offsets, present, hashes]
        if np.any(present > 1) or np.any((present == 0) & (offsets[1:] != offsets[:-1])):
            raise CorruptShardError(f"{self.entry.name}: HDF5 presence table of {what} is inconsistent")
        data = col["data"]
        where = col["data_offset"]
        if not data.shape[0]:
            return _Field(field, offsets, present, hashes.tolist(), 0, None)
        return _Field(field, offsets, present, hashes.tolist(), where, None if where is not None else data)


class Hdf5ShardReader(ShardReader):
    """Reads one HDF5 shard: tables in memory, field bytes by ``pread``.

    The shard is opened on first use in the reading process (:class:`~streamload._fork.ProcessLocal`):
    a forked worker opens its own.
    """

    def __init__(self, path: str, entry: ShardEntry, sidecar_path: str | None = None) -> None:
        super().__init__(path, entry, sidecar_path)
        self._opened: ProcessLocal[_Opened] = ProcessLocal(functools.partial(_Opened, path, entry), _Opened.close)

    # -- reading ---------------------------------------------------------------------

    def get(self, index: int) -> Sample:
        """Return sample ``index``: one ``pread`` per field present."""
        self._check_index(index)
        opened = self._opened.get()
        bounds = opened.key_bounds
        key = opened.key_blob[bounds[index] : bounds[index + 1]].decode("utf-8", "surrogateescape")
        if opened.unsafe_keys and index in opened.unsafe_keys:  # the keys table's keys, checked as tar names
            raise unsafe(self.entry.name, f"sample #{index}: {opened.unsafe_keys[index]}")
        sample: Sample = {"__key__": key}
        for field in opened.fields:
            if not field.present[index]:
                continue
            sample[field.name] = self._read(field, index, opened.fd)
        return sample

    def _read(self, field: _Field, index: int, fd: int) -> bytes:
        """Read and check sample ``index``'s bytes of ``field``: one ``pread``, one xxh3."""
        start, stop = int(field.offsets[index]), int(field.offsets[index + 1])
        if start == stop:
            return b""
        if field.file_offset is None:
            try:
                data = np.asarray(field.dataset[start:stop], dtype=np.uint8).tobytes()
            except Exception as exc:  # a damaged chunk or filter
                raise CorruptShardError(
                    f"{self.entry.name}: HDF5 field {field.name!r} of sample {index} "
                    f"cannot be read ({type(exc).__name__}: {exc})"
                ) from exc
        else:
            data = os.pread(fd, stop - start, field.file_offset + start)
        self._check_bytes(field, index, data, stop - start)
        return data

    def _check_bytes(self, field: _Field, index: int, data: bytes | memoryview, size: int) -> None:
        if len(data) != size or xxhash.xxh3_64_intdigest(data) != field.hashes[index]:
            key = self.keys_of(np.array([index]))[0]
            what = "is truncated" if len(data) != size else "does not match its checksum (corrupt bytes)"
            raise CorruptShardError(
                f"{self.path}: shard {self.entry.name}, sample {key!r}, field {field.name!r} {what}"
            )

    # -- batch reads (streamload.batch, BatchReads): sizes from the offsets, bytes by preadv --

    def _choose(self, indices: np.ndarray[Any, Any], fields: Sequence[str]) -> np.ndarray[Any, Any]:
        """Per sample, the index into the shard's fields of its first present field of ``fields``."""
        shard_fields = self._opened.get().fields
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.entry.num_samples):
            raise IndexError(f"{self.entry.name}: sample indices out of range [0, {self.entry.num_samples})")
        chosen = np.full(len(indices), -1, dtype=np.int64)
        by_name = {f.name: j for j, f in enumerate(shard_fields)}
        for name in reversed(fields):  # earlier fields win
            j = by_name.get(name)
            if j is not None:
                chosen[shard_fields[j].present[indices] == 1] = j
        if np.any(chosen < 0):
            key = self.keys_of(indices[chosen < 0][:1])[0]
            raise SampleError(f"{self.entry.name}: sample {key!r} has none of the fields {tuple(fields)}")
        return chosen

    def field_sizes(self, indices: np.ndarray[Any, Any], fields: Sequence[str]) -> np.ndarray[Any, Any]:
        """Return the sizes of each sample's first present field of ``fields``, from the offsets."""
        chosen = self._choose(indices, fields)
        sizes = np.empty(len(indices), dtype=np.int64)
        for j in np.unique(chosen).tolist():
            hit = chosen == j
            offsets = self._opened.get().fields[j].offsets
            sizes[hit] = offsets[indices[hit] + 1] - offsets[indices[hit]]
        return sizes

    def read_groups_into(self, indices: np.ndarray[Any, Any], groups: Sequence[FieldGroup]) -> None:
        """Read each group's fields straight into its ``out``: one ``preadv`` and one xxh3 per sample and group."""
        for fields, out, sizes in groups:
            self._read_group(indices, fields, out, sizes)

    def _read_group(
        self,
        indices: np.ndarray[Any, Any],
        fields: Sequence[str],
        out: np.ndarray[Any, Any],
        sizes: np.ndarray[Any, Any],
    ) -> None:
        chosen = self._choose(indices, fields).tolist()
        opened = self._opened.get()
        fd, view = opened.fd, out.data
        pos = 0
        for i, j, n in zip(indices.tolist(), chosen, sizes.tolist(), strict=True):
            field = opened.fields[j]
            if field.file_offset is None or not n:
                out[pos : pos + n] = np.frombuffer(self._read(field, i, fd), dtype=np.uint8)
            else:
                dest = view[pos : pos + n]
                got = os.preadv(fd, [dest], field.file_offset + int(field.offsets[i]))
                self._check_bytes(field, i, dest if got == n else dest[:got], n)
            pos += n

    def keys_of(self, indices: np.ndarray[Any, Any]) -> list[str]:
        """Return the keys of samples ``indices`` from the keys table."""
        opened = self._opened.get()
        bounds, blob = opened.key_bounds, opened.key_blob
        return [blob[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogateescape") for i in indices.tolist()]

    def catalog(self) -> tuple[list[str], list[int]]:
        """Return keys and payload sizes from the offsets tables (no field data is read)."""
        opened = self._opened.get()
        n = self.entry.num_samples
        sizes = np.zeros(n, dtype=np.int64)
        for field in opened.fields:
            sizes += np.diff(field.offsets)
        bounds, blob = opened.key_bounds, opened.key_blob
        keys = [blob[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogateescape") for i in range(n)]
        return keys, sizes.tolist()

    def close(self) -> None:
        """Close the file descriptor and any open HDF5 handle (a forked child's: nothing of the parent's)."""
        self._opened.clear()


FORMAT = Format(
    name="hdf5",
    extension=".h5",
    writer=Hdf5ShardWriter,
    reader=Hdf5ShardReader,
    sidecar_suffix=None,
)
