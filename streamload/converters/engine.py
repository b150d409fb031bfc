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

import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

from streamload import _env
from streamload._errors import (
    ConfigError,
    ConversionInterrupted,
    SampleError,
    SourceError,
    StorageError,
    StreamloadError,
)
from streamload._fork import alive
from streamload._redact import redact
from streamload.formats import Format, check_sample, get_format
from streamload.manifest import DEFAULT_HASH_ALGORITHM, Manifest, SkippedInput
from streamload.storage import Destination, LocalDestination, is_local, local_path_of
from streamload.storageconfig import StorageConfig
from streamload.writer import ShardResult, publish_manifest, write_shard

from .append import Appending
from .executors import TaskFailed, open_executor, parse_executor
from .images import WARNINGS_KEY
from .journal import Journal, plan_fingerprint
from .options import DEFAULT_SHARD_BYTES, MAX_WORKERS, ConvertOptions, ConvertReport
from .places import check_destination
from .planning import plan_shards
from .source import Item, PlanRequest, Source, SourcePlan, normalization_twins, printable, printable_json

__all__ = ["DEFAULT_SHARD_BYTES", "MAX_WORKERS", "ConvertOptions", "ConvertReport", "convert", "plan_shards"]


def _without_prefix(message: str, origin: str) -> str:
    """``message`` without a leading ``origin`` (a skipped input's path is recorded once).

    The message may name the input by a longer path ending in ``origin`` (its absolute
    path, where ``origin`` is relative to the source's root): that prefix goes too.
    """
    if message.startswith(origin) and message != origin:
        return message[len(origin) :].lstrip(": ") or message
    at = message.find("/" + origin + ": ")
    if origin and at >= 0 and ": " not in message[:at]:
        return message[at + len(origin) + 3 :] or message
    return message


# -- the worker side -------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _init_worker(source: Source, fmt: Format, dest: Destination, options: ConvertOptions, parent: int = 0) -> None:
    _STATE.update(source=source, fmt=fmt, dest=dest, options=options)
    if parent and sys.platform.startswith("linux"):
        # A worker dies with the conversion: killed, it must not go on writing shards
        # into a destination whose lock it never held. Its parent is the fork server,
        # which ends when the conversion does; checked after the call, as either may
        # have ended before it.
        import ctypes

        forked_by = os.getppid()
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != forked_by or not alive(parent):
            os._exit(1)


def _pool_context(source: Source) -> BaseContext:
    """The start method of the conversion's processes.

    On Linux, a fork server: not a plain fork, because the converting process may run
    other threads (an fsspec event loop and its resolver, a progress bar, the lock's
    refresher, the caller's own), and a fork copies the locks they hold at that instant
    into a child that never sees them released (a worker hung in its first lookup or
    allocation). The fork server is a fresh single-threaded process that imports this
    module once; every worker is forked from it, and the caller's script is not run again
    in it (see :func:`_main_hidden`). A source whose class is defined in the running
    script itself (``__main__``) exists nowhere else: its workers are forked, as before.
    Elsewhere, spawn.
    """
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    if type(source).__module__ == "__main__" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


@contextmanager
def _main_hidden(ctx: BaseContext) -> Iterator[None]:
    """While the fork server starts the workers, hide the caller's ``__main__`` from them.

    A process of a fork server or spawn runs the caller's main module again before its
    work (as ``__mp_main__``): a script without a ``__main__`` guard would convert again
    in every worker, and one read from standard input cannot be found at all. The
    workers run only this module's functions on objects of importable classes, so they
    are told of no main module.
    """
    if ctx.get_start_method() != "forkserver":
        yield
        return
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _write_task(task: tuple[int, Sequence[Item]]) -> ShardResult:
    return _write(_STATE["source"], _STATE["fmt"], _STATE["dest"], _STATE["options"], task)


@dataclass
class ShardJob:
    """A whole-shard task as sent to a Dask or Ray worker: it writes straight to the destination.

    Calling it with ``(index, items)`` writes shard ``index`` and returns its
    :class:`~streamload.writer.ShardResult`, or :class:`~.executors.TaskFailed` for an error
    of the input (returned, not raised, so the engine does not retry it).
    """

    source: Source
    format: str
    dst: str
    storage_options: dict[str, Any]
    options: ConvertOptions

    def __call__(self, task: tuple[int, Sequence[Item]]) -> ShardResult | TaskFailed:
        dest = StorageConfig(storage_options=self.storage_options).open_destination(self.dst)
        try:
            return _write(self.source, get_format(self.format), dest, self.options, task)
        except StreamloadError as exc:
            return TaskFailed(exc)
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
    check_destination(dst)  # names a place at all
    source.check_destination(dst)  # would not destroy the source or be read back as part of it
    try:
        dest = StorageConfig(storage_options=options.storage_options).open_destination(dst)
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
    appending = Appending(dest, dst, fmt, options, source) if options.append else None
    if options.hash_algorithm is None:  # the default: xxh3_128, or what the dataset appended to uses
        algorithm = appending.base.hash_algorithm if appending is not None else DEFAULT_HASH_ALGORITHM
        options = dataclasses.replace(options, hash_algorithm=algorithm)
    offset = appending.offset if appending is not None else 0
    plan = _scan_and_plan(source, options, dst, appending)
    problems = plan.problems
    if problems and options.on_error == "raise":
        first = problems[0]
        described = printable(source.describe())
        where = first.path if first.path.startswith(described) else f"{described}/{first.path}"
        raise SourceError(f"{where}: {first.error} (use on_error='skip' to go on)")
    total = sum(len(shard) for shard in plan.shards)
    if not total:
        raise SourceError(f"{printable(source.describe())}: nothing to convert: no readable input was found")
    tasks = [(offset + index, shard) for index, shard in enumerate(plan.shards)]
    names = [fmt.shard_name(index) for index, _ in tasks]
    sidecars = [fmt.sidecar_name(name) or name + ".idx" for name in names]
    job = _job(source, options)
    if appending is not None:
        job["append_to"] = appending.job()
    fingerprint = plan_fingerprint(job, tasks)
    extra = appending.journal_extra() if appending is not None else None
    journal = Journal(dest, fingerprint, names, [*names, *sidecars], append=appending is not None, extra=extra)
    state = journal.open(options.resume, options.overwrite, options.hash_algorithm)
    if state.complete is not None:
        journal.finish()
        return ConvertReport(state.complete, 0.0, 0, plan.ignored, len(state.complete.shards), already_complete=True)
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
    if appending is not None:
        manifest = appending.manifest(manifest, fingerprint, journal)
    check_lock()  # a writer that lost its lock never publishes
    publish_manifest(dest, manifest)
    journal.finish()
    payload = sum(r.payload_bytes for r in ordered)
    warned = [w for r in ordered for w in r.warnings]
    twins = normalization_twins(
        source, [item for shard in plan.shards for item in shard] if source.names_are_paths else []
    )
    return ConvertReport(manifest, 0.0, payload, plan.ignored, resumed=len(done), warnings=warned, twins=twins)


def _stop(running: Iterator[ShardResult], dest: Destination) -> None:
    """After a failure: stop the workers (the pool is terminated), then delete what they staged."""
    close = getattr(running, "close", None)
    if close is not None:
        close()
    dest.clean_staging()


def _scan_and_plan(source: Source, options: ConvertOptions, dst: str, appending: Appending | None = None) -> SourcePlan:
    """Ask ``source`` for its plan (:meth:`~.source.Source.make_plan`) under ``options``.

    Appending, the source checks its first inputs with ``appending.check`` and leaves out
    the inputs whose keys the dataset holds (``appending.keys``).
    """
    limit = None if options.samples_per_shard is not None else options.max_shard_bytes()
    request = PlanRequest(
        limit,
        options.samples_per_shard,
        shuffle=options.shuffle,
        seed=options.seed,
        dst=dst,
        check=appending.check if appending is not None else None,
        present=appending.keys if appending is not None else None,
    )
    return source.make_plan(request)


def _job(source: Source, options: ConvertOptions) -> dict[str, Any]:
    """What must not change between an interrupted run and its resume."""
    job: dict[str, Any] = {
        "source": redact(source.describe()),
        "format": options.format,
        "hash": options.hash_algorithm,
        "on_error": options.on_error,
    }
    settings = source.settings()
    if settings:  # only when there are some: fingerprints of other sources stay as they were
        job["source_settings"] = settings
    digest = source.content_digest()
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
    ctx = _pool_context(source)
    try:
        with _main_hidden(ctx):
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
    executor = open_executor(options.executor, options.workers, _env.ray_address())
    assert executor is not None
    where = os.path.abspath(local_path_of(dst)) if is_local(dst) else dst  # workers may have another cwd
    job = ShardJob(source, fmt.name, where, dict(options.storage_options), options)
    try:
        for result in executor.run(job, tasks):
            if isinstance(result, TaskFailed):
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
        **printable_json(source.meta()),
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


class _Progress:
    """A tqdm bar (samples/s, MB/s) on a terminal; silent otherwise."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty() and not _env.on_ci()
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
