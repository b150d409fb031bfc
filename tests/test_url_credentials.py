"""A password in a URL is never shown: ``http://alice:PW@host/...`` is written ``http://alice:***@host/...``.

The dataset is served over HTTP on loopback (``tests/lying_server.py``) and opened at a URL
carrying a user and password (aiohttp sends them as basic authentication). The password
must appear in no log line (the cache's INFO line, retry and skip WARNINGs), no error
message (``CorruptShardError``, ``StorageError`` and the errors chained to them), no
``repr``, and nothing ``info``, ``info --json``, ``show`` or ``verify`` print.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamload import (
    CorruptShardError,
    DatasetWriter,
    ShardedDataset,
    StorageConfig,
    StorageError,
    Stream,
    StreamingDataset,
)
from streamload.cli import main
from tests.lying_server import LyingServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PASSWORD = "S3cret-PW_42"
SHARDS = 4
PER_SHARD = 5


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 2000 + i, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("creds-ds")
    with DatasetWriter(str(root), format="tar", max_samples=PER_SHARD) as writer:
        for i in range(SHARDS * PER_SHARD):
            writer.write({"__key__": f"s{i:03d}", "bin": _payload(i), "cls": b"1"})
    return {f"/ds/{p.name}": p.read_bytes() for p in root.iterdir() if p.is_file()}


@pytest.fixture
def server(objects: dict[str, bytes]) -> Iterator[LyingServer]:
    srv = LyingServer(objects)
    yield srv
    srv.stop()


def _url(server: LyingServer) -> str:
    return server.url.replace("http://", f"http://alice:{PASSWORD}@") + "/ds"


def _storage(tmp_path: Path, **extra: object) -> StorageConfig:
    return StorageConfig(cache_dir=str(tmp_path / "cache"), retry_timeout=0.5, **extra)  # type: ignore[arg-type]


def _chain_text(exc: BaseException) -> str:
    out, node = [], exc
    while node is not None:
        out.append(f"{type(node).__name__}: {node} {node.args!r}")
        node = node.__cause__ or node.__context__
    return "\n".join(out)


def test_redact_replaces_only_the_password() -> None:
    from streamload._redact import redact

    assert redact("GET http://alice:pw@host:8080/ds/x.tar failed") == "GET http://alice:***@host:8080/ds/x.tar failed"
    assert redact("'s3a://k:p%2Fq@b/x' and https://bob:a:b@h/") == "'s3a://k:***@b/x' and https://bob:***@h/"
    for unchanged in ("http://host:8080/a@b", "http://***@host/x", "mail me at a@b.c", "/data/x:y@z"):
        assert redact(unchanged) == unchanged


def test_a_token_given_as_the_user_is_replaced_whole() -> None:
    # https://TOKEN@host (a GitHub- or Hugging Face-style token as the user name, no password):
    # the user information is the secret, as pip and git take it.
    from streamload._redact import redact

    token = "ghp_16C7e42F292c6912E7710c838347Ae178B4a"
    assert redact(f"GET https://{token}@github.com/o/r/x.tar failed") == "GET https://***@github.com/o/r/x.tar failed"
    assert redact(f"'https://{token}@h/a' and http://bob:pw@h/b") == "'https://***@h/a' and http://bob:***@h/b"
    assert token not in redact(f"s3://{token}@bucket/x")


def test_reading_sends_the_credentials_and_shows_them_nowhere(
    server: LyingServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = _url(server)
    with caplog.at_level(logging.DEBUG, logger="streamload"):
        ds = StreamingDataset(url, storage=_storage(tmp_path))
        assert len(list(ds)) == SHARDS * PER_SHARD
        shown = repr(ds) + repr(ShardedDataset(url, storage=_storage(tmp_path))) + repr(Stream(url, weight=1.0))
    token = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    assert {r.headers.get("authorization") for r in server.requests} == {f"Basic {token}"}
    assert "alice:***@" in caplog.text and "alice:***@" in shown  # the INFO cache line names the dataset
    assert PASSWORD not in caplog.text + shown


def test_errors_and_warnings_show_no_password(
    objects: dict[str, bytes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    damaged = dict(objects)
    shard = bytearray(damaged["/ds/shard-000002.tar"])
    shard[1500] ^= 0xFF  # in a sample's bytes: the download fails its digest
    damaged["/ds/shard-000002.tar"] = bytes(shard)
    server = LyingServer(damaged)
    try:
        url = _url(server)
        with caplog.at_level(logging.DEBUG, logger="streamload"):
            skipping = StreamingDataset(url, storage=_storage(tmp_path), on_error="skip")
            assert len(list(skipping)) == SHARDS * PER_SHARD and skipping.skipped_samples == PER_SHARD
            with pytest.raises(CorruptShardError) as corrupt:
                list(StreamingDataset(url, storage=_storage(tmp_path / "2")))
            server.status = 503
            with pytest.raises(StorageError) as unavailable:
                StreamingDataset(url, storage=_storage(tmp_path / "3"))
    finally:
        server.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("shard-000002.tar" in w for w in warnings)  # the skip
    assert any("retrying" in w for w in warnings)  # the 503
    assert "alice:***@" in str(corrupt.value) and "alice:***@" in str(unavailable.value)
    for text in (caplog.text, _chain_text(corrupt.value), _chain_text(unavailable.value)):
        assert PASSWORD not in text


def test_the_command_line_shows_no_password(
    server: LyingServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _url(server)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["info", url]) == 0
    assert main(["info", url, "--json"]) == 0
    assert main(["show", url, "0", *cache]) == 0
    assert main(["verify", url, *cache]) == 0
    server.status = 403
    assert main(["info", url]) != 0
    out, err = capsys.readouterr()
    assert out.count("alice:***@") >= 4 and "alice:***@" in err  # info, --json, show, verify; the error
    assert PASSWORD not in out + err


def test_a_bucket_without_credentials_is_one_line_saying_where_credentials_go(tmp_path: Path) -> None:
    # No credentials anywhere (environment, files, instance metadata): botocore refuses to sign;
    # the command says so in one line, not as a "bad request" or a traceback.
    import subprocess
    import sys

    from PIL import Image

    (tmp_path / "images" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "cat" / "a.jpg")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
        HOME=str(tmp_path),
    )
    out = subprocess.run(
        [sys.executable, "-m", "streamload", "convert", str(tmp_path / "images"), "s3://no-such-bucket/out"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "s3://no-such-bucket/out" in lines[0] and "no credentials found" in lines[0]
    assert "AWS_ACCESS_KEY_ID" in lines[0] and "Traceback" not in out.stderr
