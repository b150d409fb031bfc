"""How long one DataLoader worker takes to plan its part of an epoch, and how much memory.

One worker (rank 311 of 512, worker 2 of 16) builds the :class:`EpochPlan` of an epoch of
10^6 or 10^8 samples in 10^4 shards, then walks its whole run list. Time is wall clock
(best of ``--repeat``); memory is the peak of Python + numpy allocations (tracemalloc)
above the baseline, for the worker's whole walk. Also shown: an elastic resume (the same
epoch stopped half way on 512 ranks of 256 and continued on 256 ranks of 512: the same
global batch, so the worker starts at its rank's half-way item).

    python benchmarks/bench_planner.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Sequence

import numpy as np

from streamload.plan import EpochPlan, Split, World

RANKS, WORKERS = 512, 16
RANK, WORKER = 311, 2
SHARDS = 10_000


def shard_counts(total: int) -> list[int]:
    """``SHARDS`` shards of +-20 % jittered size summing to ``total``."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.8, 1.2, SHARDS)
    counts = np.floor(weights / weights.sum() * total).astype(np.int64)
    counts[: total - int(counts.sum())] += 1
    return [int(c) for c in counts]


def walk(
    counts: Sequence[int], split: Split, resumed: bool = False, world_size: int = RANKS
) -> tuple[float, float, int, int]:
    """Return (seconds to first run, seconds for all runs, runs, samples) for one worker."""
    t0 = time.perf_counter()
    plan = EpochPlan(counts, world_size, split)
    start = plan.per_rank // 2 if resumed else 0
    runs = plan.runs(World(RANK % world_size, world_size, WORKER, WORKERS), start, start // plan.chunk_size(WORKERS))
    first = next(runs)
    t_first = time.perf_counter() - t0
    n_runs, n_samples = 1, len(first.locals)
    for run in runs:
        n_runs += 1
        n_samples += len(run.locals)
    return t_first, time.perf_counter() - t0, n_runs, n_samples


def measure(counts: Sequence[int], split: Split, resumed: bool, world_size: int, repeat: int) -> dict[str, float]:
    best_first, best_all = float("inf"), float("inf")
    for _ in range(repeat):
        t_first, t_all, n_runs, n_samples = walk(counts, split, resumed, world_size)
        best_first, best_all = min(best_first, t_first), min(best_all, t_all)
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    walk(counts, split, resumed, world_size)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return {
        "first_ms": best_first * 1e3,
        "all_ms": best_all * 1e3,
        "peak_mb": peak / 2**20,
        "runs": n_runs,
        "samples": n_samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"one worker: rank {RANK}/{RANKS}, worker {WORKER}/{WORKERS}, {SHARDS} shards")
    print(f"{'samples':>11} {'case':<36} {'first run':>10} {'all runs':>10} {'peak MB':>8} {'runs':>7} {'samples':>8}")
    for total in (10**6, 10**8):
        counts = shard_counts(total)
        cases: list[tuple[str, Split, bool, int]] = [
            ("sequential, chunk=None", Split(), False, RANKS),
            ("sequential, chunk=256 (batch)", Split(batch_size=256), False, RANKS),
            ("shuffle, chunk=256", Split(shuffle=True, seed=1, batch_size=256), False, RANKS),
            ("shuffle, resumed half-way on 256 x 512", Split(shuffle=True, seed=1, batch_size=512), True, 256),
        ]
        for name, split, resumed, world_size in cases:
            r = measure(counts, split, resumed, world_size, args.repeat)
            print(
                f"{total:>11,} {name:<36} {r['first_ms']:>8.2f}ms {r['all_ms']:>8.1f}ms "
                f"{r['peak_mb']:>8.2f} {r['runs']:>7} {r['samples']:>8}"
            )


if __name__ == "__main__":
    main()
