"""``streamload info DATASET``: a dataset's summary, read from its ``index.json`` only."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .._classes import shown as short
from .._redact import redact
from .._units import counted, format_bytes
from .options import add_storage_option, config_from_cli
from .output import say, twin_marks

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``info`` to the subcommands ``sub``."""
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``streamload info``; return the exit status."""
    import shutil
    import tempfile

    from ..dataref import DatasetRef

    # Only index.json is read: a URL's manifest (or the files of a data_root on one) goes
    # through a throw-away cache, so that `info` leaves nothing behind in the shard cache.
    scratch = tempfile.mkdtemp(prefix="streamload-info-")
    try:
        config = config_from_cli(args, cache_dir=scratch, cache_limit="unbounded")
        manifest = DatasetRef.open(args.dataset, config).manifest
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(redact(json.dumps(_summary(args.dataset, manifest), indent=1)))  # no URL's password shown
        return 0
    counts = manifest.shard_counts or [0]
    say(f"dataset   {args.dataset}")
    say(f"format    {manifest.format}")
    if manifest.data_root is not None:
        say(f"files in  {manifest.data_root} (read in place; the index and sidecars here)")
    say(f"samples   {manifest.num_samples}")
    say(f"shards    {len(manifest.shards)} (samples per shard: min {min(counts)}, max {max(counts)})")
    say(f"size      {format_bytes(manifest.num_bytes)}")
    say(f"fields    {', '.join(manifest.fields) or '-'}")
    names = list(manifest.classes)
    twins = twin_marks(names)
    shown = [f"{short(name)} {twins[i]}" if i in twins else short(name) for i, name in enumerate(names[:10])]
    classes = ", ".join(shown) + (" ..." if len(names) > 10 else "")
    labels = manifest.meta.get("labels")
    if not names and isinstance(labels, dict) and isinstance(labels.get("distinct"), int):
        say(
            f"classes   {labels['distinct']} labels in {labels.get('field', 'cls')} "
            f"({labels.get('min')} to {labels.get('max')}); no class names recorded "
            "(streamload index --classes NAME,... --overwrite records them)"
        )
    else:
        say(f"classes   {len(names)}: {classes or '-'}")
    if twins:
        say(
            f"note      {counted(len(twins), 'class name')} look identical to another but differ in Unicode "
            "normalization (marked NFC/NFD twin): they are different classes"
        )
    say(f"hash      {manifest.hash_algorithm or 'none'}")
    if "indexed_by" not in manifest.meta:
        say(f"skipped   {counted(len(manifest.skipped), 'input')} at conversion")
    elif manifest.skipped:
        say(f"skipped   {counted(len(manifest.skipped), 'bad row')} at indexing")
    appends = manifest.meta.get("appends") or []
    if "indexed_by" not in manifest.meta:  # an indexed dataset is never appended to
        say(f"appends   {len(appends)}" + (f" (last: {appends[-1].get('source')})" if appends else ""))
    return 0


def _summary(url: str, manifest: Any) -> dict[str, Any]:
    """``info --json``: the manifest's figures by name."""
    summary = {
        "url": url,
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
    return summary
