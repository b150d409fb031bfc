"""Epochs in real DataLoaders: set_epoch reaches persistent workers, iterating again advances."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from streamload import StreamingDataset
from tests.helpers.datasets import make_dataset

COUNTS = [9, 0, 14, 6, 11, 3]
ALL_KEYS = {f"s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n)}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("epochs"), COUNTS)


def keys_of(ds: StreamingDataset, **loader: object) -> list[str]:
    return [s["__key__"] for s in DataLoader(ds, batch_size=None, **loader)]  # type: ignore[arg-type]


def epoch_order(root: Path, epoch: int, num_workers: int) -> list[str]:
    ds = StreamingDataset(str(root), shuffle=True, seed=11, shuffle_window=8)
    ds.set_epoch(epoch)
    return keys_of(ds, num_workers=num_workers)


def test_set_epoch_reaches_persistent_workers(root: Path) -> None:
    ds = StreamingDataset(str(root), shuffle=True, seed=11, shuffle_window=8)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    ds.set_epoch(5)
    first = [s["__key__"] for s in loader]
    second = [s["__key__"] for s in loader]  # no set_epoch: advances to epoch 6
    ds.set_epoch(2)
    third = [s["__key__"] for s in loader]
    assert Counter(first) == Counter(second) == Counter(third) == Counter(ALL_KEYS)
    assert first == epoch_order(root, 5, 2)
    assert second == epoch_order(root, 6, 2)
    assert third == epoch_order(root, 2, 2)
    assert len({tuple(first), tuple(second), tuple(third)}) == 3


def test_iterating_again_advances_the_epoch_in_process(root: Path) -> None:
    ds = StreamingDataset(str(root), shuffle=True, seed=11, shuffle_window=8)
    orders = [keys_of(ds) for _ in range(3)]
    assert orders == [epoch_order(root, e, 0) for e in range(3)]
    assert ds.epoch == 2
    # an iterator created but never consumed does not count as an epoch
    it = iter(ds)
    del it
    assert keys_of(ds) == epoch_order(root, 3, 0)


def test_dataset_built_before_the_world_is_known_splits_at_iteration(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = StreamingDataset(str(root))
    assert len(ds) == 43
    monkeypatch.setenv("WORLD_SIZE", "3")
    parts = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        assert len(ds) == 15
        parts.append(keys_of(ds, num_workers=2))
    assert [len(p) for p in parts] == [15, 15, 15]
    union = Counter(k for p in parts for k in p)
    assert set(union) == ALL_KEYS and sum(union.values()) == 45


@pytest.mark.parametrize(("counts", "world_size", "per_rank"), [([3], 5, 1), ([0], 4, 0), ([2, 0], 2, 1)])
def test_tiny_datasets_over_large_worlds(tmp_path: Path, counts: list[int], world_size: int, per_rank: int) -> None:
    root = make_dataset(tmp_path / "ds", counts)
    parts = []
    for rank in range(world_size):
        ds = StreamingDataset(str(root), rank=rank, world_size=world_size)
        assert len(ds) == per_rank
        parts.append(keys_of(ds, num_workers=2))
    assert [len(p) for p in parts] == [per_rank] * world_size
    assert {k for p in parts for k in p} == {f"s{i}_{j}" for i, n in enumerate(counts) for j in range(n)}


def _start(body: Any) -> int:
    """Fork a child that runs ``body()`` and exits 0 when it returned True; return its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() else 2
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _forked(body: Any) -> int:
    """Run ``body()`` in a forked child; return its exit code (0 when it returned True)."""
    return _exit_code(_start(body))


def test_a_sibling_workers_claim_counts_after_it_ended_and_an_older_iterators_does_not() -> None:
    """A worker that reads its first sample after its sibling ended (the loop left after one batch)
    finds the sibling's epoch; a worker started after an earlier iterator's worker ended does not."""
    from streamload.epochs import EpochTable

    table = EpochTable()
    key = 12345 | 1
    # The slow sibling: started first, asked for its first sample after the claimer has exited.
    read, write = os.pipe()

    def slow_sibling() -> bool:
        os.read(read, 1)  # started; waits for its first sample
        return table.lookup(key)[0] == 0 and table.claim(key) == 0

    pid = _start(slow_sibling)
    assert _forked(lambda: table.claim(key) == 0) == 0  # the fast sibling claims epoch 0, and ends
    os.write(write, b"x")
    assert _exit_code(pid) == 0, "the sibling's claim was not found"
    assert table.claimed() == 1
    # A worker of a later iterator whose generator repeats the seed: the claim is older than it.
    time.sleep(0.05)  # more than the kernel's start-time tick, so the child starts after the claim
    assert _forked(lambda: table.lookup(key)[0] is None and table.claim(key) == 1) == 0
    assert table.claimed() == 2
