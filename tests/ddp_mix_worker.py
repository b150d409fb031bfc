"""A DDP job reading a mixture (local tar + LMDB in a bucket), launched by tests/test_mix_ddp.py.

Usage: ``torchrun ... tests/ddp_mix_worker.py CONFIG.json``. Each rank trains a tiny
``DistributedDataParallel`` model (a gloo all-reduce per batch, so ranks with unequal
batch counts would hang) and records every batch's ``"<source>:<key>"`` strings; rank 0
writes all ranks' results to ``config["out"]``.

Config: ``{"tar": dir, "lmdb": url, "storage_options": {...}, "cache": dir, "out": path,
"epoch_size": N, "batch": B, "stop": k}``. Tasks run in order on every rank:

* epochs 0 and 1 with 2 persistent workers and ``set_epoch`` (the dataset is built before
  ``init_process_group``, as in tests/ddp_worker.py);
* epoch 0 stopped after ``stop`` steps, ``state_dict(samples_seen=stop * B * world)``, and
  a fresh dataset resumed from that state on 1 worker: the rest of the epoch.
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

from streamload import StorageConfig, Stream, StreamingDataset


def tag(sample: dict[str, Any]) -> str:
    return f"{sample['__source__']}:{sample['__key__']}"


def dataset(config: dict[str, Any]) -> StreamingDataset:
    streams = [
        Stream(config["tar"], weight=0.6, name="tar"),
        Stream(
            config["lmdb"], weight=0.4, name="lmdb", storage=StorageConfig(storage_options=config["storage_options"])
        ),
    ]
    return StreamingDataset(
        streams,
        epoch_size=config["epoch_size"],
        shuffle=True,
        seed=17,
        batch_size=config["batch"],
        transform=tag,
        storage=StorageConfig(cache_dir=config["cache"]),
    )


def train(model: DistributedDataParallel, opt: torch.optim.Optimizer, loader: Any, steps: int = -1) -> list[list[str]]:
    batches: list[list[str]] = []
    for keys in loader:
        if len(batches) == steps:
            break
        loss = model(torch.ones(len(keys), 1)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        batches.append(list(keys))
    return batches


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    batch = config["batch"]
    early = dataset(config)  # before init_process_group: the world is detected when iterating
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(early, batch_size=batch, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        early.set_epoch(epoch)
        epochs.append(train(model, opt, loader))
    stopped = dataset(config)
    seen = train(model, opt, DataLoader(stopped, batch_size=batch, num_workers=2), config["stop"])
    state = json.loads(json.dumps(stopped.state_dict(samples_seen=len(seen) * batch * world)))
    resumed = dataset(config)
    resumed.load_state_dict(state)
    rest = train(model, opt, DataLoader(resumed, batch_size=batch, num_workers=1))
    result = {"rank": dist.get_rank(), "len": len(early), "epochs": epochs, "seen": seen, "rest": rest}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        tmp = config["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(gathered, f)
        os.replace(tmp, config["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
