"""Who is reading: the rank and worker of this process, detected in exactly one place."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._errors import PlanError

__all__ = ["World", "detect_rank_world", "detect_world", "distributed_world", "local_ranks"]


@dataclass(frozen=True)
class World:
    """The position of one reader among all readers of an epoch.

    Attributes:
        rank: This process's rank among ``world_size`` (DDP) processes.
        world_size: Number of ranks.
        worker: This DataLoader worker's id among ``num_workers`` (0 in the main process).
        num_workers: Number of DataLoader workers of each rank (1 when reading in-process).
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise PlanError(f"invalid world: rank={self.rank} world_size={self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise PlanError(f"invalid worker: worker={self.worker} num_workers={self.num_workers}")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise PlanError(f"environment variable {name}={value!r} is not an integer") from exc


def distributed_world() -> tuple[int, int] | None:
    """Return ``(rank, world_size)`` from torch.distributed if it is initialised, else ``None``."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _env_rank_world() -> tuple[int, int] | None:
    env_rank, env_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if env_rank is None or env_size is None:
        return None
    return env_rank, env_size


def detect_rank_world(
    rank: int | None = None,
    world_size: int | None = None,
    inherited: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Return ``(rank, world_size)`` of this process, detected now.

    In order: explicit ``rank``/``world_size``; torch.distributed when initialised; the
    ``inherited`` world (captured by the process that started this DataLoader worker, for
    workers started with ``spawn`` where torch.distributed is not initialised); torchrun's
    ``RANK``/``WORLD_SIZE`` variables; else a single process ``(0, 1)``.

    Raises:
        PlanError: If the result is not a valid world.
    """
    if rank is not None and world_size is not None:
        detected = (rank, world_size)
    else:
        detected = distributed_world() or inherited or _env_rank_world() or (0, 1)
    rank = detected[0] if rank is None else rank
    world_size = detected[1] if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise PlanError(f"invalid world: {rank=} {world_size=}")
    return rank, world_size


def detect_world(
    rank: int | None = None,
    world_size: int | None = None,
    inherited: tuple[int, int] | None = None,
) -> World:
    """Return this process's :class:`World`, detected now (at iteration time).

    The worker comes from :func:`torch.utils.data.get_worker_info` (inside a DataLoader
    worker), else the process reads alone (``worker=0, num_workers=1``).
    """
    from torch.utils.data import get_worker_info

    rank, world_size = detect_rank_world(rank, world_size, inherited)
    info = get_worker_info()
    if info is None:
        return World(rank, world_size, 0, 1)
    return World(rank, world_size, info.id, info.num_workers)


def local_ranks() -> int:
    """Ranks of this node (``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 when unset or unreadable)."""
    try:
        return max(1, _env_int("LOCAL_WORLD_SIZE") or 1)
    except PlanError:
        return 1
