"""Mixtures through StreamingDataset and real DataLoaders: tar, LMDB and HDF5 streams in one epoch.

Counts per stream come from the rules of docs/mixing.md (``epoch_counts`` is checked
against exact fractions in test_mix_plan.py); here every guarantee is checked on the
samples that come out: exact per-stream counts each epoch, ``__source__``, subsets and
passes, ranks, workers, persistent workers with ``set_epoch``, resume, ``on_error``.
"""

from __future__ import annotations

import io
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamload import ConfigError, PlanError, SkipCounts, Stream, StreamingDataset
from streamload.batch import RawBatch, RawCollate
from streamload.decode import DecodeBatch
from streamload.plan import epoch_counts
from tests.helpers.datasets import write_dataset

SHARDS = {"t": ("tar", [9, 0, 14, 6]), "l": ("lmdb", [10, 10]), "h": ("hdf5", [7, 8])}  # 29, 20, 15 samples


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    return {tag: write_dataset(str(root / tag), fmt, counts, tag) for tag, (fmt, counts) in SHARDS.items()}


def sizes() -> dict[str, int]:
    return {tag: sum(counts) for tag, (_, counts) in SHARDS.items()}


def source_key(sample: dict[str, Any]) -> tuple[Any, str]:
    return sample["__source__"], sample["__key__"]


def check_stream_counts(items: list[tuple[Any, str]], expected: dict[Any, int], size: dict[Any, int]) -> None:
    """Exact count per stream; a subsampled stream at most once, an upsampled one in whole passes + subset."""
    per_stream = Counter(src for src, _ in items)
    assert dict(per_stream) == {k: v for k, v in expected.items() if v}
    for src, count in expected.items():
        times = Counter(Counter(key for s, key in items if s == src).values())
        passes, rest = divmod(count, size[src])
        assert set(times) <= {passes, passes + 1} - {0}
        assert times.get(passes + 1, 0) == rest
        assert sum(times.values()) == min(count, size[src])


def mixed(streams: dict[str, str], **kw: Any) -> StreamingDataset:
    return StreamingDataset(
        [
            Stream(streams["t"], weight=0.5, name="t"),
            Stream(streams["l"], weight=0.3, name="l"),
            Stream(streams["h"], weight=0.2, name="h"),
        ],
        **kw,
    )


def test_three_formats_in_exact_proportion_from_the_first_sample(streams: dict[str, str]) -> None:
    ds = mixed(streams, epoch_size=90)
    expected = dict(
        zip(
            "tlh",
            epoch_counts([29, 20, 15], weights=[0.5, 0.3, 0.2], repeats=[None] * 3, samples=[None] * 3, epoch_size=90),
            strict=True,
        )
    )
    assert expected == {"t": 45, "l": 27, "h": 18} and len(ds) == 90 == ds.num_samples
    items = [source_key(s) for s in ds]
    check_stream_counts(items, expected, sizes())
    for start in range(0, 90, 10):  # every 10 consecutive samples: 5 t, 3 l, 2 h (within one)
        window = Counter(src for src, _ in items[start : start + 10])
        assert abs(window["t"] - 5) <= 1 and abs(window["l"] - 3) <= 1 and abs(window["h"] - 2) <= 1
    assert [src for src, _ in items[:10]] != ["t"] * 10
    # a subsampled stream: each key of the subset once; the subset changes with the epoch
    small = mixed(streams, epoch_size=30)
    epochs = [[source_key(s) for s in small] for _ in range(3)]
    for items in epochs:
        check_stream_counts(items, {"t": 15, "l": 9, "h": 6}, sizes())
    assert len({frozenset(items) for items in epochs}) == 3


def test_persistent_workers_set_epoch_and_batches(streams: dict[str, str]) -> None:
    ds = mixed(streams, epoch_size=60, shuffle=True, seed=3, batch_size=6, shuffle_window=12)
    loader = DataLoader(ds, batch_size=6, num_workers=2, persistent_workers=True, collate_fn=lambda b: b)
    expected = {"t": 30, "l": 18, "h": 12}

    def epoch() -> list[tuple[Any, str]]:
        return [source_key(s) for batch in loader for s in batch]

    ds.set_epoch(4)
    four, five = epoch(), epoch()
    ds.set_epoch(4)
    again = epoch()
    for items in (four, five):
        check_stream_counts(items, expected, sizes())
    assert four == again and four != five
    in_process = mixed(streams, epoch_size=60, shuffle=True, seed=3, batch_size=6, shuffle_window=12)
    in_process.set_epoch(4)
    assert [source_key(s) for s in in_process] == four, "workers take batch-sized chunks in the plan's order"


def test_epoch_size_alone_subsamples_or_upsamples_one_dataset(streams: dict[str, str]) -> None:
    plain = [s["__key__"] for s in StreamingDataset(streams["t"])]
    assert [s["__key__"] for s in StreamingDataset(Stream(streams["t"]))] == plain
    assert next(iter(StreamingDataset(Stream(streams["t"]))))["__source__"] == 0
    assert "__source__" not in next(iter(StreamingDataset(streams["t"])))
    sub = StreamingDataset(streams["t"], epoch_size=10, shuffle=True)
    assert len(sub) == 10
    first, second = [[("t", s["__key__"]) for s in sub] for _ in range(2)]
    check_stream_counts(first, {"t": 10}, sizes())
    assert set(first) != set(second)
    up = StreamingDataset(streams["h"], epoch_size=40, rank=1, world_size=3)
    assert len(up) == 14
    everything = [
        ("h", s["__key__"])
        for r in range(3)
        for s in StreamingDataset(streams["h"], epoch_size=40, rank=r, world_size=3)
    ]
    assert len(everything) == 42  # 40 + 2 padding
    # rank blocks are contiguous (no shuffle): the 2 padding items repeat the epoch's first ones at the end
    assert everything[40:] == everything[:2]
    check_stream_counts(everything[:40], {"h": 40}, sizes())


def test_ranks_equal_and_drop_last(streams: dict[str, str]) -> None:
    for drop_last in (False, True):
        per_rank = []
        for rank in range(4):
            ds = mixed(streams, epoch_size=50, shuffle=True, rank=rank, world_size=4, drop_last=drop_last)
            per_rank.append([source_key(s) for s in DataLoader(ds, batch_size=None, num_workers=2)])
            assert len(ds) == (12 if drop_last else 13)
        assert {len(items) for items in per_rank} == {12 if drop_last else 13}
        union = Counter(item for items in per_rank for item in items)
        epoch = Counter(source_key(s) for s in mixed(streams, epoch_size=50, shuffle=True, world_size=1, rank=0))
        if drop_last:
            assert not union - epoch and sum(union.values()) == 48
        else:
            assert not epoch - union and sum((union - epoch).values()) == 2


def test_raw_collate_and_decode_batch_over_formats(tar_dataset: Path, tmp_path: Path) -> None:
    from streamload.cli import main

    for fmt in ("lmdb", "hdf5"):
        args = ["convert", str(tar_dataset), str(tmp_path / fmt), "--format", fmt, "--samples-per-shard", "40"]
        assert main([*args, "--no-progress"]) == 0
    sources = [
        Stream(str(tar_dataset), weight=2),
        Stream(str(tmp_path / "lmdb"), weight=1),
        Stream(str(tmp_path / "hdf5"), weight=1),
    ]
    ds = StreamingDataset(sources, epoch_size=64, batch_size=16, collate=RawCollate(keys=True), shuffle=True)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(batches) == len(ds) == 4 and all(isinstance(b, RawBatch) and len(b) == 16 for b in batches)
    keys = [k for b in batches for k in (b.keys or ())]
    assert len(keys) == 64 and all(b.labels is not None for b in batches)
    # per-sample path too (a transform makes the dataset build dicts): __source__ is there
    dicts = StreamingDataset(sources, epoch_size=64, batch_size=16, collate=lambda s: [x["__source__"] for x in s])
    assert Counter(src for batch in dicts for src in batch) == {0: 32, 1: 16, 2: 16}
    decoded = StreamingDataset(sources, epoch_size=32, batch_size=8, collate=DecodeBatch(16), shuffle=True)
    images = list(DataLoader(decoded, batch_size=None, num_workers=2))
    assert [tuple(b.images.shape) for b in images] == [(8, 3, 16, 16)] * 4
    assert all(b.labels is not None and b.labels.dtype == torch.int64 for b in images)


@pytest.mark.parametrize("steps", [3, 7])
def test_stateful_dataloader_resumes_a_mixture_exactly(streams: dict[str, str], steps: int) -> None:
    def loader() -> StatefulDataLoader[Any]:
        ds = mixed(streams, epoch_size=40, shuffle=True, seed=9, batch_size=4, transform=source_key)
        return StatefulDataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b)

    ref = loader()
    reference, following = [list(ref) for _ in range(2)]
    stopped = loader()
    it = iter(stopped)
    seen = [next(it) for _ in range(steps)]
    saved = io.BytesIO()
    torch.save(stopped.state_dict(), saved)
    del it, stopped
    resumed = loader()
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert seen + list(resumed) == reference
    assert list(resumed) == following


def test_plain_loop_recipe_resumes_a_mixture_on_other_workers(streams: dict[str, str]) -> None:
    def dataset() -> StreamingDataset:
        return mixed(streams, epoch_size=45, shuffle=True, seed=2, batch_size=5, transform=source_key)

    reference = [x for b in DataLoader(dataset(), batch_size=5, num_workers=2, collate_fn=lambda b: b) for x in b]
    ds = dataset()
    seen: list[Any] = []
    for step, batch in enumerate(DataLoader(ds, batch_size=5, num_workers=2, collate_fn=lambda b: b)):
        if step == 4:
            break
        seen += batch
    state = ds.state_dict(samples_seen=20)
    assert state["num_samples"] == 45 and state["mixture"]
    resumed = dataset()
    resumed.load_state_dict(state)
    rest = [x for b in DataLoader(resumed, batch_size=5, num_workers=3, collate_fn=lambda b: b) for x in b]
    assert seen + rest == reference
    other = StreamingDataset(
        [Stream(streams["t"], weight=1), Stream(streams["l"], weight=1)],
        epoch_size=45,
        shuffle=True,
        seed=2,
        batch_size=5,
    )
    with pytest.raises(PlanError, match="mixture"):
        other.load_state_dict(state)


def test_skip_a_damaged_shard_of_one_stream_keeps_ranks_equal(streams: dict[str, str], tmp_path: Path) -> None:
    broken = tmp_path / "t"
    shutil.copytree(streams["t"], broken)
    shard = broken / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[512] ^= 0x01  # the first byte of the first sample's first field (its cls)
    shard.write_bytes(bytes(data))
    sources = [Stream(str(broken), repeat=1, name="t"), Stream(streams["l"], repeat=1, name="l")]
    with pytest.raises(Exception, match=str(broken)):
        list(StreamingDataset(sources))
    lens = []
    skipped = 0
    for rank in range(2):
        ds = StreamingDataset(sources, on_error="skip", rank=rank, world_size=2)
        items = [source_key(s) for s in DataLoader(ds, batch_size=None, num_workers=2)]
        lens.append(len(items))
        skipped += ds.skipped_samples
    assert lens == [25, 25] and skipped == 1
    in_process = [StreamingDataset(sources, on_error="skip", rank=rank, world_size=2) for rank in range(2)]
    for ds in in_process:
        assert len(list(ds)) == 25
    counts = [ds.errors for ds in in_process if ds.errors.samples_skipped]
    assert counts == [SkipCounts(samples_skipped=1, shards={f"{broken}/shard-000002.tar": 1})]


def test_invalid_mixtures(streams: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="every stream has a weight"):
        StreamingDataset([Stream(streams["t"], weight=1), Stream(streams["l"], repeat=2)])
    with pytest.raises(ConfigError, match="at most one"):
        Stream(streams["t"], weight=1, samples=3)
    with pytest.raises(ConfigError, match="distinct"):
        StreamingDataset([Stream(streams["t"], name="a"), Stream(streams["l"], name="a")])
    with pytest.raises(ConfigError, match="at least one"):
        StreamingDataset([])
    ds = StreamingDataset([streams["t"], Stream(streams["l"], samples=5)])
    assert ds.streams.counts == (29, 5) and "2 streams" in repr(ds)
