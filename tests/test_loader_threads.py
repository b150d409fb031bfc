"""streamload.Loader: the DataLoader's batches made on threads of the calling process.

Every check compares against a real ``DataLoader`` (0 and 2 worker processes) or a real
``StatefulDataLoader`` over the same dataset: the same keys at every step and
bit-identical tensors with random crops and flips, for 1, 2 and 3 threads; resume at
several points onto other thread counts and onto DataLoaders and back; no child process
and no shared-memory segment; two ranks over gloo; a corrupt sample skipped; a bucket on
a real S3 server (SeaweedFS), cached and streamed.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamload import ConfigError, Loader, StorageConfig, Stream, StreamingDataset
from streamload.decode import DecodeBatch
from tests.helpers.datasets import make_dataset

BATCH = 8
COUNTS = [13, 0, 21, 8, 17, 5, 19]  # 83 samples: the last global batch is padded


class KeysAndImages:
    """Collate: the batch's keys beside its decoded images (random crops and flips)."""

    def __init__(self) -> None:
        self.decode = DecodeBatch(16, crop="random", flip=True)

    def __call__(self, samples: list[dict[str, Any]]) -> tuple[list[str], Any]:
        return [s["__key__"] for s in samples], self.decode(samples)


def key_of(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


class Keys:
    """Collate: the batch's keys (no decoding: the cheap way to follow the order)."""

    def __call__(self, samples: list[dict[str, Any]]) -> list[str]:
        return [str(s["__key__"]) for s in samples]


@pytest.fixture(scope="module")
def keys_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("loader-keys"), COUNTS)


def images(root: Path, **kw: Any) -> StreamingDataset:
    return StreamingDataset(
        str(root), shuffle=True, seed=5, batch_size=BATCH, shuffle_window=24, collate=KeysAndImages(), **kw
    )


def keyed(root: Path | str, **kw: Any) -> StreamingDataset:
    return StreamingDataset(str(root), shuffle=True, seed=5, batch_size=BATCH, shuffle_window=10, collate=Keys(), **kw)


def plain(batches: Any) -> list[tuple[list[str], torch.Tensor, torch.Tensor]]:
    """``[keys, ImageBatch]`` batches as (keys, images, labels), copied out of recycled buffers."""
    return [(list(k), b.images.clone(), b.labels.clone()) for k, b in batches]


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def reference(tar_dataset: Path) -> list[Any]:
    """The DataLoader's batches with 0 workers, checked equal to those with 2 workers."""
    zero = plain(DataLoader(images(tar_dataset), batch_size=None, num_workers=0))
    two = plain(DataLoader(images(tar_dataset), batch_size=None, num_workers=2))
    assert same(zero, two)
    assert len(zero) == len(images(tar_dataset)) == 17  # 129 samples, batches of 8, padded
    return zero


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_dataloaders_batches_bit_for_bit(tar_dataset: Path, reference: list[Any], threads: int) -> None:
    loader = Loader(images(tar_dataset), threads=threads)
    got = plain(loader)
    assert same(got, reference)
    assert len(loader) == len(reference)
    assert [t.name for t in threading.enumerate() if t.name.startswith("streamload-loader")] == []


def test_set_epoch_and_the_next_epochs(keys_root: Path) -> None:
    ds = keyed(keys_root)
    ds.set_epoch(3)
    ref = list(DataLoader(ds, batch_size=None, num_workers=0))
    ref_next = list(DataLoader(ds, batch_size=None, num_workers=0))
    mine = keyed(keys_root)
    loader = Loader(mine, threads=3)
    loader.set_epoch(3)
    assert list(loader) == ref
    assert list(loader) == ref_next  # the next iteration is the next epoch
    assert ref != ref_next


def test_a_mixture_with_an_epoch_size(keys_root: Path, tmp_path: Path) -> None:
    other = make_dataset(tmp_path / "b", [7, 12])
    streams = [Stream(str(keys_root), weight=0.7, name="a"), Stream(str(other), weight=0.3, name="b")]

    def mixed() -> StreamingDataset:
        return StreamingDataset(
            streams, epoch_size=50, shuffle=True, seed=2, batch_size=BATCH, shuffle_window=10, collate=Keys()
        )

    ref = list(DataLoader(mixed(), batch_size=None, num_workers=2))
    assert list(Loader(mixed(), threads=3)) == ref
    assert sum(len(b) for b in ref) == 56


def test_without_a_collate_batches_like_dataloader_batch_size(keys_root: Path) -> None:
    def ds() -> StreamingDataset:
        return StreamingDataset(
            str(keys_root), shuffle=True, seed=1, batch_size=BATCH, transform=lambda s: s["__key__"]
        )

    assert list(Loader(ds(), threads=2)) == list(DataLoader(ds(), batch_size=BATCH))


@pytest.mark.parametrize(("steps", "threads"), [(0, 3), (4, 1), (5, 3), (10, 2)])
def test_resume_onto_other_thread_counts_and_a_dataloader(keys_root: Path, steps: int, threads: int) -> None:
    ref = list(DataLoader(keyed(keys_root), batch_size=None, num_workers=0))
    assert len(ref) == 11
    loader = Loader(keyed(keys_root), threads=2)
    running = iter(loader)
    for _ in range(steps):
        next(running)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["samples_seen"] == steps * BATCH

    resumed = Loader(keyed(keys_root), threads=threads)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert list(resumed) == ref[steps:]
    ds = keyed(keys_root)
    ds.load_state_dict(state)
    assert list(DataLoader(ds, batch_size=None, num_workers=2)) == ref[steps:]


def test_a_finished_epoch_resumes_at_the_next(keys_root: Path) -> None:
    ds = keyed(keys_root)
    epochs = [list(DataLoader(ds, batch_size=None)) for _ in range(2)]
    loader = Loader(keyed(keys_root), threads=2)
    assert list(loader) == epochs[0]
    state = loader.state_dict()
    assert (state["epoch"], state["samples_seen"]) == (1, 0)
    again = Loader(keyed(keys_root), threads=3)
    again.load_state_dict(state)
    assert list(again) == epochs[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_dataloaders_state_resumes_on_threads(keys_root: Path, num_workers: int) -> None:
    ref = list(DataLoader(keyed(keys_root), batch_size=None))
    stateful = StatefulDataLoader(keyed(keys_root), batch_size=None, num_workers=num_workers)
    for step, _ in enumerate(stateful, 1):
        if step == 6:
            break
    loader = Loader(keyed(keys_root), threads=3)
    loader.load_state_dict(stateful.state_dict())
    assert list(loader) == ref[6:]


def test_no_child_process_and_no_shared_memory(tar_dataset: Path, reference: list[Any]) -> None:
    import psutil

    def shm() -> set[str]:
        maps = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/dev/shm/" in line}
        fds = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                fds.add(target)
        entries = {name for name in os.listdir("/dev/shm") if str(os.getpid()) in name}
        return maps | fds | entries

    loader = Loader(images(tar_dataset), threads=2)
    before = shm()
    children = {p.pid for p in psutil.Process().children(recursive=True)}  # servers of other tests
    seen = []
    for batch in loader:
        seen.append(batch)
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
        assert shm() <= before
    assert same(plain(seen), reference)


def test_loader_and_dataloader_on_one_dataset_at_once(keys_root: Path) -> None:
    ds = keyed(keys_root)
    running = iter(Loader(ds, threads=2))
    next(running)
    with pytest.raises(ConfigError, match="streamload.Loader"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=0)))
    with pytest.raises(ConfigError, match="streamload.Loader"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=1)))
    del running  # the Loader's iteration ends: the dataset is free again
    reading = iter(DataLoader(ds, batch_size=None, num_workers=0))
    next(reading)
    with pytest.raises(ConfigError, match="DataLoader"):
        next(iter(Loader(ds, threads=1)))
    del reading
    assert len(list(Loader(ds, threads=1))) == 11


def test_thread_readers_is_the_loaders_public_seam(keys_root: Path) -> None:
    ds = keyed(keys_root)
    expected = list(Loader(keyed(keys_root), threads=2))
    iteration = ds.thread_readers(2)
    assert len(iteration.readers) == 2 and iteration.chunk_size == BATCH and iteration.world.num_workers == 1
    with pytest.raises(ConfigError, match="streamload.Loader"):  # registered: no DataLoader meanwhile
        next(iter(DataLoader(ds, batch_size=None, num_workers=0)))
    first, second = (list(reader) for reader in iteration.readers)
    turns = [b for pair in zip(first, second, strict=False) for b in pair] + first[len(second) :]
    assert turns == expected  # the readers' batches taken in turn: the Loader's (and the DataLoader's)
    iteration.progress.next_item += 3 * iteration.chunk_size  # the caller consumed three batches
    assert ds.state_dict(samples_seen=3 * BATCH)["samples_seen"] == iteration.state(3 * BATCH)["samples_seen"]
    iteration.leave()
    iteration.leave()  # once
    assert len(list(DataLoader(ds, batch_size=None, num_workers=0))) == len(expected)


def test_a_loaded_state_is_the_loaders_until_it_iterates(keys_root: Path) -> None:
    ds = keyed(keys_root)
    assert ds.loaded_state() is None
    state = ds.state_dict(samples_seen=4 * BATCH)
    ds.load_state_dict(state)
    assert ds.loaded_state() == state
    next(iter(Loader(ds, threads=1)))
    assert ds.loaded_state() is None


@pytest.mark.parametrize("threads", [0, -1, 1.5])
def test_threads_below_one_is_a_config_error(keys_root: Path, threads: Any) -> None:
    with pytest.raises(ConfigError, match="threads"):
        Loader(keyed(keys_root), threads=threads)


def test_a_dataset_without_batch_size_is_a_config_error(keys_root: Path) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        Loader(StreamingDataset(str(keys_root)), threads=2)


def test_a_corrupt_sample_is_skipped_and_counted(tar_dataset: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    shutil.copytree(tar_dataset, root)
    shard = root / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[3 * 512 + 100] ^= 0x01  # shard 1's first image
    shard.write_bytes(bytes(data))

    def ds() -> StreamingDataset:
        return images(root, on_error="skip")

    ref_ds = ds()
    ref = plain(DataLoader(ref_ds, batch_size=None, num_workers=2))
    mine = ds()
    got = plain(Loader(mine, threads=2))
    assert same(got, ref)
    assert mine.skipped_samples == ref_ds.skipped_samples == 1
    assert list(mine.errors.shards) == ["shard-000001.tar"]


def test_device_copy_on_the_background_thread(tar_dataset: Path, reference: list[Any]) -> None:
    got = plain(Loader(images(tar_dataset), threads=2, device="cpu", pin_memory=True))
    assert same(got, reference)


@pytest.mark.parametrize("cache", ["shards", "none"])
def test_a_bucket_on_s3(s3_server: Any, keys_root: Path, tmp_path: Path, cache: str) -> None:
    import fsspec

    options = s3_server.storage_options()
    bucket = s3_server.make_bucket()
    fs = fsspec.filesystem("s3", **options)
    for path in sorted(keys_root.iterdir()):
        fs.put_file(str(path), f"{bucket}/ds/{path.name}")
    storage = StorageConfig(storage_options=options, cache_dir=str(tmp_path / "cache"), cache=cache)  # type: ignore[arg-type]
    got = list(Loader(keyed(f"s3://{bucket}/ds", storage=storage), threads=2))
    assert got == list(DataLoader(keyed(keys_root), batch_size=None))
    cached = list((tmp_path / "cache").rglob("data/shard-*.tar"))
    assert (len(cached) > 0) == (cache == "shards")


def _rank(rank: int, root: str, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        steps = []
        for keys in Loader(keyed(root), threads=2):
            total = torch.tensor([len(keys)])
            dist.all_reduce(total)  # a step per batch: unequal counts would hang
            steps.append(keys)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, steps)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def test_two_ranks_read_each_sample_once(keys_root: Path, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "out.json"
    mp.start_processes(_rank, args=(str(keys_root), str(tmp_path / "store"), str(out)), nprocs=2, start_method="spawn")
    ranks = json.loads(out.read_text())
    assert len(ranks[0]) == len(ranks[1])
    # One rank with batch 16 takes the same global batches: rank 0's half, then rank 1's.
    one = StreamingDataset(
        str(keys_root), shuffle=True, seed=5, batch_size=2 * BATCH, shuffle_window=10, collate=Keys()
    )
    whole = list(DataLoader(one, batch_size=None))
    assert [a + b for a, b in zip(ranks[0], ranks[1], strict=True)] == whole
    seen = Counter(k for rank in ranks for batch in rank for k in batch)
    expected = {f"s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n)}
    assert set(seen) == expected
    assert sum(seen.values()) - len(expected) < 2 * BATCH  # padding: fewer than one global batch


def test_lightning_data_module_on_threads(tar_dataset: Path) -> None:
    from streamload.lightning import StreamingDataModule

    dm = StreamingDataModule(
        str(tar_dataset), batch_size=BATCH, num_workers=2, collate=KeysAndImages(), seed=5, loader="threads"
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, Loader) and loader.threads == 2
    keys = [k for k, _ in loader]
    dm.datasets["train"].set_epoch(0)
    assert keys == [k for k, _ in DataLoader(dm.datasets["train"], batch_size=None)]
    with pytest.raises(ConfigError, match="threads"):
        StreamingDataModule(str(tar_dataset), num_workers=0, loader="threads")
