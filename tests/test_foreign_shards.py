"""Shards other tools wrote (GNU tar, Python's tarfile, webdataset): member names, suffixes, compression."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from streamload import StreamingDataset
from streamload._errors import CorruptShardError, UnsafeShardError
from streamload.cli import main
from streamload.decode import ImageLabel
from streamload.indexing import index_directory


def _jpeg(value: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (value, value, value)).save(out, "JPEG")
    return out.getvalue()


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _webdataset(shards: list[Path]) -> list[dict[str, object]]:
    return list(wds.WebDataset([str(s) for s in shards], shardshuffle=False, empty_check=False))


def _fields(sample: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def _plain(key: str) -> str:
    """A webdataset key as a path an extraction writes (leading './', empty and '.' parts dropped)."""
    return "/".join(p for p in key.split("/") if p not in ("", "."))


def test_gnu_tar_dot_slash_members_are_indexed_and_read(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i:03d}.jpg").write_bytes(_jpeg(40 * i))
        (src / f"{i:03d}.cls").write_bytes(str(i).encode())
    shards = tmp_path / "shards"
    shards.mkdir()
    subprocess.run(["tar", "-C", str(src), "--sort=name", "-cf", str(shards / "a.tar"), "."], check=True)
    names = tarfile.open(shards / "a.tar").getnames()
    assert "./000.jpg" in names  # what GNU tar writes
    assert main(["index", str(shards)]) == 0
    ours = list(StreamingDataset(str(shards)))
    assert [s["__key__"] for s in ours] == ["000", "001", "002"]
    theirs = _webdataset([shards / "a.tar"])
    assert [_plain(str(s["__key__"])) for s in theirs] == ["000", "001", "002"]
    for mine, their in zip(ours, theirs, strict=True):
        assert _fields(mine) == _fields(their)
    labelled = [ImageLabel()(s) for s in StreamingDataset(str(shards))]
    assert [int(label) for _, label in labelled] == [0, 1, 2]


def test_empty_and_dot_components_are_dropped(tmp_path: Path) -> None:
    _tar(tmp_path / "a.tar", [("a//b.txt", b"1"), ("a/./c.txt", b"2"), ("./d/./e.txt", b"3")])
    index_directory(str(tmp_path))
    ours = list(StreamingDataset(str(tmp_path)))
    assert [(s["__key__"], s["txt"]) for s in ours] == [("a/b", b"1"), ("a/c", b"2"), ("d/e", b"3")]
    theirs = _webdataset([tmp_path / "a.tar"])
    assert [(_plain(str(s["__key__"])), s["txt"]) for s in theirs] == [(s["__key__"], s["txt"]) for s in ours]


@pytest.mark.parametrize("name", ["a/../b.txt", "/abs/b.txt", "bad\x01name.txt"])
def test_unreadable_member_names_are_refused_at_index_time(tmp_path: Path, name: str) -> None:
    _tar(tmp_path / "a.tar", [("fine.txt", b"0"), (name, b"1")])
    with pytest.raises(UnsafeShardError, match=r"a\.tar: member") as caught:
        index_directory(str(tmp_path))
    assert repr(name) in str(caught.value)
    assert not (tmp_path / "index.json").exists()


def test_upper_case_suffixes_are_lower_cased(tmp_path: Path) -> None:
    _tar(tmp_path / "a.tar", [("000.JPG", _jpeg(10)), ("000.Cls", b"1"), ("001.Jpg", _jpeg(20)), ("001.CLS", b"0")])
    manifest = index_directory(str(tmp_path))
    assert manifest.fields == ("cls", "jpg")
    ours = list(StreamingDataset(str(tmp_path), transform=ImageLabel()))
    assert [int(label) for _, label in ours] == [1, 0]
    theirs = _webdataset([tmp_path / "a.tar"])
    raw = list(StreamingDataset(str(tmp_path)))
    assert [_fields(s) for s in theirs] == [_fields(s) for s in raw]


def test_a_suffix_twice_in_two_cases_is_refused_naming_it(tmp_path: Path) -> None:
    _tar(tmp_path / "a.tar", [("000.jpg", b"x"), ("000.JPG", b"y")])
    with pytest.raises(CorruptShardError, match=r"a\.tar: sample '000' has field 'jpg' twice \(member '000\.JPG'"):
        index_directory(str(tmp_path))
    with pytest.raises(ValueError, match="duplicate"):  # webdataset refuses it too
        _webdataset([tmp_path / "a.tar"])
