"""The same training on any cluster shape: global batches and augmentations independent of the world.

* torchrun (gloo) jobs of 1, 2 and 4 ranks, each with 0 and 2 DataLoader workers, record
  every global step's keys and a hash of every decoded tensor (DecodeBatch's random crop
  and flip): identical across all of them, epoch 0 and epoch 1; runs stopped at several
  steps on 2 ranks (and on 1) and resumed on 1, 2 and 4 ranks continue with exactly the
  uninterrupted run's steps.
* In this process: a mixture and an ``epoch_size`` dataset keep the property; whatever
  iterated the dataset before (a peek in the main process, abandoned iterators, another
  worker count, persistent or not), every epoch's readers agree on its number and read
  every sample once; a resumed state of another global batch or partition count is refused
  naming both values; a world that straddles partitions is warned about.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from streamload import PlanError, Stream, StreamingDataset, sample_generator, sample_seed
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder
from tests.helpers.datasets import make_dataset
from tests.helpers.torchrun import run_job

WORKER = str(Path(__file__).with_name("ddp_repro_worker.py"))
GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def jpeg_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """90 JPEGs of 40x32 in 8 shards (12 per shard, the last 6): 96 items in 6 global batches of 16."""
    root = tmp_path_factory.mktemp("repro")
    make_image_folder(str(root / "img"), num_classes=3, per_class=30, size=(40, 32), seed=5)
    convert(
        ImageFolderSource(str(root / "img")), str(root / "ds"), ConvertOptions(samples_per_shard=12, progress=False)
    )
    return root / "ds"


def global_steps(ranks: list[Any], pick: Any) -> list[tuple[list[str], list[str]]]:
    """Gather each step's batches of all ranks, in rank order: [(keys, hashes)] per step."""
    per_rank = [pick(results) for results in ranks]
    n = len(per_rank[0])
    assert all(len(steps) == n for steps in per_rank), "every rank takes the same number of steps"
    return [
        ([k for steps in per_rank for k in steps[i][0]], [h for steps in per_rank for h in steps[i][1]])
        for i in range(n)
    ]


@pytest.mark.slow
def test_same_global_batches_and_crops_on_1_2_4_ranks_and_after_resumes(jpeg_dataset: Path, tmp_path: Path) -> None:
    epochs = [{"kind": "epochs", "num_workers": w, "epochs": [0, 1], "persistent": w > 0} for w in (0, 2)]
    stops = [1, 3, 5]
    two = run_job(
        tmp_path,
        "two",
        jpeg_dataset,
        [*epochs, *({"kind": "stop", "num_workers": 2, "steps": k} for k in stops)],
        2,
        worker=WORKER,
        global_batch=GLOBAL_BATCH,
    )
    states = {k: two[0][2 + i]["state"] for i, k in enumerate(stops)}
    assert {k: s["samples_seen"] for k, s in states.items()} == {k: k * GLOBAL_BATCH for k in stops}
    resumes = [{"kind": "resume", "num_workers": w, "state": states[k]} for k in stops for w in (0, 2)]
    one = run_job(
        tmp_path,
        "one",
        jpeg_dataset,
        [*epochs, *resumes, {"kind": "stop", "num_workers": 0, "steps": 2}],
        1,
        worker=WORKER,
        global_batch=GLOBAL_BATCH,
    )
    from_one = {"kind": "resume", "num_workers": 2, "state": one[0][-1]["state"]}
    four = run_job(
        tmp_path, "four", jpeg_dataset, [*epochs, *resumes, from_one], 4, worker=WORKER, global_batch=GLOBAL_BATCH
    )

    reference = {e: global_steps(one, lambda r, e=e: r[0]["epochs"][e]) for e in ("0", "1")}
    assert len(reference["0"]) == 6 and reference["0"] != reference["1"]
    keys = Counter(k for keys, _ in reference["0"] for k in keys)
    assert len(keys) == 90 and sum(keys.values()) == 96  # every sample once, six padding repeats
    for name, job in (("one", one), ("two", two), ("four", four)):
        for task in (0, 1):  # 0 and 2 workers
            for e in ("0", "1"):
                got = global_steps(job, lambda r, t=task, e=e: r[t]["epochs"][e])
                assert got == reference[e], f"{name} ranks, task {task}, epoch {e}: other global batches"
    for name, job in (("one", one), ("four", four)):
        for i, (k, _) in enumerate((k, w) for k in stops for w in (0, 2)):
            rest = global_steps(job, lambda r, i=i: r[2 + i]["rest"])
            assert rest == reference["0"][k:], f"{name}: resumed at step {k} on another world"
    assert global_steps(four, lambda r: r[-1]["rest"]) == reference["0"][2:]


# -- in this process -----------------------------------------------------------------------


def steps_of(ds_for: Any, world_size: int, workers: int) -> list[list[str]]:
    """Global steps of keys, each rank read in this process (``rank=`` given) through a DataLoader."""
    per_rank = []
    for rank in range(world_size):
        ds = ds_for(rank, world_size)
        batches = [list(b) for b in DataLoader(ds, batch_size=None, num_workers=workers)]
        per_rank.append(batches)
    return [[k for batches in per_rank for k in batches[i]] for i in range(len(per_rank[0]))]


def keys_collate(samples: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in samples]


def test_a_mixture_and_an_epoch_size_keep_the_same_global_batches(tmp_path: Path, jpeg_dataset: Path) -> None:
    other = make_dataset(tmp_path / "b", [7, 11, 5])

    def mixture(rank: int, world_size: int) -> StreamingDataset:
        streams = [Stream(str(jpeg_dataset), weight=2), Stream(str(other), weight=1)]
        return StreamingDataset(
            streams, epoch_size=70, shuffle=True, seed=3, batch_size=8 // world_size, collate=keys_collate,
            rank=rank, world_size=world_size,
        )  # fmt: skip

    def subsample(rank: int, world_size: int) -> StreamingDataset:
        return StreamingDataset(
            str(jpeg_dataset), epoch_size=50, shuffle=True, seed=4, batch_size=8 // world_size,
            collate=keys_collate, rank=rank, world_size=world_size,
        )  # fmt: skip

    for make in (mixture, subsample):
        reference = steps_of(make, 1, 0)
        assert steps_of(make, 2, 2) == reference
        assert steps_of(make, 4, 0) == reference


def key_and_epoch(sample: dict[str, Any]) -> tuple[str, int]:
    return str(sample["__key__"]), int(sample["__epoch__"])


def epoch_of(loader: DataLoader[Any]) -> tuple[Counter[str], set[int]]:
    keys: Counter[str] = Counter()
    epochs: set[int] = set()
    for batch_keys, batch_epochs in loader:
        keys.update(batch_keys)
        epochs.update(int(e) for e in batch_epochs)
    return keys, epochs


# persistent workers need workers: (0, True) would be (0, False) again
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True), (4, False), (4, True)])
def test_a_peek_in_the_main_process_does_not_split_the_epoch(tar_dataset: Path, workers: int, persistent: bool) -> None:
    ds = StreamingDataset(str(tar_dataset), shuffle=True, seed=5, transform=key_and_epoch)
    every = Counter(k for k, _ in StreamingDataset(str(tar_dataset), transform=key_and_epoch))
    peeked = next(iter(ds))  # a look at a sample, as a notebook does
    assert peeked[1] == 0
    loader = DataLoader(ds, batch_size=10, num_workers=workers, persistent_workers=persistent)
    seen = []
    for _ in range(3):
        keys, epochs = epoch_of(loader)
        assert keys == every, "every sample exactly once"
        assert len(epochs) == 1, f"the readers of one iteration disagree on its epoch: {epochs}"
        seen.append(epochs.pop())
    assert seen == [1, 2, 3]


def test_abandoned_iterators_and_new_worker_counts_keep_epochs_whole(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), shuffle=True, seed=6, batch_size=8, transform=key_and_epoch)
    every = Counter(k for k, _ in StreamingDataset(str(tar_dataset), transform=key_and_epoch))
    padded = -(-sum(every.values()) // 8) * 8
    seen = []
    for workers in (4, 2, 4, 0, 3):
        loader = DataLoader(ds, batch_size=8, num_workers=workers)
        next(iter(loader))  # an iterator abandoned after one batch
        keys, epochs = epoch_of(loader)
        assert set(keys) == set(every) and sum(keys.values()) == padded
        assert len(epochs) == 1
        seen.append(epochs.pop())
    assert len(set(seen)) == len(seen), f"each new iteration is a new epoch: {seen}"
    ds.set_epoch(7)
    assert epoch_of(DataLoader(ds, batch_size=8, num_workers=2))[1] == {7}


def test_a_state_of_another_global_batch_or_partition_count_reads_the_rest(tar_dataset: Path) -> None:
    def make(world_size: int, batch: int, partitions: int | None = None) -> StreamingDataset:
        return StreamingDataset(
            str(tar_dataset), shuffle=True, seed=1, batch_size=batch, rank=0, world_size=world_size,
            partitions=partitions, transform=key_and_epoch,
        )  # fmt: skip

    state = make(2, 8).state_dict(samples_seen=32)  # global batch 16
    assert (state["global_batch"], state["partitions"]) == (16, 8)
    for other in (make(4, 8), make(4, 4, partitions=4)):  # global batch 32; partitions 4
        other.load_state_dict(state)
        with pytest.warns(UserWarning, match="differs from the uninterrupted run"):
            assert next(iter(other))[1] == 0
    right = make(4, 4)
    right.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same global batch: the exact continuation, no warning
        assert next(iter(right))[1] == 0
    odd = make(4, 8)
    odd.load_state_dict(make(2, 8).state_dict(samples_seen=34))
    with pytest.raises(PlanError, match="whole number of global batches of 16"):
        next(iter(odd))


def test_a_world_that_straddles_partitions_is_warned_once(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), shuffle=True, batch_size=4, rank=0, world_size=3)  # 12 = 8 partitions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(ds)
        list(ds)
    messages = [str(w.message) for w in caught if "partitions" in str(w.message)]
    assert len(messages) == 1 and "world_size=3" in messages[0] and "partitions=8" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(StreamingDataset(str(tar_dataset), shuffle=True, batch_size=2, rank=0, world_size=4))


def test_sample_generator_is_keyed_by_seed_epoch_and_position() -> None:
    a = {"__key__": "x", "__epoch__": 2, "__position__": 17}
    draws = sample_generator(a, seed=3).random(4)
    assert np.array_equal(draws, sample_generator(dict(a), seed=3).random(4))
    for other in ({**a, "__epoch__": 3}, {**a, "__position__": 18}):
        assert not np.array_equal(draws, sample_generator(other, seed=3).random(4))
    assert not np.array_equal(draws, sample_generator(a, seed=4).random(4))
    assert sample_seed(a, 3) == sample_seed(dict(a), 3) != sample_seed(a, 4)
    assert 0 <= sample_seed(a) < 2**63
    with pytest.raises(Exception, match="__epoch__"):
        sample_generator({"__key__": "y"})


def test_loaders_with_the_same_seeded_generator_still_advance_the_epoch(tar_dataset: Path) -> None:
    """A DataLoader re-created each epoch with the same seeded generator: its workers share keys with the last one's."""
    import torch

    ds = StreamingDataset(str(tar_dataset), shuffle=True, seed=2, transform=key_and_epoch)
    every = Counter(k for k, _ in StreamingDataset(str(tar_dataset), transform=key_and_epoch))
    seen = []
    for _ in range(3):
        loader = DataLoader(ds, batch_size=10, num_workers=2, generator=torch.Generator().manual_seed(0))
        keys, epochs = epoch_of(loader)
        assert keys == every and len(epochs) == 1
        seen.append(epochs.pop())
    assert seen == [0, 1, 2]
