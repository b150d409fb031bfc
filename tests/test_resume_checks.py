"""A resume state is checked against the plan and the dataset before anything is read.

Worker positions out of their plan (tampered, or from another run) are refused with a
PlanError instead of dropping or repeating samples; a state saved for another dataset of
the same size is refused by the fingerprint of its shards.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamload import StreamingDataset
from streamload._errors import PlanError
from tests.helpers.datasets import make_dataset

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


def test_a_position_on_another_workers_chunk_is_refused(root: Path) -> None:
    # Two real workers; the second one's position moved one chunk on, onto the first one's chunk.
    state = saved_state(root, workers=2, steps=5)
    positions(state)[-1]["next_item"] += BATCH
    resumed = loader(root, 2)
    resumed.load_state_dict(state)
    with pytest.raises(PlanError, match="state worker position.*not in one of its chunks") as refused:
        keys(resumed)
    del refused
    gc.collect()  # the failed iterator's workers are shut down now, not in a later test


def test_the_untouched_state_resumes(root: Path) -> None:
    reference = keys(loader(root, 2))
    state = saved_state(root, workers=2, steps=5)
    assert all({"start", "done"} <= set(p) for p in positions(state))
    good = loader(root, 2)
    good.load_state_dict(state)
    assert reference[: 5 * BATCH] + keys(good) == reference


# Each applied to the position of a rank's only worker (the main process: num_workers=0), of
# rank 1 of 2 (24 items each), saved after 3 batches (next_item 12).
TAMPERING: dict[str, tuple[dict[str, int], str]] = {
    "past the end": ({"next_item": 10**9}, "past the rank's 24 items"),
    "one past the last item": ({"next_item": 25}, "past the rank's 24 items"),
    "10**12": ({"next_item": 10**12}, "past the rank's 24 items"),
    "back to the start": ({"next_item": 0}, "follows 0 items, not 12"),
    "one batch back": ({"next_item": 8}, "follows 8 items, not 12"),
    "another first chunk": ({"first_chunk": 3}, "first_chunk=3 is not the chunk of start=0"),
    "a start after it": ({"start": 16}, "start=16 is after next_item=12"),
}


@pytest.mark.parametrize("how", sorted(TAMPERING))
def test_tampered_worker_positions_are_refused(root: Path, how: str) -> None:
    change, message = TAMPERING[how]
    state = saved_state(root, workers=0, steps=3, rank=1, world_size=2)
    assert positions(state)[0]["next_item"] == 12
    positions(state)[0].update(change)
    resumed = loader(root, 0, rank=1, world_size=2)
    resumed.load_state_dict(state)
    with pytest.raises(PlanError, match="state worker position") as refused:
        keys(resumed)
    assert message in str(refused.value)


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
