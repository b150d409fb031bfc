"""The ``streamload`` command line: ``convert``, ``info``, ``show``, ``verify``, ``index``, ``demo``, ``bench``.

Every subcommand is a ``_cmd_<name>`` function and an entry of :func:`build_parser`;
errors of the :class:`~streamload.StreamloadError` family print one line and exit 2.

Everything printed for a person (not ``--json``, which stays exact JSON with its control
characters escaped by JSON itself) goes through :func:`terminal_safe`: class names, keys,
paths, ``meta`` and error texts come from datasets others wrote, and an escape sequence
there must not reach the terminal (set its title, clear the screen, write the clipboard by
OSC 52, or forge a line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import ConversionInterrupted, StorageError, StreamloadError
from ._options import add_storage_option, parse_storage_options
from ._units import format_bytes

__all__ = ["build_parser", "main", "terminal_safe"]

#: What a terminal may act on: C0 and C1 controls (ESC, CSI, OSC, BEL, CR, newline...), DEL,
#: and the bidirectional overrides that reorder what is shown.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def terminal_safe(text: object) -> str:
    """Return ``str(text)`` with every character a terminal would act on written as an escape (ESC as x1b)."""

    def escape(match: re.Match[str]) -> str:
        code = ord(match.group())
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _UNSAFE.sub(escape, str(text))


def _say(*parts: object, file: Any = None) -> None:
    """``print`` for a person: each part made :func:`terminal_safe`."""
    print(*(terminal_safe(p) for p in parts), file=file)


class _SafeFormatter(logging.Formatter):
    """Log lines of a command made :func:`terminal_safe` (keys and paths in them come from datasets)."""

    def format(self, record: logging.LogRecord) -> str:
        return terminal_safe(super().format(record))


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``streamload`` command."""
    parser = argparse.ArgumentParser(
        prog="streamload", description="Shard image datasets and stream them into PyTorch."
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    p.add_argument(
        "--format", "-f", help="shard format: tar, lmdb or hdf5 (default: tar; with --append: the dataset's)"
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--shard-size", default="128MB", help="payload bytes per shard (default: 128MB)")
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
    p.add_argument("--hash", choices=("sha256", "xxh3_128"), default="sha256", help="shard hash")
    p.add_argument(
        "--check",
        choices=("decode", "header", "none"),
        default="decode",
        help="how image inputs are checked (default: decode at reduced size)",
    )
    p.add_argument(
        "--labels",
        choices=("auto", "folders", "none"),
        default="auto",
        help="image folders: labels from class sub-folders (folders), none (every image below SRC, no cls field), "
        "or auto: none for a flat folder of images, folders otherwise (default: auto)",
    )
    table = p.add_argument_group("listing tables (SRC is .parquet, .csv or .jsonl)")
    table.add_argument("--path-column", default="path", help="column of image paths or URLs (default: path)")
    table.add_argument(
        "--label-column",
        default="label",
        help="column of labels: class indices, or class names (sorted into indices); '' for none (default: label)",
    )
    table.add_argument(
        "--image-column",
        help="column of embedded image bytes ({bytes, path} struct or binary; found automatically in Parquet)",
    )
    table.add_argument("--keep-columns", default="", help="comma-separated columns kept in each sample's json field")
    table.add_argument(
        "--root",
        help="a directory or URL prefix that every path the table names must lie in (others are input problems)",
    )
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
    add_storage_option(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("info", help="summarise a dataset")
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    add_storage_option(p)
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("show", help="print one sample's fields (by key or index) and optionally write its image")
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument("sample", metavar="KEY_OR_INDEX", help="a sample key, or an index (negative counts from the end)")
    p.add_argument("--key", action="store_true", help="read KEY_OR_INDEX as a key even if it is a number")
    p.add_argument("--out", metavar="FILE", help="write the sample's image bytes (as stored) to FILE")
    p.add_argument("--cache-dir", help="for a URL: the shard cache (default: the usual cache)")
    add_storage_option(p)
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("verify", help="re-hash every shard and read every sample; exit 1 on any problem")
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument("--no-read", action="store_true", help="only check sizes and hashes")
    p.add_argument(
        "--decode",
        action="store_true",
        help="also decode every image (Pillow, full size): list the ones that do not decode and the "
        "library warnings of each, named by shard and key",
    )
    p.add_argument(
        "--cache-dir",
        help="for a URL: check the copies in this cache (default: the usual cache); a corrupt one is "
        "downloaded again and reported REPAIRED",
    )
    add_storage_option(p)
    p.set_defaults(func=_cmd_verify)

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
    p.add_argument("--hash", choices=("sha256", "xxh3_128"), default="sha256", help="shard hash")
    p.add_argument(
        "--output",
        metavar="DIR_OR_URL",
        help="parquet: write index.json and the sidecars here instead (the files are read in place from "
        "DIRECTORY, which is never written: for a read-only folder or someone else's bucket)",
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
    p.set_defaults(func=_cmd_index)

    p = sub.add_parser("demo", help="make a small image folder, convert it, and read it back")
    p.add_argument("--dir", help="working directory (default: a temporary one, removed after)")
    p.add_argument("--images", type=int, default=2000, help="number of images (default: 2000)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default: 2)")
    p.add_argument("--format", default="tar", help="shard format (default: tar)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DIR/images and DIR/shards-FORMAT even if the demo did not write them "
        "(its own output from an earlier run is always replaced)",
    )
    p.set_defaults(func=_cmd_demo)

    _add_optional_commands(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """Return the parser of subcommand ``command`` (``parser`` itself if there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser | None = action.choices.get(command)
            return found or parser
    return parser


def _add_optional_commands(sub: Any) -> None:
    """Subcommands that live in their own modules register themselves here."""
    try:
        from .bench import add_bench_parser
    except ImportError:  # pragma: no cover - bench module not present
        return
    add_bench_parser(sub)


def _version() -> str:
    from . import __version__

    return f"streamload {__version__}"


def _cmd_convert(args: argparse.Namespace) -> int:
    from streamload.converters import ConvertOptions, convert, open_source

    storage_options = parse_storage_options(args.storage_option)
    fmt = args.format
    if fmt is None:
        fmt = _load_manifest(args.dst, storage_options).format if args.append else "tar"
    options = ConvertOptions(
        format=fmt,
        shard_bytes=None if args.samples_per_shard else args.shard_size,
        samples_per_shard=args.samples_per_shard,
        workers=args.workers,
        shuffle=args.shuffle,
        seed=args.seed,
        on_error=args.on_error,
        hash_algorithm=args.hash,
        progress=args.progress,
        storage_options=storage_options,
        resume=args.resume,
        overwrite=args.overwrite,
        executor=args.executor,
        append=args.append,
    )
    try:
        source = open_source(
            args.src,
            options.storage_options,
            check=args.check,
            labels=args.labels,
            path_column=args.path_column,
            label_column=args.label_column,
            image_column=args.image_column,
            keep_columns=[c.strip() for c in args.keep_columns.split(",") if c.strip()],
            root=args.root,
        )
        report = convert(source, args.dst, options)
    except StreamloadError:
        raise
    except OSError as exc:  # the environment (disk, permissions, process limits): one line, no traceback
        raise StorageError(str(exc)) from exc
    _say(report.summary())
    for skipped in report.skipped:
        _say(f"  skipped {skipped.path}: {skipped.error}", file=sys.stderr)
    for warned in report.warnings:
        _say(f"  warning {warned.path}: {warned.error}", file=sys.stderr)
    return 0


def _load_manifest(url: str, storage_options: dict[str, Any]) -> Any:
    from .shards import DatasetRef, StorageConfig

    return DatasetRef.open(url, StorageConfig(storage_options=storage_options)).manifest


def _cmd_info(args: argparse.Namespace) -> int:
    manifest = _load_manifest(args.dataset, parse_storage_options(args.storage_option))
    if args.json:
        summary = {
            "url": args.dataset,
            "format": manifest.format,
            "num_samples": manifest.num_samples,
            "num_shards": len(manifest.shards),
            "num_bytes": manifest.num_bytes,
            "fields": list(manifest.fields),
            "classes": list(manifest.classes),
            "hash": manifest.hash_algorithm,
            "skipped": len(manifest.skipped),
            "appends": len(manifest.meta.get("appends") or []),
        }
        if manifest.data_root is not None:
            summary["data_root"] = manifest.data_root
        print(json.dumps(summary, indent=1))
        return 0
    counts = manifest.shard_counts or [0]
    _say(f"dataset   {args.dataset}")
    _say(f"format    {manifest.format}")
    if manifest.data_root is not None:
        _say(f"files in  {manifest.data_root} (read in place; the index and sidecars here)")
    _say(f"samples   {manifest.num_samples}")
    _say(f"shards    {len(manifest.shards)} (samples per shard: min {min(counts)}, max {max(counts)})")
    _say(f"size      {format_bytes(manifest.num_bytes)}")
    _say(f"fields    {', '.join(manifest.fields) or '-'}")
    classes = ", ".join(manifest.classes[:10]) + (" ..." if len(manifest.classes) > 10 else "")
    _say(f"classes   {len(manifest.classes)}: {classes or '-'}")
    _say(f"hash      {manifest.hash_algorithm or 'none'}")
    _say(f"skipped   {len(manifest.skipped)} inputs at conversion")
    appends = manifest.meta.get("appends") or []
    _say(f"appends   {len(appends)}" + (f" (last: {appends[-1].get('source')})" if appends else ""))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from .access import ShardedDataset
    from .sample import IMAGE_FIELDS, parse_label
    from .shards import StorageConfig

    storage = StorageConfig(storage_options=parse_storage_options(args.storage_option), cache_dir=args.cache_dir)
    ds = ShardedDataset(args.dataset, storage=storage)
    try:
        index = ds.index_of(args.sample) if args.key or not _is_int(args.sample) else int(args.sample)
        shard, local = ds.locate(index)
        sample = ds[index]
    except IndexError as exc:
        _say(f"streamload show: error: {exc}", file=sys.stderr)
        return 2
    finally:
        ds.close()
    index %= len(ds)
    _say(f"dataset   {args.dataset}")
    _say(f"sample    {index} of {len(ds)}: key {sample['__key__']!r} ({ds.manifest.shards[shard].name}, index {local})")
    image = None
    for name in sorted(k for k in sample if not k.startswith("__")):
        value = bytes(sample[name])
        detail = ""
        if name in ("cls", "cls2", "index"):
            try:
                label = parse_label(value)
                classes = ds.manifest.classes
                detail = f"label {label}" + (f" ({classes[label]})" if 0 <= label < len(classes) else "")
            except (ValueError, UnicodeDecodeError):
                detail = "not an integer label"
        elif name in IMAGE_FIELDS:
            detail = _image_summary(value)
            image = image or value
        elif name in ("txt", "text", "json"):
            text = value[:60].decode("utf-8", "replace")
            detail = repr(text) + (" ..." if len(value) > 60 else "")
        _say(f"field     {name:<8} {len(value):>9} bytes  {detail}".rstrip())
    if args.out:
        if image is None:
            _say(f"streamload show: error: sample {sample['__key__']!r} has no image field", file=sys.stderr)
            return 2
        with open(args.out, "wb") as f:
            f.write(image)
        _say(f"wrote     {args.out} ({format_bytes(len(image))})")
    return 0


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _image_summary(data: bytes) -> str:
    """``WxH MODE FORMAT`` from the image header (not decoded), or why it cannot be read."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return f"image {img.width}x{img.height} {img.mode} {img.format}"
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        return f"not a readable image ({exc})"


def _cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_dataset

    report = verify_dataset(
        args.dataset,
        parse_storage_options(args.storage_option),
        read_samples=not args.no_read,
        cache_dir=args.cache_dir,
        decode_images=args.decode and not args.no_read,
    )
    for _name, what in report.repaired:
        _say(f"REPAIRED {what}")
    for _name, problem in report.problems:
        _say(f"BAD  {problem}")
    for _name, warned in report.warnings:
        _say(f"WARN {warned}")
    if report.unhashed:
        shown = ", ".join(report.unhashed[:3]) + (", ..." if len(report.unhashed) > 3 else "")
        samples = "" if args.no_read else " (and their samples by their own checksums)"
        _say(
            f"NOTE {len(report.unhashed)} file(s) have no hash in the manifest ({shown}): "
            f"only their sizes were checked{samples}"
        )
    if not report.ok:
        status = f"FAILED: {len({name for name, _ in report.problems})} bad shard(s)"
    elif report.unhashed:
        status = f"NO HASH to check for {len(report.unhashed)} file(s), no other problem"
    else:
        status = "OK"
    decoded = f", {report.images_decoded} images decoded" if args.decode and not args.no_read else ""
    warned = f" ({len(report.warnings)} library warnings)" if report.warnings else ""
    _say(
        f"{status}: {report.shards_checked} shards, {report.samples_checked} samples checked{decoded} "
        f"in {args.dataset}{warned}"
    )
    return 0 if report.ok else 1


def _cmd_index(args: argparse.Namespace) -> int:
    classes = tuple(c for c in (args.classes or "").split(",") if c)
    try:
        manifest = _index(args, classes)
    except StreamloadError:
        raise
    except OSError as exc:  # the environment (disk, permissions): one line, no traceback
        raise StorageError(str(exc)) from exc
    written = args.output or (f"{args.directory.rstrip('/')}/{args.split}" if args.split else args.directory)
    skipped = f", {len(manifest.skipped)} bad rows skipped" if manifest.skipped else ""
    _say(f"indexed {len(manifest.shards)} shards, {manifest.num_samples} samples{skipped}; wrote {written}/index.json")
    for entry in manifest.skipped:
        _say(f"  skipped {entry.path}: {entry.error}", file=sys.stderr)
    return 0


def _index(args: argparse.Namespace, classes: tuple[str, ...]) -> Any:
    from .indexing import index_directory

    return index_directory(
        args.directory,
        args.format,
        args.hash,
        classes,
        storage_options=parse_storage_options(args.storage_option),
        match=args.match,
        image_column=args.image_column,
        label_column=args.label_column,
        output=args.output,
        overwrite=args.overwrite,
        split=args.split,
        on_error=args.on_error,
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.dir, args.images, args.workers, args.format, overwrite=args.overwrite)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would blame the top-level parser; the subcommand's usage is the useful one
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    func: Callable[[argparse.Namespace], int] = args.func
    logger = logging.getLogger("streamload")
    handler = None
    if not logger.handlers and not logging.getLogger().handlers:
        # Without one, Python's last-resort handler prints warnings raw.
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(_SafeFormatter("%(message)s"))
        logger.addHandler(handler)
    allowed = _allow_data_roots(getattr(args, "allow_data_root", None))
    try:
        return func(args)
    except ConversionInterrupted as exc:
        _say(f"streamload {args.command}: {exc}", file=sys.stderr)
        return 130
    except StreamloadError as exc:
        _say(f"streamload {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _say(f"streamload {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if handler is not None:
            logger.removeHandler(handler)
        allowed()


def _allow_data_roots(roots: list[str] | None) -> Callable[[], None]:
    """Name ``--allow-data-root`` URLs to every reader of this command; return what undoes it."""
    from .shards import ALLOW_DATA_ROOTS_ENV

    before = os.environ.get(ALLOW_DATA_ROOTS_ENV)
    if not roots:
        return lambda: None
    os.environ[ALLOW_DATA_ROOTS_ENV] = " ".join([before or "", *roots]).strip()

    def undo() -> None:
        if before is None:
            os.environ.pop(ALLOW_DATA_ROOTS_ENV, None)
        else:
            os.environ[ALLOW_DATA_ROOTS_ENV] = before

    return undo


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
