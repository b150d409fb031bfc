"""Streaming mode (``cache="none"``): tar samples read straight from a bucket by coalesced ranged GETs.

Against the real S3 server (SeaweedFS on loopback, tests/s3server.py) and, where the
latency matters, the shaping proxy in front of it (tests/shaping.py: 50 ms, 40 MB/s).
One dataset of small samples (6 tar shards x 60) written straight into a bucket.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from streamload import DatasetWriter, StorageConfig, Stream, StreamingDataset
from streamload._errors import ConfigError, CorruptShardError
from streamload.batch import RawCollate
from streamload.storage.ranges import RangeFetcher, coalesce
from tests.s3server import SeaweedS3
from tests.shaping import ShapedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SHARDS = 6
PER_SHARD = 60
TOTAL = SHARDS * PER_SHARD


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 300 + 7 * (i % 50), dtype=np.uint8).tobytes()


def _write(url: str, options: dict[str, Any], fmt: str = "tar", count: int = TOTAL) -> None:
    with DatasetWriter(url, format=fmt, max_samples=PER_SHARD, storage_options=options) as writer:
        for i in range(count):
            writer.write({"__key__": f"s{i:04d}", "jpg": _payload(i), "cls": str(i % 5).encode()})


@pytest.fixture(scope="module")
def dataset(s3_server: SeaweedS3) -> str:
    url = f"s3://{s3_server.make_bucket()}/stream"
    _write(url, s3_server.storage_options())
    return url


def _gets(server: SeaweedS3 | ShapedS3) -> float:
    """GET requests the S3 gateway answered so far."""
    metrics = server.metrics().items()
    return sum(v for k, v in metrics if k.startswith("SeaweedFS_s3_request_total") and 'type="GET"' in k)


def _samples(loader: Any) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["jpg"]) for s in loader]


def _batches(loader: Any) -> list[tuple[tuple[str, ...], list[bytes], list[int]]]:
    out = []
    for batch in loader:
        assert batch.keys is not None and batch.labels is not None
        out.append((batch.keys, [batch.tobytes(i) for i in range(len(batch))], batch.labels.tolist()))
    return out


def _padded(batch: int) -> int:
    """The items of an epoch with a (single-rank) ``batch_size``: TOTAL padded to whole batches."""
    return -(-TOTAL // batch) * batch


def _cached_files(cache: Path) -> list[str]:
    return sorted(name for root in cache.iterdir() if root.is_dir() for name in os.listdir(root / "data"))


@pytest.mark.parametrize("collate", [False, True], ids=["samples", "raw-batches"])
def test_streaming_yields_the_cached_samples_in_the_same_order(
    s3_server: SeaweedS3, dataset: str, tmp_path: Path, collate: bool
) -> None:
    """Shuffled, 2 DataLoader workers (fork for samples, spawn for RawCollate batches): same keys, bytes, order."""
    options = s3_server.storage_options()
    kwargs: dict[str, Any] = {"shuffle": True, "seed": 7, "batch_size": 16}
    if collate:
        kwargs["collate"] = RawCollate(field="jpg", keys=True)
    context = "spawn" if collate else "fork"

    def epoch(cache: str) -> Any:
        storage = StorageConfig(storage_options=options, cache_dir=str(tmp_path / cache), cache=cache)
        ds = StreamingDataset(dataset, storage=storage, **kwargs)
        if collate:
            loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=120)
            return _batches(loader)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=120)
        return _samples(loader)

    cached = epoch("shards")
    streamed = epoch("none")
    assert streamed == cached
    keys = [k for batch in streamed for k in batch[0]] if collate else [k for k, _ in streamed]
    # The epoch is padded to whole batches of 16: every sample once, plus the first
    # _padded(16) - TOTAL positions of the shuffled epoch sequence once more. That sequence
    # runs through the (permuted) shards one after the other, so the repeats are the first
    # samples of a single shard.
    extra = _padded(16) - TOTAL
    assert len(keys) == _padded(16) and extra > 0
    counts = Counter(keys)
    assert set(counts) == {f"s{i:04d}" for i in range(TOTAL)} and max(counts.values()) == 2
    repeats = sorted(k for k, c in counts.items() if c == 2)
    first = int(repeats[0][1:])
    assert first % PER_SHARD == 0 and repeats == [f"s{first + i:04d}" for i in range(extra)]
    # Only sidecars were cached: no shard data reached the disk.
    assert _cached_files(tmp_path / "none") == sorted(f"shard-{i:06d}.tar.idx" for i in range(SHARDS))
    assert any(name.endswith(".tar") for name in _cached_files(tmp_path / "shards"))


def test_streaming_ranks_read_what_cached_ranks_read(s3_server: SeaweedS3, dataset: str, tmp_path: Path) -> None:
    """Each DDP rank's part (rank/world_size given, as torchrun would detect them) is the same in both modes."""
    options = s3_server.storage_options()
    for rank in range(2):
        args: dict[str, Any] = {"shuffle": True, "seed": 3, "rank": rank, "world_size": 2}
        cache = StorageConfig(storage_options=options, cache_dir=str(tmp_path / "c"), cache="shards")
        stream = StorageConfig(storage_options=options, cache_dir=str(tmp_path / "s"), cache="none")
        cached = _samples(StreamingDataset(dataset, storage=cache, **args))
        streamed = _samples(StreamingDataset(dataset, storage=stream, **args))
        assert streamed == cached and len(streamed) == TOTAL // 2


def test_a_mixture_streams_its_remote_stream_only(s3_server: SeaweedS3, dataset: str, tmp_path: Path) -> None:
    """A bucket stream and a local stream: the bucket one is streamed, the local one read in place; same order."""
    local = tmp_path / "local"
    with DatasetWriter(str(local), max_samples=25) as writer:
        for i in range(50):
            writer.write({"__key__": f"l{i:03d}", "jpg": _payload(1000 + i), "cls": b"0"})
    options = s3_server.storage_options()
    streams = [
        Stream(dataset, weight=0.75, storage=StorageConfig(storage_options=options)),
        Stream(str(local), weight=0.25),
    ]

    def epoch(cache: str) -> list[tuple[str, bytes]]:
        ds = StreamingDataset(
            streams,
            epoch_size=200,
            shuffle=True,
            seed=2,
            storage=StorageConfig(cache_dir=str(tmp_path / cache), cache=cache),
        )
        return _samples(ds)

    cached, streamed = epoch("shards"), epoch("none")
    assert streamed == cached and len(streamed) == 200
    assert all(name.endswith(".idx") for name in _cached_files(tmp_path / "none"))


def test_streaming_memory_stays_within_the_buffer(
    s3_server: SeaweedS3, dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes fetched ahead and not yet read never pass ``stream_buffer`` plus one batch."""
    peak = [0]
    fetch = RangeFetcher.fetch

    def recording(self: RangeFetcher, wanted: Any) -> Any:
        ticket = fetch(self, wanted)
        peak[0] = max(peak[0], self.outstanding)
        return ticket

    monkeypatch.setattr(RangeFetcher, "fetch", recording)
    budget = 20_000
    ds = StreamingDataset(
        dataset,
        storage=StorageConfig(
            storage_options=s3_server.storage_options(), cache_dir=str(tmp_path), cache="none", stream_buffer=budget
        ),
        batch_size=16,
        collate=RawCollate(field="jpg"),
    )
    largest_batch = 0
    for batch in ds:
        largest_batch = max(largest_batch, int(batch.data.numel()))
    # One batch's extents hold its headers and labels too: allow twice its payload.
    assert 0 < peak[0] <= budget + 2 * 2 * largest_batch
    # Each epoch's fetch threads end with it: more epochs leave no more threads behind.
    threads = threading.active_count()
    # Unshuffled, padded to whole batches of 16: the first samples (labels i % 5) again at the end.
    labels = Counter([i % 5 for i in range(TOTAL)] + [i % 5 for i in range(_padded(16) - TOTAL)])
    for _ in range(3):
        assert Counter(label for b in ds for label in b.labels.tolist()) == labels
    time.sleep(0.5)
    assert threading.active_count() <= threads


def test_a_streaming_epoch_coalesces_its_requests(shaped_s3: ShapedS3, dataset: str, tmp_path: Path) -> None:
    """Through a far bucket: far fewer GETs than samples (a batch's neighbouring samples are one request)."""
    ds = StreamingDataset(
        dataset,
        storage=StorageConfig(storage_options=shaped_s3.storage_options(), cache_dir=str(tmp_path), cache="none"),
        batch_size=32,
        collate=RawCollate(field="jpg"),
    )
    before = _gets(shaped_s3)
    batches = list(ds)
    gets = _gets(shaped_s3) - before
    assert [len(b) for b in batches] == [32] * (_padded(32) // 32)
    # Per shard: its sidecar, two tar headers checked at open, and about one span per batch part.
    assert gets <= TOTAL / 6, f"{gets} GETs for {TOTAL} samples"
    assert gets >= SHARDS  # at least a sidecar each (and nothing cached: every byte came by a GET)


def test_streaming_rides_out_an_outage(s3_server: SeaweedS3, dataset: str, tmp_path: Path) -> None:
    """The S3 service crashes mid-epoch and comes back 4+ s later: nothing lost, nothing repeated, same order."""
    gateway = s3_server.new_gateway()
    gateway.start()
    restarter: threading.Thread | None = None
    try:
        options = s3_server.storage_options(client_kwargs={"endpoint_url": gateway.endpoint_url})
        args: dict[str, Any] = {"shuffle": True, "seed": 11}
        cached = StorageConfig(storage_options=options, cache_dir=str(tmp_path / "ref"), cache="shards")
        ref = StreamingDataset(dataset, storage=cached, **args)
        reference = _samples(DataLoader(ref, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        # A tiny buffer: the workers fetch no unit ahead of the one they read, so they need the server all along.
        streamed = StorageConfig(storage_options=options, cache_dir=str(tmp_path / "s"), cache="none", stream_buffer=1)
        ds = StreamingDataset(dataset, storage=streamed, **args)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=90)
        got: list[tuple[str, bytes]] = []
        last = [time.monotonic()]
        stalled: list[float] = []
        errors: list[BaseException] = []
        for key, data in ((s["__key__"], s["jpg"]) for s in loader):
            last[0] = time.monotonic()
            got.append((key, data))
            if len(got) == 40:
                gateway.kill()
                restarter = threading.Thread(target=_restart, args=(gateway, last, stalled, errors), daemon=True)
                restarter.start()
        assert restarter is not None
        restarter.join(timeout=130)
        assert not restarter.is_alive() and not errors, errors
        assert stalled and stalled[0] >= 1.0  # the readers did wait on the dead service
        assert got == reference
    finally:
        if restarter is not None:
            restarter.join(timeout=130)
        gateway.stop()


def _restart(gateway: Any, last: list[float], stalled: list[float], errors: list[BaseException]) -> None:
    """Bring the gateway back after 4 s, once the reader has waited 1 s for a sample (bounded)."""
    try:
        time.sleep(4)
        deadline = time.monotonic() + 60
        while time.monotonic() - last[0] < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        stalled.append(time.monotonic() - last[0])
        gateway.start(timeout=60)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_a_corrupt_sample_in_the_bucket_names_shard_and_key(s3_server: SeaweedS3, tmp_path: Path) -> None:
    """Same-size garbage in one sample of the object: CorruptShardError naming the shard URL and the key."""
    options = s3_server.storage_options()
    url = f"s3://{s3_server.make_bucket()}/corrupt"
    _write(url, options, count=2 * PER_SHARD)
    fs = s3_server.filesystem()
    path = url.removeprefix("s3://") + "/shard-000001.tar"
    raw = bytearray(fs.cat_file(path))
    victim = _payload(PER_SHARD + 17)  # sample s0077, in shard 1
    at = raw.find(victim)
    assert at > 0
    raw[at + 10 : at + 20] = bytes(10)
    fs.pipe_file(path, bytes(raw))
    for kwargs in ({}, {"batch_size": 8, "collate": RawCollate(field="jpg")}):
        ds = StreamingDataset(
            url, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path), cache="none"), **kwargs
        )
        with pytest.raises(CorruptShardError, match=rf"{url}/shard-000001\.tar.*s0077.*bad at its source"):
            list(ds)


def test_lmdb_cannot_stream_and_auto_caches_it(s3_server: SeaweedS3, tmp_path: Path) -> None:
    pytest.importorskip("lmdb")
    options = s3_server.storage_options()
    url = f"s3://{s3_server.make_bucket()}/lmdb"
    _write(url, options, fmt="lmdb", count=PER_SHARD)
    with pytest.raises(ConfigError, match=r'cache="none" cannot stream .*lmdb shards'):
        StreamingDataset(url, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path), cache="none"))
    ds = StreamingDataset(
        url, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path), cache="auto"), shuffle=True
    )
    assert len(_samples(ds)) == PER_SHARD
    assert any(name.endswith(".lmdb") for name in _cached_files(tmp_path))


def test_auto_streams_when_the_cache_cannot_hold_a_window(s3_server: SeaweedS3, dataset: str, tmp_path: Path) -> None:
    options = s3_server.storage_options()
    probe = StreamingDataset(dataset, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path / "probe")))
    largest = probe.manifest.largest_shard_bytes
    # Shuffled, the window spans every shard: two shards' room cannot hold it, so "auto" streams ...
    small = tmp_path / "small"
    ds = StreamingDataset(
        dataset,
        storage=StorageConfig(storage_options=options, cache_dir=str(small), cache_limit=2 * largest),
        shuffle=True,
    )
    assert Counter(k for k, _ in _samples(ds)) == Counter(f"s{i:04d}" for i in range(TOTAL))
    assert all(name.endswith(".idx") for name in _cached_files(small))
    # ... below two shards, caching cannot work at all, and "auto" streams too (no CacheError) ...
    tiny = tmp_path / "tiny"
    ds = StreamingDataset(
        dataset, storage=StorageConfig(storage_options=options, cache_dir=str(tiny), cache_limit=largest, cache="auto")
    )
    assert len(_samples(ds)) == TOTAL
    assert all(name.endswith(".idx") for name in _cached_files(tiny))
    # ... and a cache that holds the window caches whole shards.
    big = tmp_path / "big"
    ds = StreamingDataset(
        dataset, storage=StorageConfig(storage_options=options, cache_dir=str(big), cache_limit="1GB"), shuffle=True
    )
    assert len(_samples(ds)) == TOTAL
    assert any(name.endswith(".tar") for name in _cached_files(big))


def test_bad_cache_and_stream_buffer_values_fail_at_once() -> None:
    with pytest.raises(ConfigError, match="cache='disk' must be 'auto'"):
        StorageConfig(cache="disk")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="stream_buffer=0 must be >= 1"):
        StorageConfig(stream_buffer=0)
    assert StorageConfig(stream_buffer="128MB").stream_buffer == 128 * 10**6


def test_coalesce_merges_close_extents_and_caps_spans() -> None:
    assert coalesce([(100, 200), (0, 50), (60, 90), (1000, 1100)], gap=10) == [(0, 200), (1000, 1100)]
    assert coalesce([(0, 10), (5, 30), (30, 40), (40, 40)], gap=0) == [(0, 40)]  # overlaps, touching, empty
    assert coalesce([(0, 25)], gap=100, max_span=10) == [(0, 10), (10, 20), (20, 25)]
    assert coalesce([(0, 8), (9, 16), (17, 30)], gap=5, max_span=16) == [(0, 16), (17, 30)]


def test_one_rule_decides_cache_or_stream() -> None:
    from streamload.storageconfig import choose_streaming

    assert choose_streaming("none", True, None, 1, 10) == "none"
    assert choose_streaming("shards", True, 5, 10, 10) is None
    assert choose_streaming("auto", False, 5, 10, 10) is None  # shards that cannot be read by ranges: cache
    assert choose_streaming("auto", True, None, 10**6, 10) is None  # an unbounded cache holds anything
    assert choose_streaming("auto", True, 100, 10, 10) is None  # 10 shards of 10 bytes fit in 100
    why = choose_streaming("auto", True, 99, 10, 10)
    assert why is not None and "10 shards" in why and "cache_limit=99" in why


def test_streamed_row_groups_that_batches_share_are_fetched_once(
    s3_server: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Parquet row group two batches both read (10-row groups, 8-row batches) comes by one GET, not two."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamload.indexing import index_directory
    from tests.helpers.parquet_tables import encode

    blobs = [encode(i, "JPEG") for i in range(80)]
    local = tmp_path / "a.parquet"
    pq.write_table(
        pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array([i % 3 for i in range(80)], pa.int64())}),
        local,
        row_group_size=10,
        compression="snappy",
        use_dictionary=False,
    )
    options = s3_server.storage_options()
    url = f"s3://{s3_server.make_bucket()}/pq"
    fsspec.filesystem("s3", **options).put_file(str(local), f"{url}/a.parquet")
    index_directory(url, "parquet", storage_options=options)
    md = pq.read_metadata(local)
    chunks = sum(md.row_group(g).column(0).total_compressed_size for g in range(md.num_row_groups))
    fetched: list[int] = []
    get = RangeFetcher.get

    def recording(self: RangeFetcher, name: str, start: int, end: int) -> bytes:
        if name.endswith(".parquet"):
            fetched.append(end - start)
        return get(self, name, start, end)

    monkeypatch.setattr(RangeFetcher, "get", recording)
    ds = StreamingDataset(
        url,
        storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path / "cache"), cache="none"),
        batch_size=8,
        collate=RawCollate(keys=True),
    )
    got = {}
    for batch in ds:
        offsets = batch.offsets.tolist()
        got.update({key: batch.data[offsets[k] : offsets[k + 1]].numpy().tobytes() for k, key in enumerate(batch.keys)})
    assert got == {f"a/{i:010d}": blob for i, blob in enumerate(blobs)}
    assert len(got) == 80
    assert chunks <= sum(fetched) < 1.2 * chunks, (sum(fetched), chunks)


def test_a_span_whose_get_failed_is_not_shared_with_a_later_batch(
    s3_server: SeaweedS3, dataset: str, tmp_path: Path
) -> None:
    """A later batch inside a span whose GET failed asks again rather than meeting the old error."""
    from streamload.storage.remote import RemoteStorage

    storage = RemoteStorage(
        dataset, StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path)).resolve()
    )
    fetcher = storage.open_ranges()
    try:
        first = fetcher.fetch([("no-such-shard.tar", 10_000, [(0, 1_000)])])
        (_, failed), *_ = first.spans
        with pytest.raises(Exception, match="no-such-shard"):
            failed.data.result(30)
        second = fetcher.fetch([("no-such-shard.tar", 10_000, [(100, 200)])])
        assert [span for _, span in second.spans] != [failed] and fetcher.stats.spans == 2
        fetcher.forget(first)
        fetcher.forget(second)
        assert fetcher.outstanding == 0
    finally:
        fetcher.close()
        storage.close()
