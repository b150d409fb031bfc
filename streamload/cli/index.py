"""``streamload index DIRECTORY``: ``index.json`` for tar shards or Parquet files written by other tools."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._errors import StorageError, StreamloadError
from .._units import counted
from .options import add_storage_option, parse_storage_options
from .output import say

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``index`` to the subcommands ``sub``."""
    p = sub.add_parser("index", help="write index.json for tar shards or Parquet files written by other tools")
    p.add_argument("directory", help="directory (or URL) holding *.tar shards (or *.parquet files)")
    p.add_argument("--format", default="tar", help="shard format: tar or parquet (default: tar)")
    p.add_argument("--classes", help="comma-separated class names to record")
    p.add_argument("--match", help="only the files whose names match this glob (e.g. 'train-*.parquet')")
    p.add_argument("--image-column", help="parquet: the image column (default: found from the schema)")
    p.add_argument(
        "--label-column",
        help="parquet: the label column, integers or class names (default: label, or the Hugging Face "
        "ClassLabel; '' for none)",
    )
    p.add_argument("--hash", choices=("xxh3_128", "sha256"), default="xxh3_128", help="shard hash (default: xxh3_128)")
    p.add_argument(
        "--output",
        metavar="DIR_OR_URL",
        help="write index.json and the sidecars here instead (the tar or parquet files are read in place from "
        "DIRECTORY, which is never written: for a read-only folder, someone else's bucket, or a folder "
        "holding another tool's index.json)",
    )
    p.add_argument(
        "--split",
        metavar="NAME",
        help="parquet: index one split of a folder holding several (train-*.parquet, test-*.parquet): the files "
        "matching NAME-* (or --match) into the sub-folder DIRECTORY/NAME (or --output), read as a dataset of "
        "its own; one per split, side by side",
    )
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="parquet: on a bad row (no image bytes, not an image, a bad label): stop (raise) or leave it out, "
        "listed in the manifest (skip)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an index.json that streamload index wrote (never a converted dataset's or anyone else's)",
    )
    add_storage_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``streamload index``; return the exit status."""
    classes = tuple(c for c in (args.classes or "").split(",") if c)
    try:
        manifest = _index(args, classes)
    except StreamloadError:
        raise
    except OSError as exc:  # the environment (disk, permissions): one line, no traceback
        raise StorageError(str(exc)) from exc
    written = args.output or (f"{args.directory.rstrip('/')}/{args.split}" if args.split else args.directory)
    skipped = f", {counted(len(manifest.skipped), 'bad row')} skipped" if manifest.skipped else ""
    counts = f"{counted(len(manifest.shards), 'shard')}, {counted(manifest.num_samples, 'sample')}"
    say(f"indexed {counts}{skipped}; wrote {written}/index.json")
    for entry in manifest.skipped:
        say(f"  skipped {entry.path}: {entry.error}", file=sys.stderr)
    return 0


#: The options passed to :func:`~streamload.indexing.index_directory` as the keywords of their names.
_KEYWORDS = ("match", "image_column", "label_column", "output", "overwrite", "split", "on_error")


def _index(args: argparse.Namespace, classes: tuple[str, ...]) -> Any:
    from ..indexing import index_directory

    keywords = {name: getattr(args, name) for name in _KEYWORDS}
    storage_options = parse_storage_options(args.storage_option)
    return index_directory(args.directory, args.format, args.hash, classes, storage_options=storage_options, **keywords)
