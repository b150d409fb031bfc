"""Far bucket: streamload, MosaicML Streaming and LitData reading the same shards from one shaped S3 endpoint.

    bash benchmarks/setup_peers.sh                 # once: the peers, in benchmarks/out/peers-venv
    python benchmarks/bench_remote.py              # the whole comparison, a few minutes
    python benchmarks/bench_remote.py --smoke --no-peers   # streamload only, tiny, < 1 minute

What one run does:

1. Starts a real S3 server on loopback (SeaweedFS, ``tests/s3server.py``) and, in front of
   it, the shaping proxy of the tests (``tests/shaping.py``): every response waits
   ``--latency`` (default 50 ms) for its first byte, each connection gets ``--conn-mbps``
   (40 MB/s) and all of them together ``--node-mbps`` (400 MB/s), paced by deadlines.
2. Makes ``--images`` synthetic JPEGs of ImageNet-like sizes (~65 KB, cached under
   benchmarks/out/) and writes them three ways with ``--shard-mb`` (64 MiB) shards:
   streamload tar shards, MosaicML MDS shards (``MDSWriter``) and LitData chunks
   (``litdata.optimize``; both in the peers venv), then uploads all three to one bucket
   (straight to the server, not through the proxy).
3. Measures the machine's limits in the same run: the raw local read rate of the tar
   shards, the single-core rate of the per-sample decode, and what the shaped link
   really gives: time to first byte, one connection, and parallel ranged GETs.
4. Runs every row in its own subprocess under a hard timeout (a stalled loader is
   reported as "stalled after N s", never hangs the run): for each loader x mode x
   DataLoader workers x cache state, one epoch, timed from the dataset's construction:
   samples/s over the whole epoch (first batch included), MB/s of JPEG payload, time to
   the first batch, and GET requests per shard (the S3 server's GET counter, and every
   request the proxy saw, over the loader's number of shards/chunks). Every row must
   deliver every sample once with its label (count and label histogram); a streamload
   row whose dataset makes the batches (``batch_size=``) reads its epoch padded to whole
   batches: every sample once plus ``T - N`` repeats, ``T = ceil(N / batch) * batch``.

Loaders: ``streamload local`` (the tar shards on local disk, page cache warm: the
reference of the ``x local`` column), ``streamload`` (from the bucket through its shard
cache), ``streamload stream`` (``StorageConfig(cache="none")``: no shard cache),
``mosaicml`` and ``litdata`` (run by the peers venv's Python; MosaicML finds the
endpoint in ``S3_ENDPOINT_URL``, LitData in ``storage_options``; LitData 0.2's obstore
path needs ``allow_http`` for a plain-HTTP endpoint, set in its process).

Modes, the same per-sample work for every loader: ``bytes`` hands the JPEG bytes and
the label to the training loop (streamload as ``RawCollate`` batches, and as per-sample
dicts collated to a list like the peers do); ``decode`` decodes, resizes the shorter side
to 256 and center-crops 224 with ``streamload.decode.ImageDecoder`` (backend
``--backend``, Pillow by default) -- streamload through ``DecodeBatch``, the peers in
their ``__getitem__`` -- and collates ``uint8 [B, 3, 224, 224]``.

Cache states: ``cold`` starts from an empty cache directory; ``warm`` is a new process
reading the same cache directory again.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
PEERS_PYTHON = OUT / "peers-venv" / "bin" / "python"
RESIZE, CROP = 256, 224
PEERS = ("mosaicml", "litdata")


# -- per-sample work, the same for every loader (module level: used in DataLoader workers) ----


class Work:
    """What a loader does with one sample: keep its JPEG bytes, or decode + resize 256 + crop 224."""

    def __init__(self, mode: str, backend: str) -> None:
        self.mode = mode
        self.backend = backend
        self._decoder: Any = None

    def __call__(self, jpg: Any) -> Any:
        if self.mode == "bytes":
            return bytes(jpg)
        if self._decoder is None:
            from streamload.decode import ImageDecoder

            self._decoder = ImageDecoder(CROP, resize=RESIZE, backend=self.backend)  # type: ignore[arg-type]
        import torch

        return torch.from_numpy(self._decoder.decode(jpg)).permute(2, 0, 1)


def pair_collate(items: list[tuple[Any, int]]) -> tuple[Any, Any]:
    """``[(payload, label)]`` to ``(list of bytes | uint8 [B, 3, H, W], int64 [B])``."""
    import torch

    payload = [p for p, _ in items]
    labels = torch.tensor([int(label) for _, label in items], dtype=torch.int64)
    if payload and not isinstance(payload[0], bytes):
        return torch.stack(payload), labels
    return payload, labels


class SampleCollate:
    """streamload's per-sample dicts to the peers' batch shape."""

    def __init__(self, work: Work) -> None:
        self.work = work

    def __call__(self, samples: list[dict[str, Any]]) -> tuple[Any, Any]:
        from streamload.sample import label_of

        return pair_collate([(self.work(s["jpg"]), label_of(s)) for s in samples])


# -- one row, inside its subprocess -------------------------------------------------------


def _streamload_loader(spec: dict[str, Any]) -> tuple[Iterable[Any], str]:
    from torch.utils.data import DataLoader

    from streamload import StorageConfig, StreamingDataset
    from streamload.batch import RawCollate
    from streamload.decode import DecodeBatch

    kwargs: dict[str, Any] = {}
    if spec["source"] != "local":
        # The cached rows cache whole shards, whatever "auto" would pick.
        cache = "none" if spec["variant"].startswith("stream") else "shards"
        options, cache_dir = spec["storage_options"], spec["cache_dir"]
        kwargs["storage"] = StorageConfig(storage_options=options, cache_dir=cache_dir, cache=cache)
    if spec.get("shuffle"):
        kwargs["shuffle"] = True
    batch, workers = spec["batch"], spec["workers"]
    common: dict[str, Any] = {"num_workers": workers}
    if workers:
        common["multiprocessing_context"] = "fork"
    if spec["mode"] == "decode":
        ds = StreamingDataset(
            spec["url"],
            batch_size=batch,
            collate=DecodeBatch(CROP, resize=RESIZE, backend=spec["backend"]),
            **kwargs,
        )
        return DataLoader(ds, batch_size=None, **common), "images"
    if spec["variant"].endswith("raw"):
        ds = StreamingDataset(spec["url"], batch_size=batch, collate=RawCollate(), **kwargs)
        return DataLoader(ds, batch_size=None, **common), "raw"
    ds = StreamingDataset(spec["url"], **kwargs)
    collate = SampleCollate(Work("bytes", spec["backend"]))
    return DataLoader(ds, batch_size=batch, collate_fn=collate, **common), "pair"


def _mosaicml_loader(spec: dict[str, Any]) -> tuple[Iterable[Any], str]:
    from streaming import StreamingDataset as MDSDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    work = Work(spec["mode"], spec["backend"])

    class Mapped(MDSDataset):  # type: ignore[misc]
        def __getitem__(self, index: int) -> Any:
            item = super().__getitem__(index)
            return work(item["jpg"]), int(item["cls"])

    ds = Mapped(remote=spec["url"], local=spec["cache_dir"], batch_size=spec["batch"], shuffle=False)
    common: dict[str, Any] = {"num_workers": spec["workers"]}
    if spec["workers"]:
        common["multiprocessing_context"] = "fork"
    return DataLoader(ds, batch_size=spec["batch"], collate_fn=pair_collate, **common), "pair"


def _litdata_loader(spec: dict[str, Any]) -> tuple[Iterable[Any], str]:
    import litdata
    from litdata.streaming import downloader

    # obstore (LitData's chunk path) refuses plain-HTTP endpoints unless told otherwise.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]
    work = Work(spec["mode"], spec["backend"])

    class Mapped(litdata.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            item = super().__getitem__(index)
            return work(item["jpg"]), int(item["cls"])

    options = spec["storage_options"]
    ds = Mapped(
        input_dir=spec["url"],
        cache_dir=spec["cache_dir"],
        storage_options={
            "endpoint_url": options["client_kwargs"]["endpoint_url"],
            "aws_access_key_id": options["key"],
            "aws_secret_access_key": options["secret"],
            "region_name": "us-east-1",
        },
    )
    loader = litdata.StreamingDataLoader(
        ds, batch_size=spec["batch"], collate_fn=pair_collate, num_workers=spec["workers"]
    )
    return loader, "pair"


def _preimport(loader: str, source: str) -> None:
    """Import what the row needs, its S3 client included, so that imports are not timed."""
    import torch.utils.data  # noqa: F401

    import streamload.batch  # noqa: F401
    import streamload.decode  # noqa: F401

    if loader == "streamload" and source != "local":
        import s3fs  # noqa: F401
    elif loader == "mosaicml":
        import boto3  # noqa: F401
        import streaming  # noqa: F401
    elif loader == "litdata":
        import boto3  # noqa: F401, F811
        import litdata  # noqa: F401
        import obstore  # noqa: F401


def _log_timeline(path: str, t0: float) -> Callable[[], None]:
    """Append streamload's DEBUG lines to ``path`` as ``seconds-since-t0 pid message`` (workers inherit it).

    Returns what undoes it (rows run inline share the process).
    """

    class Relative(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{record.created - t0:7.3f} pid={record.process} {record.getMessage()}"

    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(Relative())
    logger = logging.getLogger("streamload")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()

    return undo


def print_timeline(path: Path, first: float) -> None:
    """Print the timeline of a row up to its first batch (each step's start and end)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    keep = [ln for ln in lines if ln.split() and float(ln.split()[0]) <= first + 1e-3]
    wanted = [ln for ln in keep if any(w in ln for w in (": start", ": done", "loader built", "first batch"))]
    for ln in wanted[:40]:
        print("    " + ln)


def print_profile(path: Path, top: int = 14) -> None:
    """Print the functions of a row's profile with the most time of their own (all threads of its process)."""
    import pstats

    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    print(f"    profile: {total:.2f} s of CPU in the row's threads; own CPU time of the costliest functions:")
    for (file, lineno, func), (_, calls, own, _cumulative, _) in rows:
        where = f"{Path(file).name}:{lineno}" if lineno else file
        print(f"    {own:7.3f} s {own / total * 100:5.1f}%  {calls:8d} calls  {func} ({where})")


def _profiled(spec: dict[str, Any]) -> dict[str, Any]:
    """``run_row`` under cProfile in every thread of this process (threading.setprofile for new threads)."""
    import cProfile
    import threading

    _preimport(spec["loader"], spec["source"])  # imports are not the loader's work
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    def start_thread(*_: Any) -> None:
        profile = cProfile.Profile(time.thread_time)  # CPU of this thread, not time spent waiting
        with lock:
            profiles.append(profile)
        threading.setprofile(None)
        sys.setprofile(None)
        profile.enable()

    main = cProfile.Profile(time.thread_time)
    threading.setprofile(start_thread)
    main.enable()
    try:
        return run_row({k: v for k, v in spec.items() if k != "profile"})
    finally:
        main.disable()
        threading.setprofile(None)
        for profile in profiles:
            profile.disable()
        import pstats

        stats = pstats.Stats(main)
        for profile in profiles:
            try:
                stats.add(profile)
            except (TypeError, ValueError):
                continue
        stats.dump_stats(spec["profile"])


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    """Read one epoch as ``spec`` says; time it from the dataset's construction; check count and labels."""
    if spec.get("profile"):
        return _profiled(spec)
    expected = np.asarray(spec["histogram"], dtype=np.int64)
    makers: dict[str, Callable[[dict[str, Any]], tuple[Iterable[Any], str]]] = {
        "streamload": _streamload_loader,
        "mosaicml": _mosaicml_loader,
        "litdata": _litdata_loader,
    }
    _preimport(spec["loader"], spec["source"])  # imports are not the loader's time to first batch
    timeline = spec.get("timeline")
    undo = _log_timeline(timeline, time.time()) if timeline else None  # DEBUG lines, workers included
    try:
        return _run_row(spec, makers, expected, timeline)
    finally:
        if undo is not None:
            undo()


def _run_row(
    spec: dict[str, Any],
    makers: dict[str, Callable[[dict[str, Any]], tuple[Iterable[Any], str]]],
    expected: np.ndarray,
    timeline: str | None,
) -> dict[str, Any]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    spec["_cpu0"] = usage.ru_utime + usage.ru_stime  # imports and set-up are not the row's CPU
    start = time.perf_counter()
    loader, kind = makers[spec["loader"]](spec)
    if timeline:
        logging.getLogger("streamload").debug("loader built; iterating")
    hist = np.zeros(len(expected), dtype=np.int64)
    samples = 0
    first = 0.0
    shape_ok = True
    for batch in loader:
        if kind == "raw":
            n, labels = batch.batch_size, batch.labels
            shape_ok = shape_ok and int(batch.data.numel()) > 0
        elif kind == "images":
            images, labels = batch
            n = len(labels)
            shape_ok = shape_ok and tuple(images.shape) == (n, 3, CROP, CROP)
        else:
            payload, labels = batch
            n = len(labels)
            if spec["mode"] == "decode":
                shape_ok = shape_ok and tuple(payload.shape) == (n, 3, CROP, CROP)
            else:
                shape_ok = shape_ok and all(len(p) > 0 for p in payload)
        hist += np.bincount(np.asarray(labels), minlength=len(expected))[: len(expected)]
        samples += n
        if not first:
            first = time.perf_counter() - start
            if timeline:
                logging.getLogger("streamload").debug("first batch")
    wall = time.perf_counter() - start
    del loader  # workers exit (and are waited for) before their CPU is read
    import gc
    import resource

    gc.collect()
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime - spec.get("_cpu0", 0.0)
    # A streamload dataset given batch_size= (the "raw" and "images" loaders; one process)
    # pads its epoch to whole batches; per-sample streamload rows and the peers do not.
    padded = spec["loader"] == "streamload" and kind in ("raw", "images")
    sys.path.insert(0, str(HERE))
    import _data

    from streamload.plan.planner import padded_total

    total = padded_total(int(expected.sum()), spec["batch"], drop_last=False) if padded else int(expected.sum())
    ok = shape_ok and _data.epoch_ok(hist, expected, samples, total)
    return {"ok": ok, "samples": samples, "first_batch_s": first, "wall_s": wall, "cpu_s": cpu}


# -- the driver's parts -------------------------------------------------------------------


def make_images(root: Path, count: int, seed: int = 0) -> Path:
    """``count`` ImageNet-sized synthetic JPEGs in 10 class folders under ``root`` (kept if complete)."""
    sys.path.insert(0, str(HERE))
    import _data

    done = root / ".done"
    if not done.exists():
        from concurrent.futures import ProcessPoolExecutor

        per_class = -(-count // 10)
        jobs = [(str(root), c, min(per_class, count - c * per_class), seed) for c in range(10)]
        jobs = [job for job in jobs if job[2] > 0]
        if count < 1000:  # a pool costs more than it saves
            for job in jobs:
                _data._write_class(job)
        else:
            with ProcessPoolExecutor(2) as pool:
                list(pool.map(_data._write_class, jobs))
        done.touch()
    return root


def folder_items(folder: Path) -> list[tuple[str, int]]:
    """``(path, label)`` of every JPEG, labels by sorted class folder."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    return [(str(p), label) for label, c in enumerate(classes) for p in sorted((folder / c).glob("*.jpg"))]


def write_peer_datasets(spec: dict[str, Any]) -> None:
    """In the peers venv: the image folder as MDS shards and LitData chunks of ``shard_bytes``."""
    items = [tuple(x) for x in spec["items"]]
    mds, lit = Path(spec["mds"]), Path(spec["litdata"])
    if "mosaicml" in spec["peers"] and not (mds / ".done").exists():
        from streaming import MDSWriter

        shutil.rmtree(mds, ignore_errors=True)
        with MDSWriter(out=str(mds), columns={"jpg": "bytes", "cls": "int"}, size_limit=spec["shard_bytes"]) as w:
            for path, label in items:
                w.write({"jpg": Path(path).read_bytes(), "cls": label})
        (mds / ".done").touch()
    if "litdata" in spec["peers"] and not (lit.parent / f".{lit.name}.done").exists():
        import litdata

        shutil.rmtree(lit, ignore_errors=True)
        litdata.optimize(
            fn=_lit_item, inputs=items, output_dir=str(lit), chunk_bytes=spec["shard_bytes"], num_workers=1
        )
        (lit.parent / f".{lit.name}.done").touch()


def _lit_item(item: tuple[str, int]) -> dict[str, Any]:
    return {"jpg": Path(item[0]).read_bytes(), "cls": item[1]}


def link_rate(spec: dict[str, Any]) -> dict[str, float]:
    """In a subprocess: what the shaped link gives (time to first byte, one stream, parallel ranged GETs)."""
    from concurrent.futures import ThreadPoolExecutor

    import botocore.config
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=spec["endpoint"],
        aws_access_key_id=spec["key"],
        aws_secret_access_key=spec["secret"],
        region_name="us-east-1",
        config=botocore.config.Config(max_pool_connections=64, retries={"max_attempts": 1}),
    )
    bucket, key, size = spec["bucket"], spec["object"], spec["size"]

    def get(lo: int, hi: int) -> int:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
        return len(body.read())

    ttfb = []
    for _ in range(5):
        t = time.perf_counter()
        get(0, 1)
        ttfb.append(time.perf_counter() - t)
    one = min(size, 16 << 20)
    t = time.perf_counter()
    get(0, one)
    single = one / (time.perf_counter() - t)
    parts, per = spec["parallel"], max(1, size // spec["parallel"])
    ranges = [(i * per, size if i == parts - 1 else (i + 1) * per) for i in range(parts)]
    t = time.perf_counter()
    with ThreadPoolExecutor(parts) as pool:
        got = sum(pool.map(lambda r: get(*r), ranges))
    parallel = got / (time.perf_counter() - t)
    return {"ttfb_s": min(ttfb), "one_conn_bytes_per_s": single, "parallel_bytes_per_s": parallel, "parallel": parts}


def decode_rate(folder: Path, backend: str, count: int = 150, repeats: int = 3) -> float:
    """Single-core samples/s of the per-sample decode work on in-memory JPEGs (best pass)."""
    items = folder_items(folder)
    blobs = [Path(p).read_bytes() for p, _ in items[:: max(1, len(items) // count)][:count]]
    work = Work("decode", backend)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        for b in blobs:
            work(b)
        best = max(best, len(blobs) / (time.perf_counter() - t))
    return best


def raw_read_rate(folder: Path, repeats: int = 3) -> float:
    """Bytes/s of a sequential read of every tar shard (1 MiB reads, page cache warm; best pass)."""
    files = sorted(folder.glob("*.tar"))
    buf = bytearray(1 << 20)
    best = 0.0
    for _ in range(repeats + 1):
        t, total = time.perf_counter(), 0
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        best = max(best, total / (time.perf_counter() - t))
    return best


def stream_mode_available() -> bool:
    """True when ``StreamingDataset`` has the no-shard-cache mode (``StorageConfig(cache=)``, once ``cache=``)."""
    from streamload import StreamingDataset

    parameters = inspect.signature(StreamingDataset).parameters
    return "storage" in parameters or "cache" in parameters


def gets_of(metrics: dict[str, float]) -> float:
    """GET requests the S3 server counted (its Prometheus counter, summed over buckets)."""
    return sum(
        v for k, v in metrics.items() if k.startswith("SeaweedFS_s3_request_total{") and 'type="GET' in k.split("}")[0]
    )


class Child:
    """A row's subprocess in its own session, killed with every DataLoader worker on timeout."""

    def __init__(self, python: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
            cwd=str(ROOT),
        )

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
            return {"ok": False, "error": f"stalled after {timeout:.0f} s", "stalled": True}
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if self.proc.returncode != 0 or not lines:
            tail = " | ".join((err or out).strip().splitlines()[-3:])
            return {"ok": False, "error": tail or f"exit {self.proc.returncode}"}
        result: dict[str, Any] = json.loads(lines[-1])
        return result


def child_json(python: str, role: str, spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> Any:
    """Run ``role`` in a child; its spec goes through a file (it may be larger than a command line)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bench-remote-spec-", delete=False) as f:
        json.dump(spec, f)
    try:
        return Child(python, [role, f.name], env).result(timeout)
    finally:
        os.unlink(f.name)


class Bench:
    """The server, the proxy, the data sets and the rows of one run."""

    def __init__(self, args: argparse.Namespace, server: Any = None) -> None:
        self.args = args
        self.own_server = server is None
        self.work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-remote-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.server: Any = server
        self.proxy: Any = None

    # setup

    def start(self) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.s3server import SeaweedS3
        from tests.shaping import ShapingProxy, upstream_of

        if self.server is None:
            self.server = SeaweedS3(self.work / "seaweedfs")
            self.server.start()
        a = self.args
        self.proxy = ShapingProxy(
            upstream_of(self.server),
            latency=a.latency_ms / 1000,
            bandwidth=a.conn_mbps * 1e6 or None,
            node_bandwidth=a.node_mbps * 1e6 or None,
            max_lifetime=24 * 3600,
        )
        self.bucket = self.server.make_bucket(None if not self.own_server else "far")
        self.shaped_options = self.server.storage_options()
        self.shaped_options["client_kwargs"] = {
            **self.shaped_options["client_kwargs"],
            "endpoint_url": self.proxy.endpoint_url,
        }

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None and self.own_server:
            self.server.stop()

    def make_data(self) -> None:
        from streamload.converters import ConvertOptions, ImageFolderSource, convert

        a = self.args
        images = Path(a.data) / f"images-{a.images}"
        self.folder = make_images(images, a.images)
        self.items = folder_items(self.folder)
        labels = [label for _, label in self.items]
        self.histogram = np.bincount(labels).tolist()
        self.payload = sum(Path(p).stat().st_size for p, _ in self.items)
        shard_bytes = a.shard_mb << 20
        base = Path(a.data) / f"sets-{a.images}-{a.shard_mb}mb-{a.hash}"
        self.tar = base / "tar"
        if not (self.tar / "index.json").exists():
            src = ImageFolderSource(str(self.folder))
            src.check = "none"
            workers = 1 if a.smoke else 2
            options = ConvertOptions(
                shard_bytes=shard_bytes, workers=workers, progress=False, overwrite=True, hash_algorithm=a.hash
            )
            convert(src, str(self.tar), options)
        self.paths = {"streamload": self.tar, "mosaicml": base / "mds", "litdata": base / "litdata"}
        if self.peers:
            spec = {
                "items": self.items,
                "mds": str(self.paths["mosaicml"]),
                "litdata": str(self.paths["litdata"]),
                "shard_bytes": shard_bytes,
                "peers": self.peers,
            }
            result = child_json(str(PEERS_PYTHON), "--write-peers", spec, timeout=1800)
            if not result.get("ok"):
                raise SystemExit(f"writing the peers' data sets failed: {result.get('error')}")
        fs = self.server.filesystem()
        self.urls: dict[str, str] = {}
        self.objects: dict[str, int] = {}
        for name in ("streamload", *self.peers):
            local = self.paths[name]
            files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))
            for p in files:
                fs.put_file(str(p), f"{self.bucket}/{name}/{p.relative_to(local)}")
            self.urls[name] = f"s3://{self.bucket}/{name}"
            data_files = [p for p in files if p.suffix in (".tar", ".mds", ".bin")]
            self.objects[name] = len(data_files)
            if name == "streamload":
                self.big_object = (f"streamload/{data_files[0].name}", data_files[0].stat().st_size)

    @property
    def peers(self) -> list[str]:
        return [] if self.args.no_peers else [p for p in PEERS if p in self.args.peers.split(",")]

    def limits(self) -> dict[str, Any]:
        raw = raw_read_rate(self.tar)
        dec = decode_rate(self.folder, self.args.backend, repeats=1 if self.args.smoke else 3)
        name, size = self.big_object
        spec = {
            "endpoint": self.proxy.endpoint_url,
            "key": self.server.key,
            "secret": self.server.secret,
            "bucket": self.bucket,
            "object": name,
            "size": size,
            "parallel": self.args.link_parallel,
        }
        link = child_json(sys.executable, "--link", spec, timeout=300)
        return {"raw_read_bytes_per_s": raw, "decode_per_core": dec, "link": link}

    # rows

    def plan(self) -> list[dict[str, Any]]:
        a = self.args
        variants = {"bytes": ["raw", "samples"], "decode": ["batch"]}
        rows: list[dict[str, Any]] = []
        stream = stream_mode_available()
        for workers in a.workers:
            for batch in a.batch:
                for mode, shuffle in itertools.product(a.modes, a.shuffle):
                    at = {"mode": mode, "workers": workers, "batch": batch, "shuffle": shuffle}
                    for v in variants[mode]:
                        if "local" in a.caches:
                            rows.append({"loader": "streamload", "variant": v, "source": "local", "cache": "-", **at})
                        for cache in ("cold", "warm"):
                            if cache in a.caches:
                                rows.append(
                                    {"loader": "streamload", "variant": v, "source": "bucket", "cache": cache, **at}
                                )
                        if stream and "none" in a.caches:
                            rows.append(
                                {
                                    "loader": "streamload",
                                    "variant": f"stream-{v}",
                                    "source": "bucket",
                                    "cache": "none",
                                    **at,
                                }
                            )
                    for peer in self.peers if not shuffle else ():
                        for cache in [c for c in ("cold", "warm") if c in a.caches]:
                            rows.append(
                                {"loader": peer, "variant": "samples", "source": "bucket", "cache": cache, **at}
                            )
        return rows

    def run(self, row: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        loader, source = row["loader"], row["source"]
        key = f"{loader}-{row['variant']}-{row['mode']}-w{row['workers']}-b{row['batch']}" + (
            "-shuffled" if row.get("shuffle") else ""
        )
        cache_dir = self.work / "cache" / key
        if row["cache"] in ("cold", "none"):
            shutil.rmtree(cache_dir, ignore_errors=True)
        spec = dict(
            row,
            url=str(self.paths[loader]) if source == "local" else self.urls[loader],
            storage_options=self.shaped_options,
            cache_dir=str(cache_dir),
            histogram=self.histogram,
            backend=a.backend,
        )
        if loader == "streamload" and source != "local" and row["cache"] in ("cold", "none"):
            timeline = self.work / "timeline" / f"{key}.log"
            timeline.parent.mkdir(parents=True, exist_ok=True)
            timeline.unlink(missing_ok=True)
            spec["timeline"] = str(timeline)
        env = dict(os.environ)
        env.update(
            S3_ENDPOINT_URL=self.proxy.endpoint_url,
            AWS_ACCESS_KEY_ID=self.server.key,
            AWS_SECRET_ACCESS_KEY=self.server.secret,
            AWS_DEFAULT_REGION="us-east-1",
            PYTHONPATH=str(ROOT),
        )
        python = sys.executable if loader == "streamload" else str(PEERS_PYTHON)
        requests0, gets0 = self.proxy.stats.requests, gets_of(self.server.metrics())
        cpu0 = self.cpu_of_parties()
        if a.profile and loader == "streamload" and not row["workers"] and row["cache"] == "cold":
            spec["profile"] = str(Path(a.profile) / f"{key}-{row['cache']}.prof")
            Path(a.profile).mkdir(parents=True, exist_ok=True)
        if a.inline:
            try:
                result = run_row(json.loads(json.dumps(spec)))
            except Exception as exc:  # noqa: BLE001 - reported in the row
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            result = child_json(python, "--row", spec, a.timeout, env)
        cpu1 = self.cpu_of_parties()
        gets = gets_of(self.server.metrics()) - gets0
        requests = self.proxy.stats.requests - requests0
        out = dict(row, **result)
        if spec.get("timeline"):
            out["timeline"] = spec["timeline"]
        if spec.get("profile"):
            out["profile"] = spec["profile"]
        if source != "local":
            out["gets_per_shard"] = gets / self.objects[loader]
            out["requests_per_shard"] = requests / self.objects[loader]
        if source != "local" and not a.inline:
            out["proxy_cpu_s"] = cpu1[0] - cpu0[0]
            out["server_cpu_s"] = cpu1[1] - cpu0[1]
        if result.get("wall_s"):
            out["samples_per_s"] = result["samples"] / result["wall_s"]
            out["mb_per_s"] = self.payload * result["samples"] / len(self.items) / result["wall_s"] / 1e6
        return out

    def cpu_of_parties(self) -> tuple[float, float]:
        """CPU seconds so far of this process (the shaping proxy's threads; idle otherwise) and the S3 server."""
        import psutil

        me = psutil.Process()
        mine = me.cpu_times()
        server = 0.0
        for child in me.children(recursive=True):  # the weed processes (a row's process is not "weed")
            try:
                if child.name() == "weed":
                    t = child.cpu_times()
                    server += t.user + t.system
            except psutil.Error:
                continue
        return mine.user + mine.system, server

    def reference(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The ``streamload local`` row this row is compared with (the latest: the same round)."""
        variant = row["variant"].removeprefix("stream-")
        if row["loader"] != "streamload":
            variant = "samples" if row["mode"] == "bytes" else "batch"
        for r in reversed(self.rows):
            if (r["loader"], r["source"], r["variant"], r["mode"], r["workers"], r["batch"], r.get("shuffle")) == (
                "streamload",
                "local",
                variant,
                row["mode"],
                row["workers"],
                row["batch"],
                row.get("shuffle"),
            ):
                return r
        return None


# -- output -------------------------------------------------------------------------------


def _name(r: dict[str, Any]) -> str:
    if r["loader"] != "streamload":
        return r["loader"]
    v = r["variant"]
    label = {"raw": "RawCollate", "samples": "per-sample", "batch": "DecodeBatch"}
    if v.startswith("stream-"):
        return f"streamload stream {label[v[7:]]}"
    return f"streamload {label[v]}" + (" local" if r["source"] == "local" else "")


def _shuffled(r: dict[str, Any]) -> str:
    return " shuffled" if r.get("shuffle") else ""


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per configuration over the rounds: best and median of samples/s, of x local and of the first batch."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("samples_per_s"):
            groups.setdefault(
                f"{r['mode']} w={r['workers']} b={r['batch']} {_name(r)}{_shuffled(r)} {r['cache']}", []
            ).append(r)
    out = []
    for name, rs in groups.items():
        rates = [r["samples_per_s"] for r in rs]
        text = f"{name:62} n={len(rs)} samp/s best {max(rates):6.0f} median {statistics.median(rates):6.0f}"
        xs = [r["x_local"] for r in rs if r.get("x_local")]
        if xs:
            text += f"  x local best {max(xs):.2f} median {statistics.median(xs):.2f}"
        firsts = [r["first_batch_s"] for r in rs]
        text += f"  1st(s) best {min(firsts):.2f} median {statistics.median(firsts):.2f}"
        out.append(text)
    return out


def line(r: dict[str, Any]) -> str:
    head = f"{r['mode']:6} w={r['workers']} b={r['batch']:<4} {_name(r) + _shuffled(r):34} {r['cache']:5}"
    if not r.get("samples_per_s"):
        return f"{head} FAILED: {r.get('error', 'wrong count or labels')}"
    gets = f"{r['gets_per_shard']:6.1f}" if "gets_per_shard" in r else "     -"
    req = f"{r['requests_per_shard']:6.1f}" if "requests_per_shard" in r else "     -"
    ratio = f"{r['x_local']:5.2f}" if r.get("x_local") else "    -"
    flag = "" if r["ok"] else "  WRONG COUNT/LABELS"
    cpu = ""
    if r.get("cpu_s") is not None and r.get("wall_s"):
        cpu = f"  cpu/wall: loader {r['cpu_s'] / r['wall_s']:.2f}"
        if "proxy_cpu_s" in r:
            cpu += f" proxy {r['proxy_cpu_s'] / r['wall_s']:.2f} server {r['server_cpu_s'] / r['wall_s']:.2f}"
    return (
        f"{head} {r['samples_per_s']:8.0f} {r['mb_per_s']:7.1f} {r['first_batch_s']:7.2f} {gets} {req} {ratio}"
        f"{flag}{cpu}"
    )


HEADER = (
    f"{'mode':6} {'w':3} {'batch':6} {'loader':34} {'cache':5} {'samp/s':>8} {'MB/s':>7} {'1st(s)':>7} "
    f"{'GET/sh':>6} {'req/sh':>6} {'xlocal':>5}"
)


def targets(rows: list[dict[str, Any]], link_bytes_per_s: float | None = None) -> list[str]:
    """The targets, checked on this run's rows: decode >= 0.85 of local disk, bytes >= 0.7 of the
    link's measured rate (parallel ranged GETs), cold first batch <= 1 s, ahead of every peer."""
    out = []

    def find(**kw: Any) -> list[dict[str, Any]]:
        return [r for r in rows if all(r.get(k) == v for k, v in kw.items()) and r.get("samples_per_s")]

    for r in find(loader="streamload", source="bucket"):
        if r["cache"] == "warm" or not r.get("x_local"):
            continue
        if r["mode"] == "decode":
            verdict = "met" if r["x_local"] >= 0.85 else "MISSED"
            out.append(
                f"{_name(r)}{_shuffled(r)} decode w={r['workers']} {r['cache']}: x{r['x_local']:.2f} of local "
                f"(>= 0.85) {verdict}"
            )
        elif link_bytes_per_s:
            x_link = r["mb_per_s"] * 1e6 / link_bytes_per_s
            verdict = "met" if x_link >= 0.7 else "MISSED"
            out.append(f"{_name(r)} bytes w={r['workers']} {r['cache']}: x{x_link:.2f} of the link (>= 0.7) {verdict}")
        if r["cache"] in ("cold", "none"):
            verdict = "met" if r["first_batch_s"] <= 1.0 else "MISSED"
            out.append(
                f"{_name(r)}{_shuffled(r)} {r['mode']} w={r['workers']} {r['cache']}: first batch "
                f"{r['first_batch_s']:.2f} s (<= 1 s) {verdict}"
            )
    for peer in PEERS:
        for p in find(loader=peer):
            ours = [
                r
                for r in find(
                    loader="streamload", source="bucket", mode=p["mode"], workers=p["workers"], batch=p["batch"]
                )
                if r["cache"] == p["cache"]
            ]
            if not ours:
                continue
            best = max(ours, key=lambda r: r["samples_per_s"])
            verdict = "ahead" if best["samples_per_s"] > p["samples_per_s"] else "BEHIND"
            out.append(
                f"vs {peer} {p['mode']} w={p['workers']} {p['cache']}: streamload {best['samples_per_s']:.0f} "
                f"({_name(best)}) vs {p['samples_per_s']:.0f} samples/s: {verdict}"
            )
    return out


def main(argv: list[str] | None = None, server: Any = None) -> int:
    """Run the benchmark; ``server``: a running ``tests.s3server.SeaweedS3`` to use instead of a new one."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--link", help=argparse.SUPPRESS)
    parser.add_argument("--write-peers", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=4000, help="synthetic JPEGs, ~65 KB each (default 4000)")
    parser.add_argument("--shard-mb", type=int, default=64, help="MiB per shard/chunk, every loader (default 64)")
    parser.add_argument("--batch", default="64", help="batch sizes, comma-separated (default 64)")
    parser.add_argument("--workers", default="0,2", help="DataLoader workers, comma-separated (default 0,2)")
    parser.add_argument("--modes", default="bytes,decode")
    parser.add_argument(
        "--caches", default="local,cold,warm,none", help="cache states to run (default local,cold,warm,none)"
    )
    parser.add_argument(
        "--shuffle", default="off", help="off, on or off,on: streamload rows unshuffled and/or shuffled (default off)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every row this many times, rows interleaved (local, cold, ... then again): a busy machine "
        "distorts each round differently; the summary gives best and median",
    )
    parser.add_argument(
        "--hash",
        default="xxh3_128",
        choices=("xxh3_128", "sha256"),
        help="digest of the dataset written (default xxh3_128)",
    )
    parser.add_argument("--backend", default="pillow", help="ImageDecoder backend of the decode work (default pillow)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="proxy: time to first byte (default 50)")
    parser.add_argument(
        "--conn-mbps", type=float, default=40.0, help="proxy: MB/s per connection (default 40; 0: none)"
    )
    parser.add_argument("--node-mbps", type=float, default=400.0, help="proxy: MB/s in all (default 400; 0: none)")
    parser.add_argument("--link-parallel", type=int, default=8, help="parallel ranged GETs of the link measurement")
    parser.add_argument("--peers", default=",".join(PEERS), help="peers to run (default mosaicml,litdata)")
    parser.add_argument("--no-peers", action="store_true", help="streamload rows only (no peers venv needed)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per row before it counts as stalled")
    parser.add_argument("--inline", action="store_true", help="run rows in this process (quick; for --smoke)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny and quick: at most 120 images, 1 MiB shards, 0 workers, rows in-process",
    )
    parser.add_argument("--data", default=str(OUT / "remote"), help="where the images and shards are kept")
    parser.add_argument("--work", help="server data and caches (default: a fresh temporary directory)")
    parser.add_argument("--json", default=str(OUT / "bench_remote.json"), help="write the results here")
    parser.add_argument(
        "--profile",
        help="directory: run each cold streamload row without workers under cProfile (CPU time of every thread "
        "of its process: download threads included), write <row>.prof there and print the costliest functions",
    )
    args = parser.parse_args(argv)
    for role, fn in (("row", run_row), ("link", link_rate), ("write_peers", write_peer_datasets)):
        spec_file = getattr(args, role)
        if spec_file:
            spec = Path(spec_file).read_text()
            if role == "write_peers":
                fn(json.loads(spec))
                print(json.dumps({"ok": True}))
            else:
                print(json.dumps(fn(json.loads(spec))))
            return 0
    if args.smoke:
        args.shard_mb, args.batch, args.workers = 1, "16", "0"
        args.images = min(args.images, 120)
        args.inline, args.no_peers = True, True
    args.batch = [int(b) for b in args.batch.split(",")]
    args.workers = [int(w) for w in args.workers.split(",")]
    args.modes = args.modes.split(",")
    args.caches = args.caches.split(",")
    args.shuffle = [{"off": False, "on": True}[s] for s in args.shuffle.split(",")]
    if not args.no_peers and not PEERS_PYTHON.exists():
        raise SystemExit(f"no peers venv at {PEERS_PYTHON}: run bash benchmarks/setup_peers.sh, or pass --no-peers")
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; {os.cpu_count()} CPUs")
    bench = Bench(args, server)
    try:
        bench.start()
        bench.make_data()
        n = len(bench.items)
        print(
            f"data: {n} JPEGs, {bench.payload / 1e6:.0f} MB (mean {bench.payload / n / 1e3:.1f} KB), "
            f"{args.shard_mb} MiB shards: streamload {bench.objects['streamload']}"
            + "".join(f", {p} {bench.objects[p]}" for p in bench.peers)
        )
        print(
            f"link: proxy {args.latency_ms:.0f} ms to first byte, {args.conn_mbps:.0f} MB/s per connection, "
            f"{args.node_mbps:.0f} MB/s in all"
        )
        limits = bench.limits()
        link = limits["link"]
        print(
            f"limit: raw local read of the tar shards {limits['raw_read_bytes_per_s'] / 1e6:.0f} MB/s "
            f"({limits['raw_read_bytes_per_s'] / (bench.payload / n):.0f} samples/s), one core"
        )
        print(
            f"limit: decode work ({args.backend}, resize {RESIZE}, crop {CROP}) "
            f"{limits['decode_per_core']:.0f} samples/s per core"
        )
        if link.get("ttfb_s"):
            print(
                f"limit: shaped link: first byte {link['ttfb_s'] * 1000:.0f} ms, one connection "
                f"{link['one_conn_bytes_per_s'] / 1e6:.0f} MB/s, {link['parallel']} parallel ranged GETs "
                f"{link['parallel_bytes_per_s'] / 1e6:.0f} MB/s"
            )
        print()
        print(HEADER)
        for round_, row in [(n, r) for n in range(args.rounds) for r in bench.plan()]:
            if row["source"] == "local" and args.rounds > 1:
                load = os.getloadavg()
                print(f"-- round {round_ + 1}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
            result = bench.run(row)
            ref = bench.reference(result)
            if (
                ref is not None
                and result["source"] != "local"
                and ref.get("samples_per_s")
                and result.get("samples_per_s")
            ):
                result["x_local"] = result["samples_per_s"] / ref["samples_per_s"]
            bench.rows.append(result)
            print(line(result), flush=True)
            if result.get("timeline") and result.get("first_batch_s"):
                print_timeline(Path(result["timeline"]), result["first_batch_s"])
            if result.get("profile") and Path(result["profile"]).exists():
                print_profile(Path(result["profile"]))
        verdicts = targets(bench.rows, link.get("parallel_bytes_per_s") if link else None)
        if args.rounds > 1:
            print()
            for text in summary(bench.rows):
                print(text)
        print()
        for v in verdicts:
            print(v)
        load_end = os.getloadavg()
        print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
        report = {
            "args": {k: v for k, v in vars(args).items() if k not in ("row", "link", "write_peers")},
            "data": {"images": n, "payload_bytes": bench.payload, "objects": bench.objects},
            "limits": limits,
            "rows": bench.rows,
            "targets": verdicts,
            "load_start": load_start,
            "load_end": load_end,
            "stream_mode": stream_mode_available(),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    finally:
        bench.stop()
        if not args.work:
            shutil.rmtree(bench.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
