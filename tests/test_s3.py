"""Training from a bucket, against a real S3 server (SeaweedFS on loopback; tests/s3server.py).

One server for the session; one dataset (96 samples, 12 tar shards) converted straight
into a bucket by the CLI, read back every way a trainer reads it.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from streamload import StorageConfig, StreamingDataset
from streamload._errors import (
    CacheError,
    CorruptShardError,
    ManifestNotFoundError,
    ShardNotFoundError,
    StorageError,
)
from streamload.cli import main
from streamload.converters import path_to_key
from streamload.storage.remote import RemoteStorage
from streamload.synthetic import make_image_folder
from tests.conftest import expected_samples
from tests.s3server import SeaweedS3
from tests.shaping import ShapedS3

# Generous for a loaded machine (the first test also starts the server: at most 90 s),
# yet every wait inside is bounded well below it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SHARDS = 12
PER_SHARD = 8


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache directory (used where a test passes none) is a temporary one."""
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default-cache"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("s3-images")
    make_image_folder(str(root), num_classes=4, per_class=SHARDS * PER_SHARD // 4, size=(32, 24), seed=5)
    return root


@pytest.fixture(scope="module")
def bucket_dataset(s3_server: SeaweedS3, folder: Path) -> str:  # noqa: F811
    """The image folder converted by ``streamload convert`` straight into a bucket."""
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/train"
    args = ["convert", str(folder), url, "--samples-per-shard", str(PER_SHARD), "--no-progress", "-j", "2"]
    assert main([*args, *s3_server.cli_options()]) == 0
    return url


@pytest.fixture(params=["loopback", "shaped"])
def endpoint(request: pytest.FixtureRequest, s3_server: SeaweedS3) -> SeaweedS3 | ShapedS3:
    """The test server as it is (loopback: a millisecond, GB/s) and as a far bucket (50 ms, 40 MB/s)."""
    if request.param == "shaped":
        shaped: ShapedS3 = request.getfixturevalue("shaped_s3")
        return shaped
    return s3_server


def _expected_keys(folder: Path) -> dict[str, bytes]:
    return {path_to_key(rel): data for rel, (data, _label) in expected_samples(folder).items()}


def _gets(server: SeaweedS3 | Any) -> float:
    """GET requests the S3 gateway answered so far (all buckets, all status codes)."""
    metrics = server.metrics().items()
    return sum(v for k, v in metrics if k.startswith("SeaweedFS_s3_request_total") and 'type="GET"' in k)


def test_convert_into_bucket_uploads_shards_and_manifest(s3_server: SeaweedS3, bucket_dataset: str) -> None:  # noqa: F811
    fs = s3_server.filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(bucket_dataset[len("s3://") :], detail=False))
    shards = [f"shard-{i:06d}.tar" for i in range(SHARDS)]
    assert names == sorted(["index.json", *shards, *(s + ".idx" for s in shards)])


def test_info_verify_on_url(
    s3_server: SeaweedS3,
    bucket_dataset: str,
    tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "cache"))
    assert main(["info", bucket_dataset, "--json", *s3_server.cli_options()]) == 0
    assert f'"num_samples": {SHARDS * PER_SHARD}' in capsys.readouterr().out
    assert main(["verify", bucket_dataset, *s3_server.cli_options()]) == 0
    assert f"OK: {SHARDS} shards, {SHARDS * PER_SHARD} samples" in capsys.readouterr().out


def test_read_back_bytes_equal_the_source(
    endpoint: SeaweedS3 | ShapedS3,
    bucket_dataset: str,
    folder: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    ds = StreamingDataset(
        bucket_dataset, storage=StorageConfig(storage_options=endpoint.storage_options(), cache_dir=str(tmp_path))
    )
    got = {s["__key__"]: s["jpg"] for s in ds}
    assert got == _expected_keys(folder)


def _read_rank(
    url: str, options: dict[str, Any], cache: str, rank: int, out: dict[int, list[str]], errors: list[BaseException]
) -> None:
    try:
        ds = StreamingDataset(
            url, storage=StorageConfig(storage_options=options, cache_dir=cache), rank=rank, world_size=2
        )
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        out[rank] = [s["__key__"] for s in loader]
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_two_ranks_two_workers_share_one_cache(
    endpoint: SeaweedS3 | ShapedS3,
    s3_server: SeaweedS3,
    bucket_dataset: str,
    folder: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cache = str(tmp_path / "shared-cache")
    before = _gets(s3_server)
    out: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    options = endpoint.storage_options()
    threads = [
        threading.Thread(target=_read_rank, args=(bucket_dataset, options, cache, r, out, errors)) for r in (0, 1)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "the readers did not finish in 120 s"
    assert not errors, errors
    assert len(out[0]) == len(out[1]) == SHARDS * PER_SHARD // 2
    assert Counter(out[0] + out[1]) == Counter(_expected_keys(folder).keys())
    # One cache for the four readers: each shard and sidecar was downloaded once, by one of them.
    data = sorted(os.listdir(Path(cache, os.listdir(cache)[0], "data")))
    assert len(data) == 2 * SHARDS
    # One download per file per node: every shard and sidecar once, plus each rank's manifest read.
    downloads = _gets(s3_server) - before
    assert downloads <= 2 * SHARDS + 2 + 2, f"{downloads} GETs for {2 * SHARDS} files"  # (+2: a retried GET)


def _cache_data(root: Path) -> tuple[int, list[str]]:
    """Bytes the cache limit bounds: files in ``data/`` and downloads in ``tmp/``.

    Not the zero-byte lock and pin files, nor the small ``meta/`` records of what each
    data file was verified against: the limit bounds cached data (see ShardCache).
    Returns the total and the files counted (for the failure message).
    """
    total, seen = 0, []
    for dataset in root.iterdir():
        for sub in ("data", "tmp"):
            try:
                names = os.listdir(dataset / sub)
            except FileNotFoundError:
                continue
            for name in names:
                try:
                    size = os.stat(dataset / sub / name).st_size
                except FileNotFoundError:
                    continue
                total += size
                seen.append(f"{sub}/{name}={size}")
    return total, seen


def _sample_cache(root: str, lock_path: str, stop: Any, peak: Any, count: Any, where: Any) -> None:
    """Measure the cache's data every few milliseconds until ``stop`` is set.

    Under the cache's own lock (the one its writers take to reserve, evict and rename),
    so a file being renamed from tmp/ to data/ is not counted twice. Runs in a spawned
    process: a lock held by a thread of the test process would be inherited, and held
    forever, by the DataLoader workers it forks. ``where`` gets the listing at the peak.
    """
    while not stop.is_set():
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            size, seen = _cache_data(Path(root))
        if size > peak.value:
            peak.value = size
            where.value = " ".join(sorted(seen)).encode()[:4000]
        count.value += 1
        time.sleep(0.002)


class _Sampler:
    """A spawned process measuring the one dataset cache under ``root``."""

    def __init__(self, root: Path) -> None:
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._peak = ctx.Value("q", 0)
        self._count = ctx.Value("q", 0)
        self._where = ctx.Array("c", 4001)
        (lock_path,) = (d / ".lock" for d in root.iterdir())
        self._proc = ctx.Process(
            target=_sample_cache,
            daemon=True,
            args=(str(root), str(lock_path), self._stop, self._peak, self._count, self._where),
        )

    @property
    def at_peak(self) -> str:
        """The files counted when the peak was measured."""
        return bytes(self._where.value).decode()

    @property
    def peak(self) -> int:
        return int(self._peak.value)

    @property
    def samples(self) -> int:
        return int(self._count.value)

    def __enter__(self) -> _Sampler:
        self._proc.start()
        deadline = time.monotonic() + 60  # a spawned interpreter, on a loaded machine
        while self.samples == 0 and time.monotonic() < deadline and self._proc.is_alive():
            time.sleep(0.05)
        assert self.samples > 0, "the cache sampler did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)


def _largest(url: str, options: dict[str, Any]) -> int:
    ds = StreamingDataset(url, storage=StorageConfig(storage_options=options, cache_dir=None))
    return max(s.num_bytes + (s.sidecar.num_bytes if s.sidecar else 0) for s in ds.manifest.shards)


def test_cache_limit_of_three_shards_is_never_exceeded(
    s3_server: SeaweedS3,
    bucket_dataset: str,  # noqa: F811
    folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default"))
    options = s3_server.storage_options()
    limit = 3 * _largest(bucket_dataset, options)
    cache = tmp_path / "small-cache"
    ds = StreamingDataset(  # whole shards cached (cache="auto" would stream: the window spans 12 shards)
        bucket_dataset,
        storage=StorageConfig(storage_options=options, cache_dir=str(cache), cache_limit=limit, cache="shards"),
        shuffle=True,
        seed=3,
    )
    before = _gets(s3_server)
    with _Sampler(cache) as sampler:
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        keys = [s["__key__"] for s in loader]
    assert Counter(keys) == Counter(_expected_keys(folder).keys())
    assert sampler.samples > 10
    assert 0 < sampler.peak <= limit, f"{sampler.peak} > {limit}: {sampler.at_peak}"
    # The whole dataset does not fit: shards were evicted and every one was downloaded.
    assert len(os.listdir(next(cache.iterdir()) / "data")) <= 2 * 3
    assert _gets(s3_server) - before >= 2 * SHARDS


def test_cache_limit_below_two_shards_fails_at_start(
    s3_server: SeaweedS3,
    bucket_dataset: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    options = s3_server.storage_options()
    limit = _largest(bucket_dataset, options) + 1
    with pytest.raises(CacheError, match="cache_limit=.*too small"):  # cache="auto" would stream instead
        StreamingDataset(
            bucket_dataset,
            storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path), cache_limit=limit, cache="shards"),
        )


def test_second_epoch_is_served_from_the_cache(
    shaped_s3: ShapedS3,
    s3_server: SeaweedS3,
    bucket_dataset: str,  # noqa: F811
    folder: Path,
    tmp_path: Path,
) -> None:
    ds = StreamingDataset(
        bucket_dataset,
        storage=StorageConfig(
            storage_options=shaped_s3.storage_options(), cache_dir=str(tmp_path), cache_limit="100MB"
        ),
        shuffle=True,
    )
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    first = [s["__key__"] for s in loader]
    before = _gets(s3_server)
    second = [s["__key__"] for s in loader]
    assert _gets(s3_server) == before  # not one GET: every shard came from the local cache
    assert Counter(first) == Counter(second) == Counter(_expected_keys(folder).keys())
    assert first != second  # a new epoch (reshuffled), not a replay


def test_missing_shard_names_the_url(s3_server: SeaweedS3, folder: Path, tmp_path: Path) -> None:  # noqa: F811
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/ds"
    assert (
        main(["convert", str(folder), url, "--samples-per-shard", "48", "--no-progress", *s3_server.cli_options()]) == 0
    )
    s3_server.filesystem().rm_file(f"{bucket}/ds/shard-000001.tar")
    ds = StreamingDataset(
        url, storage=StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path))
    )
    started = time.monotonic()
    with pytest.raises(ShardNotFoundError, match=f"{url}/shard-000001.tar"):
        list(ds)
    assert time.monotonic() - started < 60  # permanent: not retried for the 120 s budget
    with pytest.raises(ManifestNotFoundError, match=f"s3://{bucket}/nothing-here/index.json"):
        StreamingDataset(
            f"s3://{bucket}/nothing-here", storage=StorageConfig(storage_options=s3_server.storage_options())
        )


def test_bad_credentials_fail_at_once_with_the_url(
    s3_server: SeaweedS3,
    bucket_dataset: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = s3_server.storage_options(secret="not-the-secret")
    with pytest.raises(StorageError, match=f"{bucket_dataset}/index.json.*access denied") as info:
        StreamingDataset(bucket_dataset, storage=StorageConfig(storage_options=bad, cache_dir=str(tmp_path)))
    assert isinstance(info.value.__cause__, PermissionError)
    assert main(["info", bucket_dataset, *s3_server.cli_options(secret="wrong")]) == 2
    assert "access denied" in capsys.readouterr().err


def _restart_when_stalled(
    gateway: Any, last_sample: list[float], stalled: list[float], errors: list[BaseException]
) -> None:
    """Bring the gateway back after at least 4 s, once the reader has waited 1 s for a sample.

    The second condition makes the outage deterministic: the readers' cached shards are
    used up and they are retrying against the dead endpoint when it comes back (the test
    checks it). Every wait is bounded; an error is the test's, not lost in this thread.
    """
    try:
        time.sleep(4)
        deadline = time.monotonic() + 60
        while time.monotonic() - last_sample[0] < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        stalled.append(time.monotonic() - last_sample[0])
        gateway.start(timeout=60)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_outage_mid_epoch_loses_and_repeats_nothing(
    s3_server: SeaweedS3,
    bucket_dataset: str,  # noqa: F811
    folder: Path,
    tmp_path: Path,
) -> None:
    """The S3 service crashes (SIGKILL) mid-epoch and comes back 4+ s later on the same port.

    The reader keeps reading while the service is down, and blocks once its cached shards
    are used up; the gateway restarts only then. A failed restart is reported by the test,
    and the DataLoader's timeout bounds the wait for a sample (the readers' retry budget,
    120 s, is not what ends a broken run).
    """
    gateway = s3_server.new_gateway()
    gateway.start()
    restarter: threading.Thread | None = None
    try:
        options = s3_server.storage_options(client_kwargs={"endpoint_url": gateway.endpoint_url})
        limit = 3 * _largest(bucket_dataset, options)
        ds = StreamingDataset(
            bucket_dataset, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path), cache_limit=limit)
        )
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=90)
        keys: list[str] = []
        last_sample = [time.monotonic()]
        stalled: list[float] = []
        errors: list[BaseException] = []
        for sample in loader:
            last_sample[0] = time.monotonic()
            keys.append(sample["__key__"])
            if len(keys) == 20:  # a quarter through: most shards are still remote
                gateway.kill()
                restarter = threading.Thread(
                    target=_restart_when_stalled, args=(gateway, last_sample, stalled, errors), daemon=True
                )
                restarter.start()
        assert restarter is not None
        restarter.join(timeout=130)
        assert not restarter.is_alive() and not errors, errors
        assert stalled and stalled[0] >= 1.0  # the reader did wait on the dead service
        assert Counter(keys) == Counter(_expected_keys(folder).keys())
        assert _gets(gateway) >= 3  # shards were fetched from the restarted server
    finally:
        if restarter is not None:
            restarter.join(timeout=130)
        gateway.stop()


def test_index_tar_shards_in_a_bucket(s3_server: SeaweedS3, tar_dataset: Path, tmp_path: Path) -> None:  # noqa: F811
    bucket = s3_server.make_bucket()
    fs = s3_server.filesystem()
    shards = sorted(p for p in tar_dataset.iterdir() if p.suffix == ".tar")
    for path in shards:
        fs.put_file(str(path), f"{bucket}/foreign/{path.name}")
    url = f"s3://{bucket}/foreign"
    assert main(["index", url, *s3_server.cli_options()]) == 0
    local = StreamingDataset(str(tar_dataset))
    remote = StreamingDataset(
        url, storage=StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path))
    )
    assert [s["__key__"] for s in remote] == [s["__key__"] for s in local]


def test_storage_pickles_and_reopens_in_a_child(
    s3_server: SeaweedS3,
    bucket_dataset: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    storage = RemoteStorage(
        bucket_dataset, StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path)).resolve()
    )
    ds = StreamingDataset(
        bucket_dataset, storage=StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path))
    )
    entry = ds.manifest.shards[0]
    storage.acquire(entry)  # the parent holds a pin and a live filesystem
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    assert len([s for s in loader]) == SHARDS * PER_SHARD
    storage.release(entry)
    storage.close()
    assert storage.stats.downloads == 1


def test_a_replaced_object_fails_verification_with_its_url(
    s3_server: SeaweedS3,
    folder: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/ds"
    assert (
        main(["convert", str(folder), url, "--samples-per-shard", "48", "--no-progress", *s3_server.cli_options()]) == 0
    )
    fs = s3_server.filesystem()
    key = f"{bucket}/ds/shard-000000.tar"
    data = bytearray(fs.cat_file(key))
    data[1000] ^= 0xFF  # same size, different bytes
    fs.pipe_file(key, bytes(data))
    ds = StreamingDataset(
        url, storage=StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path))
    )
    with pytest.raises(CorruptShardError, match=f"{url}/shard-000000.tar: .*xxh3_128"):
        list(ds)
    assert not list((next(tmp_path.iterdir()) / "data").glob("shard-000000.tar"))  # never cached


def test_a_failed_conversion_into_a_bucket_publishes_no_manifest(
    s3_server: SeaweedS3,
    folder: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "class_002" / "zz-broken.jpg").write_bytes(b"not a jpeg at all")
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/ds"
    assert (
        main(["convert", str(broken), url, "--samples-per-shard", "16", "--no-progress", *s3_server.cli_options()]) == 2
    )
    names = [p.rsplit("/", 1)[-1] for p in s3_server.filesystem().find(bucket)]
    assert "index.json" not in names
    assert (
        main(
            [
                "convert",
                str(broken),
                url,
                "--samples-per-shard",
                "16",
                "--no-progress",
                "--on-error",
                "skip",
                "--overwrite",
                *s3_server.cli_options(),
            ]
        )
        == 0
    )
    ds = StreamingDataset(
        url, storage=StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path / "c"))
    )
    assert len(ds.manifest.skipped) == 1 and ds.num_samples == SHARDS * PER_SHARD
