"""Adaptive read-ahead depth, and one download per shard per node under a far bucket.

The depth rule alone (fed measured times), then the rule at work through a
``ShardSource`` reading from the shaped bucket (``shaped_s3``: 50 ms to the first byte,
40 MB/s per connection) with a slow and a fast reader, and a real two-rank job (gloo, two
DataLoader workers per rank, one cache) whose downloads the S3 server itself counts.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.utils.data import DataLoader

from streamload import DatasetWriter, StreamingDataset
from streamload.ahead import ShardsAhead
from streamload.dataref import DatasetRef
from streamload.manifest import MANIFEST_NAME
from streamload.plan.planner import Run
from streamload.shards import ShardSource
from streamload.storage.readahead import START_DEPTH, AheadDepth
from streamload.storage.remote import RemoteStorage
from streamload.storageconfig import StorageConfig
from tests.s3server import SeaweedS3
from tests.shaping import ShapedS3

MB = 1_000_000

# -- the rule ------------------------------------------------------------------------------


def _fed(rule: AheadDepth, fetch: float, consume: float, shards: int = 6, size: int = 4 * MB) -> None:
    """Feed ``rule`` downloads of ``size`` bytes taking ``fetch`` s and a reader taking ``consume`` s per shard."""
    clock = 0.0
    for _ in range(shards):
        rule.observe_fetch(size, fetch)
        rule.observe_fetch(1000, rule.latency)  # a sidecar: latency only
        rule.observe_shard(clock, blocked=0.0)
        clock += consume


def test_depth_before_any_measurement_is_the_start_depth_within_the_cap() -> None:
    assert AheadDepth(8).depth(4 * MB, None) == START_DEPTH
    assert AheadDepth(1).depth(4 * MB, None) == 1
    assert AheadDepth(0).depth(4 * MB, None) == 0  # read_ahead=0: off


def test_depth_is_fetch_time_over_reading_time_plus_a_margin() -> None:
    rule = AheadDepth(8, alpha=1.0)  # no smoothing: the last measurement is the estimate
    _fed(rule, fetch=0.5, consume=2.0)  # a slow reader: one shard ahead is plenty
    assert rule.depth(4 * MB, None) == 1
    _fed(rule, fetch=0.5, consume=0.25)  # 2 shards read per download: 2 in flight, and one spare
    assert rule.fetch_seconds(4 * MB) == pytest.approx(0.5, rel=1e-3)
    assert rule.depth(4 * MB, None) == math.ceil(0.5 / 0.25 + rule.margin) == 3
    _fed(rule, fetch=2.0, consume=0.01)  # a fast reader on a slow link: as deep as allowed
    assert rule.depth(4 * MB, None) == 8  # the cap (read_ahead=)
    assert rule.depth(4 * MB, 3) == 3  # the cache room
    assert rule.depth(4 * MB, 0) == 1  # always one
    stats = rule.stats()
    assert (stats.depth, stats.peak, stats.cap, stats.room) == (1, 8, 8, 0)


def test_time_blocked_on_downloads_is_not_reading_time() -> None:
    rule = AheadDepth(8, alpha=1.0)
    rule.observe_shard(10.0, blocked=0.0)
    rule.observe_shard(11.0, blocked=0.9)  # 1 s between shards, 0.9 s of it waiting for the download
    assert rule.consume == pytest.approx(0.1)
    rule.pause()  # the iteration ended: the gap before the next is no reading time
    rule.observe_shard(100.0, blocked=0.9)
    assert rule.consume == pytest.approx(0.1) and rule.shards == 1


def test_one_slow_download_does_not_swing_the_depth() -> None:
    rule = AheadDepth(8)
    _fed(rule, fetch=0.4, consume=0.2, shards=20)
    steady = rule.depth(4 * MB, None)
    assert steady == math.ceil(0.4 / 0.2 + rule.margin) == 3
    rule.observe_fetch(4 * MB, 4.0)  # one GET ten times slower
    assert rule.depth(4 * MB, None) <= steady + 6  # moved, but by less than the outlier says (20 + 1)
    _fed(rule, fetch=0.4, consume=0.2, shards=12)
    assert rule.depth(4 * MB, None) == steady  # and back once the link is as before


def test_cache_room_bounds_the_depth_and_is_divided_among_readers(tmp_path: Path) -> None:
    memory = "memory://ahead-room"
    largest = 10 * MB
    storage = RemoteStorage(memory, StorageConfig(cache_dir=str(tmp_path), cache_limit=4 * largest).resolve())
    other = RemoteStorage(memory, StorageConfig(cache_dir=str(tmp_path), cache_limit=8 * largest).resolve())
    unbounded = RemoteStorage(memory, StorageConfig(cache_dir=str(tmp_path / "u"), cache_limit="unbounded").resolve())
    try:
        storage.register_reader(largest)
        assert storage.max_open(largest) == 1
        assert storage._ahead_room() == 2  # 4 shards: the one read, the one opened next, two ahead
        other.register_reader(largest)  # a second process reading through the same cache directory
        assert other._ahead_room() == 2  # 8 shards / 2 readers = 4 each: as above
        unbounded.register_reader(largest)
        assert unbounded._ahead_room() is None
        assert RemoteStorage(memory, StorageConfig(cache_dir=str(tmp_path), read_ahead=0).resolve()).ahead_depth() == 0
    finally:
        for s in (storage, other, unbounded):
            s.unregister_reader()
            s.close()


# -- the rule at work, under the shaped bucket ----------------------------------------------

SHARDS = 12
PER_SHARD = 4
SAMPLE = 700_000  # ~2.8 MB shards: ~0.1 s each through the shaped proxy


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SAMPLE, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def far_dataset(shaped_s3: ShapedS3) -> Iterator[str]:
    """12 tar shards of ~2.8 MB in a bucket of their own (written directly to the server)."""
    bucket = shaped_s3.make_bucket()
    url = f"s3://{bucket}/far"
    with DatasetWriter(url, max_samples=PER_SHARD, storage_options=shaped_s3.server.storage_options()) as writer:
        for i in range(SHARDS * PER_SHARD):
            writer.write({"__key__": f"s{i:04d}", "bin": _payload(i)})
    yield url


def _read_shards(ref: DatasetRef, storage: RemoteStorage, per_shard: float) -> tuple[list[int], dict[str, bytes]]:
    """Read every shard in order, spending ``per_shard`` s on each; return the depths seen and the samples."""
    order = list(range(len(ref.manifest.shards)))
    runs = [Run(s, np.arange(PER_SHARD), np.arange(PER_SHARD), np.arange(PER_SHARD)) for s in order]
    depths: list[int] = []
    samples: dict[str, bytes] = {}
    with ShardSource(ref, storage, own_storage=True) as source:
        for run in ShardsAhead(source, iter(order)).fetch_ahead(iter(runs)):
            reader = source.get(run.shard)
            for i in run.locals:
                sample = reader.get(int(i))
                samples[str(sample["__key__"])] = bytes(sample["bin"])
            depths.append(storage.ahead_stats.depth)
            if per_shard:
                time.sleep(per_shard)
    return depths, samples


def _ref(url: str, shaped: ShapedS3, cache: Path, limit: int | str, read_ahead: int) -> DatasetRef:
    return DatasetRef.open(
        url,
        StorageConfig(
            storage_options=shaped.storage_options(), cache_dir=cache, cache_limit=limit, read_ahead=read_ahead
        ),
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_slow_reader_keeps_one_shard_ahead(shaped_s3: ShapedS3, far_dataset: str, tmp_path: Path) -> None:
    ref = _ref(far_dataset, shaped_s3, tmp_path, "unbounded", 8)
    storage = ref.open_storage()
    assert isinstance(storage, RemoteStorage)
    depths, samples = _read_shards(_first(ref, 5), storage, per_shard=0.8)
    assert samples == {f"s{i:04d}": _payload(i) for i in range(5 * PER_SHARD)}
    stats = storage.ahead_stats
    assert stats.consume_seconds is not None and stats.consume_seconds >= 0.7
    assert stats.fetch_seconds < stats.consume_seconds  # the link is faster than the reader
    assert depths[0] == START_DEPTH  # before the reader's pace is known
    assert depths[2:] == [1] * (len(depths) - 2), depths  # then the minimum
    assert stats.downloads == storage.stats.downloads == 10  # what the estimate comes from: 5 shards, 5 sidecars


def _first(ref: DatasetRef, count: int) -> DatasetRef:
    """``ref`` with its manifest cut to the first ``count`` shards (the slow reader needs fewer)."""
    return replace(ref, manifest=replace(ref.manifest, shards=ref.manifest.shards[:count]))


class _CachePeak:
    """A thread measuring a cache directory's data (``data/`` + ``tmp/``) under its lock."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self.at_peak = ""
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        (dataset,) = self.root.iterdir()
        while not self._stop.is_set():
            with open(dataset / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                seen = []
                for sub in ("data", "tmp"):
                    for item in os.scandir(dataset / sub):
                        try:
                            seen.append((f"{sub}/{item.name}", item.stat().st_size))
                        except FileNotFoundError:
                            continue
            total = sum(size for _, size in seen)
            if total > self.peak:
                self.peak, self.at_peak = total, " ".join(f"{n}={s}" for n, s in sorted(seen))
            self.samples += 1
            time.sleep(0.003)

    def __enter__(self) -> _CachePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "limit-4-shards"])
def test_a_fast_reader_on_a_slow_link_reads_deeper_within_the_cache_room(
    shaped_s3: ShapedS3, far_dataset: str, tmp_path: Path, bounded: bool
) -> None:
    probe = _ref(far_dataset, shaped_s3, tmp_path, "unbounded", 4)
    largest = probe.manifest.largest_shard_bytes
    limit = 4 * largest if bounded else "unbounded"
    ref = _ref(far_dataset, shaped_s3, tmp_path / "cache", limit, 4)
    storage = ref.open_storage()
    assert isinstance(storage, RemoteStorage)
    with _CachePeak(Path(tmp_path / "cache")) as cache:
        depths, samples = _read_shards(ref, storage, per_shard=0.0)
    assert samples == {f"s{i:04d}": _payload(i) for i in range(SHARDS * PER_SHARD)}
    stats = storage.ahead_stats
    assert stats.consume_seconds is not None and stats.fetch_seconds > stats.consume_seconds
    # Every shard and sidecar downloaded once: read-ahead never evicted a shard before it was read.
    assert storage.stats.downloads == 2 * SHARDS
    if bounded:
        assert stats.room == 2  # 4 shards: the one read, the one opened next, two ahead
        assert max(depths) == 2, depths
        assert cache.samples > 0 and cache.peak <= limit, cache.at_peak
    else:
        assert stats.room is None
        assert max(depths) == 4, depths  # the cap (read_ahead=4): deeper than the start depth of 2
        assert stats.peak == 4


# -- one download per shard per node: two ranks x two workers, one cache -------------------


def _sent_bytes(metrics_port: int, bucket: str) -> float:
    """Bytes the S3 gateway sent for ``bucket`` so far (its own Prometheus counter)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    name = f'SeaweedFS_s3_bucket_traffic_sent_bytes_total{{bucket="{bucket}"}} '
    return sum(float(line[len(name) :]) for line in text.splitlines() if line.startswith(name))


def _key(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def _rank(
    rank: int, url: str, options: dict[str, Any], cache: str, init: str, port: int, bucket: str, out: str
) -> None:
    """One rank: two epochs with two forked DataLoader workers; rank 0 records the bytes sent after each."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        ds = StreamingDataset(
            url, storage=StorageConfig(storage_options=options, cache_dir=cache), shuffle=True, seed=7, transform=_key
        )
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        lines = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            keys = list(loader)
            dist.barrier()  # both ranks done with the epoch
            sent = _sent_bytes(port, bucket) if rank == 0 else 0.0
            lines.append(f"{epoch} {sent} {' '.join(keys)}")
            dist.barrier()
        Path(out, f"rank{rank}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_two_workers_download_each_file_once_per_node(
    shaped_s3: ShapedS3, far_dataset: str, tmp_path: Path
) -> None:
    server: SeaweedS3 = shaped_s3.server
    bucket = far_dataset[len("s3://") :].split("/", 1)[0]
    port = server.gateway.metrics_port
    ref = _ref(far_dataset, shaped_s3, tmp_path / "probe", "unbounded", 0)
    files = [f for shard in ref.manifest.shards for f in shard.files]
    manifest_bytes = len(server.filesystem().cat_file(f"{far_dataset[len('s3://') :]}/{MANIFEST_NAME}"))
    before = _sent_bytes(port, bucket)

    cache = tmp_path / "node-cache"
    args = (far_dataset, shaped_s3.storage_options(), str(cache), str(tmp_path / "init"), port, bucket, str(tmp_path))
    tmp.start_processes(_rank, args=args, nprocs=2, join=True, start_method="spawn")

    epochs: dict[int, list[str]] = {0: [], 1: []}
    sent: dict[int, float] = {}
    for rank in (0, 1):
        for line in Path(tmp_path, f"rank{rank}.txt").read_text().splitlines():
            epoch, nbytes, *keys = line.split(" ")
            epochs[int(epoch)] += keys
            if rank == 0:
                sent[int(epoch)] = float(nbytes)
    everything = Counter(f"s{i:04d}" for i in range(SHARDS * PER_SHARD))
    assert Counter(epochs[0]) == everything and Counter(epochs[1]) == everything
    # Epoch 1: each rank read the manifest once, and every shard and sidecar came down
    # exactly once for the node (a ranged download's parts add up to the file, no more),
    # whichever of the four readers or their read-ahead asked first.
    first = sent[0] - before - 2 * manifest_bytes
    assert first == sum(f.num_bytes for f in files), (first, sum(f.num_bytes for f in files))
    # Epoch 2, shuffled anew (other readers need other shards): all from the node's cache.
    assert sent[1] == sent[0]
    assert len(os.listdir(next(cache.iterdir()) / "data")) == len(files)
