"""Streams: the datasets one :class:`~streamload.StreamingDataset` mixes, and their shards.

A mixture is described by :class:`Stream` objects (a URL, its share of the epoch, its own
storage settings)::

    StreamingDataset([Stream("s3://bucket/a", weight=0.7), Stream("/data/b", weight=0.3)],
                     epoch_size=1_000_000, shuffle=True)

Here they are opened once (:class:`Mixture`: every stream's manifest, its per-epoch count
and the plan's layout; picklable, no I/O afterwards), and read per process through
:class:`MixedSource`: one :class:`~streamload.shards.ShardSource` per stream (each with
its own storage, cache and read-ahead), addressed by global shard numbers (stream ``s``'s
shard ``j`` is ``offsets[s] + j``, the numbering of :class:`~streamload.plan.MixLayout`).
The counting, subset and interleave rules are in :mod:`streamload.plan.mixture` and
``docs/mixing.md``.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

from ._errors import ConfigError, StreamloadError
from ._redact import redact, redacted_repr
from .dataref import DatasetRef
from .formats import ShardReader
from .manifest import ShardEntry
from .plan import Layout, MixLayout, Split, epoch_counts, mixture_fingerprint
from .plan.state import manifest_fingerprint
from .shards import ShardSource
from .storage import Storage
from .storageconfig import StorageConfig, config_from_arguments

__all__ = ["MixedSource", "Mixture", "ShardInfo", "Stream", "StreamSource"]


@redacted_repr
@dataclass(frozen=True)
class Stream:
    """One dataset of a mixture, and how many of its samples each epoch reads.

    Set at most one of ``weight``, ``repeat`` and ``samples`` (none: the whole dataset once):

    * ``weight``: a relative share of ``epoch_size`` (every stream of the mixture then
      needs a weight; ``epoch_size`` defaults to the streams' total size).
    * ``repeat``: passes over the dataset per epoch, e.g. ``0.5`` or ``2.5``.
    * ``samples``: an absolute number of samples per epoch.

    With ``epoch_size``, repeats and sample numbers give the streams' proportions, scaled
    so the epoch holds ``epoch_size`` samples. Counts are rounded by largest remainder so
    they sum exactly; a stream asked for fewer samples than it has reads a different
    subset each epoch, one asked for more reads whole passes plus a subset.

    Args:
        url: Dataset directory or URL (any format, any fsspec storage).
        weight: Relative share of the epoch.
        repeat: Passes over the dataset per epoch.
        samples: Samples per epoch.
        name: What the samples' ``__source__`` entry says (default: the stream's index, an
            ``int``, or its ``str`` when another stream of the mixture has a name).
        storage: This stream's storage settings (a :class:`~streamload.StorageConfig`);
            each field left ``None`` is the dataset's. ``stream_buffer`` is the dataset's
            budget only (a ``ConfigError`` here). The keywords ``storage_options=``,
            ``cache_dir=``, ``cache_limit=`` and ``read_ahead=`` are deprecated (a
            ``DeprecationWarning``; they go in the next release).

    Example:
        >>> web = StorageConfig(storage_options={"anon": True})  # doctest: +SKIP
        >>> Stream("s3://bucket/web", weight=0.7, storage=web)  # doctest: +SKIP
    """

    url: str | os.PathLike[str]
    weight: float | None = None
    repeat: float | None = None
    samples: int | None = None
    name: str | None = None
    _: KW_ONLY
    storage: StorageConfig | None = field(default=None, compare=False)
    storage_options: InitVar[Mapping[str, Any] | None] = None
    cache_dir: InitVar[str | None] = None
    cache_limit: InitVar[int | str | None] = None
    read_ahead: InitVar[int | None] = None

    def __post_init__(
        self,
        storage_options: Mapping[str, Any] | None,
        cache_dir: str | None,
        cache_limit: int | str | None,
        read_ahead: int | None,
    ) -> None:
        old = {"storage_options": storage_options, "cache_dir": cache_dir, "cache_limit": cache_limit}
        old["read_ahead"] = read_ahead
        storage = config_from_arguments("Stream", self.storage, old, stacklevel=4)
        if storage is not None and storage.stream_buffer is not None:
            raise ConfigError(
                f"Stream({str(self.url)!r}): stream_buffer={storage.stream_buffer} is the dataset's budget, "
                "not a stream's: set it in StreamingDataset(storage=StorageConfig(stream_buffer=...))"
            )
        object.__setattr__(self, "storage", storage)
        if sum(v is not None for v in (self.weight, self.repeat, self.samples)) > 1:
            raise ConfigError(f"Stream({str(self.url)!r}): set at most one of weight, repeat and samples")
        for what in ("weight", "repeat"):
            value = getattr(self, what)
            if value is not None and (isinstance(value, bool) or not value >= 0 or value == float("inf")):
                raise ConfigError(f"Stream({str(self.url)!r}): {what}={value!r} must be a finite number >= 0")
        if self.samples is not None and (
            isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 0
        ):
            raise ConfigError(f"Stream({str(self.url)!r}): samples={self.samples!r} must be an integer >= 0")
        if self.name is not None and not isinstance(self.name, str):
            raise ConfigError(f"Stream({str(self.url)!r}): name={self.name!r} must be a str")

    def config(self, defaults: StorageConfig) -> StorageConfig:
        """Return this stream's storage settings, the dataset's ``defaults`` filling the gaps."""
        return defaults if self.storage is None else self.storage.with_defaults(defaults)


#: What ``StreamingDataset`` accepts as its source: a URL, a :class:`Stream`, or a list of them.
StreamSource = str | os.PathLike[str] | Stream | Sequence[str | os.PathLike[str] | Stream]


def _as_streams(source: Any) -> tuple[list[Stream], bool]:
    """Return the streams of ``source`` and whether it was a plain URL (no ``__source__`` then)."""
    if isinstance(source, (str, os.PathLike)):
        return [Stream(source)], True
    if isinstance(source, Stream):
        return [source], False
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        streams = [s if isinstance(s, Stream) else Stream(s) for s in source]
        if not streams:
            raise ConfigError("a mixture needs at least one stream")
        return streams, False
    raise ConfigError(f"source={source!r} must be a URL, a Stream or a list of them")


class Mixture:
    """The datasets a :class:`~streamload.StreamingDataset` reads, opened once.

    Picklable and small (the manifests and a few numbers); every process opens its own
    storages and readers from it (:meth:`open_storages`, :meth:`source`).

    Attributes:
        refs: Each stream's opened dataset.
        streams: The :class:`Stream` descriptions.
        counts: Each stream's samples per epoch.
        labels: Each stream's ``__source__`` value: its name, else its index (as a ``str``
            when other streams have names, so a batch's values share one type); ``None``
            for a dataset given as a plain URL (its samples get no ``__source__``).
        offsets: Global number of each stream's first shard; the last entry is the total.
        shard_counts: Samples per shard of every stream, concatenated in global numbering.
        plain: True if the epoch is one dataset read once, in the planner's default layout.
        fingerprint: Digest of the streams and counts (checked on resume), ``None`` if plain.
    """

    def __init__(
        self, refs: Sequence[DatasetRef], streams: Sequence[Stream], counts: Sequence[int], url_only: bool
    ) -> None:
        self.refs = tuple(refs)
        self.streams = tuple(streams)
        self.counts = tuple(int(c) for c in counts)
        named = any(s.name is not None for s in self.streams)
        self.labels: tuple[int | str, ...] | None = (
            None
            if url_only
            else tuple(s.name if s.name is not None else (str(i) if named else i) for i, s in enumerate(self.streams))
        )
        per_stream = [ref.manifest.shard_counts for ref in self.refs]
        self.offsets = [0]
        for counts_of in per_stream:
            self.offsets.append(self.offsets[-1] + len(counts_of))
        self.shard_counts = [c for counts_of in per_stream for c in counts_of]
        self._per_stream = per_stream
        self.plain = len(self.refs) == 1 and self.counts[0] == self.refs[0].manifest.num_samples
        self.fingerprint = None if self.plain else mixture_fingerprint(per_stream, self.counts)
        self._digest: str | None = None

    @classmethod
    def open(cls, source: Any, epoch_size: int | None, defaults: StorageConfig) -> Mixture:
        """Open every stream of ``source`` (read its manifest) and compute the per-epoch counts.

        Raises:
            ConfigError: If the source or a stream's share is invalid.
            ManifestNotFoundError: If a stream's URL holds no dataset.
        """
        streams, url_only = _as_streams(source)
        refs = [DatasetRef.open(str(s.url), s.config(defaults)) for s in streams]
        sizes = [ref.manifest.num_samples for ref in refs]
        try:
            counts = epoch_counts(
                sizes,
                weights=[s.weight for s in streams],
                repeats=[s.repeat for s in streams],
                samples=[s.samples for s in streams],
                epoch_size=epoch_size,
            )
        except ConfigError as exc:
            raise ConfigError(f"{exc} (streams: {', '.join(str(s.url) for s in streams)})") from exc
        names = [s.name for s in streams if s.name is not None]
        if len(set(names)) != len(names):
            raise ConfigError(f"stream names must be distinct, got {names}")
        return cls(refs, streams, counts, url_only)

    @property
    def total(self) -> int:
        """Samples per epoch, all streams."""
        return sum(self.counts)

    def layout(self, split: Split) -> Layout | None:
        """Return the epoch's layout for the planner (``None``: its default, one dataset once)."""
        if self.plain:
            return None
        return MixLayout(self._per_stream, self.counts, split)

    def open_storages(self) -> list[Storage]:
        """Return a new storage per stream, in this process."""
        storages: list[Storage] = []
        try:
            for ref in self.refs:
                storages.append(ref.open_storage())
        except BaseException:
            for storage in storages:
                storage.close()
            raise
        return storages

    def source(
        self, storages: Sequence[Storage], capacities: Sequence[int], streaming: Sequence[bool] | None = None
    ) -> MixedSource:
        """Return this process's shard readers over ``storages`` (one per stream; ``streaming``: which by ranges)."""
        return MixedSource(self, storages, capacities, streaming)

    @property
    def digest(self) -> str:
        """A short digest of the shards read (names, sizes, sample counts, hashes), computed once."""
        if self._digest is None:
            refs = self.refs
            shards = [[(e.name, e.num_bytes, e.num_samples, str(e.hash)) for e in r.manifest.shards] for r in refs]
            self._digest = manifest_fingerprint(shards)
        return self._digest

    def summary(self) -> str:
        """The streams for a ``repr``: URL (or URLs), format, samples and shards."""
        if len(self.refs) > 1:
            described = redact(self.describe())
            return f"{len(self.refs)} streams: {described}, samples={self.total}, shards={len(self.shard_counts)}"
        manifest = self.refs[0].manifest
        url = redact(repr(self.refs[0].url))
        return f"{url}, format={manifest.format!r}, samples={self.total}, shards={len(manifest.shards)}"

    def describe(self) -> str:
        """Return the streams' URLs (one URL for a single dataset)."""
        if len(self.refs) == 1:
            return self.refs[0].url
        return " + ".join(f"{ref.url} ({count})" for ref, count in zip(self.refs, self.counts, strict=True))


@dataclass(frozen=True)
class ShardInfo:
    """What the reading loop needs to know about one global shard.

    Attributes:
        stream: The stream's index.
        local: The shard's number within its stream.
        entry: Its manifest entry.
        url: The stream's URL.
        label: The ``__source__`` value of its samples (``None``: none).
    """

    stream: int
    local: int
    entry: ShardEntry
    url: str
    label: int | str | None


class MixedSource:
    """One process's open shards of every stream, addressed by global shard number.

    Args:
        mixture: The streams.
        storages: One storage per stream (:meth:`Mixture.open_storages`); closed by :meth:`close`.
        capacities: Readers kept open per stream.
        streaming: Per stream, read its shards by ranged GETs (see :class:`~streamload.shards.ShardSource`).
    """

    def __init__(
        self,
        mixture: Mixture,
        storages: Sequence[Storage],
        capacities: Sequence[int],
        streaming: Sequence[bool] | None = None,
    ) -> None:
        self.mixture = mixture
        modes = list(streaming) if streaming is not None else [False] * len(mixture.refs)
        #: What it was opened with (a :class:`ReaderKeep` hands it on only for the same).
        self.opened_with = (tuple(storages), tuple(capacities), tuple(modes))
        self.sources: list[ShardSource] = []
        try:
            for ref, storage, capacity, streams in zip(mixture.refs, storages, capacities, modes, strict=True):
                self.sources.append(ShardSource(ref, storage, capacity, streaming=streams))
        except BaseException:
            for src in self.sources:
                src.close()
            raise
        self._offsets = mixture.offsets
        self._info: dict[int, ShardInfo] = {}

    def locate(self, shard: int) -> tuple[int, int]:
        """Return ``(stream, shard within the stream)`` of global shard ``shard``."""
        s = bisect.bisect_right(self._offsets, shard) - 1
        return s, shard - self._offsets[s]

    def info(self, shard: int) -> ShardInfo:
        """Return the stream, local number, entry, URL and label of global shard ``shard`` (cached)."""
        info = self._info.get(shard)
        if info is None:
            s, local = self.locate(shard)
            labels = self.mixture.labels
            ref = self.mixture.refs[s]
            info = ShardInfo(s, local, ref.manifest.shards[local], ref.url, None if labels is None else labels[s])
            self._info[shard] = info
        return info

    def __contains__(self, shard: int) -> bool:
        """Whether global shard ``shard``'s reader is open."""
        info = self._info.get(shard) or self.info(shard)
        return info.local in self.sources[info.stream]

    def get(self, shard: int) -> ShardReader:
        """Return the open reader of global shard ``shard``, opening it if needed."""
        info = self._info.get(shard) or self.info(shard)
        return self.sources[info.stream].get(info.local)

    def recover(self, shard: int, error: StreamloadError) -> ShardReader | None:
        """Global ``shard`` read corrupt: a reader over a fresh copy, or ``None`` (see ``ShardSource.recover``)."""
        s, local = self.locate(shard)
        return self.sources[s].recover(local, error)

    def recover_any(self, shards: Iterable[int], error: StreamloadError) -> bool:
        """A batch over global ``shards`` read corrupt: drop their corrupt copies (see ``ShardSource.recover_any``)."""
        by_stream: dict[int, list[int]] = {}
        for shard in shards:
            s, local = self.locate(shard)
            by_stream.setdefault(s, []).append(local)
        refetched = False
        for s, locals_ in by_stream.items():
            refetched = self.sources[s].recover_any(locals_, error) or refetched
        return refetched

    @property
    def streaming(self) -> bool:
        """True if some stream is read by ranged GETs (see :mod:`streamload.ahead`)."""
        return any(src.streaming for src in self.sources)

    @property
    def local(self) -> bool:
        """Every stream read in place from local files by readers that hold descriptors and their sidecars only.

        (A format whose reader reads its sidecar whole, ``takes_sidecar``: tar. A Parquet
        reader's row groups in the process's table cache, or an LMDB environment, are more.)
        """
        return all(
            not src.storage.cached and not src.streaming and src.ref.format.takes_sidecar for src in self.sources
        )

    def close(self) -> None:
        """Close every stream's readers and release their files (the storages stay open)."""
        errors: list[BaseException] = []
        for src in self.sources:
            try:
                src.close()
            except BaseException as exc:  # noqa: BLE001 - close the others first
                errors.append(exc)
        if errors:
            raise errors[0]


class ReaderKeep:
    """One reader thread's open shards, kept from one of a :class:`~streamload.Loader`'s epochs to the next.

    An epoch's turn beside a thread running Python is slow: each step that lets go of the
    GIL waits for it, and opening a shard is one such step (and some Python). A local
    dataset's open shards hold only descriptors and parsed sidecars, so the thread that
    finished an epoch leaves them here (:meth:`give`) and the next epoch's thread of the
    same place takes them (:meth:`take`) instead of opening them again. Only what
    :attr:`MixedSource.local` says: cached and streamed datasets (their readers pin cache
    space and hold fetches) and other formats (Parquet row groups, LMDB maps) close.
    Thread-safe; each :meth:`take` hands what was kept over to one taker.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: MixedSource | None = None

    def take(
        self, storages: Sequence[Storage], capacities: Sequence[int], streaming: Sequence[bool]
    ) -> MixedSource | None:
        """What was kept, if opened with the same storages, capacities and modes (else it is closed); else ``None``."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is None:
            return None
        had, sizes, modes = kept.opened_with
        same = len(had) == len(storages) and all(a is b for a, b in zip(had, storages, strict=False))
        if not same or (sizes, modes) != (tuple(capacities), tuple(streaming)):
            kept.close()
            return None
        for src in kept.sources:
            src.opens = 0  # this iteration's count
        return kept

    def give(self, source: MixedSource) -> None:
        """Keep ``source`` for the next epoch (a local one; any other is closed, as is what was kept before)."""
        old: MixedSource | None = source
        if source.local:
            with self._lock:
                old, self._kept = self._kept, source
        if old is not None:
            old.close()

    def close(self) -> None:
        """Close what is kept (a later :meth:`give` keeps again)."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()
