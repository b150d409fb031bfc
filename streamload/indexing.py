"""Indexing shards written by other tools: ``streamload index``.

Tar shards written by the ``webdataset`` package (or ``tar`` itself) become a streamload
dataset in place: each shard gets its sidecar (offsets, sizes, checksums), and
``index.json`` is written last. The shards themselves are never rewritten. A directory
or any fsspec URL prefix (each remote shard is downloaded to a temporary file, one at a
time, and its sidecar uploaded beside it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ._errors import ConfigError
from ._files import FileEntry, hash_file
from .formats import Format, get_format
from .manifest import MANIFEST_NAME, Manifest, ShardEntry
from .storage import Destination, RemoteDestination, is_local, local_path_of, open_destination

__all__ = ["index_directory", "index_shard", "publish_index"]


def index_directory(
    url: str,
    format: str = "tar",
    hash_algorithm: str | None = "sha256",
    classes: tuple[str, ...] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write ``index.json`` (and sidecars) for shards written by another tool, in place.

    Every ``*.tar`` file of the directory or URL prefix, in sorted name order, becomes a
    shard. The shards themselves are not rewritten.

    Raises:
        ConfigError: If the format cannot be indexed or the directory holds no shard.
        DestinationBusyError: If a conversion or another writer holds the directory.
    """
    fmt = get_format(format)
    if fmt.indexer is None:
        raise ConfigError(f"format {format!r} cannot index shards written by other tools")
    dest = open_destination(url, storage_options)
    try:
        with dest.lock() as lock:  # one writer at a time, as for a conversion
            names = [n for n in dest.list_names() if n.endswith(fmt.extension) and not n.startswith(".")]
            if not names:
                where = local_path_of(url) if is_local(url) else url
                raise ConfigError(f"{where}: no *{fmt.extension} files to index")
            indexed = [_index_one(fmt, dest, name, hash_algorithm) for name in names]
            lock.check()
            return publish_index(dest, fmt, indexed, hash_algorithm, classes)
    finally:
        dest.close()


def _index_one(fmt: Format, dest: Destination, name: str, hash_algorithm: str | None) -> tuple[ShardEntry, list[str]]:
    if not isinstance(dest, RemoteDestination):
        return index_shard(fmt, dest, os.path.join(local_path_of(dest.url), name), name, hash_algorithm)
    local = dest.staging_path(name)
    try:
        dest.files.download(name, local, lambda: False)
        return index_shard(fmt, dest, local, name, hash_algorithm)
    finally:
        dest.discard(local)


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
