"""Checking a dataset end to end: ``streamload verify``.

One pass over every shard: its files are acquired through the same shard access as
training (:mod:`streamload.shards`; a remote dataset through its cache), re-hashed against
the manifest, and, unless told otherwise, every sample is read back through the format's
reader, which checks each sample's own checksum. Every problem is collected, not just the
first.

A remote dataset is checked through a cache (``cache_dir``, default the usual one): the
copies training will read. A cached copy found corrupt (a disk error after it was
downloaded) is *repaired*, by the same logic as training: deleted, downloaded again, and
the fresh copy checked in its place. It is reported (:attr:`VerifyReport.repaired`, a
``REPAIRED`` line) but is no problem of the dataset; a fresh copy that is bad too is. A
local dataset's files are never changed.

A file the manifest gives no hash for can only be checked by its size (and its samples by
their own checksums): :attr:`VerifyReport.unhashed` lists them, and the command says so
instead of ``OK``.

With ``decode_images`` (``verify --decode``) every sample's image is also decoded as the
readers decode it (Pillow, full size): an image that does not decode is a problem naming
its shard and key, and what the libraries say while decoding (Python warnings, Pillow's
log, the lines libtiff writes to stderr) is listed per sample in
:attr:`VerifyReport.warnings`, never printed raw.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError, CorruptShardError, StreamloadError
from ._files import FileEntry, hash_stream
from ._redact import redacted_repr
from .dataref import DatasetRef
from .manifest import ShardEntry
from .sample import IMAGE_FIELDS, image_warnings
from .shards import ShardSource
from .storage import is_local
from .storageconfig import StorageConfig

__all__ = ["VerifyReport", "verify_dataset"]


@redacted_repr
@dataclass
class VerifyReport:
    """The result of :func:`verify_dataset`: every problem found, per shard.

    Attributes:
        url: The dataset.
        shards_checked: Shards looked at.
        samples_checked: Samples read back.
        unhashed: Names of files the manifest gives no hash for (only their size was checked).
        repaired: ``(shard name, message)`` for every shard whose cached copy was corrupt,
            and was downloaded again and checked (no problem of the dataset).
        problems: ``(shard name, message)`` for every bad shard (and, decoding images, every
            image that does not decode).
        images_decoded: Images decoded (``decode_images``).
        warnings: ``(shard name, message)`` for every library warning an image's decode
            raised, the message naming the sample (``decode_images``).
    """

    url: str
    shards_checked: int = 0
    samples_checked: int = 0
    unhashed: list[str] = field(default_factory=list)
    repaired: list[tuple[str, str]] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    images_decoded: int = 0
    warnings: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True if no problem was found."""
        return not self.problems


def _check_file(path: str, entry: FileEntry, report: VerifyReport) -> None:
    """Re-hash a local copy of ``entry``; raise :class:`CorruptShardError` on a mismatch."""
    if entry.hash is None or entry.algorithm is None:
        if entry.name not in report.unhashed:
            report.unhashed.append(entry.name)
        return
    with open(path, "rb") as f:
        digest, size = hash_stream(f, entry.algorithm)
    if size != entry.num_bytes:
        raise CorruptShardError(f"{entry.name}: {size} bytes, manifest says {entry.num_bytes}")
    problem = entry.digest_problem(digest, entry.algorithm)
    if problem is not None:
        raise CorruptShardError(f"{entry.name}: {problem}")


def _check_images(entry: ShardEntry, samples: Any, report: VerifyReport) -> Any:
    """Decode each sample's image as it passes; yield the samples (the count stays the reader's)."""
    from .decode import decode_image

    for sample in samples:
        name = next((f for f in IMAGE_FIELDS if f in sample), None)
        if name is not None:
            where = f"{entry.name}: sample {sample.get('__key__')!r} field {name!r}"
            data = bytes(sample[name])
            found: list[str] = []
            try:
                with image_warnings(data) as found:
                    decode_image(data)  # refused above the readers' default max_pixels, as they refuse it
            except Exception as exc:  # any decoder error is this image's problem, named
                said = "; ".join(dict.fromkeys(found))
                report.problems.append(
                    (entry.name, f"{where}: cannot decode image: {exc}" + (f" ({said})" if said else ""))
                )
            else:
                report.warnings.extend((entry.name, f"{where}: {text}") for text in dict.fromkeys(found))
            report.images_decoded += 1
        yield sample


def _check_shard(
    source: ShardSource, s: int, read_samples: bool, report: VerifyReport, decode_images: bool = False
) -> None:
    entry = source.ref.manifest.shards[s]
    path, sidecar = source.acquire(s)
    try:
        if sidecar is not None and entry.sidecar is not None:
            _check_file(sidecar, entry.sidecar, report)
        _check_file(path, entry, report)
        if not read_samples:
            return
        reader = source.open_reader(s, path, sidecar)
        try:
            samples = reader.iter_range(0, len(reader))
            count = sum(1 for _ in (_check_images(entry, samples, report) if decode_images else samples))
        finally:
            reader.close()
        if count != entry.num_samples:
            raise CorruptShardError(f"{entry.name}: read {count} samples, manifest says {entry.num_samples}")
        report.samples_checked += count
    finally:
        source.release(s)


def _check_or_repair(
    source: ShardSource, s: int, read_samples: bool, report: VerifyReport, decode_images: bool = False
) -> None:
    """Check shard ``s``; a corrupt cached copy is dropped, downloaded again and checked once more."""
    entry = source.ref.manifest.shards[s]
    marks = (len(report.problems), len(report.warnings), report.images_decoded)
    try:
        _check_shard(source, s, read_samples, report, decode_images)
    except CorruptShardError as exc:
        if not source.refetch([s], exc):
            raise
        # What the corrupt copy's images said is checked again on the fresh copy.
        del report.problems[marks[0] :], report.warnings[marks[1] :]
        report.images_decoded = marks[2]
        report.repaired.append(
            (
                entry.name,
                f"{_message(entry, exc)}: the cached copy ({source.storage.describe()}) was corrupt; "
                "deleted, downloaded again and checked",
            )
        )
        _check_shard(source, s, read_samples, report, decode_images)


def _message(entry: ShardEntry, exc: BaseException) -> str:
    return str(exc) if entry.name in str(exc) else f"{entry.name}: {exc}"


def verify_dataset(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    read_samples: bool = True,
    on_shard: Callable[[ShardEntry, str | None], None] | None = None,
    cache_dir: str | None = None,
    decode_images: bool = False,
    storage: StorageConfig | None = None,
) -> VerifyReport:
    """Re-hash every shard and sidecar, check sizes and sample counts, and read every sample.

    Args:
        url: Dataset directory or URL.
        storage_options: fsspec options for remote URLs.
        read_samples: Also open each shard with its format reader and read every sample.
        on_shard: Called with ``(entry, problem or None)`` after each shard.
        cache_dir: The cache a remote dataset is checked through (default: the usual one),
            so that ``verify`` checks the copies training will use. A corrupt copy there
            is repaired (downloaded again) and listed in :attr:`VerifyReport.repaired`.
        decode_images: Also decode every sample's image (Pillow, full size, as the
            readers do; needs ``read_samples``): one that does not decode is a problem,
            and library warnings are listed in :attr:`VerifyReport.warnings`.
        storage: All the storage settings at once (``allow_data_roots`` too), instead of
            ``storage_options`` and ``cache_dir``.

    Raises:
        ManifestError: If the manifest cannot be read (nothing else can then be checked).
        ConfigError: If ``storage_options`` is not a mapping or ``cache_dir`` not a path.
    """
    if storage is None:
        storage = StorageConfig(storage_options=storage_options, cache_dir=cache_dir)  # checks them
    elif storage_options is not None or cache_dir is not None:
        raise ConfigError("give storage_options and cache_dir in storage=, not beside it")
    config = dataclasses.replace(storage, read_ahead=0)
    cache_dir = config.cache_dir
    report = VerifyReport(url)
    ref = DatasetRef.open(url, config)
    if cache_dir is not None and is_local(ref.data_url):
        warnings.warn(
            f"cache_dir={cache_dir!r} does nothing for the local dataset {url!r}: its files are checked in place",
            UserWarning,
            stacklevel=2,
        )
    with ShardSource(ref, ref.open_storage(), own_storage=True) as source:
        for s, entry in enumerate(ref.manifest.shards):
            problem = None
            try:
                _check_or_repair(source, s, read_samples, report, decode_images)
            except (StreamloadError, OSError, ValueError, OverflowError, MemoryError) as exc:
                problem = _message(entry, exc)
                report.problems.append((entry.name, problem))
            report.shards_checked += 1
            if on_shard is not None:
                on_shard(entry, problem)
    return report


def __getattr__(name: str) -> Any:
    """``streamload.verify.index_directory`` moved to :mod:`streamload.indexing` (deprecated alias)."""
    if name in ("index_directory", "index_shard", "publish_index"):
        from . import indexing

        warnings.warn(f"streamload.verify.{name} moved to streamload.indexing.{name}", DeprecationWarning, stacklevel=2)
        return getattr(indexing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
