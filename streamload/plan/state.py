"""Where an epoch stands: the plain-data state saved in checkpoints and resumed from.

The state says which epoch is running and how far it has gone, in a form that does not
depend on the number of ranks or DataLoader workers that will continue it::

    {"version": 2, "epoch": 3, "seed": 0, "shuffle": true, "drop_last": false,
     "window": 4096, "num_samples": 100000,      # must match the dataset on load
     "global_batch": 256, "partitions": 8,       # the order's shape: must match the world's
     "world_size": 8,                            # ranks that produced the progress
     "samples_seen": 40960,                      # global count, all ranks, this epoch
     "worker": null}                             # one worker's own position, see below

A mixture of streams, or one dataset with an ``epoch_size``, adds ``"mixture"``: a digest
of every stream's size, shard count and per-epoch count
(:func:`~streamload.plan.mixture.mixture_fingerprint`), checked like ``num_samples``
(which is then the epoch's sample count, all streams).

``samples_seen`` counts items of the epoch consumed over all ranks: ``world_size`` times
the items each rank consumed of its rank order. With a per-rank batch ``b`` it is
``steps * world_size * b = steps * global_batch``. The global batches of a shuffled,
batched epoch do not depend on the world (:mod:`streamload.plan.planner`), so a state
whose ``samples_seen`` is a whole number of global batches resumes on any world with the
same ``global_batch`` and ``partitions``, continuing the uninterrupted sequence of global
batches exactly; on the same world any multiple of ``world_size`` resumes each rank
where it stopped. Another global batch size or partition count is a :class:`PlanError`
naming both values.

``worker`` is set in states saved inside a DataLoader worker (the
``torchdata.stateful_dataloader.StatefulDataLoader`` protocol): that worker's next rank
item, which resumes the same worker of the same world exactly. Those states carry
``samples_seen`` only when a rank has a single worker. A worker whose iteration itself
resumed from a sample count deals chunks from the chunk it resumed at; its position then
also says ``"first_chunk"`` (see :meth:`~streamload.plan.planner.EpochPlan.worker_items`).

Everything is ints, bools, lists and ``None``: JSON- and ``torch.save``-safe, no pickle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import PlanError
from .planner import Split, padded_total
from .world import World

__all__ = ["STATE_VERSION", "EpochState", "WorkerPosition"]

STATE_VERSION = 2


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
    global_batch: int
    partitions: int
    worker: WorkerPosition | None = None
    mixture: str | None = None

    @property
    def padded(self) -> int:
        """Items of the whole epoch, all ranks (whole global batches)."""
        return padded_total(self.num_samples, self.global_batch, self.drop_last)

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
            "global_batch": self.global_batch,
            "partitions": self.partitions,
            "samples_seen": self.samples_seen,
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
            older = " (saved by an earlier streamload, whose order differs)" if version == 1 else ""
            raise PlanError(f"state {version=} is not supported{older}: expected version {STATE_VERSION}")
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
            global_batch=_int(state, "global_batch", low=1),
            partitions=_int(state, "partitions", low=1),
            worker=None if worker_raw is None else _worker(worker_raw),
            mixture=mixture,
        )
        if out.samples_seen is None and out.worker is None:
            raise PlanError("state has neither samples_seen nor a worker position")
        if out.global_batch % out.world_size:
            raise PlanError(
                f"state global_batch={out.global_batch} is not a multiple of its world_size={out.world_size}"
            )
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

    def normalized(self) -> EpochState:
        """Return the state with a finished epoch turned into the start of the next one.

        Raises:
            PlanError: If ``samples_seen`` is not a multiple of ``world_size``.
        """
        if self.samples_seen is None:
            return self
        if self.samples_seen % self.world_size:
            raise PlanError(
                f"samples_seen={self.samples_seen} must be a multiple of world_size={self.world_size} "
                "(use a fixed global batch: steps * global_batch)"
            )
        if self.samples_seen < self.padded:
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
            self.global_batch,
            self.partitions,
            mixture=self.mixture,
        )

    def check_world(self, world: World, batch: int, partitions: int) -> None:
        """Raise :class:`PlanError` unless ``world`` (global ``batch``, ``partitions``) continues this state.

        The sequence of global batches is a function of the global batch size and the
        partition count: another value of either gives other batches, so the rest of the
        epoch could not be the uninterrupted run's.
        """
        if batch != self.global_batch:
            raise PlanError(
                f"state saved with global_batch={self.global_batch} (world_size={self.world_size}) cannot resume "
                f"with global_batch={batch} (world_size={world.world_size}): keep batch_size * world_size "
                f"equal to {self.global_batch}"
            )
        if partitions != self.partitions:
            raise PlanError(
                f"state saved with partitions={self.partitions} cannot resume with partitions={partitions}: "
                "pass the same partitions= as the saving run"
            )

    def resume(self, world: World, chunk: int) -> tuple[int, int]:
        """Return the start item and the first dealt chunk of ``world``'s worker.

        The start is a rank-order item index (:meth:`EpochPlan.worker_items` skips the
        worker's items before it); the first dealt chunk is the ``first`` argument of
        :meth:`EpochPlan.worker_items`: a resume from a sample count deals chunks from the
        chunk of the start item (the DataLoader asks worker 0 first), a worker's own
        position keeps its iteration's.

        Raises:
            PlanError: If the state holds only a worker position of another world, or its
                ``samples_seen`` is not a whole number of global batches on a new world.
        """
        if self.worker is not None and self.worker.matches(world, chunk):
            return self.worker.next_item, self.worker.first_chunk
        if self.samples_seen is None:
            w = self.worker
            assert w is not None
            raise PlanError(
                f"state saved by worker {w.worker} of num_workers={w.num_workers} on rank {w.rank} of "
                f"world_size={w.world_size} (chunk={w.chunk}) cannot resume worker {world.worker} of "
                f"num_workers={world.num_workers} on rank {world.rank} of world_size={world.world_size} "
                f"({chunk=}); save the state with state_dict(samples_seen=...) to change the world"
            )
        if world.world_size != self.world_size and self.samples_seen % self.global_batch:
            raise PlanError(
                f"samples_seen={self.samples_seen} is not a whole number of global batches of "
                f"{self.global_batch}: it resumes only on its own world_size={self.world_size}, "
                f"not on world_size={world.world_size}"
            )
        start = self.samples_seen // world.world_size
        return start, start // chunk


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
