"""DevicePrefetcher on CPU (no GPU in CI): a faithful passthrough; to_device keeps structure."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from streamload import StreamingDataset
from streamload.batch import ImageBatch, RawBatch, RawCollate
from streamload.device import DevicePrefetcher, to_device


def test_cpu_prefetcher_is_a_passthrough_of_real_batches(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), batch_size=16, collate=RawCollate(keys=True))
    loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=False)
    direct = [(b.keys, b.data.clone(), b.labels) for b in loader]
    prefetcher = DevicePrefetcher(loader, device="cpu")
    assert not prefetcher.active and len(prefetcher) == len(direct)
    through = [(b.keys, b.data, b.labels) for b in prefetcher]
    assert len(through) == len(direct)
    for (k1, d1, l1), (k2, d2, l2) in zip(direct, through, strict=True):
        assert k1 == k2 and torch.equal(d1, d2) and torch.equal(l1, l2)


def test_empty_loader() -> None:
    assert list(DevicePrefetcher([], device="cpu")) == []


def test_to_device_keeps_structure() -> None:
    Pair = namedtuple("Pair", "x y")
    raw = RawBatch(torch.arange(6, dtype=torch.uint8), torch.tensor([0, 2, 6]), torch.tensor([1, 2]), ("a", "b"))
    images = ImageBatch(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([3, 4]))
    batch = {"raw": raw, "img": images, "pair": Pair(torch.ones(2), [torch.zeros(1), "text"]), "n": 7}
    out = to_device(batch, torch.device("cpu"))
    assert isinstance(out["raw"], RawBatch) and out["raw"].keys == ("a", "b")
    assert torch.equal(out["raw"].data, raw.data) and torch.equal(out["raw"].labels, raw.labels)
    assert isinstance(out["img"], ImageBatch) and torch.equal(out["img"].images, images.images)
    assert isinstance(out["pair"], Pair) and out["pair"].y[1] == "text" and out["n"] == 7
    x, y = out["img"]
    assert x.shape == (2, 3, 4, 4) and y.tolist() == [3, 4]


def test_the_device_prefetcher_is_public() -> None:
    import streamload
    import streamload.device

    assert streamload.DevicePrefetcher is streamload.device.DevicePrefetcher is DevicePrefetcher
    assert "DevicePrefetcher" in streamload.__all__
