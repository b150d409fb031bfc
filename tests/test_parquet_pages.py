"""Compressed and dictionary-encoded Parquet image columns: pages decoded directly, byte-identical, memory bounded."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from streamload import CorruptShardError, ShardedDataset, StreamingDataset
from streamload.batch import RawCollate
from streamload.formats import table_cache
from streamload.formats.parquet import pages
from streamload.indexing import index_directory

ROWS = 60
#: How pyarrow (and Spark-like writers) lay out image columns: codecs, dictionary pages, page versions.
LAYOUTS: dict[str, dict[str, Any]] = {
    "snappy": {"compression": "snappy"},
    "zstd": {"compression": "zstd"},
    "gzip": {"compression": "gzip", "use_dictionary": False},
    "dictionary": {"compression": "snappy", "dictionary_pagesize_limit": 1 << 30},
    "dictionary-plain": {"compression": "none", "dictionary_pagesize_limit": 1 << 30},
    "v2-pages": {"compression": "zstd", "data_page_version": "2.0", "use_dictionary": False},
    "small-pages": {"compression": "snappy", "use_dictionary": False, "data_page_size": 2000},
}


def image(i: int) -> bytes:
    buf = io.BytesIO()
    noise = np.random.default_rng(i).integers(0, 256, (12 + i % 5, 9, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, "PNG" if i % 4 == 0 else "JPEG")
    return buf.getvalue()


def images(part: int) -> list[bytes]:
    blobs = [image(part * 1000 + i) for i in range(ROWS)]
    blobs[7] = blobs[3]  # a repeated image: one dictionary entry for two rows
    return blobs


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """One file per layout (an ``Image``-like struct, nullable, with a label), row groups of 16; keys -> bytes."""
    root = tmp_path_factory.mktemp("pages")
    expected: dict[str, bytes] = {}
    for part, (name, options) in enumerate(LAYOUTS.items()):
        blobs = images(part)
        struct = pa.StructArray.from_arrays(
            [pa.array(blobs, pa.binary()), pa.array([None] * ROWS, pa.string())], names=["bytes", "path"]
        )
        table = pa.table({"image": struct, "label": pa.array([i % 3 for i in range(ROWS)], pa.int64())})
        pq.write_table(table, root / f"{name}.parquet", row_group_size=16, **options)
        expected.update({f"{name}/{i:010d}": blob for i, blob in enumerate(blobs)})
    index_directory(str(root), "parquet")
    return root, expected


def read_back(root: Path, workers: int, **options: Any) -> dict[str, bytes]:
    ds = StreamingDataset(str(root), batch_size=8, collate=RawCollate(keys=True), **options)
    got: dict[str, bytes] = {}
    for batch in DataLoader(ds, batch_size=None, num_workers=workers):
        offsets = batch.offsets.tolist()
        for k, key in enumerate(batch.keys):
            got[key] = batch.data[offsets[k] : offsets[k + 1]].numpy().tobytes()
    return got


def test_compressed_and_dictionary_columns_read_back_byte_identical_from_their_pages(
    layouts: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layout's images come back as written, their pages decoded here rather than by pyarrow."""
    root, expected = layouts
    calls: list[int] = []
    original = pq.ParquetFile.read_row_group

    def counted(self: Any, i: int, *args: Any, **kwargs: Any) -> Any:
        calls.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    assert read_back(root, 0) == expected
    assert read_back(root, 0, shuffle=True, seed=3) == expected
    assert calls == []  # no row group went through pyarrow: the image chunks were decoded from their pages
    sharded = ShardedDataset(str(root))
    assert sharded.get("dictionary/0000000007")["png" if 3 % 4 == 0 else "jpg"] == expected["dictionary/0000000003"]
    assert sharded.get("v2-pages/0000000033")["jpg"] == expected["v2-pages/0000000033"]
    assert read_back(root, 2) == expected  # two workers, each decoding the pages it reads


def test_a_reader_in_row_order_holds_only_the_row_groups_of_its_current_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read in order, a reader keeps the row groups its latest batch spans (two at most), not the file's."""
    blobs = [image(i) for i in range(96)]
    table = pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array([1] * 96, pa.int64())})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10, compression="zstd")  # 10 row groups
    index_directory(str(tmp_path), "parquet")
    held: list[int] = []
    inflated = _count_inflated(monkeypatch)
    ds = StreamingDataset(str(tmp_path), batch_size=8, collate=RawCollate())
    # this reader's row groups only: a reader of an earlier test in this process may still hold some
    before = set(table_cache.CACHE.items)
    for batch in ds:  # 8-row batches straddle the 10-row groups
        held.append(sum(1 for key in table_cache.CACHE.items if key not in before))
        assert len(batch.offsets) == 9
    assert max(held) <= 2 and len(held) == 12, held
    in_file = len(inflated)  # read in order: each page once
    assert sum(1 for page in inflated if page.kind != 2) >= 10  # (a data page or more per row group)
    # shuffled: the process's budget keeps the window's row groups (each page decoded once)
    inflated.clear()
    list(StreamingDataset(str(tmp_path), batch_size=8, collate=RawCollate(), shuffle=True, seed=1))
    assert len(inflated) == in_file


def _count_inflated(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The pages decompressed from now on (each a :class:`~streamload.formats.parquet.pages.Page`)."""
    inflated: list[Any] = []
    original = pages.inflate

    def counted(page: Any, *args: Any) -> Any:
        inflated.append(page)
        return original(page, *args)

    monkeypatch.setattr(pages, "inflate", counted)
    return inflated


def test_a_read_decodes_only_the_pages_holding_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row groups of many pages: one sample, or one DataLoader worker's batches, decode their own pages only."""
    blobs = [image(i) for i in range(120)]
    table = pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array([1] * 120, pa.int64())})
    pq.write_table(
        table,
        tmp_path / "a.parquet",
        row_group_size=60,
        compression="snappy",
        use_dictionary=False,
        data_page_size=1000,
        write_batch_size=1,  # (pages are cut between write batches)
    )
    index_directory(str(tmp_path), "parquet")
    expected = {f"a/{i:010d}": blob for i, blob in enumerate(blobs)}
    log = tmp_path / "inflated"
    log.mkdir()
    original = pages.inflate

    def logged(page: Any, *args: Any) -> Any:  # one line per page decompressed, a file per process
        with open(log / str(os.getpid()), "a") as f:
            f.write(f"{page.first} {page.at}\n")
        return original(page, *args)

    monkeypatch.setattr(pages, "inflate", logged)
    table_cache.CACHE.forget()
    sharded = ShardedDataset(str(tmp_path))
    assert sharded[70]["png" if 70 % 4 == 0 else "jpg"] == blobs[70]
    (mine,) = log.iterdir()
    first, _ = map(int, mine.read_text().split())
    assert len(mine.read_text().splitlines()) == 1 and first <= 10  # one page: the one holding row 10 of group 1
    mine.unlink()
    table_cache.CACHE.forget()
    assert read_back(tmp_path, 0) == expected  # in one process: every page once
    in_file = len(mine.read_text().splitlines())
    assert in_file >= 2 * 30
    mine.unlink()
    assert read_back(tmp_path, 2) == expected  # two workers, batches of 8 in turns
    per_worker = [len(f.read_text().splitlines()) for f in log.iterdir()]
    assert len(per_worker) == 2 and all(n < 0.8 * in_file for n in per_worker), (per_worker, in_file)


def test_a_damaged_compressed_page_names_file_row_group_and_row(tmp_path: Path) -> None:
    blobs = [image(i) for i in range(40)]
    for codec in ("snappy", "none"):  # a compressed page, and a dictionary page stored as is
        root = tmp_path / codec
        root.mkdir()
        table = pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array([0] * 40, pa.int64())})
        path = root / "x.parquet"
        pq.write_table(table, path, row_group_size=10, compression=codec, dictionary_pagesize_limit=1 << 30)
        index_directory(str(root), "parquet")
        raw = bytearray(path.read_bytes())
        at = raw.find(blobs[23][-40:-2])  # row 23's own scan data (tiny JPEGs share their headers)
        assert at > 0
        assert raw.find(blobs[23][-40:-2], at + 1) < 0
        raw[at + 5] ^= 0x40
        path.write_bytes(bytes(raw))
        with pytest.raises(CorruptShardError, match=r"x\.parquet, row group 2, row 23 .*checksum"):
            list(StreamingDataset(str(root), batch_size=8, collate=RawCollate()))
        with pytest.raises(CorruptShardError, match=r"x\.parquet, row group 2"):
            ShardedDataset(str(root))[23]
