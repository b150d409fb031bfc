"""A soak: hundreds of short epochs through persistent DataLoader workers leak nothing.

200 epochs of a 40-sample dataset (4 shards), shuffled within one shard's window, 2
persistent workers, ``set_epoch`` every epoch, every fifth iterator abandoned after its
first batch; once from a local directory and once from the S3 server through a cache that
holds 3 of the 4 shards (so it evicts and downloads again all along, ~7 GETs an epoch).
The measures are taken after complete epochs (an abandoned one's workers keep its shards
open until the next epoch starts). At epoch 20 (warm: imports, fsspec's IO thread, the
workers' buffers) and at the end, for the main process and each worker:

* open file descriptors (``/proc/<pid>/fd``) and threads: at most +2;
* resident memory: at most +20 MB;
* shared memory: ``/proc/<pid>/maps`` entries of ``/dev/shm`` and torch's shared files,
  and ``/dev/shm`` entries named after the process: at most +2;

the workers are the same processes throughout, and the cache never holds more than its
limit (checked after every epoch). The numbers measured are printed (``-s``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from streamload import StorageConfig, StreamingDataset
from streamload.storage.cache import ShardCache
from streamload.writer import DatasetWriter
from tests.s3server import SeaweedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SAMPLES = 40
PER_SHARD = 10
EPOCHS = 200
WARM = 20
ABANDON_EVERY = 5
BATCH = 8
MB = 1 << 20


def _write(url: str, **options: Any) -> None:
    with DatasetWriter(url, max_samples=PER_SHARD, **options) as w:
        for i in range(SAMPLES):
            w.write({"__key__": f"k{i:03d}", "bin": bytes([i]) * (4000 + 97 * i), "cls": str(i % 4).encode()})


def _sample(sample: dict[str, Any]) -> tuple[str, torch.Tensor]:
    """A key and a small tensor: the batches cross to the main process through shared memory."""
    return sample["__key__"], torch.frombuffer(bytearray(sample["bin"][:64]), dtype=torch.uint8)


@dataclass
class Usage:
    fds: int
    threads: int
    rss: int
    shm_maps: int
    shm_files: int

    def __str__(self) -> str:
        return (
            f"fds={self.fds} threads={self.threads} rss={self.rss / MB:.1f}MB "
            f"shm_maps={self.shm_maps} shm_files={self.shm_files}"
        )


def _usage(pid: int) -> Usage:
    proc = psutil.Process(pid)
    with open(f"/proc/{pid}/maps") as f:
        shm_maps = sum(1 for line in f if "/dev/shm/" in line or "torch_" in line)
    try:
        shm_files = sum(1 for name in os.listdir("/dev/shm") if str(pid) in name)
    except FileNotFoundError:
        shm_files = 0
    return Usage(len(os.listdir(f"/proc/{pid}/fd")), proc.num_threads(), proc.memory_info().rss, shm_maps, shm_files)


def _settled(pid: int) -> Usage:
    """The process's usage once its thread count has settled (read-ahead threads exit when idle)."""
    last = _usage(pid)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _usage(pid)
        if now.threads == last.threads and now.fds == last.fds:
            return now
        last = now
    return last


def _worker_pids(loader: DataLoader[Any]) -> list[int]:
    it = loader._iterator  # the persistent workers' iterator (torch keeps it between epochs)
    assert it is not None
    pids = sorted(w.pid for w in it._workers)  # type: ignore[attr-defined]
    children = {p.pid for p in psutil.Process().children()}
    assert set(pids) <= children  # they are this process's children, alive
    return pids


def _soak(ds: StreamingDataset, cache_root: Path | None, limit: int | None) -> dict[str, tuple[Usage, Usage]]:
    loader = DataLoader(
        ds, batch_size=BATCH, num_workers=2, persistent_workers=True, multiprocessing_context="fork", timeout=60
    )
    cache = ShardCache(str(cache_root), limit) if cache_root is not None else None
    expected = Counter(f"k{i:03d}" for i in range(SAMPLES))
    warm: dict[str, Usage] = {}
    pids: list[int] = []
    started = time.monotonic()
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        keys: list[str] = []
        for keys_batch, _tensor in loader:
            keys.extend(keys_batch)
            if epoch % ABANDON_EVERY == 2:
                break  # abandon the iterator after its first batch
        if epoch % ABANDON_EVERY == 2:
            assert len(keys) == BATCH
        else:
            assert Counter(keys) == expected, epoch
        if cache is not None:
            assert limit is not None and cache.usage() <= limit, (epoch, cache.usage(), limit)
        if epoch == WARM:
            pids = _worker_pids(loader)
            warm = {"main": _settled(os.getpid())} | {f"worker{i}": _settled(p) for i, p in enumerate(pids)}
    assert _worker_pids(loader) == pids  # the same persistent workers all along
    end = {"main": _settled(os.getpid())} | {f"worker{i}": _settled(p) for i, p in enumerate(pids)}
    print(f"\n{EPOCHS} epochs in {time.monotonic() - started:.1f} s ({ds.source})")
    for name in warm:
        print(f"  {name:8s} epoch {WARM}: {warm[name]}\n  {'':8s} epoch {EPOCHS}: {end[name]}")
    del loader
    return {name: (warm[name], end[name]) for name in warm}


def _check_flat(usage: dict[str, tuple[Usage, Usage]]) -> None:
    for name, (warm, end) in usage.items():
        # Growth only: in a long test session the main process may close others' leftovers meanwhile.
        assert end.fds <= warm.fds + 2, (name, str(warm), str(end))
        assert end.threads <= warm.threads + 2, (name, str(warm), str(end))
        assert end.rss - warm.rss <= 20 * MB, (name, str(warm), str(end))
        assert end.shm_maps <= warm.shm_maps + 2, (name, str(warm), str(end))
        assert end.shm_files <= warm.shm_files + 2, (name, str(warm), str(end))


def test_soak_local(tmp_path: Path) -> None:
    _write(str(tmp_path / "ds"))
    ds = StreamingDataset(str(tmp_path / "ds"), shuffle=True, seed=5, shuffle_window=PER_SHARD, transform=_sample)
    threads = threading.active_count()
    _check_flat(_soak(ds, None, None))
    assert threading.active_count() <= threads + 2


def test_soak_s3_with_eviction(s3_server: SeaweedS3, tmp_path: Path) -> None:
    options = s3_server.storage_options()
    url = f"s3://{s3_server.make_bucket()}/soak"
    _write(url, storage_options=options)
    probe = StreamingDataset(url, storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path / "probe")))
    limit = 3 * probe.manifest.largest_shard_bytes  # 3 of the 4 shards: evicts all along
    cache = tmp_path / "cache"
    ds = StreamingDataset(
        url,
        storage=StorageConfig(storage_options=options, cache_dir=str(cache), cache_limit=limit, cache="shards"),
        shuffle=True,
        seed=5,
        shuffle_window=PER_SHARD,  # the default (the whole dataset here) would reopen a shard per run
        transform=_sample,
    )
    usage = _soak(ds, next(p for p in cache.iterdir() if p.is_dir()), limit)
    _check_flat(usage)
    root = next(p for p in cache.iterdir() if p.is_dir())
    assert os.listdir(root / "tmp") == []  # no download left behind
    assert ShardCache(str(root), limit).readers() == 0 and os.listdir(root / "readers") == []
