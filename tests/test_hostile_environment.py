"""Hostile surroundings of a dataset: the cache folder, the network, the disk, the terminal, listing tables.

Cache bookkeeping names, links planted in the cache, cut and stalled bodies, a full disk,
terminal escapes in what a dataset or a folder shows, listing tables naming odd paths, and
smaller weak points (wrong key types, labels that do not fit, a stand-in from another stream)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from streamload import StorageConfig, StreamingDataset
from streamload._errors import CacheError, ConfigError, StorageError, StreamloadError
from streamload.storage.cache import ShardCache
from streamload.storage.retry import RetryPolicy, is_permanent, is_transient
from tests.faults import Fault, FaultyS3
from tests.helpers.cache_fills import file_entry, write_download
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.timeout(120)

SIZE = 1000


class _ViaCache(LocalFileSystem):  # type: ignore[misc]
    """Local files under a protocol of their own (``viacache://``), so a dataset here is read through the cache.

    (``local://`` is this machine's files to streamload, read in place like a path.)
    """

    protocol = ("viacache",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        text = str(path)
        return super()._strip_protocol(text[len("viacache://") :] if text.startswith("viacache://") else text)


fsspec.register_implementation("viacache", _ViaCache, clobber=True)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache directory (where a test passes none) is this test's own."""
    monkeypatch.setenv("STREAMLOAD_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.delenv("STREAMLOAD_CACHE_SHARED", raising=False)


def _fill(cache: ShardCache, name: str, data: bytes) -> str | None:
    pin = cache.pin(name)
    try:
        return cache.fill(file_entry(name, data), write_download(data))
    finally:
        pin.close()


def _in_thread(fn: Callable[[], object], timeout: float = 20) -> object:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not end in ``timeout``."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(_catch(fn)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "hung"
    return out[0]


def _catch(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed back to the test
        return exc


# -- 1. bookkeeping names that collide with shard names --------------------------------


def test_a_pinned_shard_named_like_another_shards_download_lock_does_not_hang(tmp_path: Path) -> None:
    """``s.tar.dl`` open (pinned) while ``s.tar`` is downloaded: their locks were one file."""
    cache = ShardCache(str(tmp_path / "c"), None)
    first = b"a" * SIZE
    assert _fill(cache, "s.tar.dl", first) is not None
    pin = cache.pin("s.tar.dl")  # open, as a reader holds it
    try:
        second = b"b" * SIZE
        path = _in_thread(lambda: _fill(cache, "s.tar", second))
        assert isinstance(path, str) and Path(path).read_bytes() == second
        assert Path(cache.data_path("s.tar.dl")).read_bytes() == first
    finally:
        pin.close()


def test_a_shard_read_through_a_local_url_named_like_a_lock_reads(tar_dataset: Path, tmp_path: Path) -> None:
    """The same through the reader: a ``viacache://`` dataset (via the cache), shards ``s.tar`` and ``s.tar.dl``."""
    import json
    import shutil

    from streamload import ShardedDataset

    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    manifest = json.loads((ds / "index.json").read_text())
    shards = manifest["shards"][:2]
    manifest["shards"] = shards
    manifest["num_samples"] = sum(s["samples"] for s in shards)
    for shard, new in zip(shards, ("s.tar.dl", "s.tar"), strict=True):
        (ds / shard["name"]).rename(ds / new)
        (ds / shard["sidecar"]["name"]).rename(ds / f"{new}.idx")
        shard["name"], shard["sidecar"]["name"] = new, f"{new}.idx"
    (ds / "index.json").write_text(json.dumps(manifest))
    reader = ShardedDataset(f"viacache://{ds}", storage=StorageConfig(cache_dir=str(tmp_path / "cache")))
    n = len(reader)

    def read_interleaved() -> int:
        first = reader[0]  # shard s.tar.dl stays open
        last = reader[n - 1]
        return len({first["__key__"], last["__key__"]})

    assert _in_thread(read_interleaved) == 2


def test_every_lock_wait_is_bounded_and_names_the_lock(tmp_path: Path) -> None:
    cache = ShardCache(str(tmp_path / "c"), None, lock_timeout=1)
    data = b"x" * SIZE
    lock = tmp_path / "c" / "downloads" / "s.tar"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process's download that never ends
        err = _in_thread(lambda: _fill(cache, "s.tar", data))
        assert isinstance(err, CacheError) and str(lock) in str(err) and "after 1 s" in str(err)
    finally:
        os.close(fd)
    fd = os.open(tmp_path / "c" / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        err = _in_thread(cache.usage)
        assert isinstance(err, CacheError) and ".lock" in str(err)
    finally:
        os.close(fd)
    assert _fill(cache, "s.tar", data) is not None


# -- 3. links planted in the cache --------------------------------------------------------


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_bytes(b"keep me")
    (victim / "s.tar").write_bytes(b"v" * SIZE)
    return victim


def _assert_untouched(victim: Path) -> None:
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt", "s.tar"]
    assert (victim / "precious.txt").read_bytes() == b"keep me"
    assert (victim / "s.tar").read_bytes() == b"v" * SIZE


@pytest.mark.parametrize("folder", ["tmp", "data", "pins", "downloads", "meta", "readers"])
def test_a_cache_folder_replaced_by_a_link_is_refused_and_nothing_outside_is_touched(
    tmp_path: Path, folder: str
) -> None:
    victim = _victim(tmp_path)
    root = tmp_path / "c"
    cache = ShardCache(str(root), 10 * SIZE)
    os.rmdir(root / folder)
    os.symlink(victim, root / folder)
    for action in (lambda: _fill(cache, "s.tar", b"n" * SIZE), cache.usage, cache.readers):
        try:
            action()
        except CacheError as exc:
            assert "link" in str(exc)
    with pytest.raises(CacheError, match="symbolic link"):
        ShardCache(str(root), 10 * SIZE)
    _assert_untouched(victim)


@pytest.mark.parametrize("where", ["pins/s.tar", "downloads/s.tar", ".lock", "meta/s.tar", "data/s.tar"])
def test_file_links_planted_in_the_cache_are_never_followed(tmp_path: Path, where: str) -> None:
    victim = _victim(tmp_path)
    root = tmp_path / "c"
    cache = ShardCache(str(root), 10 * SIZE)
    target = victim / "created-outside"
    os.symlink(victim / "s.tar" if where.startswith("data") else target, root / where)
    data = b"n" * SIZE
    try:
        path = _fill(cache, "s.tar", data)
        assert path is not None and Path(path).read_bytes() == data and not Path(path).is_symlink()
        cache.usage()
    except CacheError as exc:
        assert "symbolic link" in str(exc)
    assert not target.exists()
    _assert_untouched(victim)


def test_a_cache_folder_others_can_write_is_refused_unless_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(CacheError, match="others can write"):
        ShardCache(str(root), None)
    root.chmod(0o775)
    with pytest.raises(CacheError, match="STREAMLOAD_CACHE_SHARED"):
        ShardCache(str(root), None)
    monkeypatch.setenv("STREAMLOAD_CACHE_SHARED", "1")
    shared = StorageConfig().resolve().cache_shared  # the environment's default, applied once
    assert _fill(ShardCache(str(root), None, shared=shared), "s.tar", b"n" * SIZE) is not None
    root.chmod(0o777)
    with pytest.raises(CacheError, match="every user"):
        ShardCache(str(root), None, shared=shared)
    root.chmod(0o755)


# -- 4 and 5. bodies cut short, bodies that stall -----------------------------------------


@pytest.fixture(scope="module")
def bucket_tar(s3_server: SeaweedS3, tar_dataset: Path) -> str:
    """``tar_dataset`` copied into a bucket (directly, not through a proxy)."""
    bucket = s3_server.make_bucket()
    s3_server.filesystem().put(f"{tar_dataset}/", f"{bucket}/ds/", recursive=True)
    return f"s3://{bucket}/ds"


def test_a_cut_body_is_transient_whatever_code_it_carries() -> None:
    import aiohttp

    cut = aiohttp.http_exceptions.ContentLengthError("Not enough data to satisfy content length header.")
    try:
        raise aiohttp.ClientPayloadError("Response payload is not completed") from cut
    except aiohttp.ClientPayloadError as exc:
        assert is_transient(exc) and not is_permanent(exc)


#: The first shard's GETs (its sidecar's too: the match is a path substring).
SHARD0 = "shard-000000.tar"


@pytest.mark.parametrize("cache", ["shards", "none"])
def test_bodies_cut_short_several_times_are_retried(
    faulty_s3: FaultyS3, bucket_tar: str, cache: str, tmp_path: Path
) -> None:
    (cut,) = faulty_s3.inject(Fault("truncate", match=SHARD0, at=2000, times=5))
    ds = StreamingDataset(
        bucket_tar,
        storage=StorageConfig(storage_options=faulty_s3.storage_options(), cache=cache, cache_dir=str(tmp_path)),
        shuffle=False,
    )
    keys = [s["__key__"] for s in ds]
    assert len(keys) == len(set(keys)) == ds.num_samples
    assert cut.hits == 5


@pytest.mark.parametrize("cache", ["shards", "none"])
def test_a_body_that_stalls_for_ever_ends_in_an_error_naming_the_url(
    faulty_s3: FaultyS3, bucket_tar: str, cache: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMLOAD_READ_TIMEOUT", "1")
    monkeypatch.setenv("STREAMLOAD_RETRY_TIMEOUT", "3")
    (stall,) = faulty_s3.inject(Fault("stall", match=SHARD0, at=2000, seconds=30, times=10**6))
    ds = StreamingDataset(
        bucket_tar,
        storage=StorageConfig(storage_options=faulty_s3.storage_options(), cache=cache, cache_dir=str(tmp_path)),
        shuffle=False,
    )
    err = _in_thread(lambda: list(ds), timeout=60)
    assert isinstance(err, StorageError), err
    assert f"{bucket_tar}/shard-000000.tar" in str(err) and "unavailable" in str(err)
    assert stall.hits >= 2  # retried, within the budget


def test_the_timeouts_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RetryPolicy().inactivity_timeout == 30 and RetryPolicy().timeout == 120
    policy = StorageConfig().retry_policy()
    assert policy.inactivity_timeout == 30 and policy.timeout == 120
    monkeypatch.setenv("STREAMLOAD_READ_TIMEOUT", "2.5")
    monkeypatch.setenv("STREAMLOAD_RETRY_TIMEOUT", "7")
    policy = StorageConfig().retry_policy()
    assert policy.inactivity_timeout == 2.5 and policy.timeout == 7
    assert StorageConfig(read_timeout=4).retry_policy().inactivity_timeout == 4  # a field given wins
    monkeypatch.setenv("STREAMLOAD_READ_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="STREAMLOAD_READ_TIMEOUT"):
        StorageConfig().resolve()


# -- 6. a full cache disk -------------------------------------------------------------------


class _NearlyFullDisk:
    """``os.pwrite`` onto a disk with ``free`` bytes left: short writes, then ``ENOSPC`` (as the kernel does)."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.real = os.pwrite

    def __call__(self, fd: int, data: Any, offset: int) -> int:
        if self.free <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.real(fd, bytes(data)[: self.free], offset)
        self.free -= n
        return n


@pytest.mark.parametrize("free", [0, 32768])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_full_cache_disk_is_a_cache_error_never_a_corrupt_shard_nor_a_skip(
    tar_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int, on_error: str
) -> None:
    cache_dir = tmp_path / "cache"
    ds = StreamingDataset(
        f"viacache://{tar_dataset}",
        storage=StorageConfig(cache="shards", cache_dir=str(cache_dir)),
        on_error=on_error,
        shuffle=False,
    )
    monkeypatch.setattr(os, "pwrite", _NearlyFullDisk(free))
    with pytest.raises(CacheError) as caught:
        list(ds)
    message = str(caught.value)
    assert "no space left" in message and str(cache_dir) in message and "needed" in message
    assert "manifest says" not in message
    monkeypatch.undo()
    assert len(list(ds)) == ds.num_samples  # once there is room again


# -- 2. terminal escapes from an untrusted manifest ------------------------------------------

_ESCAPES = ["\x1b]0;owned\x07", "\x1b[2J\x1b[H", "\x1b]52;c;cm0gLXJmIH4=\x07", "\x9b31m", "a\u202eb", "x\ny"]


def _hostile_manifest_dataset(tar_dataset: Path, tmp_path: Path) -> Path:
    import json
    import shutil

    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    manifest = json.loads((ds / "index.json").read_text())
    manifest["classes"] = [f"class{i}{e}" for i, e in enumerate(_ESCAPES)] + manifest["classes"][len(_ESCAPES) :]
    manifest["meta"] = {**manifest.get("meta", {}), "appends": [{"source": "\x1b]52;c;Y2xpcA==\x07src"}]}
    manifest["skipped"] = [{"path": "\x1b[2Jbad.png", "error": "\x1b]0;title\x07broken"}]
    (ds / "index.json").write_text(json.dumps(manifest))
    return ds


def _assert_terminal_safe(text: str) -> None:
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", text), repr(text)


def test_info_and_show_escape_what_came_from_the_dataset(
    tar_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from streamload.cli import main

    ds = _hostile_manifest_dataset(tar_dataset, tmp_path)
    assert main(["info", str(ds)]) == 0
    out = capsys.readouterr()
    _assert_terminal_safe(out.out + out.err)
    assert "\\x1b]0;owned\\x07" in out.out and "\\x1b]52;c;Y2xpcA==" in out.out
    assert "class5x\\x0ay" in out.out  # a newline cannot forge a line
    assert main(["info", str(ds), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"][:6] == [f"class{i}{e}" for i, e in enumerate(_ESCAPES)]
    for index in range(0, 80, 16):  # samples of several classes: their labels are shown with the class name
        assert main(["show", str(ds), str(index), "--cache-dir", str(tmp_path / "c")]) == 0
        out = capsys.readouterr()
        _assert_terminal_safe(out.out + out.err)


def test_error_texts_from_a_dataset_stay_escaped(
    tar_dataset: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import json
    import shutil

    from streamload.cli import main

    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    manifest = json.loads((ds / "index.json").read_text())
    manifest["format"] = "\x1b]0;owned\x07tar"
    (ds / "index.json").write_text(json.dumps(manifest))
    assert main(["info", str(ds)]) == 2
    assert main(["verify", str(ds)]) != 0
    assert main(["show", str(ds), "0"]) == 2
    out = capfd.readouterr()
    _assert_terminal_safe(out.out + out.err)
    assert "\\x1b]0;owned" in out.err


# -- 7. listing tables that crashed convert; 8. --root ------------------------------------


def _png(path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (4, 4), (200, 10, 10)).save(path)


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_nul_byte_in_a_listed_path_is_an_input_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, on_error: str
) -> None:
    import json

    from streamload.cli import main

    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png")
    table = tmp_path / f"t.{kind}"
    if kind == "jsonl":
        table.write_text(json.dumps({"path": "a.png", "label": 0}) + "\n" + json.dumps({"path": "b\0.png", "label": 1}))
    else:
        table.write_text('path,label\na.png,0\n"b\0.png",1\n')
    code = main(["convert", str(table), str(tmp_path / "out"), "--on-error", on_error, "--no-progress"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "NUL byte" in err
    assert err.count(str(table)) == 1  # named once, not "t.jsonl//tmp/.../t.jsonl"
    assert code == (0 if on_error == "skip" else 2)


@pytest.mark.parametrize("header", ["path,label,path", "path,label,label"])
def test_a_csv_header_naming_a_column_twice_is_one_clear_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], header: str
) -> None:
    from streamload.cli import main

    _png(tmp_path / "a.png")
    table = tmp_path / "t.csv"
    table.write_text(f"{header}\na.png,0,x\n")
    assert main(["convert", str(table), str(tmp_path / "out"), "--on-error", "skip", "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert "more than once" in err and "Traceback" not in err and "terminate" not in err


def test_root_confines_the_paths_a_table_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from streamload import ShardedDataset
    from streamload.cli import main

    images = tmp_path / "images"
    images.mkdir()
    _png(images / "a.png")
    _png(tmp_path / "secret.png")
    (images / "link.png").symlink_to(tmp_path / "secret.png")
    rows = [
        "a.png",
        "../secret.png",
        str(tmp_path / "secret.png"),
        f"file://{tmp_path / 'secret.png'}",
        "link.png",
        "s3://other-bucket/x.png",
        f"file://{images / 'a.png'}",
    ]
    table = images / "t.jsonl"
    table.write_text("\n".join(json.dumps({"path": p, "label": 0}) for p in rows))
    out = tmp_path / "out"
    args = ["convert", str(table), str(out), "--root", str(images), "--on-error", "skip", "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("outside --root") == 5, err
    assert len(ShardedDataset(str(out))) == 2


# -- 8. weaker points -----------------------------------------------------------------------


def test_an_endpoint_from_the_environment_is_part_of_the_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload.storage.cachedir import dataset_cache_key

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    plain = dataset_cache_key("s3://b/x", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://one:9000")
    one = dataset_cache_key("s3://b/x", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://two:9000")
    two = dataset_cache_key("s3://b/x", {})
    assert len({plain, one, two}) == 3
    assert dataset_cache_key("s3://b/x", {"client_kwargs": {"endpoint_url": "http://one:9000"}}) == one


def test_sharded_dataset_refuses_keys_and_indices_of_the_wrong_type(tar_dataset: Path) -> None:
    from streamload import ShardedDataset

    ds = ShardedDataset(str(tar_dataset))
    for wrong in (5, None, b"key", 1.5):
        with pytest.raises(TypeError, match="keys are strings"):
            ds.get(wrong)  # type: ignore[arg-type]
    for flag in (True, False):
        with pytest.raises(TypeError, match="not bool"):
            ds[flag]
        with pytest.raises(TypeError, match="not bool"):
            ds[0:4][flag]
    assert ds.get(ds[1]["__key__"])["__key__"] == ds[1]["__key__"]


@pytest.mark.parametrize("label", [2**70, 2**63])
def test_a_label_that_does_not_fit_int64_is_refused_at_convert_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], label: int
) -> None:
    from streamload import ShardedDataset
    from streamload.cli import main

    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png")
    table = tmp_path / "t.csv"
    table.write_text(f"path,label\na.png,0\nb.png,{label}\n")
    out = tmp_path / "out"
    assert main(["convert", str(table), str(out), "--no-progress"]) == 2
    assert "does not fit in 64 bits" in capsys.readouterr().err
    assert main(["convert", str(table), str(tmp_path / "skip"), "--no-progress", "--on-error", "skip"]) == 0
    ds = ShardedDataset(str(tmp_path / "skip"))
    assert len(ds) == 1 and ds[0]["cls"] == b"0"


def test_a_stand_in_for_a_skipped_sample_comes_from_its_own_stream(
    tar_dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil
    from collections import Counter

    from streamload import Stream

    broken = tmp_path / "b"
    shutil.copytree(tar_dataset, broken)
    for name in ("shard-000001.tar", "shard-000002.tar"):
        shard = broken / name
        data = bytearray(shard.read_bytes())
        data[512] ^= 0x01  # the first sample's first field
        shard.write_bytes(bytes(data))
    sources = [Stream(str(tar_dataset), repeat=1, name="a"), Stream(str(broken), repeat=1, name="b")]
    ds = StreamingDataset(sources, on_error="skip", shuffle=False)
    with caplog.at_level("WARNING", logger="streamload"):
        counts = Counter(s["__source__"] for s in ds)
    n = StreamingDataset(str(tar_dataset)).num_samples
    assert ds.skipped_samples == 2
    assert counts == {"a": n, "b": n}
    assert "first key None" not in caplog.text and "skipping" in caplog.text


def test_messages_name_a_url_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from streamload.cli import main
    from streamload.converters.bucket import read_url

    with pytest.raises(StreamloadError) as caught:
        read_url("nosuchproto://b/x.png")
    assert str(caught.value).count("nosuchproto://b/x.png") == 1, caught.value
    _png(tmp_path / "a.png")
    table = tmp_path / "t.jsonl"
    missing = f"memory://{tmp_path.name}/missing.png"
    table.write_text(json.dumps({"path": "a.png", "label": 0}) + "\n" + json.dumps({"path": missing, "label": 0}))
    assert main(["convert", str(table), str(tmp_path / "out"), "--on-error", "skip", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count(missing) == 1 and err.count(str(table)) == 1, err


def test_a_destination_lock_planted_as_a_link_is_refused_and_its_target_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.cli import main
    from streamload.storage.locks import LOCAL_LOCK_NAME

    images = tmp_path / "images" / "cat"
    images.mkdir(parents=True)
    _png(images / "a.png")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCAL_LOCK_NAME).symlink_to(victim)
    assert main(["convert", str(tmp_path / "images"), str(out), "--no-progress"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "keep me"


def test_file_names_from_an_image_folder_are_escaped_when_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.cli import main

    images = tmp_path / "images" / "cat"
    images.mkdir(parents=True)
    _png(images / "a.png")
    (images / "\x1b]0;owned\x07.png").write_bytes(b"not an image")
    assert (
        main(["convert", str(tmp_path / "images"), str(tmp_path / "out"), "--on-error", "skip", "--no-progress"]) == 0
    )
    out = capsys.readouterr()
    _assert_terminal_safe(out.out + out.err)
    assert "\\x1b]0;owned\\x07.png" in out.err


def test_a_group_writable_umask_makes_no_group_writable_cache(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        cache = ShardCache(str(tmp_path / "c"), None)
        assert _fill(cache, "s.tar", b"n" * SIZE) is not None
    finally:
        os.umask(old)
    for folder in [tmp_path / "c", *(tmp_path / "c").iterdir()]:
        if folder.is_dir():
            assert not folder.stat().st_mode & 0o022, folder


def test_a_dataset_without_hashes_rewritten_at_the_same_url_is_not_served_stale(
    tar_dataset: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    from streamload import ShardedDataset

    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    manifest = json.loads((ds / "index.json").read_text())
    manifest["hash"] = None
    for shard in manifest["shards"]:
        shard["hash"] = None
        shard["sidecar"]["hash"] = None
    (ds / "index.json").write_text(json.dumps(manifest))
    a, b = "shard-000005.tar", "shard-000006.tar"
    assert (ds / a).stat().st_size == (ds / b).stat().st_size
    assert (ds / f"{a}.idx").stat().st_size == (ds / f"{b}.idx").stat().st_size

    def keys() -> list[str]:
        reader = ShardedDataset(f"viacache://{ds}", storage=StorageConfig(cache_dir=str(tmp_path / "cache")))
        try:
            return [reader.key_of(i) for i in range(len(reader))] + [reader[i]["__key__"] for i in range(len(reader))]
        finally:
            reader.close()

    before = keys()
    for name in (a, f"{a}.idx"):  # the same names and sizes, other bytes: a rewrite
        other = name.replace(a, b)
        os.rename(ds / name, ds / "swap")
        os.rename(ds / other, ds / name)
        os.rename(ds / "swap", ds / other)
    after = keys()
    assert after != before
    assert after == [ShardedDataset(str(ds)).key_of(i) for i in range(len(after) // 2)] * 2
