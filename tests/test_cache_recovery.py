"""The shard cache recovering: corrupt cached copies, admission of the readers, the default bound.

* A cached copy corrupted on local disk after it was verified is dropped and downloaded
  once more (a local dataset's own files are never touched); a shard that is bad at its
  source still fails, naming the URL, the shard, the sample key and the cache directory.
* Readers sharing a cache register in it; one that cannot get room for its shard among
  the registered readers fails at once (no silent 300 s stall); a wait for room logs.
* Without ``cache_limit`` the cache is bounded by half of the space it could use.

Fast cases read ``memory://`` datasets; the DataLoader and ``verify`` cases read from the
real S3 server (SeaweedFS, ``tests/s3server.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from streamload import StorageConfig, StreamingDataset
from streamload._errors import CacheError, CorruptShardError
from streamload.batch import RawCollate
from streamload.cli import main
from streamload.manifest import FileEntry
from streamload.storage.cache import ShardCache
from streamload.verify import verify_dataset
from streamload.writer import DatasetWriter
from tests.helpers.datasets import without_lock_settle
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.timeout(120)

SAMPLES = 23
PER_SHARD = 5  # 5 shards: 5, 5, 5, 5, 3


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache directory (where a test passes none) is this test's own."""
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default-cache"))


def _payload(i: int) -> bytes:
    return f"<sample {i:03d}>".encode() * 20


def _write(url: str, *, hash_algorithm: str | None = "sha256", **options: Any) -> None:
    with DatasetWriter(url, max_samples=PER_SHARD, hash_algorithm=hash_algorithm, **options) as w:
        for i in range(SAMPLES):
            w.write({"__key__": f"k{i:03d}", "txt": _payload(i)})


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    url = f"memory://streamload-recovery-{os.getpid()}-{time.monotonic_ns()}"
    with without_lock_settle():
        _write(url)
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def _memory_fs() -> Any:
    import fsspec

    return fsspec.filesystem("memory")


def _cache_root(cache_dir: Path) -> Path:
    (root,) = (p for p in cache_dir.iterdir() if p.is_dir())
    return root


def _flip(path: Path, needle: bytes) -> None:
    """Flip one byte inside ``needle``'s first occurrence in ``path``, in place (same size, same inode)."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, f"{needle!r} not in {path}"
    data[at + 3] ^= 0x20
    with open(path, "r+b") as f:
        f.write(bytes(data))


def _texts(ds: StreamingDataset) -> list[bytes]:
    return [s["txt"] for s in ds]


EXPECTED = [_payload(i) for i in range(SAMPLES)]


# -- 1. a corrupt cached copy is downloaded again ---------------------------------------


def test_a_cached_shard_corrupted_on_disk_is_downloaded_again(memory_url: str, tmp_path: Path) -> None:
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path), read_ahead=0))
    assert _texts(ds) == EXPECTED
    storage = ds._get_storages()[0]
    downloads = storage.stats.downloads  # type: ignore[attr-defined]
    cached = _cache_root(tmp_path) / "data" / "shard-000001.tar"
    inode = cached.stat().st_ino
    _flip(cached, b"<sample 007>")
    assert _texts(ds) == EXPECTED  # the next epoch reads it, fresh
    assert _texts(ds) == EXPECTED  # and the one after, from the repaired cache
    assert storage.stats.downloads == downloads + 1  # type: ignore[attr-defined]
    assert cached.stat().st_ino != inode
    remote = _memory_fs().cat_file(f"{memory_url.removeprefix('memory://')}/shard-000001.tar")
    assert cached.read_bytes() == remote


def test_a_cached_sidecar_corrupted_on_disk_is_downloaded_again(memory_url: str, tmp_path: Path) -> None:
    """The sidecar's corruption shows when the shard is opened (its hash is checked there)."""
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path)))
    assert _texts(ds) == EXPECTED
    sidecar = _cache_root(tmp_path) / "data" / "shard-000002.tar.idx"
    data = bytearray(sidecar.read_bytes())
    data[len(data) // 2] ^= 0x01
    sidecar.write_bytes(bytes(data))  # a new inode, like a restore from a bad backup
    os.utime(sidecar)
    assert _texts(ds) == EXPECTED


@pytest.mark.parametrize("damage", ["truncated", "record"])
def test_a_cached_file_whose_size_or_record_no_longer_matches_is_downloaded_again(
    memory_url: str, tmp_path: Path, damage: str
) -> None:
    """At the smallest cache limit, so the stale file must not hold room the fresh one needs."""
    probe = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path / "probe")))
    limit = 2 * probe.manifest.largest_shard_bytes
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path / "c"), cache_limit=limit))
    assert _texts(ds) == EXPECTED
    root = _cache_root(tmp_path / "c")
    name = ds.manifest.shards[-1].name  # still cached: the last one read
    if damage == "truncated":
        with open(root / "data" / name, "r+b") as f:
            f.truncate(512)
    else:
        (root / "meta" / name).write_text("0" * 64 + " 1 2\n")
    assert _texts(ds) == EXPECTED
    assert ds._get_storages()[0].cache.usage() <= limit  # type: ignore[attr-defined]


def test_skip_mode_repairs_before_it_skips(memory_url: str, tmp_path: Path) -> None:
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path)), on_error="skip")
    assert _texts(ds) == EXPECTED
    _flip(_cache_root(tmp_path) / "data" / "shard-000003.tar", b"<sample 017>")
    assert _texts(ds) == EXPECTED
    assert ds.skipped_samples == 0


def test_batches_read_straight_from_the_shards_repair_a_corrupt_cached_copy(memory_url: str, tmp_path: Path) -> None:
    collate = RawCollate(field="txt", label_field=None)
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path)), batch_size=4, collate=collate)

    def texts() -> list[bytes]:
        batches = list(ds)
        assert all(len(batch) == 4 for batch in batches)  # whole batches only
        return [bytes(t.numpy()) for batch in batches for t in batch.samples()]

    # The epoch is padded to whole batches of 4: the first samples again, in order.
    padded = EXPECTED + EXPECTED[: -(-SAMPLES // 4) * 4 - SAMPLES]
    assert texts() == padded
    _flip(_cache_root(tmp_path) / "data" / "shard-000001.tar", b"<sample 006>")
    _flip(_cache_root(tmp_path) / "data" / "shard-000002.tar", b"<sample 012>")
    assert texts() == padded


def _rewrite_shard(url: str, name: str, change: Callable[[bytearray], None], *, rehash: bool) -> None:
    """Change a shard at its source; with ``rehash``, make the manifest vouch for the new bytes."""
    fs = _memory_fs()
    root = url.removeprefix("memory://")
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    change(data)
    fs.pipe_file(f"{root}/{name}", bytes(data))
    if rehash:
        manifest = json.loads(fs.cat_file(f"{root}/index.json"))
        for shard in manifest["shards"]:
            if shard["name"] == name:
                shard["hash"] = hashlib.sha256(bytes(data)).hexdigest()
        fs.pipe_file(f"{root}/index.json", json.dumps(manifest).encode())


def _flip_in(data: bytearray, needle: bytes = b"<sample 008>") -> None:
    data[data.find(needle) + 3] ^= 0x20


def test_a_shard_bad_at_its_source_fails_without_a_useless_download(memory_url: str, tmp_path: Path) -> None:
    """The manifest's hash vouches for the bad bytes (a buggy writer): the cached copy is
    faithful, so downloading it again cannot help; the error names everything."""
    _rewrite_shard(memory_url, "shard-000001.tar", _flip_in, rehash=True)
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path), read_ahead=0))
    with pytest.raises(CorruptShardError) as info:
        list(ds)
    message = str(info.value)
    root = _cache_root(tmp_path)
    for part in (f"{memory_url}/shard-000001.tar", "'k008'", root.name, "bad at its source", "not downloaded again"):
        assert part in message, (part, message)
    assert ds._get_storages()[0].stats.downloads == 4  # type: ignore[attr-defined]  # 2 shards, 2 sidecars


def test_an_unhashed_shard_bad_at_its_source_is_downloaded_once_more_then_fails(tmp_path: Path) -> None:
    url = f"memory://streamload-unhashed-{os.getpid()}-{time.monotonic_ns()}"
    _write(url, hash_algorithm=None)
    try:
        _rewrite_shard(url, "shard-000000.tar", _flip_at_2, rehash=False)
        ds = StreamingDataset(url, storage=StorageConfig(cache_dir=str(tmp_path), read_ahead=0))
        with pytest.raises(CorruptShardError, match=rf"{url}/shard-000000.tar: .*'k002'") as info:
            list(ds)
        assert _cache_root(tmp_path).name in str(info.value) and "bad at its source" in str(info.value)
        # sidecar and shard, then both again: with no hash, either may be the bad one
        assert ds._get_storages()[0].stats.downloads == 4  # type: ignore[attr-defined]
    finally:
        _memory_fs().rm(url.removeprefix("memory://"), recursive=True)


def _flip_at_2(data: bytearray) -> None:
    _flip_in(data, b"<sample 002>")


def test_a_local_datasets_corrupt_file_is_never_touched(tmp_path: Path) -> None:
    _write(str(tmp_path / "ds"))
    shard = tmp_path / "ds" / "shard-000001.tar"
    _flip(shard, b"<sample 007>")
    before = (shard.read_bytes(), shard.stat().st_ino)
    ds = StreamingDataset(str(tmp_path / "ds"))
    with pytest.raises(CorruptShardError, match="'k007'"):
        list(ds)
    assert (shard.read_bytes(), shard.stat().st_ino) == before
    with pytest.warns(UserWarning, match="cache_dir=.* does nothing for the local dataset"):
        report = verify_dataset(str(tmp_path / "ds"), cache_dir=str(tmp_path / "cache"))
    assert [name for name, _ in report.problems] == ["shard-000001.tar"] and not report.repaired
    assert (shard.read_bytes(), shard.stat().st_ino) == before
    assert not (tmp_path / "cache").exists()


def test_two_readers_finding_one_corrupt_copy_download_it_once(tmp_path: Path) -> None:
    """The second reader to find the copy corrupt must not delete the fresh one the first fetched."""
    good = b"\1" * 1000
    entry = FileEntry("a", len(good), hashlib.sha256(good).hexdigest(), algorithm="sha256")
    first, second = ShardCache(str(tmp_path), limit=None), ShardCache(str(tmp_path), limit=None)
    pin = first.pin("a")
    path = Path(first.fill(entry, _writer(good)) or "")
    pin.close()
    seen = first.generation("a")  # both readers read this copy...
    assert seen is not None and second.generation("a") == seen
    _flip(path, b"\1\1\1\1")  # ...and it goes bad
    assert first.discard(entry, seen)  # the first deletes it and fetches it again
    pin = first.pin("a")
    assert first.fill(entry, _writer(good)) == str(path)  # (on tmpfs, often in the freed inode)
    pin.close()
    fresh = first.generation("a")
    assert fresh not in (None, seen)
    assert second.discard(entry, seen)  # the second: already replaced, nothing deleted
    assert first.generation("a") == fresh and path.read_bytes() == good
    assert not second.discard(entry, fresh)  # a copy that hashes to its entry is kept
    assert first.stats.discarded == 1 and second.stats.discarded == 0


def test_a_copy_deleted_between_its_lookup_and_its_opening_is_fetched_again(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another reader discarded the copy (as corrupt) just after this one looked it up."""
    from streamload.shards import ShardSource

    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path), read_ahead=0))
    assert _texts(ds) == EXPECTED
    original = ShardSource.open_reader
    deleted: list[str] = []

    def open_reader(self: ShardSource, shard: int, path: str, sidecar: str | None) -> Any:
        if shard == 2 and not deleted:
            os.unlink(path)
            deleted.append(path)
        return original(self, shard, path, sidecar)

    monkeypatch.setattr(ShardSource, "open_reader", open_reader)
    assert _texts(ds) == EXPECTED
    assert deleted and Path(deleted[0]).exists()


def test_a_cache_directory_deleted_under_a_running_job_is_made_again(memory_url: str, tmp_path: Path) -> None:
    """``rm -rf ~/.cache/streamload`` to free space while a job reads: the next epoch still works."""
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path), cache_limit="1MB"))
    assert _texts(ds) == EXPECTED
    for part in ("", "data", "pins", "tmp", "meta", "readers"):
        _remove_tree(_cache_root(tmp_path) / part)
        assert _texts(ds) == EXPECTED, part


def _remove_tree(path: Path) -> None:
    """``rm -rf`` while the job's background work (read-ahead) may still write a file into it: again."""
    import errno
    import shutil

    for attempt in range(20):
        try:
            shutil.rmtree(path)
            return
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY or attempt == 19:
                raise
            time.sleep(0.05)


def test_verify_api_repairs_a_corrupt_cached_copy_and_says_so(memory_url: str, tmp_path: Path) -> None:
    assert _texts(StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path)))) == EXPECTED
    cached = _cache_root(tmp_path) / "data" / "shard-000004.tar"
    for read_samples in (False, True):
        _flip(cached, b"<sample 021>")
        report = verify_dataset(memory_url, cache_dir=str(tmp_path), read_samples=read_samples)
        assert report.ok, report.problems
        assert [name for name, _ in report.repaired] == ["shard-000004.tar"]
        assert "sha256" in report.repaired[0][1] and str(tmp_path) in report.repaired[0][1]
        assert cached.read_bytes() == _memory_fs().cat_file(f"{memory_url.removeprefix('memory://')}/{cached.name}")
    assert verify_dataset(memory_url, cache_dir=str(tmp_path)).repaired == []


# -- the same from a real S3 server ------------------------------------------------------


@pytest.fixture(scope="module")
def s3_url(s3_server: SeaweedS3) -> str:
    url = f"s3://{s3_server.make_bucket()}/recovery"
    _write(url, storage_options=s3_server.storage_options())
    return url


@pytest.mark.slow
def test_s3_dataloader_workers_repair_corrupt_cached_copies(s3_server: SeaweedS3, s3_url: str, tmp_path: Path) -> None:
    ds = StreamingDataset(
        s3_url,
        storage=StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path)),
        shuffle=True,
    )
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    first = [s["__key__"] for s in loader]
    root = _cache_root(tmp_path)
    _flip(root / "data" / "shard-000000.tar", b"<sample 001>")
    _flip(root / "data" / "shard-000003.tar", b"<sample 016>")
    second = [s["__key__"] for s in loader]
    assert Counter(first) == Counter(second) == Counter(f"k{i:03d}" for i in range(SAMPLES))
    fs = s3_server.filesystem()
    for name in ("shard-000000.tar", "shard-000003.tar"):
        assert (root / "data" / name).read_bytes() == fs.cat_file(f"{s3_url.removeprefix('s3://')}/{name}")


@pytest.mark.slow
def test_s3_verify_with_cache_dir_repairs_and_reports(
    s3_server: SeaweedS3, s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    ds = StreamingDataset(
        s3_url, storage=StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(cache))
    )
    assert _texts(ds) == EXPECTED
    cached = _cache_root(cache) / "data" / "shard-000002.tar"
    _flip(cached, b"<sample 011>")
    capsys.readouterr()
    assert main(["verify", s3_url, "--cache-dir", str(cache), *s3_server.cli_options()]) == 0
    out = capsys.readouterr().out
    assert "REPAIRED shard-000002.tar" in out and str(cache) in out, out
    assert f"OK: {SAMPLES // PER_SHARD + 1} shards, {SAMPLES} samples" in out
    remote = s3_server.filesystem().cat_file(f"{s3_url.removeprefix('s3://')}/shard-000002.tar")
    assert cached.read_bytes() == remote
    assert main(["verify", s3_url, "--cache-dir", str(cache), *s3_server.cli_options()]) == 0
    assert "REPAIRED" not in capsys.readouterr().out


# -- 2. admission: readers sharing a cache ------------------------------------------------


def _largest(url: str, storage: StorageConfig) -> int:
    return StreamingDataset(url, storage=storage).manifest.largest_shard_bytes


@pytest.mark.slow
def test_more_readers_than_the_smallest_cache_holds_fail_at_once(
    s3_server: SeaweedS3, s3_url: str, tmp_path: Path
) -> None:
    """Three DataLoader workers at the smallest accepted limit (two shards): each needs a
    shard cached while it reads, and the DataLoader hands out samples in order, so the
    third would wait for the others' room until the 300 s wait ran out. It fails at once."""
    options = s3_server.storage_options()
    limit = 2 * _largest(s3_url, StorageConfig(storage_options=options))
    ds = StreamingDataset(  # whole shards cached (cache="auto" would stream: 3 readers need 3 shards)
        s3_url,
        storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path), cache_limit=limit, cache="shards"),
    )
    loader = DataLoader(ds, batch_size=None, num_workers=3, multiprocessing_context="fork", timeout=100)
    started = time.monotonic()
    with pytest.raises(CacheError, match=r"3 readers share the cache .* cache_limit=") as info:
        list(loader)
    assert time.monotonic() - started < 30
    assert s3_url in str(info.value)
    del info  # its traceback holds this frame: a cycle keeping the DataLoader's iterator and workers


@pytest.mark.slow
def test_two_readers_at_the_smallest_cache_read_everything(s3_server: SeaweedS3, s3_url: str, tmp_path: Path) -> None:
    options = s3_server.storage_options()
    limit = 2 * _largest(s3_url, StorageConfig(storage_options=options))
    ds = StreamingDataset(
        s3_url, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path), cache_limit=limit), shuffle=True
    )
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    for _ in range(2):
        assert Counter(s["__key__"] for s in loader) == Counter(f"k{i:03d}" for i in range(SAMPLES))
        assert ds._get_storages()[0].cache.usage() <= limit  # type: ignore[attr-defined]


def _register_and_wait(root: str, ready: Any) -> None:
    cache = ShardCache(root, limit=None)
    cache.register()
    ready.set()
    time.sleep(60)


def test_registered_readers_are_counted_and_dead_ones_forgotten(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path), limit=None)
    assert cache.readers() == 0
    mine = cache.register()
    assert cache.readers() == 1
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_register_and_wait, args=(str(tmp_path), ready))
    child.start()
    try:
        assert ready.wait(30)
        assert cache.readers() == 2
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(30)
        assert cache.readers() == 1  # its lock died with it; its file is cleaned
        assert len(os.listdir(tmp_path / "readers")) == 1
    finally:
        child.kill()
        child.join()
    mine.close()
    assert cache.readers() == 0 and os.listdir(tmp_path / "readers") == []


def test_a_wait_for_room_logs_its_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    size = 1000
    cache = ShardCache(str(tmp_path), limit=2 * size, wait_timeout=4, log_every=1.0)
    pins = []
    for name, byte in (("a", 1), ("b", 2)):
        data = bytes([byte]) * size
        pins.append(cache.pin(name))
        entry = FileEntry(name, size, hashlib.sha256(data).hexdigest(), algorithm="sha256")
        cache.fill(entry, _writer(data))
    data = b"\3" * size
    entry = FileEntry("c", size, hashlib.sha256(data).hexdigest(), algorithm="sha256")
    with caplog.at_level(logging.INFO, logger="streamload"), pytest.raises(CacheError, match="every cached file"):
        cache.fill(entry, _writer(data))
    waits = [r.getMessage() for r in caplog.records if "waiting for room" in r.getMessage()]
    assert len(waits) >= 2, caplog.text
    assert "c (1.0 KB)" in waits[0] and str(tmp_path) in waits[0]
    for pin in pins:
        pin.close()


def _writer(data: bytes) -> Callable[[str, Callable[[], bool]], None]:
    def download(part: str, cancelled: Callable[[], bool]) -> None:
        with open(part, "r+b") as f:
            f.write(data)

    return download


# -- 3. a default bound --------------------------------------------------------------------


def test_without_cache_limit_the_cache_is_bounded_by_half_the_free_space(
    memory_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    with caplog.at_level(logging.INFO, logger="streamload"):
        ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path)))
        assert _texts(ds) == EXPECTED
    limit = ds._get_storages()[0].limit  # type: ignore[attr-defined]
    assert limit is not None and abs(limit - free // 2) < free // 100
    lines = [r.getMessage() for r in caplog.records if "no cache_limit" in r.getMessage()]
    assert len(lines) == 1, caplog.text  # once, not once per storage opened
    assert memory_url in lines[0] and str(tmp_path) in lines[0]


def test_the_default_bound_holds_at_least_two_of_the_largest_shards_and_is_enforced(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    with caplog.at_level(logging.INFO, logger="streamload"):
        ds = StreamingDataset(
            memory_url, storage=StorageConfig(cache_dir=str(tmp_path), cache="shards")
        )  # "auto" would stream
    assert "less than the" in caplog.text and "two of the largest shards need" in caplog.text
    largest = ds.manifest.largest_shard_bytes
    assert ds._get_storages()[0].limit == 2 * largest  # type: ignore[attr-defined]
    assert _texts(ds) == EXPECTED
    assert ds._get_storages()[0].cache.usage() <= 2 * largest  # type: ignore[attr-defined]  # evicted as it went


def test_an_unbounded_cache_is_asked_for_explicitly(memory_url: str, tmp_path: Path) -> None:
    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path), cache_limit="unbounded"))
    assert ds._get_storages()[0].limit is None  # type: ignore[attr-defined]
    assert _texts(ds) == EXPECTED


def test_converting_a_remote_dataset_repairs_a_corrupt_cached_copy(memory_url: str, tmp_path: Path) -> None:
    """A dataset used as a conversion source reads through the same repair as training."""
    from streamload.converters import ConvertOptions, DatasetSource, convert

    cache = tmp_path / "cache"
    source = DatasetSource(memory_url, cache_dir=str(cache))
    convert(source, str(tmp_path / "first"), ConvertOptions(progress=False))
    _flip(_cache_root(cache) / "data" / "shard-000001.tar", b"<sample 007>")
    source = DatasetSource(memory_url, cache_dir=str(cache))
    convert(source, str(tmp_path / "second"), ConvertOptions(progress=False))
    assert _texts(StreamingDataset(str(tmp_path / "second"))) == EXPECTED


def test_a_copy_another_process_deletes_between_acquire_and_open_is_fetched_again(
    memory_url: str, tmp_path: Path
) -> None:
    """A reader holds a shard acquired; another reader of the cache finds that copy corrupt and deletes it
    before the first opens it: the open fetches the shard again instead of failing on the missing file."""
    from streamload.storage.remote import RemoteStorage

    ds = StreamingDataset(memory_url, storage=StorageConfig(cache_dir=str(tmp_path), read_ahead=0))
    entry = ds.manifest.shards[1]
    settings = StorageConfig(cache_dir=str(tmp_path), read_ahead=0).resolve()
    first, other = (RemoteStorage(memory_url, settings) for _ in range(2))
    path = first.acquire(entry)
    good = Path(path).read_bytes()
    damaged = bytearray(good)  # the copy in the cache is damaged on disk
    _flip_in(damaged)
    Path(path).write_bytes(bytes(damaged))
    assert other.cache.discard(entry, None)  # the other reader deletes it
    assert not os.path.exists(path)
    data = first.open_bytes(entry)
    try:
        assert data.pread(entry.num_bytes, 0) == good
    finally:
        data.close()
        first.release(entry)
        first.release(entry)
