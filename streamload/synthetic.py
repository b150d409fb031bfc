"""Synthetic image folders for the demo, the tests and the benchmarks.

Images are deterministic for a given seed: smooth colour fields with noise, saved as
JPEG (or PNG), with sizes that vary around a target so shards look like real data.
"""

from __future__ import annotations

import io
import os

import numpy as np

__all__ = ["make_image_folder", "synthetic_jpeg"]


def synthetic_jpeg(
    rng: np.random.Generator, width: int, height: int, quality: int = 90, fmt: str = "JPEG", noise: float = 24.0
) -> bytes:
    """Return the encoded bytes of one synthetic image of ``width`` x ``height``."""
    from PIL import Image

    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 6.28, size=3)
    freq = rng.uniform(0.005, 0.05, size=3)
    channels = [127 + 100 * np.sin(freq[c] * (xx + yy * (c + 1)) + phase[c]) for c in range(3)]
    img = np.stack(channels, axis=-1)
    img += rng.normal(0, noise, size=img.shape).astype(np.float32)
    array = np.clip(img, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, quality=quality)
    return buf.getvalue()


def make_image_folder(
    root: str,
    num_classes: int = 4,
    per_class: int = 25,
    size: tuple[int, int] = (64, 64),
    seed: int = 0,
    jitter: float = 0.25,
    fmt: str = "JPEG",
    noise: float = 24.0,
) -> list[tuple[str, int]]:
    """Write ``num_classes`` x ``per_class`` images under ``root/<class>/``.

    Args:
        root: Folder to create (may exist).
        num_classes: Number of class folders (``class_000``, ...).
        per_class: Images per class.
        size: Mean ``(width, height)``.
        seed: Seed; the same arguments give byte-identical files.
        jitter: Relative size variation (uniform in ``[1-jitter, 1+jitter]``).
        fmt: Pillow format name (``"JPEG"`` or ``"PNG"``).
        noise: Standard deviation of the added noise (more noise, larger JPEGs).

    Returns:
        ``(relative path, label)`` of every image, in sorted order.
    """
    rng = np.random.default_rng(seed)
    ext = "jpg" if fmt == "JPEG" else fmt.lower()
    out: list[tuple[str, int]] = []
    for label in range(num_classes):
        cls = f"class_{label:03d}"
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        for i in range(per_class):
            scale = rng.uniform(1 - jitter, 1 + jitter)
            w, h = max(8, int(size[0] * scale)), max(8, int(size[1] * scale))
            rel = f"{cls}/img_{i:06d}.{ext}"
            with open(os.path.join(root, rel), "wb") as f:
                f.write(synthetic_jpeg(rng, w, h, fmt=fmt, noise=noise))
            out.append((rel, label))
    return out
