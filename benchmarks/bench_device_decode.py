"""Decoding on the GPU: ``DeviceDecode``'s decode-only rate, and a model fed by it.

Usage::

    python benchmarks/bench_device_decode.py                    # a GPU machine (device="cuda")
        [--images 2048] [--batch 256] [--size 224] [--workers 4,16] [--steps 60] [--out FILE.json]
    python benchmarks/bench_device_decode.py --small            # anywhere: device="cpu", small figures

Data: the benchmarks' ImageNet-like JPEGs (``benchmarks/_data.py``: ~500x375, ~65 KB),
tar shards, shuffled, random-resized crop ``--size`` and flip.

1. **Decode only.** The epoch's raw batches are read into memory first (no I/O in the
   figure); then images/s of ``DeviceDecode`` over them (every batch decoded, cropped,
   resized, flipped; on CUDA timed to a ``torch.cuda.synchronize()``), with the decoder
   its ``repr`` names and the images it sent to the CPU; beside it, on the same batches,
   ``DecodeBatch`` on one core of this process (the CPU path, per core).
2. **Fed to a model.** A training step (ResNet-50, bf16, channels_last on CUDA when
   torchvision is installed; otherwise, and with ``--small``, a small CNN) on synthetic
   batches already on the device gives the ceiling in images/s. Then the same step fed by
   ``DeviceDecode.iterate(DataLoader(RawCollate batches, num_workers=w))`` and by
   ``DataLoader(num_workers=w)`` + ``DecodeBatch`` (copied by ``DevicePrefetcher``), for
   each ``w`` of ``--workers``: images/s after the first batch, the share of the ceiling,
   the loop's waiting share (``streamload.watch``), and the CPU the training process
   itself used (its CPU seconds per second: what DeviceDecode costs the host).

Numbers are printed as a table and, with ``--out``, written as JSON with the machine's
description. On a CPU-only machine (``--small``) the "device" is the CPU: the figures say
what that machine does, nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _data import dataset  # noqa: E402

from streamload import DeviceDecode, DevicePrefetcher, StreamingDataset, watch  # noqa: E402
from streamload.batch import RawBatch, RawCollate  # noqa: E402
from streamload.decode import DecodeBatch  # noqa: E402

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_dataset(root: str, batch: int, **kw: Any) -> StreamingDataset:
    return StreamingDataset(root, batch_size=batch, shuffle=True, seed=1, collate=RawCollate(), **kw)


def decode_only(root: str, batch: int, size: int, device: str, repeats: int) -> dict[str, Any]:
    """Images/s of DeviceDecode over in-memory raw batches, and of DecodeBatch on one core."""
    raws: list[RawBatch] = [b for b in raw_dataset(root, batch)]
    count = sum(len(b) for b in raws)
    dev = DeviceDecode(size, crop="random", flip=True, device=device)
    target = dev.device
    dev(raws[0])  # warm: decoder, allocator, kernels
    _sync(target)
    start = time.perf_counter()
    for _ in range(repeats):
        for raw in raws:
            dev(raw)
    _sync(target)
    rate = repeats * count / (time.perf_counter() - start)
    cpu = DecodeBatch(size, crop="random", flip=True, label_field=None)
    samples = [
        [{"__key__": str(i), "jpg": raw.tobytes(i), "__epoch__": 0, "__position__": i} for i in range(len(raw))]
        for raw in raws[: max(1, min(len(raws), 4))]
    ]
    start = time.perf_counter()
    cpu_count = 0
    for group in samples:
        cpu(group)
        cpu_count += len(group)
    cpu_rate = cpu_count / (time.perf_counter() - start)
    return {
        "decoder": repr(dev),
        "decoder_name": dev.decoder_name,
        "images": repeats * count,
        "images_per_s": rate,
        "fallbacks": dev.fallbacks.value,
        "decode_batch_one_core_images_per_s": cpu_rate,
    }


def _model(name: str, device: torch.device) -> tuple[torch.nn.Module, str]:
    if name == "resnet50":
        try:
            from torchvision.models import resnet50

            return resnet50().to(device), "resnet50 (torchvision)"
        except Exception as exc:  # noqa: BLE001 - no torchvision, or one built for another torch
            print(f"  torchvision's resnet50 unavailable ({exc}); a small CNN instead", flush=True)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 10),
    )
    return net.to(device), "small CNN"


class Trainer:
    """One training step of the model on ``(images, labels)`` already on the device."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.device = device
        model, self.name = _model(name, device)
        self.model = model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype == torch.uint8:
            images = ((images.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            out = self.model(images)
            loss = torch.nn.functional.cross_entropy(out.float(), labels % out.shape[1])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def _run(trainer: Trainer, batches: Iterable[Any], steps: int) -> dict[str, float]:
    """Images/s over ``steps`` steps after the first batch, the wait share, the process's CPU per second."""
    watched = watch(batches)
    done = images = 0
    start = cpu0 = 0.0
    while done <= steps:
        for batch in watched:
            x, y = batch
            trainer.step(x, y)
            if done == 0:
                _sync(trainer.device)
                start, cpu0 = time.perf_counter(), time.process_time()
            else:
                images += int(x.shape[0])
            done += 1
            if done > steps:
                break
    _sync(trainer.device)
    wall = time.perf_counter() - start
    report = watched.report()
    return {
        "images_per_s": images / wall,
        "waiting": report.wait_fraction,
        "main_cpu_per_s": (time.process_time() - cpu0) / wall,
        "device_decode_s": report.device_stages.get("decode", 0.0),
    }


def ceiling(trainer: Trainer, batch: int, size: int, steps: int) -> float:
    x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=trainer.device)
    y = torch.randint(0, 1000, (batch,), device=trainer.device)

    def forever() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield x, y

    return _run(trainer, forever(), steps)["images_per_s"]


def fed(
    root: str, trainer: Trainer, batch: int, size: int, device: str, workers: list[int], steps: int
) -> list[dict[str, Any]]:
    from torch.utils.data import DataLoader

    rows = []
    cuda = trainer.device.type == "cuda"

    def loader(collate: Any, w: int) -> DataLoader[Any]:
        return DataLoader(
            StreamingDataset(root, batch_size=batch, shuffle=True, seed=1, collate=collate),
            batch_size=None,
            num_workers=w,
            pin_memory=cuda,
            persistent_workers=w > 0,
        )

    for w in workers:
        decode = DeviceDecode(size, crop="random", flip=True, device=device, mean=MEAN, std=STD, channels_last=True)
        figures = _run(trainer, decode.iterate(loader(RawCollate(), w)), steps)
        rows.append({"path": f"DeviceDecode ({decode.decoder_name})", "workers": w, **figures})
        cpu_path = DevicePrefetcher(loader(DecodeBatch(size, crop="random", flip=True), w), trainer.device)
        rows.append({"path": "DecodeBatch", "workers": w, **_run(trainer, cpu_path, steps)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a quick run anywhere: device=cpu, small data")
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--workers", default="4,16")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="decode-only passes over the batches")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.small:
        args.images, args.batch, args.size, args.steps, args.repeats = 256, 32, 64, 8, 1
        args.workers, args.model = "0,2", "small"
        args.device = args.device or "cpu"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    workers = [int(w) for w in args.workers.split(",")]
    root = dataset(args.images, "tar", samples_per_shard=256)
    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "device": device,
    }
    print(f"machine: {machine}", flush=True)
    only = decode_only(root, args.batch, args.size, device, args.repeats)
    print(
        f"decode only ({only['images']} images, batch {args.batch}, {args.size}px): "
        f"{only['images_per_s']:,.0f} images/s by {only['decoder_name']} ({only['fallbacks']} on the CPU); "
        f"DecodeBatch on one core: {only['decode_batch_one_core_images_per_s']:,.0f} images/s",
        flush=True,
    )
    trainer = Trainer(args.model, torch.device(DeviceDecode(8, device=device).device))
    top = ceiling(trainer, args.batch, args.size, args.steps)
    print(f"model: {trainer.name}; ceiling (synthetic batches on the device): {top:,.0f} images/s", flush=True)
    rows = fed(root, trainer, args.batch, args.size, device, workers, args.steps)
    print(f"{'path':<34} {'workers':>7} {'images/s':>10} {'of ceiling':>10} {'waiting':>8} {'main CPU':>9}")
    for row in rows:
        row["of_ceiling"] = row["images_per_s"] / top
        print(
            f"{row['path']:<34} {row['workers']:>7} {row['images_per_s']:>10,.0f} {row['of_ceiling']:>10.2f} "
            f"{row['waiting']:>8.0%} {row['main_cpu_per_s']:>9.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "decode_only": only, "ceiling": top, "fed": rows}, f)


if __name__ == "__main__":
    main()
