"""The zero-copy batch path at every batch size: what a batch costs, and what a byte costs.

    python benchmarks/bench_batches.py                      # 10k JPEGs (~67 KB), tar, warm page cache
    python benchmarks/bench_batches.py --batches 16,64,256 --workers 0,2 --epochs 3

For each (workers, batch size) it runs ``StreamingDataset(batch_size=B, collate=RawCollate())``
in a ``DataLoader(batch_size=None)`` over the same shards and prints samples/s, MB/s and
the fraction of the machine's raw read rate measured in the same run (sequential reads of
the same shard files into a reused buffer, one core, page cache warm). Then, per worker
count, it fits ``seconds per epoch = per_batch * batches + per_byte * bytes`` over the
batch sizes (least squares), which separates the fixed cost paid per batch (queue hand-over,
rebuild in the main process, per-batch Python) from the cost per byte (reads, checksums).
Integrity checks stay on (every sample's xxh3 is checked).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _data  # noqa: E402


def raw_read_rate(root: str, repeats: int = 3) -> tuple[float, int]:
    """Best bytes/s of a sequential read of every shard file (1 MiB reads into one buffer)."""
    files = sorted(glob.glob(os.path.join(root, "*.tar")))
    total = sum(os.path.getsize(f) for f in files)
    buf = bytearray(1 << 20)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        best = max(best, total / (time.perf_counter() - start))
    return best, total


def _plain_reduce(self: object) -> tuple[object, ...]:
    """How a batch crossed before: each tensor as its own shared-memory descriptor (torch's pickling)."""
    from streamload.batch import RawBatch

    assert isinstance(self, RawBatch)
    return (RawBatch, (self.data, self.offsets, self.labels, self.keys))


def epoch_seconds(root: str, batch: int, workers: int, epochs: int, plain: bool = False) -> tuple[float, int, int]:
    """Best seconds of one epoch (after a warm-up epoch); also the samples and payload bytes seen.

    ``plain``: batches cross as separately pickled tensors (the hand-over before one-message batches);
    the forked workers inherit the patched pickling.
    """
    from torch.utils.data import DataLoader

    from streamload import StreamingDataset
    from streamload.batch import RawBatch, RawCollate

    reduce = RawBatch.__reduce__
    if plain:
        RawBatch.__reduce__ = _plain_reduce  # type: ignore[method-assign,assignment]
    try:
        return _epochs(root, batch, workers, epochs, StreamingDataset, RawCollate, DataLoader)
    finally:
        RawBatch.__reduce__ = reduce  # type: ignore[method-assign]


def _epochs(root: str, batch: int, workers: int, epochs: int, dataset: type, collate: type, loader_cls: type):

    ds = dataset(root, batch_size=batch, collate=collate())
    loader = loader_cls(
        ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None
    )
    best = float("inf")
    samples = nbytes = 0
    for epoch in range(epochs + 1):
        ds.set_epoch(epoch)
        start = time.perf_counter()
        samples = nbytes = 0
        for b in loader:
            samples += len(b)
            nbytes += int(b.data.numel())
        elapsed = time.perf_counter() - start
        if epoch:  # the first epoch starts the workers and warms their buffers
            best = min(best, elapsed)
    return best, samples, nbytes


def _fit(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Non-negative least squares of ``seconds = per_batch * batches + per_byte * bytes``."""
    a = np.array([[b, y] for b, y, _ in points], dtype=float)
    t = np.array([s for _, _, s in points])
    (per_batch, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    if per_batch < 0:  # the other coefficient alone
        return 0.0, float(a[:, 1] @ t / (a[:, 1] @ a[:, 1]))
    if per_byte < 0:
        return float(a[:, 0] @ t / (a[:, 0] @ a[:, 0])), 0.0
    return float(per_batch), float(per_byte)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--batches", default="16,64,256,1024", help="batch sizes (default 16,64,256,1024)")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per row; best kept (default 3)")
    parser.add_argument("--compare", action="store_true", help="also time the per-tensor hand-over (before)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    root = _data.dataset(args.images, "tar")
    print(f"load average {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
    raw, total = raw_read_rate(root)
    n = json.load(open(os.path.join(root, "index.json")))["num_samples"]
    print(f"machine limit: raw sequential read {raw / 1e6:,.0f} MB/s = {raw / (total / n):,.0f} samples/s")
    print(f"{'hand-over':>10} {'workers':>7} {'batch':>6} {'samples/s':>10} {'MB/s':>8} {'of raw':>7}")
    rows = []
    modes = [False, True] if args.compare else [False]
    for workers in [int(w) for w in args.workers.split(",")]:
        for plain in modes if workers else [False]:
            mode = "per-tensor" if plain else "one-msg"
            fit = []
            for batch in [int(b) for b in args.batches.split(",")]:
                seconds, samples, nbytes = epoch_seconds(root, batch, workers, args.epochs, plain)
                rate = samples / seconds
                of_raw = (nbytes / seconds) / raw
                print(
                    f"{mode:>10} {workers:>7} {batch:>6} {rate:>10,.0f} {nbytes / seconds / 1e6:>8,.0f} {of_raw:>7.2f}"
                )
                rows.append(
                    {"handover": mode, "workers": workers, "batch": batch, "samples_per_s": rate, "of_raw": of_raw}
                )
                fit.append((-(-samples // batch), nbytes, seconds))
            per_batch, per_byte = _fit(fit)
            print(
                f"  {mode}, workers={workers}: per batch {per_batch * 1e6:,.0f} us, per MB {per_byte * 1e12:,.0f} us "
                f"(raw read: {1e12 / raw:,.0f} us per MB)"
            )
            rows.append(
                {"handover": mode, "workers": workers, "per_batch_us": per_batch * 1e6, "per_mb_us": per_byte * 1e12}
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw_bytes_per_s": raw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
