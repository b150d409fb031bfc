"""The cache's descriptors and their ``flock(2)`` locks.

Opened without following links, closed by a forked child, waited for within a bound,
their holders named.

A flock belongs to the open file, which a forked child shares. A lock some thread holds
while another thread forks (a DataLoader starting its workers) would stay held by the
child's copy for the child's whole life, and every process would wait on it. So every
descriptor opened here is recorded (in a :func:`~streamload._fork.no_fork` section: never a
fork between the open and the record), and a forked child closes its copies at once: the
parent's locks are unaffected, and the child never holds a lock it did not take. A
descriptor kept past the call that opened it (a pin, a registration) is a :class:`HeldFd`,
which only the process that opened it closes: in a child, its number may already name
another descriptor of the child's.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable

from ..._errors import CacheError
from ..._fork import forks, no_fork, on_fork

__all__ = [
    "LOCK_NOTICE",
    "HeldFd",
    "close_fd",
    "describe_holders",
    "lock_holders",
    "open_fd",
    "try_lock",
    "wait_lock",
]

log = logging.getLogger("streamload")

#: Seconds a wait for one of the cache's locks lasts before it is logged (once).
LOCK_NOTICE = 5.0

_FDS: set[int] = set()  # the descriptors this process opened here and has not closed


def open_fd(path: str, flags: int) -> int:
    """Open ``path`` (never through a link: ``O_NOFOLLOW``) and record the descriptor.

    Raises:
        CacheError: If ``path`` is a symbolic link.
    """
    with no_fork():
        try:
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CacheError(
                    f"{path} is a symbolic link; the cache never follows a link it did not make "
                    "(someone else can write the cache directory: use one only you can write)"
                ) from exc
            raise
        _FDS.add(fd)
    return fd


def close_fd(fd: int) -> None:
    """Close ``fd`` if this process opened it (a child's inherited copies are already closed)."""
    with no_fork():
        if fd not in _FDS:
            return
        _FDS.discard(fd)
        os.close(fd)


@on_fork
def _close_inherited_fds() -> None:
    for fd in _FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _FDS.clear()


class HeldFd:
    """A descriptor of :func:`open_fd` kept open (and its lock held) until :meth:`release`.

    Args:
        fd: The descriptor (``-1``: none).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._forks = forks()  # tells the process that opened it from its forked children

    @property
    def open_here(self) -> bool:
        """Whether the descriptor is open, in this process: the one that opened it.

        In a forked child the copy was closed at the fork (the parent's lock is the
        parent's), and its number may since name a descriptor of the child's own.
        """
        return self.fd >= 0 and self._forks == forks()

    def release(self) -> bool:
        """Close the descriptor, dropping its lock; False (closing nothing) if it was not :attr:`open_here`."""
        here = self.open_here
        fd, self.fd = self.fd, -1
        if here:
            close_fd(fd)
        return here


def try_lock(fd: int, flags: int) -> bool:
    """Take a flock; False if ``LOCK_NB`` was given and someone else holds it."""
    try:
        fcntl.flock(fd, flags)
        return True
    except BlockingIOError:
        return False


def wait_lock(fd: int, flags: int, path: str, timeout: float, why: str, tick: Callable[[], None] | None = None) -> None:
    """Take a flock, waiting at most ``timeout`` seconds; else a :class:`CacheError` naming ``path``.

    ``tick`` is called between tries (at most every 50 ms) while the lock is held elsewhere.
    A wait longer than :data:`LOCK_NOTICE` seconds (or half the timeout, if shorter) is
    logged once, naming the lock and the processes holding it (a warning when one of them
    is stopped: it will not let go before it is continued).
    """
    if try_lock(fd, flags | fcntl.LOCK_NB):
        return
    began = time.monotonic()
    deadline = began + timeout
    notice: float | None = began + min(LOCK_NOTICE, timeout / 2)
    delay = 0.001
    while True:
        time.sleep(delay)
        if try_lock(fd, flags | fcntl.LOCK_NB):
            return
        if tick is not None:
            tick()
        now = time.monotonic()
        if notice is not None and now > notice:
            notice = None
            holders, stopped = describe_holders(fd)
            level = logging.WARNING if stopped else logging.INFO
            log.log(
                level,
                "waiting for %s (%s), held by %s, for %.0f s so far; giving up after %.0f s (lock_timeout)",
                path,
                why,
                holders,
                now - began,
                timeout,
            )
        if now > deadline:
            holders, _ = describe_holders(fd)
            raise CacheError(
                f"{path}: still locked by {holders} after {timeout:.0f} s ({why}); "
                "if no other process of this machine is reading this dataset, delete the cache directory"
            )
        delay = min(delay * 2, 0.05)


def lock_holders(fd: int) -> list[int]:
    """The process ids holding a ``flock`` on the file open as ``fd`` (from ``/proc/locks``; ``[]`` elsewhere)."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids: list[int] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue  # "->": a process blocked waiting, not a holder
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if key == want and pid not in pids:
            pids.append(pid)
    return pids


def describe_holders(fd: int) -> tuple[str, bool]:
    """``("pid 123 (stopped)", True)``: who holds the lock on ``fd``, and whether one of them is stopped."""
    pids = lock_holders(fd)
    if not pids:
        return "another process (its pid is not known here)", False
    described, stopped = [], False
    for pid in pids:
        state = _process_state(pid)
        if state in ("T", "t"):
            stopped = True
            described.append(f"pid {pid} (stopped)")
        else:
            described.append(f"pid {pid}" + (" (this process)" if pid == os.getpid() else ""))
    return ", ".join(described), stopped


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``; ``""`` if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    rest = text.rpartition(")")[2].split()
    return rest[0] if rest else ""
