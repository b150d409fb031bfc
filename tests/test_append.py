"""Appending to a dataset (``convert --append``): interrupted and resumed, keys or fields that clash, in a bucket.

Real parts only: driver processes SIGKILLed mid-append, pyarrow-written Parquet tables (with
the columns a Hugging Face table carries, kept by ``--keep-columns``), and the SeaweedFS
server (``s3_server``) as both source and destination bucket, whose listing is read like
``find``. Every dataset is read back with :class:`streamload.StreamingDataset` and compared
with the inputs' keys.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamload import StorageConfig, StreamingDataset
from streamload._errors import ConfigError, SourceError
from streamload.cli import main
from streamload.converters import ConvertOptions, DatasetSource, ImageFolderSource, TableSource, convert
from streamload.converters.journal import JOB_NAME
from streamload.synthetic import make_image_folder, synthetic_jpeg
from tests.s3server import SeaweedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parent.parent
OPTS: dict[str, Any] = {"samples_per_shard": 5, "progress": False}
CLI = ["--samples-per-shard", "2", "--no-progress"]
APPEND2 = ConvertOptions(append=True, samples_per_shard=2, progress=False)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if not p.name.startswith(".")}


def _shards(path: Path) -> dict[str, bytes]:
    return {k: v for k, v in _files(path).items() if k != "index.json"}


def _keys(url: str, **kwargs: Any) -> list[str]:
    return [s["__key__"] for s in StreamingDataset(url, **kwargs)]


def _input_keys(root: Path) -> set[str]:
    return {item.key for item in ImageFolderSource(str(root)).scan().items}


def _exactly_once(keys: list[str], expected: set[str]) -> None:
    counts = Counter(keys)
    assert set(counts) == expected
    assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two image folders of the same two classes whose keys do not clash (10 + 8 images)."""
    first = tmp_path_factory.mktemp("base-images")
    second = tmp_path_factory.mktemp("more-images")
    make_image_folder(str(first), num_classes=2, per_class=5, size=(16, 16), seed=1)
    make_image_folder(str(second), num_classes=2, per_class=4, size=(16, 16), seed=2)
    for path in second.rglob("*.jpg"):
        path.rename(path.with_name("new-" + path.name))
    return first, second


# -- 1. an interrupted append, resumed -----------------------------------------------------

APPEND_DRIVER = """
import os, signal, sys, time
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.converters import journal

class Slow(ImageFolderSource):
    def load(self, item):
        time.sleep(0.1)
        return super().load(item)

if sys.argv[3] == "die-after-publish":  # SIGKILLed between publishing index.json and removing the journal
    journal.Journal.finish = lambda self: os.kill(os.getpid(), signal.SIGKILL)
convert(Slow(sys.argv[1]), sys.argv[2], ConvertOptions(samples_per_shard=2, progress=False, append=True))
"""


def _append_driver(src: Path, dst: Path, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", APPEND_DRIVER, str(src), str(dst), mode], env=env)


def _reference(first: Path, second: Path, out: Path) -> None:
    """``first`` converted, then ``second`` appended, uninterrupted."""
    convert(ImageFolderSource(str(first)), str(out), ConvertOptions(samples_per_shard=2, progress=False))
    convert(ImageFolderSource(str(second)), str(out), ConvertOptions(samples_per_shard=2, progress=False, append=True))


def test_an_append_killed_midway_resumes_and_readers_meanwhile_see_the_old_dataset(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    first, second = folders
    out = tmp_path / "ds"
    convert(ImageFolderSource(str(first)), str(out), ConvertOptions(samples_per_shard=2, progress=False))
    old_index = (out / "index.json").read_bytes()
    old_reader = StreamingDataset(str(out))
    old_keys = [s["__key__"] for s in old_reader]
    proc = _append_driver(second, out, "slow")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if len([n for n in os.listdir(out) if n.startswith("_done-")]) >= 2:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the append finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # killed mid-way: new shards and the journal are there, index.json is the old one, byte for byte
    assert (out / JOB_NAME).exists()
    assert (out / "index.json").read_bytes() == old_index
    assert [s["__key__"] for s in old_reader] == old_keys
    assert _keys(str(out)) == old_keys  # a reader opening the dataset now sees the old samples only
    # the same command again, without --resume, is told what to do
    assert main(["convert", str(second), str(out), "--append", *CLI]) == 2
    # with --resume it finishes the append
    assert main(["convert", str(second), str(out), "--append", "--resume", *CLI]) == 0
    assert not [n for n in os.listdir(out) if n.startswith(("_done-", ".streamload-tmp", JOB_NAME))]
    _exactly_once(_keys(str(out)), _input_keys(first) | _input_keys(second))
    assert [s["__key__"] for s in old_reader] == old_keys  # old shards never rewritten
    _reference(first, second, tmp_path / "ref")
    assert _files(out) == _files(tmp_path / "ref")  # as if never interrupted, index.json included
    assert len(json.loads((out / "index.json").read_bytes())["meta"]["appends"]) == 1


def test_an_append_killed_after_publishing_is_finished_by_resume(
    folders: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = folders
    out = tmp_path / "ds"
    convert(ImageFolderSource(str(first)), str(out), ConvertOptions(samples_per_shard=2, progress=False))
    proc = _append_driver(second, out, "die-after-publish")
    assert proc.wait(120) == -signal.SIGKILL
    # published, then killed: readers see old + new already; the journal is still there
    assert (out / JOB_NAME).exists()
    published = (out / "index.json").read_bytes()
    expected = _input_keys(first) | _input_keys(second)
    _exactly_once(_keys(str(out)), expected)
    capsys.readouterr()
    assert main(["convert", str(second), str(out), "--append", "--resume", *CLI]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert not (out / JOB_NAME).exists() and not [n for n in os.listdir(out) if n.startswith("_done-")]
    assert (out / "index.json").read_bytes() == published  # nothing rewritten, no second append recorded
    _exactly_once(_keys(str(out)), expected)
    _reference(first, second, tmp_path / "ref")
    assert _files(out) == _files(tmp_path / "ref")
    # and the dataset takes further appends as usual
    third = tmp_path / "third"
    make_image_folder(str(third), num_classes=2, per_class=2, size=(16, 16), seed=3)
    for path in third.rglob("*.jpg"):
        path.rename(path.with_name("third-" + path.name))
    assert main(["convert", str(third), str(out), "--append", *CLI]) == 0
    _exactly_once(_keys(str(out)), expected | _input_keys(third))


# -- 2. keys already in the dataset ---------------------------------------------------------


def test_append_with_present_keys_skips_and_lists_them_or_names_the_first(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    first, _ = folders
    clashing = tmp_path / "clashing"
    make_image_folder(str(clashing), num_classes=2, per_class=4, size=(16, 16), seed=4)
    for path in clashing.rglob("img_00000[13].jpg"):  # img_000000 and img_000002 keep keys of the dataset
        path.rename(path.with_name("new-" + path.name))
    out = tmp_path / "ds"
    base = convert(ImageFolderSource(str(first)), str(out), ConvertOptions(**OPTS)).manifest
    old_index = (out / "index.json").read_bytes()
    with pytest.raises(SourceError) as raised:
        convert(ImageFolderSource(str(clashing)), str(out), ConvertOptions(append=True, **OPTS))
    message = str(raised.value)
    assert "class_000/img_000000.jpg" in message and f"is already in {out}" in message  # the first clashing input
    assert (out / "index.json").read_bytes() == old_index
    assert not (out / JOB_NAME).exists()

    report = convert(ImageFolderSource(str(clashing)), str(out), ConvertOptions(append=True, on_error="skip", **OPTS))
    present = sorted(k for k in _input_keys(clashing) if k in _input_keys(first))
    assert len(present) == 4
    skipped = report.manifest.skipped[len(base.skipped) :]
    assert len(skipped) == len(present)
    for entry, key in zip(sorted(skipped, key=lambda s: s.path), present, strict=True):
        assert entry.path.endswith(f"{key}.jpg")
        assert entry.error == f"its key {key!r} is already in {out}"
    on_disk = json.loads((out / "index.json").read_bytes())
    assert len(on_disk["skipped"]) == len(present)  # listed in the published manifest too
    _exactly_once(_keys(str(out)), _input_keys(first) | {k for k in _input_keys(clashing) if k.count("new-")})


# -- 3. other fields are refused, nothing published -----------------------------------------


def _hf_table(path: Path, rows: int, seed: int, prefix: str) -> list[dict[str, Any]]:
    """A Parquet table as Hugging Face writes it: image {bytes, path} structs, int label, extra columns."""
    import numpy as np

    rng = np.random.default_rng(seed)
    records = [
        {
            "image": {"bytes": synthetic_jpeg(rng, 16, 12), "path": f"{prefix}-{i}.jpg"},
            "label": i % 3,
            "width": 16 + i,
            "caption": f"{prefix} image {i} \u00e9",
            "tags": [f"t{i}", "x"] if i % 2 else [],
        }
        for i in range(rows)
    ]
    schema = pa.schema(
        [
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("label", pa.int64()),
            ("width", pa.int32()),
            ("caption", pa.string()),
            ("tags", pa.list_(pa.string())),
        ]
    )
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path, row_group_size=4)
    return records


def test_appending_other_fields_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    _hf_table(tmp_path / "base.parquet", 6, 1, "base")
    _hf_table(tmp_path / "more.parquet", 5, 2, "more")
    out = tmp_path / "ds"
    convert(TableSource(str(tmp_path / "base.parquet")), str(out), ConvertOptions(**OPTS))
    before, names = _files(out), sorted(os.listdir(out))
    assert json.loads(before["index.json"])["fields"] == ["cls", "jpg"]
    cases = [
        (TableSource(str(tmp_path / "more.parquet"), keep_columns=["caption"]), r"\{cls, jpg, json\}"),
        (TableSource(str(tmp_path / "more.parquet"), label_column=""), r"\{jpg\}"),
    ]
    for source, theirs in cases:
        with pytest.raises(ConfigError, match=rf"{out} has fields \{{cls, jpg\}}; the appended samples have {theirs}"):
            convert(source, str(out), ConvertOptions(append=True, **OPTS))
        assert _files(out) == before  # index.json byte for byte, and not one new file
        assert sorted(os.listdir(out)) == names
    args = ["convert", str(tmp_path / "more.parquet"), str(out), "--append", "--keep-columns", "caption,width"]
    assert main([*args, "--no-progress"]) == 2
    assert _files(out) == before


def test_other_fields_found_only_while_writing_are_refused_and_cleaned_up(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    first, _ = folders
    mixed = tmp_path / "mixed"
    make_image_folder(str(mixed), num_classes=2, per_class=3, size=(16, 16), seed=6)
    for path in mixed.rglob("*.jpg"):
        path.rename(path.with_name("mixed-" + path.name))
    import numpy as np

    (mixed / "class_001" / "z-late.png").write_bytes(synthetic_jpeg(np.random.default_rng(0), 16, 16, fmt="PNG"))
    out = tmp_path / "ds"
    convert(ImageFolderSource(str(first)), str(out), ConvertOptions(**OPTS))
    before = _files(out)
    names = sorted(os.listdir(out))
    # the first inputs are JPEGs like the dataset's: the PNG shows up in the last shard only
    with pytest.raises(ConfigError, match=r"has fields \{cls, jpg\}; the appended samples have \{cls, jpg, png\}"):
        convert(ImageFolderSource(str(mixed)), str(out), APPEND2)
    assert _files(out) == before
    assert sorted(os.listdir(out)) == names  # the new shards, markers and journal are gone
    (mixed / "class_001" / "z-late.png").unlink()
    assert main(["convert", str(mixed), str(out), "--append", *CLI]) == 0  # not left stuck
    _exactly_once(_keys(str(out)), _input_keys(first) | _input_keys(mixed))


# -- 4. --keep-columns from Parquet ---------------------------------------------------------


def test_keep_columns_of_a_hugging_face_parquet_table(tmp_path: Path) -> None:
    records = _hf_table(tmp_path / "hf.parquet", 9, 5, "hf")
    out = tmp_path / "ds"
    args = ["convert", str(tmp_path / "hf.parquet"), str(out), "--keep-columns", "width,caption,tags", *CLI]
    assert main(args) == 0
    source = DatasetSource(str(out))
    try:
        samples = [source.load(item) for item in source.scan().items]
    finally:
        source.close()
    assert source.manifest.fields == ("cls", "jpg", "json")
    assert [s["__key__"] for s in samples] == [f"hf/{i:010d}" for i in range(len(records))]
    for sample, record in zip(samples, records, strict=True):
        assert json.loads(sample["json"]) == {k: record[k] for k in ("width", "caption", "tags")}
        assert sample["jpg"] == record["image"]["bytes"]
        assert int(sample["cls"]) == record["label"]


# -- 5. append and read in a bucket ----------------------------------------------------------


def _upload(server: SeaweedS3, root: Path, url: str) -> None:
    fs = server.filesystem()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{url.removeprefix('s3://')}/{path.relative_to(root).as_posix()}")


def test_append_in_a_bucket_then_read_exactly_once(
    s3_server: SeaweedS3, folders: tuple[Path, Path], tmp_path: Path
) -> None:
    first, second = folders
    bucket = s3_server.make_bucket()
    _upload(s3_server, first, f"s3://{bucket}/raw/first")
    _upload(s3_server, second, f"s3://{bucket}/raw/second")
    so = s3_server.storage_options()
    dst = f"s3://{bucket}/data/ds"
    cli = [*CLI, *s3_server.cli_options()]
    assert main(["convert", f"s3://{bucket}/raw/first", dst, *cli]) == 0
    old = StreamingDataset(dst, storage=StorageConfig(storage_options=so, cache_dir=str(tmp_path / "cache-old")))
    old_keys = [s["__key__"] for s in old]
    assert set(old_keys) == _input_keys(first)
    assert main(["convert", f"s3://{bucket}/raw/second", dst, "--append", *cli]) == 0
    expected = _input_keys(first) | _input_keys(second)
    _exactly_once(_keys(dst, storage=StorageConfig(storage_options=so, cache_dir=str(tmp_path / "cache"))), expected)
    assert [s["__key__"] for s in old] == old_keys  # a reader of the old manifest still reads the old samples
    names = sorted(p.rpartition("/")[2] for p in s3_server.filesystem().ls(f"{bucket}/data/ds"))
    assert not [n for n in names if n.startswith(("_done-", "_streamload-convert", ".streamload-tmp"))]
    manifest = json.loads(s3_server.filesystem().cat_file(f"{bucket}/data/ds/index.json"))
    assert len(manifest["meta"]["appends"]) == 1
    assert manifest["meta"]["appends"][0]["source"] == f"s3://{bucket}/raw/second"


def test_list_tree_reads_the_bucket_listing_like_find(s3_server: SeaweedS3) -> None:
    from streamload.converters.bucket import _found, list_tree
    from streamload.storage.filesystems import open_filesystem

    bucket = s3_server.make_bucket()
    objects = {"p/a/x.jpg": b"12", "p/a/b/y y.jpg": b"1", "p/z.txt": b"", "p/d/": b"", "pq/n.jpg": b"1", "t.jpg": b"3"}
    s3_server.filesystem().pipe({f"{bucket}/{k}": v for k, v in objects.items()})
    so = s3_server.storage_options()
    expected = {
        f"s3://{bucket}/p": {"a/x.jpg": 2, "a/b/y y.jpg": 1, "z.txt": 0},  # not the folder marker, not pq/
        f"s3://{bucket}/p/": {"a/x.jpg": 2, "a/b/y y.jpg": 1, "z.txt": 0},
        f"s3://{bucket}": {"p/a/x.jpg": 2, "p/a/b/y y.jpg": 1, "p/z.txt": 0, "pq/n.jpg": 1, "t.jpg": 1},
        f"s3://{bucket}/nothing": {},
    }
    for url, sizes in expected.items():
        root, listed = list_tree(url, so)
        assert root == f"{bucket}/{url.partition(bucket)[2].strip('/')}".rstrip("/")
        assert listed == sizes, url
        fs, path = open_filesystem(url, so)
        assert _found(fs, path.rstrip("/")) == listed, url  # the generic listing agrees
