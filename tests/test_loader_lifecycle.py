"""streamload.Loader where training scripts take it: exit, interrupts, small caches, two loaders, forged states.

Each test reproduces a way the thread loader broke (a script ending with an iterator alive,
a cache too small for its threads, two loaders over one dataset, a loop ended from inside,
Ctrl-C in a slow transform, a failed start, forged StatefulDataLoader states, the user's
warning filters, the watch's collate stage, too many threads), with real processes, a
real DataLoader and StatefulDataLoader, and a real signal where the case is an interrupt.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import streamload
from streamload import CacheError, ConfigError, Loader, PlanError, StorageConfig, StreamingDataset
from tests.helpers.datasets import make_dataset, write_dataset

BATCH = 8
COUNTS = [16, 16, 16, 16]  # 64 samples, 8 batches
REPO = Path(__file__).resolve().parents[1]


class Keys:
    """Collate: the batch's keys."""

    def __call__(self, samples: list[dict[str, Any]]) -> list[str]:
        return [str(s["__key__"]) for s in samples]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("lifecycle"), COUNTS)


def keyed(root: Path | str, **kw: Any) -> StreamingDataset:
    return StreamingDataset(str(root), shuffle=True, seed=3, batch_size=BATCH, collate=Keys(), **kw)


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("streamload-loader")]


def run_script(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


# -- 1. exit with an iterator alive ---------------------------------------------------------


def test_a_script_ending_with_a_loader_iterator_alive_exits_cleanly(tar_dataset: Path, tmp_path: Path) -> None:
    """The step-based loop: ``it = iter(loader)`` at module level, threads inside torch ops at exit."""
    code = f"""
        import torch
        from streamload import Loader, StreamingDataset
        from streamload.decode import DecodeBatch

        class Busy:
            def __call__(self, sample):
                x = torch.randn(192, 192)
                for _ in range(30):
                    x = x @ x.T / 192
                return sample

        ds = StreamingDataset({str(tar_dataset)!r}, batch_size=8, transform=Busy(), collate=DecodeBatch(16))
        data_iter = iter(Loader(ds, threads=2))
        for step in range(2):
            next(data_iter)
        print("steps done", flush=True)
    """
    for _ in range(2):
        done = run_script(code, tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "steps done" in done.stdout
        assert "terminate called" not in done.stderr


# -- 2. a cache too small for the threads -------------------------------------------------------


def test_threads_count_as_cache_readers_and_are_refused_at_once(tmp_path: Path) -> None:
    url = write_dataset("memory://loader-small-cache", "tar", [16] * 8, "c")
    import fsspec

    sizes = {f["name"]: f["size"] for f in fsspec.filesystem("memory").ls(url[len("memory:/") :], detail=True)}
    largest = max(size + sizes.get(name + ".idx", 0) for name, size in sizes.items() if name.endswith(".tar"))
    limit = 2 * largest + largest // 2
    storage = StorageConfig(cache="shards", cache_dir=str(tmp_path / "cache"), cache_limit=limit, lock_timeout=20)
    ds = StreamingDataset(url, batch_size=4, collate=Keys(), storage=storage)
    started = time.monotonic()
    with pytest.raises(CacheError, match=r"3 readers share the cache") as info:
        list(Loader(ds, threads=4))
    assert time.monotonic() - started < 20  # refused, not a wait for room (today: 300 s)
    assert "cache_limit" in str(info.value) and "fewer readers" in str(info.value)
    del info
    assert len(list(Loader(ds, threads=2))) == 32  # two threads fit


def test_the_wait_for_room_honours_lock_timeout(tmp_path: Path) -> None:
    from streamload.storage.remote import RemoteStorage

    config = StorageConfig(cache_dir=str(tmp_path), cache_limit="1MB", lock_timeout=2)
    storage = RemoteStorage("memory://loader-lock-timeout", config.resolve())
    try:
        assert storage.cache.wait_timeout == 2
    finally:
        storage.close()


# -- 3. two Loaders over one dataset ------------------------------------------------------------


def test_two_loaders_over_one_dataset_each_report_their_own_position(root: Path) -> None:
    ref = list(DataLoader(keyed(root), batch_size=None))
    ds = keyed(root)
    first, second = Loader(ds, threads=2), Loader(ds, threads=1)
    running = iter(first)
    got = [next(running) for _ in range(3)]
    other = iter(second)
    next(other)  # the second loader claims the next epoch
    state = first.state_dict()
    assert (state["epoch"], state["samples_seen"]) == (0, 3 * BATCH)
    del other, running
    again = Loader(keyed(root), threads=2)
    again.load_state_dict(state)
    assert got + list(again) == ref  # nothing skipped, nothing repeated


# -- 4. a loop ended from inside ----------------------------------------------------------------


def test_iter_and_load_state_dict_inside_a_running_loop_do_not_end_it(root: Path) -> None:
    ref = list(DataLoader(keyed(root), batch_size=None))
    loader = Loader(keyed(root), threads=2)
    saved = None
    seen = []
    for step, batch in enumerate(loader):
        seen.append(batch)
        if step == 1:
            next(iter(loader))  # as with a DataLoader: another iteration, this loop goes on
        if step == 2:
            saved = loader.state_dict()
            loader.load_state_dict(saved)
    assert seen == ref
    assert saved is not None
    assert loader.state_dict() == saved  # loaded, not iterated yet: the loaded state


# -- 5. interrupts ------------------------------------------------------------------------------


class Slow:
    """A transform that takes long on one sample (a stuck decode), quickly on the rest."""

    def __init__(self, key: str, seconds: float) -> None:
        self.key, self.seconds = key, seconds

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"] == self.key:
            time.sleep(self.seconds)
        return sample


def test_leaving_the_loop_returns_without_waiting_for_a_busy_thread(root: Path) -> None:
    ds = StreamingDataset(str(root), batch_size=BATCH, collate=Keys(), transform=Slow("s3_5", 10))
    it = iter(Loader(ds, threads=2))
    next(it)
    time.sleep(0.5)  # thread 0 makes batches 2, 4 and 6 ahead: it is inside the slow sample now
    started = time.monotonic()
    it.close()
    assert time.monotonic() - started < 5  # today: the rest of the 10 s sample
    # The dataset is free at once: a DataLoader reads it while the busy thread finishes in the background.
    assert len(next(iter(DataLoader(ds, batch_size=None, num_workers=0)))) == BATCH


def test_ctrl_c_during_a_slow_transform_returns_promptly_and_frees_the_dataset(root: Path, tmp_path: Path) -> None:
    code = f"""
        import os, signal, threading, time
        from torch.utils.data import DataLoader
        from streamload import Loader, StreamingDataset

        class Keys:
            def __call__(self, samples):
                return [str(s["__key__"]) for s in samples]

        def slow(sample):
            if str(sample["__key__"]) == "s3_5":
                time.sleep(30)
            return sample

        ds = StreamingDataset({str(root)!r}, batch_size=8, collate=Keys(), transform=slow)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        try:
            for batch in Loader(ds, threads=2):
                pass
        except KeyboardInterrupt:
            print("interrupted after %.1f" % (time.monotonic() - started), flush=True)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()  # a second Ctrl-C, at once
        try:
            it = iter(Loader(ds, threads=2))
            next(it)
            time.sleep(1)
        except KeyboardInterrupt:
            pass
        it = None
        plain = StreamingDataset({str(root)!r}, batch_size=8, collate=Keys())
        print("batches", len(list(DataLoader(plain, batch_size=None, num_workers=0))), flush=True)
        print("again", len(next(iter(DataLoader(ds, batch_size=None, num_workers=0)))), flush=True)
        os._exit(0)  # the sleeping thread is not waited for
    """
    done = run_script(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert float(lines["interrupted"].split()[-1]) < 6, done.stdout  # today: 30 s in join()
    assert lines["batches"] == "8", done.stdout + done.stderr[-2000:]
    assert lines["again"] == "8", done.stdout + done.stderr[-2000:]


# -- 6. a failed start --------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_a_device_without_cuda_is_a_config_error_up_front(root: Path) -> None:
    with pytest.raises(ConfigError, match="device='cuda'"):
        Loader(keyed(root), device="cuda")
    with pytest.raises(ConfigError, match="not a device"):
        Loader(keyed(root), device="nonsense")


def test_a_start_that_fails_leaves_the_dataset_free(root: Path) -> None:
    ds = keyed(root)
    ref = list(DataLoader(keyed(root), batch_size=None))
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "streamload-loader-1":
            raise RuntimeError("can't start new thread")
        original(thread)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(threading.Thread, "start", start)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            next(iter(Loader(ds, threads=2)))
    ds.set_epoch(0)
    assert list(DataLoader(ds, batch_size=None)) == ref  # not "iterated by a streamload.Loader"
    deadline = time.monotonic() + 20
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader_threads() == []


# -- 7. forged states ---------------------------------------------------------------------------


def stateful_state(root: Path, steps: int, workers: int = 2) -> dict[str, Any]:
    loader = StatefulDataLoader(keyed(root), batch_size=None, num_workers=workers)
    for step, _ in enumerate(loader, 1):
        if step == steps:
            break
    state = loader.state_dict()
    del loader
    return state


def test_forged_stateful_dataloader_states_are_refused_as_the_dataloader_refuses(root: Path) -> None:
    genuine = stateful_state(root, 3)
    ref = list(DataLoader(keyed(root), batch_size=None))
    loader = Loader(keyed(root), threads=2)
    loader.load_state_dict(genuine)
    assert list(loader) == ref[3:]  # a genuine state converts exactly

    import copy

    zeroed = copy.deepcopy(genuine)
    for worker in zeroed["_snapshot"]["_worker_snapshots"].values():
        worker["dataset_state"]["worker"]["next_item"] = 0
    with pytest.raises(PlanError):  # what the DataLoader's workers raise for it
        restored = StatefulDataLoader(keyed(root), batch_size=None, num_workers=2)
        restored.load_state_dict(zeroed)
        list(restored)
    with pytest.raises(PlanError, match="next_item|start"):
        Loader(keyed(root), threads=2).load_state_dict(zeroed)

    negative = copy.deepcopy(genuine)
    negative["_steps_since_snapshot"] = -2
    with pytest.raises(PlanError, match="_steps_since_snapshot"):
        Loader(keyed(root), threads=2).load_state_dict(negative)

    twice = copy.deepcopy(genuine)
    snaps = twice["_snapshot"]["_worker_snapshots"]
    first, second = sorted(snaps)
    snaps[second]["dataset_state"]["worker"] = dict(snaps[first]["dataset_state"]["worker"])
    with pytest.raises(PlanError, match="workers 0..n-1"):
        Loader(keyed(root), threads=2).load_state_dict(twice)


# -- 8. the user's warning filters -------------------------------------------------------------


def test_the_users_warning_filters_hold_during_a_loader_run(tar_dataset: Path, tmp_path: Path) -> None:
    code = f"""
        import sys, warnings
        warnings.filterwarnings("ignore", message="silenced")
        from streamload import Loader, StreamingDataset
        from streamload.decode import DecodeBatch
        from streamload.sample import image_warnings

        recorded = []

        class Warns:
            def __call__(self, sample):
                with image_warnings() as found:
                    warnings.warn("library warning")
                    warnings.warn("library warning")
                recorded.append(len(found))
                return sample

        def mine():
            warnings.warn("my own, once")

        ds = StreamingDataset({str(tar_dataset)!r}, batch_size=8, transform=Warns(), collate=DecodeBatch(16))
        mine()
        for step, batch in enumerate(Loader(ds, threads=2)):
            for _ in range(20):
                warnings.warn("silenced by the user")
            mine()
        print("recorded", sum(recorded), "of", 2 * len(recorded))
    """
    done = run_script(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "silenced" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("my own, once") == 1, done.stderr[-2000:]
    assert "library warning" not in done.stderr  # recorded by the block, not printed
    count, _, total = done.stdout.split()[1:]
    assert count == total  # every one recorded, in every thread


def test_recording_leaves_the_process_filters_as_they_were() -> None:
    from streamload.sample import image_warnings

    with image_warnings():
        pass
    before = list(warnings.filters)
    with image_warnings() as found:
        warnings.warn("inside", stacklevel=1)
    assert found == ["UserWarning: inside"]
    assert warnings.filters == before
    assert not any(f[0] == "always" and f[1] is None and f[2] is Warning for f in warnings.filters)


# -- 9. the watch times the Loader's collate ----------------------------------------------------


def test_watch_times_the_loaders_own_collate(root: Path) -> None:
    class Big:
        def __call__(self, sample: dict[str, Any]) -> torch.Tensor:
            return torch.zeros(3, 224, 224, dtype=torch.uint8)

    ds = StreamingDataset(str(root), batch_size=BATCH, transform=Big())
    watched = streamload.watch(Loader(ds, threads=2))
    assert sum(1 for _ in watched) == 8
    stages = watched.report().stages
    assert stages["collate"] > 0, stages


# -- threads beyond what a process can use -------------------------------------------------------


def test_threads_beyond_what_a_process_can_use_are_capped_with_a_warning(root: Path) -> None:
    from streamload.loader import thread_cap

    with pytest.warns(UserWarning, match="at most"):
        loader = Loader(keyed(root), threads=20_000)
    assert loader.threads == thread_cap()
    ref = list(DataLoader(keyed(root), batch_size=None))
    assert list(loader) == ref


def test_no_thread_outlives_an_iteration(root: Path) -> None:
    for _ in Loader(keyed(root), threads=3):
        break
    deadline = time.monotonic() + 20
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader_threads() == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
