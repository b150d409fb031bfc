"""``streamload bench``: a real sweep on a tiny dataset, JSON out, a plot, and a recommendation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamload.bench import BenchResult, PeakMemory, plateau, recommend
from streamload.cli import main


def test_bench_sweeps_workers_and_plots(tar_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "sweep.png"
    code = main(["bench", str(tar_dataset), "--workers", "0,1", "--seconds", "0.3", "--batch-size", "16",
                 "--json", "--plot", str(plot)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    results = out["results"]
    assert [r["workers"] for r in results] == [0, 1]
    for r in results:
        assert r["samples"] > 0 and r["samples_per_s"] > 0 and r["first_batch_s"] > 0
        assert r["peak_pss"] > 10 * 2**20  # at least torch's share of a process
    assert out["recommended"]["workers"] in (0, 1)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_mode_prints_advice(tar_dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tar_dataset), "--mode", "decode", "--size", "32", "--workers", "0",
                 "--seconds", "0.2", "--batch-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "recommended: DataLoader(num_workers=0" in text and "samples/s" in text


def test_bench_bad_worker_list(tar_dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tar_dataset), "--workers", "two"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def _r(workers: int, rate: float, pss: int = 1) -> BenchResult:
    return BenchResult(workers, 2, False, 256, 100, 1.0, rate, 1.0, 0.1, pss)


def test_recommend_and_plateau() -> None:
    results = [_r(0, 100), _r(1, 190), _r(2, 380), _r(4, 390), _r(8, 395)]
    assert recommend(results).workers == 2  # within 5 % of the best, fewest workers
    assert plateau(results) == 2
    assert plateau([_r(0, 100), _r(1, 200)]) is None


def test_peak_memory_sees_an_allocation() -> None:
    with PeakMemory(interval=0.01) as memory:
        before = memory.sample()
        block = bytearray(64 * 2**20)
        block[:: 4096] = b"\x01" * len(block[:: 4096])
        during = memory.sample()
    assert during - before > 48 * 2**20 and memory.peak >= during
