"""What ``streamload.watch`` costs: the same loop with and without it, runs interleaved.

    python benchmarks/bench_watch.py                          # 4,000 JPEGs (~65 KB), tar, 2 workers
    python benchmarks/bench_watch.py --modes samples --runs 9 --workers 0,2

Modes (each a DataLoader over a ``StreamingDataset``, page cache warm):

* ``dataset``: the dataset iterated in this process, samples one by one (no DataLoader
  to dilute the hooks: the worst case);
* ``samples``: per-sample dicts batched by the DataLoader (the path with the most hooks:
  one sampled clock per sample in the reader, the ``collate_fn`` timed per batch);
* ``transform``: the same with a cheap per-sample transform (the field's length), the
  transform clock on top;
* ``raw``: ``collate=RawCollate()`` batches (one clock per batch);
* ``decode``: ``collate=DecodeBatch(64)`` batches (decoding dominates).

``--micro`` measures what the hooks add per sample (best of many short runs, which a busy
machine disturbs least) against what the plain path spends per sample. ``--prefetch``
instead reads DataLoader ``prefetch_factor`` against Lightning's prefetch off
the report: a pipeline that keeps up on average but stalls now and then, in a plain loop
and in a Lightning fit, at ``prefetch_factor`` 1, 2 and 4 (docs/waiting.md quotes it).

Each run reads ``--batches`` batches after the first (start-up is left out of the rate),
with a fresh dataset and loader, watched or not, in the order plain, watched, watched,
plain, ... so drift in the machine's load falls on both alike. The overhead is
``1 - median(watched rate) / median(plain rate)`` (and the same of the best runs, which
a busy machine disturbs least); the spread of the plain runs
(``(max - min) / median``) says how much of it is noise. On a busy machine the rate
is mostly noise, so the CPU time each run spent (this process and its reaped workers,
``getrusage``) per 1,000 samples is compared as well: what watching costs the machine,
start-up included. The load average is printed with the figures: on a shared machine,
compare only figures of the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _data  # noqa: E402


def _length(sample: dict[str, Any]) -> int:
    return len(sample.get("jpg", b""))


def _loader(root: str, mode: str, workers: int, batch: int) -> Any:
    from torch.utils.data import DataLoader

    from streamload import StreamingDataset
    from streamload.batch import RawCollate
    from streamload.decode import DecodeBatch

    if mode == "dataset":  # the dataset itself in this process: no DataLoader to dilute the hooks
        return StreamingDataset(root, batch_size=batch)
    if mode in ("samples", "transform"):
        ds = StreamingDataset(root, batch_size=batch, transform=_length if mode == "transform" else None)
        return DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_keep)
    collate: Any = RawCollate() if mode == "raw" else DecodeBatch(64)
    ds = StreamingDataset(root, batch_size=batch, collate=collate)
    return DataLoader(ds, batch_size=None, num_workers=workers)


def _keep(samples: list[Any]) -> list[Any]:
    return samples


def _cpu() -> float:
    """CPU seconds of this process and its reaped children (the DataLoader workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def one_run(root: str, mode: str, workers: int, batch: int, batches: int, watched: bool) -> dict[str, Any]:
    """Samples/s over ``batches`` batches after the first (epochs repeat if needed)."""
    from streamload import watch

    cpu0 = _cpu()
    loader = _loader(root, mode, workers, batch)
    source: Any = watch(loader) if watched else loader
    per_item = batch if mode == "dataset" else 1  # the dataset yields samples, loaders batches
    seen = -1
    start = 0.0
    while seen < batches * per_item:
        for _ in source:
            if seen < 0:
                start = time.perf_counter()
            seen += 1
            if seen >= batches * per_item:
                break
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"rate": batches * batch / seconds}
    if watched:
        report = source.report()
        out["wait_fraction"] = round(report.wait_fraction, 3)
        out["stages"] = {k: round(v, 3) for k, v in report.stages.items()}
    del source, loader  # the workers exit and are reaped: their CPU time counts below
    gc.collect()
    out["cpu_ms_per_1k"] = (_cpu() - cpu0) / (batches + 1) / batch * 1e6
    return out


# -- DataLoader prefetch_factor against Lightning's prefetch, read off the report ------------

STEP_S = 0.03  # the model step
SAMPLE_S = 0.0005  # the transform, per sample (8 ms a batch of 16: 4 ms a batch from 2 workers)
BURST_S = 0.15  # ... and one sample in 160 takes this long (a slow read, a shard opening)


def bursty(sample: dict[str, Any]) -> int:
    """A transform that keeps up on average (2 workers) but stalls now and then."""
    time.sleep(BURST_S if sample["__position__"] % 160 == 0 else SAMPLE_S)
    return int(sample["__position__"])


def _plain_loop(root: str, prefetch: int, steps: int) -> Any:
    from torch.utils.data import DataLoader

    from streamload import StreamingDataset, watch

    ds = StreamingDataset(root, batch_size=16, transform=bursty)
    watched = watch(DataLoader(ds, batch_size=16, num_workers=2, prefetch_factor=prefetch))
    for i, _ in enumerate(watched):
        time.sleep(STEP_S)
        if i + 1 >= steps:
            break
    return watched.report()


def _lightning_loop(root: str, prefetch: int, steps: int) -> Any:
    import lightning.pytorch as pl
    import torch

    from streamload.lightning import LoaderOptions, StreamingDataModule

    class Step(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(STEP_S)
            return (self.weight**2).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = StreamingDataModule(
        root, batch_size=16, num_workers=2, transform=bursty, loader=LoaderOptions(prefetch_factor=prefetch)
    )
    trainer = pl.Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        limit_val_batches=0,
    )
    trainer.fit(Step(), datamodule=dm)
    assert dm.watch is not None
    return dm.watch.report()


def prefetch_table(root: str, steps: int) -> None:
    """The same bursty pipeline and step, in a plain loop and under Lightning, at prefetch_factor 1, 2, 4."""
    print(
        f"step {STEP_S * 1e3:.0f} ms; transform {SAMPLE_S * 1e3:.0f} ms/sample, one in 160 {BURST_S * 1e3:.0f} ms; "
        f"batch 16, 2 workers, {steps} steps"
    )
    print(f"{'loop':>10} {'prefetch':>8} {'waiting':>8} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'busy':>6}")
    for prefetch in (1, 2, 4):
        for name, run in (("plain", _plain_loop), ("lightning", _lightning_loop)):
            r = run(root, prefetch, steps)
            busy = "-" if r.busy_fraction is None else f"{100 * r.busy_fraction:.0f} %"
            print(
                f"{name:>10} {prefetch:>8} {100 * r.wait_fraction:>7.1f}% {r.wait_p50_ms:>7.1f} "
                f"{r.wait_p95_ms:>7.1f} {r.wait_p99_ms:>7.1f} {busy:>6}",
                flush=True,
            )
    os.system("uptime")  # noqa: S605, S607


# -- the hooks' own cost, per sample: robust to a busy machine (best of many short runs) ------


def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def micro(root: str, repeats: int = 200) -> dict[str, float]:
    """Nanoseconds the watched path adds per sample, against the plain path's own cost per sample.

    Each figure is the best of ``repeats`` short runs (a few ms: the machine's other work
    rarely lands in all of them). The added cost: the reader's sampled clock around each
    item (``Clock.timed``) and the sampled transform clock (``Clock.transform``), each
    against the same loop without it; the base: one sample read by the bare dataset (an
    epoch of the benchmark dataset, best of a few).
    """
    from streamload import StreamingDataset
    from streamload.timing import SAMPLE_EVERY, StageTable

    n = 20_000
    clock = StageTable(0).clock()

    def items() -> Any:
        yield from range(n)

    def plain_loop() -> None:
        for _ in items():
            pass

    def timed_loop() -> None:
        for _ in clock.timed(items(), SAMPLE_EVERY):
            pass

    def f(x: int) -> int:
        return x

    def plain_calls() -> None:
        for i in range(n):
            f(i)

    def timed_calls() -> None:
        transform = clock.transform
        for i in range(n):
            transform(f, i)

    item_ns = (_best(timed_loop, repeats) - _best(plain_loop, repeats)) / n * 1e9
    call_ns = (_best(timed_calls, repeats) - _best(plain_calls, repeats)) / n * 1e9
    ds = StreamingDataset(root)
    count = len(ds)
    sample_ns = _best(lambda: sum(1 for _ in ds), max(3, repeats // 40)) / count * 1e9
    return {
        "clock_per_item_ns": round(item_ns, 1),
        "transform_clock_per_call_ns": round(call_ns, 1),
        "plain_sample_ns": round(sample_ns),
        "overhead_pct_no_transform": round(100 * item_ns / sample_ns, 2),
        "overhead_pct_with_transform": round(100 * (item_ns + call_ns) / sample_ns, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--modes", default="dataset,samples,transform,raw,decode")
    ap.add_argument("--workers", default="2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=150, help="batches timed per run (decode: a fifth)")
    ap.add_argument("--runs", type=int, default=6, help="runs of each kind (plain and watched)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--prefetch", action="store_true", help="prefetch_factor against Lightning's prefetch instead")
    ap.add_argument("--steps", type=int, default=150, help="--prefetch: steps per loop")
    ap.add_argument("--micro", action="store_true", help="the hooks' cost per sample, best of many short runs")
    args = ap.parse_args()
    root = _data.dataset(args.images, "tar")
    if args.prefetch:
        prefetch_table(root, args.steps)
        return
    if args.micro:
        print(f"load average before: {os.getloadavg()}")
        print(json.dumps(micro(root), indent=1))
        os.system("uptime")  # noqa: S605, S607
        return
    rows = []
    print(f"load average before: {os.getloadavg()}", flush=True)
    for mode in args.modes.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            batches = max(10, args.batches // 5) if mode == "decode" else args.batches
            plain: list[float] = []
            watched: list[float] = []
            cpu: dict[bool, list[float]] = {False: [], True: []}
            last: dict[str, Any] = {}
            for i in range(2 * args.runs):
                watch_it = i % 4 in (1, 2)  # plain, watched, watched, plain, ...
                result = one_run(root, mode, workers, args.batch, batches, watch_it)
                (watched if watch_it else plain).append(result["rate"])
                cpu[watch_it].append(result["cpu_ms_per_1k"])
                if watch_it:
                    last = result
            p, w = statistics.median(plain), statistics.median(watched)
            best = 100 * (1 - max(watched) / max(plain))
            cp, cw = statistics.median(cpu[False]), statistics.median(cpu[True])
            row = {
                "mode": mode,
                "workers": workers,
                "plain_samples_per_s": round(p),
                "watched_samples_per_s": round(w),
                "overhead_pct": round(100 * (1 - w / p), 2),
                "overhead_best_pct": round(best, 2),
                "plain_spread_pct": round(100 * (max(plain) - min(plain)) / p, 1),
                "plain_cpu_ms_per_1k_samples": round(cp, 2),
                "watched_cpu_ms_per_1k_samples": round(cw, 2),
                "cpu_overhead_pct": round(100 * (cw / cp - 1), 2),
                "runs": args.runs,
                "last_watched": last,
                "load_average": os.getloadavg(),
            }
            rows.append(row)
            print(
                f"{mode:>9} workers={workers}: plain {p:8.0f}/s  watched {w:8.0f}/s  "
                f"overhead {row['overhead_pct']:+.2f} % (best runs {best:+.2f} %) "
                f"(plain runs spread {row['plain_spread_pct']:.1f} %); CPU per 1k samples {cp:.1f} vs {cw:.1f} ms: "
                f"{row['cpu_overhead_pct']:+.2f} % (load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows, indent=1))
    os.system("uptime")  # noqa: S605, S607 - the load average, printed with the figures


if __name__ == "__main__":
    main()
