"""The GIL probe of :func:`streamload.watch`: how long a thread waits to take the GIL back.

A thread that releases the GIL (a C call, a sleep) must take it back afterwards. When
another thread is running Python, that takes up to the switch interval
(``sys.getswitchinterval()``, 5 ms): the waiting thread asks, the running one lets go at
its next check. A loader whose readers are threads pays that wait at each of its C calls
while the training loop runs Python (its op dispatch), and the loop pays it whenever the
readers run Python.

The probe is a daemon thread that, every :data:`EVERY` seconds, releases the GIL for an
instant (``time.sleep(0.0002)``) and times how long taking it back takes. Without contention
that is microseconds; when some thread runs Python without pause, it is close to the
switch interval. Its cost to the others: 20 GIL hand-overs a second of a few tens of
microseconds each (about 0.1 % of a thread's time; measured in ``benchmarks/bench_gil.py``).
The probe stops when its watch is collected.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from array import array
from typing import Any

import numpy as np

__all__ = ["EVERY", "GilProbe"]

#: Seconds between two probes.
EVERY = 0.05
#: Seconds the probe lets go of the GIL (a waiting thread is woken and takes it meanwhile).
_RELEASE = 0.0002


class GilProbe:
    """A daemon thread timing, every :data:`EVERY` s, how long it waits to take the GIL back.

    Args:
        owner: The object whose life bounds the probe's (the thread ends once it is collected).
    """

    def __init__(self, owner: Any) -> None:
        self.delays = array("d")
        #: At each probe: the wall clock, and the CPU time of the thread that made the probe
        #: (the training loop's, usually the main thread): its share of a window is how much
        #: of it the loop ran, rather than waited (for the GIL, or for the device).
        self.walls = array("d")
        self.loop_cpu = array("d")
        self.switch_s = sys.getswitchinterval()
        self._lock = threading.Lock()
        self._clock = _cpu_clock(threading.get_ident())
        self._thread = threading.Thread(target=self._run, args=(weakref.ref(owner),), name="streamload-gil-probe")
        self._thread.daemon = True
        self._thread.start()

    def _run(self, owner: weakref.ref[Any]) -> None:
        while owner() is not None:
            time.sleep(EVERY)
            start = time.perf_counter()
            time.sleep(_RELEASE)  # lets go of the GIL long enough for a waiting thread to take it
            waited = max(0.0, time.perf_counter() - start - _RELEASE)
            cpu = _read(self._clock)
            with self._lock:
                self.delays.append(waited)
                self.walls.append(start)
                self.loop_cpu.append(cpu)

    def count(self) -> int:
        """Probes taken so far."""
        with self._lock:
            return len(self.delays)

    def since(self, start: int) -> tuple[np.ndarray, float | None]:
        """The delays (seconds) of the probes from the ``start``-th on, and the loop thread's CPU share over them."""
        with self._lock:
            delays = np.array(self.delays[start:], dtype=np.float64)
            first, last = max(0, start), len(self.walls) - 1
            share = None
            if self._clock is not None and last > first and self.walls[last] > self.walls[first]:
                share = (self.loop_cpu[last] - self.loop_cpu[first]) / (self.walls[last] - self.walls[first])
        return delays, share


def _cpu_clock(ident: int) -> int | None:
    """The CPU-time clock of the thread ``ident`` (``None`` where the platform has none)."""
    try:
        return time.pthread_getcpuclockid(ident)
    except (AttributeError, OSError):
        return None


def _read(clock: int | None) -> float:
    return 0.0 if clock is None else time.clock_gettime(clock)


def contention(delays: np.ndarray, switch_s: float) -> tuple[float | None, float | None]:
    """``(median wait in ms, share of probes that waited at least half a switch interval)``; Nones without probes."""
    if len(delays) < 5:
        return None, None
    return float(np.median(delays)) * 1e3, float(np.mean(delays >= switch_s / 2))
