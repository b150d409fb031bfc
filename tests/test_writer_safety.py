"""DatasetWriter and ``streamload index`` take the destination's writer lock and never destroy a dataset by accident."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from streamload import StreamingDataset
from streamload._errors import ConfigError, DestinationBusyError
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.indexing import index_directory
from streamload.synthetic import make_image_folder
from streamload.writer import DatasetWriter


def _write(root: Path, tag: bytes, n: int = 6, **kwargs: object) -> None:
    with DatasetWriter(str(root), max_samples=4, **kwargs) as w:  # type: ignore[arg-type]
        for i in range(n):
            w.write({"__key__": f"k{i:03d}", "txt": tag + str(i).encode()})


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def test_a_second_writer_refuses_an_existing_dataset_and_touches_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _write(root, b"old")
    before = _digests(root)
    with pytest.raises(ConfigError, match=r"already holds a dataset .*overwrite=True"):
        _write(root, b"new")
    assert _digests(root) == before
    assert [s["txt"] for s in StreamingDataset(str(root))] == [b"old%d" % i for i in range(6)]


def test_overwrite_replaces_the_dataset(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _write(root, b"old")
    _write(root, b"new", n=3, overwrite=True)
    assert [s["txt"] for s in StreamingDataset(str(root))] == [b"new%d" % i for i in range(3)]


def test_two_writers_never_write_one_destination_at_once(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    first = DatasetWriter(str(root), max_samples=2)
    first.write({"__key__": "a", "txt": b"1"})
    with pytest.raises(DestinationBusyError):
        DatasetWriter(str(root), max_samples=2)
    with pytest.raises(DestinationBusyError):
        index_directory(str(root))
    folder = tmp_path / "images"
    make_image_folder(str(folder), num_classes=2, per_class=2, size=(16, 16))
    with pytest.raises(DestinationBusyError):
        convert(ImageFolderSource(str(folder)), str(root), ConvertOptions(progress=False, overwrite=True))
    first.close()
    assert [s["__key__"] for s in StreamingDataset(str(root))] == ["a"]
    _write(root, b"next", n=2, overwrite=True)  # the lock was given back


def test_a_failed_with_block_publishes_nothing_and_frees_the_destination(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="boom"), DatasetWriter(str(root), max_samples=2) as w:
        for i in range(5):
            w.write({"__key__": f"k{i}", "txt": b"x"})
        raise RuntimeError("boom")
    assert not (root / "index.json").exists()
    _write(root, b"after", n=2)
    assert len(list(StreamingDataset(str(root)))) == 2
