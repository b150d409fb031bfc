"""Inputs as people have them: images beside class folders, broken files, ``datasets`` outputs, BigTIFF.

The Parquet files, the path-only image column and the ``save_to_disk`` folders are written
by the real Hugging Face ``datasets`` library; the BigTIFF by Pillow's ``big_tiff=True``.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from streamload import ShardedDataset, StreamingDataset
from streamload.cli import main

datasets = pytest.importorskip("datasets")

CLASSES = ["cat", "dog"]


def encode(fmt: str, shade: int = 0, **options: object) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (shade, 40, 200)).save(buf, fmt, **options)
    return buf.getvalue()


def hf_dataset(n: int, *, paths: list[str] | None = None) -> object:
    """A ``datasets.Dataset`` of ``n`` PNGs (embedded, or by ``paths``) with a ClassLabel."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    images: list[object] = paths or [{"bytes": encode("PNG", i), "path": None} for i in range(n)]
    return datasets.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(n)]}, features=features)


@pytest.fixture(scope="module")
def hf_split_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The usual Hugging Face layout: train and test files side by side in one folder."""
    root = tmp_path_factory.mktemp("hf") / "data"
    root.mkdir()
    hf_dataset(4).to_parquet(str(root / "train-00000-of-00001.parquet"))  # type: ignore[attr-defined]
    hf_dataset(2).to_parquet(str(root / "test-00000-of-00001.parquet"))  # type: ignore[attr-defined]
    return root


def image_folder(root: Path, classes: dict[str, int]) -> Path:
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            (root / name / f"{i}.png").write_bytes(encode("PNG", i))
    return root


# -- convert ---------------------------------------------------------------------------


def test_images_beside_class_folders_are_refused_saying_how_many_and_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path / "imgs", {"a": 3, "b": 3})
    for i in range(4):
        (root / f"loose{i}.jpg").write_bytes(encode("JPEG", i))
    out = tmp_path / "out"
    assert main(["convert", str(root), str(out), "--no-progress", "--on-error", "skip"]) == 2
    err = capsys.readouterr().err
    assert "4 image(s) lie directly in the folder" in err and "--labels none" in err and "loose0.jpg" in err
    assert len(err.strip().splitlines()) == 1 and not (out / "index.json").exists()
    # What the message says to do works: every image, without labels.
    assert main(["convert", str(root), str(out), "--no-progress", "--labels", "none"]) == 0
    assert ShardedDataset(str(out)).manifest.num_samples == 10


def test_skip_report_counts_broken_images_and_empty_class_folders_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path / "imgs", {"a": 2, "b": 1})
    (root / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)  # a PNG's magic, then nothing
    (root / "b" / "text.jpg").write_bytes(b"plain text, not a JPEG")
    (root / "nothing_here").mkdir()
    (root / "nothing_there").mkdir()
    assert main(["convert", str(root), str(tmp_path / "out"), "--no-progress", "--on-error", "skip"]) == 0
    printed = capsys.readouterr()
    assert "2 broken inputs skipped, 2 empty class folders, 0 non-input files ignored" in printed.out
    lines = [line for line in printed.err.splitlines() if line.startswith("  skipped ")]
    assert sorted(line.split(":")[0] for line in lines) == [
        "  skipped a/broken.png",
        "  skipped b/text.jpg",
        "  skipped nothing_here/",
        "  skipped nothing_there/",
    ]
    for line in lines:  # each path once, no object reprs
        name = line.split()[1].rstrip(":").rstrip("/")
        assert line.count(name) == 1, line
        assert "object at 0x" not in line and str(root) not in line, line


def test_bigtiff_is_kept_by_convert_and_by_index_and_read_back(tmp_path: Path) -> None:
    big = encode("TIFF", big_tiff=True)
    assert big[:4] == b"II+\x00"
    root = image_folder(tmp_path / "imgs", {"a": 1})
    (root / "a" / "big.tif").write_bytes(big)
    assert main(["convert", str(root), str(tmp_path / "conv"), "--no-progress"]) == 0
    assert {s["__key__"]: s for s in StreamingDataset(str(tmp_path / "conv"))}["a/big"]["tif"] == big
    table = tmp_path / "pq"
    table.mkdir()
    pq.write_table(pa.table({"image": pa.array([encode("PNG"), big], pa.binary())}), table / "t.parquet")
    assert main(["index", str(table), "--format", "parquet"]) == 0
    assert ShardedDataset(str(table))[1]["tif"] == big


def test_convert_of_hugging_face_parquet_keeps_the_classlabel_names(hf_split_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["convert", str(hf_split_dir / "train-00000-of-00001.parquet"), str(out), "--no-progress"]) == 0
    ds = ShardedDataset(str(out))
    assert ds.manifest.classes == tuple(CLASSES)
    assert sorted(int(ds[i]["cls"]) for i in range(len(ds))) == [0, 0, 1, 1]


def test_image_column_stored_by_path_says_so_and_is_read_under_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    paths = []
    for i in range(3):
        (files / f"{i}.png").write_bytes(encode("PNG", i))
        paths.append(str(files / f"{i}.png"))
    folder = tmp_path / "pq"
    folder.mkdir()
    table = folder / "train.parquet"
    hf_dataset(3, paths=paths).to_parquet(str(table))  # type: ignore[attr-defined]
    assert pq.read_table(table).column("image")[0]["bytes"].as_py() is None  # datasets kept only the path
    assert main(["index", str(folder), "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "row 0 has no image bytes, only a path" in err and "stored by path" in err and "--root" in err
    assert main(["convert", str(table), str(tmp_path / "no-root"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "stored by path" in err and "--root DIR" in err
    out = tmp_path / "out"
    assert main(["convert", str(table), str(out), "--no-progress", "--root", str(files)]) == 0
    ds = ShardedDataset(str(out))
    assert sorted(ds[i]["png"] for i in range(len(ds))) == sorted(Path(p).read_bytes() for p in paths)
    assert ds.manifest.classes == tuple(CLASSES)


def test_save_to_disk_folders_are_recognised_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    single = tmp_path / "saved"
    hf_dataset(2).save_to_disk(str(single))  # type: ignore[attr-defined]
    splits = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": hf_dataset(2), "test": hf_dataset(1)}).save_to_disk(str(splits))
    for command in (["convert", str(single), str(tmp_path / "o1")], ["index", str(single), "--format", "parquet"]):
        assert main([*command, "--no-progress"] if command[0] == "convert" else command) == 2
        err = capsys.readouterr().err
        assert "written by save_to_disk" in err and "load_from_disk" in err and ".to_parquet(" in err, err
    assert main(["convert", str(splits), str(tmp_path / "o2"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "DatasetDict" in err and "splits: test, train" in err and "['train'].to_parquet(" in err


# -- index -------------------------------------------------------------------------------


def test_splits_side_by_side_each_get_their_own_index(hf_split_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    for f in hf_split_dir.iterdir():
        if f.suffix == ".parquet":
            (folder / f.name).write_bytes(f.read_bytes())
    assert main(["index", str(folder), "--format", "parquet", "--split", "train"]) == 0
    assert main(["index", str(folder), "--format", "parquet", "--split", "test"]) == 0
    train, test = ShardedDataset(str(folder / "train")), ShardedDataset(str(folder / "test"))
    assert (len(train), len(test)) == (4, 2)
    assert train.manifest.classes == test.manifest.classes == tuple(CLASSES)
    assert train.manifest.meta["split"] == "train" and [s.name for s in test.manifest.shards] == [
        "test-00000-of-00001.parquet"
    ]
    assert len(list(StreamingDataset(str(folder / "test")))) == 2
    assert not (folder / "index.json").exists()


def test_index_refuses_to_replace_an_index_without_overwrite(
    hf_split_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    for f in hf_split_dir.iterdir():
        if f.suffix == ".parquet":
            (folder / f.name).write_bytes(f.read_bytes())
    assert main(["index", str(folder), "--format", "parquet", "--match", "train-*.parquet"]) == 0
    before = (folder / "index.json").read_bytes()
    assert main(["index", str(folder), "--format", "parquet", "--match", "test-*.parquet"]) == 2
    err = capsys.readouterr().err
    assert "already holds an index" in err and "--overwrite" in err and "--split" in err
    assert (folder / "index.json").read_bytes() == before
    assert main(["index", str(folder), "--format", "parquet", "--match", "test-*.parquet", "--overwrite"]) == 0
    assert len(ShardedDataset(str(folder))) == 2


def test_index_never_replaces_a_converted_or_foreign_dataset(
    hf_split_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    converted = tmp_path / "converted"
    src = image_folder(tmp_path / "imgs", {"x": 2, "y": 2})
    assert main(["convert", str(src), str(converted), "--no-progress"]) == 0
    manifest = (converted / "index.json").read_bytes()
    # index over it (tar, in place) and index --output into it: refused, --overwrite or not
    for extra in ([], ["--overwrite"]):
        assert main(["index", str(converted), "--format", "tar", *extra]) == 2
        assert "written by streamload convert" in capsys.readouterr().err
        command = ["index", str(hf_split_dir), "--format", "parquet", "--match", "train-*", "--output", str(converted)]
        assert main([*command, *extra]) == 2
        assert "written by streamload convert" in capsys.readouterr().err
    assert (converted / "index.json").read_bytes() == manifest
    assert ShardedDataset(str(converted)).manifest.classes == ("x", "y")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "index.json").write_text(json.dumps({"someone": "else"}))
    command = ["index", str(hf_split_dir), "--format", "parquet", "--match", "train-*", "--output", str(foreign)]
    assert main([*command, "--overwrite"]) == 2
    assert "another dataset's index.json" in capsys.readouterr().err
    assert json.loads((foreign / "index.json").read_text()) == {"someone": "else"}


def test_index_on_error_skip_lists_bad_rows_and_reads_the_good_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    images = [encode("PNG", 1), b"not an image", encode("TIFF", big_tiff=True), b"", encode("JPEG", 2)]
    labels = pa.array([0, 1, 1, 0, None], pa.int64())
    table = pa.table({"image": pa.array(images, pa.binary()), "label": labels})
    pq.write_table(table, folder / "a.parquet", row_group_size=2)
    assert main(["index", str(folder), "--format", "parquet"]) == 2
    assert "row 1 holds bytes that are not an image" in capsys.readouterr().err
    assert main(["index", str(folder), "--format", "parquet", "--on-error", "skip"]) == 0
    printed = capsys.readouterr()
    assert "2 samples, 3 bad rows skipped" in printed.out
    ds = ShardedDataset(str(folder))
    assert {s.path: s.error for s in ds.manifest.skipped} == {
        "a.parquet: row 1": "column 'image': holds bytes that are not an image",
        "a.parquet: row 3": "column 'image': has no image bytes",
        "a.parquet: row 4": "column 'label': has no label",
    }
    for path in ds.manifest.skipped:
        assert f"skipped {path.path}: {path.error}" in printed.err
    read = {s["__key__"]: s for s in StreamingDataset(str(folder))}
    assert sorted(read) == ["a/0000000000", "a/0000000002"]  # keys keep the rows' numbers
    assert read["a/0000000000"]["png"] == images[0] and read["a/0000000002"]["tif"] == images[2]
    assert [ds[i]["cls"] for i in range(2)] == [b"0", b"1"]
    assert main(["verify", str(folder)]) == 0


@pytest.mark.timeout(120)
def test_index_refuses_a_fifo_and_a_folder_named_parquet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"image": pa.array([encode("PNG")], pa.binary())}), folder / "a.parquet")
    os.mkfifo(folder / "fifo.parquet")  # opening it for reading would wait for a writer forever
    assert main(["index", str(folder), "--format", "parquet"]) == 2
    assert "fifo.parquet: not a regular file" in capsys.readouterr().err
    os.unlink(folder / "fifo.parquet")
    (folder / "dir.parquet").mkdir()
    assert main(["index", str(folder), "--format", "parquet"]) == 2
    assert "dir.parquet: a directory, not a Parquet file" in capsys.readouterr().err
    assert not (folder / "index.json").exists()


def test_index_classes_must_be_distinct_and_cover_the_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    labels = pa.array([0, 7], pa.int64())
    pq.write_table(pa.table({"image": pa.array([encode("PNG")] * 2), "label": labels}), folder / "a.parquet")
    assert main(["index", str(folder), "--format", "parquet", "--classes", "a,b"]) == 2
    assert "row 1 has label 7 (expected 0..1)" in capsys.readouterr().err
    assert main(["index", str(folder), "--format", "parquet", "--classes", "a,b,a"]) == 2
    assert "names class 'a' more than once" in capsys.readouterr().err
    assert not (folder / "index.json").exists()


def test_index_one_line_errors_for_odd_arguments_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    big = pa.array([1, 2**64 - 1], pa.uint64())
    pq.write_table(pa.table({"image": pa.array([encode("PNG")] * 2), "label": big}), folder / "big.parquet")
    empty = pa.table({"image": pa.array([], pa.binary()), "label": pa.array([], pa.int64())})
    pq.write_table(empty, folder / "empty.parquet")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["--match", "big.parquet"], "row 1 has label 18446744073709551615 (expected >= 0)"),
        (["--match", "empty.parquet"], "empty.parquet: holds no rows"),
        (["--match", ""], "--match '' matches no file name"),
        (["--match", "big.parquet", "--output", str(a_file)], f"--output {a_file} is not a folder"),
    ]
    for extra, expected in cases:
        assert main(["index", str(folder), "--format", "parquet", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    assert a_file.read_text() == "x"
