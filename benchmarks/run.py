"""The side-by-side benchmark: streamload vs its peers on the same JPEGs, next to the machine's limits.

    bash benchmarks/setup_peers.sh                       # once: MosaicML Streaming, LitData (own venv)
    benchmarks/out/peers-venv/bin/python benchmarks/run.py   # or .venv/bin/python (peers it lacks are skipped)

What it does, in one run:

1. Builds (once, cached under benchmarks/out/) an image folder of ``--images`` synthetic
   JPEGs, ImageNet-like (mean 500x375, +-30 %, ~65 KB), 10 classes; converts it to
   streamload tar/LMDB/HDF5 shards, MDS (MosaicML Streaming) and LitData chunks. A
   smaller set (``--decode-images``) is made the same way for the decode rows.
2. Measures the machine's limits: the raw read rate of the shard files (sequential,
   page cache warm), and the single-core rate of the decode stage (decode, resize 256,
   center-crop 224) on in-memory bytes: streamload's stage, its bare library calls
   (to give the stage's own overhead) and the textbook Pillow pipeline the peers use.
3. Runs each (library, format, mode, workers) row in a fresh subprocess (so memory is
   per row), watched by this process: samples/s and MB/s in steady state (after the
   first batch), time to the first batch, peak PSS summed over the row's main process
   and its workers. Every row must deliver each sample once with the right label
   (count and per-class label histogram), else it is marked FAILED. A streamload row
   (``batch_size=`` given to the dataset) reads its epoch padded to whole batches: every
   sample once plus the ``T - N`` padding items, ``T = ceil(N / batch) * batch``.

Modes: ``bytes`` delivers every sample's encoded bytes and label to the main process
(batches of 256); ``decode`` delivers uint8 [256, 3, 224, 224] tensors and labels.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _data  # noqa: E402

BATCH = 256
RESIZE, CROP = 256, 224


# -- the peers' sample pipelines (module level: pickled to DataLoader workers) ----------


def pil_pipeline(data: bytes) -> Any:
    """The textbook pipeline: Pillow decode, resize shorter side to 256, center-crop 224, CHW uint8."""
    import io

    import torch
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    s = RESIZE / min(w, h)
    img = img.resize((max(CROP, round(w * s)), max(CROP, round(h * s))), Image.Resampling.BILINEAR)
    left, top = (img.size[0] - CROP) // 2, (img.size[1] - CROP) // 2
    array = np.asarray(img.crop((left, top, left + CROP, top + CROP)))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def bytes_collate(batch: list[tuple[bytes, int]]) -> tuple[list[bytes], Any]:
    import torch

    return [b for b, _ in batch], torch.tensor([int(label) for _, label in batch])


def decode_collate(batch: list[tuple[Any, int]]) -> tuple[Any, Any]:
    import torch

    return torch.stack([x for x, _ in batch]), torch.tensor([int(label) for _, label in batch])


class FolderDataset:
    """A plain ImageFolder-style map dataset: one file read (and Pillow decode) per item."""

    def __init__(self, items: list[tuple[str, int]], decode: bool) -> None:
        self.items, self.decode = items, decode

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.items[i]
        with open(path, "rb") as f:
            data = f.read()
        return (pil_pipeline(data) if self.decode else data), label


def _mds_item(decode: bool, item: dict[str, Any]) -> tuple[Any, int]:
    return (pil_pipeline(item["jpg"]) if decode else bytes(item["jpg"])), int(item["cls"])


# -- rows ---------------------------------------------------------------------------------


def _loader(lib: str, mode: str, workers: int, paths: dict[str, str], batch: int = BATCH) -> tuple[Any, str]:
    """Return ``(iterable of batches, batch kind)`` for one row (``batch``: samples per batch)."""
    import torch
    from torch.utils.data import DataLoader

    decode = mode == "decode"
    common: dict[str, Any] = dict(num_workers=workers)
    if workers:
        common.update(persistent_workers=True, prefetch_factor=2)
    collate = decode_collate if decode else bytes_collate
    if lib == "streamload-plain":  # what most users write first: a per-sample transform, the default collate
        from streamload import StreamingDataset
        from streamload.decode import ImageLabel

        ds = StreamingDataset(paths["tar"], transform=ImageLabel(CROP))
        return DataLoader(ds, batch_size=batch, **common), "pair"
    if lib.startswith("streamload"):
        from streamload import StreamingDataset
        from streamload.batch import RawCollate
        from streamload.decode import DecodeBatch

        fmt = lib.split("-", 1)[1]
        maker = DecodeBatch(CROP, resize=RESIZE) if decode else RawCollate()
        ds = StreamingDataset(paths[fmt], batch_size=batch, collate=maker)
        return DataLoader(ds, batch_size=None, **common), "streamload"
    if lib == "webdataset":
        import webdataset as wds

        urls = sorted(glob.glob(os.path.join(paths["tar"], "*.tar")))
        wd = wds.WebDataset(urls, shardshuffle=False, empty_check=False).to_tuple("jpg", "cls")
        wd = wd.map_tuple(pil_pipeline if decode else None, lambda c: int(c))
        wd = wd.batched(batch, collation_fn=collate, partial=True)
        return DataLoader(wd, batch_size=None, **common), "pair"
    if lib == "imagefolder":
        items = _data.folder_items(paths["folder"])
        return DataLoader(FolderDataset(items, decode), batch_size=batch, collate_fn=collate, **common), "pair"
    if lib == "mosaicml-streaming":
        import functools

        from streaming import StreamingDataset as MDSDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()

        class Mapped(MDSDataset):  # type: ignore[misc]
            def __getitem__(self, index: int) -> Any:
                return self._fn(super().__getitem__(index))

        ds = Mapped(local=paths["mds"], batch_size=batch, shuffle=False)
        ds._fn = functools.partial(_mds_item, decode)
        return DataLoader(ds, batch_size=batch, collate_fn=collate, **common), "pair"
    if lib == "litdata":
        import litdata

        class LitMapped(litdata.StreamingDataset):  # type: ignore[misc]
            def __getitem__(self, index: Any) -> Any:
                return _mds_item(decode, super().__getitem__(index))

        ds = LitMapped(input_dir=paths["litdata"])
        return litdata.StreamingDataLoader(ds, batch_size=batch, collate_fn=collate, **common), "pair"
    raise SystemExit(f"unknown library {lib}")
    del torch


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    """Inside the row's subprocess: read ``epochs`` epochs, check count and labels, time them."""
    batch = spec.get("batch", BATCH)
    loader, kind = _loader(spec["lib"], spec["mode"], spec["workers"], spec["paths"], batch)
    expected = np.asarray(spec["histogram"], dtype=np.int64)
    # streamload rows give the dataset batch_size=batch (one process): whole batches, padded.
    from streamload.plan.planner import padded_total

    total = padded_total(int(expected.sum()), batch, drop_last=False) if kind == "streamload" else int(expected.sum())
    samples = first_n = nbytes = 0
    first = steady_start = 0.0
    ok = True
    cpu0 = _tree_cpu_seconds()
    start = time.perf_counter()
    for _ in range(spec["epochs"]):
        hist = np.zeros(len(expected), dtype=np.int64)
        count = 0
        for batch in loader:
            if kind == "streamload":
                if spec["mode"] == "decode":
                    images, labels = batch
                    n, b = len(labels), 0
                else:
                    n, b, labels = batch.batch_size, int(batch.data.numel()), batch.labels
            else:
                payload, labels = batch
                n = len(labels)
                b = sum(len(x) for x in payload) if spec["mode"] == "bytes" else 0
            hist += np.bincount(np.asarray(labels), minlength=len(expected))[: len(expected)]
            count += n
            samples += n
            nbytes += b
            if not first:
                first = time.perf_counter() - start
                steady_start, first_n, first_b = time.perf_counter(), samples, nbytes
                nbytes -= first_b
        ok = ok and _data.epoch_ok(hist, expected, count, total)
    elapsed = time.perf_counter() - steady_start
    steady = samples - first_n
    return {
        "ok": ok,
        "samples": samples,
        "samples_per_s": steady / elapsed,
        "mb_per_s": nbytes / elapsed / 1e6,
        "first_batch_s": first,
        "cpu_s": _tree_cpu_seconds() - cpu0,
        "wall_s": time.perf_counter() - start,
    }


def _tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its live workers."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


# -- limits -------------------------------------------------------------------------------


def raw_read_limit(tar_dir: str, num_samples: int, repeats: int = 3) -> dict[str, float]:
    """Sequential read of every shard file into one reused buffer (page cache warm): best of ``repeats``."""
    files = sorted(glob.glob(os.path.join(tar_dir, "*.tar")))
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    best = best_cpu = 0.0
    total = 0
    for _ in range(repeats + 1):  # the first pass warms the page cache
        t, c = time.perf_counter(), time.process_time()
        total = 0
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                while n := os.readv(fd, [view]):
                    total += n
            finally:
                os.close(fd)
        best = max(best, total / (time.perf_counter() - t))
        best_cpu = max(best_cpu, total / max(time.process_time() - c, 1e-9))
    return {
        "bytes_per_s": best,
        "samples_per_s": best / total * num_samples,
        "shard_bytes": total,
        "samples_per_cpu_s": best_cpu / total * num_samples,
    }


def decode_limits(folder: str, count: int = 300, repeats: int = 5) -> dict[str, float]:
    """Single-core rates on in-memory JPEGs: streamload's stage, its bare calls, the Pillow textbook.

    Rates are the best wall-clock pass (the rows are timed by the wall clock too); the
    stage's overhead over its bare library calls is taken from CPU time.
    """
    from PIL import Image

    from streamload.decode import ImageDecoder

    items = _data.folder_items(folder)
    step = max(1, len(items) // count)
    blobs = []
    for path, _ in items[::step][:count]:
        with open(path, "rb") as f:
            blobs.append(f.read())
    decoder = ImageDecoder(CROP, resize=RESIZE)
    out = np.empty(decoder.shape, dtype=np.uint8)

    # The bare library calls of the stage, with their arguments worked out beforehand.
    import simplejpeg

    bare_args = []
    for data in blobs:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        box = decoder.box(w, h)
        f = decoder._reduction(w, h, box)
        bare_args.append((data, -(-w // f), -(-h // f), f, tuple(x / f for x in box)))

    def bare() -> None:
        for data, mw, mh, f, box in bare_args:
            a = simplejpeg.decode_jpeg(data, "RGBX", min_width=mw, min_height=mh, min_factor=f)
            img = Image.frombuffer("RGBX", (a.shape[1], a.shape[0]), a, "raw", "RGBX", 0, 1)
            img.resize((CROP, CROP), Image.Resampling.BILINEAR, box=box)

    def stage() -> None:
        for data in blobs:
            decoder.decode_into(data, out)

    def textbook() -> None:
        for data in blobs:
            pil_pipeline(data)

    rates: dict[str, list[float]] = {"stage": [], "bare": [], "pillow_textbook": []}
    cpu: dict[str, list[float]] = {"stage": [], "bare": []}
    for _ in range(repeats):  # interleaved, so load drift hits all three alike
        for name, fn in (("stage", stage), ("bare", bare), ("pillow_textbook", textbook)):
            t, c = time.perf_counter(), time.process_time()
            fn()
            rates[name].append(len(blobs) / (time.perf_counter() - t))
            if name in cpu:
                cpu[name].append(time.process_time() - c)
    best = {name: max(v) for name, v in rates.items()}
    # The stage's own cost from CPU time (robust to other processes on the machine).
    best["stage_overhead"] = min(cpu["stage"]) / min(cpu["bare"]) - 1
    return best


# -- driver -------------------------------------------------------------------------------


def available_peers() -> list[str]:
    out = ["imagefolder"]
    for lib, module in (("webdataset", "webdataset"), ("mosaicml-streaming", "streaming"), ("litdata", "litdata")):
        try:
            __import__(module)
            out.append(lib)
        except Exception:  # noqa: BLE001 - any import failure means "not installed here"
            print(f"  (peer {lib} not importable here: skipped; see benchmarks/setup_peers.sh)")
    return out


def our_formats() -> list[str]:
    """The shard formats convert writes here (their extras installed); Parquet, read in place, is bench_parquet's."""
    from streamload.formats import available_formats, get_format

    out = []
    for name in available_formats():
        try:
            if get_format(name).writable:
                out.append(name)
        except Exception:  # noqa: BLE001
            continue
    return out


def spawn_row(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one row in a subprocess; watch its PSS (and its workers') from here."""
    from streamload.bench import PeakMemory

    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--row", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with PeakMemory(proc.pid, interval=0.05) as memory:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (err or out).strip().splitlines()[-3:]
        return {"ok": False, "error": " | ".join(tail) or f"exit {proc.returncode}", "peak_pss": memory.peak}
    result: dict[str, Any] = json.loads(lines[-1])
    result["peak_pss"] = memory.peak
    return result


def machine() -> str:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=10_000, help="images for the bytes rows (default 10000)")
    parser.add_argument("--decode-images", type=int, default=2_000, help="images for the decode rows (default 2000)")
    parser.add_argument("--workers", default="0,2", help="num_workers values (default 0,2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per bytes row (default 3)")
    parser.add_argument("--modes", default="bytes,decode")
    parser.add_argument("--libs", default="", help="restrict to these rows (comma-separated names)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per row")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all rows; best rate kept (default 2)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"samples per batch (default {BATCH})")
    parser.add_argument("--json", default=os.path.join(_data.OUT, "results.json"))
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))))
        return

    load_before = os.getloadavg()
    print(f"machine: {machine()}")
    peers = available_peers()
    formats = our_formats()
    libs = [f"streamload-{f}" for f in formats] + (["streamload-plain"] if "tar" in formats else []) + peers
    if args.libs:
        libs = [lib for lib in libs if lib in args.libs.split(",")]
    sets = {"bytes": args.images, "decode": args.decode_images}
    paths: dict[int, dict[str, str]] = {}
    for n in sorted(set(sets.values())):
        print(f"data: {n} images (cached in {_data.OUT})")
        paths[n] = _data.all_datasets(n, formats, peers)
    stats = _data.folder_stats(paths[args.images]["folder"])
    print(
        f"  mean {stats['mean_bytes'] / 1e3:.1f} KB, median {stats['median_bytes'] / 1e3:.1f} KB, "
        f"min {stats['min_bytes'] / 1e3:.1f} KB, max {stats['max_bytes'] / 1e3:.1f} KB per JPEG"
    )

    raw = raw_read_limit(paths[args.images]["tar"], args.images)
    dec = decode_limits(paths[args.decode_images]["folder"])
    print(
        f"limit: raw read of the shard files {raw['samples_per_s']:.0f} samples/s "
        f"({raw['bytes_per_s'] / 1e6:.0f} MB/s), one core"
    )
    print(
        f"limit: decode stage (decode, resize 256, crop 224) {dec['stage']:.0f} samples/s per core "
        f"(bare library calls {dec['bare']:.0f}/s: stage overhead {100 * dec['stage_overhead']:.1f} %; "
        f"textbook Pillow pipeline {dec['pillow_textbook']:.0f}/s)"
    )

    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    for round_ in range(args.rounds):  # interleaved rounds; each row keeps its best rate
        print(f"round {round_ + 1} of {args.rounds}")
        for mode in args.modes.split(","):
            n = sets[mode]
            for workers in [int(w) for w in args.workers.split(",")]:
                for lib in libs:
                    if lib == "streamload-plain" and mode != "decode":
                        continue  # the per-sample transform path: a decode row only
                    spec = {
                        "lib": lib,
                        "mode": mode,
                        "workers": workers,
                        "paths": paths[n],
                        "epochs": args.epochs if mode == "bytes" else 1,
                        "batch": args.batch,
                        "histogram": _data.histogram(paths[n]),
                    }
                    result = spawn_row(spec, args.timeout)
                    if mode == "bytes":
                        limit = raw["samples_per_s"]
                    else:
                        limit = dec["stage"] * max(1, min(workers, os.cpu_count() or 1))
                    result.update(lib=lib, mode=mode, workers=workers, limit=limit)
                    print(_line(result), flush=True)
                    rows[(mode, workers, lib)] = _merge(rows.get((mode, workers, lib)), result)
    load_after = os.getloadavg()
    report = {
        "machine": machine(),
        "data": stats,
        "raw_limit": raw,
        "decode_limits": dec,
        "rows": list(rows.values()),
        "rounds": args.rounds,
        "epochs": args.epochs,
        "decode_images": args.decode_images,
        "load_before": load_before,
        "load_after": load_after,
        "batch_size": args.batch,
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(md)
    print()
    print(md)


def _busy(r: dict[str, Any]) -> str:
    """CPU seconds of the row's processes per wall second: how much of the machine it got."""
    return f"{r['cpu_s'] / r['wall_s']:.2f}" if r.get("cpu_s") and r.get("wall_s") else "-"


def _merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Best rate of the rounds; correct only if every round was; the highest peak memory."""
    if old is None:
        return new
    best = dict(new if new.get("samples_per_s", 0) > old.get("samples_per_s", 0) else old)
    best["ok"] = bool(old.get("ok")) and bool(new.get("ok"))
    best["peak_pss"] = max(old.get("peak_pss", 0), new.get("peak_pss", 0))
    return best


def _line(r: dict[str, Any]) -> str:
    if not r.get("samples_per_s"):
        return f"  {r['mode']:6} w={r['workers']} {r['lib']:20} FAILED: {r.get('error', 'wrong count or labels')}"
    flag = "" if r["ok"] else "  WRONG COUNT/LABELS"
    return (
        f"  {r['mode']:6} w={r['workers']} {r['lib']:20} {r['samples_per_s']:8.0f} samples/s "
        f"{r['mb_per_s']:7.0f} MB/s  x{r['samples_per_s'] / r['limit']:.2f} of limit  "
        f"1st batch {r['first_batch_s']:.2f}s  peak PSS {r['peak_pss'] / 2**20:.0f} MiB  CPUs {_busy(r)}{flag}"
    )


def markdown(report: dict[str, Any]) -> str:
    d, raw, dec = report["data"], report["raw_limit"], report["decode_limits"]
    busy = [r["cpu_s"] / r["wall_s"] for r in report["rows"] if r.get("cpu_s") and r.get("wall_s")]
    lines = [
        f"Machine: {report['machine']}. Load average before/after the run: "
        f"{report['load_before'][0]:.1f} / {report['load_after'][0]:.1f} (the machine is shared; each row's best of "
        f"{report['rounds']} interleaved rounds is shown, peak PSS is the highest of the rounds).",
        f"Data: {d['count']} synthetic JPEGs (ImageNet-like sizes around 500x375), mean {d['mean_bytes'] / 1e3:.1f} KB "
        f"(min {d['min_bytes'] / 1e3:.1f}, max {d['max_bytes'] / 1e3:.1f}), 10 classes, batches of "
        f"{report['batch_size']}; page cache warm. Bytes rows read them {report['epochs']} epochs; decode rows "
        f"read {report['decode_images']} images of the same kind once.",
        f"Limits measured in the same run: raw read of the shard files {raw['samples_per_s']:.0f} samples/s "
        f"({raw['bytes_per_s'] / 1e6:.0f} MB/s, one core; {raw.get('samples_per_cpu_s', 0):.0f} per CPU-second); "
        f"decode stage (decode, resize 256, center-crop 224) "
        f"{dec['stage']:.0f} images/s per core (its bare library calls: {dec['bare']:.0f}/s, so the stage's own "
        f"overhead is {100 * dec['stage_overhead']:.1f} %; the textbook Pillow pipeline the peers run: "
        f"{dec['pillow_textbook']:.0f}/s).",
        "",
        "| mode | workers | library | samples/s | MB/s | × limit | 1st batch | peak PSS | CPUs busy | correct |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in report["rows"]:
        if not r.get("samples_per_s"):
            lines.append(f"| {r['mode']} | {r['workers']} | {r['lib']} | failed | | | | | {r.get('error', '')[:60]} |")
            continue
        mb = f"{r['mb_per_s']:.0f}" if r["mode"] == "bytes" else "-"
        lines.append(
            f"| {r['mode']} | {r['workers']} | {r['lib']} | {r['samples_per_s']:.0f} | {mb} | "
            f"{r['samples_per_s'] / r['limit']:.2f} | {r['first_batch_s']:.2f} s | {r['peak_pss'] / 2**20:.0f} MiB | "
            f"{_busy(r)} | {'yes' if r['ok'] else 'NO'} |"
        )
    lines.append("")
    lines.append(
        "× limit: bytes rows against the raw read rate; decode rows against the decode stage's rate "
        "times the cores the workers can use (0 workers: one core). CPUs busy: CPU seconds of the row's "
        "main process and workers per wall-clock second (at most 2 here; less means the row waited, "
        "or other processes had the CPUs)."
    )
    del busy
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
