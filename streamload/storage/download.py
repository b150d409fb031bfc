"""A remote file's download into a local part file: concurrent ranged parts, or one resumable stream.

:meth:`~.transport.RemoteFiles.download` picks: a file whose size is known, on a backend
that serves ranges, comes as parts planned by the transport's :class:`~.parts.PartPlanner`
and run on the process's I/O executor (the ``parts`` lane for a download a reader waits
for, ``ahead_parts`` for read-ahead: see .executor); any other as one sequential stream.
Each part is retried alone and lands as it arrives; an object shorter or longer than its
entry is a :class:`~streamload.CorruptShardError` at once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .._errors import CorruptShardError
from .backends.fsspec import FsspecBackend
from .executor import io_executor
from .parts import LinkModel, PartPlanner

__all__ = ["download_parts", "download_stream"]

_CHUNK = 8 << 20


class DownloadTransport(Protocol):
    """What a download uses of its transport (:class:`~.transport.RemoteFiles`)."""

    backend: FsspecBackend
    link: LinkModel
    planner: PartPlanner

    def path(self, name: str) -> str:
        """The backend's path of ``name``."""

    def url_of(self, name: str) -> str:
        """The URL of ``name``, for messages."""

    def call(
        self,
        action: str,
        name: str,
        func: Callable[[], Any],
        *,
        not_found: str | None = None,
        stop: threading.Event | None = None,
    ) -> Any:
        """``func`` retried, its final error translated."""


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


def download_parts(
    files: DownloadTransport,
    name: str,
    part: str,
    size: int,
    cancelled: Callable[[], bool],
    stop: threading.Event | None,
    landed: Callable[[int, int], None] | None = None,
    first_part: int | None = None,
    urgent: bool = True,
) -> int:
    """Download ``name`` (``size`` bytes) into ``part`` as concurrent ranged parts; return the bytes (0: stopped)."""
    path = files.path(name)
    parts = files.planner.parts(size, first_part)
    failed = _EitherEvent(stop)  # one part failed for good (or the storage is closing): the others stop
    errors: list[BaseException] = []
    fd = os.open(part, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)

        def fetch(start: int, end: int) -> None:
            if cancelled() or failed.is_set():
                return
            began = time.monotonic()
            # The last part asks for one byte more: an object longer than its entry shows itfiles.
            ask = end + 1 if end == size else end
            try:
                got = _fetch_part(files, name, path, fd, start, ask, failed, landed, size)
                if got != end - start:
                    what = "longer" if got > end - start else "shorter"
                    raise CorruptShardError(
                        f"{files.url_of(name)}: the object is {what} than the {size} bytes its entry says "
                        f"(bytes {start}-{end} came back as {got})"
                    )
            except BaseException as exc:
                errors.append(exc)  # in the order they failed: the first is the cause
                failed.set()
                raise
            files.link.observe(got, time.monotonic() - began)

        if len(parts) == 1:
            fetch(*parts[0])
        else:
            lane = "parts" if urgent else "ahead_parts"
            executor = io_executor()
            for future in [executor.submit(lane, fetch, a, b) for a, b in parts]:
                future.exception()
            if errors:  # the part that failed first, not another one stopped because of it
                raise errors[0]
    finally:
        os.close(fd)
    return size if not cancelled() and not failed.is_set() else 0


def _fetch_part(
    files: DownloadTransport,
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
    any byte past it is read. A retry asks only for the bytes not written yet.
    """
    url = files.url_of(name)
    reached = [start]

    def written(a: int, b: int) -> None:
        reached[0] = b  # a retry after a cut asks for the rest only
        if landed is not None:
            landed(a, b)

    def attempt() -> None:
        reached[0] = files.backend.land(path, url, reached[0], end, fd, written, keep)

    files.call("download", name, attempt, stop=stop)
    return reached[0] - start


def download_stream(
    files: DownloadTransport,
    name: str,
    part: str,
    cancelled: Callable[[], bool],
    stop: threading.Event | None,
    max_bytes: int | None,
) -> int:
    """Download ``name`` into ``part`` as one sequential stream, resumed where it stopped; return the bytes."""
    path = files.path(name)
    began = time.monotonic()
    with open(part, "r+b") as out:
        state = {"offset": 0}

        def attempt() -> None:
            out.seek(state["offset"])
            out.truncate()
            with files.backend.open_stream(path) as src:
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
                            f"{files.url_of(name)}: the object is longer than the {max_bytes} bytes its entry "
                            f"says ({state['offset'] + len(chunk)} bytes came so far; nothing past "
                            f"{max_bytes} was written)"
                        )
                    out.write(chunk)
                    state["offset"] += len(chunk)

        files.call("download", name, attempt, stop=stop)
        out.flush()
        files.link.observe(state["offset"], time.monotonic() - began)
        return state["offset"]
