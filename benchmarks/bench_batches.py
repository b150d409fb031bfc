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


def epoch_seconds(root: str, batch: int, workers: int, epochs: int) -> tuple[float, int, int]:
    """Best seconds of one epoch (after a warm-up epoch); also the samples and payload bytes seen."""
    from torch.utils.data import DataLoader

    from streamload import StreamingDataset
    from streamload.batch import RawCollate

    ds = StreamingDataset(root, batch_size=batch, collate=RawCollate())
    loader = DataLoader(
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--batches", default="16,64,256,1024", help="batch sizes (default 16,64,256,1024)")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per row; best kept (default 3)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    root = _data.dataset(args.images, "tar")
    print(f"load average {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
    raw, total = raw_read_rate(root)
    n = json.load(open(os.path.join(root, "index.json")))["num_samples"]
    print(f"machine limit: raw sequential read {raw / 1e6:,.0f} MB/s = {raw / (total / n):,.0f} samples/s")
    print(f"{'workers':>7} {'batch':>6} {'samples/s':>10} {'MB/s':>8} {'of raw':>7}")
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        fit = []
        for batch in [int(b) for b in args.batches.split(",")]:
            seconds, samples, nbytes = epoch_seconds(root, batch, workers, args.epochs)
            rate = samples / seconds
            of_raw = (nbytes / seconds) / raw
            print(f"{workers:>7} {batch:>6} {rate:>10,.0f} {nbytes / seconds / 1e6:>8,.0f} {of_raw:>7.2f}")
            rows.append({"workers": workers, "batch": batch, "samples_per_s": rate, "of_raw": of_raw})
            fit.append((-(-samples // batch), nbytes, seconds))
        a = np.array([[b, y] for b, y, _ in fit], dtype=float)
        t = np.array([s for _, _, s in fit])
        (per_batch, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
        print(
            f"  workers={workers}: per batch {per_batch * 1e6:,.0f} us, per MB {per_byte * 1e9:,.0f} us "
            f"(raw read: {1e6 / raw * 1e6:,.0f} us per MB)"
        )
        rows.append({"workers": workers, "per_batch_us": per_batch * 1e6, "per_mb_us": per_byte * 1e12})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw_bytes_per_s": raw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
