"""The dataset manifest, ``index.json`` (DESIGN.md §3).

A manifest is small: it grows with the number of *shards*, never with the number of
samples, so every worker can hold it. Per-sample data a format needs for random
access (tar byte offsets) lives in a per-shard sidecar file named by the shard entry.

On disk (version 1)::

    {
      "streamload": 1,
      "format": "tar",
      "num_samples": 5000,
      "hash": "sha256",
      "fields": ["cls", "jpg"],
      "classes": ["cat", "dog"],
      "shards": [
        {"name": "shard-000000.tar", "samples": 1000, "bytes": 6553600, "hash": "ab12...",
         "sidecar": {"name": "shard-000000.tar.idx", "bytes": 8016, "hash": "cd34..."}},
        ...
      ],
      "skipped": [{"path": "cat/broken.jpg", "error": "cannot identify image file"}],
      "meta": {...}
    }

Everything in it is untrusted input: it is parsed with :func:`json.loads` only and
validated field by field (counts, sizes, names that cannot leave the dataset directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, Protocol

from ._errors import ManifestError

__all__ = [
    "HASH_ALGORITHMS",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MANIFEST_VERSION",
    "FileEntry",
    "Manifest",
    "ShardEntry",
    "SkippedInput",
    "check_file_name",
    "new_hasher",
]

MANIFEST_NAME = "index.json"
MANIFEST_VERSION = 1
#: Largest shard or sidecar size a manifest may claim (1 PiB): anything larger is corrupt.
MAX_FILE_BYTES = 2**50
#: Largest sample count one shard may claim.
MAX_SHARD_SAMPLES = 2**40
#: Largest ``index.json`` accepted (256 MiB, some 800,000 shards). Storage layers should
#: not read more than this many bytes (plus one, to tell a larger file) of a manifest.
MAX_MANIFEST_BYTES = 256 << 20
#: Deepest nesting of JSON arrays and objects inside ``meta`` (deeper values break
#: pickling the manifest for DataLoader workers with a RecursionError).
MAX_META_DEPTH = 64
#: At most one JSON array (an object counts twice) per this many bytes of a manifest,
#: plus 4096: ``[]`` is 3 bytes of JSON but 56 bytes of Python and ``{"a":0}`` 7 bytes
#: but 184, so a manifest made of them would take 30 to 50 times its size in memory;
#: with the limit, no more than about 15 times (as for short strings or numbers). Those
#: streamload writes have one object per 100 bytes or more.
_BYTES_PER_CONTAINER = 8
HASH_ALGORITHMS = ("sha256", "xxh3_128")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class _Hasher(Protocol):
    """The subset of hashlib's interface streamload uses."""

    def update(self, data: bytes, /) -> None: ...  # pragma: no cover

    def hexdigest(self) -> str: ...  # pragma: no cover


def new_hasher(algorithm: str) -> _Hasher:
    """Return a fresh incremental hasher for ``algorithm`` (one of :data:`HASH_ALGORITHMS`).

    Raises:
        ManifestError: If the algorithm is unknown.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        hasher: _Hasher = xxhash.xxh3_128()
        return hasher
    raise ManifestError(f"unknown hash algorithm {algorithm!r}; known: {', '.join(HASH_ALGORITHMS)}")


def algorithm_of(hexdigest: str) -> str:
    """Return the hash algorithm that produces digests like ``hexdigest`` (by length).

    Raises:
        ManifestError: If no known algorithm has that digest length.
    """
    by_length = {64: "sha256", 32: "xxh3_128"}
    try:
        return by_length[len(hexdigest)]
    except KeyError as exc:
        raise ManifestError(f"digest {hexdigest!r} has no known algorithm") from exc


def hash_stream(stream: BinaryIO, algorithm: str, chunk_size: int = 1 << 20) -> tuple[str, int]:
    """Hash a binary stream to its end; return ``(hexdigest, number_of_bytes)``."""
    hasher = new_hasher(algorithm)
    total = 0
    while chunk := stream.read(chunk_size):
        hasher.update(chunk)
        total += len(chunk)
    return hasher.hexdigest(), total


def hash_file(path: str, algorithm: str | None) -> tuple[str | None, int]:
    """Return ``(hexdigest or None, size)`` of a local file; no digest when ``algorithm`` is None."""
    if algorithm is None:
        return None, os.stat(path).st_size
    with open(path, "rb") as f:
        return hash_stream(f, algorithm)


def check_file_name(name: object, what: str) -> str:
    """Return ``name`` if it is a safe plain file name, else raise :class:`ManifestError`.

    A safe name has no path separator, no ``..``, no leading dot and only
    ``[A-Za-z0-9_.-]`` characters, so joining it to a directory can never escape it.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name or len(name) > 255:
        raise ManifestError(f"{what}: {name!r} is not a plain file name")
    return name


def _int(value: object, what: str, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        raise ManifestError(f"{what}={value!r} must be an integer in [0, {upper}]")
    return value


def _hex(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{16,128}", value):
        raise ManifestError(f"{what}={value!r} is not a lowercase hex digest")
    return value


@dataclass(frozen=True)
class FileEntry:
    """A file of the dataset: its name inside the dataset, byte size and content hash."""

    name: str
    num_bytes: int
    hash: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this entry."""
        return {"name": self.name, "bytes": self.num_bytes, "hash": self.hash}

    @classmethod
    def from_json(cls, obj: object, what: str) -> FileEntry:
        """Parse and validate an entry; ``what`` names it in errors."""
        if not isinstance(obj, Mapping):
            raise ManifestError(f"{what} must be an object, got {type(obj).__name__}")
        name = check_file_name(obj.get("name"), f"{what}.name")
        return cls(
            name=name,
            num_bytes=_int(obj.get("bytes"), f"{what}.bytes", MAX_FILE_BYTES),
            hash=_hex(obj.get("hash"), f"{what}.hash"),
        )


@dataclass(frozen=True)
class ShardEntry(FileEntry):
    """One shard: a :class:`FileEntry` plus its sample count and optional sidecar."""

    num_samples: int = 0
    sidecar: FileEntry | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this entry."""
        out = super().to_json()
        out["samples"] = self.num_samples
        if self.sidecar is not None:
            out["sidecar"] = self.sidecar.to_json()
        return out

    @classmethod
    def from_json(cls, obj: object, what: str) -> ShardEntry:
        """Parse and validate a shard entry; ``what`` names it in errors."""
        base = FileEntry.from_json(obj, what)
        assert isinstance(obj, Mapping)
        sidecar_obj = obj.get("sidecar")
        sidecar = None if sidecar_obj is None else FileEntry.from_json(sidecar_obj, f"{what}.sidecar")
        return cls(
            name=base.name,
            num_bytes=base.num_bytes,
            hash=base.hash,
            num_samples=_int(obj.get("samples"), f"{what}.samples", MAX_SHARD_SAMPLES),
            sidecar=sidecar,
        )


@dataclass(frozen=True)
class SkippedInput:
    """An input the converter skipped under ``on_error="skip"``, with the reason."""

    path: str
    error: str

    def to_json(self) -> dict[str, str]:
        """Return the JSON object for this entry."""
        return {"path": self.path, "error": self.error}


@dataclass(frozen=True)
class Manifest:
    """The parsed, validated content of ``index.json``.

    Attributes:
        format: Shard format name (``"tar"``, ``"lmdb"``, ``"hdf5"``).
        shards: The shards, in dataset order.
        fields: Sorted field names present in the samples (``"cls"``, ``"jpg"``, ...).
        classes: Class names; label ``i`` is ``classes[i]``. Empty if unknown.
        hash_algorithm: Algorithm of the shard hashes, or ``None`` if not hashed.
        skipped: Inputs the converter skipped.
        meta: Free-form JSON metadata (converter options); never interpreted as code.
    """

    format: str
    shards: tuple[ShardEntry, ...]
    fields: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    hash_algorithm: str | None = "sha256"
    skipped: tuple[SkippedInput, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        """Total number of samples over all shards."""
        return sum(s.num_samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        """Total bytes of shards and sidecars."""
        return sum(s.num_bytes + (s.sidecar.num_bytes if s.sidecar else 0) for s in self.shards)

    @property
    def shard_counts(self) -> list[int]:
        """Per-shard sample counts, in shard order (the planner's input)."""
        return [s.num_samples for s in self.shards]

    def with_shards(self, shards: Iterable[ShardEntry]) -> Manifest:
        """Return a copy with other shards."""
        return replace(self, shards=tuple(shards))

    # -- serialisation -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object of version :data:`MANIFEST_VERSION`."""
        return {
            "streamload": MANIFEST_VERSION,
            "format": self.format,
            "num_samples": self.num_samples,
            "hash": self.hash_algorithm,
            "fields": list(self.fields),
            "classes": list(self.classes),
            "shards": [s.to_json() for s in self.shards],
            "skipped": [s.to_json() for s in self.skipped],
            "meta": dict(self.meta),
        }

    def dumps(self) -> bytes:
        """Return the canonical bytes of ``index.json`` (stable key order, no timestamps)."""
        return (json.dumps(self.to_json(), indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()

    @classmethod
    def loads(cls, data: bytes | str, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate manifest bytes; ``where`` (a path or URL) names it in errors.

        Raises:
            ManifestError: If the JSON is malformed, of an unknown version, or inconsistent.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{where}: {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} bytes a manifest may have"
            )
        opening: Any = (b"[", b"{") if isinstance(data, bytes) else ("[", "{")
        containers = data.count(opening[0]) + 2 * data.count(opening[1])  # an upper bound: strings count too
        if containers > len(data) // _BYTES_PER_CONTAINER + 4096:
            raise ManifestError(f"{where}: {containers} JSON arrays or objects in {len(data)} bytes (a memory bomb?)")
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
        except RecursionError as exc:
            raise ManifestError(f"{where}: JSON arrays or objects nested too deeply") from exc
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: top level must be an object")
        try:
            return cls._from_json(obj)
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from exc

    @classmethod
    def _from_json(cls, obj: Mapping[str, Any]) -> Manifest:
        version = obj.get("streamload")
        if version != MANIFEST_VERSION:
            raise ManifestError(f"unsupported manifest version {version!r} (this streamload reads {MANIFEST_VERSION})")
        fmt = obj.get("format")
        if not isinstance(fmt, str) or not fmt:
            raise ManifestError(f"format={fmt!r} must be a non-empty string")
        hash_algorithm = obj.get("hash")
        if hash_algorithm is not None and hash_algorithm not in HASH_ALGORITHMS:
            raise ManifestError(f"hash={hash_algorithm!r} is not one of {HASH_ALGORITHMS}")
        shards_obj = obj.get("shards")
        if not isinstance(shards_obj, list):
            raise ManifestError("shards must be a list")
        shards = tuple(ShardEntry.from_json(s, f"shards[{i}]") for i, s in enumerate(shards_obj))
        names = [s.name for s in shards] + [s.sidecar.name for s in shards if s.sidecar]
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise ManifestError("shard and sidecar names must be unique and not index.json")
        manifest = cls(
            format=fmt,
            shards=shards,
            fields=_str_tuple(obj.get("fields", []), "fields"),
            classes=_str_tuple(obj.get("classes", []), "classes"),
            hash_algorithm=hash_algorithm,
            skipped=tuple(_skipped(s, i) for i, s in enumerate(obj.get("skipped") or [])),
            meta=_meta(obj.get("meta")),
        )
        declared = obj.get("num_samples")
        if declared != manifest.num_samples:
            raise ManifestError(f"num_samples={declared!r} does not match the sum over shards ({manifest.num_samples})")
        return manifest


def _meta(value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ManifestError("meta must be an object")
    _check_depth(value, MAX_META_DEPTH, "meta")
    return value


def _check_depth(value: object, limit: int, what: str) -> None:
    """Raise :class:`ManifestError` if arrays/objects in ``value`` nest deeper than ``limit`` (no recursion)."""
    todo: list[tuple[object, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise ManifestError(f"{what} nests arrays or objects more than {limit} levels deep")
        todo.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _str_tuple(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{what} must be a list of strings")
    return tuple(value)


def _skipped(obj: object, index: int) -> SkippedInput:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("path"), str):
        raise ManifestError(f"skipped[{index}] must be an object with a 'path' string")
    error = obj.get("error", "")
    if isinstance(error, (dict, list)):  # str() of a deeply nested value recurses
        raise ManifestError(f"skipped[{index}].error must be a string")
    return SkippedInput(path=obj["path"], error=str(error))
