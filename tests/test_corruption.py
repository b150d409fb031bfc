"""Corruption while reading: on_error="raise" names URL, shard, key and field;
on_error="skip" counts, names each skipped sample, and keeps every rank's count equal."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from streamload import (
    CorruptShardError,
    ImageLabel,
    SampleError,
    ShardNotFoundError,
    SkipCounts,
    StreamingDataset,
    StreamloadError,
)

from .conftest import expected_samples


@pytest.fixture
def damaged(tar_dataset: Path, tmp_path: Path) -> Path:
    """A copy of the tar dataset with one flipped byte in shard 1's first image."""
    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    shard = ds / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[3 * 512 + 100] ^= 0x01  # cls header, cls data, jpg header, then the jpg's bytes
    shard.write_bytes(bytes(data))
    return ds


def test_raise_names_url_shard_key_and_field(damaged: Path) -> None:
    with pytest.raises(CorruptShardError) as info:
        list(StreamingDataset(str(damaged)))
    message = str(info.value)
    assert "shard-000001.tar" in message and "field 'jpg'" in message and "sample 'class_" in message
    assert str(damaged) in message


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_counts_logs_and_keeps_the_count(damaged: Path, num_workers: int, caplog) -> None:
    ds = StreamingDataset(str(damaged), on_error="skip")
    with caplog.at_level(logging.WARNING, logger="streamload"):
        keys = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=num_workers)]
    assert len(keys) == len(ds)  # the bad sample was replaced, not dropped
    assert len(set(keys)) == len(ds) - 1  # ... by a repeat of a good one
    assert ds.skipped_samples == 1
    if num_workers == 0:
        assert any("shard-000001.tar" in r.getMessage() for r in caplog.records)
        assert ds.errors == SkipCounts(samples_skipped=1, shards={"shard-000001.tar": 1})
    else:  # the workers counted in their own copies; this process skipped nothing
        assert ds.errors == SkipCounts()


def test_skip_in_a_world_of_ranks_keeps_ranks_equal(damaged: Path) -> None:
    counts = []
    seen: set[str] = set()
    for rank in range(3):
        ds = StreamingDataset(str(damaged), on_error="skip", rank=rank, world_size=3)
        keys = [s["__key__"] for s in ds]
        counts.append(len(keys))
        seen |= set(keys)
    assert counts == [len(StreamingDataset(str(damaged), rank=0, world_size=3))] * 3
    assert len(seen) == StreamingDataset(str(damaged)).num_samples - 1


def test_skip_a_missing_shard(tar_dataset: Path, tmp_path: Path) -> None:
    ds_dir = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds_dir)
    (ds_dir / "shard-000003.tar").unlink()
    with pytest.raises(ShardNotFoundError, match="shard-000003.tar"):
        list(StreamingDataset(str(ds_dir)))
    ds = StreamingDataset(str(ds_dir), on_error="skip")
    out = list(ds)
    assert len(out) == len(ds)
    assert ds.skipped_samples == ds.manifest.shards[3].num_samples
    assert ds.errors.shards == {"shard-000003.tar": ds.manifest.shards[3].num_samples}
    assert ds.errors.samples_skipped == ds.skipped_samples
    n = ds.manifest.shards[3].num_samples
    assert [(s.shard, s.index, s.key) for s in ds.errors.samples] == [("shard-000003.tar", i, None) for i in range(n)]
    assert all("shard-000003.tar" in s.reason for s in ds.errors.samples)


def test_skip_a_shard_that_no_longer_matches_its_manifest(tar_dataset: Path, tmp_path: Path) -> None:
    ds_dir = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds_dir)
    shard = ds_dir / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes() + b"appended")
    with pytest.raises(CorruptShardError, match="shard-000000.tar.*manifest says"):
        list(StreamingDataset(str(ds_dir)))
    ds = StreamingDataset(str(ds_dir), on_error="skip")
    assert len(list(ds)) == len(ds)
    assert ds.skipped_samples == ds.manifest.shards[0].num_samples


def test_undecodable_image(image_folder: Path, tmp_path: Path) -> None:
    from streamload.converters import ConvertOptions, ImageFolderSource, convert

    src = tmp_path / "src"
    shutil.copytree(image_folder, src)
    (src / "class_002" / "img_000003.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    out = tmp_path / "out"
    convert(ImageFolderSource(str(src), check="none"), str(out), ConvertOptions(progress=False))
    with pytest.raises(SampleError, match=r"shard-000000.tar.*class_002/img_000003"):
        list(StreamingDataset(str(out), transform=ImageLabel(size=8)))
    ds = StreamingDataset(str(out), transform=ImageLabel(size=8), on_error="skip")
    images = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(images) == len(expected_samples(src)) == len(ds)
    assert ds.skipped_samples == 1


def test_everything_broken_is_an_error_not_an_empty_epoch(tar_dataset: Path, tmp_path: Path) -> None:
    ds_dir = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds_dir)
    for shard in ds_dir.glob("*.tar"):
        shard.unlink()
    with pytest.raises(StreamloadError, match="failed; nothing to substitute"):
        list(StreamingDataset(str(ds_dir), on_error="skip"))


def test_skip_names_every_skipped_sample(tar_dataset: Path, tmp_path: Path, caplog) -> None:
    """Six damaged samples over two shards: each is named (shard, index, key, reason) in errors and the log."""
    import tarfile

    ds_dir = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds_dir)
    damaged: dict[tuple[str, str], int] = {}
    for name, picks in (("shard-000001.tar", (0, 3, 4, 9)), ("shard-000002.tar", (1, 15))):
        shard = ds_dir / name
        with tarfile.open(shard) as tar:
            images = [m for m in tar.getmembers() if not m.name.endswith(".cls")]
        data = bytearray(shard.read_bytes())
        for i in picks:
            data[images[i].offset_data + 50] ^= 0x01
            damaged[(name, images[i].name.rsplit(".", 1)[0])] = i
        shard.write_bytes(bytes(data))
    ds = StreamingDataset(str(ds_dir), on_error="skip")
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert len(list(ds)) == len(ds)
    assert ds.skipped_samples == ds.errors.samples_skipped == 6
    named = {(s.shard, s.key): s.index for s in ds.errors.samples}
    assert named == damaged
    assert all(s.key is not None and s.key in s.reason for s in ds.errors.samples), ds.errors.samples
    for (shard, key), _ in damaged.items():
        assert sum(repr(key) in r.getMessage() and shard in r.getMessage() for r in caplog.records) == 1, key
