"""The cost of the partitioned order: the old rule (one block per rank) against the new one.

The old rule gave each rank one contiguous block of the shuffled epoch, shuffled inside a
window of four shards; the new one (the default with ``shuffle=True`` and a batch size)
cuts the epoch into 8 canonical partitions read in parallel, so the global batches do not
depend on the world. The old rule is reproduced with today's planner as
``partitions=world_size`` with the old window (the structure is the same: one partition
per rank, one window of four shards each). Rows, each for 1 and 2 ranks x 2 workers:

1. **Shards open**: from the plan alone, the most shards a worker (and a node: every
   rank's workers, by step) needs at once — a shard counts from its first read to its
   last, so that is the readers a worker keeps open and the shards the node's cache must
   hold to download each shard once.
2. **Throughput** on local disk, bytes (``RawCollate``, ``--epochs`` epochs) and decode
   (``DecodeBatch`` 224, random crop and flip, one epoch), each rank a process reading with
   a DataLoader of 2 persistent workers, samples/s after the first batch (whose time is
   shown apart), next to the machine's limits measured in the same run (raw read of the
   shard files, single-core decode stage).
3. With ``--remote`` (or ``--remote-only``): one cold epoch from a SeaweedFS bucket behind
   the tests' shaping proxy (``--latency``, ``--bandwidth`` per connection), every rank of
   the node sharing one cache: samples/s over the whole epoch (first batch included) and
   the bytes that crossed the proxy, i.e. downloads per shard per node.

    python benchmarks/bench_order.py [--images 6000] [--shard 100] [--batch 64] [--remote | --remote-only]

``READ_AHEAD=N`` in the environment passes ``read_ahead=N`` to every dataset (default 8).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _data  # noqa: E402
import run as peers  # noqa: E402

from streamload.plan import EpochPlan, Split, World, default_window  # noqa: E402

WORKERS = 2
RULES = ("old", "new")


def rule_kwargs(rule: str, world_size: int, counts: list[int]) -> dict[str, Any]:
    if rule == "old":
        return {"partitions": world_size, "shuffle_window": default_window(counts)}
    return {}


def spans(reads: list[tuple[int, int]]) -> int:
    """Most shards alive at once: a shard lives from its first read to its last ((time, shard) pairs)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, shard in reads:
        first.setdefault(shard, t)
        last[shard] = t
    events = sorted([(t, 1) for t in first.values()] + [(t + 1, -1) for t in last.values()])
    alive = best = 0
    for _, delta in events:
        alive += delta
        best = max(best, alive)
    return best


def footprint(counts: list[int], world_size: int, batch: int, rule: str) -> tuple[int, int]:
    """(most shards one worker needs at once, most the node needs at once) for one epoch."""
    kwargs = rule_kwargs(rule, world_size, counts)
    split = Split(
        shuffle=True, seed=1, batch_size=batch, partitions=kwargs.get("partitions"), window=kwargs.get("shuffle_window")
    )
    plan = EpochPlan(counts, world_size, split)
    worker_best = 0
    node: list[tuple[int, int]] = []
    for rank in range(world_size):
        for worker in range(WORKERS):
            reads = [
                (int(p) // batch, run.shard)
                for run in plan.runs(World(rank, world_size, worker, WORKERS))
                for p in run.positions[:1]
            ]
            worker_best = max(worker_best, spans(reads))
            node += reads
    return worker_best, spans(node)


def child(spec: dict[str, Any]) -> None:
    """One rank: read an epoch through a DataLoader, print samples, seconds and the first batch's time."""
    from torch.utils.data import DataLoader

    from streamload import StorageConfig, StreamingDataset
    from streamload.batch import RawCollate
    from streamload.decode import DecodeBatch

    collate = RawCollate() if spec["mode"] == "bytes" else DecodeBatch(224, crop="random", flip=True)
    ds = StreamingDataset(
        spec["url"],
        shuffle=True,
        seed=1,
        batch_size=spec["batch"],
        collate=collate,
        rank=spec["rank"],
        world_size=spec["world_size"],
        storage=StorageConfig(
            storage_options=spec.get("options"),
            cache_dir=spec.get("cache"),
            read_ahead=int(os.environ["READ_AHEAD"]) if os.environ.get("READ_AHEAD") else None,
        ),
        **spec["rule"],
    )
    loader = DataLoader(
        ds, batch_size=None, num_workers=WORKERS, multiprocessing_context="fork", persistent_workers=True
    )
    started = time.perf_counter()
    first = steady = 0.0
    samples = 0
    for epoch in range(spec.get("epochs", 1)):
        ds.set_epoch(epoch)
        for batch in loader:
            if not first:  # the rate is taken after the first batch: start-up is reported apart
                first = time.perf_counter() - started
                steady = time.perf_counter()
                continue
            samples += len(batch.labels if spec["mode"] == "decode" else batch)
    print(json.dumps({"samples": samples, "seconds": time.perf_counter() - steady, "first": first}))


def ranks(spec: dict[str, Any], world_size: int) -> dict[str, float]:
    """Run every rank of ``world_size`` at once (one process each); samples/s over the slowest."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps({**spec, "rank": r, "world_size": world_size})],
            stdout=subprocess.PIPE,
        )
        for r in range(world_size)
    ]
    outs = [json.loads(p.communicate()[0].decode().strip().splitlines()[-1]) for p in procs]
    seconds = max(o["seconds"] for o in outs)
    whole = max(o["seconds"] + o["first"] for o in outs)
    samples = sum(o["samples"] for o in outs)
    return {
        "samples": samples,
        "seconds": seconds,
        "per_s": samples / seconds,
        "whole_per_s": samples / whole,  # the whole epoch, its first batch included
        "first": max(o["first"] for o in outs),
    }


def best_of(repeats: int, make: Any) -> dict[str, float]:
    runs = [make() for _ in range(repeats)]
    return max(runs, key=lambda r: r["per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--shard", type=int, default=100, help="samples per shard")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per bytes row (decode rows read one)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (per rank: this / ranks)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--remote", action="store_true")
    parser.add_argument("--remote-only", action="store_true", help="skip the local rows")
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--bandwidth", type=float, default=40e6)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    url = _data.dataset(args.images, "tar", samples_per_shard=args.shard)
    from streamload import StreamingDataset

    counts = [e.num_samples for e in StreamingDataset(url).manifest.shards]
    size = sum(os.path.getsize(os.path.join(url, e.name)) for e in StreamingDataset(url).manifest.shards)
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.images} JPEGs ({size / args.images / 1e3:.0f} KB mean) "
        f"in {len(counts)} shards of {args.shard}; global batch {args.batch}; {WORKERS} workers per rank"
    )
    print("\nshards open (from the plan): most a worker / the node needs at once")
    for world_size in (1, 2):
        for rule in RULES:
            w, n = footprint(counts, world_size, args.batch // world_size, rule)
            print(f"  {rule:3s} rule, {world_size} rank(s): worker {w:3d}  node {n:3d}")

    if args.remote_only:
        remote(args, url, counts, size)
        return
    raw = peers.raw_read_limit(url, args.images)
    dec = peers.decode_limits(_data.image_folder(args.images))
    print(
        f"\nlimits: raw read {raw['samples_per_s']:.0f} samples/s ({raw['bytes_per_s'] / 1e6:.0f} MB/s); "
        f"decode stage {dec['stage']:.0f} samples/s per core"
    )
    mean = size / args.images
    for mode in ("bytes", "decode"):
        for world_size in (1, 2):
            for rule in RULES:
                spec = {
                    "url": url,
                    "mode": mode,
                    "batch": args.batch // world_size,
                    "rule": rule_kwargs(rule, world_size, counts),
                }
                r = best_of(args.repeats, lambda spec=spec, world_size=world_size: ranks(spec, world_size))
                print(
                    f"  {mode:6s} {rule:3s} rule, {world_size} rank(s) x {WORKERS} workers: {r['per_s']:8.0f} "
                    f"samples/s {r['per_s'] * mean / 1e6:7.1f} MB/s  first batch {r['first']:.2f} s"
                )
    if args.remote:
        remote(args, url, counts, size)


def remote(args: argparse.Namespace, local: str, counts: list[int], size: int) -> None:
    """One cold epoch per rule and world from a shaped bucket: bytes and GETs per node at the proxy."""
    from tests.s3server import SeaweedS3
    from tests.shaping import ShapingProxy, upstream_of

    work = Path(tempfile.mkdtemp(prefix="bench-order-"))
    server = SeaweedS3(work / "seaweedfs")
    proxy = None
    try:
        server.start()
        bucket = server.make_bucket("order")
        import fsspec

        fs = fsspec.filesystem("s3", **server.storage_options())
        fs.put(local.rstrip("/") + "/", f"{bucket}/ds", recursive=True)
        proxy = ShapingProxy(upstream_of(server), args.latency, args.bandwidth, None)
        options = server.storage_options()
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
        print(
            f"\nfrom the bucket ({args.latency * 1e3:.0f} ms, {args.bandwidth / 1e6:.0f} MB/s per connection), "
            "cold cache shared by the node's ranks, bytes mode"
        )
        for world_size in (1, 2):
            for rule in RULES:
                shutil.rmtree(work / "cache", ignore_errors=True)
                before = proxy.stats.bytes_down
                spec = {
                    "url": f"s3://{bucket}/ds",
                    "mode": "bytes",
                    "batch": args.batch // world_size,
                    "rule": rule_kwargs(rule, world_size, counts),
                    "options": options,
                    "cache": str(work / "cache"),
                }
                r = ranks(spec, world_size)
                down = proxy.stats.bytes_down - before
                print(
                    f"  {rule:3s} rule, {world_size} rank(s) x {WORKERS} workers: {r['whole_per_s']:7.0f} samples/s "
                    f"over the whole cold epoch, downloaded {down / size:.2f} x the dataset, first batch "
                    f"{r['first']:.2f} s"
                )
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
