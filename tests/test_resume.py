"""Stop and resume in one process: StatefulDataLoader, the plain recipe, bytes read, the state."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamload import StreamingDataset
from streamload._errors import PlanError
from tests.helpers.datasets import make_dataset

COUNTS = [13, 0, 21, 8, 17, 5]  # 64 samples
BATCH = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("resume"), COUNTS)


def key_of(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def dataset(root: Path, **kw: Any) -> StreamingDataset:
    return StreamingDataset(
        str(root), shuffle=True, seed=4, batch_size=BATCH, shuffle_window=10, transform=key_of, **kw
    )


def keys(batches: Any) -> list[str]:
    return [k for batch in batches for k in batch]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("steps", [0, 5, 15, 16])  # start, middle, last batch, epoch boundary
def test_stateful_dataloader_resumes_exactly(root: Path, num_workers: int, steps: int) -> None:
    ref_loader = StatefulDataLoader(dataset(root), batch_size=BATCH, num_workers=num_workers)
    reference = keys(ref_loader)
    following = keys(ref_loader)
    assert len(reference) == 64 and reference != following

    loader = StatefulDataLoader(dataset(root), batch_size=BATCH, num_workers=num_workers)
    seen: list[str] = []
    it = iter(loader)
    for _ in range(steps):
        seen += next(it)
    saved = io.BytesIO()
    torch.save(loader.state_dict(), saved)
    del it, loader

    resumed = StatefulDataLoader(dataset(root), batch_size=BATCH, num_workers=num_workers)
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    rest = keys(resumed)
    if steps < 16:
        assert seen + rest == reference, "exactly the unseen samples, in the uninterrupted order"
        assert keys(resumed) == following, "the next epoch is unchanged"
    else:
        assert seen == reference
        assert rest in ([], following)


@pytest.mark.parametrize("shuffle", [False, True])
def test_plain_dataloader_recipe_changes_workers(root: Path, shuffle: bool) -> None:
    ds = StreamingDataset(str(root), shuffle=shuffle, seed=4, batch_size=BATCH, transform=key_of)
    reference = keys(DataLoader(ds, batch_size=BATCH, num_workers=2))
    ds = StreamingDataset(str(root), shuffle=shuffle, seed=4, batch_size=BATCH, transform=key_of)
    seen = []
    for step, batch in enumerate(DataLoader(ds, batch_size=BATCH, num_workers=2)):
        if step == 6:
            break
        seen += batch
    state = json.loads(json.dumps(ds.state_dict(samples_seen=6 * BATCH)))
    assert len(json.dumps(state)) < 400

    ds2 = StreamingDataset(str(root), shuffle=shuffle, seed=4, batch_size=BATCH, transform=key_of)
    ds2.load_state_dict(state)
    rest = keys(DataLoader(ds2, batch_size=BATCH, num_workers=3))
    assert seen + rest == reference
    assert ds2.epoch == 0
    again = keys(DataLoader(ds2, batch_size=BATCH, num_workers=3))
    assert Counter(again) == Counter(reference) and ds2.epoch == 1


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_reads_no_data_of_the_skipped_part(tmp_path: Path, shuffle: bool) -> None:
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    fmt, dest = get_format("tar"), LocalDestination(str(tmp_path))
    payload = bytes(range(256)) * 64  # 16 KB per sample, 40 shards x 20 samples = 12.5 MB
    entries = [
        write_shard(fmt, dest, fmt.shard_name(i), ({"__key__": f"s{i}_{j}", "bin": payload} for j in range(20))).entry
        for i in range(40)
    ]
    publish_manifest(dest, Manifest(format="tar", shards=tuple(entries), fields=("bin",)))

    def read(state: dict[str, Any] | None) -> tuple[int, int]:
        ds = StreamingDataset(str(tmp_path), shuffle=shuffle, seed=2, batch_size=8)
        if state is not None:
            ds.load_state_dict(state)
        before = rchar()
        count = sum(1 for _ in ds)
        return count, rchar() - before

    full_count, full_bytes = read(None)
    assert full_count == 800 and full_bytes >= 800 * len(payload)
    state = StreamingDataset(str(tmp_path), shuffle=shuffle, seed=2, batch_size=8).state_dict(samples_seen=760)
    rest_count, rest_bytes = read(state)
    assert rest_count == 40
    # the 40 unseen samples (640 KB) plus sidecars of the shards they are in; not the 760 seen
    assert 40 * len(payload) <= rest_bytes < 80 * len(payload)


def test_state_dict_is_plain_and_checked(root: Path) -> None:
    ds = dataset(root)
    state = ds.state_dict()
    assert state["epoch"] == 0 and state["samples_seen"] == 0
    assert json.loads(json.dumps(state)) == state
    it = iter(ds)
    for _ in range(6):
        next(it)
    assert ds.state_dict()["samples_seen"] == 6  # num_workers=0: counted in this process
    with pytest.raises(PlanError, match="seed=4"):
        StreamingDataset(str(root), shuffle=True, seed=5, batch_size=BATCH, shuffle_window=10).load_state_dict(state)
    with pytest.raises(PlanError, match="multiple of world_size=2"):
        dataset(root, rank=0, world_size=2).state_dict(samples_seen=3)
    worker_state = {
        **state,
        "samples_seen": None,
        "worker": {"rank": 0, "world_size": 1, "worker": 1, "num_workers": 2, "chunk": 4, "next_item": 8},
    }
    other = dataset(root)
    other.load_state_dict(worker_state)
    with pytest.raises(PlanError, match="num_workers=2"):
        iter(other)


def test_main_process_without_count_refuses_to_guess(root: Path) -> None:
    ds = dataset(root)
    keys(DataLoader(ds, batch_size=BATCH, num_workers=2))
    with pytest.raises(PlanError, match="samples_seen"):
        ds.state_dict()
    assert ds.state_dict(samples_seen=64)["epoch"] == 1


def test_stateful_resume_with_persistent_workers_and_set_epoch(root: Path) -> None:
    def loader() -> StatefulDataLoader[Any]:
        return StatefulDataLoader(dataset(root), batch_size=BATCH, num_workers=2, persistent_workers=True)

    ref = loader()
    epochs = [keys(ref) for _ in range(3)]
    stopped = loader()
    it = iter(stopped)
    seen = [k for _ in range(5) for k in next(it)]
    state = stopped.state_dict()
    del it, stopped

    resumed = loader()
    resumed.load_state_dict(state)
    assert seen + keys(resumed) == epochs[0]
    assert keys(resumed) == epochs[1], "persistent workers advance past the restored epoch"
    again = loader()
    again.load_state_dict(state)
    ds = again.dataset
    assert isinstance(ds, StreamingDataset)
    out = []
    for epoch in range(3):  # the usual loop calling set_epoch
        ds.set_epoch(epoch)
        out.append(keys(again))
    assert [seen + out[0], out[1], out[2]] == epochs
