"""``streamload convert`` never destroys or silently mixes user data.

The tests come in numbered cases (the ``# -- case N`` headings): a foreign destination is
never written into, an in-place re-shard never destroys its source, of two conversions
into one destination only one succeeds, non-UTF-8 names and FIFOs neither crash nor hang
the converter, and an unreadable folder is named, never silently left out.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from streamload import ConfigError, SourceError, StorageError, StreamingDataset
from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, Item, ScanResult, Source, convert, path_to_key
from streamload.converters.journal import JOB_NAME
from streamload.manifest import MANIFEST_NAME
from streamload.storage.destination import STAGING_PREFIX
from streamload.synthetic import make_image_folder, synthetic_jpeg

FAST = ["--no-progress", "--check", "none"]
#: The destination lock: a file in a local directory, an object under a bucket prefix.
LOCAL_LOCK_NAME = ".streamload-lock"
REMOTE_LOCK_NAME = "_streamload-lock.json"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("safety-images")
    make_image_folder(str(root), num_classes=3, per_class=8, size=(16, 12), seed=11)
    return root


def _copy(folder: Path, tmp_path: Path, name: str = "src") -> Path:
    out = tmp_path / name
    shutil.copytree(folder, out, symlinks=True)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def _convert(src: Path | str, dst: Path | str, *extra: str) -> int:
    return main(["convert", str(src), str(dst), "--samples-per-shard", "5", *FAST, *extra])


def _verify(dst: Path | str, *extra: str) -> int:
    return main(["verify", str(dst), *extra])


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith((STAGING_PREFIX, "_", LOCAL_LOCK_NAME))]


# -- case 1: a destination that streamload did not write ------------------------------


def test_refuses_a_non_empty_foreign_destination(folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "photo.jpg").write_bytes(b"my photo")
    assert _convert(folder, out) == 2
    err = capsys.readouterr().err
    assert "not written by streamload" in err and "notes.txt" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "photo.jpg"]
    # --overwrite writes beside them and never deletes them.
    assert _convert(folder, out, "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "my notes" and (out / "photo.jpg").read_bytes() == b"my photo"
    assert _verify(out) == 0


@pytest.mark.parametrize("foreign", ["shard-000000.tar", "shard-000001.tar.idx", MANIFEST_NAME])
def test_overwrite_never_replaces_a_file_streamload_did_not_write(
    folder: Path, tmp_path: Path, foreign: str, capsys
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / foreign).write_bytes(b"not ours, not a streamload manifest")
    assert _convert(folder, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert foreign in err and "did not write" in err
    assert [p.name for p in out.iterdir()] == [foreign]
    assert (out / foreign).read_bytes() == b"not ours, not a streamload manifest"


def test_overwrite_replaces_our_dataset_keeps_foreign_files_and_drops_stale_shards(
    folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _convert(folder, out, "--samples-per-shard", "2") == 0  # 12 shards
    (out / "README.txt").write_text("about this dataset")
    assert _convert(folder, out, "--samples-per-shard", "10", "--overwrite") == 0  # 3 shards
    names = sorted(p.name for p in out.iterdir())
    shards = [f"shard-{i:06d}.tar" for i in range(3)]
    assert names == sorted(["README.txt", MANIFEST_NAME, *shards, *(s + ".idx" for s in shards)])
    assert _verify(out) == 0


def test_shards_indexed_by_streamload_index_are_not_ours(folder: Path, tmp_path: Path) -> None:
    # Shards written by another tool and indexed with `streamload index` are the user's:
    # --overwrite replaces the index but never a shard of theirs.
    other = tmp_path / "other"
    assert _convert(folder, other) == 0
    (other / MANIFEST_NAME).unlink()
    for idx in other.glob("*.idx"):
        idx.unlink()
    assert main(["index", str(other)]) == 0
    before = {n: b for n, b in _files(other).items() if n.endswith(".tar")}
    assert _convert(folder, other, "--overwrite", "--format", "hdf5") == 0
    assert {n: b for n, b in _files(other).items() if n.endswith(".tar")} == before
    assert _verify(other) == 0


# -- case 2: source and destination the same dataset -----------------------------------


@pytest.mark.parametrize("spelling", ["same", "trailing-slash", "dot-dot", "symlink", "file-url", "relative"])
def test_in_place_reshard_is_refused(
    folder: Path, tmp_path: Path, spelling: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    ds = tmp_path / "ds"
    assert _convert(folder, ds) == 0
    before = _files(ds)
    (tmp_path / "link").symlink_to(ds)
    monkeypatch.chdir(tmp_path)
    dst = {
        "same": str(ds),
        "trailing-slash": f"{ds}//",
        "dot-dot": f"{tmp_path}/x/../ds",
        "symlink": str(tmp_path / "link"),
        "file-url": f"file://{ds}",
        "relative": "ds",
    }[spelling]
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert main(["convert", str(ds), dst, "--samples-per-shard", "7", *FAST, *extra]) == 2
        assert "same dataset" in capsys.readouterr().err
    assert _files(ds) == before
    assert _verify(ds) == 0


# -- case 3: a destination inside the image folder -------------------------------------


@pytest.mark.parametrize("where", ["inside", "itself", "nested", "via-symlink", "inside-linked-class"])
def test_destination_inside_the_image_folder_is_refused(folder: Path, tmp_path: Path, where: str, capsys) -> None:
    src = _copy(folder, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(src / "class_002"), str(elsewhere))
    (src / "class_002").symlink_to(elsewhere)
    (tmp_path / "alias").symlink_to(src)
    dst = {
        "inside": src / "out",
        "itself": src,
        "nested": src / "class_000" / "out",
        "via-symlink": tmp_path / "alias" / "out",
        "inside-linked-class": elsewhere / "out",
    }[where]
    before = sorted(str(p) for p in src.rglob("*"))
    assert _convert(src, dst, "--overwrite") == 2
    assert "inside the image folder" in capsys.readouterr().err
    assert sorted(str(p) for p in src.rglob("*")) == before


# -- case 4: two conversions into one destination at once -----------------------------

# A conversion slowed down (every image load sleeps) so that two started together overlap
# for sure; with a gate file named, its loads instead wait (at most a minute) until that
# file exists, which holds it at work for as long as the test needs.
_SLOW_CLI = """
import os, sys, time
from streamload.converters import imagefolder
_load = imagefolder.ImageFolderSource.load
_gate = os.environ.get("SLOW_CLI_GATE")
def load(self, item):
    if not _gate:
        time.sleep(0.1)
    deadline = time.monotonic() + 60
    while _gate and not os.path.exists(_gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _load(self, item)
imagefolder.ImageFolderSource.load = load
from streamload.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _start_cli(*args: str, gate: Path | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SLOW_CLI_GATE=str(gate)) if gate is not None else None
    return subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, "convert", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def _race(first: list[str], second: list[str], wait_for: Any = None) -> tuple[list[int], list[bytes], list[int]]:
    """Run two conversions; the second starts at once, or once ``wait_for()`` is true.

    With ``wait_for``, the first conversion holds its loads until the second has ended, so
    the second meets it at work however slowly either process starts.
    """
    gate = Path(tempfile.mkdtemp()) / "go" if wait_for is not None else None
    a = _start_cli(*first, gate=gate)
    if wait_for is not None:
        deadline = time.monotonic() + 60
        while not wait_for() and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.poll() is None, "the first conversion ended before the second started; make it slower"
    b = _start_cli(*second)
    if gate is not None:
        out_b = b.communicate(timeout=120)
        gate.touch()
        outs = [a.communicate(timeout=120), out_b]
    else:
        outs = [p.communicate(timeout=120) for p in (a, b)]
    errs = [err for _, err in outs]
    for err in errs:
        assert b"Traceback" not in err, err.decode()
    return [a.returncode, b.returncode], errs, [a.pid, b.pid]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_conversions_race_into_one_directory(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [str(folder), str(out), "--samples-per-shard", "2", *FAST]
    # Started together, without --overwrite: exactly one writes the dataset.
    codes, errs, _ = _race(args, args)
    assert sorted(codes) == [0, 2], errs
    assert _verify(out) == 0
    assert not _leftovers(out)
    # The second starts while the first holds the destination, both with --overwrite.
    codes, errs, pids = _race(
        [*args, "--overwrite"], [*args, "--overwrite", "--workers", "2"], lambda: (out / JOB_NAME).exists()
    )
    assert codes == [0, 2], errs
    assert b"another conversion" in errs[1] and f"pid {pids[0]}".encode() in errs[1], errs[1]
    assert _verify(out) == 0
    assert not _leftovers(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_conversions_race_into_one_bucket_prefix(folder: Path, s3_server: Any, tmp_path: Path) -> None:
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/ds"
    fs = s3_server.filesystem()
    args = [str(folder), url, "--samples-per-shard", "2", *FAST, *s3_server.cli_options()]
    # Started together: both write the lock object, the last write wins (or, started far
    # apart, the second finds the dataset); exactly one writes the dataset.
    codes, errs, _ = _race(args, args)
    assert sorted(codes) == [0, 2], errs
    loser = errs[codes.index(2)]
    assert b"another conversion" in loser or b"already holds" in loser, loser
    opts = [*s3_server.cli_options(), "--cache-dir", str(tmp_path / "c1")]
    assert _verify(url, *opts) == 0

    def started() -> bool:
        fs.invalidate_cache()
        return bool(fs.exists(f"{bucket}/ds/{JOB_NAME}"))

    codes, errs, pids = _race([*args, "--overwrite"], [*args, "--overwrite"], started)
    assert codes == [0, 2], errs
    assert b"another conversion" in errs[1] and f"pid {pids[0]}".encode() in errs[1], errs[1]
    assert _verify(url, *s3_server.cli_options(), "--cache-dir", str(tmp_path / "c2")) == 0
    fs.invalidate_cache()
    names = {p.rsplit("/", 1)[1] for p in fs.find(f"{bucket}/ds")}
    assert REMOTE_LOCK_NAME not in names and JOB_NAME not in names


@pytest.mark.slow
def test_in_place_reshard_in_a_bucket_is_refused(folder: Path, s3_server: Any, tmp_path: Path, capsys) -> None:
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/ds"
    opts = s3_server.cli_options()
    assert _convert(folder, url, *opts) == 0
    before = sorted(s3_server.filesystem().find(f"{bucket}/ds"))
    for dst in (url, f"s3://{bucket}//ds/", f"s3a://{bucket}/ds"):
        assert _convert(url, dst, "--overwrite", *opts) == 2
        assert "same dataset" in capsys.readouterr().err
    assert sorted(s3_server.filesystem().find(f"{bucket}/ds")) == before
    assert _verify(url, *opts, "--cache-dir", str(tmp_path / "c")) == 0


@pytest.mark.slow
def test_a_stale_bucket_lock_is_taken_over_and_a_live_one_is_not(
    folder: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamload.storage.locks import RemoteLock

    monkeypatch.setattr(RemoteLock, "settle_s", 0.2)
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/ds"
    fs = s3_server.filesystem()
    options = ConvertOptions(samples_per_shard=5, progress=False, storage_options=s3_server.storage_options())
    lock_path = f"{bucket}/ds/{REMOTE_LOCK_NAME}"
    now = time.time()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holders = {
        "dead-pid-here": {"host": socket.gethostname(), "pid": dead.pid, "expires": now + 600},
        "expired-elsewhere": {"host": "elsewhere", "pid": 1, "expires": now - 1},
        "live-elsewhere": {"host": "elsewhere", "pid": 1, "expires": now + 600},
    }
    for name, holder in holders.items():
        owner = {**RemoteLock.identity(), **holder, "token": name, "started": "earlier"}
        fs.pipe_file(lock_path, json.dumps(owner).encode())
        if name == "live-elsewhere":
            with pytest.raises(StorageError, match="another conversion.*pid 1 on elsewhere"):
                convert(ImageFolderSource(str(folder), check="none"), url, options)
        else:
            convert(ImageFolderSource(str(folder), check="none"), url, options)
            options = ConvertOptions(**{**options.__dict__, "overwrite": True})
            fs.invalidate_cache()
            assert not fs.exists(lock_path)


def test_racing_bucket_locks_admit_exactly_one_even_without_a_settle_wait(
    s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock object is created exclusively (``If-None-Match: *``): of writers that all saw
    no lock, one takes it, whatever the timing; the write-wait-read-back step alone would
    let several through with no wait."""
    import threading

    from streamload._errors import DestinationBusyError
    from streamload.storage.locks import RemoteLock
    from streamload.storage.retry import RetryPolicy
    from streamload.storage.transport import RemoteFiles

    monkeypatch.setattr(RemoteLock, "settle_s", 0.0)
    bucket = s3_server.make_bucket()
    options = s3_server.storage_options()
    for round_ in range(3):
        url = f"s3://{bucket}/race-{round_}"
        locks = [RemoteLock(url, RemoteFiles(url, options, RetryPolicy())) for _ in range(6)]
        for lock in locks:
            lock.files.fs  # noqa: B018 - connect before the race
        barrier = threading.Barrier(len(locks))
        outcome: list[str] = [""] * len(locks)

        def take(i: int, locks: list[RemoteLock] = locks, outcome: list[str] = outcome, barrier: Any = barrier) -> None:
            barrier.wait()
            try:
                locks[i].acquire()
                outcome[i] = "held"
            except DestinationBusyError:
                outcome[i] = "busy"

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(locks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(outcome) == ["busy"] * (len(locks) - 1) + ["held"], outcome
        holder = locks[outcome.index("held")]
        holder.check()  # still ours
        holder.release()


# -- case 5: --resume of a conversion that already completed ---------------------------


def test_resume_after_completion_is_a_successful_no_op(folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert _convert(folder, out) == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    capsys.readouterr()
    assert _convert(folder, out, "--resume") == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
    # Other options: not the conversion at DST; refused, not silently "done".
    assert _convert(folder, out, "--resume", "--samples-per-shard", "6") == 2
    assert "--overwrite" in capsys.readouterr().err
    # A shard gone: not complete, said so.
    (out / "shard-000001.tar").unlink()
    assert _convert(folder, out, "--resume") == 2
    assert "shard-000001.tar" in capsys.readouterr().err


def test_resume_after_completion_with_the_journal_still_there(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # Killed after index.json was published, before the journal was removed.
    from streamload.converters import journal

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(journal.Journal, "finish", lambda self: None)
        assert _convert(folder, out) == 0
    assert (out / JOB_NAME).exists() and list(out.glob("_done-*.json"))
    before = _files(out)[MANIFEST_NAME]
    capsys.readouterr()
    assert _convert(folder, out, "--resume") == 0
    assert "nothing to do" in capsys.readouterr().out
    assert _files(out)[MANIFEST_NAME] == before
    assert not _leftovers(out)
    assert _verify(out) == 0
    # Journal there and a shard gone since: --resume finishes the job again.
    reference = _files(out)
    with monkeypatch.context() as m:
        m.setattr(journal.Journal, "finish", lambda self: None)
        assert _convert(folder, out, "--overwrite") == 0
    (out / "shard-000002.tar").unlink()
    assert _convert(folder, out, "--resume") == 0
    assert _files(out) == reference


# -- case 6: keys unique by construction --------------------------------------------


def _write_images(root: Path, rels: list[str | bytes]) -> None:
    import numpy as np

    rng = np.random.default_rng(3)
    for rel in rels:
        path = os.path.join(os.fsencode(root), os.fsencode(rel))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(synthetic_jpeg(rng, 16, 12))


def test_extensions_differing_only_in_case_get_distinct_keys(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write_images(src, ["cat/x.jpg", "cat/x.JPG", "cat/x.Jpg", "cat/x.png", "cat/y.JPG", "dog/z.jpg"])
    out = tmp_path / "out"
    outs = []
    for workers in ("1", "2"):
        d = tmp_path / f"out{workers}"
        assert _convert(src, d, "--workers", workers) == 0
        outs.append(_files(d))
    assert outs[0] == outs[1]
    shutil.copytree(tmp_path / "out1", out)
    keys = sorted(s["__key__"] for s in StreamingDataset(str(out)))
    assert keys == ["cat/x~JPG", "cat/x~Jpg", "cat/x~jpg", "cat/x~png", "cat/y", "dog/z"]
    # WebDataset's rules: `streamload index` (which refuses duplicate keys) accepts them.
    (out / MANIFEST_NAME).unlink()
    assert main(["index", str(out)]) == 0


def test_keys_of_ordinary_files_are_unchanged() -> None:
    expected = {
        "class_001/dotted.name.v2.jpg": "class_001/dotted%2Ename%2Ev2",
        "class_001/with space.jpg": "class_001/with space",
        "class_001/UPPER.JPG": "class_001/UPPER",
        "class_001/nested/deeper/inner.jpeg": "class_001/nested/deeper/inner",
        "class_001/percent%2E.jpg": "class_001/percent%252E",
        "class_001/tilde~x.jpg": "class_001/tilde%7Ex",
        "a.b/c%d/e.jpg": "a.b/c%d/e",
    }
    assert {rel: path_to_key(rel) for rel in expected} == expected
    assert path_to_key("c/same.jpg", disambiguate=True) == "c/same~jpg"
    assert path_to_key("c/same.PNG", disambiguate=True) == "c/same~png"


class _DuplicateKeys(Source):
    """A source whose scan lists two items with the same key."""

    classes = ["a"]

    def scan(self) -> ScanResult:
        return ScanResult([Item("k1", 1), Item("dup", 1), Item("k2", 1), Item("dup", 1)])

    def load(self, item: Item) -> dict[str, Any]:
        return {"__key__": item.key, "txt": b"x", "cls": b"0"}

    def describe(self) -> str:
        return "dup-source"

    def origin(self, item: Item) -> str:
        return f"origin-of-{item.key}-{id(item) % 2}"


def test_duplicate_keys_are_reported_naming_both_inputs(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="dup.*origin-of-dup.*origin-of-dup"):
        convert(_DuplicateKeys(), str(tmp_path / "a"), ConvertOptions(progress=False))
    report = convert(_DuplicateKeys(), str(tmp_path / "b"), ConvertOptions(progress=False, on_error="skip"))
    assert report.manifest.num_samples == 3
    assert len(report.skipped) == 1 and "dup" in report.skipped[0].error


def test_key_collision_between_escaped_and_literal_names_is_reported(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write_images(src, ["c/a%FF/x.jpg", b"c/a\xff/x.jpg", "c/b.jpg"])
    with pytest.raises(SourceError, match=r"a%FF/x.jpg"):
        convert(ImageFolderSource(str(src)), str(tmp_path / "o1"), ConvertOptions(progress=False))
    report = convert(ImageFolderSource(str(src)), str(tmp_path / "o2"), ConvertOptions(progress=False, on_error="skip"))
    assert report.manifest.num_samples == 2 and len(report.skipped) == 1


# -- case 7: file names that are not UTF-8 ---------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_non_utf8_file_names_get_escaped_reversible_keys(tmp_path: Path, on_error: str) -> None:
    src = tmp_path / "src"
    _write_images(src, [b"cat/\xff.jpg", b"cat/ok.jpg", b"cat/sub\xfe/y\xe9.jpg", b"\xfedog/z.jpg"])
    with open(os.path.join(os.fsencode(src), b"cat/notes\xff.txt"), "wb") as f:
        f.write(b"not an image")
    out = tmp_path / "out"
    assert _convert(src, out, "--on-error", on_error, "--workers", "2") == 0
    ds = StreamingDataset(str(out))
    assert ds.manifest.classes == ("cat", "%FEdog")  # sorted by the names as the system gives them
    keys = sorted(s["__key__"] for s in ds)
    assert keys == ["%FEdog/z", "cat/%FF", "cat/ok", "cat/sub%FE/y%E9"]
    assert _verify(out) == 0


def test_source_paths_that_are_not_utf8(folder: Path, tmp_path: Path) -> None:
    # The source's own path goes into the manifest (meta.source): printable, never a crash.
    src = os.path.join(os.fsencode(tmp_path), b"imgs-\xff")
    shutil.copytree(os.fsencode(folder), src)
    ds = os.path.join(os.fsencode(tmp_path), b"ds-\xfe")
    assert _convert(os.fsdecode(src), os.fsdecode(ds)) == 0
    assert _convert(os.fsdecode(ds), tmp_path / "again") == 0
    manifest = json.loads((tmp_path / "again" / MANIFEST_NAME).read_text())
    assert manifest["meta"]["source"].endswith("ds-\\xfe")
    assert _verify(tmp_path / "again") == 0


# -- case 8: an unreadable sub-directory --------------------------------------------


# chmod does not block root (CI runs as root): there, the scandir-fails variant alone.
@pytest.fixture(params=["scandir-fails", *(["chmod"] if os.geteuid() != 0 else [])])
def unreadable(request: pytest.FixtureRequest, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = _copy(folder, tmp_path)
    sub = src / "class_001" / "locked"
    _write_images(src, ["class_001/locked/a.jpg", "class_001/locked/b.jpg"])
    if request.param == "chmod":
        sub.chmod(0)
        request.addfinalizer(lambda: sub.chmod(0o755))
    else:
        real = os.scandir

        def scandir(path: Any = ".") -> Any:
            if os.fsdecode(path).rstrip("/").endswith("class_001/locked"):
                raise PermissionError(13, "Permission denied", os.fsdecode(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)
    return src


def test_an_unreadable_sub_directory_is_listed_not_dropped(unreadable: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="class_001/locked"):
        convert(ImageFolderSource(str(unreadable)), str(tmp_path / "o1"), ConvertOptions(progress=False))
    report = convert(
        ImageFolderSource(str(unreadable)), str(tmp_path / "o2"), ConvertOptions(progress=False, on_error="skip")
    )
    assert [s.path for s in report.skipped] == ["class_001/locked/"]
    assert "Permission denied" in report.skipped[0].error


def test_unreadable_and_special_entries_are_listed(folder: Path, tmp_path: Path) -> None:
    src = _copy(folder, tmp_path)
    (src / "class_000" / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (src / "class_000" / "loop.jpg").symlink_to(src / "class_000" / "loop.jpg")
    (src / "class_000" / "back").symlink_to(src / "class_000")  # a folder loop
    (src / "class_000" / "up").symlink_to(tmp_path)  # above the image folder: a loop too
    (src / "zz_root").symlink_to(src)  # a class that is the image folder itself
    os.mkfifo(src / "class_001" / "pipe.jpg")
    with pytest.raises(SourceError):
        convert(ImageFolderSource(str(src)), str(tmp_path / "o1"), ConvertOptions(progress=False))
    report = convert(ImageFolderSource(str(src)), str(tmp_path / "o2"), ConvertOptions(progress=False, on_error="skip"))
    listed = {s.path: s.error for s in report.skipped}
    assert set(listed) == {
        "class_000/dangling.jpg",
        "class_000/loop.jpg",
        "class_000/back/",
        "class_000/up/",
        "class_001/pipe.jpg",
        "zz_root/",
    }
    assert "loop" in listed["class_000/back/"] and "regular file" in listed["class_001/pipe.jpg"]
    assert "loop" in listed["zz_root/"] and "loop" in listed["class_000/up/"]
    assert report.manifest.num_samples == 24
    assert report.manifest.classes == ("class_000", "class_001", "class_002")  # zz_root gave no image: no class


# -- case 9: the umask ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "lmdb", "hdf5"])
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_output_files_honour_the_umask(folder: Path, tmp_path: Path, fmt: str, umask: int, mode: int) -> None:
    out = tmp_path / "out"
    old = os.umask(umask)
    try:
        assert _convert(folder, out, "--format", fmt, "--workers", "2") == 0
    finally:
        os.umask(old)
    files = sorted(out.iterdir())
    assert [p.name for p in files if p.name.startswith(("shard-", MANIFEST_NAME))] == [p.name for p in files]
    assert len(files) > 3
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: mode for p in files}
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


# -- case 10: no staging leftovers after a failure ------------------------------------


class _VanishingSource(ImageFolderSource):
    """Deletes a file of shard 0 as its neighbour is loaded; every load takes a while."""

    def load(self, item: Item) -> dict[str, Any]:
        relpath = getattr(item, "relpath", "")
        if relpath.endswith("img_000002.jpg") and relpath.startswith("class_000"):
            os.unlink(os.path.join(self.root, relpath.replace("000002", "000003")))
        time.sleep(0.03)
        return super().load(item)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_file_removed_mid_conversion_leaves_no_staging_files(folder: Path, tmp_path: Path, on_error: str) -> None:
    src = _copy(folder, tmp_path)
    out = tmp_path / "out"
    options = ConvertOptions(samples_per_shard=5, workers=2, progress=False, on_error=on_error)  # type: ignore[arg-type]
    if on_error == "raise":
        with pytest.raises(SourceError, match="img_000003.jpg"):
            convert(_VanishingSource(str(src), check="none"), str(out), options)
        assert not (out / MANIFEST_NAME).exists()
        assert not [p.name for p in out.iterdir() if p.name.startswith((STAGING_PREFIX, LOCAL_LOCK_NAME))]
    else:
        report = convert(_VanishingSource(str(src), check="none"), str(out), options)
        assert [s.path for s in report.skipped] == ["class_000/img_000003.jpg"]
        assert not _leftovers(out)


# -- case 11: careless users and attackers ---------------------------------------------


def _src_with_only_empty_classes(tmp_path: Path) -> Path:
    src = tmp_path / "empty-classes"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    return src


@pytest.mark.parametrize(
    "case",
    [
        "dst-is-a-file",
        "dst-under-a-file",
        "src-missing",
        "src-is-a-file",
        "src-empty",
        "src-empty-string",
        "dst-empty-string",
        "only-empty-classes-skip",
        "samples-per-shard-0",
        "shard-size-abc",
        "shard-size-0",
        "shard-size-huge",
        "workers-0",
        "workers-million",
        "seed-negative",
        "dst-is-parent-of-src",
        "dst-unwritable",
        "dst-url-without-bucket",
    ],
)
def test_careless_input_is_a_clear_error_never_a_traceback(folder: Path, tmp_path: Path, case: str, capsys) -> None:
    src: Path | str = folder
    dst: Path | str = tmp_path / "out"
    extra: list[str] = []
    if case == "dst-is-a-file":
        Path(dst).write_text("a file")
    elif case == "dst-under-a-file":
        (tmp_path / "file").write_text("a file")
        dst = tmp_path / "file" / "out"
    elif case == "src-missing":
        src = tmp_path / "nope"
    elif case == "src-is-a-file":
        src = tmp_path / "f.jpg"
        Path(src).write_bytes(b"x")
    elif case == "src-empty":
        src = tmp_path / "empty"
        Path(src).mkdir()
    elif case == "src-empty-string":
        src = ""
    elif case == "dst-empty-string":
        dst = ""
    elif case == "only-empty-classes-skip":
        src = _src_with_only_empty_classes(tmp_path)
        extra = ["--on-error", "skip"]
    elif case == "samples-per-shard-0":
        extra = ["--samples-per-shard", "0"]
    elif case == "shard-size-abc":
        extra = ["--shard-size", "abc"]
    elif case == "shard-size-0":
        extra = ["--shard-size", "0"]
    elif case == "shard-size-huge":
        extra = ["--shard-size", "9" * 400 + "TB"]
    elif case == "workers-0":
        extra = ["--workers", "0"]
    elif case == "workers-million":
        extra = ["--workers", str(10**6)]
    elif case == "seed-negative":
        extra = ["--shuffle", "--seed", "-1"]
    elif case == "dst-is-parent-of-src":
        src = _copy(folder, tmp_path)
        dst = tmp_path
    elif case == "dst-unwritable":
        if os.geteuid() == 0:
            dst = "/proc/streamload-out"  # not even root can create a directory there
        else:
            (tmp_path / "ro").mkdir(mode=0o555)
            dst = tmp_path / "ro" / "out"
    elif case == "dst-url-without-bucket":
        dst = "s3://"
    args = ["convert", str(src), str(dst), "--no-progress", *extra]
    if "--shard-size" not in extra and "--samples-per-shard" not in extra:
        args += ["--samples-per-shard", "5"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamload convert: error: ") and "Traceback" not in err, err
    if case == "dst-is-a-file":
        assert Path(dst).read_text() == "a file"


@pytest.mark.parametrize("case", ["huge-seed", "linked-class-outside", "many-workers-few-shards"])
def test_unusual_but_valid_input_converts(folder: Path, tmp_path: Path, case: str) -> None:
    src = _copy(folder, tmp_path)
    extra: list[str] = []
    expected = 24
    if case == "huge-seed":
        extra = ["--shuffle", "--seed", str(10**30)]
    elif case == "linked-class-outside":
        # A class folder that is a symlink to outside SRC is followed (documented).
        outside = tmp_path / "outside"
        _write_images(outside, ["p.jpg", "q.jpg"])
        (src / "zz_linked").symlink_to(outside)
        expected = 26
    elif case == "many-workers-few-shards":
        extra = ["--workers", "64", "--samples-per-shard", "20"]
    out = tmp_path / "out"
    assert _convert(src, out, *extra) == 0
    assert StreamingDataset(str(out)).num_samples == expected
    assert _verify(out) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_fifo_among_the_images_never_hangs(folder: Path, tmp_path: Path, on_error: str, capsys) -> None:
    src = _copy(folder, tmp_path)
    os.mkfifo(src / "class_000" / "zz.jpg")
    code = _convert(src, tmp_path / "out", "--on-error", on_error)
    assert code == (2 if on_error == "raise" else 0)
    assert "zz.jpg" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_file_replaced_by_a_fifo_after_the_scan_never_hangs(folder: Path, tmp_path: Path) -> None:
    src = _copy(folder, tmp_path)
    source = ImageFolderSource(str(src), check="none")
    scan = source.scan()
    victim = src / "class_001" / "img_000000.jpg"
    victim.unlink()
    os.mkfifo(victim)
    item = next(i for i in scan.items if getattr(i, "relpath", "") == "class_001/img_000000.jpg")
    with pytest.raises(SourceError, match="regular file"):
        source.load(item)


def test_a_failed_start_leaves_no_empty_destination(tmp_path: Path) -> None:
    src = _src_with_only_empty_classes(tmp_path)
    out = tmp_path / "out"
    assert _convert(src, out) == 2
    assert not out.exists()


def test_resume_with_another_image_check_is_refused(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    from streamload.converters import journal

    with pytest.MonkeyPatch.context() as m:
        m.setattr(journal.Journal, "finish", lambda self: None)
        assert _convert(folder, out) == 0  # --check none (FAST)
    (out / MANIFEST_NAME).unlink()  # as if killed before the manifest
    args = ["convert", str(folder), str(out), "--samples-per-shard", "5", "--no-progress", "--resume"]
    assert main([*args, "--check", "decode"]) == 2  # would mix shards checked two ways
    assert main([*args, "--check", "none"]) == 0


def test_a_corrupt_journal_marker_is_redone_not_a_crash(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    reference = tmp_path / "ref"
    assert _convert(folder, reference) == 0
    from streamload.converters import journal

    with pytest.MonkeyPatch.context() as m:
        m.setattr(journal.Journal, "finish", lambda self: None)
        assert _convert(folder, out) == 0
    (out / MANIFEST_NAME).unlink()  # as if killed before the manifest
    (out / "_done-shard-000002.tar.json").write_text("{not json")
    assert _convert(folder, out, "--resume") == 0
    assert _files(out) == _files(reference)


def test_the_convert_api_refuses_a_destination_being_written(folder: Path, tmp_path: Path) -> None:
    from streamload.storage import open_destination

    out = tmp_path / "out"
    dest = open_destination(str(out))
    from streamload import DestinationBusyError

    with dest.lock(), pytest.raises(DestinationBusyError, match=f"another conversion.*pid {os.getpid()}"):
        convert(ImageFolderSource(str(folder), check="none"), str(out), ConvertOptions(progress=False))
    with pytest.raises(ConfigError):  # the lock is free again: a plain refusal of other kind
        (out / "junk").write_text("x")
        convert(ImageFolderSource(str(folder), check="none"), str(out), ConvertOptions(progress=False))
