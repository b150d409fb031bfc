"""What a cache is told: its bound, its waits, whether its folder may be shared.

One :class:`CacheSettings` per :class:`~streamload.storage.cache.ShardCache`, shared by
reference with the parts it is made of, so a setting changed on the cache (a storage sets
``limit`` once it has measured the disk) holds for all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_LOG_EVERY",
    "DEFAULT_WAIT_TIMEOUT",
    "SHARED_ENV",
    "CacheSettings",
    "Setting",
]

#: How long an acquire waits for room held by other readers before giving up.
DEFAULT_WAIT_TIMEOUT = 300.0
#: Seconds between the log lines of an acquire waiting for room.
DEFAULT_LOG_EVERY = 10.0
#: Longest wait for one of the cache's locks (another process's download of the same file
#: holds its lock for that download, which its retry policy bounds) before a CacheError.
DEFAULT_LOCK_TIMEOUT = 600.0
#: The environment variable that allows a cache folder writable by its group (and owned by
#: another user of it): a cache shared by several users. Named in this package's messages
#: only: it is read above (the default of ``StorageConfig(cache_shared=)``), and the cache is
#: told the resolved ``shared``.
SHARED_ENV = "STREAMLOAD_CACHE_SHARED"

T = TypeVar("T")


@dataclass
class CacheSettings:
    """The settings of one cache (see :class:`~streamload.storage.cache.ShardCache` for each)."""

    limit: int | None
    verify_hash: bool = True
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT
    log_every: float = DEFAULT_LOG_EVERY
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    shared: bool = False


class Setting(Generic[T]):
    """An attribute of an object kept in the object's ``settings`` (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Setting[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Setting[T] | T:
        if obj is None:
            return self
        value: T = getattr(_settings_of(obj), self.name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(_settings_of(obj), self.name, value)


def _settings_of(obj: Any) -> CacheSettings:
    settings: CacheSettings = obj.settings
    return settings
