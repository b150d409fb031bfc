"""A batch's read and its decode in one release of the GIL: the kernel's job as the read's continuation.

``_jpegbatch.prepare`` makes a job (headers, crop draws, decode over one buffer) that
``pread_gather(..., then=job.then)`` runs right after the batch's reads. The reference is the
kernel's separate calls (``headers``, the draws, ``decode``: ``native._decode``), which the
other kernel tests hold against the per-sample path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamload import CorruptShardError, StreamingDataset
from streamload._pread import available as pread_available
from streamload._pread import pread_gather
from streamload.decode import DecodeBatch, native
from tests.helpers.jpegs import corpus as _corpus
from tests.helpers.jpegs import mutants as _mutants
from tests.helpers.jpegs import photo as _photo

pytestmark = pytest.mark.skipif(
    not native.available() or not hasattr(native.kernel(), "prepare") or native._draws_module() is None,
    reason="the native kernel is not built here",
)


def _job(batch: DecodeBatch, data: np.ndarray, offsets: np.ndarray, places: np.ndarray) -> tuple[Any, Any]:
    fused = native._Fused.make(batch, places, len(offsets) - 1)
    assert fused is not None
    return fused, fused.then(data, offsets)


def _packed(datas: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(datas) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in datas], out=offsets[1:])
    return np.frombuffer(b"".join(datas), dtype=np.uint8).copy(), offsets


def _separate(batch: DecodeBatch, datas: list[bytes], places: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """The kernel's separate calls over the same bytes: slots and outcomes."""
    slots = np.zeros((len(datas), *batch.decoder.shape), dtype=np.uint8)
    seed = batch.seed or 0

    def generator(i: int) -> np.random.Generator:
        from streamload.randomness import place_generator

        return place_generator(int(places[i, 0]), int(places[i, 1]), seed)

    outcomes = native._decode(batch, generator, datas, slots, places)
    return slots, outcomes


@pytest.mark.parametrize(
    "config",
    [
        {"size": 96, "crop": "random", "flip": True},
        {"size": (48, 80), "crop": "center", "resize": 100, "flip": True},
        {"size": 64, "crop": "random", "flip": False, "scale": (0.5, 1.0)},
    ],
    ids=["random", "center", "no-flip"],
)
def test_the_job_decodes_as_the_separate_calls(config: dict[str, Any]) -> None:
    datas = _corpus()[:24]
    rng = np.random.default_rng(4)
    datas.insert(5, b"not a jpeg at all")  # not taken: left to the per-sample path
    datas.insert(9, datas[3][: len(datas[3]) // 2])  # truncated: refused (Pillow decodes it per sample)
    places = np.stack([np.full(len(datas), 3), rng.integers(0, 1 << 33, len(datas))], axis=1).astype(np.int64)
    batch = DecodeBatch(native=True, seed=11, **config)
    data, offsets = _packed(datas)
    fused, _then = _job(batch, data, offsets, places)
    outcomes, seconds = fused.job.finish()  # run here: no read took it
    want_slots, want = _separate(batch, datas, places)
    got = native._outcomes(fused.taken, fused.full, fused.params, outcomes)
    assert [type(o) for o in got] == [type(o) for o in want]
    assert got == want and seconds > 0
    assert got[5] is None and isinstance(got[9], native.Refusal)
    done = [i for i, o in enumerate(got) if o is native.DONE]
    assert len(done) >= 20
    assert np.array_equal(fused.slots[done], want_slots[done])


def test_a_read_runs_the_job_in_its_call_after_the_bytes_are_in(tmp_path: Path) -> None:
    datas = _corpus()[:12]
    path = tmp_path / "blob"
    path.write_bytes(b"".join(datas))
    sizes = np.array([len(d) for d in datas], dtype=np.int64)
    at = np.zeros(len(datas), dtype=np.int64)
    np.cumsum(sizes[:-1], out=at[1:])
    data = np.zeros(int(sizes.sum()), dtype=np.uint8)
    offsets = np.append(at, sizes.sum()).astype(np.int64)
    places = np.stack([np.zeros(len(datas)), np.arange(len(datas))], axis=1).astype(np.int64)
    batch = DecodeBatch(80, crop="random", flip=True, native=True, seed=2)
    fused, then = _job(batch, data, offsets, places)
    fd = os.open(path, os.O_RDONLY)
    try:
        order = np.random.default_rng(0).permutation(len(datas))  # any order: read in file order
        got = pread_gather(fd, at[order], sizes[order], [data], np.zeros(len(datas), np.int32), at[order], then=then)
    finally:
        os.close(fd)
    assert got is not None and np.array_equal(got, sizes[order])
    outcomes, _ = fused.job.finish()
    assert all(o is None for o in outcomes)  # the job ran on the bytes the read put there
    want_slots, want = _separate(batch, datas, places)
    assert native._outcomes(fused.taken, fused.full, fused.params, outcomes) == want
    assert np.array_equal(fused.slots, want_slots)
    with pytest.raises(RuntimeError, match="finished"):
        fused.job.finish()


@pytest.mark.skipif(not pread_available(), reason="the _gather extension is not built here")
def test_a_continuation_must_be_one_and_runs_once_even_for_no_reads(tmp_path: Path) -> None:
    batch = DecodeBatch(32, native=True)
    data, offsets = _packed([])
    fused, then = _job(batch, data, offsets, np.zeros((0, 2), dtype=np.int64))
    path = tmp_path / "empty"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        empty = np.zeros(0, dtype=np.int64)
        with pytest.raises((TypeError, ValueError)):
            pread_gather(fd, empty, empty, [data], np.zeros(0, np.int32), empty, then=object())
        pread_gather(fd, empty, empty, [data], np.zeros(0, np.int32), empty, then=then)
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match="has run"):
        fused.job.then  # noqa: B018 - a job runs once
    reasons, seconds = fused.job.finish()
    assert reasons == [] and seconds >= 0


def test_bad_offsets_and_sizes_are_refused_before_anything_runs() -> None:
    module = native.kernel()
    batch = DecodeBatch(32, native=True)
    data, offsets = _packed([b"\xff\xd8abc", b"\xff\xd8de"])
    places = np.zeros((2, 2), dtype=np.int64)
    for bad_offsets in (np.array([0, 9, 4], dtype=np.int64), np.array([0, 3, 99], dtype=np.int64)):
        fused = native._Fused.make(batch, places, 2)
        assert fused is not None
        with pytest.raises(ValueError, match="does not lie inside data"):
            fused.then(data, bad_offsets)
    fused = native._Fused.make(batch, places, 2)
    assert fused is not None
    with pytest.raises(ValueError, match="where"):
        module.prepare(  # type: ignore[union-attr]
            data,
            offsets,
            native._prefix(0),
            np.zeros((3, 2), dtype=np.int64),
            native._geometry(batch.decoder),
            -1,
            fused.dims,
            fused.boxes,
            fused.full,
            fused.params,
            fused.taken,
            fused.slots,
            32,
            32,
            False,
        )


def test_fuzzed_jpegs_through_the_job_never_crash() -> None:
    rng = np.random.default_rng(9)
    seeds = [_photo(rng, 61, 45, subsampling=2), _photo(rng, 70, 50, mode="L"), _photo(rng, 90, 64, progressive=True)]
    mutants = _mutants(seeds, 1500, rng)
    batch = DecodeBatch(24, crop="random", flip=True, seed=1, native=True)
    decoded = refused = 0
    for start in range(0, len(mutants), 100):
        part = mutants[start : start + 100]
        data, offsets = _packed(part)
        guard = np.concatenate([data, np.full(64, 0x5A, dtype=np.uint8)])  # bytes past the last sample
        places = np.stack([np.zeros(len(part)), np.arange(start, start + len(part))], axis=1).astype(np.int64)
        fused, _then = _job(batch, guard, offsets, places)
        reasons, _ = fused.job.finish()
        got = native._outcomes(fused.taken, fused.full, fused.params, reasons)
        decoded += sum(o is native.DONE for o in got)
        refused += sum(isinstance(o, native.Refusal) for o in got)
        _, want = _separate(batch, part, places)
        assert [type(o) for o in got] == [type(o) for o in want]
    assert decoded > 100 and refused > 100


def test_a_damaged_member_is_named_and_nothing_of_the_batch_is_kept(tmp_path: Path) -> None:
    from streamload.converters import ConvertOptions, ImageFolderSource, convert
    from streamload.synthetic import make_image_folder

    make_image_folder(str(tmp_path / "src"), num_classes=2, per_class=12, size=(64, 48), seed=3)
    convert(ImageFolderSource(str(tmp_path / "src")), str(tmp_path / "ds"), ConvertOptions(samples_per_shard=12))
    shard = sorted((tmp_path / "ds").glob("*.tar"))[1]
    raw = bytearray(shard.read_bytes())
    first = raw.index(b"\xff\xd8\xff", 1024)  # inside the first JPEG member
    raw[first + 300] ^= 0x10
    shard.write_bytes(bytes(raw))
    ds = StreamingDataset(
        str(tmp_path / "ds"), batch_size=8, shuffle=True, seed=0, collate=DecodeBatch(32, native=True)
    )
    with pytest.raises(CorruptShardError, match=rf"shard {shard.name}, sample '[^']+', field 'jpg' is truncated"):
        list(ds)
