"""One I/O executor per process: every background thread of the storage runs on one of its lanes.

A lane is a pool of threads of declared concurrency. Lanes are ordered: a task may wait on
tasks of *lower* lanes only (a task waiting on tasks of its own bounded pool can deadlock it
once every thread waits), so :meth:`IOExecutor.submit` refuses a task sent to its own lane
or a higher one from a thread of a lane. Lowest first:

==============  ======  =================================================================
lane            threads  runs
==============  ======  =================================================================
``parts``       64      the parts of a download a reader waits for (never queued behind
                        read-ahead: a sidecar behind read-ahead parts would wait seconds)
``ahead_parts`` 16      the parts of read-ahead downloads (two downloads' worth at once)
``ranges``      16      streaming mode's span GETs (a far bucket needs that many in flight)
``ahead``       64      read-ahead downloads (each storage bounds its own by the depth)
``side``        64      a sidecar fetched beside its shard, a cold start's download and the
                        ranges its first batches want (not queued behind the parts)
==============  ======  =================================================================

A lane's threads exist only while it has work: one is started for a task no idle thread
takes (up to the lane's limit), and a thread left without work for :data:`LINGER` seconds
ends (an idle reader holds none). The executor is made on first use in a process and made
anew after a fork (:class:`~streamload._fork.ProcessLocal`): a DataLoader worker never uses
its parent's threads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from .._fork import ProcessLocal

__all__ = ["LANES", "IOExecutor", "io_executor"]

T = TypeVar("T")

#: The lanes, lowest first, and their threads at most.
LANES: dict[str, int] = {"parts": 64, "ahead_parts": 16, "ranges": 16, "ahead": 64, "side": 64}
_RANK = {name: rank for rank, name in enumerate(LANES)}
#: Seconds an idle thread of a lane waits for more work before it ends.
LINGER = 1.0


class _Lane:
    """One lane: a queue and at most ``limit`` threads, started on demand, ending when idle."""

    def __init__(self, name: str, limit: int, enter: Callable[[str], None]) -> None:
        self.name = name
        self.limit = limit
        self._enter = enter
        self._cond = threading.Condition()
        self._queue: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], args: tuple[Any, ...]) -> Future[T]:
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the {self.name!r} lane is shut down")
            self._queue.append((future, fn, args))
            if len(self._queue) > self._idle and self._threads < self.limit:
                self._threads += 1
                threading.Thread(target=self._work, name=f"streamload-{self.name}", daemon=True).start()
            else:
                self._cond.notify()
        return future

    def _work(self) -> None:
        self._enter(self.name)
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        self._threads -= 1
                        return
                    self._idle += 1
                    self._cond.wait(LINGER)
                    self._idle -= 1
                    if not self._queue:
                        self._threads -= 1
                        return
                future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args

    @property
    def threads(self) -> int:
        """Threads the lane has now."""
        return self._threads

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for future, _, _ in queued:
            future.cancel()


class IOExecutor:
    """The lanes of one process (each made on its first task)."""

    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._current = threading.local()

    def lane_of_thread(self) -> str | None:
        """The lane the calling thread belongs to (``None``: not one of the executor's)."""
        lane: str | None = getattr(self._current, "lane", None)
        return lane

    def submit(self, lane: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on ``lane``.

        Raises:
            RuntimeError: If called from a task of ``lane`` or of a lower lane (a task may
                wait only on lower lanes; see the module docstring).
        """
        here = self.lane_of_thread()
        if here is not None and _RANK[lane] >= _RANK[here]:
            raise RuntimeError(f"a task of the {here!r} lane may not start tasks on the {lane!r} lane")
        with self._lock:
            found = self._lanes.get(lane)
            if found is None:
                found = self._lanes[lane] = _Lane(lane, LANES[lane], self._enter)
        return found.submit(fn, args)

    def threads(self, lane: str) -> int:
        """Threads ``lane`` has now (0: no work, or never used)."""
        found = self._lanes.get(lane)
        return 0 if found is None else found.threads

    def _enter(self, lane: str) -> None:
        self._current.lane = lane

    def shutdown(self) -> None:
        """Stop every lane (queued tasks are cancelled; running ones finish)."""
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.shutdown()


_EXECUTOR: ProcessLocal[IOExecutor] = ProcessLocal(IOExecutor, lambda e: e.shutdown())


def io_executor() -> IOExecutor:
    """This process's executor."""
    return _EXECUTOR.get()
