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
    convert(
        src,
        root,
        ConvertOptions(
            format=fmt, samples_per_shard=samples_per_shard, workers=2, progress=False, hash_algorithm="xxh3_128"
        ),
    )
    return root


def folder_items(folder: str) -> list[tuple[str, int]]:
    """``(path, label)`` of every image of the folder, sorted (labels from the class folder order)."""
    classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    out = []
    for label, cls in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(folder, cls))):
            if name.endswith(".jpg"):
                out.append((os.path.join(folder, cls, name), label))
    return out


def folder_stats(folder: str) -> dict[str, float]:
    sizes = np.array([os.path.getsize(p) for p, _ in folder_items(folder)])
    return {
        "count": int(len(sizes)),
        "mean_bytes": float(sizes.mean()),
        "median_bytes": float(np.median(sizes)),
        "min_bytes": float(sizes.min()),
        "max_bytes": float(sizes.max()),
        "total_bytes": float(sizes.sum()),
    }


def histogram(paths: dict[str, str]) -> list[int]:
    labels = [label for _, label in folder_items(paths["folder"])]
    return np.bincount(labels).tolist()


def mds_dataset(num_images: int, seed: int = 0) -> str:
    """The image folder as MosaicML Streaming MDS shards (``jpg`` bytes, ``cls`` int)."""
    from streaming import MDSWriter

    root = os.path.join(OUT, f"mds-{num_images}-s{seed}")
    if os.path.exists(os.path.join(root, ".done")):
        return root
    with MDSWriter(out=root, columns={"jpg": "bytes", "cls": "int"}, size_limit="64mb", exist_ok=True) as writer:
        for path, label in folder_items(image_folder(num_images, seed=seed)):
            with open(path, "rb") as f:
                writer.write({"jpg": f.read(), "cls": label})
    open(os.path.join(root, ".done"), "w").close()
    return root


def _lit_item(item: tuple[str, int]) -> dict[str, object]:
    path, label = item
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": label}


def litdata_dataset(num_images: int, seed: int = 0) -> str:
    """The image folder as LitData chunks (``jpg`` bytes, ``cls`` int)."""
    import litdata

    root = os.path.join(OUT, f"litdata-{num_images}-s{seed}")
    done = os.path.join(OUT, f".litdata-{num_images}-s{seed}.done")
    if os.path.exists(done):
        return root
    items = folder_items(image_folder(num_images, seed=seed))
    litdata.optimize(fn=_lit_item, inputs=items, output_dir=root, chunk_bytes="64MB", num_workers=1, mode="overwrite")
    open(done, "w").close()
    return root


def all_datasets(num_images: int, formats: list[str], peers: list[str]) -> dict[str, str]:
    """Every on-disk form of the ``num_images`` set the benchmark reads."""
    out = {"folder": image_folder(num_images)}
    for fmt in formats:
        out[fmt] = dataset(num_images, fmt)
    if "mosaicml-streaming" in peers:
        out["mds"] = mds_dataset(num_images)
    if "litdata" in peers:
        out["litdata"] = litdata_dataset(num_images)
    return out


def epoch_ok(hist: np.ndarray, expected: np.ndarray, count: int, total: int) -> bool:
    """``count`` items read with label histogram ``hist``: every sample once, plus ``total - N`` repeats.

    ``total`` is the epoch's items: streamload pads a batched epoch to whole global batches
    (:func:`streamload.plan.planner.padded_total`); ``total == N`` (no padding) asks for
    exactly the expected histogram.
    """
    extra = hist - expected
    n = int(expected.sum())
    return count == total and bool((extra >= 0).all()) and int(extra.sum()) == total - n
