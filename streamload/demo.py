"""``streamload demo``: the whole path on built-in data, in under a minute.

Makes a synthetic image folder, converts it into shards, reads it back through a
DataLoader (raw bytes, then decoded tensors) and prints what happened and how fast.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["run_demo"]


#: Written into a ``workdir`` the demo used: its ``images`` and ``shards-*`` are the demo's own.
MARKER = ".streamload-demo"
#: The demo's synthetic images come in this many classes, as many images each.
CLASSES = 10
#: The most images the demo makes (about 5 KB each, plus their shards); for more, use
#: :func:`streamload.synthetic.make_image_folder` and ``streamload convert``.
MAX_IMAGES = 100_000


def run_demo(
    workdir: str | None = None, images: int = 2000, workers: int = 2, fmt: str = "tar", overwrite: bool = False
) -> dict[str, float]:
    """Run the demo; return the measured rates.

    Run again in the same ``workdir``, the demo replaces what it wrote there before
    (``images/`` and ``shards-<fmt>/``, recognised by a marker file) and says so.

    Args:
        workdir: Where to put the image folder and the shards (default: a temporary
            directory, deleted afterwards).
        images: Number of synthetic images (10 classes).
        workers: DataLoader workers for the read-back.
        fmt: Shard format.
        overwrite: Replace ``images/`` and ``shards-<fmt>/`` in ``workdir`` even if the
            demo did not write them.

    Raises:
        ConfigError: If ``workdir`` holds an ``images`` or ``shards-<fmt>`` the demo did
            not write, and ``overwrite`` is false; if ``workdir`` is empty or names a
            file; if ``images`` is not between 10 and :data:`MAX_IMAGES` (a count not a
            multiple of the 10 classes is rounded down, and said so), or ``workers`` is
            negative or above what :func:`streamload._validate.loader_worker_limit` allows.
    """
    _check_arguments(workdir, images, workers)
    import torch
    from torch.utils.data import DataLoader

    from streamload import ImageLabel, StreamingDataset
    from streamload.batch import RawCollate
    from streamload.converters import ConvertOptions, ImageFolderSource, convert
    from streamload.synthetic import make_image_folder

    own = workdir is None
    root = tempfile.mkdtemp(prefix="streamload-demo-") if own else os.path.abspath(str(workdir))
    results: dict[str, float] = {}
    try:
        folder, shards = os.path.join(root, "images"), os.path.join(root, f"shards-{fmt}")
        _clear_previous(root, [folder, shards], overwrite)
        per_class = images // CLASSES
        rounded = "" if per_class * CLASSES == images else f" ({images} rounded down to whole classes)"
        print(f"[1/4] writing {per_class * CLASSES} synthetic JPEGs ({CLASSES} classes){rounded} to {folder}")
        t = time.perf_counter()
        made = make_image_folder(folder, num_classes=CLASSES, per_class=per_class, size=(160, 120))
        print(f"      {len(made)} images in {time.perf_counter() - t:.1f} s")

        print(f"[2/4] converting to {fmt} shards in {shards}")
        report = convert(
            ImageFolderSource(folder),
            shards,
            ConvertOptions(format=fmt, samples_per_shard=max(1, len(made) // 8), workers=2, progress=False),
        )
        print(f"      {report.summary()}")
        results["convert_mb_s"] = report.payload_bytes / report.seconds / 1e6

        print(f"[3/4] reading raw samples with DataLoader(num_workers={workers})")
        per_sample = DataLoader(StreamingDataset(shards), batch_size=None, num_workers=workers)
        results["raw_samples_s"] = _read_all(
            "per-sample dicts",
            per_sample,
            len(made),
            len(made),
            lambda s: ([s["__key__"]], sum(len(v) for k, v in s.items() if not k.startswith("__"))),
        )
        batched = StreamingDataset(shards, batch_size=256, collate=RawCollate(keys=True))
        results["raw_batch_samples_s"] = _read_all(
            "zero-copy batches (RawCollate, shared memory)",
            DataLoader(batched, batch_size=None, num_workers=workers),
            len(made),
            len(batched) * 256,  # whole batches: the last one padded by the first samples again
            lambda b: (list(b.keys), int(b.offsets[-1])),
        )

        print(f"[4/4] decoding to 96x96 tensors with DataLoader(batch_size=64, num_workers={workers})")
        ds = StreamingDataset(shards, shuffle=True, seed=0, transform=ImageLabel(size=96))
        loader = DataLoader(ds, batch_size=64, num_workers=workers)
        t = time.perf_counter()
        count, labels = 0, torch.zeros(10, dtype=torch.int64)
        for images_batch, label_batch in loader:
            count += images_batch.shape[0]
            labels += torch.bincount(label_batch, minlength=10)
        dt = time.perf_counter() - t
        results["decode_samples_s"] = count / dt
        print(
            f"      {count:,} images {tuple(images_batch.shape[1:])} uint8: {count / dt:.0f} samples/s; "
            f"per-class counts {labels.tolist()}"
        )
        print("demo finished: convert -> shards -> DataLoader works on this machine.")
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return results


def _check_arguments(workdir: str | None, images: object, workers: object) -> None:
    """Refuse a ``workdir``, image count or worker count the demo cannot use, before it writes anything."""
    from ._errors import ConfigError
    from ._validate import check_int, loader_worker_limit

    if workdir is not None:
        if not str(workdir):
            raise ConfigError("--dir '' names no folder: give a directory, or leave --dir out for a temporary one")
        if os.path.lexists(workdir) and not os.path.isdir(workdir):
            raise ConfigError(f"--dir {workdir} is not a directory: give a directory to work in (it may not exist yet)")
    count = check_int("images", images)
    if not CLASSES <= count <= MAX_IMAGES:
        raise ConfigError(
            f"--images {count} must be between {CLASSES} (one image for each of the {CLASSES} classes) and {MAX_IMAGES}"
        )
    limit, why = loader_worker_limit()
    count = check_int("workers", workers)
    if not 0 <= count <= limit:
        raise ConfigError(f"--workers {count} must be between 0 and {limit} ({why})")


def _clear_previous(root: str, outputs: list[str], overwrite: bool) -> None:
    """Remove ``outputs`` an earlier demo left in ``root`` (any, with ``overwrite``); mark ``root`` as the demo's."""
    from ._errors import ConfigError

    marker = os.path.join(root, MARKER)
    found = [path for path in outputs if os.path.lexists(path)]
    if found and not (overwrite or os.path.isfile(marker)):
        names = " and ".join(os.path.basename(path) for path in found)
        raise ConfigError(
            f"{root} already holds {names}, not written by streamload demo; "
            "pass --overwrite to replace them, or choose another --dir"
        )
    if found:
        print(f"replacing the previous demo output in {root}: {', '.join(map(os.path.basename, found))}")
    for path in found:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    os.makedirs(root, exist_ok=True)
    with open(marker, "w", encoding="utf-8") as f:
        f.write("images/ and shards-*/ here were written by `streamload demo`; it replaces them when run again.\n")


def _read_all(
    what: str,
    loader: Iterable[Any],
    expected: int,
    total: int,
    keys_and_bytes: Callable[[Any], tuple[list[str], int]],
) -> float:
    """Read ``loader`` once, check every one of ``expected`` samples came (``total`` items in all), return samples/s."""
    started = time.perf_counter()
    keys: list[str] = []
    nbytes = 0
    for item in loader:
        item_keys, item_bytes = keys_and_bytes(item)
        keys.extend(item_keys)
        nbytes += item_bytes
    seconds = time.perf_counter() - started
    if not (len(keys) == total and len(set(keys)) == expected):
        raise RuntimeError(
            f"{what}: read {len(keys)} samples ({len(set(keys))} distinct), expected {total} ({expected} distinct)"
        )
    read = f"{expected:,} samples, each exactly once"
    if total > expected:  # whole batches: the last one filled up by samples read again
        read = f"{expected:,} samples, {total:,} with padding (the last batch filled up with samples again)"
    print(f"      {what}: {read}: {len(keys) / seconds:.0f} samples/s, {nbytes / seconds / 1e6:.1f} MB/s")
    return len(keys) / seconds
