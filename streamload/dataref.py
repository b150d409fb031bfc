"""A dataset opened once: :class:`DatasetRef` (its URL, validated manifest, format and storage settings).

It is small and picklable (it holds no file, thread or connection), so DataLoader workers
and conversion processes receive it and open their own storage from it. Opening checks
what the manifest may ask of its readers (a ``data_root`` elsewhere: see
:func:`data_root_options`) and settles ``cache="auto"`` where caching cannot work at all.
The per-process readers over it are :class:`~streamload.shards.ShardSource`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

from ._errors import ConfigError, ManifestError
from ._redact import redacted_repr
from .formats import Format, get_format
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ShardEntry, data_root_place
from .storage import Storage, is_local, local_path_of
from .storage.split import split_storage
from .storageconfig import StorageConfig, can_stream, choose_streaming, largest_sidecar

__all__ = ["DatasetRef", "load_manifest"]

log = logging.getLogger("streamload")

#: Datasets whose "auto" choice this process logged already.
_LOGGED_AUTO: set[str] = set()


def load_manifest(storage: Storage, url: str) -> Manifest:
    """Read and validate ``index.json`` through ``storage`` (at most :data:`MAX_MANIFEST_BYTES`).

    Raises:
        ManifestNotFoundError: If there is none (the message suggests ``streamload index``).
        ManifestError: If it is malformed.
    """
    where = f"{url.rstrip('/')}/{MANIFEST_NAME}"
    missing = f"{where} does not exist: is {url!r} a streamload dataset? ({_what_to_run(url)})"
    raw = storage.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES, not_found=missing)
    return Manifest.loads(raw, where=where)


def _what_to_run(url: str) -> str:
    """The command that makes a dataset of the folder ``url`` (by what a local one holds)."""
    generic = (
        "for tar shards or Parquet files written by other tools, run `streamload index`; "
        "for a folder of images, `streamload convert`"
    )
    if not is_local(url):
        return generic
    path = local_path_of(url)
    try:
        with os.scandir(path) as entries:
            names = [(e.name, e.is_dir()) for e, _ in zip(entries, range(1000), strict=False)]
    except OSError:
        return generic
    files = [n.lower() for n, is_dir in names if not is_dir and not n.startswith(".")]
    if any(n.endswith((".tgz", ".tar.gz")) for n in files):
        return f"its gzip-compressed tar shards need `gunzip` first, then `streamload index {path}`"
    if any(n.endswith(".tar") for n in files):
        return f"its tar shards become one with `streamload index {path}`"
    if any(n.endswith(".parquet") for n in files):
        return f"its Parquet files become one with `streamload index {path} --format parquet`"
    if any(is_dir for _, is_dir in names) or files:
        return f"a folder of images becomes one with `streamload convert {path} OUT_DIR`"
    return generic


@redacted_repr
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

        ``url`` may also name tar shard files, as a path or URL ending in ``.tar`` or a
        brace pattern: they are indexed into the cache (:mod:`streamload.shardlist`) and
        the dataset's URL is that index's folder.

        Raises:
            ManifestNotFoundError: If ``url`` holds no ``index.json``.
            ManifestError: If the manifest is malformed.
            CacheError: If the cache limit cannot hold the largest shards.
            ConfigError: If the URL's protocol or its storage options are unusable.
        """
        config = (config or StorageConfig()).with_cache("shards")
        url = str(url)
        from .shardlist import index_shard_list, shard_list

        shards = shard_list(url)
        if shards is not None:  # tar shard files ("s/{000..009}.tar"): their index in the cache
            url = index_shard_list(shards, config)
        storage = config.open(url)
        try:
            manifest = load_manifest(storage, url)
            storage = _with_data_root(url, manifest, config, storage)
            config = _choose_mode(url, manifest, storage, config)
            storage.check_capacity(_largest_cached(manifest, config))
            if config.cache_limit is None and storage.cached and storage.default_limit:
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

    @property
    def data_url(self) -> str:
        """Where the shard files are: the manifest's ``data_root``, else the dataset's URL."""
        return self.manifest.data_root or self.url

    def open_storage(self) -> Storage:
        """Return a new storage for this dataset's files, in this process."""
        storage = _with_data_root(self.url, self.manifest, self.config, self.config.open(self.url))
        storage.check_capacity(_largest_cached(self.manifest, self.config))
        return storage

    def streams(self, storage: Storage, shards_at_once: int) -> bool:
        """Whether this process reads the shards by ranges (streaming mode) rather than through the cache.

        Args:
            storage: This process's storage of the dataset.
            shards_at_once: Shards the readers of this machine keep open at once (the
                shards one shuffle window spans, times the readers); ``"auto"`` streams
                when the cache limit cannot hold that many of the largest shards.
        """
        if not storage.cached:
            return False  # a local dataset is read in place
        why = choose_streaming(
            self.config.cache or "shards",
            can_stream(self.manifest),
            storage.limit,
            shards_at_once,
            self.manifest.largest_shard_bytes,
        )
        if why is not None and why != "none":
            _log_auto(self.url, why + " (a shuffle window's shards x the readers of this machine)")
        return why is not None

    def where(self, entry: ShardEntry) -> str:
        """Return ``<url>/<shard name>`` for messages (the data root's URL for an index kept apart)."""
        return f"{self.data_url.rstrip('/')}/{entry.name}"


def _with_data_root(url: str, manifest: Manifest, config: StorageConfig, storage: Storage) -> Storage:
    """The dataset's storage: ``storage`` itself, or with the shards from the manifest's ``data_root``.

    A ``data_root`` is honoured only for formats read in place (whose files streamload
    never writes), and a manifest read from a remote URL may not name local files.
    ``storage`` is closed on failure.

    Raises:
        ManifestError: If the manifest's ``data_root`` may not be used.
    """
    root = manifest.data_root
    if root is None:
        return storage
    try:
        fmt = get_format(manifest.format)
        if fmt.indexer is None and fmt.tables is None:
            raise ManifestError(
                f"{url}/{MANIFEST_NAME}: data_root is only for files streamload indexes in place "
                f"(tar, parquet), not {fmt.name}"
            )
        data = config.open(root, _data_root_options(url, root, config))
    except BaseException:
        storage.close()
        raise
    return split_storage(storage, data, [s.name for s in manifest.shards], largest_sidecar(manifest))


def _data_root_options(url: str, root: str, config: StorageConfig) -> dict[str, Any] | None:
    """The ``storage_options`` a manifest's ``data_root`` is read with (``None``: the dataset's own).

    A manifest read from a local path may name any root (it is the caller's own file).
    One read from a URL may name only files under the same scheme and host (bucket) as
    its own, read with the dataset's options; a root elsewhere only if the caller allowed
    it (:attr:`StorageConfig.allow_data_roots`), read with the options given for it; and
    never local files (a path, ``file://``, ``local://``).

    Raises:
        ManifestError: If the root may not be used, naming it and how to allow it.
    """
    if is_local(url):
        return None
    where = f"{url}/{MANIFEST_NAME}"
    if is_local(root):
        raise ManifestError(f"{where}: a manifest read from a URL may not name local files (data_root={root!r})")
    if data_root_place(root) == data_root_place(url):
        return None
    options = config.data_root_options(root)
    if options is None:
        scheme, host = data_root_place(url)
        raise ManifestError(
            f"{where}: data_root={root!r} is not under {scheme}://{host}, where the manifest was read; "
            f"a manifest read from a URL may only send readers to its own scheme and host (bucket). "
            f"To read it anyway, name it: StorageConfig(allow_data_roots=[{root!r}]) "
            f"(or --allow-data-root {root} on the command line)"
        )
    return options


def _log_auto(url: str, why: str) -> None:
    if url not in _LOGGED_AUTO:
        _LOGGED_AUTO.add(url)
        log.info(
            '%s: cache="auto" streams samples by ranged GETs (only sidecars are cached): %s; '
            'pass storage=StorageConfig(cache="shards") to cache whole shards anyway',
            url,
            why,
        )


def _choose_mode(url: str, manifest: Manifest, storage: Storage, config: StorageConfig) -> StorageConfig:
    """Check ``config.cache`` against the dataset; ``"auto"`` becomes ``"none"`` where caching cannot work.

    Raises:
        ConfigError: ``cache="none"`` for a remote dataset whose shards cannot be streamed.
    """
    remote = storage.cached
    if config.cache == "none" and remote and not can_stream(manifest):
        what = f"{manifest.format} shards" if manifest.format != "tar" else "tar shards without sidecars"
        raise ConfigError(
            f'cache="none" cannot stream {url}: its {what} cannot be read by byte ranges (only tar shards '
            'with sidecars can; build them with `streamload index`); use cache="shards" or "auto"'
        )
    if config.cache == "auto" and remote:
        from .storage.remote import MIN_CACHE_SHARDS

        # Whatever the readers: the cache must hold two of the largest shards to cache at all.
        why = choose_streaming(
            "auto", can_stream(manifest), storage.limit, MIN_CACHE_SHARDS, manifest.largest_shard_bytes
        )
        if why is not None:
            _log_auto(url, why)
            return replace(config, cache="none")
    return config


def _largest_cached(manifest: Manifest, config: StorageConfig) -> int:
    """The largest set of files a reader keeps in the cache: a shard with its sidecar, or a sidecar when streaming."""
    return largest_sidecar(manifest) if config.cache == "none" else manifest.largest_shard_bytes
