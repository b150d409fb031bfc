"""The parallel conversion engine: a source's items to shards and a manifest.

The engine decides every shard's content *before* any worker starts: items are listed
(and optionally shuffled with a seed), then cut into shards by sample count or payload
bytes. Each worker process writes whole shards, so the output is byte-identical for any
number of workers. Shards are staged under temporary names and published when complete;
``index.json`` is published last, only if every shard succeeded.

A conversion never destroys or silently mixes data. Before anything is written it
refuses a destination that is its own source (an in-place re-shard: convert into a new
location instead) or lies inside the image folder it reads; it takes the destination's
lock (:meth:`~streamload.storage.Destination.lock`) for its whole run, so a second
conversion into the same destination fails at once naming the first; and the journal
(:mod:`.journal`) refuses destinations holding files streamload did not write. Keys are
checked unique over the whole scan. After a failure no staged file is left behind.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from streamload._errors import (
    ConfigError,
    ConversionInterrupted,
    SampleError,
    SourceError,
    StorageError,
    StreamloadError,
)
from streamload._units import parse_bytes
from streamload.formats import Format, check_sample, get_format
from streamload.manifest import HASH_ALGORITHMS, MANIFEST_NAME, Manifest, SkippedInput
from streamload.storage import Destination, LocalDestination, is_local, local_path_of, open_destination
from streamload.writer import ShardResult, publish_manifest, write_shard

from .dataset_source import DatasetSource, SampleItem
from .executors import Failed, open_executor, parse_executor
from .imagefolder import ImageFolderSource
from .images import WARNINGS_KEY
from .journal import JOB_NAME, Journal, plan_fingerprint, plan_of
from .planning import plan_shards
from .source import Item, ScanResult, Source, printable
from .table import TableSource

__all__ = ["ConvertOptions", "ConvertReport", "convert", "plan_shards"]

DEFAULT_SHARD_BYTES = 128 * 10**6
#: Most conversion processes accepted (each is a full process; more only thrash).
MAX_WORKERS = 1024


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
        executor: Where shard tasks run: ``"local"`` (a process pool of ``workers``),
            ``"dask"`` / ``"dask://HOST:PORT"``, ``"ray"`` / ``"ray://HOST:PORT"``
            (see :mod:`.executors`). The output is the same for every executor.
        append: Add the source's samples as new shards to the dataset at the destination.
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
    executor: str = "local"
    append: bool = False

    def validate(self) -> None:
        """Raise :class:`~streamload.ConfigError` for impossible values."""
        if not isinstance(self.workers, int) or not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers={self.workers!r} must be between 1 and {MAX_WORKERS}")
        if self.samples_per_shard is not None and (
            not isinstance(self.samples_per_shard, int) or self.samples_per_shard < 1
        ):
            raise ConfigError(f"samples_per_shard={self.samples_per_shard!r} must be >= 1")
        max_bytes = self.max_shard_bytes()
        if self.samples_per_shard is None and max_bytes is not None and max_bytes < 1:
            raise ConfigError(f"shard_bytes={self.shard_bytes!r} must be at least 1 byte")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be an integer >= 0")
        if self.on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={self.on_error!r} must be 'raise' or 'skip'")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError(f"hash_algorithm={self.hash_algorithm!r} must be one of {HASH_ALGORITHMS}")
        get_format(self.format)
        parse_executor(self.executor)
        if self.append and self.overwrite:
            raise ConfigError("append and overwrite exclude each other: --append keeps the dataset it adds to")

    def max_shard_bytes(self) -> int | None:
        """Return ``shard_bytes`` as a number of bytes (``None``: no byte limit).

        Raises:
            ConfigError: If it is not a byte size.
        """
        if self.shard_bytes is None:
            return None
        try:
            return parse_bytes(self.shard_bytes, name="shard_bytes")
        except (OverflowError, ValueError) as exc:  # a size too large for a float
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"shard_bytes={self.shard_bytes!r} is not a usable byte size") from exc


@dataclass
class ConvertReport:
    """What a conversion did.

    Attributes:
        manifest: The manifest written (or found, if ``already_complete``).
        seconds: Wall time of the call.
        payload_bytes: Payload bytes written by this call.
        ignored: Files of the source that are not inputs.
        resumed: Shards reused from an interrupted run.
        already_complete: ``--resume`` found this very conversion complete: nothing was written.
        warnings: Library warnings (Pillow's ``DecompressionBombWarning``, truncated or
            malformed files...) raised while checking inputs that were kept, each with its input.
    """

    manifest: Manifest
    seconds: float
    payload_bytes: int
    ignored: list[SkippedInput]
    resumed: int = 0
    already_complete: bool = False
    warnings: list[SkippedInput] = field(default_factory=list)

    @property
    def skipped(self) -> tuple[SkippedInput, ...]:
        """Inputs skipped because they were broken (under ``on_error="skip"``)."""
        return self.manifest.skipped

    def summary(self) -> str:
        """Return a one-paragraph human summary."""
        m = self.manifest
        if self.already_complete:
            return (
                f"nothing to do: the destination already holds this conversion, complete "
                f"({m.num_samples} samples in {len(m.shards)} {m.format} shards, {m.num_bytes / 1e6:.1f} MB)"
            )
        rate = self.payload_bytes / max(self.seconds, 1e-9) / 1e6
        return (
            f"wrote {m.num_samples} samples in {len(m.shards)} {m.format} shards "
            f"({m.num_bytes / 1e6:.1f} MB) in {self.seconds:.2f} s: "
            f"{m.num_samples / max(self.seconds, 1e-9):.0f} samples/s, {rate:.1f} MB/s; "
            f"{len(self.skipped)} broken inputs skipped, {len(self.ignored)} non-input files ignored"
            + (f", {len(self.warnings)} library warnings" if self.warnings else "")
            + (f"; {self.resumed} shards reused from the interrupted run" if self.resumed else "")
        )


def _without_prefix(message: str, origin: str) -> str:
    """``message`` without a leading ``origin`` (a skipped input's path is recorded once)."""
    if message.startswith(origin) and message != origin:
        return message[len(origin) :].lstrip(": ") or message
    return message


# -- the worker side -------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _init_worker(source: Source, fmt: Format, dest: Destination, options: ConvertOptions, parent: int = 0) -> None:
    _STATE.update(source=source, fmt=fmt, dest=dest, options=options)
    if parent and sys.platform.startswith("linux"):
        # A worker dies with the conversion: killed, it must not go on writing shards
        # into a destination whose lock it never held.
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)


def _write_task(task: tuple[int, Sequence[Item]]) -> ShardResult:
    return _write(_STATE["source"], _STATE["fmt"], _STATE["dest"], _STATE["options"], task)


@dataclass
class ShardJob:
    """A whole-shard task as sent to a Dask or Ray worker: it writes straight to the destination.

    Calling it with ``(index, items)`` writes shard ``index`` and returns its
    :class:`~streamload.writer.ShardResult`, or :class:`~.executors.Failed` for an error
    of the input (returned, not raised, so the engine does not retry it).
    """

    source: Source
    format: str
    dst: str
    storage_options: dict[str, Any]
    options: ConvertOptions

    def __call__(self, task: tuple[int, Sequence[Item]]) -> ShardResult | Failed:
        dest = open_destination(self.dst, self.storage_options)
        try:
            return _write(self.source, get_format(self.format), dest, self.options, task)
        except StreamloadError as exc:
            return Failed(exc)
        finally:
            if not isinstance(dest, LocalDestination):
                dest.close()  # its local staging folder


def _write(
    source: Source, fmt: Format, dest: Destination, options: ConvertOptions, task: tuple[int, Sequence[Item]]
) -> ShardResult:
    index, items = task
    skipped: list[SkippedInput] = []
    warned: list[SkippedInput] = []

    def samples() -> Iterator[dict[str, Any]]:
        for item in source.iter_items(items):  # a table reads its part here (an error there is no row's)
            try:
                sample = source.load(item)
                for text in sample.pop(WARNINGS_KEY, None) or ():
                    warned.append(SkippedInput(printable(source.origin(item)), printable(str(text))))
                check_sample(sample)  # a sample the writer would refuse is a broken input, named
            except (SourceError, SampleError, UnicodeError) as exc:
                if options.on_error == "raise":
                    if isinstance(exc, SourceError):
                        raise
                    raise SourceError(f"{printable(source.origin(item))}: {printable(str(exc))}") from exc
                origin = printable(source.origin(item))
                skipped.append(SkippedInput(origin, _without_prefix(printable(str(exc)), origin)))
                continue
            yield sample

    result = write_shard(fmt, dest, fmt.shard_name(index), samples(), options.hash_algorithm)
    result.skipped = skipped
    result.warnings = warned
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
        A :class:`ConvertReport` with the manifest written. With ``resume`` on a
        destination that already holds this very conversion, complete, nothing is written
        and the report says ``already_complete``.

    Raises:
        SourceError: At the first broken input under ``on_error="raise"``, or if there is
            nothing to convert.
        ConfigError: If ``dst`` is ``source`` itself or inside the image folder, or holds
            data the options do not allow to touch (see :class:`~.journal.Journal`).
        StorageError: If another conversion is writing ``dst`` (naming it), or writing fails.
    """
    options = options or ConvertOptions()
    options.validate()
    started = time.perf_counter()
    fmt = get_format(options.format)
    if not fmt.writable:  # parquet: read in place, never written
        raise ConfigError(
            f"format {fmt.name!r} is read in place (streamload index DIR --format {fmt.name}); "
            "convert writes tar, lmdb or hdf5 shards"
        )
    _check_paths(source, dst)
    try:
        dest = open_destination(dst, options.storage_options)
    except StreamloadError:
        raise
    except OSError as exc:
        raise StorageError(f"cannot write to {dst}: {exc.strerror or exc}") from exc
    try:
        with dest.lock() as lock:
            report = _convert_locked(source, dst, dest, fmt, options, on_progress, lock.check)
    except StreamloadError:
        raise
    except OSError as exc:  # the destination's disk, permissions...: name it, no traceback
        raise StorageError(f"writing {dst} failed: {printable(str(exc))}") from exc
    finally:
        dest.close()
    report.seconds = time.perf_counter() - started
    return report


def _convert_locked(
    source: Source,
    dst: str,
    dest: Destination,
    fmt: Format,
    options: ConvertOptions,
    on_progress: Callable[[int, int], None] | None,
    check_lock: Callable[[], None],
) -> ConvertReport:
    """The conversion proper, with the destination locked."""
    base, offset = _append_base(dest, dst, fmt, options) if options.append else (None, 0)
    appending = None
    if base is not None:
        appending = (
            lambda items: _check_appendable(source, base, dst, options, items),
            lambda: _keys_of(dst, options, len(base.shards)),
        )
    scan, planned, clashes = _scan_and_plan(source, options, dst, appending)
    problems = [*scan.problems, *clashes]
    if problems and options.on_error == "raise":
        first = problems[0]
        described = printable(source.describe())
        where = first.path if first.path.startswith(described) else f"{described}/{first.path}"
        raise SourceError(f"{where}: {first.error} (use on_error='skip' to go on)")
    total = sum(len(shard) for _, shard in planned)
    if not total:
        raise SourceError(f"{printable(source.describe())}: nothing to convert: no readable input was found")
    tasks = [(offset + index, shard) for index, shard in planned]
    names = [fmt.shard_name(index) for index, _ in tasks]
    sidecars = [fmt.sidecar_name(name) or name + ".idx" for name in names]
    job = _job(source, options)
    if base is not None:
        job["append_to"] = {"shards": offset, "plan": base.meta.get("converter", {}).get("plan")}
    fingerprint = plan_fingerprint(job, tasks)
    extra = _append_journal(base) if base is not None else None
    journal = Journal(dest, fingerprint, names, [*names, *sidecars], append=base is not None, extra=extra)
    state = journal.open(options.resume, options.overwrite, options.hash_algorithm)
    if state.complete is not None:
        journal.finish()
        return ConvertReport(state.complete, 0.0, 0, scan.ignored, len(state.complete.shards), already_complete=True)
    done = state.reusable
    results: dict[str, ShardResult] = dict(done)
    todo = [task for task in tasks if fmt.shard_name(task[0]) not in done]
    bar = _Progress(total, options.progress)
    bar.update(sum(r.entry.num_samples + len(r.skipped) for r in done.values()), 0)
    running = _run_tasks(todo, source, fmt, dest, options, dst)
    try:
        for result in running:
            journal.record(result)
            results[result.entry.name] = result
            bar.update(result.entry.num_samples + len(result.skipped), result.payload_bytes)
            if on_progress is not None:
                on_progress(
                    sum(r.entry.num_samples for r in results.values()), sum(r.payload_bytes for r in results.values())
                )
    except KeyboardInterrupt as exc:
        _stop(running, dest)
        raise ConversionInterrupted(
            f"conversion into {dst} interrupted after {len(results)} of {len(tasks)} shards; "
            "run the same command with --resume to finish it"
        ) from exc
    except BaseException:
        _stop(running, dest)
        raise
    finally:
        bar.close()
    dest.clean_staging()  # what a worker killed mid-shard staged (its task ran again elsewhere)
    ordered = [results[name] for name in names]
    manifest = _manifest(source, fmt, options, ordered, problems, fingerprint)
    if base is not None:
        try:
            manifest = _appended(base, offset, manifest, source, fingerprint, dst)
        except ConfigError:
            _abandon_append(dest, journal, base)
            raise
    check_lock()  # a writer that lost its lock never publishes
    publish_manifest(dest, manifest)
    journal.finish()
    payload = sum(r.payload_bytes for r in ordered)
    warned = [w for r in ordered for w in r.warnings]
    return ConvertReport(manifest, 0.0, payload, scan.ignored, resumed=len(done), warnings=warned)


# -- appending ---------------------------------------------------------------------------


def _append_base(dest: Destination, dst: str, fmt: Format, options: ConvertOptions) -> tuple[Manifest, int]:
    """Return the dataset an append adds to and how many shards it has.

    The dataset is ``index.json`` as found, unless an append is under way there (its
    journal names ``base_shards``). Interrupted before publishing, that append left
    ``index.json`` as it was. Published but killed before its journal was removed, it
    left the dataset *with* its new shards: the base is then rebuilt from what the
    journal recorded of it (shards, skipped inputs, fields, classes and ``meta`` as they
    were), so that ``--append --resume`` plans the very same job and finds it complete.

    Raises:
        ConfigError: If there is no streamload dataset at ``dst``, it was indexed from
            another tool's shards, has another format or hash, or the journal of an
            interrupted append does not match it.
    """
    if dest.exists(MANIFEST_NAME) is None:
        raise ConfigError(f"{dst}: --append needs an existing dataset there (no index.json); convert without --append")
    try:
        manifest = Manifest.loads(dest.read_bytes(MANIFEST_NAME), f"{dst}/{MANIFEST_NAME}")
    except (StreamloadError, ValueError) as exc:
        raise ConfigError(f"{dst}/{MANIFEST_NAME}: not a streamload dataset to append to ({exc})") from exc
    if "indexed_by" in manifest.meta:
        raise ConfigError(f"{dst}: its shards were written by another tool (streamload index); --append refuses them")
    if manifest.format != fmt.name:
        raise ConfigError(
            f"{dst} holds {manifest.format} shards: --append writes the same format (use --format {manifest.format})"
        )
    if manifest.hash_algorithm is not None and manifest.hash_algorithm != options.hash_algorithm:
        algorithm = manifest.hash_algorithm
        raise ConfigError(f"{dst} uses the {algorithm} hash: append with --hash {algorithm}")
    if dest.exists(JOB_NAME) is None:
        return manifest, len(manifest.shards)
    try:
        job = json.loads(dest.read_bytes(JOB_NAME))
    except ValueError:
        job = {}
    base = job.get("base_shards") if isinstance(job, dict) else None
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base <= len(manifest.shards):
        return manifest, len(manifest.shards)  # another job's journal: Journal.open says what to do with it
    if base == len(manifest.shards):
        return manifest, base  # interrupted before publishing: index.json is the base itself
    return _base_before(manifest, job, base, dst), base


def _base_before(manifest: Manifest, job: dict[str, Any], shards: int, dst: str) -> Manifest:
    """The dataset before a published append whose journal ``job`` is still at ``dst``."""
    skipped, fields, classes, meta = (job.get(k) for k in ("base_skipped", "base_fields", "base_classes", "base_meta"))
    fine = (
        plan_of(manifest) == job.get("fingerprint")
        and isinstance(skipped, int)
        and not isinstance(skipped, bool)
        and 0 <= skipped <= len(manifest.skipped)
        and isinstance(fields, list)
        and all(isinstance(f, str) for f in fields)
        and isinstance(classes, list)
        and all(isinstance(c, str) for c in classes)
        and isinstance(meta, dict)
    )
    if not fine:
        raise ConfigError(
            f"{dst}: an append published its {len(manifest.shards) - shards} shards but {JOB_NAME} does not "
            "record the dataset it added to: the append cannot be resumed. Check the dataset "
            f"(streamload verify {dst}), then delete {dst}/{JOB_NAME} and its _done-* markers"
        )
    assert isinstance(skipped, int) and isinstance(meta, dict)  # for mypy: checked above
    return Manifest(
        format=manifest.format,
        shards=manifest.shards[:shards],
        fields=tuple(map(str, fields or ())),
        classes=tuple(map(str, classes or ())),
        hash_algorithm=manifest.hash_algorithm,
        skipped=manifest.skipped[:skipped],
        meta=meta,
    )


def _append_journal(base: Manifest) -> dict[str, Any]:
    """What an append's journal records of the dataset it adds to (see :func:`_append_base`)."""
    return {
        "base_shards": len(base.shards),
        "base_skipped": len(base.skipped),
        "base_fields": list(base.fields),
        "base_classes": list(base.classes),
        "base_meta": _printable_json(dict(base.meta)),
    }


def _check_appendable(
    source: Source, base: Manifest, dst: str, options: ConvertOptions, items: Sequence[Item] = ()
) -> None:
    """Refuse an append whose samples would not fit the dataset, before any shard is written.

    Labels must mean the same classes. The fields are checked on the first input that
    loads (the driver reads that one input): samples with other fields (a ``json`` of
    ``--keep-columns``, labels where the dataset has none, another image type) are
    refused here. :func:`_appended` checks the fields of every shard again before
    publishing.

    Raises:
        ConfigError: Naming both class lists, or both field sets.
    """
    if list(source.classes) != list(base.classes) and (source.classes or base.classes):
        raise ConfigError(
            f"{printable(source.describe())} has classes {_few(source.classes)} but {dst} has {_few(base.classes)}: "
            "appended labels would name other classes"
        )
    if not base.fields:
        return
    for item in items[:_PROBES]:
        try:
            sample = source.load(item)
        except (StreamloadError, UnicodeError):
            continue  # a broken input: its task reports it under --on-error
        fields = sorted(k for k in sample if not k.startswith("__"))
        if set(fields) != set(base.fields):
            raise ConfigError(
                f"{dst} has fields {_fields(base.fields)}; the appended samples have {_fields(fields)} "
                f"(first: {printable(source.origin(item))}): an appended dataset keeps the same fields. "
                "Nothing was written."
            )
        return


#: Inputs :func:`_check_appendable` tries to load to learn the appended fields.
_PROBES = 8


def _fields(names: Sequence[str]) -> str:
    return "{" + ", ".join(sorted(names)) + "}"


def _few(names: Sequence[str]) -> str:
    return "[" + ", ".join(map(repr, names[:5])) + (", ...]" if len(names) > 5 else "]") if names else "none"


def _keys_of(dst: str, options: ConvertOptions, shards: int | None = None) -> set[str]:
    """The keys of the dataset at ``dst`` (from its shards' indexes); only its first ``shards`` if given."""
    existing = DatasetSource(dst, options.storage_options)
    try:
        scan = existing.scan()
    finally:
        existing.close()
    count = len(existing.manifest.shards) if shards is None else shards
    mine = {entry.name for entry in existing.manifest.shards[:count]}
    problems = [p for p in scan.problems if p.path in mine]
    if problems:
        first = problems[0]
        raise ConfigError(f"{dst}/{first.path}: {first.error}: cannot check the appended keys against it")
    return {item.key for item in scan.items if isinstance(item, SampleItem) and item.shard < count}


def _drop_present(
    source: Source, items: Sequence[Item], present: set[str], dst: str
) -> tuple[Sequence[Item], list[SkippedInput]]:
    """Keep the items whose keys are not in the dataset yet; the others are problems."""
    keep = [item.key not in present for item in items]
    problems = [
        SkippedInput(printable(source.origin(item)), f"its key {printable(item.key)!r} is already in {dst}")
        for item, k in zip(items, keep, strict=True)
        if not k
    ]
    if all(keep):
        return items, problems
    return [item for item, k in zip(items, keep, strict=True) if k], problems


def _appended(base: Manifest, offset: int, new: Manifest, source: Source, fingerprint: str, dst: str) -> Manifest:
    """The base dataset's manifest with the new shards after its own, and the append recorded in ``meta``."""
    if base.fields and set(new.fields) != set(base.fields):
        raise ConfigError(
            f"{dst} has fields {_fields(base.fields)}; the appended samples have {_fields(new.fields)}: "
            "an appended dataset keeps the same fields (nothing was published; the shards written for it were "
            "removed)"
        )
    meta = dict(base.meta)
    appends = list(meta.get("appends") or [])
    appends.append(
        {
            "source": printable(source.describe()),
            "shards": len(new.shards),
            "samples": new.num_samples,
            "first_shard": new.shards[0].name if new.shards else None,
            "plan": fingerprint,
        }
    )
    meta["appends"] = appends
    converter = dict(meta.get("converter") or {})
    converter["plan"] = fingerprint  # what --resume compares: the latest job on this dataset
    meta["converter"] = converter
    return Manifest(
        format=base.format,
        shards=(*base.shards[:offset], *new.shards),
        fields=tuple(sorted(set(base.fields) | set(new.fields))),
        classes=base.classes or new.classes,
        hash_algorithm=base.hash_algorithm,
        skipped=(*base.skipped, *new.skipped),
        meta=meta,
    )


def _abandon_append(dest: Destination, journal: Journal, base: Manifest) -> None:
    """After a refused append: delete the shards it wrote and its journal; the dataset stays as it was.

    Files of the base dataset and of the published ``index.json`` are never deleted.
    """
    published = Manifest.loads(dest.read_bytes(MANIFEST_NAME), f"{dest.url}/{MANIFEST_NAME}")
    kept = {f.name for m in (base, published) for entry in m.shards for f in (entry, entry.sidecar) if f is not None}
    for name in journal.outputs:
        if name not in kept:
            dest.remove(name)
    dest.clean_staging()
    journal.finish()


def _stop(running: Iterator[ShardResult], dest: Destination) -> None:
    """After a failure: stop the workers (the pool is terminated), then delete what they staged."""
    close = getattr(running, "close", None)
    if close is not None:
        close()
    dest.clean_staging()


def _unique_keys(source: Source, items: Sequence[Item]) -> tuple[Sequence[Item], list[SkippedInput]]:
    """Keep the items whose keys are valid and unique; the others are problems naming both inputs."""
    first: dict[str, Item] = {}
    out: list[Item] = []
    problems: list[SkippedInput] = []
    for item in items:
        try:
            check_sample({"__key__": item.key})
        except (SampleError, UnicodeError) as exc:
            problems.append(SkippedInput(printable(source.origin(item)), f"unusable key: {printable(str(exc))}"))
            continue
        other = first.setdefault(item.key, item)
        if other is not item:
            problems.append(
                SkippedInput(
                    printable(source.origin(item)),
                    f"its key {printable(item.key)!r} is also the key of {printable(source.origin(other))}",
                )
            )
            continue
        out.append(item)
    return out, problems


# -- where the data is ------------------------------------------------------------------


def _check_paths(source: Source, dst: str) -> None:
    """Refuse destinations that would destroy the source or be read back as part of it."""
    if not dst:
        raise ConfigError("the destination is an empty string")
    if is_local(dst):
        path = local_path_of(dst)
        if not path:
            raise ConfigError(f"the destination {dst!r} names no directory")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(f"the destination {dst} exists and is not a directory")
    elif not _normal_url(dst).partition("://")[2]:
        raise ConfigError(f"the destination {dst!r} names no bucket or path")
    if isinstance(source, DatasetSource) and _same_place(source.url, dst):
        raise ConfigError(
            f"SRC {source.url} and DST {dst} are the same dataset: converting it in place would destroy its "
            "shards before the new ones exist. Convert into a new location, check it (streamload verify), "
            "then replace the old dataset with it."
        )
    if isinstance(source, ImageFolderSource) and is_local(dst):
        path = local_path_of(dst)
        for root in [source.root, *source.class_dirs()]:
            if _within(path, root):
                where = "" if root == source.root else f" (in its linked class folder {printable(root)})"
                raise ConfigError(
                    f"DST {dst} is inside the image folder {printable(source.root)}{where}: "
                    "the next conversion would read it back as a class or as images. Write it outside SRC."
                )


def _same_place(a: str, b: str) -> bool:
    """True if ``a`` and ``b`` name the same directory or URL prefix, however spelled."""
    if is_local(a) and is_local(b):
        pa, pb = local_path_of(a), local_path_of(b)
        try:
            return os.path.samefile(pa, pb)
        except OSError:
            return os.path.realpath(pa) == os.path.realpath(pb)
    if is_local(a) or is_local(b):
        return False
    return _normal_url(a) == _normal_url(b)


_PROTOCOL_ALIASES = {"s3a": "s3", "gcs": "gs", "abfss": "abfs"}


def _normal_url(url: str) -> str:
    protocol, _, rest = url.partition("://")
    protocol = protocol.lower()
    return f"{_PROTOCOL_ALIASES.get(protocol, protocol)}://{re.sub('/+', '/', rest).strip('/')}"


def _within(path: str, root: str) -> bool:
    """True if ``path`` is ``root`` or below it, through any symlink or bind mount of either."""
    try:
        top = os.stat(root)
    except OSError:
        return False
    current = os.path.realpath(path)
    while True:
        try:
            st = os.stat(current)
            if (st.st_dev, st.st_ino) == (top.st_dev, top.st_ino):
                return True
        except OSError:
            pass
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


def _scan_and_plan(
    source: Source,
    options: ConvertOptions,
    dst: str,
    appending: tuple[Callable[[Sequence[Item]], None], Callable[[], set[str]]] | None = None,
) -> tuple[ScanResult, list[tuple[int, Sequence[Item]]], list[SkippedInput]]:
    """Scan ``source`` and plan its shards; return the scan, the numbered shards and the clashing inputs.

    A listing table is scanned and cut in one streamed pass (:meth:`.TableSource.plan`):
    each shard is a compact row span and the driver holds O(shards), not O(rows) (a
    shuffled table keeps one array of its rows). Any other source is listed, checked for
    unique keys and cut by :func:`_plan`. ``appending`` is ``(check, keys)``: the check
    that the source may be appended (called after the scan with the first inputs: a
    table's first planned shard, or every listed item), and the keys already in the
    destination, whose items are left out as clashes.
    """
    check, keys = appending if appending is not None else (None, None)
    if isinstance(source, TableSource):
        present = keys() if keys is not None else None  # the scan leaves these rows out as it cuts
        limit = None if options.samples_per_shard is not None else options.max_shard_bytes()
        plan = source.plan(
            limit, options.samples_per_shard, shuffle=options.shuffle, seed=options.seed, present=present, dst=dst
        )
        if check is not None:
            check(plan.shards[0] if plan.shards else [])
        return ScanResult([], [], plan.problems), list(enumerate(plan.shards)), plan.present
    scan = source.scan()
    items, clashes = _unique_keys(source, scan.items)
    if check is not None and keys is not None:
        check(items)
        items, present_items = _drop_present(source, items, keys(), dst)
        clashes += present_items
    return scan, _plan(items, options), clashes


def _plan(scanned: Sequence[Item], options: ConvertOptions) -> list[tuple[int, Sequence[Item]]]:
    """Order the items (seeded shuffle) and cut them into numbered shards."""
    items = list(scanned)
    if options.shuffle:
        order = np.random.default_rng(options.seed).permutation(len(items))
        items = [items[i] for i in order]
    max_bytes = None if options.samples_per_shard is not None else options.max_shard_bytes()
    return list(enumerate(plan_shards(items, max_bytes, options.samples_per_shard)))


def _job(source: Source, options: ConvertOptions) -> dict[str, Any]:
    """What must not change between an interrupted run and its resume."""
    job: dict[str, Any] = {
        "source": source.describe(),
        "format": options.format,
        "hash": options.hash_algorithm,
        "on_error": options.on_error,
    }
    settings = source.settings()
    if settings:  # only when there are some: fingerprints of other sources stay as they were
        job["source_settings"] = settings
    content = getattr(source, "content_digest", None)
    digest = content() if content is not None else None
    if digest is not None:  # a table's content as its scan read it: a changed table is another plan
        job["source_content"] = digest
    return job


def _run_tasks(
    tasks: list[tuple[int, Sequence[Item]]],
    source: Source,
    fmt: Format,
    dest: Destination,
    options: ConvertOptions,
    dst: str,
) -> Iterator[ShardResult]:
    if parse_executor(options.executor)[0] != "local":
        yield from _run_elsewhere(tasks, source, fmt, dest, options, dst)
        return
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
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(source, fmt, dest, options, os.getpid()))
    except OSError as exc:
        raise ConfigError(f"cannot start {workers} conversion processes ({exc}); use fewer --workers") from exc
    with pool:
        yield from pool.imap(_write_task, tasks)


def _run_elsewhere(
    tasks: list[tuple[int, Sequence[Item]]],
    source: Source,
    fmt: Format,
    dest: Destination,
    options: ConvertOptions,
    dst: str,
) -> Iterator[ShardResult]:
    """Run the tasks on Dask or Ray: each writes its shard straight to ``dst``; check each shard's size here."""
    if not tasks:
        return
    executor = open_executor(options.executor, options.workers)
    assert executor is not None
    where = os.path.abspath(local_path_of(dst)) if is_local(dst) else dst  # workers may have another cwd
    job = ShardJob(source, fmt.name, where, dict(options.storage_options), options)
    try:
        for result in executor.run(job, tasks):
            if isinstance(result, Failed):
                raise result.error
            assert isinstance(result, ShardResult)
            for entry in (result.entry, result.entry.sidecar):
                if entry is not None and dest.exists(entry.name) != entry.num_bytes:
                    raise StorageError(
                        f"{dst}/{entry.name}: the {executor.name} task reported {entry.num_bytes} bytes, "
                        f"the destination holds {dest.exists(entry.name)}: is DST shared with the workers?"
                    )
            yield result
    finally:
        executor.close()


def _manifest(
    source: Source,
    fmt: Format,
    options: ConvertOptions,
    results: list[ShardResult],
    problems: list[SkippedInput],
    fingerprint: str,
) -> Manifest:
    fields: set[str] = set()
    skipped: list[SkippedInput] = list(problems)
    for r in results:
        fields |= r.fields
        skipped.extend(r.skipped)
    skipped = [SkippedInput(printable(s.path), printable(s.error)) for s in skipped]
    meta = {
        **_printable_json(source.meta()),
        "converter": {
            "shard_bytes": None if options.samples_per_shard else options.shard_bytes,
            "samples_per_shard": options.samples_per_shard,
            "shuffle": options.shuffle,
            "seed": options.seed if options.shuffle else None,
            "plan": fingerprint,  # what --resume compares to tell this very conversion complete
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


def _printable_json(value: Any) -> Any:
    """``value`` with every string :func:`~.source.printable` (a manifest is UTF-8)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): _printable_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable_json(v) for v in value]
    return value


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
