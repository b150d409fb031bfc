"""Image folder -> tar shards -> StreamingDataset/DataLoader gives back every image exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from streamload import ImageLabel, StreamingDataset
from streamload.decode import IMAGE_FIELDS

from .conftest import expected_samples


def _collect(ds: StreamingDataset, num_workers: int) -> list[dict]:
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_image_comes_back_exactly_once(image_folder: Path, tar_dataset: Path, num_workers: int) -> None:
    expected = expected_samples(image_folder)
    by_bytes = {data: (rel, label) for rel, (data, label) in expected.items()}
    assert len(by_bytes) == len(expected), "fixture images must be distinct"
    samples = _collect(StreamingDataset(str(tar_dataset)), num_workers)
    assert len(samples) == len(expected)
    seen = set()
    for sample in samples:
        image_fields = [f for f in sample if f in IMAGE_FIELDS]
        assert len(image_fields) == 1, sample.keys()
        data = sample[image_fields[0]]
        rel, label = by_bytes[data]
        assert int(sample["cls"]) == label
        assert image_fields[0] == rel.rsplit(".", 1)[1].lower()
        seen.add(rel)
    assert seen == set(expected)


def test_keys_are_unique_valid_webdataset_keys(tar_dataset: Path) -> None:
    keys = [s["__key__"] for s in StreamingDataset(str(tar_dataset))]
    assert len(keys) == len(set(keys))
    for key in keys:
        last = key.rsplit("/", 1)[-1]
        assert last and "." not in last, key


def test_keys_are_derived_from_paths(tar_dataset: Path) -> None:
    keys = {s["__key__"] for s in StreamingDataset(str(tar_dataset))}
    assert "class_000/img_000000" in keys
    assert "class_001/nested/deeper/inner" in keys
    assert "class_001/with space" in keys
    assert "class_001/ünïcødé-名前" in keys
    # same stem, two extensions: both kept, told apart
    assert {"class_001/same~jpg", "class_001/same~png"} <= keys


def test_classes_and_counts_in_manifest(image_folder: Path, tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset))
    assert list(ds.manifest.classes) == sorted(p.name for p in image_folder.iterdir() if p.is_dir())
    assert ds.num_samples == len(expected_samples(image_folder)) == len(ds)
    assert all(s.num_samples <= 16 for s in ds.manifest.shards)


def test_image_label_pairs_batch_through_dataloader(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), transform=ImageLabel(size=16))
    batches = list(DataLoader(ds, batch_size=10, num_workers=2))
    images = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    assert images.shape == (len(ds), 3, 16, 16) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64
    assert sorted(labels.tolist()) == sorted(int(s["cls"]) for s in StreamingDataset(str(tar_dataset)))


def test_persistent_workers_iterate_several_epochs(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset))
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for _ in range(3):
        keys = [s["__key__"] for s in loader]
        assert len(keys) == len(set(keys)) == len(ds)
