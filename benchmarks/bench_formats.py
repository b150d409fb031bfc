"""Shard formats side by side: conversion speed, read speed, size, next to the disk's own speed.

One command::

    python benchmarks/bench_formats.py                 # 3000 JPEGs of ~50 KB, page cache warm
    python benchmarks/bench_formats.py --cold          # evict the shards before every read
    python benchmarks/bench_formats.py --images 10000 --json out.json

Steps, all in one run on this machine:

1. A folder of synthetic JPEGs (``streamload.synthetic``; ~400x300, mean ~50 KB), cached
   under ``benchmarks/out``.
2. For each format: ``convert`` the folder (2 processes, no image check, so the number is
   the format's writing speed) -> conversion MB/s of payload, on-disk size.
3. ``raw``: plain sequential ``read()`` of the same shard files in 1 MiB chunks: the
   ceiling any format could reach here.
4. Reading every sample as raw bytes: the format reader alone (``iter_range``, one
   process), and ``StreamingDataset`` through a ``DataLoader`` with 0 and 2 workers
   (batches of 64 sample dicts; workers persistent, timed on the second epoch so worker
   start-up is not counted).
5. For HDF5, the two ways to read a field: ``os.pread`` at the dataset's file offset (what
   the reader does) against an h5py slice.

Each read number is the median of ``--repeat`` runs. With ``--cold`` the shard files are
evicted from the page cache (``posix_fadvise(DONTNEED)``, no root needed) before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from torch.utils.data import DataLoader

from streamload import StreamingDataset
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.formats import get_format
from streamload.manifest import Manifest
from streamload.synthetic import make_image_folder

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
FORMATS = ("tar", "lmdb", "hdf5")
CLASSES = 10


# -- data ----------------------------------------------------------------------------


def _make_class(args: tuple[str, int, int]) -> None:
    root, label, per_class = args
    tmp = os.path.join(root, f".tmp-{label}")
    make_image_folder(tmp, num_classes=1, per_class=per_class, size=(400, 300), seed=label, noise=12.0)
    os.replace(os.path.join(tmp, "class_000"), os.path.join(root, f"class_{label:03d}"))
    os.rmdir(tmp)


def image_folder(num_images: int) -> str:
    """Return a cached folder of ``num_images`` synthetic JPEGs in 10 classes."""
    root = os.path.join(OUT, f"formats-images-{num_images}")
    if os.path.exists(os.path.join(root, ".done")):
        return root
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    per_class = num_images // CLASSES
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(_make_class, [(root, c, per_class) for c in range(CLASSES)]))
    open(os.path.join(root, ".done"), "w").close()
    return root


def dataset_files(root: str) -> list[str]:
    """Shard and sidecar paths of a dataset, in manifest order."""
    with open(os.path.join(root, "index.json"), "rb") as f:
        manifest = Manifest.loads(f.read())
    paths = []
    for s in manifest.shards:
        paths.append(os.path.join(root, s.name))
        if s.sidecar:
            paths.append(os.path.join(root, s.sidecar.name))
    return paths


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (clean pages; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- measurements ------------------------------------------------------------------------


def timed(fn: Callable[[], tuple[int, int]], repeat: int, before: Callable[[], None]) -> dict[str, float]:
    """Run ``fn`` -> (samples, bytes) ``repeat`` times; return median samples/s and MB/s."""
    rates, mbs = [], []
    for _ in range(repeat):
        before()
        start = time.perf_counter()
        samples, nbytes = fn()
        seconds = time.perf_counter() - start
        rates.append(samples / seconds)
        mbs.append(nbytes / seconds / 1e6)
    return {"samples_per_s": statistics.median(rates), "mb_per_s": statistics.median(mbs)}


def raw_read(paths: list[str]) -> tuple[int, int]:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return 0, total


def payload(sample: dict[str, Any]) -> int:
    return sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def reader_read(root: str) -> tuple[int, int]:
    """Every sample through the format reader alone, shard by shard."""
    with open(os.path.join(root, "index.json"), "rb") as f:
        manifest = Manifest.loads(f.read())
    fmt = get_format(manifest.format)
    samples = nbytes = 0
    for entry in manifest.shards:
        sidecar = os.path.join(root, entry.sidecar.name) if entry.sidecar else None
        reader = fmt.reader(os.path.join(root, entry.name), entry, sidecar)
        try:
            for sample in reader.iter_range(0, len(reader)):
                samples += 1
                nbytes += payload(sample)
        finally:
            reader.close()
    return samples, nbytes


def as_list(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def loader_read(loader: DataLoader[Any]) -> tuple[int, int]:
    samples = nbytes = 0
    for batch in loader:
        samples += len(batch)
        nbytes += sum(payload(s) for s in batch)
    return samples, nbytes


def bench_loader(root: str, workers: int, repeat: int, before: Callable[[], None]) -> dict[str, float]:
    ds = StreamingDataset(root)
    loader = DataLoader(
        ds,
        batch_size=64,
        num_workers=workers,
        collate_fn=as_list,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )
    loader_read(loader)  # start the workers, warm up
    return timed(lambda: loader_read(loader), repeat, before)


def hdf5_paths(root: str) -> dict[str, float]:
    """samples/s reading the ``jpg`` field of every sample: pread at the dataset offset vs an h5py slice."""
    import h5py

    with open(os.path.join(root, "index.json"), "rb") as f:
        manifest = Manifest.loads(f.read())
    out: dict[str, float] = {}
    for how in ("pread", "h5py_slice"):
        count, start = 0, time.perf_counter()
        for entry in manifest.shards:
            path = os.path.join(root, entry.name)
            with h5py.File(path, "r") as h5:
                names = json.loads(h5.attrs["streamload"])["fields"]
                ds = h5[f"fields/{names.index('jpg')}/data"]
                offsets = h5[f"fields/{names.index('jpg')}/offsets"][()].tolist()
                base = ds.id.get_offset()
                fd = os.open(path, os.O_RDONLY)
                try:
                    for i in range(len(offsets) - 1):
                        a, b = offsets[i], offsets[i + 1]
                        data = os.pread(fd, b - a, base + a) if how == "pread" else ds[a:b].tobytes()
                        count += len(data) > 0
                finally:
                    os.close(fd)
        out[how] = count / (time.perf_counter() - start)
    return out


# -- driver ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    src = image_folder(args.images)
    print(f"image folder: {src} ({time.perf_counter() - t0:.1f} s)", flush=True)
    results: dict[str, Any] = {"machine": machine(), "images": args.images, "formats": {}}
    print(HEADER)
    for fmt in args.formats:
        root = os.path.join(OUT, f"formats-{args.images}-{fmt}")
        shutil.rmtree(root, ignore_errors=True)
        source = ImageFolderSource(src, check="none")
        report = convert(
            source,
            root,
            ConvertOptions(
                format=fmt, shard_bytes=args.shard_size, workers=2, hash_algorithm="xxh3_128", progress=False
            ),
        )
        paths = dataset_files(root)
        before = (lambda p=paths: evict(p)) if args.cold else (lambda: None)
        row: dict[str, Any] = {
            "convert_mb_per_s": report.payload_bytes / report.seconds / 1e6,
            "convert_samples_per_s": report.manifest.num_samples / report.seconds,
            "payload_mb": report.payload_bytes / 1e6,
            "disk_mb": sum(os.path.getsize(p) for p in paths) / 1e6,
            "shards": len(report.manifest.shards),
        }
        row["raw_read_mb_per_s"] = timed(lambda p=paths: raw_read(p), args.repeat, before)["mb_per_s"]
        row["reader"] = timed(lambda r=root: reader_read(r), args.repeat, before)
        for workers in (0, 2):
            row[f"loader_{workers}w"] = bench_loader(root, workers, args.repeat, before)
        if fmt == "hdf5":
            row["hdf5_field_read_samples_per_s"] = hdf5_paths(root)
        results["formats"][fmt] = row
        print_row(fmt, row)
    return results


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


HEADER = (
    f"{'format':<6} {'convert':>14} {'disk MB':>8} {'raw read':>10} {'reader':>20} "
    f"{'loader 0 workers':>20} {'loader 2 workers':>20}"
)


def print_row(fmt: str, row: dict[str, Any]) -> None:
    def rate(r: dict[str, float]) -> str:
        return f"{r['samples_per_s']:>7.0f}/s {r['mb_per_s']:>6.0f}MB/s"

    print(
        f"{fmt:<6} {row['convert_mb_per_s']:>9.1f} MB/s {row['disk_mb']:>8.1f} "
        f"{row['raw_read_mb_per_s']:>5.0f} MB/s {rate(row['reader']):>20} "
        f"{rate(row['loader_0w']):>20} {rate(row['loader_2w']):>20}",
        flush=True,
    )
    if "hdf5_field_read_samples_per_s" in row:
        h = row["hdf5_field_read_samples_per_s"]
        print(f"       hdf5 field read: pread {h['pread']:.0f}/s, h5py slice {h['h5py_slice']:.0f}/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--images", type=int, default=3000, help="number of JPEGs (default 3000)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--shard-size", default="32MB", help="payload per shard (default 32MB)")
    p.add_argument("--repeat", type=int, default=3, help="runs per read measurement (median)")
    p.add_argument("--cold", action="store_true", help="evict shards from the page cache before each read")
    p.add_argument("--json", help="also write the results as JSON here")
    args = p.parse_args()
    print(
        f"streamload format benchmark: {args.images} JPEGs, shards of {args.shard_size}, "
        f"{'cold' if args.cold else 'warm'} page cache, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} (other work on the machine skews every number)",
        flush=True,
    )
    results = run(args)
    results["load_average_after"] = os.getloadavg()[0]
    print(f"load average after: {results['load_average_after']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
