"""Resuming an epoch with another global batch (or partition count) reads its rest exactly once.

The ranks are simulated in one process with explicit ``rank=``/``world_size=``: the plan
is a pure function of them, so each rank's share is what that rank reads under DDP.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from streamload import Stream, StreamingDataset
from streamload._errors import PlanError
from tests.helpers.datasets import make_dataset

COUNTS = [13, 0, 21, 8, 17, 5, 30]  # 94 samples


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("reshape"), COUNTS)


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("reshape-other"), [9, 6])


def tagged(sample: dict[str, Any]) -> str:
    return f"{sample.get('__source__', '')}:{sample['__key__']}"


class World:
    """One dataset per rank of a simulated world, all of the same configuration."""

    def __init__(self, source: Any, world_size: int, batch: int, **kw: Any) -> None:
        self.batch = batch
        self.ranks = [
            StreamingDataset(source, batch_size=batch, rank=r, world_size=world_size, transform=tagged, **kw)
            for r in range(world_size)
        ]

    def load(self, state: dict[str, Any]) -> None:
        for ds in self.ranks:
            ds.load_state_dict(state)

    def read(self, steps: int | None = None) -> list[list[str]]:
        """Each rank's keys of its first ``steps`` batches (all without ``steps``)."""
        out = []
        for ds in self.ranks:
            batches = [list(b) for b in DataLoader(ds, batch_size=self.batch)]
            out.append([k for b in batches[:steps] for k in b])
        return out

    def state(self, samples_seen: int) -> dict[str, Any]:
        return self.ranks[0].state_dict(samples_seen=samples_seen)


def flat(shares: list[list[str]]) -> list[str]:
    return [k for share in shares for k in share]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("steps", [1, 3, 6, 7])  # of 8 global batches of 12 (the last one padded by 2)
def test_two_ranks_of_6_resumed_on_three_ranks_of_6(root: Path, shuffle: bool, steps: int) -> None:
    kw: dict[str, Any] = {"shuffle": shuffle, "seed": 3, "pad": False}
    whole = Counter(flat(World(str(root), 2, 6, **kw).read()))  # every sample once
    assert sum(whole.values()) == 94
    seen = flat(World(str(root), 2, 6, **kw).read(steps))
    state = World(str(root), 2, 6, **kw).state(steps * 12)
    resumed = World(str(root), 3, 6, **kw)
    resumed.load(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = resumed.read()
    told = [w for w in caught if "differs from the uninterrupted run" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]  # once, by rank 0
    assert Counter(seen + flat(rest)) == whole  # the rest of the epoch exactly once
    lengths = [len(share) for share in rest]
    assert max(lengths) - min(lengths) <= 1  # pad=False: the short last global batch shared evenly
    later = resumed.ranks[0].state_dict(samples_seen=steps * 12 + 18)  # one more step: the state records both shapes
    if steps * 12 + 18 < 94:
        assert later["segments"] == [[12, state["partitions"], steps * 12]] and later["rest"] == 94 - steps * 12
    else:
        assert later["epoch"] == 1 and "segments" not in later


@pytest.mark.parametrize("steps", [2, 5])
def test_padded_epoch_resumed_with_another_global_batch_is_equal_per_rank(root: Path, steps: int) -> None:
    kw: dict[str, Any] = {"shuffle": True, "seed": 5}
    seen = flat(World(str(root), 2, 6, **kw).read(steps))
    state = World(str(root), 2, 6, **kw).state(steps * 12)
    resumed = World(str(root), 3, 5, **kw)  # global batch 12 -> 15
    resumed.load(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rest = resumed.read()
    lengths = {len(share) for share in rest}
    assert len(lengths) == 1 and lengths.pop() % 5 == 0  # equal per rank, whole batches (padded)
    every = {f":s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n)}
    assert set(seen) | set(flat(rest)) == every
    left = every - set(seen)
    assert set(flat(rest)) >= left and len(flat(rest)) - len(left) < 15  # the fewest repeats: less than one batch


def test_changed_twice_and_a_mixture(root: Path, other: Path) -> None:
    source = [Stream(str(root), samples=50), Stream(str(other), repeat=2)]  # 50 + 30 = 80 an epoch
    kw: dict[str, Any] = {"shuffle": True, "seed": 1, "pad": False}
    whole = Counter(flat(World(source, 2, 4, **kw).read()))
    assert sum(whole.values()) == 80 and max(whole.values()) == 2  # the repeated stream, twice each
    seen = flat(World(source, 2, 4, **kw).read(3))  # 24
    state = World(source, 2, 4, **kw).state(24)
    second = World(source, 3, 3, **kw)  # global batch 8 -> 9
    second.load(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        middle = second.read(2)  # 18 more
        state = second.state(24 + 18)
        third = World(source, 1, 5, **kw)  # -> 5
        third.load(state)
        rest = third.read()
    assert state["segments"] == [[8, 8, 24]] and state["global_batch"] == 9
    assert Counter(seen + flat(middle) + flat(rest)) == whole
    assert third.ranks[0].state_dict(samples_seen=80)["epoch"] == 1  # the epoch ends on its count


def test_another_partition_count_and_the_same_global_batch(root: Path) -> None:
    kw: dict[str, Any] = {"shuffle": True, "seed": 2, "pad": False}
    reference = World(str(root), 2, 6, **kw).read()
    seen = flat(World(str(root), 2, 6, **kw).read(4))
    state = World(str(root), 2, 6, **kw).state(48)
    same = World(str(root), 3, 4, **kw)  # 12 again: exactly the uninterrupted global batches, no warning
    same.load(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exact = same.read()
    assert not [w for w in caught if "differs" in str(w.message)]
    steps = [[k for share in exact for k in share[j * 4 : (j + 1) * 4]] for j in range(4)]
    uninterrupted = [[k for share in reference for k in share[j * 6 : (j + 1) * 6]] for j in range(4, 8)]
    assert steps[:3] == uninterrupted[:3]  # (the short last one is shared another way)
    fewer = World(str(root), 2, 6, partitions=4, **kw)  # the same global batch, other partitions
    fewer.load(state)
    with pytest.warns(UserWarning, match="differs from the uninterrupted run"):
        rest = fewer.read()
    assert Counter(seen + flat(rest)) == Counter(flat(reference))


def test_a_rest_that_does_not_match_its_segments_is_refused(root: Path) -> None:
    kw: dict[str, Any] = {"shuffle": True, "seed": 3, "pad": False}
    state = World(str(root), 2, 6, **kw).state(24)
    resumed = World(str(root), 3, 6, **kw)
    resumed.load(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        later = resumed.state(24 + 18)
    assert later["rest"] == 94 - 24
    resumed = World(str(root), 3, 6, **kw)
    resumed.load({**later, "rest": 71})
    with pytest.raises(PlanError, match="rest=71"):
        resumed.read()
    for segments in ([[10**12, 10**12, 10**12]], [[12, 2, 24]] * 40, [[12, 2, 25]], [[12, 2, 24], [12, 2, 24]]):
        with pytest.raises(PlanError, match="segment"):  # checked on load, before a plan is built from them
            World(str(root), 3, 6, **kw).load({**later, "segments": segments})
    with pytest.raises(PlanError, match="whole number of global batches"):
        odd = World(str(root), 3, 6, **kw)
        odd.load(World(str(root), 2, 6, **kw).state(26))
        odd.read()


def test_a_dataloader_with_workers_reads_the_rest(root: Path) -> None:
    kw: dict[str, Any] = {"shuffle": True, "seed": 4, "pad": False}
    whole = Counter(flat(World(str(root), 1, 8, **kw).read()))
    seen = flat(World(str(root), 1, 8, **kw).read(5))
    ds = StreamingDataset(str(root), batch_size=5, transform=tagged, **kw)
    ds.load_state_dict(World(str(root), 1, 8, **kw).state(40))
    rest = [k for b in DataLoader(ds, batch_size=5, num_workers=2) for k in b]
    assert Counter(seen + rest) == whole
