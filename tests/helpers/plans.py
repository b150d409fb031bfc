"""Reading a pure epoch plan the way the ranks and their workers read it, checked as it is read."""

from __future__ import annotations

from streamload.plan import EpochPlan, World

Item = tuple[int, int]  # (shard, index within shard)


def read_rank(plan: EpochPlan, rank: int, num_workers: int, start: int = 0) -> list[tuple[int, Item]]:
    """(rank-order position, sample) pairs read by all workers of ``rank``, sorted by position."""
    out: list[tuple[int, Item]] = []
    for worker in range(num_workers):
        for run in plan.runs(World(rank, plan.world_size, worker, num_workers), start):
            assert len(run.locals) == len(run.positions) > 0
            out += [(int(p), (run.shard, int(i))) for p, i in zip(run.positions, run.locals, strict=True)]
    out.sort()
    return out


def rank_sequences(plan: EpochPlan, num_workers: int, start: int = 0) -> list[list[Item]]:
    """Every rank's samples in its reading order; each position is read by exactly one worker."""
    seqs = []
    for rank in range(plan.world_size):
        pairs = read_rank(plan, rank, num_workers, start)
        # the workers of a rank partition its items: each position exactly once
        assert [p for p, _ in pairs] == list(range(start, start + len(pairs)))
        seqs.append([item for _, item in pairs])
    return seqs


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
