"""How a dataset's files are reached: :class:`StorageConfig`, and the one rule that decides cached or streamed.

:class:`StorageConfig` holds the fsspec options, the cache, read-ahead and streaming
settings, each field checked once, when it is made; :meth:`StorageConfig.resolve` applies
the defaults, the environment's included (this is the one module that reads the
storage's environment variables), and the resolved
:class:`~streamload.storage.StorageSettings` is what the storage below is opened with.
:func:`config_from_arguments` makes one from a constructor's ``storage=`` or its
deprecated keywords. :func:`choose_streaming` decides whether a remote dataset is
streamed (read by ranges) or cached. A dataset opened once with them is a
:class:`~streamload.dataref.DatasetRef`; its shards are read by a
:class:`~streamload.shards.ShardSource`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypedDict

from . import _env
from ._errors import ConfigError
from ._units import format_bytes
from ._validate import (
    CACHE_MODES,
    CacheMode,
    check_allowed_roots,
    check_cache_dir,
    check_flag,
    check_lock_timeout,
    check_read_ahead,
    check_seconds,
    check_size,
    check_storage_options,
    parse_cache_limit,
    parse_cache_mode,
    parse_stream_buffer,
)
from .formats import ROW_GROUP_CACHE_BYTES, get_format, set_row_group_cache_bytes, set_row_group_cache_default
from .manifest import Manifest, is_under
from .storage import Destination, Storage, StorageSettings, is_local, open_destination, open_storage
from .storage.cache import DEFAULT_LOCK_TIMEOUT
from .storage.retry import DEFAULT_INACTIVITY_TIMEOUT, DEFAULT_RETRY_TIMEOUT, RetryPolicy
from .storage.settings import DEFAULT_READ_AHEAD

__all__ = [
    "ALLOW_DATA_ROOTS_ENV",
    "CACHE_KEYWORDS",
    "CACHE_MODES",
    "STORAGE_KEYWORDS",
    "CacheKeywords",
    "CacheMode",
    "StorageConfig",
    "StorageKeywords",
    "can_stream",
    "choose_streaming",
    "config_from_arguments",
    "largest_sidecar",
]


def can_stream(manifest: Manifest) -> bool:
    """True if the dataset's shards can be read by ranges: a ranged format, every shard with its sidecar."""
    return get_format(manifest.format).ranged and all(s.sidecar is not None for s in manifest.shards)


def choose_streaming(mode: str, ranged: bool, limit: int | None, shards_at_once: int, largest: int) -> str | None:
    """Decide whether a remote dataset is streamed (read by ranges) rather than cached: the one rule.

    Args:
        mode: The ``cache`` setting: ``"none"`` streams, ``"shards"`` caches, ``"auto"`` decides.
        ranged: The shards can be streamed (:func:`can_stream`).
        limit: The cache limit in bytes (``None``: unbounded).
        shards_at_once: Shards the readers of this machine keep open at once.
        largest: The largest shard's bytes.

    Returns:
        Why ``"auto"`` streams (to be logged once), ``"none"`` for a streamed dataset whose
        mode asked for it, or ``None`` to cache.
    """
    if mode == "none":
        return "none"
    if mode == "shards" or not ranged or limit is None:
        return None
    need = shards_at_once * largest
    if need <= limit:
        return None
    return (
        f"{shards_at_once} shards open at once need {format_bytes(need)}, more than cache_limit={format_bytes(limit)}"
    )


def largest_sidecar(manifest: Manifest) -> int:
    """The largest sidecar's bytes (0 if the shards have none)."""
    return max((s.sidecar.num_bytes for s in manifest.shards if s.sidecar is not None), default=0)


@dataclass(frozen=True, init=False)
class StorageConfig:
    """How a dataset's files are reached: fsspec options, the local cache, read-ahead and streaming.

    One object that :class:`~streamload.StreamingDataset`, :class:`~streamload.Stream`,
    :class:`~streamload.ShardedDataset` and the Lightning data module take as ``storage=``.
    Every field is checked once, here: a bad value is a :class:`~streamload.ConfigError`
    naming the field and the value. A field left ``None`` takes the reader's default (for
    a :class:`~streamload.Stream`: the dataset's setting). All but ``storage_options``
    apply to remote URLs only (read through the cache); a local dataset is read in place.

    Attributes:
        storage_options: Passed to fsspec (credentials, endpoint...); kept as a copy.
        cache_dir: Local cache directory for remote shards (a path; kept as a ``str``;
            default ``$STREAMLOAD_CACHE`` or ``~/.cache/streamload``).
        cache_limit: Cache size bound: bytes, or a string like ``"20GB"`` (kept as bytes);
            at least twice the largest shard; ``None``: half of the space the cache could
            use (logged once); ``"unbounded"``: no bound.
        read_ahead: At most this many shards each worker downloads ahead of its reads
            (cached mode; ``None``: 8; ``0`` turns read-ahead off; at most 64).
        cache: How remote shards are read. ``"shards"``: each shard is downloaded whole
            into the cache, verified, and read locally. ``"none"`` (streaming mode, tar
            shards with sidecars, and Parquet): only sidecars are cached and samples are
            read by coalesced ranged GETs, fetched several batches ahead, every sample's
            checksum checked; no shard is written to disk. ``"auto"``: stream when the
            cache cannot hold the shards one shuffle window spans for every reader of the
            machine, else cache. LMDB and HDF5 datasets are always cached (``"none"`` is a
            ``ConfigError`` for them). ``None``: ``"auto"`` for
            :class:`~streamload.StreamingDataset`, ``"shards"`` for random access,
            verification and conversion. See ``docs/remote.md``.
        stream_buffer: Streaming mode: bytes of ranges each worker fetches ahead (an int
            or a string like ``"256MB"``, kept as bytes; ``None``: 64 MiB). A setting of
            the dataset, not of a single :class:`~streamload.Stream`.
        lock_timeout: Most seconds a reader waits for one of the cache's locks (another
            process's download of the same shard, an eviction) before a
            :class:`~streamload.CacheError` naming the lock (``None``: 600). A reader that
            waits logs once, after a few seconds, which lock and which process it waits for.
        allow_data_roots: Where a manifest read from a URL may send its readers besides
            its own scheme and host (bucket): URL prefixes, as a list (the files there are
            read with no ``storage_options``) or as a mapping from prefix to the
            ``storage_options`` to read them with. The dataset's own ``storage_options``
            never go to another host unless given here. Prefixes in
            ``$STREAMLOAD_ALLOW_DATA_ROOTS`` (separated by spaces; what the command line's
            ``--allow-data-root`` sets) are allowed too, read with these ``storage_options``.
            A manifest from a URL may never name local files. See ``docs/remote.md``.
        retry_timeout: Seconds a failing remote call is retried, counted from the start of
            its first failed attempt (``None``: ``$STREAMLOAD_RETRY_TIMEOUT``, else 120;
            ``0``: no retry).
        read_timeout: Seconds a remote read may go without a byte before it fails (and is
            retried) (``None``: ``$STREAMLOAD_READ_TIMEOUT``, else 30).
        s3_direct: Read S3 shard bytes on botocore's own client (``True``) or through s3fs
            (``False``) (``None``: ``$STREAMLOAD_S3_DIRECT``, else ``True``).
        parquet_cache: Bytes of decoded Parquet row groups a process keeps (an int or a
            string like ``"2GB"``, kept as bytes; ``None``: ``$STREAMLOAD_PARQUET_CACHE``,
            else 1 GiB); set in each process that opens the dataset's storage.
        cache_shared: Accept a cache directory other users may write (a group's shared
            cache) (``None``: ``$STREAMLOAD_CACHE_SHARED``, else ``False``).

    Raises:
        ConfigError: If a field's value is not one it can take.

    Example:
        >>> storage = StorageConfig(storage_options={"anon": True}, cache_dir="/scratch/cache", cache_limit="20GB")
        >>> storage.cache_limit
        20000000000
    """

    storage_options: Mapping[str, Any] | None
    cache_dir: str | None
    cache_limit: int | str | None
    read_ahead: int | None
    cache: CacheMode | None
    stream_buffer: int | None
    lock_timeout: float | None
    allow_data_roots: Mapping[str, Mapping[str, Any]] | None
    retry_timeout: float | None
    read_timeout: float | None
    s3_direct: bool | None
    parquet_cache: int | None
    cache_shared: bool | None

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | float | str | None = None,
        read_ahead: int | None = None,
        cache: CacheMode | None = None,
        stream_buffer: int | str | None = None,
        lock_timeout: float | None = None,
        allow_data_roots: Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None = None,
        retry_timeout: float | None = None,
        read_timeout: float | None = None,
        s3_direct: bool | None = None,
        parquet_cache: int | str | None = None,
        cache_shared: bool | None = None,
    ) -> None:
        checked: dict[str, Any] = {
            "storage_options": check_storage_options(storage_options),
            "cache_dir": check_cache_dir(cache_dir),
            "cache_limit": parse_cache_limit(cache_limit),
            "read_ahead": check_read_ahead(read_ahead),
            "cache": None if cache is None else parse_cache_mode(cache),
            "stream_buffer": parse_stream_buffer(stream_buffer),
            "lock_timeout": check_lock_timeout(lock_timeout),
            "allow_data_roots": check_allowed_roots(allow_data_roots),
            "retry_timeout": check_seconds("retry_timeout", retry_timeout, zero=True),
            "read_timeout": check_seconds("read_timeout", read_timeout),
            "s3_direct": check_flag("s3_direct", s3_direct),
            "parquet_cache": check_size("parquet_cache", parquet_cache),
            "cache_shared": check_flag("cache_shared", cache_shared),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    @property
    def options(self) -> dict[str, Any]:
        """The fsspec options (a new dict; empty if none were given)."""
        return dict(self.storage_options or {})

    def settings(self) -> dict[str, Any]:
        """Return the fields by name (``storage_options`` not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_defaults(self, defaults: StorageConfig) -> StorageConfig:
        """Return these settings, each field left ``None`` taken from ``defaults``."""
        mine = self.settings()
        return replace(defaults, **{name: value for name, value in mine.items() if value is not None})

    def with_cache(self, default: CacheMode) -> StorageConfig:
        """Return these settings with ``cache`` set to ``default`` if it was left ``None``."""
        return self if self.cache is not None else replace(self, cache=default)

    def cache_directory(self) -> str:
        """The cache directory: :attr:`cache_dir`, else ``$STREAMLOAD_CACHE``, else the user's cache folder.

        ``$XDG_CACHE_HOME/streamload``, else ``~/.cache/streamload``.
        """
        return self.cache_dir if self.cache_dir is not None else _env.cache_dir()

    def cache_is_shared(self) -> bool:
        """Whether the cache directory may be shared with other users (``$STREAMLOAD_CACHE_SHARED`` if unset)."""
        return _env.cache_shared() if self.cache_shared is None else self.cache_shared

    def resolve(self, storage_options: Mapping[str, Any] | None = None) -> StorageSettings:
        """These settings with every default applied, the environment's first: what a remote storage is opened with.

        The one place the storage's defaults are applied (the environment is read here, and
        nothing below reads it). A field given here wins; a field left ``None`` takes the
        environment's value (``STREAMLOAD_CACHE``, ``STREAMLOAD_RETRY_TIMEOUT``,
        ``STREAMLOAD_READ_TIMEOUT``, ``STREAMLOAD_S3_DIRECT``, ``STREAMLOAD_CACHE_SHARED``)
        where it has one, else streamload's default.

        Args:
            storage_options: fsspec options to use instead of :attr:`storage_options`.

        Raises:
            ConfigError: If an environment variable a default comes from holds a bad value.
        """
        retry = self.retry_policy()
        return StorageSettings(
            cache_dir=self.cache_directory(),
            storage_options=self.options if storage_options is None else dict(storage_options),
            cache_limit=self.cache_limit,
            read_ahead=DEFAULT_READ_AHEAD if self.read_ahead is None else self.read_ahead,
            lock_timeout=DEFAULT_LOCK_TIMEOUT if self.lock_timeout is None else self.lock_timeout,
            retry_timeout=retry.timeout,
            read_timeout=retry.inactivity_timeout,
            s3_direct=_env.s3_direct() if self.s3_direct is None else self.s3_direct,
            cache_shared=self.cache_is_shared(),
        )

    def retry_policy(self) -> RetryPolicy:
        """How remote calls are retried: :attr:`retry_timeout` and :attr:`read_timeout`.

        Each left ``None`` is ``$STREAMLOAD_RETRY_TIMEOUT`` and ``$STREAMLOAD_READ_TIMEOUT``,
        else 120 and 30 seconds.
        """
        return RetryPolicy(
            timeout=_or_env(self.retry_timeout, _env.RETRY_TIMEOUT, DEFAULT_RETRY_TIMEOUT),
            inactivity_timeout=_or_env(self.read_timeout, _env.READ_TIMEOUT, DEFAULT_INACTIVITY_TIMEOUT),
        )

    def open_destination(self, url: str) -> Destination:
        """Return a new destination for writing a dataset at ``url`` (a remote one's transport with these settings)."""
        if is_local(str(url)):
            return open_destination(url)
        direct = _env.s3_direct() if self.s3_direct is None else self.s3_direct
        return open_destination(url, self.options, retry=self.retry_policy(), s3_direct=direct)

    def open(self, url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
        """Return a new storage for the dataset at ``url`` in this process.

        A remote URL's storage is opened with :meth:`resolve`'s settings; a local dataset
        is read in place (nothing to resolve). The Parquet row-group budget is the
        process's: set here, in each process that opens the dataset.

        Args:
            url: The dataset's (or a data root's) URL or path.
            storage_options: fsspec options to use instead of :attr:`storage_options`
                (a data root on another host gets its own, never the dataset's).
        """
        if self.parquet_cache is not None:
            set_row_group_cache_bytes(self.parquet_cache)
        else:
            set_row_group_cache_default(_env.env_bytes(_env.PARQUET_CACHE, ROW_GROUP_CACHE_BYTES))
        return open_storage(url, None if is_local(str(url)) else self.resolve(storage_options))

    def data_root_options(self, root: str) -> dict[str, Any] | None:
        """The ``storage_options`` for a data root elsewhere that the caller allowed; ``None`` if not allowed.

        The longest prefix of :attr:`allow_data_roots` that ``root`` is under decides (its
        options; none for a prefix given in a list); then a prefix of
        ``$STREAMLOAD_ALLOW_DATA_ROOTS``, read with this config's own ``storage_options``
        (the command line's ``--allow-data-root``, named next to its ``-o`` options).
        """
        allowed = dict(self.allow_data_roots or {})
        named = check_allowed_roots(_env.allowed_data_roots()) or {}
        for prefix in named:
            allowed.setdefault(prefix, self.options)
        matches = [prefix for prefix in allowed if is_under(root, prefix)]
        if not matches:
            return None
        return dict(allowed[max(matches, key=len)])


#: The environment variable naming data roots a manifest read from a URL may send readers to
#: (URL prefixes separated by spaces; set by the command line's ``--allow-data-root``).
ALLOW_DATA_ROOTS_ENV = _env.ALLOW_DATA_ROOTS


def _or_env(value: float | None, name: str, default: float) -> float:
    """``value`` if given, else the environment's seconds ``name``, else ``default``."""
    return _env.env_seconds(name, default) if value is None else value


#: The storage settings :class:`StorageConfig` groups, by the keyword names they had on their own.
STORAGE_KEYWORDS = ("storage_options", "cache_dir", "cache_limit", "read_ahead", "cache", "stream_buffer")
#: Those that every reader took (``Stream`` and ``ShardedDataset`` did not take ``cache`` and ``stream_buffer``).
CACHE_KEYWORDS = ("storage_options", "cache_dir", "cache_limit", "read_ahead")


class CacheKeywords(TypedDict, total=False):
    """The cache settings once given as keywords of their own to every reader (deprecated: pass ``storage=``)."""

    storage_options: Mapping[str, Any] | None
    cache_dir: str | os.PathLike[str] | None
    cache_limit: int | float | str | None
    read_ahead: int | None


class StorageKeywords(CacheKeywords, total=False):
    """All storage settings once given as keywords of their own to ``StreamingDataset`` (deprecated)."""

    cache: CacheMode | None
    stream_buffer: int | str | None


def config_from_arguments(
    owner: str,
    storage: StorageConfig | None,
    keywords: Mapping[str, Any],
    *,
    accepted: tuple[str, ...] = STORAGE_KEYWORDS,
    stacklevel: int = 3,
) -> StorageConfig | None:
    """Return the storage settings a constructor was given: ``storage=``, or the deprecated keywords.

    The keywords ``storage_options=``, ``cache_dir=``, ``cache_limit=``, ``read_ahead=``,
    ``cache=`` and ``stream_buffer=`` still work for one release: they are grouped into a
    :class:`StorageConfig` (checked like one) and one ``DeprecationWarning`` names them and
    the new spelling. A keyword given as ``None`` counts as not given.

    Args:
        owner: The constructor, for messages (``"StreamingDataset"``).
        storage: The ``storage=`` argument.
        keywords: The other keyword arguments the constructor took as ``**``.
        accepted: The old keywords this constructor had (others are a ``TypeError``).
        stacklevel: Where the warning points (the constructor's caller).

    Raises:
        TypeError: For a keyword that is no storage setting (as Python would).
        ConfigError: If ``storage`` is not a :class:`StorageConfig`, or it is given with
            an old keyword, or a keyword's value is bad.
    """
    unknown = [name for name in keywords if name not in accepted]
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    if storage is not None and not isinstance(storage, StorageConfig):
        raise ConfigError(f"storage={storage!r} must be a StorageConfig or None")
    given = {name: value for name, value in keywords.items() if value is not None}
    if not given:
        return storage
    names = ", ".join(f"{name}=" for name in given)
    if storage is not None:
        raise ConfigError(f"{owner}(): pass storage=StorageConfig(...) or the old keywords {names}, not both")
    config = StorageConfig(**given)
    warnings.warn(
        f"{owner}({names}) is deprecated and goes in the next release: pass "
        f"storage=StorageConfig({', '.join(f'{name}=...' for name in given)})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return config
