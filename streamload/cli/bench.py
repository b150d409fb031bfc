"""``streamload bench DATASET``: the command line of the DataLoader sweep (:mod:`streamload.bench`)."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict
from typing import Any

from .._errors import ConfigError
from .._redact import redact
from .._units import counted, format_bytes
from .._validate import check_number, loader_worker_limit
from ..bench import (
    BACKENDS,
    HEADER,
    MAX_BATCH,
    MAX_PREFETCH,
    MAX_SIZE,
    MODES,
    BenchResult,
    check_plot,
    plateau,
    plot,
    recommend,
    sweep,
)
from .options import add_storage_option, config_from_cli

__all__ = ["add_parser", "run_bench"]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from exc


def _default_workers() -> str:
    cpus = os.cpu_count() or 1
    counts = {0, 1, cpus}
    n = 2
    while n < cpus:
        counts.add(n)
        n *= 2
    return ",".join(str(c) for c in sorted(counts))


def add_parser(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to the ``streamload`` command line."""
    p = subparsers.add_parser(
        "bench",
        help="sweep DataLoader settings on a dataset; recommend one",
        epilog="Every number is checked before a worker starts: the time per setting must be positive and "
        "finite; worker counts 0 to 8 per CPU or 64, whichever is larger (at most 1024, within ulimit -n); "
        f"prefetch factors 1 to {MAX_PREFETCH}; batch sizes 1 to {MAX_BATCH}; image sizes 1 to {MAX_SIZE}; "
        "and the batches in flight must fit in half of the memory.",
    )
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="raw",
        help="raw: zero-copy encoded batches; decode: decoded images; samples: per-sample dicts",
    )
    p.add_argument("--workers", default=_default_workers(), help="num_workers values (default: %(default)s)")
    p.add_argument("--prefetch", default="2", help="prefetch_factor values (default: 2)")
    p.add_argument("--pin-memory", choices=("off", "on", "both"), default="off", help="pin_memory (default: off)")
    p.add_argument("--batch-size", default="256", help="batch sizes (default: 256)")
    p.add_argument("--size", type=int, default=224, help="decode mode: output size (default: 224)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="decode mode: JPEG decoder (default: auto, simplejpeg when installed, else pillow); "
        "JPEGs simplejpeg refuses are decoded by Pillow and counted",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="reading time per setting (default: 5)")
    p.add_argument("--cache-dir", help="local cache directory for remote shards")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw samples/s against workers into an image (.png, .svg, .pdf...; needs matplotlib); the file "
        "name and its folder are checked before measuring",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    add_storage_option(p)
    p.set_defaults(func=_run)


def _checked(args: argparse.Namespace) -> tuple[list[int], list[int], list[int]]:
    """Check every number of parsed ``bench`` arguments before anything starts; return the three lists.

    Returns:
        The ``--workers``, ``--prefetch`` and ``--batch-size`` values.

    Raises:
        ConfigError: Naming the option and the value: a time not positive and finite, a
            list without values, a count out of its range (workers up to what
            :func:`~streamload._validate.loader_worker_limit` allows), or batches that
            would take more than half of this machine's memory at once.
    """
    seconds = float(args.seconds)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"--seconds {seconds:g} must be a positive, finite number of seconds")
    lists = {}
    for option, text in (("--workers", args.workers), ("--prefetch", args.prefetch), ("--batch-size", args.batch_size)):
        values = _ints(text)
        if not values:
            raise ConfigError(f"{option} {text!r} names no value: give one or more, comma-separated")
        lists[option] = values
    for value in lists["--prefetch"]:
        check_number("--prefetch", value, 1, MAX_PREFETCH)
    limit, why = loader_worker_limit(max(lists["--prefetch"]))
    for value in lists["--workers"]:
        check_number("--workers", value, 0, limit, why)
    for value in lists["--batch-size"]:
        check_number("--batch-size", value, 1, MAX_BATCH)
    check_number("--size", args.size, 1, MAX_SIZE)
    return lists["--workers"], lists["--prefetch"], lists["--batch-size"]


def _check_memory(
    args: argparse.Namespace, workers: list[int], prefetch: list[int], batch_sizes: list[int], storage: Any
) -> None:
    """Refuse a sweep whose batches in flight would take more than half of this machine's memory.

    A batch is ``batch x size x size x 3`` bytes decoded, or ``batch`` times the dataset's
    mean sample size encoded; ``workers x prefetch`` of them are in flight, and two more
    in the main process.
    """
    import psutil

    from ..dataref import DatasetRef

    if args.mode == "decode":
        per_sample = 3 * args.size * args.size
        what = f"{args.size}x{args.size} RGB images"
    else:
        manifest = DatasetRef.open(args.dataset, storage).manifest
        per_sample = manifest.num_bytes // max(manifest.num_samples, 1)
        what = f"samples of {format_bytes(per_sample)} on average"
    need = max(batch_sizes) * per_sample * (max(workers) * max(prefetch) + 2)
    have = psutil.virtual_memory().total
    if need > have // 2:
        raise ConfigError(
            f"batches of {max(batch_sizes)} {what}, {max(workers) * max(prefetch) + 2} at once, would take "
            f"{format_bytes(need)}: more than half of this machine's memory ({format_bytes(have)}); "
            "lower --batch-size, --size, --workers or --prefetch"
        )


def run_bench(args: argparse.Namespace) -> list[BenchResult]:
    """Run the sweep described by parsed ``bench`` arguments; print the table and advice.

    Every number is checked first (:func:`_checked`), before a worker starts.
    """
    workers, prefetch, batch_sizes = _checked(args)
    if args.plot:
        check_plot(args.plot)  # before measuring: a plot that cannot be written fails now, not after the sweep
    storage = config_from_cli(args, cache_dir=args.cache_dir)
    _check_memory(args, workers, prefetch, batch_sizes, storage)
    pins = {"off": [False], "on": [True], "both": [False, True]}[args.pin_memory]
    quiet = bool(args.json)
    if not quiet:
        mode = args.mode if args.mode != "decode" else f"decode ({_backend_name(args.backend)})"
        print(
            f"streamload bench {redact(args.dataset)}: mode {mode}, {args.seconds:g} s per setting, "
            f"{counted(os.cpu_count() or 1, 'CPU')}"
        )
        print(HEADER)
    results = sweep(
        args.dataset,
        args.mode,
        workers,
        prefetch,
        pins,
        batch_sizes,
        args.size,
        args.seconds,
        progress=not quiet,
        backend=args.backend,
        storage=storage,
    )
    best = recommend(results)
    flat = plateau(results)
    if quiet:
        print(
            json.dumps(
                {"results": [asdict(r) for r in results], "recommended": asdict(best), "plateau_workers": flat},
                indent=1,
            )
        )
    else:
        fallbacks = sum(r.fallbacks for r in results)
        if fallbacks:
            print(
                f"{fallbacks} JPEG decodes fell back to Pillow (simplejpeg refused those files); "
                "their time is in the rates above"
            )
        tried = sorted({r.workers for r in results})
        if len(tried) < 2:  # one worker count: no trend to tell
            print(
                f"one num_workers value tried ({tried[0]}): give several (e.g. --workers 0,2,4,8) "
                "to see where throughput stops growing"
            )
        elif flat is not None:
            print(f"throughput stops growing at num_workers={flat} (the next step adds < 5 %)")
        else:
            print("throughput still grows at the largest num_workers tried")
        pf = "" if best.prefetch_factor is None else f", prefetch_factor={best.prefetch_factor}"
        print(
            f"recommended: DataLoader(num_workers={best.workers}{pf}, pin_memory={best.pin_memory}) with "
            f"batch_size={best.batch_size}: {best.samples_per_s:.0f} samples/s, peak {format_bytes(best.peak_pss)}"
        )
        if best.stages:
            total = sum(best.stages.values())
            split = ", ".join(
                f"{name} {100 * seconds / total:.0f} %" for name, seconds in best.stages.items() if total > 0
            )
            print(f"where its readers' time goes: {split} (streamload.watch stages; see docs/waiting.md)")
    if args.plot:
        plot(results, args.plot, f"streamload bench ({args.mode}): {os.path.basename(args.dataset.rstrip('/'))}")
        if not quiet:
            print(f"plot written to {args.plot}")
    return results


def _backend_name(backend: str) -> str:
    """``auto`` resolved: the JPEG decoder that runs."""
    from ..decode.image import have_simplejpeg

    if backend != "auto":
        return f"{backend} backend"
    return f"auto backend: {'simplejpeg' if have_simplejpeg() else 'pillow'}"


def _run(args: argparse.Namespace) -> int:
    run_bench(args)
    return 0
