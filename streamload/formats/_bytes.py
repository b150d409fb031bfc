"""Where a reader's shard bytes come from: a local file, or anything that reads byte ranges.

A reader that knows every offset from its index (the tar sidecar) needs only positioned
reads, so the same reader serves a shard on local disk (:class:`FileBytes`, ``pread``) and
a shard read by ranged requests straight from a bucket (any object with the
:class:`ShardBytes` methods, e.g. :class:`streamload.storage.transport.RangedFile`).
"""

from __future__ import annotations

import os
from typing import Protocol

__all__ = ["FileBytes", "ShardBytes"]


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

    def close(self) -> None:
        """Close the descriptor (once)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        # A reader dropped without close() must not leak its descriptor.
        if getattr(self, "fd", -1) >= 0:
            try:
                self.close()
            except OSError:
                pass
