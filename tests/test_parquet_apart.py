"""An index apart from its Parquet files (``index SRC --output DST``): files read in place, SRC never written."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from streamload import ConfigError, CorruptShardError, ManifestError, ShardedDataset, StorageConfig, StreamingDataset
from streamload.cli import main
from streamload.indexing import index_directory
from streamload.manifest import Manifest
from tests.helpers.parquet_tables import CLASSES, encode, hf_rows, write_hf
from tests.s3server import SeaweedS3

pytest.importorskip("datasets")


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry of a folder with its content hash and mtime: what 'never written' means."""
    out = {}
    for path in sorted(root.rglob("*")):
        out[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    out["."] = ("", root.stat().st_mtime_ns)
    return out


def expected(rows: int, split: int) -> dict[str, bytes]:
    data = hf_rows(0, rows)
    return {
        f"train-0000{0 if i < split else 1}/{i if i < split else i - split:010d}": data["image"][i]["bytes"]
        for i in range(rows)
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only Hugging Face ``data/`` folder (two files, 30 + 20 rows in row groups of 16)."""
    root = tmp_path_factory.mktemp("ro") / "data"
    root.mkdir()
    write_hf(root / "train-00000.parquet", 0, 30)
    write_hf(root / "train-00001.parquet", 30, 50)
    for path in [*root.iterdir(), root]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    return root


def test_local_index_apart_reads_the_files_in_place(source: Path, tmp_path: Path) -> None:
    before = snapshot(source)
    out = tmp_path / "index"
    assert main(["index", str(source), "--format", "parquet", "--output", str(out)]) == 0
    assert snapshot(source) == before  # nothing written (nor locked) in the source folder
    assert sorted(os.listdir(out)) == ["index.json", "train-00000.parquet.slpq", "train-00001.parquet.slpq"]
    manifest = json.loads((out / "index.json").read_text())
    assert manifest["data_root"] == str(source) and manifest["classes"] == CLASSES
    assert [s["name"] for s in manifest["shards"]] == ["train-00000.parquet", "train-00001.parquet"]

    want = expected(50, 30)
    keys: list[str] = []
    for rank in range(2):  # exactly once over 2 ranks x 2 workers
        ds = StreamingDataset(str(out), rank=rank, world_size=2, shuffle=True, seed=3, batch_size=5)
        for sample in DataLoader(ds, batch_size=None, num_workers=2):
            assert sample.get("jpg", sample.get("png")) == want[sample["__key__"]]
            keys.append(sample["__key__"])
    assert Counter(keys) == Counter(want.keys())  # 50 rows in global batches of 10: no repeats
    access = ShardedDataset(str(out))
    assert access.get("train-00001/0000000004")["png"] == want["train-00001/0000000004"]
    assert main(["verify", str(out)]) == 0
    assert snapshot(source) == before


def test_verify_of_an_index_apart_catches_a_changed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    blobs = [encode(i, "PNG") for i in range(12)]
    table = pa.table({"image": pa.array(blobs, pa.binary())})
    pq.write_table(table, src / "t.parquet", row_group_size=4, compression="NONE")
    index_directory(str(src), "parquet", output=str(out))
    raw = bytearray((src / "t.parquet").read_bytes())
    at = raw.find(blobs[5])
    assert at > 0
    raw[at + len(blobs[5]) // 2] ^= 0x21
    (src / "t.parquet").write_bytes(bytes(raw))
    assert main(["verify", str(out)]) == 1
    assert "t.parquet" in capsys.readouterr().out
    with pytest.raises(CorruptShardError, match=r"t\.parquet, row group 1, row 5 "):
        list(StreamingDataset(str(out)))


def test_output_never_names_local_files_from_a_bucket(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a remote index cannot name the local files"):
        index_directory(str(tmp_path), "parquet", output="s3://bucket/index")
    # the output being the source folder itself is a plain index in place (no data_root)
    src = tmp_path / "same"
    src.mkdir()
    pq.write_table(pa.table({"image": pa.array([encode(1, "PNG")], pa.binary())}), src / "a.parquet")
    assert index_directory(str(src), "parquet", output=str(src) + "/").data_root is None


def manifest_with(root: object, fmt: str = "parquet") -> bytes:
    obj = {"streamload": 1, "format": fmt, "num_samples": 0, "hash": None, "shards": [], "data_root": root}
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "root",
    ["data", "../up", "/a/../b", "/a//b", "s3://bucket/a/../b", "s3://bucket?x=1", "/a\nb", "file://rel/x", 3, ""],
)
def test_a_data_root_must_be_absolute_and_plain(root: object) -> None:
    with pytest.raises(ManifestError, match="data_root"):
        Manifest.loads(manifest_with(root))


def test_a_data_root_is_refused_for_formats_streamload_only_writes(tmp_path: Path) -> None:
    (tmp_path / "index.json").write_bytes(manifest_with(str(tmp_path / "elsewhere"), "lmdb"))
    with pytest.raises(ManifestError, match=r"only for files streamload indexes in place \(tar, parquet\), not lmdb"):
        StreamingDataset(str(tmp_path))
    assert Manifest.loads(manifest_with("s3://b/p/")).data_root == "s3://b/p"


def test_index_apart_from_a_bucket_never_written(s3_server: SeaweedS3, tmp_path: Path) -> None:
    local = tmp_path / "up"
    local.mkdir()
    write_hf(local / "train-00000.parquet", 0, 30)
    write_hf(local / "train-00001.parquet", 30, 50)
    options = s3_server.storage_options()
    theirs = f"s3://{s3_server.make_bucket()}/hf/data"
    fs = s3_server.filesystem()
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"{theirs}/{path.name}")
    before = sorted(fs.find(theirs.split("/")[2], detail=False))

    ours = tmp_path / "index"  # local index of remote files
    assert main(["index", theirs, "--format", "parquet", "--output", str(ours), *s3_server.cli_options()]) == 0
    assert json.loads((ours / "index.json").read_text())["data_root"] == theirs
    want = expected(50, 30)
    for mode in ("shards", "none"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the options apply: the files are remote
            ds = StreamingDataset(
                str(ours), storage=StorageConfig(storage_options=options, cache=mode, cache_dir=str(tmp_path / mode))
            )
        assert {s["__key__"]: s.get("jpg", s.get("png")) for s in ds} == want, mode
        cached = [p.name for p in (tmp_path / mode).rglob("*") if p.is_file()]
        assert any(n.endswith(".parquet") for n in cached) == (mode == "shards"), cached  # "none": ranged reads

    remote_index = f"s3://{s3_server.make_bucket()}/index"  # an index in our bucket, the files in theirs
    index_directory(theirs, "parquet", storage_options=options, output=remote_index)
    with pytest.raises(ManifestError, match="allow_data_roots"):  # another bucket: only when named
        StreamingDataset(remote_index, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path / "c1")))
    storage = StorageConfig(
        storage_options=options, cache="shards", cache_dir=str(tmp_path / "c2"), allow_data_roots={theirs: options}
    )
    ds = StreamingDataset(remote_index, storage=storage)
    assert {s["__key__"]: s.get("jpg", s.get("png")) for s in ds} == want
    verify = ["verify", remote_index, "--cache-dir", str(tmp_path / "c3"), *s3_server.cli_options()]
    assert main([*verify, "--allow-data-root", theirs]) == 0
    assert sorted(fs.find(theirs.split("/")[2], detail=False)) == before  # their bucket: no sidecar, no lock

    # a manifest in a bucket may not send readers to local files
    forged = json.loads(fs.cat_file(f"{remote_index}/index.json"))
    forged["data_root"] = str(local)
    fs.pipe_file(f"{remote_index}/index.json", json.dumps(forged).encode())
    with pytest.raises(ManifestError, match="a manifest read from a URL may not name local files"):
        StreamingDataset(remote_index, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path / "c4")))
