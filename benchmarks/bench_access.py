"""Random access: ``ShardedDataset`` lookups per second, by index and by key, warm caches.

Datasets of ``--samples`` samples (16 KB random payload + label, 100 samples per shard) in
tar, LMDB and HDF5 on local disk, plus the tar dataset behind a remote URL
(``memory://``, read through the shard cache, already filled). One process; uniformly
random indices (``ds[i]``) and keys (``ds.get(key)``), best of ``--repeat`` rounds of
``--lookups`` each; warm page cache and, for ``get``, a key index already built (its build
time is shown too). ``open_readers`` (the reader LRU) is 8, the default 64, and every
shard: with fewer readers than shards, a random lookup often reopens a shard, which is
what the first rows measure.

    python benchmarks/bench_access.py [--samples 10000] [--lookups 5000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from streamload import ShardedDataset, StorageConfig

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
PAYLOAD = 16 * 1024
PER_SHARD = 100


def make_dataset(url: str, fmt: str, samples: int, storage_options: dict[str, object] | None = None) -> str:
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import open_destination
    from streamload.writer import publish_manifest, write_shard

    if "://" not in url and os.path.exists(os.path.join(url, "index.json")):
        return url
    format_, dest = get_format(fmt), open_destination(url, storage_options)
    rng = np.random.default_rng(0)
    entries = []
    for s in range(-(-samples // PER_SHARD)):
        n = min(PER_SHARD, samples - s * PER_SHARD)
        batch = ({"__key__": f"k{s:05d}/{j:04d}", "bin": rng.bytes(PAYLOAD), "cls": b"%d" % (j % 10)} for j in range(n))
        entries.append(write_shard(format_, dest, format_.shard_name(s), batch, "xxh3_128").entry)
    publish_manifest(
        dest, Manifest(format=fmt, shards=tuple(entries), fields=("bin", "cls"), hash_algorithm="xxh3_128")
    )
    return url


def rate(fn: object, items: list[object], repeat: int) -> float:
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        for item in items:
            fn(item)  # type: ignore[operator]
        best = max(best, len(items) / (time.perf_counter() - t0))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--lookups", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average: {' '.join(f.read().split()[:3])} on {os.cpu_count()} cores")
    cache = tempfile.mkdtemp(prefix="bench-access-")
    try:
        sources = {fmt: make_dataset(os.path.join(OUT, f"access-{fmt}-{args.samples}"), fmt, args.samples) for fmt in
                   ("tar", "lmdb", "hdf5")}  # fmt: skip
        sources["tar via memory:// + cache"] = make_dataset("memory://bench/tar", "tar", args.samples)
        rng = np.random.default_rng(1)
        indices = rng.integers(0, args.samples, args.lookups).tolist()
        shards = -(-args.samples // PER_SHARD)
        print(f"{args.samples} samples of {PAYLOAD // 1024} KB, {shards} shards; {args.lookups} random lookups")
        print(f"{'dataset':<28} {'open_readers':>12} {'ds[i]':>12} {'ds.get(key)':>12} {'key index':>10}")
        for name, url in sources.items():
            for readers in sorted({8, 64, shards}):
                ds = ShardedDataset(url, storage=StorageConfig(cache_dir=cache), open_readers=readers)
                for i in range(0, args.samples, PER_SHARD):  # fill the shard cache (remote), warm the pages
                    ds[i]
                keys = [ds.key_of(i) for i in indices]
                t0 = time.perf_counter()
                ds.key_index()
                build = time.perf_counter() - t0
                by_index = rate(ds.__getitem__, indices, args.repeat)  # type: ignore[arg-type]
                by_key = rate(ds.get, keys, args.repeat)  # type: ignore[arg-type]
                built = f"{build * 1e3:>8.0f}ms" if readers == 8 else f"{'(file)':>10}"  # then mapped from its file
                print(f"{name:<28} {readers:>12} {by_index:>10.0f}/s {by_key:>10.0f}/s {built}")
                ds.close()
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
