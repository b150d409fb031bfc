"""A bad value given to the public API is a ``ConfigError`` at once, naming it.

Not a raw ``TypeError`` at the first iteration, nor a silent acceptance (``seed="3"``);
every valid call keeps working, numpy integers included (and they come back as plain
ints: ``state_dict()`` stays JSON).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamload import StorageConfig, StreamingDataset
from streamload._errors import ConfigError, PlanError
from streamload._validate import check_samples_seen, parse_cache_limit
from streamload.writer import DatasetWriter

SAMPLES = 23


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("validation-ds")
    with DatasetWriter(str(root), max_samples=5) as w:
        for i in range(SAMPLES):
            w.write({"__key__": f"k{i:03d}", "txt": f"{i}".encode()})
    return str(root)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One dataset in memory for the module (a remote writer's lock waits a second to settle)."""
    import fsspec

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STREAMLOAD_CACHE", str(tmp_path_factory.mktemp("validation-cache")))
        url = f"memory://streamload-validation-{os.getpid()}-{time.monotonic_ns()}"
        with DatasetWriter(url, max_samples=5) as w:
            for i in range(SAMPLES):
                w.write({"__key__": f"k{i:03d}", "txt": f"{i}".encode()})
        yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"seed": 1.5}, "seed=1.5 must be an integer"),
    ({"seed": "3"}, "seed='3' must be an integer"),
    ({"seed": True}, "seed=True must be an integer"),
    ({"seed": None}, "seed=None must be an integer"),
    ({"batch_size": 2.5}, "batch_size=2.5 must be an integer"),
    ({"batch_size": "8"}, "batch_size='8' must be an integer"),
    ({"batch_size": 0}, "batch_size=0 must be >= 1"),
    ({"batch_size": -4}, "batch_size=-4 must be >= 1"),
    ({"shuffle_window": 0, "shuffle": True}, "shuffle_window=0 must be >= 1"),
    ({"shuffle_window": 2.5, "shuffle": True}, "shuffle_window=2.5 must be an integer"),
    ({"shuffle_window": "100"}, "shuffle_window='100' must be an integer"),
    ({"shuffle": "no"}, "shuffle='no' must be True or False"),
    ({"drop_last": 1}, "drop_last=1 must be True or False"),
    ({"rank": 2, "world_size": 2}, "rank=2 must be < world_size=2"),
    ({"rank": "0", "world_size": 2}, "rank='0' must be an integer"),
    ({"rank": -1}, "rank=-1 must be >= 0"),
    ({"rank": 0, "world_size": 0}, "world_size=0 must be >= 1"),
    ({"world_size": 2.0}, "world_size=2.0 must be an integer"),
    ({"transform": 3}, "transform=3 must be callable"),
    ({"collate": "stack", "batch_size": 2}, "collate='stack' must be callable"),
    ({"on_error": "ignore"}, "on_error='ignore' must be 'raise' or 'skip'"),
    ({"partitions": 0, "shuffle": True}, "partitions=0 must be >= 1"),
    ({"storage": {"cache_dir": "/tmp"}}, "storage=.* must be a StorageConfig or None"),
]

#: Bad storage settings: a ``ConfigError`` when the :class:`StorageConfig` is made.
BAD_STORAGE: list[tuple[dict[str, Any], str]] = [
    ({"storage_options": [("key", "x")]}, "storage_options=.* must be a mapping"),
    ({"storage_options": "anon=true"}, "storage_options=.* must be a mapping"),
    ({"read_ahead": -1}, "read_ahead=-1 must be >= 0"),
    ({"read_ahead": 1.5}, "read_ahead=1.5 must be an integer"),
    ({"read_ahead": 10_000}, "read_ahead=10000 must be <= 64"),
    ({"cache_limit": "lots"}, "cache_limit='lots' is not a byte size"),
    ({"cache_limit": 0}, "cache_limit=0 must be positive"),
    ({"cache_limit": -5}, "cache_limit=-5 must be >= 0"),
    ({"cache_limit": True}, "cache_limit=True must be a byte count"),
    ({"cache_limit": float("inf")}, "cache_limit=inf must be a byte count"),
    ({"cache_limit": [1]}, r"cache_limit=\[1\] must be a byte count"),
    ({"cache_dir": 3}, "cache_dir=3 must be a path"),
    ({"cache": "disk"}, "cache='disk' must be 'auto'"),
    ({"stream_buffer": 0}, "stream_buffer=0 must be >= 1"),
    ({"stream_buffer": "-1MB"}, "stream_buffer='-1MB'"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[repr(k) for k, _ in BAD])
def test_a_bad_value_is_a_config_error_at_construction(remote: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StreamingDataset(remote, **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[repr(k) for k, _ in BAD])
def test_a_bad_value_is_a_config_error_for_a_local_dataset_too(
    local: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        StreamingDataset(local, **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), BAD_STORAGE, ids=[repr(k) for k, _ in BAD_STORAGE])
def test_a_bad_storage_setting_is_a_config_error_when_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StorageConfig(**kwargs)


def _order(ds: StreamingDataset) -> list[str]:
    return [s["__key__"] for s in ds]


def test_numpy_integers_and_bools_are_accepted_as_plain_values(local: str) -> None:
    plain = StreamingDataset(local, shuffle=True, seed=3, shuffle_window=8, batch_size=4, rank=1, world_size=2)
    numpy = StreamingDataset(
        local,
        shuffle=np.bool_(True),
        seed=np.int64(3),
        shuffle_window=np.int32(8),
        batch_size=np.int64(4),
        rank=np.int64(1),
        world_size=np.int16(2),
        drop_last=np.bool_(False),
    )
    assert _order(numpy) == _order(plain)
    assert type(numpy.seed) is int and type(numpy.shuffle) is bool and type(numpy.rank) is int
    state = numpy.state_dict()
    json.dumps(state)  # plain values only
    numpy.load_state_dict(state)
    numpy.set_epoch(np.int64(5))
    assert numpy.epoch == 5


def test_every_valid_value_keeps_working(local: str, remote: str, tmp_path: Path) -> None:
    for kwargs in (
        {},
        {"seed": -7, "shuffle": True},  # any integer seeds the shuffle
        {"seed": 2**70, "shuffle": True},
        {"batch_size": 1, "drop_last": True},
        {"rank": 0},
        {"world_size": 1},
        {"storage": StorageConfig(storage_options={})},
        {"transform": dict, "on_error": "skip"},
    ):
        assert len(_order(StreamingDataset(local, **kwargs))) == len(StreamingDataset(local, **kwargs)), kwargs
    for limit in ("100MB", " 2GiB ", 10**9, np.int64(10**9), 2.5e9, "unbounded", "UNBOUNDED", None):
        ds = StreamingDataset(
            remote, storage=StorageConfig(cache_dir=str(tmp_path), cache_limit=limit, read_ahead=np.int8(1))
        )
        assert len(_order(ds)) == SAMPLES, limit


@pytest.mark.parametrize("epoch", [1.7, 2**70, -1, True, "2", None, 2**63])
def test_set_epoch_refuses_what_is_no_epoch(local: str, epoch: Any) -> None:
    ds = StreamingDataset(local)
    with pytest.raises(ConfigError, match=r"epoch=.* must be"):
        ds.set_epoch(epoch)


def test_set_epoch_takes_every_epoch_the_counter_holds(local: str) -> None:
    ds = StreamingDataset(local, shuffle=True)
    for epoch in (0, np.int64(3), 2**62, 2**63 - 1):
        ds.set_epoch(epoch)
        assert len(_order(ds)) == SAMPLES and ds.epoch == epoch


@pytest.mark.parametrize("option", ["cache_dir", "cache_limit", "read_ahead", "storage_options", "stream_buffer"])
def test_remote_only_options_warn_for_a_local_dataset(local: str, tmp_path: Path, option: str) -> None:
    value: Any = {
        "cache_dir": str(tmp_path),
        "cache_limit": "1GB",
        "read_ahead": 4,
        "storage_options": {"anon": 1},
        "stream_buffer": "1MB",
    }[option]
    with pytest.warns(UserWarning, match=rf"{option}=.* does nothing for the local dataset") as record:
        ds = StreamingDataset(local, storage=StorageConfig(**{option: value}))
    assert record[0].filename == __file__  # points at the caller
    assert len(_order(ds)) == SAMPLES


def test_no_warning_for_what_is_used(local: str, remote: str, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StreamingDataset(local, storage=StorageConfig(storage_options={}))
        StreamingDataset(
            remote, storage=StorageConfig(cache_dir=str(tmp_path), cache_limit="1GB", read_ahead=0, storage_options={})
        )


def test_parse_cache_limit() -> None:
    assert parse_cache_limit(None) is None
    assert parse_cache_limit("unbounded") == "unbounded"
    assert parse_cache_limit("20GB") == 20 * 10**9
    assert parse_cache_limit(np.uint32(5000)) == 5000
    assert parse_cache_limit(1.5e9) == 1_500_000_000
    with pytest.raises(ConfigError, match="positive"):
        parse_cache_limit("0MB")


# -- samples_seen past the end of the epoch ---------------------------------------------


def test_check_samples_seen_ends_at_the_last_whole_global_batch() -> None:
    # 23 samples, global batch 2 x 4 = 8: padded to three whole steps = 24 items.
    check_samples_seen(24, 24, 2, 8)
    check_samples_seen(0, 24, 2, 8)
    # drop_last: 16 items (two steps); a loop's count ends there exactly
    check_samples_seen(16, 16, 2, 8)
    with pytest.raises(PlanError, match="samples_seen=24 is past the end of the epoch: it ends at 16"):
        check_samples_seen(24, 16, 2, 8)
    with pytest.raises(PlanError, match="samples_seen=26 is past the end.*global batches of 8"):
        check_samples_seen(26, 24, 2, 8)


def test_a_samples_seen_past_the_epoch_is_refused(local: str) -> None:
    ds = StreamingDataset(local, batch_size=4)
    with pytest.raises(PlanError, match="past the end of the epoch"):
        ds.state_dict(samples_seen=10**6)
    state = ds.state_dict(samples_seen=8)
    state["samples_seen"] = 10**6
    with pytest.raises(PlanError, match="past the end of the epoch"):
        ds.load_state_dict(state)
