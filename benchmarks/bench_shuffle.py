"""Shuffle quality: streamload's window shuffle vs a uniform shuffle vs WebDataset's recipe.

One epoch of N samples in equal shards, read by one rank in batches of 256: the default
order (8 canonical partitions, each shuffled within its share of the window) beside the
old rule (one block per rank, shuffled within a window of four shards). Metrics of
the output order (lower is "more shuffled" for the first two, 1.0 is ideal for the third):

* same-shard pairs: fraction of consecutive samples inside a batch that come from the
  same shard (uniform: about 1 / #shards);
* any-two pairs: the chance that two distinct samples of a batch, drawn at random, come
  from the same shard (uniform: about 1 / #shards); unlike the column before, it does not
  depend on the order of the samples inside a batch, which a gradient step ignores;
* |corr|: absolute Spearman correlation of output position with the original index;
* shards/batch: mean number of distinct shards in a batch.
* displacement: mean |output position - original position| / N (uniform: 1/3).

WebDataset's recipe is emulated with its own buffer shuffle (``webdataset.filters._shuffle``,
bufsize=1000, initial=100) after a full random permutation of the shard list (the
strongest form of ``shardshuffle``), in one worker.

    python benchmarks/bench_shuffle.py [--samples 200000]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy as np

from streamload.plan import EpochPlan, Split, default_window

BATCH = 256


def streamload_order(counts: list[int], window: int | None, seed: int = 1, partitions: int | None = None) -> np.ndarray:
    plan = EpochPlan(counts, 1, Split(shuffle=True, seed=seed, window=window, batch_size=BATCH, partitions=partitions))
    shards, locals_ = plan.locate(plan.rank_positions(0, 0, plan.per_rank))
    start = np.concatenate([[0], np.cumsum(counts)])
    return np.asarray(start[shards] + locals_, dtype=np.int64)


def webdataset_order(counts: list[int], seed: int = 1) -> np.ndarray:
    from webdataset.filters import _shuffle

    rng = np.random.default_rng(seed)
    start = np.concatenate([[0], np.cumsum(counts)])

    def stream() -> Iterator[int]:
        for shard in rng.permutation(len(counts)):
            yield from range(int(start[shard]), int(start[shard + 1]))

    return np.fromiter(_shuffle(stream(), bufsize=1000, initial=100, seed=seed), dtype=np.int64)


def metrics(order: np.ndarray, shard_size: int) -> dict[str, float]:
    n = len(order)
    shard = order // shard_size
    batches = shard[: n - n % BATCH].reshape(-1, BATCH)
    same = float(np.mean(batches[:, 1:] == batches[:, :-1]))
    collide = []
    for b in batches:
        counts = np.unique(b, return_counts=True)[1]
        collide.append(float((counts * (counts - 1)).sum()) / (BATCH * (BATCH - 1)))
    any_two = float(np.mean(collide))
    per_batch = float(np.mean([len(np.unique(b)) for b in batches]))
    corr = abs(float(np.corrcoef(np.arange(n), order)[0, 1]))
    displacement = float(np.mean(np.abs(np.arange(n) - order))) / n
    return {"same": same, "any": any_two, "corr": corr, "per_batch": per_batch, "disp": displacement}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200_000)
    args = parser.parse_args()
    n = args.samples
    print(f"{n} samples, batch {BATCH}")
    print(
        f"{'shard size':>10} {'order':<40} {'same-shard pairs':>16} {'any-two pairs':>13} {'|corr|':>7} "
        f"{'shards/batch':>12} {'displ.':>7}"
    )
    for size in (100, 1000, 10_000):
        counts = [size] * (n // size)
        rows = [
            ("uniform permutation", np.random.default_rng(1).permutation(n)),
            ("webdataset shards+buffer(1000)", webdataset_order(counts)),
            ("streamload old rule (1 block)", streamload_order(counts, default_window(counts), partitions=1)),
            ("streamload default (8 partitions)", streamload_order(counts, None)),
            (f"streamload window={16 * size}", streamload_order(counts, 16 * size)),
        ]
        default = EpochPlan(counts, 1, Split(shuffle=True, batch_size=BATCH)).window
        for name, order in rows:
            assert len(order) - n < BATCH and sorted(set(order.tolist())) == list(range(n)), name
            order = order[:n]  # whole batches: the padding (the fewest repeats) left out of the metrics
            m = metrics(order, size)
            label = f"{name} ({default})" if name.startswith("streamload default") else name
            print(
                f"{size:>10} {label:<40} {m['same']:>16.4f} {m['any']:>13.4f} {m['corr']:>7.4f} "
                f"{m['per_batch']:>12.1f} {m['disp']:>7.3f}"
            )


if __name__ == "__main__":
    main()
