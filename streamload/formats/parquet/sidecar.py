"""The sidecar of a Parquet file: written once by the indexer, checked whole by every reader.

An uncompressed ``.npz`` (read with ``allow_pickle=False``; its manifest hash is checked
before use); its tables are listed in :mod:`streamload.formats.parquet`. A reader trusts
nothing of the file it did not check against it: not the file's own footer (the sidecar
keeps the footer as indexed), nor a row's bytes (each has its digest here).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._errors import CorruptShardError, UnsafeShardError
from ...manifest import ShardEntry, algorithm_of, new_hasher
from ...sample import IMAGE_EXTENSIONS
from .._record import open_regular_file
from ..base import key_problem
from .schema import Plan

__all__ = ["MAGIC", "MAX_SIDECAR_BYTES", "SIDECAR_SUFFIX", "VERSION", "Sidecar", "relabel_sidecar", "write_sidecar"]

MAGIC = "streamload-parquet"
VERSION = 1
SIDECAR_SUFFIX = ".slpq"
#: Largest sidecar read.
MAX_SIDECAR_BYTES = 1 << 31


@dataclass(frozen=True)
class Sidecar:
    """A Parquet file's sidecar, checked against its manifest entry: what a reader knows before it reads."""

    meta: dict[str, Any]
    #: Rows of the file (kept or not).
    rows_total: int
    #: Per sample, its row in the file (``None``: sample ``i`` is row ``i``).
    rows: np.ndarray | None
    #: The image field names; ``codes`` indexes them per sample.
    fields: list[str]
    codes: np.ndarray
    sizes: np.ndarray
    digests: list[int]
    labels: np.ndarray | None
    json_digests: list[int] | None
    #: Per row group, the ``[start, end)`` bytes a read of it needs.
    extent: np.ndarray
    #: Rows stored as they are: each image's file offset (read by positioned reads, no pyarrow).
    offsets: np.ndarray | None
    #: Per row group, its first row (and the number of rows at the end).
    starts: np.ndarray
    #: The file's footer as indexed (a metadata-only Parquet file).
    footer: bytes
    plan: Plan

    @classmethod
    def load(cls, path: str, entry: ShardEntry) -> Sidecar:
        """Read and check the sidecar at ``path`` of shard ``entry``.

        Raises:
            CorruptShardError: Naming the shard, if it is damaged or does not describe the shard.
            UnsafeShardError: If its key prefix would make unsafe keys.
        """
        meta, arrays = _parse(_read(path, entry), entry.name)
        _check(meta, arrays, entry)
        groups = meta["row_groups"]
        return cls(
            meta=meta,
            rows_total=meta["rows"],
            rows=arrays.get("row") if "kept" in meta else None,
            fields=meta["fields"],
            codes=arrays["field"],
            sizes=arrays["size"],
            digests=arrays["image_xxh3"].tolist(),
            labels=arrays.get("label"),
            json_digests=arrays["json_xxh3"].tolist() if meta.get("json") else None,
            extent=arrays["extent"],
            offsets=arrays.get("offset") if meta.get("direct") else None,
            starts=np.concatenate([[0], np.cumsum(np.asarray(groups, dtype=np.int64))]),
            footer=arrays["footer"].tobytes(),
            plan=Plan(
                str(meta.get("image")),
                bool(meta.get("struct")),
                False,
                meta.get("label"),
                tuple(map(str, meta.get("json") or ())),
                None,
            ),
        )

    def row(self, index: int) -> int:
        """Sample ``index``'s row in the file."""
        return index if self.rows is None else int(self.rows[index])

    def group_of(self, index: int) -> int:
        """The row group holding sample ``index``."""
        return int(np.searchsorted(self.starts, self.row(index), side="right")) - 1

    def key(self, index: int) -> str:
        """Sample ``index``'s key: the file's key prefix and its row."""
        return f"{self.meta['prefix']}/{self.row(index):010d}"


def _read(path: str, entry: ShardEntry) -> bytes:
    """The sidecar's bytes, checked against the manifest's hash when it has one."""
    name = entry.name
    fd = open_regular_file(path, name)
    try:
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_SIDECAR_BYTES + 1)
    finally:
        os.close(fd)
    sidecar = entry.sidecar
    if sidecar is not None and sidecar.hash is not None:
        hasher = new_hasher(sidecar.algorithm or algorithm_of(sidecar.hash))
        hasher.update(raw)
        if hasher.hexdigest() != sidecar.hash:
            raise CorruptShardError(f"{name}: sidecar {sidecar.name} does not match its manifest hash")
    return raw


#: A ``.npy`` header as ``np.save`` writes it (version 1): a little-endian or byte dtype, C order.
_NPY = re.compile(rb"\{'descr': '([<|][a-z]\d{1,2})', 'fortran_order': False, 'shape': \(((?:\d+, ?)*\d*)\), \} *\n")
_LOCAL = struct.Struct("<4s22xHH")  # a zip member's local header: signature, name and extra lengths


def _tables(raw: bytes) -> dict[str, np.ndarray] | None:
    """The tables of an uncompressed ``.npz`` as views of ``raw``, CRCs checked; ``None``: not as ``np.savez`` writes.

    ``np.load`` reads the same, at several times the cost (a file object per table, its
    header through ``ast``); a sidecar is read by every reader of its file.
    """
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                return None
            signature, name_len, extra_len = _LOCAL.unpack_from(raw, info.header_offset)
            start = info.header_offset + _LOCAL.size + name_len + extra_len
            data = memoryview(raw)[start : start + info.file_size]
            if signature != b"PK\x03\x04" or len(data) != info.file_size or zlib.crc32(data) != info.CRC:
                return None
            head = _NPY.match(raw, start + 10, start + 10 + int.from_bytes(data[8:10], "little"))
            if bytes(data[:8]) != b"\x93NUMPY\x01\x00" or head is None:
                return None
            dtype = np.dtype(head[1].decode())
            shape = tuple(int(d) for d in head[2].split(b",") if d.strip())
            count = math.prod(shape)
            if head.end() - start + count * dtype.itemsize != info.file_size:
                return None
            out[info.filename[:-4]] = np.frombuffer(raw, dtype, count, head.end()).reshape(shape)
    return out


def _parse(raw: bytes, name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The sidecar's meta and tables (no pickle), or a ``CorruptShardError`` naming the shard."""
    try:
        arrays = _tables(raw)
        if arrays is None:  # written otherwise: numpy reads it
            with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        meta = json.loads(arrays["meta"].tobytes())
    except Exception as exc:  # a damaged zip, a missing array, bad JSON
        raise CorruptShardError(f"{name}: Parquet sidecar is damaged ({type(exc).__name__}: {exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != MAGIC or meta.get("version") != VERSION:
        raise CorruptShardError(f"{name}: not a streamload Parquet sidecar (or another version)")
    return meta, arrays


def _check(meta: dict[str, Any], arrays: dict[str, np.ndarray], entry: ShardEntry) -> None:
    """Check that the sidecar describes the shard's samples, and that its tables are consistent."""
    name, n = entry.name, entry.num_samples
    groups = meta.get("row_groups")
    fields = meta.get("fields")
    rows = meta.get("rows")
    kept = arrays.get("row") if "kept" in meta else None  # rows left out at indexing: sample i is row[i]
    if (
        not isinstance(rows, int)
        or (rows != n if kept is None else meta.get("kept") != n)
        or not isinstance(groups, list)
        or not all(isinstance(g, int) and g >= 0 for g in groups)
        or sum(groups) != rows
        or not isinstance(fields, list)
        or not all(isinstance(f, str) and f in IMAGE_EXTENSIONS for f in fields)
    ):
        raise CorruptShardError(f"{name}: Parquet sidecar does not describe {n} rows")
    expect = {"field": (np.uint8, n), "size": (np.int64, n), "image_xxh3": (np.uint64, n)}
    if meta.get("label"):
        expect["label"] = (np.int64, n)
    if meta.get("json"):
        expect["json_xxh3"] = (np.uint64, n)
    if meta.get("direct"):
        expect["offset"] = (np.int64, n)
    if "kept" in meta:
        expect["row"] = (np.int64, n)
    for key, (dtype, length) in expect.items():
        arr = arrays.get(key)
        if arr is None or arr.dtype != dtype or arr.shape != (length,):
            raise CorruptShardError(f"{name}: Parquet sidecar table {key!r} is damaged")
    if kept is not None and n and (int(kept[0]) < 0 or int(kept[-1]) >= rows or bool(np.any(kept[1:] <= kept[:-1]))):
        raise CorruptShardError(f"{name}: Parquet sidecar table 'row' is damaged")
    extent = arrays.get("extent")
    if extent is None or extent.dtype != np.int64 or extent.shape != (len(groups), 2):
        raise CorruptShardError(f"{name}: Parquet sidecar table 'extent' is damaged")
    if n and (int(arrays["field"].max()) >= len(fields) or int(arrays["size"].min()) < 0):
        raise CorruptShardError(f"{name}: Parquet sidecar field table is damaged")
    direct = arrays.get("offset") if meta.get("direct") else None
    if direct is not None and n:
        ends = direct + arrays["size"]
        if int(direct.min()) < 4 or int(ends.max()) > entry.num_bytes - 8 or bool(np.any(ends < direct)):
            raise CorruptShardError(f"{name}: Parquet sidecar offsets lie outside the file")
    prefix = meta.get("prefix")
    problem = key_problem(f"{prefix}/{0:010d}") if isinstance(prefix, str) else "its key prefix is not a str"
    if problem is not None:
        raise UnsafeShardError(f"{name}: Parquet sidecar key prefix: {problem}")


def write_sidecar(path: str, meta: Mapping[str, Any], footer: bytes, tables: Mapping[str, np.ndarray]) -> None:
    """Write a sidecar: ``meta`` (its format and version added), the footer as indexed, and the tables."""
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(
            json.dumps({**meta, "format": MAGIC, "version": VERSION}, sort_keys=True).encode(), np.uint8
        ),
        "footer": np.frombuffer(footer, dtype=np.uint8),
        **tables,
    }
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def relabel_sidecar(path: str, mapping: Sequence[int]) -> None:
    """Rewrite the labels of a sidecar the indexer just wrote: label ``i`` becomes ``mapping[i]``."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    table = np.asarray(mapping, dtype=np.int64)
    arrays["label"] = table[arrays["label"]] if len(arrays["label"]) else arrays["label"]
    with open(path, "wb") as f:
        np.savez(f, **arrays)
