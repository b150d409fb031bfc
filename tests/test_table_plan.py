"""Streamed planning of listing tables: shards cut while scanning, each task reads only its rows.

Expectations come from the rows themselves (which rows are good, their labels, their
images), never from the code under test. Real parts: tables written by pyarrow or as
text, image files on disk, the local process pool, a Dask LocalCluster and a local Ray.
"""

from __future__ import annotations

import json
import pickle
import tracemalloc
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamload._errors import ConversionInterrupted, SourceError
from streamload.converters import ConvertOptions, DatasetSource, TableSource, convert, open_source
from streamload.converters import table as table_module
from streamload.converters.engine import _job
from streamload.converters.journal import plan_fingerprint
from streamload.converters.table import RowList, RowSpan
from streamload.converters.table import kinds as table_kinds
from streamload.converters.table.blocks import TextBlocks
from streamload.synthetic import make_image_folder

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, bytes]]:
    """(absolute path, class, bytes) of a few small JPEGs."""
    root = tmp_path_factory.mktemp("plan-images")
    make_image_folder(str(root), num_classes=3, per_class=4, size=(16, 12), seed=5)
    return sorted((str(p), p.parent.name, p.read_bytes()) for p in root.rglob("*.jpg"))


def _by_shard(url: str) -> list[list[dict[str, Any]]]:
    """The samples of the dataset at ``url``, shard by shard."""
    src = DatasetSource(url)
    try:
        shards: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for item in src.scan().items:
            shards[item.shard].append(src.load(item))  # type: ignore[attr-defined]
        return [shards[k] for k in sorted(shards)]
    finally:
        src.close()


def _rows(n: int, images: list[tuple[str, str, bytes]], bad: dict[int, str]) -> list[dict[str, Any]]:
    """``n`` rows: row i names image i mod len(images) with its class name, except the ``bad`` ones."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        path, cls, _ = images[i % len(images)]
        row: dict[str, Any] = {"path": path, "label": cls, "n": i}
        if bad.get(i) == "no path":
            row["path"] = ""
        elif bad.get(i) == "no label":
            row["label"] = ""
        elif bad.get(i) == "not an image file extension":
            row["path"] = path[:-4] + ".txt"
        rows.append(row)
    return rows


def _write(kind: str, path: Path, rows: list[dict[str, Any]]) -> None:
    if kind == "parquet":
        table = pa.table({k: pa.array([r[k] for r in rows]) for k in ("path", "label", "n")})
        pq.write_table(table, path, row_group_size=9)
    elif kind == "csv":
        path.write_text("\n".join(["path,label,n"] + [f"{r['path']},{r['label']},{r['n']}" for r in rows]) + "\n")
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


BAD = {3: "no path", 10: "no label", 11: "not an image file extension", 25: "no label", 26: "no path"}


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_shards_hold_the_good_rows_in_order_cut_every_n(
    kind: str, images: list[tuple[str, str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_module, "TEXT_BLOCK_BYTES", 200)  # many blocks, shards across blocks
    monkeypatch.setattr(table_module, "PARQUET_BATCH_ROWS", 4)
    rows = _rows(40, images, BAD)
    table = tmp_path / f"list.{kind}"
    _write(kind, table, rows)
    source = TableSource(str(table), keep_columns=["n"])
    with pytest.raises(SourceError, match="row 3.*no path"):
        convert(source, str(tmp_path / "raise"), ConvertOptions(samples_per_shard=7, progress=False))
    report = convert(
        source, str(tmp_path / "out"), ConvertOptions(samples_per_shard=7, on_error="skip", progress=False)
    )
    good = [i for i in range(40) if i not in BAD]
    classes = sorted({cls for _, cls, _ in images})
    assert list(report.manifest.classes) == classes
    expected = [good[k : k + 7] for k in range(0, len(good), 7)]
    got = _by_shard(str(tmp_path / "out"))
    assert [[s["__key__"] for s in shard] for shard in got] == [[f"list/{i:010d}" for i in e] for e in expected]
    for shard in got:
        for s in shard:
            i = int(s["__key__"].rsplit("/", 1)[1])
            path, cls, data = images[i % len(images)]
            assert s["jpg"] == data
            assert classes[int(s["cls"])] == cls
            assert json.loads(s["json"]) == {"n": i}  # the task read this very row's values
    skipped = {s.path: s.error for s in report.manifest.skipped}
    assert len(skipped) == len(BAD)
    for i, why in BAD.items():
        assert any(p.startswith(f"{table}: row {i}") and e == why for p, e in skipped.items()), (i, skipped)


def test_byte_cut_of_embedded_images_is_greedy(images: list[tuple[str, str, bytes]], tmp_path: Path) -> None:
    datas = [images[i % len(images)][2] + bytes(i * 37) for i in range(30)]
    datas[12] = b""  # no image bytes: left out
    path = tmp_path / "emb.parquet"
    pq.write_table(pa.table({"image": pa.array(datas, pa.binary()), "label": list(range(30))}), path, row_group_size=7)
    limit = 3 * len(images[0][2]) + 400
    report = convert(
        TableSource(str(path), check="none"),
        str(tmp_path / "out"),
        ConvertOptions(shard_bytes=limit, on_error="skip", progress=False),
    )
    expected: list[list[int]] = []  # the rule: fill while the sum fits; an empty shard takes any item
    size = 0
    for i, d in enumerate(datas):
        if not d:
            continue
        if expected and expected[-1] and size + len(d) > limit:
            expected.append([])
            size = 0
        if not expected:
            expected.append([])
        expected[-1].append(i)
        size += len(d)
    got = _by_shard(str(tmp_path / "out"))
    assert [[int(s["cls"]) for s in shard] for shard in got] == expected
    assert [s["jpg"] for shard in got for s in shard] == [d for d in datas if d]
    assert [s.path for s in report.manifest.skipped] == [f"{path}: row 12"]


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_many_small_blocks_two_workers_every_row_once(
    kind: str, images: list[tuple[str, str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_module, "TEXT_BLOCK_BYTES", 100)
    n = 700
    table = tmp_path / f"big.{kind}"
    _write(kind, table, _rows(n, images, {}))
    source = TableSource(str(table), keep_columns=["n"], check="none")
    plan = source.plan(None, 23)
    assert len(plan.shards) == -(-n // 23) and all(isinstance(s, RowSpan) for s in plan.shards)
    report = convert(source, str(tmp_path / "out"), ConvertOptions(samples_per_shard=23, workers=2, progress=False))
    assert report.manifest.num_samples == n
    seen = [json.loads(s["json"])["n"] for shard in _by_shard(str(tmp_path / "out")) for s in shard]
    assert seen == list(range(n))


class _Counting(TableSource):
    """A table source that counts the bytes it reads from the table."""

    read = 0

    def _open(self) -> Any:
        inner = super()._open()
        owner = self

        class Counted:
            def __enter__(self) -> Counted:
                return self

            def __exit__(self, *exc: object) -> None:
                inner.close()

            def read(self, size: int = -1) -> bytes:
                data = inner.read(size)
                owner.read += len(data)
                return bytes(data)

            def __iter__(self) -> Iterator[bytes]:
                for line in inner:
                    owner.read += len(line)
                    yield line

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

        return Counted()


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_a_task_reads_only_its_part_of_the_table(
    kind: str, images: list[tuple[str, str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_module, "TEXT_BLOCK_BYTES", 512)
    per_shard = 1000 if kind == "parquet" else 100  # Parquet: the footer alone is read in 64 KiB
    n = 30 * per_shard
    table = tmp_path / f"t.{kind}"
    rows = _rows(n, images, {})
    if kind == "parquet":  # row groups of 1000 rows
        columns = {k: [r[k] for r in rows] for k in ("path", "label", "n")}
        pq.write_table(pa.table(columns), table, row_group_size=1000)
    else:
        _write(kind, table, rows)
    source = _Counting(str(table), keep_columns=["n"])
    plan = source.plan(None, per_shard)
    middle = plan.shards[len(plan.shards) // 2]
    source.read = 0
    items = list(source.iter_items(middle))
    assert [it.values["n"] for it in items] == [it.row for it in items] == list(middle.rows())  # type: ignore[attr-defined]
    assert len(items) == per_shard
    footer = 65536 if kind == "parquet" else 0  # pyarrow reads a Parquet file's last 64 KiB for its footer
    assert 0 < source.read < table.stat().st_size / 5 + footer, (source.read, table.stat().st_size)


def test_crlf_quotes_blank_lines_and_a_header_only_csv(images: list[tuple[str, str, bytes]], tmp_path: Path) -> None:
    folder = Path(images[0][0]).parent
    (folder / 'we"ird, name.jpg').write_bytes(images[0][2])
    table = folder / "crlf.csv"
    lines = [
        "\ufeffpath,label,note",
        f'"{images[1][0]}",class_a,"a, ""quoted"" note"',
        "",
        '"we""ird, name.jpg",class_b,plain',
        "",
        f"{images[2][0]},class_a,",
    ]
    table.write_bytes(("\r\n".join(lines) + "\r\n\r\n").encode())
    try:
        report = convert(
            TableSource(str(table), keep_columns=["note"]),
            str(tmp_path / "out"),
            ConvertOptions(samples_per_shard=2, workers=2, progress=False),
        )
    finally:
        (folder / 'we"ird, name.jpg').unlink()
        table.unlink()
    assert list(report.manifest.classes) == ["class_a", "class_b"]
    samples = [s for shard in _by_shard(str(tmp_path / "out")) for s in shard]
    assert [s["__key__"] for s in samples] == ["crlf/0000000000", "crlf/0000000001", "crlf/0000000002"]
    assert [s["jpg"] for s in samples] == [images[1][2], images[0][2], images[2][2]]
    assert [int(s["cls"]) for s in samples] == [0, 1, 0]
    assert [json.loads(s["json"])["note"] for s in samples] == ['a, "quoted" note', "plain", ""]
    header_only = tmp_path / "empty.csv"
    header_only.write_text("path,label\r\n")
    with pytest.raises(SourceError, match="nothing to convert"):
        convert(TableSource(str(header_only)), str(tmp_path / "none"), ConvertOptions(progress=False))


def test_labels_negative_indices_are_named_by_row_and_names_may_look_like_numbers(
    images: list[tuple[str, str, bytes]], tmp_path: Path
) -> None:
    path = images[0][0]
    ints = tmp_path / "ints.jsonl"
    ints.write_text("".join(json.dumps({"path": path, "label": v}) + "\n" for v in [2, "0", -1, 7, "-3", True, 1.5]))
    report = convert(TableSource(str(ints)), str(tmp_path / "a"), ConvertOptions(on_error="skip", progress=False))
    assert report.manifest.classes == ()
    assert [int(s["cls"]) for shard in _by_shard(str(tmp_path / "a")) for s in shard] == [2, 0, 7]
    assert {s.path: s.error for s in report.manifest.skipped} == {
        f"{ints}: row 2": "label -1 is negative (labels are class indices)",
        f"{ints}: row 4": "label -3 is negative (labels are class indices)",
        f"{ints}: row 5": "label True is not usable",
        f"{ints}: row 6": "label 1.5 is not usable",
    }
    # a name after the negative numbers makes every label a class name: nothing is left out
    names = tmp_path / "names.jsonl"
    names.write_text("".join(json.dumps({"path": path, "label": v}) + "\n" for v in [-1, 3, "-1", "cat"]))
    report = convert(TableSource(str(names)), str(tmp_path / "b"), ConvertOptions(progress=False))
    assert list(report.manifest.classes) == ["-1", "3", "cat"]
    assert [int(s["cls"]) for shard in _by_shard(str(tmp_path / "b")) for s in shard] == [0, 1, 0, 2]


def test_shuffled_table_is_the_seeded_permutation_of_the_good_rows(
    images: list[tuple[str, str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_module, "TEXT_BLOCK_BYTES", 150)
    table = tmp_path / "s.csv"
    _write("csv", table, _rows(60, images, BAD))
    source = TableSource(str(table), keep_columns=["n"], check="none")
    options = ConvertOptions(samples_per_shard=8, shuffle=True, seed=4, on_error="skip", workers=2, progress=False)
    convert(source, str(tmp_path / "out"), options)
    good = np.array([i for i in range(60) if i not in BAD])
    order = good[np.random.default_rng(4).permutation(len(good))].tolist()
    got = _by_shard(str(tmp_path / "out"))
    assert [json.loads(s["json"])["n"] for shard in got for s in shard] == order
    assert [len(shard) for shard in got] == [8] * 6 + [7]


def _paths_parquet(path: Path, rows: int) -> None:
    paths = pa.array([f"images/{i // 1000:04d}/{i:08d}.jpg" for i in range(rows)])
    pq.write_table(pa.table({"path": paths, "label": pa.array(np.arange(rows) % 100)}), path, row_group_size=50_000)


def test_planned_tasks_hold_no_rows(tmp_path: Path) -> None:
    """The pickled plan grows with the shards, not with the rows in them."""
    sizes = {}
    for rows in (2_000, 40_000):
        path = tmp_path / f"p{rows}.parquet"
        _paths_parquet(path, rows)
        plan = TableSource(str(path)).plan(None, rows // 20)
        assert len(plan.shards) == 20 and plan.samples == rows
        sizes[rows] = len(pickle.dumps(plan.shards))
    assert sizes[40_000] <= sizes[2_000] * 1.1
    assert sizes[40_000] / 20 < 200  # bytes per shard
    # the shuffled plan is the one that keeps rows: the measure can tell
    shuffled = TableSource(str(tmp_path / "p40000.parquet")).plan(None, 2_000, shuffle=True)
    assert all(isinstance(s, RowList) for s in shuffled.shards)
    assert len(pickle.dumps(shuffled.shards)) > 6 * 40_000


def test_planning_memory_does_not_grow_with_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python-side peak of planning 2*10^5 rows: bounded by a batch (8192 rows here), not by the rows."""
    monkeypatch.setattr(table_module, "PARQUET_BATCH_ROWS", 8192)
    rows = 200_000
    path = tmp_path / "listing.parquet"
    _paths_parquet(path, rows)

    def peak(**kwargs: Any) -> int:
        source = TableSource(str(path))
        tracemalloc.start()
        try:
            plan = source.plan(None, 1000, **kwargs)
            assert plan.samples == rows
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    streamed = peak()
    assert streamed < 5 * rows, f"planning peaked at {streamed} bytes for {rows} rows"  # 24 B/row was the old cost
    assert peak(shuffle=True) > 16 * rows  # an O(rows) plan (the shuffled one) is seen by this measure


def test_fingerprint_is_stable_and_sees_a_changed_table(images: list[tuple[str, str, bytes]], tmp_path: Path) -> None:
    table = tmp_path / "f.csv"
    rows = _rows(30, images, {})
    _write("csv", table, rows)

    def fingerprint() -> str:
        source = TableSource(str(table))
        plan = source.plan(None, 7)
        return plan_fingerprint(_job(source, ConvertOptions()), list(enumerate(plan.shards)))

    first = fingerprint()
    assert fingerprint() == first
    rows[17]["label"] = images[0][1] if rows[17]["label"] != images[0][1] else images[1][1]
    _write("csv", table, rows)
    assert fingerprint() != first


def test_resume_after_an_interruption_gives_the_same_bytes(
    images: list[tuple[str, str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_module, "TEXT_BLOCK_BYTES", 120)
    table = tmp_path / "r.jsonl"
    _write("jsonl", table, _rows(40, images, {5: "no path"}))
    options = ConvertOptions(samples_per_shard=6, on_error="skip", progress=False)
    convert(TableSource(str(table)), str(tmp_path / "whole"), options)

    def stop(samples: int, nbytes: int) -> None:
        if samples >= 12:
            raise KeyboardInterrupt

    with pytest.raises(ConversionInterrupted):
        convert(TableSource(str(table)), str(tmp_path / "part"), options, on_progress=stop)
    assert not (tmp_path / "part" / "index.json").exists()
    resumed = convert(
        TableSource(str(table)),
        str(tmp_path / "part"),
        ConvertOptions(samples_per_shard=6, on_error="skip", progress=False, resume=True),
    )
    assert resumed.resumed == 2
    whole = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    part = {p.name: p.read_bytes() for p in (tmp_path / "part").iterdir()}
    assert part == whole


def test_appending_a_grown_table_adds_only_its_new_rows(images: list[tuple[str, str, bytes]], tmp_path: Path) -> None:
    table = tmp_path / "grow.csv"
    rows = _rows(45, images, {})
    for i, r in enumerate(rows):
        r["label"] = i % 3  # class indices: the grown table has the same (no) class names
    _write("csv", table, rows[:30])
    dst = str(tmp_path / "out")
    convert(TableSource(str(table)), dst, ConvertOptions(samples_per_shard=8, progress=False))
    rows[33]["path"] = ""  # a broken new row
    _write("csv", table, rows)
    with pytest.raises(SourceError, match="row 33.*no path"):
        convert(TableSource(str(table)), dst, ConvertOptions(samples_per_shard=8, append=True, progress=False))
    report = convert(
        TableSource(str(table)), dst, ConvertOptions(samples_per_shard=8, append=True, on_error="skip", progress=False)
    )
    keys = [s["__key__"] for shard in _by_shard(dst) for s in shard]
    assert keys == [f"grow/{i:010d}" for i in range(45) if i != 33]
    skipped = [s.path for s in report.manifest.skipped]
    assert skipped.count(f"{table}: row 33") == 1
    assert sum("already in" in s.error for s in report.manifest.skipped) == 30
    assert [len(shard) for shard in _by_shard(dst)] == [8, 8, 8, 6, 8, 6]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dask_and_ray_write_the_local_pools_bytes_from_a_table(
    images: list[tuple[str, str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dask_address: str,
    ray_local: str,
) -> None:
    monkeypatch.setattr(table_module, "TEXT_BLOCK_BYTES", 100)  # the source carries it to the workers
    table = tmp_path / "x.csv"
    _write("csv", table, _rows(50, images, {7: "no label"}))
    options: dict[str, Any] = {"samples_per_shard": 6, "on_error": "skip", "progress": False}

    def files(path: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}

    convert(TableSource(str(table)), str(tmp_path / "one"), ConvertOptions(**options))
    convert(TableSource(str(table)), str(tmp_path / "two"), ConvertOptions(workers=2, **options))
    expected = files(tmp_path / "one")
    assert files(tmp_path / "two") == expected
    convert(TableSource(str(table)), str(tmp_path / "dask"), ConvertOptions(executor=dask_address, **options))
    assert files(tmp_path / "dask") == expected
    convert(TableSource(str(table)), str(tmp_path / "ray"), ConvertOptions(executor=ray_local, **options))
    assert files(tmp_path / "ray") == expected


def test_a_broken_jsonl_line_is_named_by_its_row(images: list[tuple[str, str, bytes]], tmp_path: Path) -> None:
    table = tmp_path / "broken.jsonl"
    good = json.dumps({"path": images[0][0], "label": 1})
    table.write_text(f"{good}\n\n{good}\n{{not json\n{good}\n")
    with pytest.raises(SourceError, match=r"broken.jsonl: row 2 is not valid JSON"):
        TableSource(str(table)).plan(None, 2)
    table.write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(SourceError, match=r"broken.jsonl: row 1 is not a JSON object"):
        TableSource(str(table)).plan(None, 2)


class _TsvBlocks(TextBlocks):
    """A table kind of tab-separated lines, written as the docs say a new kind is (one reader class)."""

    kind = "tsv"
    extensions = (".tsv",)

    names: list[str] = []  # its own state: the header's names, found once and carried to the tasks

    def read_columns(self) -> dict[str, Any]:
        with self.open() as f:
            header = f.readline()
        self.start = len(header)
        self.names = header.decode().rstrip("\r\n").split("\t")
        return {name: pa.string() for name in self.names}

    def parse(self, data: bytes, columns: Sequence[str], offset: int, first_row: int) -> dict[str, Any]:
        lines = [line.split("\t") for line in data.decode().splitlines() if line]
        return {c: [cells[self.names.index(c)] for cells in lines] for c in columns}


def test_a_table_kind_is_one_reader_class_and_one_registration(
    images: list[tuple[str, str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_module, "TEXT_BLOCK_BYTES", 200)  # many blocks: spans start inside the table
    monkeypatch.setattr(table_kinds, "KINDS", (*table_kinds.KINDS, _TsvBlocks))
    monkeypatch.setattr(table_kinds, "TABLE_EXTENSIONS", {**table_kinds.TABLE_EXTENSIONS, ".tsv": "tsv"})
    rows = _rows(30, images, {4: "no label"})
    table = tmp_path / "list.tsv"
    table.write_text("path\tlabel\tn\n" + "".join(f"{r['path']}\t{r['label']}\t{r['n']}\n" for r in rows))
    source = open_source(str(table), keep_columns=["n"])
    report = convert(source, str(tmp_path / "out"), ConvertOptions(samples_per_shard=4, workers=2, on_error="skip"))
    assert report.manifest.meta["source_table"] == "tsv"
    assert [s.path for s in report.skipped] == [f"{table}: row 4"]
    samples = [s for shard in _by_shard(str(tmp_path / "out")) for s in shard]
    good = [i for i in range(30) if i != 4]
    assert [json.loads(s["json"])["n"] for s in samples] == [str(i) for i in good]
    classes = list(report.manifest.classes)
    assert [classes[int(s["cls"])] for s in samples] == [images[i % len(images)][1] for i in good]
    assert [s["jpg"] for s in samples] == [images[i % len(images)][2] for i in good]
