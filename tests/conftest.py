"""Shared fixtures: small synthetic image folders and converted datasets."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder, synthetic_jpeg

# One SeaweedFS server per test session, shared by every module that asks for `s3_server`;
# `shaped_s3` puts it behind a proxy that makes it a far bucket (latency, bandwidth);
# `faulty_s3` puts it behind a proxy that breaks chosen responses (resets, 503s, flipped bytes);
# `dask_address` and `ray_local` are real conversion engines (one per module that asks).
pytest_plugins = ["tests.s3server", "tests.shaping", "tests.faults", "tests.engines"]


def add_tricky_files(root: Path) -> None:
    """Names that break naive key derivation: dots, spaces, unicode, same stem, nesting, case."""
    rng = np.random.default_rng(7)
    cls = root / "class_001"
    tricky = [
        "dotted.name.v2.jpg",
        "with space.jpg",
        "ünïcødé-名前.jpg",
        "same.jpg",
        "UPPER.JPG",
        "nested/deeper/inner.jpeg",
        "percent%2E.jpg",
        "tilde~x.jpg",
    ]
    for rel in tricky:
        path = cls / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(synthetic_jpeg(rng, 24, 20))
    (cls / "same.png").write_bytes(synthetic_jpeg(rng, 20, 24, fmt="PNG"))


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 classes x 30 small JPEGs plus tricky file names (129 images)."""
    root = tmp_path_factory.mktemp("images")
    make_image_folder(str(root), num_classes=4, per_class=30, size=(32, 24), seed=1)
    add_tricky_files(root)
    return root


def expected_samples(root: Path) -> dict[str, tuple[bytes, int]]:
    """Map relative path -> (file bytes, label) by walking the folder independently."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    out: dict[str, tuple[bytes, int]] = {}
    for label, cls in enumerate(classes):
        for dirpath, _, files in os.walk(root / cls):
            for name in files:
                if name.rsplit(".", 1)[-1].lower() in {"jpg", "jpeg", "png", "webp", "bmp", "gif"}:
                    path = Path(dirpath) / name
                    out[path.relative_to(root).as_posix()] = (path.read_bytes(), label)
    return out


@pytest.fixture(scope="session")
def tar_dataset(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``image_folder`` converted to tar shards of 16 samples."""
    out = tmp_path_factory.mktemp("tar-ds")
    convert(ImageFolderSource(str(image_folder)), str(out), ConvertOptions(samples_per_shard=16, progress=False))
    return out


@pytest.fixture
def fresh_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "work"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)
