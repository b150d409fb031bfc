"""An existing streamload dataset as a conversion source: re-shard it or change its format.

Any format reads here (tar, LMDB, HDF5, or WebDataset tar shards indexed with
``streamload index``), local or remote. The scan lists every sample from the shards'
own indexes (:meth:`~streamload.formats.ShardReader.catalog`: the tar sidecar, the LMDB
catalog record, the HDF5 offsets tables), so payload sizes for byte-based shard planning
come without reading any sample. An item is ``(key, nbytes, shard, index)``: small and
picklable.

Conversion workers load items shard by shard; each process keeps the source shards it
opened in a small LRU of readers, so a shard is opened once per task, not once per
sample. Readers and storage are per process and never pickled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamload._errors import ConfigError, SourceError, StreamloadError
from streamload._fork import ProcessLocal
from streamload.dataref import DatasetRef
from streamload.formats import ShardReader
from streamload.manifest import SkippedInput
from streamload.shards import ShardSource
from streamload.storageconfig import StorageConfig

from .places import same_place
from .source import Item, ScanResult, Source

__all__ = ["DatasetSource", "SampleItem"]

#: Source shards a conversion process keeps open (a shuffled conversion reads from many).
_OPEN_SHARDS = 64


@dataclass(frozen=True)
class SampleItem(Item):
    """One sample of the source dataset: its shard's position in the manifest and its index there."""

    shard: int = 0
    index: int = 0


class _Readers:
    """The source shards one process holds open, and how many it opened before them."""

    def __init__(self) -> None:
        self.source: ShardSource | None = None
        self.opens_before = 0

    @property
    def opens(self) -> int:
        return self.opens_before + (self.source.opens if self.source is not None else 0)


class DatasetSource(Source):
    """Read the samples of an existing dataset (directory or URL holding ``index.json``).

    Args:
        url: Dataset directory or fsspec URL prefix.
        storage_options: fsspec options for remote URLs.
        cache_dir: Local cache for remote shards (default: the storage layer's).
        allow_data_roots: Where the manifest (read from a URL) may send its readers besides
            its own scheme and host (see :class:`~streamload.StorageConfig`).

    Attributes:
        shard_opens: How many times this process opened a source shard (a shard is
            opened once per scan and once per conversion task that reads it).
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        allow_data_roots: Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.url = str(url).rstrip("/") or str(url)
        config = StorageConfig(storage_options=storage_options, cache_dir=cache_dir, allow_data_roots=allow_data_roots)
        self.ref = DatasetRef.open(self.url, config)
        self.manifest = self.ref.manifest
        self.format = self.ref.format
        self.classes = list(self.manifest.classes)
        self._readers = ProcessLocal(_Readers)  # a forked conversion worker starts with none of the parent's

    @property
    def shard_opens(self) -> int:
        """Source shards opened by this process so far."""
        return self._readers.get().opens

    def describe(self) -> str:
        """Return the dataset's URL."""
        return self.url

    def check_destination(self, dst: str) -> None:
        """Refuse ``dst`` if it is this dataset, however spelled (converting in place would destroy it).

        Raises:
            ConfigError: Naming both.
        """
        if same_place(self.url, dst):
            raise ConfigError(
                f"SRC {self.url} and DST {dst} are the same dataset: converting it in place would destroy its "
                "shards before the new ones exist. Convert into a new location, check it (streamload verify), "
                "then replace the old dataset with it."
            )

    def meta(self) -> dict[str, Any]:
        """Return the source URL and format for the new manifest."""
        return {"source": self.url, "source_format": self.manifest.format}

    def origin(self, item: Item) -> str:
        """Return ``<shard name>#<index>`` of an item, for error listings."""
        assert isinstance(item, SampleItem)
        return f"{self.manifest.shards[item.shard].name}#{item.index}"

    # -- scanning --------------------------------------------------------------------

    def scan(self) -> ScanResult:
        """List every sample, shard by shard, from the shards' indexes.

        A shard that cannot be opened is a problem (named, with its sample count): an
        error under ``on_error="raise"``, skipped and listed under ``"skip"``.
        """
        items: list[Item] = []
        problems: list[SkippedInput] = []
        with ShardSource(self.ref, self.ref.open_storage(), 1, own_storage=True) as source:  # one shard at a time
            for s, entry in enumerate(self.manifest.shards):
                try:
                    keys, sizes = source.get(s).catalog()
                except (StreamloadError, OSError) as exc:
                    problems.append(SkippedInput(entry.name, f"{entry.num_samples} samples unreadable: {exc}"))
                    continue
                if len(keys) != entry.num_samples or len(sizes) != entry.num_samples:
                    problems.append(
                        SkippedInput(entry.name, f"index lists {len(keys)} samples, manifest says {entry.num_samples}")
                    )
                    continue
                items.extend(
                    SampleItem(key, int(size), s, i) for i, (key, size) in enumerate(zip(keys, sizes, strict=True))
                )
        self._readers.get().opens_before += source.opens
        return ScanResult(items, [], problems)

    # -- loading ---------------------------------------------------------------------

    def load(self, item: Item) -> dict[str, Any]:
        """Return the sample of ``item``, read with the shard's format reader.

        Raises:
            SourceError: Naming the dataset, shard and key, if the sample cannot be read
                or is not the one the scan listed.
        """
        assert isinstance(item, SampleItem)
        entry = self.manifest.shards[item.shard]
        where = f"{self.ref.where(entry)}: sample {item.index} ({item.key!r})"
        try:
            try:
                sample = self._reader(item.shard).get(item.index)
            except StreamloadError as exc:
                # A remote source's cached copy damaged on disk: read it again from a fresh download, once.
                source = self._readers.get().source
                fresh = source.recover(item.shard, exc) if source is not None else None
                if fresh is None:
                    raise
                sample = fresh.get(item.index)
        except (StreamloadError, OSError) as exc:
            raise SourceError(f"{where}: cannot read: {exc}") from exc
        if sample.get("__key__") != item.key:
            raise SourceError(
                f"{where}: the shard now holds key {sample.get('__key__')!r} there; "
                "was the source changed during the conversion?"
            )
        return sample

    def _reader(self, shard: int) -> ShardReader:
        """Return an open reader of ``shard`` in this process (LRU of :data:`_OPEN_SHARDS`)."""
        readers = self._readers.get()
        if readers.source is None:
            readers.source = ShardSource(self.ref, self.ref.open_storage(), _OPEN_SHARDS, own_storage=True)
        return readers.source.get(shard)

    def close(self) -> None:
        """Close the open source shards and their storage (reopened on the next read)."""
        readers = self._readers.get()
        source, readers.source = readers.source, None
        if source is not None:
            readers.opens_before += source.opens
            source.close()

    def __del__(self) -> None:
        # A conversion in this process leaves its last shards open: close them with the
        # source (readers hold plain file descriptors that nothing else would close).
        local = getattr(self, "_readers", None)
        readers = local.peek() if local is not None else None  # none in a forked child: the parent's
        if readers is not None and readers.source is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001, S110 - best effort at collection time
                pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_readers"]  # reopened lazily in the receiving process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._readers = ProcessLocal(_Readers)
