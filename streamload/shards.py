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
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .formats import Format, ShardReader, get_format
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ShardEntry
from .plan import Run
from .storage import Storage, open_storage

__all__ = ["DatasetRef", "ShardSource", "StorageConfig", "load_manifest"]

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
        cache_limit: Cache size bound (bytes or a string like ``"20GB"``).
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
    """

    def __init__(
        self, ref: DatasetRef, storage: Storage, capacity: int = DEFAULT_OPEN_READERS, *, own_storage: bool = False
    ) -> None:
        self.ref = ref
        self.storage = storage
        bound = storage.max_open(ref.manifest.largest_shard_bytes)
        self.capacity = max(1, capacity if bound is None else min(capacity, bound))
        self.opens = 0
        self._own_storage = own_storage
        self._format = ref.format
        self._open: OrderedDict[int, ShardReader] = OrderedDict()

    def __contains__(self, shard: int) -> bool:
        return shard in self._open

    def get(self, shard: int) -> ShardReader:
        """Return the open reader of ``shard`` (0-based position in the manifest), opening it if needed."""
        reader = self._open.get(shard)
        if reader is not None:
            self._open.move_to_end(shard)
            return reader
        while self._open and len(self._open) >= self.capacity:  # a bounded cache needs the room
            old_shard, old = self._open.popitem(last=False)
            old.close()
            self.release(old_shard)
        path, sidecar = self.acquire(shard)
        try:
            reader = self.open_reader(shard, path, sidecar)
        except BaseException:
            self.release(shard)
            raise
        self._open[shard] = reader
        return reader

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

    def read_ahead(self, runs: Iterator[Run], ahead: Iterator[int]) -> Iterator[Run]:
        """Pass ``runs`` through; when a run opens a shard, name the next shards to the storage's read-ahead.

        ``ahead`` yields one shard per change of shard in ``runs`` (the same plan), so the
        two stay in step; ``upcoming`` holds what was read from it early.
        """
        count = self.storage.read_ahead
        upcoming: deque[int] = deque()
        current = -1
        for run in runs:
            if run.shard != current:
                current = run.shard
                if upcoming:
                    upcoming.popleft()  # == run.shard
                else:
                    next(ahead, None)
                if count > 0 and run.shard not in self:
                    wanted = self._next_shards(upcoming, ahead, current, count)
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
        """Close every reader, release its files and cancel read-ahead (and close an owned storage)."""
        try:
            while self._open:
                shard, reader = self._open.popitem()
                reader.close()
                self.release(shard)
            if self.storage.read_ahead:
                self.storage.prefetch(())  # the epoch ended or was abandoned
        finally:
            if self._own_storage:
                self.storage.close()

    def __enter__(self) -> ShardSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
