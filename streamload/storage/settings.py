"""What a remote storage is opened with: :class:`StorageSettings`, every default already applied.

:class:`~streamload.StorageConfig` is what a caller asks for (a field left ``None`` takes
its default); :meth:`~streamload.StorageConfig.resolve` applies the defaults, the
environment's included, once, and hands this object down. Nothing under
:mod:`streamload.storage` reads the environment: a field's default here is the
documented value a setting takes when neither the caller nor the environment chose one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .cache import DEFAULT_LOCK_TIMEOUT
from .retry import DEFAULT_INACTIVITY_TIMEOUT, DEFAULT_RETRY_TIMEOUT, RetryPolicy

__all__ = ["DEFAULT_READ_AHEAD", "StorageSettings"]

#: The most shards each process downloads ahead of the one it reads (the depth adapts below it).
DEFAULT_READ_AHEAD = 8


@dataclass(frozen=True)
class StorageSettings:
    """The settings of one remote storage, resolved: no field means "the default" any more.

    Attributes:
        cache_dir: The machine's cache directory (``~`` is expanded when it is used).
        storage_options: Passed to the URL's backend (credentials, ``client_kwargs``...).
        cache_limit: The checked ``cache_limit``: bytes, ``"unbounded"``, or ``None`` for
            the bound the storage measures itself (see :mod:`.limit`).
        read_ahead: The most shards each process downloads ahead (0: none).
        lock_timeout: Most seconds a wait for one of the cache's locks lasts.
        retry_timeout: Seconds a failing remote call is retried (0: no retry).
        read_timeout: Seconds a remote read may go without a byte.
        s3_direct: S3 ranged reads on botocore's own client (``False``: through s3fs).
        cache_shared: Accept a cache directory other users may write.
    """

    cache_dir: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache_limit: int | str | None = None
    read_ahead: int = DEFAULT_READ_AHEAD
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT
    read_timeout: float = DEFAULT_INACTIVITY_TIMEOUT
    s3_direct: bool = True
    cache_shared: bool = False

    def retry(self) -> RetryPolicy:
        """The retry policy of these settings' transports (its budget and read timeout)."""
        return RetryPolicy(timeout=self.retry_timeout, inactivity_timeout=self.read_timeout)
