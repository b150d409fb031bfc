"""`streamload._pread`: a batch's positioned reads in one call, and the tar reader's batch reads through it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from streamload import CorruptShardError, _pread
from streamload._pread import available, hashes, pread_gather
from streamload.formats import tar as tar_format
from streamload.formats.tar import TarShardReader
from streamload.manifest import Manifest

pytestmark = pytest.mark.skipif(not available(), reason="the _gather extension is not built here")


def _file(tmp_path: Path, size: int = 1 << 16) -> tuple[Path, bytes]:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    return path, data


def test_many_entries_into_several_buffers_are_the_files_bytes(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    rng = np.random.default_rng(1)
    n = 3000
    lengths = rng.integers(0, 300, n)
    offsets = rng.integers(0, len(data) - 300, n)
    which = rng.integers(0, 2, n).astype(np.int32)
    at = np.zeros(n, dtype=np.int64)
    totals = [0, 0]
    for i in range(n):  # back to back in each buffer, in entry order
        at[i] = totals[which[i]]
        totals[which[i]] += int(lengths[i])
    outs = [np.zeros(totals[0], dtype=np.uint8), bytearray(totals[1])]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = pread_gather(fd, offsets, lengths, outs, which, at)
    finally:
        os.close(fd)
    assert got is not None and got.tolist() == lengths.tolist()
    for i in range(n):
        a, k = int(at[i]), int(lengths[i])
        assert bytes(memoryview(outs[which[i]])[a : a + k]) == data[offsets[i] : offsets[i] + k]


def test_a_read_past_the_end_comes_back_short_and_a_bad_fd_gives_its_errno(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 1000)
    out = np.zeros(300, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = pread_gather(
            fd, np.array([900, 1000, 0]), np.array([100, 50, 100]), [out], np.zeros(3), np.array([0, 100, 150])
        )
    finally:
        os.close(fd)
    assert got is not None and got.tolist() == [100, 0, 100]
    assert out[:100].tobytes() == data[900:] and out[150:250].tobytes() == data[:100]
    bad = pread_gather(fd, np.array([0]), np.array([10]), [out], np.zeros(1), np.zeros(1))  # closed above
    assert bad is not None and bad.tolist() == [-errno.EBADF]


def test_a_destination_outside_its_buffer_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, 1000)
    out = np.zeros(100, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offsets, lengths, which, at in [
            ([0, 0], [10, 60], [0, 0], [0, 50]),  # the second runs 10 bytes past the end
            ([0], [10], [1], [0]),  # no buffer 1
            ([0], [-1], [0], [0]),
            ([-5], [10], [0], [0]),
            ([0], [10], [0], [-1]),
        ]:
            with pytest.raises(ValueError, match="do not fit"):
                pread_gather(fd, np.array(offsets), np.array(lengths), [out], np.array(which), np.array(at))
            assert not out.any()
        with pytest.raises(BufferError):
            pread_gather(fd, np.array([0]), np.array([1]), [b"read-only"], np.zeros(1), np.zeros(1))
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def tar_shard(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from streamload.formats import get_format
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    root = tmp_path_factory.mktemp("gather-tar")
    rng = np.random.default_rng(2)
    fmt, dest = get_format("tar"), LocalDestination(str(root))
    samples = (
        {"__key__": f"k{i}", "jpg": rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes(),
         "cls": str(i % 7).encode(), "txt": b"x" * (i % 5)}
        for i in range(200)
    )  # fmt: skip
    entry = write_shard(fmt, dest, fmt.shard_name(0), samples).entry
    publish_manifest(dest, Manifest(format="tar", shards=(entry,), fields=("cls", "jpg", "txt")))
    return root / entry.name, entry


def _read(reader: TarShardReader, indices: np.ndarray) -> tuple[bytes, bytes]:
    jpg_sizes = reader.field_sizes(indices, ("jpg",))
    cls_sizes = reader.field_sizes(indices, ("cls",))
    jpg, cls = np.zeros(int(jpg_sizes.sum()), np.uint8), np.zeros(int(cls_sizes.sum()), np.uint8)
    reader.read_groups_into(indices, [(("jpg",), jpg, jpg_sizes), (("cls",), cls, cls_sizes)])
    return jpg.tobytes(), cls.tobytes()


def test_the_tar_readers_batch_read_is_the_python_paths(
    tar_shard: tuple[Path, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, entry = tar_shard
    reader = TarShardReader(str(path), entry, str(path) + ".idx")  # type: ignore[arg-type]
    try:
        for indices in (np.arange(200), np.random.default_rng(3).permutation(200)[:64], np.array([5, 5, 199, 0])):
            gathered = _read(reader, indices)
            want = (
                b"".join(reader.get(int(i))["jpg"] for i in indices),
                b"".join(reader.get(int(i))["cls"] for i in indices),
            )
            assert gathered == want
            with monkeypatch.context() as patch:  # the Python path (preadv of runs), as where it is not built
                patch.setattr(tar_format, "available", lambda: False)
                assert _read(reader, indices) == want
    finally:
        reader.close()


def _copied_reader(path: Path, entry: object, folder: Path) -> tuple[Path, TarShardReader]:
    """A copy of the shard and its sidecar in ``folder`` (to damage), and a reader of the copy."""
    copy = folder / path.name
    copy.write_bytes(path.read_bytes())
    (folder / (path.name + ".idx")).write_bytes(Path(str(path) + ".idx").read_bytes())
    return copy, TarShardReader(str(copy), entry, str(copy) + ".idx")  # type: ignore[arg-type]


def test_a_shard_cut_short_under_an_open_reader_is_named_truncated(
    tar_shard: tuple[Path, object], tmp_path: Path
) -> None:
    path, entry = tar_shard
    copy, reader = _copied_reader(path, entry, tmp_path)
    try:
        os.truncate(copy, copy.stat().st_size // 2)
        with pytest.raises(CorruptShardError, match=r"shard-000000\.tar is truncated at byte"):
            _read(reader, np.arange(200))
        _read(reader, np.arange(10))  # what is still there reads
    finally:
        reader.close()


@pytest.mark.skipif(not hashes(), reason="the system's xxHash (libxxhash.so.0) is not here")
def test_the_sums_are_python_xxhashs_xxh3_64(tmp_path: Path) -> None:
    import xxhash

    path, data = _file(tmp_path)
    rng = np.random.default_rng(4)
    n = 500
    lengths = rng.integers(0, 3000, n)
    offsets = rng.integers(0, len(data) - 3000, n)
    at = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    sums = np.zeros(n, dtype=np.uint64)
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_gather(fd, offsets, lengths, [out], np.zeros(n), at, sums)
    finally:
        os.close(fd)
    assert sums.tolist() == [xxhash.xxh3_64_intdigest(data[a : a + k]) for a, k in zip(offsets, lengths, strict=True)]


@pytest.mark.parametrize("hashing", [True, False], ids=["sums-in-the-call", "sums-in-python"])
def test_a_flipped_byte_is_named_by_sample_and_field(
    tar_shard: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashing: bool
) -> None:
    path, entry = tar_shard
    copy, reader = _copied_reader(path, entry, tmp_path)
    try:
        if not hashing:
            monkeypatch.setattr(_pread, "hashes", lambda: False)
        elif not hashes():
            pytest.skip("the system's xxHash (libxxhash.so.0) is not here")
        member = reader._members_of(("jpg",))[37]
        at = int(np.frombuffer(reader._offset, dtype=np.uint64)[member]) + 3
        with open(copy, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(CorruptShardError, match=r"sample 'k37', field 'jpg' is truncated or does not match"):
            _read(reader, np.random.default_rng(5).permutation(np.arange(30, 60)))
    finally:
        reader.close()


@pytest.mark.parametrize("gathered", [True, False], ids=["pread_gather", "preadv"])
def test_read_groups_at_puts_each_sample_in_its_place(
    tar_shard: tuple[Path, object], monkeypatch: pytest.MonkeyPatch, gathered: bool
) -> None:
    # What a shuffled batch needs: a shard's samples to places spread over the batch's buffer, no copy after.
    path, entry = tar_shard
    if not gathered:
        monkeypatch.setattr(tar_format, "available", lambda: False)
    reader = TarShardReader(str(path), entry, str(path) + ".idx")  # type: ignore[arg-type]
    try:
        indices = np.random.default_rng(6).permutation(200)[:50]
        sizes = reader.field_sizes(indices, ("jpg",))
        gaps = np.random.default_rng(7).integers(0, 40, len(indices))
        at = np.cumsum(np.concatenate([[0], sizes[:-1] + gaps[:-1]]))[np.random.default_rng(8).permutation(50)]
        order = np.argsort(at)  # places in the buffer in another order than the samples'
        at_sorted = np.zeros(len(at), dtype=np.int64)
        at_sorted[order] = np.cumsum(np.concatenate([[0], (sizes[order] + gaps[order])[:-1]]))
        out = np.zeros(int((sizes + gaps).sum()), dtype=np.uint8)
        cls_sizes = reader.field_sizes(indices, ("cls",))
        cls = np.zeros(int(cls_sizes.sum()) + 10, dtype=np.uint8)
        cls_at = np.concatenate([[0], np.cumsum(cls_sizes)[:-1]]) + 10
        reader.read_groups_at(indices, [(("jpg",), out, sizes, at_sorted), (("cls",), cls, cls_sizes, cls_at)])
        for k, i in enumerate(indices.tolist()):
            sample = reader.get(i)
            a = int(at_sorted[k])
            assert out[a : a + int(sizes[k])].tobytes() == sample["jpg"]
            assert cls[int(cls_at[k]) : int(cls_at[k]) + int(cls_sizes[k])].tobytes() == sample["cls"]
        with pytest.raises(ValueError, match="outside its buffer"):
            reader.read_groups_at(indices[:1], [(("jpg",), out, sizes[:1], np.array([out.nbytes - 1]))])
    finally:
        reader.close()


def test_one_call_reads_many_files_with_a_descriptor_an_entry(tmp_path: Path) -> None:
    # A batch over several shards: each entry names its own file, the entries in any order.
    datas = [np.random.default_rng(10 + k).integers(0, 256, 5000 + k, dtype=np.uint8).tobytes() for k in range(3)]
    paths = []
    for k, data in enumerate(datas):
        paths.append(tmp_path / f"f{k}")
        paths[-1].write_bytes(data)
    rng = np.random.default_rng(11)
    n = 400
    files = rng.integers(0, 3, n)
    lengths = rng.integers(0, 200, n)
    offsets = np.array([int(rng.integers(0, len(datas[f]) - 200)) for f in files])
    at = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        for cached_first in (True, False):
            out = np.zeros(int(lengths.sum()), dtype=np.uint8)
            got = pread_gather(
                np.array([fds[f] for f in files], dtype=np.int32), offsets, lengths, [out], np.zeros(n), at,
                cached_first=cached_first,
            )  # fmt: skip
            assert got is not None and got.tolist() == lengths.tolist()
            for f, o, a, k in zip(files.tolist(), offsets.tolist(), at.tolist(), lengths.tolist(), strict=True):
                assert out[a : a + k].tobytes() == datas[f][o : o + k]
    finally:
        for fd in fds:
            os.close(fd)


def test_what_the_page_cache_does_not_hold_is_read_as_well(tmp_path: Path) -> None:
    # Read what is cached first (RWF_NOWAIT, holding the GIL), then the rest: a file just
    # dropped from the page cache still reads whole, checksums included.
    import xxhash

    path, data = _file(tmp_path, 1 << 22)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (a hint: the kernel may keep some pages)
        lengths = np.full(64, 50_000)
        offsets = np.arange(64) * 60_000
        at = np.arange(64) * 50_000
        out = np.zeros(64 * 50_000, dtype=np.uint8)
        sums = np.zeros(64, dtype=np.uint64) if hashes() else None
        got = pread_gather(fd, offsets, lengths, [out], np.zeros(64), at, sums)
    finally:
        os.close(fd)
    assert got is not None and got.tolist() == lengths.tolist()
    for o, a in zip(offsets.tolist(), at.tolist(), strict=True):
        assert out[a : a + 50_000].tobytes() == data[o : o + 50_000]
    if sums is not None:
        assert sums.tolist() == [xxhash.xxh3_64_intdigest(data[o : o + 50_000]) for o in offsets.tolist()]


@pytest.fixture(scope="module")
def three_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from streamload.formats import get_format
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    root = tmp_path_factory.mktemp("gather-three")
    rng = np.random.default_rng(12)
    fmt, dest = get_format("tar"), LocalDestination(str(root))
    entries = []
    for s in range(3):
        samples = (
            {"__key__": f"s{s}-{i}", "jpg": rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes(),
             "cls": str((s * 40 + i) % 9).encode()}
            for i in range(40)
        )  # fmt: skip
        entries.append(write_shard(fmt, dest, fmt.shard_name(s), samples).entry)
    publish_manifest(dest, Manifest(format="tar", shards=tuple(entries), fields=("cls", "jpg")))
    return root


#: A shuffled batch's reads: samples of the three shards interleaved, a shard met several times.
_PARTS = [(2, [5, 1]), (0, [7]), (1, [3, 39, 0]), (0, [2, 30]), (2, [22]), (1, [8])]


def _read_batch(root: Path, capacity: int = 8) -> object:
    from streamload.batch import RawCollate
    from streamload.dataref import DatasetRef
    from streamload.shards import ShardSource

    ref = DatasetRef.open(str(root))
    with ShardSource(ref, ref.open_storage(), capacity, own_storage=True) as source:
        parts = [(s, np.array(idx)) for s, idx in _PARTS]
        return RawCollate(keys=True).read_batch(source.get, parts)


def test_a_batch_over_three_shards_is_one_read_call(three_shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload.batch import RawCollate
    from streamload.dataref import DatasetRef
    from streamload.shards import ShardSource

    calls: list[int] = []
    real = _pread.pread_gather

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(len(args[1]))  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_pread, "pread_gather", counted)
    batch = _read_batch(three_shards)
    # each shard opened reads its first and last tar headers in one call; the batch is one more
    assert sorted(calls) == [2, 2, 2, 2 * sum(len(idx) for _, idx in _PARTS)]
    ref = DatasetRef.open(str(three_shards))
    with ShardSource(ref, ref.open_storage(), own_storage=True) as source:
        samples = [source.get(s).get(i) for s, idx in _PARTS for i in idx]
        want = RawCollate(keys=True)(samples)
    assert [bytes(x) for x in batch.samples()] == [bytes(x) for x in want.samples()]  # type: ignore[attr-defined]
    assert batch.labels.tolist() == want.labels.tolist()  # type: ignore[attr-defined, union-attr]
    assert batch.keys == want.keys  # type: ignore[attr-defined]


def test_a_batch_over_more_shards_than_the_reader_cache_keeps_open_reads_right(
    three_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Opening the third shard's reader closes the first's (capacity 2): its descriptor may
    # name another file by then, so the batch is read a shard at a time, reopening as needed.
    calls: list[int] = []
    real = _pread.pread_gather

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    want = _read_batch(three_shards)
    monkeypatch.setattr(_pread, "pread_gather", counted)
    got = _read_batch(three_shards, capacity=2)
    assert len(calls) > 1  # not one call: a shard at a time
    assert [bytes(x) for x in got.samples()] == [bytes(x) for x in want.samples()]  # type: ignore[attr-defined]
    assert got.labels.tolist() == want.labels.tolist()  # type: ignore[attr-defined]
    assert got.keys == want.keys  # type: ignore[attr-defined]


def _damage(root: Path, tmp_path: Path, flip: dict[int, str], cut: set[int]) -> Path:
    """A copy of ``root`` with one byte of the named samples' jpg flipped and the shards in ``cut`` cut short."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    for s, key in flip.items():
        shard = copy / f"shard-{s:06d}.tar"
        reader = TarShardReader(str(shard), _entry(copy, s), str(shard) + ".idx")  # type: ignore[arg-type]
        try:
            keys = reader.keys_of(np.arange(40))
            member = reader._members_of(("jpg",))[keys.index(key)]
            at = int(np.frombuffer(reader._offset, dtype=np.uint64)[member])
        finally:
            reader.close()
        with open(shard, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x01]))
    for s in cut:
        shard = copy / f"shard-{s:06d}.tar"
        os.truncate(shard, shard.stat().st_size // 3)
    return copy


def _entry(root: Path, shard: int) -> object:
    from streamload.dataref import DatasetRef

    return DatasetRef.open(str(root)).manifest.shards[shard]


@pytest.mark.parametrize("hashing", [True, False], ids=["sums-in-the-call", "sums-in-python"])
def test_damage_in_a_batchs_later_shard_is_named_and_the_first_bad_shard_comes_first(
    three_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashing: bool
) -> None:
    if not hashing:
        monkeypatch.setattr(_pread, "hashes", lambda: False)
    elif not hashes():
        pytest.skip("the system's xxHash (libxxhash.so.0) is not here")
    flipped = _damage(three_shards, tmp_path / "a", {1: "s1-39"}, set())
    with pytest.raises(CorruptShardError, match=r"shard-000001\.tar, sample 's1-39', field 'jpg'"):
        _read_batch(flipped)
    # shard 2 comes first in the batch: its damage is named, not shard 1's
    both = _damage(three_shards, tmp_path / "b", {2: "s2-1", 1: "s1-3"}, set())
    with pytest.raises(CorruptShardError, match=r"shard-000002\.tar, sample 's2-1'"):
        _read_batch(both)


def test_a_read_over_the_cached_limit_reads_whole(tmp_path: Path) -> None:
    # Past 16 MiB a call reads everything with the GIL released (no cached pass first): the
    # same bytes, with and without cached_first.
    path, data = _file(tmp_path, 40 << 20)
    n, size = 32, 1 << 20
    lengths, offsets, at = np.full(n, size), np.arange(n) * size + 11, np.arange(n)[::-1] * size
    fd = os.open(path, os.O_RDONLY)
    try:
        for cached_first in (True, False):
            out = np.zeros(n * size, dtype=np.uint8)
            got = pread_gather(fd, offsets, lengths, [out], np.zeros(n), at, cached_first=cached_first)
            assert got is not None and got.tolist() == lengths.tolist()
            for o, a in zip(offsets.tolist(), at.tolist(), strict=True):
                assert out[a : a + size].tobytes() == data[o : o + size]
    finally:
        os.close(fd)


def test_random_batches_over_many_files_read_what_the_files_hold(tmp_path: Path) -> None:
    # Fuzzed calls: several files (one empty, one closed), entries past their end, zero-length
    # ones, in any order, cached first or not; every entry comes back as Python's own read of
    # it says (bytes, a short count at the end, -EBADF for the closed one), nothing else written.
    rng = np.random.default_rng(21)
    datas = [b"", *(rng.integers(0, 256, int(rng.integers(1, 20_000)), dtype=np.uint8).tobytes() for _ in range(4))]
    fds = []
    for k, data in enumerate(datas):
        (tmp_path / f"f{k}").write_bytes(data)
        fds.append(os.open(tmp_path / f"f{k}", os.O_RDONLY))
    closed = os.open(tmp_path / "f1", os.O_RDONLY)
    os.close(closed)
    try:
        for case in range(2000):
            n = int(rng.integers(0, 40))
            files = rng.integers(0, len(datas) + 1, n)  # len(datas): the closed descriptor
            lengths = rng.integers(0, 3000, n)
            offsets = rng.integers(0, 25_000, n)
            at = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
            out = np.full(int(lengths.sum()) + 16, 0xAB, dtype=np.uint8)
            fd_of = np.array([fds[f] if f < len(datas) else closed for f in files], dtype=np.int32)
            got = pread_gather(fd_of, offsets, lengths, [out], np.zeros(n), at, cached_first=bool(case % 2))
            assert got is not None and len(got) == n
            for i in range(n):
                if files[i] == len(datas):  # (an empty entry needs no read)
                    assert got[i] == (-errno.EBADF if lengths[i] else 0)
                    continue
                want = datas[files[i]][offsets[i] : offsets[i] + lengths[i]]
                assert got[i] == len(want)
                assert out[at[i] : at[i] + len(want)].tobytes() == want
            assert out[int(lengths.sum()) :].tolist() == [0xAB] * 16  # nothing past the last entry
    finally:
        for fd in fds:
            os.close(fd)
