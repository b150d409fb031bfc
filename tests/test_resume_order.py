"""The plain-loop resume recipe keeps the exact order for any number of steps and workers.

A DataLoader asks its workers for batches in turn from worker 0, so an iteration resumed
at batch ``k`` must deal batch ``k`` to worker 0 (chunks dealt round-robin from the
resumed chunk); before, a stop after a number of batches that was not a multiple of the
workers resumed with batches swapped. A StatefulDataLoader checkpoint taken inside such a
resumed iteration remembers where its dealing started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamload import Stream, StreamingDataset
from tests.helpers.datasets import make_dataset

COUNTS = [10, 7, 3, 12]
BATCH = 3


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("order"), COUNTS)


def key_of(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def keys(loader: Any) -> list[str]:
    return [k for batch in loader for k in batch]


@pytest.mark.parametrize("mixture", [False, True])
@pytest.mark.parametrize(("steps", "workers"), [(1, 2), (3, 2), (5, 3), (4, 3), (3, 1)])
def test_plain_recipe_resumes_in_order(root: Path, mixture: bool, steps: int, workers: int) -> None:
    def dataset() -> StreamingDataset:
        source: Any = [Stream(str(root), repeat=0.75), Stream(str(root), samples=9)] if mixture else str(root)
        return StreamingDataset(source, shuffle=True, seed=5, batch_size=BATCH, transform=key_of)

    reference = keys(DataLoader(dataset(), batch_size=BATCH, num_workers=2))
    ds = dataset()
    seen: list[str] = []
    for step, batch in enumerate(DataLoader(ds, batch_size=BATCH, num_workers=2)):
        if step == steps:
            break
        seen += batch
    state = ds.state_dict(samples_seen=steps * BATCH)
    resumed = dataset()
    resumed.load_state_dict(state)
    assert seen + keys(DataLoader(resumed, batch_size=BATCH, num_workers=workers)) == reference


def test_stateful_checkpoint_inside_a_resumed_iteration(root: Path) -> None:
    def dataset() -> StreamingDataset:
        return StreamingDataset(str(root), shuffle=True, seed=5, batch_size=BATCH, transform=key_of)

    reference = keys(DataLoader(dataset(), batch_size=BATCH, num_workers=2))
    first = dataset()
    first.load_state_dict(dataset().state_dict(samples_seen=3 * BATCH))  # resumed at batch 3 (odd)
    loader = StatefulDataLoader(first, batch_size=BATCH, num_workers=2)
    it = iter(loader)
    middle = [k for _ in range(3) for k in next(it)]
    state = loader.state_dict()
    del it, loader
    again = StatefulDataLoader(dataset(), batch_size=BATCH, num_workers=2)
    again.load_state_dict(state)
    assert reference[: 3 * BATCH] + middle + keys(again) == reference
