"""The decode stage: ImageDecoder against a plain Pillow reference, DecodeBatch through workers."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from streamload import ImageLabel, SampleError, StreamingDataset
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DecodeBatch, ImageDecoder
from streamload.decode.image import have_simplejpeg
from streamload.synthetic import make_image_folder, synthetic_jpeg
from tests.helpers.memory import in_shared_memory

BACKENDS = ["pillow", "simplejpeg"] if have_simplejpeg() else ["pillow"]


def reference(data: bytes, resize: int, size: int) -> np.ndarray:
    """The textbook pipeline: Pillow decode, resize the shorter side, center-crop."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    s = resize / min(w, h)
    img = img.resize((max(size, round(w * s)), max(size, round(h * s))), Image.Resampling.BILINEAR)
    left, top = (img.size[0] - size) // 2, (img.size[1] - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size))).astype(np.int16)


SIZES = [(500, 375), (375, 500), (401, 333), (651, 497), (230, 229)]


def _images(noise: float) -> list[bytes]:
    rng = np.random.default_rng(3)
    return [synthetic_jpeg(rng, w, h, noise=noise) for w, h in SIZES]


def test_have_simplejpeg_in_test_environment() -> None:
    assert have_simplejpeg(), "the test extra installs simplejpeg; the fast path must be tested"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("resize", "size"), [(256, 224), (224, 224), (100, 96)])
def test_full_size_decode_matches_pillow_reference(backend: str, resize: int, size: int) -> None:
    decoder = ImageDecoder(size, resize=resize, backend=backend, dct_scaling=False)  # type: ignore[arg-type]
    for data in _images(noise=9):
        diff = np.abs(decoder.decode(data).astype(np.int16) - reference(data, resize, size))
        assert diff.max() <= 1, diff.max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("resize", "size"), [(128, 112), (64, 64), (40, 32)])
def test_dct_scaled_decode_is_close_to_reference(backend: str, resize: int, size: int) -> None:
    decoder = ImageDecoder(size, resize=resize, backend=backend)  # type: ignore[arg-type]
    for data in _images(noise=2):
        diff = np.abs(decoder.decode(data).astype(np.int16) - reference(data, resize, size))
        assert diff.mean() < 3 and diff.max() <= 16, (diff.mean(), diff.max())  # 1/8 decode: block means


def test_random_crop_is_seeded_and_flip_mirrors() -> None:
    data = _images(noise=2)[0]
    plain = ImageDecoder(64, crop="random")
    flipping = ImageDecoder(64, crop="random", flip=True)
    a = plain.decode(data, np.random.default_rng(5))
    assert np.array_equal(a, plain.decode(data, np.random.default_rng(5)))
    assert not np.array_equal(a, plain.decode(data, np.random.default_rng(6)))
    flips = 0
    for seed in range(8):
        base = plain.decode(data, np.random.default_rng(seed))
        out = flipping.decode(data, np.random.default_rng(seed))
        assert np.array_equal(out, base) or np.array_equal(out, base[:, ::-1])
        flips += int(not np.array_equal(out, base))
    assert 0 < flips < 8


def test_png_goes_through_pillow() -> None:
    data = synthetic_jpeg(np.random.default_rng(0), 300, 200, fmt="PNG", noise=0)
    out = ImageDecoder(64, resize=80, dct_scaling=False).decode(data)
    assert np.abs(out.astype(np.int16) - reference(data, 80, 64)).max() <= 1


@pytest.fixture(scope="module")
def big_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big")
    make_image_folder(str(root / "img"), num_classes=3, per_class=10, size=(160, 120), seed=4)
    convert(ImageFolderSource(str(root / "img")), str(root / "ds"), ConvertOptions(samples_per_shard=7, progress=False))
    return root / "ds"


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_batch_equals_per_sample_image_label(big_images: Path, workers: int) -> None:
    per_sample = {}
    ds = StreamingDataset(str(big_images), transform=lambda s: (s["__key__"], ImageLabel(size=48)(s)))
    for key, (image, label) in ds:
        per_sample[key] = (image, label)
    keys = [s["__key__"] for s in StreamingDataset(str(big_images))]
    batched = StreamingDataset(str(big_images), batch_size=8, collate=DecodeBatch(48))
    images, labels = [], []
    for batch in DataLoader(batched, batch_size=None, num_workers=workers):
        x, y = batch
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, 48, 48) and y.dtype == torch.int64
        if workers:
            assert in_shared_memory(x)
        images.append(x.clone())
        labels.append(y)
    x, y = torch.cat(images), torch.cat(labels)
    assert len(keys) == 30 and len(x) == 32  # padded to whole batches of 8 by the first two samples again
    padded = keys + keys[:2]
    if workers == 0:  # same order as the plain iteration
        for i, key in enumerate(padded):
            assert torch.equal(x[i], per_sample[key][0]) and int(y[i]) == per_sample[key][1]
    else:  # two workers: compare as sets of (image bytes, label)
        got = sorted((x[i].numpy().tobytes(), int(y[i])) for i in range(len(x)))
        want = sorted((per_sample[k][0].numpy().tobytes(), per_sample[k][1]) for k in padded)
        assert got == want


def test_decode_batch_hwc_and_corrupt_image(big_images: Path) -> None:
    collate = DecodeBatch((40, 56), layout="HWC", label_field=None)
    batch = next(iter(StreamingDataset(str(big_images), batch_size=4, collate=collate)))
    assert batch.images.shape == (4, 40, 56, 3) and batch.labels is None
    bad = {"__key__": "broken/one", "jpg": b"\xff\xd8not a jpeg", "cls": b"1"}
    with pytest.raises(SampleError, match="broken/one.*jpg"):
        DecodeBatch(32)([bad])
    with pytest.raises(SampleError, match="broken/one.*jpg"):
        ImageLabel(size=32)(bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_image_label_gives_contiguous_channels_first_pixels(big_images: Path, backend: str) -> None:
    """ImageLabel's tensor is C-contiguous [3, H, W] with the decoder's pixels; so is a default-collated batch."""
    samples = list(StreamingDataset(str(big_images)))[:6]
    transform = ImageLabel(size=48, backend=backend)
    decoder = ImageDecoder(48, backend=backend)
    for sample in samples:
        image, label = transform(sample)
        assert image.shape == (3, 48, 48) and image.dtype == torch.uint8 and image.is_contiguous()
        assert np.array_equal(image.numpy(), decoder.decode(sample["jpg"]).transpose(2, 0, 1))
        assert label == int(sample["cls"])
    # Without a size: the image's own size, channels first and contiguous too.
    png = io.BytesIO()
    Image.fromarray(np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)).save(png, "PNG")
    whole = ImageLabel(label_field=None)({"__key__": "k", "png": png.getvalue()})
    assert whole.shape == (3, 5, 7) and whole.is_contiguous()
    assert np.array_equal(whole.numpy(), np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3).transpose(2, 0, 1))
    ds = StreamingDataset(str(big_images), transform=transform)
    images, labels = next(iter(DataLoader(ds, batch_size=4)))
    assert images.shape == (4, 3, 48, 48) and images.is_contiguous() and labels.dtype == torch.int64
    for i, sample in enumerate(samples[:4]):
        assert np.array_equal(images[i].numpy(), decoder.decode(sample["jpg"]).transpose(2, 0, 1))
