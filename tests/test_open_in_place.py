"""A local tar shard opened in one native call: its files checked, the shard opened, the sidecar read.

Opened in Python, a shard makes a dozen system calls (stat, lstat, open, fstat, fcntl, read,
close, two header preads), each a release of the GIL that, beside a thread running Python,
may wait up to the switch interval to be taken back. ``_gather.open_files`` does the checks
and the opening in one release, and the headers are read in one more call (none when cached).
The checks must be the same as the Python path's: regular files only (a FIFO never blocks),
a symbolic link only inside the dataset, the manifest's sizes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from streamload import CorruptShardError, ShardNotFoundError, StorageError, UnsafeShardError, _pread
from streamload.dataref import DatasetRef
from streamload.labels import parse_labels
from streamload.shards import ShardSource
from tests.helpers.datasets import make_dataset

pytestmark = pytest.mark.skipif(
    _pread._module() is None or not hasattr(_pread._module(), "open_files"),
    reason="the _gather extension is not built (setup.py build_ext)",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("inplace") / "ds", [20, 20, 20])


def _samples(root: Path) -> list[dict[str, bytes]]:
    ref = DatasetRef.open(str(root))
    out = []
    with ShardSource(ref, ref.open_storage(), own_storage=True) as source:
        for shard, entry in enumerate(ref.manifest.shards):
            reader = source.get(shard)
            out += [dict(reader.get(i)) for i in range(entry.num_samples)]
    return out


def test_open_files_reports_each_file_as_it_is(tmp_path: Path) -> None:
    data = os.urandom(5000)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "big").write_bytes(b"x" * 100)
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    paths = [str(tmp_path / n) for n in ("a", "a", "big", "missing", "dir", "fifo", "link")]
    got = _pread.open_files(paths, [True, False, True, True, False, False, True], [5000, 0, 99, 10, 0, 0, 5000])
    assert got is not None
    read, kept, big, missing, folder, fifo, link = got
    assert (read.error, read.fd, read.size, read.link, read.data) == (0, -1, 5000, False, data)
    assert kept.error == 0 and kept.fd >= 0 and kept.data is None and stat.S_ISREG(kept.mode)
    try:
        assert os.pread(kept.fd, 10, 100) == data[100:110]
        assert os.get_blocking(kept.fd)  # opened non-blocking, handed over blocking
    finally:
        os.close(kept.fd)
    assert (big.error, big.fd, big.size, big.data) == (0, -1, 100, None)  # over its limit: not read
    assert (missing.error, missing.fd) == (errno.ENOENT, -1)
    assert folder.fd == -1 and stat.S_ISDIR(folder.mode)  # never opened
    assert fifo.fd == -1 and stat.S_ISFIFO(fifo.mode) and fifo.error == 0  # never opened, so never blocked
    assert link.link and link.data == data


def test_open_files_refuses_bad_arguments(tmp_path: Path) -> None:
    module = _pread._module()
    assert module is not None
    with pytest.raises(ValueError, match="same length"):
        module.open_files([b"/x"], [True, False], [1])
    with pytest.raises(ValueError, match="without NUL"):
        module.open_files([b"/x\0y"], [True], [1])
    with pytest.raises(ValueError, match="without NUL"):
        module.open_files(["/x"], [True], [1])
    assert module.open_files([], [], []) == []


def test_a_shard_opens_in_one_call_and_reads_what_the_python_path_reads(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = DatasetRef.open(str(dataset))
    module = _pread._module()
    calls: dict[str, int] = {}

    def counting(name: str, real: object) -> object:
        def wrapped(*args: object, **kwargs: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)  # type: ignore[operator]

        return wrapped

    with ShardSource(ref, ref.open_storage(), own_storage=True) as source:
        for name in ("open", "stat", "lstat", "fstat", "read", "pread", "close"):
            monkeypatch.setattr(os, name, counting(name, getattr(os, name)))
        monkeypatch.setattr(_pread, "_module", lambda: _Counted(module, calls))
        for shard in range(len(ref.manifest.shards)):
            source.get(shard)
        monkeypatch.undo()
    shards = len(ref.manifest.shards)
    # one call a shard for its files, one for its two tar headers; no os call at all
    assert calls == {"open_files": shards, "pread_gather": shards}, calls
    fast = _samples(dataset)
    monkeypatch.setattr(_pread, "open_files", lambda *a: None)  # the Python path
    from streamload.storage import base

    monkeypatch.setattr(base, "open_files", lambda *a: None)
    assert _samples(dataset) == fast
    assert [s["__key__"] for s in fast] == [f"s{i}_{j}" for i in range(3) for j in range(20)]
    assert [s["txt"] for s in fast] == [f"{i}-{j}".encode() for i in range(3) for j in range(20)]


class _Counted:
    def __init__(self, module: object, calls: dict[str, int]) -> None:
        self.module, self.calls = module, calls

    def __getattr__(self, name: str) -> object:
        real = getattr(self.module, name)
        if name not in ("open_files", "pread_gather"):
            return real

        def wrapped(*args: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(*args)

        return wrapped


def _copy(dataset: Path, dest: Path) -> tuple[Path, Path, Path]:
    import shutil

    shutil.copytree(dataset, dest)
    ref = DatasetRef.open(str(dest))
    entry = ref.manifest.shards[0]
    assert entry.sidecar is not None
    return dest, dest / entry.name, dest / entry.sidecar.name


def _open_first(root: Path) -> None:
    ref = DatasetRef.open(str(root))
    with ShardSource(ref, ref.open_storage(), own_storage=True) as source:
        source.get(0).get(0)


def test_a_missing_shard_or_sidecar_is_named(dataset: Path, tmp_path: Path) -> None:
    root, shard, sidecar = _copy(dataset, tmp_path / "ds")
    sidecar.unlink()
    with pytest.raises(ShardNotFoundError, match=f"{sidecar.name} does not exist"):
        _open_first(root)
    shard.unlink()
    with pytest.raises(ShardNotFoundError, match=f"{shard.name} does not exist"):
        _open_first(root)


def test_a_fifo_in_place_of_a_sidecar_is_refused_not_waited_on(dataset: Path, tmp_path: Path) -> None:
    root, _shard, sidecar = _copy(dataset, tmp_path / "ds")
    sidecar.unlink()
    os.mkfifo(sidecar)
    with pytest.raises(UnsafeShardError, match="not a regular file"):
        _open_first(root)


def test_a_link_inside_the_dataset_is_read_and_one_out_of_it_refused(dataset: Path, tmp_path: Path) -> None:
    root, shard, _sidecar = _copy(dataset, tmp_path / "ds")
    inside = root / "elsewhere.bin"
    shard.rename(inside)
    shard.symlink_to(inside)
    _open_first(root)
    outside = tmp_path / "outside.bin"
    inside.rename(outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(UnsafeShardError, match="symbolic link out of the dataset directory"):
        _open_first(root)


def test_a_shard_or_sidecar_of_another_size_is_corrupt(dataset: Path, tmp_path: Path) -> None:
    root, shard, sidecar = _copy(dataset, tmp_path / "ds")
    with open(sidecar, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptShardError, match=f"{sidecar.name}: .* bytes on disk, the manifest says"):
        _open_first(root)
    root, shard, sidecar = _copy(dataset, tmp_path / "ds2")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 512)
    with pytest.raises(CorruptShardError, match=f"{shard.name}: .* bytes on disk, the manifest says"):
        _open_first(root)


def test_an_unreadable_sidecar_is_a_storage_error(dataset: Path, tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root reads whatever the mode says: a directory in its place cannot be opened
        root, _shard, sidecar = _copy(dataset, tmp_path / "ds")
        sidecar.unlink()
        sidecar.mkdir()
        with pytest.raises(UnsafeShardError, match="not a regular file"):
            _open_first(root)
        return
    root, _shard, sidecar = _copy(dataset, tmp_path / "ds")
    sidecar.chmod(0)
    with pytest.raises(StorageError, match=f"cannot read .*{sidecar.name}"):
        _open_first(root)


def test_a_damaged_sidecar_read_in_one_call_is_named(dataset: Path, tmp_path: Path) -> None:
    root, _shard, sidecar = _copy(dataset, tmp_path / "ds")
    raw = bytearray(sidecar.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    sidecar.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match="shard-000000"):
        _open_first(root)


def test_pread_blocks_reads_each_block_and_short_at_the_end(tmp_path: Path) -> None:
    data = os.urandom(3000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _pread.pread_blocks(fd, [0, 1000, 2800], 512) == [data[:512], data[1000:1512], data[2800:]]
    finally:
        os.close(fd)


def test_labels_parse_exactly_up_to_eighteen_digits_in_many_labels() -> None:
    rng = np.random.default_rng(3)
    labels = [int(x) for x in rng.integers(0, 10**18, 3000)] + [0, 10**18 - 1, 7, 999_999_999_999_999_999]
    text = [str(v).encode() for v in labels]
    raw = np.frombuffer(b"".join(text), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in text])]).astype(np.int64)
    assert parse_labels(raw, offsets, str, "cls").tolist() == labels
