"""A cold shuffled reader fetches, at once, the shards its first batches draw on, in the order it reads them.

The dataset is read from a ``memory://`` bucket through the shard cache; every read-ahead
window the storage is given is recorded (a wrapper around the real method, which still
runs) and compared with the shards the reader actually went through, taken from the
samples it yielded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from streamload import StorageConfig, StreamingDataset
from streamload.manifest import FileEntry
from streamload.storage.remote import RemoteStorage
from streamload.writer import DatasetWriter

pytestmark = pytest.mark.timeout(60)

SHARDS, PER_SHARD, BATCH = 6, 8, 8


def _payload(i: int) -> bytes:
    return f"<{i:03d}>".encode() * 50


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    url = f"memory://streamload-cold-ahead-{os.getpid()}-{time.monotonic_ns()}"
    with DatasetWriter(url, max_samples=PER_SHARD) as w:
        for i in range(SHARDS * PER_SHARD):
            w.write({"__key__": f"k{i:03d}", "txt": _payload(i)})
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], set[str]]]:
    """Record every ``(window, together)`` given to ``RemoteStorage.fetch_ahead`` (the real method still runs)."""
    calls: list[tuple[list[str], set[str]]] = []
    real = RemoteStorage.fetch_ahead

    def prefetch(self: RemoteStorage, entries: Iterable[FileEntry], together: Iterable[str] = ()) -> None:
        wanted, now = list(entries), list(together)
        calls.append(([e.name for e in wanted], set(now)))
        real(self, wanted, now)

    monkeypatch.setattr(RemoteStorage, "fetch_ahead", prefetch)
    return calls


def _shards_in_reading_order(keys: list[str]) -> list[int]:
    """The shards of ``keys`` in the order they were read, consecutive repeats merged."""
    out: list[int] = []
    for key in keys:
        shard = int(key[1:]) // PER_SHARD
        if not out or out[-1] != shard:
            out.append(shard)
    return out


def _files(shards: list[int]) -> list[str]:
    return [name for s in shards for name in (f"shard-{s:06d}.tar.idx", f"shard-{s:06d}.tar")]


def test_a_cold_shuffled_reader_names_its_working_set_at_once_in_reading_order(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _recorded(monkeypatch)
    storage = StorageConfig(cache_dir=tmp_path / "shuffled", read_ahead=8)
    ds = StreamingDataset(memory_url, shuffle=True, seed=7, batch_size=BATCH, storage=storage)
    keys = [str(sample["__key__"]) for sample in ds]
    assert sorted(set(keys)) == [f"k{i:03d}" for i in range(SHARDS * PER_SHARD)]  # every sample, once at least
    order = _shards_in_reading_order(keys)
    # The reader comes back to a shard within its first batch: the shards before that are read together.
    back = next(i for i, s in enumerate(order) if s in order[:i])
    working = order[1:back]
    assert len(working) >= 3, order
    window, together = calls[0]  # named as the reader opened its first shard, before anything was read
    assert window[: len(_files(working))] == _files(working)  # in the order the reader reads them
    assert together == set(_files(working))

    calls.clear()  # unshuffled, each shard is left for good: nothing is named as read together
    storage = StorageConfig(cache_dir=tmp_path / "in-order", read_ahead=8)
    keys = [str(sample["__key__"]) for sample in StreamingDataset(memory_url, batch_size=BATCH, storage=storage)]
    assert _shards_in_reading_order(keys) == list(range(SHARDS))
    assert calls and all(not together for _, together in calls)
    assert calls[0][0][:2] == _files([1])  # the next shard, its sidecar first
