"""Hostile input: tar members and manifests built to escape, crash or exhaust the reader."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from streamload import (
    CorruptShardError,
    ManifestError,
    StreamingDataset,
    StreamloadError,
    UnsafeShardError,
)
from streamload.indexing import index_directory
from tests.digests import digest


def _tar(path: Path, build: Callable[[tarfile.TarFile], None]) -> None:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        build(tar)


def _file(tar: tarfile.TarFile, name: str, data: bytes = b"x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _special(tar: tarfile.TarFile, name: str, kind: bytes, target: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    tar.addfile(info)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda t: _file(t, "/etc/passwd.txt"), UnsafeShardError, "absolute"),
        (lambda t: _file(t, "../../escape.txt"), UnsafeShardError, r"\.\."),
        (lambda t: _file(t, "a/../../b.txt"), UnsafeShardError, r"\.\."),
        (lambda t: _special(t, "link.txt", tarfile.SYMTYPE, "/etc/passwd"), UnsafeShardError, "link"),
        (lambda t: _special(t, "hard.txt", tarfile.LNKTYPE, "other.txt"), UnsafeShardError, "link"),
        (lambda t: _special(t, "dev.txt", tarfile.CHRTYPE), UnsafeShardError, "devices"),
        (lambda t: _special(t, "fifo.txt", tarfile.FIFOTYPE), UnsafeShardError, "FIFO"),
        (lambda t: (_file(t, "a.txt"), _file(t, "a.txt")), CorruptShardError, "twice"),
        (lambda t: (_file(t, "a.txt"), _file(t, "b.txt"), _file(t, "a.cls")), CorruptShardError, "not adjacent"),
        (lambda t: _file(t, "noextension"), CorruptShardError, "no extension"),
    ],
)
def test_hostile_tar_members_are_refused_by_index(tmp_path: Path, build, error, message: str) -> None:
    _tar(tmp_path / "evil.tar", build)
    with pytest.raises(error, match=message) as info:
        index_directory(str(tmp_path))
    assert "evil.tar" in str(info.value)
    assert not (tmp_path / "index.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.tar"]  # nothing written beside it


def _raw_header(name: bytes, size_field: bytes) -> bytes:
    header = bytearray(512)
    header[: len(name)] = name
    header[100:108] = b"0000644\0"
    header[124:136] = size_field
    header[136:148] = b"00000000000\0"
    header[156:157] = b"0"
    header[257:263] = b"ustar\0"
    header[148:156] = b"        "
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    return bytes(header)


def test_huge_member_size_is_refused_without_allocating(tmp_path: Path) -> None:
    # A header claiming an 8 GB member in a 2 KB file.
    (tmp_path / "huge.tar").write_bytes(_raw_header(b"big.bin", b"77777777777\0") + bytes(1536))
    with pytest.raises(CorruptShardError, match="huge.tar.*runs past the end"):
        index_directory(str(tmp_path))


def test_bad_header_checksum_is_corruption(tmp_path: Path) -> None:
    header = bytearray(_raw_header(b"a.txt", b"00000000001\0"))
    header[0] ^= 1
    (tmp_path / "bad.tar").write_bytes(bytes(header) + b"x" + bytes(511) + bytes(1024))
    with pytest.raises(CorruptShardError, match="bad.tar.*checksum"):
        index_directory(str(tmp_path))


# -- manifests -----------------------------------------------------------------------


def _mutated(tar_dataset: Path, tmp_path: Path, mutate: Callable[[dict], object]) -> Path:
    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    manifest = json.loads((ds / "index.json").read_text())
    result = mutate(manifest)
    (ds / "index.json").write_text(json.dumps(manifest if result is None else result))
    return ds


def _shard0(m: dict) -> dict:
    return m["shards"][0]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: _shard0(m).update(samples=-5), "samples=-5"),
        (lambda m: _shard0(m).update(bytes=2**62), "bytes="),
        (lambda m: _shard0(m).update(samples=2**60), "samples="),
        (lambda m: _shard0(m).update(name="sub/shard.tar"), "plain file name"),
        (lambda m: _shard0(m).update(name=".."), "plain file name"),
        (lambda m: _shard0(m).update(name="/etc/passwd"), "plain file name"),
        (lambda m: _shard0(m)["sidecar"].update(name="../../x.idx"), "plain file name"),
        (lambda m: _shard0(m).update(name=m["shards"][1]["name"]), "unique"),
        (lambda m: _shard0(m).update(hash="not-hex"), "hex digest"),
        (lambda m: m.update(streamload=2), "version 2"),
        (lambda m: m.update(streamload="1"), "version '1'"),
        (lambda m: m.update(shards={"a": 1}), "shards must be a list"),
        (lambda m: m.update(hash="md5"), "hash='md5'"),
        (lambda m: m.update(format=["tar"]), "format="),
        (lambda m: m.update(fields="jpg"), "fields"),
        (lambda m: ["not", "an", "object"], "top level"),
    ],
)
def test_hostile_manifest_is_refused(tar_dataset: Path, tmp_path: Path, mutate, message: str) -> None:
    ds = _mutated(tar_dataset, tmp_path, mutate)
    with pytest.raises(ManifestError, match=message):
        StreamingDataset(str(ds))


def test_unknown_format_is_a_clear_error(tar_dataset: Path, tmp_path: Path) -> None:
    ds = _mutated(tar_dataset, tmp_path, lambda m: m.update(format="pickle"))
    with pytest.raises(StreamloadError, match="unknown shard format 'pickle'"):
        StreamingDataset(str(ds))


def test_sidecar_pointing_outside_the_shard_is_refused(tar_dataset: Path, tmp_path: Path) -> None:
    import struct

    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    idx = ds / "shard-000000.tar.idx"
    raw = bytearray(idx.read_bytes())
    _, n, m, _, names_len, _, _ = struct.unpack_from("<8s6Q", raw)
    member_offsets = 56 + names_len + (-names_len % 8) + 3 * 8 * (n + 1)
    struct.pack_into("<Q", raw, member_offsets, 10**12)  # first member's data offset: 1 TB
    idx.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match="shard-000000.tar.*does not match its manifest hash"):
        list(StreamingDataset(str(ds)))
    # A hostile writer also fixes the manifest's hash: the offsets themselves are refused.
    manifest = json.loads((ds / "index.json").read_text())
    manifest["shards"][0]["sidecar"]["hash"] = digest(bytes(raw), manifest)
    (ds / "index.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptShardError, match="shard-000000.tar.*member extents"):
        list(StreamingDataset(str(ds)))


def test_flipped_data_byte_names_shard_key_and_field(tar_dataset: Path, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    shard = ds / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[3 * 512 + 100] ^= 0x01  # inside the first sample's jpg (members: cls header+data, jpg header)
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"shard-000001.tar.*sample '.+'.*field 'jpg'"):
        list(StreamingDataset(str(ds)))


def test_truncated_shard_is_detected(tar_dataset: Path, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds)
    shard = ds / "shard-000002.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(CorruptShardError, match="shard-000002.tar.*3000 bytes on disk"):
        list(StreamingDataset(str(ds)))


@pytest.mark.parametrize("key", ["a/../../x", "../x", "a//b", "./a", "a/./b"])
def test_keys_with_path_escapes_are_refused_by_every_writer(tmp_path: Path, key: str) -> None:
    from streamload import SampleError
    from streamload.writer import DatasetWriter

    for fmt in ("tar", "lmdb", "hdf5"):
        with pytest.raises(SampleError, match="components"), DatasetWriter(str(tmp_path / fmt), format=fmt) as w:
            w.write({"__key__": key, "txt": b"x"})
