"""Where a manifest read from a URL may send its readers (``data_root``), and with which credentials.

A manifest kept apart from its files names them by ``data_root``. Read from a URL, it may
name only files under its own scheme and host (bucket): never local files, however
spelled (a path, ``file:``, ``file://``, ``local://`` with or without a leading slash,
upper case, an fsspec chain), and another host only when the caller names it
(``StorageConfig(allow_data_roots=...)`` or ``--allow-data-root``). The dataset's
``storage_options`` (its token) never go to another host unless the caller gives them for
it. The servers are small loopback endpoints that record every request
(``tests/lying_server.py``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import streamload._validate
from streamload import ManifestError, ShardedDataset, StorageConfig
from streamload.cli import main
from streamload.dataref import DatasetRef
from streamload.indexing import index_directory
from streamload.storage import is_local, local_path_of
from tests.lying_server import LyingServer

TOKEN = "Bearer the-datasets-own-token"
ROWS = 12


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (i * 20, 0, 255 - i * 20)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Parquet file of 12 JPEG rows, indexed in place (index.json and its sidecar beside it)."""
    root = tmp_path_factory.mktemp("pq") / "files"
    root.mkdir()
    table = pa.table({"jpg": [_jpeg(i) for i in range(ROWS)], "label": [i % 2 for i in range(ROWS)]})
    pq.write_table(table, root / "part-0.parquet", row_group_size=4)
    index_directory(str(root), "parquet", image_column="jpg", label_column="label")
    return root


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LyingServer, LyingServer]]:
    """Two hosts: ``a`` serves the index, ``b`` is somewhere else."""
    a, b = LyingServer(), LyingServer()
    yield a, b
    a.stop()
    b.stop()


def _publish(server: LyingServer, prefix: str, parquet_dir: Path, data_root: str) -> None:
    """Serve the index and sidecar of ``parquet_dir`` under ``prefix``, the manifest naming ``data_root``."""
    for path in parquet_dir.iterdir():
        if path.name != "index.json" and not path.name.endswith(".parquet"):
            server.objects[f"{prefix}/{path.name}"] = path.read_bytes()
    manifest = json.loads((parquet_dir / "index.json").read_text())
    manifest["data_root"] = data_root
    server.objects[f"{prefix}/index.json"] = json.dumps(manifest).encode()


def _serve_files(server: LyingServer, prefix: str, parquet_dir: Path) -> None:
    for path in parquet_dir.glob("*.parquet"):
        server.objects[f"{prefix}/{path.name}"] = path.read_bytes()


def test_one_is_local_knows_every_local_spelling() -> None:
    for url in ("/data/x", "rel/x", "file:///data/x", "FILE:///data/x", "local:///data/x", "local://data/x"):
        assert is_local(url), url
    for url in ("s3://b/x", "http://h/x", "memory://x", "simplecache::file:///data/x"):
        assert not is_local(url), url
    assert local_path_of("local:///data/x") == "/data/x" and local_path_of("File:///data/x") == "/data/x"
    assert streamload._validate.is_local is is_local  # the argument checks ask the same function


def test_a_manifest_from_a_url_never_reaches_local_files(
    servers: tuple[LyingServer, LyingServer], parquet_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = servers
    monkeypatch.chdir("/")  # fsspec's local:// resolves a relative path against the working directory
    here = str(parquet_dir)
    spellings = [
        f"local://{here.lstrip('/')}",
        f"local://{here}",
        f"file://{here}",
        f"FILE://{here}",
        f"file:{here}",
        here,
        f"simplecache::file://{here}",
        f"simplecache::local://{here.lstrip('/')}",
    ]
    for i, root in enumerate(spellings):
        _publish(a, f"/local{i}", parquet_dir, root)
        storage = StorageConfig(cache_dir=str(tmp_path / "cache"))
        with pytest.raises(ManifestError) as caught:
            DatasetRef.open(f"{a.url}/local{i}", storage)
        assert "data_root" in str(caught.value), root
    copied = [p.name for p in (tmp_path / "cache").rglob("*.parquet")] if (tmp_path / "cache").exists() else []
    assert copied == []  # no local file was copied into the cache


def test_a_manifest_from_a_url_sends_readers_only_to_its_own_host(
    servers: tuple[LyingServer, LyingServer], parquet_dir: Path, tmp_path: Path
) -> None:
    a, b = servers
    a.requests.clear()
    b.requests.clear()
    _serve_files(a, "/same/data", parquet_dir)
    _publish(a, "/same/index", parquet_dir, f"{a.url}/same/data")
    _serve_files(b, "/elsewhere", parquet_dir)
    _publish(a, "/far", parquet_dir, f"{b.url}/elsewhere")
    options = {"headers": {"Authorization": TOKEN}}

    # its own host: read, with its own options
    ds = ShardedDataset(f"{a.url}/same/index", storage=StorageConfig(storage_options=options, cache_dir=str(tmp_path)))
    assert len(ds) == ROWS and ds[3]["jpg"] == _jpeg(3)
    assert {r.headers.get("authorization") for r in a.seen("GET")} == {TOKEN}

    # another host: refused before any request reaches it, naming the root and the way to allow it
    storage = StorageConfig(storage_options=options, cache_dir=str(tmp_path))
    with pytest.raises(ManifestError, match="allow_data_roots") as caught:
        ShardedDataset(f"{a.url}/far", storage=storage)
    assert f"{b.url}/elsewhere" in str(caught.value)
    assert b.requests == []

    # named by the caller: read, without the dataset's token
    allowed = StorageConfig(storage_options=options, cache_dir=str(tmp_path), allow_data_roots=[f"{b.url}/elsewhere"])
    ds = ShardedDataset(f"{a.url}/far", storage=allowed)
    assert len(ds) == ROWS and ds[5]["jpg"] == _jpeg(5)
    assert b.seen("GET") and all("authorization" not in r.headers for r in b.requests)

    # ... or with the options the caller gives for that root
    b.requests.clear()
    theirs = {"headers": {"Authorization": "Bearer theirs"}}
    given = StorageConfig(
        storage_options=options, cache_dir=str(tmp_path / "c2"), allow_data_roots={f"{b.url}/elsewhere": theirs}
    )
    ds = ShardedDataset(f"{a.url}/far", storage=given)
    assert ds[7]["jpg"] == _jpeg(7)
    assert {r.headers.get("authorization") for r in b.requests} == {"Bearer theirs"}


def test_a_bucket_manifest_may_not_send_its_credentials_to_another_url(
    servers: tuple[LyingServer, LyingServer], parquet_dir: Path, tmp_path: Path
) -> None:
    a, b = servers
    b.requests.clear()
    _publish(a, "/bkt/ds", parquet_dir, f"{b.url}/latest/meta-data")
    options = a.s3_options(token="the-buckets-session-token")
    with pytest.raises(ManifestError, match="is not under s3://bkt"):
        DatasetRef.open("s3://bkt/ds", StorageConfig(storage_options=options, cache_dir=str(tmp_path)))
    _publish(a, "/bkt/other", parquet_dir, "s3://another-bucket/data")  # same endpoint, another bucket
    with pytest.raises(ManifestError, match="another-bucket"):
        DatasetRef.open("s3://bkt/other", StorageConfig(storage_options=options, cache_dir=str(tmp_path)))
    assert b.requests == []


def test_the_command_line_names_an_allowed_root(
    servers: tuple[LyingServer, LyingServer], parquet_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = servers
    _serve_files(b, "/cli", parquet_dir)
    _publish(a, "/cli", parquet_dir, f"{b.url}/cli")
    assert main(["info", f"{a.url}/cli"]) == 2
    assert "--allow-data-root" in capsys.readouterr().err
    assert main(["info", f"{a.url}/cli", "--allow-data-root", f"{b.url}/cli"]) == 0
    assert f"{b.url}/cli" in capsys.readouterr().out


def test_allowed_roots_are_checked_when_given() -> None:
    from streamload import ConfigError

    for bad in ("s3://b/x", ["/data"], ["file:///data"], ["local://data"], ["s3://"], {"s3://b": "token"}):
        with pytest.raises(ConfigError, match="allow_data_roots"):
            StorageConfig(allow_data_roots=bad)  # type: ignore[arg-type]
    assert StorageConfig(allow_data_roots=["s3://b/x/"]).allow_data_roots == {"s3://b/x": {}}
