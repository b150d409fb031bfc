"""Checks of the values given to the public API: a bad one is a :class:`~streamload.ConfigError` at once.

Without them a bad value fails later and elsewhere: ``batch_size=2.5`` as a ``TypeError``
deep in the planner, ``seed="3"`` or ``seed=1.5`` not at all (silently another order),
``set_epoch(2**70)`` as an overflow in a tensor, a numpy seed as an ``OverflowError`` in the
shuffle, or as a ``state_dict()`` that JSON cannot hold. Every message names the option
and the value.

Integers may be any :class:`numbers.Integral` (numpy's included) and are returned as
plain ``int``; ``bool`` is refused where a number is meant (``seed=True`` is a mistake).
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, SupportsIndex, cast, get_args

from ._errors import ConfigError, PlanError
from ._files import is_local
from ._units import counted, parse_bytes

__all__ = [
    "CACHE_MODES",
    "MAX_EPOCH",
    "MAX_LOADER_WORKERS",
    "MAX_READ_AHEAD",
    "UNBOUNDED",
    "CacheMode",
    "DatasetArgs",
    "check_allowed_roots",
    "check_int",
    "check_number",
    "check_on_error",
    "check_lock_timeout",
    "check_epoch",
    "check_flag",
    "check_seconds",
    "check_size",
    "check_cache_dir",
    "check_read_ahead",
    "check_samples_seen",
    "check_storage_options",
    "dataset_args",
    "loader_worker_limit",
    "warn_remote_only",
    "parse_cache_limit",
    "parse_cache_mode",
    "parse_stream_buffer",
]

#: ``cache_limit`` value for a cache with no bound (``None`` means the default bound).
UNBOUNDED = "unbounded"
#: Largest epoch: the epoch counter is an ``int64`` shared with the DataLoader workers.
MAX_EPOCH = 2**63 - 1
#: Most shards downloaded ahead per process (one thread each; readers look no further ahead).
MAX_READ_AHEAD = 64
#: Options that only matter for a remote dataset (read through the cache).
_REMOTE_ONLY = ("cache_dir", "cache_limit", "read_ahead", "storage_options", "stream_buffer", "lock_timeout")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) in ``[low, high]``.

    Raises:
        ConfigError: Naming ``name`` and the value otherwise.
    """
    if not _is_int(value):
        raise ConfigError(f"{name}={value!r} must be an integer, not {type(value).__name__}")
    number = operator.index(cast(SupportsIndex, value))
    if low is not None and number < low:
        raise ConfigError(f"{name}={number} must be >= {low}")
    if high is not None and number > high:
        raise ConfigError(f"{name}={number} must be <= {high}")
    return number


def _optional_int(name: str, value: object, *, low: int, high: int | None = None) -> int | None:
    return None if value is None else check_int(name, value, low=low, high=high)


def _check_bool(name: str, value: object) -> bool:
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name}={value!r} must be True or False, not {type(value).__name__}")
    return bool(value)


def _check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise ConfigError(f"{name}={value!r} must be callable (a function or an object with __call__), or None")


def parse_cache_limit(value: object) -> int | str | None:
    """Return the byte bound ``cache_limit`` names, :data:`UNBOUNDED`, or ``None`` (the default bound).

    Accepted: ``None``; ``"unbounded"``; a positive integer or finite float of bytes; a
    string like ``"20GB"`` (see :func:`~streamload._units.parse_bytes`).

    Raises:
        ConfigError: For anything else, zero and negative sizes included.
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == UNBOUNDED:
        return UNBOUNDED
    size: int | str
    if isinstance(value, str):
        size = value
    elif _is_int(value):
        size = operator.index(cast(SupportsIndex, value))
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        size = int(float(value))
    else:
        raise ConfigError(
            f"cache_limit={value!r} must be a byte count, a size like '20GB', {UNBOUNDED!r} or None (the default)"
        )
    limit = parse_bytes(size, name="cache_limit")
    if limit <= 0:
        raise ConfigError(f"cache_limit={value!r} must be positive (for no bound: cache_limit={UNBOUNDED!r})")
    return limit


#: How remote shards are read: ``"shards"`` downloads each whole into the cache;
#: ``"none"`` streams tar samples by ranged GETs (only sidecars are cached); ``"auto"``
#: streams when the cache cannot hold the shards a shuffle window needs, else caches.
CacheMode = Literal["auto", "shards", "none"]
#: Values of ``cache`` (those of :data:`CacheMode`): how a remote dataset's shards are read.
CACHE_MODES: tuple[str, ...] = get_args(CacheMode)


def parse_cache_mode(value: object) -> str:
    """Return ``cache`` (``"auto"``, ``"shards"`` or ``"none"``).

    Raises:
        ConfigError: For anything else.
    """
    if not isinstance(value, str) or value not in CACHE_MODES:
        raise ConfigError(
            f"cache={value!r} must be 'auto' (stream when the cache cannot hold a shuffle window's shards), "
            "'shards' (download whole shards into the cache) or 'none' (stream samples by ranged GETs)"
        )
    return value


def parse_stream_buffer(value: object) -> int | None:
    """Return ``stream_buffer`` in bytes (an integer or a string like ``"128MB"``), or ``None`` (the default).

    Raises:
        ConfigError: If it is not a positive byte size.
    """
    if value is None:
        return None
    if isinstance(value, str):
        size = parse_bytes(value, name="stream_buffer")
    else:
        size = check_int("stream_buffer", value, low=1)
    if size <= 0:
        raise ConfigError(f"stream_buffer={value!r} must be positive")
    return size


def check_storage_options(value: object) -> dict[str, Any] | None:
    """Return a copy of ``storage_options`` (fsspec options), or ``None``.

    Raises:
        ConfigError: If it is not a mapping.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"storage_options={value!r} must be a mapping (a dict of fsspec options) or None")
    return dict(value)


def check_cache_dir(value: object) -> str | None:
    """Return ``cache_dir`` as a ``str`` (a path or ``os.PathLike``), or ``None``.

    Raises:
        ConfigError: If it is not a path.
    """
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"cache_dir={value!r} must be a path or None")
    return os.fspath(value)


def check_read_ahead(value: object) -> int | None:
    """Return ``read_ahead`` (``None``, or an int in ``[0, MAX_READ_AHEAD]``).

    Raises:
        ConfigError: If it is not an integer or out of range.
    """
    return _optional_int("read_ahead", value, low=0, high=MAX_READ_AHEAD)


def check_lock_timeout(value: object) -> float | None:
    """Return ``lock_timeout`` in seconds (``None``, or a positive finite number).

    Raises:
        ConfigError: If it is not a positive finite number.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise ConfigError(f"lock_timeout={value!r} must be a positive number of seconds or None")
    return float(value)


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


def check_allowed_roots(value: object) -> dict[str, dict[str, Any]] | None:
    """Return ``allow_data_roots`` as ``{URL prefix: storage_options}`` (a list gives each no options).

    Each prefix must be a ``protocol://`` URL of a remote place (a manifest read from a URL
    never reaches local files), without ``::`` chains; a trailing ``/`` is dropped.

    Raises:
        ConfigError: Naming the bad prefix or value.
    """
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (Mapping, list, tuple)):
        raise ConfigError(
            f"allow_data_roots={value!r} must be a list of URL prefixes or a mapping from prefix to storage_options"
        )
    pairs = list(value.items()) if isinstance(value, Mapping) else [(prefix, None) for prefix in value]
    out: dict[str, dict[str, Any]] = {}
    for prefix, options in pairs:
        if not isinstance(prefix, str) or "://" not in prefix or "::" in prefix or is_local(prefix):
            raise ConfigError(
                f"allow_data_roots: {prefix!r} must be the URL of a remote place (protocol://host/...), "
                "not a path, a file:// or local:// URL or an fsspec chain"
            )
        if not prefix.split("://", 1)[1].split("/", 1)[0]:
            raise ConfigError(f"allow_data_roots: {prefix!r} names no host (bucket)")
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"allow_data_roots[{prefix!r}]={options!r} must be a mapping of storage_options or None")
        out[prefix.rstrip("/")] = dict(options or {})
    return out


class DatasetArgs(NamedTuple):
    """The checked arguments of ``StreamingDataset.__init__``, numbers as plain ``int``."""

    shuffle: bool
    seed: int
    drop_last: bool
    shuffle_window: int | None
    batch_size: int | None
    partitions: int | None
    rank: int | None
    world_size: int | None
    on_error: str


def dataset_args(args: Mapping[str, Any]) -> DatasetArgs:
    """Check the arguments of ``StreamingDataset.__init__`` (its ``locals()``); return the normalized ones.

    Only the names this module knows are looked at, so a new argument is simply not
    checked here. The storage settings are checked by their own object
    (:class:`~streamload.StorageConfig`), once, when it is made.

    Raises:
        ConfigError: Naming the first bad argument and its value.
    """
    shuffle = _check_bool("shuffle", args.get("shuffle", False))
    seed = check_int("seed", args.get("seed", 0))
    drop_last = _check_bool("drop_last", args.get("drop_last", False))
    window = _optional_int("shuffle_window", args.get("shuffle_window"), low=1)
    batch_size = _optional_int("batch_size", args.get("batch_size"), low=1)
    partitions = check_partitions(args.get("partitions"))
    rank = _optional_int("rank", args.get("rank"), low=0)
    world_size = _optional_int("world_size", args.get("world_size"), low=1)
    if rank is not None and world_size is not None and rank >= world_size:
        raise ConfigError(f"rank={rank} must be < world_size={world_size}")
    _check_callable("transform", args.get("transform"))
    _check_callable("collate", args.get("collate"))
    on_error = check_on_error(args.get("on_error", "raise"))
    pad = args.get("pad", True)
    if not isinstance(pad, bool):
        raise ConfigError(f"pad={pad!r} must be True or False")
    collate = args.get("collate")
    if collate is not None and batch_size is None:
        raise ConfigError(f"collate={collate!r} needs batch_size= (the batches are made in the workers)")
    return DatasetArgs(shuffle, seed, drop_last, window, batch_size, partitions, rank, world_size, on_error)


def check_on_error(on_error: Any) -> str:
    """Return ``on_error`` if it is ``"raise"`` or ``"skip"``.

    Raises:
        ConfigError: For any other value.
    """
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error={on_error!r} must be 'raise' or 'skip'")
    return str(on_error)


def warn_remote_only(source: object, settings: Mapping[str, Any], data_url: str) -> None:
    """Warn about storage settings given for a local dataset that only a remote one uses.

    Args:
        source: What the dataset was given (only a local path or URL is warned about).
        settings: The storage settings by name (their unset ones ``None``).
        data_url: Where the dataset's files are (an index kept apart from its files may
            name remote ones: then the settings apply).
    """
    if not isinstance(source, (str, os.PathLike)) or not is_local(os.fspath(source)) or not is_local(data_url):
        return
    for name in _REMOTE_ONLY:
        value = settings.get(name)
        if value is not None and not (name == "storage_options" and not value):
            warnings.warn(
                f"{name}={value!r} does nothing for the local dataset {os.fspath(source)!r}: "
                "its shards are read in place (it applies to remote URLs, read through the cache)",
                UserWarning,
                stacklevel=3,  # the caller of StreamingDataset()
            )


def check_epoch(epoch: object) -> int:
    """Return ``epoch`` as an ``int`` in ``[0, MAX_EPOCH]`` (for ``set_epoch``).

    Raises:
        ConfigError: If it is not an integer (``1.7``, ``"2"``, ``True``) or out of range.
    """
    return check_int("epoch", epoch, low=0, high=MAX_EPOCH)


def check_partitions(partitions: object) -> int | None:
    """Return ``partitions`` (``None`` or an int in ``[1, 65536]``).

    Raises:
        ConfigError: If it is not an integer or out of range.
    """
    return None if partitions is None else check_int("partitions", partitions, low=1, high=1 << 16)


def check_samples_seen(samples_seen: int, epoch_total: int, world_size: int, global_batch: int) -> None:
    """Refuse a ``samples_seen`` past the end of its epoch (for ``state_dict`` and ``load_state_dict``).

    The epoch holds ``epoch_total`` items over all ranks, whole global batches of
    ``global_batch``; the count of a plain loop is ``steps * global_batch``, so it reaches
    the end exactly. Anything further is a wrong count, not a finished epoch.

    Raises:
        PlanError: If ``samples_seen`` is beyond that (a :class:`PlanError`, like the other
            checks of a state's ``samples_seen``).
    """
    if samples_seen > epoch_total:
        raise PlanError(
            f"samples_seen={samples_seen} is past the end of the epoch: it ends at {epoch_total} samples "
            f"(whole global batches of {global_batch} over world_size={world_size})"
        )


#: The most DataLoader workers a command starts, whatever the machine (``convert`` caps its processes the same).
MAX_LOADER_WORKERS = 1024
#: File descriptors a command keeps for itself, beside its DataLoader workers'.
_RESERVED_FDS = 64


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
