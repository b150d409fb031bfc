"""Shard access: one process's open shards (how a dataset's files are reached: :mod:`streamload.storageconfig`).

:class:`ShardSource` is one process's open shards, the readers' cache: the format readers
over the files the storage acquires (downloading into the cache if remote), kept in a
bounded LRU (:meth:`~ShardSource.get`), evicted and their files released when closed. It
names no format: the manifest's does the reading. It calls nothing above it: the fetch
node (:class:`~streamload.ahead.FetchAhead`) owns the cold start (it opens a cold batch's
shards and asks for their samples' bytes, ends :attr:`~ShardSource.early` and tells the
storage at the first item) and fetch-ahead; a watched iteration's timing wraps the calls
into it from the nodes (and the :attr:`~ShardSource.view` put over streamed bytes).

The storage is told what each file must be (the manifest's entries); it never reads the
manifest itself (``docs/design.md#storage-and-the-cache``). Streaming, a remote shard is
not downloaded: its reader reads ranges fetched ahead for the planned batches
(:mod:`streamload.ahead`). A copy or a range found corrupt: :mod:`streamload.recovery`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from ._errors import ConfigError, CorruptShardError, StreamloadError
from ._files import FileEntry
from .formats import Format, ShardBytes, ShardReader
from .formats.base import RangedReads
from .manifest import Manifest, ShardEntry
from .recovery import Refetch
from .storage import Storage
from .storage.bytes import FileBytes, Landing
from .storage.executor import io_executor
from .storage.ranges import RangeFetcher
from .storageconfig import StorageConfig, can_stream, largest_sidecar

__all__ = ["ShardSet", "ShardSource"]

log = logging.getLogger("streamload")

#: Shard readers a process keeps open by default.
DEFAULT_OPEN_READERS = 8
#: Shard readers a streaming reader keeps open at least (each holds only its sidecar).
_STREAMING_READERS = 64


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
        early: A cold shard (cached mode, not cached yet) is opened over its download, each
            sample read as the part holding it lands (the cold start). The fetch node turns it
            off when the reader's first item is out.
        view: Streaming: a view put over each shard's ranged bytes before its reader gets
            them (a watched iteration times the reads through it), else ``None``.
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
        self.early = True
        self.view: Callable[[ShardBytes], ShardBytes] | None = None
        self._landings: dict[int, Landing] = {}  # shards read over their downloads (the cold start)
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
        reader = self._open_files(shard)
        self._open[shard] = reader
        return reader

    def _open_files(self, shard: int) -> ShardReader:
        """Acquire ``shard``'s files and build its reader (not kept in the LRU); release them on failure."""
        early = self._open_early(shard) if self._copies is not None else _open_in_place(self, shard)
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
            or not self.early
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
            reader = self._ranged_reader(shard, self.ref.where(entry), sidecar, got)
        except BaseException:
            got.close()
            self.release(shard)
            raise
        self._landings[shard] = got
        return reader

    @property
    def opens_early(self) -> bool:
        """:attr:`early`, cached, with room for one more reader: a cold shard opened now reads its download."""
        return self.early and self._copies is not None and not self.streaming and len(self._open) < self.capacity

    def landing(self, shard: int) -> tuple[RangedReads, Landing] | None:
        """Open ``shard``'s reader and the download it reads over, while that download lands; else ``None``."""
        landing = self._landings.get(shard)
        reader = self._open.get(shard)
        if landing is not None and not landing.done and isinstance(reader, RangedReads):
            return reader, landing
        return None

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
        self._landings.pop(shard, None)
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
            ranged = self.storage.open_bytes(entry, ranges=self.fetcher)
            return self._ranged_reader(shard, path, sidecar, ranged if self.view is None else self.view(ranged))
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
        """Close every reader, release its files and unregister (and close an owned storage).

        The read-ahead its fetch node asked for is the fetch node's to cancel
        (:meth:`FetchAhead.close <streamload.ahead.FetchAhead.close>`).
        """
        if self.fetcher is not None:
            self.fetcher.close()
        try:
            while self._open:
                shard, reader = self._open.popitem()
                reader.close()
                self.release(shard)
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


def _open_in_place(shards: ShardSource, shard: int) -> ShardReader | None:
    """A local shard read in place: its files checked, opened and its sidecar read in one native call.

    Opened the usual way, a shard makes a dozen system calls, each a release of the GIL
    (beside a thread running Python, each may wait up to the switch interval to take it
    back): here one. ``None``: not a local dataset, a format that reads its sidecar
    itself, or the native helper not built (the caller acquires and opens as usual).
    """
    entry = shards.ref.manifest.shards[shard]
    if entry.sidecar is None or not shards._format.takes_sidecar:  # (the caller asks for local datasets only)
        return None
    opened = shards.storage.open_in_place(entry, entry.sidecar)
    if opened is None:
        return None
    source = FileBytes(opened.fd, size=opened.size)
    try:
        reader = shards._format.open_reader(
            opened.path, entry, opened.sidecar_path, source=source, sidecar=opened.sidecar
        )
    except BaseException:
        source.close()  # (a reader that failed closes it too: closing twice is harmless)
        raise
    reader.num_classes = len(shards.ref.manifest.classes) or None
    shards.opens += 1
    return reader
