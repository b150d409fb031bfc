"""The link model of a transport, and how a file is cut into concurrent ranged GETs.

:class:`LinkModel` is a transport's estimate of its link (latency and per-connection
rate). :class:`PartPlanner` is used by :class:`~streamload.storage.transport.RemoteFiles`
for every download whose size is known (a shard or sidecar: its entry says it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["FIRST_PART", "LEAD_PARTS", "SMALL_TRANSFER", "LinkModel", "PartPlanner", "merge_range"]

#: A download a reader waits for starts with this many bytes cut into :data:`LEAD_PARTS` parallel
#: parts, so the first batch's samples land at several connections' rate, not one's.
FIRST_PART = 8 << 20
#: The parts :data:`FIRST_PART` is cut into (a batch of 64 ImageNet-sized JPEGs is about 7 MB).
LEAD_PARTS = 8

_MIB = 1 << 20
#: Transfers smaller than this measure the latency; larger ones the rate.
SMALL_TRANSFER = _MIB


class LinkModel:
    """One transport's link: seconds from a request to its first byte, and bytes/s of one connection.

    ``seconds = latency + nbytes / (rate x connections)``, fitted to each transfer
    (exponentially weighted, so one slow GET does not swing it): a small transfer
    measures the latency, a large one the rate, each solved with the other held. The
    part planner, streaming's span sizes and the read-ahead depth all read this one
    estimate. Updated without a lock (a lost update of a float is harmless).

    Args:
        latency: First guess of the seconds to a request's first byte.
        rate: First guess of one connection's bytes/s.
        alpha: Weight of a new measurement.
    """

    __slots__ = ("alpha", "latency", "rate", "transfers")

    def __init__(self, latency: float = 0.05, rate: float = 40e6, alpha: float = 0.3) -> None:
        self.latency = latency
        self.rate = rate
        self.alpha = alpha
        #: Transfers measured.
        self.transfers = 0

    def observe(self, nbytes: int, seconds: float, connections: int = 1) -> None:
        """Fold one transfer of ``nbytes`` in ``seconds`` (first byte included) over ``connections`` at once."""
        if seconds <= 0 or nbytes < 0:
            return
        self.transfers += 1
        if nbytes < SMALL_TRANSFER:
            sample = max(0.0, seconds - nbytes / (self.rate * connections))
            self.latency += self.alpha * (sample - self.latency)
        elif seconds > self.latency:
            sample = nbytes / ((seconds - self.latency) * connections)
            self.rate += self.alpha * (sample - self.rate)

    def seconds(self, nbytes: int, connections: int = 1) -> float:
        """Estimated seconds to transfer ``nbytes`` over ``connections`` at once."""
        return self.latency + nbytes / (self.rate * max(1, connections))


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
        link: The link's estimates (the transport's own).
    """

    part_size: int | None = None
    max_concurrency: int = 8
    min_part: int = 4 * _MIB
    max_part: int = 16 * _MIB
    part_latencies: float = 4.0
    link: LinkModel = field(default_factory=lambda: LinkModel())

    @property
    def latency(self) -> float:
        """Estimated seconds from a request to its first byte."""
        return self.link.latency

    @property
    def rate(self) -> float:
        """Estimated bytes/s of one connection."""
        return self.link.rate

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


def merge_range(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint ``[start, end)``) with ``[start, end)`` added, merged."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*ranges, (start, end)]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged
