"""``streamload verify DATASET``: re-hash every shard and read every sample; exit 1 on any problem."""

from __future__ import annotations

import argparse
from typing import Any

from .._units import counted
from .caches import CacheUse, cache_dirs, data_root_of
from .options import add_storage_option, config_from_cli
from .output import say

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``verify`` to the subcommands ``sub``."""
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``streamload verify``; return the exit status."""
    from ..storage import is_local
    from ..verify import verify_dataset

    storage = config_from_cli(args, cache_dir=args.cache_dir)
    data_root = data_root_of(args.dataset, storage)
    folders = cache_dirs(args.dataset, data_root, storage.options, args.cache_dir)
    cache = CacheUse("verify", folders[:-1], any(not is_local(u) for u in (args.dataset, data_root) if u))
    report = verify_dataset(
        args.dataset,
        read_samples=not args.no_read,
        decode_images=args.decode and not args.no_read,
        storage=storage,
    )
    for _name, what in report.repaired:
        say(f"REPAIRED {what}")
    for _name, problem in report.problems:
        say(f"BAD  {problem}")
    for _name, warned in report.warnings:
        say(f"WARN {warned}")
    unhashed = len(report.unhashed)
    if unhashed:
        shown = ", ".join(report.unhashed[:3]) + (", ..." if unhashed > 3 else "")
        samples = "" if args.no_read else f" (and {'its' if unhashed == 1 else 'their'} samples by their own checksums)"
        say(
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
    say(f"{status}: {checked} checked{decoded} in {args.dataset}{warned}")
    return 0 if report.ok else 1
