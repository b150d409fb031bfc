"""The command line under nonsense: closed pipes, bad numbers, empty paths, ``--out`` into a dataset, odd names.

Every case ends in one line on stderr and a status (2 for an error, 141 for a closed
standard output), never a traceback, and leaves the dataset as it was.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from streamload._units import format_bytes
from streamload.cli import EXIT_CLOSED_OUTPUT, main
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder, synthetic_jpeg
from tests.s3server import SeaweedS3


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 images of 2 classes in a single tar shard."""
    images = tmp_path_factory.mktemp("images")
    make_image_folder(str(images), num_classes=2, per_class=3, size=(16, 16), seed=3)
    out = tmp_path_factory.mktemp("one-shard") / "ds"
    convert(ImageFolderSource(str(images)), str(out), ConvertOptions(samples_per_shard=100, progress=False))
    return out


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default cache of every test is a folder of its own (never ~/.cache)."""
    cache = tmp_path / "default-cache"
    monkeypatch.setenv("STREAMLOAD_CACHE", str(cache))
    return cache


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- a closed standard output --------------------------------------------------------------


def _closed_pipe() -> int:
    """The writing end of a pipe whose reader is gone (as after ``| head -1`` exited)."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_info_into_a_closed_pipe_exits_quietly(one_shard: Path) -> None:
    """``streamload info DS | head -1``: status 141 and nothing on stderr, block-buffered or not."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    write = _closed_pipe()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "streamload.cli", "info", str(one_shard)],
            stdout=write,
            stderr=subprocess.PIPE,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.stderr.decode() == "" and done.returncode == EXIT_CLOSED_OUTPUT


@contextlib.contextmanager
def _closed_stdout() -> Iterator[None]:
    """``sys.stdout`` writes straight into a pipe whose reader is gone (set in the test: capture resets it)."""
    write = _closed_pipe()
    saved = sys.stdout
    sys.stdout = io.TextIOWrapper(io.FileIO(write, "w", closefd=False), write_through=True)
    try:
        yield
    finally:
        sys.stdout = saved
        os.close(write)


@pytest.mark.parametrize(
    "argv",
    [["info", "{ds}"], ["info", "{ds}", "--json"], ["verify", "{ds}"], ["show", "{ds}", "0"], ["info", "--help"]],
)
def test_every_command_ends_quietly_on_a_closed_stdout(
    one_shard: Path, capfd: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with _closed_stdout():
        assert main([a.format(ds=one_shard) for a in argv]) == EXIT_CLOSED_OUTPUT
    assert capfd.readouterr().err == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stdout_is_one_line_on_stderr(one_shard: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``streamload info DS > /dev/full``: status 2 and why, whether the output is buffered or not."""
    for write_through in (False, True):
        full = os.open("/dev/full", os.O_WRONLY)
        saved = sys.stdout
        sys.stdout = io.TextIOWrapper(io.FileIO(full, "w", closefd=False), write_through=write_through)
        try:
            assert main(["info", str(one_shard)]) == 2
        finally:
            sys.stdout = saved
            os.close(full)
        err = capfd.readouterr().err
        assert "No space left on device" in err and err.count("\n") == 1, err


# -- counts in words -----------------------------------------------------------------------


def test_counts_of_one_are_singular(one_shard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "images"
    make_image_folder(str(images), num_classes=1, per_class=1, size=(8, 8))
    assert main(["convert", str(images), str(tmp_path / "one"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    # "161 samples/s" is a rate, not a count of one: only a count standing alone is checked.
    assert not re.search(r"(?<![\d.,])1 samples(?!/s)", out) and "wrote 1 sample in 1 tar shard (" in out
    assert main(["verify", str(one_shard)]) == 0
    assert f"OK: 1 shard, 6 samples checked in {one_shard}" in capsys.readouterr().out
    assert main(["info", str(one_shard)]) == 0
    assert "skipped   0 inputs at conversion" in capsys.readouterr().out
    assert main(["show", str(one_shard), "0"]) == 0
    assert re.search(r"^field     cls +1 byte +label 0", capsys.readouterr().out, re.MULTILINE)


# -- the cache a URL is read through -------------------------------------------------------


def test_info_leaves_no_cache_and_verify_says_where_it_wrote(
    one_shard: Path, s3_server: SeaweedS3, s3_bucket: str, own_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fs = s3_server.filesystem()
    for path in sorted(one_shard.iterdir()):
        fs.put_file(str(path), f"{s3_bucket}/ds/{path.name}")
    url = f"s3://{s3_bucket}/ds"
    assert main(["info", url, *s3_server.cli_options()]) == 0
    out = capsys.readouterr()
    assert "samples   6" in out.out and out.err == ""
    assert not own_cache.exists()  # info reads index.json only, and keeps nothing of it

    assert main(["verify", url, *s3_server.cli_options()]) == 0
    err = capsys.readouterr().err
    (folder,) = [p for p in own_cache.iterdir() if p.name != "keys"]
    inodes = {(p.stat().st_dev, p.stat().st_ino): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    held = sum(inodes.values())
    assert held >= sum(p.stat().st_size for p in one_shard.glob("shard-*"))  # the shard and its sidecar at least
    said = f"streamload verify: {format_bytes(held)} written to the cache {folder} ({format_bytes(held)} there now;"
    assert said in err and "--cache-dir" in err

    assert main(["verify", url, *s3_server.cli_options()]) == 0  # again: the copies are there, nothing written
    assert "0 B written to the cache" in capsys.readouterr().err

    other = own_cache.parent / "other-cache"
    assert main(["show", url, "class_001/img_000000", "--cache-dir", str(other), *s3_server.cli_options()]) == 0
    err = capsys.readouterr().err
    assert "streamload show: " in err and "written to the cache" in err and str(other) in err
    assert not re.search(r": 0 B written", err)  # the shard, its sidecar and the key index
    copy = next(p for p in other.rglob("shard-*.tar") if p.is_file())
    for out in (copy, other / "keys" / "x.jpg"):
        assert main(["show", url, "0", "--cache-dir", str(other), "--out", str(out), *s3_server.cli_options()]) == 2
        assert "lies inside the shard cache of" in capsys.readouterr().err


# -- show --out ----------------------------------------------------------------------------


def test_show_out_never_writes_into_the_dataset(
    one_shard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _files(one_shard)
    shard = next(one_shard.glob("shard-*.tar"))
    (tmp_path / "link").symlink_to(one_shard / "index.json")
    os.link(shard, tmp_path / "hardlink")
    refused = {
        str(one_shard / "index.json"): "lies inside the dataset",
        str(shard): "lies inside the dataset",
        str(one_shard / "new.jpg"): "lies inside the dataset",
        f"{one_shard}/../{one_shard.name}/x.jpg": "lies inside the dataset",
        str(tmp_path / "link"): "lies inside the dataset",
        str(tmp_path / "hardlink"): f"is the dataset's {shard.name}",
        str(tmp_path): "is a directory",
        str(tmp_path / "missing" / "x.jpg"): "cannot write --out",
    }
    if os.path.exists("/dev/full"):
        refused["/dev/full"] = "No space left on device"
    for out, why in refused.items():
        assert main(["show", str(one_shard), "0", "--out", out]) == 2, out
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, (out, err)
    assert _files(one_shard) == before
    assert main(["show", str(one_shard), "0", "--out", str(tmp_path / "ok.jpg")]) == 0
    assert (tmp_path / "ok.jpg").read_bytes()[:2] == b"\xff\xd8"


# -- numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seconds", "nan"], "--seconds nan must be a positive, finite number"),
        (["--seconds", "inf"], "--seconds inf must be"),
        (["--seconds", "-1"], "--seconds -1 must be"),
        (["--seconds", "0"], "--seconds 0 must be"),
        (["--workers", "-1"], "--workers -1 must be between 0 and"),
        (["--workers", "100000"], "--workers 100000 must be between 0 and"),
        (["--workers", ","], "--workers ',' names no value"),
        (["--prefetch", "0"], "--prefetch 0 must be between 1 and 64"),
        (["--batch-size", "0"], "--batch-size 0 must be between 1 and 65536"),
        (["--batch-size", "1000000000"], "--batch-size 1000000000 must be between"),
        (["--size", "0", "--mode", "decode"], "--size 0 must be between 1 and 8192"),
        (["--size", "8192", "--mode", "decode", "--batch-size", "65536"], "more than half of this machine's memory"),
    ],
)
def test_bench_refuses_bad_numbers_before_starting(
    one_shard: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # servers of other tests
    assert main(["bench", str(one_shard), *args]) == 2
    out = capsys.readouterr()
    assert message in out.err and out.err.count("\n") == 1 and out.out == "", out
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no worker started, none left


def test_bench_rate_is_not_a_division_by_nothing(one_shard: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The steady rate leaves out the first batch; the shortest time still times real batches."""
    argv = ["bench", str(one_shard), "--workers", "0", "--seconds", "1e-9", "--batch-size", "6", "--json"]
    assert main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["samples"] >= 6 and result["samples_per_s"] < 1e7


def test_demo_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    cases = {
        ("--dir", str(a_file)): "is not a directory",
        ("--images", "-1"): "--images -1 must be between 10",
        ("--images", "9"): "--images 9 must be between 10",
        ("--workers", "-1"): "--workers -1 must be between 0 and",
    }
    for args, message in cases.items():
        assert main(["demo", "--dir", str(tmp_path / "work"), *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (args, err)
    assert not (tmp_path / "work").exists()
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize(
    "argv", [["info", ""], ["verify", ""], ["show", "", "0"], ["bench", ""], ["demo", "--dir", ""]]
)
def test_an_empty_path_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"streamload {argv[0]}: error: ") and "an empty path names no file or folder" in err, err


# -- names that look alike -----------------------------------------------------------------


def test_info_escapes_invisible_characters_and_marks_normalization_twins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    nfc, nfd = "caf\u00e9", unicodedata.normalize("NFD", "caf\u00e9")
    images = tmp_path / "images"
    rng = np.random.default_rng(0)
    for name in (nfc, nfd, "a\u200bb", "dog"):
        (images / name).mkdir(parents=True)
        (images / name / "x.jpg").write_bytes(synthetic_jpeg(rng, 8, 8))
    ds = tmp_path / "ds"
    convert(ImageFolderSource(str(images)), str(ds), ConvertOptions(progress=False))
    assert main(["info", str(ds)]) == 0
    out = capsys.readouterr().out
    assert "\u200b" not in out and "a\\u200bb" in out
    assert f"{nfc} [NFC twin]" in out and f"{nfd} [NFD twin]" in out
    assert "2 class names look identical to another" in out
    label = json.loads((ds / "index.json").read_text())["classes"].index(nfd)
    assert main(["show", str(ds), str(label)]) == 0  # one image per class, in class order
    assert f"label {label} ({nfd} [NFD twin])" in capsys.readouterr().out
