"""The storage axis: where shard bytes live and how they reach the worker.

Local paths are used in place (:class:`LocalStorage`). Any other fsspec URL (``s3://``,
``gs://``, ``http(s)://``, ``memory://``...) is read through :class:`RemoteStorage`, which
keeps a bounded local cache shared by every worker and rank on the machine. Converters
write through a :class:`Destination`.

The path of a byte, in one direction: URL -> backend -> transport -> cache -> bytes.

Rooms:

* ``base``: the :class:`Storage` interface (no-op defaults for what only a cache does) and
  local directories;
* ``backends/``: what is particular to a protocol family, behind a registry
  (``fsspec`` generic, ``s3``, ``http``; :func:`~.backends.register_backend`);
* ``filesystems``: the fsspec instances of a process (a front of ``backends.fsspec``);
* ``s3direct``: S3 ranged reads on botocore's own client; ``bounded``: the checks that
  keep a ranged GET from taking a byte past its range;
* ``transport``: the files under a URL prefix with retries (:func:`~.transport.open_transport`);
  ``download``: a file's download as concurrent parts or one stream; ``retry``: the retry
  policy and error classes;
* ``parts``: the link model and how a download is cut into parts; ``executor``: the one
  I/O executor of a process, its lanes;
* ``bytes``: :class:`~.bytes.ShardBytes` and its kinds (a local file, a download read as
  it lands, streamed ranges); ``ranges``: streaming mode's ranges fetched ahead;
* ``cache/``, ``locks``, ``cachedir``, ``admission``, ``limit``: the shared cache directory
  (a package of its own), its locks, where it lives, its readers, its bound;
* ``filler``: how a file comes into the cache; ``readahead``: background fetches and their
  depth; ``remote``: :class:`~.remote.RemoteStorage`; ``split``: an index kept apart from
  its files;
* ``config``: checks of the tuning settings; ``destination``: writing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .backends import register_backend
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
    "register_backend",
]


def open_storage(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_limit: int | str | None = None,
    read_ahead: int | None = None,
    *,
    lock_timeout: float | None = None,
    retry_timeout: float | None = None,
    read_timeout: float | None = None,
    s3_direct: bool | None = None,
    cache_shared: bool | None = None,
) -> Storage:
    """Return the :class:`Storage` for a dataset directory or URL prefix.

    ``cache_dir``, ``cache_limit``, ``read_ahead`` (shards downloaded ahead per
    worker), ``lock_timeout`` (the longest wait for one of the cache's locks),
    ``retry_timeout`` (the retry budget), ``read_timeout`` (the inactivity timeout of a
    read), ``s3_direct`` and ``cache_shared`` apply to remote URLs only; ``None`` takes
    each one's default (see :class:`~streamload.StorageConfig`).
    """
    url = str(url)
    if is_local(url):
        return LocalStorage(local_path_of(url))
    from .remote import DEFAULT_READ_AHEAD, RemoteStorage
    from .retry import RetryPolicy

    timeouts = {"timeout": retry_timeout, "inactivity_timeout": read_timeout}
    retry = RetryPolicy(**{k: v for k, v in timeouts.items() if v is not None})

    return RemoteStorage(
        url,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        read_ahead=DEFAULT_READ_AHEAD if read_ahead is None else read_ahead,
        lock_timeout=lock_timeout,
        retry=retry,
        s3_direct=s3_direct,
        cache_shared=cache_shared,
    )


def open_destination(url: str, storage_options: Mapping[str, Any] | None = None) -> Destination:
    """Return the :class:`Destination` for writing a dataset to a directory or URL prefix."""
    url = str(url)
    if is_local(url):
        return LocalDestination(local_path_of(url))
    return RemoteDestination(url, storage_options=storage_options)
