"""The generic backend: any fsspec filesystem, one instance per process and options, safe across fork.

A DataLoader worker must never use its parent's connections: async filesystems (s3fs,
gcsfs) own an event-loop thread that a forked child does not inherit. So instances are
never shared through fsspec's own instance cache; :func:`open_filesystem` keeps one per
``(process id, protocol, options)``, and a filesystem inherited across a fork is kept
alive but never finalized in the child (its finalizer would try to close the parent's
sessions on the child's loop: ``attached to a different loop`` errors at exit).

:class:`FsspecBackend` is also the base of the other backends (:mod:`.s3`, :mod:`.http`):
each overrides what its protocol does better or otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..._errors import ConfigError
from ..._files import check_file_name, pwrite_all
from ..._fork import ProcessLocal, on_fork
from ..bounded import longer_than_asked
from . import install_hint, protocol_of

__all__ = ["BackendSettings", "FsspecBackend", "detach_finalizers", "open_filesystem"]

#: Bytes read per call from a sequential stream.
STREAM_CHUNK = 8 << 20
#: The inactivity timeout when the caller gives none (see :class:`~..retry.RetryPolicy`).
DEFAULT_READ_TIMEOUT = 30.0
#: Metadata fields that change when an object is written again (S3, GCS, Azure, local files).
VERSION_FIELDS = ("ETag", "etag", "VersionId", "generation", "md5Hash", "LastModified", "last_modified", "mtime", "ino")

#: (pid, protocol, options) -> filesystem: see :func:`open_filesystem` (the pid is the owner's identity:
#: a child keeps its parent's instances alive, never finalized, and never uses them).
_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def _reset_after_fork() -> None:
    global _FILESYSTEMS_LOCK
    _FILESYSTEMS_LOCK = threading.Lock()


on_fork(_reset_after_fork)


def detach_finalizers(fs: Any) -> None:
    """Detach the ``weakref.finalize`` callbacks registered on ``fs``.

    s3fs registers one when it first connects, which would schedule the session's close
    on whatever event loop the collecting thread has (``Task exception was never
    retrieved`` at worker exit); the operating system closes the sockets with the process.
    """
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        if info is not None and info[0] is fs:
            finalizer.detach()


def open_filesystem(
    url: str, storage_options: Mapping[str, Any] | None = None, inactivity_timeout: float | None = None
) -> tuple[Any, str]:
    """Return ``(filesystem, root path)`` for ``url``, one instance per process and options.

    Args:
        url: The URL (its protocol picks the backend and the filesystem).
        storage_options: The filesystem's options.
        inactivity_timeout: Seconds a read may wait for a byte (default 30 s); a stalled
            read fails after it, and the retry policy (not the filesystem) retries it.

    Raises:
        ConfigError: If the protocol is unknown, its package is not installed (the
            message says what to ``pip install``), or the options are not accepted.
    """
    from . import backend_class

    backend = backend_class(url)
    protocol = protocol_of(url)
    inactivity = DEFAULT_READ_TIMEOUT if inactivity_timeout is None else inactivity_timeout
    options = backend.timed_options(dict(storage_options or {}), inactivity)
    options.setdefault("skip_instance_cache", True)
    cls = backend.filesystem_class(url)
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=repr))
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            try:
                fs = backend.make_filesystem(cls, options)
            except TypeError as exc:
                raise ConfigError(f"{url}: bad storage_options for {protocol}:// ({exc})") from exc
            detach_finalizers(fs)
            _FILESYSTEMS[key] = fs
    root = cls._strip_protocol(url)
    root = root.rstrip("/") if isinstance(root, str) else root
    return fs, root


@dataclass(frozen=True)
class BackendSettings:
    """What a backend is told besides its URL and options.

    Attributes:
        read_timeout: Seconds a read may go without a byte (applied unless the options choose).
        direct: Use the backend's direct client for ranged reads where it has one (S3 on botocore).
    """

    read_timeout: float = DEFAULT_READ_TIMEOUT
    direct: bool = True


class FsspecBackend:
    """The files under one URL prefix on an fsspec filesystem (the filesystem is made anew in each process).

    Args:
        url: The URL prefix (``gs://bucket/prefix``).
        storage_options: Passed to the fsspec filesystem.
        settings: Timeouts and switches.
    """

    #: A download of known size is fetched as concurrent ranged parts (``False``: one resumable stream).
    parted: bool = True

    def __init__(self, url: str, storage_options: Mapping[str, Any], settings: BackendSettings) -> None:
        self.url = url.rstrip("/")
        self.options = dict(storage_options)
        self.settings = settings
        self.filesystem_class(self.url)  # fail now on a missing package; connect lazily
        self._fs = self._local()

    def _local(self) -> ProcessLocal[tuple[Any, str, list[bool]]]:
        def make() -> tuple[Any, str, list[bool]]:
            fs, root = open_filesystem(self.url, self.options, self.settings.read_timeout)
            return fs, root, [False]

        return ProcessLocal(make)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_fs"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs = self._local()

    # -- per protocol: override in a backend ----------------------------------------

    @classmethod
    def filesystem_class(cls, url: str) -> Any:
        """The fsspec filesystem class for ``url``'s protocol.

        Raises:
            ConfigError: If the protocol is unknown or its package is missing (with the
                ``pip install`` that fixes it).
        """
        import fsspec

        protocol = protocol_of(url)
        try:
            return fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            hint = install_hint(protocol)
            raise ConfigError(
                f"{url}: reading {protocol}:// URLs needs a package that is missing ({exc}); {hint}"
            ) from exc
        except ValueError as exc:
            raise ConfigError(f"{url}: unknown protocol {protocol!r} ({exc})") from exc

    @classmethod
    def timed_options(cls, options: dict[str, Any], read_timeout: float) -> dict[str, Any]:
        """``options`` with this protocol's default timeouts (bounding a read by ``read_timeout``), unless chosen."""
        return options

    @classmethod
    def make_filesystem(cls, fs_class: Any, options: dict[str, Any]) -> Any:
        """A new filesystem instance of ``fs_class`` for ``options``."""
        return fs_class(**options)

    @classmethod
    def cache_endpoint(cls, options: Mapping[str, Any]) -> str | None:
        """The endpoint these options reach (part of a dataset's cache key), if they name one."""
        client = options.get("client_kwargs") or {}
        endpoint = client.get("endpoint_url") if isinstance(client, Mapping) else None
        found = endpoint or options.get("endpoint_url")
        return str(found) if found else None

    def get_range(self, path: str, url: str, start: int, end: int) -> bytes:
        """One GET (no retry) of ``[start, end)`` of ``path``; fewer bytes where it ends, never more.

        Raises:
            RangeResponseError: If the answer holds more than the range (see :mod:`..bounded`).
        """
        if end <= start:
            return b""
        data: bytes = self.fs.cat_file(path, start=start, end=end)
        if len(data) > end - start:
            raise longer_than_asked(url, start, end, len(data))
        return data

    def land(
        self, path: str, url: str, start: int, end: int, fd: int, written: Callable[[int, int], None], keep: int
    ) -> int:
        """Write ``[start, end)`` of ``path`` into ``fd`` at its offsets; return the offset the bytes reached.

        No byte at or past ``keep`` is written; ``written(a, b)`` is called for what was.
        Here the range comes whole (at most its bytes), then lands.
        """
        data = self.get_range(path, url, start, end)
        kept = data[: max(0, keep - start)]
        if kept:
            pwrite_all(fd, kept, start)
            written(start, start + len(kept))
        return start + len(data)

    def open_stream(self, path: str) -> Any:
        """A file object reading ``path`` sequentially (a download of unknown size)."""
        return self.fs.open(path, "rb", block_size=STREAM_CHUNK, cache_type="none")

    @staticmethod
    def version_of(info: Mapping[str, Any]) -> str | None:
        """A short token of an object's version from its metadata (``None``: it tells none)."""
        found = {k: str(info[k]) for k in VERSION_FIELDS if info.get(k) is not None}
        if not found:
            return None
        return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:32]

    # -- the same for every fsspec filesystem ----------------------------------------

    @property
    def fs(self) -> Any:
        """The filesystem of this process."""
        return self._fs.get()[0]

    def path(self, name: str) -> str:
        """The filesystem path of file ``name`` under the prefix."""
        return f"{self._fs.get()[1]}/{check_file_name(name, 'file name')}"

    def connected(self) -> None:
        """After a remote call: detach the finalizers a filesystem registers when it first connects (once)."""
        value = self._fs.peek()
        if value is not None and not value[2][0]:
            detach_finalizers(value[0])
            value[2][0] = True

    def cat(self, path: str) -> bytes:
        """The whole content of ``path``."""
        data: bytes = self.fs.cat_file(path)
        return data

    def info(self, path: str) -> Mapping[str, Any]:
        """Fresh metadata of ``path`` (not from a listing cache)."""
        self.fs.invalidate_cache(path)
        info: Mapping[str, Any] = self.fs.info(path)
        return info

    def put(self, local: str, path: str) -> None:
        """Upload local file ``local`` as ``path``."""
        self.fs.put_file(local, path)

    def create(self, path: str, data: bytes) -> bool | None:
        """Write ``path`` only if it does not exist: True if written, False if it did, None if unsupported."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError):  # no ``mode`` here
            return None
        except OSError as exc:
            text = str(exc).lower()
            if "pre-condition" in text or "precondition" in text or "412" in text:
                return False
            raise
        return True

    def delete(self, path: str) -> None:
        """Delete ``path``."""
        self.fs.rm_file(path)

    def listing(self, root: str) -> list[str]:
        """The paths directly under ``root`` (fresh, not from a listing cache)."""
        return [str(p) for p in self.fs.ls(root, detail=False, refresh=True)]
