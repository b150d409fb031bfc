"""Read-ahead: fetch the files a reader will need next, in background threads.

The reader knows its future (the planner's order), so it names the next files; this
module keeps them in a *window* that each call replaces. Queued fetches that left the
window are forgotten, running ones are cancelled when the window is emptied (end of an
epoch), and every fetch pauses while some acquire is starved for cache room, so
read-ahead never takes the room a reader waits for. Threads exist only while there is
work: an idle reader holds none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .._files import FileEntry

__all__ = ["ReadAhead"]

log = logging.getLogger("streamload")

#: ``fetch(entry, cancelled)`` brings ``entry`` into the cache, polling ``cancelled()``.
Fetch = Callable[[FileEntry, Callable[[], bool]], None]


@dataclass
class _Task:
    entry: FileEntry
    cancelled: bool = False


class ReadAhead:
    """Background fetches of a window of files, in at most ``threads`` daemon threads.

    Args:
        threads: Concurrent fetches at most (0: read-ahead is off).
        fetch: Brings one file into the cache; errors are left to the reader's own
            acquire, which will meet them again and report them.
    """

    def __init__(self, threads: int, fetch: Fetch) -> None:
        self.threads = threads
        self._fetch = fetch
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._queue: list[_Task] = []
        self._running: dict[str, _Task] = {}
        self._workers: list[threading.Thread] = []
        self._starved: set[str] = set()

    def want(self, entries: Iterable[FileEntry], held: Iterable[str] = ()) -> None:
        """Make ``entries`` (in order of use) the window; files in ``held`` are not fetched.

        An empty ``entries`` cancels everything, including fetches under way.
        """
        if self.threads <= 0:
            return
        wanted = list(entries)
        names = {e.name for e in wanted}
        skip = set(held)
        with self._lock:
            for task in self._queue:
                task.cancelled = task.entry.name not in names
            self._queue = [t for t in self._queue if not t.cancelled]
            if not names:
                for task in self._running.values():
                    task.cancelled = True
            queued = {t.entry.name for t in self._queue} | set(self._running) | skip
            for entry in wanted:
                if entry.name not in queued:
                    self._queue.append(_Task(entry))
                    queued.add(entry.name)
            self._start_workers()

    def starve(self, name: str) -> None:
        """Pause every fetch while the acquire of ``name`` waits for cache room."""
        with self._lock:
            self._starved.add(name)

    def fed(self, name: str) -> None:
        """The acquire of ``name`` no longer waits: fetches may go on."""
        with self._lock:
            self._starved.discard(name)

    def stop(self, timeout: float = 30) -> None:
        """Stop every fetch (in-flight downloads stop at their next chunk) and join the threads."""
        self._stop.set()
        with self._lock:
            self._queue.clear()
            workers = list(self._workers)
        for worker in workers:
            worker.join(timeout=timeout)
        with self._lock:
            self._workers = []
        self._stop = threading.Event()

    def _start_workers(self) -> None:
        """Start threads up to ``threads`` (the caller holds the lock)."""
        self._workers = [t for t in self._workers if t.is_alive()]
        while self._queue and len(self._workers) < self.threads and not self._stop.is_set():
            worker = threading.Thread(target=self._loop, args=(self._stop,), name="streamload-read-ahead", daemon=True)
            self._workers.append(worker)
            worker.start()

    def _loop(self, stop: threading.Event) -> None:
        """Fetch queued files until the queue is empty, then exit (no idle threads)."""
        while not stop.is_set():
            with self._lock:
                if not self._queue:
                    return
                task = self._queue.pop(0)
                self._running[task.entry.name] = task

            def cancelled(task: _Task = task) -> bool:
                return task.cancelled or stop.is_set() or bool(self._starved)

            try:
                if not cancelled():
                    self._fetch(task.entry, cancelled)
            except Exception as exc:  # noqa: BLE001 - the reader's acquire meets it again and reports it
                log.debug("read-ahead of %s failed: %s", task.entry.name, exc)
            finally:
                with self._lock:
                    self._running.pop(task.entry.name, None)
