"""``streamload bench DATASET``: the DataLoader tuning advice, measured on your data and machine.

For each setting of the sweep (``num_workers`` x ``prefetch_factor`` x ``pin_memory``
x batch size) it reads the dataset for a few seconds through a real DataLoader and
records samples/s, MB/s, the time to the first batch and the peak memory (PSS summed
over the main process and its workers: shared pages are counted once, not per worker).
Then it says where throughput stops growing and recommends the smallest setting within
5 % of the best, and can plot samples/s against workers.

Three modes: ``raw`` (zero-copy :class:`~streamload.batch.RawBatch` batches: the I/O
ceiling), ``decode`` (:class:`~streamload.decode.DecodeBatch` to ``--size`` pixels,
JPEGs by ``--backend``: what training sees) and ``samples`` (per-sample dicts batched by the DataLoader, the
path without streamload's batching, for comparison).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigError
from ._units import format_bytes

__all__ = [
    "HEADER",
    "BenchResult",
    "PeakMemory",
    "check_plot",
    "plateau",
    "plot",
    "recommend",
    "run_one",
    "stage_split",
    "sweep",
]

MODES = ("raw", "decode", "samples")
#: ``--backend`` choices: the JPEG decoder of the ``decode`` mode (see :class:`~streamload.decode.ImageDecoder`).
BACKENDS = ("auto", "simplejpeg", "pillow")
#: The largest ``--batch-size``, ``--size`` (pixels a side) and ``--prefetch`` the sweep takes.
MAX_BATCH, MAX_SIZE, MAX_PREFETCH = 65536, 8192, 64


class PeakMemory:
    """Sample the PSS of a process and its children in a thread; keep the peak.

    PSS (proportional set size) splits each shared page among the processes that map it,
    so summing it over the main process and the DataLoader workers counts the memory the
    machine really spends (RSS would count torch's libraries once per worker).

    Args:
        pid: Process to watch (default: this one), with all its descendants.
        interval: Seconds between samples.
    """

    def __init__(self, pid: int | None = None, interval: float = 0.1) -> None:
        self.pid = pid if pid is not None else os.getpid()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        """Return the current PSS in bytes of the process tree (0 if it is gone)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            try:
                total += int(proc.memory_full_info().pss)
            except psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self.peak = self.sample()
        self._thread = threading.Thread(target=self._run, name="streamload-pss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.sample())


@dataclass
class BenchResult:
    """One measured DataLoader setting."""

    workers: int
    prefetch_factor: int | None
    pin_memory: bool
    batch_size: int
    samples: int
    seconds: float
    samples_per_s: float
    mb_per_s: float
    first_batch_s: float
    peak_pss: int
    #: ``decode`` mode: JPEGs the fast backend refused and Pillow decoded (over the workers), counted
    #: from the first batch on, as ``samples`` is (with workers, those decoded ahead count too).
    fallbacks: int = 0
    #: Seconds per stage summed over the readers (``streamload.watch``): fetch, read, transform, collate.
    stages: dict[str, float] | None = None


def _loader(
    dataset: str,
    mode: str,
    workers: int,
    prefetch: int | None,
    pin: bool,
    batch_size: int,
    size: int,
    storage: Any,
    backend: str = "auto",
) -> Any:
    from torch.utils.data import DataLoader

    from .batch import RawCollate
    from .dataset import StreamingDataset
    from .decode import DecodeBatch

    common: dict[str, Any] = dict(batch_size=batch_size, storage=storage)
    extra: dict[str, Any] = dict(num_workers=workers, pin_memory=pin)
    if workers:
        extra.update(prefetch_factor=prefetch, persistent_workers=True)
    if mode == "samples":
        ds = StreamingDataset(dataset, **common)
        return DataLoader(ds, batch_size=batch_size, collate_fn=_payloads, **extra)
    collate: Any = RawCollate() if mode == "raw" else DecodeBatch(size, backend=backend)  # type: ignore[arg-type]
    ds = StreamingDataset(dataset, collate=collate, **common)
    return DataLoader(ds, batch_size=None, **extra)


def _payloads(samples: list[dict[str, Any]]) -> list[bytes]:
    """Collate for the ``samples`` mode: each sample's bytes, pickled to the main process.

    That is the path of any per-sample dataset; the main process then counts them.
    """
    return [v for s in samples for k, v in s.items() if not k.startswith("__") and k != "cls"]


def _measure_batch(batch: Any) -> tuple[int, int]:
    """Return ``(samples, payload bytes)`` of a batch of any mode."""
    from .batch import ImageBatch, RawBatch

    if isinstance(batch, RawBatch):
        return batch.batch_size, int(batch.data.numel())
    if isinstance(batch, ImageBatch):
        return len(batch), int(batch.images.numel())
    return len(batch), sum(len(b) for b in batch)


def _fallbacks(loader: Any) -> int:
    """JPEG decodes that fell back to Pillow so far (counted in shared memory by the workers)."""
    return int(getattr(loader.dataset.collate, "fallbacks", 0))


def _storage(storage: Any, storage_options: dict[str, Any] | None, cache_dir: str | None) -> Any:
    """The storage settings to read with: ``storage``, else those of ``storage_options`` and ``cache_dir``."""
    from .storageconfig import StorageConfig

    if storage is None:
        return StorageConfig(storage_options=storage_options, cache_dir=cache_dir)
    if storage_options is not None or cache_dir is not None:
        raise ConfigError("give storage_options and cache_dir in storage=, not beside it")
    return storage


def run_one(
    dataset: str,
    mode: str,
    workers: int,
    prefetch: int | None,
    pin: bool,
    batch_size: int,
    size: int,
    seconds: float,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    backend: str = "auto",
    storage: Any = None,
) -> BenchResult:
    """Measure one setting: read for about ``seconds`` (at least one batch, epochs repeat).

    ``storage``: a :class:`~streamload.StorageConfig` to read with, instead of
    ``storage_options`` and ``cache_dir``.
    """
    from .watching import watch

    storage = _storage(storage, storage_options, cache_dir)
    raw = _loader(dataset, mode, workers, prefetch, pin, batch_size, size, storage, backend)
    loader = watch(raw)  # the stage breakdown of the setting (the same figures as a watched training loop)
    samples = nbytes = fallbacks_before = 0
    first = steady = 0.0
    with PeakMemory() as memory:
        start = time.perf_counter()
        done = False
        while not done:
            for batch in loader:
                n, b = _measure_batch(batch)
                if not first:  # the rate excludes start-up: it counts the batches after the first
                    first = time.perf_counter() - start
                    steady = time.perf_counter()
                    fallbacks_before = _fallbacks(raw)  # counted over the same batches as the rate
                    continue
                samples += n
                nbytes += b
                if time.perf_counter() - start >= seconds:
                    done = True
                    break
            if not first:
                raise ConfigError(f"dataset {dataset!r} yielded no batch")
        elapsed = max(time.perf_counter() - steady, 1e-9)
    fallbacks = _fallbacks(raw) - fallbacks_before
    stages = loader.report().stages
    del loader, raw
    rate = samples / elapsed if samples else 0.0
    return BenchResult(
        workers,
        prefetch if workers else None,
        pin,
        batch_size,
        samples,
        elapsed,
        rate,
        nbytes / elapsed / 1e6,
        first,
        memory.peak,
        fallbacks,
        {name: round(value, 4) for name, value in stages.items()},
    )


def sweep(
    dataset: str,
    mode: str = "raw",
    workers: Sequence[int] = (0, 1, 2),
    prefetch: Sequence[int] = (2,),
    pin_memory: Sequence[bool] = (False,),
    batch_sizes: Sequence[int] = (256,),
    size: int = 224,
    seconds: float = 5.0,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    backend: str = "auto",
    storage: Any = None,
) -> list[BenchResult]:
    """Measure every combination; return the results in sweep order.

    ``backend``: the ``decode`` mode's JPEG decoder (:data:`BACKENDS`); ``storage``: a
    :class:`~streamload.StorageConfig` to read with, instead of ``storage_options`` and
    ``cache_dir``.
    """
    storage = _storage(storage, storage_options, cache_dir)
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} must be one of {MODES}")
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} must be one of {BACKENDS}")
    out: list[BenchResult] = []
    for bs in batch_sizes:
        for pin in pin_memory:
            for w in workers:
                for pf in prefetch if w else (prefetch[0],):
                    result = run_one(dataset, mode, w, pf, pin, bs, size, seconds, backend=backend, storage=storage)
                    if progress:
                        print(_row(result), flush=True)
                    out.append(result)
    return out


def recommend(results: Sequence[BenchResult], within: float = 0.05) -> BenchResult:
    """The cheapest setting within ``within`` of the best rate (fewest workers, then memory)."""
    if not results:
        raise ConfigError("no results to recommend from")
    best = max(r.samples_per_s for r in results)
    good = [r for r in results if r.samples_per_s >= (1 - within) * best]
    return min(good, key=lambda r: (r.workers, r.prefetch_factor or 0, r.peak_pss))


def plateau(results: Sequence[BenchResult], gain: float = 0.05) -> int | None:
    """The worker count after which one more step of the sweep adds less than ``gain``."""
    by_workers: dict[int, float] = {}
    for r in results:
        by_workers[r.workers] = max(by_workers.get(r.workers, 0.0), r.samples_per_s)
    counts = sorted(by_workers)
    for a, b in zip(counts, counts[1:], strict=False):
        if by_workers[b] < (1 + gain) * by_workers[a]:
            return a
    return None


#: The heading of the table of results :func:`sweep` prints a row of for each setting.
HEADER = (
    f"{'workers':>7} {'prefetch':>8} {'pin':>5} {'batch':>5} {'samples/s':>10} {'MB/s':>8} "
    f"{'1st batch':>9} {'peak PSS':>10}  {'fetch/read/transform/collate %':>30}"
)


def stage_split(stages: dict[str, float] | None) -> str:
    """Each stage's share of the readers' time, ``fetch/read/transform/collate`` in percent."""
    from .timing import STAGES

    total = sum((stages or {}).values())
    if not stages or total <= 0:
        return "-"
    return "/".join(f"{100 * stages.get(name, 0.0) / total:.0f}" for name in STAGES)


def _row(r: BenchResult) -> str:
    prefetch = "-" if r.prefetch_factor is None else str(r.prefetch_factor)
    return (
        f"{r.workers:>7} {prefetch:>8} {str(r.pin_memory):>5} {r.batch_size:>5} {r.samples_per_s:>10.0f} "
        f"{r.mb_per_s:>8.1f} {r.first_batch_s:>8.2f}s {format_bytes(r.peak_pss):>10}  {stage_split(r.stages):>30}"
    )


def _matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed); a :class:`ConfigError` if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install streamload[plot]") from exc
    return plt


def check_plot(path: str) -> None:
    """Check, before anything is measured, that :func:`plot` can write ``path``.

    Raises:
        ConfigError: Naming ``path``, if matplotlib is missing, the extension is not a
            format it writes (``.png``, ``.svg``, ``.pdf``...), the path is a folder, or
            its folder does not exist or cannot be written.
    """
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in formats:
        said = f"has the extension .{extension}" if extension else "has no extension"
        raise ConfigError(
            f"--plot {path} {said}: name an image file, with one of the extensions matplotlib writes "
            f"({', '.join('.' + f for f in formats)}), e.g. --plot sweep.png"
        )
    if os.path.isdir(path):
        raise ConfigError(f"--plot {path} is a folder: name the image file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"--plot {path}: cannot write there (permission denied)")


def plot(results: Sequence[BenchResult], path: str, title: str) -> None:
    """Draw samples/s against workers, one line per (prefetch, pin, batch) setting."""
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple[Any, ...], list[BenchResult]] = {}
    for r in results:
        series.setdefault((r.prefetch_factor if r.workers else None, r.pin_memory, r.batch_size), []).append(r)
    for (pf, pin, bs), rs in series.items():
        rs = sorted(rs, key=lambda r: r.workers)
        label = f"batch {bs}, pin {pin}" + (f", prefetch {pf}" if pf is not None else "")
        ax.plot([r.workers for r in rs], [r.samples_per_s for r in rs], marker="o", label=label)
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
