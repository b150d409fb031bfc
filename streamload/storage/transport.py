"""Files under one remote URL prefix, with retries: read, stat, download, upload, list, delete.

Every call goes through :func:`~streamload.storage.retry.retry_call` (transient errors are
retried with backoff) and its final error becomes a streamload error naming the URL:
``ShardNotFoundError`` for a missing object, ``StorageError`` for access denied or an
outage that outlived the retry budget. What a call does on the wire is the URL's
backend's (:mod:`.backends`); :func:`open_transport` is the one place transports are made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import ManifestNotFoundError, ShardNotFoundError, StorageError, StreamloadError
from .._redact import scrub_chain
from .backends import backend_class
from .backends.fsspec import BackendSettings, FsspecBackend
from .download import download_parts, download_stream
from .parts import LinkModel, PartPlanner
from .retry import RetryPolicy, is_permanent, is_transient, retry_call, status_of

__all__ = ["PartPlanner", "RemoteFiles", "open_transport", "translate_error"]


def open_transport(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    retry: RetryPolicy | None = None,
    s3_direct: bool | None = None,
) -> RemoteFiles:
    """The transport of the files under ``url``: its backend, with retries (the one factory of transports).

    Args:
        url: The URL prefix.
        storage_options: The backend's (fsspec's) options.
        retry: How transient errors are retried (default: :class:`~.retry.RetryPolicy`).
        s3_direct: Ranged reads on the backend's direct client where it has one (``None``:
            ``$STREAMLOAD_S3_DIRECT``, on by default).
    """
    return RemoteFiles(url, dict(storage_options or {}), retry or RetryPolicy(), s3_direct=s3_direct)


#: Errors of a client that found no credentials to sign with (botocore's; google-auth's for GCS).
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"})


def translate_error(exc: BaseException, url: str, action: str, *, not_found: str | None = None) -> StreamloadError:
    """Return the streamload error for a failed remote call (the caller raises it ``from exc``).

    Only a 404 (``FileNotFoundError``) is a missing object; every other failure is a
    :class:`~streamload.StorageError` naming the URL and the HTTP status where the storage
    answered one (``HTTP 403``): access denied (401/403), a bad request (another 4xx), or
    the storage unavailable past the retry budget (5xx, throttling, a connection refused,
    reset or timed out). ``on_error="skip"`` never skips one (see
    :func:`streamload.recovery.skippable`): it is not about one shard.

    Args:
        exc: The error of the last attempt.
        url: The object's URL, named in the message.
        action: What was tried (``"read"``, ``"download"``...).
        not_found: The message for a missing object when it is the dataset's manifest
            (a :class:`~streamload.ManifestNotFoundError`); ``None`` for any other file.
    """
    if isinstance(exc, StreamloadError):
        return exc
    status = status_of(exc)
    if (isinstance(exc, FileNotFoundError) and status in (None, 404)) or status == 404:
        if not_found is not None:
            return ManifestNotFoundError(not_found)
        return ShardNotFoundError(f"{url} does not exist (listed in the manifest)")
    answered = "" if status is None else f"HTTP {status}, "
    why = f"{answered}{type(exc).__name__}: {exc}"
    if type(exc).__name__ in _NO_CREDENTIALS:
        return StorageError(
            f"cannot {action} {url}: no credentials found ({why}); give them as storage options "
            "(key=..., secret=...; on the command line -o key=... -o secret=...), in the environment "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE), in ~/.aws/credentials, or read "
            "a public bucket with anon=True"
        )
    if status in (401, 403) or (isinstance(exc, PermissionError) and status is None):
        return StorageError(f"cannot {action} {url}: access denied ({why}); check the credentials and permissions")
    if is_permanent(exc):
        return StorageError(f"cannot {action} {url}: bad request ({why})")
    if is_transient(exc):
        notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", []))
        return StorageError(f"cannot {action} {url}: storage unavailable ({why}){notes}")
    return StorageError(f"cannot {action} {url}: {why}")


class RemoteFiles:
    """The files under one URL prefix, reached through its backend; calls retried, errors translated.

    Args:
        url: The URL prefix (``s3://bucket/prefix``).
        storage_options: Passed to the backend (the fsspec filesystem).
        retry: How transient errors are retried; its ``inactivity_timeout`` is the read timeout.
        s3_direct: See :func:`open_transport`.

    Attributes:
        link: This transport's estimate of its link (latency, bytes/s of one connection),
            fitted to every GET it makes; read by the part planner, streaming's span sizes
            and the read-ahead depth.
        planner: How a download is cut into parts.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None,
        retry: RetryPolicy,
        *,
        s3_direct: bool | None = None,
    ) -> None:
        from .. import _env

        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.retry = retry
        direct = _env.s3_direct() if s3_direct is None else s3_direct
        settings = BackendSettings(read_timeout=retry.inactivity_timeout, direct=direct)
        self.backend: FsspecBackend = backend_class(self.url)(self.url, self.storage_options, settings)
        self.link = LinkModel()
        self.planner = PartPlanner(link=self.link)

    @property
    def direct(self) -> Any:
        """The backend's direct client for ranged reads, if it has one (``None``: through fsspec)."""
        return getattr(self.backend, "direct", None)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of this process."""
        return self.backend.fs

    def path(self, name: str) -> str:
        """The filesystem path of file ``name`` under the prefix."""
        return self.backend.path(name)

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
            scrub_chain(exc)  # a library's error may name the URL with its password
            raise translate_error(exc, url, action, not_found=not_found) from exc
        finally:
            self.backend.connected()

    def cat(self, name: str, *, max_bytes: int | None = None, not_found: str | None = None) -> bytes:
        """Return the bytes of file ``name``.

        Raises:
            StorageError: If the file is longer than ``max_bytes`` (at most that many
                bytes and one more are transferred).
        """
        path = self.path(name)
        if max_bytes is None:
            data = self.call("read", name, lambda: self.backend.cat(path), not_found=not_found)
        else:  # one ranged GET: a larger object shows itself by the byte past the limit
            url = self.url_of(name)
            read = lambda: self.backend.get_range(path, url, 0, max_bytes + 1)  # noqa: E731
            data = self.call("read", name, read, not_found=not_found)
            if len(data) > max_bytes:
                raise StorageError(f"{self.url_of(name)} is larger than the {max_bytes} bytes accepted for it")
        assert isinstance(data, bytes)
        return data

    def get_range(self, name: str, start: int, end: int) -> bytes:
        """One retried GET of bytes ``[start, end)`` of file ``name`` (fewer where the file ends first).

        Never more: at most the bytes asked for (and one more) are read from the answer.

        Raises:
            RangeResponseError: If the server answered with more bytes than asked, or
                ignored the range (see :mod:`.bounded`); not retried.
        """
        path, url = self.path(name), self.url_of(name)

        def get() -> bytes:
            began = time.monotonic()
            data = self.backend.get_range(path, url, start, end)
            self.link.observe(len(data), time.monotonic() - began)
            return data

        data: bytes = self.call("read", name, get)
        return data

    def size(self, name: str, *, not_found: str | None = None) -> int | None:
        """Return the size of file ``name``, or ``None`` if it does not exist (unless ``not_found`` says why)."""
        path = self.path(name)
        try:
            result = self.call("stat", name, lambda: self.backend.info(path), not_found=not_found)
        except ShardNotFoundError:
            return None
        size = result.get("size")
        return int(size) if size is not None else None

    def version(self, name: str) -> str | None:
        """Return a short token of the version of file ``name`` (its ETag, generation or mtime and inode).

        One metadata request. ``None`` if the backend tells none, or the file does not exist.
        """
        path = self.path(name)
        try:
            result = self.call("stat", name, lambda: self.backend.info(path))
        except ShardNotFoundError:
            return None
        return self.backend.version_of(result)

    def download(
        self,
        name: str,
        part: str,
        cancelled: Callable[[], bool],
        stop: threading.Event | None = None,
        max_bytes: int | None = None,
        landed: Callable[[int, int], None] | None = None,
        first_part: int | None = None,
        urgent: bool = True,
    ) -> int:
        """Copy file ``name`` into local ``part``; return the number of bytes.

        ``landed(start, end)`` is called as bytes are written (a reader may read them
        before the file is complete): each chunk as it arrives where the backend streams
        a range into the file (S3 directly), each whole part otherwise. With
        ``first_part``, the file's first bytes come as several small parts at once (see
        :meth:`~.parts.PartPlanner.parts`), so that they land early. A download a reader
        waits for is ``urgent``: its parts run on the executor's ``parts`` lane, never
        queued behind read-ahead's (the ``ahead_parts`` lane; see :mod:`.executor`).

        With ``max_bytes`` (the file's size from its entry, which the cache reserved), the
        file is fetched as concurrent ranged GETs planned by :class:`PartPlanner` (no
        size request first; the last part asks for one byte more); each part is retried
        alone, and an object shorter or longer than ``max_bytes`` is a
        :class:`~streamload.CorruptShardError` at once. Without it (or where the backend
        does not download in parts: HTTP servers may not serve ranges), one sequential
        stream that resumes at the byte where it stopped.
        """
        if max_bytes is not None and self.backend.parted:
            return download_parts(self, name, part, max_bytes, cancelled, stop, landed, first_part, urgent)
        return download_stream(self, name, part, cancelled, stop, max_bytes)

    def upload(self, local: str, name: str) -> None:
        """Upload local file ``local`` as ``name`` (an object appears whole or not at all)."""
        path = self.path(name)
        try:
            self.call("upload", name, lambda: self.backend.put(local, path))
        except ShardNotFoundError as exc:  # when writing, "not found" means no such bucket
            raise StorageError(
                f"cannot write {self.url_of(name)}: the bucket (or container) does not exist or is not writable"
            ) from exc

    def create(self, name: str, data: bytes) -> bool | None:
        """Write ``name`` only if no object of that name exists (an exclusive create).

        On S3 this is a ``PutObject`` with ``If-None-Match: *`` (AWS S3, SeaweedFS and
        others check it atomically); a filesystem that has no exclusive create answers
        ``None`` and nothing is written. A retried request whose first attempt did
        write finds its own object: the caller reads it back to tell.

        Returns:
            True if written, False if the object already existed, None if this
            filesystem cannot create exclusively.
        """
        path = self.path(name)
        try:
            created: bool | None = self.call("create", name, lambda: self.backend.create(path, data))
        except ShardNotFoundError as exc:
            raise StorageError(
                f"cannot write {self.url_of(name)}: the bucket (or container) does not exist or is not writable"
            ) from exc
        return created

    def remove(self, name: str) -> None:
        """Delete ``name`` if it exists."""
        path = self.path(name)
        try:
            self.call("delete", name, lambda: self.backend.delete(path))
        except ShardNotFoundError:
            pass

    def list_names(self) -> list[str]:
        """Return the sorted plain names of the files directly under the prefix."""
        root = self.path("index.json").rsplit("/", 1)[0]
        listed = self.call("list", "", lambda: self.backend.listing(root))
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed)
