"""The ``streamload`` command line: ``convert``, ``info``, ``show``, ``verify``, ``index``, ``demo``, ``bench``.

Every subcommand is a ``_cmd_<name>`` function and an entry of :func:`build_parser`;
errors of the :class:`~streamload.StreamloadError` family print one line and exit 2, and so
do errors of the environment (``OSError``: a full disk, a missing permission) and
``MemoryError``. A closed standard output (``streamload info DS | head -1``) ends the command
quietly with status 141 (128 + SIGPIPE, what a shell reports for a Unix tool that SIGPIPE
stopped), no traceback; whatever it still writes goes to ``/dev/null``.

Everything printed for a person (not ``--json``, which stays exact JSON with its control
characters escaped by JSON itself) goes through :func:`terminal_safe`: class names, keys,
paths, ``meta`` and error texts come from datasets others wrote, and an escape sequence
there must not reach the terminal (set its title, clear the screen, write the clipboard by
OSC 52, or forge a line), nor an invisible character hide in a name.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._errors import ConfigError, ConversionInterrupted, StorageError, StreamloadError
from ._options import add_storage_option, parse_storage_options
from ._units import counted, format_bytes

__all__ = ["EXIT_CLOSED_OUTPUT", "build_parser", "main", "terminal_safe"]

#: Exit status when the reader of the standard output went away: 128 + SIGPIPE, as shells report ``yes | head``.
EXIT_CLOSED_OUTPUT = 141

#: Unicode categories a terminal acts on or shows as nothing: controls (C0, C1, DEL), format
#: characters (bidirectional overrides and isolates, zero-width spaces and joiners, BOM, soft
#: hyphen), lone surrogates (undecodable file names) and the line and paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def terminal_safe(text: object) -> str:
    r"""Return ``str(text)`` with every character a terminal would act on, or show as nothing, escaped.

    Controls, bidirectional marks and overrides, zero-width and other invisible format
    characters, lone surrogates and line separators are written as Python escapes (ESC as
    ``\x1b``, a zero-width space as ``\u200b``); everything printable is kept.
    """
    out = str(text)
    if out.isprintable():  # the common case; non-printable is a superset of what is escaped
        return out
    return "".join(_escape(c) if unicodedata.category(c) in _UNSAFE_CATEGORIES else c for c in out)


def _form(name: str) -> str:
    """The Unicode normalization form ``name`` is written in: NFC, NFD or mixed."""
    if unicodedata.is_normalized("NFC", name):
        return "NFC"
    return "NFD" if unicodedata.is_normalized("NFD", name) else "mixed"


def _twin_marks(names: Sequence[str]) -> dict[int, str]:
    """Return ``{position: "[NFC twin]"...}`` for the names that differ from another only in Unicode normalization.

    ``"café"`` written with a precomposed ``é`` (NFC) and with ``e`` + a combining accent
    (NFD) look identical but are different names (two classes, two keys).
    """
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(unicodedata.normalize("NFC", name), []).append(i)
    return {i: f"[{_form(names[i])} twin]" for group in groups.values() if len(group) > 1 for i in group}


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
    p.add_argument(
        "--hash",
        choices=("xxh3_128", "sha256"),
        default=None,
        help="shard hash (default: xxh3_128; with --append, the dataset's own)",
    )
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

    p = sub.add_parser(
        "info",
        help="summarise a dataset",
        epilog="Reads index.json only: for a URL through a throw-away folder, so nothing is kept in the shard "
        "cache. Invisible and control characters in names are shown escaped (a zero-width space as \\u200b); "
        "class names that differ only in Unicode normalization are marked [NFC twin] and [NFD twin].",
    )
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    add_storage_option(p)
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser(
        "show",
        help="print one sample's fields (by key or index) and optionally write its image",
        epilog="For a URL, the sample's shard is downloaded into the cache (a key lookup also keeps the "
        "dataset's key index there); how much was written, and where, is said on stderr.",
    )
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument("sample", metavar="KEY_OR_INDEX", help="a sample key, or an index (negative counts from the end)")
    p.add_argument("--key", action="store_true", help="read KEY_OR_INDEX as a key even if it is a number")
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the sample's image bytes (as stored) to FILE; a FILE inside the dataset, one of its files "
        "(or a link to it) or its cache is refused",
    )
    p.add_argument("--cache-dir", help="for a URL: the shard cache (default: the usual cache)")
    add_storage_option(p)
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser(
        "verify",
        help="re-hash every shard and read every sample; exit 1 on any problem",
        epilog="A URL's shards are checked through the cache (as training reads them); how much was written "
        "there, and where, is said on stderr before the result line.",
    )
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
    p.add_argument("--hash", choices=("xxh3_128", "sha256"), default="xxh3_128", help="shard hash (default: xxh3_128)")
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
    p.add_argument(
        "--images",
        type=int,
        default=2000,
        help="number of images, 10 to 100000, rounded down to whole classes of the 10 (default: 2000)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="DataLoader workers (default: 2; up to 8 per CPU or 64, whichever is larger, within ulimit -n)",
    )
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
    import shutil
    import tempfile

    from .shards import DatasetRef, StorageConfig

    storage_options = parse_storage_options(args.storage_option)
    # Only index.json is read: a URL's manifest (or the files of a data_root on one) goes
    # through a throw-away cache, so that `info` leaves nothing behind in the shard cache.
    scratch = tempfile.mkdtemp(prefix="streamload-info-")
    try:
        config = StorageConfig(storage_options=storage_options, cache_dir=scratch, cache_limit="unbounded")
        manifest = DatasetRef.open(args.dataset, config).manifest
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
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
    names = list(manifest.classes)
    twins = _twin_marks(names)
    shown = [f"{name} {twins[i]}" if i in twins else name for i, name in enumerate(names[:10])]
    classes = ", ".join(shown) + (" ..." if len(names) > 10 else "")
    _say(f"classes   {len(names)}: {classes or '-'}")
    if twins:
        _say(
            f"note      {counted(len(twins), 'class name')} look identical to another but differ in Unicode "
            "normalization (marked NFC/NFD twin): they are different classes"
        )
    _say(f"hash      {manifest.hash_algorithm or 'none'}")
    _say(f"skipped   {counted(len(manifest.skipped), 'input')} at conversion")
    appends = manifest.meta.get("appends") or []
    _say(f"appends   {len(appends)}" + (f" (last: {appends[-1].get('source')})" if appends else ""))
    return 0


def _data_root_of(url: str, storage_options: dict[str, Any]) -> str | None:
    """The ``data_root`` the manifest at ``url`` names, if any, without validating a local manifest twice.

    A local ``index.json`` is only searched for the field (validating a manifest of many
    shards takes seconds, and ``verify`` does it anyway); a remote one is loaded.
    """
    from .manifest import MANIFEST_NAME
    from .storage import is_local, local_path_of

    if not is_local(url):
        return _load_manifest(url, storage_options).data_root  # type: ignore[no-any-return]
    try:
        with open(os.path.join(local_path_of(url), MANIFEST_NAME), "rb") as f:
            raw = f.read()
        if b'"data_root"' not in raw:
            return None
        root = json.loads(raw).get("data_root")
    except (OSError, ValueError, AttributeError):
        return None  # verify says what is wrong with it
    return root if isinstance(root, str) else None


def _cache_dirs(url: str, data_root: str | None, storage_options: dict[str, Any], cache_dir: str | None) -> list[str]:
    """The shard-cache folders of a dataset (its URL's, its ``data_root``'s), and the key indexes' folder."""
    from .storage import is_local
    from .storage.cachedir import dataset_cache_key, default_cache_dir

    base = os.path.expanduser(cache_dir if cache_dir is not None else default_cache_dir())
    remote = [u for u in (url, data_root) if u is not None and not is_local(u)]
    return [os.path.join(base, dataset_cache_key(u, storage_options)) for u in remote] + [os.path.join(base, "keys")]


def _tree_bytes(folders: Iterable[str]) -> int:
    """Bytes of the regular files below ``folders`` (links not followed; a file linked twice counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = list(folders)
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
            except OSError:
                continue
    return total


class _CacheUse:
    """What a command wrote into the shard cache, measured before and after; said on stderr."""

    def __init__(self, command: str, folders: list[str], remote: bool) -> None:
        self.command, self.folders, self.remote = command, folders, remote
        self.before = _tree_bytes(folders)

    def report(self) -> None:
        """Say where the cache is and how much this command wrote there (if it is remote or wrote anything)."""
        after = _tree_bytes(self.folders)
        written = max(after - self.before, 0)
        if not (self.remote or written):
            return
        used = [f for f in self.folders if os.path.isdir(f)] or self.folders[:1]
        _say(
            f"streamload {self.command}: {format_bytes(written)} written to the cache "
            f"{', '.join(used)} ({format_bytes(after)} there now; --cache-dir DIR puts it elsewhere, "
            "deleting the folder frees it)",
            file=sys.stderr,
        )


def _check_out(out: str, ds: Any, folders: list[str]) -> None:
    """Refuse an ``--out`` that is a directory or lies in the dataset (its folders, files or cached copies).

    Raises:
        ConfigError: Naming ``out`` and what it would overwrite.
    """
    from .manifest import MANIFEST_NAME
    from .storage import is_local, local_path_of

    if os.path.isdir(out):
        raise ConfigError(f"--out {out} is a directory: name the file to write the image to")
    manifest = ds.manifest
    local = [local_path_of(u) for u in (ds.source, manifest.data_root) if u is not None and is_local(u)]
    target = os.path.realpath(out)
    for folder in [*local, *folders]:
        real = os.path.realpath(folder)
        if target == real or target.startswith(real.rstrip(os.sep) + os.sep):
            what = "the dataset" if folder in local else "the shard cache of"
            raise ConfigError(
                f"--out {out} lies inside {what} {ds.source} ({real}): writing there would change it; "
                "choose a file outside it"
            )
    if not os.path.exists(out):
        return
    mine = os.stat(out)
    names = [MANIFEST_NAME] + [f.name for entry in manifest.shards for f in (entry, entry.sidecar) if f is not None]
    for folder in local:
        for name in names:
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                raise ConfigError(
                    f"--out {out} is the dataset's {name} (a hard link to it): writing there would change the dataset"
                )


def _write_out(out: str, data: bytes) -> None:
    """Write ``data`` to ``out``; an error of the system is one line naming the file."""
    try:
        with open(out, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise StorageError(f"cannot write --out {out}: {exc.strerror or exc}") from exc


def _cmd_show(args: argparse.Namespace) -> int:
    from .access import ShardedDataset
    from .sample import IMAGE_FIELDS, parse_label
    from .shards import StorageConfig
    from .storage import is_local

    storage_options = parse_storage_options(args.storage_option)
    storage = StorageConfig(storage_options=storage_options, cache_dir=args.cache_dir)
    ds = ShardedDataset(args.dataset, storage=storage)
    data_root = ds.manifest.data_root
    folders = _cache_dirs(args.dataset, data_root, storage_options, args.cache_dir)
    remote = not (is_local(args.dataset) and (data_root is None or is_local(data_root)))
    try:
        if args.out:
            _check_out(args.out, ds, folders)
        cache = _CacheUse("show", folders, remote)
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
    twins = _twin_marks(list(ds.manifest.classes))
    for name in sorted(k for k in sample if not k.startswith("__")):
        value = bytes(sample[name])
        detail = ""
        if name in ("cls", "cls2", "index"):
            try:
                label = parse_label(value)
                classes = ds.manifest.classes
                twin = f" {twins[label]}" if label in twins else ""
                detail = f"label {label}" + (f" ({classes[label]}{twin})" if 0 <= label < len(classes) else "")
            except (ValueError, UnicodeDecodeError):
                detail = "not an integer label"
        elif name in IMAGE_FIELDS:
            detail = _image_summary(value)
            image = image or value
        elif name in ("txt", "text", "json"):
            text = value[:60].decode("utf-8", "replace")
            detail = repr(text) + (" ..." if len(value) > 60 else "")
        unit = "byte " if len(value) == 1 else "bytes"
        _say(f"field     {name:<8} {len(value):>9} {unit}  {detail}".rstrip())
    if args.out:
        if image is None:
            _say(f"streamload show: error: sample {sample['__key__']!r} has no image field", file=sys.stderr)
            return 2
        _write_out(args.out, image)
        _say(f"wrote     {args.out} ({format_bytes(len(image))})")
    cache.report()
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
    from .storage import is_local
    from .verify import verify_dataset

    storage_options = parse_storage_options(args.storage_option)
    data_root = _data_root_of(args.dataset, storage_options)
    folders = _cache_dirs(args.dataset, data_root, storage_options, args.cache_dir)
    cache = _CacheUse("verify", folders[:-1], any(not is_local(u) for u in (args.dataset, data_root) if u))
    report = verify_dataset(
        args.dataset,
        storage_options,
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
    unhashed = len(report.unhashed)
    if unhashed:
        shown = ", ".join(report.unhashed[:3]) + (", ..." if unhashed > 3 else "")
        samples = "" if args.no_read else f" (and {'its' if unhashed == 1 else 'their'} samples by their own checksums)"
        _say(
            f"NOTE {counted(unhashed, 'file')} {'has' if unhashed == 1 else 'have'} no hash in the manifest "
            f"({shown}): only {'its size was' if unhashed == 1 else 'their sizes were'} checked{samples}"
        )
    if not report.ok:
        status = f"FAILED: {counted(len({name for name, _ in report.problems}), 'bad shard')}"
    elif unhashed:
        status = f"NO HASH to check for {counted(unhashed, 'file')}, no other problem"
    else:
        status = "OK"
    cache.report()
    decoded = f", {counted(report.images_decoded, 'image')} decoded" if args.decode and not args.no_read else ""
    warned = f" ({counted(len(report.warnings), 'library warning')})" if report.warnings else ""
    checked = f"{counted(report.shards_checked, 'shard')}, {counted(report.samples_checked, 'sample')}"
    _say(f"{status}: {checked} checked{decoded} in {args.dataset}{warned}")
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


#: Options and arguments that name a file or folder, by ``dest``: an empty one is refused (``''`` would
#: name the root: ``info ''`` read ``/index.json``).
_PATH_DESTS = ("dataset", "src", "dst", "directory", "dir", "out", "output", "cache_dir", "plot")


def _empty_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The error for an argument that names a file or folder by the empty string, else ``None``."""
    sub = _subparser(parser, args.command)
    for action in sub._actions:
        if action.dest in _PATH_DESTS and getattr(args, action.dest, None) == "":
            name = "/".join(action.option_strings) or action.metavar or action.dest
            return f"argument {name}: an empty path names no file or folder"
    return None


def _reader_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe or socket whose reading end was closed (``| head`` exited)."""
    import select

    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    if not hasattr(select, "poll"):  # pragma: no cover - not a Unix
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    try:
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))
    except OSError:  # pragma: no cover
        return False


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s descriptor at ``/dev/null``: what is still written or flushed (at exit too) is dropped."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    A closed standard output (its reader exited, as ``head`` does) ends the command with
    :data:`EXIT_CLOSED_OUTPUT` and no traceback, as the Python documentation recommends
    for ``SIGPIPE``: the rest of the output is sent to ``/dev/null``.
    """
    try:
        try:
            return _main(argv)
        except SystemExit as exc:  # --help and --version: argparse itself drops a failed write
            if exc.code == 0 and _reader_gone(sys.stdout):
                raise BrokenPipeError(errno.EPIPE, "the standard output was closed") from None
            raise
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not at exit as "Exception ignored"
    except BrokenPipeError as exc:
        gone = [stream for stream in (sys.stdout, sys.stderr) if _reader_gone(stream)]
        if not gone:  # another pipe or socket broke, not ours
            _say(f"streamload: error: {exc}", file=sys.stderr)
            return 2
        for stream in gone:
            _to_devnull(stream)
        return EXIT_CLOSED_OUTPUT
    except OSError as exc:  # the standard output cannot take what was written (`> /dev/full`)
        try:
            _to_devnull(sys.stdout)  # else Python's flush at exit fails again, with a traceback
        except (AttributeError, OSError, ValueError):
            pass
        _say(f"streamload: error: cannot write the standard output: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would blame the top-level parser; the subcommand's usage is the useful one
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    empty = _empty_path(parser, args)
    if empty is not None:
        _say(f"streamload {args.command}: error: {empty}", file=sys.stderr)
        return 2
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
    except BrokenPipeError:
        raise  # main() tells a closed stdout from another broken pipe
    except OSError as exc:  # the environment (disk, permissions, process limits): one line, no traceback
        _say(f"streamload {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        _say(f"streamload {args.command}: error: out of memory {exc}".rstrip(), file=sys.stderr)
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
