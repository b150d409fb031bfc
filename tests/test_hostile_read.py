"""Hostile input for the readers: shards, sidecars, manifests and images built to leave
the dataset, hang, crash with a raw traceback or allocate absurd memory."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import xxhash

from streamload import CorruptShardError, DatasetWriter, ShardError, UnsafeShardError
from streamload.formats import get_format
from streamload.manifest import Manifest, ShardEntry
from streamload.verify import verify_dataset
from tests.digests import digest

Sample = dict[str, Any]

SAMPLES: list[Sample] = [
    {"__key__": f"k{i:03d}", "bin": bytes([i]) * (100 + i), **({"cls": str(i % 3).encode()} if i % 2 else {})}
    for i in range(8)
]


# -- HDF5: a streamload layout written by hand, one dataset at a time --------------------

#: ``make(group, name, array)`` creates one dataset of the layout (default: contiguous, as ours).
Maker = Callable[[h5py.Group, str, np.ndarray], None]


def _contiguous(group: h5py.Group, name: str, array: np.ndarray) -> None:
    group.create_dataset(name, data=array, track_times=False)


#: ``alter(path, array)`` returns what to store as table or data ``path`` (e.g. ``"fields/0/offsets"``).
Alter = Callable[[str, np.ndarray], np.ndarray]


def _build_h5(
    path: Path,
    samples: list[Sample],
    make: Maker = _contiguous,
    alter: Alter | None = None,
    fields: list[str] | None = None,
) -> None:
    """Write ``samples`` in the streamload HDF5 layout, creating each dataset with ``make``.

    ``alter`` changes arrays before they are hashed and written (so the checksums still
    match, as a hostile writer would make them); ``fields`` replaces the field list of the
    metadata.
    """
    names = sorted({f for s in samples for f in s if not f.startswith("__")})
    digest = xxhash.xxh3_64()

    def column(group: h5py.Group, values: list[bytes | None], presence: bool) -> None:
        data = b"".join(v for v in values if v is not None)
        tables = {"offsets": np.cumsum([0] + [len(v or b"") for v in values]).astype("<i8")}
        if presence:
            tables["present"] = np.array([v is not None for v in values], np.uint8)
        tables["xxh3"] = np.array([0 if v is None else xxhash.xxh3_64_intdigest(v) for v in values], "<u8")
        prefix = group.name.strip("/")
        for name, array in [("data", np.frombuffer(data, np.uint8)), *tables.items()]:
            if alter is not None:
                array = alter(f"{prefix}/{name}", array)
            make(group, name, array)
            if name != "data":
                digest.update(np.ascontiguousarray(array).tobytes())

    with h5py.File(path, "w", libver="earliest") as f:
        column(f.create_group("keys"), [s["__key__"].encode() for s in samples], presence=False)
        for j, name in enumerate(names):
            column(f.create_group(f"fields/{j}"), [s.get(name) for s in samples], presence=True)
        meta = json.dumps(
            {
                "format": "streamload-hdf5",
                "version": 1,
                "num_samples": len(samples),
                "fields": names if fields is None else fields,
                "tables_xxh3": f"{digest.intdigest():016x}",
            },
            sort_keys=True,
        )
        f.attrs["streamload"] = meta
        f.attrs["streamload_xxh3"] = f"{xxhash.xxh3_64_intdigest(meta.encode()):016x}"


def _only(target: str, special: Maker) -> Maker:
    """A maker that builds the dataset ``target`` (e.g. ``"fields/0/data"``) with ``special``."""

    def make(group: h5py.Group, name: str, array: np.ndarray) -> None:
        (special if f"{group.name.strip('/')}/{name}" == target else _contiguous)(group, name, array)

    return make


def _read_all(path: Path, n: int) -> list[Sample]:
    entry = ShardEntry(name=path.name, num_bytes=path.stat().st_size, num_samples=n)
    reader = get_format("hdf5").reader(str(path), entry, None)
    try:
        return list(reader.iter_range(0, n))
    finally:
        reader.close()


def _dataset_with_shard(tmp_path: Path, fmt: str, samples: list[Sample], hostile: Path | None = None) -> Path:
    """A real dataset of one shard; with ``hostile``, that file replaces the shard (manifest updated)."""
    ds = tmp_path / "ds"
    with DatasetWriter(str(ds), format=fmt, max_samples=len(samples)) as writer:
        for sample in samples:
            writer.write(sample)
    if hostile is not None:
        _replace_shard(ds, hostile.read_bytes())
    return ds


def _replace_shard(ds: Path, data: bytes, index: int = 0, sidecar: bytes | None = None) -> None:
    """Overwrite shard ``index`` (and its sidecar) and fix its manifest entry as a hostile writer would."""
    manifest = json.loads((ds / "index.json").read_text())
    entry = manifest["shards"][index]
    (ds / entry["name"]).write_bytes(data)
    entry.update(bytes=len(data), hash=digest(data, manifest))
    if sidecar is not None:
        (ds / entry["sidecar"]["name"]).write_bytes(sidecar)
        entry["sidecar"].update(bytes=len(sidecar), hash=digest(sidecar, manifest))
    (ds / "index.json").write_text(json.dumps(manifest))


def _assert_verify_refuses(ds: Path, *patterns: str) -> None:
    report = verify_dataset(str(ds))
    assert not report.ok
    (name, problem), *_ = report.problems
    assert name in problem
    assert any(p in problem for p in patterns), problem


def test_hand_built_h5_layout_is_readable(tmp_path: Path) -> None:
    """The builder above makes shards the reader accepts (so each hostile test changes one thing)."""
    path = tmp_path / "ok.h5"
    _build_h5(path, SAMPLES)
    assert _read_all(path, len(SAMPLES)) == SAMPLES
    ds = _dataset_with_shard(tmp_path, "hdf5", SAMPLES, hostile=path)
    assert verify_dataset(str(ds)).ok


def _external(outside: Path) -> Maker:
    def make(group: h5py.Group, name: str, array: np.ndarray) -> None:
        outside.write_bytes(array.tobytes())  # the very bytes the checksums expect
        group.create_dataset(name, shape=array.shape, dtype=array.dtype, external=[(str(outside), 0, array.nbytes)])

    return make


def test_hdf5_external_storage_is_refused_before_reading(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    path = tmp_path / "ext.h5"
    _build_h5(path, SAMPLES, _only("fields/0/data", _external(outside)))
    with pytest.raises(ShardError, match=r"ext\.h5.*fields/0/data has external storage"):
        _read_all(path, len(SAMPLES))
    ds = _dataset_with_shard(tmp_path, "hdf5", SAMPLES, hostile=path)
    _assert_verify_refuses(ds, "external storage")


@pytest.mark.parametrize("table", ["keys/offsets", "fields/1/xxh3"])
def test_hdf5_external_storage_of_a_table_is_refused(tmp_path: Path, table: str) -> None:
    path = tmp_path / "ext.h5"
    _build_h5(path, SAMPLES, _only(table, _external(tmp_path / "outside.bin")))
    with pytest.raises(ShardError, match=r"ext\.h5.*external storage"):
        _read_all(path, len(SAMPLES))


@pytest.mark.timeout(30)
def test_hdf5_external_fifo_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    path = tmp_path / "fifo.h5"

    def make(group: h5py.Group, name: str, array: np.ndarray) -> None:
        group.create_dataset(name, shape=array.shape, dtype=array.dtype, external=[(str(fifo), 0, array.nbytes)])

    _build_h5(path, SAMPLES, _only("fields/0/data", make))
    os.mkfifo(fifo)
    with pytest.raises(ShardError, match=r"fifo\.h5.*external storage"):
        _read_all(path, len(SAMPLES))
    ds = _dataset_with_shard(tmp_path, "hdf5", SAMPLES, hostile=path)
    _assert_verify_refuses(ds, "external storage")


def _linked(kind: str, tmp_path: Path) -> Maker:
    def make(group: h5py.Group, name: str, array: np.ndarray) -> None:
        if kind == "external_link":
            with h5py.File(tmp_path / "other.h5", "w") as other:
                other.create_dataset("x", data=array)
            group[name] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
        elif kind == "soft_link":
            group.file.create_dataset(f"/elsewhere{group.name.replace('/', '_')}", data=array)
            group[name] = h5py.SoftLink(f"/elsewhere{group.name.replace('/', '_')}")
        else:  # a virtual dataset mapping another file
            with h5py.File(tmp_path / "other.h5", "w") as other:
                other.create_dataset("x", data=array)
            layout = h5py.VirtualLayout(shape=array.shape, dtype=array.dtype)
            layout[:] = h5py.VirtualSource(str(tmp_path / "other.h5"), "x", shape=array.shape)
            group.create_virtual_dataset(name, layout)

    return make


@pytest.mark.parametrize(
    "kind, message", [("external_link", "external link"), ("soft_link", "soft link"), ("vds", "virtual dataset")]
)
@pytest.mark.parametrize("target", ["fields/0/data", "keys/data", "fields/1/present"])
def test_hdf5_links_and_virtual_datasets_are_refused(tmp_path: Path, kind: str, message: str, target: str) -> None:
    path = tmp_path / "hostile.h5"
    _build_h5(path, SAMPLES, _only(target, _linked(kind, tmp_path)))
    with pytest.raises(ShardError, match=rf"hostile\.h5.*{target}.*{message}"):
        _read_all(path, len(SAMPLES))
    ds = _dataset_with_shard(tmp_path, "hdf5", SAMPLES, hostile=path)
    _assert_verify_refuses(ds, message)


def test_hdf5_linked_group_is_refused(tmp_path: Path) -> None:
    """A whole group (``fields/0``) that is an external link to another file."""
    path = tmp_path / "hostile.h5"
    _build_h5(path, SAMPLES)
    other = tmp_path / "other.h5"
    with h5py.File(path, "a") as f, h5py.File(other, "w") as o:
        f.copy(f["fields/0"], o, name="g")
        del f["fields/0"]
        f["fields/0"] = h5py.ExternalLink(str(other), "/g")
    with pytest.raises(ShardError, match=r"hostile\.h5.*fields/0 is an external link"):
        _read_all(path, len(SAMPLES))


# -- HDF5: storage that is not ours: bombs, fill values, filters, extents ------------------


def _bomb(tmp_path: Path, nbytes: int, write: bool, **options: Any) -> Path:
    """One sample whose ``bin`` field is ``nbytes`` zero bytes, chunked and compressed (or never written)."""
    path = tmp_path / "bomb.h5"
    digest = xxhash.xxh3_64()
    zeros = bytes(1 << 20)
    for _ in range(nbytes >> 20):
        digest.update(zeros)
    bomb = {"__key__": "bomb", "bin": b""}

    def alter(target: str, array: np.ndarray) -> np.ndarray:
        if target == "fields/0/offsets":
            return np.array([0, nbytes], "<i8")
        if target == "fields/0/xxh3":
            return np.array([digest.intdigest()], "<u8")
        return array

    def make(group: h5py.Group, name: str, array: np.ndarray) -> None:
        if group.name != "/fields/0" or name != "data":
            return _contiguous(group, name, array)
        dset = group.create_dataset(name, shape=(nbytes,), dtype=np.uint8, **options)
        if write:
            step = dset.chunks[0] if dset.chunks else 1 << 20
            for at in range(0, nbytes, step):
                dset[at : at + step] = np.zeros(min(step, nbytes - at), np.uint8)

    _build_h5(path, [bomb], make, alter)
    return path


def _rss_growth(fn: Callable[[], object]) -> int:
    """Peak RSS growth (bytes) while ``fn`` runs, from ``ru_maxrss`` (a high-water mark)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def test_hdf5_gzip_bomb_is_refused_before_reading(tmp_path: Path) -> None:
    """256 MiB of zeros in 1 MiB gzip chunks: a shard of a few hundred KB."""
    path = _bomb(tmp_path, 256 << 20, write=True, chunks=(1 << 20,), compression="gzip", compression_opts=9)
    assert path.stat().st_size < 1 << 20

    def read() -> None:
        with pytest.raises(UnsafeShardError, match=r"bomb\.h5.*fields/0/data expands .* decompression bomb"):
            _read_all(path, 1)

    assert _rss_growth(read) < 64 << 20
    ds = _dataset_with_shard(tmp_path, "hdf5", [{"__key__": "bomb", "bin": b""}], hostile=path)
    _assert_verify_refuses(ds, "decompression bomb")


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, r"fields/0/data has 0 bytes of storage for its 268435456 bytes"),  # contiguous, never written
        ({"chunks": (1 << 20,)}, "decompression bomb"),  # chunked, no chunk allocated: all fill value
        ({"chunks": (1 << 20,), "fillvalue": 7}, "decompression bomb"),
    ],
)
def test_hdf5_data_made_of_fill_value_is_refused(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    path = _bomb(tmp_path, 256 << 20, write=False, **options)
    with pytest.raises(ShardError, match=rf"bomb\.h5.*{message}"):
        _read_all(path, 1)


@pytest.mark.parametrize(
    "nbytes, options, message",
    [
        (1 << 20, {"chunks": (1 << 16,), "compression": "lzf"}, r"filters \[32000\]"),
        (1 << 20, {"chunks": (1 << 16,), "scaleoffset": 0}, r"filters \[6\]"),
        (64 << 20, {"chunks": (64 << 20,), "compression": "gzip"}, "chunks of"),
    ],
)
def test_hdf5_filters_and_chunks_we_do_not_read_are_refused(
    tmp_path: Path, nbytes: int, options: dict[str, Any], message: str
) -> None:
    path = _bomb(tmp_path, nbytes, write=False, **options)
    with pytest.raises(UnsafeShardError, match=rf"bomb\.h5.*fields/0/data.*{message}"):
        _read_all(path, 1)


def test_hdf5_compact_layout_is_refused(tmp_path: Path) -> None:
    def compact(group: h5py.Group, name: str, array: np.ndarray) -> None:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple(array.shape)
        tid = h5py.h5t.py_create(array.dtype)
        h5py.h5d.create(group.id, name.encode(), tid, space, dcpl=dcpl).write(h5py.h5s.ALL, h5py.h5s.ALL, array)

    path = tmp_path / "compact.h5"
    _build_h5(path, SAMPLES, _only("fields/1/offsets", compact))
    with pytest.raises(UnsafeShardError, match=r"compact\.h5.*fields/1/offsets has HDF5 storage layout 0"):
        _read_all(path, len(SAMPLES))


def test_hdf5_dataset_outside_the_file_is_refused(tmp_path: Path) -> None:
    """The layout message of ``fields/0/data`` points past the end of the file (HDF5 also checks it)."""
    import struct

    path = tmp_path / "far.h5"
    _build_h5(path, SAMPLES)
    with h5py.File(path, "r") as f:
        offset = f["fields/0/data"].id.get_offset()
    raw = bytearray(path.read_bytes())
    packed = struct.pack("<Q", offset)
    assert raw.count(packed) == 1
    at = raw.index(packed)
    raw[at : at + 8] = struct.pack("<Q", len(raw) - 10)  # the data would end 90 bytes past the end
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match=r"far\.h5.*(fields/0/data lies outside the file|invalid dataset size)"):
        _read_all(path, len(SAMPLES))


def _set(target: str, value: list[int], dtype: str = "<i8") -> Alter:
    def alter(path: str, array: np.ndarray) -> np.ndarray:
        return np.array(value, dtype) if path == target else array

    return alter


N = len(SAMPLES)
SIZES = [100 + i for i in range(N)]
ENDS = np.cumsum([0, *SIZES]).tolist()


@pytest.mark.parametrize(
    "alter, message",
    [
        (_set("fields/0/offsets", [0, -5, *ENDS[2:]]), "offsets of field 'bin' are inconsistent"),
        (_set("fields/0/offsets", [0, ENDS[2], ENDS[1], *ENDS[3:]]), "offsets of field 'bin' are inconsistent"),
        (_set("fields/0/offsets", [0, *ENDS[1:-1], ENDS[-1] + 1]), "offsets of field 'bin' are inconsistent"),
        (_set("fields/0/offsets", [0, *ENDS[1:-1], 2**63 - 1]), "offsets of field 'bin' are inconsistent"),
        (_set("fields/0/offsets", ENDS[:-1]), "has 8 entries, expected 9"),
        (_set("fields/0/offsets", ENDS, "<i4"), "expected a flat int64"),
        (_set("fields/0/offsets", ENDS, ">i8"), "expected a flat int64"),
        (_set("fields/0/xxh3", [0] * N, "<i8"), "expected a flat uint64"),
        (_set("fields/1/present", [0, 2] * (N // 2), "u1"), "presence table of field 'cls' is inconsistent"),
        (_set("fields/1/present", [1, 0] * (N // 2), "u1"), "presence table of field 'cls' is inconsistent"),
        (_set("keys/offsets", [0, 5000, *[5000 + 4 * i for i in range(1, N)]]), "inconsistent|longer than"),
    ],
)
def test_hdf5_hostile_tables_are_refused(tmp_path: Path, alter: Alter, message: str) -> None:
    path = tmp_path / "tables.h5"
    _build_h5(path, SAMPLES, alter=alter)
    with pytest.raises(CorruptShardError, match=rf"tables\.h5.*({message})"):
        _read_all(path, N)


def test_hdf5_long_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.h5"
    _build_h5(path, [{"__key__": "k" * 5000, "bin": b"x"}])
    with pytest.raises(CorruptShardError, match=r"keys\.h5.*keys longer than 4096 bytes"):
        _read_all(path, 1)


@pytest.mark.parametrize("fields", [["bin", "bin"], ["__key__", "cls"], ["a/b", "cls"], ["", "cls"]])
def test_hdf5_hostile_field_names_are_refused(tmp_path: Path, fields: list[str]) -> None:
    path = tmp_path / "names.h5"
    _build_h5(path, SAMPLES, fields=fields)
    with pytest.raises(CorruptShardError, match=r"names\.h5.*field name"):
        _read_all(path, N)


# -- tar sidecars: numbers that wrap, overlap or lie ---------------------------------------

_HEAD = "<8s6Q"


def _unpack_sidecar(raw: bytes) -> dict[str, Any]:
    """The sidecar's header, names and tables as numpy arrays (layout in streamload/formats/tar.py)."""
    import struct

    magic, n, m, n_fields, names_len, keys_len, reserved = struct.unpack_from(_HEAD, raw)
    pos = struct.calcsize(_HEAD)
    out: dict[str, Any] = {"magic": magic, "n_fields": n_fields, "reserved": reserved}
    out["names"] = raw[pos : pos + names_len]
    pos += names_len + (-names_len % 8)
    for name, count, dtype in [
        ("start", n + 1, "<u8"),
        ("member", n + 1, "<u8"),
        ("key_off", n + 1, "<u8"),
        ("offset", m, "<u8"),
        ("size", m, "<u8"),
        ("field", m, "<u4"),
        ("hash", m, "<u8"),
    ]:
        width = np.dtype(dtype).itemsize * count
        out[name] = np.frombuffer(raw, dtype, count, pos).copy()
        pos += width + (-width % 8)
    out["keys"] = raw[pos : pos + keys_len]
    return out


def _pack_sidecar(t: dict[str, Any]) -> bytes:
    import struct

    n, m = len(t["start"]) - 1, len(t["offset"])
    parts = [struct.pack(_HEAD, t["magic"], n, m, t["n_fields"], len(t["names"]), len(t["keys"]), t["reserved"])]
    parts.append(t["names"] + bytes(-len(t["names"]) % 8))
    for name in ("start", "member", "key_off", "offset", "size", "field", "hash"):
        data = np.asarray(t[name]).tobytes()
        parts.append(data + bytes(-len(data) % 8))
    parts.append(t["keys"])
    return b"".join(parts)


TAR_SAMPLES: list[Sample] = [
    {"__key__": f"k{i:03d}", "bin": bytes([i]) * 3000, "cls": str(i).encode()} for i in range(8)
]


def _hostile_sidecar(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A tar dataset whose sidecar was changed by ``change`` and re-hashed in the manifest."""
    ds = _dataset_with_shard(tmp_path, "tar", TAR_SAMPLES)
    manifest = json.loads((ds / "index.json").read_text())
    entry = manifest["shards"][0]
    tables = _unpack_sidecar((ds / entry["sidecar"]["name"]).read_bytes())
    change(tables)
    _replace_shard(ds, (ds / entry["name"]).read_bytes(), sidecar=_pack_sidecar(tables))
    return ds


def _tar_reader(ds: Path) -> Any:
    manifest = Manifest.loads((ds / "index.json").read_bytes())
    entry = manifest.shards[0]
    assert entry.sidecar is not None
    return get_format("tar").reader(str(ds / entry.name), entry, str(ds / entry.sidecar.name))


def _wrap_first(t: dict[str, Any]) -> None:
    """Member 0's offset wraps around 2**64 so that offset + size lands inside the file."""
    t["offset"][0] = np.uint64(2**64 - 512)
    t["size"][0] = np.uint64(1024)


def _overlap(t: dict[str, Any]) -> None:
    """Every ``bin`` member points at the same bytes (a batch of n samples: n times the bytes)."""
    is_bin = t["field"] == t["names"].split(b"\n").index(b"bin")
    t["offset"][is_bin] = t["offset"][is_bin][0]
    t["hash"][is_bin] = t["hash"][is_bin][0]


def _field_id(value: int) -> Callable[[dict[str, Any]], None]:
    def change(t: dict[str, Any]) -> None:
        t["field"][1] = value

    return change


def _set_table(name: str, index: int, value: int) -> Callable[[dict[str, Any]], None]:
    def change(t: dict[str, Any]) -> None:
        t[name][index] = np.uint64(value)

    return change


def _no_fields(t: dict[str, Any]) -> None:
    """No field names, every member's field id 0 (which indexed an empty name list)."""
    t["names"], t["n_fields"] = b"", 0
    t["field"][:] = 0


def _names(names: bytes, n_fields: int) -> Callable[[dict[str, Any]], None]:
    def change(t: dict[str, Any]) -> None:
        t["names"], t["n_fields"] = names, n_fields

    return change


@pytest.mark.parametrize(
    "change, message",
    [
        (_wrap_first, "member extents"),
        (_set_table("size", 0, 2**64 - 1), "member extents"),
        (_overlap, "member extents"),
        (_set_table("member", 0, 2**64 - 1), "member ranges"),
        (_set_table("key_off", 0, 2**64 - 4), "key offsets"),
        (_set_table("start", 0, 2**64 - 1), "sample offsets"),
        (_field_id(7), "field ids"),
        (_no_fields, "field ids"),
        (_field_id(0), "field twice"),  # member 1 (k000's cls) becomes a second 'bin' of k000
        (_names(b"bin\nbin", 2), "field name"),
        (_names(b"__key__\ncls", 2), "field name"),
    ],
)
def test_tar_hostile_sidecar_is_refused_when_opened(tmp_path: Path, change: Any, message: str) -> None:
    ds = _hostile_sidecar(tmp_path, change)
    with pytest.raises(CorruptShardError, match=rf"shard-000000\.tar.*{message}"):
        _tar_reader(ds)
    _assert_verify_refuses(ds, message)


def test_tar_wrapped_offset_does_not_reach_batch_reads(tmp_path: Path) -> None:
    """Before: verify died with OverflowError and RawCollate sized a batch from the wrapped size."""
    from streamload import StreamingDataset
    from streamload.batch import RawCollate

    def wrap(t: dict[str, Any]) -> None:  # 1 GiB at an offset where offset + size wraps into the file
        t["offset"][0], t["size"][0] = np.uint64(2**64 - 2**30 + 1024), np.uint64(2**30)

    ds = _hostile_sidecar(tmp_path, wrap)
    dataset = StreamingDataset(str(ds), batch_size=4, collate=RawCollate(field="bin", label_field=None))
    with pytest.raises(CorruptShardError, match=r"shard-000000\.tar.*member extents"):
        next(iter(dataset))


# -- tar files written by other tools: `streamload index` ----------------------------------


def _member(name: str, data: bytes, pax: dict[str, str] | None = None, size: int | None = None) -> bytes:
    """One member as tarfile writes it (PAX headers first when given), ``size`` overriding the header's."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    info.pax_headers = pax or {}
    header = info.tobuf(tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    return header + data + bytes(-len(data) % 512)


def _raw_pax(records: bytes, kind: bytes = b"x") -> bytes:
    """An extended header member holding ``records`` exactly as given."""
    import tarfile

    info = tarfile.TarInfo("././@PaxHeader")
    info.type = kind
    info.size = len(records)
    return info.tobuf(tarfile.USTAR_FORMAT) + records + bytes(-len(records) % 512)


def _index(tmp_path: Path, *members: bytes) -> Any:
    from streamload.indexing import index_directory

    (tmp_path / "evil.tar").write_bytes(b"".join(members) + bytes(10240))
    return index_directory(str(tmp_path))


@pytest.mark.parametrize("size", ["-5", "abc", str(10**12), "+5", " 5", "5 ", "0x10", "1" * 5000, ""])
def test_index_refuses_a_bad_pax_size(tmp_path: Path, size: str) -> None:
    """Before: OSError (negative read), MemoryError/OverflowError (1 TB read) or ValueError (int())."""
    with pytest.raises(CorruptShardError, match=r"evil\.tar.*(PAX size|runs past the end)"):
        _index(tmp_path, _member("a.txt", b"hello", pax={"size": size}, size=5), _member("a.cls", b"1"))
    assert not (tmp_path / "index.json").exists()


@pytest.mark.parametrize(
    "records",
    [
        b"1" * 5000 + b" path=a.txt\n",  # a record length int() refuses (more than 4300 digits)
        b"99999999999999999999999 path=a.txt\n",
        b"3 x\n",  # shorter than its own length field
        b"13 path=a.txt",  # no newline
        b"12 path=a.txt\n",  # length one short
    ],
)
def test_index_refuses_malformed_pax_records(tmp_path: Path, records: bytes) -> None:
    with pytest.raises(CorruptShardError, match=r"evil\.tar.*PAX"):
        _index(tmp_path, _raw_pax(records), _member("a.txt", b"hello"))


def test_index_reads_a_pax_size_equal_to_the_header(tmp_path: Path) -> None:
    from streamload import StreamingDataset

    data = b"0123456789" * 100
    first = _member("k0.bin", data, pax={"size": str(len(data))})
    _index(tmp_path, first, _member("k0.cls", b"3"), _member("k1.bin", b"xyz"))
    samples = list(StreamingDataset(str(tmp_path)))
    assert samples == [{"__key__": "k0", "bin": data, "cls": b"3"}, {"__key__": "k1", "bin": b"xyz"}]


def test_index_refuses_a_pax_size_that_disagrees_with_the_header(tmp_path: Path) -> None:
    """Tar readers would take the PAX size, the sidecar check the header's: refused."""
    with pytest.raises(CorruptShardError, match=r"evil\.tar.*PAX size 1000 disagrees with the header's 0"):
        _index(tmp_path, _member("k0.bin", b"x" * 1000, pax={"size": "1000"}, size=0))


def test_members_over_8_gib_take_their_size_from_pax(tmp_path: Path) -> None:
    """As tarfile writes them (header size 0, PAX size); the next header is found after the data.

    The file is sparse: only the headers take room on disk.
    """
    import tarfile

    from streamload.formats.tar import iter_members

    big = 8**11 + 5
    head = _member("k0.bin", b"", pax={"size": str(big)}, size=0)
    path = tmp_path / "big.tar"
    with open(path, "wb") as f:
        f.write(head)
        f.seek(len(head) + big + (-big % 512))
        f.write(_member("k1.txt", b"abc") + bytes(1024))
    with tarfile.open(path) as tar:  # what tarfile makes of it
        assert [(m.name, m.size) for m in tar.getmembers()] == [("k0.bin", big), ("k1.txt", 3)]
    members = list(iter_members(str(path), "big.tar"))
    data_at = len(head)
    assert members == [
        ("k0.bin", 0, data_at, big),
        ("k1.txt", data_at + big + (-big % 512), data_at + big + (-big % 512) + 512, 3),
    ]
    path.unlink()  # 8 GiB apparent size: do not leave it to tools that copy temporary files


def test_index_refuses_a_huge_extended_header(tmp_path: Path) -> None:
    with pytest.raises(UnsafeShardError, match=r"evil\.tar.*extended header of 2097[0-9]+ bytes"):
        _index(tmp_path, _member("a.txt", b"x", pax={"comment": "c" * (2 << 20)}))


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("k" * 5000 + ".txt", CorruptShardError, "longer than 4096"),
        ("a.__key__", CorruptShardError, "field name"),
        ("a.txt\nnext", CorruptShardError, "field name"),
        ("a\0b.txt", UnsafeShardError, "NUL"),
    ],
)
def test_index_refuses_hostile_member_names(tmp_path: Path, name: str, error: type, message: str) -> None:
    """Each would give a sidecar the reader refuses (or a sample whose key a field replaces)."""
    with pytest.raises(error, match=rf"evil\.tar.*{message}"):
        _index(tmp_path, _member(name, b"x", pax={"path": name}))
    assert not (tmp_path / "index.json").exists()


def test_index_refuses_sparse_members(tmp_path: Path) -> None:
    """A PAX sparse member's bytes are a sparse map, not the file: refused, not misread."""
    pax = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "100000", "path": "a.txt"}
    with pytest.raises(CorruptShardError, match=r"evil\.tar.*sparse"):
        _index(tmp_path, _member("GNUSparseFile.0/a.txt", b"1\n0\n0\n" + bytes(506), pax=pax))


def test_tar_writer_refuses_a_field_name_the_sidecar_cannot_hold(tmp_path: Path) -> None:
    from streamload import SampleError

    writer = get_format("tar").writer(str(tmp_path / "x.tar"))
    with pytest.raises(SampleError, match="newline"):
        writer.write({"__key__": "a", "b\nc": b"x"})
    writer.abort()


# -- every format: the shard itself is not a regular file ----------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("fmt", "which"), [("tar", "shard"), ("tar", "sidecar"), ("lmdb", "shard"), ("hdf5", "shard")]
)  # only tar shards have a sidecar
def test_a_fifo_in_place_of_a_shard_is_refused_without_blocking(tmp_path: Path, fmt: str, which: str) -> None:
    ds = _dataset_with_shard(tmp_path, fmt, TAR_SAMPLES)
    entry = Manifest.loads((ds / "index.json").read_bytes()).shards[0]
    target = ds / (entry.name if which == "shard" else entry.sidecar.name)  # type: ignore[union-attr]
    target.unlink()
    os.mkfifo(target)
    sidecar = str(ds / entry.sidecar.name) if entry.sidecar else None
    with pytest.raises(UnsafeShardError, match=rf"{entry.name}.*not a regular file"):
        reader = get_format(fmt).reader(str(ds / entry.name), entry, sidecar)
        try:
            reader.get(0)
        finally:
            reader.close()


@pytest.mark.timeout(30)
def test_index_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    from streamload.indexing import index_directory

    os.mkfifo(tmp_path / "evil.tar")
    with pytest.raises(UnsafeShardError, match=r"evil\.tar.*not a regular file"):
        index_directory(str(tmp_path))


# -- LMDB: records, catalog and B-tree that lie ---------------------------------------------


def _lmdb_shard(path: Path, records: list[bytes], keys: list[bytes], sizes: list[int], fields: Any = ("bin",)) -> None:
    """An LMDB shard from hand-made records (the writer's own helpers, no check_sample)."""
    from streamload.formats._record import seal
    from streamload.formats.lmdb import _catalog_bytes, map_size_for, write_environment

    meta = {"format": "streamload-lmdb", "version": 1, "num_samples": len(records), "fields": list(fields)}
    items = [(i.to_bytes(8, "big"), r) for i, r in enumerate(records)]
    items.append((b"__catalog__", seal(_catalog_bytes(keys, sizes))))
    items.append((b"__streamload__", seal(json.dumps(meta, sort_keys=True).encode())))
    write_environment(str(path), items, map_size_for([(k, len(v)) for k, v in items]))


def _read_lmdb(path: Path, n: int, how: str = "get") -> list[Sample]:
    entry = ShardEntry(name=path.name, num_bytes=path.stat().st_size, num_samples=n)
    reader = get_format("lmdb").reader(str(path), entry, None)
    try:
        if how == "catalog":
            reader.catalog()
            return []
        return [reader.get(i) for i in range(n)]
    finally:
        reader.close()


@pytest.mark.parametrize(
    "fields, message",
    [
        ([("bin", b"a"), ("bin", b"b")], "field name"),  # one would hide the other
        ([("__key__", b"other"), ("bin", b"x")], "field name"),  # would replace the sample's key
        ([("a/b", b"x")], "field name"),
        ([("bin", b"x"), ("alpha", b"y")], "field name"),  # not in sorted order
    ],
)
def test_lmdb_record_with_hostile_field_names_is_refused(
    tmp_path: Path, fields: list[tuple[str, bytes]], message: str
) -> None:
    from streamload.formats._record import encode_record

    path = tmp_path / "names.lmdb"
    _lmdb_shard(path, [encode_record("k0", fields)], [b"k0"], [2])
    with pytest.raises(CorruptShardError, match=rf"names\.lmdb.*{message}"):
        _read_lmdb(path, 1)


@pytest.mark.parametrize(
    "keys, sizes, message",
    [
        ([b"k0"], [2**62], "catalog sizes"),
        ([b"k" * 5000], [1], "catalog key lengths"),
    ],
)
def test_lmdb_catalog_that_lies_is_refused(tmp_path: Path, keys: list[bytes], sizes: list[int], message: str) -> None:
    from streamload.formats._record import encode_record

    path = tmp_path / "catalog.lmdb"
    _lmdb_shard(path, [encode_record("k0", [("bin", b"x")])], keys, sizes)
    with pytest.raises(CorruptShardError, match=rf"catalog\.lmdb.*{message}"):
        _read_lmdb(path, 1, how="catalog")


def test_lmdb_meta_json_nested_too_deep_is_corruption(tmp_path: Path) -> None:
    from streamload.formats._record import encode_record, seal
    from streamload.formats.lmdb import _catalog_bytes, map_size_for, write_environment

    path = tmp_path / "deep.lmdb"
    items = [
        ((0).to_bytes(8, "big"), encode_record("k0", [("bin", b"x")])),
        (b"__catalog__", seal(_catalog_bytes([b"k0"], [1]))),
        (b"__streamload__", seal(b"[" * 100_000 + b"]" * 100_000)),
    ]
    write_environment(str(path), items, map_size_for([(k, len(v)) for k, v in items]))
    with pytest.raises(CorruptShardError, match=r"deep\.lmdb.*not JSON"):
        _read_lmdb(path, 1)


def test_lmdb_records_sharing_overflow_pages_are_refused(tmp_path: Path) -> None:
    """Two leaf nodes pointing at the same overflow pages: n records, one value read n times."""
    import struct

    samples = [{"__key__": f"k{i}", "bin": bytes([i]) * 9000} for i in range(4)]
    ds = _dataset_with_shard(tmp_path, "lmdb", samples)
    entry = Manifest.loads((ds / "index.json").read_bytes()).shards[0]
    path = ds / entry.name
    data = bytearray(path.read_bytes())
    psize = 4096
    pointers = []  # file offsets of the overflow page numbers of big values, in key order
    page = 2
    while page < len(data) // psize:
        at = page * psize
        _, _, flags, lower, _ = struct.unpack_from("<QHHHH", data, at)
        page += struct.unpack_from("<I", data, at + 12)[0] if flags & 0x04 else 1  # skip overflow runs
        if flags & 0x02:  # a leaf
            for k in range((lower - 16) // 2):
                node = at + struct.unpack_from("<H", data, at + 16 + 2 * k)[0]
                if struct.unpack_from("<H", data, node + 4)[0] & 0x01:  # F_BIGDATA
                    ksize = struct.unpack_from("<H", data, node + 6)[0]
                    pointers.append(node + 8 + ksize)
    assert len(pointers) == 4
    first = struct.unpack_from("<Q", data, pointers[0])[0]
    struct.pack_into("<Q", data, pointers[1], first)  # sample 1 now reads sample 0's value
    _replace_shard(ds, bytes(data))
    with pytest.raises(CorruptShardError, match=rf"{entry.name}.*overflow page {first} .*twice"):
        _read_lmdb_entry(ds)
    _assert_verify_refuses(ds, "twice")


def _read_lmdb_entry(ds: Path) -> None:
    entry = Manifest.loads((ds / "index.json").read_bytes()).shards[0]
    reader = get_format("lmdb").reader(str(ds / entry.name), entry, None)
    try:
        for i in range(entry.num_samples):
            reader.get(i)
    finally:
        reader.close()


# -- index.json ---------------------------------------------------------------------------


def _manifest_text(**extra: Any) -> str:
    return json.dumps({"streamload": 1, "format": "tar", "num_samples": 0, "shards": [], **extra})


def test_manifest_size_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    import streamload.manifest as manifest_module
    from streamload import ManifestError
    from streamload.manifest import MAX_MANIFEST_BYTES

    assert MAX_MANIFEST_BYTES == 256 << 20 and "MAX_MANIFEST_BYTES" in manifest_module.__all__
    text = _manifest_text(meta={"pad": "x" * 2000}).encode()
    assert Manifest.loads(text).meta["pad"]
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(ManifestError, match=rf"ds/index\.json: {len(text)} bytes, more than the 1000 bytes"):
        Manifest.loads(text, where="ds/index.json")


@pytest.mark.parametrize("opening, closing", [("[", "]"), ('{"a":', "}")])
def test_deeply_nested_manifest_is_a_manifest_error(tmp_path: Path, opening: str, closing: str) -> None:
    from streamload import ManifestError, StreamingDataset

    opening += " " * 16  # sparse enough to pass the density check: the parser itself gives up
    deep = opening * 100_000 + "1" + closing * 100_000
    for text in (deep, _manifest_text()[:-1] + f', "meta": {{"x": {deep}}}}}'):
        with pytest.raises(ManifestError, match=r"index\.json.*nested too deeply"):
            Manifest.loads(text)
        (tmp_path / "index.json").write_text(text)
        with pytest.raises(ManifestError, match=r"index\.json.*nested too deeply"):
            StreamingDataset(str(tmp_path))


def test_meta_nested_deeper_than_pickle_can_go_is_refused() -> None:
    """500 levels parse, but pickling the manifest for DataLoader workers hits RecursionError."""
    import pickle

    from streamload import ManifestError

    def nested(levels: int) -> Any:
        value: Any = 1
        for _ in range(levels):
            value = [value]
        return value

    with pytest.raises(ManifestError, match=r"meta nests arrays or objects more than 64 levels"):
        Manifest.loads(_manifest_text(meta={"x": nested(500)}))
    manifest = Manifest.loads(_manifest_text(meta={"x": nested(63)}))  # meta itself is the first level
    assert pickle.dumps(manifest)  # what sending it to DataLoader workers does


def test_skipped_error_must_be_a_string_not_a_nested_value() -> None:
    from streamload import ManifestError

    nested: Any = "e"
    for _ in range(900):  # str() of it recursed past the limit: RecursionError
        nested = [nested]
    with pytest.raises(ManifestError, match=r"skipped\[0\]\.error must be a string"):
        Manifest.loads(_manifest_text(skipped=[{"path": "a.jpg", "error": nested}]))
    assert Manifest.loads(_manifest_text(skipped=[{"path": "a.jpg", "error": 5}])).skipped[0].error == "5"


# -- decode: images that decode to gigabytes ------------------------------------------------


def _png(width: int, height: int, rows: int | None = None) -> bytes:
    """A grayscale PNG of zeros written by hand, streamed through zlib (no big buffer): tiny on disk.

    With ``rows``, only that many scanlines are stored (a truncated image: enough for the header).
    """
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    compressor = zlib.compressobj(9)
    line = bytes(width + 1)  # filter byte 0, then zeros
    idat = bytearray()
    for _ in range(height if rows is None else rows):
        idat += compressor.compress(line)
    idat += compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", bytes(idat)) + chunk(b"IEND", b"")


def _huge_jpeg(width: int, height: int) -> bytes:
    """A small real JPEG whose frame header (SOF0) claims ``width`` x ``height``."""
    import io
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 40, 200)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


BOMB_PNG = _png(10_000, 10_000)  # 100 M pixels (between Pillow's warning and its error), ~100 KB
#: Pillow warns about images over its MAX_IMAGE_PIXELS as it opens them (before our check refuses them).
quiet_pillow = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")


@quiet_pillow
def test_png_bomb_is_refused_from_its_header_by_image_decoder() -> None:
    from streamload import SampleError
    from streamload.decode import ImageDecoder

    assert len(BOMB_PNG) < 200_000
    decoder = ImageDecoder(224, backend="pillow")

    def decode() -> None:
        with pytest.raises(SampleError, match=r"10000x10000 = 100000000 pixels.*max_pixels=89478485"):
            decoder.decode(BOMB_PNG)

    assert _rss_growth(decode) < 64 << 20
    big = ImageDecoder(224, backend="pillow", max_pixels=10**8)  # configurable
    assert big.max_pixels == 10**8


@quiet_pillow
@pytest.mark.parametrize("path", ["ImageLabel", "ImageLabel-sized", "decode_sample", "DecodeBatch"])
def test_png_bomb_is_a_sample_error_naming_key_field_and_size(path: str) -> None:
    from streamload import ImageLabel, SampleError, decode_sample
    from streamload.decode import DecodeBatch

    sample = {"__key__": "evil/bomb", "png": BOMB_PNG, "cls": b"1"}
    run: Callable[[], object] = {
        "ImageLabel": lambda: ImageLabel()(sample),
        "ImageLabel-sized": lambda: ImageLabel(size=64)(sample),
        "decode_sample": lambda: decode_sample(sample),
        "DecodeBatch": lambda: DecodeBatch(64, backend="pillow")([sample]),
    }[path]

    def decode() -> None:
        with pytest.raises(SampleError, match=r"'evil/bomb'.*'png'.*10000x10000 = 100000000 pixels"):
            run()

    assert _rss_growth(decode) < 64 << 20


def test_max_pixels_is_configurable_on_every_decode_path() -> None:
    from streamload import ImageLabel, SampleError
    from streamload.decode import DecodeBatch, decode_image

    small = _png(40, 30)
    sample = {"__key__": "k", "png": small, "cls": b"1"}
    with pytest.raises(SampleError, match=r"40x30 = 1200 pixels.*max_pixels=1000"):
        decode_image(small, max_pixels=1000)
    with pytest.raises(SampleError, match=r"'k'.*40x30"):
        ImageLabel(max_pixels=1000)(sample)
    with pytest.raises(SampleError, match=r"'k'.*40x30"):
        DecodeBatch(16, max_pixels=1000)([sample])
    assert decode_image(small, max_pixels=None).size == (40, 30)
    assert ImageLabel(size=16, max_pixels=1200)(sample)[0].shape == (3, 16, 16)


def test_huge_png_over_pillows_own_limit_is_a_sample_error_with_its_size() -> None:
    from streamload import SampleError
    from streamload.decode import ImageDecoder

    data = _png(30_000, 30_000, rows=10)  # 900 M pixels; only the header matters
    with pytest.raises(SampleError, match=r"30000x30000 = 900000000 pixels"):
        ImageDecoder(224, backend="pillow").decode(data)


@pytest.mark.parametrize("backend", ["simplejpeg", "pillow"])
def test_jpeg_claiming_a_huge_frame_is_refused_from_its_header(backend: str) -> None:
    from streamload import SampleError
    from streamload.decode import ImageDecoder

    data = _huge_jpeg(60_000, 50_000)

    def decode() -> None:
        with pytest.raises(SampleError, match=r"60000x50000 = 3000000000 pixels"):
            ImageDecoder(224, backend=backend).decode(data)  # type: ignore[arg-type]

    assert _rss_growth(decode) < 64 << 20


def test_max_pixels_must_be_positive() -> None:
    from streamload import ConfigError
    from streamload.decode import ImageDecoder

    with pytest.raises(ConfigError, match="max_pixels"):
        ImageDecoder(224, max_pixels=0)


def test_hdf5_metadata_nested_too_deep_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "deep.h5"
    _build_h5(path, SAMPLES)
    text = "[" * 100_000 + "]" * 100_000
    with h5py.File(path, "a") as f:
        f.attrs["streamload"] = text
        f.attrs["streamload_xxh3"] = f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"
    with pytest.raises(CorruptShardError, match=r"deep\.h5.*RecursionError"):
        _read_all(path, N)


@pytest.mark.parametrize("item", ["[]", "{}", '{"a":0}', "[{}]"])
def test_manifest_made_of_tiny_containers_is_refused_before_parsing(item: str) -> None:
    """30 MB of ``[],[],...`` took 1.4 GB to parse (48x); such density is refused up front."""
    from streamload import ManifestError

    text = _manifest_text()[:-1] + ', "meta": {"x": [' + ",".join([item] * 200_000) + "]}}"
    with pytest.raises(ManifestError, match=r"index\.json: \d+ JSON arrays or objects in \d+ bytes"):
        Manifest.loads(text)


def test_manifest_with_dense_but_real_metadata_is_accepted() -> None:
    classes = [{"name": f"class_{i:05d}", "count": i} for i in range(20_000)]
    boxes = [[i, i + 1, 20, 30] for i in range(20_000)]
    text = json.dumps(json.loads(_manifest_text(meta={"classes": classes, "boxes": boxes})), separators=(",", ":"))
    assert Manifest.loads(text).meta["classes"][-1] == {"name": "class_19999", "count": 19999}
