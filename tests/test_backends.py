"""A storage backend registered from outside the package serves a dataset: written, read, cached, streamed.

The backend here is what a new protocol takes: one class (a subclass of the generic fsspec
backend) and one ``register_backend`` line. Its filesystem is fsspec's in-memory one under
a protocol name of its own, and it counts the ranged GETs the package asks of it.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from streamload import ConfigError, DatasetWriter, StorageConfig, StreamingDataset
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


class NotABackend:
    """A class that is no FsspecBackend."""


@pytest.mark.parametrize(
    ("protocols", "backend", "named"),
    [
        ("nomodule", "streamload_no_such_package.gcs:GcsBackend", "streamload_no_such_package"),
        ("badint", 42, "not 42"),
        (None, CountingBackend, "protocols must be"),
        (["ok", None], CountingBackend, "protocol None"),
        ([], CountingBackend, "protocols is empty"),
        ("bad://", CountingBackend, "protocol 'bad://'"),
        ("file", CountingBackend, "protocol 'file'"),
        ("notsub", NotABackend, "NotABackend is not a subclass of"),
        ("noclass", "streamload.storage.backends.http", "is not 'module:Class'"),
    ],
)
def test_a_bad_registration_is_refused_at_once_naming_the_argument(
    protocols: Any, backend: Any, named: str, tmp_path: Path
) -> None:
    before = registered_backends()
    with pytest.raises(ConfigError, match="register_backend: .*" + re.escape(named)):
        register_backend(protocols, backend)
    assert registered_backends() == before  # nothing half registered; the listing still works
    assert backend_class("testmem://x") is CountingBackend


def test_a_lazily_named_backend_that_cannot_be_had_is_a_config_error_naming_it(tmp_path: Path) -> None:
    register_backend("lazymissing", "streamload.storage.backends.http:NoSuchBackend")
    register_backend("lazynotsub", "streamload.storage.backends.http:FsspecBackend")  # imported there: accepted
    register_backend("lazywrong", "json:JSONDecoder")
    assert backend_class("lazynotsub://b/x").__name__ == "FsspecBackend"
    with pytest.raises(ConfigError, match=r"lazymissing://.*has no 'NoSuchBackend'"):
        StreamingDataset("lazymissing://bucket/ds", storage=StorageConfig(cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"lazywrong://.*not a subclass of FsspecBackend"):
        StreamingDataset("lazywrong://bucket/ds", storage=StorageConfig(cache_dir=str(tmp_path)))
    assert registered_backends()["lazywrong"] == "json:JSONDecoder"
