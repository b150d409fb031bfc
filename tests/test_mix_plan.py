"""Property tests of mixtures against the pure planner: counts, subsets, interleave, ranks, resume.

Expected values come from the rules of docs/mixing.md (largest remainder over exact
fractions; whole passes plus an at-most-once subset; ceil / floor of N / world_size),
computed here independently of the planner.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from streamload._errors import ConfigError, PlanError
from streamload.plan import EpochPlan, MixLayout, Split, World, epoch_counts, mixture
from streamload.plan.state import EpochState
from tests.helpers.plans import divisors, rank_sequences

SETTINGS = settings(max_examples=120, deadline=None)

Item = tuple[int, int]


@st.composite
def mixtures(draw: st.DrawFn, max_streams: int = 4) -> tuple[list[list[int]], list[int]]:
    """Streams' shard counts and their per-epoch counts (0 for an empty stream)."""
    shards = draw(st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=5), min_size=1, max_size=max_streams))
    counts = [draw(st.integers(0, 3 * sum(k) + 5)) if sum(k) else 0 for k in shards]
    return shards, counts


split_st = st.builds(
    Split,
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**40),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    window=st.none() | st.integers(1, 40),
    batch_size=st.none() | st.integers(1, 9),
)


def flat_counts(shards: list[list[int]]) -> list[int]:
    return [c for k in shards for c in k]


def epoch_items(layout: MixLayout) -> list[Item]:
    if layout.total == 0:
        return []
    s, i = layout.locate(np.arange(layout.total))
    return list(zip(s.tolist(), i.tolist(), strict=True))


def stream_of(layout: MixLayout, shard: int) -> int:
    return int(np.searchsorted(layout.offsets, shard, side="right") - 1)


# -- counts --------------------------------------------------------------------------


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 10**6), min_size=1, max_size=6),
    data=st.data(),
    epoch_size=st.none() | st.integers(0, 10**7),
)
def test_weights_share_the_epoch_exactly(sizes: list[int], data: st.DataObject, epoch_size: int | None) -> None:
    weights = data.draw(st.lists(st.floats(0, 100), min_size=len(sizes), max_size=len(sizes)))
    assume(sum(weights) > 0)
    none = [None] * len(sizes)
    counts = epoch_counts(sizes, weights=weights, repeats=none, samples=none, epoch_size=epoch_size)
    total = sum(sizes) if epoch_size is None else epoch_size
    assert sum(counts) == total
    exact = [Fraction(total) * Fraction(w) / sum(Fraction(x) for x in weights) for w in weights]
    for count, target in zip(counts, exact, strict=True):
        assert math.floor(target) <= count <= math.ceil(target)
    # largest remainder: every stream rounded up has a remainder at least as large as any rounded down
    ups = [t - math.floor(t) for c, t in zip(counts, exact, strict=True) if c > t]
    downs = [t - math.floor(t) for c, t in zip(counts, exact, strict=True) if c < t]
    assert not ups or not downs or min(ups) >= max(downs)


@SETTINGS
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=5), data=st.data())
def test_repeats_and_samples_round_each_target(sizes: list[int], data: st.DataObject) -> None:
    kinds = data.draw(
        st.lists(st.sampled_from(["repeat", "samples", "none"]), min_size=len(sizes), max_size=len(sizes))
    )
    repeats = [data.draw(st.floats(0, 5)) if k == "repeat" else None for k in kinds]
    samples = [data.draw(st.integers(0, 5000)) if k == "samples" else None for k in kinds]
    counts = epoch_counts(sizes, weights=[None] * len(sizes), repeats=repeats, samples=samples)
    targets = [
        Fraction(c) if c is not None else n * Fraction(1 if r is None else r)
        for n, r, c in zip(sizes, repeats, samples, strict=True)
    ]
    assert sum(counts) == math.floor(sum(targets) + Fraction(1, 2))
    for count, target in zip(counts, targets, strict=True):
        assert math.floor(target) <= count <= math.ceil(target)
    for count, c in zip(counts, samples, strict=True):
        if c is not None:
            assert count == c


def test_count_examples_and_errors() -> None:
    none = [None, None]
    assert epoch_counts([10, 10], weights=[0.7, 0.3], repeats=none, samples=none, epoch_size=None) == [14, 6]
    assert epoch_counts([3, 10], weights=none, repeats=[2.5, None], samples=[None, 4]) == [8, 4]
    assert epoch_counts([3, 10, 7], weights=[1, 1, 1], repeats=[None] * 3, samples=[None] * 3, epoch_size=100) == [
        34,
        33,
        33,
    ]
    # repeat/samples with epoch_size: proportions scaled to it
    assert epoch_counts([100, 100], weights=none, repeats=[1, None], samples=[None, 300], epoch_size=8) == [2, 6]
    with pytest.raises(ConfigError, match="every stream has a weight"):
        epoch_counts([1, 1], weights=[1, None], repeats=none, samples=none)
    with pytest.raises(ConfigError, match="at most one"):
        epoch_counts([1], weights=[1], repeats=[2], samples=[None])
    with pytest.raises(ConfigError, match="all zero"):
        epoch_counts([1, 1], weights=[0, 0], repeats=none, samples=none)
    with pytest.raises(ConfigError, match="empty"):
        epoch_counts([0, 5], weights=[1, 1], repeats=none, samples=none)
    with pytest.raises(ConfigError, match="epoch_size"):
        epoch_counts([5], weights=[None], repeats=[None], samples=[None], epoch_size=-1)


# -- which samples -------------------------------------------------------------------


@SETTINGS
@given(mix=mixtures(), split=split_st)
def test_exact_counts_whole_passes_and_at_most_once_subsets(
    mix: tuple[list[list[int]], list[int]], split: Split
) -> None:
    shards, counts = mix
    layout = MixLayout(shards, counts, split)
    items = epoch_items(layout)
    assert len(items) == sum(counts) == layout.total
    per_stream = Counter(stream_of(layout, s) for s, _ in items)
    assert [per_stream[s] for s in range(len(shards))] == counts
    seen = Counter(items)
    for s, (k, count) in enumerate(zip(shards, counts, strict=True)):
        n = sum(k)
        if not n:
            continue
        base = int(layout.offsets[s])
        mine = {(base + j, i): seen[base + j, i] for j in range(len(k)) for i in range(k[j])}
        assert sum(mine.values()) == count and set(seen) >= {x for x, v in mine.items() if v}
        passes, rest = divmod(count, n)
        times = Counter(mine.values())
        assert set(times) <= {passes, passes + 1}, "whole passes, then each sample of the subset once more"
        assert times[passes + 1] == rest if passes + 1 in times else rest == 0
    assert all(0 <= i < flat_counts(shards)[s] for s, i in items), "never a sample outside its shard"


@settings(max_examples=60, deadline=None)
@given(mix=mixtures(), split=split_st)
def test_large_shards_use_a_lazy_bijection_with_the_same_guarantees(
    mix: tuple[list[list[int]], list[int]], split: Split
) -> None:
    """Shards above SORTED_SUBSET_LIMIT get a Feistel bijection instead of a sorted subset."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mixture, "SORTED_SUBSET_LIMIT", 0)
        test_exact_counts_whole_passes_and_at_most_once_subsets.hypothesis.inner_test(mix, split)  # type: ignore[attr-defined]


def test_feistel_is_a_bijection() -> None:
    for size in (1, 2, 3, 7, 64, 65, 1000, 4099):
        image = mixture.feistel_permute(np.arange(size), size, [11, 22, 33, 44])
        assert sorted(image.tolist()) == list(range(size))
    assert mixture.feistel_permute(np.arange(50), 50, [1, 2, 3, 4]).tolist() != list(range(50))


@SETTINGS
@given(mix=mixtures(), split=split_st, world_size=st.integers(1, 5), num_workers=st.integers(1, 3))
def test_equal_per_rank_and_every_item_once_plus_padding(
    mix: tuple[list[list[int]], list[int]], split: Split, world_size: int, num_workers: int
) -> None:
    shards, counts = mix
    layout = MixLayout(shards, counts, split)
    plan = EpochPlan(flat_counts(shards), world_size, split, layout=layout)
    n = layout.total
    batch = world_size * (split.batch_size or 1)
    per_rank = (n // batch if split.drop_last else -(-n // batch)) * batch // world_size
    seqs = rank_sequences(plan, num_workers)
    assert [len(s) for s in seqs] == [per_rank] * world_size
    union = Counter(item for seq in seqs for item in seq)
    epoch = Counter(epoch_items(layout))
    if split.drop_last:
        assert not union - epoch
    else:
        assert not epoch - union
        assert sum((union - epoch).values()) == per_rank * world_size - n


@SETTINGS
@given(mix=mixtures(), split=split_st, world_size=st.integers(1, 4))
def test_deterministic_by_seed(mix: tuple[list[list[int]], list[int]], split: Split, world_size: int) -> None:
    shards, counts = mix

    def order(sp: Split) -> list[list[Item]]:
        return rank_sequences(EpochPlan(flat_counts(shards), world_size, sp, layout=MixLayout(shards, counts, sp)), 2)

    assert order(split) == order(Split(**{**split.__dict__}))


@SETTINGS
@given(
    k=st.lists(st.integers(20, 40), min_size=2, max_size=4),
    seed=st.integers(0, 2**40),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_subsampled_stream_reads_another_subset_each_epoch(
    k: list[int], seed: int, shuffle: bool, data: st.DataObject
) -> None:
    n = sum(k)
    count = data.draw(st.integers(n // 4, 3 * n // 4))  # C(n, count) > 10**8: equal subsets never happen
    subsets = []
    for epoch in range(3):
        layout = MixLayout([k], [count], Split(epoch=epoch, seed=seed, shuffle=shuffle))
        items = epoch_items(layout)
        assert len(set(items)) == count
        subsets.append(frozenset(items))
    assert len(set(subsets)) == 3
    again = MixLayout([k], [count], Split(epoch=1, seed=seed, shuffle=shuffle))
    assert frozenset(epoch_items(again)) == subsets[1]


# -- the interleave ------------------------------------------------------------------


@SETTINGS
@given(counts=st.lists(st.integers(0, 60), min_size=1, max_size=7), seed=st.integers(0, 99))
def test_interleave_keeps_every_prefix_in_proportion(counts: list[int], seed: int) -> None:
    shards = [[c] for c in counts]
    layout = MixLayout(shards, counts, Split(seed=seed))
    total = sum(counts)
    assume(total > 0)
    streams, within = layout.interleave(np.arange(total))
    live = sum(1 for c in counts if c)
    bound = 0.5 * max(1, math.ceil(math.log2(live))) if live > 1 else 0.0
    seen = np.zeros(len(counts), dtype=np.int64)
    for p, (s, t) in enumerate(zip(streams.tolist(), within.tolist(), strict=True)):
        assert t == seen[s], "each stream's items come in order"
        seen[s] += 1
        length = p + 1
        for x, c in enumerate(counts):
            assert abs(seen[x] - length * c / total) <= bound + 1e-9
    assert seen.tolist() == counts


def test_two_streams_interleave_exactly() -> None:
    layout = MixLayout([[7], [3]], [7, 3], Split())
    streams, _ = layout.interleave(np.arange(20))
    assert "".join("ab"[s] for s in streams.tolist()) == "abaaabaaba" * 2


def test_mixture_batches_follow_the_weights() -> None:
    """No shuffle: every batch of 10 from a 70/30 mixture holds 7 and 3, on every rank."""
    layout = MixLayout([[100] * 7, [50] * 6], [700, 300], Split())
    plan = EpochPlan([100] * 7 + [50] * 6, 2, Split(batch_size=10), layout=layout)
    for seq in rank_sequences(plan, 3):
        for b in range(0, len(seq), 10):
            assert sum(1 for s, _ in seq[b : b + 10] if s >= 7) == 3


# -- resume --------------------------------------------------------------------------


@SETTINGS
@given(mix=mixtures(3), split=split_st, world_size=st.integers(1, 4), num_workers=st.integers(1, 3), data=st.data())
def test_resume_same_world_continues_each_rank_order(
    mix: tuple[list[list[int]], list[int]], split: Split, world_size: int, num_workers: int, data: st.DataObject
) -> None:
    shards, counts = mix
    plan = EpochPlan(flat_counts(shards), world_size, split, layout=MixLayout(shards, counts, split))
    start = data.draw(st.integers(0, plan.per_rank))
    full = rank_sequences(plan, 1)
    again = EpochPlan(flat_counts(shards), world_size, split, layout=MixLayout(shards, counts, split))
    assert rank_sequences(again, num_workers, start) == [seq[start:] for seq in full]


@SETTINGS
@given(mix=mixtures(3), batch=st.sampled_from([2, 4, 6]), seed=st.integers(0, 2**40), data=st.data())
def test_a_mixture_has_the_same_global_batches_on_any_world(
    mix: tuple[list[list[int]], list[int]], batch: int, seed: int, data: st.DataObject
) -> None:
    shards, counts = mix
    flat = flat_counts(shards)

    def steps(world_size: int, workers: int) -> list[list[Item]]:
        split = Split(seed=seed, shuffle=True, batch_size=batch // world_size)
        seqs = rank_sequences(EpochPlan(flat, world_size, split, layout=MixLayout(shards, counts, split)), workers)
        chunk = batch // world_size
        n = len(seqs[0]) // chunk
        return [[item for seq in seqs for item in seq[k * chunk : (k + 1) * chunk]] for k in range(n)]

    reference = steps(1, 1)
    world_size = data.draw(st.sampled_from(divisors(batch)))
    assert steps(world_size, data.draw(st.integers(1, 3))) == reference


def test_state_carries_and_checks_the_mixture() -> None:
    state = EpochState(0, 1, True, False, 8, 30, 2, 10, 2, 2, mixture="abc")
    raw = state.to_dict()
    assert raw["mixture"] == "abc" and EpochState.from_dict(raw) == state
    assert "mixture" not in EpochState(0, 1, True, False, 8, 30, 2, 10, 2, 2).to_dict()
    with pytest.raises(PlanError, match="mixture"):
        state.check_dataset(seed=1, shuffle=True, drop_last=False, window=8, num_samples=30, mixture="abd")
    with pytest.raises(PlanError, match="mixture"):
        EpochState.from_dict({**raw, "mixture": 5})
    assert state.normalized().mixture == "abc"


def test_empty_and_invalid_mixtures() -> None:
    layout = MixLayout([[0], [3]], [0, 0], Split())
    assert layout.total == 0 and EpochPlan([0, 3], 2, Split(), layout=layout).per_rank == 0
    with pytest.raises(PlanError, match="empty"):
        MixLayout([[0]], [4], Split())
    with pytest.raises(PlanError):
        MixLayout([[3]], [1, 2], Split())


def test_planner_memory_is_per_shard_not_per_sample() -> None:
    """10 streams x 100 shards x 10**6 samples per shard, upsampled 1.5x: nothing is O(samples)."""
    import tracemalloc

    shards = [[10**6] * 100 for _ in range(10)]
    counts = [150 * 10**6] * 10
    tracemalloc.start()
    layout = MixLayout(shards, counts, Split(shuffle=True, seed=3))
    plan = EpochPlan(flat_counts(shards), 64, Split(shuffle=True, seed=3, batch_size=256), layout=layout)
    runs = plan.runs(World(5, 64, 1, 8))
    for _ in range(50):
        next(runs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert layout.total == 1_500_000_000
    assert peak < 64 * 2**20, f"{peak / 2**20:.1f} MB"


@SETTINGS
@given(
    counts=st.lists(st.integers(1, 10**13), min_size=2, max_size=9),
    data=st.data(),
)
def test_interleave_of_huge_epochs_is_exact(counts: list[int], data: st.DataObject) -> None:
    """Epochs beyond 2e9 samples use a float estimate corrected in int64: equal to exact integer arithmetic."""
    total = sum(counts)
    positions = np.array(data.draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=50)), dtype=np.int64)
    positions = np.concatenate([positions, [0, total - 1]])
    layout = MixLayout([[c] for c in counts], counts, Split())
    fast = layout.interleave(positions)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mixture, "_FLOAT_SAFE", 0)  # exact Python integers
        exact = layout.interleave(positions)
    assert fast[0].tolist() == exact[0].tolist() and fast[1].tolist() == exact[1].tolist()
    assert all(0 <= t < counts[s] for s, t in zip(*(x.tolist() for x in exact), strict=True))
