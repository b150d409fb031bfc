"""The start of a cold epoch from a bucket: what crosses the network before the first batch.

Counted at the fault proxy in front of the test S3 server (tests/faults.py, no fault
injected), every request of every method: the design says a cold cached epoch asks for
the manifest once (in the process that opens the dataset), then, per shard a reader
opens, its parts (one for these small shards) and its sidecar, nothing else (no HEAD,
no listing); read-ahead fetches beside the reader's own download, whose parts go first.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from streamload import DatasetWriter, StorageConfig, StreamingDataset
from streamload.batch import RawCollate
from streamload.storage.bytes import Landing
from streamload.storage.cache import ShardCache
from streamload.storage.executor import LANES, io_executor
from streamload.storage.remote import RemoteStorage
from tests.faults import Fault, FaultyS3
from tests.s3server import SeaweedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SHARDS = 4
PER_SHARD = 40


def _payload(i: int) -> bytes:
    return np.random.default_rng(100 + i).integers(0, 256, 5_000 + 31 * (i % 20), dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def dataset(s3_server: SeaweedS3) -> str:
    url = f"s3://{s3_server.make_bucket()}/coldstart"
    with DatasetWriter(url, format="tar", max_samples=PER_SHARD, storage_options=s3_server.storage_options()) as w:
        for i in range(SHARDS * PER_SHARD):
            w.write({"__key__": f"k{i:04d}", "bin": _payload(i), "cls": b"0"})
    return url


def _requests_before_first_batch(faulty: FaultyS3, ds: Any, workers: int) -> tuple[Counter[str], Any]:
    before = Counter(faulty.proxy.requests)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None)
    it = iter(loader)
    first = next(it)
    seen = Counter(faulty.proxy.requests)
    seen.subtract(before)
    del it
    return +seen, first


def test_a_cold_cached_start_asks_for_the_manifest_a_shard_and_its_sidecar(
    faulty_s3: FaultyS3, dataset: str, tmp_path: Path
) -> None:
    """No read-ahead, no workers: the first batch costs exactly 3 GETs and nothing else."""
    before = Counter(faulty_s3.proxy.requests)
    ds = StreamingDataset(
        dataset,
        storage=StorageConfig(
            storage_options=faulty_s3.storage_options(), cache_dir=str(tmp_path), cache="shards", read_ahead=0
        ),
        batch_size=16,
        collate=RawCollate(field="bin"),
    )
    opened = Counter(faulty_s3.proxy.requests)
    opened.subtract(before)
    assert +opened == Counter({"GET": 1})  # index.json
    seen, first = _requests_before_first_batch(faulty_s3, ds, 0)
    assert len(first) == 16
    assert seen == Counter({"GET": 2}), seen  # the first shard (one part) and its sidecar


def test_read_ahead_runs_beside_the_readers_own_download(faulty_s3: FaultyS3, dataset: str, tmp_path: Path) -> None:
    """The first shard's download stalls for 1.5 s: read-ahead does not leave the link idle meanwhile, the
    next shards arrive during the stall (the reader's own parts still take free slots first, see
    test_parts_of_the_download_a_reader_waits_for_go_first)."""
    faulty_s3.inject(Fault("stall", match="shard-000000.tar", unless=".idx", at=100, seconds=1.5))
    ds = StreamingDataset(
        dataset,
        storage=StorageConfig(
            storage_options=faulty_s3.storage_options(), cache_dir=str(tmp_path), cache="shards", read_ahead=2
        ),
        batch_size=16,
        collate=RawCollate(field="bin"),
    )
    assert sum(len(b) for b in ds) == SHARDS * PER_SHARD
    events = [(event, path.rsplit("/", 1)[-1].split("?")[0]) for event, _, path in faulty_s3.proxy.events]
    # this dataset's own requests: a download an earlier test left running can end after the proxy's reset
    events = events[events.index(("start", "index.json")) :]
    arrived = events.index(("end", "shard-000000.tar"))
    others = [i for i, (event, name) in enumerate(events) if event == "end" and name == "shard-000001.tar"]
    assert others and min(others) < arrived, events


def test_parts_of_the_download_a_reader_waits_for_go_first() -> None:
    """Read-ahead's part lane full: the reader's part starts at once; a read-ahead part waits for a free thread."""
    executor = io_executor()
    release = threading.Event()
    busy = [executor.submit("ahead_parts", release.wait, 10.0) for _ in range(LANES["ahead_parts"])]
    order: list[str] = []
    ahead = executor.submit("ahead_parts", order.append, "ahead")
    time.sleep(0.2)
    assert order == []  # read-ahead waits: its lane is full
    executor.submit("parts", order.append, "own").result(5)
    assert order == ["own"]  # the reader's part did not queue behind it
    release.set()
    ahead.result(5)
    assert order == ["own", "ahead"] and all(f.result(5) for f in busy)


def test_a_download_with_read_ahead_running_cannot_starve(tmp_path: Path) -> None:
    """Every read-ahead lane full and waiting on its parts: a download's own parts still run; nested waits refused."""
    executor = io_executor()
    release = threading.Event()

    def ahead_download() -> bool:  # a read-ahead download: waits on parts of the lane below it
        parts = [executor.submit("ahead_parts", release.wait, 10.0) for _ in range(2)]
        return all(p.result(10) for p in parts)

    downloads = [executor.submit("ahead", ahead_download) for _ in range(LANES["ahead_parts"])]
    own = [executor.submit("parts", lambda i=i: i) for i in range(4 * LANES["ahead_parts"])]
    assert [f.result(5) for f in own] == list(range(4 * LANES["ahead_parts"]))
    release.set()
    assert all(f.result(10) for f in downloads)
    # a task may wait only on lower lanes: one sent to its own lane (which could deadlock it) is refused
    nested = executor.submit("ahead", lambda: executor.submit("ahead", time.sleep, 0).result())
    with pytest.raises(RuntimeError, match="may not start tasks on the 'ahead' lane"):
        nested.result(5)


def test_a_batch_from_a_partly_downloaded_shard_equals_the_batch_from_the_finished_file(
    s3_server: SeaweedS3, faulty_s3: FaultyS3, tmp_path: Path
) -> None:
    """The shard's body stalls for 3 s after its first MiB: the first batch comes from the bytes that landed
    meanwhile, equal to what the verified file gives; the epoch goes on through the stall and caches the
    whole shard."""
    url = f"s3://{s3_server.make_bucket()}/early"
    count = 100  # ~3 MB in one shard, one part
    with DatasetWriter(url, format="tar", max_samples=count, storage_options=s3_server.storage_options()) as w:
        for i in range(count):
            w.write({"__key__": f"e{i:04d}", "bin": _payload(i) * 6, "cls": b"0"})
    shard = f"{url.removeprefix('s3://')}/shard-000000.tar"
    stall = faulty_s3.inject(Fault("stall", match=shard, unless=".idx", at=1 << 20, seconds=3.0))[0]

    def open_ds(cache: Path) -> Any:
        return StreamingDataset(
            url,
            storage=StorageConfig(
                storage_options=faulty_s3.storage_options(), cache_dir=str(cache), cache="shards", read_ahead=0
            ),
            batch_size=16,
            collate=RawCollate(field="bin"),
        )

    batches = iter(open_ds(tmp_path))
    first = next(batches)
    ours = f"/{shard}"  # not another test's shard of that name, still landing
    shard_events = [e for e, _, path in faulty_s3.proxy.events if f"{ours}?" in path or path.endswith(ours)]
    assert stall.hits == 1
    assert shard_events == ["start"], shard_events  # its one GET is still on its way
    rest = list(batches)
    faulty_s3.proxy.clear()
    finished = list(open_ds(tmp_path))  # the same cache: the verified file, read locally
    got = [(b.keys, [b.tobytes(i) for i in range(len(b))]) for b in [first, *rest]]
    want = [(b.keys, [b.tobytes(i) for i in range(len(b))]) for b in finished]
    assert got == want
    assert got[0][1] == [_payload(i) * 6 for i in range(16)]


def test_a_reader_reads_the_parts_another_process_has_landed(
    s3_server: SeaweedS3, faulty_s3: FaultyS3, tmp_path: Path
) -> None:
    """Two readers of one cache want the same cold shard: the one that did not win its download serves its
    first samples from what the other has written so far (the body stalls for 3 s after its first MiB),
    then the verified cached file."""
    url = f"s3://{s3_server.make_bucket()}/follow"
    with DatasetWriter(url, format="tar", max_samples=100, storage_options=s3_server.storage_options()) as w:
        for i in range(100):
            w.write({"__key__": f"f{i:04d}", "bin": _payload(i) * 6, "cls": b"0"})
    ds = StreamingDataset(url, storage=StorageConfig(storage_options=faulty_s3.storage_options(), cache="shards"))
    entry = ds.manifest.shards[0]
    want = s3_server.filesystem().cat_file(f"{url.removeprefix('s3://')}/{entry.name}")
    faulty_s3.inject(
        Fault("stall", match=f"{url.removeprefix('s3://')}/{entry.name}", unless=".idx", at=1 << 20, seconds=3.0)
    )
    # Two storages on one cache directory: the download lock and the progress they share are the
    # cache's (flock and files), as between two DataLoader workers.
    config = StorageConfig(storage_options=faulty_s3.storage_options(), cache_dir=str(tmp_path), read_ahead=0)
    first, second = (RemoteStorage(url, config.resolve()) for _ in range(2))
    try:
        downloading = first.open_bytes(entry, early=True)
        assert isinstance(downloading, Landing)
        assert downloading.pread(1000, 5000) == want[5000:6000]  # landed in the first process
        began = time.monotonic()
        following = second.open_bytes(entry, early=True)
        assert isinstance(following, Landing)
        assert following.pread(1000, 5000) == want[5000:6000]
        assert time.monotonic() - began < 2.0, "the second reader waited for the whole file"
        assert not following.done  # the body is still stalled: those bytes came from the first's part file
        assert following.pread(2000, len(want) - 2000) == want[-2000:]  # the rest, once it lands
        assert following.wait_done() == downloading.wait_done()
        assert first.stats.downloads + second.stats.downloads == 1
    finally:
        for storage in (first, second):
            storage.release(entry)
            storage.close()


def test_a_landing_record_never_points_outside_the_cache(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path / "c"), None)
    cache.publish_landing("a.tar", str(tmp_path / "c" / "tmp" / "a.tar.10.1.ab.part"), 1, [(0, 5)])
    assert cache.read_landing("a.tar") == (str(tmp_path / "c" / "tmp" / "a.tar.10.1.ab.part"), 1, [(0, 5)])
    for bad in ("../../etc/passwd", "b.tar.10.1.ab.part", "a.tar.10.1.ab", "a.tar/../../x.part"):
        Path(cache.folder.landing_path("a.tar")).write_text(json.dumps({"part": bad, "attempt": 1, "landed": [[0, 5]]}))
        assert cache.read_landing("a.tar") is None, bad
    Path(cache.folder.landing_path("a.tar")).write_text("not json")
    assert cache.read_landing("a.tar") is None
    cache.clear_landing("a.tar")
    assert cache.read_landing("a.tar") is None


def _recorded_landing(name: str, size: int, seed: int, lead: int) -> tuple[Landing, bytes, list[tuple[int, int]]]:
    """A landing over ``size`` random bytes whose ranged GETs are recorded; its data and the GETs asked."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    asked: list[tuple[int, int]] = []

    def get(start: int, end: int) -> bytes:
        asked.append((start, end))
        return data[start:end]

    return Landing(name, len(data), get, lead=lead), data, asked


def _write_shard(s3_server: SeaweedS3, prefix: str, count: int, size: int) -> str:
    """One tar shard of ``count`` samples of ``size`` bytes (key ``<prefix[0]><i>``, each byte ``i % 251``); its URL."""
    url = f"s3://{s3_server.make_bucket()}/{prefix}"
    with DatasetWriter(url, format="tar", max_samples=count, storage_options=s3_server.storage_options()) as w:
        for i in range(count):
            payload = np.full(size, i % 251, dtype=np.uint8).tobytes()
            w.write({"__key__": f"{prefix[0]}{i:04d}", "bin": payload, "cls": b"0"})
    return url


def _cold_shuffled(url: str, faulty: FaultyS3, cache: Path) -> Any:
    """The shard read shuffled in batches of 16 (keys kept) through the fault proxy, on a cold cache, no read-ahead."""
    return StreamingDataset(
        url,
        storage=StorageConfig(
            storage_options=faulty.storage_options(), cache_dir=str(cache), cache="shards", read_ahead=0
        ),
        batch_size=16,
        collate=RawCollate(field="bin", keys=True),
        shuffle=True,
        seed=3,
    )


def test_wanted_ranges_past_the_lead_are_read_before_the_download_lands_them(tmp_path: Path) -> None:
    """A landing serves wanted ranges from their own GETs (nothing landed yet), leaves the lead to the download."""
    landing, data, asked = _recorded_landing("x.tar", 200_000, 5, lead=1_000)
    part = tmp_path / "x.part"
    part.write_bytes(b"")
    landing.begin(str(part))
    landing.want([(5_000, 5_200), (5_300, 5_400), (120_000, 120_500), (100, 900), (0, 0)])
    assert landing.pread(100, 5_250) == data[5_250:5_350]  # nothing has landed: from the wanted GET
    out = bytearray(300)
    assert landing.preadv([memoryview(out)[:100], memoryview(out)[100:]], 120_100) == 300
    assert bytes(out) == data[120_100:120_400]
    assert sorted(asked) == [(5_000, 5_400), (120_000, 120_500)]  # close ones together; the lead's left alone
    landing.want([(5_000, 5_100)])
    assert len(asked) == 2  # wanted already: no second GET
    waiting = io_executor().submit("side", landing.pread, 100, 500)  # in the lead: it waits for the download
    time.sleep(0.2)
    assert not waiting.done()
    part.write_bytes(data)
    landing.land(0, len(data))
    assert waiting.result(5) == data[500:600]
    landing.finish(str(part))
    landing.want([(150_000, 150_100)])
    assert len(asked) == 2 and landing.pread(100, 5_250) == data[5_250:5_350]  # cached: from the file
    landing.close()


def test_a_cold_shuffled_first_batch_does_not_wait_for_the_parts_holding_its_samples(
    s3_server: SeaweedS3, faulty_s3: FaultyS3, tmp_path: Path
) -> None:
    """A 12 MB shard whose part past the first 8 MB stalls for 4 s: the shuffled first batch, some of its
    samples in that part, is read meanwhile (its samples by ranged GETs of their own), as the epoch after it."""
    from streamload.storage.parts import FIRST_PART

    count, size = 600, 20_000
    url = _write_shard(s3_server, "wanted", count, size)
    shard = f"{url.removeprefix('s3://')}/shard-000000.tar"
    (stall,) = faulty_s3.inject(
        Fault("stall", match=shard, unless=".idx", range_start=FIRST_PART, at=200_000, seconds=4.0, times=5)
    )
    batches = iter(_cold_shuffled(url, faulty_s3, tmp_path))
    first = next(batches)
    late = [int(key[1:]) for key in first.keys if int(key[1:]) * (size + 1024) > FIRST_PART]
    assert late, first.keys  # (the seed puts samples past the first 8 MB in the first batch)
    assert stall.stalled == 0  # the part holding them is still stalled (or not asked for yet)
    assert [first.tobytes(k) for k in range(16)] == [bytes([int(key[1:]) % 251]) * size for key in first.keys]
    seen = [*first.keys] + [key for batch in batches for key in batch.keys]
    assert sorted(set(seen)) == [f"w{i:04d}" for i in range(count)] and len(seen) == 38 * 16  # (padded)
    assert stall.hits == 1 and stall.stalled == 1


def test_wanted_ranges_held_stay_within_their_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the budget a wanted range is left to the download; ranges the download has landed free their room."""
    from streamload.storage import bytes as shard_bytes

    monkeypatch.setattr(shard_bytes, "WANT_BUDGET", 250_000)
    landing, data, asked = _recorded_landing("y.tar", 1_000_000, 6, lead=0)
    part = tmp_path / "y.part"
    part.write_bytes(data)  # (written; landed only when said so)
    landing.begin(str(part))
    landing.want([(0, 100_000), (200_000, 300_000), (400_000, 500_000)])  # the third is past the budget
    assert landing.pread(10, 5) == data[5:15] and landing.pread(10, 200_000) == data[200_000:200_010]
    assert sorted(asked) == [(0, 100_000), (200_000, 300_000)]
    landing.land(0, 300_000)  # the download caught up: those GETs' bytes are not needed any more
    landing.want([(400_000, 500_000), (600_000, 700_000)])
    assert landing.pread(10, 450_000) == data[450_000:450_010]
    assert landing.pread(10, 650_000) == data[650_000:650_010]
    assert sorted(asked)[2:] == [(400_000, 500_000), (600_000, 700_000)]
    landing.land(0, len(data))
    landing.finish(str(part))
    landing.close()


def test_the_same_long_range_wanted_twice_is_fetched_once(tmp_path: Path) -> None:
    """A Parquet row group's extent comes once per sample read from it: one GET, not one per sample."""
    landing, data, asked = _recorded_landing("z.parquet", 4 << 20, 7, lead=0)
    group = (100, 3_000_100)  # longer than a GET of nearby samples may grow
    landing.want([group, group, (1_000, 2_000), group])
    assert landing.pread(10, 2_000_000) == data[2_000_000:2_000_010]
    assert asked == [(100, 3_000_100)]
    landing.fail(OSError("no download in this test"))
    landing.close()


def test_a_sample_damaged_on_its_own_get_is_read_again_from_the_verified_file(
    s3_server: SeaweedS3, faulty_s3: FaultyS3, tmp_path: Path
) -> None:
    """A wanted range's GET flips bytes of a sample: its digest fails, and the shard is not condemned as bad at
    its source (its download was verified at once): the sample is read again from the cached file."""
    from streamload.formats import get_format
    from streamload.storage.parts import FIRST_PART

    count, size = 600, 20_000
    url = _write_shard(s3_server, "flipped", count, size)

    # Where the first batch's wanted GETs start: its samples past the download's lead, alone within 64 KiB.
    ds = _cold_shuffled(url, faulty_s3, tmp_path / "plain")
    first = next(iter(list(ds))).keys  # (the whole epoch: the shard is cached after it)
    entry = ds.manifest.shards[0]
    data = next(p for p in (tmp_path / "plain").rglob(entry.name) if p.parent.name == "data")
    reader = get_format("tar").open_reader(str(data), entry, str(data.with_name(entry.sidecar.name)))
    starts = sorted(int(reader.sample_extents(np.array([int(k[1:])]))[0][0]) for k in first)
    reader.close()
    gaps = zip(starts, [-(1 << 30), *starts[:-1]], strict=True)
    alone = [a for a, before in gaps if a > FIRST_PART and a - before > 1 << 17]
    assert alone, starts  # (the seed puts one there)
    shard = f"{url.removeprefix('s3://')}/{entry.name}"
    flip, _ = faulty_s3.inject(
        Fault("flip", match=shard, unless=".idx", range_start=alone[0], at=5_000, count=4),  # (in its data)
        Fault("stall", match=shard, unless=".idx", range_start=FIRST_PART, at=200_000, seconds=2.0, times=5),
    )
    seen = []
    for batch in _cold_shuffled(url, faulty_s3, tmp_path / "flipped"):
        assert [batch.tobytes(k) for k in range(len(batch))] == [
            bytes([int(key[1:]) % 251]) * size for key in batch.keys
        ]
        seen += batch.keys
    assert sorted(set(seen)) == [f"f{i:04d}" for i in range(count)]
    assert flip.hits == 1
