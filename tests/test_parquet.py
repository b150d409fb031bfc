"""Parquet image tables read in place: files written by Hugging Face ``datasets`` and by plain pyarrow."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from streamload import CorruptShardError, ShardedDataset, StorageConfig, Stream, StreamingDataset
from streamload.batch import RawCollate
from streamload.cli import main
from streamload.decode import DecodeBatch, ImageLabel
from streamload.indexing import index_directory
from tests.helpers.parquet_tables import CLASSES, encode, hf_rows, write_hf
from tests.s3server import SeaweedS3

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face ``data/`` folder: two train files (60 + 40 rows) and a test file."""
    root = tmp_path_factory.mktemp("hf") / "data"
    root.mkdir()
    write_hf(root / "train-00000-of-00002.parquet", 0, 60)
    write_hf(root / "train-00001-of-00002.parquet", 60, 100)
    write_hf(root / "test-00000-of-00001.parquet", 100, 110)
    assert main(["index", str(root), "--format", "parquet", "--match", "train-*.parquet"]) == 0
    return root


def expected_hf() -> dict[str, tuple[bytes, str, int, str]]:
    """key -> (image bytes, field, label, caption), computed from the rows independently."""
    rows = hf_rows(0, 100)
    out = {}
    for i in range(100):
        name, row = ("train-00000-of-00002", i) if i < 60 else ("train-00001-of-00002", i - 60)
        out[f"{name}/{row:010d}"] = (rows["image"][i]["bytes"], "jpg" if i % 2 else "png", i % 3, rows["caption"][i])
    return out


def test_hugging_face_files_read_in_place(hf_dir: Path) -> None:
    manifest = json.loads((hf_dir / "index.json").read_text())
    assert manifest["format"] == "parquet" and manifest["classes"] == CLASSES
    assert [s["name"] for s in manifest["shards"]] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert manifest["num_samples"] == 100
    assert set(manifest["fields"]) == {"jpg", "png", "cls", "json"}
    assert pq.ParquetFile(hf_dir / "train-00000-of-00002.parquet").metadata.num_row_groups == 4  # several row groups

    expected = expected_hf()
    seen = {}
    for sample in StreamingDataset(str(hf_dir), shuffle=True, seed=1):
        image, field, label, caption = expected[sample["__key__"]]
        assert sample[field] == image
        assert int(sample["cls"]) == label
        assert json.loads(sample["json"]) == {"caption": caption}
        seen[sample["__key__"]] = sample
    assert len(seen) == 100

    # The decoders work unchanged: per sample and whole batches.
    image, label = ImageLabel(size=8)(seen["train-00000-of-00002/0000000003"])
    assert tuple(image.shape) == (3, 8, 8) and label == 0
    ds = StreamingDataset(str(hf_dir), batch_size=10, collate=DecodeBatch(8))
    images, labels = next(iter(DataLoader(ds, batch_size=None, num_workers=0)))
    assert tuple(images.shape) == (10, 3, 8, 8)
    assert labels is not None and labels.tolist() == [i % 3 for i in range(10)]
    raw = next(iter(StreamingDataset(str(hf_dir), batch_size=10, collate=RawCollate())))
    assert raw.labels is not None and raw.labels.tolist() == [i % 3 for i in range(10)]
    offsets = raw.offsets.tolist()
    assert raw.data[offsets[3] : offsets[4]].numpy().tobytes() == expected["train-00000-of-00002/0000000003"][0]


def test_exact_and_elastic_resume(hf_dir: Path) -> None:
    def keys(ds: StreamingDataset) -> list[str]:
        return [s["__key__"] for s in ds]

    whole = [
        keys(StreamingDataset(str(hf_dir), rank=r, world_size=2, shuffle=True, seed=9, batch_size=5)) for r in range(2)
    ]
    state = StreamingDataset(str(hf_dir), rank=0, world_size=2, shuffle=True, seed=9, batch_size=5).state_dict(
        samples_seen=20
    )
    resumed = []
    for r in range(2):
        ds = StreamingDataset(str(hf_dir), rank=r, world_size=2, shuffle=True, seed=9, batch_size=5)
        ds.load_state_dict(state)
        resumed.append(keys(ds))
    assert resumed == [whole[0][10:], whole[1][10:]]  # exactly the unseen rest, in order
    one = StreamingDataset(str(hf_dir), shuffle=True, seed=9, batch_size=10)
    one.load_state_dict(state)  # elastic: 2 ranks of 5 -> 1 rank of 10, the same global batch
    steps = [whole[0][k : k + 5] + whole[1][k : k + 5] for k in range(0, len(whole[0]), 5)]
    assert keys(one) == [key for step in steps[2:] for key in step]  # the uninterrupted global batches


def test_exactly_once_over_two_ranks_of_two_workers(hf_dir: Path) -> None:
    keys: list[str] = []
    for rank in range(2):
        ds = StreamingDataset(str(hf_dir), rank=rank, world_size=2, shuffle=True, seed=5, batch_size=7)
        rank_keys = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
        assert len(rank_keys) == 56  # 100 rows in whole global batches of 14: 112, 12 repeats
        keys += rank_keys
    extra = Counter(keys) - Counter(expected_hf().keys())
    assert set(keys) == set(expected_hf()) and sum(extra.values()) == 12 and max(extra.values()) == 1


def test_random_access_and_a_mixture_with_tar(hf_dir: Path, tar_dataset: Path) -> None:
    expected = expected_hf()
    ds = ShardedDataset(str(hf_dir))
    assert len(ds) == 100
    assert ds[61]["__key__"] == "train-00001-of-00002/0000000001"
    key = "train-00000-of-00002/0000000037"
    sample = ds.get(key)
    assert sample[expected[key][1]] == expected[key][0]
    assert ds[37] == sample

    mixed = StreamingDataset([Stream(str(hf_dir), weight=0.5), Stream(str(tar_dataset), weight=0.5)], epoch_size=60)
    items = [(s["__source__"], s["__key__"]) for s in mixed]
    counts = Counter(src for src, _ in items)
    assert counts == {0: 30, 1: 30}
    for src, k in items:
        if src == 0:
            assert k in expected


def test_plain_pyarrow_files_snappy_and_zstd(tmp_path: Path) -> None:
    root = tmp_path / "pa"
    root.mkdir()
    rows: dict[str, tuple[bytes, int, float]] = {}
    for part, codec in enumerate(("snappy", "zstd")):
        blobs = [encode(part * 50 + i, "PNG") for i in range(50)]
        labels = [(part * 50 + i) % 7 for i in range(50)]
        scores = [i / 4 for i in range(50)]
        table = pa.table({"jpeg": pa.array(blobs, pa.binary()), "y": labels, "score": scores})
        name = f"part-{part}.{codec}.parquet"
        pq.write_table(table, root / name, row_group_size=12, compression=codec)
        prefix = f"part-{part}%2E{codec}"
        rows.update({f"{prefix}/{i:010d}": (blobs[i], labels[i], scores[i]) for i in range(50)})
    assert main(["index", str(root), "--format", "parquet", "--image-column", "jpeg", "--label-column", "y"]) == 0
    got = {s["__key__"]: s for s in StreamingDataset(str(root))}
    assert set(got) == set(rows)
    for key, (blob, label, score) in rows.items():
        assert got[key]["png"] == blob and int(got[key]["cls"]) == label
        assert json.loads(got[key]["json"]) == {"score": score}
    assert json.loads((root / "index.json").read_text())["classes"] == []
    # no label column: samples without cls, decoded with label_field=None
    other = tmp_path / "nolabels"
    other.mkdir()
    pq.write_table(pa.table({"img": pa.array([encode(1, "JPEG")] * 3, pa.binary())}), other / "a.parquet")
    index_directory(str(other), "parquet")
    samples = list(StreamingDataset(str(other)))
    assert [sorted(s) for s in samples] == [["__key__", "jpg"]] * 3
    assert DecodeBatch(4, label_field=None)(samples).labels is None


def flip_inside_image(path: Path, image: bytes) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.find(image)
    assert at > 0
    raw[at + len(image) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def test_verify_and_reads_catch_a_flipped_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "flip"
    root.mkdir()
    blobs = [encode(i, "PNG") for i in range(30)]
    pq.write_table(
        pa.table({"image": pa.array(blobs, pa.binary())}), root / "x.parquet", row_group_size=10, compression="NONE"
    )
    index_directory(str(root), "parquet")
    assert main(["verify", str(root), "--no-read"]) == 0
    flip_inside_image(root / "x.parquet", blobs[14])
    capsys.readouterr()
    assert main(["verify", str(root)]) == 1
    assert "x.parquet" in capsys.readouterr().out
    with pytest.raises(CorruptShardError, match=r"x\.parquet.*row group 1, row 14 .*checksum"):
        list(StreamingDataset(str(root)))
    with pytest.raises(CorruptShardError, match="row group 1, row 14"):
        ShardedDataset(str(root))[14]
    ds = StreamingDataset(str(root), on_error="skip")
    assert len([s["__key__"] for s in ds]) == 30
    assert ds.skipped_samples >= 1


def bad_lines(err: str) -> list[str]:
    """The error lines (``datasets`` draws progress bars on stderr too)."""
    return [line for line in err.splitlines() if line.strip() and "Creating parquet" not in line]


@pytest.mark.parametrize(
    ("table", "args", "message"),
    [
        (
            lambda: pa.table({"image": pa.array([encode(0, "PNG")], pa.binary())}),
            ["--image-column", "picture"],
            "no column 'picture'",
        ),
        (
            lambda: pa.table({"image": pa.array([b"just some text"], pa.binary())}),
            [],
            "column 'image': row 0 holds bytes that are not an image",
        ),
        (
            lambda: pa.table(
                {"image": pa.array([{"bytes": encode(0, "PNG"), "path": "a.png"}, {"bytes": b"t", "path": "b.jpg"}])}
            ),
            [],
            "column 'image': row 1 holds bytes that are not an image",
        ),
        (
            lambda: pa.table({"image": pa.array([encode(0, "PNG")] * 2, pa.binary()), "label": [0, -3]}),
            [],
            "column 'label': row 1 has label -3",
        ),
        (
            lambda: pa.table({"image": pa.array([encode(0, "PNG")] * 2, pa.binary()), "label": pa.array([1, None])}),
            [],
            "column 'label': row 1 has no label",
        ),
        (
            lambda: pa.table(
                {"image": pa.array([[{"bytes": b"x"}]]), "other": pa.array([encode(0, "PNG")], pa.binary())}
            ),
            ["--image-column", "image"],
            "column 'image' of type list<",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: Any, args: list[str], message: str
) -> None:
    root = tmp_path / "bad"
    root.mkdir()
    pq.write_table(pa.table({"image": pa.array([encode(1, "PNG")], pa.binary())}), root / "a-good.parquet")
    pq.write_table(table(), root / "b-bad.parquet")
    before = sorted(os.listdir(root))
    assert main(["index", str(root), "--format", "parquet", *args]) == 2
    err = bad_lines(capsys.readouterr().err)
    assert len(err) == 1 and message in err[0], err
    assert "b-bad.parquet" in err[0] or "a-good.parquet" in err[0]
    assert sorted(os.listdir(root)) == before


def test_labels_out_of_hugging_face_class_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "hf"
    root.mkdir()
    write_hf(root / "train.parquet", 0, 5)
    table = pq.read_table(root / "train.parquet")
    labels = table.column("label").to_pylist()
    labels[3] = 3  # three class names: 0..2
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.int64()))
    pq.write_table(table, root / "train.parquet")
    assert main(["index", str(root), "--format", "parquet"]) == 2
    err = bad_lines(capsys.readouterr().err)
    assert len(err) == 1 and "train.parquet: column 'label': row 3 has label 3 (expected 0..2)" in err[0]
    assert sorted(os.listdir(root)) == ["train.parquet"]


def test_hostile_files_name_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.parquet"
    blobs = [encode(i, "PNG") for i in range(20)]
    pq.write_table(pa.table({"image": pa.array(blobs, pa.binary())}), good, row_group_size=5)
    raw = good.read_bytes()
    footer = int.from_bytes(raw[-8:-4], "little")
    cases = {
        "bad-footer": raw[: -8 - footer] + b"\x00" * footer + raw[-8:],
        "no-magic": raw[:-4] + b"PAR0",
        "short": raw[:100] + raw[-(footer + 8) :],  # the row groups' chunks now lie past the end
        "huge-footer": raw[:-8] + (2**31).to_bytes(4, "little") + b"PAR1",
        "bomb": None,
    }
    expected = {
        "bad-footer": "not a readable Parquet file",
        "no-magic": "no PAR1 magic",
        "short": "outside the file",
        "huge-footer": "its footer claims 2147483648 bytes",
        "bomb": "a decompression bomb",
    }
    for name, data in cases.items():
        root = tmp_path / name
        root.mkdir()
        if data is None:  # 8 MB of zeros in a column the samples' json needs, a few hundred bytes stored
            bomb = pa.table({"image": pa.array(blobs[:1], pa.binary()), "notes": pa.array([b"\0" * (8 << 20)])})
            pq.write_table(bomb, root / f"{name}.parquet", compression="zstd")
            with pytest.raises(CorruptShardError, match=rf"{name}\.parquet: .*{expected[name]}"):
                index_directory(str(root), "parquet", image_column="image")
            continue
        else:
            (root / f"{name}.parquet").write_bytes(data)
        with pytest.raises(CorruptShardError, match=rf"{name}\.parquet: .*{expected[name]}"):
            index_directory(str(root), "parquet")
        assert os.listdir(root) == [f"{name}.parquet"]


def test_hostile_row_group_after_indexing_is_refused(tmp_path: Path) -> None:
    """A file replaced after indexing, its chunks now outside it: an error naming the file, not a crash."""
    root = tmp_path / "swap"
    root.mkdir()
    blobs = [encode(i, "PNG") for i in range(20)]
    pq.write_table(pa.table({"image": pa.array(blobs, pa.binary())}), root / "s.parquet", row_group_size=5)
    index_directory(str(root), "parquet")
    pq.write_table(pa.table({"image": pa.array(blobs[:2], pa.binary())}), root / "s.parquet")
    with pytest.raises(CorruptShardError, match=r"s\.parquet"):
        list(StreamingDataset(str(root)))


def test_from_seaweedfs_cached_and_streamed(s3_server: SeaweedS3, tmp_path: Path) -> None:
    import fsspec

    local = tmp_path / "up"
    local.mkdir()
    write_hf(local / "train-00000.parquet", 0, 40)
    write_hf(local / "train-00001.parquet", 40, 70)
    options = s3_server.storage_options()
    url = f"s3://{s3_server.make_bucket()}/hf/data"
    fs = fsspec.filesystem("s3", **options)
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"{url}/{path.name}")
    index_directory(url, "parquet", storage_options=options)
    rows = hf_rows(0, 70)
    expected = {
        f"train-0000{i // 40}/{i % 40 if i < 40 else i - 40:010d}": rows["image"][i]["bytes"] for i in range(70)
    }
    for mode in ("shards", "none"):
        ds = StreamingDataset(
            url,
            storage=StorageConfig(storage_options=options, cache=mode, cache_dir=str(tmp_path / f"cache-{mode}")),
            batch_size=8,
        )
        got = {s["__key__"]: s.get("jpg", s.get("png")) for s in ds}
        assert got == expected, mode
        cached = [p.name for p in (tmp_path / f"cache-{mode}").rglob("*") if p.is_file()]
        assert any(n.endswith(".slpq") for n in cached)
        assert any(n.endswith(".parquet") for n in cached) == (mode == "shards"), cached  # "none": ranged reads
    # a flipped byte in the bucket's copy is caught when streamed, naming file, row group and row
    raw = bytearray((local / "train-00001.parquet").read_bytes())
    image = rows["image"][45]["bytes"]
    at = raw.find(image)
    assert at > 0
    raw[at + len(image) // 2] ^= 0x55
    fs.pipe_file(f"{url}/train-00001.parquet", bytes(raw))
    ds = StreamingDataset(
        url, storage=StorageConfig(storage_options=options, cache="none", cache_dir=str(tmp_path / "cache-x"))
    )
    with pytest.raises(CorruptShardError, match=r"train-00001\.parquet, row group 0, row 5 "):
        list(ds)


def test_convert_refuses_to_write_parquet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "images" / "a"
    folder.mkdir(parents=True)
    (folder / "x.png").write_bytes(encode(0, "PNG"))
    assert main(["convert", str(tmp_path / "images"), str(tmp_path / "out"), "--format", "parquet"]) == 2
    assert "read in place" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shuffled_reads_decode_each_row_group_once(hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shuffle window jumps between row groups; the process's row-group cache decodes each once."""
    reads: list[int] = []
    original = pq.ParquetFile.read_row_group

    def counted(self: Any, i: int, *args: Any, **kwargs: Any) -> Any:
        reads.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    keys = [s["__key__"] for s in StreamingDataset(str(hf_dir), shuffle=True, seed=2, shuffle_window=100)]
    assert Counter(keys) == Counter(expected_hf().keys())
    assert len(reads) == 4 + 3  # 60 and 40 rows in row groups of 16
    from streamload.formats import set_row_group_cache_bytes

    set_row_group_cache_bytes(1)  # a cache that holds one group
    try:
        reads.clear()
        list(StreamingDataset(str(hf_dir), shuffle=True, seed=2, shuffle_window=100))
    finally:
        set_row_group_cache_bytes(None)
    assert len(reads) > 30  # decoded again for most samples


def test_a_file_truncated_while_read_is_an_error_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "trunc"
    root.mkdir()
    blobs = [encode(i, "PNG") for i in range(40)]
    pq.write_table(pa.table({"image": pa.array(blobs, pa.binary())}), root / "t.parquet", row_group_size=10)
    index_directory(str(root), "parquet")
    it = iter(StreamingDataset(str(root)))
    assert next(it)["png"] == blobs[0]
    os.truncate(root / "t.parquet", 600)  # positioned reads, no memory map: an error, not SIGBUS
    with pytest.raises(CorruptShardError, match=r"t\.parquet, row group 1 cannot be read"):
        list(it)


def test_string_class_names_become_classes_as_convert_makes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "named"
    root.mkdir()
    first = ["dog", "cat", "dog", "eel", "cat", "dog", "eel", "cat"]
    second = ["ant", "dog", "ant"]
    for name, names in (("a.parquet", first), ("b.parquet", second)):
        table = pa.table(
            {"image": pa.array([encode(i, "PNG") for i in range(len(names))], pa.binary()), "label": names}
        )
        pq.write_table(table, root / name, row_group_size=3)
    assert main(["index", str(root), "--format", "parquet"]) == 0
    ds = StreamingDataset(str(root))
    classes = ["ant", "cat", "dog", "eel"]  # sorted unique names over both files
    assert list(ds.manifest.classes) == classes
    assert [classes[int(s["cls"])] for s in ds] == first + second

    # one file alone: the same labels and classes `convert` gives the table
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "a.parquet").write_bytes((root / "a.parquet").read_bytes())
    index_directory(str(alone), "parquet")
    assert main(["convert", str(root / "a.parquet"), str(tmp_path / "tar")]) == 0
    converted = StreamingDataset(str(tmp_path / "tar"))
    assert converted.manifest.classes == StreamingDataset(str(alone)).manifest.classes == ("cat", "dog", "eel")
    assert [s["cls"] for s in converted] == [s["cls"] for s in StreamingDataset(str(alone))]

    # decimal strings are class indices, as for convert
    digits = tmp_path / "digits"
    digits.mkdir()
    pq.write_table(
        pa.table({"image": pa.array([encode(0, "PNG")] * 3, pa.binary()), "label": ["2", "0", "11"]}),
        digits / "d.parquet",
    )
    index_directory(str(digits), "parquet")
    assert [int(s["cls"]) for s in StreamingDataset(str(digits))] == [2, 0, 11]

    # a blank name, or files labelled by integers and by names: one line, exit 2, nothing written
    for bad, message in ((["cat", " "], "row 1 has no label"), ([0, 1], "its labels are strings, those of")):
        case = tmp_path / f"bad-{len(message)}"
        case.mkdir()
        pq.write_table(
            pa.table({"image": pa.array([encode(0, "PNG")] * 2, pa.binary()), "label": ["x", "y"]}), case / "a.parquet"
        )
        pq.write_table(
            pa.table({"image": pa.array([encode(0, "PNG")] * 2, pa.binary()), "label": bad}), case / "b.parquet"
        )
        capsys.readouterr()
        assert main(["index", str(case), "--format", "parquet"]) == 2
        err = bad_lines(capsys.readouterr().err)
        assert len(err) == 1 and message in err[0], err
        assert sorted(os.listdir(case)) == ["a.parquet", "b.parquet"]


def test_rows_stored_as_they_are_are_read_without_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncompressed image chunks (as ``datasets`` writes them): rows read by positioned reads, still checked."""
    root = tmp_path / "plain"
    root.mkdir()
    blobs = [encode(i, "JPEG" if i % 3 else "PNG") for i in range(50)]
    table = pa.table({"image": pa.array(blobs, pa.binary()), "label": [i % 4 for i in range(50)]})
    pq.write_table(table, root / "u.parquet", row_group_size=16, compression="NONE", use_dictionary=False)
    pq.write_table(table, root / "z.parquet", row_group_size=16, compression="zstd")  # compressed: pages decoded
    index_directory(str(root), "parquet")
    reads: list[str] = []
    original = pq.ParquetFile.read_row_group

    def counted(self: Any, i: int, *args: Any, **kwargs: Any) -> Any:
        reads.append(str(self.metadata.row_group(0).column(0).compression))
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    ds = StreamingDataset(str(root), shuffle=True, seed=4, batch_size=8, collate=RawCollate(keys=True))
    got: dict[str, bytes] = {}
    for batch in ds:
        offsets = batch.offsets.tolist()
        for k, key in enumerate(batch.keys):
            got[key] = batch.data[offsets[k] : offsets[k + 1]].numpy().tobytes()
    assert got == {f"{f}/{i:010d}": blobs[i] for f in ("u", "z") for i in range(50)}
    assert not reads  # neither file went through pyarrow's row-group reads (no json columns here)
    assert ShardedDataset(str(root)).get("u/0000000017")["jpg"] == blobs[17]

    flip_inside_image(root / "u.parquet", blobs[33])
    with pytest.raises(CorruptShardError, match=r"u\.parquet, row group 2, row 33 .*checksum"):
        list(StreamingDataset(str(root), batch_size=8, collate=RawCollate()))
    os.truncate(root / "u.parquet", 3000)
    with pytest.raises(CorruptShardError, match=r"u\.parquet"):
        list(StreamingDataset(str(root), batch_size=8, collate=RawCollate()))
