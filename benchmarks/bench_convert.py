"""Conversion at scale: executors, a bucket as source, planning a huge listing, listing a big prefix.

Three figures (each can be run alone):

    throughput   images/s and MB/s converting a synthetic folder, from local disk and from a
                 bucket (SeaweedFS on loopback, started here), with the local, dask and ray
                 executors at 1 and 2 processes (tar shards to local disk)
    planning     driver memory (peak RSS growth of a fresh process) and time to scan and plan
                 a Parquet listing of N rows of paths (no image is read: the plan only), the
                 number of shards and the size of the pickled plan; --shuffle plans a
                 seeded permutation instead (O(rows) by nature)
    listing      time and driver memory of the one recursive listing (``list_tree``) of a bucket
                 prefix of M empty objects (made through the SeaweedFS filer, see below)

    python benchmarks/bench_convert.py throughput --images 2000
    python benchmarks/bench_convert.py planning --rows 10000000
    python benchmarks/bench_convert.py listing --objects 100000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamload.converters import ConvertOptions, ImageFolderSource, RemoteImageFolderSource, convert  # noqa: E402
from streamload.synthetic import make_image_folder  # noqa: E402
from tests.s3server import SeaweedS3  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def throughput(images: int, work: Path) -> list[dict[str, Any]]:
    folder = work / "images"
    make_image_folder(str(folder), num_classes=10, per_class=images // 10, size=(128, 96), seed=0)
    server = SeaweedS3(work / "s3")
    server.start()
    rows: list[dict[str, Any]] = []
    try:
        so = server.storage_options()
        bucket = server.make_bucket()
        fs = server.filesystem()
        fs.put(str(folder) + "/", f"{bucket}/images/", recursive=True)
        sources = {
            "local folder": lambda: ImageFolderSource(str(folder)),
            "bucket": lambda: RemoteImageFolderSource(f"s3://{bucket}/images", so),
        }
        for name, make in sources.items():
            for executor in ("local", "dask", "ray"):
                for workers in (1, 2):
                    out = work / f"out-{executor}-{workers}"
                    shutil.rmtree(out, ignore_errors=True)
                    started = time.perf_counter()
                    report = convert(
                        make(),
                        str(out),
                        ConvertOptions(
                            shard_bytes="4MB", workers=workers, executor=executor, progress=False, storage_options=so
                        ),
                    )
                    seconds = time.perf_counter() - started  # engine start-up included
                    m = report.manifest
                    rows.append(
                        {
                            "source": name,
                            "executor": executor,
                            "processes": workers,
                            "images": m.num_samples,
                            "seconds": round(seconds, 2),
                            "images_per_s": round(m.num_samples / seconds),
                            "MB_per_s": round(report.payload_bytes / seconds / 1e6, 1),
                        }
                    )
                    print(rows[-1], flush=True)
    finally:
        server.stop()
    return rows


#: Scans and plans a table in a fresh process; its RSS is sampled every 2 ms while it plans.
_PLAN_CHILD = """
import json, os, pickle, sys, threading, time
sys.path.insert(0, sys.argv[1])
from streamload.converters import ConvertOptions, TableSource
from streamload.converters.engine import _scan_and_plan

PAGE = os.sysconf("SC_PAGE_SIZE")

def rss_mb():  # the current resident set (ru_maxrss would keep the imports' transient peak)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20

source = TableSource(sys.argv[2])
options = ConvertOptions(samples_per_shard=int(sys.argv[3]), shuffle=sys.argv[4] == "1")
before = peak = rss_mb()
done = threading.Event()

def watch():
    global peak
    while not done.wait(0.002):
        peak = max(peak, rss_mb())

watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
started = time.perf_counter()
planned = list(enumerate(_scan_and_plan(source, options, "").shards))
seconds = time.perf_counter() - started
done.set()
watcher.join()
peak = max(peak, rss_mb())
print(json.dumps({
    "shards": len(planned),
    "samples": sum(len(shard) for _, shard in planned),
    "scan_plan_s": round(seconds, 2),
    "peak_rss_growth_MB": round(peak - before, 1),
    "plan_pickle_KB": round(len(pickle.dumps(planned)) / 1024, 1),
}))
"""


def planning(rows: int, work: Path, samples_per_shard: int = 1000, shuffle: bool = False) -> dict[str, Any]:
    """Scan and plan a generated Parquet listing of ``rows`` paths in a fresh process (the engine's own call)."""
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = work / "listing.parquet"
    writer = pq.ParquetWriter(path, pa.schema([("path", pa.string()), ("label", pa.int64())]))
    step = 1_000_000
    for start in range(0, rows, step):
        n = min(step, rows - start)
        paths = pa.array([f"images/{i // 1000:05d}/{i:09d}.jpg" for i in range(start, start + n)])
        writer.write_table(pa.table({"path": paths, "label": pa.array([i % 1000 for i in range(start, start + n)])}))
    writer.close()
    out = subprocess.run(
        [sys.executable, "-c", _PLAN_CHILD, str(ROOT), str(path), str(samples_per_shard), "1" if shuffle else "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    result = {"rows": rows, "samples_per_shard": samples_per_shard, "shuffle": shuffle, **json.loads(out.stdout)}
    print(result, flush=True)
    return result


def _create_empty_objects(server: SeaweedS3, bucket: str, prefix: str, objects: int, connections: int) -> float:
    """Create ``objects`` empty objects ``<prefix>/class_NN/NNNNNNN.jpg``; return the seconds taken.

    They are written through SeaweedFS's filer HTTP API (the bucket is the filer folder
    ``/buckets/<bucket>``), one keep-alive connection per thread: an empty object is a
    filer entry without chunks, about ten times faster to make than a put through the S3
    gateway (signing, one volume write per object). The S3 listing sees them like any
    other object (size 0); a listing's cost does not depend on the objects' sizes.
    """
    import http.client

    def create(first: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.filer_port, timeout=60)
        try:
            for i in range(first, objects, connections):
                conn.request("PUT", f"/buckets/{bucket}/{prefix}/class_{i % 10:02d}/{i:07d}.jpg", body=b"")
                response = conn.getresponse()
                response.read()
                if response.status >= 300:
                    raise RuntimeError(f"filer PUT of object {i} answered {response.status}")
        finally:
            conn.close()

    started = time.perf_counter()
    with ThreadPoolExecutor(connections) as pool:
        list(pool.map(create, range(connections)))
    return time.perf_counter() - started


_LIST_CHILD = """
import json, os, sys, threading, time
from streamload.converters.bucket import _found, list_tree
from streamload.storage.filesystems import open_filesystem

url, how = sys.argv[1], sys.argv[2]
so = json.loads(sys.argv[3])
def rss():  # resident set now, MB
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
fs, root = open_filesystem(url, so)
fs.ls(root.partition("/")[0])  # the client is made and connected before the measure
before = peak = rss()
done = threading.Event()
def sample():
    global peak
    while not done.wait(0.005):
        peak = max(peak, rss())
sampler = threading.Thread(target=sample)
sampler.start()
started = time.perf_counter()
found = list_tree(url, so)[1] if how == "list_tree" else _found(fs, root)
seconds = time.perf_counter() - started
done.set()
sampler.join()
peak = max(peak, rss())
print(json.dumps({"objects": len(found), "seconds": seconds, "peak_rss_growth_MB": peak - before}))
"""


def _list_in_child(url: str, how: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """List ``url`` in a fresh process (``list_tree``, or fsspec ``find``): seconds and peak RSS growth."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", _LIST_CHILD, url, how, json.dumps(storage_options)]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def listing(objects: int, work: Path, connections: int = 8, rounds: int = 2) -> dict[str, Any]:
    """Time ``list_tree`` (the converter's one recursive listing) over ``objects`` objects, and its memory.

    Each listing runs in a fresh process, whose resident set is sampled every 5 ms
    (peak minus the resident set before the listing); ``list_tree``
    (S3 pages read one by one, path and size kept) and fsspec's ``find`` (what it used
    before) alternate, ``rounds`` times each, on the same objects.
    """
    server = SeaweedS3(work / "s3")
    server.start()
    try:
        bucket = server.make_bucket()
        created = _create_empty_objects(server, bucket, "images", objects, connections)
        url = f"s3://{bucket}/images"
        so = server.storage_options()
        runs: dict[str, list[dict[str, Any]]] = {"list_tree": [], "find": []}
        for _ in range(rounds):
            for how, results in runs.items():
                results.append(_list_in_child(url, how, so))
                if results[-1]["objects"] != objects:
                    raise RuntimeError(f"{how} found {results[-1]['objects']} objects, {objects} were made")
        started = time.perf_counter()
        items = RemoteImageFolderSource(url, so, check="none").scan().items  # the listing, then the scan
        scanned = time.perf_counter() - started
    finally:
        server.stop()
    result: dict[str, Any] = {
        "objects": objects,
        "create_s": round(created, 1),
        "create_objects_per_s": round(objects / created),
        "source_scan_s": round(scanned, 2),
        "items": len(items),
    }
    for how, results in runs.items():
        best = min(r["seconds"] for r in results)
        result[f"{how}_s"] = [round(r["seconds"], 2) for r in results]
        result[f"{how}_objects_per_s"] = round(objects / best)
        result[f"{how}_peak_rss_growth_MB"] = round(max(r["peak_rss_growth_MB"] for r in results), 1)
    print(result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=("throughput", "planning", "listing"))
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--samples-per-shard", type=int, default=1000, help="planning: rows per shard")
    parser.add_argument("--shuffle", action="store_true", help="planning: plan a seeded permutation")
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-convert-"))
    try:
        if args.figure == "throughput":
            result: Any = throughput(args.images, work)
        elif args.figure == "planning":
            result = planning(args.rows, work, args.samples_per_shard, args.shuffle)
        else:
            result = listing(args.objects, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"result": result, "load": load}, indent=1))


if __name__ == "__main__":
    main()
