"""Conversion: determinism across worker counts, shard sizing, shuffle, bad inputs, CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from streamload import ManifestError, ManifestNotFoundError, ShardNotFoundError, SourceError, StreamingDataset
from streamload.cli import main
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def test_output_is_byte_identical_for_any_worker_count(image_folder: Path, tmp_path: Path) -> None:
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        assert (
            main(
                [
                    "convert",
                    str(image_folder),
                    str(out),
                    "--samples-per-shard",
                    "10",
                    "--workers",
                    str(workers),
                    "--shuffle",
                    "--seed",
                    "5",
                    "--no-progress",
                ]
            )
            == 0
        )
        outs.append(_files(out))
    assert outs[0] == outs[1]
    assert len([n for n in outs[0] if n.endswith(".tar")]) == 13
    assert not [n for n in outs[0] if n.startswith(".tmp")]


def test_shard_size_in_bytes(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    manifest = convert(
        ImageFolderSource(str(image_folder)), str(out), ConvertOptions(shard_bytes="20KB", progress=False)
    ).manifest
    assert len(manifest.shards) > 3
    ds = StreamingDataset(str(out))
    payload = [0] * len(manifest.shards)
    boundaries = [0]
    for entry in manifest.shards:
        boundaries.append(boundaries[-1] + entry.num_samples)
    for i, sample in enumerate(ds):
        shard = next(j for j in range(len(manifest.shards)) if boundaries[j] <= i < boundaries[j + 1])
        payload[shard] += sum(len(v) for k, v in sample.items() if k != "__key__")
    for entry, nbytes in zip(manifest.shards, payload, strict=True):
        assert nbytes <= 20_000 or entry.num_samples == 1
        assert nbytes > 10_000 or entry is manifest.shards[-1]


def test_shuffle_changes_order_but_not_content(image_folder: Path, tmp_path: Path) -> None:
    plain = [s["__key__"] for s in _dataset(image_folder, tmp_path / "a", shuffle=False)]
    shuffled = [s["__key__"] for s in _dataset(image_folder, tmp_path / "b", shuffle=True, seed=1)]
    other = [s["__key__"] for s in _dataset(image_folder, tmp_path / "c", shuffle=True, seed=2)]
    assert sorted(plain) == sorted(shuffled) == sorted(other)
    assert plain != shuffled != other
    assert plain == sorted(plain, key=plain.index)


def _dataset(src: Path, out: Path, **kw: object) -> StreamingDataset:
    convert(ImageFolderSource(str(src)), str(out), ConvertOptions(samples_per_shard=20, progress=False, **kw))  # type: ignore[arg-type]
    return StreamingDataset(str(out))


# -- bad inputs ----------------------------------------------------------------------


@pytest.fixture
def broken_folder(tmp_path: Path) -> Path:
    root = tmp_path / "broken"
    make_image_folder(str(root), num_classes=2, per_class=5, size=(16, 16))
    good = (root / "class_000" / "img_000000.jpg").read_bytes()
    (root / "class_000" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "class_001" / "not-an-image.jpg").write_bytes(b"this is text, not a jpeg")
    (root / "class_001" / "notes.txt").write_text("ignored: not an image extension")
    return root


def test_corrupt_image_raises_naming_the_file(broken_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"(truncated|not-an-image)\.jpg"):
        convert(ImageFolderSource(str(broken_folder)), str(tmp_path / "o"), ConvertOptions(progress=False))
    assert not (tmp_path / "o" / "index.json").exists()


def test_corrupt_images_skipped_are_listed_and_counted(broken_folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    code = main(["convert", str(broken_folder), str(out), "--on-error", "skip", "--no-progress"])
    assert code == 0
    manifest = json.loads((out / "index.json").read_text())
    skipped = {s["path"] for s in manifest["skipped"]}
    assert skipped == {"class_000/truncated.jpg", "class_001/not-an-image.jpg"}
    assert manifest["num_samples"] == 10
    printed = capsys.readouterr()
    assert "2 broken inputs skipped" in printed.out and "1 non-input file ignored" in printed.out
    assert "truncated.jpg" in printed.err


def test_empty_class_folder(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    make_image_folder(str(root), num_classes=2, per_class=3, size=(16, 16))
    (root / "zz_empty").mkdir()
    with pytest.raises(SourceError, match="zz_empty"):
        convert(ImageFolderSource(str(root)), str(tmp_path / "o"), ConvertOptions(progress=False))
    report = convert(
        ImageFolderSource(str(root)), str(tmp_path / "o2"), ConvertOptions(progress=False, on_error="skip")
    )
    assert report.manifest.classes == ("class_000", "class_001")  # only folders that gave samples are classes
    assert [s.path for s in report.skipped] == ["zz_empty/"]


def test_not_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SourceError, match="nope: does not exist"):
        ImageFolderSource(str(tmp_path / "nope"))
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "nope: does not exist" in capsys.readouterr().err
    (tmp_path / "file.jpg").write_bytes(b"x")
    with pytest.raises(SourceError, match="file.jpg: not a directory"):
        ImageFolderSource(str(tmp_path / "file.jpg"))


def test_mistyped_option_prints_the_subcommands_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(tmp_path), str(tmp_path / "o"), "--samples-per-shrd", "10"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: streamload convert ") and "--samples-per-shard" in err
    assert "streamload convert: error: unrecognized arguments: --samples-per-shrd 10" in err


def test_missing_manifest_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ManifestNotFoundError, match=str(tmp_path)):
        StreamingDataset(str(tmp_path))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: "{not json", "not valid JSON"),
        (lambda m: json.dumps({**m, "streamload": 99}), "version 99"),
        (lambda m: json.dumps({**m, "num_samples": m["num_samples"] + 1}), "num_samples"),
        (lambda m: json.dumps({**m, "shards": [{**m["shards"][0], "samples": -1}]}), "samples"),
        (lambda m: json.dumps({**m, "shards": [{**m["shards"][0], "name": "../evil.tar"}]}), "plain file name"),
    ],
)
def test_broken_manifest_names_the_file(tar_dataset: Path, tmp_path: Path, mutate, message: str) -> None:
    ds_dir = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds_dir)
    manifest = json.loads((ds_dir / "index.json").read_text())
    (ds_dir / "index.json").write_text(mutate(manifest))
    with pytest.raises(ManifestError, match=message) as info:
        StreamingDataset(str(ds_dir))
    assert "index.json" in str(info.value)


def test_missing_shard_names_it(tar_dataset: Path, tmp_path: Path) -> None:
    ds_dir = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds_dir)
    (ds_dir / "shard-000002.tar").unlink()
    ds = StreamingDataset(str(ds_dir))
    with pytest.raises(ShardNotFoundError, match="shard-000002.tar"):
        list(ds)
    assert main(["verify", str(ds_dir)]) == 1


def test_info_and_verify(tar_dataset: Path, capsys) -> None:
    assert main(["info", str(tar_dataset), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "tar" and info["num_samples"] == StreamingDataset(str(tar_dataset)).num_samples
    assert main(["info", str(tar_dataset)]) == 0
    assert "format    tar" in capsys.readouterr().out
    assert main(["verify", str(tar_dataset)]) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_reports_every_bad_shard(tar_dataset: Path, tmp_path: Path, capsys) -> None:
    ds_dir = tmp_path / "ds"
    shutil.copytree(tar_dataset, ds_dir)
    for name in ("shard-000001.tar", "shard-000004.tar"):
        data = bytearray((ds_dir / name).read_bytes())
        data[1000] ^= 0xFF
        (ds_dir / name).write_bytes(bytes(data))
    assert main(["verify", str(ds_dir)]) == 1
    out = capsys.readouterr().out
    assert "shard-000001.tar" in out and "shard-000004.tar" in out and "FAILED: 2 bad shards" in out
