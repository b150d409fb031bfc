"""Who reads a dataset, and which epoch: two small tables in shared memory, seen by every process.

:class:`EpochTable` is ``[base epoch, iterations claimed, (key, epoch, pid, time) * CLAIMS]``.
Every iteration has a key that all of its readers share (the DataLoader iterator's base
seed and the worker process's iteration count; a fresh random key in the main process);
the first reader of an iteration to ask for a sample claims the next epoch for its key,
the others find it there. A claim counts while its claimer lives, or when it was made
after the reader's own process started: a new DataLoader whose generator repeats an
earlier one's seed has the same keys, but the earlier iteration's workers are gone and
their claims are older than the new workers; a sibling worker of the same iterator may
have ended already (the loop left after one batch) when a slow worker reads its first
sample, but it claimed after every worker was started (a DataLoader sends no work before
it has started all of them). ``set_epoch`` sets the base and clears the claims.

:class:`Users` holds who iterates the dataset now, ``pid << 2 | kind`` per slot (one
aligned word: never seen half-written), so that a :class:`streamload.Loader` (threads)
and a DataLoader (processes) never read one dataset at once (their epochs would collide).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from ._errors import ConfigError
from ._fork import ProcessLocal, alive, clock_ns, process_started_ns
from ._shared import shared_block

__all__ = ["ITERATOR", "LOADER", "EpochTable", "Users"]

_BASE, _CLAIMED, _TABLE = 0, 1, 2
_CLAIMS, _CLAIM = 64, 4
_KEY_MASK = (1 << 62) - 1
#: Slots of :class:`Users`, and its kinds: the dataset's own iterator, a Loader's.
_USERS = 64
ITERATOR, LOADER = 1, 2


def _counter() -> list[int]:
    return [0]


class EpochTable:
    """The epochs of a dataset's iterations, shared across fork and spawn (``set_epoch`` reaches persistent workers)."""

    def __init__(self) -> None:
        # A block of a segment many datasets share: one file descriptor per arena, not two per dataset.
        self.table = shared_block(_TABLE + _CLAIM * _CLAIMS)
        #: Iterations this process started (part of a DataLoader worker's key; 0 in a new process).
        self._started: ProcessLocal[list[int]] = ProcessLocal(_counter)

    def __getstate__(self) -> dict[str, Any]:
        return {"table": self.table}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.table = state["table"]
        self._started = ProcessLocal(_counter)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (clears the claims)."""
        self.table[_BASE] = epoch
        self.table[_CLAIMED] = 0

    def claimed(self) -> int:
        """Iterations claimed since the last ``set_epoch``."""
        return int(self.table[_CLAIMED])

    def iteration_key(self) -> int:
        """The key shared by every reader of this iteration; counts the iteration."""
        from torch.utils.data import get_worker_info

        count = self._started.get()
        started = count[0]
        count[0] += 1
        info = get_worker_info()
        if info is None:
            return secrets.randbits(62) | 1
        # Every worker of one DataLoader iterator has the same base seed (seed - id), and
        # persistent workers all start their k-th iteration together.
        base = (info.seed - info.id) & 0xFFFFFFFFFFFFFFFF
        return _mix(base, started) & _KEY_MASK | 1

    def lookup(self, key: int) -> tuple[int | None, int]:
        """Return the epoch claimed for ``key`` (``None`` if none) and the number of claims."""
        table = self.table
        claimed = int(table[_CLAIMED])
        # Up to claim ``claimed`` itself: a sibling may have written it and not yet counted it.
        for i in range(max(0, claimed - _CLAIMS), claimed + 1):
            slot = _TABLE + _CLAIM * (i % _CLAIMS)
            if int(table[slot]) != key:
                continue
            if alive(int(table[slot + 2])) or int(table[slot + 3]) >= process_started_ns():
                return int(table[slot + 1]), claimed
        return None, claimed

    def find(self, key: int) -> int:
        """Return the epoch claimed for ``key``, else the epoch the next claim would get."""
        epoch, claimed = self.lookup(key)
        return self.next_epoch(claimed) if epoch is None else epoch

    def claim(self, key: int) -> int:
        """Return the epoch of the iteration ``key``, claiming the next one if it has none yet.

        Readers of one iteration that race here compute the same claim from the same table
        (the previous claim's epoch + 1, or the base) and write the same values.
        """
        epoch, claimed = self.lookup(key)
        if epoch is not None:
            return epoch
        epoch = self.next_epoch(claimed)
        table, slot = self.table, _TABLE + _CLAIM * (claimed % _CLAIMS)
        table[slot + 1] = epoch
        table[slot + 2] = os.getpid()  # the claimer's identity: its claim counts while it lives,
        table[slot + 3] = clock_ns()  # and for readers started before it
        table[slot] = key
        table[_CLAIMED] = claimed + 1
        return epoch

    def next_epoch(self, claimed: int) -> int:
        """The epoch the claim after ``claimed`` claims gets."""
        if claimed == 0:
            return int(self.table[_BASE])
        return int(self.table[_TABLE + _CLAIM * ((claimed - 1) % _CLAIMS) + 1]) + 1

    def last(self) -> int:
        """The last epoch claimed, else the next one."""
        claimed = int(self.table[_CLAIMED])
        return self.next_epoch(claimed) - 1 if claimed else int(self.table[_BASE])


class Users:
    """Who iterates a dataset now (``pid << 2 | kind`` per slot), shared across processes."""

    def __init__(self) -> None:
        self.slots = shared_block(_USERS)

    def enter(self, kind: int, source: str) -> int:
        """Register this process as iterating the dataset as ``kind``; return its slot (-1: not tracked).

        Raises:
            ConfigError: If a reader of the other kind (a :class:`streamload.Loader`'s
                threads, or the dataset's own iterator in a DataLoader) is iterating it now.
        """
        users, pid = self.slots, os.getpid()
        free = None
        for i in range(_USERS):
            slot = (pid + i) % _USERS
            word = int(users[slot])  # one aligned 64-bit word: written and read whole
            other, other_kind = word >> 2, word & 3
            if other and other_kind != kind and alive(other):
                mine, theirs = ("a streamload.Loader", "a DataLoader (or a loop over it)")
                if kind == LOADER:
                    mine, theirs = theirs, mine
                raise ConfigError(
                    f"{source}: this dataset is being iterated by {mine} (process {other}); "
                    f"{theirs} cannot read it at the same time (the two would read the same samples): "
                    "finish or delete the other iteration, or give each loader its own StreamingDataset"
                )
            if free is None and (not other or not alive(other)):
                free = slot
        if free is None:  # every slot held by a live reader of this kind: not tracked
            return -1
        users[free] = (pid << 2) | kind
        return free

    def leave(self, slot: int) -> None:
        """Unregister the slot :meth:`enter` returned."""
        if slot >= 0 and int(self.slots[slot]) >> 2 == os.getpid():
            self.slots[slot] = 0


def _mix(*words: int) -> int:
    """Hash 64-bit words into one (splitmix64 steps): keys that differ in any word differ."""
    h = 0x9E3779B97F4A7C15
    for word in words:
        h = (h ^ (word & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h
