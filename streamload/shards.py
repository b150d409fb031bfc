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

Corrupt cached copies. A remote dataset's files are local *copies* (a :class:`CachedCopies`
storage); one can go bad on disk after it was verified, and the format reader's checksums
find it. Then :meth:`ShardSource.recover` (while reading) and :meth:`ShardSource.get` (when
opening) drop the bad copy and read a fresh download, once per shard and iteration: a
shard still bad then is bad at its source, and its error says so, naming the shard's
URL, the sample key and the cached path. A copy that hashes to its manifest entry is not
downloaded again (the same bytes would come), nor is a local dataset's own file ever touched.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from ._errors import CorruptShardError, StreamloadError
from ._files import FileEntry
from .formats import Format, ShardReader, get_format
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ShardEntry
from .plan import Run
from .storage import Storage, open_storage

__all__ = ["CachedCopies", "DatasetRef", "ShardSource", "StorageConfig", "load_manifest"]

log = logging.getLogger("streamload")

#: Shard readers a process keeps open by default.
DEFAULT_OPEN_READERS = 8
#: How many shard changes ahead a reader looks for shards to name to the read-ahead.
_READ_AHEAD_SCAN = 64


@dataclass(frozen=True)
class StorageConfig:
    """How to reach a dataset's files: fsspec options and the local cache (remote URLs only).

    Attributes:
        storage_options: Passed to fsspec (credentials, endpoint...).
        cache_dir: Local cache directory for remote shards.
        cache_limit: Cache size bound (bytes or a string like ``"20GB"``; ``None``: the
            default bound, ``"unbounded"``: none; see :mod:`streamload.storage.remote`).
        read_ahead: Shards downloaded ahead per process (``None``: the default).
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    cache_limit: int | str | None = None
    read_ahead: int | None = None

    def open(self, url: str) -> Storage:
        """Return a new storage for the dataset at ``url`` in this process."""
        return open_storage(url, self.storage_options, self.cache_dir, self.cache_limit, self.read_ahead)


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


@runtime_checkable
class CachedCopies(Protocol):
    """A storage whose files are local copies of remote ones, in a cache shared by the readers of a machine.

    (:class:`~streamload.storage.remote.RemoteStorage`; a local dataset's storage is not one.)
    """

    #: The cache bound the storage chose itself (no ``cache_limit`` was given), else ``None``.
    default_limit: int | None

    def discard(self, entry: FileEntry) -> bool:
        """Drop the copy of ``entry`` a reader found corrupt; True if the next acquire brings another."""

    def register_reader(self, largest: int) -> None:
        """A reader of shards of up to ``largest`` bytes starts (admission; may raise ``CacheError``)."""

    def unregister_reader(self) -> None:
        """A reader ended."""


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
        config = config or StorageConfig()
        url = str(url)
        storage = config.open(url)
        try:
            manifest = load_manifest(storage, url)
            storage.check_capacity(manifest.largest_shard_bytes)
            if config.cache_limit is None and isinstance(storage, CachedCopies) and storage.default_limit:
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

    def open_storage(self) -> Storage:
        """Return a new storage for this dataset's files, in this process."""
        storage = self.config.open(self.url)
        storage.check_capacity(self.manifest.largest_shard_bytes)
        return storage

    def where(self, entry: ShardEntry) -> str:
        """Return ``<url>/<shard name>`` for messages."""
        return f"{self.url.rstrip('/')}/{entry.name}"


class ShardSource:
    """The shard readers one process has open, least recently used closed first.

    Args:
        ref: The dataset.
        storage: Where its files come from (see :meth:`DatasetRef.open_storage`).
        capacity: Readers kept open at most (fewer if a bounded cache cannot pin that many).
        own_storage: Close ``storage`` in :meth:`close`.

    Attributes:
        opens: How many times a shard was opened (a reader built).
        recovered: Shards whose corrupt cached copies were dropped and fetched again.

    Raises:
        CacheError: If the storage's cache cannot admit one more reader (see
            :mod:`streamload.storage.remote`).
    """

    def __init__(
        self, ref: DatasetRef, storage: Storage, capacity: int = DEFAULT_OPEN_READERS, *, own_storage: bool = False
    ) -> None:
        self.ref = ref
        self.storage = storage
        self.opens = 0
        self.recovered: set[int] = set()
        self._wanted = capacity
        self._own_storage = own_storage
        self._format = ref.format
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        self._copies = storage if isinstance(storage, CachedCopies) else None
        if self._copies is not None:
            self._copies.register_reader(ref.manifest.largest_shard_bytes)
        self.capacity = self._capacity()

    def _capacity(self) -> int:
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
        reader = self._open_files(shard)
        self._open[shard] = reader
        return reader

    def _open_files(self, shard: int) -> ShardReader:
        """Acquire ``shard``'s files and build its reader (not kept in the LRU); release them on failure."""
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

    def acquire(self, shard: int) -> tuple[str, str | None]:
        """Acquire ``shard``'s files from the storage; return local ``(shard path, sidecar path)``.

        Each acquire must be paired with :meth:`release`.
        """
        entry = self.ref.manifest.shards[shard]
        path = self.storage.acquire(entry)
        try:
            sidecar = self.storage.acquire(entry.sidecar) if entry.sidecar else None
        except BaseException:
            self.storage.release(entry)
            raise
        return path, sidecar

    def release(self, shard: int) -> None:
        """Release ``shard``'s files (after its reader was closed)."""
        for entry in self.ref.manifest.shards[shard].files:
            self.storage.release(entry)

    def open_reader(self, shard: int, path: str, sidecar: str | None) -> ShardReader:
        """Build the format's reader over acquired files (not kept in the LRU)."""
        reader = self._format.reader(path, self.ref.manifest.shards[shard], sidecar)
        self.opens += 1
        return reader

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
        (the next acquire of a dropped file downloads it). Returns ``[]`` for a local
        dataset or an error that is no corruption.

        Raises:
            CorruptShardError: If none was dropped because they are bad at their source:
                a copy downloaded again already failed, or the cached copies hash to their
                manifest entries (a download would bring the same bytes). The message
                starts with the shard's URL and says which.
        """
        if self._copies is None or not isinstance(error, CorruptShardError):
            return []
        dropped: list[int] = []
        bad: list[str] = []
        for shard in shards:
            entry = self.ref.manifest.shards[shard]
            if shard in self.recovered:
                bad.append(
                    f"{self.ref.where(entry)}: {error} (in a copy downloaded again after the cached one was "
                    "corrupt: the shard is bad at its source)"
                )
                continue
            files = [f.name for f in entry.files if self._copies.discard(f)]
            if not files:
                bad.append(
                    f"{self.ref.where(entry)}: {error} (its cached copy, {self.storage.describe()}, matches "
                    "the manifest's hash: the shard is bad at its source; not downloaded again)"
                )
                continue
            self.recovered.add(shard)
            dropped.append(shard)
            log.warning(
                "%s: a cached copy is corrupt (%s); deleted %s from %s, downloading again",
                self.ref.where(entry),
                error,
                ", ".join(files),
                self.storage.describe(),
            )
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
        """
        enabled = self.storage.read_ahead > 0
        upcoming: deque[int] = deque()
        current = -1
        for run in runs:
            if run.shard != current:
                current = run.shard
                if upcoming:
                    upcoming.popleft()  # == run.shard
                else:
                    next(ahead, None)
                if enabled and run.shard not in self:
                    wanted = self._next_shards(upcoming, ahead, current, max(1, self.storage.ahead_depth()))
                    if wanted:
                        shards = self.ref.manifest.shards
                        self.storage.prefetch([f for s in wanted for f in shards[s].files])
            yield run

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
        try:
            while self._open:
                shard, reader = self._open.popitem()
                reader.close()
                self.release(shard)
            if self.storage.read_ahead:
                self.storage.prefetch(())  # the epoch ended or was abandoned
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
