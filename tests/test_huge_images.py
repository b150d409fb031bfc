"""An image past the readers' pixel limit is refused by convert too, naming it and the limit.

Convert and read apply one limit (``streamload.decode.DEFAULT_MAX_PIXELS``): an image the
readers would refuse mid-epoch never enters a dataset; ``--on-error skip`` leaves it out,
listed in the skip report, and the dataset written reads and verifies clean.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path

import pytest
from PIL import Image

from streamload import SourceError, StreamingDataset
from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DEFAULT_MAX_PIXELS, ImageLabel


def _jpeg(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG", quality=50)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two small photos and a 12000x12000 one (flat colour: 2 MB of JPEG, made once)."""
    root = tmp_path_factory.mktemp("huge") / "photos"
    (root / "cat").mkdir(parents=True)
    (root / "dog").mkdir()
    (root / "cat" / "a.jpg").write_bytes(_jpeg((40, 30), (200, 10, 10)))
    (root / "dog" / "b.jpg").write_bytes(_jpeg((30, 40), (10, 200, 10)))
    (root / "dog" / "huge.jpg").write_bytes(_jpeg((12000, 12000), (10, 10, 200)))
    return root


def test_the_huge_photo_is_past_the_readers_limit(folder: Path) -> None:
    assert 12000 * 12000 > DEFAULT_MAX_PIXELS
    sample = {"__key__": "dog/huge", "jpg": (folder / "dog" / "huge.jpg").read_bytes(), "cls": b"1"}
    with pytest.raises(Exception, match=r"12000x12000 = 144000000 pixels is larger than max_pixels=89478485"):
        ImageLabel(size=32)(sample)


def test_convert_refuses_it_naming_the_file_and_the_limit(folder: Path, tmp_path: Path) -> None:
    limit = re.escape(f"{DEFAULT_MAX_PIXELS:,}")
    with pytest.raises(SourceError, match=rf"dog/huge\.jpg: image of 12000x12000 = 144,000,000 pixels .*{limit}"):
        convert(ImageFolderSource(str(folder)), str(tmp_path / "out"), ConvertOptions(progress=False))
    assert not (tmp_path / "out" / "index.json").exists()


def test_skipped_it_is_in_the_skip_report_and_the_dataset_reads_clean(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning escapes either
        assert main(["convert", str(folder), str(out), "--on-error", "skip", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "1 broken input skipped" in captured.out and "library warning" not in captured.out
    assert re.search(
        rf"skipped dog/huge\.jpg: image of 12000x12000 .*{re.escape(f'{DEFAULT_MAX_PIXELS:,}')}", captured.err
    )
    manifest = json.loads((out / "index.json").read_text())
    assert manifest["num_samples"] == 2
    assert [s["path"] for s in manifest["skipped"]] == ["dog/huge.jpg"]
    # What was written reads with the default decoder and verifies clean.
    assert main(["verify", str(out), "--decode"]) == 0
    transform = ImageLabel(size=16)
    assert sorted(label for _, label in (transform(s) for s in StreamingDataset(str(out)))) == [0, 1]


def test_pillows_own_refusal_is_named_with_the_size(tmp_path: Path) -> None:
    # Past twice Pillow's limit Pillow raises instead of warning: the same message, with the size.
    root = tmp_path / "bombs"
    (root / "x").mkdir(parents=True)
    buf = io.BytesIO()
    Image.new("1", (14000, 14000)).save(buf, "PNG")
    (root / "x" / "bomb.png").write_bytes(buf.getvalue())
    with pytest.raises(SourceError, match=r"x/bomb\.png: image of 14000x14000 = 196000000 pixels is larger than"):
        convert(ImageFolderSource(str(root)), str(tmp_path / "out"), ConvertOptions(progress=False))
