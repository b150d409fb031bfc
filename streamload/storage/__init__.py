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
* ``settings``: :class:`StorageSettings`, what a storage is opened with, every default
  applied above (nothing here reads the environment); ``destination``: writing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._errors import ConfigError
from .backends import register_backend
from .base import LocalStorage, Storage, is_local, local_path_of
from .destination import Destination, LocalDestination, RemoteDestination
from .retry import RetryPolicy
from .settings import StorageSettings

__all__ = [
    "Destination",
    "LocalDestination",
    "LocalStorage",
    "RemoteDestination",
    "Storage",
    "StorageSettings",
    "is_local",
    "local_path_of",
    "open_destination",
    "open_storage",
    "register_backend",
]


def open_storage(url: str, settings: StorageSettings | None = None) -> Storage:
    """Return the :class:`Storage` for a dataset directory or URL prefix.

    A local path is read in place; any other URL through :class:`~.remote.RemoteStorage`
    with ``settings``, resolved by the caller (:meth:`streamload.StorageConfig.resolve`).

    Raises:
        ConfigError: If ``url`` is remote and no ``settings`` are given.
    """
    url = str(url)
    if is_local(url):
        return LocalStorage(local_path_of(url))
    if settings is None:
        raise ConfigError(f"{url}: a remote storage needs its settings (StorageConfig(...).resolve())")
    from .remote import RemoteStorage

    return RemoteStorage(url, settings)


def open_destination(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    retry: RetryPolicy | None = None,
    s3_direct: bool = True,
) -> Destination:
    """Return the :class:`Destination` for writing a dataset to a directory or URL prefix.

    ``retry`` and ``s3_direct`` are a remote destination's transport's (resolved by the
    caller: :meth:`streamload.StorageConfig.resolve`; ``None``: the policy's defaults).
    """
    url = str(url)
    if is_local(url):
        return LocalDestination(local_path_of(url))
    return RemoteDestination(url, storage_options=storage_options, retry=retry, s3_direct=s3_direct)
