"""Files under one remote URL prefix, with retries: read, stat, download, upload, list, delete.

Every call goes through :func:`~streamload.storage.retry.retry_call` (transient errors are
retried with backoff) and its final error becomes a streamload error naming the URL:
``ShardNotFoundError`` for a missing object, ``StorageError`` for access denied or an
outage that outlived the retry budget.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from .._errors import CorruptShardError, ManifestNotFoundError, ShardNotFoundError, StorageError, StreamloadError
from .._files import check_file_name
from .filesystems import detach_finalizers, filesystem_class, forget_inherited, open_filesystem, protocol_of
from .retry import RetryPolicy, is_permanent, is_transient, retry_call

__all__ = ["RemoteFiles"]

_CHUNK = 8 << 20


def translate_error(exc: BaseException, url: str, action: str, *, not_found: str | None = None) -> StreamloadError:
    """Return the streamload error for a failed remote call (the caller raises it ``from exc``).

    Args:
        exc: The error of the last attempt.
        url: The object's URL, named in the message.
        action: What was tried (``"read"``, ``"download"``...).
        not_found: The message for a missing object when it is the dataset's manifest
            (a :class:`~streamload.ManifestNotFoundError`); ``None`` for any other file.
    """
    if isinstance(exc, StreamloadError):
        return exc
    if isinstance(exc, FileNotFoundError) or getattr(exc, "status", None) == 404:
        if not_found is not None:
            return ManifestNotFoundError(not_found)
        return ShardNotFoundError(f"{url} does not exist (listed in the manifest)")
    if isinstance(exc, PermissionError) or is_permanent(exc):
        return StorageError(f"cannot {action} {url}: access denied or bad request ({type(exc).__name__}: {exc})")
    if is_transient(exc):
        notes = "; ".join(getattr(exc, "__notes__", []))
        return StorageError(f"cannot {action} {url}: storage unavailable ({type(exc).__name__}: {exc}) {notes}".strip())
    return StorageError(f"cannot {action} {url}: {type(exc).__name__}: {exc}")


class RemoteFiles:
    """The files under one fsspec URL prefix; the filesystem is re-created in each process.

    Args:
        url: The URL prefix (``s3://bucket/prefix``).
        storage_options: Passed to the fsspec filesystem.
        retry: How transient errors are retried.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None, retry: RetryPolicy) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.retry = retry
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._finalizers_detached = False
        self._lock = threading.Lock()
        filesystem_class(self.url)  # fail now on a missing package; connect lazily

    @property
    def fs(self) -> Any:
        """The filesystem of this process (created lazily, again after a fork)."""
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                if self._fs is not None:
                    forget_inherited(self._fs)
                self._fs, self._root = open_filesystem(self.url, self.storage_options)
                self._pid = os.getpid()
                self._finalizers_detached = False
            return self._fs

    def path(self, name: str) -> str:
        """The filesystem path of file ``name`` under the prefix."""
        self.fs  # noqa: B018 - sets _root
        return f"{self._root}/{check_file_name(name, 'file name')}"

    def url_of(self, name: str) -> str:
        """The URL of file ``name``, for messages."""
        return f"{self.url}/{name}"

    def call(
        self,
        action: str,
        name: str,
        func: Callable[[], Any],
        *,
        not_found: str | None = None,
        stop: threading.Event | None = None,
    ) -> Any:
        """Run ``func`` with retries; translate its final error into a streamload error."""
        url = self.url_of(name)
        try:
            return retry_call(func, self.retry, f"{action} {url}", stop)
        except Exception as exc:
            raise translate_error(exc, url, action, not_found=not_found) from exc
        finally:
            if not self._finalizers_detached and self._fs is not None:
                detach_finalizers(self._fs)  # s3fs registers one when it first connects
                self._finalizers_detached = True

    def cat(self, name: str, *, max_bytes: int | None = None, not_found: str | None = None) -> bytes:
        """Return the bytes of file ``name``.

        Raises:
            StorageError: If the file is longer than ``max_bytes`` (its size is asked first,
                so nothing larger is transferred).
        """
        path = self.path(name)
        if max_bytes is not None:
            size = self.size(name, not_found=not_found)
            if size is not None and size > max_bytes:
                raise StorageError(f"{self.url_of(name)} is {size} bytes, larger than the {max_bytes} accepted for it")
        data = self.call("read", name, lambda: self.fs.cat_file(path), not_found=not_found)
        if max_bytes is not None and len(data) > max_bytes:  # it grew since the size was asked
            raise StorageError(f"{self.url_of(name)} is larger than the {max_bytes} bytes accepted for it")
        assert isinstance(data, bytes)
        return data

    def size(self, name: str, *, not_found: str | None = None) -> int | None:
        """Return the size of file ``name``, or ``None`` if it does not exist (unless ``not_found`` says why)."""
        path = self.path(name)

        def info() -> Any:
            self.fs.invalidate_cache(path)
            return self.fs.info(path)

        try:
            result = self.call("stat", name, info, not_found=not_found)
        except ShardNotFoundError:
            return None
        size = result.get("size")
        return int(size) if size is not None else None

    def download(
        self,
        name: str,
        part: str,
        cancelled: Callable[[], bool],
        stop: threading.Event | None = None,
        max_bytes: int | None = None,
    ) -> int:
        """Copy file ``name`` into local ``part``; return the number of bytes.

        A transient failure resumes at the byte where it stopped (or restarts, for streams
        that cannot seek). With ``max_bytes`` (the bytes the cache reserved for ``part``),
        the file never grows past it: an object longer than that is a
        :class:`~streamload.CorruptShardError` at once.
        """
        path = self.path(name)
        with open(part, "r+b") as out:
            state = {"offset": 0}

            def attempt() -> None:
                out.seek(state["offset"])
                out.truncate()
                with self._open(path) as src:
                    if state["offset"]:
                        if src.seekable():
                            src.seek(state["offset"])
                        else:
                            state["offset"] = 0
                            out.seek(0)
                            out.truncate()
                    while not cancelled():
                        chunk = src.read(_CHUNK)
                        if not chunk:
                            return
                        if max_bytes is not None and state["offset"] + len(chunk) > max_bytes:
                            raise CorruptShardError(
                                f"{name}: the object is longer than the {max_bytes} bytes the manifest says"
                            )
                        out.write(chunk)
                        state["offset"] += len(chunk)

            self.call("download", name, attempt, stop=stop)
            out.flush()
            return state["offset"]

    def upload(self, local: str, name: str) -> None:
        """Upload local file ``local`` as ``name`` (an object appears whole or not at all)."""
        path = self.path(name)
        self.call("upload", name, lambda: self.fs.put_file(local, path))

    def remove(self, name: str) -> None:
        """Delete ``name`` if it exists."""
        path = self.path(name)
        try:
            self.call("delete", name, lambda: self.fs.rm_file(path))
        except ShardNotFoundError:
            pass

    def list_names(self) -> list[str]:
        """Return the sorted plain names of the files directly under the prefix."""
        root = self.path("index.json").rsplit("/", 1)[0]
        listed = self.call("list", "", lambda: self.fs.ls(root, detail=False, refresh=True))
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed)

    def _open(self, path: str) -> Any:
        if protocol_of(self.url) in ("http", "https"):
            return self.fs.open(path, "rb", block_size=0)  # a plain stream: no range requests needed
        return self.fs.open(path, "rb", block_size=_CHUNK, cache_type="none")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_fs=None, _pid=-1, _lock=None, _finalizers_detached=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
