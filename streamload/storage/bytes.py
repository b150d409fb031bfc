"""Where a reader's shard bytes come from: one interface, :class:`ShardBytes`, and all its kinds.

A reader that knows every offset from its index (the tar sidecar, a Parquet footer) needs
only positioned reads, so the same reader serves:

* :class:`FileBytes`: a local file (a shard read in place, or a cached copy), by ``pread``;
* :class:`Landing`: a download in progress, read by byte ranges as its parts land (a
  cold shard's first samples before the whole file is in the cache);
* :class:`StreamedFile`: a remote object never downloaded whole, read from the byte
  ranges streaming mode fetched ahead (:mod:`.ranges`), else by direct ranged GETs.

A storage hands them out: :meth:`~streamload.storage.Storage.open_bytes`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._errors import CorruptShardError
from .._pread import pread_blocks
from .parts import FIRST_PART, merge_range

if TYPE_CHECKING:
    from .ranges import RangeFetcher


def _executor() -> Any:
    from .executor import io_executor  # (the executor module imports the transport: not at import time)

    return io_executor()


log = logging.getLogger("streamload")

__all__ = ["MAX_GAP", "WANT_BUDGET", "WANT_SPAN", "FileBytes", "Landing", "ShardBytes", "StreamedFile", "gather"]

#: Bytes between two wanted ranges read along (into a scratch buffer) rather than split into two reads.
MAX_GAP = 64 << 10
#: Longest ranged GET of :meth:`Landing.want` (a batch's run of samples comes over several connections).
WANT_SPAN = 1 << 20
#: Bytes of wanted ranges one :class:`Landing` holds at most (the first batches' samples of
#: its shard; past it, reads wait for the download as before).
WANT_BUDGET = 8 << 20
#: Buffers one ``preadv`` takes at most (the kernel's IOV_MAX).
_IOV_MAX = 1024


@runtime_checkable
class ShardBytes(Protocol):
    """What a format reader needs from its shard's bytes: positioned reads of one object.

    A local file (``pread``/``preadv`` on its descriptor) and a remote object read by
    ranged requests (streaming mode) both fit; a reader that knows every offset from its
    index (tar, Parquet) serves either without knowing which. Reads past the end come
    back short, never raise: the reader names the truncated shard.
    """

    #: The object's size in bytes.
    size: int

    def pread(self, n: int, offset: int) -> bytes:
        """Return up to ``n`` bytes at ``offset`` (fewer only at the end)."""

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset``; return the bytes read (fewer only at the end)."""

    def close(self) -> None:
        """Release the source (the reader does not use it afterwards)."""


class FileBytes:
    """A local file's bytes through its descriptor (``os.pread``/``os.preadv``; one copy, no page-cache RSS)."""

    def __init__(self, fd: int, size: int | None = None) -> None:
        """Read ``fd``; ``size``: its size when known (else ``fstat``)."""
        self.fd = fd
        self.size = os.fstat(fd).st_size if size is None else size

    def pread(self, n: int, offset: int) -> bytes:
        """``os.pread``."""
        return os.pread(self.fd, n, offset)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """``os.preadv``."""
        return os.preadv(self.fd, buffers, offset)

    def pread_blocks(self, n: int, offsets: list[int]) -> list[bytes]:
        """``n`` bytes at each of ``offsets``, in one native call (cached: holding the GIL), else ``os.pread`` each."""
        blocks = pread_blocks(self.fd, offsets, n)
        return [os.pread(self.fd, n, at) for at in offsets] if blocks is None else blocks

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


class Landing:
    """A file being downloaded into the cache, readable by byte ranges as its parts land.

    The downloader calls :meth:`begin` with each attempt's part file, :meth:`land` as each
    part is written, then :meth:`finish` with the cached path (or :meth:`fail`). A reader's
    :meth:`pread` / :meth:`preadv` wait until their range has landed (or the file is
    cached) and read it from the part file: the same inode the cache renames into place.
    Nothing read here was verified by the whole file's hash: the reader checks each
    sample's own digest, as for every read.

    A reader may also :meth:`want` byte ranges before they land (a cold start's first
    batches, their samples all over the file): those are fetched at once by ranged GETs
    and kept here, not written into the part file (only the download writes, and checks,
    the file), until the file is cached.

    Args:
        name: The file's name (for messages).
        size: Its size from its entry.
        get: ``get(start, end)``: bytes ``[start, end)`` of the remote object by one ranged
            GET (``None``: :meth:`want` does nothing).
        lead: The bytes at the file's start its download brings first, in parallel parts
            (:data:`~.parts.FIRST_PART`): ranges there are not wanted by GETs of their own.
    """

    def __init__(
        self, name: str, size: int, get: Callable[[int, int], bytes] | None = None, lead: int = FIRST_PART
    ) -> None:
        self.name = name
        self.size = size
        self._get = get
        self._lead = lead
        self._direct: list[tuple[int, int, Future[bytes]]] = []  # ranges wanted before they landed
        #: Bytes fetched by ranged GETs because a reader wanted them before they landed.
        self.direct_bytes = 0
        #: Reads served from those GETs: bytes that never came from the file its download checks.
        self.wanted_reads = 0
        self._cond = threading.Condition()
        self._fd = -1
        self._fds: list[int] = []  # closed by close(): a reader may still be reading an older one
        self._landed: list[tuple[int, int]] = []  # merged [start, end) ranges of the current attempt
        self._final: str | None = None
        self._error: BaseException | None = None
        self._closed = False
        #: Reads served before the file was complete (from its landed parts).
        self.early_reads = 0
        #: Download attempts (more than one: a copy failed its check and was fetched again).
        self.attempts = 0

    def begin(self, part_path: str) -> None:
        """A (new) download attempt writes ``part_path``: what landed before is forgotten."""
        fd = os.open(part_path, os.O_RDONLY | os.O_NOFOLLOW)
        with self._cond:
            self.attempts += 1
            if self._closed:
                os.close(fd)
                return
            self._fds.append(fd)
            self._fd, self._landed = fd, []

    def land(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` were written to the current part file."""
        with self._cond:
            self._landed = merge_range(self._landed, start, end)
            self._cond.notify_all()

    def finish(self, path: str) -> None:
        """The file is verified and cached at ``path``: every read is served from there."""
        fd = os.open(path, os.O_RDONLY)
        with self._cond:
            if self._closed:
                os.close(fd)
                return
            self._fds.append(fd)
            self._fd, self._final = fd, path
            self._direct = []
            self._cond.notify_all()

    def want(self, extents: Iterable[tuple[int, int]], lead: bool = False) -> None:
        """Fetch the byte ranges ``extents`` now, by ranged GETs in parallel, where they have not landed.

        Close extents are fetched together (:data:`MAX_GAP`), in GETs of at most
        :data:`WANT_SPAN` bytes; those within the download's lead are left to it, unless
        ``lead`` (several downloads started at once: one's lead parts may queue behind
        another's). A read they cover waits for its GET rather than for the download's
        part; a GET that fails leaves the read to the download. The bytes held stay under
        :data:`WANT_BUDGET` (those the download has landed since are dropped first).
        """
        get = self._get
        if get is None:
            return
        spans: list[tuple[int, int]] = []
        skip = 0 if lead else self._lead
        for start, end in sorted((max(0, int(a)), min(self.size, int(b))) for a, b in extents):
            if end <= max(start, skip):
                continue
            near = spans and start - spans[-1][1] <= MAX_GAP and end - spans[-1][0] <= WANT_SPAN
            if spans and (start < spans[-1][1] or near):  # overlapping ones always (the same row group twice)
                spans[-1] = (spans[-1][0], max(spans[-1][1], end))
            else:
                spans.append((start, end))
        with self._cond:
            if self._final is not None or self._closed:
                return
            # What the download has landed since is read from the file: its GETs' bytes go.
            self._direct = [d for d in self._direct if not (self._fd >= 0 and self._covered(d[0], d[1]))]
            room = WANT_BUDGET - sum(b - a for a, b, _ in self._direct)
            kept: list[tuple[int, int]] = []
            for a, b in spans:
                if not self._covered(a, b) and self._wanted(a, b) is None and b - a <= room:
                    kept.append((a, b))
                    room -= b - a
            spans = kept
            if not spans:
                return
            executor = _executor()
            for a, b in spans:
                try:
                    future = executor.submit("side", get, a, b)
                except RuntimeError:  # the executor is shutting down (interpreter exit): the download serves
                    break
                future.add_done_callback(self._got)
                self._direct.append((a, b, future))
                self.direct_bytes += b - a
        log.debug("want %s: %d ranges, %d bytes: start", self.name, len(spans), sum(b - a for a, b in spans))

    def _wanted(self, start: int, end: int) -> tuple[int, Future[bytes]] | None:
        for a, b, future in self._direct:
            if a <= start and end <= b:
                return a, future
        return None

    def _read_wanted(self, start: int, end: int) -> memoryview | None:
        """Bytes ``[start, end)`` from a wanted range's GET unless the file has them first, else ``None``.

        Waits for whichever comes first: the GET, or the download landing the range (or
        ending, or failing).
        """
        with self._cond:
            found = self._wanted(start, end) if self._direct else None
            while found is not None and not found[1].done():
                if self._final is not None or self._error is not None or self._closed:
                    return None
                if self._fd >= 0 and self._covered(start, end):
                    return None
                self._cond.wait()
            if found is None or self._final is not None or (self._fd >= 0 and self._covered(start, end)):
                return None
        at, future = found
        try:
            data = future.result()
        except Exception:  # noqa: BLE001 - the download brings these bytes too (or names the failure)
            return None
        if len(data) < end - at:
            return None
        with self._cond:
            self.early_reads += 1
            self.wanted_reads += 1
        return memoryview(data)[start - at : end - at]

    def _got(self, _: Future[bytes]) -> None:
        with self._cond:
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The download failed: reads not yet served raise ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """True once the file is cached (:meth:`finish`)."""
        return self._final is not None

    def _covered(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self._landed)

    def _wait(self, start: int, end: int) -> int:
        end = min(end, self.size)
        with self._cond:
            while True:
                if self._final is not None:
                    return self._fd
                if self._fd >= 0 and (end <= start or self._covered(start, end)):
                    self.early_reads += 1
                    return self._fd
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise ValueError(f"{self.name}: read after close")
                self._cond.wait()

    def wait_done(self) -> str:
        """Wait until the file is cached; return its path (or raise the download's error)."""
        with self._cond:
            while self._final is None:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
            return self._final

    def pread(self, n: int, offset: int) -> bytes:
        """Return ``n`` bytes at ``offset`` once they have landed (or came by a wanted range's GET)."""
        wanted = self._read_wanted(offset, min(self.size, offset + n))
        if wanted is not None:
            return bytes(wanted)
        return os.pread(self._wait(offset, offset + n), n, offset)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset`` once their span has landed; return the bytes read."""
        total = sum(len(b) for b in buffers)
        wanted = self._read_wanted(offset, min(self.size, offset + total))
        if wanted is not None:
            at = 0
            for buf in buffers:
                take = min(len(buf), len(wanted) - at)
                buf[:take] = wanted[at : at + take]
                at += take
            return at
        return os.preadv(self._wait(offset, offset + total), buffers, offset)

    def close(self) -> None:
        """Wait for the download to end (bounded by its retries), then close the descriptors.

        The reader that read parts early is done with the file only once the file is
        cached, as if it had waited for it before reading: the next epoch finds it.

        Raises:
            CorruptShardError: The download failed its check (again): the file is bad at
                its source, even if every sample read early passed its own digest.
        """
        try:
            self.wait_done()
        except CorruptShardError:
            raise
        except Exception:  # noqa: BLE001, S110 - met by a read, or the next acquire meets it again
            pass
        finally:
            with self._cond:
                fds, self._fds, self._fd, self._closed = self._fds, [], -1, True
                direct, self._direct = self._direct, []
                self._cond.notify_all()
            for _, _, future in direct:
                future.cancel()
            for fd in fds:
                os.close(fd)


class StreamedFile:
    """A remote object's bytes for a shard reader, by ranges (streaming mode).

    Reads are served by a :class:`RangeFetcher` from the spans fetched ahead for the
    planned batches, else by direct ranged GETs; nothing is kept here.

    Args:
        fetcher: This process's fetcher for the object's prefix.
        name: The object's name.
        size: Its size from its entry.
    """

    def __init__(self, fetcher: RangeFetcher, name: str, size: int) -> None:
        self.fetcher = fetcher
        self.name = name
        self.size = size

    def pread(self, n: int, offset: int) -> bytes:
        """Return ``n`` bytes at ``offset`` (fewer only at the end of the object)."""
        buf = bytearray(max(0, min(n, self.size - offset)))
        got = self.fetcher.read_into(self.name, self.size, memoryview(buf), offset)
        return bytes(buf[:got]) if got != len(buf) else bytes(buf)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset``; return the bytes read."""
        total = sum(len(b) for b in buffers)
        whole = self.fetcher.span_bytes(self.name, offset, offset + total)
        if whole is not None:  # the usual case: one fetched span holds the whole run
            at = 0
            for buf in buffers:
                buf[:] = whole[at : at + len(buf)]
                at += len(buf)
            return total
        done = 0
        for buf in buffers:
            got = self.fetcher.read_into(self.name, self.size, buf, offset + done)
            done += got
            if got < len(buf):
                break
        return done

    def close(self) -> None:
        """Nothing to release (the fetcher's spans belong to the batches that planned them)."""
