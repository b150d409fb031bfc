"""Resource hygiene: no file handle, thread or temporary file outlives an iterator,
an epoch, or a dead worker."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from streamload import StreamingDataset


def _fds(under: Path | None = None) -> int:
    """Open file descriptors of this process (only those on files under ``under`` if given)."""
    if under is None:
        return len(os.listdir("/proc/self/fd"))
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(str(under))
    return count


def _tmp_files(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if p.name.startswith((".tmp", "tmp"))]


class _WorkerFds:
    """Transform returning how many shard files the worker process has open."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, sample: dict) -> int:
        return _fds(self.root)


def test_early_close_releases_every_handle(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), shuffle=True)
    list(ds)  # warm imports
    before_fds, before_threads = _fds(tar_dataset), threading.active_count()
    for _ in range(20):
        it = iter(ds)
        for _, _sample in zip(range(17), it, strict=False):  # stop inside the second shard
            pass
        it.close()  # type: ignore[attr-defined]
    assert _fds(tar_dataset) == before_fds == 0
    assert threading.active_count() == before_threads


def test_abandoned_iterator_is_collected(tar_dataset: Path) -> None:
    import gc

    ds = StreamingDataset(str(tar_dataset))
    for _ in range(10):
        it = iter(ds)
        next(it)
        assert _fds(tar_dataset) == 1
        del it
    gc.collect()
    assert _fds(tar_dataset) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [True, False])
def test_many_short_epochs_leak_nothing(tar_dataset: Path, persistent: bool) -> None:
    ds = StreamingDataset(str(tar_dataset), transform=_WorkerFds(tar_dataset))
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
    worker_fd_counts = []
    for _epoch in range(12):
        worker_fd_counts.append(max(list(loader)))
    # Inside workers: shard files open at once stay bounded by the reader cache (8 shards),
    # and nothing accumulates epoch after epoch.
    assert max(worker_fd_counts) <= 8, worker_fd_counts
    assert worker_fd_counts[-1] <= worker_fd_counts[0], worker_fd_counts
    del loader
    assert _fds(tar_dataset) == 0
    assert not _tmp_files(tar_dataset)


@pytest.mark.timeout(120)
def test_a_killed_worker_fails_loudly_and_leaves_nothing(tar_dataset: Path) -> None:
    def die_once(sample: dict) -> dict:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None and info.id == 1 and sample["__key__"].endswith("img_000005"):
            os.kill(os.getpid(), signal.SIGKILL)
        return sample

    ds = StreamingDataset(str(tar_dataset), transform=die_once)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    with pytest.raises(RuntimeError, match="(?i)worker.*(killed|exited)"):
        list(loader)
    del loader
    assert _fds(tar_dataset) == 0
    assert not _tmp_files(tar_dataset)
    # and a fresh loader over the same dataset still reads everything
    assert len(list(DataLoader(StreamingDataset(str(tar_dataset)), batch_size=None, num_workers=2))) == len(ds)
