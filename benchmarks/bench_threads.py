"""Threads against worker processes: ``streamload.Loader`` beside the DataLoader and peers.

Usage: ``python benchmarks/bench_threads.py [--images 1280] [--rounds 2] [--out FILE.json]``

Every row runs in a fresh Python process (what a training job pays: imports, the first
batch, its memory); this process polls the row's PSS (process and all its children,
``psutil``'s ``memory_full_info().pss``) every 50 ms and keeps the peak. Rows, on the
same ImageNet-like photo-like JPEGs (~500x375, ~50 KB; :func:`streamload.synthetic.synthetic_jpeg`),
shuffled, batch 64:

- decode: ``DecodeBatch(160, crop="random")`` through ``Loader(threads=2/4/8)``,
  ``DataLoader(num_workers=0/2/4/8)``, and torchdata.nodes'
  ``ParallelMapper(method="thread")`` (per-sample decode on 2/4/8 threads over the
  dataset's samples, then batched and stacked); SPDL's pipeline when ``spdl`` imports;
- bytes: ``RawCollate()`` through ``Loader`` and ``DataLoader``;
- python: a per-sample transform that runs ~0.3 ms of Python (the GIL's case) and
  ``RawCollate``, through ``Loader(threads=2)`` and ``DataLoader(num_workers=2)``.

And the machine's limits: Pillow decode + resize of the same files on 1 thread and on
2 threads (a ``ThreadPoolExecutor``), no loader at all.

Each figure is samples per second over one epoch after the first batch, the first batch's
time from the start of the iteration (dataset built, imports done), and the peak PSS.
The load average is printed with the figures: on a busy machine they are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
BATCH = 64
SIZE = 160
#: ~500x375 +-30 %, noise giving ~50 KB files at quality 90.
MEAN = (500, 375)
NOISE = 6.0


def dataset_root(images: int) -> str:
    """Build (once) the image folder and its tar dataset; return the dataset folder."""
    from streamload.converters import ConvertOptions, ImageFolderSource, convert
    from streamload.synthetic import synthetic_jpeg

    root = os.path.join(OUT, f"threads-{images}")
    ds = os.path.join(root, "ds")
    if os.path.exists(os.path.join(ds, "index.json")):
        return ds
    folder = os.path.join(root, "images")
    rng = np.random.default_rng(0)
    for i in range(images):
        cls = os.path.join(folder, f"class_{i % 10:03d}")
        os.makedirs(cls, exist_ok=True)
        scale = rng.uniform(0.7, 1.3)
        data = synthetic_jpeg(rng, int(MEAN[0] * scale), int(MEAN[1] * scale), quality=90, noise=NOISE)
        with open(os.path.join(cls, f"img_{i:06d}.jpg"), "wb") as f:
            f.write(data)
    convert(ImageFolderSource(folder), ds, ConvertOptions(samples_per_shard=500, progress=False))
    return ds


# -- one row, in its own process --------------------------------------------------------


def _python_heavy(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform that holds the GIL ~0.3 ms per sample (pure Python arithmetic)."""
    total = 0
    for i in range(6000):
        total += i * i
    sample["__work__"] = total
    return sample


def _dataset(root: str, mode: str, collate: bool = True) -> Any:
    from streamload import StreamingDataset
    from streamload.batch import RawCollate
    from streamload.decode import DecodeBatch

    transform = _python_heavy if mode == "python" else None
    made = DecodeBatch(SIZE, crop="random") if mode == "decode" else RawCollate()
    return StreamingDataset(
        root, shuffle=True, seed=0, batch_size=BATCH, collate=made if collate else None, transform=transform
    )


def _per_sample() -> tuple[Any, Any]:
    """The peers' work: one sample decoded (the same decoder and crop key as DecodeBatch), a batch stacked."""
    import torch

    from streamload.decode import ImageDecoder

    decoder = ImageDecoder(SIZE, crop="random")

    def decode(sample: dict[str, Any]) -> tuple[np.ndarray, int]:
        out = np.empty(decoder.shape, dtype=np.uint8)
        decoder.decode_into(sample["jpg"], out, np.random.default_rng(sample["__position__"]))
        return out, int(sample["cls"])

    def stack(items: list[tuple[np.ndarray, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.stack([i[0] for i in items])), torch.tensor([i[1] for i in items])

    return decode, stack


def _nodes(root: str, threads: int) -> Any:
    """torchdata.nodes: the dataset's samples, decoded one by one on ``threads`` threads, batched."""
    from torchdata.nodes import Batcher, IterableWrapper, Loader, Mapper, ParallelMapper

    decode, stack = _per_sample()

    ds = _dataset(root, "decode", collate=False)
    ds.transform = lambda s: s  # samples carry __epoch__/__position__ (the crop's key), as for DecodeBatch
    node = ParallelMapper(IterableWrapper(ds), decode, num_workers=threads, method="thread", in_order=True)
    return Loader(Mapper(Batcher(node, BATCH, drop_last=False), stack))


def _spdl(root: str, threads: int) -> Any:
    """SPDL's pipeline (spdl.pipeline), decoding with the same decoder on ``threads`` threads."""
    from spdl.pipeline import PipelineBuilder

    decode, stack = _per_sample()

    ds = _dataset(root, "decode", collate=False)
    ds.transform = lambda s: s
    pipeline = (
        PipelineBuilder()
        .add_source(ds)
        .pipe(decode, concurrency=threads)
        .aggregate(BATCH)
        .pipe(stack)
        .add_sink(4)
        .build(num_threads=threads)
    )

    class Run:
        def __iter__(self) -> Any:
            with pipeline.auto_stop():
                yield from pipeline

    return Run()


def run_one(root: str, kind: str, mode: str, n: int) -> dict[str, Any]:
    """Time one epoch of one row in this process."""
    import torch

    torch.set_num_threads(1)
    from torch.utils.data import DataLoader

    import streamload

    if kind == "loader":
        loader: Any = streamload.Loader(_dataset(root, mode), threads=n)
    elif kind == "dataloader":
        loader = DataLoader(_dataset(root, mode), batch_size=None, num_workers=n)
    elif kind == "nodes":
        loader = _nodes(root, n)
    elif kind == "spdl":
        loader = _spdl(root, n)
    else:
        raise SystemExit(f"unknown kind {kind}")
    start = time.perf_counter()
    first = None
    samples = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter()
        else:
            samples += len(batch[1]) if isinstance(batch, tuple | list) else len(batch)
    end = time.perf_counter()
    assert first is not None
    return {"first_batch_s": first - start, "samples_per_s": samples / (end - first)}


def limits(root: str) -> dict[str, float]:
    """Pillow decode + resize of the dataset's JPEGs, 1 thread and 2 threads, no loader."""
    from concurrent.futures import ThreadPoolExecutor

    from streamload import StreamingDataset
    from streamload.decode import ImageDecoder

    blobs = [bytes(s["jpg"]) for s in StreamingDataset(root)][:1000]
    decoder = ImageDecoder(SIZE, backend="pillow")
    out: dict[str, float] = {"mean_kb": sum(map(len, blobs)) / len(blobs) / 1024}

    def work(part: list[bytes]) -> None:
        slot = np.empty(decoder.shape, dtype=np.uint8)
        for b in part:
            decoder.decode_into(b, slot)

    for threads in (1, 2):
        best = 0.0
        for _ in range(2):
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(work, [blobs[i::threads] for i in range(threads)]))
            best = max(best, len(blobs) / (time.perf_counter() - t))
        out[f"pillow_{threads}_thread_per_s"] = best
    return out


# -- the driver ---------------------------------------------------------------------------


def measure(root: str, kind: str, mode: str, n: int) -> dict[str, Any]:
    """Run one row in a fresh process, polling the peak PSS of its process tree."""
    import psutil

    cmd = [sys.executable, os.path.abspath(__file__), "--row", root, kind, mode, str(n)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    me = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        except psutil.NoSuchProcess:
            break
        peak = max(peak, total)
        time.sleep(0.05)
    out, _ = proc.communicate()
    if proc.returncode:
        return {"kind": kind, "mode": mode, "n": n, "error": f"exit {proc.returncode}"}
    row = json.loads(out.strip().splitlines()[-1])
    row.update(kind=kind, mode=mode, n=n, peak_pss_mib=peak / 2**20)
    return row


ROWS = [
    *[("loader", "decode", n) for n in (2, 4, 8)],
    *[("dataloader", "decode", n) for n in (0, 2, 4, 8)],
    *[("nodes", "decode", n) for n in (2, 4, 8)],
    *[("loader", "bytes", n) for n in (2, 4)],
    *[("dataloader", "bytes", n) for n in (2, 4)],
    ("loader", "python", 2),
    ("dataloader", "python", 2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1280)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spdl", action="store_true", help="add SPDL's pipeline rows (needs spdl)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--row", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        root, kind, mode, n = args.row
        print(json.dumps(run_one(root, kind, mode, int(n))))
        return
    root = dataset_root(args.images)
    print(f"load average before: {os.getloadavg()}")
    print(json.dumps(limits(root)))
    rows = list(ROWS) + ([("spdl", "decode", 2)] if args.spdl else [])
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for kind, mode, n in rows:
            row = measure(root, kind, mode, n)
            row["round"] = r
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(f"{'mode':7} {'loader':12} {'n':>2} {'samples/s':>20} {'first batch s':>16} {'peak PSS MiB':>16}")
    for kind, mode, n in rows:
        mine = [x for x in results if (x["kind"], x["mode"], x["n"]) == (kind, mode, n) and "error" not in x]
        if not mine:
            print(f"{mode:7} {kind:12} {n:>2}  failed")
            continue

        def span(key: str, fmt: str, rows: list[dict[str, Any]] = mine) -> str:
            values = sorted(x[key] for x in rows)
            return f"{values[0]:{fmt}}-{values[-1]:{fmt}}" if len(values) > 1 else f"{values[0]:{fmt}}"

        print(
            f"{mode:7} {kind:12} {n:>2} {span('samples_per_s', ',.0f'):>20} "
            f"{span('first_batch_s', '.2f'):>16} {span('peak_pss_mib', '.0f'):>16}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load_average": os.getloadavg(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
