"""Command-line options shared by the ``streamload`` subcommands (``cli`` and ``bench``)."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from ._errors import ConfigError
from ._units import counted

__all__ = [
    "MAX_LOADER_WORKERS",
    "add_storage_option",
    "check_number",
    "loader_worker_limit",
    "parse_storage_options",
]

#: The most DataLoader workers a command starts, whatever the machine (``convert`` caps its processes the same).
MAX_LOADER_WORKERS = 1024
#: File descriptors a command keeps for itself, beside its DataLoader workers'.
_RESERVED_FDS = 64


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


def loader_worker_limit(prefetch: int = 2) -> tuple[int, str]:
    """Return the most DataLoader workers a command starts on this machine, and what sets that bound.

    The smallest of :data:`MAX_LOADER_WORKERS`; 8 per CPU (at least 64), past which workers
    only contend for the cores; and what the soft open-file limit allows, with
    ``_RESERVED_FDS`` kept for the rest: each worker holds about ``5 + prefetch``
    descriptors in the main process (its queues, and its shared-memory batches in flight).

    Args:
        prefetch: The DataLoader's ``prefetch_factor``.
    """
    cpus = os.cpu_count() or 1
    limit, why = MAX_LOADER_WORKERS, f"at most {MAX_LOADER_WORKERS}"
    by_cpus = max(64, 8 * cpus)
    if by_cpus < limit:
        limit, why = by_cpus, f"the most for this machine's {counted(cpus, 'CPU')}: 8 per CPU, never fewer than 64"
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not a Unix
        return limit, why
    if soft != resource.RLIM_INFINITY:
        by_fds = max(1, (soft - _RESERVED_FDS) // (5 + prefetch))
        if by_fds < limit:
            limit, why = by_fds, f"the open-file limit (ulimit -n {soft}) allows {by_fds} with prefetch {prefetch}"
    return limit, why


def check_number(option: str, value: float, low: float, high: float | None = None, why: str = "") -> None:
    """Refuse a command-line number that is not finite or lies outside ``[low, high]``.

    Args:
        option: The option as typed (``"--seconds"``), for the message.
        value: Its value.
        low: The smallest value allowed.
        high: The largest (``None``: no bound).
        why: What sets ``high``, added to the message.

    Raises:
        ConfigError: Naming the option, the value and the range.
    """
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bound = f"between {_number(low)} and {_number(high)}" if high is not None else f">= {_number(low)}"
        reason = f" ({why})" if why else ""
        raise ConfigError(f"{option} {_number(value)} must be {bound}{reason}")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
