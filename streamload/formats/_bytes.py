"""Where a reader's shard bytes come from: a local file, or anything that reads byte ranges.

A reader that knows every offset from its index (the tar sidecar) needs only positioned
reads, so the same reader serves a shard on local disk (:class:`FileBytes`, ``pread``) and
a shard read by ranged requests straight from a bucket (any object with the
:class:`ShardBytes` methods, e.g. :class:`streamload.storage.transport.RangedFile`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Protocol

__all__ = ["MAX_GAP", "FileBytes", "ShardBytes", "gather"]

#: Bytes between two wanted ranges read along (into a scratch buffer) rather than split into two reads.
MAX_GAP = 64 << 10
#: Buffers one ``preadv`` takes at most (the kernel's IOV_MAX).
_IOV_MAX = 1024


class ShardBytes(Protocol):
    """Positioned reads of one shard's bytes."""

    #: The shard's size in bytes.
    size: int

    def pread(self, n: int, offset: int) -> bytes:
        """Return up to ``n`` bytes at ``offset`` (fewer only at the end)."""

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset``; return the bytes read."""

    def close(self) -> None:
        """Release the source."""


class FileBytes:
    """A local file's bytes through its descriptor (``os.pread``/``os.preadv``; one copy, no page-cache RSS)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        """``os.pread``."""
        return os.pread(self.fd, n, offset)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """``os.preadv``."""
        return os.preadv(self.fd, buffers, offset)

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        """Close the descriptor (once).

        ``os.close`` is bound at definition: at interpreter exit this may run after the
        module's globals are gone.
        """
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _close(fd)

    def __del__(self) -> None:
        # A reader dropped without close() must not leak its descriptor; never raises
        # (also at interpreter exit).
        try:
            if getattr(self, "fd", -1) >= 0:
                self.close()
        except Exception:  # noqa: BLE001, S110 - best effort at collection time
            pass


def gather(
    segments: Iterable[tuple[int, int, memoryview]],
    scratch: memoryview,
    preadv: Callable[[list[memoryview], int, int], None],
) -> None:
    """Read ``(file offset, size, destination)`` segments, in file order, with as few ``preadv`` as it takes.

    Segments closer than :data:`MAX_GAP` share one read; the bytes between them land in
    ``scratch`` (at least :data:`MAX_GAP` long). ``preadv(buffers, offset, expected)`` does
    each read and raises if it came back short (the reader names the shard).
    """
    iov: list[memoryview] = []
    first = end = 0
    for off, size, dest in segments:
        gap = off - end
        if iov and (gap < 0 or gap > MAX_GAP or len(iov) >= _IOV_MAX - 2):
            preadv(iov, first, end - first)
            iov = []
        if not iov:
            first = end = off
        elif gap:
            iov.append(scratch[:gap])
        iov.append(dest[:size])
        end = off + size
    if iov:
        preadv(iov, first, end - first)
