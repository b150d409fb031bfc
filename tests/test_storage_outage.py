"""An outage is never a skip: a bucket that stops answering is an error naming its status, under on_error="skip" too.

``on_error="skip"`` is for a shard whose bytes are bad (its digest, its structure): that
shard is counted, named and stood in for. A storage that starts answering 401/403 (its
credentials expired or were revoked), 5xx past the retry budget, or goes away, is not
about one shard: every remaining shard would be "skipped" and the epoch filled with one
repeated sample. Such a failure raises a :class:`~streamload.StorageError` naming the
status and the shard's URL, in both read modes, over HTTP (a loopback server that fails
on cue, ``tests/lying_server.py``) and S3 (the SeaweedFS test server behind the fault
proxy, ``tests/faults.py``). Only a 404 is "does not exist".
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamload import DatasetWriter, ShardNotFoundError, StorageConfig, StorageError, StreamingDataset
from tests.faults import Fault, FaultyS3
from tests.lying_server import LyingServer
from tests.s3server import SeaweedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SHARDS = 16
PER_SHARD = 8
TOTAL = SHARDS * PER_SHARD
MODES = ["shards", "none"]


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 3000 + 37 * i, dtype=np.uint8).tobytes()


def _write(url: str, options: dict[str, Any] | None = None) -> None:
    with DatasetWriter(url, format="tar", max_samples=PER_SHARD, storage_options=options) as writer:
        for i in range(TOTAL):
            writer.write({"__key__": f"s{i:04d}", "bin": _payload(i), "cls": b"1"})


@pytest.fixture(scope="module")
def http_objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("outage-ds")
    _write(str(root))
    return {f"/ds/{p.name}": p.read_bytes() for p in root.iterdir() if p.is_file()}


@pytest.fixture
def http_server(http_objects: dict[str, bytes]) -> Iterator[LyingServer]:
    server = LyingServer(http_objects)
    yield server
    server.stop()


def _storage(mode: str, cache_dir: Path, **extra: Any) -> StorageConfig:
    # No read-ahead and little streamed ahead: the shards after the first are asked for
    # after the outage starts, as they would be in a long epoch.
    return StorageConfig(
        cache_dir=str(cache_dir), cache=mode, read_ahead=0, stream_buffer=1, retry_timeout=0.5, **extra
    )


def _read_through_outage(ds: StreamingDataset, start_outage: Any) -> list[Any]:
    """Read the first shard's samples, start the outage, then read on (what the test expects raises)."""
    it = iter(ds)
    got = [next(it) for _ in range(PER_SHARD)]
    start_outage()
    got.extend(it)
    return got


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("status", [401, 403, 500, 503])
def test_http_status_mid_epoch_is_a_storage_error_not_a_skip(
    http_server: LyingServer, tmp_path: Path, mode: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{http_server.url}/ds"
    ds = StreamingDataset(url, storage=_storage(mode, tmp_path), on_error="skip", shuffle=False)

    def fail() -> None:
        http_server.status = status

    with pytest.raises(StorageError, match=rf"\b{status}\b") as info:
        _read_through_outage(ds, fail)
    assert not isinstance(info.value, ShardNotFoundError)
    assert f"{url}/shard-" in str(info.value)
    assert ds.skipped_samples == 0
    assert "does not exist" not in caplog.text + str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_http_server_gone_mid_epoch_is_a_storage_error_not_a_skip(
    http_server: LyingServer, tmp_path: Path, mode: str
) -> None:
    url = f"{http_server.url}/ds"
    ds = StreamingDataset(url, storage=_storage(mode, tmp_path), on_error="skip", shuffle=False)

    def down() -> None:
        http_server.down = True
        http_server.stop()

    with pytest.raises(StorageError, match="storage unavailable") as info:
        _read_through_outage(ds, down)
    assert f"{url}/shard-" in str(info.value)
    assert ds.skipped_samples == 0


@pytest.fixture(scope="module")
def s3_dataset(s3_server: SeaweedS3) -> str:
    url = f"s3://{s3_server.make_bucket()}/outage"
    _write(url, s3_server.storage_options())
    return url


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("status", "code"), [(403, "AccessDenied"), (503, "ServiceUnavailable")])
def test_s3_status_mid_epoch_is_a_storage_error_not_a_skip(
    faulty_s3: FaultyS3, s3_dataset: str, tmp_path: Path, mode: str, status: int, code: str
) -> None:
    options = faulty_s3.storage_options(config_kwargs={"retries": {"max_attempts": 1}})
    ds = StreamingDataset(
        s3_dataset, storage=_storage(mode, tmp_path, storage_options=options), on_error="skip", shuffle=False
    )

    def fail() -> None:
        for method in ("GET", "HEAD"):
            faulty_s3.inject(Fault("status", match="/outage/", method=method, status=status, code=code, times=10**6))

    with pytest.raises(StorageError, match=rf"\b{status}\b") as info:
        _read_through_outage(ds, fail)
    assert f"{s3_dataset}/shard-" in str(info.value)
    assert ds.skipped_samples == 0


def test_a_missing_shard_is_still_skipped_over_http(
    http_objects: dict[str, bytes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 404 is about one shard: skipped, counted and named, as before."""
    objects = {k: v for k, v in http_objects.items() if not k.endswith("shard-000002.tar")}
    server = LyingServer(objects)
    try:
        ds = StreamingDataset(f"{server.url}/ds", storage=_storage("shards", tmp_path), on_error="skip")
        with caplog.at_level(logging.WARNING, logger="streamload"):
            got = list(ds)
    finally:
        server.stop()
    assert len(got) == TOTAL
    assert ds.skipped_samples == PER_SHARD
    assert "shard-000002.tar does not exist" in caplog.text


def _closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_an_unreachable_endpoint_gives_up_within_its_stated_budget_logging_once(
    tmp_path: Path, scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    if scheme == "http":
        url, options = f"{endpoint}/ds", None
    else:
        url = "s3://bkt/ds"
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    storage = StorageConfig(storage_options=options, cache_dir=str(tmp_path), retry_timeout=1.5)
    with caplog.at_level(logging.DEBUG, logger="streamload"), pytest.raises(StorageError) as info:
        StreamingDataset(url, storage=storage)
    message = str(info.value)
    assert f"{url}/index.json" in message and "storage unavailable" in message
    found = re.search(r"gave up after (\d+) attempts over ([\d.]+) s \(retry budget 1.5 s\)", message)
    assert found is not None, message
    attempts, spent = found.groups()
    assert int(attempts) > 1 and float(spent) <= 1.5
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "retrying for up to 1.5 s" in warnings[0].getMessage()
    retries = [r for r in caplog.records if r.levelno == logging.DEBUG and "retrying" in r.getMessage()]
    assert len(retries) == int(attempts) - 2  # every retry after the first is a debug line
