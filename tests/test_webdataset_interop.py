"""Our tar shards read in the real `webdataset` package, and its shards read in ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import webdataset as wds

from streamload import StreamingDataset
from streamload.cli import main


def test_webdataset_reads_our_shards(tar_dataset: Path) -> None:
    ours = {s["__key__"]: s for s in StreamingDataset(str(tar_dataset))}
    shards = sorted(str(p) for p in tar_dataset.glob("*.tar"))
    theirs = list(wds.WebDataset(shards, shardshuffle=False, empty_check=False))
    assert len(theirs) == len(ours)
    for sample in theirs:
        mine = ours[sample["__key__"]]
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        assert fields == {k: v for k, v in mine.items() if not k.startswith("__")}


def test_our_reader_reads_webdataset_shardwriter_output(tmp_path: Path) -> None:
    pattern = str(tmp_path / "wds-%06d.tar")
    written = {}
    with wds.ShardWriter(pattern, maxcount=7) as sink:
        for i in range(25):
            key = f"sample{i:04d}"
            sample = {"__key__": key, "txt": f"hello {i}", "cls": str(i % 3), "bin": bytes([i]) * i}
            sink.write(sample)
            written[key] = sample
    assert main(["index", str(tmp_path)]) == 0
    ds = StreamingDataset(str(tmp_path))
    got = list(ds)
    assert len(got) == 25 == ds.num_samples
    assert len(ds.manifest.shards) == 4
    for sample in got:
        src = written[sample["__key__"]]
        assert sample["txt"] == src["txt"].encode()
        assert sample["cls"] == src["cls"].encode()
        assert sample["bin"] == src["bin"]


def test_index_refuses_non_adjacent_members(tmp_path: Path) -> None:
    import io
    import tarfile

    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        for name in ["a.txt", "b.txt", "a.cls"]:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    from streamload import CorruptShardError
    from streamload.indexing import index_directory

    with pytest.raises(CorruptShardError, match="bad.tar.*'a'.*not adjacent"):
        index_directory(str(tmp_path))
