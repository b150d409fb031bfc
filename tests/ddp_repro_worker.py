"""A torchrun job for the reproducibility tests: each step's global batch and augmentations.

Usage: ``torchrun ... tests/ddp_repro_worker.py CONFIG.json``. Every rank reads the
dataset ``config["data"]`` shuffled with a fixed seed, ``batch_size = global_batch //
world_size``, each batch collated in the DataLoader worker by :class:`DecodeBatch` with a
random-resized crop and a random flip; for every batch it records the keys and a hash of
every decoded image tensor, and takes one gloo all-reduce step (ranks with unequal batch
counts would hang). Rank 0 writes every rank's results to ``config["out"]`` as JSON.

Tasks (run in order):
    {"kind": "epochs", "num_workers": W, "epochs": [0, 1], "persistent": bool}
        whole epochs (``set_epoch`` before each).
    {"kind": "stop", "num_workers": W, "steps": k}
        k steps of epoch 0, then ``state_dict(samples_seen=k * global_batch)``.
    {"kind": "resume", "num_workers": W, "state": {...}}
        ``load_state_dict(state)``, then the rest of that epoch.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from ddp_worker import finish  # this script's folder is first on sys.path (torchrun runs it by path)
from torch.utils.data import DataLoader

from streamload import StreamingDataset
from streamload.decode import DecodeBatch

SEED = 7


class KeysAndHashes:
    """Collate: the batch's keys and a hash of each image decoded by DecodeBatch (random crop + flip)."""

    def __init__(self) -> None:
        self.decode = DecodeBatch(24, crop="random", flip=True, seed=11)

    def __call__(self, samples: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
        batch = self.decode(samples)
        images = batch.images.contiguous()
        hashes = [hashlib.sha1(images[i].numpy().tobytes()).hexdigest()[:16] for i in range(len(samples))]
        return [s["__key__"] for s in samples], hashes


def dataset(data: str, global_batch: int) -> StreamingDataset:
    batch = global_batch // dist.get_world_size()
    return StreamingDataset(data, shuffle=True, seed=SEED, batch_size=batch, collate=KeysAndHashes())


def steps(ds: StreamingDataset, loader: DataLoader[Any], limit: int = -1) -> list[list[list[str]]]:
    out: list[list[list[str]]] = []
    for keys, hashes in loader:
        if len(out) == limit:
            break
        signal = torch.ones(1)
        dist.all_reduce(signal)  # a DDP step: every rank must have a batch here
        out.append([list(keys), list(hashes)])
    return out


def run_task(task: dict[str, Any], data: str, global_batch: int) -> dict[str, Any]:
    ds = dataset(data, global_batch)
    workers = task["num_workers"]
    loader = DataLoader(
        ds, batch_size=None, num_workers=workers, persistent_workers=bool(task.get("persistent")) and workers > 0
    )
    if task["kind"] == "epochs":
        epochs = {}
        for epoch in task["epochs"]:
            ds.set_epoch(epoch)
            epochs[str(epoch)] = steps(ds, loader)
        return {"epochs": epochs}
    if task["kind"] == "stop":
        done = steps(ds, loader, task["steps"])
        return {"state": json.loads(json.dumps(ds.state_dict(samples_seen=len(done) * global_batch)))}
    ds.load_state_dict(task["state"])
    return {"rest": steps(ds, loader)}


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    dist.init_process_group("gloo")
    results = [run_task(task, config["data"], config["global_batch"]) for task in config["tasks"]]
    finish(config["out"], results)


if __name__ == "__main__":
    main()
