"""A DDP training job for the multi-process tests, launched with ``torchrun``.

Usage: ``torchrun ... tests/ddp_worker.py CONFIG.json``. The config lists tasks; each
rank runs them in order with a real ``DistributedDataParallel`` model step (a gloo
all-reduce) per batch, so ranks with unequal batch counts would hang. Rank 0 writes every
rank's results to ``config["out"]`` as JSON.

Tasks:
    {"kind": "epoch", "num_workers": W, "batch": B, "shuffle": bool, "epoch": e}
        one epoch; the dataset is built *before* ``init_process_group``. With
        ``"spawn": true`` the workers are spawned and RANK/WORLD_SIZE are removed first.
    {"kind": "stop", "num_workers": W, "batch": B, "shuffle": bool, "steps": k}
        k steps, then ``state_dict(samples_seen=k * B * world_size)``; k = -1 runs the
        whole epoch (the uninterrupted order).
    {"kind": "resume", "num_workers": W, "batch": B, "shuffle": bool, "state": {...}}
        ``load_state_dict(state)``, then the rest of the epoch, then one more epoch;
        ``"state_from": i`` instead takes the state saved by task ``i`` of this launch.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from streamload import StreamingDataset

SEED = 21


def key_of(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def make_dataset(data: str, task: dict[str, Any]) -> StreamingDataset:
    return StreamingDataset(
        data,
        shuffle=task["shuffle"],
        seed=SEED,
        batch_size=task["batch"],
        transform=key_of,
        shuffle_window=task.get("window"),
    )


def train(
    model: DistributedDataParallel, opt: torch.optim.Optimizer, loader: DataLoader[Any], steps: int = -1
) -> list[list[str]]:
    """Run DDP steps over ``loader`` (all of it when ``steps < 0``); return the batches' keys."""
    batches: list[list[str]] = []
    for keys in loader:
        if len(batches) == steps:
            break
        x = torch.ones(len(keys), 1)
        loss = model(x).sum()
        loss.backward()  # all-reduce over the ranks
        opt.step()
        opt.zero_grad()
        batches.append(list(keys))
    return batches


def loader_for(ds: StreamingDataset, task: dict[str, Any]) -> DataLoader[Any]:
    if task.get("spawn"):
        # Like a job started by torch.multiprocessing.spawn: no RANK/WORLD_SIZE variables, and
        # spawned workers without torch.distributed; they must get the world from the parent.
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(name, None)
        return DataLoader(
            ds, batch_size=task["batch"], num_workers=task["num_workers"], multiprocessing_context="spawn"
        )
    return DataLoader(ds, batch_size=task["batch"], num_workers=task["num_workers"])


def run_task(
    task: dict[str, Any],
    ds: StreamingDataset | None,
    data: str,
    model: DistributedDataParallel,
    opt: torch.optim.Optimizer,
    done: list[dict[str, Any]],
) -> dict[str, Any]:
    world = dist.get_world_size()
    if task["kind"] == "epoch":
        assert ds is not None
        ds.set_epoch(task["epoch"])
        return {"len": len(ds), "batches": train(model, opt, loader_for(ds, task))}
    ds = make_dataset(data, task)
    if task["kind"] == "stop":
        batches = train(model, opt, loader_for(ds, task), task["steps"])
        state = ds.state_dict(samples_seen=len(batches) * task["batch"] * world)
        return {"batches": batches, "state": json.loads(json.dumps(state))}
    state = task["state"] if "state" in task else done[task["state_from"]]["state"]
    ds.load_state_dict(state)
    loader = loader_for(ds, task)
    rest = train(model, opt, loader)
    following = train(model, opt, loader)
    return {"batches": rest, "next": following, "next_epoch": ds.epoch}


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    data, tasks = config["data"], config["tasks"]
    # Built before init_process_group: the world must be detected when iterating.
    early = [make_dataset(data, t) if t["kind"] == "epoch" else None for t in tasks]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    results: list[dict[str, Any]] = []
    for task, ds in zip(tasks, early, strict=True):
        results.append(run_task(task, ds, data, model, opt, results))
    finish(config["out"], results)


def finish(out: str, results: list[dict[str, Any]]) -> None:
    """Gather every rank's results; rank 0 writes them to ``out`` (JSON); end the process group."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "results": results})
    if dist.get_rank() == 0:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "ranks": gathered}, f)
        os.replace(tmp, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
