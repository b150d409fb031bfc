"""A dataset whose index lives apart from its files: sidecars from one storage, shards from another.

``streamload index SRC --format parquet --output DST`` writes ``index.json`` and the
sidecars to ``DST`` and records ``SRC`` as the manifest's ``data_root``; the files stay
where they are (someone else's bucket, a read-only folder). :class:`SplitStorage` serves
such a dataset: the manifest and the sidecars come from the index's storage, the files
named as data (the shards) from the data root's storage, each with its own cache when
remote. Callers still name files by their plain manifest names only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._files import FileEntry
from .base import Storage
from .bytes import ShardBytes

if TYPE_CHECKING:
    from .ranges import RangeFetcher

__all__ = ["SplitStorage", "split_storage"]


class SplitStorage(Storage):
    """Files named in ``data_names`` from ``data``, every other file from ``index``.

    Args:
        index: The storage of the index (``index.json``, sidecars).
        data: The storage of the data root (the shard files).
        data_names: The names of the data files.
        largest_index_file: The largest file read from ``index`` (capacity checks).
    """

    def __init__(self, index: Storage, data: Storage, data_names: Iterable[str], largest_index_file: int) -> None:
        self.index = index
        self.data = data
        self.url = index.url
        self.read_ahead = data.read_ahead
        self.cached = data.cached
        self._data_names = frozenset(data_names)
        self._largest_index = largest_index_file

    @property
    def limit(self) -> int | None:
        """The data cache's bound."""
        return self.data.limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        self.data.limit = value

    @property
    def default_limit(self) -> int | None:
        """The bound the data cache chose itself."""
        return self.data.default_limit

    @default_limit.setter
    def default_limit(self, value: int | None) -> None:
        self.data.default_limit = value

    def _of(self, entry: FileEntry) -> Storage:
        return self.data if entry.name in self._data_names else self.index

    def read_bytes(self, name: str, max_bytes: int | None = None, *, not_found: str | None = None) -> bytes:
        """Return the content of small file ``name`` of the index (the manifest)."""
        return self.index.read_bytes(name, max_bytes, not_found=not_found)

    def acquire(self, entry: FileEntry) -> str:
        """Return a local path of ``entry`` from the storage that holds it."""
        return self._of(entry).acquire(entry)

    def release(self, entry: FileEntry) -> None:
        """Release ``entry`` in the storage that holds it."""
        self._of(entry).release(entry)

    def open_bytes(self, entry: FileEntry, *, early: bool = False, ranges: RangeFetcher | None = None) -> ShardBytes:
        """``entry``'s bytes from the storage that holds it."""
        return self._of(entry).open_bytes(entry, early=early, ranges=ranges)

    def open_ranges(self) -> RangeFetcher | None:
        """The data storage's range fetcher (the shards are what streams)."""
        return self.data.open_ranges()

    def discard(self, entry: FileEntry) -> bool:
        """Drop the corrupt copy of ``entry`` where it was cached."""
        return self._of(entry).discard(entry)

    def started(self) -> None:
        """The reader made its first item: tell each storage."""
        self.data.started()
        self.index.started()

    def register_reader(self, largest: int) -> None:
        """Register a reader with each storage (the index's holds sidecars only)."""
        self.data.register_reader(largest)
        try:
            self.index.register_reader(min(largest, self._largest_index))
        except BaseException:
            self.data.unregister_reader()
            raise

    def unregister_reader(self) -> None:
        """A reader ended."""
        try:
            self.data.unregister_reader()
        finally:
            self.index.unregister_reader()

    def fetch_ahead(self, entries: Iterable[FileEntry], together: Iterable[str] = ()) -> None:
        """Name the next files to each storage (its own share of them)."""
        wanted, now = list(entries), list(together)
        self.data.fetch_ahead([e for e in wanted if e.name in self._data_names], now)
        self.index.fetch_ahead([e for e in wanted if e.name not in self._data_names], now)

    def ahead_depth(self) -> int:
        """Return the data storage's read-ahead depth."""
        return self.data.ahead_depth()

    def check_capacity(self, largest: int) -> None:
        """Check both storages: the data files' and the index files' largest sets."""
        self.data.check_capacity(largest)
        self.index.check_capacity(min(largest, self._largest_index))

    def max_open(self, largest: int) -> int | None:
        """Return the data storage's bound (the shards are what fills a cache)."""
        return self.data.max_open(largest)

    def close(self) -> None:
        """Close both storages."""
        try:
            self.data.close()
        finally:
            self.index.close()

    def describe(self) -> str:
        """Both storages, for messages."""
        return f"{self.index.describe()} (index), {self.data.describe()} (data)"


def split_storage(index: Storage, data: Storage, data_names: Iterable[str], largest_index_file: int) -> SplitStorage:
    """Return the split storage of an index and its data root."""
    return SplitStorage(index, data, data_names, largest_index_file)
