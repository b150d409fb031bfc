"""Real DDP jobs (torchrun, gloo on loopback): equal batches, exactly once, stop and resume.

Launches are few and each does many checks (process start + torch import cost seconds):

* 2 ranks: epochs with 0/2 workers, the dataset built before ``init_process_group``;
  2x2 runs stopped at the start, the middle, inside the last batch and at the epoch
  boundary, and each resumed on 2x2 (shuffle on and off).
* 3 ranks: epochs with 0/2 workers; the 2x2 states resumed on 3x1.
* in this process: the same states resumed on 1 rank x 3 workers.
* two "nodes" (two torchrun launchers on 127.0.0.1): one epoch with 2 workers, and one
  with spawned workers and no RANK/WORLD_SIZE variables (the world reaches the workers
  from the parent process).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from streamload import StreamingDataset
from tests.test_split_basic import make_dataset

COUNTS = [17, 0, 23, 30, 1, 20, 10]
N = sum(COUNTS)  # 101: not a multiple of 2 or 3, so ranks need padding
ALL_KEYS = Counter(f"s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n))
WORKER = str(Path(__file__).with_name("ddp_worker.py"))
GLOBAL_BATCH = 12  # 2 ranks x 6, 3 ranks x 4, 1 rank x 12
STOPS = [0, 4, 8, 9]  # steps: start, middle, inside the last batch, epoch boundary (51 = 8*6 + 3)
LAUNCH_TIMEOUT = 200

pytestmark = [pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(config: Path, nproc: int, port: int, nnodes: int = 1, node_rank: int = 0) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if nnodes == 1:  # the launcher binds a free port itself: no race for the port
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *where, WORKER, str(config)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def run_job(tmp: Path, name: str, data: Path, tasks: list[dict[str, Any]], nproc: int, nnodes: int = 1) -> Any:
    config, out = tmp / f"{name}.json", tmp / f"{name}-out.json"
    config.write_text(json.dumps({"data": str(data), "out": str(out), "tasks": tasks}))
    port = free_port()
    procs = [torchrun(config, nproc, port, nnodes, node) for node in range(nnodes)]
    logs = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
            logs.append(stdout.decode(errors="replace")[-4000:])
    finally:
        for proc in procs:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    result = json.loads(out.read_text())
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(nproc * nnodes))
    return [r["results"] for r in ranks]  # [rank][task]


def flat(batches: list[list[str]]) -> list[str]:
    return [k for b in batches for k in b]


def check_epoch(per_rank: list[dict[str, Any]], world_size: int) -> None:
    """Equal batch counts, len() the per-rank count, union = the dataset plus the fewest repeats."""
    per = -(-N // world_size)
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
    for t in range(len(epoch_tasks(5)) + 1):
        check_epoch([rank[t] for rank in two], 2)

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
        assert len({json.dumps(rank[j]["state"], sort_keys=True) for rank in two}) == 1, "same state on all ranks"
        states[shuffle, k] = two[0][j]["state"]
        if 6 * k < 51:
            assert rest == [f[6 * k :] for f in full], "same world: exactly the unseen rest, in order"
            nxt = [flat(rank[j + len(stops)]["next"]) for rank in two]
            if shuffle:  # the interruption leaves the next epoch unchanged
                assert nxt == [flat(rank[len(epoch_tasks(5))]["batches"]) for rank in two]
        else:  # stopped at the epoch boundary: the resumed run is the whole next epoch
            assert states[shuffle, k]["epoch"] == 1 and states[shuffle, k]["samples_seen"] == 0
            epoch1 = [flat(rank[len(epoch_tasks(5))]["batches"]) for rank in two] if shuffle else full
            assert rest == epoch1

    three_resumes = [
        {"kind": "resume", "num_workers": 1, "batch": 4, "shuffle": shuffle, "state": state}
        for (shuffle, _), state in states.items()
    ]
    three = run_job(tmp_path, "three", data, [*epoch_tasks(4), *three_resumes], nproc=3)
    for t in range(len(epoch_tasks(4))):
        check_epoch([rank[t] for rank in three], 3)

    for i, ((shuffle, k), state) in enumerate(states.items()):
        full_epoch = Counter(
            k2
            for rank in two
            for k2 in flat(
                rank[
                    first + stops.index({"kind": "stop", "num_workers": 2, "batch": 6, "shuffle": shuffle, "steps": -1})
                ]["batches"]
            )
        )
        seen_count = Counter(
            k2
            for rank in two
            for k2 in flat(
                rank[
                    first + stops.index({"kind": "stop", "num_workers": 2, "batch": 6, "shuffle": shuffle, "steps": k})
                ]["batches"]
            )
        )
        rest3 = [flat(rank[len(epoch_tasks(4)) + i]["batches"]) for rank in three]
        assert len({len(r) for r in rest3}) == 1, "resumed ranks are equal"
        rest1, _ = resume_in_process(data, state, shuffle)
        if k == 0 or 6 * k >= 51:  # nothing read yet, or boundary: the resumed runs are a whole epoch
            check_epoch([{"len": 34, "batches": [r]} for r in rest3], 3)
            assert Counter(rest1) == ALL_KEYS
            continue
        remaining = 2 * (51 - 6 * k)
        assert len(rest3[0]) == -(-remaining // 3)
        union3 = seen_count + Counter(k2 for r in rest3 for k2 in r)
        assert not full_epoch - union3, "every unseen sample is read after resuming on 3 ranks"
        assert sum((union3 - full_epoch).values()) == 3 * len(rest3[0]) - remaining
        assert seen_count + Counter(rest1) == full_epoch, "1 rank x 3 workers: exactly the unseen rest"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "ds", COUNTS)
    tasks = [
        {"kind": "epoch", "num_workers": 2, "batch": 5, "shuffle": True, "epoch": 1},
        {"kind": "epoch", "num_workers": 2, "batch": 5, "shuffle": False, "epoch": 0, "spawn": True},
    ]
    ranks = run_job(tmp_path, "nodes", data, tasks, nproc=1, nnodes=2)
    check_epoch([rank[0] for rank in ranks], 2)
    check_epoch([rank[1] for rank in ranks], 2)
