"""A dataset's iterations in one process: each claims its epoch, registers its reader, runs its stages.

An iteration's readers (the DataLoader workers of one ``iter(loader)``, or the threads of
one :class:`streamload.Loader` iteration) share its epoch (:class:`~streamload.epochs.EpochTable`),
claimed when the first sample is asked for; a Loader's threads and a DataLoader never
read one dataset at once (:class:`~streamload.epochs.Users`). Each reader runs one
:class:`~streamload.stages.Pipeline` from its place in the plan
(:class:`~streamload.resume.Planner`).
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import replace
from typing import Any

from ._atexit import close_at_exit
from ._errors import PlanError, StreamloadError
from .epochs import ITERATOR, LOADER, EpochTable, Users
from .plan import EpochPlan, World
from .resume import Planner, Position

__all__ = ["Iterations"]

#: Builds one reader's stages over a plan (the dataset's :class:`~streamload.stages.Pipeline`).
Stages = Callable[[EpochPlan, World, Position], Iterable[Any]]


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

    def iterator(self, world: World, stages: Stages) -> Iterator[Any]:
        """One iteration of this reader (the dataset's ``__iter__``)."""
        key = self.epochs.iteration_key()
        try:
            plan, progress = self.start(world, self.epochs.find(key))  # state_dict() may ask before the first sample
        except PlanError as exc:
            if world.num_workers == 1:
                raise
            # In a DataLoader worker, raise with the first sample: the loader then hands the error to
            # the main process at once (raised here, it kills the worker and is seen only after a timeout).
            return _refused(exc)
        iterator = self._iterate(world, key, plan, progress, stages)
        close_at_exit(iterator)  # closed before the interpreter's teardown if still alive then
        return iterator

    def _iterate(
        self, world: World, key: int, plan: EpochPlan, progress: Position, stages: Stages
    ) -> Generator[Any, None, None]:
        """One iteration: its epoch is claimed when its first sample is asked for.

        An iterator still alive at interpreter exit is closed after the modules' globals
        are gone: what its cleanup raises then is dropped, not printed.
        """
        finalizing = sys.is_finalizing  # bound now: the module's globals may be gone at exit
        slot = self.users.enter(ITERATOR, self.source)
        try:
            epoch = self.epochs.claim(key)
            if epoch != progress.epoch:  # another iteration claimed in between
                plan, progress = self.start(world, epoch)
            self.planner.warn_locality(plan, world)
            try:
                yield from stages(plan, world, progress)
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
        """Register a :class:`streamload.Loader`'s iteration; return its slot (see :meth:`Users.enter`)."""
        return self.users.enter(LOADER, self.source)

    def threads(
        self, rank: int, world_size: int, threads: int, stages: Stages
    ) -> tuple[EpochPlan, Position, list[Iterator[Any]]]:
        """One iteration read by ``threads`` readers of this process (:class:`streamload.Loader`).

        Claims the epoch now, and plans it as if this rank had ``threads`` DataLoader
        workers: reader ``w`` reads exactly what worker ``w`` would, so taking their
        batches in turn gives the DataLoader's batches for any number of workers. Returns
        the epoch's plan, the rank's progress (set as this process's, its ``next_item`` advanced by the
        caller as batches are consumed) and one lazy iterator per reader.
        """
        plan = self.planner.plan(self.epochs.claim(secrets.randbits(62) | 1), world_size)
        readers: list[Iterator[Any]] = []
        position = Position(plan.split.epoch, plan.chunk_size(threads), 0)
        for worker in range(threads):
            world = World(rank, world_size, worker, threads)
            position = self.planner.position(world, plan)
            if worker == 0:
                self.planner.warn_locality(plan, world)
            readers.append(iter(stages(plan, world, position)))
        self.progress = replace(position)  # the last reader's start (advanced by the Loader)
        return plan, self.progress, readers


def _refused(exc: StreamloadError) -> Iterator[Any]:
    """An iterator that raises ``exc`` when asked for its first item."""
    raise exc
    yield  # a generator
