"""A Loader's threads leave a local dataset's open shards at the end of an epoch for the next epoch's.

Beside a thread running Python, an epoch's turn is slow: every step that lets go of the GIL
waits for it, and each shard opened again is such a step. A local dataset's open shards
hold only descriptors and parsed sidecars, so a ``Loader`` keeps them (one
``ReaderKeep`` a thread) and the next epoch's threads read from them; the batches are the
same as a fresh loader's. A cached dataset's readers pin cache space: they are closed at
the end of each epoch, as before. Closing the loader closes what it kept.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from streamload import Loader, StorageConfig, StreamingDataset
from streamload.batch import RawCollate
from streamload.indexing import index_directory
from streamload.shards import ShardSource
from streamload.storage.base import LocalStorage
from tests.helpers.datasets import write_dataset


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_dataset(str(tmp_path_factory.mktemp("keep") / "ds"), "tar", [30, 30, 30], "k")


def _dataset(url: str, **kwargs: Any) -> StreamingDataset:
    return StreamingDataset(url, shuffle=True, seed=3, batch_size=8, collate=RawCollate("txt", keys=True), **kwargs)


def _epochs(loader: Loader, epochs: int) -> list[list[tuple[str, ...]]]:
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out.append([batch.keys for batch in loader])
    return out


def _counting(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(cls, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def _fresh(url: str, epochs: int, threads: int, **kwargs: Any) -> list[list[tuple[str, ...]]]:
    """Each epoch by a loader of its own (nothing kept)."""
    out = []
    for epoch in range(epochs):
        loader = Loader(_dataset(url, **kwargs), threads=threads)
        try:
            out += _epochs_from(loader, epoch)
        finally:
            loader.close()
    return out


def _epochs_from(loader: Loader, epoch: int) -> list[list[tuple[str, ...]]]:
    loader.set_epoch(epoch)
    return [[batch.keys for batch in loader]]


def test_a_loader_opens_each_shard_once_over_its_epochs(local: str, monkeypatch: pytest.MonkeyPatch) -> None:
    opens = _counting(monkeypatch, LocalStorage, "open_in_place")
    loader = Loader(_dataset(local), threads=2)
    try:
        first = _epochs(loader, 1)
        opened = len(opens)
        assert 3 <= opened <= 6  # each thread opens the shards it reads from
        later = [_epochs_from(loader, epoch)[0] for epoch in (1, 2)]
        assert len(opens) == opened  # the next epochs' threads read from the shards kept
    finally:
        loader.close()
    assert first + later == _fresh(local, 3, threads=2)  # the same batches as loaders of their own
    assert len({key for epoch in later for batch in epoch for key in batch}) == 90
    assert later[0] != later[1]  # each epoch its own order


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_closing_a_loader_closes_the_shards_it_kept(local: str) -> None:
    loader = Loader(_dataset(local), threads=2)
    before = _open_descriptors()
    _epochs(loader, 1)
    assert _open_descriptors() > before  # the shards kept for the next epoch
    loader.close()
    assert _open_descriptors() == before
    again = {key for batch in _epochs(loader, 1)[0] for key in batch}
    assert len(again) == 90  # a later iteration opens them again
    loader.close()
    assert _open_descriptors() == before


def test_a_loop_left_early_keeps_nothing(local: str, monkeypatch: pytest.MonkeyPatch) -> None:
    closes = _counting(monkeypatch, ShardSource, "close")
    loader = Loader(_dataset(local), threads=1)
    try:
        for _batch in loader:
            break  # the thread is stopped: its shards are closed, not kept
        assert len(closes) == 1
        assert _epochs(loader, 1)[0]
    finally:
        loader.close()


def test_a_cached_dataset_is_not_kept_between_epochs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = write_dataset(f"memory://streamload-keep-{os.getpid()}", "tar", [20, 20], "m")
    try:
        config = StorageConfig(cache_dir=str(tmp_path / "cache"))
        opens = _counting(monkeypatch, ShardSource, "_open_files")
        loader = Loader(_dataset(url, storage=config), threads=1)
        try:
            got = _epochs(loader, 2)
        finally:
            loader.close()
        assert len(opens) == 4  # both shards opened in each epoch: a cached copy's reader is closed
        assert got == _fresh(url, 2, threads=1, storage=config)
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_a_parquet_dataset_read_in_place_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Parquet reader holds row groups in the process's table cache: closed at each epoch's end, as before."""
    blobs = []
    for i in range(40):
        out = io.BytesIO()
        Image.new("RGB", (4, 4), (i, 0, 0)).save(out, "PNG")
        blobs.append(out.getvalue())
    table = pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array([i % 3 for i in range(40)])})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10)
    index_directory(str(tmp_path), "parquet")

    def epochs(loader: Loader) -> list[list[bytes]]:
        out = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            out.append([bytes(batch.data.numpy()) for batch in loader])
        return out

    def dataset() -> StreamingDataset:
        return StreamingDataset(str(tmp_path), shuffle=True, seed=3, batch_size=8, collate=RawCollate())

    closes = _counting(monkeypatch, ShardSource, "close")
    loader = Loader(dataset(), threads=1)
    try:
        got = epochs(loader)
    finally:
        loader.close()
    assert len(closes) == 2  # each epoch's readers closed when it ended
    fresh = Loader(dataset(), threads=1)
    try:
        assert got == epochs(fresh)
    finally:
        fresh.close()
