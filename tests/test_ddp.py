"""Real DDP jobs (torchrun, gloo on loopback): equal batches, exactly once, stop and resume.

Launches are few and each does many checks (process start + torch import cost seconds):

* 2 ranks: epochs with 0/2 workers, the dataset built before ``init_process_group``;
  2x2 runs stopped at the start, the middle, before the last step and at the epoch
  boundary, and each resumed on 2x2 (shuffle on and off).
* 3 ranks: epochs with 0/2 workers; the 2x2 states resumed on 3x1: the same global
  batches as the uninterrupted 2-rank run (the global batch, 12, is the same).
* in this process: the same states resumed on 1 rank x 3 workers, likewise.
* two "nodes" (two torchrun launchers on 127.0.0.1): one epoch with 2 workers, and one
  with spawned workers and no RANK/WORLD_SIZE variables (the world reaches the workers
  from the parent process).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from streamload import StreamingDataset
from tests.helpers.datasets import make_dataset
from tests.helpers.torchrun import LAUNCH_TIMEOUT, run_job

COUNTS = [17, 0, 23, 30, 1, 20, 10]
N = sum(COUNTS)  # 101: not a multiple of 2 or 3, so ranks need padding
ALL_KEYS = Counter(f"s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n))
GLOBAL_BATCH = 12  # 2 ranks x 6, 3 ranks x 4, 1 rank x 12
STOPS = [0, 4, 8, 9]  # steps: start, middle, before the last step, epoch boundary (108 = 9 * 12)
STEPS = -(-N // GLOBAL_BATCH)  # 9 whole global steps: 108 items, 7 padding repeats

pytestmark = [pytest.mark.slow]


def flat(batches: list[list[str]]) -> list[str]:
    return [k for b in batches for k in b]


def check_epoch(per_rank: list[dict[str, Any]], world_size: int, batch: int) -> None:
    """Equal batch counts, len() the per-rank count, union = the dataset plus the fewest repeats.

    ``batch`` per rank: the epoch is padded to whole global batches of ``batch * world_size``.
    """
    per = -(-N // (world_size * batch)) * batch
    assert [r["len"] for r in per_rank] == [per] * world_size
    assert len({len(r["batches"]) for r in per_rank}) == 1
    assert [len(flat(r["batches"])) for r in per_rank] == [per] * world_size
    union = Counter(k for r in per_rank for k in flat(r["batches"]))
    assert set(union) == set(ALL_KEYS)
    assert sum(union.values()) == per * world_size and max(union.values()) <= 2


def epoch_tasks(batch: int) -> list[dict[str, Any]]:
    return [
        {"kind": "epoch", "num_workers": 0, "batch": batch, "shuffle": False, "epoch": 0},
        {"kind": "epoch", "num_workers": 2, "batch": batch, "shuffle": True, "epoch": 3},
    ]


def stop_tasks() -> list[dict[str, Any]]:
    return [
        {"kind": "stop", "num_workers": 2, "batch": 6, "shuffle": shuffle, "steps": steps}
        for shuffle in (False, True)
        for steps in [-1, *STOPS]
    ]


def resume_in_process(data: Path, state: dict[str, Any], shuffle: bool) -> tuple[list[str], list[str]]:
    """Resume on 1 rank x 3 workers (plain DataLoader): the rest of the epoch, then the next."""
    ds = StreamingDataset(
        str(data),
        shuffle=shuffle,
        seed=21,
        batch_size=GLOBAL_BATCH,
        rank=0,
        world_size=1,
        transform=lambda s: s["__key__"],
    )
    ds.load_state_dict(state)
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH, num_workers=3)
    rest = flat([list(b) for b in loader])
    following = flat([list(b) for b in loader])
    return rest, following


def global_steps(per_rank: list[list[list[str]]]) -> list[list[str]]:
    """Each step's keys over all ranks, in rank order (``per_rank[r]`` is rank r's batches)."""
    assert len({len(b) for b in per_rank}) == 1, "every rank takes the same number of steps"
    return [[k for batches in per_rank for k in batches[i]] for i in range(len(per_rank[0]))]


def in_steps(keys: list[str], size: int) -> list[list[str]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_ddp_epochs_and_stop_resume_on_2_3_and_1_ranks(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "ds", COUNTS)
    stops = stop_tasks()
    first = len(epoch_tasks(5)) + 1
    resumes = [
        {"kind": "resume", "num_workers": 2, "batch": 6, "shuffle": t["shuffle"], "state_from": first + i}
        for i, t in enumerate(stops)
    ]
    fresh_next = {"kind": "epoch", "num_workers": 2, "batch": 6, "shuffle": True, "epoch": 1}
    two = run_job(tmp_path, "two", data, [*epoch_tasks(5), fresh_next, *stops, *resumes], nproc=2)
    for t in range(len(epoch_tasks(5))):
        check_epoch([rank[t] for rank in two], 2, 5)
    check_epoch([rank[len(epoch_tasks(5))] for rank in two], 2, 6)
    epoch1 = global_steps([rank[len(epoch_tasks(5))]["batches"] for rank in two])  # shuffled epoch 1, 2 x 6

    def full_steps(shuffle: bool) -> list[list[str]]:
        task = first + stops.index({"kind": "stop", "num_workers": 2, "batch": 6, "shuffle": shuffle, "steps": -1})
        return global_steps([rank[task]["batches"] for rank in two])

    states = {}
    for i, task in enumerate(stops):
        if task["steps"] < 0:
            continue
        shuffle, k = task["shuffle"], task["steps"]
        j = first + i
        full = [flat(rank[stops.index({**task, "steps": -1}) + first]["batches"]) for rank in two]
        seen = [flat(rank[j]["batches"]) for rank in two]
        rest = [flat(rank[j + len(stops)]["batches"]) for rank in two]
        assert seen == [f[: 6 * k] for f in full], "the interrupted run saw the uninterrupted prefix"
        assert len({json.dumps(rank[j]["state"], sort_keys=True) for rank in two}) == 1, (
            f"same state on all ranks, stop {task}: {[rank[j]['state'] for rank in two]}"
        )
        states[shuffle, k] = two[0][j]["state"]
        if k < STEPS:
            assert rest == [f[6 * k :] for f in full], "same world: exactly the unseen rest, in order"
            nxt = [flat(rank[j + len(stops)]["next"]) for rank in two]
            if shuffle:  # the interruption leaves the next epoch unchanged
                assert global_steps([in_steps(x, 6) for x in nxt]) == epoch1
        else:  # stopped at the epoch boundary: the resumed run is the whole next epoch
            assert states[shuffle, k]["epoch"] == 1 and states[shuffle, k]["samples_seen"] == 0
            assert rest == (full if not shuffle else [flat(rank[len(epoch_tasks(5))]["batches"]) for rank in two])

    three_resumes = [
        {"kind": "resume", "num_workers": 1, "batch": 4, "shuffle": shuffle, "state": state}
        for (shuffle, _), state in states.items()
    ]
    three = run_job(tmp_path, "three", data, [*epoch_tasks(4), *three_resumes], nproc=3)
    for t in range(len(epoch_tasks(4))):
        check_epoch([rank[t] for rank in three], 3, 4)

    for i, ((shuffle, k), state) in enumerate(states.items()):
        rest3 = global_steps([rank[len(epoch_tasks(4)) + i]["batches"] for rank in three])
        rest1, _ = resume_in_process(data, state, shuffle)
        if k == STEPS:  # the boundary: both resumed runs read the whole next epoch
            if shuffle:  # the same global batches as the 2-rank epoch 1
                assert rest3 == epoch1 and in_steps(rest1, GLOBAL_BATCH) == epoch1
            else:  # unshuffled: one block per rank, every sample once plus the fewest repeats
                check_epoch(
                    [{"len": 36, "batches": [flat([b[r * 4 : r * 4 + 4] for b in rest3])]} for r in range(3)], 3, 4
                )
                extra = Counter(rest1) - ALL_KEYS
                assert set(rest1) == set(ALL_KEYS) and sum(extra.values()) == 108 - N and max(extra.values()) == 1
            continue
        # Same global batch (12 = 2 x 6 = 3 x 4 = 1 x 12): exactly the uninterrupted run's remaining steps.
        assert rest3 == full_steps(shuffle)[k:], f"3 ranks resumed at step {k} (shuffle={shuffle})"
        assert in_steps(rest1, GLOBAL_BATCH) == full_steps(shuffle)[k:], f"1 rank x 3 workers resumed at {k}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "ds", COUNTS)
    tasks = [
        {"kind": "epoch", "num_workers": 2, "batch": 5, "shuffle": True, "epoch": 1},
        {"kind": "epoch", "num_workers": 2, "batch": 5, "shuffle": False, "epoch": 0, "spawn": True},
    ]
    ranks = run_job(tmp_path, "nodes", data, tasks, nproc=1, nnodes=2)
    check_epoch([rank[0] for rank in ranks], 2, 5)
    check_epoch([rank[1] for rank in ranks], 2, 5)
