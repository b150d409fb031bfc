"""Shard access: how a dataset's files are reached, and one process's open shards.

* :class:`StorageConfig` is how a dataset's files are reached (fsspec options, cache,
  read-ahead, streaming), each field checked once; :func:`choose_streaming` is the one
  rule that decides cached or streamed. A dataset opened once with them is a
  :class:`~streamload.dataref.DatasetRef`.
* :class:`ShardSource` is one process's open shards: the format readers over the files
  the storage acquires (downloading into the cache if remote), kept in a bounded LRU,
  their files released when closed. It names no format: the manifest's does the reading.

The storage is told what each file must be (the manifest's entries); it never reads the
manifest itself (``docs/design.md#storage-and-the-cache``). Streaming, a remote shard is
not downloaded: its reader reads ranges fetched ahead for the planned batches
(:mod:`streamload.ahead`). A copy or a range found corrupt: :mod:`streamload.recovery`.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

from . import _env
from ._errors import ConfigError, CorruptShardError, StreamloadError
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
from .formats import Format, ShardBytes, ShardReader, get_format, set_row_group_cache_bytes
from .manifest import Manifest, ShardEntry, is_under
from .recovery import Refetch
from .storage import Storage, open_storage
from .storage.bytes import Landing
from .storage.config import check_flag, check_seconds, check_size
from .storage.executor import io_executor
from .storage.ranges import RangeFetcher

__all__ = [
    "ALLOW_DATA_ROOTS_ENV",
    "CACHE_MODES",
    "CacheMode",
    "ShardSet",
    "ShardSource",
    "StorageConfig",
    "can_stream",
    "choose_streaming",
    "largest_sidecar",
]

log = logging.getLogger("streamload")

#: Shard readers a process keeps open by default.
DEFAULT_OPEN_READERS = 8
#: Shard readers a streaming reader keeps open at least (each holds only its sidecar).
_STREAMING_READERS = 64


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


class ShardSet(Protocol):
    """The dataset a :class:`ShardSource` reads (a :class:`~streamload.dataref.DatasetRef`)."""

    @property
    def url(self) -> str:
        """The dataset's URL."""

    @property
    def manifest(self) -> Manifest:
        """Its validated manifest."""

    @property
    def config(self) -> StorageConfig:
        """How its files are reached."""

    @property
    def format(self) -> Format:
        """Its shard format."""

    @property
    def data_url(self) -> str:
        """Where its shard files are."""

    def where(self, entry: ShardEntry) -> str:
        """``<url>/<shard name>``, for messages."""


class ShardSource:
    """The shard readers one process has open, least recently used closed first.

    Args:
        ref: The dataset (a :class:`~streamload.dataref.DatasetRef`).
        storage: Where its files come from (see :meth:`DatasetRef.open_storage`).
        capacity: Readers kept open at most (fewer if a bounded cache cannot pin that many).
        own_storage: Close ``storage`` in :meth:`close`.
        streaming: Read the shards by ranged GETs instead of downloading them (see
            :meth:`DatasetRef.streams`; ranged formats of a remote dataset only). Only the
            sidecars go through the cache.

    Attributes:
        opens: How many times a shard was opened (a reader built).
        refetch: Drops corrupt copies of shards, once each (:class:`~streamload.recovery.Refetch`).
        fetcher: Streaming: the ranges fetched ahead (its ``stats`` count the GETs), else ``None``.

    Raises:
        CacheError: If the storage's cache cannot admit one more reader (see
            :mod:`streamload.storage.remote`).
    """

    def __init__(
        self,
        ref: ShardSet,
        storage: Storage,
        capacity: int = DEFAULT_OPEN_READERS,
        *,
        own_storage: bool = False,
        streaming: bool = False,
    ) -> None:
        self.ref = ref
        self.storage = storage
        self.opens = 0
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
        self.refetch = Refetch(ref.manifest.shards, ref.where, self._copies, self.fetcher, storage.describe)

    @property
    def recovered(self) -> set[int]:
        """Shards whose corrupt copies (streaming: fetched ranges) were dropped and fetched again."""
        return self.refetch.recovered

    @property
    def _largest_cached(self) -> int:
        manifest = self.ref.manifest
        return largest_sidecar(manifest) if self.streaming else manifest.largest_shard_bytes

    def _capacity(self) -> int:
        if self.streaming:  # a reader holds a sidecar (cached, small) and no shard
            return max(self._wanted, _STREAMING_READERS)
        bound = self.storage.max_open(self.ref.manifest.largest_shard_bytes)
        return max(1, self._wanted if bound is None else min(self._wanted, bound))

    def __contains__(self, shard: int) -> bool:
        return shard in self._open

    def get(self, shard: int) -> ShardReader:
        """Return the open reader of ``shard`` (0-based position in the manifest), opening it if needed.

        A corrupt cached copy met when opening is dropped and fetched again once (:attr:`refetch`).
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
        """Cached mode, before the first item (the cold start), a shard not cached yet: a reader over its download.

        Each sample is read as soon as the part holding it has landed, checked by its own
        digest (:meth:`~streamload.storage.Storage.open_bytes` with ``early=True``).
        ``None``: not applicable, or cached.
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
            return self._ranged_reader(shard, self.ref.where(entry), sidecar, got)
        except BaseException:
            got.close()
            self.release(shard)
            raise

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
        storage = self.storage
        if self.streaming:
            assert entry.sidecar is not None
            return self.ref.where(entry), storage.acquire(entry.sidecar)
        if entry.sidecar is None:
            return storage.acquire(entry), None
        if self._copies is None:  # local files: nothing to wait for
            path = storage.acquire(entry)
            try:
                return path, storage.acquire(entry.sidecar)
            except BaseException:
                storage.release(entry)
                raise
        # Remote: the sidecar comes by a GET of its own alongside the shard's parts (not after them).
        side = io_executor().submit("side", storage.acquire, entry.sidecar)
        try:
            path = storage.acquire(entry)
        except BaseException:
            if side.exception() is None:
                storage.release(entry.sidecar)
            raise
        try:
            return path, side.result()
        except BaseException:
            storage.release(entry)
            raise

    def release(self, shard: int) -> None:
        """Release ``shard``'s files (after its reader was closed)."""
        entry = self.ref.manifest.shards[shard]
        files: Iterable[FileEntry] = entry.files
        if self.streaming:
            files = () if entry.sidecar is None else (entry.sidecar,)
        for file in files:
            self.storage.release(file)

    def open_reader(self, shard: int, path: str, sidecar: str | None) -> ShardReader:
        """Build the format's reader over acquired files (not kept in the LRU)."""
        entry = self.ref.manifest.shards[shard]
        if self.fetcher is not None:
            return self._ranged_reader(shard, path, sidecar, self.storage.open_bytes(entry, ranges=self.fetcher))
        reader = self._format.reader(path, entry, sidecar)
        reader.num_classes = len(self.ref.manifest.classes) or None  # labels in an index are checked against it
        self.opens += 1
        return reader

    def _ranged_reader(self, shard: int, path: str, sidecar: str | None, source: ShardBytes) -> ShardReader:
        """The reader of a ranged format over ``source`` (positioned reads: ranged GETs, a download landing)."""
        entry = self.ref.manifest.shards[shard]
        # No header reads at open (round trips): the samples' checksums catch a mismatch.
        reader = self._format.open_reader(path, entry, sidecar, source=source, check_headers=False)
        reader.num_classes = len(self.ref.manifest.classes) or None
        self.opens += 1
        return reader

    def recover(self, shard: int, error: StreamloadError) -> ShardReader | None:
        """Reading ``shard`` failed with ``error``: if a cached copy is corrupt, return a reader over a fresh one.

        ``None`` when ``error`` is no corruption or the dataset is local. Whenever this
        raises (the shard is bad at its source, or no fresh copy could be had), the reader
        that failed stays open, for the caller to read what it can.
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
        """A read over several shards failed (a batch): drop whichever of their copies are corrupt.

        True if some were (their readers are closed: the next :meth:`get` reads fresh copies).
        """
        refetched = self.refetch(dict.fromkeys(shards), error)
        for shard in refetched:
            reader = self._open.pop(shard, None)
            if reader is not None:
                reader.close()
                self.release(shard)
        return bool(refetched)

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
