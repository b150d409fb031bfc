"""Files under one remote URL prefix, with retries: read, stat, download, upload, list, delete.

Every call goes through :func:`~streamload.storage.retry.retry_call` (transient errors are
retried with backoff) and its final error becomes a streamload error naming the URL:
``ShardNotFoundError`` for a missing object, ``StorageError`` for access denied or an
outage that outlived the retry budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._errors import CorruptShardError, ManifestNotFoundError, ShardNotFoundError, StorageError, StreamloadError
from .._files import check_file_name, pwrite_all
from .bounded import read_range
from .filesystems import (
    detach_finalizers,
    filesystem_class,
    forget_inherited,
    open_filesystem,
    protocol_of,
    with_default_timeouts,
)
from .parts import PartPlanner, PartSlots
from .retry import RetryPolicy, is_permanent, is_transient, retry_call
from .s3direct import DirectS3, direct_s3

__all__ = ["PartPlanner", "RangedFile", "RemoteFiles"]

_CHUNK = 8 << 20
#: Downloads whose parts a process fetches at once, at most (see :class:`~.parts.PartSlots`).
_SLOT_DOWNLOADS = 2
_MIB = 1 << 20
#: Metadata fields that change when an object is written again (S3, GCS, Azure, local files).
_VERSION_FIELDS = (
    "ETag",
    "etag",
    "VersionId",
    "generation",
    "md5Hash",
    "LastModified",
    "last_modified",
    "mtime",
    "ino",
)


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


class _EitherEvent(threading.Event):
    """An event that also counts as set when ``other`` is (a download's parts stop on either)."""

    def __init__(self, other: threading.Event | None) -> None:
        super().__init__()
        self._other = other

    def is_set(self) -> bool:
        return super().is_set() or (self._other is not None and self._other.is_set())

    def wait(self, timeout: float | None = None) -> bool:
        if self._other is None:
            return super().wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)
        return True


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
        self.planner = PartPlanner()
        self._slots: PartSlots | None = None
        self._slots_pid = -1
        filesystem_class(self.url)  # fail now on a missing package; connect lazily
        protocol = protocol_of(self.url)
        timed = with_default_timeouts(protocol, dict(self.storage_options), retry.inactivity_timeout)
        #: Ranged reads of S3 objects on botocore's threads (``None``: through fsspec); see .s3direct.
        self.direct: DirectS3 | None = direct_s3(protocol, timed)

    @property
    def slots(self) -> PartSlots:
        """This process's GET slots for downloads' parts (made again after a fork)."""
        with self._lock:
            if self._slots is None or self._slots_pid != os.getpid():
                self._slots = PartSlots(_SLOT_DOWNLOADS * self.planner.max_concurrency)
                self._slots_pid = os.getpid()
            return self._slots

    @property
    def fs(self) -> Any:
        """The filesystem of this process (created lazily, again after a fork)."""
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                if self._fs is not None:
                    forget_inherited(self._fs)
                self._fs, self._root = open_filesystem(self.url, self.storage_options, self.retry.inactivity_timeout)
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
            StorageError: If the file is longer than ``max_bytes`` (at most that many
                bytes and one more are transferred).
        """
        path = self.path(name)
        if max_bytes is None:
            data = self.call("read", name, lambda: self.fs.cat_file(path), not_found=not_found)
        else:  # one ranged GET: a larger object shows itself by the byte past the limit
            url = self.url_of(name)
            read = lambda: self.ranged(path, url, 0, max_bytes + 1)  # noqa: E731
            data = self.call("read", name, read, not_found=not_found)
            if len(data) > max_bytes:
                raise StorageError(f"{self.url_of(name)} is larger than the {max_bytes} bytes accepted for it")
        assert isinstance(data, bytes)
        return data

    def ranged(self, path: str, url: str, start: int, end: int) -> bytes:
        """One GET (no retry) of ``[start, end)`` of ``path`` through fsspec, never more (see :mod:`.bounded`)."""
        return read_range(self.fs, path, url, start, end)

    def get_range(self, name: str, start: int, end: int) -> bytes:
        """One retried GET of bytes ``[start, end)`` of file ``name`` (fewer where the file ends first).

        Never more: at most the bytes asked for (and one more) are read from the answer.

        Raises:
            RangeResponseError: If the server answered with more bytes than asked, or
                ignored the range (see :mod:`.bounded`); not retried.
        """
        path = self.path(name)
        url = self.url_of(name)
        direct = self.direct
        if direct is not None:
            data: bytes = self.call("read", name, lambda: direct.get(path, start, end, url))
        else:
            data = self.call("read", name, lambda: self.ranged(path, url, start, end))
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

    def version(self, name: str) -> str | None:
        """Return a short token of the version of file ``name`` (its ETag, generation or mtime and inode).

        One metadata request. ``None`` if the filesystem tells none, or the file does not exist.
        """
        path = self.path(name)

        def info() -> Any:
            self.fs.invalidate_cache(path)
            return self.fs.info(path)

        try:
            result = self.call("stat", name, info)
        except ShardNotFoundError:
            return None
        found = {k: str(result[k]) for k in _VERSION_FIELDS if result.get(k) is not None}
        if not found:
            return None
        return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:32]

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
        before the file is complete): each chunk as it arrives on the direct S3 path
        (:mod:`.s3direct`), each whole part through fsspec. With ``first_part``, the
        file's first bytes come as several small parts at once (see
        :meth:`~.parts.PartPlanner.parts`), so that they land early. A download a
        reader waits for is ``urgent``: its parts take the process's free GET slots
        before those of read-ahead (see :class:`~.parts.PartSlots`).

        With ``max_bytes`` (the file's size from its entry, which the cache reserved), the
        file is fetched as concurrent ranged GETs planned by :class:`PartPlanner` (no
        size request first; the last part asks for one byte more); each part is retried
        alone, and an object shorter or longer than ``max_bytes`` is a
        :class:`~streamload.CorruptShardError` at once. Without it (or for
        HTTP servers, which may not serve ranges), one sequential stream that resumes at
        the byte where it stopped.
        """
        if max_bytes is not None and protocol_of(self.url) not in ("http", "https"):
            return self._download_parts(name, part, max_bytes, cancelled, stop, landed, first_part, urgent)
        return self._download_stream(name, part, cancelled, stop, max_bytes)

    def _download_parts(
        self,
        name: str,
        part: str,
        size: int,
        cancelled: Callable[[], bool],
        stop: threading.Event | None,
        landed: Callable[[int, int], None] | None = None,
        first_part: int | None = None,
        urgent: bool = True,
    ) -> int:
        path = self.path(name)
        slots = self.slots
        parts = self.planner.parts(size, first_part)
        failed = _EitherEvent(stop)  # one part failed for good (or the storage is closing): the others stop
        errors: list[BaseException] = []
        fd = os.open(part, os.O_WRONLY)
        try:
            os.ftruncate(fd, 0)

            def fetch(start: int, end: int) -> None:
                if cancelled() or failed.is_set():
                    return
                if not slots.take(urgent, failed):
                    return
                began = time.monotonic()
                # The last part asks for one byte more: an object longer than its entry shows itself.
                ask = end + 1 if end == size else end
                try:
                    got = self._fetch_part(name, path, fd, start, ask, failed, landed, size)
                    if got != end - start:
                        what = "longer" if got > end - start else "shorter"
                        raise CorruptShardError(
                            f"{self.url_of(name)}: the object is {what} than the {size} bytes its entry says "
                            f"(bytes {start}-{end} came back as {got})"
                        )
                except BaseException as exc:
                    errors.append(exc)  # in the order they failed: the first is the cause
                    failed.set()
                    raise
                finally:
                    slots.give()
                self.planner.observe(got, time.monotonic() - began)

            if len(parts) == 1:
                fetch(*parts[0])
            else:
                threads = max(1, min(self.planner.max_concurrency, len(parts)))
                with ThreadPoolExecutor(threads, thread_name_prefix="streamload-part") as pool:
                    for future in [pool.submit(fetch, a, b) for a, b in parts]:
                        future.exception()
                if errors:  # the part that failed first, not another one stopped because of it
                    raise errors[0]
        finally:
            os.close(fd)
        return size if not cancelled() and not failed.is_set() else 0

    def _fetch_part(
        self,
        name: str,
        path: str,
        fd: int,
        start: int,
        end: int,
        stop: threading.Event,
        landed: Callable[[int, int], None] | None,
        keep: int,
    ) -> int:
        """Write bytes ``[start, end)`` of ``name`` into ``fd`` at their offsets; return how many came.

        No byte at or past ``keep`` (the file's size: the last part asks for one byte
        more) is written, so the part file never outgrows the room reserved for it; an
        answer longer than the range is a :class:`~streamload.RangeResponseError` before
        any byte past it is read. Directly on S3 each chunk lands as it arrives, and a
        retry asks only for the bytes not written yet; through fsspec the part comes whole
        (at most its range), then lands.
        """
        direct = self.direct
        url = self.url_of(name)
        if direct is None:
            fetch = lambda: self.ranged(path, url, start, end)  # noqa: E731
            data = self.call("download", name, fetch, stop=stop)
            kept = data[: max(0, keep - start)]
            pwrite_all(fd, kept, start)
            if landed is not None and kept:
                landed(start, start + len(kept))
            return len(data)
        reached = [start]

        def written(a: int, b: int) -> None:
            reached[0] = b  # a retry after a cut asks for the rest only
            if landed is not None:
                landed(a, b)

        def attempt() -> None:
            reached[0] = direct.land(path, reached[0], end, fd, written, keep, url)

        self.call("download", name, attempt, stop=stop)
        return reached[0] - start

    def _download_stream(
        self,
        name: str,
        part: str,
        cancelled: Callable[[], bool],
        stop: threading.Event | None,
        max_bytes: int | None,
    ) -> int:
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
                                f"{self.url_of(name)}: the object is longer than the {max_bytes} bytes its entry "
                                f"says ({state['offset'] + len(chunk)} bytes came so far; nothing past "
                                f"{max_bytes} was written)"
                            )
                        out.write(chunk)
                        state["offset"] += len(chunk)

            self.call("download", name, attempt, stop=stop)
            out.flush()
            return state["offset"]

    def upload(self, local: str, name: str) -> None:
        """Upload local file ``local`` as ``name`` (an object appears whole or not at all)."""
        path = self.path(name)
        try:
            self.call("upload", name, lambda: self.fs.put_file(local, path))
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
        fs = self.fs

        def attempt() -> bool | None:
            try:
                fs.pipe_file(path, data, mode="create")
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

        try:
            created: bool | None = self.call("create", name, attempt)
        except ShardNotFoundError as exc:
            raise StorageError(
                f"cannot write {self.url_of(name)}: the bucket (or container) does not exist or is not writable"
            ) from exc
        return created

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
        state.update(_fs=None, _pid=-1, _lock=None, _finalizers_detached=False, _slots=None, _slots_pid=-1)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class RangedFile:
    """Positioned reads of one remote object by ranged GETs (no local copy of the object).

    ``preadv`` fetches exactly the span asked for in one request (callers coalesce a run
    of samples into one span); ``pread`` serves sequential small reads from a read-through
    block of ``block_size`` bytes, so reading a shard sample by sample costs one request per
    block, not one per field. Every GET is retried like any other (:meth:`RemoteFiles.call`);
    the bytes are checked by the reader (each sample's checksum).

    Args:
        files: The object's prefix.
        name: The object's name.
        size: Its size from its entry (no size request).
        block_size: Bytes fetched at least per ``pread`` miss.
    """

    def __init__(self, files: RemoteFiles, name: str, size: int, block_size: int = 4 * _MIB) -> None:
        self.files = files
        self.name = name
        self.size = size
        self.block_size = block_size
        self.requests = 0
        self._path = files.path(name)
        self._block = b""
        self._block_at = 0

    def _get(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if end <= start:
            return b""
        self.requests += 1
        return self.files.get_range(self.name, start, end)

    def pread(self, n: int, offset: int) -> bytes:
        """Return ``n`` bytes at ``offset`` (from the current block, else a new block from there)."""
        at = offset - self._block_at
        if 0 <= at and at + n <= len(self._block):
            return self._block[at : at + n]
        if n >= self.block_size:
            return self._get(offset, offset + n)
        self._block, self._block_at = self._get(offset, offset + self.block_size), offset
        return self._block[:n]

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` from one GET of exactly their total span."""
        total = sum(len(b) for b in buffers)
        data = memoryview(self._get(offset, offset + total))
        done = 0
        for buf in buffers:
            take = min(len(buf), len(data) - done)
            buf[:take] = data[done : done + take]
            done += take
        return done

    def close(self) -> None:
        """Drop the read-through block."""
        self._block = b""
