"""``StorageConfig``: the storage settings as one checked object, and the old keywords' deprecation.

``StreamingDataset``, ``Stream``, ``ShardedDataset`` and the Lightning
data module take ``storage=StorageConfig(...)``; each setting is checked once, when the
object is made; the old keywords (``storage_options=``, ``cache_dir=``...) still work for
one release with one ``DeprecationWarning`` per call, and mixing both forms is an error.
The remote datasets here are fsspec ``memory://`` URLs: read through the real cache.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamload import ConfigError, ShardedDataset, StorageConfig, Stream, StreamingDataset
from streamload._validate import DatasetArgs, dataset_args
from streamload.writer import DatasetWriter
from tests.helpers.datasets import without_lock_settle

SAMPLES = 23


def _write(url: str, tag: str) -> str:
    with DatasetWriter(url, max_samples=5) as writer:
        for i in range(SAMPLES):
            writer.write({"__key__": f"{tag}{i:03d}", "txt": f"{tag}{i}".encode()})
    return url


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(str(tmp_path_factory.mktemp("settings-ds")), "l")


@pytest.fixture
def remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import fsspec

    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default-cache"))
    with without_lock_settle():
        url = _write(f"memory://streamload-settings-{os.getpid()}-{time.monotonic_ns()}", "r")
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def _keys(ds: Any) -> list[str]:
    return [s["__key__"] for s in ds]


def _cached(cache: Path) -> set[str]:
    """The file suffixes in a cache's ``data/`` folders (``.tar``, ``.idx``)."""
    return {Path(f).suffix for root, _, files in os.walk(cache) if os.path.basename(root) == "data" for f in files}


# -- the object --------------------------------------------------------------------------


def test_each_field_is_checked_and_normalized_when_made(tmp_path: Path) -> None:
    options = {"anon": True}
    storage = StorageConfig(
        storage_options=options,
        cache_dir=tmp_path,  # a PathLike: kept as a str
        cache_limit="20GB",
        read_ahead=np.int8(3),  # type: ignore[arg-type]  # numpy integers are accepted
        cache="none",
        stream_buffer="128MB",
    )
    options["anon"] = False  # the object keeps its own copy
    assert storage.storage_options == {"anon": True} and storage.options == {"anon": True}
    assert storage.cache_dir == str(tmp_path) and type(storage.cache_dir) is str
    assert storage.cache_limit == 20 * 10**9
    assert storage.read_ahead == 3 and type(storage.read_ahead) is int
    assert storage.stream_buffer == 128 * 10**6
    assert StorageConfig(cache_limit="UNBOUNDED").cache_limit == "unbounded"
    with pytest.raises(dataclasses.FrozenInstanceError):
        storage.cache = "shards"  # type: ignore[misc]
    # None everywhere: the reader's defaults
    assert StorageConfig().settings() == dict.fromkeys(
        (
            "storage_options",
            "cache_dir",
            "cache_limit",
            "read_ahead",
            "cache",
            "stream_buffer",
            "lock_timeout",
            "allow_data_roots",
            "retry_timeout",
            "read_timeout",
            "s3_direct",
            "parquet_cache",
            "cache_shared",
        )
    )


def test_the_tuning_fields_are_checked_and_reach_the_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload.formats import set_row_group_cache_bytes
    from streamload.formats import table_cache as row_groups
    from streamload.storage.remote import RemoteStorage

    config = StorageConfig(
        cache_dir=str(tmp_path),
        retry_timeout=5,
        read_timeout=2.5,
        s3_direct=False,
        parquet_cache="2MB",
        cache_shared=True,
    )
    fields = (config.retry_timeout, config.read_timeout, config.s3_direct, config.parquet_cache, config.cache_shared)
    assert fields == (5.0, 2.5, False, 2_000_000, True)
    storage = config.open("s3://bucket/tuned", {"anon": True})
    assert isinstance(storage, RemoteStorage)
    try:
        files = storage._remote
        assert (files.retry.timeout, files.retry.inactivity_timeout) == (5.0, 2.5)
        assert files.direct is None  # s3_direct=False: shard bytes through s3fs
        assert storage.cache.shared is True
        assert row_groups.CACHE.budget == 2_000_000  # the Parquet readers' budget in this process
    finally:
        storage.close()
        set_row_group_cache_bytes(None)
    # left None, each takes the environment's default
    monkeypatch.setenv("STREAMLOAD_RETRY_TIMEOUT", "7")
    monkeypatch.setenv("STREAMLOAD_S3_DIRECT", "0")
    monkeypatch.setenv("STREAMLOAD_CACHE_SHARED", "1")
    storage = StorageConfig(cache_dir=str(tmp_path)).open("s3://bucket/tuned", {"anon": True})
    assert isinstance(storage, RemoteStorage)
    try:
        assert storage._remote.retry.timeout == 7.0 and storage._remote.direct is None and storage.cache.shared
    finally:
        storage.close()
    for bad, message in [
        ({"retry_timeout": -1}, "retry_timeout=-1 must be >= 0"),
        ({"read_timeout": 0}, "read_timeout=0 must be > 0"),
        ({"read_timeout": "slow"}, "read_timeout='slow' must be a number of seconds"),
        ({"s3_direct": "yes"}, "s3_direct='yes' must be True, False or None"),
        ({"parquet_cache": "lots"}, "parquet_cache='lots' is not a byte size"),
        ({"cache_shared": 1}, "cache_shared=1 must be True, False or None"),
    ]:
        with pytest.raises(ConfigError, match=message):
            StorageConfig(**bad)


def test_the_defaults_are_applied_once_and_the_resolved_settings_passed_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``resolve()`` applies the environment's defaults; the storage opened with its result reads no environment."""
    from streamload.storage import StorageSettings, open_storage
    from streamload.storage.remote import RemoteStorage

    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "env-cache"))
    monkeypatch.setenv("STREAMLOAD_RETRY_TIMEOUT", "7")
    monkeypatch.setenv("STREAMLOAD_READ_TIMEOUT", "3")
    monkeypatch.setenv("STREAMLOAD_S3_DIRECT", "0")
    monkeypatch.setenv("STREAMLOAD_CACHE_SHARED", "1")
    config = StorageConfig(read_timeout=2.5, cache_limit="1GB")
    settings = config.resolve({"anon": True})
    assert settings == StorageSettings(
        cache_dir=str(tmp_path / "env-cache"),
        storage_options={"anon": True},
        cache_limit=10**9,
        read_ahead=8,
        lock_timeout=600.0,
        retry_timeout=7.0,  # the environment's
        read_timeout=2.5,  # given: wins over the environment
        s3_direct=False,
        cache_shared=True,
    )
    assert config.read_ahead is None and config.cache_dir is None  # the object asked for is unchanged
    # Below StorageConfig, nothing reads the environment: changed now, the storage keeps the resolved values.
    for name, value in [
        ("STREAMLOAD_CACHE", str(tmp_path / "other")),
        ("STREAMLOAD_RETRY_TIMEOUT", "99"),
        ("STREAMLOAD_READ_TIMEOUT", "not seconds"),  # never read again: no error
        ("STREAMLOAD_S3_DIRECT", "1"),
        ("STREAMLOAD_CACHE_SHARED", "0"),
    ]:
        monkeypatch.setenv(name, value)
    storage = open_storage("s3://bucket/resolved", settings)
    assert isinstance(storage, RemoteStorage)
    try:
        files = storage._remote
        assert (files.retry.timeout, files.retry.inactivity_timeout, files.direct) == (7.0, 2.5, None)
        assert storage.cache.shared and storage.cache_root.startswith(str(tmp_path / "env-cache"))
        assert storage.limit == 10**9 and storage.read_ahead == 8
    finally:
        storage.close()
    # The storage takes the resolved object whole: no setting unpacked into keywords on the way.
    assert list(inspect.signature(open_storage).parameters) == ["url", "settings"]
    assert list(inspect.signature(RemoteStorage).parameters)[:2] == ["url", "settings"]
    with pytest.raises(ConfigError, match="STREAMLOAD_READ_TIMEOUT"):
        StorageConfig().resolve()  # resolving again reads the environment as it is now


def test_a_stream_fills_its_unset_settings_from_the_dataset(remote: str, tmp_path: Path) -> None:
    dataset = StorageConfig(storage_options={"skip_instance_cache": False}, cache_dir=str(tmp_path), read_ahead=2)
    mine = StorageConfig(read_ahead=0, storage_options={})
    assert mine.with_defaults(dataset) == StorageConfig(storage_options={}, cache_dir=str(tmp_path), read_ahead=0)
    ds = StreamingDataset([Stream(remote, storage=mine), Stream(remote, name="plain")], storage=dataset)
    first, second = (ref.config for ref in ds.streams.refs)
    assert (first.cache_dir, first.read_ahead, first.storage_options, first.cache) == (str(tmp_path), 0, {}, "auto")
    assert (second.read_ahead, second.storage_options) == (2, {"skip_instance_cache": False})


def test_the_default_cache_mode_is_the_readers(local: str) -> None:
    assert StreamingDataset(local).storage.cache == "auto"  # training streams when it must
    assert StreamingDataset(local, storage=StorageConfig(cache="shards")).storage.cache == "shards"
    assert ShardedDataset(local).storage.cache == "shards"  # random access reads whole shards
    assert ShardedDataset(local, storage=StorageConfig(cache="auto")).storage.cache == "shards"
    with pytest.raises(ConfigError, match="ShardedDataset reads whole shards.*cache='none'"):
        ShardedDataset(local, storage=StorageConfig(cache="none"))


def test_a_stream_may_stream_while_the_other_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stream's cache mode is its own: the streamed one caches sidecars only, the other whole shards."""
    import fsspec

    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default-cache"))
    base = f"memory://streamload-settings-mix-{os.getpid()}-{time.monotonic_ns()}"
    a, b = _write(f"{base}/a", "a"), _write(f"{base}/b", "b")
    try:
        streams = [
            Stream(a, storage=StorageConfig(cache_dir=str(tmp_path / "a"), cache="none")),
            Stream(b, storage=StorageConfig(cache_dir=str(tmp_path / "b"))),
        ]
        ds = StreamingDataset(streams, storage=StorageConfig(cache="shards"))
        keys = _keys(ds)
        assert sorted(keys) == sorted([f"a{i:03d}" for i in range(SAMPLES)] + [f"b{i:03d}" for i in range(SAMPLES)])
        assert _cached(tmp_path / "a") == {".idx"}
        assert ".tar" in _cached(tmp_path / "b")
    finally:
        fsspec.filesystem("memory").rm(base.removeprefix("memory://"), recursive=True)


def test_stream_buffer_is_the_datasets_not_a_streams(remote: str) -> None:
    with pytest.raises(ConfigError, match=r"stream_buffer=1000 is the dataset's budget"):
        Stream(remote, storage=StorageConfig(stream_buffer=1000))


def test_dataset_args_are_named() -> None:
    args = dataset_args({"seed": np.int64(3), "shuffle": np.bool_(True), "partitions": np.int16(4)})
    assert isinstance(args, DatasetArgs)
    assert (args.seed, args.shuffle, args.partitions, args.on_error, args.batch_size) == (3, True, 4, "raise", None)
    assert type(args.seed) is int and type(args.partitions) is int


# -- the old keywords -------------------------------------------------------------------


def _one_deprecation(record: pytest.WarningsRecorder) -> str:
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    assert deprecations[0].filename == __file__  # points at the caller
    return str(deprecations[0].message)


def test_the_old_keywords_still_work_and_warn_once(remote: str, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    with pytest.warns(DeprecationWarning) as record:
        old = StreamingDataset(remote, cache_dir=cache, cache_limit="1GB", read_ahead=1, cache="shards", shuffle=True)
    message = _one_deprecation(record)
    assert "StreamingDataset(cache_dir=, cache_limit=, read_ahead=, cache=)" in message
    assert "storage=StorageConfig(cache_dir=..., cache_limit=..., read_ahead=..., cache=...)" in message
    new = StreamingDataset(
        remote,
        storage=StorageConfig(cache_dir=cache, cache_limit="1GB", read_ahead=1, cache="shards"),
        shuffle=True,
    )
    assert old.storage == new.storage and _keys(old) == _keys(new)


def test_the_old_keywords_of_stream_and_sharded_dataset_warn(remote: str, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    with pytest.warns(DeprecationWarning) as record:
        stream = Stream(remote, weight=1.0, cache_dir=cache, read_ahead=0)
    assert "Stream(cache_dir=, read_ahead=)" in _one_deprecation(record)
    assert stream.storage == StorageConfig(cache_dir=cache, read_ahead=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert dataclasses.replace(stream, weight=2.0).storage == stream.storage  # no old keyword given again
    with pytest.warns(DeprecationWarning) as record:
        access = ShardedDataset(remote, cache_dir=cache, cache_limit="1GB")
    assert "ShardedDataset(cache_dir=, cache_limit=)" in _one_deprecation(record)
    assert access.storage == StorageConfig(cache_dir=cache, cache_limit="1GB", cache="shards")
    assert access[3]["__key__"] == "r003"
    # What they never took is still no keyword of theirs.
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache'"):
        ShardedDataset(remote, cache="none")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="cache"):
        Stream(remote, cache="none")  # type: ignore[call-arg]


def test_the_old_keywords_of_the_lightning_module_warn(local: str, remote: str, tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    from streamload.lightning import StreamingDataModule

    with pytest.warns(DeprecationWarning) as record:
        dm = StreamingDataModule(local, dataset_options={"cache_dir": str(tmp_path), "drop_last": True})
    assert "StreamingDataModule(cache_dir=) is deprecated" in _one_deprecation(record)
    assert dm.storage == StorageConfig(cache_dir=str(tmp_path)) and dm.dataset_options == {"drop_last": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        dm = StreamingDataModule(remote, storage=StorageConfig(read_ahead=0), batch_size=4)
        dm.setup("fit")
    assert dm.datasets["train"].storage == StorageConfig(read_ahead=0, cache="auto")
    with pytest.raises(ConfigError, match="not both"):
        StreamingDataModule(local, storage=StorageConfig(), dataset_options={"read_ahead": 0})
    with pytest.raises(ConfigError, match=r"may not set \['storage'\]"):
        StreamingDataModule(local, dataset_options={"storage": StorageConfig()})


def test_an_old_keyword_with_the_object_is_an_error(local: str, remote: str) -> None:
    with pytest.raises(ConfigError, match=r"StreamingDataset\(\): pass storage=StorageConfig\(...\) or .*cache_dir="):
        StreamingDataset(local, storage=StorageConfig(), cache_dir="/tmp")
    with pytest.raises(ConfigError, match="not both"):
        Stream(remote, storage=StorageConfig(), storage_options={})
    with pytest.raises(ConfigError, match="not both"):
        ShardedDataset(local, storage=StorageConfig(), read_ahead=0)


def test_an_old_keyword_is_checked_like_the_field(local: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the bad value fails before any warning
        with pytest.raises(ConfigError, match="cache_limit=0 must be positive"):
            StreamingDataset(local, cache_limit=0)
        with pytest.raises(ConfigError, match="cache='disk' must be 'auto'"):
            StreamingDataset(local, cache="disk")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="read_ahead=-1 must be >= 0"):
            Stream(local, read_ahead=-1)
        # None is "not given": no warning, the defaults
        assert StreamingDataset(local, cache_dir=None, cache=None).storage == StorageConfig(cache="auto")
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_size'"):
        StreamingDataset(local, cache_size=3)  # type: ignore[call-arg]


def test_each_setting_is_checked_in_one_place() -> None:
    """``cache``, ``stream_buffer``, ``cache_limit`` and ``on_error`` of a reader: one check each, in the package."""
    root = Path(__file__).resolve().parent.parent / "streamload"
    sources = {p: p.read_text(encoding="utf-8") for p in root.rglob("*.py") if "converters" not in p.parts}
    checks = ("parse_cache_mode(", "parse_stream_buffer(", "check_storage_options(", "check_cache_dir(")
    for check in (*checks, "parse_cache_limit(", "check_read_ahead("):
        calls = [str(p.relative_to(root)) for p, text in sources.items() for _ in range(text.count(check))]
        assert calls == ["_validate.py", "storageconfig.py"], (check, calls)  # its definition, and StorageConfig
    # the storage below takes the checked values: it checks read_ahead and cache_limit no second time
    again = [str(p.relative_to(root)) for p, text in sources.items() if 'check_int("read_ahead"' in text]
    assert again == [], again
    on_error = [str(p.relative_to(root)) for p, text in sources.items() if "must be 'raise' or 'skip'" in text]
    assert on_error == ["_validate.py"]  # dataset_args
