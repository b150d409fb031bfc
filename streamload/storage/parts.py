"""How a file is cut into concurrent ranged GETs, and reading a download by its parts as they land.

:class:`PartPlanner` is used by :class:`~streamload.storage.transport.RemoteFiles` for
every download whose size is known (a shard or sidecar: its entry says it).
:class:`Landing` is one download in progress seen by a reader of the same process: the
byte ranges whose parts were written can be read before the whole file is verified and
renamed into the cache (see :meth:`~streamload.storage.remote.RemoteStorage.acquire_early`).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

from .._errors import CorruptShardError

__all__ = ["FIRST_PART", "LEAD_PARTS", "Landing", "PartPlanner", "PartSlots", "merge_range"]

#: A download a reader waits for starts with this many bytes cut into :data:`LEAD_PARTS` parallel
#: parts, so the first batch's samples land at several connections' rate, not one's.
FIRST_PART = 8 << 20
#: The parts :data:`FIRST_PART` is cut into (a batch of 64 ImageNet-sized JPEGs is about 7 MB).
LEAD_PARTS = 8

_MIB = 1 << 20


@dataclass
class PartPlanner:
    """How a file is cut into concurrent ranged GETs: part size and concurrency.

    A far bucket answers each request after a latency and gives each connection a
    limited bandwidth, so one GET per shard is bound by one connection. A part should be
    large enough that its transfer time dwarfs the latency (``part_latencies`` latencies'
    worth of bytes at the measured per-connection rate), and enough parts run at once to
    fill the pipe. The rate and latency are measured from the parts themselves
    (exponentially weighted), starting from the guesses below; ``part_size`` and
    ``max_concurrency`` override the choice.

    Attributes:
        part_size: Fixed part size in bytes, or ``None`` to choose it from the measurements.
        max_concurrency: Most parts of one file in flight at once.
        min_part: Smallest part chosen (bytes).
        max_part: Largest part chosen (bytes); also bounds the memory of a download
            (``max_concurrency x max_part``).
        part_latencies: A part's transfer should take this many latencies.
        latency: Estimated seconds from a request to its first byte.
        rate: Estimated bytes/s of one connection.
    """

    part_size: int | None = None
    max_concurrency: int = 8
    min_part: int = 4 * _MIB
    max_part: int = 16 * _MIB
    part_latencies: float = 4.0
    latency: float = 0.05
    rate: float = 40e6

    def chosen_part_size(self) -> int:
        """The part size for the next file (a whole number of MiB)."""
        if self.part_size is not None:
            return max(1, self.part_size)
        want = self.part_latencies * self.latency * self.rate
        return int(min(self.max_part, max(self.min_part, math.ceil(want / _MIB) * _MIB)))

    def parts(self, size: int, first: int | None = None) -> list[tuple[int, int]]:
        """``[start, end)`` byte ranges covering a file of ``size`` bytes, in whole rounds.

        The parts are equal and their count a multiple of :attr:`max_concurrency` once
        there are more than it: a lone last part would be a second round of one
        connection (a 64 MiB shard and a little more, cut in 8 MiB parts, took twice as
        long as in 8 parts of a bit more). Parts grow up to :attr:`max_part` to keep the
        rounds few. With ``first``, the file's first ``first`` bytes come first, as
        :data:`LEAD_PARTS` equal parts fetched at once (the bytes a waiting reader needs
        first), then the rest cut as usual.
        """
        if first is not None and 0 < first < size:
            step = math.ceil(first / LEAD_PARTS)
            lead = [(a, min(first, a + step)) for a in range(0, first, step)]
            rest = self._cut(size - first, self.max_concurrency)
            return lead + [(a + first, b + first) for a, b in rest]
        return self._cut(size, self.max_concurrency)

    def _cut(self, size: int, slots: int) -> list[tuple[int, int]]:
        if size <= 0:
            return [(0, 0)] if size == 0 else []
        step = self.chosen_part_size()
        count = max(1, math.ceil(size / step))
        if count > slots and self.part_size is None:
            rounds = max(1, math.ceil(size / (slots * max(step, self.max_part))))
            count = rounds * slots
        step = math.ceil(size / count)  # equal parts
        return [(a, min(size, a + step)) for a in range(0, size, step)]

    def concurrency(self, size: int) -> int:
        """Parts of a file of ``size`` bytes fetched at once."""
        return max(1, min(self.max_concurrency, len(self.parts(size))))

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one part's transfer (``nbytes`` in ``seconds``, first byte included) into the estimates.

        A small part is mostly latency, a large one mostly transfer: ``seconds = latency +
        nbytes / rate`` is solved with the other estimate held.
        """
        if seconds <= 0:
            return
        alpha = 0.3
        transfer = seconds - self.latency
        if nbytes >= self.min_part and transfer > 0:
            self.rate += alpha * (nbytes / transfer - self.rate)
        elif nbytes < self.min_part:
            latency = max(0.0, seconds - nbytes / self.rate)
            self.latency += alpha * (latency - self.latency)


class PartSlots:
    """The ranged GETs of one process's read-ahead in flight at once; the reader's own never wait.

    Read-ahead downloads run beside the download a reader waits for (the link is shared,
    not left idle while one shard arrives), up to ``capacity`` GETs in flight counting the
    reader's own; a part of a download a reader waits for (``urgent``) starts at once,
    even past ``capacity`` (a part takes a second or more on a far link: a sidecar queued
    behind read-ahead parts would wait that long).

    Args:
        capacity: GETs in flight at most (a few downloads' parts).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._cond = threading.Condition()
        self._busy = 0

    def take(self, urgent: bool, stop: threading.Event | None = None) -> bool:
        """Wait for a slot; False if ``stop`` was set first (no slot taken)."""
        with self._cond:
            if urgent:  # never queued behind read-ahead: parts are long, a sidecar would wait seconds
                self._busy += 1
                return True
            while self._busy >= self.capacity:
                if stop is not None and stop.is_set():
                    return False
                self._cond.wait(0.05)
            self._busy += 1
            return True

    def give(self) -> None:
        """Free a slot taken by :meth:`take`."""
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    @property
    def busy(self) -> int:
        """Slots taken now."""
        return self._busy


def merge_range(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint ``[start, end)``) with ``[start, end)`` added, merged."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*ranges, (start, end)]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


class Landing:
    """A file being downloaded into the cache, readable by byte ranges as its parts land.

    The downloader calls :meth:`begin` with each attempt's part file, :meth:`land` as each
    part is written, then :meth:`finish` with the cached path (or :meth:`fail`). A reader's
    :meth:`pread` / :meth:`preadv` wait until their range has landed (or the file is
    cached) and read it from the part file: the same inode the cache renames into place.
    Nothing read here was verified by the whole file's hash: the reader checks each
    sample's own digest, as for every read.

    Args:
        name: The file's name (for messages).
        size: Its size from its entry.
    """

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
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
        """Return ``n`` bytes at ``offset`` once they have landed."""
        return os.pread(self._wait(offset, offset + n), n, offset)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset`` once their span has landed; return the bytes read."""
        total = sum(len(b) for b in buffers)
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
                self._cond.notify_all()
            for fd in fds:
                os.close(fd)
