"""``watch`` sees the GIL: a thread Loader beside a loop that runs Python is named as such.

A loader whose readers are threads shares the GIL with the training loop. Beside a loop
that runs Python without pause (eager op dispatch looks like that to the GIL), each time a
reader lets go of the GIL for a C call it waits up to the switch interval to get it back.
The verdict must name the GIL, the side that waits and what to do, and never tell the user
to speed up the model.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import streamload
from streamload import StreamingDataset, watch
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DecodeBatch
from streamload.synthetic import make_image_folder
from streamload.watch_report import DataReport, verdict


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    make_image_folder(str(folder), num_classes=2, per_class=48, size=(320, 240), seed=3)
    out = tmp_path_factory.mktemp("photos-ds")
    convert(ImageFolderSource(str(folder)), str(out), ConvertOptions(samples_per_shard=32, progress=False))
    return out


def _busy(seconds: float) -> int:
    """Pure Python for ``seconds``: what an eager training step's dispatch is to the GIL."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        for _ in range(200):
            n += 1
    return n


def test_a_loop_running_python_beside_loader_threads_is_told_about_the_gil(photos: Path) -> None:
    ds = StreamingDataset(str(photos), batch_size=8, collate=DecodeBatch(64, crop="random", native=False))
    watched = watch(streamload.Loader(ds, threads=1))
    for _epoch in range(2):
        for _ in watched:
            _busy(0.04)
    report = watched.report()
    assert report.gil_busy is not None and report.gil_busy >= 0.25  # the probe waited ~ a switch interval
    # (the median is reported; on a loaded machine fewer than half the probes may wait, so it
    # can be small: the share that waited is what the verdict reads)
    assert report.gil_wait_p50_ms is not None and report.gil_wait_p50_ms >= 0.0
    assert "GIL" in report.verdict and "speed up the model" not in report.verdict
    assert "num_workers" in report.verdict and "native kernel" in report.verdict
    assert "GIL: taking it back took" in str(report)


def test_a_loop_that_waits_without_python_is_not_told_about_the_gil(photos: Path) -> None:
    # A step that leaves the GIL free (a device sync, a sleep): no contention, the usual verdict.
    ds = StreamingDataset(str(photos), batch_size=8, collate=DecodeBatch(64, crop="random"))
    watched = watch(streamload.Loader(ds, threads=1))
    for _epoch in range(2):
        for _ in watched:
            time.sleep(0.04)
    report = watched.report()
    assert report.gil_busy is not None and report.gil_busy < 0.25
    assert "GIL" not in report.verdict


def test_a_dataloader_is_not_probed(photos: Path) -> None:
    from torch.utils.data import DataLoader

    ds = StreamingDataset(str(photos), batch_size=8, collate=DecodeBatch(64))
    watched = watch(DataLoader(ds, batch_size=None, num_workers=0))
    for _ in watched:
        pass
    assert watched.report().gil_busy is None


def _report(wait_fraction: float, gil_busy: float | None, loop_cpu: float | None) -> DataReport:
    return DataReport(
        steps=100,
        first_batch_s=1.0,
        wall_s=50.0,
        wait_s=50.0 * wait_fraction,
        wait_fraction=wait_fraction,
        wait_p50_ms=1.0,
        wait_p95_ms=3.0,
        wait_p99_ms=4.0,
        stages={"fetch": 0.1, "read": 1.0, "transform": 0.0, "collate": 40.0},
        readers=16,
        busy_fraction=0.9,
        settings={"num_workers": None, "threads": 16, "collate": "DecodeBatch", "cpus": 16},
        gil_wait_p50_ms=4.8 if gil_busy else 0.05,
        gil_busy=gil_busy,
        loop_cpu_share=loop_cpu,
    )


def test_the_verdict_of_a_loop_held_back_by_the_gil() -> None:
    # The GPU node's case: 16 threads, the loop hardly waits for data (1.3 %) yet runs at 0.39 of its pace.
    text = verdict(_report(0.013, gil_busy=0.9, loop_cpu=0.4))
    assert "GIL" in text and "speed up the model" not in text and "Not input-bound" not in text
    assert "the loader's 16 threads hold" in text and "fewer threads" in text
    # The loader's side waiting: the loop's own Python holds the GIL.
    text = verdict(_report(0.6, gil_busy=0.95, loop_cpu=0.97))
    assert text.startswith("Input-bound on the GIL") and "the loop's own Python holds" in text
    assert "DataLoader(num_workers=...)" in text and "native kernel" in text


def test_no_gil_verdict_without_contention_or_when_the_loop_ran_all_along() -> None:
    assert "GIL" not in verdict(_report(0.01, gil_busy=0.1, loop_cpu=0.4))
    assert "GIL" not in verdict(_report(0.01, gil_busy=None, loop_cpu=None))
    # The loop ran Python all along and hardly waited: its own step sets the pace.
    assert verdict(_report(0.01, gil_busy=0.95, loop_cpu=0.98)).startswith("Not input-bound")
