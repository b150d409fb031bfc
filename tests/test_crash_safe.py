"""Conversion survives SIGKILL and Ctrl-C: nothing complete-looking is left, --resume finishes
the job byte-identically to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamload import ConfigError
from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder

ARGS = ["--samples-per-shard", "3", "--no-progress", "--shuffle", "--seed", "3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("imgs")
    make_image_folder(str(root), num_classes=3, per_class=40, size=(48, 40), seed=4)
    return root


@pytest.fixture(scope="module")
def reference(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("ref")
    assert main(["convert", str(folder), str(out), *ARGS]) == 0
    return _files(out)


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def _start(folder: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    code = "import sys; from streamload.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, "convert", str(folder), str(out), *ARGS, "--workers", "2", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # A test process may ignore SIGINT (pytest-xdist's workers do) and children inherit
        # that: give the converter the terminal's default, as a user's shell does.
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_shards(out: Path, count: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and len(list(out.glob("shard-*.tar"))) >= count:
            return
        if proc.poll() is not None:
            return
        time.sleep(0.002)
    raise AssertionError("converter made no progress")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_shards", [0, 3, 20])
def test_sigkill_then_resume_is_byte_identical(
    folder: Path, reference: dict[str, bytes], tmp_path: Path, after_shards: int
) -> None:
    out = tmp_path / "out"
    proc = _start(folder, out)
    if after_shards:
        _wait_for_shards(out, after_shards, proc)
    else:
        time.sleep(0.3)  # during start-up/scanning
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # Nothing complete-looking: no manifest after a kill.
    assert not (out / "index.json").exists() or proc.returncode == 0
    assert main(["convert", str(folder), str(out), *ARGS, "--resume"]) == 0
    assert _files(out) == reference


@pytest.mark.timeout(120)
def test_ctrl_c_stops_cleanly_and_says_how_to_resume(folder: Path, reference: dict[str, bytes], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _start(folder, out)
    _wait_for_shards(out, 4, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.fail("conversion finished before the interrupt; make the input larger")
    assert proc.returncode == 130, err
    assert b"--resume" in err and b"interrupted" in err
    assert not (out / "index.json").exists()
    assert main(["convert", str(folder), str(out), *ARGS, "--resume"]) == 0
    assert _files(out) == reference
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp-", ".streamload-tmp-", "_"))]


def test_resume_rewrites_a_tampered_shard(folder: Path, reference: dict[str, bytes], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _start(folder, out)
    _wait_for_shards(out, 6, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    shard = sorted(out.glob("shard-*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[600] ^= 0x55
    shard.write_bytes(bytes(data))
    assert main(["convert", str(folder), str(out), *ARGS, "--resume"]) == 0
    assert _files(out) == reference


def test_refuses_to_mix_runs(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _start(folder, out)
    _wait_for_shards(out, 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    if (out / "index.json").exists():
        pytest.skip("conversion finished before the kill")
    # Without --resume: refuses and names the way out.
    with pytest.raises(ConfigError, match="--resume"):
        convert(ImageFolderSource(str(folder)), str(out), ConvertOptions(samples_per_shard=3, progress=False))
    # Different options cannot resume the interrupted job.
    with pytest.raises(ConfigError, match="another source, other options"):
        convert(
            ImageFolderSource(str(folder)), str(out), ConvertOptions(samples_per_shard=5, progress=False, resume=True)
        )


def test_existing_dataset_needs_overwrite(folder: Path, reference: dict[str, bytes], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["convert", str(folder), str(out), *ARGS]) == 0
    assert main(["convert", str(folder), str(out), *ARGS]) == 2
    assert main(["convert", str(folder), str(out), *ARGS, "--overwrite"]) == 0
    assert _files(out) == reference
    assert not [n for n in os.listdir(out) if n.startswith("_")]


# -- into a bucket -------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_sigkill_into_a_bucket_then_resume_is_identical(
    folder: Path, reference: dict[str, bytes], s3_server, tmp_path: Path
) -> None:
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/ds"
    options = [
        "-o",
        f"key={s3_server.key}",
        "-o",
        f"secret={s3_server.secret}",
        "-o",
        f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
    ]
    fs = s3_server.filesystem()
    code = "import sys; from streamload.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "convert", str(folder), url, *ARGS, "--workers", "2", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        fs.invalidate_cache()
        if len(fs.glob(f"{bucket}/ds/shard-*.tar")) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    fs.invalidate_cache()
    if proc.returncode != -signal.SIGKILL:
        pytest.fail(f"conversion ended before the kill ({proc.returncode}); make the input larger")
    assert not fs.exists(f"{bucket}/ds/index.json")
    assert main(["convert", str(folder), url, *ARGS, "--resume", *options]) == 0
    fs.invalidate_cache()
    uploaded = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(f"{bucket}/ds")}
    assert uploaded == reference
