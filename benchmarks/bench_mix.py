"""Mixtures: what planning costs a worker, and what mixing costs the reading.

Two parts (``--part planner``, ``--part throughput``, default both):

**planner** -- one DataLoader worker (rank 311 of 512, worker 2 of 16, chunk 256) plans its
part of an epoch of a mixture of ``--streams`` streams x ``--shards`` shards each (default
100 x 10^4 = 10^6 shards), with random weights, then walks its whole run list. Time is
wall clock (best of ``--repeat``); memory is the tracemalloc peak above the baseline for
the whole walk (layout + plan + runs). Shown against a single dataset with the same
shards, and with 100x more samples per shard (O(shards), not O(samples)).

**throughput** -- samples/s of one epoch of a 2-stream mixture (A: 60 %, B: 40 % of the
samples, both tar, 64 KB random payloads, shards of 200) against one dataset of the same
total size and bytes (C), warm page cache: in-process reads (``num_workers=0``, per-sample
dicts), shuffled and not, and 2 DataLoader workers (sample dicts batched by the DataLoader,
or ``RawCollate`` batches of 64). Rates are samples per CPU second of all the processes
(main and workers, ``getrusage``), which a shared machine disturbs far less than wall
clock (also shown, best round); median of ``--repeat`` epochs, mixture and single alternating.

    python benchmarks/bench_mix.py [--part planner|throughput] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from streamload.plan import EpochPlan, MixLayout, Split, World, epoch_counts

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
RANKS, WORKERS = 512, 16
RANK, WORKER = 311, 2


# -- planner ----------------------------------------------------------------------------


def stream_shards(streams: int, shards: int, per_shard: int) -> list[list[int]]:
    """Per stream, ``shards`` shards of +-20 % jittered sizes around ``per_shard``."""
    rng = np.random.default_rng(0)
    return [(rng.uniform(0.8, 1.2, shards) * per_shard).astype(np.int64).tolist() for _ in range(streams)]


def walk(make: Callable[[], EpochPlan]) -> tuple[float, float, int, int]:
    """Return (seconds to the first run, seconds for all runs, runs, samples) of the worker."""
    t0 = time.perf_counter()
    plan = make()
    runs = plan.runs(World(RANK, RANKS, WORKER, WORKERS))
    first = next(runs)
    t_first = time.perf_counter() - t0
    n_runs, n_samples = 1, len(first.locals)
    for run in runs:
        n_runs += 1
        n_samples += len(run.locals)
    return t_first, time.perf_counter() - t0, n_runs, n_samples


def measure(make: Callable[[], EpochPlan], repeat: int) -> dict[str, float]:
    best_first = best_all = float("inf")
    for _ in range(repeat):
        t_first, t_all, n_runs, n_samples = walk(make)
        best_first, best_all = min(best_first, t_first), min(best_all, t_all)
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    walk(make)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return {"first_ms": best_first * 1e3, "all_ms": best_all * 1e3, "peak_mb": peak / 2**20, "runs": n_runs,
            "samples": n_samples}  # fmt: skip


def plan_maker(
    flat: list[int], split: Split, per_stream: list[list[int]] | None = None, counts: list[int] | None = None
) -> Callable[[], EpochPlan]:
    """A function building the plan of a single dataset (no ``counts``) or of a mixture."""

    def make() -> EpochPlan:
        if per_stream is None or counts is None:
            return EpochPlan(flat, RANKS, split)
        return EpochPlan(flat, RANKS, split, layout=MixLayout(per_stream, counts, split))

    return make


def planner(streams: int, shards: int, repeat: int) -> None:
    print(f"one worker: rank {RANK}/{RANKS}, worker {WORKER}/{WORKERS}, chunk 256; {streams} streams x {shards} shards")
    header = f"{'case':<52} {'first run':>10} {'all runs':>10} {'peak MB':>8} {'runs':>7} {'samples':>8}"
    print(header)
    rng = np.random.default_rng(1)
    weights = rng.uniform(0.5, 2.0, streams).tolist()
    for per_shard in (100, 10_000):
        per_stream = stream_shards(streams, shards, per_shard)
        flat = [c for k in per_stream for c in k]
        sizes = [sum(k) for k in per_stream]
        total = sum(sizes)
        none = [None] * streams
        weighted = epoch_counts(sizes, weights=weights, repeats=none, samples=none, epoch_size=total)
        upsampled = epoch_counts(sizes, weights=none, repeats=[2.5] * streams, samples=none)
        cases: list[tuple[str, Callable[[], EpochPlan]]] = []
        for shuffle in (False, True):
            split = Split(shuffle=shuffle, seed=1, batch_size=256)
            tag = "shuffle" if shuffle else "in order"
            cases.append((f"single dataset, {len(flat):,} shards, {tag}", plan_maker(flat, split)))
            for name, counts in (("weights", weighted), ("repeat=2.5", upsampled)):
                cases.append((f"mixture, {name}, {tag}", plan_maker(flat, split, per_stream, counts)))
        print(f"-- {total:,} samples in the datasets ({per_shard} per shard)")
        for name, make in cases:
            r = measure(make, repeat)
            print(
                f"{name:<52} {r['first_ms']:>8.1f}ms {r['all_ms']:>8.1f}ms {r['peak_mb']:>8.1f} "
                f"{r['runs']:>7} {r['samples']:>8}"
            )


# -- throughput ---------------------------------------------------------------------------

PAYLOAD = 64 * 1024
PER_SHARD = 200


def make_dataset(name: str, samples: int, seed: int) -> str:
    """A tar dataset of ``samples`` random 64 KB payloads (cached under benchmarks/out/)."""
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    root = os.path.join(OUT, f"mix-{name}-{samples}")
    if os.path.exists(os.path.join(root, "index.json")):
        return root
    os.makedirs(root, exist_ok=True)
    fmt, dest = get_format("tar"), LocalDestination(root)
    rng = np.random.default_rng(seed)
    entries = []
    for s in range(-(-samples // PER_SHARD)):
        n = min(PER_SHARD, samples - s * PER_SHARD)
        batch = (
            {"__key__": f"{name}{s}_{j}", "bin": rng.bytes(PAYLOAD), "cls": str(j % 10).encode()} for j in range(n)
        )
        entries.append(write_shard(fmt, dest, fmt.shard_name(s), batch, "xxh3_128").entry)
    publish_manifest(
        dest, Manifest(format="tar", shards=tuple(entries), fields=("bin", "cls"), hash_algorithm="xxh3_128")
    )
    return root


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the DataLoader workers, once joined)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def epoch_rate(make: Callable[[], object], workers: int, batch: int | None) -> tuple[float, float]:
    """Read one epoch; return (samples per wall-clock second, per CPU second of all its processes)."""
    from torch.utils.data import DataLoader

    ds = make()
    t0, c0 = time.perf_counter(), cpu_seconds()
    n = 0
    if workers:
        for out in DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=len):  # type: ignore[arg-type]
            n += out if isinstance(out, int) else len(out)
    else:
        for _ in ds:  # type: ignore[attr-defined]
            n += 1
    wall = time.perf_counter() - t0
    return n / wall, n / (cpu_seconds() - c0)


def throughput(total: int, repeat: int) -> None:
    from streamload import Stream, StreamingDataset
    from streamload.batch import RawCollate

    a = make_dataset("a", total * 6 // 10, 1)
    b = make_dataset("b", total - total * 6 // 10, 2)
    c = make_dataset("c", total, 3)
    print(f"{total} samples of {PAYLOAD // 1024} KB ({total * PAYLOAD / 1e9:.2f} GB), tar, {PER_SHARD} per shard")
    print("samples per CPU second of all processes (main + workers, median of the rounds), and per wall-clock")
    print("second in brackets (best round); the ratio is of the CPU rates (wall clock swings with the machine's load)")
    print(f"{'reading':<48} {'single':>18} {'mixture':>18} {'mixture/single':>15}")
    raw = {"batch_size": 64, "collate": RawCollate(field="bin", label_field="cls")}
    configs: list[tuple[str, dict[str, object], int, int | None]] = [
        ("in-process dicts, in order", {}, 0, None),
        ("in-process dicts, shuffle", {"shuffle": True}, 0, None),
        ("2 workers, dicts, DataLoader batch 64, shuffle", {"shuffle": True, "batch_size": 64}, 2, 64),
        ("2 workers, RawCollate(64), shuffle", {"shuffle": True, **raw}, 2, None),
        ("2 workers, RawCollate(64), in order", raw, 2, None),
    ]
    for name, options, workers, batch in configs:

        def single(options: dict[str, object] = options) -> object:
            return StreamingDataset(c, **options)  # type: ignore[arg-type]

        def mixed(options: dict[str, object] = options) -> object:
            streams = [Stream(a, weight=0.6), Stream(b, weight=0.4)]
            return StreamingDataset(streams, epoch_size=total, **options)  # type: ignore[arg-type]

        epoch_rate(single, workers, batch), epoch_rate(mixed, workers, batch)  # warm the page cache
        rounds: dict[str, list[tuple[float, float]]] = {"single": [], "mixed": []}
        for _ in range(repeat):  # alternate, so both see the same machine
            for key, make in (("single", single), ("mixed", mixed)):
                rounds[key].append(epoch_rate(make, workers, batch))
        cpu = {k: statistics.median(r[1] for r in v) for k, v in rounds.items()}
        wall = {k: max(r[0] for r in v) for k, v in rounds.items()}
        cells = f"{cpu['single']:>7.0f}/s ({wall['single']:>6.0f}) {cpu['mixed']:>7.0f}/s ({wall['mixed']:>6.0f})"
        print(f"{name:<48} {cells} {cpu['mixed'] / cpu['single']:>14.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("planner", "throughput", "both"), default="both")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=10_000, help="samples of the throughput datasets")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average: {' '.join(f.read().split()[:3])} on {os.cpu_count()} cores")
    if args.part in ("planner", "both"):
        planner(args.streams, args.shards, args.repeat)
    if args.part in ("throughput", "both"):
        throughput(args.samples, args.repeat)


if __name__ == "__main__":
    main()
