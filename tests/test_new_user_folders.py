"""A new user's image folder: empty and looping class folders, files convert does not take.

Only folders that gave samples are classes (the others are in the skip report), and every
file convert does not take is named with why: hidden ones, notes, and photos of kinds it
does not read (HEIC, AVIF: with the Pillow plugin that reads them).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import PIL
import pytest
from PIL import Image, features

from streamload import StreamingDataset
from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, convert


def _image(fmt: str, shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (10, 8), (shade, 90, 30)).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "photos"
    for rel, fmt in (
        ("cat/a.jpg", "JPEG"),
        ("cat/b.png", "PNG"),
        ("dog/c.jpg", "JPEG"),
        ("dog/.hidden_good.jpg", "JPEG"),
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(_image(fmt, len(rel)))
    (root / "dog" / "notes.txt").write_text("where these came from")
    (root / "dog" / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic" + b"\x00" * 16)  # a phone's photo
    (root / "empty").mkdir()
    (root / "loop").symlink_to(root)  # a class folder that leads back to the image folder
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]")
    (root / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    return root


def test_only_folders_that_gave_samples_are_classes(folder: Path, tmp_path: Path) -> None:
    report = convert(
        ImageFolderSource(str(folder)), str(tmp_path / "out"), ConvertOptions(progress=False, on_error="skip")
    )
    assert report.manifest.classes == ("cat", "dog")
    skipped = {s.path: s.error for s in report.skipped}
    assert set(skipped) == {"empty/", "loop/"}
    assert "empty class folder" in skipped["empty/"] and "link loop" in skipped["loop/"]
    labels = {s["__key__"]: int(s["cls"]) for s in StreamingDataset(str(tmp_path / "out"))}
    assert labels == {"cat/a": 0, "cat/b": 0, "dog/c": 1}


def test_every_file_not_taken_is_named_with_why(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    avif = folder / "cat" / "phone.avif"
    if features.check("avif"):  # a real AVIF where this Pillow writes them
        Image.new("RGB", (10, 8), (1, 2, 3)).save(avif)
    else:
        avif.write_bytes(b"\x00\x00\x00\x1cftypavif")
    out = tmp_path / "out"
    assert main(["convert", str(folder), str(out), "--on-error", "skip", "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert "6 non-input files ignored" in printed.out
    ignored = {
        line.split(": ", 1)[0].removeprefix("  ignored "): line.split(": ", 1)[1]
        for line in printed.err.splitlines()
        if line.startswith("  ignored ")
    }
    assert set(ignored) == {
        ".DS_Store",
        ".git/",
        "cat/phone.avif",
        "dog/.hidden_good.jpg",
        "dog/IMG_0001.HEIC",
        "dog/notes.txt",
    }
    assert ignored["dog/notes.txt"] == "not an image file extension"
    assert ignored["dog/.hidden_good.jpg"].startswith("hidden") and ignored[".git/"].startswith("hidden")
    assert "a HEIC photo" in ignored["dog/IMG_0001.HEIC"] and "pillow-heif" in ignored["dog/IMG_0001.HEIC"]
    said = ignored["cat/phone.avif"]
    assert "an AVIF photo" in said and "11.3" in said and "pillow-avif-plugin" in said
    assert f"this Pillow {PIL.__version__} {'is' if features.check('avif') else 'is not'}" in said
    # The photos not taken are named first (a user looks there first).
    order = [line for line in printed.err.splitlines() if line.startswith("  ignored ")]
    assert {order[0].split(":")[0], order[1].split(":")[0]} == {
        "  ignored cat/phone.avif",
        "  ignored dog/IMG_0001.HEIC",
    }
    assert json.loads((out / "index.json").read_text())["num_samples"] == 3


def test_many_ignored_files_name_twenty_and_count_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "photos"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "a.jpg").write_bytes(_image("JPEG", 1))
    for i in range(30):
        (root / "cat" / f"note{i:02d}.txt").write_text("x")
    (root / "cat" / "zz.heic").write_bytes(b"\x00\x00\x00\x18ftypheic")
    assert main(["convert", str(root), str(tmp_path / "out"), "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    named = [line for line in err if line.startswith("  ignored ")]
    assert len(named) == 20 and named[0].startswith("  ignored cat/zz.heic: a HEIC photo")
    assert "  ... and 11 more non-input files ignored" in err


def test_unlabelled_folder_names_hidden_files_too(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    root.mkdir()
    (root / "a.jpg").write_bytes(_image("JPEG", 1))
    (root / ".b.jpg").write_bytes(_image("JPEG", 2))
    os.mkdir(root / ".thumbs")
    scan = ImageFolderSource(str(root)).scan()
    assert [i.key for i in scan.items] == ["a"]
    assert sorted(s.path for s in scan.ignored) == [".b.jpg", ".thumbs/"]


def test_a_bucket_folder_names_hidden_objects_and_other_photos(tmp_path: Path) -> None:
    import fsspec

    from streamload.converters.bucket import RemoteImageFolderSource

    fs = fsspec.filesystem("memory")
    root = f"/newuser-{tmp_path.name}"
    objects = {"cat/a.jpg": _image("JPEG", 1), "cat/.b.jpg": _image("JPEG", 2), "dog/c.png": _image("PNG", 3)}
    objects |= {".git/config": b"[core]", ".git/HEAD": b"ref", "dog/note.txt": b"x", "dog/p.HEIC": b"x"}
    try:
        for rel, data in objects.items():
            fs.pipe_file(f"{root}/{rel}", data)
        scan = RemoteImageFolderSource(f"memory://{root}").scan()
        assert sorted(i.key for i in scan.items) == ["cat/a", "dog/c"]
        ignored = {s.path: s.error for s in scan.ignored}
        assert set(ignored) == {".git/", "cat/.b.jpg", "dog/note.txt", "dog/p.HEIC"}  # a hidden folder once
        assert ignored["cat/.b.jpg"].startswith("hidden") and "pillow-heif" in ignored["dog/p.HEIC"]
    finally:
        fs.rm(root, recursive=True)
