"""Checks of the storage settings that tune the transport and the cache (:class:`~streamload.StorageConfig`).

Each returns the value to keep, or ``None`` for "the default", which comes from the
environment when the storage is opened (:mod:`streamload._env`).
"""

from __future__ import annotations

import math
import numbers

from .._errors import ConfigError
from .._units import parse_bytes

__all__ = ["check_flag", "check_seconds", "check_size"]


def check_seconds(name: str, value: object, *, zero: bool = False) -> float | None:
    """``value`` as seconds: ``None``, or a positive (``zero``: or zero) finite number.

    Raises:
        ConfigError: Naming the field and the value.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"{name}={value!r} must be a number of seconds or None")
    if float(value) < 0 or (float(value) == 0 and not zero):
        raise ConfigError(f"{name}={value!r} must be {'>= 0' if zero else '> 0'} seconds")
    return float(value)


def check_flag(name: str, value: object) -> bool | None:
    """``value`` as a switch: ``None``, ``True`` or ``False``.

    Raises:
        ConfigError: Naming the field and the value.
    """
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"{name}={value!r} must be True, False or None")


def check_size(name: str, value: object) -> int | None:
    """``value`` as bytes: ``None``, a non-negative integer, or a string like ``"512MiB"``.

    Raises:
        ConfigError: Naming the field and the value.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return parse_bytes(value, name=name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ConfigError(f"{name}={value!r} must be a number of bytes (or a string like '512MiB') or None")
    return int(value)
