"""Time from ``load_state_dict`` to the first batch when resuming near the end of an epoch.

A tar dataset of 10^5 samples (100 shards, ~1 KB per sample, built once under
``benchmarks/out``) read with ``shuffle=True`` through a ``DataLoader`` (batch 256).
Compared: starting a fresh epoch; resuming at 99 % of the epoch on the same world;
resuming elastically (state saved on 4 ranks, resumed on 1); and, for scale, what a loader
without resume support does instead (replay: read and discard the seen samples).

    python benchmarks/bench_resume.py [--workers 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from streamload import StreamingDataset

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
SAMPLES, SHARDS, BATCH = 100_000, 100, 256


def build(root: str) -> str:
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    if os.path.exists(os.path.join(root, "index.json")):
        return root
    os.makedirs(root, exist_ok=True)
    fmt, dest = get_format("tar"), LocalDestination(root)
    per = SAMPLES // SHARDS
    entries = []
    for i in range(SHARDS):
        samples = (
            {"__key__": f"s{i:03d}_{j:05d}", "bin": os.urandom(1000), "cls": str(j % 10).encode()} for j in range(per)
        )
        entries.append(write_shard(fmt, dest, fmt.shard_name(i), samples).entry)
    publish_manifest(dest, Manifest(format="tar", shards=tuple(entries), fields=("bin", "cls")))
    return root


def to_label(sample: dict[str, Any]) -> int:
    return int(sample["cls"])


def dataset(root: str, **kw: Any) -> StreamingDataset:
    return StreamingDataset(root, shuffle=True, seed=3, batch_size=BATCH, transform=to_label, **kw)


def first_batch(ds: StreamingDataset, workers: int, state: dict[str, Any] | None) -> float:
    t0 = time.perf_counter()
    if state is not None:
        ds.load_state_dict(state)
    it = iter(DataLoader(ds, batch_size=BATCH, num_workers=workers))
    next(it)
    elapsed = time.perf_counter() - t0
    del it
    return elapsed


def replay(root: str, seen: int) -> float:
    t0 = time.perf_counter()
    it = iter(dataset(root, rank=0, world_size=1))
    for _ in range(seen):  # what a loader without resume must do: read and throw away
        next(it)
    next(it)
    return time.perf_counter() - t0


def median_ms(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    root = build(os.path.join(OUT, f"resume-{SAMPLES}"))
    global_batch = 4 * BATCH
    near_end = (SAMPLES // global_batch - 1) * global_batch  # 99 % of the epoch
    same = dataset(root, rank=0, world_size=1).state_dict(samples_seen=near_end - near_end % BATCH)
    elastic = dataset(root, rank=0, world_size=4).state_dict(samples_seen=near_end)
    w = args.workers
    rows = [
        ("fresh epoch", lambda: first_batch(dataset(root, rank=0, world_size=1), w, None)),
        (
            f"resume same world at {same['samples_seen']}",
            lambda: first_batch(dataset(root, rank=0, world_size=1), w, same),
        ),
        (f"resume 4 ranks -> 1 at {near_end}", lambda: first_batch(dataset(root, rank=0, world_size=1), w, elastic)),
    ]
    print(f"{SAMPLES} samples, {SHARDS} shards, batch {BATCH}, {w} workers, shuffle=True; median of {args.repeat}")
    for name, fn in rows:
        print(f"  {name:<40} {median_ms(fn, args.repeat):8.1f} ms to first batch")
    print(f"  {'replay (no resume support), 0 workers':<40} {median_ms(lambda: replay(root, near_end), 1):8.1f} ms")


if __name__ == "__main__":
    main()
