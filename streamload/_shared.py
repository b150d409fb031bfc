"""Small shared-memory counters, many to one segment.

Each :class:`~streamload.StreamingDataset` keeps two small ``int64`` tables in shared
memory (the epoch claim table and the skip counters), so that ``set_epoch`` reaches
persistent DataLoader workers and the main process sees its workers' skips. torch gives
every shared tensor a segment of its own, and under its default ``file_descriptor``
strategy each segment holds a file descriptor for as long as it lives: two per dataset,
so a few hundred live datasets exhausted the usual soft limit of 1024.

Here a block of ``n`` words is a view into an **arena**: one shared segment (one
descriptor) that holds the blocks of many datasets. A block goes back to its arena when
the tensor handed out is collected; an arena whose blocks are all free is dropped (its
descriptor with it). A view pickled to a worker carries its arena and offset, so worker
and main process share the same words, as before. After a fork, the child starts arenas
of its own (the parent's are the parent's to hand out).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING

from ._errors import StreamloadError

if TYPE_CHECKING:
    import torch

__all__ = ["ARENA_WORDS", "shared_block", "shared_zeros"]

#: ``int64`` words of one arena (128 KiB; a dataset's tables take about 1,200 words). Made
#: shared from the start (:func:`shared_zeros`) and zeroed block by block under torch's
#: parallel grain (32,768 elements), so no OpenMP thread is started: a child forked after
#: its parent used them hangs in its first parallel region.
ARENA_WORDS = 1 << 14


class _Arena:
    """One shared segment and the offsets of its free blocks, by block size."""

    def __init__(self, words: int) -> None:
        import torch

        self.tensor = shared_zeros(words, torch.int64)
        self.words = words
        self.top = 0  # words handed out at least once
        self.free: dict[int, list[int]] = {}  # block size -> free offsets below top
        self.used = 0  # blocks in use

    def take(self, n: int) -> int | None:
        spare = self.free.get(n)
        if spare:
            offset = spare.pop()
            self.tensor[offset : offset + n].zero_()
        elif self.top + n <= self.words:
            offset, self.top = self.top, self.top + n
        else:
            return None
        self.used += 1
        return offset


class _Arenas:
    """This process's arenas (a forked child starts its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.arenas: list[_Arena] = []
        self.lock = threading.Lock()
        #: Blocks collected since the last :meth:`block`. A finalizer only appends here (no
        #: lock): it may run inside :meth:`block` itself, when an allocation there collects
        #: garbage, and taking the lock then would deadlock.
        self.returned: list[tuple[_Arena, int, int]] = []

    def block(self, n: int) -> torch.Tensor:
        with self.lock:
            self._take_back()
            for arena in self.arenas:
                offset = arena.take(n)
                if offset is not None:
                    break
            else:
                arena = _Arena(max(ARENA_WORDS, n))
                self.arenas.append(arena)
                offset = arena.take(n)
                assert offset is not None
            view = arena.tensor[offset : offset + n]
        weakref.finalize(view, self._give_back, arena, offset, n)
        return view

    def _take_back(self) -> None:
        """Return the collected blocks to their arenas (under the lock)."""
        while self.returned:
            arena, offset, n = self.returned.pop()
            arena.free.setdefault(n, []).append(offset)
            arena.used -= 1
            if not arena.used and arena in self.arenas:
                self.arenas.remove(arena)  # its descriptor closes with the last view

    def _give_back(self, arena: _Arena, offset: int, n: int) -> None:
        if self.pid != os.getpid():  # a finalizer inherited through fork: the parent's block
            return
        self.returned.append((arena, offset, n))  # atomic; taken back by the next block()


_ARENAS: _Arenas | None = None
_ARENAS_LOCK = threading.Lock()


def shared_block(n: int) -> torch.Tensor:
    """Return ``n`` zeroed ``int64`` words in shared memory, a view into a shared arena.

    Raises:
        StreamloadError: If the process has no file descriptor left for a new arena.
    """
    global _ARENAS
    with _ARENAS_LOCK:
        if _ARENAS is None or _ARENAS.pid != os.getpid():
            _ARENAS = _Arenas()
        arenas = _ARENAS
    return arenas.block(n)


def shared_zeros(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return a zeroed tensor made directly in shared memory (no copy into it).

    ``Tensor.share_memory_()`` copies the tensor into a new segment with torch's parallel
    copy kernel; in a child forked after its parent used OpenMP threads (a rank started by
    ``fork``, a process forked by a library) that copy can hang in libgomp. A segment made
    shared from the start (``ftruncate``: zero-filled by the kernel) needs no copy.

    Raises:
        StreamloadError: If the process has no file descriptor left for a new segment.
    """
    import torch  # here, not at import: a conversion (which shares no counters) starts without torch

    dims = (shape,) if isinstance(shape, int) else shape
    count = 1
    for d in dims:
        count *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    try:
        storage = torch.UntypedStorage._new_shared(max(1, count * itemsize))  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        raise StreamloadError(f"cannot make shared memory for a dataset's counters: {_fd_usage()} ({exc})") from exc
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return torch.empty(0, dtype=dtype).set_(storage, 0, dims, tuple(reversed(strides)))


def _fd_usage() -> str:
    """Say how many file descriptors the process has open, and its limit."""
    advice = "raise the limit, or close datasets, loaders and files no longer needed"
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return f"the process may have no file descriptor left ({advice})"
    try:
        used = str(len(os.listdir("/proc/self/fd")))
    except OSError:  # listing them takes a descriptor too
        used = "all"
    return f"the process has {used} file descriptors open, its limit (ulimit -n) is {soft}; {advice}"
