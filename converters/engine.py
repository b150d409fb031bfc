"""The parallel conversion engine: a source's items to shards and a manifest.

The engine decides every shard's content *before* any worker starts: items are listed
(and optionally shuffled with a seed), then cut into shards by sample count or payload
bytes. Each worker process writes whole shards, so the output is byte-identical for any
number of workers. Shards are staged under temporary names and published when complete;
``index.json`` is published last, only if every shard succeeded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from streamload._errors import ConfigError, ConversionInterrupted, SourceError
from streamload._units import parse_bytes
from streamload.formats import Format, get_format
from streamload.manifest import HASH_ALGORITHMS, Manifest, SkippedInput
from streamload.storage import Destination, open_destination
from streamload.writer import ShardResult, publish_manifest, write_shard

from .journal import Journal, plan_fingerprint
from .source import Item, Source

__all__ = ["ConvertOptions", "ConvertReport", "convert", "plan_shards"]

DEFAULT_SHARD_BYTES = 128 * 10**6


@dataclass(frozen=True)
class ConvertOptions:
    """Options of a conversion.

    Attributes:
        format: Shard format name.
        shard_bytes: Payload bytes per shard at most (ignored if ``samples_per_shard``).
        samples_per_shard: Samples per shard at most.
        workers: Conversion processes (output is identical for any value).
        shuffle: Shuffle the sample order before sharding.
        seed: Seed of that shuffle.
        on_error: ``"raise"`` at the first broken input, or ``"skip"`` it (listed in the
            manifest and counted).
        hash_algorithm: Shard hash algorithm.
        progress: Show a progress bar: ``True``, ``False`` or ``None`` (only on a terminal).
        storage_options: fsspec options for a remote destination.
        resume: Finish an interrupted conversion, reusing the shards it published.
        overwrite: Replace a dataset or an interrupted conversion at the destination.
    """

    format: str = "tar"
    shard_bytes: int | str | None = DEFAULT_SHARD_BYTES
    samples_per_shard: int | None = None
    workers: int = 1
    shuffle: bool = False
    seed: int = 0
    on_error: Literal["raise", "skip"] = "raise"
    hash_algorithm: str = "sha256"
    progress: bool | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    overwrite: bool = False

    def validate(self) -> None:
        """Raise :class:`~streamload.ConfigError` for impossible values."""
        if self.workers < 1:
            raise ConfigError(f"workers={self.workers} must be >= 1")
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            raise ConfigError(f"samples_per_shard={self.samples_per_shard} must be >= 1")
        if self.on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={self.on_error!r} must be 'raise' or 'skip'")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError(f"hash_algorithm={self.hash_algorithm!r} must be one of {HASH_ALGORITHMS}")
        get_format(self.format)


@dataclass
class ConvertReport:
    """What a conversion did."""

    manifest: Manifest
    seconds: float
    payload_bytes: int
    ignored: list[SkippedInput]
    resumed: int = 0

    @property
    def skipped(self) -> tuple[SkippedInput, ...]:
        """Inputs skipped because they were broken (under ``on_error="skip"``)."""
        return self.manifest.skipped

    def summary(self) -> str:
        """Return a one-paragraph human summary."""
        m = self.manifest
        rate = self.payload_bytes / max(self.seconds, 1e-9) / 1e6
        return (
            f"wrote {m.num_samples} samples in {len(m.shards)} {m.format} shards "
            f"({m.num_bytes / 1e6:.1f} MB) in {self.seconds:.2f} s: "
            f"{m.num_samples / max(self.seconds, 1e-9):.0f} samples/s, {rate:.1f} MB/s; "
            f"{len(self.skipped)} broken inputs skipped, {len(self.ignored)} non-input files ignored"
            + (f"; {self.resumed} shards reused from the interrupted run" if self.resumed else "")
        )


def plan_shards(items: Sequence[Item], max_bytes: int | None, max_samples: int | None) -> list[list[Item]]:
    """Cut ``items`` into consecutive shards by sample count or payload bytes.

    A shard holds at most ``max_samples`` items (if given), else at most ``max_bytes``
    payload bytes; an item larger than ``max_bytes`` gets a shard alone.
    """
    shards: list[list[Item]] = []
    current: list[Item] = []
    size = 0
    for item in items:
        full = (max_samples is not None and len(current) >= max_samples) or (
            max_samples is None and max_bytes is not None and current and size + item.nbytes > max_bytes
        )
        if full:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current:
        shards.append(current)
    return shards


# -- the worker side -------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _init_worker(source: Source, fmt: Format, dest: Destination, options: ConvertOptions) -> None:
    _STATE.update(source=source, fmt=fmt, dest=dest, options=options)


def _write_task(task: tuple[int, list[Item]]) -> ShardResult:
    index, items = task
    source: Source = _STATE["source"]
    options: ConvertOptions = _STATE["options"]
    fmt: Format = _STATE["fmt"]
    skipped: list[SkippedInput] = []

    def samples() -> Iterator[dict[str, Any]]:
        for item in items:
            try:
                yield source.load(item)
            except SourceError as exc:
                if options.on_error == "raise":
                    raise
                skipped.append(SkippedInput(source.origin(item), str(exc)))

    result = write_shard(fmt, _STATE["dest"], fmt.shard_name(index), samples(), options.hash_algorithm)
    result.skipped = skipped
    return result


# -- the driver --------------------------------------------------------------------


def convert(
    source: Source,
    dst: str,
    options: ConvertOptions | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ConvertReport:
    """Convert ``source`` into a dataset at ``dst`` (a directory or fsspec URL).

    Args:
        source: What to convert.
        dst: Destination directory or URL prefix.
        options: Conversion options.
        on_progress: Called with ``(samples_done, payload_bytes_done)`` after each shard.

    Returns:
        A :class:`ConvertReport` with the manifest written.

    Raises:
        SourceError: At the first broken input under ``on_error="raise"``.
    """
    options = options or ConvertOptions()
    options.validate()
    started = time.perf_counter()
    fmt = get_format(options.format)
    scan = source.scan()
    if scan.problems and options.on_error == "raise":
        first = scan.problems[0]
        raise SourceError(f"{source.describe()}/{first.path}: {first.error} (use on_error='skip' to go on)")
    tasks = _plan(scan.items, options)
    dest = open_destination(dst, options.storage_options)
    names = [fmt.shard_name(index) for index, _ in tasks]
    journal = Journal(dest, plan_fingerprint(_job(source, options), tasks), names)
    done = journal.open(options.resume, options.overwrite, options.hash_algorithm)
    results: dict[str, ShardResult] = dict(done)
    todo = [task for task in tasks if fmt.shard_name(task[0]) not in done]
    bar = _Progress(len(scan.items), options.progress)
    bar.update(sum(r.entry.num_samples + len(r.skipped) for r in done.values()), 0)
    try:
        for result in _run_tasks(todo, source, fmt, dest, options):
            journal.record(result)
            results[result.entry.name] = result
            bar.update(result.entry.num_samples + len(result.skipped), result.payload_bytes)
            if on_progress is not None:
                on_progress(
                    sum(r.entry.num_samples for r in results.values()), sum(r.payload_bytes for r in results.values())
                )
    except KeyboardInterrupt as exc:
        raise ConversionInterrupted(
            f"conversion into {dst} interrupted after {len(results)} of {len(tasks)} shards; "
            "run the same command with --resume to finish it"
        ) from exc
    finally:
        bar.close()
    ordered = [results[name] for name in names]
    manifest = _manifest(source, fmt, options, ordered, scan.problems)
    publish_manifest(dest, manifest)
    journal.finish()
    payload = sum(r.payload_bytes for r in ordered)
    return ConvertReport(manifest, time.perf_counter() - started, payload, scan.ignored, resumed=len(done))


def _plan(scanned: Sequence[Item], options: ConvertOptions) -> list[tuple[int, list[Item]]]:
    """Order the items (seeded shuffle) and cut them into numbered shards."""
    items = list(scanned)
    if options.shuffle:
        order = np.random.default_rng(options.seed).permutation(len(items))
        items = [items[i] for i in order]
    max_bytes = None if options.shard_bytes is None else parse_bytes(options.shard_bytes, name="shard_bytes")
    return list(enumerate(plan_shards(items, max_bytes, options.samples_per_shard)))


def _job(source: Source, options: ConvertOptions) -> dict[str, Any]:
    """What must not change between an interrupted run and its resume."""
    return {
        "source": source.describe(),
        "format": options.format,
        "hash": options.hash_algorithm,
        "on_error": options.on_error,
    }


def _run_tasks(
    tasks: list[tuple[int, list[Item]]], source: Source, fmt: Format, dest: Destination, options: ConvertOptions
) -> Iterator[ShardResult]:
    workers = min(options.workers, max(1, len(tasks)))
    if workers == 1:
        _init_worker(source, fmt, dest, options)
        try:
            yield from map(_write_task, tasks)
        finally:
            _STATE.clear()
        return
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    ctx = mp.get_context(method)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(source, fmt, dest, options)) as pool:
        yield from pool.imap(_write_task, tasks)


def _manifest(
    source: Source, fmt: Format, options: ConvertOptions, results: list[ShardResult], problems: list[SkippedInput]
) -> Manifest:
    fields: set[str] = set()
    skipped: list[SkippedInput] = list(problems)
    for r in results:
        fields |= r.fields
        skipped.extend(r.skipped)
    meta = {
        **source.meta(),
        "converter": {
            "shard_bytes": None if options.samples_per_shard else options.shard_bytes,
            "samples_per_shard": options.samples_per_shard,
            "shuffle": options.shuffle,
            "seed": options.seed if options.shuffle else None,
        },
    }
    return Manifest(
        format=fmt.name,
        shards=tuple(r.entry for r in results),
        fields=tuple(sorted(fields)),
        classes=tuple(source.classes),
        hash_algorithm=options.hash_algorithm,
        skipped=tuple(skipped),
        meta=meta,
    )


class _Progress:
    """A tqdm bar (samples/s, MB/s) on a terminal; silent otherwise."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty() and not os.environ.get("CI")
        self._bar: Any = None
        self._bytes = 0
        self._start = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="img", unit_scale=True, dynamic_ncols=True, desc="convert")

    def update(self, samples: int, nbytes: int) -> None:
        if self._bar is None:
            return
        self._bytes += nbytes
        rate = self._bytes / max(time.perf_counter() - self._start, 1e-9) / 1e6
        self._bar.set_postfix_str(f"{rate:.1f} MB/s", refresh=False)
        self._bar.update(samples)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
