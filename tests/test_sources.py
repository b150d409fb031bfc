"""Sources beyond a local folder: listing tables (CSV, JSONL, Parquet with embedded bytes) and buckets.

Real parts: pyarrow-written Parquet, CSV files of relative paths, SeaweedFS (tests/s3server.py)
as both the source bucket and the destination bucket.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamload._errors import ConfigError, SourceError
from streamload.cli import main
from streamload.converters import (
    ConvertOptions,
    DatasetSource,
    ImageFolderSource,
    RemoteImageFolderSource,
    TableSource,
    convert,
    open_source,
)
from streamload.synthetic import make_image_folder
from tests.s3server import SeaweedS3

OPTS = {"samples_per_shard": 5, "progress": False}


def _samples(url: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    src = DatasetSource(url, storage_options)
    try:
        return [src.load(item) for item in src.scan().items]
    finally:
        src.close()


def _images(root: Path) -> list[tuple[str, str, bytes]]:
    """(relative path, class, bytes) of every image under ``root``, sorted."""
    return sorted((p.relative_to(root).as_posix(), p.parent.name, p.read_bytes()) for p in root.rglob("*.jpg"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("table-images")
    make_image_folder(str(root), num_classes=3, per_class=6, size=(24, 20), seed=3)
    return root


def test_each_kind_of_source_takes_its_own_keywords(folder: Path, tmp_path: Path) -> None:
    (folder / "kinds.csv").write_text("path,label\n")
    try:
        with pytest.raises(
            ConfigError, match=r"a local image folder: it takes no path_column= \(its options: check=, labels=\)"
        ):
            open_source(str(folder), path_column="file")
        with pytest.raises(ConfigError, match="a listing table: it takes no labels="):
            open_source(str(folder / "kinds.csv"), labels="none")
    finally:
        (folder / "kinds.csv").unlink()
    convert(open_source(str(folder), labels="folders"), str(tmp_path / "ds"), ConvertOptions(**OPTS))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="an existing dataset: it takes no check="):
        open_source(str(tmp_path / "ds"), check="none")
    source = open_source(str(tmp_path / "ds"), allow_data_roots=["s3://theirs/x"])
    assert isinstance(source, DatasetSource)
    assert source.ref.config.allow_data_roots == {"s3://theirs/x": {}}  # the manifest's readers may go there
    source.close()


def test_csv_of_relative_paths_with_class_names(folder: Path, tmp_path: Path) -> None:
    images = _images(folder)
    lines = ["path,label"] + [f"{rel},{cls}" for rel, cls, _ in images]
    (folder / "list.csv").write_text("\n".join(lines) + "\n")
    try:
        source = open_source(str(folder / "list.csv"))
        assert isinstance(source, TableSource)
        report = convert(source, str(tmp_path / "out"), ConvertOptions(**OPTS))  # type: ignore[arg-type]
    finally:
        (folder / "list.csv").unlink()
    m = report.manifest
    assert list(m.classes) == sorted({cls for _, cls, _ in images})  # class names sorted into indices
    assert m.meta["labels"] == "class names, sorted"
    samples = _samples(str(tmp_path / "out"))
    assert [s["__key__"] for s in samples] == [f"list/{i:010d}" for i in range(len(images))]
    for sample, (_, cls, data) in zip(samples, images, strict=True):
        assert sample["jpg"] == data
        assert m.classes[int(sample["cls"])] == cls


def test_jsonl_with_int_labels_and_kept_columns(folder: Path, tmp_path: Path) -> None:
    images = _images(folder)
    table = tmp_path / "rows.jsonl"
    table.write_text(
        "".join(
            json.dumps({"path": str(folder / rel), "label": i % 3, "caption": f"img {i}", "w": 24}) + "\n"
            for i, (rel, _, _) in enumerate(images)
        )
    )
    source = TableSource(str(table), keep_columns=["caption", "w"])
    convert(source, str(tmp_path / "out"), ConvertOptions(**OPTS))  # type: ignore[arg-type]
    samples = _samples(str(tmp_path / "out"))
    assert len(samples) == len(images)
    for i, sample in enumerate(samples):
        assert int(sample["cls"]) == i % 3
        assert json.loads(sample["json"]) == {"caption": f"img {i}", "w": 24}
        assert sample["jpg"] == images[i][2]


@pytest.mark.parametrize("struct", [True, False], ids=["hf-image-struct", "binary"])
def test_parquet_with_embedded_bytes_read_a_row_group_at_a_time(folder: Path, tmp_path: Path, struct: bool) -> None:
    images = _images(folder)
    if struct:
        col = pa.array([{"bytes": data, "path": rel.rsplit("/", 1)[1]} for rel, _, data in images])
    else:
        col = pa.array([data for _, _, data in images], type=pa.binary())
    labels = pa.array([rel.split("/")[0] for rel, _, _ in images])
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"image": col, "label": labels}), path, row_group_size=4)
    assert pq.ParquetFile(path).num_row_groups > 1
    source = TableSource(str(path))
    assert source.image_column == "image"  # detected
    convert(source, str(tmp_path / "out"), ConvertOptions(format="lmdb", **OPTS))  # type: ignore[arg-type]
    samples = _samples(str(tmp_path / "out"))
    assert [s["jpg"] for s in samples] == [data for _, _, data in images]


def test_bad_rows_raise_naming_the_row_or_are_skipped_and_listed(folder: Path, tmp_path: Path) -> None:
    images = _images(folder)
    (tmp_path / "corrupt.jpg").write_bytes(b"\xff\xd8\xffnot really a jpeg")
    rows = [f"{folder / rel},{i % 3}" for i, (rel, _, _) in enumerate(images[:4])]
    rows += [
        ",1",  # row 4: no path
        f"{folder / images[4][0]},",  # row 5: no label
        f"{tmp_path / 'missing.jpg'},0",  # row 6: missing file
        f"{tmp_path / 'corrupt.jpg'},0",  # row 7: corrupt image
        f"{tmp_path / 'notes.txt'},0",  # row 8: not an image
    ]
    table = tmp_path / "t.csv"
    table.write_text("path,label\n" + "\n".join(rows) + "\n")
    with pytest.raises(SourceError, match="row 4.*no path"):
        convert(TableSource(str(table)), str(tmp_path / "raise"), ConvertOptions(**OPTS))  # type: ignore[arg-type]
    report = convert(
        TableSource(str(table)),
        str(tmp_path / "skip"),
        ConvertOptions(on_error="skip", **OPTS),  # type: ignore[arg-type]
    )
    reasons = {s.path: s.error for s in report.manifest.skipped}
    assert report.manifest.num_samples == 4
    assert reasons[f"{table}: row 4"] == "no path"
    assert reasons[f"{table}: row 5"] == "no label"
    assert "not an image file extension" in reasons[f"{table}: row 8 ({tmp_path / 'notes.txt'})"]
    assert "does not exist" in reasons[f"{table}: row 6"]
    assert "not a valid image" in reasons[f"{table}: row 7"]
    # the CLI: one line, exit 2
    assert main(["convert", str(table), str(tmp_path / "cli"), "--no-progress"]) == 2


def test_missing_column_is_named(folder: Path, tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("file,label\na.jpg,1\n")
    with pytest.raises(ConfigError, match="no column 'path'.*file, label"):
        TableSource(str(table))


# -- buckets -----------------------------------------------------------------------------


def _upload(server: SeaweedS3, root: Path, url: str) -> None:
    fs = server.filesystem()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{url.removeprefix('s3://')}/{path.relative_to(root).as_posix()}")


@pytest.mark.slow
def test_bucket_image_folder_converts_like_its_local_copy(s3_server: SeaweedS3, folder: Path, tmp_path: Path) -> None:
    bucket = s3_server.make_bucket()
    src = f"s3://{bucket}/raw/images"
    _upload(s3_server, folder, src)
    so = s3_server.storage_options()
    source = open_source(src, so)
    assert isinstance(source, RemoteImageFolderSource)
    dst = f"s3://{bucket}/data/shards"
    remote = convert(source, dst, ConvertOptions(storage_options=so, workers=2, **OPTS))  # type: ignore[arg-type]
    local = convert(ImageFolderSource(str(folder)), str(tmp_path / "local"), ConvertOptions(**OPTS))  # type: ignore[arg-type]
    assert [(e.name, e.hash) for e in remote.manifest.shards] == [(e.name, e.hash) for e in local.manifest.shards]
    # a 404 while converting (the object went away after the listing) is skipped and listed under skip
    gone = sorted(source.scan().items, key=lambda i: i.key)[0]
    s3_server.filesystem().rm_file(f"{bucket}/raw/images/{gone.relpath}")  # type: ignore[attr-defined]
    with pytest.raises(SourceError, match="does not exist"):
        convert(source, f"s3://{bucket}/data/raise", ConvertOptions(storage_options=so, **OPTS))  # type: ignore[arg-type]
    report = convert(
        source,
        f"s3://{bucket}/data/skip",
        ConvertOptions(storage_options=so, on_error="skip", **OPTS),  # type: ignore[arg-type]
    )
    assert [s.path for s in report.manifest.skipped] == [f"{src}/{gone.relpath}"]  # type: ignore[attr-defined]


@pytest.mark.slow
def test_table_in_a_bucket_names_objects_relative_to_it(s3_server: SeaweedS3, folder: Path, tmp_path: Path) -> None:
    bucket = s3_server.make_bucket()
    _upload(s3_server, folder, f"s3://{bucket}/lists/images")
    images = _images(folder)
    lines = ["path,label"] + [f"images/{rel},{cls}" for rel, cls, _ in images] + ["images/nothing.jpg,class_000"]
    s3_server.filesystem().pipe_file(f"{bucket}/lists/all.csv", ("\n".join(lines) + "\n").encode())
    so = s3_server.storage_options()
    dst = f"s3://{bucket}/out"
    opts = ["--samples-per-shard", "5", "--no-progress", "--on-error", "skip"]
    cli_so = ["-o", f"key={s3_server.key}", "-o", f"secret={s3_server.secret}"]
    cli_so += ["-o", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]
    assert main(["convert", f"s3://{bucket}/lists/all.csv", dst, *opts, *cli_so]) == 0
    samples = _samples(dst, so)
    assert [s["jpg"] for s in samples] == [data for _, _, data in images]
    manifest_skipped = json.loads(s3_server.filesystem().cat_file(f"{bucket}/out/index.json"))["skipped"]
    assert len(manifest_skipped) == 1
    assert f"row {len(images)}" in manifest_skipped[0]["path"]
    assert "404" in manifest_skipped[0]["error"]
