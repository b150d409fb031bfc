"""DecodeBatch's batch read: a planned batch read into one buffer and decoded by the kernel in one call.

The reference is the dict path on the same dataset (``on_error="skip"`` keeps a dataset on
it: sample dicts read one by one, then ``DecodeBatch.__call__``): the batch read must give
the same images, bit for bit, and the same labels, through DataLoader workers and the
thread Loader, shuffled, over a mixture of tar and LMDB shards holding PNG, CMYK and grey
images among the JPEGs (the samples the kernel does not take go the per-sample path). And
it must let go of the GIL a few times a batch (a read call per shard, the kernel once),
where the dict path lets go of it at least once a sample.
"""

from __future__ import annotations

import io
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import streamload
from streamload import Loader, SampleError, Stream, StreamingDataset
from streamload._pread import available as pread_available
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DecodeBatch, native
from streamload.synthetic import make_image_folder, synthetic_jpeg

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel is not built here")


def _encode(array: np.ndarray, mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same images as tar shards and as LMDB shards of 8: JPEGs of many sizes, a PNG, a CMYK and a grey JPEG."""
    root = tmp_path_factory.mktemp("batch-read")
    make_image_folder(str(root / "src"), num_classes=3, per_class=10, size=(96, 72), seed=4, jitter=0.5)
    rng = np.random.default_rng(9)
    extra = root / "src" / "class_001"
    for i, (w, h) in enumerate([(60, 110), (400, 300), (37, 53), (640, 200)]):
        (extra / f"extra_{i}.jpg").write_bytes(synthetic_jpeg(rng, w, h))
    pixels = (rng.random((50, 70, 3)) * 255).astype(np.uint8)
    (extra / "a_png.png").write_bytes(_encode(pixels, fmt="PNG"))
    (extra / "cmyk.jpg").write_bytes(_encode(pixels, "CMYK"))
    (extra / "grey.jpg").write_bytes(_encode(pixels, "L"))
    source = ImageFolderSource(str(root / "src"))
    convert(source, str(root / "tar"), ConvertOptions(samples_per_shard=8, progress=False))
    convert(source, str(root / "lmdb"), ConvertOptions(samples_per_shard=8, progress=False, format="lmdb"))
    return root / "tar", root / "lmdb"


def _dataset(shards: tuple[Path, Path], on_error: Any, mixed: bool, **kw: Any) -> StreamingDataset:
    url: Any = [Stream(str(shards[0]), weight=2), Stream(str(shards[1]), weight=1)] if mixed else str(shards[0])
    decode = DecodeBatch(32, crop="random", flip=True, seed=3, native=True, **kw)
    ds = StreamingDataset(url, batch_size=6, shuffle=True, seed=2, on_error=on_error, collate=decode)
    ds.set_epoch(1)
    return ds


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want) > 0
    for (images, labels), (ref_images, ref_labels) in zip(got, want, strict=True):
        assert images.shape == ref_images.shape and images.dtype == torch.uint8
        assert torch.equal(images, ref_images)
        assert torch.equal(labels, ref_labels)


@pytest.mark.parametrize("mixed", [False, True], ids=["tar", "tar+lmdb"])
def test_the_batch_read_decodes_what_the_dict_path_does_in_process(shards: tuple[Path, Path], mixed: bool) -> None:
    _same(list(_dataset(shards, "raise", mixed)), list(_dataset(shards, "skip", mixed)))


def test_without_labels_and_in_hwc(shards: tuple[Path, Path]) -> None:
    kw: dict[str, Any] = {"label_field": None, "layout": "HWC"}
    got, want = list(_dataset(shards, "raise", True, **kw)), list(_dataset(shards, "skip", True, **kw))
    assert len(got) == len(want) > 0
    for (images, labels), (ref_images, ref_labels) in zip(got, want, strict=True):
        assert labels is None and ref_labels is None and images.shape[-1] == 3
        assert torch.equal(images, ref_images)


@pytest.mark.slow
def test_the_batch_read_decodes_what_the_dict_path_does_in_dataloader_workers(shards: tuple[Path, Path]) -> None:
    got = list(DataLoader(_dataset(shards, "raise", True), batch_size=None, num_workers=2))
    want = list(DataLoader(_dataset(shards, "skip", True), batch_size=None, num_workers=2))
    _same(got, want)


def test_the_batch_read_decodes_what_the_dict_path_does_in_loader_threads(shards: tuple[Path, Path]) -> None:
    got = sorted(Loader(_dataset(shards, "raise", True), threads=2), key=lambda b: b[1].tolist())
    want = sorted(Loader(_dataset(shards, "skip", True), threads=2), key=lambda b: b[1].tolist())
    # (the threads' batches may come in another order: matched by their labels, then compared whole)
    got_keys = [b[1].tolist() for b in got]
    assert got_keys == [b[1].tolist() for b in want]
    _same(got, want)


def _calls(ds: StreamingDataset) -> tuple[int, Counter[str]]:
    """Batches of an in-process iteration, and the C calls seen that let go of the GIL (after the first batch)."""
    releasing = {"pread", "preadv", "pread_gather", "decode"}
    calls: Counter[str] = Counter()

    def profile(frame: object, event: str, arg: object) -> None:
        name = getattr(arg, "__qualname__", "")
        if event == "c_call" and name in releasing:
            calls[name] += 1

    it = iter(ds)
    next(it)  # shards opened (their headers checked) out of the count
    sys.setprofile(profile)
    try:
        batches = 1 + sum(1 for _ in it)
    finally:
        sys.setprofile(None)
    return batches, calls


@pytest.mark.skipif(not pread_available(), reason="the _gather extension is not built here")
def test_a_batch_read_lets_go_of_the_gil_a_few_times_a_batch_not_a_few_times_a_sample(tmp_path: Path) -> None:
    # JPEGs only (every sample taken by the kernel), shards of 40, batches of 16 shuffled.
    make_image_folder(str(tmp_path / "src"), num_classes=2, per_class=40, size=(64, 48), seed=1)
    convert(ImageFolderSource(str(tmp_path / "src")), str(tmp_path / "ds"), ConvertOptions(samples_per_shard=40))

    def dataset(on_error: Any) -> StreamingDataset:
        decode = DecodeBatch(32, crop="random", flip=True, native=True)
        return StreamingDataset(
            str(tmp_path / "ds"), batch_size=16, shuffle=True, seed=1, on_error=on_error, collate=decode
        )

    batches, calls = _calls(dataset("raise"))
    assert batches == 5
    # per batch: one gathered read over the shards it spans, which runs the kernel's headers,
    # crop draws and decode right after the reads, in the same release of the GIL
    assert calls["pread_gather"] == batches - 1
    assert calls["decode"] == 0
    assert calls["pread"] + calls["preadv"] == 0
    _, dict_calls = _calls(dataset("skip"))
    assert dict_calls["pread"] + dict_calls["preadv"] >= 16 * (batches - 1)  # a read a field of each sample


def test_a_bad_image_in_a_batch_read_is_todays_error_naming_shard_and_sample(tmp_path: Path) -> None:
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    rng = np.random.default_rng(3)
    datas = [synthetic_jpeg(rng, 80, 60) for _ in range(6)]
    datas[4] = datas[4][: len(datas[4]) // 3]  # neither the kernel nor Pillow can read it
    fmt, dest = get_format("tar"), LocalDestination(str(tmp_path))
    samples = ({"__key__": f"k{i}", "jpg": d, "cls": b"1"} for i, d in enumerate(datas))
    entry = write_shard(fmt, dest, fmt.shard_name(0), samples).entry
    publish_manifest(dest, Manifest(format="tar", shards=(entry,), fields=("cls", "jpg")))
    ds = StreamingDataset(str(tmp_path), batch_size=6, collate=DecodeBatch(32, native=True))
    with pytest.raises(SampleError, match=r"shard-000000\.tar: sample 'k4' field 'jpg': cannot decode image"):
        list(ds)


def test_a_jpeg_the_kernel_refuses_is_decoded_by_pillow_and_counted_as_on_the_dict_path(tmp_path: Path) -> None:
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    rng = np.random.default_rng(5)
    datas = [synthetic_jpeg(rng, int(rng.integers(60, 300)), int(rng.integers(60, 300))) for _ in range(8)]
    sos = datas[3].index(b"\xff\xda")
    datas[3] = datas[3][:sos] + b"\x00" * 16 + datas[3][sos:]  # libjpeg warns: the kernel refuses, Pillow reads it
    fmt, dest = get_format("tar"), LocalDestination(str(tmp_path))
    samples = ({"__key__": f"k{i}", "jpg": d, "cls": str(i).encode()} for i, d in enumerate(datas))
    entry = write_shard(fmt, dest, fmt.shard_name(0), samples).entry
    publish_manifest(dest, Manifest(format="tar", shards=(entry,), fields=("cls", "jpg")))

    def run(on_error: Any) -> tuple[list[Any], int]:
        decode = DecodeBatch(48, crop="random", flip=True, seed=4, native=True)
        ds = StreamingDataset(str(tmp_path), batch_size=4, shuffle=True, seed=1, on_error=on_error, collate=decode)
        return list(ds), decode.fallbacks

    (got, fallbacks), (want, want_fallbacks) = run("raise"), run("skip")
    _same(got, want)
    assert fallbacks == want_fallbacks == 1


def test_a_sample_without_the_image_field_takes_the_dict_path_and_its_error(shards: tuple[Path, Path]) -> None:
    ds = StreamingDataset(str(shards[0]), batch_size=6, collate=DecodeBatch(32, field="webp", native=True))
    with pytest.raises(SampleError, match=r"has none of the fields \('webp',\)"):
        list(ds)


def test_called_directly_without_places_it_draws_from_the_process_generator(shards: tuple[Path, Path]) -> None:
    from streamload.formats.tar import TarShardReader
    from streamload.manifest import Manifest

    entry = Manifest.loads((shards[0] / "index.json").read_bytes()).shards[0]
    path = str(shards[0] / entry.name)
    reader = TarShardReader(path, entry, path + ".idx")
    try:
        parts = [(0, np.arange(entry.num_samples, dtype=np.int64))]
        got = DecodeBatch(32, crop="center", native=True).read_batch(lambda _: reader, parts)
        samples = [reader.get(i) for i in range(entry.num_samples)]
        want = DecodeBatch(32, crop="center", native=True)(samples)
        assert torch.equal(got.images, want.images) and torch.equal(got.labels, want.labels)
    finally:
        reader.close()


@pytest.mark.skipif(not pread_available(), reason="the _gather extension is not built here")
def test_a_batch_read_makes_its_chw_batch_without_a_torch_op(tmp_path: Path) -> None:
    # A torch op lets go of the GIL (beside a loop running Python, taking it back waits up to
    # a switch interval): in this process the batch is numpy views and torch.from_numpy only.
    make_image_folder(str(tmp_path / "src"), num_classes=2, per_class=20, size=(64, 48), seed=2)
    convert(ImageFolderSource(str(tmp_path / "src")), str(tmp_path / "ds"), ConvertOptions(samples_per_shard=20))
    decode = DecodeBatch(32, crop="random", flip=True, native=True)
    ds = StreamingDataset(str(tmp_path / "ds"), batch_size=8, shuffle=True, seed=1, collate=decode)
    package = os.path.dirname(streamload.__file__) + os.sep
    no_gil_release = {"numpy", "from_numpy", "untyped_storage", "tolist"}
    seen: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: object) -> None:
        if event != "c_call" or not frame.f_code.co_filename.startswith(package):
            return  # the library's calls, not this test's
        owner = getattr(arg, "__self__", None)
        if isinstance(owner, torch.Tensor) or getattr(arg, "__module__", None) == "torch":
            seen[getattr(arg, "__name__", "")] += 1

    it = iter(ds)
    next(it)
    sys.setprofile(profile)
    views = []
    try:
        for images, _labels in it:  # each batch dropped before the next (its pooled buffer reused)
            views.append((tuple(images.shape), images.stride()))
    finally:
        sys.setprofile(None)
    assert len(views) == 4
    assert seen and set(seen) <= no_gil_release, seen
    # permute's view, as before: the same shape and strides
    assert set(views) == {((8, 3, 32, 32), torch.empty(8, 32, 32, 3).permute(0, 3, 1, 2).stride())}
