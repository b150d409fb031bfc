"""Servers that answer a byte range with more than asked: nothing past the range is kept, in memory or on disk.

A ranged GET answered with megabytes more than asked (its ``Content-Length`` saying so), or
with ``200`` and the whole object (a server that ignores ``Range``), is a
``RangeResponseError`` naming the URL and both sizes, on every path that reads ranges:
botocore's client (the direct S3 path), s3fs, fsspec's HTTP filesystem, a cached
download's parts and streaming mode. A download's part file never grows past the bytes
reserved for it, and a 1-byte range never costs more than a little memory. The server is
a small loopback endpoint that lies on purpose (``tests/lying_server.py``).
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamload import RangeResponseError, StorageConfig, StreamingDataset
from streamload.storage.retry import RetryPolicy
from streamload.storage.transport import RemoteFiles, open_transport
from tests.lying_server import LyingServer

MIB = 1 << 20
#: What the lying server adds: far more than any bound asserted below.
LIE = 48 * MIB
BLOB = os.urandom(3 * MIB + 4321)


@pytest.fixture(scope="module")
def server() -> Iterator[LyingServer]:
    srv = LyingServer({"/bkt/d/blob.bin": BLOB})
    yield srv
    srv.stop()


@pytest.fixture
def liar(server: LyingServer) -> Iterator[LyingServer]:
    server.extra, server.ignore_range, server.tail = 0, False, 0
    server.requests.clear()
    yield server
    server.extra, server.ignore_range, server.tail = 0, False, 0


@pytest.fixture(params=["botocore", "s3fs"])
def s3(
    request: pytest.FixtureRequest, liar: LyingServer, monkeypatch: pytest.MonkeyPatch
) -> tuple[RemoteFiles, LyingServer]:
    """The blob's prefix on the lying server as S3, read by botocore's client or by s3fs; and the server."""
    monkeypatch.setenv("STREAMLOAD_S3_DIRECT", "1" if request.param == "botocore" else "0")
    settings = StorageConfig(storage_options=liar.s3_options()).resolve()  # the environment's s3_direct
    files = open_transport("s3://bkt/d", settings, retry=RetryPolicy(timeout=5))
    assert (files.direct is not None) == (request.param == "botocore")
    return files, liar


def _peak_while(func: object) -> tuple[BaseException | None, int]:
    """Run ``func``; return what it raised and the peak of Python memory it allocated meanwhile (all threads)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        try:
            func()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            return exc, tracemalloc.get_traced_memory()[1]
        return None, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_range_answered_with_more_bytes_is_refused_without_reading_them(s3: tuple[RemoteFiles, LyingServer]) -> None:
    s3_files, server = s3
    assert s3_files.get_range("blob.bin", 5, 6) == BLOB[5:6]  # the honest answer first
    server.extra = LIE
    error, peak = _peak_while(lambda: s3_files.get_range("blob.bin", 5, 6))
    assert isinstance(error, RangeResponseError), error
    message = str(error)
    assert "s3://bkt/d/blob.bin" in message and "(1 byte)" in message and str(LIE + 1) in message
    assert peak < 4 * MIB, f"a 1-byte range held {peak} bytes of memory"
    assert len(server.seen("GET", "blob.bin")) == 2  # refused at once: a lie is not retried


def test_a_server_that_ignores_range_is_named_as_such(s3: tuple[RemoteFiles, LyingServer]) -> None:
    s3_files, server = s3
    server.ignore_range, server.tail = True, LIE  # the object grew, and the whole of it comes back
    error, peak = _peak_while(lambda: s3_files.get_range("blob.bin", 1000, 1001))
    assert isinstance(error, RangeResponseError), error
    assert "ignored the Range header" in str(error) and "s3://bkt/d/blob.bin" in str(error)
    assert str(len(BLOB) + LIE) in str(error) and "shorter" not in str(error)
    assert peak < 4 * MIB, f"a 1-byte range held {peak} bytes of memory"


@pytest.mark.parametrize("lie", ["extra", "ignore_range"])
def test_a_download_part_never_grows_past_its_reserved_size(
    s3: tuple[RemoteFiles, LyingServer], tmp_path: Path, lie: str
) -> None:
    s3_files, server = s3
    part = tmp_path / "blob.bin.part"
    part.write_bytes(b"")
    assert s3_files.download("blob.bin", str(part), lambda: False, max_bytes=len(BLOB)) == len(BLOB)
    assert part.read_bytes() == BLOB
    if lie == "extra":
        server.extra = LIE
    else:
        server.ignore_range, server.tail = True, LIE
    with pytest.raises(RangeResponseError, match="s3://bkt/d/blob.bin") as caught:
        s3_files.download("blob.bin", str(part), lambda: False, max_bytes=len(BLOB))
    assert str(len(BLOB) + LIE) in str(caught.value) or str(LIE) in str(caught.value)
    assert part.stat().st_size <= len(BLOB), "the part file grew past the bytes reserved for it"


def test_an_object_one_byte_longer_than_its_entry_writes_no_byte_past_it(
    s3: tuple[RemoteFiles, LyingServer], tmp_path: Path
) -> None:
    s3_files, server = s3
    server.tail = 1  # an honest server, a longer object: the last part's extra byte tells it
    part = tmp_path / "blob.bin.part"
    part.write_bytes(b"")
    with pytest.raises(Exception, match="longer than the") as caught:
        s3_files.download("blob.bin", str(part), lambda: False, max_bytes=len(BLOB))
    assert not isinstance(caught.value, RangeResponseError)  # the server did nothing wrong
    assert part.stat().st_size <= len(BLOB)


def test_http_streaming_from_a_server_that_ignores_range_says_so(
    liar: LyingServer, tar_dataset: Path, tmp_path: Path
) -> None:
    """``cache="none"`` over ``python -m http.server``-like serving: an error about Range, not a corrupt shard."""
    for path in tar_dataset.iterdir():
        liar.objects[f"/ds/{path.name}"] = path.read_bytes()
    liar.ignore_range = True
    storage = StorageConfig(cache="none", cache_dir=str(tmp_path / "cache"))
    ds = StreamingDataset(f"{liar.url}/ds", storage=storage)  # the manifest and sidecars come whole: fine
    with pytest.raises(RangeResponseError, match="ignored the Range header") as caught:
        next(iter(ds))
    assert f"{liar.url}/ds/shard-" in str(caught.value) and "shorter" not in str(caught.value)


def test_a_manifest_read_keeps_at_most_its_limit(liar: LyingServer) -> None:
    files = RemoteFiles(f"{liar.url}/bkt/d", {}, RetryPolicy(timeout=5))
    liar.extra = LIE
    error, peak = _peak_while(lambda: files.cat("blob.bin", max_bytes=10))
    assert isinstance(error, RangeResponseError), error
    assert peak < 4 * MIB
