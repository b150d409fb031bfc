"""Property tests of the pure split planner: exactly once, equal per rank, deterministic.

Expected values are computed here from the arithmetic of docs/design.md ("Epochs and the split": ceil / floor of
N / world_size), never taken from the planner.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from streamload.plan import EpochPlan, Split, Stage, World

Item = tuple[int, int]  # (shard, index within shard)

SETTINGS = settings(max_examples=150, deadline=None)


def all_samples(counts: list[int]) -> Counter[Item]:
    return Counter((s, i) for s, n in enumerate(counts) for i in range(n))


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
    seqs = []
    for rank in range(plan.world_size):
        pairs = read_rank(plan, rank, num_workers, start)
        # the workers of a rank partition its items: each position exactly once
        assert [p for p, _ in pairs] == list(range(start, start + len(pairs)))
        seqs.append([item for _, item in pairs])
    return seqs


counts_st = st.lists(st.integers(0, 25), min_size=0, max_size=8)
split_st = st.builds(
    Split,
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**40),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    window=st.none() | st.integers(1, 40),
    chunk=st.none() | st.integers(1, 9),
)


@SETTINGS
@given(counts=counts_st, world_size=st.integers(1, 7), num_workers=st.integers(1, 4), split=split_st)
def test_exactly_once_equal_per_rank(counts: list[int], world_size: int, num_workers: int, split: Split) -> None:
    plan = EpochPlan(counts, world_size, split)
    n = sum(counts)
    per_rank = n // world_size if split.drop_last else -(-n // world_size)
    seqs = rank_sequences(plan, num_workers)
    assert [len(s) for s in seqs] == [per_rank] * world_size
    assert plan.per_rank == per_rank
    seen = Counter(item for seq in seqs for item in seq)
    expected = all_samples(counts)
    assert set(seen) <= set(expected)  # never a sample outside the shards (empty shards unread)
    if split.drop_last:
        assert max(seen.values(), default=1) == 1
        assert sum(seen.values()) == per_rank * world_size
    else:
        assert set(seen) == set(expected)
        assert sum(seen.values()) - n == per_rank * world_size - n
        if seen:  # the fewest repeats: no sample twice before every sample once
            assert max(seen.values()) - min(seen.values()) <= 1


@SETTINGS
@given(counts=counts_st, world_size=st.integers(1, 5), num_workers=st.integers(1, 3), split=split_st)
def test_deterministic_and_contiguous(counts: list[int], world_size: int, num_workers: int, split: Split) -> None:
    a = rank_sequences(EpochPlan(counts, world_size, split), num_workers)
    b = rank_sequences(EpochPlan(list(counts), world_size, split), num_workers)
    assert a == b
    if not split.shuffle:  # without shuffling every run reads consecutive samples of one shard
        plan = EpochPlan(counts, world_size, split)
        for rank in range(world_size):
            for worker in range(num_workers):
                for run in plan.runs(World(rank, world_size, worker, num_workers)):
                    assert run.contiguous


@SETTINGS
@given(counts=counts_st, world_size=st.integers(1, 5), num_workers=st.integers(1, 3), split=split_st, data=st.data())
def test_resume_same_world_continues_each_rank_order(
    counts: list[int], world_size: int, num_workers: int, split: Split, data: st.DataObject
) -> None:
    plan = EpochPlan(counts, world_size, split)
    start = data.draw(st.integers(0, plan.per_rank))
    full = rank_sequences(plan, 1)
    resumed = rank_sequences(plan, num_workers, start)
    assert resumed == [seq[start:] for seq in full]


@SETTINGS
@given(
    counts=counts_st,
    worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    split=split_st,
    num_workers=st.integers(1, 3),
    data=st.data(),
)
def test_elastic_resume_reads_every_unseen_sample_once(
    counts: list[int], worlds: list[int], split: Split, num_workers: int, data: st.DataObject
) -> None:
    """Interrupt an epoch on worlds[0], resume on worlds[1], maybe again on worlds[2]..."""
    stages: list[Stage] = []
    seen: Counter[Item] = Counter()
    expected_total = 0
    padding = 0  # samples repeated by the resumed stages to keep ranks equal
    plan = EpochPlan(counts, worlds[0], split)
    epoch_items = Counter(item for seq in rank_sequences(plan, 1) for item in seq)
    global_seen = 0
    for world_size in worlds[1:]:
        done = data.draw(st.integers(0, plan.per_rank))  # items each rank consumed
        for seq in rank_sequences(plan, 1):
            seen.update(seq[:done])
        global_seen += done * plan.world_size
        remaining = (plan.per_rank - done) * plan.world_size
        expected_total = -(-remaining // world_size)  # the resumed stage always pads
        padding += expected_total * world_size - remaining
        stages.append(Stage(plan.world_size, global_seen))
        plan = EpochPlan(counts, world_size, split, stages)
        assert plan.per_rank == expected_total
    rest = rank_sequences(plan, num_workers)
    assert [len(seq) for seq in rest] == [expected_total] * plan.world_size
    union = seen + Counter(item for seq in rest for item in seq)
    assert not epoch_items - union  # every sample of the epoch: seen, or read after resuming
    assert sum((union - epoch_items).values()) == padding
