"""A storage backend registered from outside the package serves a dataset: written, read, cached, streamed.

The backend here is what a new protocol takes: one class (a subclass of the generic fsspec
backend) and one ``register_backend`` line. Its filesystem is fsspec's in-memory one under
a protocol name of its own, and it counts the ranged GETs the package asks of it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from streamload import DatasetWriter, StorageConfig, StreamingDataset
from streamload.storage.backends import backend_class, register_backend, registered_backends
from streamload.storage.backends.fsspec import FsspecBackend
from streamload.storage.cachedir import dataset_cache_key

_NAMES = itertools.count()


class _TestMemory(MemoryFileSystem):
    """fsspec's memory filesystem under the protocol ``testmem``, with a store of its own."""

    protocol = ("testmem",)
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return MemoryFileSystem._strip_protocol(str(path).removeprefix("testmem://"))


class CountingBackend(FsspecBackend):
    """A backend of another package: its own filesystem, its ranged GETs counted, its endpoint in the cache key."""

    ranged: ClassVar[list[tuple[str, int, int]]] = []

    @classmethod
    def filesystem_class(cls, url: str) -> Any:
        return _TestMemory

    @classmethod
    def cache_endpoint(cls, options: Any) -> str | None:
        return str(options.get("region", "default-region"))

    def get_range(self, path: str, url: str, start: int, end: int) -> bytes:
        self.ranged.append((path.rsplit("/", 1)[-1], start, end))
        return super().get_range(path, url, start, end)


register_backend("testmem", CountingBackend)


@pytest.fixture
def testmem_dataset() -> str:
    url = f"testmem://data-{next(_NAMES)}"
    with DatasetWriter(url, max_samples=5) as writer:
        for i in range(23):
            writer.write({"__key__": f"k{i:03d}", "txt": f"sample {i}".encode()})
    return url


def test_a_registered_backend_serves_a_dataset_it_wrote(testmem_dataset: str, tmp_path: Path) -> None:
    assert backend_class(testmem_dataset) is CountingBackend
    assert registered_backends()["testmem"].endswith(":CountingBackend")
    CountingBackend.ranged.clear()
    ds = StreamingDataset(testmem_dataset, storage=StorageConfig(cache_dir=str(tmp_path), cache="shards"))
    assert [s["txt"] for s in ds] == [f"sample {i}".encode() for i in range(23)]
    files = {name for name, _, _ in CountingBackend.ranged}
    assert "index.json" in files and any(name.endswith(".tar") for name in files)  # every byte came through it
    # its cache key names its endpoint: two regions never share a cache
    assert dataset_cache_key(testmem_dataset, {"region": "a"}) != dataset_cache_key(testmem_dataset, {"region": "b"})


def test_a_registered_backend_streams_by_ranges(testmem_dataset: str, tmp_path: Path) -> None:
    CountingBackend.ranged.clear()
    ds = StreamingDataset(
        testmem_dataset, storage=StorageConfig(cache_dir=str(tmp_path), cache="none"), shuffle=True, seed=3
    )
    assert sorted(s["txt"] for s in ds) == sorted(f"sample {i}".encode() for i in range(23))
    shard_reads = [(start, end) for name, start, end in CountingBackend.ranged if name.endswith(".tar")]
    assert shard_reads  # the samples' bytes came by its ranged GETs
    cached = [p.name for p in tmp_path.glob("*/data/*")]
    assert cached and all(name.endswith(".idx") for name in cached)  # only sidecars went to the cache
