"""The plan stage (the plan node): an epoch's plan for a world, where each reader starts in it, and where it stands.

:class:`Planner` holds the dataset's order settings (seed, shuffle, window, batch,
partitions, padding) and the one piece of state a dataset carries between iterations:
the resume point given to ``load_state_dict`` (:meth:`Planner.state` / :meth:`Planner.reset`).
The plan itself is pure (:class:`~streamload.plan.EpochPlan`); a reader's position in it is
a :class:`~streamload.stages.Progress`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ._errors import PlanError
from ._validate import check_samples_seen
from .plan import EpochPlan, Remainder, Split, World, locality_warning, partition_count
from .plan.state import EpochState, WorkerPosition
from .streams import Mixture

__all__ = ["Planner", "Position"]


@dataclass
class Position:
    """Where one reader's iteration stands in its plan (plain data: the state of the shard-runs stage).

    Attributes:
        epoch: The iteration's epoch.
        chunk_size: Items a worker takes at a time (its batches: the batch size, when batched).
        next_item: Rank-order index of this reader's next item.
        first: The chunk from which this iteration dealt chunks to the readers.
        origin: The rank item this reader's iteration started from (``None``: unknown, an earlier state).
    """

    epoch: int
    chunk_size: int
    next_item: int
    first: int = 0
    origin: int | None = 0

    def state(self) -> dict[str, Any]:
        """This position as a plain dict."""
        return {
            "epoch": self.epoch,
            "chunk_size": self.chunk_size,
            "next_item": self.next_item,
            "first": self.first,
            "origin": self.origin,
        }

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Stand where ``state`` (from :meth:`state` of a position of the same plan) says; ``None``: stay.

        Raises:
            PlanError: If ``state`` is malformed, or of another epoch or chunk size.
        """
        if state is None:
            return
        if not isinstance(state, Mapping):
            raise PlanError(f"a position's state must be a mapping, not {type(state).__name__}")
        values = {}
        for name in ("epoch", "chunk_size", "next_item", "first"):
            value = state.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"position state {name}={value!r} must be an integer >= 0")
            values[name] = value
        origin = state.get("origin")
        if origin is not None and (isinstance(origin, bool) or not isinstance(origin, int)):
            raise PlanError(f"position state origin={origin!r} must be an integer or None")
        if (values["epoch"], values["chunk_size"]) != (self.epoch, self.chunk_size):
            raise PlanError(
                f"position state of epoch {values['epoch']} with chunk_size={values['chunk_size']} cannot "
                f"resume this reader (epoch {self.epoch}, chunk_size={self.chunk_size})"
            )
        self.next_item, self.first, self.origin = values["next_item"], values["first"], origin


class Planner:
    """The dataset's epoch plans, and the state it was asked to resume from.

    Args:
        streams: The datasets read (their shard counts and layout).
        split: The order settings (``epoch`` left 0: set per plan).
    """

    def __init__(self, streams: Mixture, split: Split) -> None:
        self.streams = streams
        self.split = split
        #: The state given to ``load_state_dict`` (applies to iterations of its epoch).
        self.resume: EpochState | None = None
        #: Locality warnings already given by this process (once per world size).
        self._warned: set[int] = set()

    def state(self) -> dict[str, Any] | None:
        """The resume point as a plain dict, ``None`` if none was loaded."""
        return None if self.resume is None else self.resume.to_dict()

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Forget the resume point (``None``: iterations start at their epoch's first sample), or load ``state``.

        Raises:
            PlanError: If ``state`` is malformed or belongs to a differently configured
                dataset (:meth:`load`).
        """
        if state is None:
            self.resume = None
        else:
            self.load(state)

    def plan(self, epoch: int, world_size: int) -> EpochPlan:
        """The plan of ``epoch`` in a world of ``world_size`` (see :meth:`StreamingDataset.plan`)."""
        split = replace(self.split, epoch=epoch)
        counts = self.streams.shard_counts
        resume = self.resume
        if resume is None or resume.epoch != epoch:
            return EpochPlan(counts, world_size, split, self.streams.layout(split))
        batch = world_size * (split.batch_size or 1)
        reshaped = resume.reshaped(batch, partition_count(split, world_size), split.canonical)
        segments = resume.segments + ((resume.new_segment(),) if reshaped else ())
        if not segments:
            if not split.canonical:
                split = replace(split, partitions=resume.partitions)
            return EpochPlan(counts, world_size, split, self.streams.layout(split))
        first_batch, first_parts, _ = segments[0]
        base = replace(split, batch_size=first_batch, partitions=first_parts, window=resume.window)
        rest = Remainder(EpochPlan(counts, 1, base, self.streams.layout(base)), segments[0][2] // first_batch)
        plain = Split(epoch=epoch, seed=split.seed, drop_last=split.drop_last, pad=split.pad)
        for (_, _, begin), (batch_i, parts_i, end) in zip(segments, segments[1:], strict=False):
            part = replace(plain, batch_size=batch_i, partitions=parts_i)
            rest = Remainder(EpochPlan(counts, 1, part, rest), (end - begin) // batch_i)
        final = replace(plain, batch_size=split.batch_size, partitions=None if reshaped else resume.partitions)
        plan = EpochPlan(counts, world_size, final, rest)
        if not reshaped and resume.rest != rest.total:
            raise PlanError(
                f"state rest={resume.rest} does not match the rest of the epoch its segments leave ({rest.total})"
            )
        plan.segments, plan.reshaped = segments, reshaped
        return plan

    def start(self, world: World, plan: EpochPlan) -> tuple[int, int, int | None]:
        """Return the start item, first dealt chunk and iteration start of ``plan`` for ``world`` (fresh: 0, 0, 0).

        A worker's own position is checked against the plan first (:meth:`WorkerPosition.check`).
        """
        resume = self.resume
        if resume is None or resume.epoch != plan.split.epoch or plan.reshaped:
            return 0, 0, 0  # a new segment is read from its start
        if self.split.shuffle and resume.window != plan.base_window:
            raise PlanError(
                f"state saved with window={resume.window} cannot resume with window={plan.base_window}: "
                "pass the saving run's shuffle_window="
            )
        chunk = plan.chunk_size(world.num_workers)
        if resume.worker is not None and resume.worker.matches(world, chunk):
            resume.worker.check(world, plan)
        start, first = resume.resume(world, chunk)
        origin, _ = resume.origin(world, chunk, start)
        return start, first, None if origin < 0 or _ < 0 else origin

    def position(self, world: World, plan: EpochPlan) -> Position:
        """Where a reader of ``world`` starts in ``plan``."""
        start, first, origin = self.start(world, plan)
        return Position(plan.split.epoch, plan.chunk_size(world.num_workers), start, first, origin)

    def load(self, state_dict: Mapping[str, Any]) -> EpochState:
        """Check ``state_dict`` against this dataset and keep it as the resume point; return it.

        Raises:
            PlanError: If the state is malformed or belongs to a differently configured dataset.
        """
        state = EpochState.from_dict(state_dict)
        split = self.split
        state.check_dataset(
            seed=split.seed,
            shuffle=split.shuffle,
            drop_last=split.drop_last,
            window=split.window or state.window,
            num_samples=self.streams.total,
            mixture=self.streams.fingerprint,
            pad=split.pad,
            manifest=self.streams.digest,
        )
        check_seen(state)
        self.resume = state.normalized()
        return self.resume

    def epoch_state(
        self,
        world: World,
        plan: EpochPlan,
        position: Position | None,
        samples_seen: int | None,
        claimed: int,
    ) -> EpochState:
        """The state of ``plan``'s epoch: ``samples_seen`` (global), or counted from this reader's ``position``.

        ``claimed``: iterations claimed (a process that read nothing while others did
        cannot know the count).

        Raises:
            PlanError: If the count cannot be known or is not a multiple of the world size.
        """
        if samples_seen is None and position is None:
            if claimed > 0:
                raise PlanError(
                    "this process has not read the dataset (DataLoader workers did): "
                    "pass samples_seen=steps * global_batch to state_dict()"
                )
            samples_seen = 0
        worker = None
        if samples_seen is None and position is not None:
            origin = position.origin
            done = None if origin is None else plan.worker_done(world, origin, position.first, position.next_item)
            worker = WorkerPosition(
                world.rank,
                world.world_size,
                world.worker,
                world.num_workers,
                position.chunk_size,
                position.next_item,
                position.first,
                None if done is None else origin,
                done,
            )
            if world.num_workers == 1 and (position.next_item <= plan.per_rank or world.world_size == 1):
                begun = plan.segments[-1][2] if plan.segments else 0
                samples_seen = begun + world.world_size * position.next_item
        split = self.split
        state = EpochState(
            plan.split.epoch,
            split.seed,
            split.shuffle,
            split.drop_last,
            plan.base_window,
            self.streams.total,
            world.world_size,
            samples_seen,
            plan.global_batch,
            plan.partitions,
            worker,
            self.streams.fingerprint,
            pad=split.pad,
            manifest=self.streams.digest,
            segments=plan.segments,
            rest=plan.total if plan.segments else None,
        )
        check_seen(state)
        return state

    def warn_locality(self, plan: EpochPlan, world: World) -> None:
        """Warn once per world size (in the first reader of rank 0) if its ranks straddle partitions.

        Also once per resumed epoch whose global batch changed: its order differs from
        the uninterrupted run's from the resume point on.
        """
        if world.rank or world.worker:
            return
        if plan.reshaped and -1 - plan.split.epoch not in self._warned:
            self._warned.add(-1 - plan.split.epoch)
            old_batch, old_parts, seen = plan.segments[-1]
            warnings.warn(
                f"resuming epoch {plan.split.epoch} after {seen} samples with global_batch={plan.global_batch} "
                f"(partitions={plan.partitions}); it was read with global_batch={old_batch} "
                f"(partitions={old_parts}): the rest of the epoch ({plan.total} samples) is read each once, "
                "equal per rank, in an order that differs from the uninterrupted run's",
                UserWarning,
                stacklevel=4,
            )
        if world.world_size in self._warned:
            return
        self._warned.add(world.world_size)
        message = locality_warning(plan.split, world.world_size)
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=4)


def check_seen(state: EpochState) -> None:
    """Refuse a global ``samples_seen`` past the end of its epoch (a wrong count, not a finished epoch)."""
    if state.samples_seen is not None:
        check_samples_seen(state.samples_seen, state.padded, state.world_size, state.global_batch)
