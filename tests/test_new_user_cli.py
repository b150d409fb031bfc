"""What a new user reads from the command line: options spelled as typed, normalization twins flagged."""

from __future__ import annotations

import io
import unicodedata
from pathlib import Path

import pytest
from PIL import Image

from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, convert


def _jpeg(path: Path, shade: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (shade, 50, 90)).save(buf, "JPEG")
    path.write_bytes(buf.getvalue())


def test_errors_spell_options_as_the_command_line_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "photos"
    _jpeg(root / "cat" / "a.jpg")
    (root / "dog").mkdir()  # an empty class folder: an error unless skipping
    assert main(["convert", str(root), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "empty class folder" in err and "(use --on-error skip to go on)" in err and "on_error" not in err
    # ...and doing what it says works.
    assert main(["convert", str(root), str(tmp_path / "out"), "--no-progress", "--on-error", "skip"]) == 0
    capsys.readouterr()
    for args, said in (
        (["--samples-per-shard", "0"], "--samples-per-shard 0 must be >= 1"),
        (["--shard-size", "0"], "--shard-size 0 must be at least 1 byte"),
        (["--workers", "0"], "--workers 0 must be between 1 and"),
    ):
        assert main(["convert", str(root), str(tmp_path / "o2"), "--no-progress", *args]) == 2
        err = capsys.readouterr().err
        assert said in err and "_" not in err.split("error: ", 1)[1], err


def test_only_options_of_the_command_are_respelled_never_paths() -> None:
    from streamload.cli.parser import build_parser, cli_spelling, subparser

    index = subparser(build_parser(), "index")
    convert_parser = subparser(build_parser(), "convert")
    # A Hive-style folder name is a path, not an option, even where --split exists.
    assert cli_spelling("data/split=train: no *.parquet files", index) == "data/split=train: no *.parquet files"
    assert cli_spelling("use on_error='skip' to go on", index) == "use --on-error skip to go on"
    # A keyword that is no option of the command stays as the library wrote it.
    assert cli_spelling("max_pixels=89478485 exceeded", convert_parser) == "max_pixels=89478485 exceeded"
    assert cli_spelling("shard_bytes='0' must be", convert_parser) == "--shard-size 0 must be"


def test_convert_flags_file_and_class_names_that_are_normalization_twins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    zoe_nfc, zoe_nfd = unicodedata.normalize("NFC", "Zoë"), unicodedata.normalize("NFD", "Zoë")
    root = tmp_path / "photos"
    _jpeg(root / nfc / "a.jpg", 1)
    _jpeg(root / nfd / "b.jpg", 2)
    _jpeg(root / "plain" / f"{zoe_nfc}.jpg", 3)
    _jpeg(root / "plain" / f"{zoe_nfd}.jpg", 4)
    _jpeg(root / "plain" / "other.jpg", 5)
    report = convert(ImageFolderSource(str(root)), str(tmp_path / "out"), ConvertOptions(progress=False))
    assert report.manifest.num_samples == 5  # twins are kept: they are different names
    twins = {(t.path, t.error.split("]")[0] + "]") for t in report.twins}
    assert twins == {
        (f"{nfc}/", "[NFC twin]"),
        (f"{nfd}/", "[NFD twin]"),
        (f"plain/{zoe_nfc}.jpg", "[NFC twin]"),
        (f"plain/{zoe_nfd}.jpg", "[NFD twin]"),
    }
    by_path = {t.path: t.error for t in report.twins}
    assert "a different class" in by_path[f"{nfc}/"] and f"{nfd}/ (NFD)" in by_path[f"{nfc}/"]
    assert "a different sample" in by_path[f"plain/{zoe_nfd}.jpg"]
    assert "4 Unicode normalization twins" in report.summary()
    # The command line lists them as info marks class names.
    assert main(["convert", str(root), str(tmp_path / "out2"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"  twin plain/{zoe_nfd}.jpg [NFD twin] looks identical to plain/{zoe_nfc}.jpg (NFC)" in err
