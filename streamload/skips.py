"""The skip/substitute stage: under ``on_error="skip"`` a bad sample is counted, named, and replaced.

Every rank still yields ``len(dataset)`` items (so DDP cannot hang): a skipped sample is
replaced by a repeat of the last good one of its stream (:class:`Substitute`), counted in
shared memory (the main process sees its workers' skips: ``skipped_samples``) and named,
the first :data:`MAX_NAMED_SKIPS` of a process, in the log and in :class:`SkipCounts`.

A collate that decodes samples itself (:class:`~streamload.decode.DecodeBatch`) meets a bad
sample inside the batch, where the stage cannot replace it: it reports the sample with
:func:`sample_failed`, which counts and names it the same way (and under
``on_error="raise"`` raises its error naming the shard), then fills its slot from another
sample of the batch, so the batch keeps its shape.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ._errors import StreamloadError
from ._shared import shared_block

__all__ = [
    "MAX_NAMED_SKIPS",
    "SkipCounts",
    "SkipLog",
    "SkippedSample",
    "Substitute",
    "batch_errors",
    "sample_failed",
]

log = logging.getLogger("streamload")

#: DataLoader workers whose skips are counted apart (one shared word each).
_MAX_WORKERS = 1024


#: Skipped samples a process names one by one (in ``errors.samples`` and the log); more are counted.
MAX_NAMED_SKIPS = 1000


@dataclass(frozen=True)
class SkippedSample:
    """One sample skipped under ``on_error="skip"``.

    Attributes:
        shard: The shard's name (``<stream URL>/<shard>`` in a mixture).
        index: The sample's index within the shard.
        key: The sample's key, or ``None`` if the shard's index could not be read.
        reason: Why it was skipped (the error's message).
    """

    shard: str
    index: int
    key: str | None
    reason: str


_SKIP_LOCK = threading.Lock()


@dataclass
class SkipCounts:
    """Samples one process skipped under ``on_error="skip"`` (:attr:`StreamingDataset.errors`).

    Unlike :attr:`StreamingDataset.skipped_samples` (shared with the DataLoader workers),
    these counts are the calling process's own (a DataLoader worker names its skips in its
    own log lines).

    Attributes:
        samples_skipped: Samples skipped in all.
        shards: Samples skipped per shard, by shard name (``<stream URL>/<shard>`` in a mixture).
        samples: Each skipped sample, named (shard, index, key, reason), in the order they
            were skipped: the first :data:`MAX_NAMED_SKIPS`; ``samples_skipped`` counts
            them all. Not part of equality (which compares the counts).
    """

    samples_skipped: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    samples: list[SkippedSample] = field(default_factory=list, compare=False)

    def add(self, shard: str, count: int, named: list[SkippedSample] | None = None) -> bool:
        """Count ``count`` skipped samples of ``shard`` (naming ``named``); return True if they are its first.

        Safe to call from several threads (the readers of a :class:`streamload.Loader`).
        """
        with _SKIP_LOCK:
            before = self.shards.get(shard, 0)
            self.samples_skipped += count
            self.shards[shard] = before + count
            self.samples.extend(named or ())
        return before == 0


class SkipLog:
    """Counts (shared with the DataLoader workers), names and logs the samples a dataset skips.

    Args:
        source: The dataset's URL(s), for the log.

    Attributes:
        errors: This process's counts (:attr:`StreamingDataset.errors`).
    """

    def __init__(self, source: str) -> None:
        self.source = source
        #: Skipped samples per worker id (shared memory, so the main process sees them).
        self.counts = shared_block(_MAX_WORKERS)
        self.errors = SkipCounts()

    def total(self) -> int:
        """Samples skipped by this process and its DataLoader workers."""
        return int(self.counts.sum())

    def skip(
        self,
        name: str,
        exc: BaseException,
        indices: list[int],
        keys: list[str | None],
        source: str | None = None,
    ) -> None:
        """Count, name and log skipped samples of shard ``name`` (indices and keys, ``None`` if unreadable).

        ``source``: a mixture's stream URL. Each sample is named in :attr:`errors` and the
        log, up to :data:`MAX_NAMED_SKIPS` per process; those past it are counted.
        """
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        count = len(indices)
        self.counts[0 if info is None else info.id] += count
        shard = name if source is None else f"{source}/{name}"
        where = f"{self.source if source is None else source}/{name}"
        reason = " ".join(str(exc).split()) or type(exc).__name__
        errors = self.errors
        room = max(0, MAX_NAMED_SKIPS - len(errors.samples))
        named = [SkippedSample(shard, i, k, reason) for i, k in zip(indices[:room], keys[:room], strict=True)]
        errors.add(shard, count, named)
        if named and all(k is None for k in keys):  # keys unreadable (the shard could not be opened)
            span = f"#{indices[0]}" if count == 1 else f"#{indices[0]}..#{indices[-1]}"
            log.warning("skipping %d sample(s) %s of %s (their keys could not be read): %s", count, span, where, reason)
        else:
            for sample in named:
                log.warning("skipping sample %r (#%d) of %s: %s", sample.key, sample.index, where, reason)
        if len(named) < count and room:
            log.warning(
                "more than %d samples skipped: further ones are counted (errors.samples_skipped), not named",
                MAX_NAMED_SKIPS,
            )


class Substitute:
    """Keeps the item count whole under ``on_error="skip"``.

    Each skipped item is replaced by a repeat of the last good one of the same stream (owed
    until one exists), so a mixture's shares hold: a stand-in for stream B's bad sample
    comes from stream B. An item still owed at the end comes from any stream.
    """

    def __init__(self) -> None:
        self.last: dict[object, Any] = {}
        self.owed: dict[object, int] = {}

    def state(self) -> dict[str, Any]:
        """Plain data: the items owed per stream, and the streams that have a stand-in."""
        return {"owed": dict(self.owed), "stand_ins": list(self.last)}

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Forget the stand-ins and what is owed (a new iteration), whatever ``state`` says.

        Stand-ins are samples, not plain data: a resumed skip stage starts without them.
        """
        self.last.clear()
        self.owed.clear()

    def good(self, item: Any, stream: object = None) -> Iterator[Any]:
        """Yield ``item`` of ``stream``, and the stand-ins it owes."""
        self.last[stream] = item
        yield item
        for _ in range(self.owed.pop(stream, 0)):
            yield item

    def fail(self, count: int, stream: object = None) -> Iterator[Any]:
        """Yield stand-ins for ``count`` skipped items of ``stream`` (owed until it has a good one)."""
        if stream not in self.last:
            self.owed[stream] = self.owed.get(stream, 0) + count
            return
        for _ in range(count):
            yield self.last[stream]

    def finish(self) -> Iterator[Any]:
        """Yield what is still owed at the end, from any stream."""
        owed = sum(self.owed.values())
        if owed and not self.last:
            raise StreamloadError(
                f"every one of the {owed} samples this worker had to read failed; nothing to substitute"
            )
        self.owed.clear()
        stand_in = next(reversed(self.last.values()), None)
        for _ in range(owed):
            yield stand_in


#: What a collate reports a bad sample of its batch to: ``(index in the batch, error) -> skipped``.
SampleErrors = Callable[[int, BaseException], bool]

_BATCH_ERRORS: ContextVar[SampleErrors | None] = ContextVar("streamload_batch_errors", default=None)


@contextmanager
def batch_errors(handler: SampleErrors) -> Iterator[None]:
    """Within the block, :func:`sample_failed` reports to ``handler`` (the dataset's read stage sets it)."""
    token = _BATCH_ERRORS.set(handler)
    try:
        yield
    finally:
        _BATCH_ERRORS.reset(token)


def sample_failed(index: int, error: BaseException) -> bool:
    """Report that sample ``index`` of the batch being collated failed (a collate calls this).

    Inside a :class:`~streamload.StreamingDataset` (or :class:`~streamload.Loader`) with
    ``on_error="skip"``, the sample is counted and named like any skipped sample
    (``skipped_samples``, ``errors.samples``, the log) and True is returned: the collate
    then fills its slot from another sample of the batch. With ``on_error="raise"`` the
    error is raised with the sample's shard in front of its message. Outside a dataset's
    iteration (a collate called directly) it returns False: the collate raises the error.

    Args:
        index: The sample's index in the list the collate was given.
        error: Why it failed (its message names the sample).

    Raises:
        StreamloadError: ``error`` (a :class:`~streamload.SampleError` if it was none),
            located, under ``on_error="raise"``.
    """
    handler = _BATCH_ERRORS.get()
    return handler is not None and handler(index, error)
