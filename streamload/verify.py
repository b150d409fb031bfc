"""Checking and indexing datasets: ``streamload verify`` and ``streamload index``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError, ShardError, StreamloadError
from .formats import Format, get_format
from .manifest import MANIFEST_NAME, FileEntry, Manifest, ShardEntry, hash_file, hash_stream
from .storage import Destination, is_local, local_path_of, open_destination, open_storage

__all__ = ["VerifyReport", "index_directory", "verify_dataset"]


@dataclass
class VerifyReport:
    """The result of :func:`verify_dataset`: every problem found, per shard."""

    url: str
    shards_checked: int = 0
    samples_checked: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True if no problem was found."""
        return not self.problems


def _check_file(storage: Any, entry: FileEntry, algorithm: str | None) -> str:
    path: str = storage.acquire(entry)
    if algorithm is not None and entry.hash is not None:
        with open(path, "rb") as f:
            digest, size = hash_stream(f, algorithm)
        if size != entry.num_bytes:
            raise ShardError(f"{entry.name}: {size} bytes, manifest says {entry.num_bytes}")
        if digest != entry.hash:
            raise ShardError(f"{entry.name}: {algorithm} is {digest[:16]}..., manifest says {entry.hash[:16]}...")
    return path


def verify_dataset(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    read_samples: bool = True,
    on_shard: Callable[[ShardEntry, str | None], None] | None = None,
) -> VerifyReport:
    """Re-hash every shard and sidecar, check sizes and sample counts, and read every sample.

    All problems are collected (one pass), not just the first.

    Args:
        url: Dataset directory or URL.
        storage_options: fsspec options for remote URLs.
        read_samples: Also open each shard with its format reader and read every sample.
        on_shard: Called with ``(entry, problem or None)`` after each shard.
    """
    report = VerifyReport(url)
    storage = open_storage(url, storage_options)
    try:
        manifest = Manifest.loads(storage.read_bytes(MANIFEST_NAME), where=f"{url}/{MANIFEST_NAME}")
        fmt = get_format(manifest.format)
        for entry in manifest.shards:
            problem = None
            try:
                path = _check_file(storage, entry, manifest.hash_algorithm)
                sidecar = _check_file(storage, entry.sidecar, manifest.hash_algorithm) if entry.sidecar else None
                if read_samples:
                    reader = fmt.reader(path, entry, sidecar)
                    try:
                        count = sum(1 for _ in reader.iter_range(0, len(reader)))
                    finally:
                        reader.close()
                    if count != entry.num_samples:
                        raise ShardError(f"{entry.name}: read {count} samples, manifest says {entry.num_samples}")
                    report.samples_checked += count
            except (StreamloadError, OSError, ValueError) as exc:
                problem = str(exc) if entry.name in str(exc) else f"{entry.name}: {exc}"
                report.problems.append((entry.name, problem))
            finally:
                storage.release(entry)
                if entry.sidecar:
                    storage.release(entry.sidecar)
            report.shards_checked += 1
            if on_shard is not None:
                on_shard(entry, problem)
    finally:
        storage.close()
    return report


def index_directory(
    url: str,
    format: str = "tar",
    hash_algorithm: str | None = "sha256",
    classes: tuple[str, ...] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write ``index.json`` (and sidecars) for shards written by another tool, in place.

    Every ``*.tar`` file of the directory, in sorted name order, becomes a shard. The
    shards themselves are not rewritten.

    Raises:
        ConfigError: If the format cannot be indexed or the directory holds no shard.
    """
    fmt = get_format(format)
    if fmt.indexer is None:
        raise ConfigError(f"format {format!r} cannot index shards written by other tools")
    if not is_local(url):
        from .storage.remote import index_remote

        remote_manifest: Manifest = index_remote(url, fmt, hash_algorithm, classes, storage_options)
        return remote_manifest
    root = local_path_of(url)
    names = sorted(n for n in os.listdir(root) if n.endswith(fmt.extension) and not n.startswith("."))
    if not names:
        raise ConfigError(f"{root}: no *{fmt.extension} files to index")
    dest = open_destination(root)
    indexed = [index_shard(fmt, dest, os.path.join(root, name), name, hash_algorithm) for name in names]
    return publish_index(dest, fmt, indexed, hash_algorithm, classes)


def index_shard(
    fmt: Format, dest: Destination, path: str, name: str, hash_algorithm: str | None
) -> tuple[ShardEntry, list[str]]:
    """Index one shard written by another tool: build and publish its sidecar at ``dest``.

    Args:
        fmt: The shard's format (with an indexer).
        dest: Where the dataset is (the sidecar is committed there).
        path: A local copy of the shard.
        name: The shard's file name in the dataset.
        hash_algorithm: Hash for the manifest entries, or ``None``.

    Returns:
        The shard's manifest entry and its field names.
    """
    assert fmt.indexer is not None
    sidecar_name = fmt.sidecar_name(name)
    staged = dest.staging_path(sidecar_name or name + ".idx")
    try:
        count, fields = fmt.indexer(path, name, staged)
    except BaseException:
        dest.discard(staged)
        raise
    sidecar = None
    if sidecar_name is not None:
        s_hash, s_size = hash_file(staged, hash_algorithm)
        dest.commit(staged, sidecar_name)
        sidecar = FileEntry(sidecar_name, s_size, s_hash)
    else:
        dest.discard(staged)
    digest, size = hash_file(path, hash_algorithm)
    return ShardEntry(name=name, num_bytes=size, hash=digest, num_samples=count, sidecar=sidecar), fields


def publish_index(
    dest: Destination,
    fmt: Format,
    indexed: list[tuple[ShardEntry, list[str]]],
    hash_algorithm: str | None,
    classes: tuple[str, ...],
) -> Manifest:
    """Write ``index.json`` for shards indexed with :func:`index_shard`; return it."""
    fields = sorted({f for _, shard_fields in indexed for f in shard_fields})
    manifest = Manifest(
        format=fmt.name,
        shards=tuple(entry for entry, _ in indexed),
        fields=tuple(fields),
        classes=classes,
        hash_algorithm=hash_algorithm,
        meta={"indexed_by": "streamload index"},
    )
    dest.write_bytes(MANIFEST_NAME, manifest.dumps())
    return manifest
