"""Human units: byte sizes such as ``"256MB"`` or ``"20GiB"``, and counts such as ``"1 shard"``."""

from __future__ import annotations

import re

from ._errors import ConfigError

__all__ = ["counted", "format_bytes", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "size") -> int:
    """Return a byte count from an int or a string like ``"256MB"`` or ``"1.5GiB"``.

    Args:
        value: A non-negative int, or a number followed by a unit (B, KB, MB, GB, TB,
            KiB, MiB, GiB, TiB; case-insensitive; decimal units are powers of 1000).
        name: The option's name, used in the error message.

    Raises:
        ConfigError: If the value cannot be parsed or is negative.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a byte size")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}={value!r} must be >= 0")
        return value
    match = _PATTERN.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}={value!r} is not a byte size like '256MB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num: float) -> str:
    """Return ``num`` bytes as a short human string (decimal units)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num) < 1000 or unit == "TB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1000
    raise AssertionError("unreachable")


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """Return ``number`` and ``noun`` in the number it takes: ``"1 shard"``, ``"2 shards"``, ``"0 shards"``.

    Args:
        number: How many.
        noun: The singular (``"shard"``).
        plural: The plural if it is not ``noun + "s"`` (``"classes"``).
    """
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
