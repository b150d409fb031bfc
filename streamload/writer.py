"""Writing shards and manifests: the part every format and every converter shares.

A format only turns samples into one local file (:class:`~streamload.formats.ShardWriter`);
this module stages it under a temporary name, hashes it, publishes it under its final
name, and writes ``index.json`` last, so a dataset never looks complete before it is.

For writing samples from your own code, :class:`DatasetWriter` rolls shards over by
sample count or bytes, like WebDataset's ``ShardWriter``::

    with DatasetWriter("out/", format="tar", max_bytes="128MB") as w:
        for key, jpg, label in records:
            w.write({"__key__": key, "jpg": jpg, "cls": str(label).encode()})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ._errors import ConfigError
from ._units import parse_bytes
from .formats import Format, check_sample, get_format
from .manifest import DEFAULT_HASH_ALGORITHM, MANIFEST_NAME, FileEntry, Manifest, ShardEntry, SkippedInput, hash_file
from .storage import Destination
from .storageconfig import StorageConfig

__all__ = ["DatasetWriter", "ShardResult", "publish_manifest", "sample_nbytes", "write_shard"]


def sample_nbytes(sample: Mapping[str, Any]) -> int:
    """Payload bytes of a sample (sum of its field sizes): the unit of ``max_bytes``."""
    return sum(len(v) for k, v in sample.items() if not k.startswith("__"))


@dataclass
class ShardResult:
    """What writing one shard produced."""

    entry: ShardEntry
    fields: set[str] = field(default_factory=set)
    skipped: list[SkippedInput] = field(default_factory=list)
    payload_bytes: int = 0
    #: Library warnings raised while the inputs were checked (kept inputs), each naming its input.
    warnings: list[SkippedInput] = field(default_factory=list)


def write_shard(
    fmt: Format,
    dest: Destination,
    name: str,
    samples: Iterable[Mapping[str, Any]],
    hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
) -> ShardResult:
    """Write ``samples`` into shard ``name`` at ``dest``.

    The shard is staged, hashed, and published after its sidecar. Returns its result,
    whose ``entry`` goes into the manifest.
    """
    staged = dest.staging_path(name)
    result = ShardResult(entry=ShardEntry(name=name, num_bytes=0))
    sidecar_staged: str | None = None
    try:
        writer = fmt.open_writer(staged)
    except BaseException:
        dest.discard(staged)
        raise
    try:
        for sample in samples:
            writer.write(sample)  # validates the sample
            result.fields.update(k for k in sample if not k.startswith("__"))
            result.payload_bytes += sample_nbytes(sample)
        sidecar_staged = writer.finish()
        digest, size = hash_file(staged, hash_algorithm)
        sidecar = None
        if sidecar_staged is not None:
            sidecar_name = fmt.sidecar_name(name) or name + ".idx"
            s_digest, s_size = hash_file(sidecar_staged, hash_algorithm)
            dest.commit(sidecar_staged, sidecar_name)
            sidecar = FileEntry(sidecar_name, s_size, s_digest)
        dest.commit(staged, name)
    except BaseException:
        writer.abort()
        dest.discard(staged)
        # the sidecar, also when the writer failed while writing it (finish() did not return)
        for extra in {sidecar_staged, fmt.sidecar_name(staged)}:
            if extra is not None:
                dest.discard(extra)
        raise
    result.entry = ShardEntry(name=name, num_bytes=size, hash=digest, num_samples=writer.num_samples, sidecar=sidecar)
    return result


def publish_manifest(dest: Destination, manifest: Manifest) -> None:
    """Write ``index.json`` atomically; call only after every shard is published."""
    dest.write_bytes(MANIFEST_NAME, manifest.dumps())


class DatasetWriter:
    """Write samples into a new dataset, rolling over to a new shard by count or bytes.

    Args:
        url: Destination directory or fsspec URL.
        format: Shard format name.
        max_samples: Samples per shard at most.
        max_bytes: Payload bytes per shard at most (a larger sample gets a shard alone).
        classes: Class names to record in the manifest.
        hash_algorithm: Shard hash algorithm, or ``None``.
        storage_options: fsspec options for remote destinations.
        meta: JSON metadata to store in the manifest.
        overwrite: Replace a dataset already at ``url`` (its ``index.json`` and the shards
            whose names come again). Without it such a destination is refused, so a
            second writer never destroys a dataset by accident.

    The manifest is written by :meth:`close` only if no exception is pending, so a
    failed ``with`` block leaves no complete-looking dataset. The writer holds the
    destination's writer lock (the one ``streamload convert`` takes) from construction to
    :meth:`close` or :meth:`abort`: two writers, or a writer and a conversion, never
    write one destination at once.

    Raises:
        ConfigError: If ``url`` already holds a dataset and ``overwrite`` is false.
        DestinationBusyError: If another writer or conversion holds the destination.
    """

    def __init__(
        self,
        url: str,
        format: str = "tar",
        *,
        max_samples: int | None = None,
        max_bytes: int | str | None = "128MB",
        classes: Sequence[str] = (),
        hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
        storage_options: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        if max_samples is not None and max_samples < 1:
            raise ConfigError(f"max_samples={max_samples} must be >= 1")
        self.format = get_format(format)
        self.dest = StorageConfig(storage_options=storage_options).open_destination(url)
        self._lock = self.dest.lock()
        try:
            self._lock.acquire()
            if not overwrite and self.dest.exists(MANIFEST_NAME) is not None:
                raise ConfigError(
                    f"{url} already holds a dataset ({MANIFEST_NAME}): DatasetWriter(..., overwrite=True) replaces it"
                )
        except BaseException:
            self._lock.release()
            self.dest.close()
            raise
        self.max_samples = max_samples
        self.max_bytes = None if max_bytes is None else parse_bytes(max_bytes, name="max_bytes")
        self.classes = tuple(classes)
        self.hash_algorithm = hash_algorithm
        self.meta = dict(meta or {})
        self._pending: list[Mapping[str, Any]] = []
        self._pending_bytes = 0
        self._results: list[ShardResult] = []
        self._closed = False

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample; may flush a full shard."""
        check_sample(sample)
        size = sample_nbytes(sample)
        full_count = self.max_samples is not None and len(self._pending) >= self.max_samples
        full_bytes = self.max_bytes is not None and self._pending and self._pending_bytes + size > self.max_bytes
        if full_count or full_bytes:
            self._flush()
        self._pending.append(sample)
        self._pending_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        name = self.format.shard_name(len(self._results))
        self._results.append(write_shard(self.format, self.dest, name, self._pending, self.hash_algorithm))
        self._pending, self._pending_bytes = [], 0

    def close(self) -> Manifest:
        """Flush the last shard and write the manifest; return it (and release the destination)."""
        if self._closed:
            raise ConfigError("DatasetWriter is already closed")
        try:
            self._flush()
            self._lock.check()  # a writer that lost its lock never publishes
            return self._publish()
        finally:
            self._closed = True
            self._lock.release()
            self.dest.close()

    def abort(self) -> None:
        """Give up: publish nothing and release the destination (the shards written stay unlisted)."""
        if not self._closed:
            self._closed = True
            self._pending = []
            self._lock.release()
            self.dest.close()

    def _publish(self) -> Manifest:
        fields: set[str] = set()
        for r in self._results:
            fields |= r.fields
        manifest = Manifest(
            format=self.format.name,
            shards=tuple(r.entry for r in self._results),
            fields=tuple(sorted(fields)),
            classes=self.classes,
            hash_algorithm=self.hash_algorithm,
            meta=self.meta,
        )
        publish_manifest(self.dest, manifest)
        return manifest

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
