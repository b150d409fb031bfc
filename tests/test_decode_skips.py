"""A sample that does not decode: the same under ``collate=DecodeBatch`` as under ``transform=ImageLabel``.

Under ``on_error="skip"`` both count and name it through the dataset's skip report and keep
the shape (ImageLabel: the item count; DecodeBatch: the batch, its slot filled by another
sample of the batch). Under ``"raise"`` both name the shard in front of the sample.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from streamload import SampleError, StreamingDataset
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DecodeBatch, ImageLabel

SIDE = 16


def _jpeg(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 20), (value, 255 - value, 7)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten flat-coloured JPEGs in two classes, one of them (``a/img3``) damaged past decoding."""
    root = tmp_path_factory.mktemp("skips") / "folder"
    for i in range(10):
        folder = root / ("a" if i < 5 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        data = _jpeg(20 * i + 10)
        if i == 3:
            data = data[:2] + b"\x00" * 200  # JPEG magic, then nothing a decoder can read
        (folder / f"img{i}.jpg").write_bytes(data)
    out = root.parent / "out"
    convert(ImageFolderSource(str(root), check="none"), str(out), ConvertOptions(samples_per_shard=6, progress=False))
    return out


def _mean(image: torch.Tensor) -> float:
    return float(image[0].float().mean())


def test_skip_under_decode_batch_is_counted_named_and_keeps_the_batch(dataset: Path) -> None:
    per_sample = StreamingDataset(str(dataset), transform=ImageLabel(size=SIDE), on_error="skip")
    items = list(per_sample)
    assert len(items) == 10 and per_sample.skipped_samples == 1
    [named] = per_sample.errors.samples

    batched = StreamingDataset(str(dataset), batch_size=4, collate=DecodeBatch(SIDE), on_error="skip")
    batches = list(batched)
    assert [len(images) for images, _ in batches] == [4, 4, 4]  # 10 samples, padded to 12
    assert batched.skipped_samples == 1
    [skipped] = batched.errors.samples
    # The same sample, named the same way: shard, index, key, and the reason (the shard's
    # name is what SkipLog puts in front of it in the log).
    assert (
        (skipped.shard, skipped.index, skipped.key)
        == (named.shard, named.index, named.key)
        == (
            "shard-000000.tar",
            3,
            "a/img3",
        )
    )
    assert "cannot decode image" in skipped.reason and skipped.reason == named.reason

    # The bad slot (batch 0, slot 3) repeats the good sample before it, image and label.
    images, labels = batches[0]
    assert labels is not None
    assert torch.equal(images[3], images[2]) and int(labels[3]) == int(labels[2]) == 0
    # ...and the ImageLabel path repeated that same sample (the last good one) in its place.
    assert abs(_mean(items[3][0]) - _mean(images[3])) < 1
    good = (
        [_mean(images[i]) for i in range(3)] + [_mean(b) for b in batches[1][0]] + [_mean(b) for b in batches[2][0][:2]]
    )
    assert len(set(np.round(good))) == 9  # every other slot is its own sample


def test_skip_fills_from_the_next_sample_when_the_first_is_bad(dataset: Path) -> None:
    # Batches of 3: a/img3 opens the second batch, so the next sample (a/img4) fills its slot
    # (the per-sample path, too, repeats the next good sample when none came before).
    ds = StreamingDataset(str(dataset), batch_size=3, collate=DecodeBatch(SIDE), on_error="skip")
    batches = list(ds)
    assert ds.skipped_samples == 1 and len(batches[1].images) == 3
    assert torch.equal(batches[1].images[0], batches[1].images[1])
    # A batch of one bad sample has no other: a good sample of an earlier batch fills it.
    ds = StreamingDataset(str(dataset), batch_size=1, collate=DecodeBatch(SIDE), on_error="skip")
    out = list(ds)
    assert len(out) == 10 and ds.skipped_samples == 1
    assert torch.equal(out[3].images, out[2].images)
    # The collate called directly, outside a dataset: the error, as before.
    samples = list(StreamingDataset(str(dataset)))
    with pytest.raises(SampleError, match=r"sample 'a/img3' field 'jpg': cannot decode image"):
        DecodeBatch(SIDE)(samples[3:5])


def test_skipped_samples_seen_through_dataloader_workers(dataset: Path) -> None:
    ds = StreamingDataset(str(dataset), batch_size=5, collate=DecodeBatch(SIDE), on_error="skip")
    loader = DataLoader(ds, batch_size=None, num_workers=1)
    shapes = [tuple(images.shape) for images, _ in loader]
    assert shapes == [(5, 3, SIDE, SIDE)] * 2  # the batch of the bad sample keeps its shape
    assert ds.skipped_samples == 1


def test_raise_names_the_shard_in_both_paths(dataset: Path) -> None:
    where = f"{dataset}/shard-000000.tar: sample 'a/img3' field 'jpg': cannot decode image"
    with pytest.raises(SampleError, match="^" + re.escape(where)):
        list(StreamingDataset(str(dataset), transform=ImageLabel(size=SIDE)))
    with pytest.raises(SampleError, match="^" + re.escape(where)):
        list(StreamingDataset(str(dataset), batch_size=4, collate=DecodeBatch(SIDE)))


def test_a_mixture_fills_the_slot_from_the_same_stream(dataset: Path, tmp_path: Path) -> None:
    from streamload import Stream

    other = tmp_path / "blue"
    for i in range(10):
        (other / "c").mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.new("RGB", (24, 20), (7, 7, 20 * i + 10)).save(buf, "JPEG", quality=95)
        (other / "c" / f"blue{i}.jpg").write_bytes(buf.getvalue())
    convert(ImageFolderSource(str(other)), str(tmp_path / "blue-ds"), ConvertOptions(progress=False))
    streams = [Stream(str(dataset), name="red"), Stream(str(tmp_path / "blue-ds"), name="blue")]
    ds = StreamingDataset(streams, batch_size=20, collate=DecodeBatch(SIDE), on_error="skip")
    [batch] = list(ds)
    assert ds.skipped_samples == 1 and ds.errors.samples[0].key == "a/img3"
    images = batch.images
    pairs = [(i, j) for i in range(20) for j in range(i + 1, 20) if torch.equal(images[i], images[j])]
    assert len(pairs) == 1  # the bad slot and the sample repeated in it
    i, _ = pairs[0]
    assert float(images[i][2].float().mean()) < 20 < float(images[i][0].float().mean())  # red: its own stream's
