"""A Hugging Face-layout Parquet image dataset read in place, against its peers and against tar.

The benchmark's synthetic JPEGs (``_data.image_folder``, ~65 KB each) are written by the
real ``datasets`` library as a Hub split (``data/train-0000N-of-0000M.parquet``: an
``Image`` column and a ``ClassLabel``, row groups of 100), indexed once with
``streamload index --format parquet``, and read:

* streamload in place (the ``parquet`` format), ``RawCollate`` (bytes) or ``DecodeBatch(224)``;
* streamload after ``convert`` of the same files to tar (same collates);
* Hugging Face ``datasets`` streaming (``load_dataset("parquet", ..., streaming=True)``,
  images kept as bytes; in decode mode each image goes through the same ``ImageDecoder``).

Each row: samples/s over one epoch through a ``DataLoader`` (batch 64) with 0 and 2
workers, and the time from creating the loader's iterator to its first batch; median of
``--repeat`` epochs after an untimed one, local disk, page cache warm. LitData's Parquet streaming and the shaped
bucket are not measured here (see the docs for what was run).

    python benchmarks/bench_parquet.py [--images 1000] [--repeat 3] [--shuffle] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _data import OUT, folder_items, image_folder
from torch.utils.data import DataLoader

from streamload import StorageConfig, StreamingDataset
from streamload.batch import RawCollate
from streamload.decode import DecodeBatch, ImageDecoder

BATCH = 64
ROWS_PER_FILE = 500
ROW_GROUP = 100


def hf_split(num_images: int) -> str:
    """The image folder as a Hub-style split written by ``datasets`` (built once), indexed in place."""
    import datasets

    root = os.path.join(OUT, f"hf-{num_images}", "data")
    if os.path.exists(os.path.join(root, "index.json")):
        return root
    os.makedirs(root, exist_ok=True)
    items = folder_items(image_folder(num_images))
    classes = sorted({os.path.basename(os.path.dirname(p)) for p, _ in items})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    rng = np.random.default_rng(0)
    order = rng.permutation(len(items))  # a Hub split is usually shuffled
    files = -(-len(items) // ROWS_PER_FILE)
    for f in range(files):
        part = [items[i] for i in order[f * ROWS_PER_FILE : (f + 1) * ROWS_PER_FILE]]
        images = [{"bytes": open(p, "rb").read(), "path": None} for p, _ in part]
        split = datasets.Dataset.from_dict({"image": images, "label": [lab for _, lab in part]}, features=features)
        split.to_parquet(os.path.join(root, f"train-{f:05d}-of-{files:05d}.parquet"), batch_size=ROW_GROUP)
    from streamload.indexing import index_directory

    index_directory(root, "parquet", hash_algorithm="xxh3_128")
    return root


#: The layouts ``--codecs`` writes with pyarrow (``write_table`` options): small JPEGs as Spark
#: and most pipelines store them.
CODECS: dict[str, dict[str, Any]] = {
    "plain": {"compression": "none", "use_dictionary": False},
    "snappy": {"compression": "snappy"},
    "zstd": {"compression": "zstd"},
    # every value through the dictionary page (pyarrow falls back to PLAIN past 1 MB of dictionary)
    "dict": {"compression": "snappy", "use_dictionary": True, "dictionary_pagesize_limit": 1 << 30},
}
SMALL_ROWS_PER_FILE = 500


def small_jpegs(num_images: int, seed: int = 0) -> list[tuple[bytes, int]]:
    """``num_images`` synthetic JPEGs of 160-260 px (~20 KB), with labels (built once, kept in OUT)."""
    from streamload.synthetic import synthetic_jpeg

    root = os.path.join(OUT, f"small-{num_images}-s{seed}")
    done = os.path.join(root, ".done")
    if not os.path.exists(done):
        os.makedirs(root, exist_ok=True)
        rng = np.random.default_rng(seed)
        for i in range(num_images):
            w = int(rng.uniform(160, 260))
            with open(os.path.join(root, f"{i:06d}-{i % 10}.jpg"), "wb") as f:
                f.write(synthetic_jpeg(rng, w, w, quality=90, noise=12.0))
        open(done, "w").close()
    out = []
    for name in sorted(n for n in os.listdir(root) if n.endswith(".jpg")):
        with open(os.path.join(root, name), "rb") as f:
            out.append((f.read(), int(name[-5])))
    return out


def codec_splits(num_images: int, codecs: list[str]) -> dict[str, str]:
    """The small JPEGs as pyarrow-written Parquet (one directory per codec, indexed) and as tar, same images."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamload.indexing import index_directory

    items = small_jpegs(num_images)
    base = os.path.join(OUT, f"pq-codecs-{num_images}")
    roots = {}
    for codec in codecs:
        root = os.path.join(base, codec)
        roots[codec] = root
        if os.path.exists(os.path.join(root, "index.json")):
            continue
        os.makedirs(root, exist_ok=True)
        for f, lo in enumerate(range(0, len(items), SMALL_ROWS_PER_FILE)):
            part = items[lo : lo + SMALL_ROWS_PER_FILE]
            image = pa.StructArray.from_arrays(
                [pa.array([b for b, _ in part], pa.binary()), pa.array([None] * len(part), pa.string())],
                names=["bytes", "path"],
            )
            table = pa.table({"image": image, "label": pa.array([lab for _, lab in part], pa.int64())})
            pq.write_table(
                table, os.path.join(root, f"train-{f:05d}.parquet"), row_group_size=ROW_GROUP, **CODECS[codec]
            )
        index_directory(root, "parquet", hash_algorithm="xxh3_128")
    roots["tar"] = converted(roots[codecs[0]], os.path.join(base, "tar"))
    return roots


def raw_read_rate(root: str) -> float:
    """Samples/s of reading the dataset's files whole from the page cache, one thread: the machine's raw read limit."""
    files = [os.path.join(root, n) for n in sorted(os.listdir(root)) if n.endswith(".tar")]
    with open(os.path.join(root, "index.json")) as f:
        samples = int(json.load(f)["num_samples"])
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass
        best = max(best, samples / (time.perf_counter() - t0))
    return best


def converted(parquet: str, root: str | None = None) -> str:
    """The same samples converted to tar shards (``streamload convert``)."""
    from streamload.converters import ConvertOptions, DatasetSource, convert

    root = root or parquet.rstrip("/") + "-tar"
    if not os.path.exists(os.path.join(root, "index.json")):
        convert(DatasetSource(parquet), root, ConvertOptions(samples_per_shard=ROWS_PER_FILE, progress=False))
    return root


#: Shuffle as in training (streamload: its shuffle window; ``datasets``: a 1000-sample buffer).
SHUFFLE = False


def streamload_loader(url: str, mode: str, workers: int, storage: StorageConfig | None = None) -> DataLoader[Any]:
    collate: Any = RawCollate() if mode == "bytes" else DecodeBatch(224)
    if storage is not None:  # a cold cache for every epoch
        storage = replace(storage, cache_dir=tempfile.mkdtemp(prefix="bench-parquet-cache-", dir=OUT))
    ds = StreamingDataset(url, batch_size=BATCH, collate=collate, shuffle=SHUFFLE, seed=0, storage=storage)
    return DataLoader(ds, batch_size=None, num_workers=workers)


def shaped_bucket(parquet: str, tar: str) -> tuple[Any, Any, str, str, dict[str, Any]]:
    """SeaweedFS on loopback behind the tests' shaping proxy (50 ms to first byte, 40 MB/s a
    connection, 400 MB/s in all), holding both datasets (uploaded straight to the server)."""
    import fsspec

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.s3server import SeaweedS3
    from tests.shaping import ShapingProxy, upstream_of

    server = SeaweedS3(Path(tempfile.mkdtemp(prefix="bench-parquet-s3-", dir=OUT)))
    server.start()
    proxy = ShapingProxy(
        upstream_of(server), latency=0.05, bandwidth=40e6, node_bandwidth=400e6, max_lifetime=24 * 3600
    )
    bucket = server.make_bucket()
    direct = server.storage_options()
    fs = fsspec.filesystem("s3", **direct)
    for local, prefix in ((parquet, "parquet"), (tar, "tar")):
        for name in sorted(os.listdir(local)):
            if not name.startswith((".", "_")):
                fs.put_file(os.path.join(local, name), f"s3://{bucket}/{prefix}/{name}")
    shaped = {**direct, "client_kwargs": {**direct["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
    return server, proxy, f"s3://{bucket}/parquet", f"s3://{bucket}/tar", shaped


class _Decoded:
    """Collate for the peer: decode each image with the same decoder streamload uses."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.decoder = ImageDecoder(224)

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        labels = torch.tensor([r["label"] for r in rows])
        if self.mode == "bytes":
            return [r["image"]["bytes"] for r in rows], labels
        out = np.empty((len(rows), 224, 224, 3), dtype=np.uint8)
        for i, r in enumerate(rows):
            self.decoder.decode_into(r["image"]["bytes"], out[i])
        return torch.from_numpy(out), labels


def hf_loader(parquet: str, mode: str, workers: int, files: list[str] | None = None, **options: Any) -> DataLoader[Any]:
    import datasets

    files = files or sorted(glob.glob(os.path.join(parquet, "train-*.parquet")))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True, **options)
    ds = ds.cast_column("image", datasets.Image(decode=False))
    if SHUFFLE:
        ds = ds.shuffle(seed=0, buffer_size=1000)
    return DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=_Decoded(mode))


def epoch(make: Callable[[], DataLoader[Any]]) -> tuple[float, float, int]:
    """(samples/s, seconds to the first batch, samples) of one epoch."""
    t0 = time.perf_counter()
    it: Iterator[Any] = iter(make())
    first = next(it)
    ttfb = time.perf_counter() - t0
    count = len(first[1]) if isinstance(first, (tuple, list)) else len(first)
    for batch in it:
        count += len(batch[1]) if isinstance(batch, (tuple, list)) else len(batch)
    return count / (time.perf_counter() - t0), ttfb, count


def codec_main(args: argparse.Namespace) -> None:
    """``--codecs``: pyarrow-written Parquet (compressed, dictionary-encoded) against tar of the same images.

    Bytes mode (``RawCollate``, batch 64), each configuration ``--passes`` epochs per round
    (a fresh loader each), rounds interleaved (the machine is shared: best and median of
    ``--repeat`` rounds), ratios to tar.
    """
    codecs = args.codecs.split(",")
    roots = codec_splits(args.images, codecs)
    limit = raw_read_rate(roots["tar"])
    stop: list[Any] = []
    storage: StorageConfig | None = None
    urls = dict(roots)
    if args.bucket:  # streamed by ranged GETs from the shaped bucket, cache="none"
        server, proxy, _, tar_url, shaped = shaped_bucket(roots[codecs[0]], roots["tar"])
        stop = [proxy, server]
        urls = {"tar": tar_url}
        for codec in codecs:
            urls[codec] = upload(server, tar_url.split("/")[2], roots[codec], codec)
        storage = StorageConfig(storage_options=shaped, cache="none")
    names = ["tar", *codecs]
    workers = [int(w) for w in args.workers.split(",")]
    print(
        f"{args.images} JPEGs (~{_mean_kb(roots['tar']):.0f} KB), "
        f"row groups of {ROW_GROUP}, bytes (RawCollate, batch {BATCH}), "
        f"{'bucket, cache=none' if args.bucket else 'local'}; "
        f"raw read limit {limit:,.0f} samples/s; load {os.getloadavg()}"
    )
    rates: dict[tuple[str, int], list[float]] = {(n, w): [] for n in names for w in workers}
    for w in workers:
        for n in names:  # warm-up, not timed
            epoch(lambda n=n, w=w: streamload_loader(urls[n], "bytes", w, storage))
    for _ in range(args.repeat):
        for w in workers:
            for n in names:
                seconds = 0.0
                for _ in range(args.passes):
                    rate, _, count = epoch(lambda n=n, w=w: streamload_loader(urls[n], "bytes", w, storage))
                    assert count in (args.images, -(-args.images // BATCH) * BATCH), count
                    seconds += count / rate
                rates[n, w].append(args.passes * count / seconds)
    results = []
    for w in workers:
        tar = rates["tar", w]
        for n in names:
            got = rates[n, w]
            best, median = max(got), statistics.median(got)
            row = {"layout": n, "workers": w, "best": best, "median": median}
            row["best_vs_tar"], row["median_vs_tar"] = best / max(tar), median / statistics.median(tar)
            results.append(row)
            print(
                f"  {w} workers  {n:<7} best {best:8,.0f}/s  median {median:8,.0f}/s   "
                f"vs tar: best {row['best_vs_tar']:.2f}  median {row['median_vs_tar']:.2f}"
            )
    print(f"load {os.getloadavg()}")
    for thing in stop:
        thing.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "images": args.images,
                    "bucket": args.bucket,
                    "raw_read_limit": limit,
                    "load": os.getloadavg(),
                    "repeat": args.repeat,
                    "results": results,
                },
                f,
                indent=1,
            )


def _mean_kb(tar_root: str) -> float:
    with open(os.path.join(tar_root, "index.json")) as f:
        manifest = json.load(f)
    return sum(int(s["bytes"]) for s in manifest["shards"]) / max(1, int(manifest["num_samples"])) / 1000


def upload(server: Any, bucket: str, root: str, prefix: str) -> str:
    """Upload a dataset folder to ``bucket`` under ``prefix`` (straight to the server); its URL."""
    import fsspec

    fs = fsspec.filesystem("s3", **server.storage_options())
    for name in sorted(os.listdir(root)):
        if not name.startswith((".", "_")):
            fs.put_file(os.path.join(root, name), f"s3://{bucket}/{prefix}/{name}")
    return f"s3://{bucket}/{prefix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default="bytes,decode")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--shuffle", action="store_true", help="shuffle (as in training)")
    parser.add_argument("--bucket", action="store_true", help="read from a shaped S3 bucket instead of local disk")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--passes", type=int, default=6, help="--codecs: epochs per configuration and round")
    parser.add_argument(
        "--codecs",
        help=f"pyarrow-written layouts against tar instead (of {','.join(CODECS)}; ~20 KB JPEGs, bytes mode)",
    )
    args = parser.parse_args()
    if args.codecs:
        codec_main(args)
        return
    global SHUFFLE
    SHUFFLE = args.shuffle
    import datasets  # noqa: F401 - imported before any timing (pyarrow with it), for every reader alike

    parquet = hf_split(args.images)
    tar = converted(parquet)
    readers: dict[str, Callable[[str, int], DataLoader[Any]]] = {
        "streamload parquet in place": lambda mode, w: streamload_loader(parquet, mode, w),
        "streamload tar (converted)": lambda mode, w: streamload_loader(tar, mode, w),
        "HF datasets streaming": lambda mode, w: hf_loader(parquet, mode, w),
    }
    stop: list[Any] = []
    if args.bucket:
        server, proxy, pq_url, tar_url, shaped = shaped_bucket(parquet, tar)
        stop = [proxy, server]
        names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(parquet, "train-*.parquet")))
        remote_files = [f"{pq_url}/{n}" for n in names]
        stream = StorageConfig(storage_options=shaped, cache="none")
        cached = StorageConfig(storage_options=shaped, cache="shards")
        readers = {
            "streamload parquet, cache=none": lambda m, w: streamload_loader(pq_url, m, w, stream),
            "streamload parquet, cold cache": lambda m, w: streamload_loader(pq_url, m, w, cached),
            "streamload tar, cache=none": lambda m, w: streamload_loader(tar_url, m, w, stream),
            "streamload tar, cold cache": lambda m, w: streamload_loader(tar_url, m, w, cached),
            "HF datasets streaming": lambda m, w: hf_loader(
                "", m, w, files=remote_files, storage_options=copy.deepcopy(shaped)
            ),
        }
    files = len(glob.glob(parquet + "/*.parquet"))
    print(f"{args.images} JPEGs (~65 KB) in {files} Parquet files; load {os.getloadavg()}")
    results = []
    for mode in args.modes.split(","):
        for workers in map(int, args.workers.split(",")):
            for name, make in readers.items():
                epoch(lambda make=make, mode=mode, workers=workers: make(mode, workers))  # warm-up, not timed
                runs = [
                    epoch(lambda make=make, mode=mode, workers=workers: make(mode, workers)) for _ in range(args.repeat)
                ]
                rate = statistics.median(r[0] for r in runs)
                ttfb = statistics.median(r[1] for r in runs)
                # streamload pads an epoch to whole batches (1000 -> 1024 samples), the peer does not
                assert all(r[2] in (args.images, -(-args.images // BATCH) * BATCH) for r in runs), [r[2] for r in runs]
                results.append(
                    {"reader": name, "mode": mode, "workers": workers, "samples_per_s": rate, "ttfb_s": ttfb}
                )
                print(
                    f"  {mode:<6} {workers} workers  {name:<30} {rate:9.0f} samples/s  first batch {ttfb * 1e3:7.0f} ms"
                )
    for thing in stop:
        thing.stop()
    if args.json:
        with open(args.json, "w") as f:
            record = {
                "images": args.images,
                "shuffle": args.shuffle,
                "bucket": args.bucket,
                "load": os.getloadavg(),
                "results": results,
            }
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
