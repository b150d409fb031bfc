"""Shard formats: a registry of :class:`Format` objects, imported lazily by name.

A new format is one module that builds a :class:`Format` named ``FORMAT`` and an
entry in :data:`_BUILTIN` (or a call to :func:`register_format`).

:func:`set_row_group_cache_bytes` sets the bytes of decoded Parquet row groups a process
keeps (importing no table library); :func:`set_row_group_cache_default` the budget when
none is set.
"""

from __future__ import annotations

import importlib

from .._errors import ConfigError
from .base import Format, RangedReads, Sample, ShardBytes, ShardReader, ShardWriter, TableIndexing, check_sample
from .table_cache import ROW_GROUP_CACHE_BYTES, set_row_group_cache_bytes, set_row_group_cache_default

__all__ = [
    "ROW_GROUP_CACHE_BYTES",
    "Format",
    "RangedReads",
    "Sample",
    "ShardBytes",
    "ShardReader",
    "ShardWriter",
    "TableIndexing",
    "available_formats",
    "check_sample",
    "get_format",
    "register_format",
    "set_row_group_cache_bytes",
    "set_row_group_cache_default",
]

#: name -> (module, what to install if its import fails)
_BUILTIN: dict[str, tuple[str, str]] = {
    "tar": ("streamload.formats.tar", ""),
    "lmdb": ("streamload.formats.lmdb", "pip install lmdb"),
    "hdf5": ("streamload.formats.hdf5", "pip install h5py"),
    "parquet": ("streamload.formats.parquet", "pip install pyarrow"),
}
_LOADED: dict[str, Format] = {}


def register_format(fmt: Format) -> None:
    """Register (or replace) a format under ``fmt.name``."""
    _LOADED[fmt.name] = fmt


def available_formats() -> list[str]:
    """Return the names of every known format, built-in or registered."""
    return sorted(set(_BUILTIN) | set(_LOADED))


def get_format(name: str) -> Format:
    """Return the format called ``name``, importing its module on first use.

    Raises:
        ConfigError: If no such format exists or its dependency is not installed.
    """
    if name in _LOADED:
        return _LOADED[name]
    if name not in _BUILTIN:
        raise ConfigError(f"unknown shard format {name!r}; known: {', '.join(available_formats())}")
    module_name, hint = _BUILTIN[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"format {name!r} needs a missing package ({exc}); {hint}") from exc
    fmt = module.FORMAT
    assert isinstance(fmt, Format)
    _LOADED[name] = fmt
    return fmt
