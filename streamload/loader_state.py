"""A thread :class:`~streamload.Loader`'s resume states: a ``StatefulDataLoader``'s, checked and converted.

A ``StatefulDataLoader`` keeps each worker's dataset state; the ``Loader`` reads on
threads and resumes from a plain sample count. The conversion checks every worker's
position first, as the DataLoader's own workers check theirs when they resume, so that a
forged state is refused rather than resumed with repeated or skipped samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._errors import PlanError
from .dataset import StreamingDataset
from .plan import World

__all__ = ["check_workers", "dataset_state"]


def dataset_state(state: Mapping[str, Any], ds: StreamingDataset) -> Mapping[str, Any]:
    """Return the dataset state in ``state``: itself, or derived from a ``StatefulDataLoader``'s state.

    A ``StatefulDataLoader`` keeps each worker's dataset state as of the last batch it
    yielded (its rank-order position); the loader has consumed every batch before the
    furthest of them, plus the steps since that snapshot. Every worker's position is
    checked first, as the DataLoader's workers check theirs when they resume
    (:meth:`~streamload.plan.state.WorkerPosition.check`): one worker each, of one world,
    each where the plan puts it.

    Raises:
        PlanError: If the state is malformed or a worker's position is not one the plan reaches.
    """
    if not isinstance(state, Mapping):
        raise PlanError(f"state must be a dict, got {type(state).__name__}")
    if "version" in state:
        return state
    if isinstance(state.get("dataset_state"), Mapping):  # StatefulDataLoader without workers
        return dict(state["dataset_state"])
    snapshot = state.get("_snapshot")
    workers = snapshot.get("_worker_snapshots") if isinstance(snapshot, Mapping) else None
    if not isinstance(workers, Mapping) or not workers:
        raise PlanError(
            "state is neither a StreamingDataset state nor a StatefulDataLoader state of one "
            f"(keys: {sorted(map(str, state))[:8]})"
        )
    inner = [w.get("dataset_state") if isinstance(w, Mapping) else None for w in workers.values()]
    if not all(isinstance(s, Mapping) and isinstance(s.get("worker"), Mapping) for s in inner):
        raise PlanError("StatefulDataLoader state without a StreamingDataset worker position in every worker")
    positions = [s["worker"] for s in inner]  # type: ignore[index]
    nexts = [p.get("next_item") for p in positions]
    chunk = positions[0].get("chunk")
    since = state.get("_steps_since_snapshot", 0)
    well_formed = all(isinstance(n, int) and n >= 0 for n in nexts)
    if not well_formed or not isinstance(chunk, int) or chunk < 1:
        raise PlanError("StatefulDataLoader state with a malformed worker position")
    if isinstance(since, bool) or not isinstance(since, int) or since < 0:
        raise PlanError(f"StatefulDataLoader state with _steps_since_snapshot={since!r} (must be an integer >= 0)")
    first = dict(inner[0])  # type: ignore[arg-type]
    world_size = first.get("world_size")
    if not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"StatefulDataLoader state with world_size={world_size!r}")
    check_workers(ds, inner, positions)  # type: ignore[arg-type]
    first["worker"] = None
    first["samples_seen"] = world_size * (max(nexts) + since * chunk)
    return first


def check_workers(ds: StreamingDataset, inner: list[Mapping[str, Any]], positions: list[Mapping[str, Any]]) -> None:
    """Check a ``StatefulDataLoader``'s worker states as its workers would on resume.

    Raises:
        PlanError: If the workers are not ``0 .. n-1`` of one world with one chunk, or a
            position is not where the plan puts its worker.
    """
    shape = {(p.get("rank"), p.get("world_size"), p.get("num_workers"), p.get("chunk")) for p in positions}
    ids = sorted(int(p["worker"]) for p in positions if isinstance(p.get("worker"), int))
    if len(shape) != 1 or ids != list(range(len(positions))) or next(iter(shape))[2] != len(positions):
        raise PlanError(
            "StatefulDataLoader state whose worker positions are not one world's workers 0..n-1 "
            f"(workers {[p.get('worker') for p in positions]}, shapes {sorted(map(str, shape))})"
        )
    planner = ds.planner
    saved = planner.resume
    try:
        for dataset_state in inner:
            loaded = planner.load(dataset_state)  # the dataset's own checks (seed, size, manifest...)
            position = loaded.worker
            if position is None:  # a finished epoch: normalized to the next one's start
                continue
            world = World(position.rank, position.world_size, position.worker, position.num_workers)
            plan = planner.plan(loaded.epoch, position.world_size)
            if position.chunk != plan.chunk_size(position.num_workers):
                raise PlanError(
                    f"state worker position {position.describe()}: chunk={position.chunk} is not this dataset's "
                    f"({plan.chunk_size(position.num_workers)} for {position.num_workers} workers)"
                )
            position.check(world, plan)
    finally:
        planner.resume = saved
