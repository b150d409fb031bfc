"""A faulty path to the bucket: every fault ridden out in both modes, or a clear error naming the shard.

Through the fault proxy (tests/faults.py) in front of the test S3 server: connection
resets and bodies cut short mid-object, a 503 SlowDown storm, a stall, a throttling
burst, a few bytes flipped in one response. Each is injected into an epoch read by a
DataLoader with 2 workers, cached (``cache="shards"``) and streaming (``cache="none"``):
every sample must come once with its bytes. A shard corrupt at its source ends in a
``CorruptShardError`` naming it; a download that fails for good leaves no half file in
the cache, and neither does a reader killed mid-download.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from streamload import DatasetWriter, StorageConfig, StreamingDataset
from streamload._errors import CorruptShardError, StorageError
from streamload._files import FileEntry
from streamload.storage.remote import RemoteStorage
from streamload.storage.retry import RetryPolicy
from tests.faults import Fault, FaultyS3
from tests.s3server import SeaweedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SHARDS = 4
PER_SHARD = 30
TOTAL = SHARDS * PER_SHARD
MODES = ["shards", "none"]


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 12_000 + 97 * (i % 40), dtype=np.uint8).tobytes()


def _expected() -> dict[str, bytes]:
    return {f"s{i:04d}": _payload(i) for i in range(TOTAL)}


def _write(url: str, options: dict[str, Any]) -> None:
    with DatasetWriter(url, format="tar", max_samples=PER_SHARD, storage_options=options) as writer:
        for key, data in _expected().items():
            writer.write({"__key__": key, "bin": data, "cls": b"1"})


@pytest.fixture(scope="module")
def dataset(s3_server: SeaweedS3) -> str:
    url = f"s3://{s3_server.make_bucket()}/faults"
    _write(url, s3_server.storage_options())
    return url


def _options(faulty: FaultyS3) -> dict[str, Any]:
    """botocore retries nothing itself (its backoff is up to seconds per try): streamload's retries ride faults out."""
    return faulty.storage_options(config_kwargs={"retries": {"max_attempts": 1}})


def _read(
    url: str, faulty: FaultyS3, cache_dir: Path, mode: str, read_ahead: int | None = None, **kwargs: Any
) -> list[tuple[str, bytes]]:
    options = _options(faulty)
    storage = StorageConfig(storage_options=options, cache_dir=str(cache_dir), cache=mode, read_ahead=read_ahead)
    ds = StreamingDataset(url, storage=storage, **kwargs)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=90)
    return [(s["__key__"], s["bin"]) for s in loader]


def _check_every_sample_once(got: list[tuple[str, bytes]]) -> None:
    keys = [key for key, _ in got]
    assert len(keys) == len(set(keys)) == TOTAL
    expected = _expected()
    wrong = [key for key, data in got if data != expected[key]]
    assert not wrong, f"wrong bytes for {wrong[:5]}"


FAULTS: dict[str, list[Fault]] = {
    "resets": [Fault("reset", match=".tar", at=40_000, times=3)],
    "truncated-bodies": [Fault("truncate", match=".tar", at=60_000, times=3)],
    "slowdown-storm": [Fault("status", match="", times=6, code="SlowDown")],
    "stall": [Fault("stall", match=".tar", at=30_000, seconds=2.5)],
    "throttling-burst": [Fault("status", match=".tar", times=20, status=429, code="TooManyRequests")],
    "flipped-bytes": [Fault("flip", match=".tar", at=25_000, count=3)],
    "flipped-sidecar": [Fault("flip", match=".idx", at=100, count=2)],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FAULTS))
def test_every_fault_is_ridden_out(faulty_s3: FaultyS3, dataset: str, tmp_path: Path, name: str, mode: str) -> None:
    """Each fault in an epoch of 2 workers: every sample once with its bytes, and the fault did happen."""
    faults = faulty_s3.inject(*(replace(f) for f in FAULTS[name]))  # fresh counters
    # Without read-ahead every download is a reader's own (a read-ahead that fails is only logged).
    ahead = 0 if name.startswith("flipped") else None
    got = _read(dataset, faulty_s3, tmp_path, mode, ahead, shuffle=True, seed=3)
    assert all(f.hits >= 1 for f in faults), [(f.kind, f.hits) for f in faults]
    _check_every_sample_once(got)


@pytest.mark.parametrize("mode", MODES)
def test_a_shard_corrupt_at_its_source_names_it(
    s3_server: SeaweedS3, faulty_s3: FaultyS3, tmp_path: Path, mode: str
) -> None:
    """Same-size garbage in one sample of the object: both modes end in a CorruptShardError naming the shard."""
    url = f"s3://{s3_server.make_bucket()}/bad-at-source"
    _write(url, s3_server.storage_options())
    fs = s3_server.filesystem()
    path = url.removeprefix("s3://") + "/shard-000001.tar"
    raw = bytearray(fs.cat_file(path))
    at = raw.find(_payload(PER_SHARD + 5))
    assert at > 0
    raw[at + 100 : at + 110] = bytes(10)
    fs.pipe_file(path, bytes(raw))
    with pytest.raises(Exception, match=rf"{url}/shard-000001\.tar.*bad at its source") as info:
        _read(url, faulty_s3, tmp_path, mode)
    assert "CorruptShardError" in str(info.value) or isinstance(info.value, CorruptShardError)
    # The traceback holds this frame, which holds it: a cycle that keeps the DataLoader's iterator
    # (and waits 5 s per worker when the collector frees it later, in another test). Let it go now.
    del info


def _shard_entry(url: str, faulty: FaultyS3, shard: int) -> FileEntry:
    ds = StreamingDataset(url, storage=StorageConfig(storage_options=faulty.storage_options(), cache="shards"))
    return ds.manifest.shards[shard]


def _cache_files(root: str, sub: str) -> list[str]:
    return sorted(os.listdir(os.path.join(root, sub)))


def test_a_part_that_fails_its_retries_fails_the_read_and_leaves_no_half_file(
    faulty_s3: FaultyS3, dataset: str, tmp_path: Path
) -> None:
    """The GETs of a shard's parts answer 500 past the retry budget: the acquire fails naming the URL and the
    outage; no part file or half shard stays in the cache, and the next acquire downloads the shard."""
    entry = _shard_entry(dataset, faulty_s3, 2)
    storage = RemoteStorage(
        dataset,
        StorageConfig(storage_options=_options(faulty_s3), cache_dir=str(tmp_path), read_ahead=0).resolve(),
        retry=RetryPolicy(timeout=1.0, initial_delay=0.05, max_delay=0.2),
    )
    storage._remote.planner.part_size = 64 << 10  # several parts: one fails, the others must stop
    outage = Fault("status", match=entry.name, ranged=True, skip=2, times=10**6, status=500, code="InternalError")
    fault = faulty_s3.inject(outage)[0]
    try:
        with pytest.raises(StorageError, match=rf"{dataset}/{entry.name}.*unavailable"):
            storage.acquire(entry)
        assert fault.hits >= 1
        assert _cache_files(storage.cache_root, "tmp") == []
        assert entry.name not in _cache_files(storage.cache_root, "data")
        faulty_s3.proxy.clear()
        path = storage.acquire(entry)  # the next read downloads it whole
        assert os.path.getsize(path) == entry.num_bytes
        storage.release(entry)
    finally:
        storage.close()


_DOWNLOADER = textwrap.dedent(
    """
    import sys, json
    from streamload import StorageConfig, StreamingDataset
    url, cache_dir, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    storage = StorageConfig(storage_options=options, cache_dir=cache_dir, cache="shards", read_ahead=0)
    for sample in StreamingDataset(url, storage=storage):
        pass
    """
)


def test_a_reader_killed_mid_download_leaves_a_cache_the_next_run_repairs(
    faulty_s3: FaultyS3, dataset: str, tmp_path: Path
) -> None:
    """SIGKILL while the first shard's download is stalled half-way: the next run reads everything right."""
    import json

    fault = faulty_s3.inject(Fault("stall", match="shard-000000.tar", at=50_000, seconds=60))[0]
    options = faulty_s3.storage_options()
    proc = subprocess.Popen([sys.executable, "-c", _DOWNLOADER, dataset, str(tmp_path), json.dumps(options)])
    try:
        deadline = time.monotonic() + 60
        while fault.hits == 0 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert fault.hits == 1
        (root,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        assert _cache_files(str(root), "tmp"), "the download in progress has its part file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    faulty_s3.proxy.clear()
    got = _read(dataset, faulty_s3, tmp_path, "shards")
    _check_every_sample_once(got)
    assert _cache_files(str(root), "tmp") == []
    assert {f"shard-{i:06d}.tar" for i in range(SHARDS)} <= set(_cache_files(str(root), "data"))
