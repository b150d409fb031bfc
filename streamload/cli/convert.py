"""``streamload convert SRC DST``: an image folder, a listing table or a dataset into shards.

The parsed arguments become the conversion's options in one place
(:func:`conversion_options`: every option whose ``dest`` is a
:class:`~streamload.converters.ConvertOptions` field) and the source's in another
(:func:`source_options`: only those given, each checked against what the kind of source
takes by :func:`~streamload.converters.open_source`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._errors import StorageError, StreamloadError
from .options import add_storage_option, config_from_cli
from .output import say

__all__ = ["add_parser", "conversion_options", "run", "source_options"]

#: The ``dest`` of the options that go to the source (left ``None`` when not given).
SOURCE_DESTS = ("check", "labels", "path_column", "label_column", "image_column", "keep_columns", "root")


def _columns(text: str) -> list[str]:
    """``--keep-columns``: comma-separated column names."""
    return [c.strip() for c in text.split(",") if c.strip()]


def add_parser(sub: Any) -> None:
    """Add ``convert`` to the subcommands ``sub``."""
    p = sub.add_parser(
        "convert",
        help="convert an image folder or a dataset into shards",
        epilog="DST must be new or empty (or hold a conversion to --resume or --overwrite), never SRC itself "
        "nor inside an image-folder SRC. One conversion at a time per DST: another one fails at once, naming "
        "the first (the lock is .streamload-lock in a directory, _streamload-lock.json under a URL prefix).",
    )
    p.add_argument(
        "src",
        help="image folder (ROOT/<class>/<image>, a directory or any fsspec URL), existing dataset (dir or URL), "
        "or listing table (.parquet, .csv, .jsonl)",
    )
    p.add_argument("dst", help="output directory or fsspec URL (s3://bucket/prefix, ...)")
    _add_shard_options(p)
    _add_input_options(p)
    _add_table_options(p)
    _add_again_options(p)
    add_storage_option(p)
    p.set_defaults(func=run)


def _add_shard_options(p: argparse.ArgumentParser) -> None:
    """What the shards are and how they are written."""
    p.add_argument(
        "--format", "-f", help="shard format: tar, lmdb or hdf5 (default: tar; with --append: the dataset's)"
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--shard-size",
        dest="shard_bytes",
        metavar="SHARD_SIZE",
        default="128MB",
        help="payload bytes per shard (default: 128MB)",
    )
    size.add_argument("--samples-per-shard", type=int, help="samples per shard (instead of --shard-size)")
    p.add_argument("--workers", "-j", type=int, default=1, help="conversion processes, 1 to 1024 (output is identical)")
    p.add_argument(
        "--executor",
        default="local",
        help="where shard tasks run: local (a process pool, default), dask, dask://HOST:PORT, ray, ray://HOST:PORT; "
        "the output is identical",
    )
    p.add_argument("--shuffle", action="store_true", help="shuffle the sample order before sharding")
    p.add_argument("--seed", type=int, default=0, help="seed for --shuffle (default: 0)")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="on a broken input: stop (raise) or skip it, listed in the manifest",
    )
    p.add_argument(
        "--hash",
        dest="hash_algorithm",
        choices=("xxh3_128", "sha256"),
        default=None,
        help="shard hash (default: xxh3_128; with --append, the dataset's own)",
    )


def _add_input_options(p: argparse.ArgumentParser) -> None:
    """How image inputs are checked and labelled."""
    p.add_argument(
        "--check",
        choices=("decode", "header", "none"),
        help="how image inputs are checked (default: decode at reduced size)",
    )
    p.add_argument(
        "--labels",
        choices=("auto", "folders", "none"),
        help="image folders: labels from class sub-folders (folders), none (every image below SRC, no cls field), "
        "or auto: none for a flat folder of images, folders otherwise (default: auto)",
    )


def _add_table_options(p: argparse.ArgumentParser) -> None:
    table = p.add_argument_group("listing tables (SRC is .parquet, .csv or .jsonl)")
    table.add_argument("--path-column", help="column of image paths or URLs (default: path)")
    table.add_argument(
        "--label-column",
        help="column of labels: class indices, or class names (sorted into indices); '' for none (default: label)",
    )
    table.add_argument(
        "--image-column",
        help="column of embedded image bytes ({bytes, path} struct or binary; found automatically in Parquet)",
    )
    table.add_argument("--keep-columns", type=_columns, help="comma-separated columns kept in each sample's json field")
    table.add_argument(
        "--root",
        help="a directory or URL prefix that every path the table names must lie in (others are input problems)",
    )


def _add_again_options(p: argparse.ArgumentParser) -> None:
    """A destination that already holds something; the progress bar."""
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted conversion, reusing the shards it wrote (checked by hash); "
        "nothing to do if DST already holds it, complete",
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset or interrupted conversion at DST; files streamload did not write are kept, "
        "never replaced",
    )
    p.add_argument(  # not in the group: `--append --resume` finishes an interrupted append
        "--append",
        action="store_true",
        help="add SRC's samples as new shards to the dataset at DST (same format and fields; a key already there "
        "is an error, or skipped with --on-error skip); index.json is replaced atomically; with --resume: "
        "finish an interrupted append",
    )
    prog = p.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None, help="force a progress bar")
    prog.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def conversion_options(args: argparse.Namespace) -> Any:
    """The :class:`~streamload.converters.ConvertOptions` of parsed ``convert`` arguments.

    Every option whose ``dest`` names a field is taken as it is; ``format`` defaults to
    ``tar`` (with ``--append``: the dataset's), a shard size counts only without
    ``--samples-per-shard``, and the ``-o`` options are parsed.
    """
    from .._fields import fields_from
    from ..converters import ConvertOptions
    from ..dataref import DatasetRef

    storage = config_from_cli(args)
    fmt = args.format
    if fmt is None:
        fmt = DatasetRef.open(args.dst, storage).manifest.format if args.append else "tar"
    shard_bytes = None if args.samples_per_shard else args.shard_bytes
    return fields_from(ConvertOptions, args, format=fmt, shard_bytes=shard_bytes, storage_options=storage.options)


def source_options(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The keywords of a source of ``kind``: the source options given, and ``--allow-data-root``.

    ``--check`` is left out for a source without image inputs to check (an existing
    dataset); any other option the kind does not take is passed on, for
    :func:`~streamload.converters.open_source` to refuse by name.
    """
    from ..converters import SOURCE_KEYWORDS

    chosen = {name: getattr(args, name) for name in SOURCE_DESTS if getattr(args, name) is not None}
    if "check" not in SOURCE_KEYWORDS[kind]:
        chosen.pop("check", None)
    if args.allow_data_root:
        chosen["allow_data_roots"] = config_from_cli(args).allow_data_roots
    return chosen


#: Files ignored, and normalization twins, named one by one after a conversion (the others counted).
_NAMED = 20


def run(args: argparse.Namespace) -> int:
    """Run ``streamload convert``; return the exit status."""
    from ..converters import convert, open_source, source_kind
    from ..converters.images import ignored_first

    options = conversion_options(args)
    try:
        kind = source_kind(args.src, options.storage_options)
        source = open_source(args.src, options.storage_options, **source_options(args, kind))
        report = convert(source, args.dst, options)
    except StreamloadError:
        raise
    except OSError as exc:  # the environment (disk, permissions, process limits): one line, no traceback
        raise StorageError(str(exc)) from exc
    say(report.summary())
    named, more = ignored_first(report.ignored, _NAMED)
    for ignored in named:
        say(f"  ignored {ignored.path}: {ignored.error}", file=sys.stderr)
    if more:
        say(f"  ... and {more} more non-input files ignored", file=sys.stderr)
    for skipped in report.skipped:
        say(f"  skipped {skipped.path}: {skipped.error}", file=sys.stderr)
    for warned in report.warnings:
        say(f"  warning {warned.path}: {warned.error}", file=sys.stderr)
    for twin in report.twins[:_NAMED]:
        say(f"  twin {twin.path} {twin.error}", file=sys.stderr)
    if len(report.twins) > _NAMED:
        say(f"  ... and {len(report.twins) - _NAMED} more Unicode normalization twins", file=sys.stderr)
    return 0
