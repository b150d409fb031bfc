"""The planner's shapes and shuffle, world detection, and the resume state's validation."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from streamload._errors import PlanError
from streamload.plan import EpochPlan, Split, World, detect_rank_world, detect_world
from streamload.plan.state import EpochState


def worker_items(plan: EpochPlan, rank: int, worker: int, num_workers: int) -> list[tuple[int, int]]:
    return [
        (run.shard, int(i)) for run in plan.runs(World(rank, plan.world_size, worker, num_workers)) for i in run.locals
    ]


def rank_order(plan: EpochPlan, rank: int) -> list[tuple[int, int]]:
    shards, locals_ = plan.locate(plan.rank_positions(rank, 0, plan.per_rank))
    return list(zip(shards.tolist(), locals_.tolist(), strict=True))


# -- shapes ------------------------------------------------------------------------


def test_single_shard_read_by_4_ranks_x_3_workers() -> None:
    plan = EpochPlan([50], 4, Split())
    parts = {(r, w): worker_items(plan, r, w, 3) for r in range(4) for w in range(3)}
    assert all(parts.values()), "every worker of every rank gets part of the single shard"
    assert [sum(len(parts[r, w]) for w in range(3)) for r in range(4)] == [13] * 4
    seen = Counter(item for part in parts.values() for item in part)
    assert set(seen) == {(0, i) for i in range(50)} and sum(seen.values()) == 52


@pytest.mark.parametrize(("n", "world_size", "per_rank"), [(3, 5, 1), (1, 4, 1), (0, 3, 0)])
def test_dataset_smaller_than_world(n: int, world_size: int, per_rank: int) -> None:
    plan = EpochPlan([n], world_size, Split())
    assert plan.per_rank == per_rank
    reads = [worker_items(plan, r, 0, 1) for r in range(world_size)]
    assert [len(x) for x in reads] == [per_rank] * world_size
    assert {item for x in reads for item in x} == {(0, i) for i in range(n)}
    dropped = EpochPlan([n], world_size, Split(drop_last=True))
    assert dropped.per_rank == n // world_size
    assert not any(worker_items(dropped, r, 0, 1) for r in range(world_size)) or n >= world_size


def test_chunks_go_round_robin_to_workers() -> None:
    plan = EpochPlan([10, 10], 1, Split(batch_size=3))
    positions = [[int(p) for run in plan.runs(World(0, 1, w, 2)) for p in run.positions] for w in range(2)]
    # 20 samples padded to 7 whole batches of 3 (one repeat)
    assert positions == [[0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20], [3, 4, 5, 9, 10, 11, 15, 16, 17]]


def test_invalid_inputs_raise_plan_error() -> None:
    with pytest.raises(PlanError, match="world_size"):
        EpochPlan([3], 0, Split())
    with pytest.raises(PlanError, match="non-negative"):
        EpochPlan([3, -1], 2, Split())
    with pytest.raises(PlanError, match="window"):
        Split(window=0)
    with pytest.raises(PlanError, match="partitions"):
        Split(partitions=0)


# -- shuffle -----------------------------------------------------------------------


def test_shuffle_is_deterministic_and_changes_each_epoch() -> None:
    counts = [100] * 20
    orders = {e: rank_order(EpochPlan(counts, 2, Split(epoch=e, seed=7, shuffle=True)), 1) for e in range(3)}
    again = rank_order(EpochPlan(counts, 2, Split(epoch=1, seed=7, shuffle=True)), 1)
    assert again == orders[1]
    assert orders[0] != orders[1] != orders[2]
    other_seed = rank_order(EpochPlan(counts, 2, Split(epoch=1, seed=8, shuffle=True)), 1)
    assert other_seed != orders[1]


def test_shuffle_mixes_shards_within_the_window() -> None:
    counts = [100] * 40
    plan = EpochPlan(counts, 1, Split(shuffle=True, seed=3, window=400))
    order = rank_order(plan, 0)
    first_shards = {s for s, _ in order[:16]}
    assert len(first_shards) >= 3, "a batch draws on several shards, not one"
    # shard order is permuted, not the manifest order
    shard_sequence = list(dict.fromkeys(s for s, _ in order))
    assert shard_sequence != sorted(shard_sequence)
    # within each window of 400 items, samples come from 4 or 5 shards (window = 4 shards)
    for w in range(0, len(order), 400):
        assert 4 <= len({s for s, _ in order[w : w + 400]}) <= 5


def test_default_window_is_wider_than_a_shard_and_bounded() -> None:
    assert EpochPlan([10_000, 500], 1, Split(shuffle=True)).window == 40_000
    assert EpochPlan([1000] * 50, 1, Split(shuffle=True)).window == 4096
    assert EpochPlan([10] * 5, 1, Split(shuffle=True)).window == 320  # 32 shards at most
    assert EpochPlan([0, 0], 1, Split(shuffle=True)).window == 1
    assert EpochPlan([10**7], 1, Split(shuffle=True)).window == 2**20
    # partitioned (shuffled and batched): the whole window shared, never below the largest shard
    assert EpochPlan([1000] * 50, 1, Split(shuffle=True, batch_size=64)).window == 1000
    # 32 shards of 10 shared by 8 windows, less the 7 extra boundaries: (320 - 7 * 10) // 8
    assert EpochPlan([10] * 1000, 4, Split(shuffle=True, batch_size=64)).window == 31
    assert EpochPlan([10] * 1000, 4, Split(shuffle=True, batch_size=64, partitions=2)).window == 155
    assert EpochPlan([10] * 1000, 4, Split(shuffle=True, batch_size=1, partitions=2)).window == 155  # min(P, B) = 2


# -- world detection ---------------------------------------------------------------


def test_world_detection_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert detect_rank_world() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert detect_rank_world() == (2, 3)
    assert detect_rank_world(inherited=(1, 4)) == (1, 4)
    assert detect_rank_world(rank=0) == (0, 3)
    assert detect_rank_world(rank=1, world_size=2) == (1, 2)
    assert detect_world() == World(2, 3, 0, 1)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(PlanError, match="WORLD_SIZE"):
        detect_rank_world()
    with pytest.raises(PlanError, match="rank=5"):
        detect_rank_world(rank=5, world_size=2)


# -- resume state ------------------------------------------------------------------


def good_state() -> dict[str, object]:
    return {
        "version": 2,
        "epoch": 2,
        "seed": 5,
        "shuffle": True,
        "drop_last": False,
        "window": 40,
        "num_samples": 30,
        "world_size": 2,
        "global_batch": 4,
        "partitions": 4,
        "samples_seen": 12,
        "worker": None,
    }


def test_state_round_trips_through_json() -> None:
    state = EpochState.from_dict(json.loads(json.dumps(good_state())))
    assert state.to_dict() == good_state()
    assert (state.global_batch, state.partitions) == (4, 4)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("version", 9, "version"),
        ("version", 1, "earlier streamload"),
        ("epoch", -1, "epoch"),
        ("samples_seen", "12", "samples_seen"),
        ("shuffle", 1, "shuffle"),
        ("global_batch", 0, "global_batch"),
        ("global_batch", 5, "multiple of its world_size"),
        ("partitions", None, "partitions"),
        ("worker", {"rank": 0}, "world_size"),
    ],
)
def test_state_validation_names_the_field(field: str, value: object, match: str) -> None:
    state = good_state()
    state[field] = value
    with pytest.raises(PlanError, match=match):
        EpochState.from_dict(state)


def test_state_at_the_end_of_an_epoch_is_the_next_epoch() -> None:
    state = EpochState.from_dict({**good_state(), "samples_seen": 32})  # 30 samples padded to 8 batches of 4
    assert state.normalized().to_dict()["epoch"] == 3
    assert state.normalized().samples_seen == 0
    assert EpochState.from_dict({**good_state(), "samples_seen": 28}).normalized().epoch == 2
    odd = EpochState.from_dict({**good_state(), "samples_seen": 7})
    with pytest.raises(PlanError, match="multiple of world_size=2"):
        odd.normalized()


def test_resume_same_world_and_another() -> None:
    state = EpochState.from_dict(good_state())  # 12 = 3 global batches of 4
    assert state.resume(World(1, 2, 0, 3), chunk=2) == (6, 3)
    assert state.resume(World(0, 4, 0, 1), chunk=1) == (3, 3)
    assert state.resume(World(0, 1, 0, 2), chunk=4) == (12, 3)
    mid = EpochState.from_dict({**good_state(), "samples_seen": 10})  # not a whole global batch
    assert mid.resume(World(1, 2, 0, 1), chunk=2) == (5, 2)
    with pytest.raises(PlanError, match="whole number of global batches of 4"):
        mid.resume(World(0, 1, 0, 1), chunk=4)
    with pytest.raises(PlanError, match="global_batch=4.*global_batch=8"):
        state.check_world(World(0, 4, 0, 1), 8, 4)
    with pytest.raises(PlanError, match="partitions=4.*partitions=8"):
        state.check_world(World(0, 4, 0, 1), 4, 8)
    worker_only = EpochState.from_dict(
        {
            **good_state(),
            "samples_seen": None,
            "worker": {"rank": 0, "world_size": 2, "worker": 1, "num_workers": 2, "chunk": 4, "next_item": 8},
        }
    )
    assert worker_only.resume(World(0, 2, 1, 2), chunk=4) == (8, 0)
    with pytest.raises(PlanError, match="num_workers=2"):
        worker_only.resume(World(0, 2, 1, 3), chunk=4)


def test_padding_repeats_the_start_of_the_epoch() -> None:
    plan = EpochPlan([4, 3], 3, Split())  # 7 samples, 3 ranks of 3: 2 repeats
    assert plan.per_rank == 3
    positions = np.concatenate([plan.rank_positions(r, 0, 3) for r in range(3)])
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1]
