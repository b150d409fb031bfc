"""Shards other tools wrote (GNU tar, Python's tarfile, webdataset): member names, suffixes, compression."""

from __future__ import annotations

import gzip
import io
import re
import subprocess
import tarfile
import warnings
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from streamload import StorageConfig, StreamingDataset
from streamload._errors import ConfigError, CorruptShardError, ManifestError, ShardNotFoundError, UnsafeShardError
from streamload.cli import main
from streamload.decode import ImageLabel
from streamload.indexing import index_directory
from tests.s3server import SeaweedS3


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


def _write_shards(folder: Path, count: int, per: int = 3) -> dict[str, bytes]:
    """``count`` shards written by webdataset's ShardWriter (``wds-000000.tar``, ...); returns key -> txt."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    with wds.ShardWriter(str(folder / "wds-%06d.tar"), maxcount=per, verbose=0) as sink:
        for i in range(count * per):
            key = f"s{i:04d}"
            sink.write({"__key__": key, "txt": f"sample {i}", "cls": str(i % 2)})
            written[key] = f"sample {i}".encode()
    return written


def _indexes(cache: Path) -> list[Path]:
    """The indexed shard lists in the cache (not their lock files)."""
    return [p for p in (cache / "shard-lists").iterdir() if not p.name.startswith(".")]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_list_of_shard_paths_is_read_in_its_order(tmp_path: Path, cache: Path) -> None:
    written = _write_shards(tmp_path / "shards", 3)
    before = sorted(p.name for p in (tmp_path / "shards").iterdir())
    shards = [str(tmp_path / "shards" / "wds-000002.tar"), str(tmp_path / "shards" / "wds-000000.tar")]
    ds = StreamingDataset(shards)
    got = [(s["__key__"], s["txt"]) for s in ds]
    theirs = _webdataset([Path(s) for s in shards])
    assert got == [(s["__key__"], s["txt"]) for s in theirs]
    assert [k for k, _ in got] == ["s0006", "s0007", "s0008", "s0000", "s0001", "s0002"]
    assert all(written[k] == v for k, v in got)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == before  # nothing written beside them
    assert len(_indexes(cache)) == 1
    # again: the index in the cache is reused; a brace pattern names the same shards
    again = StreamingDataset(str(tmp_path / "shards" / "wds-{000000..000002}.tar"))
    assert len(again) == 9
    assert len(_indexes(cache)) == 2


def test_a_shard_that_changes_is_indexed_again(tmp_path: Path, cache: Path) -> None:
    _write_shards(tmp_path / "shards", 1)
    shard = tmp_path / "shards" / "wds-000000.tar"
    assert len(StreamingDataset([str(shard)])) == 3
    _tar(shard, [("x.txt", b"new")])
    assert [s["txt"] for s in StreamingDataset([str(shard)])] == [b"new"]


def test_shard_lists_that_cannot_be_read_say_why(tmp_path: Path, cache: Path) -> None:
    _write_shards(tmp_path / "a", 1)
    _write_shards(tmp_path / "b", 1)
    with pytest.raises(ConfigError, match=r"wds-000000\.tar is named twice"):
        StreamingDataset([str(tmp_path / "a" / "wds-000000.tar")] * 2)
    with pytest.raises(ConfigError, match="2 folders"):
        StreamingDataset([str(tmp_path / "a" / "wds-000000.tar"), str(tmp_path / "b" / "wds-000000.tar")])
    with pytest.raises(ShardNotFoundError, match=r"wds-000001\.tar does not exist \(9 missing\)"):
        StreamingDataset(str(tmp_path / "a" / "wds-{000000..000009}.tar"))
    with pytest.raises(ConfigError, match="mixes tar shard files and datasets"):
        StreamingDataset([str(tmp_path / "a" / "wds-000000.tar"), str(tmp_path / "b")])
    with pytest.raises(ConfigError, match=r"mix gzip-compressed tar files \(.*x\.tgz\) and plain ones"):
        StreamingDataset([str(tmp_path / "a" / "x.tgz"), str(tmp_path / "a" / "wds-000000.tar")])


def test_expand_braces_matches_webdataset() -> None:
    import braceexpand

    from streamload.shardlist import expand_braces

    for pattern in ["s/{000..012}.tar", "s/{a,b}-{0..3}.tar", "s/{7..10}.tar", "s/{08..10}.tar", "plain.tar"]:
        assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern))


def _sample_files(folder: Path, count: int) -> None:
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"{i:03d}.txt").write_text(f"sample {i}")
        (folder / f"{i:03d}.cls").write_text(str(i % 2))


def test_gzip_shards_are_refused_in_one_line_saying_what_to_run(tmp_path: Path) -> None:
    _sample_files(tmp_path / "src", 6)
    folder = tmp_path / "gz"
    folder.mkdir()
    for name in ("a.tgz", "b.tar.gz"):
        subprocess.run(["tar", "-C", str(tmp_path / "src"), "--sort=name", "-czf", str(folder / name), "."], check=True)
    with pytest.raises(ConfigError) as caught:
        index_directory(str(folder))
    message = str(caught.value)
    assert "\n" not in message
    assert "a.tgz and 1 more is gzip-compressed" in message
    assert f"`gunzip {folder}/*.tar.gz {folder}/*.tgz`" in message
    with pytest.raises(ConfigError, match="a.tgz is gzip-compressed"):
        index_directory(str(folder), match="*.tgz")
    # what the message says to run works
    subprocess.run(f"gunzip {folder}/*.tar.gz {folder}/*.tgz", shell=True, check=True)
    assert index_directory(str(folder)).num_samples == 2 * 6


def test_gzip_compressed_shards_in_a_list_are_read_as_webdataset_reads_them(tmp_path: Path, cache: Path) -> None:
    for part in range(2):
        _sample_files(tmp_path / f"src{part}", 3)
    folder = tmp_path / "gz"
    folder.mkdir()
    for part, name in enumerate(("a.tgz", "b.tar.gz")):
        tar = ["tar", "-C", str(tmp_path / f"src{part}"), "--sort=name", "-czf", str(folder / name), "."]
        subprocess.run(tar, check=True)
    before = sorted(p.name for p in folder.iterdir())
    shards = [folder / "b.tar.gz", folder / "a.tgz"]
    ours = list(StreamingDataset([str(s) for s in shards]))
    theirs = _webdataset(shards)  # webdataset reads .tgz as a gzip stream
    assert len(ours) == len(theirs) == 6
    assert [_fields(s) for s in ours] == [_fields(s) for s in theirs]
    assert [s["__key__"] for s in ours] == [_plain(str(s["__key__"])) for s in theirs]
    assert sorted(p.name for p in folder.iterdir()) == before  # decompressed into the cache, not beside them
    made = sorted(p.name for p in (cache / "shard-lists").rglob("*.tar"))
    assert made == ["a.tar", "b.tar"]
    # a truncated one is named
    raw = (folder / "a.tgz").read_bytes()
    (folder / "a.tgz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptShardError, match=r"a\.tgz: not a whole gzip file"):
        StreamingDataset([str(folder / "a.tgz")])


def test_gzip_bytes_named_tar_are_named_as_such(tmp_path: Path) -> None:
    _sample_files(tmp_path / "src", 2)
    folder = tmp_path / "gz"
    folder.mkdir()
    tar = ["tar", "-C", str(tmp_path / "src"), "--sort=name", "-czf", str(folder / "a.tar"), "."]
    subprocess.run(tar, check=True)
    with pytest.raises(CorruptShardError, match=r"a\.tar is gzip-compressed.*gunzip"):
        index_directory(str(folder))


def test_index_output_elsewhere_works_for_tar(tmp_path: Path) -> None:
    written = _write_shards(tmp_path / "shards", 2)
    (tmp_path / "shards" / "index.json").write_text('{"shards": [{"format": "mds"}], "version": 2}')
    with pytest.raises(ConfigError, match=r"write the index elsewhere \(--output DIR\)"):
        index_directory(str(tmp_path / "shards"))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["index", str(tmp_path / "shards"), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "index.json",
        "wds-000000.tar.idx",
        "wds-000001.tar.idx",
    ]
    got = {s["__key__"]: s["txt"] for s in StreamingDataset(str(out))}
    assert got == written
    assert main(["verify", str(out)]) == 0
    # a damaged shard in the source folder is found through the index kept apart
    raw = bytearray((tmp_path / "shards" / "wds-000001.tar").read_bytes())
    raw[raw.find(b"sample 4")] ^= 0x01
    (tmp_path / "shards" / "wds-000001.tar").write_bytes(bytes(raw))
    assert main(["verify", str(out)]) == 1
    with pytest.raises(CorruptShardError, match=r"wds-000001\.tar.*'s0004'"):
        list(StreamingDataset(str(out)))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shard_urls_in_a_bucket_are_indexed_into_the_cache(s3_server: SeaweedS3, tmp_path: Path) -> None:
    written = _write_shards(tmp_path / "up", 3)
    fs = s3_server.filesystem()
    bucket = s3_server.make_bucket()
    for path in sorted((tmp_path / "up").iterdir()):
        fs.put_file(str(path), f"s3://{bucket}/wds/{path.name}")
    before = sorted(fs.find(bucket, detail=False))
    pattern = f"s3://{bucket}/wds/wds-{{000000..000002}}.tar"
    for mode in ("shards", "none"):
        storage = StorageConfig(storage_options=s3_server.storage_options(), cache=mode, cache_dir=str(tmp_path / mode))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ds = StreamingDataset(pattern, storage=storage, shuffle=True)
        got = {s["__key__"]: s["txt"] for s in ds}
        assert got == written, mode
        cached = [p.name for p in (tmp_path / mode).rglob("*") if p.is_file()]
        assert "index.json" in cached
        assert any(n.endswith(".tar") for n in cached) == (mode == "shards"), cached
    assert sorted(fs.find(bucket, detail=False)) == before  # the bucket: no sidecar, no index, no lock
    # a shard rewritten in the bucket is indexed again (its size or ETag changed), not read by a stale sidecar
    raw = bytearray((tmp_path / "up" / "wds-000001.tar").read_bytes())
    at = raw.find(b"sample 4")
    raw[at] ^= 0x01
    fs.pipe_file(f"s3://{bucket}/wds/wds-000001.tar", bytes(raw))
    storage = StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path / "shards"))
    got = {s["__key__"]: s["txt"] for s in StreamingDataset(pattern, storage=storage)}
    assert got == {**written, "s0004": b"rample 4"}
    # gzip-compressed shards in the bucket: downloaded, decompressed into the cache, read there
    for path in sorted((tmp_path / "up").iterdir()):
        fs.pipe_file(f"s3://{bucket}/tgz/{path.stem}.tgz", gzip.compress(path.read_bytes()))
    storage = StorageConfig(storage_options=s3_server.storage_options(), cache_dir=str(tmp_path / "tgz"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the storage settings apply: the shards are remote
        ds = StreamingDataset(f"s3://{bucket}/tgz/wds-{{000000..000002}}.tgz", storage=storage)
    assert {s["__key__"]: s["txt"] for s in ds} == written


#: index.json as MosaicML Streaming's MDSWriter writes it (its shape in mosaicml/streaming) and as
#: LitData's optimize() writes it (Lightning-AI/litdata).
MDS_INDEX = {
    "shards": [
        {
            "column_encodings": ["int", "jpeg"],
            "column_names": ["class", "image"],
            "column_sizes": [8, None],
            "compression": None,
            "format": "mds",
            "hashes": [],
            "raw_data": {"basename": "shard.00000.mds", "bytes": 125824, "hashes": {}},
            "samples": 100,
            "size_limit": 67108864,
            "version": 2,
            "zip_data": None,
        }
    ],
    "version": 2,
}
LITDATA_INDEX = {
    "chunks": [{"chunk_bytes": 4096, "chunk_size": 10, "dim": None, "filename": "chunk-0-0.bin"}],
    "config": {
        "chunk_bytes": 64000000,
        "chunk_size": None,
        "compression": None,
        "data_format": ["int", "jpeg"],
        "data_spec": '[1, {"type": null, "context": null, "children_spec": []}]',
        "encryption": None,
        "item_loader": "PyTreeLoader",
    },
    "updated_at": "1716470163.3513482",
}


@pytest.mark.parametrize(
    ("index", "kind"),
    [(MDS_INDEX, "a MosaicML Streaming (MDS) dataset"), (LITDATA_INDEX, "a LitData (litdata.optimize) dataset")],
)
def test_other_tools_datasets_are_named(
    tmp_path: Path, index: dict[str, object], kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "index.json").write_text(json.dumps(index))
    (folder / "shard.00000.mds").write_bytes(b"\0" * 64)
    said = f"{kind}, not a streamload one"
    for command in (["info", str(folder)], ["verify", str(folder)], ["convert", str(folder), str(tmp_path / "out")]):
        assert main(command) != 0
        err = capsys.readouterr().err
        assert said in err, command
        assert "unsupported manifest version" not in err
    with pytest.raises(ManifestError, match=re.escape(said)):
        StreamingDataset(str(folder))
    with pytest.raises(ConfigError, match=re.escape(f"holds {kind}'s index.json")):
        index_directory(str(folder))


def test_formats_doc_states_how_convert_and_indexing_differ_on_other_columns(tmp_path: Path) -> None:
    from tests.helpers.parquet_tables import write_hf

    doc = (Path(__file__).parent.parent / "docs" / "formats.md").read_text()
    statement = doc[doc.index("**Sample model**") : doc.index("| column | sample field |")]
    assert "--keep-columns" in statement and "no `json`" in statement
    src = tmp_path / "src"
    src.mkdir()
    write_hf(src / "train-00000.parquet", 0, 6)
    index_directory(str(src), "parquet")
    assert main(["convert", str(src / "train-00000.parquet"), str(tmp_path / "plain")]) == 0
    assert main(["convert", str(src / "train-00000.parquet"), str(tmp_path / "kept"), "--keep-columns", "caption"]) == 0
    indexed = list(StreamingDataset(str(src)))
    kept = list(StreamingDataset(str(tmp_path / "kept")))
    plain = list(StreamingDataset(str(tmp_path / "plain")))
    assert [s["json"] for s in indexed] == [f'{{"caption": "image number {i}"}}'.encode() for i in range(6)]
    assert [_fields(s) | {"__key__": s["__key__"]} for s in kept] == [
        _fields(s) | {"__key__": s["__key__"]} for s in indexed
    ]
    assert [_fields(s) | {"__key__": s["__key__"]} for s in plain] == [
        {k: v for k, v in _fields(s).items() if k != "json"} | {"__key__": s["__key__"]} for s in indexed
    ]
    for where in (src, tmp_path / "kept", tmp_path / "plain"):
        assert StreamingDataset(str(where)).manifest.classes == ("cat", "dog", "eel")


def test_index_and_info_of_a_webdataset_folder_read_well(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "one"
    folder.mkdir()
    with wds.TarWriter(str(folder / "a.tar")) as sink:
        for i in range(5):
            sink.write({"__key__": f"k{i}", "jpg": _jpeg(i), "cls": str(i % 3)})
    assert main(["index", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"indexed 1 shard, 5 samples; wrote {folder}/index.json" in out
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "classes   3 labels in cls (0 to 2); no class names recorded" in out
    assert "classes   0" not in out
    assert "at conversion" not in out and "appends" not in out
    # the names recorded with --classes are shown; a label past them is refused
    assert main(["index", str(folder), "--classes", "a,b,c", "--overwrite"]) == 0
    capsys.readouterr()
    assert main(["info", str(folder)]) == 0
    assert "classes   3: a, b, c" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"a cls label is 2, but --classes names 2 classes"):
        index_directory(str(folder), classes=("a", "b"), overwrite=True)


def test_info_on_folders_that_are_no_dataset_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    images = tmp_path / "images"
    (images / "dog").mkdir(parents=True)
    (images / "dog" / "a.jpg").write_bytes(_jpeg(1))
    assert main(["info", str(images)]) != 0
    err = capsys.readouterr().err
    assert f"`streamload convert {images} OUT_DIR`" in err and "streamload index" not in err
    _write_shards(tmp_path / "shards", 1)
    assert main(["info", str(tmp_path / "shards")]) != 0
    assert f"`streamload index {tmp_path / 'shards'}`" in capsys.readouterr().err


def test_tar_writer_refuses_upper_case_fields_webdataset_would_read_lower_cased(tmp_path: Path) -> None:
    from streamload import DatasetWriter
    from streamload._errors import SampleError

    with pytest.raises(SampleError, match=r"field name 'JPG' has upper-case letters.*name it 'jpg'"):
        with DatasetWriter(str(tmp_path / "out"), format="tar") as writer:
            writer.write({"__key__": "a", "JPG": b"x"})
    with DatasetWriter(str(tmp_path / "lmdb"), format="lmdb") as writer:  # not a tar suffix: kept as given
        writer.write({"__key__": "a", "JPG": b"x"})
    assert [s["JPG"] for s in StreamingDataset(str(tmp_path / "lmdb"))] == [b"x"]


def test_shard_patterns_work_as_streams_and_map_style(tmp_path: Path, cache: Path) -> None:
    from streamload import ShardedDataset, Stream

    a = _write_shards(tmp_path / "a", 2)
    _write_shards(tmp_path / "b", 1)
    mixed = StreamingDataset(
        [Stream(str(tmp_path / "a" / "wds-{000000..000001}.tar")), Stream(str(tmp_path / "b" / "wds-000000.tar"))]
    )
    assert sorted(s["__source__"] for s in mixed) == [0] * 6 + [1] * 3
    mapped = ShardedDataset(str(tmp_path / "a" / "wds-{000000..000001}.tar"))
    assert [mapped[i]["txt"] for i in range(len(mapped))] == list(a.values())
    assert mapped.get("s0004")["txt"] == a["s0004"]


def _count(pattern: str) -> int:
    return len(StreamingDataset(pattern))


def test_processes_opening_one_list_at_once_index_it_once(tmp_path: Path, cache: Path) -> None:
    import multiprocessing as mp

    _write_shards(tmp_path / "s", 4)
    pattern = str(tmp_path / "s" / "wds-{000000..000003}.tar")
    with mp.get_context("fork").Pool(3) as pool:
        assert pool.map(_count, [pattern] * 3) == [12] * 3
    assert len(_indexes(cache)) == 1
    assert not [p for p in (cache / "shard-lists").iterdir() if p.is_dir() and p.name.startswith(".")]


def test_index_of_a_folder_without_shards_says_what_would_work(tmp_path: Path) -> None:
    images = tmp_path / "images"
    (images / "dog").mkdir(parents=True)
    (images / "dog" / "a.jpg").write_bytes(_jpeg(1))
    with pytest.raises(
        ConfigError,
        match=re.escape(f"no *.tar files to index; for a folder of images, `streamload convert {images} OUT_DIR`"),
    ):
        index_directory(str(images))
    assert main(["convert", str(images), str(tmp_path / "out")]) == 0  # the advice works
    _write_shards(tmp_path / "s", 1)
    with pytest.raises(
        ConfigError, match=re.escape("no b*.tar files to index; it holds .tar files that --match 'b*.tar' leaves out")
    ):
        index_directory(str(tmp_path / "s"), match="b*.tar")
