"""What C libraries write straight to file descriptor 2, captured around one call.

libtiff (under Pillow's TIFF decoder) prints its warnings and errors with ``fprintf(stderr,
...)``: ``TIFFFetchNormalTag: ...``, ``Fax4Decode: Bad code word ...``, ``TIFFFillStrip:
...``. They bypass Python (its ``warnings``, ``sys.stderr``), so the only way to report
them per file is to point fd 2 somewhere else while that file decodes::

    lock            one capture at a time per process (fd 2 is process-wide)
    dup(2)          keep the real stderr
    dup2(sink, 2)   the C library writes into this process's unlinked temp file
    ... decode ...
    dup2(saved, 2)  restored in a ``finally``: even when the decode raises
    pread(sink)     the captured lines; the sink is truncated for the next capture

Measured on the Pillow test images, only TIFF decodes write there, so callers capture
only around data with a TIFF header (:func:`wants_capture`): the redirect costs a few
system calls (microseconds) and serializes TIFF decodes of one process's threads.
Whatever another thread of the process writes to fd 2 during that window is captured
too, and so reported with that file rather than lost.

Fork-safe: the lock is held across ``fork()`` (no child starts with fd 2 redirected),
and a child makes its own temp file (sharing the parent's would mix their captures).
A nested capture in the same thread is a no-op (the outer one gets the lines).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["c_stderr", "wants_capture"]

#: Headers of the formats whose C decoders write to fd 2: TIFF and BigTIFF, both byte orders.
_CHATTY = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")


def wants_capture(data: object) -> bool:
    """True if ``data`` (encoded image bytes) is of a kind whose C decoder writes to fd 2 (TIFF)."""
    try:
        head = bytes(data[:4])  # type: ignore[index]
    except TypeError:
        return False
    return head in _CHATTY


class _Capture:
    """This process's capture state: the lock, the temp file and the thread that captures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sink = -1
        self.local = threading.local()

    def sink_fd(self) -> int:
        if self.sink < 0:
            fd, path = tempfile.mkstemp(prefix="streamload-stderr-")
            try:
                # O_APPEND: writes always land at the end, so a truncate to 0 is a full reset.
                self.sink = os.open(path, os.O_RDWR | os.O_APPEND)
            finally:
                os.close(fd)
                os.unlink(path)
        return self.sink

    def after_fork_in_child(self) -> None:
        if self.sink >= 0:
            os.close(self.sink)  # the parent's file: never written by this process
        self.__init__()  # type: ignore[misc]


_STATE = _Capture()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: _STATE.lock.acquire(),
        after_in_parent=lambda: _STATE.lock.release(),
        after_in_child=_STATE.after_fork_in_child,
    )


@contextmanager
def c_stderr() -> Iterator[list[str]]:
    """Context manager: capture what is written to fd 2 inside it; yields the list of its lines.

    The list is filled when the block exits (lines stripped, empty ones dropped), also when
    it raises. Safe from several threads (captures are serialized) and across ``fork()``.
    """
    lines: list[str] = []
    state = _STATE
    if getattr(state.local, "active", False):
        yield lines  # an outer capture of this thread gets them
        return
    with state.lock:
        try:
            sink = state.sink_fd()
            saved = os.dup(2)
        except OSError:  # no temp file, or no fd 2 at all (a daemon): decode uncaptured
            yield lines
            return
        try:
            sys.stderr.flush()  # Python's own pending output is not the library's
        except (AttributeError, OSError, ValueError):
            pass
        state.local.active = True
        try:
            os.dup2(sink, 2)
            try:
                yield lines
            finally:
                os.dup2(saved, 2)
        finally:
            state.local.active = False
            os.close(saved)
            size = os.fstat(sink).st_size
            if size:
                text = os.pread(sink, size, 0).decode("utf-8", "replace")
                os.ftruncate(sink, 0)
                lines.extend(line.strip() for line in text.splitlines() if line.strip())
