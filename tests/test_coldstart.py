"""The start of a cold epoch from a bucket: what crosses the network before the first batch.

Counted at the fault proxy in front of the test S3 server (tests/faults.py, no fault
injected), every request of every method: the design says a cold cached epoch asks for
the manifest once (in the process that opens the dataset), then, per shard a reader
opens, its parts (one for these small shards) and its sidecar, nothing else (no HEAD,
no listing); read-ahead starts no download before the reader's own shard has arrived.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from streamload import DatasetWriter, StorageConfig, StreamingDataset
from streamload.batch import RawCollate
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


def test_read_ahead_yields_to_the_readers_own_download(faulty_s3: FaultyS3, dataset: str, tmp_path: Path) -> None:
    """The first shard's download stalls for 1 s: read-ahead asks for no other shard until it has arrived
    (and does read ahead after)."""
    faulty_s3.inject(Fault("stall", match="shard-000000.tar", at=100, seconds=1.0))
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
    arrived = events.index(("end", "shard-000000.tar"))
    own = {"shard-000000.tar", "shard-000000.tar.idx", "shard-000000.idx"}
    others = [
        i
        for i, (event, name) in enumerate(events)
        if event == "start" and name.startswith("shard-") and name not in own
    ]
    assert others, events  # read-ahead did start, after the first shard
    assert min(others) > arrived, events


def test_a_batch_from_a_partly_downloaded_shard_equals_the_batch_from_the_finished_file(
    s3_server: SeaweedS3, faulty_s3: FaultyS3, tmp_path: Path
) -> None:
    """The shard's second part stalls for 3 s: the first batch comes from its first part meanwhile, equal to
    what the verified file gives; the epoch goes on through the stall and caches the whole shard."""
    url = f"s3://{s3_server.make_bucket()}/early"
    count = 100  # ~3 MB in one shard: a first part of 1 MiB, then the rest
    with DatasetWriter(url, format="tar", max_samples=count, storage_options=s3_server.storage_options()) as w:
        for i in range(count):
            w.write({"__key__": f"e{i:04d}", "bin": _payload(i) * 6, "cls": b"0"})
    stall = faulty_s3.inject(Fault("stall", match="shard-000000.tar", range_start=1 << 20, seconds=3.0))[0]

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
    shard_events = [
        e for e, _, path in faulty_s3.proxy.events if "shard-000000.tar?" in path or path.endswith("shard-000000.tar")
    ]
    assert stall.hits == 1
    assert shard_events.count("start") == 2 and shard_events.count("end") == 1, (
        shard_events
    )  # the stalled part is still on its way
    rest = list(batches)
    faulty_s3.proxy.clear()
    finished = list(open_ds(tmp_path))  # the same cache: the verified file, read locally
    got = [(b.keys, [b.tobytes(i) for i in range(len(b))]) for b in [first, *rest]]
    want = [(b.keys, [b.tobytes(i) for i in range(len(b))]) for b in finished]
    assert got == want
    assert got[0][1] == [_payload(i) * 6 for i in range(16)]
