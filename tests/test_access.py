"""Random access: ShardedDataset by index, slice and key, for every format, local and through S3.

The reference is what StreamingDataset iterates (no shuffle: manifest order), so ``ds[i]``
must be exactly the ``i``-th iterated sample, in every format and storage.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader, DistributedSampler

from streamload import SampleNotFoundError, SampleView, ShardedDataset, StorageConfig, StreamingDataset
from streamload import access as access_module
from streamload.cli import main
from tests.helpers.datasets import write_dataset
from tests.s3server import SeaweedS3

COUNTS = [6, 0, 9, 4, 7]  # 26 samples, one empty shard
FORMATS = ["tar", "lmdb", "hdf5"]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default-cache"))


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("access")
    return {fmt: write_dataset(str(root / fmt), fmt, COUNTS, fmt[0]) for fmt in FORMATS}


def check_random_access(ds: ShardedDataset, url: str, **options: Any) -> None:
    """Every index, negative index, slice and key gives the iterated sample."""
    iterated = list(StreamingDataset(url, **options))
    assert len(ds) == len(iterated) == sum(COUNTS)
    assert [ds[i] for i in range(len(ds))] == iterated
    assert ds[-1] == iterated[-1] and ds[-len(ds)] == iterated[0]
    assert ds[np.int64(5)] == iterated[5]
    view = ds[3:20:4]
    assert isinstance(view, SampleView) and len(view) == 5
    assert list(view) == iterated[3:20:4] and view[-1] == iterated[19] and list(view[1:3]) == iterated[7:12:4]
    assert view.keys() == [s["__key__"] for s in iterated[3:20:4]]
    assert list(ds[::-1]) == iterated[::-1] and list(ds[100:]) == []
    for bad in (len(ds), -len(ds) - 1):
        with pytest.raises(IndexError, match="out of range"):
            ds[bad]
    with pytest.raises(IndexError):
        view[5]
    for i in np.random.default_rng(0).permutation(len(ds)).tolist():
        key = iterated[i]["__key__"]
        assert ds.get(key) == iterated[i] and ds.index_of(key) == i and key in ds and ds.key_of(i) == key
    with pytest.raises(SampleNotFoundError) as missing:
        ds.get("no/such-key")
    assert isinstance(missing.value, KeyError)
    assert "'no/such-key'" in str(missing.value) and url in str(missing.value)
    assert "no/such-key" not in ds and 5 not in ds


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_locally(local: dict[str, str], fmt: str, tmp_path: Path) -> None:
    ds = ShardedDataset(local[fmt], storage=StorageConfig(cache_dir=str(tmp_path / "cache")))
    check_random_access(ds, local[fmt])
    index_file = ds.key_index_path()
    assert index_file.startswith(str(tmp_path / "cache")) and os.path.exists(index_file)
    again = ShardedDataset(local[fmt], storage=StorageConfig(cache_dir=str(tmp_path / "cache")))

    def no_build() -> Any:
        raise AssertionError("the key index must come from the file")

    again._build_key_index = no_build  # type: ignore[method-assign]
    key = ds.key_of(10)
    assert again.get(key) == ds[10]
    assert isinstance(again.key_index().table, np.memmap)
    ds.close()


def test_hash_collisions_are_resolved_by_the_real_key(
    local: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(access_module, "key_hash", lambda key: 7)  # every key collides
    ds = ShardedDataset(local["lmdb"], key_index="memory")
    for i in (0, 13, 25):
        assert ds.index_of(ds.key_of(i)) == i
    with pytest.raises(SampleNotFoundError):
        ds.index_of("l9_9")
    assert not os.path.exists(ds.key_index_path())


def test_transform_pickle_and_distributed_sampler(local: dict[str, str]) -> None:
    ds = ShardedDataset(local["hdf5"], transform=lambda s: s["__key__"])
    assert ds[0] == "h0_0"  # opens shards in this process before the workers fork
    pickled = pickle.loads(pickle.dumps(ShardedDataset(local["tar"])))  # noqa: S301 - our own bytes
    assert pickled[7]["__key__"] == "t2_1"
    seen: Counter[str] = Counter()
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=1)
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
        seen.update(k for batch in loader for k in batch)
    assert set(seen) == {f"h{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n)}
    assert sum(seen.values()) == 26


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_format_through_s3(s3_server: SeaweedS3, tmp_path: Path) -> None:
    options = s3_server.storage_options()
    bucket = s3_server.make_bucket()
    for fmt in FORMATS:
        url = write_dataset(f"s3://{bucket}/{fmt}", fmt, COUNTS, fmt[0], options)
        cache = str(tmp_path / "cache")
        ds = ShardedDataset(url, storage=StorageConfig(storage_options=options, cache_dir=cache, cache_limit="1MB"))
        check_random_access(ds, url, storage=StorageConfig(storage_options=options, cache_dir=cache))
        assert ds.key_index_path().startswith(os.path.join(cache, "keys"))
        ds.close()


def test_show_prints_a_sample_and_writes_its_image(
    tar_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = ShardedDataset(str(tar_dataset))
    key = ds.key_of(3)
    assert main(["show", str(tar_dataset), key, "--out", str(tmp_path / "img")]) == 0
    out = capsys.readouterr().out
    label = int(ds[3]["cls"])
    assert key in out and f"label {label} ({ds.manifest.classes[label]})" in out
    assert "jpg" in out and "x" in out and "bytes" in out
    assert (tmp_path / "img").read_bytes() == ds[3]["jpg"]
    assert main(["show", str(tar_dataset), "-1"]) == 0
    assert ds.key_of(-1) in capsys.readouterr().out
    assert main(["show", str(tar_dataset), "no-such-key"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-key'" in err and str(tar_dataset) in err
    assert main(["show", str(tar_dataset), "100000"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_a_linked_key_folder_is_not_followed(local: dict[str, str], tmp_path: Path, caplog) -> None:
    """A ``keys/`` folder that is a symbolic link: nothing is written where it points; lookups still work."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    elsewhere.mkdir()
    (cache / "keys").symlink_to(elsewhere)
    ds = ShardedDataset(local["tar"], storage=StorageConfig(cache_dir=str(cache)))
    with caplog.at_level("WARNING", logger="streamload"):
        assert ds.get(ds.key_of(12)) == ds[12]
    assert list(elsewhere.iterdir()) == []
    assert "is a link or not a directory" in caplog.text and "stays in memory" in caplog.text


def test_a_linked_key_index_file_is_replaced_not_followed(local: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = Path(ShardedDataset(local["tar"], storage=StorageConfig(cache_dir=str(cache))).key_index_path())
    path.parent.mkdir(parents=True)
    good = ShardedDataset(local["tar"], key_index="memory").key_index()
    target = tmp_path / "target.npy"
    np.save(target, good.table)  # a valid index, but through a link: neither read nor written
    before = target.read_bytes()
    path.symlink_to(target)
    ds = ShardedDataset(local["tar"], storage=StorageConfig(cache_dir=str(cache)))
    calls = []
    build = ds._build_key_index
    ds._build_key_index = lambda: calls.append(1) or build()  # type: ignore[method-assign]
    assert ds.index_of(ds.key_of(20)) == 20
    assert calls == [1]  # the linked file was not used
    assert not path.is_symlink() and path.is_file() and target.read_bytes() == before


@pytest.mark.parametrize("plant", ["shuffled", "one_entry"])
def test_a_planted_key_index_is_rebuilt_not_believed(
    tar_dataset: Path, tmp_path: Path, plant: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A key index file of the right size but wrong content never makes a present key missing
    (one wrong entry of 129 is found when that key is missed, and the file rebuilt)."""
    url = str(tar_dataset)
    storage = StorageConfig(cache_dir=str(tmp_path / "cache"))
    first = ShardedDataset(url, storage=storage)
    first.key_index()  # written to its file
    path = Path(first.key_index_path())
    table = np.load(path)
    victim = first.key_of(17)
    if plant == "shuffled":  # another dataset's index of the same size
        table[1] = np.random.default_rng(1).permutation(table.shape[1]).astype(np.uint64)
    else:  # one hash changed: only a lookup of that key can tell
        row = int(np.flatnonzero(table[1] == 17)[0])
        table[0, row] = table[0, row] + 1 if row == table.shape[1] - 1 else table[0, row + 1]
    np.save(path, table)
    ds = ShardedDataset(url, storage=storage)
    with caplog.at_level("WARNING", logger="streamload"):
        assert ds.index_of(victim) == 17 and ds.get(victim) == ds[17]
        with pytest.raises(SampleNotFoundError):
            ds.get("no/such-key")
    # found by the few keys checked on load, or by confirming a missed key against the shards
    assert ("rebuilding it" if plant == "shuffled" else "does not match " + url + ": rebuilt") in caplog.text
    rebuilt = np.load(path)
    assert np.array_equal(rebuilt, ShardedDataset(url, key_index="memory").key_index().table)
