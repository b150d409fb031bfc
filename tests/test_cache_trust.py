"""The shard cache under other processes and other users: a stopped downloader, folders and files others can write.

A reader waiting for another process's download says so after a few seconds (the lock
and the holder's pid, a warning when the holder is stopped) and gives up after
``StorageConfig(lock_timeout=...)`` with a ``CacheError`` naming both. A folder of the
cache others can write (``data/`` at mode 777) is refused like the cache folder itself; a
cached file someone else could have written (mode 666, or another user's) is not served
but downloaded again. The dataset is served by a small loopback HTTP endpoint
(``tests/lying_server.py``, honest here).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamload import CacheError, ShardedDataset, StorageConfig, StreamingDataset
from streamload.storage.bytes import Landing
from streamload.storage.cachedir import dataset_cache_key
from streamload.storage.remote import RemoteStorage
from tests.lying_server import LyingServer


@pytest.fixture(scope="module")
def served(tar_dataset: Path) -> Iterator[tuple[LyingServer, str]]:
    server = LyingServer({f"/ds/{p.name}": p.read_bytes() for p in tar_dataset.iterdir()})
    yield server, f"{server.url}/ds"
    server.stop()


def _keys(ds: StreamingDataset) -> list[str]:
    return sorted(s["__key__"] for s in ds)


def _cache_of(url: str, cache_dir: Path) -> Path:
    return cache_dir / dataset_cache_key(url, {})


def test_a_reader_behind_a_stopped_downloader_says_who_and_gives_up_after_lock_timeout(
    served: tuple[LyingServer, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, url = served
    storage = StorageConfig(cache="shards", cache_dir=str(tmp_path), lock_timeout=2, read_ahead=0)
    ds = StreamingDataset(url, storage=storage)
    lock = _cache_of(url, tmp_path) / "downloads" / ds.manifest.shards[0].name
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)  # a downloader stopped mid-download (Ctrl-Z, a debugger)
        with caplog.at_level(logging.INFO, logger="streamload"), pytest.raises(CacheError) as caught:
            next(iter(ds))
    finally:
        holder.kill()
        holder.wait()
    assert str(lock) in str(caught.value) and f"pid {holder.pid}" in str(caught.value)
    assert "after 2 s" in str(caught.value)
    notes = [r for r in caplog.records if str(lock) in r.getMessage()]
    assert len(notes) == 1, [r.getMessage() for r in caplog.records]  # once, before giving up
    assert notes[0].levelno == logging.WARNING and f"pid {holder.pid} (stopped)" in notes[0].getMessage()


def test_a_cache_folder_others_can_write_is_refused(served: tuple[LyingServer, str], tmp_path: Path) -> None:
    _, url = served
    storage = StorageConfig(cache="shards", cache_dir=str(tmp_path), read_ahead=0)
    expected = _keys(StreamingDataset(url, storage=storage))
    data = _cache_of(url, tmp_path) / "data"
    data.chmod(0o777)
    with pytest.raises(CacheError, match="writable by every user") as caught:
        _keys(StreamingDataset(url, storage=storage))
    assert str(data) in str(caught.value)
    data.chmod(0o755)
    assert _keys(StreamingDataset(url, storage=storage)) == expected


def test_a_cached_file_others_could_write_is_downloaded_again(served: tuple[LyingServer, str], tmp_path: Path) -> None:
    server, url = served
    storage = StorageConfig(cache="shards", cache_dir=str(tmp_path), read_ahead=0)
    expected = _keys(StreamingDataset(url, storage=storage))
    name = StreamingDataset(url, storage=storage).manifest.shards[1].name
    cached = _cache_of(url, tmp_path) / "data" / name
    suspects = [0o666]
    if os.geteuid() == 0:
        suspects.append(-1)  # another user's file, not writable by others: still not ours
    for mode in suspects:
        if mode == -1:
            os.chown(cached, 4242, 4242)
            cached.chmod(0o644)
        else:
            cached.chmod(mode)
        before = len(server.seen("GET", f"/ds/{name}"))
        assert _keys(StreamingDataset(url, storage=storage)) == expected
        assert len(server.seen("GET", f"/ds/{name}")) == before + 1, "the suspect copy was served"
        st = cached.stat()
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o644


def _key_file(cache_dir: Path) -> Path:
    (found,) = (cache_dir / "keys").glob("*.npy")
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("shared", [False, True])
def test_a_key_index_someone_else_could_have_written_is_rebuilt(
    served: tuple[LyingServer, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """The cache's rule holds for the key index: never a file every user can write, nor (unless shared) another's."""
    _, url = served
    if shared:
        monkeypatch.setenv("STREAMLOAD_CACHE_SHARED", "1")
    storage = StorageConfig(cache_dir=str(tmp_path))
    ds = ShardedDataset(url, storage=storage)
    key = ds.key_of(7)
    assert ds.index_of(key) == 7
    planted = _key_file(tmp_path)
    owner = 4242 if shared else os.geteuid()  # another user's in a shared cache; ours otherwise
    os.chown(planted, owner, owner)
    planted.chmod(0o666)
    ds = ShardedDataset(url, storage=storage)
    assert ds.index_of(key) == 7
    kept = _key_file(tmp_path).stat()
    assert kept.st_uid == os.geteuid() and kept.st_mode & 0o777 == 0o644, "the planted index was used"


def test_a_key_index_folder_every_user_can_write_is_not_used(
    served: tuple[LyingServer, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, url = served
    storage = StorageConfig(cache_dir=str(tmp_path))
    ds = ShardedDataset(url, storage=storage)
    key = ds.key_of(3)
    ds.index_of(key)
    (tmp_path / "keys").chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        ds = ShardedDataset(url, storage=storage)
        assert ds.index_of(key) == 3
    assert "writable by every user" in caplog.text and "stays in memory" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_download_in_progress_is_not_read_early(served: tuple[LyingServer, str], tmp_path: Path) -> None:
    """A reader follows another process's download (shown in ``landing/``) only from a trusted part file."""
    _, url = served
    storage = RemoteStorage(url, StorageConfig(cache_dir=str(tmp_path)).resolve())
    entry = StreamingDataset(url, storage=StorageConfig(cache_dir=str(tmp_path))).manifest.shards[0]
    for owner, mode, followed in [(os.geteuid(), 0o644, True), (4242, 0o644, False), (os.geteuid(), 0o666, False)]:
        part = Path(storage.cache_root) / "tmp" / f"{entry.name}.{owner}-{mode:o}.part"
        part.write_bytes(bytes(entry.num_bytes))
        os.chown(part, owner, owner)
        part.chmod(mode)
        storage.cache.publish_landing(entry.name, str(part), 1, [(0, entry.num_bytes)])
        landing = Landing(entry.name, entry.num_bytes, lambda start, end: b"")
        storage._filler._follower(entry, landing)()
        assert (landing.attempts == 1) == followed, (owner, oct(mode))
        landing.fail(CacheError("the test's download ends here"))
        landing.close()
