"""Hostile sidecars whose manifest hashes were recomputed: labels and keys are checked as tar member names are."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from streamload import ImageLabel, SampleError, ShardedDataset, StreamingDataset, UnsafeShardError
from streamload.batch import RawCollate
from streamload.indexing import index_directory
from tests.digests import digest

ROWS = 6


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 6), (40 * i, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


def _rehash(ds: Path, name: str) -> None:
    """Write the manifest again with the sidecar's new size and hash (as a hostile publisher would)."""
    manifest = json.loads((ds / "index.json").read_text())
    data = (ds / name).read_bytes()
    for shard in manifest["shards"]:
        sidecar = shard.get("sidecar")
        if sidecar and sidecar["name"] == name:
            sidecar["bytes"], sidecar["hash"] = len(data), digest(data, manifest)
    (ds / "index.json").write_text(json.dumps(manifest))


def _parquet(tmp_path: Path, change: Callable[[dict[str, Any], dict[str, Any]], None]) -> Path:
    """A two-class Parquet dataset of 6 rows whose sidecar ``change(arrays, meta)`` rewrote."""
    ds = tmp_path / "pq"
    ds.mkdir()
    table = pa.table(
        {"image": [{"bytes": _png(i), "path": None} for i in range(ROWS)], "label": [i % 2 for i in range(ROWS)]}
    )
    pq.write_table(table, str(ds / "a.parquet"))
    index_directory(str(ds), format="parquet", classes=("cat", "dog"))
    sidecar = ds / "a.parquet.slpq"
    with np.load(sidecar, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(arrays["meta"].tobytes())
    change(arrays, meta)
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    with open(sidecar, "wb") as f:
        np.savez(f, **arrays)
    _rehash(ds, sidecar.name)
    return ds


def _labels(*values: int) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    def change(arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        for row, value in zip((1, 4), values, strict=False):
            arrays["label"][row] = value

    return change


def test_sidecar_labels_outside_the_classes_name_the_sample(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ds = _parquet(tmp_path, _labels(10**15, -3))
    with pytest.raises(SampleError, match=r"a\.parquet: sample 'a/0000000001': label 1000000000000000 .* 2 classes"):
        list(StreamingDataset(str(ds), transform=ImageLabel(4)))
    with pytest.raises(SampleError, match=r"sample 'a/0000000004': label -3 in the sidecar is outside 0\.\.1"):
        ShardedDataset(str(ds))[4]
    # a batch read takes the sidecar's integer labels as they are: checked the same
    with pytest.raises(SampleError, match=r"sample 'a/0000000001': label 1000000000000000 .* 2 classes"):
        list(StreamingDataset(str(ds), batch_size=3, collate=RawCollate()))
    skipping = StreamingDataset(str(ds), transform=ImageLabel(4), on_error="skip")
    with caplog.at_level(logging.WARNING, logger="streamload"):
        labels = [int(label) for _, label in skipping]
    assert len(labels) == ROWS and set(labels) <= {0, 1}
    assert [(s.key, s.index) for s in skipping.errors.samples] == [("a/0000000001", 1), ("a/0000000004", 4)]
    assert "'a/0000000004'" in caplog.text


@pytest.mark.parametrize(
    "prefix, message",
    [
        ("../../etc/x", "'..' path component"),
        ("/etc/x", "absolute"),
        ("cat\u202egpj.exe", "U\\+202E"),
        ("new\nline", "U\\+000A"),
        ("k" * 5000, "longer than 4096 bytes"),
    ],
)
def test_sidecar_key_prefixes_are_checked_as_tar_names(tmp_path: Path, prefix: str, message: str) -> None:
    def change(arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        meta["prefix"] = prefix

    ds = _parquet(tmp_path, change)
    with pytest.raises(UnsafeShardError, match=rf"a\.parquet: Parquet sidecar key prefix: .*{message}"):
        list(StreamingDataset(str(ds)))
    skipping = StreamingDataset(str(ds), on_error="skip")
    with pytest.raises(Exception, match="every one of the 6 samples"):  # nothing left to stand in
        list(skipping)
    assert skipping.skipped_samples == ROWS


def test_tar_sidecar_keys_are_checked_as_tar_names(tar_dataset: Path, tmp_path: Path) -> None:
    """A tar sidecar whose first key was rewritten to climb out (same length: the tables stay consistent)."""
    import shutil

    ds = tmp_path / "tar"
    shutil.copytree(tar_dataset, ds)
    reader = ShardedDataset(str(ds))
    first = reader.key_of(0)
    hostile = ("../" * len(first))[: len(first) - 1] + "x"
    sidecar = next(p for p in ds.iterdir() if p.name.startswith("shard-000000.tar") and p.name != "shard-000000.tar")
    data = sidecar.read_bytes()
    assert data.count(first.encode()) == 1
    sidecar.write_bytes(data.replace(first.encode(), hostile.encode()))
    _rehash(ds, sidecar.name)
    with pytest.raises(
        UnsafeShardError, match=r"shard-000000\.tar: sample #0: sample key '\.\./.*'\.\.' path component"
    ):
        ShardedDataset(str(ds))[0]
    skipping = StreamingDataset(str(ds), on_error="skip")
    keys = [s["__key__"] for s in skipping]
    assert len(keys) == len(skipping) and not any(".." in k for k in keys)
    assert [(s.shard, s.index) for s in skipping.errors.samples] == [("shard-000000.tar", 0)]


def test_lmdb_record_keys_are_checked_as_tar_names(tmp_path: Path) -> None:
    """An LMDB record whose key was rewritten (same length, checksum and manifest hash redone)."""
    import lmdb

    from streamload.converters import ConvertOptions, ImageFolderSource, convert
    from streamload.formats._record import seal, unseal
    from streamload.synthetic import make_image_folder

    make_image_folder(str(tmp_path / "images"), num_classes=2, per_class=2, size=(8, 8), seed=2)
    ds = tmp_path / "lmdb"
    convert(ImageFolderSource(str(tmp_path / "images")), str(ds), ConvertOptions(format="lmdb", progress=False))
    first = ShardedDataset(str(ds)).key_of(0)
    hostile = ("a\u202e" + "x" * len(first))[: len(first.encode()) - 2]  # U+202E is 3 bytes: same length
    assert len(hostile.encode()) == len(first.encode())
    shard = ds / "shard-000000.lmdb"
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        index = (0).to_bytes(8, "big")
        payload = bytes(unseal(txn.get(index), "record"))
        txn.put(index, seal(payload.replace(first.encode(), hostile.encode(), 1)))
    env.close()
    manifest = json.loads((ds / "index.json").read_text())
    data = shard.read_bytes()
    manifest["shards"][0]["bytes"], manifest["shards"][0]["hash"] = len(data), digest(data, manifest)
    (ds / "index.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafeShardError, match=r"shard-000000\.lmdb.*U\+202E"):
        ShardedDataset(str(ds))[0]


def test_a_blob_of_keys_is_checked_key_by_key() -> None:
    from streamload.formats.base import unsafe_keys

    keys = ["a/b", "../x", "ok.", "a/./b", "x\u202ey", "fine", "c//d", "/abs", "", "e\nf", "g/.."]
    keys += [".hidden", "dotted.name", "k" * 5000, "ü/名前", "a/b/"]
    blob = "".join(keys).encode()
    bounds = np.concatenate([[0], np.cumsum([len(k.encode()) for k in keys])])
    found = unsafe_keys(blob, bounds)
    assert sorted(found) == [1, 3, 4, 6, 7, 8, 9, 10, 13, 15]
    assert "U+202E" in found[4] and "longer than 4096" in found[13] and "'..'" in found[1]


def _rewritten(tmp_path: Path, write: Callable[[Path, dict[str, Any]], None]) -> Path:
    """The 6-row dataset whose sidecar ``write(path, arrays)`` wrote again (another writer), rehashed."""
    ds = _parquet(tmp_path, lambda arrays, meta: None)
    sidecar = ds / "a.parquet.slpq"
    with np.load(sidecar, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    write(sidecar, arrays)
    _rehash(ds, sidecar.name)
    return ds


def _savez_compressed(path: Path, arrays: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def test_a_compressed_sidecar_reads_the_same(tmp_path: Path) -> None:
    """The sidecar's own fast parse takes what ``np.savez`` writes; numpy itself reads other ``.npz``."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "other").mkdir()
    plain = _parquet(tmp_path / "plain", lambda arrays, meta: None)
    other = _rewritten(tmp_path / "other", _savez_compressed)
    assert (other / "a.parquet.slpq").read_bytes() != (plain / "a.parquet.slpq").read_bytes()
    read = [(s["__key__"], s["png"], s["cls"]) for s in StreamingDataset(str(plain))]
    assert [(s["__key__"], s["png"], s["cls"]) for s in StreamingDataset(str(other))] == read


def test_a_sidecar_table_changed_without_a_manifest_hash_fails_its_crc(tmp_path: Path) -> None:
    from streamload import CorruptShardError

    ds = _parquet(tmp_path, lambda arrays, meta: None)
    manifest = json.loads((ds / "index.json").read_text())
    for shard in manifest["shards"]:
        shard["sidecar"].pop("hash", None)
    (ds / "index.json").write_text(json.dumps(manifest))
    sidecar = ds / "a.parquet.slpq"
    raw = bytearray(sidecar.read_bytes())
    at = raw.index(b"size.npy")  # the sizes table: its local header's name, then its data
    at = raw.index(b"\n", raw.index(b"'shape'", at)) + 1
    raw[at] ^= 0x01  # row 0's size, one bit off
    sidecar.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match=r"a\.parquet: Parquet sidecar is damaged .*CRC"):
        list(StreamingDataset(str(ds)))
