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
where it stopped. Another global batch size or partition count reads the rest (below).

``worker`` is set in states saved inside a DataLoader worker (the
``torchdata.stateful_dataloader.StatefulDataLoader`` protocol): that worker's next rank
item, which resumes the same worker of the same world exactly. Those states carry
``samples_seen`` only when a rank has a single worker. A worker whose iteration itself
resumed from a sample count deals chunks from the chunk it resumed at; its position then
also says ``"first_chunk"`` (see :meth:`~streamload.plan.planner.EpochPlan.worker_items`).

``"pad": false`` is there for a dataset of ``pad=False`` (absent: ``True``); with
``pad=False`` the epoch ends after its short last global batch, at ``num_samples``, and a
count of whole steps (``steps * global_batch``, up to the next multiple) also ends it.

``"manifest"`` is a digest of the shards the epoch reads (names, sizes, sample counts,
hashes; :func:`manifest_fingerprint`); a state for another dataset of the same size is
refused. States without it (earlier versions) are checked as before.

**Another global batch** (or partition count) continues the epoch from its rest
(:class:`~streamload.plan.planner.Remainder`): every sample not yet read, each once, cut
into the new world's global batches. The state then records the segments read before:
``"segments": [[global_batch, partitions, samples_seen], ...]`` (each one's shape and the
epoch's count when it ended, oldest first) and ``"rest"``, the items the current segment
began with; ``samples_seen`` still counts the whole epoch, all segments.

``worker`` positions also say ``"start"`` (the rank item the worker's iteration started
from) and ``"done"`` (items the worker has read since); on load, ``next_item`` must be
where the plan puts the worker after ``done`` items from ``start``, inside the rank's
items, with ``first_chunk`` the chunk of ``start``: a tampered position is a
:class:`PlanError`, never dropped or repeated samples.

Everything is ints, bools, lists and ``None``: JSON- and ``torch.save``-safe, no pickle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .._errors import PlanError
from .._fields import fields_from
from .split import Split, padded_total
from .world import World

if TYPE_CHECKING:
    from .planner import EpochPlan

__all__ = ["STATE_VERSION", "EpochState", "WorkerPosition", "manifest_fingerprint"]

STATE_VERSION = 2
#: Most changes of global batch one epoch's state records.
MAX_SEGMENTS = 32
#: Largest global batch and partition count of a recorded segment (its plan is rebuilt on load).
_MAX_SEGMENT_BATCH, _MAX_SEGMENT_PARTS = 1 << 24, 1 << 16


def manifest_fingerprint(shards: Sequence[Sequence[tuple[str, int, int, str]]]) -> str:
    """Return a short digest of the shards read, per stream: ``(name, bytes, samples, hash)`` each."""
    digest = hashlib.sha256()
    for stream in shards:
        digest.update(json.dumps([list(entry) for entry in stream]).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


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
        start: The rank item the worker's iteration started from (``None`` in states of
            earlier versions).
        done: Items the worker has read since ``start`` (``None`` likewise).
    """

    rank: int
    world_size: int
    worker: int
    num_workers: int
    chunk: int
    next_item: int
    first_chunk: int = 0
    start: int | None = None
    done: int | None = None

    def check(self, world: World, plan: EpochPlan) -> None:
        """Raise :class:`PlanError` unless the position is one ``world``'s worker reaches in ``plan``.

        ``next_item`` must lie inside the rank's items and be where the worker stands
        after ``done`` of its items from ``start``, dealt from ``first_chunk`` (the
        chunk of ``start``). Checked in the worker, against its own plan: a position that
        agrees with itself in every field is taken as it is.
        """
        count, chunk = plan.rank_count(world.rank), self.chunk
        what = f"state worker position {self.describe()}"
        if self.next_item > count:
            raise PlanError(f"{what}: next_item={self.next_item} is past the rank's {count} items")
        if self.first_chunk * chunk > count:
            raise PlanError(f"{what}: first_chunk={self.first_chunk} is past the rank's {count} items")
        if self.start is None or self.done is None:
            return  # an earlier version's state: no more to check it against
        if self.start > self.next_item:
            raise PlanError(f"{what}: start={self.start} is after next_item={self.next_item}")
        if self.first_chunk != self.start // chunk:
            raise PlanError(
                f"{what}: first_chunk={self.first_chunk} is not the chunk of start={self.start} "
                f"(chunk={chunk}: {self.start // chunk})"
            )
        done = plan.worker_done(world, self.start, self.first_chunk, self.next_item)
        if done is None or done != self.done:
            where = "is not in one of its chunks" if done is None else f"follows {done} items, not {self.done}"
            raise PlanError(f"{what}: next_item={self.next_item} {where} (tampered or from another plan)")

    def describe(self) -> str:
        """Return the position as ``key=value`` pairs."""
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items())

    def to_dict(self) -> dict[str, int]:
        """Return the position as plain data."""
        out = {
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": self.worker,
            "num_workers": self.num_workers,
            "chunk": self.chunk,
            "next_item": self.next_item,
        }
        if self.first_chunk:
            out["first_chunk"] = self.first_chunk
        if self.start is not None and self.done is not None:
            out["start"], out["done"] = self.start, self.done
        return out

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
    pad: bool = True
    manifest: str | None = None
    #: Earlier segments of the epoch: ``(global_batch, partitions, samples_seen at its end)``.
    segments: tuple[tuple[int, int, int], ...] = field(default=())
    #: Items the current segment began with (with ``segments`` only).
    rest: int | None = None

    @property
    def segment_start(self) -> int:
        """The epoch's count when the current segment began (0 without segments)."""
        return self.segments[-1][2] if self.segments else 0

    @property
    def segment_total(self) -> int:
        """Items (samples) of the current segment's sequence."""
        return self.num_samples if self.rest is None else self.rest

    @property
    def padded(self) -> int:
        """The largest count of the epoch, all ranks: whole global batches (``pad=False``: the next multiple)."""
        return self.segment_start + padded_total(self.segment_total, self.global_batch, self.drop_last)

    @property
    def end(self) -> int:
        """The count at which the epoch has ended (``pad=False``: after its short last global batch)."""
        if self.pad or self.drop_last:
            return self.padded
        return self.segment_start + self.segment_total

    @property
    def full(self) -> int:
        """The count at the end of the current segment's whole global batches."""
        return self.segment_start + padded_total(self.segment_total, self.global_batch, self.drop_last or not self.pad)

    def split(self) -> Split:
        """Return the :class:`Split` of this epoch (without chunking, and with the default partitions)."""
        return fields_from(Split, self, partitions=None)

    def to_dict(self) -> dict[str, Any]:
        """Return the state as plain data."""
        worker = None if self.worker is None else self.worker.to_dict()
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
        if not self.pad:
            out["pad"] = False
        if self.manifest is not None:
            out["manifest"] = self.manifest
        if self.segments:
            out["segments"] = [list(s) for s in self.segments]
            out["rest"] = self.rest
        return out

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> EpochState:
        """Validate untrusted plain data (e.g. loaded from JSON) and return the state.

        Raises:
            PlanError: If a field is missing, of the wrong type, or out of range.
        """
        return _state_from_dict(state)

    def check_dataset(
        self,
        *,
        seed: int,
        shuffle: bool,
        drop_last: bool,
        window: int,
        num_samples: int,
        mixture: str | None = None,
        pad: bool = True,
        manifest: str | None = None,
    ) -> None:
        """Raise :class:`PlanError` if the state was saved for a differently configured dataset.

        ``manifest`` is compared only when the state has one (earlier versions had none).
        """
        mine = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
            "num_samples": self.num_samples,
            "mixture": self.mixture,
        }
        theirs = {
            "seed": seed,
            "shuffle": shuffle,
            "drop_last": drop_last,
            "pad": pad,
            "num_samples": num_samples,
            "mixture": mixture,
        }
        if shuffle:
            mine["window"], theirs["window"] = self.window, window
        wrong = [f"{k}={mine[k]!r} (dataset has {theirs[k]!r})" for k in mine if mine[k] != theirs[k]]
        if wrong:
            raise PlanError("state does not match the dataset: " + ", ".join(wrong))
        if self.manifest is not None and self.manifest != manifest:
            raise PlanError(
                f"state was saved for another dataset: its shards' fingerprint is manifest={self.manifest!r}, "
                f"this dataset's is {manifest!r} (same size, other shards: a state of another dataset or "
                "of an earlier version of this one)"
            )

    def normalized(self) -> EpochState:
        """Return the state with a finished epoch turned into the start of the next one.

        Raises:
            PlanError: If ``samples_seen`` is not a multiple of ``world_size``.
        """
        if self.samples_seen is None:
            return self
        seen = self.samples_seen - self.segment_start
        if seen % self.world_size and not (self.world_size == 1 or self.full < self.samples_seen < self.end):
            raise PlanError(
                f"samples_seen={self.samples_seen} must be a multiple of world_size={self.world_size} "
                "(use a fixed global batch: steps * global_batch)"
            )
        if self.samples_seen < self.end:
            return self
        return replace(self, epoch=self.epoch + 1, samples_seen=0, worker=None, segments=(), rest=None)

    def check_world(self, world: World, batch: int, partitions: int) -> None:
        """Raise :class:`PlanError` unless ``world`` (global ``batch``, ``partitions``) continues this state exactly.

        (The dataset reads the rest of the epoch instead, see :meth:`reshaped`.)

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
        assert self.samples_seen is None or self.samples_seen >= self.segment_start
        if self.samples_seen is None:
            w = self.worker
            assert w is not None
            raise PlanError(
                f"state saved by worker {w.worker} of num_workers={w.num_workers} on rank {w.rank} of "
                f"world_size={w.world_size} (chunk={w.chunk}) cannot resume worker {world.worker} of "
                f"num_workers={world.num_workers} on rank {world.rank} of world_size={world.world_size} "
                f"({chunk=}); save the state with state_dict(samples_seen=...) to change the world"
            )
        seen = self.samples_seen - self.segment_start
        if world.world_size != self.world_size and seen % self.global_batch and self.samples_seen < self.full:
            raise PlanError(
                f"samples_seen={self.samples_seen} is not a whole number of global batches of "
                f"{self.global_batch}: it resumes only on its own world_size={self.world_size}, "
                f"not on world_size={world.world_size}"
            )
        if self.samples_seen > self.full:  # inside the short last global batch (pad=False)
            if world.world_size != 1 or self.world_size != 1:
                raise PlanError(
                    f"samples_seen={self.samples_seen} is inside the short last global batch "
                    f"({self.full}..{self.end}): only a one-rank world resumes there"
                )
            return seen, seen // chunk
        start = seen // world.world_size
        return start, start // chunk

    def origin(self, world: World, chunk: int, start: int) -> tuple[int, int]:
        """Return the start item and items done of the iteration that ``world``'s worker resumes.

        A worker's own position keeps its iteration's start and count; a resume from a
        sample count starts a new iteration at ``start``.
        """
        w = self.worker
        if w is not None and w.matches(world, chunk) and w.start is not None and w.done is not None:
            return w.start, w.done
        if w is not None and w.matches(world, chunk):  # an earlier version's position: counted from here
            return w.first_chunk * chunk, -1
        return start, 0

    def reshaped(self, world_batch: int, world_partitions: int, canonical: bool) -> bool:
        """True if a world of global batch ``world_batch`` reads the rest of the epoch in a new segment.

        The same global batch continues the current segment exactly (any partition count
        of a segment that is not the canonical order is kept from the state); another
        one, or other canonical partitions, starts a new segment.
        """
        if self.samples_seen is None or self.samples_seen == self.segment_start:
            return False  # nothing read yet in this segment: nothing to carry on from
        if world_batch != self.global_batch:
            return True
        return canonical and not self.segments and world_partitions != self.partitions

    def new_segment(self) -> tuple[int, int, int]:
        """Return the current segment as a finished one: ``(global_batch, partitions, samples_seen)``.

        Raises:
            PlanError: If ``samples_seen`` is not a whole number of the segment's global
                batches, or the epoch already changed shape :data:`MAX_SEGMENTS` times.
        """
        assert self.samples_seen is not None
        seen = self.samples_seen - self.segment_start
        if seen % self.global_batch:
            raise PlanError(
                f"samples_seen={self.samples_seen} is not a whole number of global batches of "
                f"{self.global_batch}: it resumes only with the same global batch"
            )
        if len(self.segments) >= MAX_SEGMENTS:
            raise PlanError(f"the epoch changed its global batch {MAX_SEGMENTS} times already: finish it first")
        if self.global_batch > _MAX_SEGMENT_BATCH or self.partitions > _MAX_SEGMENT_PARTS:
            raise PlanError(
                f"state global_batch={self.global_batch} (partitions={self.partitions}) is too large to resume "
                f"with another global batch (at most {_MAX_SEGMENT_BATCH}, {_MAX_SEGMENT_PARTS})"
            )
        return self.global_batch, self.partitions, self.samples_seen


def _state_from_dict(state: Mapping[str, Any]) -> EpochState:
    """:meth:`EpochState.from_dict`: every field checked, then how they fit together."""
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
    manifest = state.get("manifest")
    if manifest is not None and (not isinstance(manifest, str) or len(manifest) > 64):
        raise PlanError(f"state manifest={manifest!r} must be a short string or absent")
    segments = _segments(state.get("segments"))
    rest = None if not segments else _int(state, "rest")
    out = EpochState(
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
        pad=_bool(state, "pad") if "pad" in state else True,
        manifest=manifest,
        segments=segments,
        rest=rest,
    )
    if out.samples_seen is None and out.worker is None:
        raise PlanError("state has neither samples_seen nor a worker position")
    if out.global_batch % out.world_size:
        raise PlanError(f"state global_batch={out.global_batch} is not a multiple of its world_size={out.world_size}")
    if segments:
        assert rest is not None
        if rest > out.num_samples:
            raise PlanError(f"state rest={rest} is more than num_samples={out.num_samples}")
        if out.samples_seen is not None and out.samples_seen < out.segment_start:
            raise PlanError(
                f"state samples_seen={out.samples_seen} is before its last segment's end {out.segment_start}"
            )
    return out


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
    start = _int(raw, "start") if "start" in raw else None
    done = _int(raw, "done") if "done" in raw else None
    if (start is None) != (done is None):
        raise PlanError(f"state worker={dict(raw)!r}: start and done come together")
    position = WorkerPosition(
        **values, first_chunk=_int(raw, "first_chunk") if "first_chunk" in raw else 0, start=start, done=done
    )
    try:
        World(position.rank, position.world_size, position.worker, position.num_workers)
    except PlanError as exc:
        raise PlanError(f"state worker={dict(raw)!r}: {exc}") from exc
    if position.chunk < 1:
        raise PlanError(f"state worker chunk={position.chunk} must be >= 1")
    return position


def _segments(raw: Any) -> tuple[tuple[int, int, int], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or len(raw) > MAX_SEGMENTS:
        raise PlanError(f"state segments must be a list of at most {MAX_SEGMENTS} entries, got {raw!r:.200}")
    out: list[tuple[int, int, int]] = []
    last = 0
    for entry in raw:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) for v in entry)
        ):
            raise PlanError(f"state segment {entry!r:.100} must be [global_batch, partitions, samples_seen]")
        batch, parts, seen = (int(v) for v in entry)
        if (
            not 1 <= batch <= _MAX_SEGMENT_BATCH
            or not 1 <= parts <= min(batch, _MAX_SEGMENT_PARTS)
            or seen <= last
            or (seen - last) % batch
        ):
            raise PlanError(
                f"state segment {list(entry)} must have 1 <= global_batch <= {_MAX_SEGMENT_BATCH}, "
                f"1 <= partitions <= min(global_batch, {_MAX_SEGMENT_PARTS}) and end after {last} by whole "
                "global batches"
            )
        out.append((batch, parts, seen))
        last = seen
    return tuple(out)
