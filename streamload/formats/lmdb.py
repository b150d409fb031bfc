"""LMDB shards: one single-file LMDB environment per shard (``subdir=False``).

Layout of a shard (one unnamed database)::

    key  u64 big-endian sample index      value: the sample as a binary record (see _record.py)
    key  b"__catalog__"                   u64 n, u64 sizes[n], u64 key_offsets[n + 1], keys (UTF-8)
    key  b"__streamload__"                JSON: {"format": "streamload-lmdb", "version": 1,
                                                 "num_samples": n, "fields": [...]}

Every value is sealed with its xxh3_64 (``_record.seal``) and checked on every read, so
flipped bytes in a sample raise an error naming the shard and sample.

Index keys are 8 bytes and the two metadata keys are longer, so they never collide; they
also sort after every index key, so the whole shard is written in key order with
``append=True`` (full pages, no splits to repair).

Writing: records are kept until :meth:`LmdbShardWriter.finish`, which sizes the map
from their exact lengths with a margin (pages are at least half full, every value larger
than a page's node limit goes to overflow pages), writes them in **one** write
transaction, and grows and retries should that bound ever be short. The environment is
opened with ``lock=False`` (the writer is the only user of its staging file), so no
``-lock`` file appears. The file holds only the pages in use: no compaction copy is
needed, and for the same samples on the same page size the bytes are identical.

Reading: ``readonly=True, lock=False, readahead=False``. Without the lock file there is
no reader table, so any number of workers and ranks can read one shard (no
``MDB_READERS_FULL``); one read transaction lives as long as the reader. The
environment is opened on first use in the reading process and reopened if that process
forks; the reader is never pickled. Batch reads (``read_groups_into``) look each record up
once per batch, check its checksum and copy its fields straight from the map into the
batch; a contiguous batch not yet in the page cache is asked for in large reads first
(py-lmdb touches a value's pages as it returns it, one 4 KiB fault at a time otherwise).

Damage: truncated files, damaged metadata and damaged samples (every value is
checksummed) raise :class:`~streamload.CorruptShardError`. LMDB itself trusts its
B-tree pages (a damaged page number can make it read outside its map and crash the
process), so before an environment is opened its B-tree is walked in Python
(``_lmdb_check.py``): every page, node, child and overflow page LMDB would follow is
bounds-checked first.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np

from .._errors import CorruptShardError, SampleError
from .._fork import ProcessLocal
from ..manifest import ShardEntry
from ._lmdb_env import ADVISE_CHUNK, PROBE_BYTES, SharedEnv, acquire_env, address, page_size, release_env, resident
from ._record import check_field_names, decode_record, encode_record, record_spans, seal, unseal
from .base import MAX_KEY_BYTES, Format, Sample, ShardReader, ShardWriter, check_sample

__all__ = ["FORMAT", "LmdbShardReader", "LmdbShardWriter", "map_size_for", "write_environment"]

_INDEX = struct.Struct(">Q")
_META_KEY = b"__streamload__"
_CATALOG_KEY = b"__catalog__"
_MAGIC = "streamload-lmdb"
_VERSION = 1
#: LMDB page header and node header sizes (lmdb.h internals, stable since 0.9).
_PAGE_HEADER = 16
_NODE_HEADER = 8
#: A record of the batch being read: ``[value, payload view, {field: (offset, size)}, checksum checked]``.
_Record = list[Any]


def map_size_for(records: list[tuple[bytes, int]], page: int | None = None) -> int:
    """Return a map size that holds ``records`` ``(key, value_size)`` in one environment.

    A generous bound, not an estimate: values above a page's node limit take their own
    overflow pages; every other node is counted twice (leaf pages are at least half
    full); branch pages, the two meta pages and slack are added, then 1/8 on top.
    """
    page = page or page_size()
    node_max = (((page - _PAGE_HEADER) // 2) & ~1) - 2
    overflow = leaf = 0
    for key, size in records:
        node = _NODE_HEADER + len(key) + size
        if node > node_max:
            overflow += (_PAGE_HEADER - 1 + size) // page + 1
            node = _NODE_HEADER + len(key) + 8
        leaf += node + (node & 1) + 2
    leaf_pages = 2 * (leaf // (page - _PAGE_HEADER) + 1)
    pages = 2 + overflow + leaf_pages + leaf_pages // 8 + 16
    return (pages + pages // 8) * page


def _catalog_bytes(keys: list[bytes], sizes: list[int]) -> bytes:
    offsets = np.zeros(len(keys) + 1, dtype="<u8")
    np.cumsum([len(k) for k in keys], out=offsets[1:])
    return b"".join([_INDEX.pack(len(keys)), np.asarray(sizes, dtype="<u8").tobytes(), offsets.tobytes(), *keys])


class LmdbShardWriter(ShardWriter):
    """Writes one LMDB shard in a single write transaction."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._records: list[bytes] = []
        self._keys: list[bytes] = []
        self._sizes: list[int] = []
        self._fields: set[str] = set()

    def write(self, sample: Mapping[str, Any]) -> None:
        """Encode one sample; it is written to the environment by :meth:`finish`."""
        key, fields = check_sample(sample)
        self._records.append(encode_record(key, fields))
        self._keys.append(key.encode("utf-8", "surrogateescape"))
        self._sizes.append(sum(len(data) for _, data in fields))
        self._fields.update(name for name, _ in fields)
        self.num_samples += 1

    def _items(self) -> list[tuple[bytes, bytes]]:
        meta = {"format": _MAGIC, "version": _VERSION, "num_samples": self.num_samples, "fields": sorted(self._fields)}
        items = [(_INDEX.pack(i), record) for i, record in enumerate(self._records)]
        items.append((_CATALOG_KEY, seal(_catalog_bytes(self._keys, self._sizes))))
        items.append((_META_KEY, seal(json.dumps(meta, sort_keys=True).encode())))
        return items

    def finish(self) -> None:
        """Write every sample in one transaction into a map sized to fit; no sidecar."""
        items = self._items()
        write_environment(self.path, items, map_size_for([(k, len(v)) for k, v in items]))
        self._records, self._keys, self._sizes = [], [], []
        return None


def write_environment(path: str, items: list[tuple[bytes, bytes]], map_size: int) -> int:
    """Write ``items`` (in key order) into a fresh single-file environment in one transaction.

    Should ``map_size`` be short, the transaction is abandoned and written again from an
    empty file with twice the room, so ``MapFullError`` never escapes. Returns the map
    size used (it is recorded in the file, so it depends only on the items).
    """
    while not _try_write(path, items, map_size):
        map_size *= 2
    return map_size


def _try_write(path: str, items: list[tuple[bytes, bytes]], map_size: int) -> bool:
    with open(path, "wb"):
        pass  # start from an empty file: a retry must not see the pages of the last try
    env = lmdb.open(
        path,
        subdir=False,
        lock=False,
        map_size=map_size,
        max_dbs=0,
        readahead=False,
        meminit=True,
        metasync=True,
        sync=True,
    )
    try:
        with env.begin(write=True) as txn:
            cursor = txn.cursor()
            for key, value in items:
                if not cursor.put(key, value, append=True):
                    raise CorruptShardError(f"{path}: LMDB refused key {key!r} (keys out of order)")
    except lmdb.MapFullError:
        return False
    finally:
        env.close()
    return True


@dataclass
class _Open:
    """A reader's hold on its shard in one process: the shared environment, its own read transaction.

    ``batch``: the parsed records of the batch being read (see ``LmdbShardReader._records``),
    by index: views into the map, valid while the transaction lives.
    """

    env_id: tuple[int, int]
    shared: SharedEnv
    txn: Any
    batch: dict[int, _Record] = field(default_factory=dict)


def _open_shard(path: str, entry: ShardEntry) -> _Open:
    """Open shard ``entry`` at ``path`` here: its shared environment, a read transaction; its metadata checked."""
    env_id, shared = acquire_env(path, entry.name)
    try:
        try:
            txn = shared.env.begin(buffers=True)
            meta, entries = txn.get(_META_KEY), shared.env.stat()["entries"]
        except lmdb.Error as exc:
            raise CorruptShardError(f"{entry.name}: LMDB metadata unreadable ({exc})") from exc
        _check_meta(meta, entries, entry)
    except BaseException:
        release_env(env_id, shared)
        raise
    return _Open(env_id, shared, txn)


def _check_meta(raw: Any, entries: int, entry: ShardEntry) -> None:
    """Check the shard's metadata record against its manifest entry."""
    name, n = entry.name, entry.num_samples
    if raw is None:
        raise CorruptShardError(f"{name}: not a streamload LMDB shard (no {_META_KEY.decode()} record)")
    try:
        meta = json.loads(bytes(unseal(raw, f"{name}: LMDB metadata record")))
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        if isinstance(exc, CorruptShardError):
            raise
        raise CorruptShardError(f"{name}: LMDB metadata record is not JSON ({type(exc).__name__})") from exc
    if not isinstance(meta, dict) or meta.get("format") != _MAGIC:
        raise CorruptShardError(f"{name}: not a streamload LMDB shard (no {_META_KEY.decode()} record)")
    fields = meta.get("fields")
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise CorruptShardError(f"{name}: LMDB metadata field list is damaged")
    check_field_names(fields, f"{name}: LMDB metadata")
    if meta.get("version") != _VERSION:
        raise CorruptShardError(f"{name}: LMDB shard version {meta.get('version')!r}, expected {_VERSION}")
    if meta.get("num_samples") != n or entries != n + 2:
        raise CorruptShardError(
            f"{name}: LMDB shard holds {meta.get('num_samples')!r} samples ({entries} records), manifest says {n}"
        )


def _close_open(
    held: _Open,
    _error: type[Exception] = lmdb.Error,
    _release: Callable[[tuple[int, int], SharedEnv], None] = release_env,
    _finalizing: Callable[[], bool] = sys.is_finalizing,
) -> None:
    """End the read transaction and release the environment.

    What it calls is bound at definition: at interpreter exit this may run after the
    module's globals are gone; the environment is then left to the process's end.
    """
    try:
        try:
            held.txn.abort()
        except _error:  # pragma: no cover - the environment was closed under it
            pass
        _release(held.env_id, held.shared)
    except Exception:
        if not _finalizing():
            raise


class LmdbShardReader(ShardReader):
    """Reads one LMDB shard through a read-only, lock-free environment opened on first use.

    The environment and the read transaction belong to the process that opened them
    (:class:`~streamload._fork.ProcessLocal`): a forked worker opens its own.
    """

    def __init__(self, path: str, entry: ShardEntry, sidecar_path: str | None = None) -> None:
        super().__init__(path, entry, sidecar_path)
        self._held: ProcessLocal[_Open] = ProcessLocal(functools.partial(_open_shard, path, entry), _close_open)
        self._catalog: tuple[list[str], list[int]] | None = None

    # -- opening ---------------------------------------------------------------------

    def _transaction(self) -> Any:
        """Return the read transaction of this process, opening the environment if needed."""
        return self._held.get().txn

    @property
    def _env(self) -> SharedEnv | None:
        """The environment this process opened for the reader, if it did."""
        held = self._held.peek()
        return None if held is None else held.shared

    # -- reading ---------------------------------------------------------------------

    def _where(self, index: int) -> str:
        return f"{self.entry.name}: sample {index}"

    def _decode(self, value: Any, index: int) -> Sample:
        try:
            return decode_record(value, self._where(index))
        except CorruptShardError as exc:
            raise self._with_key(exc, index) from exc

    def _with_key(self, exc: CorruptShardError, index: int) -> CorruptShardError:
        """Name the damaged sample's key too, from the catalog (sealed on its own)."""
        try:
            key = self.catalog()[0][index]
        except (CorruptShardError, IndexError):
            return CorruptShardError(f"{self.path}: {exc}")
        return CorruptShardError(f"{self.path}: {exc}; key {key!r}")

    def get(self, index: int) -> Sample:
        """Return sample ``index`` (one B-tree lookup, one copy out of the map)."""
        self._check_index(index)
        value = _get(self._transaction(), _INDEX.pack(index), self._where(index))
        if value is None:
            raise CorruptShardError(f"{self._where(index)} is missing from the LMDB shard")
        return self._decode(value, index)

    def iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        """Yield samples ``start..stop-1`` walking one cursor through the B-tree."""
        if start >= stop:
            return
        self._check_index(start)
        self._check_index(stop - 1)
        txn = self._transaction()
        cursor = txn.cursor()
        error = lmdb.Error  # bound now: closed at interpreter exit, the module's globals may be gone
        try:
            self._prefetch_run(txn, start, stop)
            found = cursor.set_key(_INDEX.pack(start))
            for index in range(start, stop):
                if not found or bytes(cursor.key()) != _INDEX.pack(index):
                    raise CorruptShardError(f"{self._where(index)} is missing from the LMDB shard")
                sample = self._decode(cursor.value(), index)
                found = cursor.next()
                yield sample
        except error as exc:
            raise CorruptShardError(f"{self.entry.name}: LMDB read failed ({exc})") from exc
        finally:
            cursor.close()

    # -- batch reads (streamload.batch): each record looked up and parsed once per batch --
    # ``RawCollate.read_batch`` asks for the sizes of the data fields, then of the label
    # field, then reads both groups. The first call looks each record up and parses its
    # field table (lengths checked, so every size lies inside the record); the later
    # calls on the same indices reuse those views into the map (valid while this
    # reader's read transaction lives: the cache is dropped with it). Reading checks
    # each record's checksum and copies its fields straight from the map into the batch
    # buffers while the record is still in the CPU cache, so every byte handed out is
    # verified. A record whose lengths do not add up, or that lacks a field, is
    # checksummed at once, so damage is reported as damage. Only the latest call's
    # records are kept.

    def _records(self, indices: list[int]) -> list[_Record]:
        """Return each record as ``[value, payload view, field spans, checked]``; reuse the last call's."""
        held = self._held.get()
        txn = held.txn
        cached, fresh = held.batch, {}
        missing = [index for index in indices if index not in cached]
        if len(missing) > 1:
            self._prefetch_batch(txn, missing)
        records = []
        for index in indices:
            record = cached.get(index)
            if record is None:
                self._check_index(index)
                value = _get(txn, _INDEX.pack(index), self._where(index))
                if value is None:
                    raise CorruptShardError(f"{self._where(index)} is missing from the LMDB shard")
                try:
                    view, spans = record_spans(value, self._where(index), check=False)
                except CorruptShardError as exc:
                    self._verify([value, None, {}, False], index)  # a checksum mismatch says more
                    raise self._with_key(exc, index) from exc
                record = [value, view, spans, False]
            fresh[index] = record
            records.append(record)
        held.batch = fresh
        return records

    def _prefetch_batch(self, txn: Any, indices: list[int]) -> None:
        """Ask the kernel for the batch's bytes in large reads when they lie close together.

        py-lmdb touches every page of a value as it returns it, and the map is opened
        without read-ahead, so a batch read from a cold page cache would fault its pages
        in one at a time. Values are stored in index order: the batch spans the bytes
        from its lowest to its highest index, found with two lookups, and they are asked
        for (as ``iter_range`` does for a run) only when that span is at most twice the
        batch's own bytes (from the catalog), never for a scattered batch.
        """
        lo, hi = min(indices), max(indices)
        if self._env is None or self._env.base is None or not 0 <= lo <= hi < self.entry.num_samples:
            return
        first = _get(txn, _INDEX.pack(lo), self._where(lo))
        last = _get(txn, _INDEX.pack(hi), self._where(hi))
        if first is None or last is None:
            return
        start, end = address(first), address(last) + len(last)
        # Warm page cache (the usual case): asking would only cost time. The two values
        # above were just read, so look at the pages half way between them.
        middle = (start + end) // 2
        if end <= start or resident(middle, min(PROBE_BYTES, end - middle)):
            return
        try:
            sizes = self.catalog()[1]
        except CorruptShardError:
            return  # reported where the catalog is needed; prefetching is only a hint
        if end - start <= 2 * sum(sizes[i] for i in indices) + ADVISE_CHUNK:
            self._env.prefetch(first, last)

    def _verify(self, record: _Record, index: int) -> None:
        """Check the record's checksum (once); raise CorruptShardError naming shard and key."""
        if not record[3]:
            try:
                unseal(record[0], self._where(index))
            except CorruptShardError as exc:
                raise self._with_key(exc, index) from exc
            record[3] = True

    def _span(self, record: _Record, fields: Sequence[str], index: int) -> tuple[int, int]:
        spans = record[2]
        for name in fields:
            span = spans.get(name)
            if span is not None:
                return span  # type: ignore[no-any-return]
        self._verify(record, index)  # a damaged field name is damage, not a missing field
        key = self.keys_of(np.array([index]))[0]
        raise SampleError(f"{self.entry.name}: sample {key!r} has none of the fields {tuple(fields)}")

    def field_sizes(self, indices: np.ndarray[Any, Any], fields: Sequence[str]) -> np.ndarray[Any, Any]:
        """Return the sizes of each sample's first present field of ``fields`` (record headers only)."""
        idx = indices.tolist()
        span = self._span
        return np.array(
            [span(record, fields, i)[1] for i, record in zip(idx, self._records(idx), strict=True)], dtype=np.int64
        )

    def read_groups_into(
        self,
        indices: np.ndarray[Any, Any],
        groups: Sequence[tuple[Sequence[str], np.ndarray[Any, Any], np.ndarray[Any, Any]]],
    ) -> None:
        """Check each record, then copy each group's field from the map into its ``out``: one lookup per sample."""
        idx = indices.tolist()
        try:
            records = self._records(idx)
            dests = [out.data.cast("B") for _, out, _ in groups]
            sizes = [np.asarray(size).tolist() for _, _, size in groups]
            pos = [0] * len(groups)
            for k, (i, record) in enumerate(zip(idx, records, strict=True)):
                self._verify(record, i)
                view = record[1]
                for g, (fields, _, _) in enumerate(groups):
                    at, size = self._span(record, fields, i)
                    if size != sizes[g][k]:
                        raise CorruptShardError(f"{self._where(i)}: field size changed between two reads")
                    dests[g][pos[g] : pos[g] + size] = view[at : at + size]
                    pos[g] += size
        finally:
            held = self._held.peek()
            if held is not None:
                held.batch = {}  # the batch is read: drop its views

    def keys_of(self, indices: np.ndarray[Any, Any]) -> list[str]:
        """Return the keys of samples ``indices`` from the catalog record."""
        keys = self.catalog()[0]
        return [keys[i] for i in indices.tolist()]

    def _prefetch_run(self, txn: Any, start: int, stop: int) -> None:
        first = _get(txn, _INDEX.pack(start), self._where(start))
        last = _get(txn, _INDEX.pack(stop - 1), self._where(stop - 1))
        if stop - start > 1 and first is not None and last is not None and self._env is not None:
            self._env.prefetch(first, last)

    def catalog(self) -> tuple[list[str], list[int]]:
        """Return keys and payload sizes from the shard's catalog record (no sample is read)."""
        if self._catalog is None:
            self._catalog = self._read_catalog()
        return self._catalog

    def _read_catalog(self) -> tuple[list[str], list[int]]:
        name, n = self.entry.name, self.entry.num_samples
        sealed = _get(self._transaction(), _CATALOG_KEY, f"{name}: LMDB catalog record")
        raw = bytes(unseal(sealed, f"{name}: LMDB catalog record")) if sealed is not None else b""
        head = _INDEX.size + 8 * n + 8 * (n + 1)
        if len(raw) < head or _INDEX.unpack_from(raw)[0] != n:
            raise CorruptShardError(f"{name}: LMDB catalog record is missing or damaged")
        sizes = np.frombuffer(raw, dtype="<u8", count=n, offset=_INDEX.size)
        offsets = np.frombuffer(raw, dtype="<u8", count=n + 1, offset=_INDEX.size + 8 * n)
        keys_blob = raw[head:]
        if offsets[0] != 0 or np.any(offsets[1:] < offsets[:-1]) or offsets[-1] != len(keys_blob):
            raise CorruptShardError(f"{name}: LMDB catalog has inconsistent key offsets")
        if np.any(np.diff(offsets) > MAX_KEY_BYTES):
            raise CorruptShardError(f"{name}: LMDB catalog key lengths exceed {MAX_KEY_BYTES} bytes")
        # Payload sizes: each inside the file, and all of them together (as float: no wrap-around).
        file_size = self._env.size if self._env is not None else 0
        if np.any(sizes > file_size) or float(np.sum(sizes, dtype=np.float64)) > file_size:
            raise CorruptShardError(f"{name}: LMDB catalog sizes exceed the shard's {file_size} bytes")
        bounds = offsets.tolist()
        keys = [keys_blob[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogateescape") for i in range(n)]
        return keys, [int(s) for s in sizes]

    def close(self) -> None:
        """End the read transaction and release the environment (a forked child's: nothing of the parent's)."""
        self._held.clear()  # the batch's views into the map die with the transaction


def _get(txn: Any, key: bytes, where: str) -> Any:
    """``txn.get(key)`` with LMDB's errors (damaged pages) as :class:`CorruptShardError`."""
    try:
        return txn.get(key)
    except lmdb.Error as exc:
        raise CorruptShardError(f"{where}: LMDB read failed ({exc})") from exc


FORMAT = Format(
    name="lmdb",
    extension=".lmdb",
    writer=LmdbShardWriter,
    reader=LmdbShardReader,
    sidecar_suffix=None,
)
