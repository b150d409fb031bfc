"""Per-process state: made anew in a forked child, and the environment read as defaults."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from streamload import _env
from streamload._errors import ConfigError
from streamload._fork import ProcessLocal, forks, no_fork, on_fork


def _in_child(check: object) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if check() else 2  # type: ignore[operator]
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_forked_child_makes_its_own_value_and_the_parent_keeps_its() -> None:
    closed: list[object] = []
    local: ProcessLocal[tuple[int, object]] = ProcessLocal(lambda: (os.getpid(), object()), close=closed.append)
    parent = local.get()
    before = forks()
    assert _in_child(lambda: local.peek() is None and local.get()[0] == os.getpid() and forks() == before + 1) == 0
    assert local.get() is parent and not closed  # the child closed nothing of the parent's
    local.clear()
    assert closed == [parent] and local.peek() is None


def test_a_lock_held_by_another_thread_at_fork_does_not_hang_the_child() -> None:
    local: ProcessLocal[threading.Lock] = ProcessLocal(threading.Lock)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with local.get():
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:  # the child's lock is its own: free, though the parent's thread holds the parent's
        assert _in_child(lambda: local.get().acquire(timeout=5)) == 0
    finally:
        release.set()
        thread.join()


def test_module_resets_run_in_the_child_only() -> None:
    state = {"cache": "parent"}
    on_fork(lambda: state.update(cache=""))
    assert _in_child(lambda: state["cache"] == "") == 0
    time.sleep(0)
    assert state["cache"] == "parent"


def test_a_fork_waits_for_a_no_fork_section_and_the_child_enters_its_own() -> None:
    entered, done = threading.Event(), threading.Event()

    def section() -> None:
        with no_fork():
            entered.set()
            time.sleep(0.3)
            done.set()

    def child() -> bool:
        signal.alarm(5)  # a section held at the fork and inherited held would hang here
        with no_fork():
            return done.is_set()  # forked only once the parent's section had ended

    thread = threading.Thread(target=section)
    thread.start()
    entered.wait(10)
    try:
        assert _in_child(child) == 0
    finally:
        thread.join()


@pytest.mark.parametrize(
    ("name", "value", "read"),
    [
        (_env.S3_DIRECT, "maybe", _env.s3_direct),
        (_env.CACHE_SHARED, "2", _env.cache_shared),
        (_env.READ_TIMEOUT, "-1", lambda: _env.env_seconds(_env.READ_TIMEOUT, 30.0)),
        (_env.PARQUET_CACHE, "lots", lambda: _env.env_bytes(_env.PARQUET_CACHE, 1)),
    ],
)
def test_a_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str, read: object) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        read()  # type: ignore[operator]


def test_environment_values_set_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_env.S3_DIRECT, "off")
    monkeypatch.setenv(_env.PARQUET_CACHE, "3MiB")
    monkeypatch.setenv(_env.CACHE, "/somewhere/else")
    assert not _env.s3_direct()
    assert _env.env_bytes(_env.PARQUET_CACHE, 1) == 3 << 20
    assert _env.cache_dir() == "/somewhere/else"
    monkeypatch.delenv(_env.S3_DIRECT)
    assert _env.s3_direct()


def test_shared_memory_is_made_in_a_child_forked_after_openmp_ran() -> None:
    """A child forked after its parent ran OpenMP threads hangs in its first parallel region:
    shared counters are made without one (no parallel copy into the segment)."""
    from streamload._shared import shared_zeros
    from streamload.decode import ImageDecoder

    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    torch.ones(1 << 22).add_(1)  # a parallel region in this process: OpenMP's threads exist now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            big = shared_zeros(1 << 20, torch.int64)  # a segment larger than torch's grain
            ImageDecoder(16)  # its counters live in shared memory
            code = 0 if big.is_shared() and int(big[-1000:].sum()) == 0 else 2
        finally:
            os._exit(code)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung making shared memory")


def test_conversion_workers_start_clean_while_a_thread_of_the_converter_holds_a_lock(tmp_path: Path) -> None:
    """A thread of the converting process holds a lock that a worker's reads take: the workers are not its forks."""
    from streamload.converters import ConvertOptions, convert
    from streamload.synthetic import make_image_folder
    from tests.helpers import held_lock

    make_image_folder(str(tmp_path / "images"), num_classes=2, per_class=6, size=(8, 8))
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with held_lock.LOCK:
            held.set()
            done.wait(120)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        source = held_lock.HeldLockSource(str(tmp_path / "images"))
        report = convert(source, str(tmp_path / "out"), ConvertOptions(workers=2, samples_per_shard=3))
    finally:
        done.set()
        holder.join()
    assert report.manifest.num_samples == 12 and len(report.manifest.shards) == 4


@pytest.mark.parametrize(
    "how", ["a script without a main guard", "a script on standard input", "a source class of the script"]
)
def test_a_conversion_with_workers_runs_the_callers_script_once(tmp_path: Path, how: str) -> None:
    """The workers never run the caller's script again: a script without ``if __name__ == "__main__"``
    converts once, and one read from standard input (no file to run again) converts at all."""
    import subprocess
    import sys

    from streamload.synthetic import make_image_folder

    make_image_folder(str(tmp_path / "images"), num_classes=2, per_class=6, size=(8, 8))
    script = (
        "from streamload.converters import ConvertOptions, ImageFolderSource, convert\n"
        "print('the script ran', flush=True)\n"
        "report = convert(ImageFolderSource('images'), 'out', ConvertOptions(workers=2, samples_per_shard=3))\n"
        "print('shards', len(report.manifest.shards))\n"
    )
    if how == "a source class of the script":  # it exists only in the script: its workers are forked
        script = script.replace("ImageFolderSource('images')", "Mine('images')").replace(
            "print('the script ran'", "class Mine(ImageFolderSource):\n    pass\nprint('the script ran'"
        )
    if how == "a script on standard input":
        cmd, stdin = [sys.executable, "-"], script
    else:
        (tmp_path / "convert_images.py").write_text(script)
        cmd, stdin = [sys.executable, "convert_images.py"], ""
    proc = subprocess.run(cmd, input=stdin, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("the script ran") == 1 and "shards 4" in proc.stdout, proc.stdout + proc.stderr
