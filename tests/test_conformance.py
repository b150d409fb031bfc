"""One conformance suite that every shard format runs (like fsspec's AbstractCopyTests).

Adding a format = writing its module and adding its name to ``FORMATS``. Every test
writes samples through the public writer API and reads them back through
``StreamingDataset`` / the format's reader, comparing with samples built here, never
with output of the code under test.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from streamload import CorruptShardError, DatasetWriter, StreamingDataset, StreamloadError
from streamload.cli import main
from streamload.formats import ShardReader, get_format
from streamload.manifest import Manifest, ShardEntry
from streamload.storage import open_destination
from streamload.verify import verify_dataset
from streamload.writer import publish_manifest, write_shard
from tests.digests import digest

FORMATS = ["tar", "lmdb", "hdf5"]

Sample = dict[str, Any]


def make_samples(n: int = 40) -> list[Sample]:
    """Samples with unicode keys, empty fields, different field sets and varied sizes."""
    out: list[Sample] = []
    for i in range(n):
        sample: Sample = {"__key__": f"part{i % 3}/ключ-{i:03d}-名前"}
        sample["bin"] = bytes((i * 7 + j) % 256 for j in range((i * 613) % 3000))
        if i % 2:
            sample["cls"] = str(i % 5).encode()
        if i % 5 == 0:
            sample["txt"] = b""  # present, empty
        if i % 7 == 3:
            sample["json"] = json.dumps({"i": i, "név": "ü"}).encode()
        out.append(sample)
    return out


def write_dataset(root: Path, fmt: str, shards: list[list[Sample]]) -> Manifest:
    """Write ``shards`` (lists of samples, possibly empty) as a dataset, one shard each."""
    f = get_format(fmt)
    dest = open_destination(str(root))
    entries, fields = [], set()
    for i, samples in enumerate(shards):
        result = write_shard(f, dest, f.shard_name(i), samples)
        entries.append(result.entry)
        fields |= result.fields
    manifest = Manifest(format=fmt, shards=tuple(entries), fields=tuple(sorted(fields)))
    publish_manifest(dest, manifest)
    return manifest


def keys_of(samples: list[Sample]) -> list[str]:
    return [s["__key__"] for s in samples]


@pytest.fixture(params=FORMATS)
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dataset(fmt: str, tmp_path: Path) -> tuple[Path, list[Sample]]:
    """40 samples in shards of 7 (the last one short)."""
    samples = make_samples()
    root = tmp_path / "ds"
    with DatasetWriter(str(root), format=fmt, max_samples=7) as w:
        for sample in samples:
            w.write(sample)
    return root, samples


class TestFormat:
    """What every format must do; ``fmt`` parametrizes the class over FORMATS."""

    def test_round_trip_in_order(self, dataset: tuple[Path, list[Sample]], fmt: str) -> None:
        root, samples = dataset
        ds = StreamingDataset(str(root))
        assert ds.manifest.format == fmt and len(ds.manifest.shards) == 6
        assert list(ds) == samples
        assert all(isinstance(v, bytes) for s in ds for k, v in s.items() if k != "__key__")

    def test_shard_files_have_the_format_extension(self, dataset: tuple[Path, list[Sample]], fmt: str) -> None:
        root, _ = dataset
        ext = get_format(fmt).extension
        names = sorted(p.name for p in root.iterdir() if not p.name.endswith((".json", ".idx")))
        assert names == [f"shard-{i:06d}{ext}" for i in range(6)]
        assert not [p for p in root.iterdir() if p.name.startswith(".tmp") or p.name.endswith("-lock")]

    def test_random_access_and_ranges(self, dataset: tuple[Path, list[Sample]], fmt: str) -> None:
        root, samples = dataset
        entry, reader = _open_shard(root, fmt, 2)
        try:
            assert [reader.get(i) for i in (6, 0, 3, 3)] == [samples[14 + i] for i in (6, 0, 3, 3)]
            assert list(reader.iter_range(2, 5)) == samples[16:19]
            assert list(reader.iter_range(4, 4)) == []
            with pytest.raises(IndexError, match=entry.name):
                reader.get(7)
            keys, sizes = reader.catalog()
            assert keys == keys_of(samples[14:21])
            assert sizes == [sum(len(v) for k, v in s.items() if k != "__key__") for s in samples[14:21]]
        finally:
            reader.close()

    def test_batch_reads_agree_with_samples(self, dataset: tuple[Path, list[Sample]], fmt: str) -> None:
        import numpy as np

        from streamload import SampleError

        root, samples = dataset
        entry, reader = _open_shard(root, fmt, 1)
        try:
            indices = np.array([6, 0, 3, 3, 1])
            fields = ("json", "txt", "bin")  # the first present one of these, per sample
            wanted = [next(s[f] for f in fields if f in s) for s in (samples[7 + i] for i in indices)]
            sizes = reader.field_sizes(indices, fields)
            assert sizes.tolist() == [len(w) for w in wanted]
            from streamload.formats.base import BatchReads

            assert isinstance(reader, BatchReads), f"{fmt} readers serve zero-copy batches"
            out = np.zeros(int(sizes.sum()), dtype=np.uint8)
            reader.read_groups_into(indices, [(fields, out, sizes)])
            assert out.tobytes() == b"".join(wanted)
            assert reader.keys_of(indices) == [samples[7 + i]["__key__"] for i in indices]
            with pytest.raises(SampleError, match="nope"):
                reader.field_sizes(indices, ("nope",))
        finally:
            reader.close()

    def test_raw_batches_through_the_dataset(self, dataset: tuple[Path, list[Sample]]) -> None:
        from streamload.batch import RawCollate

        root, samples = dataset
        ds = StreamingDataset(
            str(root), batch_size=6, collate=RawCollate(field=("txt", "bin"), label_field=None, keys=True)
        )
        batches = list(DataLoader(ds, batch_size=None, num_workers=2))
        got = [(k, b.tobytes(i)) for b in batches for i, k in enumerate(b.keys)]
        # The epoch is padded to whole batches: T = ceil(40/6)*6 = 42 items, the 2 extra ones
        # repeating the first 2 samples of the (unshuffled) epoch in manifest order.
        total = -(-len(samples) // 6) * 6
        assert [len(b.keys) for b in batches] == [6] * (total // 6)
        padded = samples + samples[: total - len(samples)]
        assert sorted(got) == sorted((s["__key__"], s.get("txt", s["bin"])) for s in padded)

    def test_empty_field_and_missing_field_differ(self, tmp_path: Path, fmt: str) -> None:
        samples = [
            {"__key__": "a", "txt": b"", "cls": b"1"},
            {"__key__": "b", "cls": b"2"},
            {"__key__": "c", "txt": b"x"},
            {"__key__": "d"},
        ]
        write_dataset(tmp_path, fmt, [samples])
        got = list(StreamingDataset(str(tmp_path)))
        assert got == samples  # "d" has no field at all: a tar shard lists it in its sidecar only
        assert "txt" in got[0] and got[0]["txt"] == b"" and "txt" not in got[1]

    def test_unicode_keys(self, tmp_path: Path, fmt: str) -> None:
        keys = ["日本/画像-1", "emoji/😀", "ñandú/ü", "a b/c d", "x" * 300]
        samples = [{"__key__": k, "bin": k.encode()} for k in keys]
        write_dataset(tmp_path, fmt, [samples])
        assert list(StreamingDataset(str(tmp_path))) == samples

    def test_empty_shards(self, tmp_path: Path, fmt: str) -> None:
        samples = make_samples(12)
        manifest = write_dataset(tmp_path / "mid", fmt, [samples[:5], [], samples[5:], []])
        assert [s.num_samples for s in manifest.shards] == [5, 0, 7, 0]
        assert list(StreamingDataset(str(tmp_path / "mid"))) == samples
        got = list(DataLoader(StreamingDataset(str(tmp_path / "mid")), batch_size=None, num_workers=2))
        assert sorted(keys_of(got)) == sorted(keys_of(samples))
        assert verify_dataset(str(tmp_path / "mid")).ok
        write_dataset(tmp_path / "only", fmt, [[]])
        assert list(StreamingDataset(str(tmp_path / "only"))) == []

    def test_sample_larger_than_shard_size(self, tmp_path: Path, fmt: str) -> None:
        big = {"__key__": "big", "bin": bytes(range(256)) * 2000}  # 512 KB
        small = [{"__key__": f"s{i}", "bin": bytes([i]) * 300} for i in range(6)]
        samples = small[:3] + [big] + small[3:]
        with DatasetWriter(str(tmp_path), format=fmt, max_bytes=1000) as w:
            for sample in samples:
                w.write(sample)
        ds = StreamingDataset(str(tmp_path))
        assert list(ds) == samples
        assert [s.num_samples for s in ds.manifest.shards] == [3, 1, 3]

    def test_same_samples_give_identical_files(self, tmp_path: Path, fmt: str) -> None:
        digests = []
        for run in ("a", "b"):
            write_dataset(tmp_path / run, fmt, [make_samples(20)])
            files = sorted(p for p in (tmp_path / run).iterdir())
            digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
        assert digests[0] == digests[1]

    def test_pickle_dataset_before_and_after_iteration(self, dataset: tuple[Path, list[Sample]]) -> None:
        root, samples = dataset
        ds = StreamingDataset(str(root))
        assert list(pickle.loads(pickle.dumps(ds))) == samples  # noqa: S301 - our own bytes
        it = iter(ds)
        next(it)  # a reader is open now; the dataset still pickles, the reader does not travel
        assert list(pickle.loads(pickle.dumps(ds))) == samples  # noqa: S301 - our own bytes

    def test_reader_refuses_pickling(self, dataset: tuple[Path, list[Sample]], fmt: str) -> None:
        root, _ = dataset
        entry = Manifest.loads((root / "index.json").read_bytes()).shards[0]
        sidecar = str(root / entry.sidecar.name) if entry.sidecar else None
        reader = get_format(fmt).reader(str(root / entry.name), entry, sidecar)
        reader.get(0)
        with pytest.raises(TypeError, match=entry.name):
            pickle.dumps(reader)
        reader.close()

    @pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
    def test_dataloader_start_methods(self, dataset: tuple[Path, list[Sample]], context: str) -> None:
        root, samples = dataset
        loader = DataLoader(
            StreamingDataset(str(root)), batch_size=None, num_workers=2, multiprocessing_context=context
        )
        got = list(loader)
        assert Counter(keys_of(got)) == Counter(keys_of(samples))
        by_key = {s["__key__"]: s for s in samples}
        assert all(s == by_key[s["__key__"]] for s in got)

    def test_fork_while_the_parent_holds_open_shards(self, dataset: tuple[Path, list[Sample]]) -> None:
        root, samples = dataset
        ds = StreamingDataset(str(root))
        it = iter(ds)
        first = [next(it) for _ in range(9)]  # the parent has shards 0 and 1 open now
        got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        assert Counter(keys_of(got)) == Counter(keys_of(samples))
        assert first + list(it) == samples  # and the parent's own iteration goes on unharmed

    def test_exactly_once_across_ranks_and_workers(self, dataset: tuple[Path, list[Sample]]) -> None:
        root, samples = dataset
        seen: Counter[str] = Counter()
        per_rank = []
        for rank in range(2):
            ds = StreamingDataset(str(root), rank=rank, world_size=2, shuffle=True, seed=3, drop_last=True)
            got = keys_of(list(DataLoader(ds, batch_size=None, num_workers=3)))
            per_rank.append(len(got))
            seen.update(got)
        assert per_rank == [20, 20]
        assert set(seen) == set(keys_of(samples)) and max(seen.values()) == 1

    def test_many_readers_of_one_shard_at_once(self, dataset: tuple[Path, list[Sample]], fmt: str) -> None:
        # Like many workers x ranks on one machine: no reader-slot limit may be hit.
        root, samples = dataset
        entry = Manifest.loads((root / "index.json").read_bytes()).shards[0]
        sidecar = str(root / entry.sidecar.name) if entry.sidecar else None
        readers = [get_format(fmt).reader(str(root / entry.name), entry, sidecar) for _ in range(200)]
        try:
            assert all(r.get(i % 7) == samples[i % 7] for i, r in enumerate(readers))
        finally:
            for r in readers:
                r.close()

    @pytest.mark.parametrize("damage", ["truncated", "overwritten_head", "zeroed"])
    def test_corrupt_shard_error_names_it(self, dataset: tuple[Path, list[Sample]], damage: str) -> None:
        root, _ = dataset
        manifest = json.loads((root / "index.json").read_text())
        entry = manifest["shards"][3]
        path = root / entry["name"]
        data = path.read_bytes()
        if damage == "truncated":
            data = data[: len(data) * 2 // 3]
        elif damage == "overwritten_head":
            data = bytes([0xA5]) * 4096 + data[4096:]
        else:
            data = bytes(len(data))
        path.write_bytes(data)
        # Patch the manifest so the storage layer's size check lets the shard reach its reader.
        entry["bytes"] = len(data)
        entry["hash"] = digest(data, manifest)
        (root / "index.json").write_text(json.dumps(manifest))
        with pytest.raises(StreamloadError, match=entry["name"]) as info:
            list(StreamingDataset(str(root)))
        assert isinstance(info.value, CorruptShardError), repr(info.value)
        report = verify_dataset(str(root))
        assert [name for name, _ in report.problems] == [entry["name"]]

    def test_flipped_byte_in_a_sample_is_never_returned(self, tmp_path: Path, fmt: str) -> None:
        import random

        samples = [{"__key__": f"s{i}", "bin": random.Random(i).randbytes(3000), "cls": b"1"} for i in range(6)]
        manifest = write_dataset(tmp_path, fmt, [samples])
        path = tmp_path / manifest.shards[0].name
        data = bytearray(path.read_bytes())
        at = data.find(samples[4]["bin"])
        assert at > 0 and data.count(samples[4]["bin"]) == 1  # stored once, raw
        data[at + 1500] ^= 0x01
        path.write_bytes(bytes(data))  # same size: only the format's own checks can tell
        with pytest.raises(CorruptShardError, match=rf"{manifest.shards[0].name}.*s4") as info:
            list(StreamingDataset(str(tmp_path)))
        assert "s4" in str(info.value)
        entry = manifest.shards[0]
        sidecar = str(tmp_path / entry.sidecar.name) if entry.sidecar else None
        reader = get_format(fmt).reader(str(path), entry, sidecar)
        try:  # the other samples still read, exactly
            assert [reader.get(i) for i in (0, 1, 2, 3, 5)] == [samples[i] for i in (0, 1, 2, 3, 5)]
        finally:
            reader.close()

    def test_verify_catches_flipped_bytes_and_info_shows_format(
        self, dataset: tuple[Path, list[Sample]], fmt: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        root, _ = dataset
        assert main(["verify", str(root)]) == 0
        assert main(["info", str(root), "--json"]) == 0
        assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["format"] == fmt
        name = Manifest.loads((root / "index.json").read_bytes()).shards[4].name
        data = bytearray((root / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (root / name).write_bytes(bytes(data))
        assert main(["verify", str(root)]) == 1
        assert f"BAD  {name}" in capsys.readouterr().out


# -- format-specific guarantees ------------------------------------------------------


@pytest.mark.parametrize(
    "sizes", [[10] * 20_000, [2000, 2030, 2040, 2050, 4080, 4096, 4097] * 300, [0], [3 * 2**20 + 5] + [1] * 100]
)
def test_lmdb_never_runs_out_of_map(tmp_path: Path, sizes: list[int]) -> None:
    samples = [{"__key__": f"k{i}", "bin": bytes([i % 256]) * n} for i, n in enumerate(sizes)]
    write_dataset(tmp_path, "lmdb", [samples])
    got = list(StreamingDataset(str(tmp_path)))
    assert len(got) == len(samples) and got[-1] == samples[-1] and got[0] == samples[0]


def test_lmdb_grows_and_retries_when_the_map_is_short(tmp_path: Path) -> None:
    import lmdb

    from streamload.formats.lmdb import write_environment

    items = [(i.to_bytes(8, "big"), bytes([i]) * 5000) for i in range(50)]
    used = write_environment(str(tmp_path / "x.lmdb"), items, map_size=4 * 4096)
    assert used >= 250_000
    env = lmdb.open(str(tmp_path / "x.lmdb"), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        assert list(txn.cursor()) == items
    env.close()


def test_lmdb_shard_is_one_compact_file_readable_by_plain_lmdb(tmp_path: Path) -> None:
    import lmdb

    samples = make_samples(30)
    manifest = write_dataset(tmp_path, "lmdb", [samples])
    path = tmp_path / manifest.shards[0].name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", path.name]
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        stat, info = env.stat(), env.info()
        assert path.stat().st_size == (info["last_pgno"] + 1) * stat["psize"]  # no unused pages
        assert stat["entries"] == len(samples) + 2
        with env.begin() as txn:
            meta = json.loads(txn.get(b"__streamload__")[8:])  # after its xxh3_64
            assert meta["num_samples"] == 30 and meta["fields"] == ["bin", "cls", "json", "txt"]
            assert txn.get((5).to_bytes(8, "big")).count(samples[5]["bin"]) == 1
    finally:
        env.close()


def test_hdf5_layout_is_flat_uint8_with_int64_offsets(tmp_path: Path) -> None:
    import h5py
    import numpy as np

    samples = make_samples(30)
    manifest = write_dataset(tmp_path, "hdf5", [samples])
    with h5py.File(tmp_path / manifest.shards[0].name, "r") as f:
        fields = json.loads(f.attrs["streamload"])["fields"]
        j = fields.index("bin")
        data, offsets = f[f"fields/{j}/data"], f[f"fields/{j}/offsets"]
        assert data.dtype == np.uint8 and data.ndim == 1 and data.chunks is None
        assert offsets.dtype == np.int64 and offsets.shape == (31,)
        assert h5py.check_vlen_dtype(data.dtype) is None
        assert data[offsets[7] : offsets[8]].tobytes() == samples[7]["bin"]
        txt = fields.index("txt")
        assert f[f"fields/{txt}/present"][()].tolist() == [int("txt" in s) for s in samples]
        keys = f["keys/data"][()].tobytes().decode()
        assert keys == "".join(s["__key__"] for s in samples)


def test_hdf5_chunked_compressed_layout_reads_through_h5py(tmp_path: Path) -> None:
    """A shard with our layout written by another tool, chunked and gzip-compressed."""
    import h5py
    import numpy as np
    import xxhash

    from streamload.manifest import ShardEntry

    samples = make_samples(12)
    names = sorted({f for s in samples for f in s if f != "__key__"})
    path = tmp_path / "foreign.h5"

    tables_hash = xxhash.xxh3_64()

    def column(group: h5py.Group, values: list[bytes | None], presence: bool) -> None:
        data = b"".join(v for v in values if v is not None)
        tables = {"offsets": np.cumsum([0] + [len(v or b"") for v in values]).astype("<i8")}
        if presence:
            tables["present"] = np.array([v is not None for v in values], np.uint8)
        tables["xxh3"] = np.array([0 if v is None else xxhash.xxh3_64_intdigest(v) for v in values], "<u8")
        group.create_dataset("data", data=np.frombuffer(data, np.uint8), chunks=True, compression="gzip")
        for name, table in tables.items():
            group.create_dataset(name, data=table)
            tables_hash.update(table.tobytes())

    with h5py.File(path, "w") as f:
        column(f.create_group("keys"), [s["__key__"].encode() for s in samples], presence=False)
        for j, name in enumerate(names):
            column(f.create_group(f"fields/{j}"), [s.get(name) for s in samples], presence=True)
        meta = json.dumps(
            {
                "format": "streamload-hdf5",
                "version": 1,
                "num_samples": 12,
                "fields": names,
                "tables_xxh3": f"{tables_hash.intdigest():016x}",
            }
        )
        f.attrs["streamload"] = meta
        f.attrs["streamload_xxh3"] = f"{xxhash.xxh3_64_intdigest(meta.encode()):016x}"
    entry = ShardEntry(name="foreign.h5", num_bytes=path.stat().st_size, num_samples=12)
    reader = get_format("hdf5").reader(str(path), entry)
    try:
        assert list(reader.iter_range(0, 12)) == samples
    finally:
        reader.close()


@pytest.mark.parametrize("damage", ["root_page", "child_page", "overflow_pages"])
def test_lmdb_damaged_btree_is_refused_before_lmdb_reads_it(tmp_path: Path, damage: str) -> None:
    """Page numbers LMDB would follow blindly (and crash on) are checked first."""
    import struct

    samples = [{"__key__": f"k{i:05d}", "bin": bytes([i % 251]) * (40 if i % 50 else 9000)} for i in range(3000)]
    manifest = write_dataset(tmp_path, "lmdb", [samples])
    path = tmp_path / manifest.shards[0].name
    data = bytearray(path.read_bytes())
    psize = 4096
    meta = psize + 16  # the writer's single transaction commits meta page 1
    root_at = meta + 24 + 48 + 40  # main db record: after magic/version/address/mapsize and the free db
    root = struct.unpack_from("<Q", data, root_at)[0]
    if damage == "root_page":
        struct.pack_into("<Q", data, root_at, 10**9)
    elif damage == "child_page":
        page = root * psize
        assert struct.unpack_from("<H", data, page + 10)[0] & 0x01, "3000 samples need a branch root"
        node = struct.unpack_from("<H", data, page + 16 + 2)[0]  # second node of the root
        struct.pack_into("<HH", data, page + node, 0xFFFF, 0xFFFF)
    else:  # a leaf's overflow value claims more pages than the file has
        at = next(
            p * psize for p in range(2, len(data) // psize) if struct.unpack_from("<H", data, p * psize + 10)[0] == 0x04
        )
        struct.pack_into("<I", data, at + 12, 1)  # 9000 bytes in one page
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=rf"{path.name}.*LMDB structure is damaged"):
        list(StreamingDataset(str(tmp_path)))


@pytest.mark.parametrize("damage", ["data", "field_name", "field_size"])
def test_lmdb_batch_reads_check_every_record_like_sample_reads(tmp_path: Path, damage: str) -> None:
    """The one-lookup batch path reports a damaged record (data or header) as the per-sample path does."""
    import random

    import numpy as np

    from streamload.batch import RawCollate

    samples: list[Sample] = [
        {"__key__": f"s{i}", "bin": random.Random(i).randbytes(3000), "cls": str(i).encode()} for i in range(6)
    ]
    manifest = write_dataset(tmp_path, "lmdb", [samples])
    entry = manifest.shards[0]
    path = tmp_path / entry.name
    data = bytearray(path.read_bytes())
    at = data.find(samples[4]["bin"])
    assert at > 0 and data.count(samples[4]["bin"]) == 1
    # record: sum, head, table (name_len u32, size u64) x 2, key "s4", names "bin" "cls", data
    offset = {"data": at + 1500, "field_name": at - 6, "field_size": at - 6 - 2 - 24 + 4}[damage]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))

    collate = RawCollate(field="bin", label_field="cls", keys=True)
    reader = get_format("lmdb").reader(str(path), entry, None)
    try:
        with pytest.raises(CorruptShardError, match=rf"{entry.name}.*'s4'"):
            reader.get(4)
        with pytest.raises(CorruptShardError, match=rf"{entry.name}.*'s4'"):
            collate.read_batch(lambda _: reader, [(0, np.array([5, 4, 0]))])
        with pytest.raises(CorruptShardError, match=rf"{entry.name}.*'s4'"):
            reader.field_sizes(np.array([4]), ("bin",)) if damage != "data" else reader.read_groups_into(
                np.array([4]), [(("bin",), np.zeros(3000, dtype=np.uint8), np.array([3000]))]
            )
        good = np.array([5, 0, 3, 3, 1])  # the other records still read, in one batch, exactly
        batch = collate.read_batch(lambda _: reader, [(0, good)])
        assert [batch.tobytes(k) for k in range(len(good))] == [reader.get(i)["bin"] for i in good.tolist()]
        assert batch.labels is not None and batch.labels.tolist() == good.tolist()
        assert batch.keys == tuple(f"s{i}" for i in good.tolist())
    finally:
        reader.close()
    with pytest.raises(CorruptShardError, match=rf"{entry.name}.*s4"):
        list(StreamingDataset(str(tmp_path), batch_size=4, collate=RawCollate(field="bin", label_field="cls")))


def test_lmdb_batch_from_a_cold_page_cache_asks_for_its_bytes_and_reads_them_exactly(tmp_path: Path) -> None:
    """A contiguous batch not in the page cache is asked for in large reads (a hint only)."""
    import os
    import random

    import numpy as np

    from streamload.batch import RawCollate
    from streamload.formats import lmdb as lmdb_format
    from streamload.formats._lmdb_env import address, resident

    samples: list[Sample] = [
        {"__key__": f"s{i}", "jpg": random.Random(i).randbytes(20000), "cls": str(i % 3).encode()} for i in range(40)
    ]
    manifest = write_dataset(tmp_path, "lmdb", [samples])
    entry = manifest.shards[0]
    path = tmp_path / entry.name
    reader = lmdb_format.LmdbShardReader(str(path), entry, None)
    asked: list[int] = []
    evicted = False
    try:
        reader.get(0)  # opens the environment
        shared = reader._env
        assert shared is not None
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # clean pages, so the kernel drops them
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        evicted = shared.base is not None and not resident(shared.base + shared.size // 2, 4096)
        prefetch = shared.prefetch

        def counted(first: Any, last: Any) -> None:
            asked.append(1)
            prefetch(first, last)

        shared.prefetch = counted  # type: ignore[method-assign]
        batch = RawCollate().read_batch(lambda _: reader, [(0, np.arange(3, 35))])
        assert [batch.tobytes(k) for k in range(32)] == [s["jpg"] for s in samples[3:35]]
        assert batch.labels is not None and batch.labels.tolist() == [i % 3 for i in range(3, 35)]
        value = reader._transaction().get(b"\0" * 7 + b"\x05")
        assert resident(address(value), len(value))  # just read: in the cache
    finally:
        reader.close()
    if evicted:  # (tmpfs, say, keeps its pages: then there is nothing to ask for)
        assert asked


def _open_shard(root: Path, fmt: str, index: int) -> tuple[ShardEntry, ShardReader]:
    """Open shard ``index`` of the dataset at ``root`` with its format's reader."""
    entry = Manifest.loads((root / "index.json").read_bytes()).shards[index]
    sidecar = str(root / entry.sidecar.name) if entry.sidecar else None
    return entry, get_format(fmt).reader(str(root / entry.name), entry, sidecar)
