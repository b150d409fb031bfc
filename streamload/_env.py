"""The environment, read in one place: the documented defaults of streamload's parameters.

Every knob is a parameter (:class:`~streamload.StorageConfig`, the dataset's keywords);
an environment variable only changes the default a parameter takes when it is not given,
so a job can be tuned without code changes. The defaults are applied where the settings
are made (:meth:`~streamload.StorageConfig.resolve`, a conversion's engine) and passed
down resolved: nothing below them imports this module. Rank detection (``RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``: :mod:`streamload.plan.world`) is the one other reader of the
environment.

========================================  ====================================================
variable                                  default of
========================================  ====================================================
``STREAMLOAD_CACHE``                      the cache directory (else ``$XDG_CACHE_HOME/streamload``
                                          or ``~/.cache/streamload``)
``STREAMLOAD_CACHE_SHARED``               ``StorageConfig(cache_shared=)``: a cache directory
                                          other users may share (``1``)
``STREAMLOAD_READ_TIMEOUT``               ``StorageConfig(read_timeout=)``: seconds a read may
                                          go without a byte (30)
``STREAMLOAD_RETRY_TIMEOUT``              ``StorageConfig(retry_timeout=)``: seconds a failing
                                          call is retried (120)
``STREAMLOAD_S3_DIRECT``                  ``StorageConfig(s3_direct=)``: S3 reads on botocore
                                          directly (``1``) or through s3fs (``0``)
``STREAMLOAD_PARQUET_CACHE``              ``StorageConfig(parquet_cache=)``: bytes of decoded
                                          Parquet row groups kept per process (1 GiB)
``STREAMLOAD_ALLOW_DATA_ROOTS``           directories a manifest may name as data roots
========================================  ====================================================
"""

from __future__ import annotations

import os

from ._errors import ConfigError
from ._units import parse_bytes

__all__ = [
    "ALLOW_DATA_ROOTS",
    "CACHE",
    "CACHE_SHARED",
    "PARQUET_CACHE",
    "READ_TIMEOUT",
    "RETRY_TIMEOUT",
    "S3_DIRECT",
    "allowed_data_roots",
    "aws_endpoint",
    "cache_dir",
    "cache_shared",
    "env_bytes",
    "env_flag",
    "env_seconds",
    "on_ci",
    "ray_address",
    "s3_direct",
]

CACHE = "STREAMLOAD_CACHE"
CACHE_SHARED = "STREAMLOAD_CACHE_SHARED"
READ_TIMEOUT = "STREAMLOAD_READ_TIMEOUT"
RETRY_TIMEOUT = "STREAMLOAD_RETRY_TIMEOUT"
S3_DIRECT = "STREAMLOAD_S3_DIRECT"
PARQUET_CACHE = "STREAMLOAD_PARQUET_CACHE"
ALLOW_DATA_ROOTS = "STREAMLOAD_ALLOW_DATA_ROOTS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """A yes/no variable (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``).

    Raises:
        ConfigError: If it is set to anything else.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={value!r} must be one of {', '.join(_TRUE + _FALSE)}")


def env_seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds (``default`` if unset).

    Raises:
        ConfigError: If it is not such a number.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"environment variable {name}={value!r} must be a positive number of seconds")
    return seconds


def env_bytes(name: str, default: int) -> int:
    """A size in bytes, with units (``512MiB``; ``default`` if unset).

    Raises:
        ConfigError: If it is not a size.
    """
    value = os.environ.get(name, "").strip()
    return parse_bytes(value, name=name) if value else default


def cache_dir() -> str:
    """``$STREAMLOAD_CACHE`` if set, else ``$XDG_CACHE_HOME/streamload`` or ``~/.cache/streamload``."""
    env = os.environ.get(CACHE)
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "streamload")


def cache_shared() -> bool:
    """Whether a cache directory may be shared with other users (``STREAMLOAD_CACHE_SHARED``)."""
    return env_flag(CACHE_SHARED, False)


def s3_direct() -> bool:
    """Whether S3 is read on botocore directly (``STREAMLOAD_S3_DIRECT``, on by default)."""
    return env_flag(S3_DIRECT, True)


def allowed_data_roots() -> list[str]:
    """The directories ``STREAMLOAD_ALLOW_DATA_ROOTS`` names (space separated)."""
    return os.environ.get(ALLOW_DATA_ROOTS, "").split()


def ray_address() -> str | None:
    """The Ray cluster ``RAY_ADDRESS`` names (Ray's own variable), else ``None``: a conversion's ``--executor ray``."""
    return os.environ.get("RAY_ADDRESS") or None


def on_ci() -> bool:
    """Whether ``CI`` is set (to anything not empty), as CI services do: no progress bar by default."""
    return bool(os.environ.get("CI"))


def aws_endpoint() -> str | None:
    """The S3 endpoint botocore reads from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``).

    Part of a dataset's cache key: the same ``s3://bucket/x`` on two servers must not share a cache.
    """
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
