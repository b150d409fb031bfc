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
``benchmarks/bench_formats.py``). A dataset that is chunked or filtered (a file written
by another tool) is read with h5py slices instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import xxhash

from .._errors import CorruptShardError, SampleError, ShardNotFoundError
from ..manifest import ShardEntry
from .base import Format, Sample, ShardReader, ShardWriter, check_sample

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


@dataclass
class _Field:
    """A field of an open shard: its tables, and where its bytes are."""

    name: str
    offsets: np.ndarray[Any, Any]
    present: np.ndarray[Any, Any]
    hashes: list[int]
    file_offset: int | None  # contiguous, unfiltered data at this byte of the file
    dataset: Any  # the h5py dataset when file_offset is None


class Hdf5ShardReader(ShardReader):
    """Reads one HDF5 shard: tables in memory, field bytes by ``pread``."""

    def __init__(self, path: str, entry: ShardEntry, sidecar_path: str | None = None) -> None:
        super().__init__(path, entry, sidecar_path)
        self._pid = -1
        self._fd: int | None = None
        self._h5: Any = None
        self._fields: list[_Field] = []
        self._key_blob = b""
        self._key_bounds: list[int] = []

    # -- opening ---------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._pid == os.getpid():
            return
        self.close()  # a forked child opens its own handles
        name = self.entry.name
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ShardNotFoundError(f"{name}: {self.path} does not exist") from exc
        self._fd = fd
        try:
            self._load(os.fstat(fd).st_size)
        except BaseException:
            self.close()
            raise
        self._pid = os.getpid()

    def _load(self, file_size: int) -> None:
        name = self.entry.name
        try:
            h5 = h5py.File(self.path, "r", locking=False)  # read-only: no lock (NFS, Lustre, many readers)
        except Exception as exc:  # h5py raises OSError, RuntimeError... for a damaged file
            raise CorruptShardError(f"{name}: not a readable HDF5 file ({exc})") from exc
        try:
            meta = self._check_meta(h5.attrs.get(_ATTR), h5.attrs.get(_ATTR + "_xxh3"))
            tables: list[np.ndarray[Any, Any]] = []  # in the order the writer hashed them
            keys_blob, key_bounds = self._read_keys(h5, tables)
            fields = [self._read_field(h5, j, field, file_size, tables) for j, field in enumerate(meta["fields"])]
            if _tables_digest(tables) != meta.get("tables_xxh3"):
                raise CorruptShardError(f"{name}: HDF5 offsets, presence or checksum tables are damaged")
            self._check_keys(keys_blob, key_bounds, tables[1])
        except Exception as exc:  # whatever h5py raises on a damaged layout: KeyError, OSError...
            h5.close()
            if isinstance(exc, CorruptShardError):
                raise
            raise CorruptShardError(f"{name}: HDF5 shard layout is damaged ({type(exc).__name__}: {exc})") from exc
        except BaseException:
            h5.close()
            raise
        self._key_blob, self._key_bounds, self._fields = keys_blob, key_bounds, fields
        if all(f.file_offset is not None for f in fields):
            h5.close()  # the hot path needs only the fd
        else:
            self._h5 = h5

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
        return meta

    def _table(self, group: Any, name: str, dtype: str, length: int, what: str) -> np.ndarray[Any, Any]:
        table = np.asarray(group[name][()])
        if table.shape != (length,) or table.dtype.kind != np.dtype(dtype).kind:
            raise CorruptShardError(f"{self.entry.name}: HDF5 {name} table of {what} has the wrong shape or type")
        return table.astype(dtype)

    def _offsets(self, group: Any, what: str, data_len: int) -> np.ndarray[Any, Any]:
        offsets = self._table(group, "offsets", "<i8", self.entry.num_samples + 1, what)
        if offsets[0] != 0 or offsets[-1] != data_len or np.any(np.diff(offsets) < 0):
            raise CorruptShardError(f"{self.entry.name}: HDF5 offsets of {what} are inconsistent")
        return offsets

    def _read_keys(self, h5: Any, tables: list[np.ndarray[Any, Any]]) -> tuple[bytes, list[int]]:
        group = h5["keys"]
        data = group["data"]
        offsets = self._offsets(group, "keys", data.shape[0])
        tables += [offsets, self._table(group, "xxh3", "<u8", self.entry.num_samples, "keys")]
        return np.asarray(data[()], dtype=np.uint8).tobytes(), offsets.tolist()

    def _check_keys(self, blob: bytes, bounds: list[int], hashes: np.ndarray[Any, Any]) -> None:
        digest = xxhash.xxh3_64_intdigest
        for i, expected in enumerate(hashes.tolist()):
            if digest(blob[bounds[i] : bounds[i + 1]]) != expected:
                raise CorruptShardError(f"{self.entry.name}: HDF5 key of sample {i} does not match its checksum")

    def _read_field(self, h5: Any, j: int, field: str, file_size: int, tables: list[np.ndarray[Any, Any]]) -> _Field:
        group = h5[f"fields/{j}"]
        data = group["data"]
        if data.dtype != np.uint8 or data.ndim != 1:
            raise CorruptShardError(f"{self.entry.name}: HDF5 field {field!r} is not a flat uint8 dataset")
        n, what = self.entry.num_samples, f"field {field!r}"
        offsets = self._offsets(group, what, data.shape[0])
        present = self._table(group, "present", "u1", n, what)
        hashes = self._table(group, "xxh3", "<u8", n, what)
        tables += [offsets, present, hashes]
        where = data.id.get_offset()
        contiguous = data.chunks is None and not data.compression and where is not None
        if data.shape[0] and contiguous and where + data.shape[0] > file_size:
            raise CorruptShardError(f"{self.entry.name}: HDF5 field {field!r} runs past the end of the file")
        if not data.shape[0]:
            return _Field(field, offsets, present, hashes.tolist(), 0, None)
        return _Field(
            field, offsets, present, hashes.tolist(), where if contiguous else None, None if contiguous else data
        )

    # -- reading ---------------------------------------------------------------------

    def get(self, index: int) -> Sample:
        """Return sample ``index``: one ``pread`` per field present."""
        self._check_index(index)
        self._ensure_open()
        bounds = self._key_bounds
        key = self._key_blob[bounds[index] : bounds[index + 1]].decode("utf-8", "surrogateescape")
        sample: Sample = {"__key__": key}
        for field in self._fields:
            if not field.present[index]:
                continue
            sample[field.name] = self._read(field, index)
        return sample

    def _read(self, field: _Field, index: int) -> bytes:
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
            assert self._fd is not None
            data = os.pread(self._fd, stop - start, field.file_offset + start)
        self._check_bytes(field, index, data, stop - start)
        return data

    def _check_bytes(self, field: _Field, index: int, data: bytes | memoryview, size: int) -> None:
        if len(data) != size or xxhash.xxh3_64_intdigest(data) != field.hashes[index]:
            key = self.keys_of(np.array([index]))[0]
            what = "is truncated" if len(data) != size else "does not match its checksum (corrupt bytes)"
            raise CorruptShardError(
                f"{self.path}: shard {self.entry.name}, sample {key!r}, field {field.name!r} {what}"
            )

    # -- batch reads (streamload.batch): sizes from the offsets, bytes by preadv ---------

    can_read_into = True

    def _choose(self, indices: np.ndarray[Any, Any], fields: Sequence[str]) -> np.ndarray[Any, Any]:
        """Per sample, the index into ``self._fields`` of its first present field of ``fields``."""
        self._ensure_open()
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.entry.num_samples):
            raise IndexError(f"{self.entry.name}: sample indices out of range [0, {self.entry.num_samples})")
        chosen = np.full(len(indices), -1, dtype=np.int64)
        by_name = {f.name: j for j, f in enumerate(self._fields)}
        for name in reversed(fields):  # earlier fields win
            j = by_name.get(name)
            if j is not None:
                chosen[self._fields[j].present[indices] == 1] = j
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
            offsets = self._fields[j].offsets
            sizes[hit] = offsets[indices[hit] + 1] - offsets[indices[hit]]
        return sizes

    def read_into(
        self,
        indices: np.ndarray[Any, Any],
        fields: Sequence[str],
        out: np.ndarray[Any, Any],
        sizes: np.ndarray[Any, Any],
    ) -> None:
        """Read the fields straight into ``out``: one ``preadv`` and one xxh3 per sample."""
        chosen = self._choose(indices, fields).tolist()
        fd, view = self._fd, out.data
        if fd is None:
            raise ValueError(f"{self.entry.name}: reader is closed")
        pos = 0
        for i, j, n in zip(indices.tolist(), chosen, sizes.tolist(), strict=True):
            field = self._fields[j]
            if field.file_offset is None or not n:
                out[pos : pos + n] = np.frombuffer(self._read(field, i), dtype=np.uint8)
            else:
                dest = view[pos : pos + n]
                got = os.preadv(fd, [dest], field.file_offset + int(field.offsets[i]))
                self._check_bytes(field, i, dest if got == n else dest[:got], n)
            pos += n

    def keys_of(self, indices: np.ndarray[Any, Any]) -> list[str]:
        """Return the keys of samples ``indices`` from the keys table."""
        self._ensure_open()
        bounds, blob = self._key_bounds, self._key_blob
        return [blob[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogateescape") for i in indices.tolist()]

    def catalog(self) -> tuple[list[str], list[int]]:
        """Return keys and payload sizes from the offsets tables (no field data is read)."""
        self._ensure_open()
        n = self.entry.num_samples
        sizes = np.zeros(n, dtype=np.int64)
        for field in self._fields:
            sizes += np.diff(field.offsets)
        bounds, blob = self._key_bounds, self._key_blob
        keys = [blob[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogateescape") for i in range(n)]
        return keys, sizes.tolist()

    def close(self) -> None:
        """Close the file descriptor and any open HDF5 handle."""
        fd, h5 = self._fd, self._h5
        self._fd, self._h5, self._pid = None, None, -1
        if h5 is not None:
            h5.close()
        if fd is not None:
            os.close(fd)


FORMAT = Format(
    name="hdf5",
    extension=".h5",
    writer=Hdf5ShardWriter,
    reader=Hdf5ShardReader,
    sidecar_suffix=None,
)
