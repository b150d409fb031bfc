"""Shard access, in one place: open a dataset once, then open, keep and release its shards.

Everything that reads shards goes through here: :class:`~streamload.StreamingDataset`,
``streamload verify``, ``streamload info``, and a dataset used as a conversion source.

* :class:`DatasetRef` is a dataset opened once: its URL, its validated manifest, its
  format, and how to reach its files (storage options, cache). It is small and picklable
  (it holds no file, thread or connection), so DataLoader workers and conversion
  processes receive it and open their own storage.
* :class:`ShardSource` is one process's open shards: it acquires a shard and its sidecar
  from the storage (downloading into the cache if remote), builds the format's reader,
  keeps a bounded LRU of open readers, releases what it closes, and names the shards
  that come next to the storage's read-ahead.

The storage is told what each file must be (size, digest, algorithm: the manifest's
entries); it never reads the manifest itself. See ``docs/design.md#storage-and-the-cache``.

Streaming mode (``cache="none"``, or ``"auto"`` when the cache cannot hold what a
shuffle window needs): a remote tar shard is not downloaded; only its sidecar is cached
(verified by its manifest hash), and its reader reads the shard's bytes through a
:class:`~streamload.storage.bytes.StreamedFile`, served from the byte ranges fetched
ahead for the planned batches (:meth:`ShardSource.fetch_ahead`). A sample that fails its
checksum drops the shard's fetched ranges and is read once more from the bucket; bad
again, the shard is bad at its source.

Corrupt cached copies. A remote dataset's files are local *copies* (a storage whose
``cached`` is true); one can go bad on disk after it was verified, and the format reader's checksums
find it. Then :meth:`ShardSource.recover` (while reading) and :meth:`ShardSource.get` (when
opening) drop the bad copy and read a fresh download, once per shard and iteration: a
shard still bad then is bad at its source, and its error says so, naming the shard's
URL, the sample key and the cached path. A copy that hashes to its manifest entry is not
downloaded again (the same bytes would come), nor is a local dataset's own file ever touched.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict

import numpy as np

from . import _env
from ._errors import ConfigError, CorruptShardError, ManifestError, StreamloadError
from ._files import FileEntry
from ._stages import fetching
from ._units import format_bytes
from ._validate import (
    CACHE_MODES,
    CacheMode,
    check_allowed_roots,
    check_cache_dir,
    check_lock_timeout,
    check_read_ahead,
    check_storage_options,
    parse_cache_limit,
    parse_cache_mode,
    parse_stream_buffer,
)
from .formats import Format, ShardReader, get_format, set_row_group_cache_bytes
from .formats.tar import TarShardReader
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ShardEntry, data_root_place, is_under
from .plan import Run
from .storage import Storage, is_local, open_storage
from .storage.bytes import Landing
from .storage.config import check_flag, check_seconds, check_size
from .storage.executor import io_executor
from .storage.ranges import RangeFetcher, Ticket
from .storage.split import split_storage

__all__ = [
    "ALLOW_DATA_ROOTS_ENV",
    "CACHE_KEYWORDS",
    "CACHE_MODES",
    "CacheMode",
    "DatasetRef",
    "ShardSource",
    "STORAGE_KEYWORDS",
    "StorageConfig",
    "StorageKeywords",
    "CacheKeywords",
    "can_stream",
    "choose_streaming",
    "load_manifest",
    "storage_config",
]

log = logging.getLogger("streamload")

#: Shard readers a process keeps open by default.
DEFAULT_OPEN_READERS = 8
#: How many shard changes ahead a reader looks for shards to name to the read-ahead.
_READ_AHEAD_SCAN = 64
#: Shard readers a streaming reader keeps open at least (each holds only its sidecar).
_STREAMING_READERS = 64

#: Datasets whose "auto" choice this process logged already.
_LOGGED_AUTO: set[str] = set()


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


def _largest_sidecar(manifest: Manifest) -> int:
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

    def open(self, url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
        """Return a new storage for the dataset at ``url`` in this process.

        Args:
            url: The dataset's (or a data root's) URL or path.
            storage_options: fsspec options to use instead of :attr:`storage_options`
                (a data root on another host gets its own, never the dataset's).
        """
        options = self.options if storage_options is None else dict(storage_options)
        if self.parquet_cache is not None:  # the row-group budget is the process's (set in each worker)
            set_row_group_cache_bytes(self.parquet_cache)
        return open_storage(
            url,
            options,
            self.cache_dir,
            self.cache_limit,
            self.read_ahead,
            lock_timeout=self.lock_timeout,
            retry_timeout=self.retry_timeout,
            read_timeout=self.read_timeout,
            s3_direct=self.s3_direct,
            cache_shared=self.cache_shared,
        )

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


def storage_config(
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


def load_manifest(storage: Storage, url: str) -> Manifest:
    """Read and validate ``index.json`` through ``storage`` (at most :data:`MAX_MANIFEST_BYTES`).

    Raises:
        ManifestNotFoundError: If there is none (the message suggests ``streamload index``).
        ManifestError: If it is malformed.
    """
    where = f"{url.rstrip('/')}/{MANIFEST_NAME}"
    missing = (
        f"{where} does not exist: is {url!r} a streamload dataset? "
        "(for tar shards written by other tools, run `streamload index`)"
    )
    raw = storage.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES, not_found=missing)
    return Manifest.loads(raw, where=where)


@dataclass(frozen=True)
class DatasetRef:
    """A dataset opened once: URL, manifest, format and storage settings (picklable, no I/O).

    Attributes:
        url: Dataset directory or URL prefix.
        manifest: The validated ``index.json``.
        config: How to reach the files.
    """

    url: str
    manifest: Manifest
    config: StorageConfig = field(default_factory=StorageConfig)

    @classmethod
    def open(cls, url: str, config: StorageConfig | None = None) -> DatasetRef:
        """Read the manifest of the dataset at ``url`` and check the storage can serve its shards.

        Raises:
            ManifestNotFoundError: If ``url`` holds no ``index.json``.
            ManifestError: If the manifest is malformed.
            CacheError: If the cache limit cannot hold the largest shards.
            ConfigError: If the URL's protocol or its storage options are unusable.
        """
        config = (config or StorageConfig()).with_cache("shards")
        url = str(url)
        storage = config.open(url)
        try:
            manifest = load_manifest(storage, url)
            storage = _with_data_root(url, manifest, config, storage)
            config = _choose_mode(url, manifest, storage, config)
            storage.check_capacity(_largest_cached(manifest, config))
            if config.cache_limit is None and storage.cached and storage.default_limit:
                # The default bound, chosen once here: every worker and rank gets the same number.
                config = replace(config, cache_limit=storage.default_limit)
        finally:
            storage.close()
        get_format(manifest.format)  # an unknown format or a missing package fails now
        return cls(url, manifest, config)

    @property
    def format(self) -> Format:
        """The shard format."""
        return get_format(self.manifest.format)

    @property
    def data_url(self) -> str:
        """Where the shard files are: the manifest's ``data_root``, else the dataset's URL."""
        return self.manifest.data_root or self.url

    def open_storage(self) -> Storage:
        """Return a new storage for this dataset's files, in this process."""
        storage = _with_data_root(self.url, self.manifest, self.config, self.config.open(self.url))
        storage.check_capacity(_largest_cached(self.manifest, self.config))
        return storage

    def streams(self, storage: Storage, shards_at_once: int) -> bool:
        """Whether this process reads the shards by ranges (streaming mode) rather than through the cache.

        Args:
            storage: This process's storage of the dataset.
            shards_at_once: Shards the readers of this machine keep open at once (the
                shards one shuffle window spans, times the readers); ``"auto"`` streams
                when the cache limit cannot hold that many of the largest shards.
        """
        if not storage.cached:
            return False  # a local dataset is read in place
        why = choose_streaming(
            self.config.cache or "shards",
            can_stream(self.manifest),
            storage.limit,
            shards_at_once,
            self.manifest.largest_shard_bytes,
        )
        if why is not None and why != "none":
            _log_auto(self.url, why + " (a shuffle window's shards x the readers of this machine)")
        return why is not None

    def where(self, entry: ShardEntry) -> str:
        """Return ``<url>/<shard name>`` for messages (the data root's URL for an index kept apart)."""
        return f"{self.data_url.rstrip('/')}/{entry.name}"


def _with_data_root(url: str, manifest: Manifest, config: StorageConfig, storage: Storage) -> Storage:
    """The dataset's storage: ``storage`` itself, or with the shards from the manifest's ``data_root``.

    A ``data_root`` is honoured only for formats read in place (whose files streamload
    never writes), and a manifest read from a remote URL may not name local files.
    ``storage`` is closed on failure.

    Raises:
        ManifestError: If the manifest's ``data_root`` may not be used.
    """
    root = manifest.data_root
    if root is None:
        return storage
    try:
        fmt = get_format(manifest.format)
        if fmt.writable:
            raise ManifestError(
                f"{url}/{MANIFEST_NAME}: data_root is only for formats read in place (parquet), not {fmt.name}"
            )
        data = config.open(root, _data_root_options(url, root, config))
    except BaseException:
        storage.close()
        raise
    largest_sidecar = _largest_sidecar(manifest)
    return split_storage(storage, data, [s.name for s in manifest.shards], largest_sidecar)


def _data_root_options(url: str, root: str, config: StorageConfig) -> dict[str, Any] | None:
    """The ``storage_options`` a manifest's ``data_root`` is read with (``None``: the dataset's own).

    A manifest read from a local path may name any root (it is the caller's own file).
    One read from a URL may name only files under the same scheme and host (bucket) as
    its own, read with the dataset's options; a root elsewhere only if the caller allowed
    it (:attr:`StorageConfig.allow_data_roots`), read with the options given for it; and
    never local files (a path, ``file://``, ``local://``).

    Raises:
        ManifestError: If the root may not be used, naming it and how to allow it.
    """
    if is_local(url):
        return None
    where = f"{url}/{MANIFEST_NAME}"
    if is_local(root):
        raise ManifestError(f"{where}: a manifest read from a URL may not name local files (data_root={root!r})")
    if data_root_place(root) == data_root_place(url):
        return None
    options = config.data_root_options(root)
    if options is None:
        scheme, host = data_root_place(url)
        raise ManifestError(
            f"{where}: data_root={root!r} is not under {scheme}://{host}, where the manifest was read; "
            f"a manifest read from a URL may only send readers to its own scheme and host (bucket). "
            f"To read it anyway, name it: StorageConfig(allow_data_roots=[{root!r}]) "
            f"(or --allow-data-root {root} on the command line)"
        )
    return options


def _log_auto(url: str, why: str) -> None:
    if url not in _LOGGED_AUTO:
        _LOGGED_AUTO.add(url)
        log.info(
            '%s: cache="auto" streams samples by ranged GETs (only sidecars are cached): %s; '
            'pass storage=StorageConfig(cache="shards") to cache whole shards anyway',
            url,
            why,
        )


def _choose_mode(url: str, manifest: Manifest, storage: Storage, config: StorageConfig) -> StorageConfig:
    """Check ``config.cache`` against the dataset; ``"auto"`` becomes ``"none"`` where caching cannot work.

    Raises:
        ConfigError: ``cache="none"`` for a remote dataset whose shards cannot be streamed.
    """
    remote = storage.cached
    if config.cache == "none" and remote and not can_stream(manifest):
        what = f"{manifest.format} shards" if manifest.format != "tar" else "tar shards without sidecars"
        raise ConfigError(
            f'cache="none" cannot stream {url}: its {what} cannot be read by byte ranges (only tar shards '
            'with sidecars can; build them with `streamload index`); use cache="shards" or "auto"'
        )
    if config.cache == "auto" and remote:
        from .storage.remote import MIN_CACHE_SHARDS

        # Whatever the readers: the cache must hold two of the largest shards to cache at all.
        why = choose_streaming(
            "auto", can_stream(manifest), storage.limit, MIN_CACHE_SHARDS, manifest.largest_shard_bytes
        )
        if why is not None:
            _log_auto(url, why)
            return replace(config, cache="none")
    return config


def _largest_cached(manifest: Manifest, config: StorageConfig) -> int:
    """The largest set of files a reader keeps in the cache: a shard with its sidecar, or a sidecar when streaming."""
    return _largest_sidecar(manifest) if config.cache == "none" else manifest.largest_shard_bytes


class ShardSource:
    """The shard readers one process has open, least recently used closed first.

    Args:
        ref: The dataset.
        storage: Where its files come from (see :meth:`DatasetRef.open_storage`).
        capacity: Readers kept open at most (fewer if a bounded cache cannot pin that many).
        own_storage: Close ``storage`` in :meth:`close`.
        streaming: Read the shards by ranged GETs instead of downloading them (see
            :meth:`DatasetRef.streams`; tar shards of a remote dataset only). Only the
            sidecars go through the cache.
        stream_buffer: Streaming: bytes of ranges fetched ahead (the caller's budget, see
            :meth:`fetch_ahead`).

    Attributes:
        opens: How many times a shard was opened (a reader built).
        recovered: Shards whose corrupt cached copies were dropped and fetched again
            (streaming: whose fetched ranges were dropped and read again).
        fetcher: Streaming: the ranges fetched ahead (its ``stats`` count the GETs), else ``None``.

    Raises:
        CacheError: If the storage's cache cannot admit one more reader (see
            :mod:`streamload.storage.remote`).
    """

    def __init__(
        self,
        ref: DatasetRef,
        storage: Storage,
        capacity: int = DEFAULT_OPEN_READERS,
        *,
        own_storage: bool = False,
        streaming: bool = False,
    ) -> None:
        self.ref = ref
        self.storage = storage
        self.opens = 0
        self.recovered: set[int] = set()
        self._wanted = capacity
        self._own_storage = own_storage
        self._format = ref.format
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        self._started = False  # the reader made its first item: no more shards opened over their downloads
        self._copies = storage if storage.cached else None
        self.streaming = streaming and self._copies is not None
        if self.streaming and not can_stream(ref.manifest):
            raise ConfigError(f"{ref.url}: {ref.manifest.format} shards cannot be streamed by byte ranges")
        self.fetcher: RangeFetcher | None = None
        if self.streaming:
            self.fetcher = storage.open_ranges()  # its GETs start with the first fetch
        if self._copies is not None:
            self._copies.register_reader(self._largest_cached)
        self.capacity = self._capacity()

    @property
    def _largest_cached(self) -> int:
        manifest = self.ref.manifest
        return _largest_sidecar(manifest) if self.streaming else manifest.largest_shard_bytes

    def _capacity(self) -> int:
        if self.streaming:  # a reader holds a sidecar (cached, small) and no shard
            return max(self._wanted, _STREAMING_READERS)
        bound = self.storage.max_open(self.ref.manifest.largest_shard_bytes)
        return max(1, self._wanted if bound is None else min(self._wanted, bound))

    def __contains__(self, shard: int) -> bool:
        return shard in self._open

    def get(self, shard: int) -> ShardReader:
        """Return the open reader of ``shard`` (0-based position in the manifest), opening it if needed.

        A corrupt cached copy met when opening is dropped and fetched again once (see
        :meth:`recover`).
        """
        reader = self._open.get(shard)
        if reader is not None:
            self._open.move_to_end(shard)
            return reader
        if self._copies is not None:
            self.capacity = self._capacity()  # the readers sharing the cache come and go
        while self._open and len(self._open) >= self.capacity:  # a bounded cache needs the room
            old_shard, old = self._open.popitem(last=False)
            old.close()
            self.release(old_shard)
        with fetching():  # a watched loader's "fetch" stage: download or cache wait, and the open
            reader = self._open_files(shard)
        self._open[shard] = reader
        return reader

    def _open_files(self, shard: int) -> ShardReader:
        """Acquire ``shard``'s files and build its reader (not kept in the LRU); release them on failure."""
        early = self._open_early(shard)
        if early is not None:
            return early
        vanished = False
        while True:
            path, sidecar = self.acquire(shard)
            try:
                return self.open_reader(shard, path, sidecar)
            except CorruptShardError as exc:
                self.release(shard)
                if not self.refetch([shard], exc):
                    raise
            except FileNotFoundError:
                self.release(shard)
                if self._copies is None or vanished:
                    raise
                vanished = True  # deleted as corrupt by another reader since it was looked up: look again
            except BaseException:
                self.release(shard)
                raise

    def _open_early(self, shard: int) -> ShardReader | None:
        """Cached mode, a shard opened before the first item, not cached yet: a reader over its download in progress.

        Only before the reader's first item (the cold start: the shards its first batch
        draws on, whose downloads read-ahead started side by side; later shards are
        fetched ahead of the reader, and read-ahead's cache room is planned for whole files).

        The shard's download starts in a thread of the storage, the sidecar is acquired
        meanwhile, and the reader reads each sample as soon as the part holding it has
        landed (:meth:`~streamload.storage.Storage.open_bytes` with ``early=True``), checked
        by the sample's own digest as every read is; the whole file is still hash-checked
        before it counts as cached. ``None``: not applicable, or the shard is cached
        already (the caller opens it as usual).
        """
        copies = self._copies
        entry = self.ref.manifest.shards[shard]
        if (
            copies is None
            or self.streaming
            or entry.sidecar is None
            or not self._format.ranged  # the reader must take its bytes as positioned reads (source=)
            or shard in self.recovered
            or self._started
        ):
            return None
        got = copies.open_bytes(entry, early=True)  # a miss starts the shard's download and returns at once
        if not isinstance(got, Landing):  # cached: the usual reader (and its checks at open)
            got.close()
            self.storage.release(entry)
            return None
        try:
            sidecar = self.storage.acquire(entry.sidecar)  # meanwhile, alongside the shard's parts
        except BaseException:
            got.close()
            self.storage.release(entry)
            raise
        try:
            ranged: Any = self._format.reader  # a ranged format's reader takes source= (see open_reader)
            reader: ShardReader = ranged(self.ref.where(entry), entry, sidecar, source=got, check_headers=False)
            reader.num_classes = len(self.ref.manifest.classes) or None
        except BaseException:
            got.close()
            self.release(shard)
            raise
        self.opens += 1
        return reader

    def started(self) -> None:
        """The reader made its first item: the storage's read-ahead, held for the first bytes, may start."""
        self._started = True
        if self._copies is not None:
            self._copies.started()

    def acquire(self, shard: int) -> tuple[str, str | None]:
        """Acquire ``shard``'s files from the storage; return local ``(shard path, sidecar path)``.

        Each acquire must be paired with :meth:`release`. Streaming, only the sidecar is
        acquired; the shard's "path" is its URL (named in messages).
        """
        entry = self.ref.manifest.shards[shard]
        if self.streaming:
            assert entry.sidecar is not None
            return self.ref.where(entry), self.storage.acquire(entry.sidecar)
        if entry.sidecar is None:
            return self.storage.acquire(entry), None
        if self._copies is None:  # local files: nothing to wait for
            return self._acquire_both(entry, entry.sidecar)
        # Remote: the sidecar comes by a GET of its own alongside the shard's parts (not after them).
        side = io_executor().submit("side", self.storage.acquire, entry.sidecar)
        try:
            path = self.storage.acquire(entry)
        except BaseException:
            if side.exception() is None:
                self.storage.release(entry.sidecar)
            raise
        try:
            sidecar = side.result()
        except BaseException:
            self.storage.release(entry)
            raise
        return path, sidecar

    def _acquire_both(self, entry: ShardEntry, sidecar_entry: FileEntry) -> tuple[str, str]:
        path = self.storage.acquire(entry)
        try:
            sidecar = self.storage.acquire(sidecar_entry)
        except BaseException:
            self.storage.release(entry)
            raise
        return path, sidecar

    def release(self, shard: int) -> None:
        """Release ``shard``'s files (after its reader was closed)."""
        entry = self.ref.manifest.shards[shard]
        if self.streaming:
            if entry.sidecar is not None:
                self.storage.release(entry.sidecar)
            return
        for file in entry.files:
            self.storage.release(file)

    def open_reader(self, shard: int, path: str, sidecar: str | None) -> ShardReader:
        """Build the format's reader over acquired files (not kept in the LRU)."""
        entry = self.ref.manifest.shards[shard]
        if self.fetcher is not None:
            source = self.storage.open_bytes(entry, ranges=self.fetcher)
            # No header reads at open (two round trips): the samples' checksums catch a mismatch.
            ranged: Any = self._format.reader  # tar and parquet readers take ranged reads as source=
            reader: ShardReader = ranged(path, entry, sidecar, source=source, check_headers=False)
        else:
            reader = self._format.reader(path, entry, sidecar)
        reader.num_classes = len(self.ref.manifest.classes) or None  # labels in an index are checked against it
        self.opens += 1
        return reader

    # -- streaming: ranges fetched ahead -------------------------------------------------

    def fetch_ahead(self, parts: Iterable[tuple[int, np.ndarray]]) -> Ticket | None:
        """Streaming: start fetching the byte ranges of a planned batch's samples (``(shard, locals)``).

        Opens the shards' readers (their sidecars) to learn the samples' extents. A shard
        that cannot be opened is left out: its error comes when the batch is read.
        Returns the ticket to :meth:`forget` once the batch was read (``None``: not streaming).
        """
        fetcher = self.fetcher
        if fetcher is None:
            return None
        by_shard: dict[int, list[np.ndarray]] = {}
        for shard, locals_ in parts:
            by_shard.setdefault(shard, []).append(np.asarray(locals_, dtype=np.int64))
        self._warm_sidecars([s for s in by_shard if s not in self._open])
        wanted: list[tuple[str, int, list[tuple[int, int]]]] = []
        for shard, chunks in by_shard.items():
            try:
                reader = self.get(shard)
            except StreamloadError:
                continue
            assert isinstance(reader, TarShardReader) or hasattr(reader, "sample_extents")
            extents = reader.sample_extents(np.concatenate(chunks) if len(chunks) > 1 else chunks[0])
            entry = self.ref.manifest.shards[shard]
            wanted.append((entry.name, entry.num_bytes, [(int(a), int(b)) for a, b in extents.tolist()]))
        return fetcher.fetch(wanted)

    def _warm_sidecars(self, shards: list[int]) -> None:
        """Bring the sidecars of several shards about to open into the cache at once (one round trip, not one each)."""
        if len(shards) < 2 or self.fetcher is None:
            return
        storage = self.storage
        sidecars = [e.sidecar for e in (self.ref.manifest.shards[s] for s in shards) if e.sidecar is not None]

        def warm(entry: FileEntry) -> Callable[[], None]:
            def call() -> None:
                storage.acquire(entry)
                storage.release(entry)  # cached, unpinned: the reader's own acquire pins it

            return call

        self.fetcher.run([warm(entry) for entry in sidecars])

    def forget(self, ticket: Ticket | None) -> None:
        """Drop the ranges fetched for a batch that was read (see :meth:`fetch_ahead`)."""
        if ticket is not None and self.fetcher is not None:
            self.fetcher.forget(ticket)

    # -- corrupt cached copies ---------------------------------------------------------

    def recover(self, shard: int, error: StreamloadError) -> ShardReader | None:
        """Reading ``shard`` failed with ``error``: if a cached copy is corrupt, return a reader over a fresh one.

        The caller reads the rest of its samples from the returned reader. ``None`` when
        ``error`` is no corruption or the dataset is local (its files are never touched).

        Raises:
            CorruptShardError: If the shard is bad at its source (see :meth:`refetch`).
            StreamloadError: If the fresh copy cannot be had (the download failed) or fails
                when opened. Whenever this raises, the reader that failed stays open, for
                the caller to read what it can.
        """
        if not self.refetch([shard], error):
            return None
        old = self._open.pop(shard, None)
        if old is not None:
            self.release(shard)  # its files stay readable through its descriptors
        try:
            fresh = self._open_files(shard)
        except BaseException:
            if old is not None:
                self._open[shard] = old  # no pins now; releasing again at close is harmless
            raise
        if old is not None:
            old.close()
        self._open[shard] = fresh
        return fresh

    def recover_any(self, shards: Iterable[int], error: StreamloadError) -> bool:
        """A read over several shards failed (a batch): drop whichever of their cached copies are corrupt.

        Returns:
            True if some were (their open readers are closed: the next :meth:`get` reads
            fresh copies, so the caller reads again); False as :meth:`recover` returns ``None``.

        Raises:
            CorruptShardError: If they are bad at their source (see :meth:`refetch`).
        """
        refetched = self.refetch(dict.fromkeys(shards), error)
        for shard in refetched:
            reader = self._open.pop(shard, None)
            if reader is not None:
                reader.close()
                self.release(shard)
        return bool(refetched)

    def refetch(self, shards: Iterable[int], error: BaseException) -> list[int]:
        """Drop the corrupt cached copies of ``shards`` (``error`` was met reading them); return the shards dropped.

        Each shard is fetched again at most once per source; open readers are left alone
        (the next acquire of a dropped file downloads it). In streaming mode the shard's
        fetched ranges are dropped instead (and its cached sidecar, if that copy went
        bad), so the next read goes to the bucket. Returns ``[]`` for a local dataset or
        an error that is no corruption.

        Raises:
            CorruptShardError: If none was dropped because they are bad at their source:
                a copy downloaded again already failed, or the cached copies hash to their
                manifest entries (a download would bring the same bytes). The message
                starts with the shard's URL and says which.
        """
        if self._copies is None or not isinstance(error, CorruptShardError):
            return []
        again = (
            "read again from the bucket after the first read failed"
            if self.fetcher is not None
            else "in a copy downloaded again after the cached one was corrupt"
        )
        dropped: list[int] = []
        bad: list[str] = []
        for shard in shards:
            entry = self.ref.manifest.shards[shard]
            if shard in self.recovered:
                bad.append(f"{self.ref.where(entry)}: {error} ({again}: the shard is bad at its source)")
                continue
            if self.fetcher is not None:  # streaming: drop the fetched ranges (and a sidecar copy gone bad)
                self.fetcher.drop(entry.name)
                if entry.sidecar is not None:
                    self._copies.discard(entry.sidecar)  # only if its copy no longer hashes to its entry
                log.warning("%s: %s; reading its bytes from the bucket again", self.ref.where(entry), error)
            else:
                files = [f.name for f in entry.files if self._copies.discard(f)]
                if not files:
                    bad.append(
                        f"{self.ref.where(entry)}: {error} (its cached copy, {self.storage.describe()}, matches "
                        "the manifest's hash: the shard is bad at its source; not downloaded again)"
                    )
                    continue
                log.warning(
                    "%s: a cached copy is corrupt (%s); deleted %s from %s, downloading again",
                    self.ref.where(entry),
                    error,
                    ", ".join(files),
                    self.storage.describe(),
                )
            self.recovered.add(shard)
            dropped.append(shard)
        if not dropped and bad:
            raise CorruptShardError("; ".join(bad)) from error
        return dropped

    # -- read-ahead --------------------------------------------------------------------

    def read_ahead(self, runs: Iterator[Run], ahead: Iterator[int]) -> Iterator[Run]:
        """Pass ``runs`` through; when a run opens a shard, name the next shards to the storage's read-ahead.

        ``ahead`` yields one shard per change of shard in ``runs`` (the same plan), so the
        two stay in step; ``upcoming`` holds what was read from it early. How many are
        named is asked of the storage at each shard opened (:meth:`Storage.ahead_depth`:
        a remote storage adapts it to the measured download and reading times).

        At the iteration's first shard, the shards the reader's plan comes back to before
        it leaves them (a shuffled reader's first batches draw on all of its partitions'
        shards: :meth:`_working_set`) are named too, in order of use, to be fetched at once
        and side by side: the first batch needs every one of them.
        """
        enabled = self.storage.read_ahead > 0
        upcoming: deque[int] = deque()
        current = -1
        first = True
        for run in runs:
            if run.shard != current:
                current = run.shard
                if upcoming:
                    upcoming.popleft()  # == run.shard
                else:
                    next(ahead, None)
                if enabled and run.shard not in self:
                    together = self._working_set(upcoming, ahead, current, self.capacity - 1) if first else []
                    depth = max(1, self.storage.ahead_depth(), len(together))
                    wanted = self._next_shards(upcoming, ahead, current, depth)
                    if wanted:
                        shards = self.ref.manifest.shards
                        names = [f.name for s in together for f in shards[s].files]
                        self.storage.fetch_ahead([f for s in wanted for f in shards[s].files], names)
                first = False
            yield run

    def _working_set(self, upcoming: deque[int], ahead: Iterator[int], current: int, most: int) -> list[int]:
        """The unopened shards read together with ``current``, in order of first use; ``[]`` if none.

        The distinct shards after ``current`` up to the first the plan comes back to (one
        named already, or ``current`` itself): the reader holds them all open and reads
        them in turn, as a shuffled reader does with its partitions' shards. An unshuffled
        reader leaves each shard for good: nothing comes back, and nothing is named here.
        Nor when more than ``most`` shards come before the plan comes back (the reader
        could not keep them all open).
        """
        seen = [current]
        index = 0
        while index < _READ_AHEAD_SCAN:
            if index == len(upcoming):
                shard = next(ahead, None)
                if shard is None:
                    break
                upcoming.append(shard)
            shard = upcoming[index]
            index += 1
            if shard in seen:
                return [s for s in seen[1:] if s not in self]
            if len(seen) > most:
                break
            seen.append(shard)
        return []

    def _next_shards(self, upcoming: deque[int], ahead: Iterator[int], current: int, count: int) -> list[int]:
        """Return up to ``count`` distinct unopened shards that come after ``current``, in order of first use."""
        out: list[int] = []
        index = 0
        while len(out) < count and index < _READ_AHEAD_SCAN:
            if index == len(upcoming):
                shard = next(ahead, None)
                if shard is None:
                    break
                upcoming.append(shard)
            shard = upcoming[index]
            index += 1
            if shard != current and shard not in out and shard not in self:
                out.append(shard)
        return out

    def close(self) -> None:
        """Close every reader, release its files, cancel read-ahead and unregister (and close an owned storage)."""
        if self.fetcher is not None:
            self.fetcher.close()
        try:
            while self._open:
                shard, reader = self._open.popitem()
                reader.close()
                self.release(shard)
            if self.storage.read_ahead:
                self.storage.fetch_ahead(())  # the epoch ended or was abandoned
        finally:
            copies, self._copies = self._copies, None
            try:
                if copies is not None:
                    copies.unregister_reader()
            finally:
                if self._own_storage:
                    self.storage.close()

    def __enter__(self) -> ShardSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
