"""Zero-copy batches: RawCollate/RawBatch through the DataLoader, and the recycled segments."""

from __future__ import annotations

import gc
import io
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from streamload import CorruptShardError, SampleError, StreamingDataset
from streamload._batchmem import BufferPool, pack, unpack
from streamload.ahead import group_runs
from streamload.batch import RawBatch, RawCollate
from streamload.decode import IMAGE_FIELDS
from streamload.plan import Run
from tests.helpers.memory import in_shared_memory


def _per_sample(root: Path) -> dict[str, tuple[bytes, int]]:
    """The reference: the plain per-sample path, image bytes and label by key."""
    out = {}
    for sample in StreamingDataset(str(root)):
        field = next(f for f in IMAGE_FIELDS if f in sample)
        out[sample["__key__"]] = (sample[field], int(sample["cls"]))
    return out


def _unpack(batch: RawBatch) -> dict[str, tuple[bytes, int]]:
    assert batch.keys is not None and batch.labels is not None
    assert batch.data.dtype == torch.uint8 and batch.offsets.dtype == torch.int64 and batch.labels.dtype == torch.int64
    assert int(batch.offsets[0]) == 0 and int(batch.offsets[-1]) == batch.data.numel()
    return {k: (batch.tobytes(i), int(batch.labels[i])) for i, k in enumerate(batch.keys)}


@pytest.mark.parametrize("workers", [0, 2])
def test_raw_batches_round_trip_exactly_and_in_plan_order(tar_dataset: Path, workers: int) -> None:
    expected = _per_sample(tar_dataset)
    ds = StreamingDataset(str(tar_dataset), batch_size=16, collate=RawCollate(keys=True))
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    batches = list(loader)  # all held at once: more batches than a worker's recycled segments
    assert len(batches) == len(loader) == -(-len(expected) // 16)
    got: dict[str, tuple[bytes, int]] = {}
    order: list[str] = []
    for batch in batches:
        if workers:
            assert in_shared_memory(batch.data), "batch bytes must arrive through shared memory"
        unpacked = _unpack(batch)
        got.update(unpacked)
        order.extend(unpacked)
    # whole batches: padded by the fewest repeats (the first samples of the epoch again)
    assert len(order) == -(-len(expected) // 16) * 16
    assert order[len(expected) :] == order[: len(order) - len(expected)]
    assert got == expected
    # The same plan as the per-sample path batched by the DataLoader itself.
    plain = DataLoader(
        StreamingDataset(str(tar_dataset), batch_size=16),
        batch_size=16,
        num_workers=workers,
        collate_fn=lambda samples: [s["__key__"] for s in samples],
    )
    assert order == [k for keys in plain for k in keys]


def test_recycled_segments_are_not_overwritten_while_in_use(tar_dataset: Path) -> None:
    expected = _per_sample(tar_dataset)
    ds = StreamingDataset(str(tar_dataset), batch_size=8, shuffle=True, collate=RawCollate(keys=True))
    loader = DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=4)
    held: list[RawBatch] = []
    for n, batch in enumerate(loader):
        assert _unpack(batch).items() <= expected.items()
        if n % 3 == 0:
            held.append(batch)  # keep some while the workers go on recycling the others
    for batch in held:
        assert _unpack(batch).items() <= expected.items()


def test_generic_collate_path_matches_direct_read(tar_dataset: Path) -> None:
    direct = list(StreamingDataset(str(tar_dataset), batch_size=10, collate=RawCollate(keys=True)))
    generic = list(
        StreamingDataset(str(tar_dataset), batch_size=10, collate=RawCollate(keys=True), transform=lambda s: s)
    )
    assert [_unpack(b) for b in direct] == [_unpack(b) for b in generic]
    assert torch.equal(direct[0].offsets, generic[0].offsets)


def test_raw_batch_views_and_samples(tar_dataset: Path) -> None:
    batch = next(iter(StreamingDataset(str(tar_dataset), batch_size=5, collate=RawCollate(label_field=None))))
    assert batch.labels is None and batch.keys is None and len(batch) == 5
    views = batch.samples()
    assert [bytes(v.numpy()) for v in views] == [batch.tobytes(i) for i in range(5)]
    assert views[1].data_ptr() == batch.data.data_ptr() + int(batch.offsets[1])  # a view, no copy


def test_lease_released_only_when_last_view_dies() -> None:
    pool = BufferPool(slots=2)
    storage, lease = pool.take(1000)
    assert lease is not None and int(pool.flags[lease.slot]) == 1
    data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (1000,), (1,))
    data[:] = 5
    # What a worker sends and the main process rebuilds (here in one process): the first
    # message carries the segment and the flags, then only integers.
    message, specs = pack((data, None), lease)
    assert message[3] is not None and message[4] is not None
    received, nothing = unpack(message, specs)
    assert nothing is None and received is not None and bool((received == 5).all())
    view = received[10:20]
    del received
    gc.collect()
    assert int(pool.flags[lease.slot]) == 1, "a live view must keep the segment leased"
    other, other_lease = pool.take(1000)
    assert other_lease is not None and other_lease.slot != lease.slot
    del view
    gc.collect()
    assert int(pool.flags[lease.slot]) == 0
    again, again_lease = pool.take(900)
    assert again_lease == lease and again.data_ptr() == storage.data_ptr()  # recycled
    message, specs = pack((data[:900], None), again_lease)
    assert message[3] is None and message[4] is None, "a segment already sent crosses as integers"
    held = unpack(message, specs)[0]
    assert held is not None and bool((held == 5).all())
    _, spare = pool.take(10)
    assert spare is None  # every slot leased: a fresh, unpooled segment


def test_a_batch_crosses_to_workers_main_process_as_one_small_message(tar_dataset: Path) -> None:
    """Through real DataLoader workers: every batch after a segment's first use is a few integers."""
    import pickle

    ds = StreamingDataset(str(tar_dataset), batch_size=4, collate=RawCollate(keys=True))
    plain = [(_unpack(b), b.keys) for b in ds]
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    batches = list(loader)
    assert [(_unpack(b), b.keys) for b in batches] == plain
    assert all(b.offsets.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr() for b in batches)
    again = pickle.loads(pickle.dumps(batches[0]))  # noqa: S301 - our own batch; the main process pickles plain tensors on
    assert _unpack(again) == _unpack(batches[0])


def test_group_runs_cuts_at_batch_boundaries() -> None:
    runs = [
        Run(0, np.arange(0, 5), np.arange(3, 8), np.arange(3, 8)),
        Run(1, np.arange(2, 9), np.arange(8, 15), np.arange(8, 15)),
    ]
    groups = list(group_runs(iter(runs), 4))
    assert [[(r.shard, r.positions.tolist()) for r in g] for g in groups] == [
        [(0, [3])],
        [(0, [4, 5, 6, 7])],
        [(1, [8, 9, 10, 11])],
        [(1, [12, 13, 14])],
    ]


def test_collate_needs_batch_size(tar_dataset: Path) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        StreamingDataset(str(tar_dataset), collate=RawCollate())


def test_missing_field_names_sample(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), batch_size=4, collate=RawCollate(field="webp"))
    with pytest.raises(SampleError, match=r"sample '.*'.*webp"):
        next(iter(ds))


def test_corrupt_bytes_detected_on_direct_read(tar_dataset: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    shutil.copytree(tar_dataset, root)
    shard = sorted(root.glob("*.tar"))[0]
    first = next(iter(StreamingDataset(str(root))))
    blob = bytearray(shard.read_bytes())
    at = blob.find(first["jpg"][100:140])
    blob[at] ^= 0xFF
    shard.write_bytes(bytes(blob))
    ds = StreamingDataset(str(root), batch_size=4, collate=RawCollate())
    with pytest.raises(CorruptShardError, match=rf"{shard.name}.*{first['__key__']}.*jpg"):
        next(iter(ds))


def test_in_process_buffers_recycled_only_after_last_view_dies() -> None:
    from streamload.batch import batch_buffer

    first, _ = batch_buffer(1000, shared=False)
    first[:] = 7
    ptr = first.data_ptr()
    view = first[3:5]
    del first
    gc.collect()
    second, _ = batch_buffer(1000, shared=False)
    assert second.data_ptr() != ptr and int(view.sum()) == 14  # still ours while a view lives
    del view
    gc.collect()
    third, _ = batch_buffer(800, shared=False)
    assert third.data_ptr() == ptr  # recycled


def test_a_label_outside_int64_is_refused_when_written(tmp_path: Path) -> None:
    from streamload.writer import DatasetWriter

    for label in (b"9" * 30, b"-" + b"9" * 19):
        with pytest.raises(SampleError, match="'bad'.*cls"), DatasetWriter(str(tmp_path / "w"), format="tar") as w:
            w.write({"__key__": "bad", "txt": b"x", "cls": label})


def test_labels_parsed_together_equal_each_parsed_alone() -> None:
    """Batches of ``cls`` labels parse as :func:`parse_label` parses each (plain digits take a faster path)."""
    from streamload.labels import parse_labels
    from streamload.sample import parse_label

    rng = np.random.default_rng(7)
    odd = [b" 7\n", b"+3", b"-12", b"007", b"9" * 18, b"9223372036854775807", b"1_0", b"0"]
    for trial in range(300):
        n = int(rng.integers(1, 80))
        labels = [str(int(rng.integers(0, 10 ** int(rng.integers(1, 19))))).encode() for _ in range(n)]
        if trial % 2:
            labels[int(rng.integers(0, n))] = odd[trial % len(odd)]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(label) for label in labels], out=offsets[1:])
        raw = np.frombuffer(b"".join(labels), dtype=np.uint8)
        assert parse_labels(raw, offsets, str, "cls").tolist() == [parse_label(label) for label in labels]
    raw = np.frombuffer(b"12x", dtype=np.uint8)
    with pytest.raises(SampleError, match="sample '1' field 'cls'"):
        parse_labels(raw, np.array([0, 2, 3]), str, "cls")


@pytest.mark.parametrize("label", [b"12a", b"\xff"])
def test_a_label_that_is_not_an_int64_names_the_sample(tmp_path: Path, label: bytes) -> None:
    from streamload.decode import DecodeBatch
    from streamload.writer import DatasetWriter

    image = io.BytesIO()
    Image.new("RGB", (8, 8)).save(image, format="PNG")
    with DatasetWriter(str(tmp_path), format="tar", max_samples=4) as writer:
        writer.write({"__key__": "ok", "png": image.getvalue(), "cls": b"1"})
        writer.write({"__key__": "bad", "png": image.getvalue(), "cls": label})
    for collate in (RawCollate(), DecodeBatch(8)):
        ds = StreamingDataset(str(tmp_path), batch_size=2, collate=collate)
        with pytest.raises(SampleError, match="'bad'.*cls"):
            next(iter(ds))


@pytest.mark.parametrize("fmt", ["tar", "lmdb", "hdf5"])
def test_a_batch_interleaving_shards_reads_each_shard_once_and_keeps_batch_order(
    image_folder: Path, tmp_path: Path, fmt: str
) -> None:
    from streamload.converters import ConvertOptions, ImageFolderSource, convert
    from streamload.dataref import DatasetRef
    from streamload.shards import ShardSource

    convert(
        ImageFolderSource(str(image_folder)),
        str(tmp_path / fmt),
        ConvertOptions(format=fmt, samples_per_shard=7, progress=False),
    )
    ref = DatasetRef.open(str(tmp_path / fmt))
    parts = [(0, np.array([1, 2])), (1, np.array([0])), (0, np.array([5])), (1, np.array([3, 4])), (0, np.array([0]))]
    with ShardSource(ref, ref.open_storage(), own_storage=True) as source:
        calls: list[int] = []
        reader_of = source.get
        wrapped: set[int] = set()

        def counting(shard: int) -> Any:
            reader = reader_of(shard)
            if shard in wrapped:
                return reader
            wrapped.add(shard)
            # (at: samples read to places apart; gather_plan: a shard's part of the batch's one read call)
            for name in ("read_groups_into", "read_groups_at", "gather_plan"):
                real = getattr(reader, name, None)
                if real is None:
                    continue

                def read(indices: np.ndarray, groups: Any, real: Any = real) -> Any:
                    calls.append(shard)
                    return real(indices, groups)

                setattr(reader, name, read)
            return reader

        collate = RawCollate(keys=True)
        direct = collate.read_batch(counting, parts)
        generic = collate([source.get(s).get(int(i)) for s, idx in parts for i in idx])
    assert _unpack(direct) == _unpack(generic)
    assert direct.keys == generic.keys and torch.equal(direct.offsets, generic.offsets)
    assert sorted(calls) == [0, 1], "one read per shard, not one per part"


def test_image_batch_indexes_as_it_unpacks() -> None:
    from streamload.batch import ImageBatch

    images, labels = torch.zeros(4, 3, 2, 2, dtype=torch.uint8), torch.arange(4)
    batch = ImageBatch(images, labels)
    first, second = batch
    assert batch[0] is first is images and batch[1] is second is labels
    assert batch[-1] is labels and batch[-2] is images
    assert batch[:] == (images, labels) and batch[np.int64(1)] is labels
    assert ImageBatch(images, None)[1] is None
    with pytest.raises(IndexError, match="pair"):
        batch[2]
    with pytest.raises(TypeError, match="pair"):
        batch["images"]  # type: ignore[call-overload]
