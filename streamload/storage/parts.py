"""How a file is cut into concurrent ranged GETs: part size and concurrency, from measurements.

Used by :class:`~streamload.storage.transport.RemoteFiles` for every download whose size
is known (a shard or sidecar: its entry says it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PartPlanner"]

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

    def parts(self, size: int) -> list[tuple[int, int]]:
        """``[start, end)`` byte ranges covering a file of ``size`` bytes."""
        if size <= 0:
            return [(0, 0)] if size == 0 else []
        step = self.chosen_part_size()
        count = max(1, math.ceil(size / step))
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
