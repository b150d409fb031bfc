"""A dataset's iterations in one process: each claims its epoch, registers its reader, runs its stages.

An iteration's readers (the DataLoader workers of one ``iter(loader)``, or the threads of
one :class:`streamload.Loader` iteration) share its epoch (:class:`~streamload.epochs.EpochTable`),
claimed when the first sample is asked for; a Loader's threads and a DataLoader never
read one dataset at once (:class:`~streamload.epochs.Users`). This module plans and
registers them; the dataset runs each reader's :class:`~streamload.stages.Pipeline` from
its place in the plan (:class:`~streamload.plan_stage.Planner`): nothing here calls back
up into the dataset.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from .epochs import ITERATOR, LOADER, EpochTable, Users
from .plan import EpochPlan, World
from .plan_stage import Planner, Position

__all__ = ["Iterations", "ThreadReaders"]


class Iterations:
    """A dataset's iterations in this process, and where the current (or last) one stands.

    Args:
        planner: The dataset's plans.
        source: The dataset's URL(s), for messages.

    Attributes:
        epochs: The epochs claimed (shared memory: ``set_epoch`` reaches persistent workers).
        users: Who iterates the dataset now.
        progress: This process's current (or last) iteration's position, else ``None``.
    """

    def __init__(self, planner: Planner, source: str) -> None:
        self.planner = planner
        self.source = source
        self.epochs = EpochTable()
        self.users = Users()
        self.progress: Position | None = None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"progress": None}

    def epoch(self) -> int:
        """The epoch of the current or last iteration, else the last one claimed, else the next."""
        return self.progress.epoch if self.progress is not None else self.epochs.last()

    def claimed(self) -> int:
        """Iterations claimed since the last ``set_epoch``."""
        return self.epochs.claimed()

    def start(self, world: World, epoch: int) -> tuple[EpochPlan, Position]:
        """Plan ``epoch`` for ``world`` and make its start this process's progress."""
        plan = self.planner.plan(epoch, world.world_size)
        self.progress = self.planner.position(world, plan)
        return plan, self.progress

    def prepare(self, world: World) -> tuple[int, EpochPlan, Position]:
        """A reader's iteration about to start: its key, plan and start (this process's progress).

        Planned before the first sample is asked for (``state_dict()`` may ask meanwhile);
        the epoch is claimed by :meth:`running`.

        Raises:
            PlanError: If the resume state does not fit this reader's plan.
        """
        key = self.epochs.iteration_key()
        plan, progress = self.start(world, self.epochs.find(key))
        return key, plan, progress

    @contextmanager
    def running(
        self, world: World, key: int, plan: EpochPlan, progress: Position
    ) -> Generator[tuple[EpochPlan, Position], None, None]:
        """The iteration of :meth:`prepare` while its reader reads: its epoch claimed, itself registered.

        Yields the plan and start it reads (planned again if another iteration claimed
        the epoch meanwhile). An iteration still alive at interpreter exit is closed after
        the modules' globals are gone: what its cleanup raises then is dropped.
        """
        finalizing = sys.is_finalizing  # bound now: the module's globals may be gone at exit
        slot = self.users.enter(ITERATOR, self.source)
        try:
            epoch = self.epochs.claim(key)
            if epoch != progress.epoch:  # another iteration claimed in between
                plan, progress = self.start(world, epoch)
            self.planner.warn_locality(plan, world)
            try:
                yield plan, progress
            except Exception:
                if not finalizing():
                    raise
        finally:
            try:
                self.users.leave(slot)
            except Exception:
                if not finalizing():
                    raise

    def enter_threads(self) -> int:
        """Register an iteration read by threads of this process (a DataLoader iterating the dataset now refuses it).

        Returns:
            Its slot, for :meth:`plan_threads`, :class:`ThreadReaders` and :meth:`leave`.
        """
        return self.users.enter(LOADER, self.source)

    def leave(self, slot: int) -> None:
        """Unregister the iteration of ``slot``."""
        self.users.leave(slot)

    def plan_threads(self, rank: int, world_size: int, threads: int) -> tuple[EpochPlan, list[tuple[World, Position]]]:
        """Claim the epoch of a thread iteration and plan it: each reader's world and start.

        Planned as if this rank had ``threads`` DataLoader workers: reader ``w`` reads
        exactly what worker ``w`` would, so taking their batches in turn gives the
        DataLoader's batches for any number of workers. The last reader's start becomes this
        process's progress (advanced by the :class:`streamload.Loader`).
        """
        plan = self.planner.plan(self.epochs.claim(secrets.randbits(62) | 1), world_size)
        starts: list[tuple[World, Position]] = []
        position = Position(plan.split.epoch, plan.chunk_size(threads), 0)
        for worker in range(threads):
            world = World(rank, world_size, worker, threads)
            position = self.planner.position(world, plan)
            if worker == 0:
                self.planner.warn_locality(plan, world)
            starts.append((world, position))
        self.progress = replace(position)
        return plan, starts


class ThreadReaders:
    """One iteration of a dataset read by threads of this process (:meth:`StreamingDataset.thread_readers`).

    Reader ``w`` of ``n`` reads exactly what DataLoader worker ``w`` of ``n`` workers would
    read; taking their batches in turn gives the DataLoader's batches. The iteration stays
    registered with the dataset (no DataLoader may iterate it meanwhile) until
    :meth:`leave`.

    Attributes:
        plan: The epoch's plan.
        progress: The rank's position (this process's, for the dataset's ``state_dict``):
            its ``next_item`` is advanced by the caller as it consumes batches.
        readers: One lazy iterator per thread, of batches (with a ``collate``) or samples.
        world: This rank, as one reader (worker 0 of 1): the world of :meth:`state`.
    """

    def __init__(
        self,
        plan: EpochPlan,
        progress: Position,
        readers: list[Iterator[Any]],
        world: World,
        iterations: Iterations,
        slot: int,
    ) -> None:
        self.plan = plan
        self.progress = progress
        self.readers = readers
        self.world = world
        self._iterations = iterations
        self._slot = slot

    @property
    def chunk_size(self) -> int:
        """Samples of each batch a reader makes (the plan's chunk for this many readers)."""
        return self.progress.chunk_size

    def state(self, samples_seen: int) -> dict[str, Any]:
        """The dataset's plain state of this epoch after ``samples_seen`` global samples (all ranks)."""
        planner = self._iterations.planner
        return planner.epoch_state(self.world, self.plan, None, samples_seen, 1).normalized().to_dict()

    def leave(self) -> None:
        """Unregister the iteration from its dataset (once; later calls do nothing)."""
        slot, self._slot = self._slot, -1
        if slot >= 0:
            self._iterations.leave(slot)
