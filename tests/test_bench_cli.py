"""``streamload bench``: a real sweep on a tiny dataset, JSON out, a plot, and a recommendation."""

from __future__ import annotations

import json
import mmap
import time
from pathlib import Path

import pytest

from streamload.bench import BenchResult, PeakMemory, plateau, recommend
from streamload.cli import main
from tests.s3server import SeaweedS3


def test_bench_sweeps_workers_and_plots(tar_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "sweep.png"
    code = main(
        [
            "bench",
            str(tar_dataset),
            "--workers",
            "0,1",
            "--seconds",
            "0.3",
            "--batch-size",
            "16",
            "--json",
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    results = out["results"]
    assert [r["workers"] for r in results] == [0, 1]
    for r in results:
        assert r["samples"] > 0 and r["samples_per_s"] > 0 and r["first_batch_s"] > 0
        assert r["peak_pss"] > 10 * 2**20  # at least torch's share of a process
        assert set(r["stages"]) == {"fetch", "read", "transform", "collate"} and r["stages"]["read"] > 0
    assert out["recommended"]["workers"] in (0, 1)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_mode_prints_advice(tar_dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "bench",
                str(tar_dataset),
                "--mode",
                "decode",
                "--size",
                "32",
                "--workers",
                "0",
                "--seconds",
                "0.2",
                "--batch-size",
                "8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "recommended: DataLoader(num_workers=0" in text and "samples/s" in text
    assert "fetch/read/transform/collate %" in text  # the stage breakdown of each setting
    split = text.split("where its readers' time goes: ")[1].splitlines()[0]
    shares = {name: float(pct) for name, pct in (part.split()[:2] for part in split.split(" (")[0].split(", "))}
    # DecodeBatch decodes in the collate stage (with the native kernel, 32 px images decode about
    # as fast as they are read: the decode is timed there, not lost or charged to transform)
    assert shares["collate"] >= 15 and shares["transform"] == 0, shares
    assert max(shares, key=shares.__getitem__) in ("collate", "read"), shares


def test_bench_bad_worker_list(tar_dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tar_dataset), "--workers", "two"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("x.json", "has the extension .json"),
        ("plot", "has no extension"),
        ("missing/x.png", "does not exist"),
        ("folder.png", "is a folder"),
    ],
)
def test_bench_checks_the_plot_before_measuring(
    tar_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, said: str
) -> None:
    (tmp_path / "folder.png").mkdir()
    code = main(["bench", str(tar_dataset), "--workers", "0", "--seconds", "0.2", "--plot", str(tmp_path / name)])
    out, err = capsys.readouterr()
    assert code == 2
    assert f"--plot {tmp_path / name}" in err and said in err and "Traceback" not in err
    assert "samples/s" not in out  # nothing was measured


def test_bench_over_one_worker_count_claims_no_trend(tar_dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tar_dataset), "--workers", "0", "--seconds", "0.2", "--batch-size", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "still grows" not in out and "stops growing at" not in out
    assert "one num_workers value tried (0)" in out


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
        # A fresh anonymous mapping: new pages whatever the heap already holds (a bytearray may
        # reuse memory malloc kept resident after an earlier test freed it: no growth to see).
        block = mmap.mmap(-1, 64 * 2**20)
        for at in range(0, len(block), 4096):
            block[at] = 1
        during = memory.sample()
        time.sleep(0.05)  # a few samples of the thread while the block is alive
        block.close()
    assert during - before > 48 * 2**20
    assert memory.peak - before > 48 * 2**20  # the sampling thread saw it too


def test_benchmark_rows_smoke(tmp_path: Path) -> None:
    """benchmarks/run.py's row runner on a tiny set: streamload and a peer agree on count and labels."""
    import sys

    from streamload.converters import ConvertOptions, ImageFolderSource, convert
    from streamload.synthetic import make_image_folder

    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(bench_dir))
    try:
        import _data
        import run
    finally:
        sys.path.remove(str(bench_dir))
    folder, tar = tmp_path / "img", tmp_path / "tar"
    make_image_folder(str(folder), num_classes=3, per_class=4, size=(80, 60), seed=2)
    convert(ImageFolderSource(str(folder)), str(tar), ConvertOptions(samples_per_shard=5, progress=False))
    paths = {"folder": str(folder), "tar": str(tar)}
    assert _data.histogram(paths) == [4, 4, 4]
    for lib in ("streamload-tar", "imagefolder", "webdataset"):
        for mode in ("bytes", "decode"):
            spec = {"lib": lib, "mode": mode, "workers": 0, "paths": paths, "epochs": 1, "histogram": [4, 4, 4]}
            result = run.run_row(spec)
            # streamload's dataset makes the batches (run.BATCH each, one process): its epoch
            # is padded to whole batches; the peers read the 12 samples once.
            batch = run.BATCH
            samples = -(-12 // batch) * batch if lib.startswith("streamload") else 12
            assert result["ok"] and result["samples"] == samples, (lib, mode, result)
    limit = run.raw_read_limit(str(tar), 12, repeats=1)
    assert limit["shard_bytes"] == sum(p.stat().st_size for p in tar.glob("*.tar"))


def test_bench_on_s3_dataset(
    tar_dataset: Path,
    s3_server: SeaweedS3,
    s3_bucket: str,
    tmp_path: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    fs = s3_server.filesystem()
    for path in sorted(tar_dataset.iterdir()):
        fs.put_file(str(path), f"{s3_bucket}/ds/{path.name}")
    opts = s3_server.storage_options()
    args = [
        "bench",
        f"s3://{s3_bucket}/ds",
        "--workers",
        "0,1",
        "--seconds",
        "0.3",
        "--batch-size",
        "16",
        "--json",
        "--cache-dir",
        str(tmp_path / "cache"),
        "-o",
        f"key={opts['key']}",
        "-o",
        f"secret={opts['secret']}",
        "-o",
        f"client_kwargs.endpoint_url={opts['client_kwargs']['endpoint_url']}",
        "-o",
        "client_kwargs.region_name=us-east-1",
    ]
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["workers"] for r in results] == [0, 1] and all(r["samples"] > 0 for r in results)


def test_bench_remote_smoke(s3_server: SeaweedS3, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_remote.py --smoke --no-peers: a real server, proxy and rows; every row reads every sample."""
    import sys

    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(bench_dir))
    try:
        import bench_remote
    finally:
        sys.path.remove(str(bench_dir))
    out = tmp_path / "remote.json"
    argv = ["--smoke", "--no-peers", "--images", "60", "--data", str(tmp_path / "data"), "--work", str(tmp_path / "w")]
    assert bench_remote.main([*argv, "--json", str(out)], server=s3_server) == 0
    text = capsys.readouterr().out
    assert "load average at start" in text and "load average at end" in text and "shaped link" in text
    report = json.loads(out.read_text())
    rows, shards = report["rows"], report["data"]["objects"]["streamload"]
    assert shards >= 3 and report["data"]["images"] == 60
    assert {(r["mode"], r["source"], r["cache"]) for r in rows} >= {
        (mode, source, cache) for mode in ("bytes", "decode") for source, cache in (("local", "-"), ("bucket", "cold"))
    }
    for r in rows:
        # Rows whose streamload dataset makes the batches (batch_size=) read their epoch
        # padded to whole batches; per-sample rows (DataLoader batching) read the 60 once.
        padded = r["loader"] == "streamload" and not r["variant"].endswith("samples")
        samples = -(-60 // r["batch"]) * r["batch"] if padded else 60
        assert r["ok"] and r["samples"] == samples and r["samples_per_s"] > 0 and r["first_batch_s"] > 0, r
        if r["cache"] == "cold":  # every shard and its sidecar fetched (ranged GETs: maybe more than one each)
            assert r["gets_per_shard"] >= 2, r
        if r["cache"] == "warm":  # only index.json: the shards come from the cache
            assert r["gets_per_shard"] * shards <= 1, r
        if r["source"] == "bucket":
            assert r["x_local"] > 0
