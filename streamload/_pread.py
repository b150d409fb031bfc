"""A batch's positioned reads of local files in one call that lets go of the GIL once.

A thread that releases the GIL for a system call must take it back afterwards, and beside a
thread running Python that can wait up to the switch interval (5 ms). A shuffled batch's
samples lie all over their shards: read one ``os.pread`` (or ``os.preadv`` of a run) at a
time, a batch makes about one such release per sample (and python-xxhash lets go of it for
each member's checksum too). :func:`pread_gather` makes it one per batch, over all the
batch's shards (:class:`Gather`, one a shard, run together by :func:`gather_all`),
checksums included where the system's xxHash is there, through the small C extension
``streamload._gather`` (built by the package's install where a C compiler is present;
optional). Where it is absent, :func:`pread_gather` returns ``None`` and the caller reads
as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["Gather", "available", "gather_all", "hashes", "pread_gather"]

_STATE: dict[str, ModuleType | None] = {}


def _module() -> ModuleType | None:
    if "module" not in _STATE:
        try:
            _STATE["module"] = importlib.import_module(f"{__package__}._gather")
        except ImportError:
            _STATE["module"] = None
    return _STATE["module"]


def available() -> bool:
    """True if the extension is built (importable)."""
    return _module() is not None


def hashes() -> bool:
    """True if :func:`pread_gather` can hash what it reads (the system's xxHash, ``libxxhash.so.0``, is there)."""
    module = _module()
    return module is not None and bool(module.has_xxh3())


def pread_gather(
    fd: int | np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    outs: Sequence[Any],
    which: np.ndarray,
    at: np.ndarray,
    sums: np.ndarray | None = None,
) -> np.ndarray | None:
    """Read ``lengths[i]`` bytes at ``offsets[i]`` of ``fd`` into ``outs[which[i]]`` at byte ``at[i]``, for every i.

    All reads in one call that releases the GIL once, in (file, offset) order. Every
    destination is checked to lie inside its buffer before anything is read.

    Args:
        fd: An open file descriptor, or one an entry (``int32``: a batch over many files).
        offsets: File offsets (``int64``).
        lengths: Bytes to read (``int64``).
        outs: Writable C-contiguous buffers (``uint8`` arrays, ``bytearray``, ...).
        which: Each entry's buffer in ``outs`` (``int32``).
        at: Each entry's byte offset in its buffer (``int64``).
        sums: If given (``uint64``, one an entry; needs :func:`hashes`), gets each fully read
            entry's XXH3-64 digest (``xxhash.xxh3_64_intdigest`` of its bytes), computed in
            the same call: a batch's checksums without a call a member.

    Returns:
        ``int64`` bytes read per entry (fewer than asked only at the end of the file; a
        negative value is ``-errno`` of a failed read), or ``None`` when the extension is not
        built (the caller reads another way).

    Raises:
        ValueError: If an entry's destination does not fit in its buffer, or a value is negative.
    """
    module = _module()
    if module is None:
        return None
    n = len(offsets)
    got = np.empty(n, dtype=np.int64)
    module.pread_gather(
        fd if isinstance(fd, int) else np.ascontiguousarray(fd, dtype=np.int32),
        np.ascontiguousarray(offsets, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int64),
        outs,
        np.ascontiguousarray(which, dtype=np.int32),
        np.ascontiguousarray(at, dtype=np.int64),
        got,
        sums,
    )
    return got


@dataclass
class Gather:
    """One shard's part of a batch's gathered read: its entries, and the check of what came back.

    Attributes:
        fd: The shard's open file descriptor.
        offsets: ``int64`` file offset of each entry.
        lengths: ``int64`` bytes of each entry.
        outs: The buffers the entries go to.
        which: ``int32`` each entry's buffer in :attr:`outs`.
        at: ``int64`` each entry's byte offset in its buffer.
        check: Called with the entries' bytes read and digests (``None`` without
            :func:`hashes`); raises, naming the shard and sample, for a short, failed or
            damaged read.
    """

    fd: int
    offsets: np.ndarray
    lengths: np.ndarray
    outs: Sequence[Any]
    which: np.ndarray
    at: np.ndarray
    check: Callable[[np.ndarray, np.ndarray | None], None]


def gather_all(plans: Sequence[Gather]) -> bool:
    """Read every plan's entries in one :func:`pread_gather` call, then check each plan in turn.

    The checks run in the plans' order, so an error names the first bad shard of the batch.

    Returns:
        False (nothing read) when the extension is not built.
    """
    if not available():
        return False
    if len(plans) == 1:
        plan = plans[0]
        sums = np.empty(len(plan.offsets), dtype=np.uint64) if hashes() else None
        got = pread_gather(plan.fd, plan.offsets, plan.lengths, plan.outs, plan.which, plan.at, sums)
        assert got is not None
        plan.check(got, sums)
        return True
    outs: list[Any] = []
    slot: dict[int, int] = {}  # id(buffer) -> its place in outs
    remaps = []
    for plan in plans:
        remap = np.empty(len(plan.outs), dtype=np.int32)
        for j, out in enumerate(plan.outs):
            k = slot.get(id(out))
            if k is None:
                k = slot[id(out)] = len(outs)
                outs.append(out)
            remap[j] = k
        remaps.append(remap[plan.which])
    counts = [len(plan.offsets) for plan in plans]
    fds = np.repeat(np.array([plan.fd for plan in plans], dtype=np.int32), counts)
    total = sum(counts)
    sums = np.empty(total, dtype=np.uint64) if hashes() else None
    got = pread_gather(
        fds,
        np.concatenate([plan.offsets for plan in plans]),
        np.concatenate([plan.lengths for plan in plans]),
        outs,
        np.concatenate(remaps),
        np.concatenate([plan.at for plan in plans]),
        sums,
    )
    assert got is not None
    start = 0
    for plan, count in zip(plans, counts, strict=True):
        plan.check(got[start : start + count], None if sums is None else sums[start : start + count])
        start += count
    return True
