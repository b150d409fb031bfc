"""The benchmark dataset: thousands of synthetic JPEGs around 65 KB, built once and cached."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from streamload.synthetic import synthetic_jpeg

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
#: ImageNet-like: mean 500x375, +-30 % in size, noise chosen so the mean file is ~65 KB.
MEAN_SIZE = (500, 375)
JITTER = 0.3
NOISE = 9.0


def _write_class(args: tuple[str, int, int, int]) -> int:
    root, label, per_class, seed = args
    rng = np.random.default_rng([seed, label])
    folder = os.path.join(root, f"class_{label:03d}")
    os.makedirs(folder, exist_ok=True)
    total = 0
    for i in range(per_class):
        path = os.path.join(folder, f"img_{i:06d}.jpg")
        scale = rng.uniform(1 - JITTER, 1 + JITTER)
        w, h = int(MEAN_SIZE[0] * scale), int(MEAN_SIZE[1] * scale)
        data = synthetic_jpeg(rng, w, h, quality=90, noise=NOISE)
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        total += len(data)
    return total


def image_folder(num_images: int, num_classes: int = 10, seed: int = 0, jobs: int = 2) -> str:
    """Return the cached image folder of ``num_images`` JPEGs, building it if needed."""
    root = os.path.join(OUT, f"images-{num_images}-s{seed}")
    done = os.path.join(root, ".done")
    if os.path.exists(done):
        return root
    per_class = num_images // num_classes
    with ProcessPoolExecutor(jobs) as pool:
        list(pool.map(_write_class, [(root, c, per_class, seed) for c in range(num_classes)]))
    open(done, "w").close()
    return root


def dataset(num_images: int, fmt: str, samples_per_shard: int = 1000, seed: int = 0) -> str:
    """Return the cached streamload dataset of the image folder in format ``fmt``."""
    from streamload.converters import ConvertOptions, ImageFolderSource, convert

    root = os.path.join(OUT, f"ds-{num_images}-s{seed}-{fmt}")
    if os.path.exists(os.path.join(root, "index.json")):
        return root
    src = ImageFolderSource(image_folder(num_images, seed=seed))
    src.check = "none"
    convert(src, root, ConvertOptions(format=fmt, samples_per_shard=samples_per_shard, workers=2,
                                      progress=False, hash_algorithm="xxh3_128"))
    return root
