"""The storage axis: where shard bytes live and how they reach the worker.

Local paths are used in place (:class:`LocalStorage`). Any other fsspec URL (``s3://``,
``gs://``, ``http(s)://``, ``memory://``...) is read through :class:`RemoteStorage`, which
keeps a bounded local cache shared by every worker and rank on the machine. Converters
write through a :class:`Destination`.

Rooms: ``base`` (the interface, local directories), ``filesystems`` (fsspec instances per
process), ``transport`` (remote files with retries), ``bounded`` (ranged GETs that keep
no byte past their range), ``cache`` (the shared cache
directory), ``readahead`` (background fetches), ``remote`` (:class:`RemoteStorage`),
``destination`` (writing), ``retry`` (the retry policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import LocalStorage, Storage, is_local, local_path_of
from .destination import Destination, LocalDestination, RemoteDestination

__all__ = [
    "Destination",
    "LocalDestination",
    "LocalStorage",
    "RemoteDestination",
    "Storage",
    "is_local",
    "local_path_of",
    "open_destination",
    "open_storage",
]


def open_storage(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_limit: int | str | None = None,
    read_ahead: int | None = None,
    *,
    lock_timeout: float | None = None,
) -> Storage:
    """Return the :class:`Storage` for a dataset directory or URL prefix.

    ``cache_dir``, ``cache_limit``, ``read_ahead`` (shards downloaded ahead per
    worker; ``None`` for the default) and ``lock_timeout`` (the longest wait for one of
    the cache's locks; ``None`` for the default) apply to remote URLs only.
    """
    url = str(url)
    if is_local(url):
        return LocalStorage(local_path_of(url))
    from .remote import DEFAULT_READ_AHEAD, RemoteStorage

    return RemoteStorage(
        url,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        read_ahead=DEFAULT_READ_AHEAD if read_ahead is None else read_ahead,
        lock_timeout=lock_timeout,
    )


def open_destination(url: str, storage_options: Mapping[str, Any] | None = None) -> Destination:
    """Return the :class:`Destination` for writing a dataset to a directory or URL prefix."""
    url = str(url)
    if is_local(url):
        return LocalDestination(local_path_of(url))
    return RemoteDestination(url, storage_options=storage_options)
