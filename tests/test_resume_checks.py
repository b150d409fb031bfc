"""A resume state is checked against the plan and the dataset before anything is read.

Worker positions out of their plan (tampered, or from another run) are refused with a
PlanError instead of dropping or repeating samples; a state saved for another dataset of
the same size is refused by the fingerprint of its shards.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamload import StreamingDataset
from streamload._errors import PlanError
from tests.test_split_basic import make_dataset

COUNTS = [20, 28]  # 48 samples
BATCH = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("checks"), COUNTS)


def key_of(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def loader(root: Path, workers: int, **kw: Any) -> StatefulDataLoader:
    ds = StreamingDataset(str(root), shuffle=True, seed=1, batch_size=BATCH, transform=key_of, **kw)
    return StatefulDataLoader(ds, batch_size=BATCH, num_workers=workers)


def saved_state(root: Path, workers: int, steps: int, **kw: Any) -> dict[str, Any]:
    first = loader(root, workers, **kw)
    it = iter(first)
    for _ in range(steps):
        next(it)
    state: dict[str, Any] = first.state_dict()
    del it
    return state


def positions(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The dataset's worker positions inside a StatefulDataLoader state."""
    if "_snapshot" in state:
        snaps = state["_snapshot"]["_worker_snapshots"]
        return [snaps[name]["dataset_state"]["worker"] for name in sorted(snaps)]
    return [state["dataset_state"]["worker"]]


def keys(batches: Any) -> list[str]:
    return [k for b in batches for k in b]


# Each applied to the last worker's position (the first worker's is tampered with in process below).
TAMPERING: dict[str, Callable[[dict[str, Any]], None]] = {
    "past the end": lambda p: p.update(next_item=10**9),
    "back to the start": lambda p: p.update(next_item=0),
    "another first chunk": lambda p: p.update(first_chunk=3),
    "one position 10**12": lambda p: p.update(next_item=10**12),
    "a chunk not its own": lambda p: p.update(next_item=p["next_item"] + BATCH),
}


@pytest.mark.parametrize("how", sorted(TAMPERING))
def test_tampered_worker_positions_are_refused(root: Path, how: str) -> None:
    state = saved_state(root, workers=2, steps=5)
    TAMPERING[how](positions(state)[-1])
    resumed = loader(root, 2)
    resumed.load_state_dict(state)
    with pytest.raises(PlanError, match="state worker position"):
        keys(resumed)


def test_the_untouched_state_resumes(root: Path) -> None:
    reference = keys(loader(root, 2))
    state = saved_state(root, workers=2, steps=5)
    assert all({"start", "done"} <= set(p) for p in positions(state))
    good = loader(root, 2)
    good.load_state_dict(state)
    assert reference[: 5 * BATCH] + keys(good) == reference


@pytest.mark.parametrize("next_item", [25, 0])
def test_a_position_past_the_ranks_items_is_refused_in_process(root: Path, next_item: int) -> None:
    # Two ranks of 24 items each; this rank's only worker (the main process) stopped after 3 batches.
    state = saved_state(root, workers=0, steps=3, rank=1, world_size=2)
    assert positions(state)[0]["next_item"] == 12
    positions(state)[0]["next_item"] = next_item
    resumed = loader(root, 0, rank=1, world_size=2)
    resumed.load_state_dict(state)
    with pytest.raises(PlanError, match="next_item=" + str(next_item)):
        keys(resumed)


def test_a_state_of_another_dataset_of_the_same_size_is_refused(root: Path, tmp_path: Path) -> None:
    other = make_dataset(tmp_path / "other", [28, 20])  # 48 samples too, other shards
    state = StreamingDataset(str(root), shuffle=True, batch_size=BATCH).state_dict(samples_seen=8)
    assert isinstance(state["manifest"], str)
    theirs = StreamingDataset(str(other), shuffle=True, batch_size=BATCH)
    with pytest.raises(PlanError, match="another dataset"):
        theirs.load_state_dict(state)
    mine = StreamingDataset(str(root), shuffle=True, batch_size=BATCH, transform=key_of)
    mine.load_state_dict(state)  # its own state: accepted
    assert len(keys(DataLoader(mine, batch_size=BATCH))) == 40
    older = {k: v for k, v in state.items() if k != "manifest"}  # saved before states had the fingerprint
    theirs.load_state_dict(older)
    assert len(list(theirs)) == 40
