"""``streamload demo``: make a small image folder, convert it, and read it back."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``demo`` to the subcommands ``sub``."""
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``streamload demo``; return the exit status."""
    from ..demo import run_demo

    run_demo(args.dir, args.images, args.workers, args.format, overwrite=args.overwrite)
    return 0
