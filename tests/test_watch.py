"""``streamload.watch``: the loop's waits and the readers' stage times, measured in real loops.

Input-bound and compute-bound loops over a real DataLoader, stage times from worker
processes, a real Lightning ``Trainer`` whose logger receives the figures, and two gloo
ranks of which the slow one is named.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import streamload
from streamload import DataReport, StorageConfig, StreamingDataset, watch
from tests.s3server import SeaweedS3

SLOW = 0.004  # seconds per sample of the slow transform


def slow_transform(sample: dict[str, Any]) -> str:
    """A per-sample transform that takes SLOW seconds (sleeping, so the machine's load does not matter)."""
    time.sleep(SLOW)
    return str(sample["__key__"])


def keys(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def _input_bound(tar_dataset: Path, workers: int) -> tuple[DataReport, int]:
    ds = StreamingDataset(str(tar_dataset), transform=slow_transform, batch_size=8)
    watched = watch(DataLoader(ds, batch_size=8, num_workers=workers))
    samples = sum(len(batch) for batch in watched)  # no work per step: the loop only waits
    return watched.report(), samples


def test_input_bound_loop_blames_the_transform(tar_dataset: Path, tmp_path: Path) -> None:
    report, samples = _input_bound(tar_dataset, workers=1)
    assert report.steps == -(-samples // 8) and report.first_batch_s is not None and report.first_batch_s > 0
    assert report.wait_fraction > 0.8
    assert report.wait_p50_ms > 0 and report.wait_p50_ms <= report.wait_p95_ms <= report.wait_p99_ms
    assert max(report.stages, key=report.stages.__getitem__) == "transform"
    assert report.stage_shares["transform"] > 0.5
    # the sampled clock counts about every sample's sleep (one in 16 timed, counted as 16)
    assert 0.5 * samples * SLOW < report.stages["transform"] < 3 * samples * SLOW
    assert report.verdict.startswith("Input-bound") and "transform" in report.verdict
    assert "num_workers" in report.verdict  # the knob, with the setting it has now
    text = str(report)
    assert "transform" in text and "%" in text and "verdict: Input-bound" in text
    assert [line.split()[0] for line in text.splitlines()[3:7]] == ["fetch", "read", "transform", "collate"]
    png = tmp_path / "report.png"
    report.plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compute_bound_loop_is_not_input_bound(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), transform=keys, batch_size=16)
    watched = watch(DataLoader(ds, batch_size=16, num_workers=1))
    for _ in watched:
        time.sleep(0.1)  # the "model step": the worker has the next batches ready long before
    report = watched.report()
    assert report.wait_fraction < 0.2  # (under 5 % on a quiet machine: the hand-over of each batch)
    assert not report.verdict.startswith("Input-bound") and "input-bound" in report.verdict
    bound, _ = _input_bound(tar_dataset, workers=0)
    assert bound.wait_fraction > 0.8
    assert bound.verdict.startswith("Input-bound") and bound.verdict != report.verdict
    assert "num_workers" in bound.verdict  # reading in the main process: workers are the knob


def test_stage_times_arrive_from_two_workers(tar_dataset: Path) -> None:
    report, samples = _input_bound(tar_dataset, workers=2)
    assert report.readers == 2  # both workers' rows of the shared table were written
    assert 0.5 * samples * SLOW < report.stages["transform"] < 3 * samples * SLOW
    assert report.stages["fetch"] > 0  # the workers opened shards
    assert report.settings["num_workers"] == 2


@pytest.mark.parametrize("cache", ["shards", "none"])
def test_fetch_stage_counts_the_bytes_from_a_bucket(
    tar_dataset: Path, s3_server: SeaweedS3, s3_bucket: str, tmp_path: Path, cache: str
) -> None:
    fs = s3_server.filesystem()
    for path in sorted(tar_dataset.iterdir()):
        fs.put_file(str(path), f"{s3_bucket}/fetch-{cache}/{path.name}")
    storage = StorageConfig(storage_options=s3_server.storage_options(), cache_dir=tmp_path, cache=cache)  # type: ignore[arg-type]
    ds = StreamingDataset(f"s3://{s3_bucket}/fetch-{cache}", transform=keys, batch_size=16, storage=storage)
    watched = watch(DataLoader(ds, batch_size=16, num_workers=1))
    assert sum(len(b) for b in watched) >= 129
    report = watched.report()
    # downloads (cached) or ranged GETs (streamed) are fetch time; a local dataset's opens take next to none
    assert report.stages["fetch"] > 0.01 and report.settings["remote"] is True
    assert report.readers == 1


class ThreadLoader:
    """A loader whose readers are threads of the main process: each thread iterates the dataset into a queue."""

    def __init__(self, dataset: StreamingDataset, threads: int) -> None:
        self.dataset = dataset
        self.threads = threads

    def __iter__(self) -> Any:
        import queue
        import threading

        out: queue.Queue[Any] = queue.Queue(maxsize=4)

        def read() -> None:
            for item in self.dataset:
                out.put(item)
            out.put(None)

        workers = [threading.Thread(target=read) for _ in range(self.threads)]
        for t in workers:
            t.start()
        done = 0
        while done < self.threads:
            item = out.get()
            if item is None:
                done += 1
            else:
                yield item
        for t in workers:
            t.join()


def test_stage_times_arrive_from_reader_threads(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), transform=slow_transform)
    watched = watch(ThreadLoader(ds, threads=2))
    samples = sum(1 for _ in watched)
    report = watched.report()
    assert samples == 2 * 129 and report.readers == 2  # a row per reading thread, no shared memory
    assert report.settings["num_workers"] is None
    assert 0.5 * samples * SLOW < report.stages["transform"] < 3 * samples * SLOW
    assert report.verdict.startswith("Input-bound") and "reading threads" in report.verdict


def test_report_since_a_mark_and_unwatched_loaders(tar_dataset: Path) -> None:
    ds = StreamingDataset(str(tar_dataset), transform=keys, batch_size=8)
    watched = watch(DataLoader(ds, batch_size=8, num_workers=0))
    it = iter(watched)
    for _ in range(3):
        next(it)
    mark = watched.mark()
    for _ in it:
        pass
    after = watched.report(since=mark)
    whole = watched.report()
    assert after.steps == whole.steps - 3 and after.first_batch_s is None
    assert 0 < after.wall_s < whole.wall_s
    assert set(after.metrics()) >= {"data/wait_fraction", "data/wait_p95_ms", "data/share_read"}
    plain = watch([1, 2, 3])  # any iterable: the waits, no stages
    assert list(plain) == [1, 2, 3]
    assert plain.report().readers == 0 and plain.report().steps == 3
    assert DataReport.from_dict(whole.to_dict()).stages == whole.stages


def test_attach_times_a_twin_and_leaves_the_loader_as_it_was(tar_dataset: Path) -> None:
    from streamload.watching import attached_watch

    ds = StreamingDataset(str(tar_dataset), transform=keys, batch_size=8)
    dl = DataLoader(ds, batch_size=8, num_workers=0)
    collate = dl.collate_fn
    watched = watch(dl, attach=True)
    assert type(dl) is DataLoader and dl.collate_fn is collate  # the user's loader: not changed
    assert attached_watch(dl) is None and "streamload" not in repr(vars(dl))
    twin = watched.loader
    assert twin is not dl and isinstance(twin, DataLoader) and type(twin).__name__ == "DataLoader"
    assert twin.dataset is ds and twin.batch_size == 8 and len(twin) == len(dl)
    assert watch(twin, attach=True) is watched and attached_watch(twin) is watched
    keys_from_dl = [k for batch in dl for k in batch]  # the loader itself: untimed
    assert watched.report().steps == 0
    keys_from_twin = [k for batch in twin for k in batch]  # as a framework iterates what it was given
    assert keys_from_twin == keys_from_dl
    assert watched.report().steps == len(dl) and watched.report().readers == 1


def test_lightning_logger_receives_the_figures(tar_dataset: Path, tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    from streamload.lightning import DataWatchCallback, StreamingDataModule

    class Collect(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.metrics: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "collect"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.metrics.append((step, dict(metrics)))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (self.weight - float(len(batch))) ** 2

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    logger = Collect()
    dm = StreamingDataModule(str(tar_dataset), batch_size=8, transform=slow_transform)
    trainer = pl.Trainer(
        max_steps=6,
        logger=logger,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )
    trainer.fit(Tiny(), datamodule=dm)
    assert any(isinstance(cb, DataWatchCallback) for cb in trainer.callbacks)  # type: ignore[attr-defined]
    logged = [(step, m) for step, m in logger.metrics if "data/wait_fraction" in m]
    assert [step for step, _ in logged] == [2, 4, 6]
    for _, metrics in logged:
        assert metrics["data/wait_fraction"] > 0.5  # the loop only waits on the slow transform
        assert metrics["data/wait_p95_ms"] > 0
        assert metrics["data/share_transform"] > 0.5
    assert isinstance(trainer.train_dataloader, DataLoader)  # watched, and still the loader Lightning made
    assert dm.watch is not None and dm.watch.report().steps == 6


def _rank_main(rank: int, world: int, root: str, out: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        transform = slow_transform if rank == 1 else keys  # rank 1's input pipeline is the slow one
        ds = StreamingDataset(root, transform=transform, batch_size=8, rank=rank, world_size=world)
        watched = watch(DataLoader(ds, batch_size=8))
        for _ in watched:
            dist.all_reduce(torch.ones(1))  # the step's gradient all-reduce: rank 0 waits here, not on data
        report = watched.report(all_ranks=True)
        Path(out, f"rank{rank}.json").write_text(json.dumps(report.to_dict()))
        if rank == 0:
            Path(out, "table.txt").write_text(str(report))
    finally:
        dist.destroy_process_group()


def test_all_ranks_name_the_slowest(tar_dataset: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the ranks start at once (no fresh interpreters importing torch); gloo is not yet initialised here
    torch.multiprocessing.start_processes(
        _rank_main, args=(2, str(tar_dataset), str(tmp_path), port), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        report = DataReport.from_dict(json.loads((tmp_path / f"rank{rank}.json").read_text()))
        assert report.rank == rank and report.slowest_rank == 1
        assert report.ranks is not None and [r.rank for r in report.ranks] == [0, 1]
        assert report.ranks[1].wait_fraction > report.ranks[0].wait_fraction
        assert report.verdict.startswith("Rank 1 is the slowest")
    assert "<- slowest" in (tmp_path / "table.txt").read_text()


def test_watch_is_exported() -> None:
    assert streamload.watch is watch and "watch" in streamload.__all__ and "DataReport" in streamload.__all__
