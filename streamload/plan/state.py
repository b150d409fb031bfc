"""Where an epoch stands: the plain-data state saved in checkpoints and resumed from.

The state says which epoch is running and how far it has gone, in a form that does not
depend on the number of ranks or DataLoader workers that will continue it::

    {"version": 1, "epoch": 3, "seed": 0, "shuffle": true, "drop_last": false,
     "window": 4096, "num_samples": 100000,      # must match the dataset on load
     "world_size": 8,                            # ranks that produced the progress
     "samples_seen": 40960,                      # global count, all ranks, this epoch
     "stages": [[16, 8192]],                     # earlier worlds of this epoch, if any
     "worker": null}                             # one worker's own position, see below

A mixture of streams, or one dataset with an ``epoch_size``, adds ``"mixture"``: a digest
of every stream's size, shard count and per-epoch count
(:func:`~streamload.plan.mixture.mixture_fingerprint`), checked like ``num_samples``
(which is then the epoch's sample count, all streams).

``samples_seen`` counts items of the epoch consumed over all ranks: ``world_size`` times
the items each rank consumed of its rank order (a multiple of ``world_size`` past the
current stage's start). With a fixed per-rank batch ``B`` it is ``steps * world_size * B``.
Resuming on the same number of ranks continues every rank order where it stopped (the
uninterrupted order exactly); on a different number, the unread suffixes are re-split
(:class:`~streamload.plan.planner.Stage`).

``worker`` is set in states saved inside a DataLoader worker (the
``torchdata.stateful_dataloader.StatefulDataLoader`` protocol): that worker's next rank
item, which resumes the same worker of the same world exactly. Those states carry
``samples_seen`` only when a rank has a single worker. A worker whose iteration itself
resumed from a sample count deals chunks from the chunk it resumed at; its position then
also says ``"first_chunk"`` (see :meth:`~streamload.plan.planner.EpochPlan.worker_items`).

Everything is ints, bools, lists and ``None``: JSON- and ``torch.save``-safe, no pickle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import PlanError
from .planner import EpochPlan, Split, Stage
from .world import World

__all__ = ["STATE_VERSION", "EpochState", "WorkerPosition"]

STATE_VERSION = 1


@dataclass(frozen=True)
class WorkerPosition:
    """One DataLoader worker's own progress through its rank's order.

    Attributes:
        rank: The worker's rank.
        world_size: Ranks of the world.
        worker: Worker id.
        num_workers: Workers of the rank.
        chunk: Items per chunk handed to a worker.
        next_item: The rank-order index of the worker's next item.
        first_chunk: The chunk from which the iteration dealt chunks to its workers.
    """

    rank: int
    world_size: int
    worker: int
    num_workers: int
    chunk: int
    next_item: int
    first_chunk: int = 0

    def matches(self, world: World, chunk: int) -> bool:
        """True if this position belongs to ``world``'s worker with the same chunking."""
        return (self.rank, self.world_size, self.worker, self.num_workers, self.chunk) == (
            world.rank,
            world.world_size,
            world.worker,
            world.num_workers,
            chunk,
        )


@dataclass(frozen=True)
class EpochState:
    """How far an epoch has gone (see the module docstring for the dict form)."""

    epoch: int
    seed: int
    shuffle: bool
    drop_last: bool
    window: int
    num_samples: int
    world_size: int
    samples_seen: int | None
    stages: tuple[Stage, ...] = ()
    worker: WorkerPosition | None = None
    mixture: str | None = None

    @property
    def stage_start(self) -> int:
        """Global samples seen when the current stage began."""
        return self.stages[-1].samples_seen if self.stages else 0

    def split(self) -> Split:
        """Return the :class:`Split` of this epoch (without chunking)."""
        return Split(
            epoch=self.epoch, seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last, window=self.window
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the state as plain data."""
        worker = None
        if self.worker is not None:
            w = self.worker
            worker = {
                "rank": w.rank,
                "world_size": w.world_size,
                "worker": w.worker,
                "num_workers": w.num_workers,
                "chunk": w.chunk,
                "next_item": w.next_item,
            }
            if w.first_chunk:
                worker["first_chunk"] = w.first_chunk
        out: dict[str, Any] = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "window": self.window,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "samples_seen": self.samples_seen,
            "stages": [[s.world_size, s.samples_seen] for s in self.stages],
            "worker": worker,
        }
        if self.mixture is not None:
            out["mixture"] = self.mixture
        return out

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> EpochState:
        """Validate untrusted plain data (e.g. loaded from JSON) and return the state.

        Raises:
            PlanError: If a field is missing, of the wrong type, or out of range.
        """
        if not isinstance(state, Mapping):
            raise PlanError(f"state must be a dict, got {type(state).__name__}")
        version = _int(state, "version")
        if version != STATE_VERSION:
            raise PlanError(f"state {version=} is not supported (expected {STATE_VERSION})")
        stages_raw = state.get("stages", [])
        if not isinstance(stages_raw, Sequence) or isinstance(stages_raw, (str, bytes)):
            raise PlanError(f"state stages={stages_raw!r} must be a list of [world_size, samples_seen]")
        stages = tuple(_stage(item) for item in stages_raw)
        seen = state.get("samples_seen")
        worker_raw = state.get("worker")
        mixture = state.get("mixture")
        if mixture is not None and (not isinstance(mixture, str) or len(mixture) > 64):
            raise PlanError(f"state mixture={mixture!r} must be a short string or absent")
        out = cls(
            epoch=_int(state, "epoch"),
            seed=_int(state, "seed", signed=True),
            shuffle=_bool(state, "shuffle"),
            drop_last=_bool(state, "drop_last"),
            window=_int(state, "window", low=1),
            num_samples=_int(state, "num_samples"),
            world_size=_int(state, "world_size", low=1),
            samples_seen=None if seen is None else _int(state, "samples_seen"),
            stages=stages,
            worker=None if worker_raw is None else _worker(worker_raw),
            mixture=mixture,
        )
        if out.samples_seen is None and out.worker is None:
            raise PlanError("state has neither samples_seen nor a worker position")
        previous = 0
        for stage in stages:
            if stage.samples_seen < previous:
                raise PlanError(f"state stages={stages_raw!r} must have non-decreasing samples_seen")
            previous = stage.samples_seen
        return out

    def check_dataset(
        self, *, seed: int, shuffle: bool, drop_last: bool, window: int, num_samples: int, mixture: str | None = None
    ) -> None:
        """Raise :class:`PlanError` if the state was saved for a differently configured dataset."""
        mine = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_samples": self.num_samples,
            "mixture": self.mixture,
        }
        theirs = {
            "seed": seed,
            "shuffle": shuffle,
            "drop_last": drop_last,
            "num_samples": num_samples,
            "mixture": mixture,
        }
        if shuffle:
            mine["window"], theirs["window"] = self.window, window
        wrong = [f"{k}={mine[k]!r} (dataset has {theirs[k]!r})" for k in mine if mine[k] != theirs[k]]
        if wrong:
            raise PlanError("state does not match the dataset: " + ", ".join(wrong))

    def normalized(self, shard_counts: Sequence[int]) -> EpochState:
        """Return the state with a finished epoch turned into the start of the next one.

        Only the sum of ``shard_counts`` matters (the epoch's sample count).

        Raises:
            PlanError: If ``samples_seen`` is not a multiple of ``world_size`` past the
                stage start, or the stages are inconsistent.
        """
        if self.samples_seen is None:
            return self
        plan = EpochPlan(shard_counts, self.world_size, self.split(), self.stages)
        done = self.samples_seen - self.stage_start
        if done < 0 or done % self.world_size:
            raise PlanError(
                f"samples_seen={self.samples_seen} minus the stage start {self.stage_start} must be a "
                f"non-negative multiple of world_size={self.world_size} (use a fixed global batch)"
            )
        if done < plan.stage_total:
            return self
        return EpochState(
            self.epoch + 1,
            self.seed,
            self.shuffle,
            self.drop_last,
            self.window,
            self.num_samples,
            self.world_size,
            0,
            mixture=self.mixture,
        )

    def resume_point(self, world: World, chunk: int) -> tuple[tuple[Stage, ...], int]:
        """Return the stages and the start item with which ``world``'s worker continues.

        The start is a rank-order item index (:meth:`EpochPlan.worker_items` skips the
        worker's items before it).

        Raises:
            PlanError: If the state holds only a worker position of another world.
        """
        stages, start, _ = self.resume(world, chunk)
        return stages, start

    def resume(self, world: World, chunk: int) -> tuple[tuple[Stage, ...], int, int]:
        """Return the stages, the start item and the first dealt chunk of ``world``'s worker.

        Like :meth:`resume_point`, plus the ``first`` argument of
        :meth:`EpochPlan.worker_items`: a resume from a sample count deals chunks from the
        chunk of the start item (the DataLoader asks worker 0 first), a worker's own
        position keeps its iteration's.

        Raises:
            PlanError: If the state holds only a worker position of another world.
        """
        if self.worker is not None and self.worker.matches(world, chunk):
            return self.stages, self.worker.next_item, self.worker.first_chunk
        if self.samples_seen is None:
            w = self.worker
            assert w is not None
            raise PlanError(
                f"state saved by worker {w.worker} of num_workers={w.num_workers} on rank {w.rank} of "
                f"world_size={w.world_size} (chunk={w.chunk}) cannot resume worker {world.worker} of "
                f"num_workers={world.num_workers} on rank {world.rank} of world_size={world.world_size} "
                f"({chunk=}); save the state with state_dict(samples_seen=...) to change the world"
            )
        done = self.samples_seen - self.stage_start
        if world.world_size == self.world_size:
            start = done // self.world_size
            return self.stages, start, start // chunk
        if done == 0:  # the current stage read nothing: the new world simply replaces it
            return self.stages, 0, 0
        return (*self.stages, Stage(self.world_size, self.samples_seen)), 0, 0


def _int(state: Mapping[str, Any], name: str, low: int = 0, signed: bool = False) -> int:
    value = state.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or (not signed and value < low):
        raise PlanError(f"state {name}={value!r} must be an integer" + ("" if signed else f" >= {low}"))
    return value


def _bool(state: Mapping[str, Any], name: str) -> bool:
    value = state.get(name)
    if not isinstance(value, bool):
        raise PlanError(f"state {name}={value!r} must be a bool")
    return value


def _stage(item: Any) -> Stage:
    if (
        not isinstance(item, Sequence)
        or len(item) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        or item[0] < 1
        or item[1] < 0
    ):
        raise PlanError(f"state stage {item!r} must be [world_size >= 1, samples_seen >= 0]")
    return Stage(int(item[0]), int(item[1]))


def _worker(raw: Any) -> WorkerPosition:
    if not isinstance(raw, Mapping):
        raise PlanError(f"state worker={raw!r} must be a dict or null")
    names = ("rank", "world_size", "worker", "num_workers", "chunk", "next_item")
    values = {name: _int(raw, name) for name in names}
    position = WorkerPosition(**values, first_chunk=_int(raw, "first_chunk") if "first_chunk" in raw else 0)
    try:
        World(position.rank, position.world_size, position.worker, position.num_workers)
    except PlanError as exc:
        raise PlanError(f"state worker={dict(raw)!r}: {exc}") from exc
    if position.chunk < 1:
        raise PlanError(f"state worker chunk={position.chunk} must be >= 1")
    return position
