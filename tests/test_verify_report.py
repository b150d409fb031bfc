"""``verify`` says what it could not check, and digests of two algorithms are never compared.

* A file the manifest gives no hash for is listed (``VerifyReport.unhashed``), and the
  command prints a NOTE and no ``OK`` (only sizes and the samples' own checksums were
  checked), still exiting 0 (nothing is wrong).
* A manifest whose digests do not have its algorithm's length (``"hash": "sha256"`` over
  xxh3 digests) is not rejected when loaded, so the mismatch shows when a file is checked:
  by ``verify`` and by a remote download, both saying the algorithms differ.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from streamload import StorageConfig, StreamingDataset
from streamload._errors import CorruptShardError
from streamload.cli import main
from streamload.manifest import FileEntry
from streamload.verify import verify_dataset
from streamload.writer import DatasetWriter


def _write(url: str, hash_algorithm: str | None) -> None:
    with DatasetWriter(url, max_samples=5, hash_algorithm=hash_algorithm) as w:
        for i in range(12):
            w.write({"__key__": f"k{i:03d}", "txt": f"sample {i}".encode()})


def test_an_unhashed_dataset_is_not_reported_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(str(tmp_path), None)
    report = verify_dataset(str(tmp_path))
    assert report.ok and report.shards_checked == 3 and report.samples_checked == 12
    assert sorted(report.unhashed) == sorted(
        [f"shard-{i:06d}.tar" for i in range(3)] + [f"shard-{i:06d}.tar.idx" for i in range(3)]
    )
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NOTE 6 files have no hash in the manifest (shard-000000.tar.idx, shard-000000.tar, shard-000001" in out
    assert "only their sizes were checked (and their samples by their own checksums)" in out
    assert "OK" not in out, out
    assert f"NO HASH to check for 6 files, no other problem: 3 shards, 12 samples checked in {tmp_path}" in out
    assert main(["verify", str(tmp_path), "--no-read"]) == 0
    out = capsys.readouterr().out
    assert "only their sizes were checked\n" in out and "OK" not in out


def test_a_hashed_dataset_is_ok_with_no_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(str(tmp_path), "xxh3_128")
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NOTE" not in out and out.startswith("OK: 3 shards, 12 samples checked")
    assert verify_dataset(str(tmp_path)).unhashed == []


def _declare_sha256(manifest_path: Path) -> None:
    """Say the manifest's (xxh3_128, 32 hex digits) digests are sha256 ones (64 hex digits)."""
    manifest = json.loads(manifest_path.read_text())
    assert manifest["hash"] == "xxh3_128" and len(manifest["shards"][0]["hash"]) == 32
    manifest["hash"] = "sha256"
    manifest_path.write_text(json.dumps(manifest))


def test_verify_says_the_hash_algorithms_differ(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(str(tmp_path), "xxh3_128")
    _declare_sha256(tmp_path / "index.json")
    report = verify_dataset(str(tmp_path), read_samples=False)
    assert len(report.problems) == 3
    for name, problem in report.problems:
        assert problem.startswith(f"{name}") and "hash algorithms differ" in problem, problem
    assert main(["verify", str(tmp_path)]) == 1
    assert "hash algorithms differ" in capsys.readouterr().out


def test_a_download_says_the_hash_algorithms_differ(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://streamload-digests-{os.getpid()}-{time.monotonic_ns()}"
    local = tmp_path / "ds"
    _write(str(local), "xxh3_128")
    _declare_sha256(local / "index.json")
    try:
        for path in local.iterdir():
            fs.pipe_file(f"{url.removeprefix('memory://')}/{path.name}", path.read_bytes())
        ds = StreamingDataset(url, storage=StorageConfig(cache_dir=str(tmp_path / "cache"), read_ahead=0))
        with pytest.raises(CorruptShardError, match=rf"{url}/shard-000000.tar.*hash algorithms differ"):
            list(ds)
        assert not list((tmp_path / "cache").glob("*/data/shard-*"))  # nothing cached on a mismatch
    finally:
        fs.rm(url.removeprefix("memory://"), recursive=True)


def test_digest_problem_compares_only_digests_of_one_algorithm() -> None:
    sha = "ab" * 32
    xxh = "cd" * 16
    entry = FileEntry("f", 1, sha, algorithm="sha256")
    assert entry.digest_problem(sha, "sha256") is None
    assert "hash algorithms differ" in (entry.digest_problem(xxh, "xxh3_128") or "")
    assert "sha256 is" in (entry.digest_problem("ef" * 32, "sha256") or "")
    unknown = FileEntry("f", 1, xxh)  # no algorithm: the digest's length tells it
    assert "hash algorithms differ" in (unknown.digest_problem(sha, "sha256") or "")
    assert FileEntry("f", 1, None).digest_problem(sha, "sha256") is None


@pytest.mark.parametrize("name", ["index_directory", "index_shard", "publish_index"])
def test_the_old_verify_names_still_work_with_a_deprecation_warning(name: str) -> None:
    import streamload.indexing
    import streamload.verify

    with pytest.deprecated_call(match=f"streamload.verify.{name} moved to streamload.indexing.{name}"):
        alias = getattr(streamload.verify, name)
    assert alias is getattr(streamload.indexing, name)
    with pytest.raises(AttributeError, match="no attribute 'index_nothing'"):
        _ = streamload.verify.index_nothing  # type: ignore[attr-defined]
