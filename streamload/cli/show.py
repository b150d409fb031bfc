"""``streamload show DATASET KEY_OR_INDEX``: one sample's fields, and its image written to a file."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._classes import shown as short
from .._errors import ConfigError, StorageError
from .._units import format_bytes
from .caches import CacheUse, cache_dirs
from .options import add_storage_option, config_from_cli
from .output import say, twin_marks

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``show`` to the subcommands ``sub``."""
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
    p.set_defaults(func=run)


def _check_out(out: str, ds: Any, folders: list[str]) -> None:
    """Refuse an ``--out`` that is a directory or lies in the dataset (its folders, files or cached copies).

    Raises:
        ConfigError: Naming ``out`` and what it would overwrite.
    """
    from ..manifest import MANIFEST_NAME
    from ..storage import is_local, local_path_of

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


def run(args: argparse.Namespace) -> int:
    """Run ``streamload show``; return the exit status."""
    from ..access import ShardedDataset
    from ..sample import IMAGE_FIELDS, parse_label
    from ..storage import is_local

    storage = config_from_cli(args, cache_dir=args.cache_dir)
    ds = ShardedDataset(args.dataset, storage=storage)
    data_root = ds.manifest.data_root
    folders = cache_dirs(args.dataset, data_root, storage.options, args.cache_dir)
    remote = not (is_local(args.dataset) and (data_root is None or is_local(data_root)))
    try:
        if args.out:
            _check_out(args.out, ds, folders)
        cache = CacheUse("show", folders, remote)
        index = ds.index_of(args.sample) if args.key or not _is_int(args.sample) else int(args.sample)
        shard, local = ds.locate(index)
        sample = ds[index]
    except IndexError as exc:
        say(f"streamload show: error: {exc}", file=sys.stderr)
        return 2
    finally:
        ds.close()
    index %= len(ds)
    say(f"dataset   {args.dataset}")
    say(f"sample    {index} of {len(ds)}: key {sample['__key__']!r} ({ds.manifest.shards[shard].name}, index {local})")
    image = None
    twins = twin_marks(list(ds.manifest.classes))
    for name in sorted(k for k in sample if not k.startswith("__")):
        value = bytes(sample[name])
        detail = ""
        if name in ("cls", "cls2", "index"):
            try:
                label = parse_label(value)
                classes = ds.manifest.classes
                twin = f" {twins[label]}" if label in twins else ""
                detail = f"label {label}" + (f" ({short(classes[label])}{twin})" if 0 <= label < len(classes) else "")
            except (ValueError, UnicodeDecodeError):
                detail = "not an integer label"
        elif name in IMAGE_FIELDS:
            detail = _image_summary(value)
            image = image or value
        elif name in ("txt", "text", "json"):
            text = value[:60].decode("utf-8", "replace")
            detail = repr(text) + (" ..." if len(value) > 60 else "")
        unit = "byte " if len(value) == 1 else "bytes"
        say(f"field     {name:<8} {len(value):>9} {unit}  {detail}".rstrip())
    if args.out:
        if image is None:
            say(f"streamload show: error: sample {sample['__key__']!r} has no image field", file=sys.stderr)
            return 2
        _write_out(args.out, image)
        say(f"wrote     {args.out} ({format_bytes(len(image))})")
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
