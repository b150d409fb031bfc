"""A dataset's iterations in one process: each claims its epoch, registers its reader, runs its stages.

An iteration's readers (the DataLoader workers of one ``iter(loader)``, or the threads of
one :class:`streamload.Loader` iteration) share its epoch (:class:`~streamload.epochs.EpochTable`),
claimed when the first sample is asked for; a Loader's threads and a DataLoader never
read one dataset at once (:class:`~streamload.epochs.Users`). Each reader runs one
:class:`~streamload.stages.Pipeline` from its place in the plan
(:class:`~streamload.plan_stage.Planner`).
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
from .plan_stage import Planner, Position

__all__ = ["Iterations", "ThreadReaders"]

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

    def threads(
        self, rank: int, world_size: int, threads: int, stages: Stages, prepare: Callable[[], object]
    ) -> ThreadReaders:
        """One iteration read by ``threads`` readers of this process (:class:`streamload.Loader`).

        Registers the iteration (a DataLoader iterating the dataset now refuses it), calls
        ``prepare`` (the storages opened once, not by the readers at once), claims the
        epoch and plans it as if this rank had ``threads`` DataLoader workers: reader
        ``w`` reads exactly what worker ``w`` would, so taking their batches in turn gives
        the DataLoader's batches for any number of workers. If anything fails, the
        iteration is unregistered before the error is raised.
        """
        slot = self.users.enter(LOADER, self.source)
        try:
            prepare()
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
        except BaseException:
            self.users.leave(slot)
            raise
        return ThreadReaders(plan, self.progress, readers, World(rank, world_size, 0, 1), self, slot)


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
            self._iterations.users.leave(slot)


def _refused(exc: StreamloadError) -> Iterator[Any]:
    """An iterator that raises ``exc`` when asked for its first item."""
    raise exc
    yield  # a generator
