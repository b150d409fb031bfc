"""Format-to-format conversion: an existing dataset as the source of ``streamload convert``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import webdataset as wds

from streamload import SourceError, StreamingDataset
from streamload.cli import main
from streamload.converters import ConvertOptions, convert, open_source
from streamload.converters.dataset_source import DatasetSource

from .conftest import expected_samples


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name.startswith("shard-")}


def _convert(src: Path, dst: Path, *args: str) -> None:
    assert main(["convert", str(src), str(dst), "--no-progress", *args]) == 0


def test_tar_lmdb_hdf5_tar_round_trip_is_exact(tar_dataset: Path, image_folder: Path, tmp_path: Path) -> None:
    _convert(tar_dataset, tmp_path / "l", "--format", "lmdb", "--samples-per-shard", "40")
    _convert(tmp_path / "l", tmp_path / "h", "--format", "hdf5", "--shard-size", "30KB", "-j", "2")
    _convert(tmp_path / "h", tmp_path / "t", "--format", "tar", "--samples-per-shard", "16")
    original = _files(tar_dataset)
    assert _files(tmp_path / "t") == original  # the same shards and sidecars, byte for byte
    by_path = {data: label for data, label in expected_samples(image_folder).values()}
    for step in ("l", "h", "t"):
        ds = StreamingDataset(str(tmp_path / step))
        assert ds.manifest.format == {"l": "lmdb", "h": "hdf5", "t": "tar"}[step]
        assert ds.manifest.classes == StreamingDataset(str(tar_dataset)).manifest.classes
        samples = list(ds)
        assert samples == list(StreamingDataset(str(tar_dataset)))
        assert sorted(by_path[s.get("jpg", s.get("jpeg", s.get("png")))] for s in samples) == sorted(by_path.values())


def test_reshard_by_bytes_keeps_order_and_content(tar_dataset: Path, tmp_path: Path) -> None:
    _convert(tar_dataset, tmp_path / "o", "--format", "lmdb", "--shard-size", "8KB")
    new = StreamingDataset(str(tmp_path / "o"))
    old = StreamingDataset(str(tar_dataset))
    assert len(new.manifest.shards) > len(old.manifest.shards)
    assert list(new) == list(old)
    boundaries = [0]
    for entry in new.manifest.shards:
        boundaries.append(boundaries[-1] + entry.num_samples)
    samples = list(new)
    for i, entry in enumerate(new.manifest.shards):
        shard_samples = samples[boundaries[i] : boundaries[i + 1]]
        payload = sum(len(v) for s in shard_samples for k, v in s.items() if k != "__key__")
        assert payload <= 8000 or entry.num_samples == 1


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_conversion_is_identical_for_any_worker_count(tar_dataset: Path, tmp_path: Path, fmt: str) -> None:
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        _convert(
            tar_dataset,
            out,
            "--format",
            fmt,
            "--samples-per-shard",
            "10",
            "--shuffle",
            "--seed",
            "4",
            "--workers",
            str(workers),
        )
        outs.append(_files(out))
    assert outs[0] == outs[1] and len(outs[0]) == 13


def test_scan_sizes_come_from_the_shard_indexes(tar_dataset: Path, tmp_path: Path) -> None:
    _convert(tar_dataset, tmp_path / "h", "--format", "hdf5")
    reference = [
        (s["__key__"], sum(len(v) for k, v in s.items() if k != "__key__")) for s in StreamingDataset(str(tar_dataset))
    ]
    for root in (tar_dataset, tmp_path / "h"):
        source = open_source(str(root))
        assert isinstance(source, DatasetSource)
        items = source.scan().items
        assert [(i.key, i.nbytes) for i in items] == reference
        assert source.shard_opens == len(source.manifest.shards)


def test_each_source_shard_opens_once_per_task(tar_dataset: Path, tmp_path: Path) -> None:
    source = DatasetSource(str(tar_dataset))
    shards = len(source.manifest.shards)
    convert(source, str(tmp_path / "o"), ConvertOptions(format="lmdb", samples_per_shard=1000, progress=False))
    assert source.shard_opens == 2 * shards  # once while scanning, once while loading


def test_webdataset_shards_indexed_then_converted(tmp_path: Path) -> None:
    src = tmp_path / "wds"
    src.mkdir()
    written = []
    with wds.ShardWriter(str(src / "part-%04d.tar"), maxcount=6) as sink:
        for i in range(20):
            sample = {"__key__": f"s{i:03d}", "txt": f"sample {i}", "cls": str(i % 4)}
            sink.write(sample)
            written.append({"__key__": sample["__key__"], "txt": sample["txt"].encode(), "cls": sample["cls"].encode()})
    assert main(["index", str(src)]) == 0
    _convert(src, tmp_path / "h", "--format", "hdf5", "--samples-per-shard", "8")
    ds = StreamingDataset(str(tmp_path / "h"))
    assert ds.manifest.format == "hdf5" and [s.num_samples for s in ds.manifest.shards] == [8, 8, 4]
    assert list(ds) == written
    meta = json.loads((tmp_path / "h" / "index.json").read_text())["meta"]
    assert meta["source_format"] == "tar" and meta["source"] == str(src)


def test_unreadable_source_shard_raises_or_is_skipped(tar_dataset: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tar_dataset, src)
    (src / "shard-000002.tar").unlink()
    with pytest.raises(SourceError, match="shard-000002.tar"):
        convert(open_source(str(src)), str(tmp_path / "a"), ConvertOptions(format="hdf5", progress=False))
    assert not (tmp_path / "a" / "index.json").exists()
    report = convert(
        open_source(str(src)), str(tmp_path / "b"), ConvertOptions(format="hdf5", progress=False, on_error="skip")
    )
    assert [s.path for s in report.skipped] == ["shard-000002.tar"]
    old = StreamingDataset(str(tar_dataset)).manifest
    assert report.manifest.num_samples == old.num_samples - old.shards[2].num_samples


def test_corrupt_source_sample_is_named_or_skipped(tar_dataset: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tar_dataset, src)
    data = bytearray((src / "shard-000001.tar").read_bytes())
    data[2000] ^= 0xFF  # inside the data of one member; tar reads check each member's hash
    (src / "shard-000001.tar").write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"shard-000001\.tar.*sample"):
        convert(open_source(str(src)), str(tmp_path / "a"), ConvertOptions(format="lmdb", progress=False))
    report = convert(
        open_source(str(src)), str(tmp_path / "b"), ConvertOptions(format="lmdb", progress=False, on_error="skip")
    )
    assert len(report.skipped) == 1 and report.skipped[0].path.startswith("shard-000001.tar#")
    assert report.manifest.num_samples == StreamingDataset(str(tar_dataset)).num_samples - 1


def test_conversion_leaves_no_source_shard_open(tar_dataset: Path, tmp_path: Path) -> None:
    def open_in(root: Path) -> int:
        fds = Path("/proc/self/fd")
        return sum(1 for fd in fds.iterdir() if str(root) in str(fd.resolve(strict=False)))

    _convert(tar_dataset, tmp_path / "o", "--format", "hdf5", "--samples-per-shard", "30")
    assert open_in(tar_dataset) == 0
