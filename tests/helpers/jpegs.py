"""JPEGs for the kernel's tests: photo-like files written by Pillow, and damaged variants of them."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from streamload.synthetic import synthetic_jpeg

__all__ = ["corpus", "mutants", "photo"]


def photo(rng: np.random.Generator, width: int, height: int, **save: object) -> bytes:
    """A photo-like JPEG (smooth colour fields + noise) re-saved by Pillow with ``save`` options."""
    mode = str(save.pop("mode", "RGB"))
    img = Image.open(io.BytesIO(synthetic_jpeg(rng, width, height))).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(save.pop("quality", 88)), **save)
    return buf.getvalue()


def corpus() -> list[bytes]:
    """Pillow-written JPEGs: 4:4:4, 4:2:2, 4:2:0, grey and progressive, at sizes that take every DCT reduction."""
    rng = np.random.default_rng(7)
    out = []
    for width, height in [(500, 375), (375, 500), (1900, 1300), (999, 333), (33, 47), (224, 224), (7, 5), (640, 481)]:
        for subsampling in (0, 1, 2):
            out.append(photo(rng, width, height, subsampling=subsampling))
        out.append(photo(rng, width, height, mode="L"))
        out.append(photo(rng, width, height, progressive=True, subsampling=2))
    return out


def mutants(seeds: list[bytes], count: int, rng: np.random.Generator) -> list[bytes]:
    """Truncated, bit-flipped, zero-filled and garbage-headed variants of ``seeds``."""
    out: list[bytes] = []
    while len(out) < count:
        data = bytearray(seeds[int(rng.integers(len(seeds)))])
        kind = int(rng.integers(5))
        if kind == 0:  # truncated anywhere
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == 1:  # bits flipped
            for _ in range(int(rng.integers(1, 12))):
                pos = int(rng.integers(len(data)))
                data[pos] ^= 1 << int(rng.integers(8))
        elif kind == 2:  # a range zero-filled
            start = int(rng.integers(len(data)))
            data[start : start + int(rng.integers(1, 512))] = b"\x00" * len(data[start : start + 512])
        elif kind == 3:  # the header region garbled (markers, tables, sizes)
            end = min(len(data), 700)
            for _ in range(int(rng.integers(1, 8))):
                data[int(rng.integers(2, end))] = int(rng.integers(256))
        else:  # random bytes after a JPEG magic
            data = bytearray(b"\xff\xd8" + rng.bytes(int(rng.integers(0, 2000))))
        out.append(bytes(data))
    return out
