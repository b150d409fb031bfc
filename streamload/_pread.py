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
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["Gather", "Opened", "available", "gather_all", "hashes", "open_files", "pread_blocks", "pread_gather"]

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
    cached_first: bool = True,
    then: Any = None,
) -> np.ndarray | None:
    """Read ``lengths[i]`` bytes at ``offsets[i]`` of ``fd`` into ``outs[which[i]]`` at byte ``at[i]``, for every i.

    All reads in one call, in (file, offset) order, that releases the GIL once at most.
    Every destination is checked to lie inside its buffer before anything is read. What
    the page cache holds is read first with the GIL held (Linux's ``RWF_NOWAIT``: a read
    that would wait for the disk is left for later), up to 16 MiB a call: a copy of a
    millisecond or two, where taking the GIL back after a release can wait the switch
    interval (5 ms) beside a thread running Python. Only what is not cached is read with
    the GIL released.

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
        cached_first: Read what is cached holding the GIL first (``False``: every read
            with the GIL released).
        then: A continuation (a ``streamload.then`` capsule, e.g. the JPEG kernel's
            ``Job.then``) run right after the reads in the same release of the GIL: every
            read is then made with the GIL released, and the batch's read and its decode are
            one release, not two.

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
        cached_first,
        then,
    )
    return got


def pread_blocks(fd: int, offsets: Sequence[int], size: int) -> list[bytes] | None:
    """Read ``size`` bytes at each of ``offsets`` of ``fd`` in one :func:`pread_gather` call.

    What the page cache holds is read holding the GIL (no release at all), the rest in one
    release. Returns the blocks (shorter at the end of the file), or ``None`` when the
    extension is not built.

    Raises:
        OSError: If a read failed.
    """
    n = len(offsets)
    buffer = bytearray(n * size)
    got = pread_gather(
        fd,
        np.asarray(offsets, dtype=np.int64),
        np.full(n, size, dtype=np.int64),
        [buffer],
        np.zeros(n, dtype=np.int32),
        np.arange(n, dtype=np.int64) * size,
    )
    if got is None:
        return None
    if n and int(got.min()) < 0:
        code = -int(got.min())
        raise OSError(code, os.strerror(code))
    return [bytes(buffer[i * size : i * size + int(got[i])]) for i in range(n)]


@dataclass(frozen=True)
class Opened:
    """What :func:`open_files` found of one file.

    Attributes:
        error: ``errno`` of the step that failed (``0``: none).
        fd: The open descriptor, the caller's to close (``-1`` when read, refused or failed).
        mode: ``st_mode`` (of the link's target for a symbolic link).
        size: ``st_size``.
        link: The path is a symbolic link (the caller checks where it leads).
        data: The file's bytes when read, else ``None``.
    """

    error: int
    fd: int
    mode: int
    size: int
    link: bool
    data: bytes | None


def open_files(paths: Sequence[str], reads: Sequence[bool], limits: Sequence[int]) -> list[Opened] | None:
    """Check, open and (``reads``) read whole local files, all in one call that releases the GIL once.

    A shard opened in Python makes a dozen system calls (stat, lstat, open, fstat, fcntl,
    read, close...), each a release of the GIL, and beside a thread running Python each may
    cost a wait of up to the switch interval: here they are one. Each file is opened only
    if a regular file (non-blocking: a FIFO cannot block the open). ``limits``: the most
    bytes read of each (a larger file is not read: its size tells the caller).

    Returns:
        One :class:`Opened` a path, or ``None`` when the extension is not built (or is an
        older build without it): the caller opens them another way.
    """
    module = _module()
    if module is None or not hasattr(module, "open_files"):
        return None
    rows = module.open_files([os.fsencode(p) for p in paths], [bool(r) for r in reads], [int(n) for n in limits])
    return [Opened(*row) for row in rows]


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
        digests: ``uint64`` each entry's expected XXH3-64 digest.
        check: Called with the entries' bytes read and digests (``None`` without
            :func:`hashes`) when a read came back short or failed, a digest differs, or
            there are no digests to compare; raises, naming the shard and sample, for a
            short, failed or damaged read (without digests: checks them itself).
        owner: What holds :attr:`fd` open (the shard's bytes): its ``fd`` attribute is
            still :attr:`fd` while open (a reader cache may close one reader to open another,
            and a closed descriptor's number may name another file by then).
    """

    fd: int
    offsets: np.ndarray
    lengths: np.ndarray
    outs: Sequence[Any]
    which: np.ndarray
    at: np.ndarray
    digests: np.ndarray
    check: Callable[[np.ndarray, np.ndarray | None], None]
    owner: Any


def gather_all(plans: Sequence[Gather], then: Any = None) -> bool:
    """Read every plan's entries in one :func:`pread_gather` call, then check each plan in turn.

    The checks run in the plans' order, so an error names the first bad shard of the batch.
    ``then``: :func:`pread_gather`'s continuation, run after the reads and before the checks
    (it must stand bytes that fail them: the kernel's decode does).

    Returns:
        False (nothing read) when the extension is not built, or when a plan's reader was
        closed after it was planned (its descriptor may name another file by now): the
        caller reads another way.
    """
    if not available() or not all(getattr(plan.owner, "fd", -1) == plan.fd for plan in plans):
        return False
    if len(plans) == 1:
        plan = plans[0]
        sums = np.empty(len(plan.offsets), dtype=np.uint64) if hashes() else None
        got = pread_gather(plan.fd, plan.offsets, plan.lengths, plan.outs, plan.which, plan.at, sums, then=then)
        assert got is not None
        if sums is None or not np.array_equal(got, plan.lengths) or not np.array_equal(sums, plan.digests):
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
    sums = np.empty(sum(counts), dtype=np.uint64) if hashes() else None
    lengths = np.concatenate([plan.lengths for plan in plans])
    got = pread_gather(
        fds,
        np.concatenate([plan.offsets for plan in plans]),
        lengths,
        outs,
        np.concatenate(remaps),
        np.concatenate([plan.at for plan in plans]),
        sums,
        then=then,
    )
    assert got is not None
    if sums is not None and np.array_equal(got, lengths):
        if np.array_equal(sums, np.concatenate([plan.digests for plan in plans])):
            return True  # the whole batch read and checked: no check a shard
    start = 0
    for plan, count in zip(plans, counts, strict=True):  # in batch order: the first bad shard is named
        plan.check(got[start : start + count], None if sums is None else sums[start : start + count])
        start += count
    return True
