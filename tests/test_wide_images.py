"""Images of more than 8 bits per sample (16-bit PNG/TIFF/PGM, 32-bit integer and float TIFF).

Pillow's own ``convert("RGB")`` clips these (a 16-bit photo comes out almost white, a
float one in [0, 1] black). Every decode path scales them to 8 bits by one rule
(:func:`streamload.decode.image.to_eight_bits`); each expected mean here is computed by
numpy from the values Pillow reads out of the file, not by the code under test.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from streamload import StreamingDataset
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DecodeBatch, ImageDecoder, ImageLabel, decode_image, decode_sample
from streamload.decode.image import have_simplejpeg
from streamload.verify import verify_dataset

SIDE = 48


def _gradient(lo: float, hi: float, dtype: type) -> np.ndarray:
    """A diagonal ramp from ``lo`` to ``hi`` (a photo-like spread of values, mean near the middle)."""
    ramp = np.add.outer(np.arange(SIDE), np.arange(SIDE)) / (2 * SIDE - 2)
    return np.asarray(lo + ramp * (hi - lo)).astype(dtype)


def _save(array: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    img = Image.fromarray(array)
    if mode is not None and img.mode != mode:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


#: name -> (file bytes' extension, bytes). Values span a photo's range, mostly above 255.
FILES = {
    "png16": ("png", _save(_gradient(2000, 60000, np.uint16), "PNG")),
    "tif16": ("tif", _save(_gradient(0, 65535, np.uint16), "TIFF")),
    "pgm16": ("pgm", _save(_gradient(300, 50000, np.uint16), "PPM")),
    "tif32_16bit_range": ("tif", _save(_gradient(1000, 40000, np.int32), "TIFF")),
    "tif32_wide": ("tif", _save(_gradient(-70000, 3_000_000, np.int32), "TIFF")),
    "float_unit": ("tif", _save(_gradient(0.1, 0.9, np.float32), "TIFF")),
    "float_wide": ("tif", _save(_gradient(-3.0, 120.0, np.float32), "TIFF")),
}


def expected_gray(data: bytes) -> np.ndarray:
    """The 8-bit values of the rule in docs/formats.md, from the file's own values (numpy)."""
    img = Image.open(io.BytesIO(data))
    values = np.asarray(img).astype(np.float64)
    lo, hi = values.min(), values.max()
    if img.mode == "F":
        scaled = values * 255 if 0 <= lo and hi <= 1 else (values - lo) / (hi - lo) * 255
    elif 0 <= lo and hi <= 65535:  # I;16 or I holding 16-bit values
        scaled = values / 257
    else:
        scaled = (values - lo) / (hi - lo) * 255
    return np.rint(scaled)


def test_files_are_what_they_claim() -> None:
    modes = {name: Image.open(io.BytesIO(data)).mode for name, (_, data) in FILES.items()}
    assert modes["png16"] == modes["tif16"] == "I;16"
    assert modes["pgm16"] in ("I", "I;16")
    assert modes["tif32_16bit_range"] == modes["tif32_wide"] == "I"
    assert modes["float_unit"] == modes["float_wide"] == "F"
    # What Pillow alone makes of them: clipped (the bug this file guards against).
    clipped = np.asarray(Image.open(io.BytesIO(FILES["png16"][1])).convert("RGB")).mean()
    assert clipped > 250 > expected_gray(FILES["png16"][1]).mean() + 100


@pytest.mark.parametrize("name", sorted(FILES))
def test_decode_image_and_decoder_scale_not_clip(name: str) -> None:
    ext, data = FILES[name]
    want = expected_gray(data)
    rgb = np.asarray(decode_image(data))
    assert rgb.shape == (SIDE, SIDE, 3)
    assert abs(rgb.mean() - want.mean()) < 0.6, (rgb.mean(), want.mean())
    assert np.abs(rgb[..., 0].astype(np.int16) - want).max() <= 1
    gray = np.asarray(decode_image(data, "L"))
    assert np.abs(gray.astype(np.int16) - want).max() <= 1
    # The decoder of ImageLabel(size=...) and DecodeBatch: the same pixels at the same size.
    for backend in ("pillow", "simplejpeg") if have_simplejpeg() else ("pillow",):
        out = ImageDecoder(SIDE, backend=backend).decode(data)  # type: ignore[arg-type]
        assert np.abs(out[..., 1].astype(np.int16) - want).max() <= 1, backend
    # decode_sample (FIELD_DECODERS) goes through decode_image too.
    decoded = decode_sample({"__key__": "k", ext: data})
    assert abs(np.asarray(decoded[ext]).mean() - want.mean()) < 0.6


def test_wide_images_through_every_reading_path(tmp_path: Path) -> None:
    root = tmp_path / "folder"
    for i, (name, (ext, data)) in enumerate(sorted(FILES.items())):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{name}.{ext}").write_bytes(data)
    out = tmp_path / "out"
    convert(ImageFolderSource(str(root)), str(out), ConvertOptions(samples_per_shard=4, progress=False))
    want = {f"c{i % 2}/{name}": expected_gray(data).mean() for i, (name, (_, data)) in enumerate(sorted(FILES.items()))}

    # ImageLabel at the file's size and at its own size (no resize: exact pixels).
    for transform in (ImageLabel(), ImageLabel(size=SIDE)):
        got = {}
        for sample in StreamingDataset(str(out)):
            image, _ = transform(sample)
            assert tuple(image.shape) == (3, SIDE, SIDE)
            got[sample["__key__"]] = float(image.float().mean())
        assert got.keys() == want.keys()
        for key, mean in want.items():
            assert abs(got[key] - mean) < 0.6, (transform.size, key, got[key], mean)

    # DecodeBatch, the batch path.
    ds = StreamingDataset(str(out), batch_size=len(FILES), collate=DecodeBatch(SIDE))
    images, _labels = next(iter(ds))
    keys = [s["__key__"] for s in StreamingDataset(str(out))]
    for key, image in zip(keys, images, strict=True):
        assert abs(float(image.float().mean()) - want[key]) < 0.6, key

    # verify --decode decodes them all with the same function, without a problem.
    report = verify_dataset(str(out), decode_images=True)
    assert report.images_decoded == len(FILES) and not report.problems


def _other_kinds() -> dict[str, bytes]:
    """8-bit kinds Pillow converts itself: CMYK JPEG (Adobe, inverted), palette PNG, grey+alpha PNG."""
    out = {}
    for name, img, fmt in (
        ("cmyk.jpg", Image.new("RGB", (SIDE, SIDE), (200, 40, 90)).convert("CMYK"), "JPEG"),
        ("palette.png", Image.new("RGB", (SIDE, SIDE), (10, 200, 90)).convert("P"), "PNG"),
        ("grey_alpha.png", Image.new("LA", (SIDE, SIDE), (120, 30)), "PNG"),
    ):
        buf = io.BytesIO()
        img.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
        out[name] = buf.getvalue()
    return out


@pytest.mark.parametrize(("name", "data"), sorted(_other_kinds().items()))
def test_eight_bit_kinds_agree_with_pillow_on_every_path(name: str, data: bytes) -> None:
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).reshape(-1, 3).mean(0)
    got = [np.asarray(decode_image(data)).reshape(-1, 3).mean(0)]
    for backend in ("pillow", "simplejpeg") if have_simplejpeg() else ("pillow",):
        got.append(ImageDecoder(SIDE, backend=backend).decode(data).reshape(-1, 3).mean(0))  # type: ignore[arg-type]
    batch = DecodeBatch(SIDE, label_field=None)([{"__key__": "k", name.rpartition(".")[2]: data}])
    got.append(np.asarray(batch.images[0]).reshape(3, -1).mean(1))
    for mean in got:
        assert np.abs(mean - want).max() < 1.5, (name, mean, want)
