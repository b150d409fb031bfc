"""Parquet tables as Hugging Face ``datasets`` writes them: small real images, a class label, a caption."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

CLASSES = ["cat", "dog", "eel"]


def encode(i: int, fmt: str) -> bytes:
    """A small image in ``fmt`` (a Pillow format name) whose size and colour depend on ``i``."""
    buf = io.BytesIO()
    Image.new("RGB", (10 + i % 3, 8), (i % 256, 255 - i % 256, 7)).save(buf, fmt)
    return buf.getvalue()


def hf_rows(start: int, stop: int) -> dict[str, list[Any]]:
    """Rows ``start``..``stop``: image structs (JPEG for odd rows, PNG for even), labels ``i % 3``, captions."""
    return {
        "image": [{"bytes": encode(i, "JPEG" if i % 2 else "PNG"), "path": None} for i in range(start, stop)],
        "label": [i % 3 for i in range(start, stop)],
        "caption": [f"image number {i}" for i in range(start, stop)],
    }


def write_hf(path: Path, start: int, stop: int) -> None:
    """A Hugging Face split file: Image + ClassLabel + string, row groups of 16."""
    import datasets

    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES), "caption": datasets.Value("string")}
    )
    ds = datasets.Dataset.from_dict(hf_rows(start, stop), features=features)
    ds.to_parquet(str(path), batch_size=16)
