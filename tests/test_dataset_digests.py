"""Whole-file digests: new datasets get xxh3-128, SHA-256 datasets keep working, unknown algorithms are refused.

Written and checked on local disk (convert, ``DatasetWriter``, ``verify``) and downloaded
through the shard cache from a ``memory://`` bucket, where the download's own digest is
what catches a damaged byte no sample's checksum covers.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from streamload import StorageConfig, StreamingDataset
from streamload._errors import CorruptShardError, ManifestError
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder
from streamload.verify import verify_dataset
from streamload.writer import DatasetWriter

pytestmark = pytest.mark.timeout(60)

SAMPLES = 10


def _payload(i: int) -> bytes:
    return f"<sample {i:02d}>".encode() * 10


def _write(url: str, **options: Any) -> None:
    with DatasetWriter(url, max_samples=4, **options) as w:
        for i in range(SAMPLES):
            w.write({"__key__": f"k{i:02d}", "txt": _payload(i)})


def _manifest(root: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((root / "index.json").read_text())
    return loaded


def _files(manifest: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for shard in manifest["shards"]:
        yield shard
        if shard.get("sidecar"):
            yield shard["sidecar"]


def _damage_tail(data: bytes) -> bytes:
    """``data`` with one byte of a tar's end-of-archive zeros changed: no sample's bytes, the same size."""
    at = len(data) - 10
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    url = f"memory://streamload-digests-{os.getpid()}-{time.monotonic_ns()}"
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_a_new_dataset_is_hashed_with_xxh3_128_and_verifies(tmp_path: Path) -> None:
    _write(str(tmp_path))
    manifest = _manifest(tmp_path)
    assert manifest["hash"] == "xxh3_128"
    for entry in _files(manifest):
        assert entry["hash"] == xxhash.xxh3_128_hexdigest((tmp_path / entry["name"]).read_bytes())
    report = verify_dataset(str(tmp_path))
    assert report.problems == [] and report.shards_checked == 3
    assert [bytes(s["txt"]) for s in StreamingDataset(str(tmp_path))] == [_payload(i) for i in range(SAMPLES)]


def test_convert_writes_xxh3_128_and_verify_names_a_changed_byte(tmp_path: Path) -> None:
    images, out = tmp_path / "images", tmp_path / "ds"
    make_image_folder(str(images), num_classes=2, per_class=3, size=(16, 12), seed=3)
    convert(ImageFolderSource(str(images)), str(out), ConvertOptions(samples_per_shard=4, progress=False))
    manifest = _manifest(out)
    assert manifest["hash"] == "xxh3_128" and len(manifest["shards"]) == 2
    assert verify_dataset(str(out)).problems == []
    shard = out / manifest["shards"][1]["name"]
    shard.write_bytes(_damage_tail(shard.read_bytes()))
    problems = verify_dataset(str(out)).problems
    assert [name for name, _ in problems] == [shard.name]
    assert "xxh3_128" in problems[0][1]


def test_a_download_with_a_changed_byte_fails_its_xxh3_128_check(memory_url: str, tmp_path: Path) -> None:
    import fsspec

    _write(memory_url)
    fs = fsspec.filesystem("memory")
    name = _manifest_of(memory_url)["shards"][0]["name"]
    path = f"{memory_url.removeprefix('memory://')}/{name}"
    fs.pipe_file(path, _damage_tail(fs.cat_file(path)))
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=tmp_path / "cache"))
    with pytest.raises(CorruptShardError, match=rf"{name}.*xxh3_128"):
        list(ds)


def _manifest_of(url: str) -> dict[str, Any]:
    import fsspec

    loaded: dict[str, Any] = json.loads(
        fsspec.filesystem("memory").cat_file(f"{url.removeprefix('memory://')}/index.json")
    )
    return loaded


def test_a_sha256_dataset_is_still_downloaded_checked_and_read(memory_url: str, tmp_path: Path) -> None:
    import fsspec

    _write(memory_url, hash_algorithm="sha256")  # what earlier versions wrote
    manifest = _manifest_of(memory_url)
    assert manifest["hash"] == "sha256"
    fs = fsspec.filesystem("memory")
    for entry in _files(manifest):
        data = fs.cat_file(f"{memory_url.removeprefix('memory://')}/{entry['name']}")
        assert entry["hash"] == hashlib.sha256(data).hexdigest()
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=tmp_path / "cache"))
    assert [bytes(s["txt"]) for s in ds] == [_payload(i) for i in range(SAMPLES)]


def test_appending_to_a_sha256_dataset_keeps_its_algorithm(tmp_path: Path) -> None:
    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "ds"
    make_image_folder(str(first), num_classes=2, per_class=2, size=(16, 12), seed=4)
    make_image_folder(str(second), num_classes=2, per_class=2, size=(16, 12), seed=5)
    for folder in (second,):  # other file names: new keys to append
        for path in sorted(folder.rglob("*.*")):
            path.rename(path.with_name(f"more-{path.name}"))
    convert(ImageFolderSource(str(first)), str(out), ConvertOptions(progress=False, hash_algorithm="sha256"))
    convert(ImageFolderSource(str(second)), str(out), ConvertOptions(progress=False, append=True))
    manifest = _manifest(out)
    assert manifest["hash"] == "sha256" and len(manifest["shards"]) == 2
    for entry in _files(manifest):
        assert entry["hash"] == hashlib.sha256((out / entry["name"]).read_bytes()).hexdigest()
    assert verify_dataset(str(out)).problems == []


def test_a_manifest_naming_an_unknown_hash_algorithm_is_refused(tmp_path: Path) -> None:
    _write(str(tmp_path))
    manifest = _manifest(tmp_path)
    manifest["hash"] = "md5"
    (tmp_path / "index.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"index\.json.*'md5'.*sha256.*xxh3_128"):
        StreamingDataset(str(tmp_path))
