"""The dataset manifest, ``index.json`` (``docs/design.md#a-dataset-on-disk``).

A manifest is small: it grows with the number of *shards*, never with the number of
samples, so every worker can hold it. Per-sample data a format needs for random
access (tar byte offsets) lives in a per-shard sidecar file named by the shard entry.

On disk (version 1)::

    {
      "streamload": 1,
      "format": "tar",
      "num_samples": 5000,
      "hash": "xxh3_128",
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

An index written apart from its files (``streamload index SRC --format parquet --output
DST``) adds ``"data_root": "s3://bucket/data"`` (or an absolute local path): the shards'
plain names are then looked up under that root, their sidecars beside ``index.json``. It
is honoured only for formats read in place (see :func:`check_data_root`).

Everything in it is untrusted input: it is parsed with :func:`json.loads` only and
validated field by field (counts, sizes, names that cannot leave the dataset directory).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ._classes import long_name
from ._errors import ManifestError
from ._files import (
    DEFAULT_HASH_ALGORITHM,
    HASH_ALGORITHMS,
    LOCAL_PROTOCOLS,
    FileEntry,
    algorithm_of,
    check_file_name,
    hash_file,
    hash_stream,
    new_hasher,
)

__all__ = [
    "DEFAULT_HASH_ALGORITHM",
    "HASH_ALGORITHMS",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "FileEntry",
    "Manifest",
    "ShardEntry",
    "SkippedInput",
    "algorithm_of",
    "check_data_root",
    "data_root_place",
    "is_under",
    "check_file_name",
    "ForeignManifestError",
    "foreign_kind",
    "foreign_manifest",
    "hash_file",
    "hash_stream",
    "new_hasher",
]

MANIFEST_NAME = "index.json"
#: Longest ``data_root`` accepted.
MAX_DATA_ROOT = 4096
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
    def from_json(cls, obj: object, what: str, algorithm: str | None = None) -> ShardEntry:
        """Parse and validate a shard entry; ``what`` names it in errors.

        ``algorithm`` is the manifest's hash algorithm, carried by the entry and its sidecar.
        """
        name, num_bytes, digest = _file_fields(obj, what)
        assert isinstance(obj, Mapping)
        sidecar_obj = obj.get("sidecar")
        sidecar = None
        if sidecar_obj is not None:
            s_name, s_bytes, s_digest = _file_fields(sidecar_obj, f"{what}.sidecar")
            sidecar = FileEntry(s_name, s_bytes, s_digest, algorithm=algorithm)
        return cls(
            name=name,
            num_bytes=num_bytes,
            hash=digest,
            num_samples=_int(obj.get("samples"), f"{what}.samples", MAX_SHARD_SAMPLES),
            sidecar=sidecar,
            algorithm=algorithm,
        )

    def with_algorithm(self, algorithm: str | None) -> ShardEntry:
        """Return this entry (and its sidecar) carrying ``algorithm``."""
        if self.algorithm == algorithm and (self.sidecar is None or self.sidecar.algorithm == algorithm):
            return self
        sidecar = None if self.sidecar is None else replace(self.sidecar, algorithm=algorithm)
        return replace(self, sidecar=sidecar, algorithm=algorithm)

    @property
    def files(self) -> tuple[FileEntry, ...]:
        """The files this shard needs: its sidecar (if any), then the shard itself."""
        return (self,) if self.sidecar is None else (self.sidecar, self)


def _file_fields(obj: object, what: str) -> tuple[str, int, str | None]:
    """Parse a file entry's ``name``, ``bytes`` and ``hash``; ``what`` names it in errors."""
    if not isinstance(obj, Mapping):
        raise ManifestError(f"{what} must be an object, got {type(obj).__name__}")
    name = check_file_name(obj.get("name"), f"{what}.name")
    return name, _int(obj.get("bytes"), f"{what}.bytes", MAX_FILE_BYTES), _hex(obj.get("hash"), f"{what}.hash")


@dataclass(frozen=True)
class SkippedInput:
    """An input the converter skipped under ``on_error="skip"``, with the reason."""

    path: str
    error: str

    def to_json(self) -> dict[str, str]:
        """Return the JSON object for this entry."""
        return {"path": self.path, "error": self.error}


#: The shard formats of MosaicML Streaming (``"format"`` of each entry of its ``shards``).
_MDS_FORMATS = ("mds", "csv", "tsv", "json", "jsonl")


def foreign_kind(obj: object) -> tuple[str, str] | None:
    """Which other tool's ``index.json`` ``obj`` (parsed JSON) is, and what reads it; ``None`` if none is known.

    MosaicML Streaming (MDS) writes ``{"shards": [{"format": "mds", "column_encodings": ...}],
    "version": 2}``; LitData (``litdata.optimize``) writes ``{"chunks": [...], "config": {...}}``.
    Neither is a streamload manifest: their shards are not tar, Parquet, LMDB or HDF5 files.
    """
    if not isinstance(obj, dict) or "streamload" in obj:
        return None
    shards = obj.get("shards")
    first = shards[0] if isinstance(shards, list) and shards else None
    if isinstance(first, dict) and ("column_encodings" in first or first.get("format") in _MDS_FORMATS):
        kind = str(first.get("format", "mds")).upper()
        return f"a MosaicML Streaming ({kind}) dataset", "mosaicml-streaming's streaming.StreamingDataset"
    if isinstance(obj.get("chunks"), list) and isinstance(obj.get("config"), dict):
        return "a LitData (litdata.optimize) dataset", "litdata's StreamingDataset"
    return None


class ForeignManifestError(ManifestError):
    """An ``index.json`` another tool wrote (MDS, LitData): ``kind`` names it (see :func:`foreign_kind`)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def foreign_manifest(obj: object) -> ForeignManifestError | None:
    """The error saying what another tool's ``index.json`` is and the way forward (see :func:`foreign_kind`)."""
    found = foreign_kind(obj)
    if found is None:
        return None
    kind, reader = found
    return ForeignManifestError(
        f"{kind}, not a streamload one: streamload cannot read its shards; read it with {reader}, "
        "or write its samples into a streamload dataset with streamload.DatasetWriter",
        kind,
    )


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
        data_root: Where the shard files are (an absolute local path or a URL), when the
            index lives apart from them; ``None``: beside ``index.json``. Sidecars are
            always beside ``index.json``.
    """

    format: str
    shards: tuple[ShardEntry, ...]
    fields: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM
    skipped: tuple[SkippedInput, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    data_root: str | None = None

    def __post_init__(self) -> None:
        # Every entry carries the manifest's hash algorithm: storage checks files by their entry alone.
        object.__setattr__(self, "shards", tuple(s.with_algorithm(self.hash_algorithm) for s in self.shards))
        too_long = long_name(self.classes)
        if too_long is not None:  # a label's name, not a document (info and show print them)
            raise ManifestError(f"classes: {too_long}")

    @property
    def largest_shard_bytes(self) -> int:
        """Bytes of the largest shard together with its sidecar (what a cache must hold at once)."""
        return max((sum(f.num_bytes for f in s.files) for s in self.shards), default=0)

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

    # -- serialisation -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object of version :data:`MANIFEST_VERSION`."""
        out: dict[str, Any] = {
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
        if self.data_root is not None:  # absent otherwise: the bytes of other manifests stay the same
            out["data_root"] = self.data_root
        return out

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
        except ForeignManifestError as exc:
            raise ForeignManifestError(f"{where}: {exc}", exc.kind) from exc
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from exc

    @classmethod
    def _from_json(cls, obj: Mapping[str, Any]) -> Manifest:
        version = obj.get("streamload")
        foreign = foreign_manifest(obj)
        if foreign is not None:
            raise foreign
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
            data_root=None if obj.get("data_root") is None else check_data_root(obj.get("data_root")),
        )
        declared = obj.get("num_samples")
        if declared != manifest.num_samples:
            raise ManifestError(f"num_samples={declared!r} does not match the sum over shards ({manifest.num_samples})")
        return manifest


def check_data_root(value: object) -> str:
    """Return a valid ``data_root``: an absolute local path or a ``protocol://`` URL, normalised.

    It must be explicit and plain: no ``.`` or ``..`` segments, no empty segments, no query
    or fragment, no control characters, no fsspec chain (``::``), a lower-case protocol, an
    absolute path after ``file://`` and ``local://``, at most :data:`MAX_DATA_ROOT`
    characters; a trailing ``/`` is dropped. (Whether it may be used at all depends on the format and on
    where the manifest was read: see :meth:`streamload.dataref.DatasetRef.open`.)

    Raises:
        ManifestError: Naming the value.
    """
    if not isinstance(value, str) or not value or len(value) > MAX_DATA_ROOT:
        raise ManifestError(f"data_root={value!r} must be a non-empty string of at most {MAX_DATA_ROOT} characters")
    root = value.rstrip("/") or "/"
    if any(ord(c) < 32 or c in "?#\\\x7f" for c in root):
        raise ManifestError(f"data_root={value!r} holds control characters, '?', '#' or a backslash")
    if "::" in root:
        raise ManifestError(f"data_root={value!r} is an fsspec chain ('::'); name one place: a path or one URL")
    match = re.fullmatch(r"([a-z][a-z0-9+.-]*)://(.+)", root)
    if match is not None:
        rest = match.group(2)
        local = match.group(1) in LOCAL_PROTOCOLS
        if local and not rest.startswith("/"):
            raise ManifestError(f"data_root={value!r}: a {match.group(1)}:// root must be an absolute path")
        segments = rest.lstrip("/").split("/") if local else rest.split("/")
    elif root.startswith("/"):
        segments = root[1:].split("/") if root != "/" else []
    else:
        raise ManifestError(f"data_root={value!r} must be an absolute path or a protocol:// URL")
    if any(seg in ("", ".", "..") for seg in segments):
        raise ManifestError(f"data_root={value!r} has an empty, '.' or '..' path segment")
    return root


def data_root_place(url: str) -> tuple[str, str]:
    """The ``(scheme, host)`` of a URL, lower case: where its files are served from.

    The host is everything between ``://`` and the next ``/``: the bucket of ``s3://`` and
    ``gs://``, ``host:port`` of ``http(s)://``. A manifest read from a URL may send its
    readers only to its own place (see :func:`streamload.dataref.DatasetRef.open`).
    """
    scheme, _, rest = url.partition("://")
    return scheme.lower(), rest.split("/", 1)[0].lower()


def is_under(root: str, prefix: str) -> bool:
    """True if ``root`` is ``prefix`` or a path below it (whole segments: ``s3://b/da`` is not under ``s3://b/d``)."""
    prefix = prefix.rstrip("/")
    return root == prefix or root.startswith(prefix + "/")


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
