"""Property tests of the pure split planner: exactly once, equal per rank, deterministic.

Expected values are computed here from the arithmetic of docs/design.md ("Epochs and the split": whole global
batches of ``B = world_size * batch``, ``ceil`` / ``floor`` of ``N / B``), never taken from the planner.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from streamload.plan import EpochPlan, Split, World
from streamload.plan.state import EpochState
from tests.helpers.plans import Item, divisors, rank_sequences

SETTINGS = settings(max_examples=150, deadline=None)


def all_samples(counts: list[int]) -> Counter[Item]:
    return Counter((s, i) for s, n in enumerate(counts) for i in range(n))


counts_st = st.lists(st.integers(0, 25), min_size=0, max_size=8)
split_st = st.builds(
    Split,
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**40),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    window=st.none() | st.integers(1, 40),
    batch_size=st.none() | st.integers(1, 9),
)


@SETTINGS
@given(counts=counts_st, world_size=st.integers(1, 7), num_workers=st.integers(1, 4), split=split_st)
def test_exactly_once_equal_per_rank(counts: list[int], world_size: int, num_workers: int, split: Split) -> None:
    plan = EpochPlan(counts, world_size, split)
    n = sum(counts)
    batch = world_size * (split.batch_size or 1)
    per_rank = (n // batch if split.drop_last else -(-n // batch)) * batch // world_size
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


def global_steps(counts: list[int], world_size: int, num_workers: int, split: Split) -> list[list[Item]]:
    """The samples of each global step: every rank's k-th batch of ``split.batch_size``, in rank order."""
    chunk = split.batch_size
    assert chunk is not None
    seqs = rank_sequences(EpochPlan(counts, world_size, split), num_workers)
    steps = len(seqs[0]) // chunk if seqs else 0
    return [[item for seq in seqs for item in seq[k * chunk : (k + 1) * chunk]] for k in range(steps)]


world_split_st = st.builds(
    Split,
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**40),
    shuffle=st.just(True),
    drop_last=st.booleans(),
    window=st.none() | st.integers(1, 40),
    partitions=st.none() | st.integers(1, 12),
)


@SETTINGS
@given(counts=counts_st, batch=st.sampled_from([1, 2, 4, 6, 8, 12]), split=world_split_st, data=st.data())
def test_global_batches_do_not_depend_on_the_world(
    counts: list[int], batch: int, split: Split, data: st.DataObject
) -> None:
    """The same global batch on any world (ranks x workers): the same sequence of global steps."""
    worlds = divisors(batch)
    reference = global_steps(counts, 1, 1, Split(**{**split.__dict__, "batch_size": batch}))
    assert sum(len(step) for step in reference) == (
        (sum(counts) // batch if split.drop_last else -(-sum(counts) // batch)) * batch
    )
    for world_size in data.draw(st.lists(st.sampled_from(worlds), min_size=1, max_size=3)):
        workers = data.draw(st.integers(1, 4))
        chunk = batch // world_size
        assert global_steps(counts, world_size, workers, Split(**{**split.__dict__, "batch_size": chunk})) == reference


@SETTINGS
@given(
    counts=st.lists(st.integers(1, 25), min_size=1, max_size=8),
    batch=st.sampled_from([2, 4, 8, 16]),
    split=world_split_st,
    data=st.data(),
)
def test_resume_on_another_world_continues_the_same_global_batches(
    counts: list[int], batch: int, split: Split, data: st.DataObject
) -> None:
    """Stop after k global batches on one world, continue on another: the rest is the uninterrupted run's."""
    saved_world, resumed_world = (
        data.draw(st.sampled_from(divisors(batch))),
        data.draw(st.sampled_from(divisors(batch))),
    )
    workers = data.draw(st.integers(1, 3))
    reference = global_steps(counts, 1, 1, Split(**{**split.__dict__, "batch_size": batch}))
    k = data.draw(st.integers(0, len(reference)))
    chunk = batch // resumed_world
    plan = EpochPlan(counts, resumed_world, Split(**{**split.__dict__, "batch_size": chunk}))
    state = EpochState(
        split.epoch,
        split.seed,
        True,
        split.drop_last,
        plan.window,
        sum(counts),
        saved_world,
        k * batch,
        batch,
        plan.partitions,
    )
    rests = []
    for rank in range(resumed_world):
        pairs = []
        for worker in range(workers):
            world = World(rank, resumed_world, worker, workers)
            state.check_world(world, plan.global_batch, plan.partitions)
            start, first = state.resume(world, chunk)
            for run in plan.runs(world, start, first):
                pairs += [(int(p), (run.shard, int(i))) for p, i in zip(run.positions, run.locals, strict=True)]
        rests.append([item for _, item in sorted(pairs)])
    steps = [[item for seq in rests for item in seq[j * chunk : (j + 1) * chunk]] for j in range(len(reference) - k)]
    assert steps == reference[k:]


@SETTINGS
@given(
    counts=st.lists(st.integers(1, 30), min_size=1, max_size=10),
    parts=st.sampled_from([1, 2, 4, 8]),
    chunk=st.integers(1, 6),
    seed=st.integers(0, 99),
    data=st.data(),
)
def test_ranks_that_divide_the_partitions_read_only_their_own(
    counts: list[int], parts: int, chunk: int, seed: int, data: st.DataObject
) -> None:
    """Locality: with R dividing P, rank r reads only a contiguous run of the padded sequence (its partitions)."""
    world_size = data.draw(st.sampled_from(divisors(parts)))
    split = Split(seed=seed, shuffle=True, batch_size=chunk, partitions=parts)
    plan = EpochPlan(counts, world_size, split)
    spans = []
    for rank in range(world_size):
        items = plan.rank_items(rank, 0, plan.per_rank)
        spans.append((int(items.min()), int(items.max())) if len(items) else None)
    used = [s for s in spans if s is not None]
    for (_, high), (low, _) in zip(used, used[1:], strict=False):
        assert high < low, f"ranks' item spans overlap: {spans}"
