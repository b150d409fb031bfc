"""Exactly-once over DataLoader workers, with fewer, equal and more shards than workers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from streamload import StreamingDataset
from tests.helpers.datasets import make_dataset


@pytest.mark.parametrize("counts", [[37], [10, 10], [5, 0, 9, 1], [3] * 9])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 4])
def test_exactly_once_over_workers(tmp_path: Path, counts: list[int], num_workers: int) -> None:
    root = make_dataset(tmp_path / "ds", counts)
    ds = StreamingDataset(str(root))
    keys = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=num_workers)]
    expected = {f"s{i}_{j}" for i, n in enumerate(counts) for j in range(n)}
    assert Counter(keys) == Counter(expected)


def test_single_shard_is_shared_by_all_workers(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds", [40])
    ds = StreamingDataset(str(root), transform=lambda s: (s["__key__"], _worker_id()))
    seen = list(DataLoader(ds, batch_size=None, num_workers=4))
    per_worker = Counter(w for _, w in seen)
    assert sorted(per_worker.values()) == [10, 10, 10, 10]


def _worker_id() -> int:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return -1 if info is None else info.id


def test_explicit_rank_world_size_splits_and_pads(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds", [5, 6])  # 11 samples over 3 ranks -> 4 each, 1 repeat
    per_rank = []
    for rank in range(3):
        ds = StreamingDataset(str(root), rank=rank, world_size=3)
        assert len(ds) == 4
        per_rank.append([s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)])
    assert [len(k) for k in per_rank] == [4, 4, 4]
    union = Counter(k for keys in per_rank for k in keys)
    assert set(union) == {f"s{i}_{j}" for i, n in enumerate([5, 6]) for j in range(n)}
    assert sum(union.values()) - len(union) == 1

    dropped = [list(StreamingDataset(str(root), rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert [len(d) for d in dropped] == [3, 3, 3]
