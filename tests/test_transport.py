"""Downloads as concurrent ranged GETs, against the real S3 server (direct and as a far bucket)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from streamload import StorageConfig
from streamload._errors import CorruptShardError
from streamload.storage.parts import LinkModel, PartPlanner
from streamload.storage.retry import RetryPolicy
from streamload.storage.transport import RemoteFiles, open_transport
from tests.s3server import SeaweedS3
from tests.shaping import ShapedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SIZE = 5 * 2**20 + 12345  # not a multiple of any part size


@pytest.fixture(scope="module")
def blob(s3_server: SeaweedS3) -> tuple[str, bytes]:
    bucket = s3_server.make_bucket()
    data = os.urandom(SIZE)
    s3_server.filesystem().pipe(f"{bucket}/blob.bin", data)
    return f"s3://{bucket}", data


@pytest.fixture(params=["direct", "fsspec"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The bytes come through botocore's client (the default on S3) or through s3fs."""
    if request.param == "fsspec":
        monkeypatch.setenv("STREAMLOAD_S3_DIRECT", "0")  # the default StorageConfig.resolve() applies
    return str(request.param)


def _files(url: str, options: dict[str, Any], part_size: int) -> RemoteFiles:
    settings = StorageConfig(storage_options=options).resolve()
    files = open_transport(url, settings, retry=RetryPolicy(timeout=20, initial_delay=0.05))
    files.planner = PartPlanner(part_size=part_size, max_concurrency=4)
    return files


def _count_ranges(files: RemoteFiles, fail: set[int] | None = None) -> Counter[tuple[int, int]]:
    """Count every ranged read of ``files``; the first read of each start in ``fail`` raises a reset.

    On the path the reads take: botocore's client on S3 (``files.direct``), else fsspec's (``files.ranged``).
    """
    calls: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()

    def count(start: int | None, end: int | None) -> None:
        with lock:
            calls[(start or 0, end or -1)] += 1
            first = calls[(start or 0, end or -1)] == 1
        if fail and start in fail and first:
            raise ConnectionResetError(f"injected reset at byte {start}")

    direct = files.direct
    if direct is not None:
        real_open = direct._open

        def open_range(path: str, start: int, end: int) -> Any:
            count(start, end)
            return real_open(path, start, end)

        direct._open = open_range  # type: ignore[method-assign]
        return calls
    real = files.backend.get_range

    def ranged(path: str, url: str, start: int, end: int) -> bytes:
        count(start, end)
        return real(path, url, start, end)

    files.backend.get_range = ranged  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("where", ["loopback", "shaped"])
def test_parts_reassemble_to_the_file(
    path: str, where: str, blob: tuple[str, bytes], s3_server: SeaweedS3, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url, data = blob
    endpoint: SeaweedS3 | ShapedS3 = s3_server if where == "loopback" else request.getfixturevalue("shaped_s3")
    files = _files(url, endpoint.storage_options(), part_size=2**20)
    calls = _count_ranges(files)
    part = tmp_path / "blob.part"
    part.write_bytes(b"stale bytes from an earlier try")
    assert files.download("blob.bin", str(part), lambda: False, max_bytes=SIZE) == SIZE
    assert part.read_bytes() == data
    planned = files.planner.parts(SIZE)
    asked = [*planned[:-1], (planned[-1][0], SIZE + 1)]  # the last part asks one byte more
    assert sorted(calls) == asked and len(planned) == 6, "one GET per planned part, each once"
    assert all(n == 1 for n in calls.values())


def test_a_failed_part_is_retried_alone(
    path: str, blob: tuple[str, bytes], s3_server: SeaweedS3, tmp_path: Path
) -> None:
    url, data = blob
    files = _files(url, s3_server.storage_options(), part_size=2**20)
    planned = files.planner.parts(SIZE)
    failing = planned[3][0]
    calls = _count_ranges(files, fail={failing})
    part = tmp_path / "blob.part"
    part.touch()
    files.download("blob.bin", str(part), lambda: False, max_bytes=SIZE)
    assert part.read_bytes() == data
    assert calls[planned[3]] == 2, "the failed part was fetched again"
    asked = [*planned[:-1], (planned[-1][0], SIZE + 1)]  # the last part asks one byte more
    assert all(calls[p] == 1 for p in asked if p != planned[3]), "and no other part was"


@pytest.mark.parametrize(("claimed", "what"), [(SIZE + 100, "shorter"), (SIZE - 100, "longer")])
def test_an_object_of_another_size_than_its_entry_is_corrupt(
    path: str, blob: tuple[str, bytes], s3_server: SeaweedS3, tmp_path: Path, claimed: int, what: str
) -> None:
    url, _ = blob
    files = _files(url, s3_server.storage_options(), part_size=2**20)
    part = tmp_path / "blob.part"
    part.touch()
    with pytest.raises(CorruptShardError, match=rf"blob\.bin.*{what} than the {claimed} bytes"):
        files.download("blob.bin", str(part), lambda: False, max_bytes=claimed)


def test_the_planner_sizes_parts_from_latency_and_rate() -> None:
    near = PartPlanner(link=LinkModel(latency=0.001, rate=1e9))
    far = PartPlanner(link=LinkModel(latency=0.1, rate=40e6))
    assert near.chosen_part_size() == near.min_part  # little latency to hide: small parts
    assert far.chosen_part_size() == 16 * 2**20  # 4 x 100 ms x 40 MB/s, capped at max_part
    assert far.concurrency(64 * 2**20) == 4 and far.concurrency(1000) == 1
    parts = far.parts(64 * 2**20 + 1)
    assert parts[0][0] == 0 and parts[-1][1] == 64 * 2**20 + 1
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    # Measurements move the estimates: slow large parts lower the rate, slow small ones raise the latency.
    far.link.observe(16 * 2**20, 2.0)
    assert far.rate < 40e6
    far.link.observe(1000, 0.3)
    assert far.latency > 0.1


def test_a_tar_shard_read_by_ranges_equals_the_local_read(
    s3_server: SeaweedS3, tar_dataset: Path, tmp_path: Path
) -> None:
    """The tar reader over a storage's streamed bytes of the bucket object: the same samples, few requests."""
    import numpy as np

    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage.bytes import StreamedFile
    from streamload.storage.remote import RemoteStorage

    manifest = Manifest.loads((tar_dataset / "index.json").read_bytes())
    entry = manifest.shards[0]
    assert entry.sidecar is not None
    bucket = s3_server.make_bucket()
    s3_server.filesystem().put_file(str(tar_dataset / entry.name), f"{bucket}/{entry.name}")
    config = StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path), read_ahead=0)
    storage = RemoteStorage(f"s3://{bucket}", config.resolve())
    ranges = storage.open_ranges()
    fmt = get_format("tar")
    local = fmt.reader(str(tar_dataset / entry.name), entry, str(tar_dataset / entry.sidecar.name))
    streamed = storage.open_bytes(entry, ranges=ranges)
    assert isinstance(streamed, StreamedFile)
    remote = fmt.reader(entry.name, entry, str(tar_dataset / entry.sidecar.name), source=streamed, check_headers=False)  # type: ignore[call-arg]
    try:
        n = entry.num_samples
        idx = np.array([n - 1, 0, 2])
        ticket = ranges.fetch([(entry.name, entry.num_bytes, remote.sample_extents(idx).tolist())])  # type: ignore[attr-defined]
        sizes = remote.field_sizes(idx, ("jpg",))  # type: ignore[attr-defined]
        out = np.zeros(int(sizes.sum()), dtype=np.uint8)
        remote.read_groups_into(idx, [(("jpg",), out, sizes)])  # type: ignore[attr-defined]
        assert out.tobytes() == b"".join(local.get(int(i))["jpg"] for i in idx)
        assert ranges.stats.misses == 0 and ranges.stats.requests == ranges.stats.spans <= 3, ranges.stats
        ranges.forget(ticket)
        assert [remote.get(i) for i in range(n)] == [local.get(i) for i in range(n)]  # no span: direct GETs
        assert ranges.stats.misses > 0
    finally:
        local.close()
        remote.close()
        ranges.close()
        storage.close()
