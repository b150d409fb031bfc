"""Distributed conversion on real engines: a Dask LocalCluster of worker processes and a local Ray.

One cluster of each per module (2 processes). Checks: shards byte-identical to the local
pool's, a Dask or Ray worker SIGKILLed mid-task (the task runs again, no half shard, no
staging left), resume after the driver is SIGKILLed, and append then read exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from streamload import StreamingDataset
from streamload._errors import SourceError
from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.converters.source import Item
from streamload.synthetic import make_image_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cluster-images")
    make_image_folder(str(root), num_classes=3, per_class=8, size=(24, 20), seed=9)
    return root


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if not p.name.startswith(".")}


def _shards(path: Path) -> dict[str, bytes]:
    return {k: v for k, v in _files(path).items() if k != "index.json"}


OPTS: dict[str, Any] = {"samples_per_shard": 5, "progress": False}


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_dask_and_ray_write_the_local_pools_bytes(
    folder: Path, tmp_path: Path, dask_address: str, ray_local: str, fmt: str
) -> None:
    local = convert(ImageFolderSource(str(folder)), str(tmp_path / "local"), ConvertOptions(format=fmt, **OPTS))
    for name, executor in [("dask", dask_address), ("ray", ray_local)]:
        out = tmp_path / name
        report = convert(
            ImageFolderSource(str(folder)), str(out), ConvertOptions(format=fmt, executor=executor, workers=2, **OPTS)
        )
        assert report.manifest.shards == local.manifest.shards, name
        assert _shards(out) == _shards(tmp_path / "local"), name
        assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "local"))  # no journal, no staging


def test_an_input_error_on_dask_is_raised_once_and_staging_is_cleaned(
    folder: Path, tmp_path: Path, dask_address: str
) -> None:
    broken = tmp_path / "images"
    make_image_folder(str(broken), num_classes=2, per_class=4, size=(16, 16), seed=2)
    (broken / "class_000" / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(SourceError, match="bad.jpg: not a valid image"):
        convert(ImageFolderSource(str(broken)), str(tmp_path / "o"), ConvertOptions(executor=dask_address, **OPTS))
    assert not [n for n in os.listdir(tmp_path / "o") if n.startswith(".streamload-tmp-")]


class KillOnce(ImageFolderSource):
    """Kills the process loading ``victim`` (SIGKILL), once: a marker file remembers it."""

    def __init__(self, root: str, victim: str, marker: str) -> None:
        super().__init__(root)
        self.victim, self.marker = victim, marker

    def load(self, item: Item) -> dict[str, Any]:
        if item.key == self.victim and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().load(item)


def test_a_dask_worker_killed_mid_shard_is_retried_and_the_output_is_identical(
    folder: Path, tmp_path: Path, dask_address: str
) -> None:
    local = convert(ImageFolderSource(str(folder)), str(tmp_path / "local"), ConvertOptions(**OPTS))
    items = ImageFolderSource(str(folder)).scan().items
    victim = items[12].key  # the third sample of shard 2: its staged file is half written
    marker = tmp_path / "killed"
    source = KillOnce(str(folder), victim, str(marker))
    report = convert(source, str(tmp_path / "dask"), ConvertOptions(executor=dask_address, workers=2, **OPTS))
    assert marker.exists()  # a worker did die
    assert report.manifest.shards == local.manifest.shards
    assert sorted(os.listdir(tmp_path / "dask")) == sorted(os.listdir(tmp_path / "local"))  # no leftovers
    assert _shards(tmp_path / "dask") == _shards(tmp_path / "local")


def test_a_ray_worker_killed_mid_shard_is_retried_and_the_output_is_identical(
    folder: Path, tmp_path: Path, ray_local: str
) -> None:
    local = convert(ImageFolderSource(str(folder)), str(tmp_path / "local"), ConvertOptions(**OPTS))
    items = ImageFolderSource(str(folder)).scan().items
    victim = items[12].key  # the third sample of shard 2: its staged file is half written when it dies
    marker = tmp_path / "killed"
    source = KillOnce(str(folder), victim, str(marker))
    report = convert(source, str(tmp_path / "ray"), ConvertOptions(executor=ray_local, workers=2, **OPTS))
    assert marker.exists()
    assert int(marker.read_text()) not in (os.getpid(), 0)  # a Ray worker process died, not this driver
    assert report.manifest.shards == local.manifest.shards  # the task ran again (max_retries) and wrote it all
    assert sorted(os.listdir(tmp_path / "ray")) == sorted(os.listdir(tmp_path / "local"))  # no staging, no journal
    assert _shards(tmp_path / "ray") == _shards(tmp_path / "local")  # byte-identical, no half or duplicate shard
    keys = [s["__key__"] for s in StreamingDataset(str(tmp_path / "ray"))]
    assert Counter(keys) == Counter(i.key for i in items)  # every input exactly once


SLOW_DRIVER = """
import sys, time
from streamload.converters import ConvertOptions, ImageFolderSource, convert

class Slow(ImageFolderSource):
    def load(self, item):
        time.sleep(0.15)
        return super().load(item)

convert(Slow(sys.argv[1]), sys.argv[2], ConvertOptions(samples_per_shard=2, progress=False, executor=sys.argv[3]))
"""


@pytest.mark.parametrize("engine", ["dask", "ray"])
def test_resume_after_the_driver_is_killed(
    folder: Path, tmp_path: Path, dask_address: str, ray_local: str, engine: str
) -> None:
    executor = dask_address if engine == "dask" else "ray"
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if engine == "ray":  # the driver joins the module's Ray instance (RAY_ADDRESS), which outlives it
        import ray

        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-c", SLOW_DRIVER, str(folder), str(out), executor], env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and len([n for n in os.listdir(out) if n.startswith("_done-")]) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the driver finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1.0)  # tasks the dead driver had started finish or are cancelled
    assert not (out / "index.json").exists()
    args = ["convert", str(folder), str(out), "--samples-per-shard", "2", "--no-progress", "--resume"]
    assert main([*args, "--executor", dask_address]) == 0
    convert(ImageFolderSource(str(folder)), str(tmp_path / "ref"), ConvertOptions(samples_per_shard=2, progress=False))
    assert _files(out) == _files(tmp_path / "ref")


def test_append_then_read_exactly_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    make_image_folder(str(first), num_classes=2, per_class=5, size=(16, 16), seed=1)
    make_image_folder(str(second), num_classes=2, per_class=5, size=(16, 16), seed=2)
    for path in second.rglob("*.jpg"):
        path.rename(path.with_name("new-" + path.name))
    out = tmp_path / "ds"
    base = convert(ImageFolderSource(str(first)), str(out), ConvertOptions(**OPTS)).manifest
    old_reader = StreamingDataset(str(out))  # opened on the old manifest
    base_keys = [s["__key__"] for s in old_reader]
    report = convert(ImageFolderSource(str(second)), str(out), ConvertOptions(append=True, **OPTS))
    m = report.manifest
    assert [s.name for s in m.shards[: len(base.shards)]] == [s.name for s in base.shards]
    assert m.shards[len(base.shards)].name == "shard-000002.tar"  # numbering continues
    assert len(m.meta["appends"]) == 1
    assert [s["__key__"] for s in old_reader] == base_keys  # old shards never rewritten
    keys = [s["__key__"] for s in StreamingDataset(str(out))]
    assert Counter(keys) == Counter({k: 1 for k in keys}) and len(keys) == 20 and set(base_keys) <= set(keys)
    # the same inputs again: every key is already there
    assert main(["convert", str(second), str(out), "--append", "--samples-per-shard", "5", "--no-progress"]) == 2
    assert "already in" in capsys.readouterr().err
    assert main(["info", str(out)]) == 0
    assert "appends   1" in capsys.readouterr().out
