"""Shard bytes from S3 on botocore's threads (streamload/storage/s3direct.py), against the real test server.

The options s3fs takes map to the same client, or keep the ranged reads on s3fs; a range
comes back exactly, short at the object's end and empty past it; a missing object, a bad
key and a body cut short are told apart as the rest of the package expects; a part whose
body is cut is resumed at the byte where it stopped, not fetched again from its start.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamload import StorageConfig
from streamload._errors import ShardNotFoundError, StorageError
from streamload.storage.retry import RetryPolicy
from streamload.storage.s3direct import direct_s3
from streamload.storage.transport import RemoteFiles, open_transport
from tests.faults import Fault, FaultyS3
from tests.s3server import SeaweedS3

MIB = 1 << 20


def test_s3fs_options_map_to_one_client_or_stay_on_s3fs(monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore import UNSIGNED

    base = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:1", "region_name": "x"}}
    direct = RemoteFiles(
        "s3://b/x", {**base, "requester_pays": True, "use_listings_cache": False}, RetryPolicy()
    ).direct
    assert direct is not None
    args = direct._client_args
    assert (args["aws_access_key_id"], args["aws_secret_access_key"]) == ("k", "s")
    assert args["endpoint_url"] == "http://127.0.0.1:1" and args["region_name"] == "x"
    assert args["config"].max_pool_connections >= 32  # botocore's 10 would queue a download's parts
    assert args["config"].read_timeout == RetryPolicy().inactivity_timeout  # a stalled body fails, then is retried
    assert direct._get_args == {"RequestPayer": "requester"}
    anon = direct_s3({"anon": True})
    assert anon is not None and anon._client_args["config"].signature_version is UNSIGNED
    # what this module does not know stays on s3fs, and so do other protocols
    assert direct_s3({**base, "session": object()}) is None
    assert direct_s3({**base, "s3_additional_kwargs": {"ACL": "private"}}) is None
    assert RemoteFiles("memory://x", {}, RetryPolicy()).direct is None
    assert (
        RemoteFiles("s3://b/x", base, RetryPolicy(), s3_direct=False).direct is None
    )  # StorageConfig(s3_direct=False)
    monkeypatch.setenv("STREAMLOAD_S3_DIRECT", "0")  # the default of the switch, applied by StorageConfig.resolve()
    assert open_transport("s3://b/x", StorageConfig(storage_options=base).resolve()).direct is None
    assert open_transport("s3://b/x", StorageConfig(storage_options=base, s3_direct=True).resolve()).direct is not None


@pytest.fixture(scope="module")
def blob(s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    data = os.urandom(9 * MIB + 12345)
    local = tmp_path_factory.mktemp("direct") / "blob.bin"
    local.write_bytes(data)
    bucket = s3_server.make_bucket()
    s3_server.filesystem().put_file(str(local), f"{bucket}/d/blob.bin")
    return f"s3://{bucket}/d", data


def test_ranges_come_back_exactly(s3_server: SeaweedS3, blob: tuple[str, bytes]) -> None:
    url, data = blob
    files = RemoteFiles(url, s3_server.storage_options(), RetryPolicy(timeout=5))
    assert files.direct is not None
    assert files.get_range("blob.bin", 1000, 2000) == data[1000:2000]
    assert files.get_range("blob.bin", len(data) - 10, len(data) + 50) == data[-10:]  # short at the end
    assert files.get_range("blob.bin", len(data) + 5, len(data) + 50) == b""  # nothing past it
    with pytest.raises(ShardNotFoundError, match="nope.bin"):
        files.get_range("nope.bin", 0, 10)
    denied = RemoteFiles(url, s3_server.storage_options(secret="wrong-secret"), RetryPolicy(timeout=30))
    with pytest.raises(StorageError, match="access denied"):  # at once: a permanent error is not retried
        denied.get_range("blob.bin", 0, 10)


def test_a_cut_part_resumes_where_it_stopped(faulty_s3: FaultyS3, blob: tuple[str, bytes], tmp_path: Path) -> None:
    url, data = blob
    files = RemoteFiles(url, faulty_s3.storage_options(), RetryPolicy(timeout=20, initial_delay=0.05))
    assert files.direct is not None
    files.planner.part_size = 4 * MIB  # parts at 0, ~3 MiB, ~6 MiB (equal parts of a 9 MiB file)
    parts = files.planner.parts(len(data))
    second = parts[1][0]
    cut, resumed = faulty_s3.inject(
        Fault("truncate", match="blob.bin", range_start=second, at=2 * MIB),
        Fault("stall", match="blob.bin", range_start=second + 2 * MIB, seconds=0.0),
    )
    landed: list[tuple[int, int]] = []
    out = tmp_path / "part"
    out.write_bytes(b"")
    got = files.download(
        "blob.bin", str(out), lambda: False, max_bytes=len(data), landed=lambda a, b: landed.append((a, b))
    )
    assert got == len(data) and out.read_bytes() == data
    assert cut.hits == 1, "the fault did not cut the second part"
    assert resumed.hits == 1, "the retry did not ask for the rest of the part only"
    # each part lands chunk by chunk as it arrives, not once at its end
    assert sum(1 for a, b in landed if parts[0][0] <= a < parts[0][1]) > 1
