"""Every still-image kind a folder may hold, library warnings reported per file, folders without classes."""

from __future__ import annotations

import io
import json
import logging
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from streamload import SampleError, SourceError, StreamingDataset
from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DecodeBatch, ImageLabel
from streamload.sample import IMAGE_EXTENSIONS, IMAGE_FIELDS, image_warnings, sniff_image

#: Pillow format and extension of every kind the list promises.
KINDS = {
    "jpg": "JPEG",
    "jpeg": "JPEG",
    "png": "PNG",
    "webp": "WEBP",
    "gif": "GIF",
    "bmp": "BMP",
    "tif": "TIFF",
    "tiff": "TIFF",
    "ppm": "PPM",
    "pgm": "PPM",
    "pbm": "PPM",
    "pnm": "PPM",
}


def encode(ext: str, size: tuple[int, int] = (12, 10), colour: tuple[int, int, int] = (200, 40, 90)) -> bytes:
    mode = {"pgm": "L", "pbm": "1"}.get(ext, "RGB")
    img = Image.new("RGB", size, colour).convert(mode)
    buf = io.BytesIO()
    img.save(buf, KINDS[ext])
    return buf.getvalue()


def tiff_with_tag_warning() -> bytes:
    """A valid TIFF whose PlanarConfiguration tag claims two values: Pillow warns, then decodes it."""
    data = bytearray(encode("tif"))
    ifd = struct.unpack("<I", data[4:8])[0]
    for i in range(struct.unpack("<H", data[ifd : ifd + 2])[0]):
        entry = ifd + 2 + 12 * i
        if struct.unpack("<H", data[entry : entry + 2])[0] == 284:
            data[entry + 4 : entry + 8] = struct.pack("<I", 2)
    return bytes(data)


def bomb_png() -> bytes:
    """A PNG of slightly more pixels than Pillow's limit (its DecompressionBombWarning), 11 kB."""
    buf = io.BytesIO()
    Image.new("1", (9500, 9500)).save(buf, "PNG")
    return buf.getvalue()


def test_one_list_of_kinds_and_sniffing() -> None:
    assert set(KINDS) == IMAGE_EXTENSIONS == set(IMAGE_FIELDS)
    from streamload.converters import IMAGE_EXTENSIONS as converter_kinds

    assert converter_kinds is IMAGE_EXTENSIONS
    expected = {"jpeg": "jpg", "tiff": "tif", "pnm": "ppm"}
    for ext in KINDS:
        assert sniff_image(encode(ext)) == expected.get(ext, ext), ext
    assert sniff_image(b"not an image at all") is None
    assert sniff_image(b"P7 arbitrary") is None


def test_image_warnings_records_and_restores() -> None:
    with image_warnings():
        pass  # its one filter is put in place once; the blocks change nothing after that
    before = list(warnings.filters)
    with image_warnings() as outer:
        warnings.warn("first", UserWarning, stacklevel=1)
        with image_warnings() as inner:
            warnings.warn("second", RuntimeWarning, stacklevel=1)
        warnings.warn("first", UserWarning, stacklevel=1)  # same place again: still recorded
    assert inner == ["RuntimeWarning: second"]
    assert outer == ["UserWarning: first", "RuntimeWarning: second", "UserWarning: first"]
    assert warnings.filters == before


@pytest.fixture
def kinds_folder(tmp_path: Path) -> Path:
    root = tmp_path / "kinds"
    for i, ext in enumerate(KINDS):
        cls = root / ("a" if i % 2 else "b")
        cls.mkdir(parents=True, exist_ok=True)
        (cls / f"img{i}.{ext.upper() if ext == 'tif' else ext}").write_bytes(encode(ext))
    (root / "a" / "tagged.tiff").write_bytes(tiff_with_tag_warning())
    (root / "b" / "huge.png").write_bytes(bomb_png())
    (root / "b" / "notes.txt").write_text("not an image")
    return root


def test_convert_keeps_every_kind_and_reports_warnings_per_file(
    kinds_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning escaping the report would fail the conversion
        args = [
            "convert",
            str(kinds_folder),
            str(out),
            "--no-progress",
            "--samples-per-shard",
            "5",
            "--on-error",
            "skip",
        ]
        assert main(args) == 0
    captured = capsys.readouterr()
    assert "1 non-input file ignored" in captured.out
    assert "1 library warning" in captured.out
    lines = [line for line in captured.err.splitlines() if line.startswith("  warning ")]
    assert lines[0].startswith("  warning a/tagged.tiff: UserWarning: Metadata Warning, tag 284")
    assert len(lines) == 1
    # An image past the readers' pixel limit (Pillow warns of a bomb) is left out, not kept.
    assert "  skipped b/huge.png: image of 9500x9500 = 90,250,000 pixels is larger than" in captured.err
    manifest = json.loads((out / "index.json").read_text())
    assert manifest["num_samples"] == len(KINDS) + 1
    assert set(manifest["fields"]) == {*KINDS, "cls"}

    # Every kind reads back and decodes; the TIFF's warning is logged naming the sample.
    ds = StreamingDataset(str(out), transform=ImageLabel(size=8, max_pixels=10**8))
    transform = ds.transform
    assert isinstance(transform, ImageLabel)
    seen = {}
    logger = logging.getLogger("streamload.decode")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for sample in StreamingDataset(str(out)):
                if sample["__key__"] != "b/huge":
                    image, label = transform(sample)
                    seen[sample["__key__"]] = (tuple(image.shape), label)
    finally:
        logger.removeHandler(handler)
    assert len(seen) == len(KINDS) + 1
    assert "b/huge" not in seen
    assert all(shape == (3, 8, 8) for shape, _ in seen.values())
    assert transform.warnings == 1
    assert [r.getMessage() for r in records] == [
        "sample 'a/tagged' field 'tiff': UserWarning: Metadata Warning, tag 284 had too many entries: 2, expected 1"
    ]


def test_flat_folder_converts_without_labels(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    root.mkdir()
    for i, ext in enumerate(("jpg", "png", "tif", "ppm")):
        (root / f"x{i}.{ext}").write_bytes(encode(ext, colour=(10 * i, 0, 0)))
    out = tmp_path / "out"
    assert main(["convert", str(root), str(out), "--no-progress"]) == 0
    manifest = json.loads((out / "index.json").read_text())
    assert manifest["num_samples"] == 4
    assert manifest["classes"] == []
    assert "cls" not in manifest["fields"]

    samples = list(StreamingDataset(str(out)))
    assert sorted(s["__key__"] for s in samples) == ["x0", "x1", "x2", "x3"]
    image = ImageLabel(size=8, label_field=None)(samples[0])
    assert tuple(image.shape) == (3, 8, 8)
    with pytest.raises(SampleError, match="label_field=None"):
        ImageLabel(size=8)(samples[0])
    batch = DecodeBatch(8, label_field=None)(samples)
    images, labels = batch
    assert tuple(images.shape) == (4, 3, 8, 8) and labels is None
    assert int(images[0, 0].float().mean()) == 0 and int(images[3, 0].float().mean()) == 30

    # --labels folders names the way out on a flat folder, and nothing is written.
    assert main(["convert", str(root), str(tmp_path / "o2"), "--labels", "folders", "--no-progress"]) == 2
    assert not (tmp_path / "o2" / "index.json").exists()


def test_labels_none_reads_a_tree_whose_folders_are_not_classes(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for rel in ("2024/01/a.jpg", "2024/02/b.png", "top.webp", "2025/c.pgm"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(encode(rel.rpartition(".")[2]))
    (root / "2024" / "readme.md").write_text("x")
    source = ImageFolderSource(str(root), labels="none")
    assert source.classes == []
    scan = source.scan()
    assert sorted(item.key for item in scan.items) == ["2024/01/a", "2024/02/b", "2025/c", "top"]
    assert [i.path for i in scan.ignored] == ["2024/readme.md"]
    out = tmp_path / "out"
    report = convert(source, str(out), ConvertOptions(samples_per_shard=3, progress=False))
    assert report.manifest.classes == () and report.manifest.num_samples == 4
    by_key = {s["__key__"]: s for s in StreamingDataset(str(out))}
    assert by_key["2025/c"]["pgm"] == (root / "2025/c.pgm").read_bytes()
    assert all("cls" not in s for s in by_key.values())
    # The default reads the sub-folders as classes, and then refuses the image beside them (it
    # has no class); "folders" on a folder without any is refused.
    with pytest.raises(SourceError, match=r"1 image\(s\) lie directly in the folder.*top\.webp.*--labels none"):
        ImageFolderSource(str(root))
    (root / "top.webp").unlink()
    assert ImageFolderSource(str(root)).classes == ["2024", "2025"]
    with pytest.raises(SourceError, match="--labels none"):
        ImageFolderSource(str(root / "2024" / "01"), labels="folders")
    with pytest.raises(SourceError, match="labels="):
        ImageFolderSource(str(root), labels="maybe")


def test_decode_batch_counts_warnings(tmp_path: Path) -> None:
    samples = [{"__key__": "t", "tiff": tiff_with_tag_warning(), "cls": b"1"}, {"__key__": "p", "png": encode("png")}]
    samples[1]["cls"] = b"2"
    collate = DecodeBatch(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        images, labels = collate(samples)
    assert collate.warnings == 1
    assert labels is not None and labels.tolist() == [1, 2]
    assert np.asarray(images[1]).shape == (3, 6, 6)
