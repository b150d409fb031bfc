"""Corrupt copies, in one place: drop the bad copy, read a fresh one, once; and name where an error happened.

A remote dataset's files are local *copies* (a cached storage); one can go bad on disk
after it was verified, and the format reader's checksums find it. Three places meet it,
and all three come here:

* opening a shard (:meth:`~streamload.shards.ShardSource.get`): the copy is dropped and
  the shard opened again over a fresh download (:class:`Refetch`);
* reading a run of samples (:func:`recovering_samples`): the rest of the run is read from
  a reader over a fresh copy;
* reading a whole batch straight from the readers (:func:`recover_batch`): the batch is read
  again once its shards' bad copies are dropped.

Each shard is fetched again at most once per reader set: a shard still bad then is bad at
its source, and its error says so, naming the shard's URL, the sample key and the cached
path. A copy that hashes to its manifest entry is not downloaded again (the same bytes
would come), nor is a local dataset's own file ever touched. Streaming (ranged GETs), the
shard's fetched ranges are dropped instead, and the sample read once more from the bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

import numpy as np

from ._errors import CorruptShardError, StorageError, StreamloadError
from ._files import FileEntry
from ._redact import redact
from .formats import Sample, ShardReader
from .manifest import ShardEntry
from .plan import Run

__all__ = ["Failed", "Refetch", "key_of", "raise_located", "recover_batch", "recovering_samples", "skippable"]

log = logging.getLogger("streamload")


def skippable(exc: BaseException) -> bool:
    """True if ``on_error="skip"`` may skip what failed with ``exc``: it is about that shard or sample.

    A :class:`~streamload.StorageError` never is: the storage refused (401/403), failed
    past its retry budget (5xx, a connection refused or timed out) or the machine's cache
    cannot work (a :class:`~streamload.CacheError`). Skipping it would skip every shard
    after it and fill the epoch with one repeated sample. A missing shard (404, a
    :class:`~streamload.ShardNotFoundError`), a corrupt or unsafe one and a sample that
    cannot be decoded are about that shard or sample, and are skipped.
    """
    return not isinstance(exc, StorageError)


def raise_located(exc: StreamloadError, url: str, where: str) -> NoReturn:
    """Raise ``exc`` with ``where`` (``<url>/<shard>``) in front of its message, unless ``url`` is named there.

    An error type whose constructor takes something else than a message is raised as it is.
    """
    message = str(exc)
    if redact(url) in message:  # a message shows a URL's password as ***
        raise exc
    try:
        located = type(exc)(f"{where}: {message}")
    except TypeError:  # an error type with another constructor: keep it as it is
        raise exc from exc.__cause__
    raise located from exc


class _Discards(Protocol):
    def discard(self, entry: FileEntry) -> bool: ...  # pragma: no cover


class _Drops(Protocol):
    def drop(self, name: str) -> None: ...  # pragma: no cover


class Refetch:
    """Which shards of one reader set were fetched again, and the rule that drops a corrupt copy.

    Args:
        entries: The dataset's shard entries (by shard number).
        where: Names a shard for messages (``<url>/<shard>``).
        copies: The cached storage (``None``: a local dataset, never touched).
        ranges: Streaming: the fetched ranges (dropped instead of a copy), else ``None``.
        describe: Names the cache for messages.

    Attributes:
        recovered: Shards whose copies (or fetched ranges) were dropped and fetched again.
    """

    def __init__(
        self,
        entries: Sequence[ShardEntry],
        where: Callable[[ShardEntry], str],
        copies: _Discards | None,
        ranges: _Drops | None,
        describe: Callable[[], str],
    ) -> None:
        self.entries = entries
        self.where = where
        self.copies = copies
        self.ranges = ranges
        self.describe = describe
        self.recovered: set[int] = set()

    def __call__(self, shards: Iterable[int], error: BaseException) -> list[int]:
        """Drop the corrupt copies of ``shards`` (``error`` was met reading them); return the shards dropped.

        Returns ``[]`` for a local dataset or an error that is no corruption.

        Raises:
            CorruptShardError: If none was dropped because they are bad at their source:
                a copy fetched again already failed, or the cached copies hash to their
                manifest entries (a download would bring the same bytes). The message
                starts with the shard's URL and says which.
        """
        copies = self.copies
        if copies is None or not isinstance(error, CorruptShardError):
            return []
        again = (
            "read again from the bucket after the first read failed"
            if self.ranges is not None
            else "in a copy downloaded again after the cached one was corrupt"
        )
        dropped: list[int] = []
        bad: list[str] = []
        for shard in shards:
            entry = self.entries[shard]
            where = self.where(entry)
            if shard in self.recovered:
                bad.append(f"{where}: {error} ({again}: the shard is bad at its source)")
                continue
            if self.ranges is not None:  # streaming: drop the fetched ranges (and a sidecar copy gone bad)
                self.ranges.drop(entry.name)
                if entry.sidecar is not None:
                    copies.discard(entry.sidecar)  # only if its copy no longer hashes to its entry
                log.warning("%s: %s; reading its bytes from the bucket again", where, error)
            else:
                files = [f.name for f in entry.files if copies.discard(f)]
                if not files:
                    bad.append(
                        f"{where}: {error} (its cached copy, {self.describe()}, matches "
                        "the manifest's hash: the shard is bad at its source; not downloaded again)"
                    )
                    continue
                log.warning(
                    "%s: a cached copy is corrupt (%s); deleted %s from %s, downloading again",
                    where,
                    error,
                    ", ".join(files),
                    self.describe(),
                )
            self.recovered.add(shard)
            dropped.append(shard)
        if not dropped and bad:
            raise CorruptShardError("; ".join(bad)) from error
        return dropped


class _Recovers(Protocol):
    def recover(self, shard: int, error: StreamloadError) -> ShardReader | None: ...  # pragma: no cover

    def recover_any(self, shards: Iterable[int], error: StreamloadError) -> bool: ...  # pragma: no cover


def recover_batch(error: CorruptShardError, shards: list[int], readers: _Recovers, again: bool) -> None:
    """A batch read from ``shards`` met a corrupt copy: drop it and return (read the batch again, once), or raise.

    The caller reads the batch, and on :class:`CorruptShardError` calls this with
    ``again=False``; if its second read meets one too, with ``again=True``.

    Raises:
        CorruptShardError: ``error``, when no cached copy could be dropped, or on the
            second read (a shard bad at its source: ``recover_any`` names it).
    """
    if again:
        readers.recover_any(shards, error)  # bad at the source: say so (it raises)
        raise error
    if not readers.recover_any(shards, error):
        raise error


@dataclass
class Failed:
    """A sample that could not be read (under ``on_error="skip"``)."""

    error: StreamloadError
    key: str | None


def key_of(reader: ShardReader, index: int) -> str | None:
    """The key of sample ``index`` from the shard's index, if that can still be read."""
    try:
        return reader.keys_of(np.array([index], dtype=np.int64))[0]
    except Exception:  # noqa: BLE001 - the shard's index is damaged too: the sample is named by its index
        return None


def recovering_samples(
    readers: _Recovers, reader: ShardReader, run: Run, skip: bool, url: str, where: str
) -> Iterator[Sample | Failed]:
    """Read the run's samples from ``reader``.

    A corrupt cached copy of a remote shard is read again from a fresh download, once
    (``readers.recover``). With ``skip`` (``on_error="skip"``), a bad sample becomes a
    :class:`Failed` and reading goes on with the next one; else its error is raised,
    located (``where``: ``<url>/<shard>``). A :class:`~streamload.StorageError` (an
    outage, access denied, the machine's cache) is never skipped (see :func:`skippable`).
    """
    locals_ = run.locals.tolist()
    done = 0
    try:
        if run.contiguous:
            for sample in reader.iter_range(locals_[0], locals_[-1] + 1):
                yield sample
                done += 1
        else:
            for index in locals_:
                yield reader.get(index)
                done += 1
    except StreamloadError as exc:
        try:
            fresh = readers.recover(run.shard, exc)
        except StreamloadError as again:  # no fresh copy could be had
            fresh, exc = None, again
        if fresh is not None:
            yield from recovering_samples(readers, fresh, run.part(done), skip, url, where)
            return
        if not skip or not skippable(exc):  # the storage's or the machine's fault: never a skip
            raise_located(exc, url, where)
        yield Failed(exc, key_of(reader, locals_[done]))
        for index in locals_[done + 1 :]:
            try:
                yield reader.get(index)
            except StreamloadError as again:
                if not skippable(again):
                    raise_located(again, url, where)
                yield Failed(again, key_of(reader, index))
