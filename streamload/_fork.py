"""Fork safety in one place: what a process holds that a forked child must not inherit.

A DataLoader worker (or a rank started by ``fork``) begins as a copy of its parent: its
open clients, thread pools, file handles and locks held by the parent's threads are the
parent's, not its own. Instead of each object remembering the pid that made its state and
comparing it on every use, per-process state lives in a :class:`ProcessLocal`, and one
``os.register_at_fork`` hook drops every such value in the child (without closing it: the
resource is the parent's). Module-level state registers a reset with :func:`on_fork`; state
a child must never see half-made (a descriptor opened but not yet recorded) is made in a
:func:`no_fork` section. Whether another process lives (:func:`alive`) and when this one
started (:func:`process_started_ns`) are told here too.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

__all__ = ["ProcessLocal", "alive", "clock_ns", "forks", "no_fork", "on_fork", "process_started_ns"]

T = TypeVar("T")

_LIVE: weakref.WeakSet[ProcessLocal[object]] = weakref.WeakSet()
_RESETS: list[Callable[[], None]] = []
_FORKS = 0
#: Held by a :func:`no_fork` section, and by a fork (from just before it until just after).
_GATE = threading.Lock()


class ProcessLocal(Generic[T]):
    """A value that belongs to one process: made on first use, made anew after a fork.

    Args:
        make: Builds the value (a client, a pool, a lock...) on first use in a process.
        close: Releases it when :meth:`clear` is called in the process that made it.
    """

    __slots__ = ("__weakref__", "_close", "_lock", "_make", "_value")

    def __init__(self, make: Callable[[], T], close: Callable[[T], object] | None = None) -> None:
        self._make = make
        self._close = close
        self._value: T | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)  # type: ignore[arg-type]

    def get(self) -> T:
        """The value of this process, made now if it has none."""
        value = self._value
        if value is None:
            with self._lock:
                value = self._value
                if value is None:
                    value = self._value = self._make()
        return value

    def peek(self) -> T | None:
        """The value of this process if it was made, else ``None`` (makes nothing)."""
        return self._value

    def clear(self) -> None:
        """Drop this process's value, closing it (the next :meth:`get` makes a new one)."""
        with self._lock:
            value, self._value = self._value, None
        if value is not None and self._close is not None:
            self._close(value)

    def _forget(self) -> None:
        """In a forked child: drop the parent's value unclosed, and take a fresh lock."""
        self._value = None
        self._lock = threading.Lock()


def on_fork(reset: Callable[[], None]) -> Callable[[], None]:
    """Run ``reset`` in every child forked from now on (as its first act); returns ``reset``.

    For module-level state: ``reset`` should only drop references, never close what the
    parent owns (the parent still uses it).
    """
    _RESETS.append(reset)
    return reset


@contextmanager
def no_fork() -> Iterator[None]:
    """A section no fork of this process falls into: a fork waits until it ends.

    For two steps a child must see both or neither of: a descriptor opened, then recorded
    for a forked child to close (forked between the two, the child would keep a copy no one
    records, and with it any lock the parent takes through it). Sections exclude each other
    (one lock): keep them short, and never wait in one.
    """
    with _GATE:
        yield


def forks() -> int:
    """How many forks lie between the interpreter's start and this process (0 in the first)."""
    return _FORKS


def alive(pid: int) -> bool:
    """True if process ``pid`` exists (another user's process counts: it exists)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clock_ns() -> int:
    """Nanoseconds on a clock every process of the machine shares (boot time on Linux)."""
    if sys.platform.startswith("linux"):
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    return time.monotonic_ns()


def process_started_ns() -> int:
    """When this process started, on :func:`clock_ns`.

    On Linux the kernel's record, rounded down (never later than the truth); elsewhere the
    parent's clock just before the fork that made it or, in a spawned process, the import
    of this module.
    """
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return int(fields[19]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")  # field 22, starttime
        except (OSError, ValueError, IndexError):
            pass
    return _STARTED


_STARTED = clock_ns()  # this process's start where /proc does not tell it
_FORKING = 0  # the parent's clock as it forks (inherited by the child)


def _before_fork() -> None:
    global _FORKING
    _GATE.acquire()
    _FORKING = clock_ns()


def _after_fork_in_parent() -> None:
    _GATE.release()


def _after_fork_in_child() -> None:
    global _FORKS, _GATE, _STARTED
    _GATE = threading.Lock()  # the copy is held (by this fork)
    _FORKS += 1
    _STARTED = _FORKING
    for local in list(_LIVE):
        local._forget()
    for reset in _RESETS:
        reset()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
