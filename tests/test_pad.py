"""Reading without padding: every sample exactly once, the last global batch short, no repeats."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamload import Stream, StreamingDataset
from streamload._errors import ConfigError
from tests.helpers.datasets import make_dataset

COUNTS = [100, 97, 250, 3, 244]  # 694 samples: not a multiple of any batch below
TOTAL = sum(COUNTS)
BATCH = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("pad"), COUNTS)


@pytest.fixture(scope="module")
def every_key() -> Counter[str]:
    return Counter(f"s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n))


def key_of(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def batches(ds: StreamingDataset, workers: int = 0, loader: type[DataLoader[Any]] = DataLoader) -> list[list[str]]:
    return [list(b) for b in loader(ds, batch_size=BATCH, num_workers=workers)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_one_process_reads_each_sample_once_and_a_short_last_batch(
    root: Path, every_key: Counter[str], shuffle: bool, workers: int
) -> None:
    ds = StreamingDataset(str(root), shuffle=shuffle, seed=2, batch_size=BATCH, pad=False, transform=key_of)
    got = batches(ds, workers)
    assert [len(b) for b in got] == [BATCH] * (TOTAL // BATCH) + [TOTAL % BATCH]
    assert Counter(k for b in got for k in b) == every_key  # 694, not 696: no repeats
    assert len(ds) == TOTAL
    padded = StreamingDataset(str(root), batch_size=BATCH, transform=key_of)
    assert len(padded) == 696 and sum(len(b) for b in batches(padded)) == 696  # the default pads as before


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [BATCH, None])
def test_ranks_together_read_each_sample_once(
    root: Path, every_key: Counter[str], shuffle: bool, batch_size: int | None
) -> None:
    shares = []
    for rank in range(3):
        ds = StreamingDataset(
            str(root), shuffle=shuffle, seed=2, batch_size=batch_size, pad=False, rank=rank, world_size=3,
            partitions=6, transform=key_of,
        )  # fmt: skip
        got = batches(ds, workers=2 if rank == 1 else 0)
        assert sum(len(b) for b in got) == len(ds)
        if batch_size is not None:  # 28 whole batches, then each rank's part of the short global batch
            assert len(got) == 29 and all(len(b) == BATCH for b in got[:28])
        shares.append([k for b in got for k in b])
    assert Counter(k for share in shares for k in share) == every_key
    # 694 = 28 global batches of 24, then 22 shared 7, 7, 8 (unbatched: 231 * 3, then 1 for the last rank).
    assert [len(s) for s in shares] == [231, 231, 232]


def test_a_mixture_without_padding(root: Path, tmp_path: Path) -> None:
    other = make_dataset(tmp_path / "other", [9, 4])
    source = [Stream(str(root), samples=101), Stream(str(other), repeat=2)]  # 101 + 26 = 127 a epoch

    def tagged(sample: dict[str, Any]) -> str:
        return f"{sample['__source__']}:{sample['__key__']}"

    shares = []
    for rank in range(2):
        ds = StreamingDataset(
            source, shuffle=True, seed=1, batch_size=BATCH, pad=False, rank=rank, world_size=2, transform=tagged
        )
        shares.append([k for b in batches(ds) for k in b])
        assert len(shares[-1]) == len(ds)
    assert [len(s) for s in shares] == [63, 64]  # 112 in whole global batches of 16, then 7 + 8
    seen = Counter(k for s in shares for k in s)
    first = [k for k in seen if k.startswith("0:")]
    assert len(first) == 101 and all(seen[k] == 1 for k in first)  # a subset, each sample once
    assert Counter(seen[k] for k in seen if k.startswith("1:")) == {2: 13}  # two whole passes, no more


@pytest.mark.parametrize("steps", [3, 86])  # middle; after the last whole batch, before the short one
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_resume_without_padding(root: Path, steps: int, workers: int) -> None:
    def loader() -> StatefulDataLoader:
        ds = StreamingDataset(str(root), shuffle=True, seed=2, batch_size=BATCH, pad=False, transform=key_of)
        return StatefulDataLoader(ds, batch_size=BATCH, num_workers=workers)

    reference = [k for b in loader() for k in b]
    first = loader()
    it = iter(first)
    seen = [k for _ in range(steps) for k in next(it)]
    state = first.state_dict()
    del it, first
    again = loader()
    again.load_state_dict(state)
    rest = [k for b in again for k in b]
    assert seen + rest == reference
    assert len(reference) == TOTAL


@pytest.mark.parametrize("steps", [5, 28, 29])  # of 29 global batches of 24 (the last one holds 22)
def test_plain_recipe_resumes_without_padding_on_another_world(root: Path, every_key: Counter[str], steps: int) -> None:
    def make(rank: int, world_size: int, batch: int) -> StreamingDataset:
        return StreamingDataset(
            str(root), shuffle=True, seed=2, batch_size=batch, pad=False, rank=rank, world_size=world_size,
            partitions=6, transform=key_of,
        )  # fmt: skip

    seen = [k for rank in range(3) for b in batches(make(rank, 3, BATCH))[:steps] for k in b]
    state = make(0, 3, BATCH).state_dict(samples_seen=steps * 3 * BATCH)
    if steps == 29:  # the whole epoch, short last batch included: the next one starts
        assert state["epoch"] == 1 and state["samples_seen"] == 0 and state["pad"] is False
        return
    rest = []
    for rank in range(2):  # 2 ranks of 12: the same global batch of 24, so the same global batches
        ds = make(rank, 2, 12)
        ds.load_state_dict(state)
        rest.append([k for b in DataLoader(ds, batch_size=12) for k in b])
    assert abs(len(rest[0]) - len(rest[1])) <= 1
    assert Counter(seen + rest[0] + rest[1]) == every_key


def test_pad_must_be_a_bool(root: Path) -> None:
    with pytest.raises(ConfigError, match="pad='no'"):
        StreamingDataset(str(root), pad="no")  # type: ignore[arg-type]
