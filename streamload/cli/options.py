"""Command-line options shared by the ``streamload`` subcommands, and the storage settings they make."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError

if TYPE_CHECKING:
    from ..storageconfig import StorageConfig

__all__ = ["add_storage_option", "config_from_cli", "parse_storage_options"]


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """Parse ``key=value`` pairs into fsspec storage options.

    Values are JSON when they parse (numbers, booleans, objects), strings otherwise.
    Dotted keys nest: ``client_kwargs.endpoint_url=...``.
    """
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--storage-option {pair!r} must look like key=value")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--storage-option {pair!r}: {part!r} was already given a value, not options")
        node[leaf] = value
    return out


def add_storage_option(p: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--storage-option/-o KEY=VALUE`` and ``--allow-data-root URL`` to a subcommand's parser."""
    p.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option for remote URLs (repeatable; dotted keys nest, "
        "e.g. client_kwargs.endpoint_url=http://127.0.0.1:8333)",
    )
    p.add_argument(
        "--allow-data-root",
        action="append",
        metavar="URL",
        help="let a manifest read from a URL name its files under URL although it is on another host or bucket "
        "(repeatable; they are read with the -o options given here)",
    )


def config_from_cli(args: argparse.Namespace, **settings: Any) -> StorageConfig:
    """The storage settings of a subcommand's parsed ``-o`` and ``--allow-data-root`` options.

    Each ``--allow-data-root`` URL is read with the ``-o`` options given beside it.

    Args:
        args: The parsed arguments (those without the options count as giving none).
        settings: Further :class:`~streamload.StorageConfig` fields (``cache_dir``...).
    """
    from ..storageconfig import StorageConfig

    options = parse_storage_options(getattr(args, "storage_option", None))
    roots = getattr(args, "allow_data_root", None) or []
    allowed = {root: options for root in roots} or None
    return StorageConfig(storage_options=options, allow_data_roots=allowed, **settings)
