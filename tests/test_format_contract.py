"""What a shard format declares: its reader's bytes, an optional writer, tables read in place, the row-group budget."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from streamload import ConfigError, DatasetWriter, StorageConfig, StreamingDataset, formats
from streamload.formats import (
    Format,
    RangedReads,
    ShardBytes,
    TableIndexing,
    get_format,
    register_format,
    set_row_group_cache_bytes,
    set_row_group_cache_default,
)
from streamload.formats.table_cache import CACHE, RowGroupCache
from streamload.indexing import index_directory
from streamload.manifest import Manifest
from streamload.storage.bytes import FileBytes


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Formats registered by a test are forgotten after it."""
    monkeypatch.setattr(formats, "_LOADED", dict(formats._LOADED))


def png(i: int) -> bytes:
    """A small PNG whose pixels depend on ``i``."""
    out = io.BytesIO()
    Image.new("RGB", (6, 5), (i * 7 % 256, 40, 90)).save(out, format="PNG")
    return out.getvalue()


def test_a_local_file_is_the_bytes_a_ranged_reader_takes(tmp_path: Path) -> None:
    """A tar reader over a local file's ShardBytes reads what the reader of the file reads; lmdb takes no bytes."""
    with DatasetWriter(str(tmp_path / "tar"), "tar") as writer:
        for i in range(5):
            writer.write({"__key__": f"k{i}", "png": png(i), "cls": str(i).encode()})
    entry = Manifest.loads((tmp_path / "tar" / "index.json").read_bytes()).shards[0]
    shard, sidecar = str(tmp_path / "tar" / entry.name), str(tmp_path / "tar" / f"{entry.name}.idx")
    fmt = get_format("tar")
    source = FileBytes(os.open(shard, os.O_RDONLY))
    assert isinstance(source, ShardBytes)
    ranged = fmt.open_reader(shard, entry, sidecar, source=source, check_headers=False)
    plain = fmt.open_reader(shard, entry, sidecar)
    try:
        assert isinstance(ranged, RangedReads)
        assert [ranged.get(i) for i in range(5)] == [plain.get(i) for i in range(5)]
        extents = ranged.sample_extents(np.arange(5))
        assert extents.shape == (5, 2) and int(extents[-1, 1]) <= source.size
    finally:
        ranged.close()
        plain.close()
    with DatasetWriter(str(tmp_path / "lmdb"), "lmdb") as writer:
        writer.write({"__key__": "k0", "png": png(0)})
    lmdb_entry = Manifest.loads((tmp_path / "lmdb" / "index.json").read_bytes()).shards[0]
    with pytest.raises(ConfigError, match="lmdb format reads local files only"):
        get_format("lmdb").open_reader(str(tmp_path / "lmdb" / lmdb_entry.name), lmdb_entry, source=source)


def test_a_format_without_a_writer_is_refused_by_name_when_written(tmp_path: Path, registry: None) -> None:
    """A format registered with a reader only: never written, the refusal naming it."""
    register_format(Format(name="tar-read-only", extension=".tar", reader=get_format("tar").reader))
    fmt = get_format("tar-read-only")
    assert not fmt.writable and fmt.writer is None
    with pytest.raises(ConfigError, match="tar-read-only format is read in place, never written"):
        fmt.open_writer(str(tmp_path / "x.tar"))
    with pytest.raises(ConfigError, match=r"parquet format is read in place \(streamload index DIR --format parquet"):
        with DatasetWriter(str(tmp_path / "out"), "parquet") as writer:
            writer.write({"__key__": "k0", "png": png(0)})
    assert not (tmp_path / "out" / "index.json").exists()


def test_tables_read_in_place_are_a_capability_any_format_may_have(tmp_path: Path, registry: None) -> None:
    """A format named otherwise, with Parquet's table indexing, is indexed as tables: --split and skipped rows."""
    parquet = get_format("parquet")
    assert isinstance(parquet.tables, TableIndexing) and parquet.reads_in_place
    register_format(
        Format(
            name="pq-elsewhere",
            extension=".pqx",
            reader=parquet.reader,
            sidecar_suffix=parquet.sidecar_suffix,
            ranged=True,
            tables=parquet.tables,
        )
    )
    images = [png(i) for i in range(6)]
    images[2] = b"not an image"
    pq.write_table(pa.table({"image": images, "label": [0, 1, 0, 1, 0, 1]}), tmp_path / "train-0.pqx")
    manifest = index_directory(str(tmp_path), "pq-elsewhere", split="train", on_error="skip")
    assert manifest.format == "pq-elsewhere" and manifest.num_samples == 5
    assert [s.path for s in manifest.skipped] == ["train-0.pqx: row 2"]
    got = {s["__key__"]: s["png"] for s in StreamingDataset(str(tmp_path / "train"))}
    assert got == {f"train-0/{r:010d}": images[r] for r in (0, 1, 3, 4, 5)}
    with pytest.raises(ConfigError, match="--split is for tables read in place"):
        index_directory(str(tmp_path), "tar", split="train")


def test_the_row_group_budget_is_a_parameter_with_the_environment_as_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("STREAMLOAD_PARQUET_CACHE", "3MiB")
    assert RowGroupCache().budget == 1 << 30  # the cache reads no environment: it is told
    assert RowGroupCache(5).budget == 5
    try:
        StorageConfig().open(str(tmp_path)).close()  # opening a dataset applies the environment's default
        assert CACHE.budget == 3 << 20
        set_row_group_cache_bytes("2MB")
        assert CACHE.budget == 2_000_000
        StorageConfig().open(str(tmp_path)).close()  # the budget set wins over the default
        assert CACHE.budget == 2_000_000
        set_row_group_cache_bytes(None)
        assert CACHE.budget == 3 << 20
        for bad in (-1, 1.5, "lots", True):
            with pytest.raises(ConfigError):
                set_row_group_cache_bytes(bad)
    finally:
        set_row_group_cache_bytes(None)
        set_row_group_cache_default(1 << 30)


def test_a_forked_child_starts_with_no_decoded_row_groups() -> None:
    """The row-group cache is the process's own: a forked child holds none of its parent's."""
    group = ([np.zeros(4, np.uint8)], np.zeros(1, np.int32), np.zeros(1, np.int64), np.ones(1, np.int64), None)
    CACHE.put((-1, 0), group)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0 if not CACHE.items and CACHE.total == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert CACHE.held(-1) == [0]
    finally:
        CACHE.drop(-1)
