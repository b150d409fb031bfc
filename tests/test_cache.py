"""The shard cache, retries and fsspec URLs without an S3 server: memory://, http://, errors."""

from __future__ import annotations

import fcntl
import functools
import http.server
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from streamload import StorageConfig, StreamingDataset
from streamload._errors import CacheError, ConfigError, CorruptShardError
from streamload.storage import open_storage
from streamload.storage.cache import ShardCache
from streamload.storage.retry import RetryPolicy, is_transient, retry_call
from streamload.writer import DatasetWriter
from tests.helpers.cache_fills import file_entry, write_download
from tests.helpers.datasets import without_lock_settle

SIZE = 1000

# Every wait in these tests is bounded; none should come near this, even on a loaded machine.
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache directory (where a test passes none) is this test's own."""
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default-cache"))


def _fill(cache: ShardCache, name: str, byte: int) -> str:
    data = bytes([byte]) * SIZE
    pin = cache.pin(name)
    try:
        path = cache.fill(file_entry(name, data), write_download(data))
    finally:
        pin.close()
    assert path is not None
    return path


def _cached(cache: ShardCache) -> set[str]:
    return set(os.listdir(os.path.join(cache.root, "data")))


def test_lru_eviction_keeps_the_limit_and_the_recently_used(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path), limit=2 * SIZE)
    _fill(cache, "a", 1)
    time.sleep(0.01)
    _fill(cache, "b", 2)
    time.sleep(0.01)
    assert cache.lookup(file_entry("a", b"\1" * SIZE)) is not None  # a is now the most recent
    time.sleep(0.01)
    _fill(cache, "c", 3)
    assert _cached(cache) == {"a", "c"}
    assert cache.usage() <= 2 * SIZE
    assert Path(cache.data_path("c")).read_bytes() == b"\3" * SIZE


def test_a_pinned_file_is_never_evicted(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path), limit=2 * SIZE, wait_timeout=1)
    _fill(cache, "a", 1)
    _fill(cache, "b", 2)
    pin_a, pin_b = cache.pin("a"), cache.pin("b")
    with pytest.raises(CacheError, match="every cached file is in use"):
        _fill(cache, "c", 3)
    assert _cached(cache) == {"a", "b"}
    pin_b.close()
    _fill(cache, "c", 3)
    assert _cached(cache) == {"a", "c"}
    pin_a.close()


def _crash_mid_download(root: str) -> None:
    cache = ShardCache(root, limit=10 * SIZE)

    def half_then_die(part: str, cancelled: Callable[[], bool]) -> None:
        with open(part, "r+b") as f:
            f.write(b"\5" * (SIZE // 2))
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    data = b"\5" * SIZE
    cache.fill(file_entry("x", data), half_then_die)


def test_a_crashed_downloaders_partial_file_is_not_used_and_is_cleaned(tmp_path: Path) -> None:
    child = mp.get_context("fork").Process(target=_crash_mid_download, args=(str(tmp_path),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL
    parts = os.listdir(tmp_path / "tmp")
    assert len(parts) == 1  # left behind by the crash
    cache = ShardCache(str(tmp_path), limit=10 * SIZE)
    assert cache.lookup(file_entry("x", b"\5" * SIZE)) is None
    path = _fill(cache, "x", 5)  # downloads again; the dead part is deleted on the way
    assert Path(path).read_bytes() == b"\5" * SIZE
    assert os.listdir(tmp_path / "tmp") == []


def test_a_download_with_the_wrong_hash_is_rejected(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path), limit=None)
    good = b"\1" * SIZE
    entry = file_entry("a", good)
    with pytest.raises(CorruptShardError, match="a: downloaded bytes do not match the manifest: sha256 is"):
        cache.fill(entry, write_download(b"\2" * SIZE))
    with pytest.raises(CorruptShardError, match="downloaded 10 bytes, the manifest says 1000"):
        cache.fill(entry, write_download(b"\1" * 10))
    assert _cached(cache) == set() and os.listdir(tmp_path / "tmp") == []
    unverified = ShardCache(str(tmp_path), limit=None, verify_hash=False)
    assert unverified.fill(entry, write_download(b"\2" * SIZE)) is not None  # size only


def test_a_same_size_file_of_another_version_is_not_served(tmp_path: Path) -> None:
    """The cache is keyed by URL: a dataset re-written there may have a file of the same
    name and size but other bytes; the cached one must not be served for the new entry."""
    cache = ShardCache(str(tmp_path), limit=None)
    old, new = b"\1" * SIZE, b"\2" * SIZE
    assert Path(_fill(cache, "a", 1)).read_bytes() == old
    assert cache.lookup(file_entry("a", old)) is not None
    assert cache.lookup(file_entry("a", new)) is None  # same name and size, other hash: a miss
    pin = cache.pin("a")
    try:
        path = cache.fill(file_entry("a", new), write_download(new))
    finally:
        pin.close()
    assert path is not None and Path(path).read_bytes() == new
    assert cache.lookup(file_entry("a", old)) is None and cache.lookup(file_entry("a", new)) is not None


def test_a_file_without_a_record_of_its_verification_is_downloaded_again(tmp_path: Path) -> None:
    """A record left by a crash between writing it and the rename never vouches for the
    file already in data/ (nor does a file with no record at all)."""
    cache = ShardCache(str(tmp_path), limit=None)
    _fill(cache, "a", 1)
    entry = file_entry("a", b"\1" * SIZE)
    record = Path(tmp_path, "meta", "a")
    digest, size, _inode, *generation = record.read_text().split()
    record.write_text(" ".join([digest, size, "1", *generation]) + "\n")  # the inode of some other file
    assert cache.lookup(entry) is None
    record.unlink()
    assert cache.lookup(entry) is None
    _fill(cache, "a", 1)
    assert cache.lookup(entry) is not None


def test_a_dataset_rewritten_at_the_same_url_is_read_fresh(tmp_path: Path) -> None:
    """End to end: same URL, same cache, same shard names and sizes, other bytes."""
    import fsspec

    url = f"memory://streamload-rewrite-{os.getpid()}-{time.monotonic_ns()}"
    try:
        for version in (b"A", b"B"):
            if fsspec.filesystem("memory").exists(url.removeprefix("memory://")):
                fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
            with DatasetWriter(url, max_samples=4) as w:
                for i in range(8):
                    w.write({"__key__": f"k{i:03d}", "txt": version * 10})
            ds = StreamingDataset(url, storage=StorageConfig(cache_dir=str(tmp_path)))
            assert [s["txt"] for s in ds] == [version * 10] * 8
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_a_download_longer_than_the_manifest_says_stops_at_the_reservation(tmp_path: Path) -> None:
    """The part file never outgrows the bytes reserved for it (the cache limit holds
    during the download, not only at the size check after it)."""
    import fsspec

    url = f"memory://streamload-longer-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with DatasetWriter(url, max_samples=4) as w:
            for i in range(8):
                w.write({"__key__": f"k{i:03d}", "txt": b"x" * 10})
        ds = StreamingDataset(url, storage=StorageConfig(cache_dir=str(tmp_path)))
        shard = ds.manifest.shards[0].name
        fs = fsspec.filesystem("memory")
        path = f"{url.removeprefix('memory://')}/{shard}"
        fs.pipe_file(path, fs.cat_file(path) + b"\0" * 512)
        with pytest.raises(CorruptShardError, match="longer than"):
            list(ds)
        ds._get_storages()[0].close()  # joins the read-ahead of the next shards
        cache_root = next(p for p in tmp_path.iterdir() if p.is_dir())
        assert not (cache_root / "data" / shard).exists() and os.listdir(cache_root / "tmp") == []
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


# -- retries -----------------------------------------------------------------------------


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def test_transient_and_permanent_errors_are_told_apart() -> None:
    from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

    assert is_transient(ConnectionRefusedError(111, "Connection refused"))
    assert is_transient(ConnectionResetError(104, "Connection reset by peer"))
    assert is_transient(TimeoutError("timed out"))
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(_client_error(503, "SlowDown"))
    assert is_transient(_client_error(500, "InternalError"))
    assert is_transient(OSError("An error occurred (ServiceUnavailable) when calling GetObject"))
    assert not is_transient(FileNotFoundError("bucket/key"))
    assert not is_transient(PermissionError("Forbidden"))
    assert not is_transient(_client_error(403, "AccessDenied"))
    assert not is_transient(_client_error(404, "NoSuchKey"))
    assert not is_transient(ValueError("bad argument"))


def test_retry_call_rides_out_transient_errors_and_stops_at_permanent_ones() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError(104, "Connection reset by peer")
        return "ok"

    policy = RetryPolicy(timeout=30, initial_delay=0.01, max_delay=0.05)
    assert retry_call(flaky, policy, "GET x") == "ok" and len(calls) == 4

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("x")

    calls.clear()
    with pytest.raises(FileNotFoundError):
        retry_call(missing, policy, "GET x")
    assert len(calls) == 1

    def down() -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(ConnectionRefusedError) as info:
        retry_call(down, RetryPolicy(timeout=0.2, initial_delay=0.01, max_delay=0.05), "GET x")
    assert "gave up after" in " ".join(info.value.__notes__)


def test_default_policy_outlasts_a_thirty_second_outage() -> None:
    policy = RetryPolicy()
    assert policy.timeout >= 30
    # The worst case of the waits before the budget is spent is also well past 30 s.
    elapsed, attempt = 0.0, 0
    while elapsed + policy.max_delay <= policy.timeout:
        elapsed += policy.delay(attempt)
        attempt += 1
    assert elapsed >= 30


# -- fsspec URLs without a server ------------------------------------------------------


@pytest.fixture
def memory_dataset() -> Iterator[str]:
    import fsspec

    url = f"memory://streamload-test-{os.getpid()}-{time.monotonic_ns()}"
    with without_lock_settle(), DatasetWriter(url, max_samples=5) as w:
        for i in range(23):
            w.write({"__key__": f"k{i:03d}", "txt": f"sample {i}".encode()})
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_memory_url_round_trip_and_second_epoch_from_cache(memory_dataset: str, tmp_path: Path) -> None:
    ds = StreamingDataset(memory_dataset, storage=StorageConfig(cache_dir=str(tmp_path)))
    first = [s["txt"] for s in ds]
    assert first == [f"sample {i}".encode() for i in range(23)]
    storage = ds._get_storages()[0]
    storage.close()  # joins read-ahead still finishing the first epoch's downloads
    downloads = storage.stats.downloads  # type: ignore[attr-defined]
    assert [s["txt"] for s in ds] == first
    assert storage.stats.downloads == downloads  # type: ignore[attr-defined]


def test_a_file_pinned_by_another_threads_early_download_is_acquired_once_cached(
    memory_dataset: str, tmp_path: Path
) -> None:
    """Two readers of one process (a Loader's threads) want one shard: the first reads its
    download as it lands, the second acquires the whole file and gets its path once it is
    cached, not before (its open would find no file)."""
    ds = StreamingDataset(memory_dataset, storage=StorageConfig(cache_dir=str(tmp_path), read_ahead=0))
    storage = ds._get_storages()[0]
    entry = ds.manifest.shards[0]
    filler = storage._filler  # type: ignore[attr-defined]
    fill = filler.fill

    def slow_fill(*args: object, **kwargs: object) -> str:
        time.sleep(0.5)  # the download is still landing when the second reader asks
        return fill(*args, **kwargs)  # type: ignore[no-any-return]

    filler.fill = slow_fill
    try:
        landing = storage.open_bytes(entry, early=True)
        path = storage.acquire(entry)
        assert os.path.exists(path) and os.path.getsize(path) == entry.num_bytes
        assert landing.pread(entry.num_bytes, 0) == Path(path).read_bytes()
        landing.close()
        storage.release(entry)
        storage.release(entry)
        with open(os.path.join(os.path.dirname(os.path.dirname(path)), "pins", entry.name), "rb") as pin:
            fcntl.flock(pin, fcntl.LOCK_EX | fcntl.LOCK_NB)  # both released: unpinned, evictable
    finally:
        filler.fill = fill
        storage.close()


def test_read_ahead_threads_end_when_the_iterator_is_closed_early(memory_dataset: str, tmp_path: Path) -> None:
    ds = StreamingDataset(memory_dataset, storage=StorageConfig(cache_dir=str(tmp_path)))
    it = iter(ds)
    next(it)
    it.close()  # type: ignore[attr-defined]
    ds._get_storages()[0].close()
    deadline = time.monotonic() + 30
    while any(t.name == "streamload-ahead" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "streamload-ahead"]


def test_cache_limit_too_small_is_a_clear_error(memory_dataset: str, tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="cache_limit=.* is too small"):
        StreamingDataset(memory_dataset, storage=StorageConfig(cache_dir=str(tmp_path), cache_limit=100))
    with pytest.raises(ConfigError, match="is not a byte size"):
        StreamingDataset(memory_dataset, storage=StorageConfig(cache_dir=str(tmp_path), cache_limit="lots"))


def test_missing_backend_package_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pip install 'streamload\[gcs\]'"):
        open_storage("gs://bucket/dataset", StorageConfig(cache_dir=str(tmp_path)).resolve())
    with pytest.raises(ConfigError, match="unknown protocol"):
        StorageConfig(cache_dir=str(tmp_path)).open("nosuchproto://bucket/dataset")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_http_url(tar_dataset: Path, tmp_path: Path) -> None:
    handler = functools.partial(_QuietHandler, directory=str(tar_dataset))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = StreamingDataset(url, storage=StorageConfig(cache_dir=str(tmp_path / "http-cache")))
        local = StreamingDataset(str(tar_dataset))
        assert list(remote) == list(local)
        with pytest.raises(FileNotFoundError, match=f"{url}/nothing/index.json"):
            StreamingDataset(f"{url}/nothing", storage=StorageConfig(cache_dir=str(tmp_path)))
    finally:
        server.shutdown()
        server.server_close()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_lock_held_while_forking_is_not_kept_by_the_child(tmp_path: Path) -> None:
    """A DataLoader forking its workers while a read-ahead thread holds a cache lock must
    not leave that lock held by the workers (flocks belong to the shared open file)."""
    cache = ShardCache(str(tmp_path), limit=10 * SIZE)
    with cache.folder.cache_lock():
        child = mp.get_context("fork").Process(target=_sleep, args=(30,))
        child.start()
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (cache.usage(), done.set()), daemon=True).start()
        assert done.wait(timeout=10), "the forked child still holds the cache lock"
        assert _fill(cache, "a", 1)  # and downloads go on
    finally:
        child.kill()
        child.join()


def test_a_pin_inherited_through_fork_closes_nothing_of_the_child(tmp_path: Path) -> None:
    """A storage in a forked worker drops the pins it inherited; their descriptor numbers
    may already name the child's own pins, which must keep holding."""
    cache = ShardCache(str(tmp_path), limit=None)
    inherited = cache.pin("a")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            own = cache.pin("b")  # likely the number the child's copy of "a" had
            inherited.close()
            probe = os.open(os.path.join(str(tmp_path), "pins", "b"), os.O_RDONLY)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                code = 2  # "b" is not pinned any more
            except BlockingIOError:
                code = 0
            own.close()
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    inherited.close()


def test_a_registration_inherited_through_fork_stays_the_parents(tmp_path: Path) -> None:
    """A forked worker closing what it inherited leaves its parent registered as a reader."""
    cache = ShardCache(str(tmp_path), limit=None)
    registration = cache.register()
    pid = os.fork()
    if pid == 0:
        try:
            registration.close()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert os.path.exists(registration.path) and cache.readers() == 1
    registration.close()
    assert cache.readers() == 0
