"""The GIL: the thread Loader beside a Python training loop, with and without the native kernel.

Usage: ``python benchmarks/bench_gil.py [--images 1280] [--batch 64] [--paths per_sample,kernel_dicts,kernel]
[--seconds 5] [--rounds 3] [--neighbor] [--interleaved N] [--extra-hold MS] [--unfused] [--python-open]
[--out FILE.json]``

On the photo-like JPEGs of ``bench_threads.py`` (~500x375, shuffled, batch 64,
``DecodeBatch(160, crop="random", flip=True)``), side by side in one run, with the load
average:

1. ``Loader(threads=1)`` alone, and beside a pure-Python busy loop in the main thread (the
   loader iterated by a second thread, as a training step's data fetch is); the busy loop
   alone, before and after (its share is taken against the mean of the two). Each as a
   rate and as a ratio (beside / alone). Three paths: per sample (``native=False``); the
   kernel fed sample dicts (``native=True`` with ``on_error="skip"``, which keeps a
   dataset on the dict path: each sample read by its own ``pread`` calls);
   the kernel fed by the batch read (``native=True``: ``DecodeBatch.read_batch``, the
   batch's bytes in one gathered read a shard, then one kernel call).
2. ``DataLoader(num_workers=2)`` + ``DecodeBatch``: decode rate on each of the three paths.
   With ``--neighbor``, also the busy loop beside a separate *process* running the kernel
   path (alone, beside, alone again): the machine's share of the loop's loss, with no GIL shared.
3. The cost of ``watch``'s GIL probe to a loop that runs Python all along.
4. Per core, one process, the same files: today's ``ImageDecoder`` (one ``decode_into`` a
   sample) against the kernel (one call a batch), images per CPU-second, and where the time
   goes (the kernel's Python part: headers, boxes, flips, drawn in one C call for the batch,
   and, for comparison, by a numpy generator a sample; its C call; the per-sample path's
   decode and its resize + pack).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_threads import BATCH, SIZE, dataset_root  # noqa: E402

#: The paths measured: name -> (native kernel, on_error). ``skip`` keeps the dataset on the dict path.
PATHS = {"per_sample": (False, "raise"), "kernel_dicts": (True, "skip"), "kernel": (True, "raise")}


#: Samples a batch (``--batch``): the Loader's GIL acquisitions are a constant per batch, its work per sample.
_BATCH = [BATCH]


def _dataset(root: str, path: str) -> Any:
    from streamload import StreamingDataset
    from streamload.decode import DecodeBatch

    native, on_error = PATHS[path]
    collate = DecodeBatch(SIZE, crop="random", flip=True, native=native)
    return StreamingDataset(root, shuffle=True, seed=0, batch_size=_BATCH[0], collate=collate, on_error=on_error)


def _busy(stop: threading.Event) -> int:
    """A pure-Python loop (what an eager training step's op dispatch looks like to the GIL)."""
    n = 0
    while not stop.is_set():
        for _ in range(2000):
            n += 1
    return n


def _consume(loader: Any, stop: threading.Event, counts: list[int]) -> None:
    while not stop.is_set():
        for images, _labels in loader:
            counts[0] += len(images)
            if stop.is_set():
                break


class _Sched:
    """The loader threads' Linux schedstat (seconds on a CPU, runnable without one), over a window.

    The Loader starts threads each epoch; a poller keeps each thread's last figures, so a
    thread that ends inside the window still counts (up to one poll interval short).
    """

    def __init__(self) -> None:
        self.first: dict[int, tuple[float, float]] = {}
        self.last: dict[int, tuple[float, float]] = {}
        self.stop = threading.Event()
        self.poll()
        self.first = dict(self.last)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def poll(self) -> None:
        for t in threading.enumerate():
            if not t.name.startswith("streamload-loader") or t.native_id is None:
                continue
            try:
                with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                    on_cpu, waiting, _ = f.read().split()
            except OSError:
                continue
            self.last[t.native_id] = (int(on_cpu) / 1e9, int(waiting) / 1e9)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            self.poll()

    def done(self) -> tuple[float, float, int]:
        """(CPU seconds, run-queue seconds, threads seen) since the start."""
        self.stop.set()
        self.thread.join()
        self.poll()
        cpu = queued = 0.0
        for tid, (c, q) in self.last.items():
            c0, q0 = self.first.get(tid, (0.0, 0.0))
            cpu += c - c0
            queued += q - q0
        return cpu, queued, len(self.last)


def loader_beside_loop(root: str, path: str, seconds: float, busy: bool) -> dict[str, float]:
    """Images/s of ``Loader(threads=1)`` over ``seconds`` (after its first batch), and the loop's count/s."""
    import streamload

    loader = streamload.Loader(_dataset(root, path), threads=1)
    next(iter(loader))  # start-up out of the window
    stop = threading.Event()
    counts = [0]
    reader = threading.Thread(target=_consume, args=(loader, stop, counts), daemon=True)
    reader.start()
    time.sleep(0.5)
    start_images, start = counts[0], time.perf_counter()
    sched = _Sched()
    loop = 0
    me = _schedstat(threading.get_native_id())
    if busy:
        timer = threading.Timer(seconds, stop.set)
        timer.start()
        loop = _busy(stop)
    else:
        time.sleep(seconds)
        stop.set()
    wall = time.perf_counter() - start
    mine = _schedstat(threading.get_native_id())
    images = counts[0] - start_images
    cpu, queued, _seen = sched.done()
    reader.join(30)
    loader.close()
    # The loader's threads: on a CPU, runnable but without one (other jobs: the machine's
    # share, not the GIL), and the rest of their wall time blocked (the GIL; queues, I/O).
    threads = loader.threads
    blocked = max(0.0, threads * wall - cpu - queued)
    return {
        "images_s": images / wall,
        "loop_s": loop / wall,
        "loader_cpu": cpu / wall,
        "loader_queued": queued / wall,
        "loader_blocked": blocked / wall,
        "images_per_cpu_s": images / cpu if cpu > 0 else 0.0,
        # the busy loop's thread: on a CPU, and runnable without one (the machine, not the GIL)
        "loop_cpu": (mine[0] - me[0]) / wall,
        "loop_queued": (mine[1] - me[1]) / wall,
    }


def interleaved(root: str, path: str, windows: int, seconds: float) -> dict[str, Any]:
    """The loop alone, the loop beside the loader, the loader alone: short windows in turn, one loader.

    One ``Loader(threads=1)`` all along; it is paused by not taking its batches (its queue
    fills, its thread waits) and resumed by taking them again, 0.3 s before each window. The
    three modes alternate ``windows`` times, so the machine's drift over a run (the loop's
    rate alone swings by ~10 % between separate measurements here) falls on all three alike.
    Returns each window's loop count/s and images/s, per mode, and the ratios of the medians;
    and, beside the loop and alone, the median time between two batches of an epoch and what
    an epoch's turn adds to it (a new thread, the epoch's plan, its shards opened again).
    """
    import streamload

    loader = streamload.Loader(_dataset(root, path), threads=1)
    take = threading.Event()
    done = threading.Event()
    counts = [0]
    # when each batch came, and whether it was its epoch's first (the loader starts a thread,
    # plans the epoch and opens its shards again: the turn between two epochs)
    stamps: list[tuple[float, bool]] = []

    def consume() -> None:
        while not done.is_set():
            first = True
            for images, _labels in loader:
                counts[0] += len(images)
                stamps.append((time.perf_counter(), first))
                first = False
                while not take.is_set() and not done.is_set():
                    take.wait(0.05)
                if done.is_set():
                    break

    take.set()
    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    time.sleep(1.0)  # start-up and the first batches out of the windows
    rows: dict[str, list[dict[str, float]]] = {"loop": [], "both": [], "loader": []}
    gaps: dict[str, list[tuple[float, bool]]] = {"both": [], "loader": []}
    try:
        for _ in range(windows):
            for mode in ("loop", "both", "loader"):
                if mode == "loop":
                    take.clear()
                else:
                    take.set()
                time.sleep(0.3)
                first, start, mark = counts[0], time.perf_counter(), len(stamps)
                if mode == "loader":
                    time.sleep(seconds)
                    loop = 0
                else:
                    stop = threading.Event()
                    timer = threading.Timer(seconds, stop.set)
                    timer.start()
                    loop = _busy(stop)
                wall = time.perf_counter() - start
                rows[mode].append({"loop_s": loop / wall, "images_s": (counts[0] - first) / wall})
                if mode != "loop":
                    got = stamps[mark:]
                    gaps[mode] += [(b[0] - a[0], b[1]) for a, b in zip(got, got[1:], strict=False)]
    finally:
        done.set()
        take.set()
        reader.join(30)
        loader.close()
    median = {
        mode: {k: float(np.median([r[k] for r in rs])) for k in ("loop_s", "images_s")} for mode, rs in rows.items()
    }
    turns = {}
    for mode, got in gaps.items():
        within = [g for g, turned in got if not turned]
        across = [g for g, turned in got if turned]
        if within and across:
            batch = float(np.median(within))
            turns[mode] = {"batch_ms": batch * 1e3, "turn_extra_ms": (float(np.mean(across)) - batch) * 1e3,
                           "turns": len(across), "batches_a_turn": len(got) / len(across)}  # fmt: skip
    return {
        "windows": rows,
        "median": median,
        "turns": turns,
        "loop_kept": median["both"]["loop_s"] / median["loop"]["loop_s"],
        "loader_kept": median["both"]["images_s"] / median["loader"]["images_s"],
        "loop_kept_per_window": [b["loop_s"] / a["loop_s"] for a, b in zip(rows["loop"], rows["both"], strict=True)],
    }


def _schedstat(tid: int) -> tuple[float, float]:
    """A thread's seconds on a CPU and runnable without one (Linux schedstat)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def loop_alone(seconds: float) -> float:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    start = time.perf_counter()
    n = _busy(stop)
    return n / (time.perf_counter() - start)


_NEIGHBOR = """
import sys, time
sys.path.insert(0, sys.argv[3])
from bench_gil import _BATCH, _dataset
import streamload
_BATCH[0] = int(sys.argv[4])
loader = streamload.Loader(_dataset(sys.argv[1], "kernel"), threads=1)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    for _batch in loader:
        if time.time() > end:
            break
"""


def loop_beside_process(root: str, seconds: float) -> dict[str, float]:
    """The busy loop alone, beside a *process* decoding with the kernel, alone again (loop count/s).

    The machine's share, without the GIL: if the loop keeps its rate beside a process doing
    the loader's work, what it loses beside the loader's thread is the process's own (the GIL).
    """
    import subprocess

    before = loop_alone(seconds)
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen([sys.executable, "-c", _NEIGHBOR, root, str(seconds + 3.5), here, str(_BATCH[0])])
    try:
        time.sleep(2.5)  # its imports and first batch out of the window
        beside = loop_alone(seconds)
    finally:
        child.wait()
    after = loop_alone(seconds)
    return {"alone": before, "beside_process": beside, "alone_again": after}


def dataloader_rate(root: str, path: str, workers: int = 2) -> float:
    from torch.utils.data import DataLoader

    loader = DataLoader(_dataset(root, path), batch_size=None, num_workers=workers)
    images, start = 0, 0.0
    for i, (batch, _labels) in enumerate(loader):
        if i == 0:
            start = time.perf_counter()  # after the first batch (workers started)
            continue
        images += len(batch)
    return images / (time.perf_counter() - start)


def per_core(root: str, batches: int = 10) -> dict[str, float]:
    """One thread: the per-sample path against the kernel on the same samples, per CPU-second."""
    import simplejpeg
    from PIL import Image

    from streamload import StreamingDataset
    from streamload.decode import DecodeBatch, native

    ds = StreamingDataset(root, shuffle=True, seed=0)
    samples = []
    for sample in ds:
        samples.append(sample)
        if len(samples) >= BATCH * batches:
            break
    parts = [samples[i : i + BATCH] for i in range(0, len(samples), BATCH)]
    # each sample with its (epoch, position), as the dataset hands them to a collate
    placed = [
        [dict(s, __epoch__=0, __position__=k * BATCH + j) for j, s in enumerate(part)] for k, part in enumerate(parts)
    ]
    out: dict[str, float] = {}
    for name, flag in (("per_sample", False), ("kernel", True)):
        collate = DecodeBatch(SIZE, crop="random", flip=True, native=flag)
        collate(placed[0])
        cpu = time.thread_time()
        for part in placed:
            collate(part)
        out[f"{name}_images_per_cpu_s"] = len(samples) / (time.thread_time() - cpu)
    # Where the kernel's time goes: its Python (headers, boxes, flips) and its one C call; the
    # boxes and flips drawn in one C call for the batch (samples with their epoch and position,
    # as a dataset's batch read has them) and, for comparison, by a generator a sample in Python.
    collate = DecodeBatch(SIZE, crop="random", flip=True, native=True)
    module = native.kernel()
    assert module is not None
    slots = np.empty((BATCH, *collate.decoder.shape), dtype=np.uint8)
    real_decode = module.decode
    for label, batches_of in (("", placed), ("_python_draws", parts)):
        python_s = c_s = 0.0
        for part in batches_of:
            datas = [s["jpg"] for s in part]
            timing: dict[str, float] = {}

            def timed(*args: Any, _t: dict[str, float] = timing) -> Any:
                t = time.thread_time()
                try:
                    return real_decode(*args)
                finally:
                    _t["c"] = time.thread_time() - t

            module.decode = timed
            try:
                t0 = time.thread_time()
                native.decode_batch(collate, part, datas, slots[: len(part)])
                total = time.thread_time() - t0
            finally:
                module.decode = real_decode
            c_s += timing["c"]
            python_s += total - timing["c"]
        n = len(samples)
        out[f"kernel{label}_python_us_per_image"] = python_s / n * 1e6
        out[f"kernel{label}_c_us_per_image"] = c_s / n * 1e6
    # The per-sample path's parts: libjpeg-turbo decode (simplejpeg, DCT-scaled as it is) and the rest.
    decoder = collate.decoder
    t0 = time.thread_time()
    for s in samples:
        h, w, _, _ = simplejpeg.decode_jpeg_header(s["jpg"])
        box = decoder.box(w, h, np.random.default_rng(0))
        f = decoder._reduction(w, h, box)
        array = simplejpeg.decode_jpeg(s["jpg"], "RGBX", min_width=-(-w // f), min_height=-(-h // f), min_factor=f)
        Image.frombuffer("RGBX", (array.shape[1], array.shape[0]), array, "raw", "RGBX", 0, 1)
    out["per_sample_decode_us_per_image"] = (time.thread_time() - t0) / n * 1e6
    per_image_us = 1e6 / out["per_sample_images_per_cpu_s"]
    out["per_sample_rest_us_per_image"] = per_image_us - out["per_sample_decode_us_per_image"]
    return out


def _hold_longer(seconds: float) -> None:
    """Make each kernel batch hold the GIL ``seconds`` longer after its decode (``--extra-hold``)."""
    from streamload.decode import native

    decoded = native._decoded

    def held(*args: Any, **kwargs: Any) -> Any:
        out = decoded(*args, **kwargs)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return out

    native._decoded = held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1280)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the three paths interleaved in each")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples a batch")
    parser.add_argument("--paths", default=",".join(PATHS), help="the paths to measure, comma-separated")
    parser.add_argument(
        "--neighbor", action="store_true", help="also: the busy loop beside a decoding process (no GIL shared)"
    )
    parser.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="N",
        help="only: N windows each of the loop alone, beside the loader, the loader alone, in turn (one loader)",
    )
    parser.add_argument(
        "--extra-hold",
        type=float,
        default=0.0,
        metavar="MS",
        help="a diagnostic: hold the GIL MS ms longer after each batch's decode (a pure-Python wait), to see "
        "what the loader's per-batch GIL time costs the loop",
    )
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="a diagnostic: the kernel's decode as its own call after the batch's read (as before the two were "
        "one), for an A/B against the default",
    )
    parser.add_argument(
        "--python-open",
        action="store_true",
        help="a diagnostic: each shard opened by Python's own system calls (a dozen GIL releases), as before "
        "the one-call open, for an A/B against the default",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.python_open:
        from streamload.storage import base

        base.open_files = lambda *_args: None  # type: ignore[assignment]
    if args.extra_hold > 0:
        _hold_longer(args.extra_hold / 1e3)
    if args.unfused:
        from streamload.decode import native

        native._Fused.make = classmethod(lambda cls, *_args: None)  # type: ignore[assignment]
    _BATCH[0] = args.batch
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths {unknown}: choose from {sorted(PATHS)}")
    root = dataset_root(args.images)
    print(f"load average before: {os.getloadavg()}, switch interval {sys.getswitchinterval() * 1e3:.0f} ms")
    result: dict[str, Any] = {"load_before": os.getloadavg(), "batch": args.batch, "rounds": []}
    print(f"batch {args.batch}, {args.images} images")
    if args.interleaved:
        result["interleaved"] = {}
        for key in paths:
            got = interleaved(root, key, args.interleaved, args.seconds)
            result["interleaved"][key] = got
            m = got["median"]
            per = got["loop_kept_per_window"]
            print(
                f"{key:12s} interleaved, {args.interleaved} windows of {args.seconds:g} s each: the loop keeps "
                f"{got['loop_kept']:.3f} of its rate alone (median {m['loop']['loop_s'] / 1e6:.1f} -> "
                f"{m['both']['loop_s'] / 1e6:.1f} M/s; windows {min(per):.2f}-{max(per):.2f}), the loader "
                f"{got['loader_kept']:.3f} of its rate alone ({m['loader']['images_s']:.0f} -> "
                f"{m['both']['images_s']:.0f} img/s)"
            )
            for mode, t in got["turns"].items():
                print(
                    f"{'':12s} {'beside the loop' if mode == 'both' else 'alone':15s}: a batch every "
                    f"{t['batch_ms']:.1f} ms within an epoch; an epoch's turn adds {t['turn_extra_ms']:.0f} ms "
                    f"({t['turns']} turns, one every {t['batches_a_turn']:.0f} batches)"
                )
        result["load_after"] = os.getloadavg()
        print(f"load average after: {result['load_after']}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        return
    # The cost of watch's GIL probe to a thread that runs Python all along (alone, probed, alone).
    from streamload._gil import GilProbe

    class Owner:
        pass

    loop = loop_alone(args.seconds)
    owner = Owner()
    GilProbe(owner)
    probed = loop_alone(args.seconds)
    del owner
    loop_again = loop_alone(args.seconds)
    result["gil_probe"] = {"alone": loop, "probed": probed, "alone_again": loop_again}
    print(
        f"busy loop alone {loop / 1e6:.2f} M/s; with watch's GIL probe {probed / 1e6:.2f} M/s; "
        f"alone again {loop_again / 1e6:.2f} M/s (probed / mean of the two: {2 * probed / (loop + loop_again):.3f})"
    )
    for r in range(args.rounds):
        row: dict[str, Any] = {"load": os.getloadavg()}
        if args.neighbor:
            near = loop_beside_process(root, args.seconds)
            row["loop_beside_process"] = near
            print(
                f"round {r + 1} busy loop beside a decoding process (kernel, Loader(threads=1)): "
                f"{2 * near['beside_process'] / (near['alone'] + near['alone_again']):.2f} of its rate alone "
                f"({near['alone'] / 1e6:.1f}, {near['beside_process'] / 1e6:.1f}, {near['alone_again'] / 1e6:.1f} M/s)"
            )
        for key in paths:
            # The loop alone before and after (its rate drifts by up to ~10 % between
            # measurements here): the loop's share is taken against the mean of the two.
            first = loop_alone(args.seconds)
            alone = loader_beside_loop(root, key, args.seconds, busy=False)
            beside = loader_beside_loop(root, key, args.seconds, busy=True)
            after = loop_alone(args.seconds)
            loop = (first + after) / 2
            row[key] = {"loop_alone": loop, "loop_before": first, "loop_after": after, "alone": alone, "beside": beside}
            print(
                f"round {r + 1} Loader(threads=1) {key:12s}: alone {alone['images_s']:5.0f} img/s; beside a busy "
                f"loop {beside['images_s']:5.0f} img/s ({beside['images_s'] / alone['images_s']:.2f} of alone); "
                f"the loop keeps {beside['loop_s'] / loop:.2f} of its {loop / 1e6:.1f} M/s (alone before and "
                f"after: {first / 1e6:.1f}, {after / 1e6:.1f}; load "
                f"{os.getloadavg()[0]:.1f}); the loader's threads, alone / beside: on a CPU "
                f"{alone['loader_cpu']:.2f} / "
                f"{beside['loader_cpu']:.2f}, waiting for a CPU {alone['loader_queued']:.2f} / "
                f"{beside['loader_queued']:.2f}, blocked (GIL, queues) {alone['loader_blocked']:.2f} / "
                f"{beside['loader_blocked']:.2f} of the time; the loop's thread beside: on a CPU "
                f"{beside['loop_cpu']:.2f}, waiting for a CPU {beside['loop_queued']:.2f}"
            )
        for key in paths:
            rate = dataloader_rate(root, key)
            row[f"dataloader2_{key}"] = rate
            print(f"round {r + 1} DataLoader(num_workers=2) + DecodeBatch, {key}: {rate:.0f} img/s")
        result["rounds"].append(row)
    for key in paths:
        loader = [x[key]["beside"]["images_s"] / x[key]["alone"]["images_s"] for x in result["rounds"]]
        kept = [x[key]["beside"]["loop_s"] / x[key]["loop_alone"] for x in result["rounds"]]
        dl = [x[f"dataloader2_{key}"] for x in result["rounds"]]
        print(
            f"{key:12s}: beside a busy loop the Loader keeps {min(loader):.2f}-{max(loader):.2f} of its rate alone, "
            f"the loop {min(kept):.2f}-{max(kept):.2f} of its own; DataLoader(2) {min(dl):.0f}-{max(dl):.0f} img/s"
        )
    core = per_core(root)
    result["per_core"] = core
    print(
        f"per core: per-sample {core['per_sample_images_per_cpu_s']:.0f} img/CPU-s "
        f"(decode {core['per_sample_decode_us_per_image']:.0f} us + resize/pack/Python "
        f"{core['per_sample_rest_us_per_image']:.0f} us an image); kernel {core['kernel_images_per_cpu_s']:.0f} "
        f"img/CPU-s (C {core['kernel_c_us_per_image']:.0f} us + Python {core['kernel_python_us_per_image']:.0f} us; "
        f"with a generator a sample in Python: {core['kernel_python_draws_python_us_per_image']:.0f} us)"
    )
    result["load_after"] = os.getloadavg()
    print(f"load average after: {result['load_after']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
