"""A batch's positioned reads of one local file in one call that lets go of the GIL once.

A thread that releases the GIL for a system call must take it back afterwards, and beside a
thread running Python that can wait up to the switch interval (5 ms). A shuffled batch's
samples lie all over their shards: read one ``os.pread`` (or ``os.preadv`` of a run) at a
time, a batch makes about one such release per sample (and python-xxhash lets go of it for
each member's checksum too). :func:`pread_gather` makes it one per shard, checksums
included where the system's xxHash is there, through the small C extension
``streamload._gather`` (built by the package's install where a C compiler is present;
optional). Where it is absent, :func:`pread_gather` returns ``None`` and the caller reads
as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["available", "hashes", "pread_gather"]

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
    fd: int,
    offsets: np.ndarray,
    lengths: np.ndarray,
    outs: Sequence[Any],
    which: np.ndarray,
    at: np.ndarray,
    sums: np.ndarray | None = None,
) -> np.ndarray | None:
    """Read ``lengths[i]`` bytes at ``offsets[i]`` of ``fd`` into ``outs[which[i]]`` at byte ``at[i]``, for every i.

    All reads in one call that releases the GIL once. Every destination is checked to lie
    inside its buffer before anything is read.

    Args:
        fd: An open file descriptor.
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
        fd,
        np.ascontiguousarray(offsets, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int64),
        outs,
        np.ascontiguousarray(which, dtype=np.int32),
        np.ascontiguousarray(at, dtype=np.int64),
        got,
        sums,
    )
    return got
