"""The interface every shard format implements.

A format is one module that defines a :class:`ShardReader` (one shard in, samples out by
index) and, unless its files are read in place and never written, a :class:`ShardWriter`
(samples in, one local file out, plus an optional sidecar file), and registers a
:class:`Format` describing them and what else it can do (index files written by other
tools, serve reads from byte ranges). Everything around a shard — rollover, temporary
names, hashing, upload, the manifest, caching, splitting — is done once, outside the
formats.

A reader that knows every offset from its index reads its shard through
:class:`ShardBytes`, the contract between a format and the bytes it reads: positioned
reads of one object, whether a local file or ranged requests to a bucket.

The sample model (``docs/design.md#sample-model``): a ``dict`` with ``"__key__"`` (``str``) and one
``bytes`` value per field, named by its WebDataset extension (``"jpg"``, ``"cls"``...).
"""

from __future__ import annotations

import dataclasses
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._errors import ConfigError, SampleError, UnsafeShardError
from .._pread import Gather
from ..manifest import ShardEntry
from ..storage.bytes import ShardBytes

__all__ = [
    "MAX_KEY_BYTES",
    "BatchReads",
    "FieldGroup",
    "Format",
    "GatherPlans",
    "IntegerLabels",
    "PlacedGroup",
    "PlacedReads",
    "RangedReads",
    "Sample",
    "ShardBytes",
    "ShardReader",
    "ShardWriter",
    "TableIndex",
    "TableIndexing",
    "check_sample",
    "key_problem",
    "unsafe_keys",
]

#: A sample: ``{"__key__": str, field: bytes, ...}``.
Sample = dict[str, Any]
#: Longest key (UTF-8 bytes) any format accepts; longer keys are hostile or broken.
MAX_KEY_BYTES = 4096


#: Fields holding an integer label (ASCII decimal): readers parse them as 64-bit integers.
_LABEL_FIELDS = ("cls", "cls2")
_DECIMAL = re.compile(rb"\s*[+-]?[0-9]+\s*")


def _check_label(key: str, name: str, value: bytes) -> None:
    """Refuse an integer label that no reader can take (outside the 64-bit signed range)."""
    if len(value) <= 64 and _DECIMAL.fullmatch(value) and not -(2**63) <= int(value) < 2**63:
        raise SampleError(f"sample {key!r} field {name!r}: label {int(value)} does not fit in 64 bits")
    if len(value) > 64 and _DECIMAL.fullmatch(value[:64]):
        raise SampleError(f"sample {key!r} field {name!r}: a label of {len(value)} characters does not fit in 64 bits")


#: Characters a key may not hold: controls (C0, DEL, C1) and the bidirectional overrides,
#: embeddings and isolates that make a printed key read as another (e.g. U+202E).
_KEY_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
#: Anything a key may not hold, in one search (the common, clean key costs one pass):
#: a forbidden character, or an absolute path, an empty, ``.`` or ``..`` component.
_KEY_BAD = re.compile(_KEY_FORBIDDEN.pattern + r"|^/|//|/$|(?:^|/)\.{1,2}(?:/|$)")


def key_problem(key: object) -> str | None:
    """Return why ``key`` is not a safe sample key, or ``None`` if it is one.

    The rules of tar member names (what a tar writer would extract): a non-empty str of at
    most :data:`MAX_KEY_BYTES` UTF-8 bytes, not absolute, no empty, ``.`` or ``..`` path
    component; and no control or bidirectional-override character (a key printed in a
    log or a terminal must read as what it is).
    """
    if not isinstance(key, str) or not key:
        return f"sample key {key!r} is not a non-empty str"
    if len(key) * 4 > MAX_KEY_BYTES and len(key.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
        return f"sample key {key[:60]!r}... is longer than {MAX_KEY_BYTES} bytes"
    if _KEY_BAD.search(key) is None:
        return None
    bad = _KEY_FORBIDDEN.search(key)
    if bad is not None:
        return f"sample key {key[:200]!r} holds the control or bidirectional character U+{ord(bad.group()):04X}"
    return f"sample key {key[:200]!r} is absolute or has an empty, '.' or '..' path component"


#: In a blob of UTF-8 keys back to back: bytes that may start an unsafe key's trouble (a
#: forbidden character's encoding, an empty, ``.`` or ``..`` component inside a key).
_BLOB_SUSPECT = re.compile(
    rb"[\x00-\x1f\x7f]|\xc2[\x80-\x9f]|\xd8\x9c|\xe2\x80[\x8e\x8f\xaa-\xae]|\xe2\x81[\xa6-\xa9]|//|/\./|/\.\./"
)


def unsafe_keys(blob: bytes | memoryview, bounds: Any) -> dict[int, str]:
    """Return ``{index: problem}`` for the unsafe keys (see :func:`key_problem`) of a blob of keys.

    ``bounds`` holds ``n + 1`` offsets: key ``i`` is ``blob[bounds[i]:bounds[i + 1]]``. One
    pass over the blob and a vectorised look at each key's first and last byte find the
    usual shard clean, so a reader checks its index once when it opens the shard; only
    suspect keys are decoded and checked one by one.
    """
    raw = bytes(blob)
    ends = np.asarray(bounds, dtype=np.int64)
    if len(ends) < 2:
        return {}
    first, last = ends[:-1], ends[1:]
    data = np.frombuffer(raw, dtype=np.uint8)
    suspect = (last <= first) | (last - first > MAX_KEY_BYTES)
    edge = np.zeros(len(first), dtype=bool)
    sized = ~suspect
    if data.size and bool(np.any(sized)):
        head, tail = data[first[sized]], data[last[sized] - 1]
        edge[sized] = (head == ord("/")) | (head == ord(".")) | (tail == ord("/")) | (tail == ord("."))
    candidates = set(np.flatnonzero(suspect | edge).tolist())
    if data.size and (int(data.min()) < 0x20 or int(data.max()) >= 0x7F):
        scan = True  # a control byte, DEL or non-ASCII keys: the regex looks
    elif data.size:  # ASCII: only '//', '/./' or '/../' could be wrong inside a key
        slash, dot = data == ord("/"), data == ord(".")
        scan = bool(
            np.any(slash[:-1] & slash[1:])
            or np.any(slash[:-2] & dot[1:-1] & slash[2:])
            or np.any(slash[:-3] & dot[1:-2] & dot[2:-1] & slash[3:])
        )
    else:
        scan = False
    if scan:
        for match in _BLOB_SUSPECT.finditer(raw):
            candidates.add(int(np.searchsorted(ends, match.start(), side="right")) - 1)
    out = {}
    for i in sorted(candidates):
        if 0 <= i < len(first):
            problem = key_problem(raw[int(first[i]) : int(last[i])].decode("utf-8", "surrogateescape"))
            if problem is not None:
                out[i] = problem
    return out


def check_sample(sample: Mapping[str, Any]) -> tuple[str, list[tuple[str, bytes]]]:
    """Validate a sample for writing; return its key and its fields sorted by name.

    Raises:
        SampleError: If the key is missing or invalid, or a field is not bytes-like.
    """
    key = sample.get("__key__")
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise SampleError(f"sample key {key!r} must be a non-empty str of at most {MAX_KEY_BYTES} bytes")
    last = key.rsplit("/", 1)[-1]
    if "." in last or not last or key.startswith("/") or "\0" in key:
        raise SampleError(f"sample key {key!r}: its last component must be non-empty and dot-free")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise SampleError(f"sample key {key!r}: empty, '.' or '..' path components would escape an extracted tar")
    problem = key_problem(key)
    if problem is not None:
        raise SampleError(problem)
    fields: list[tuple[str, bytes]] = []
    for name in sorted(sample):
        if name.startswith("__"):
            continue
        value = sample[name]
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise SampleError(f"sample {key!r} field {name!r}: expected bytes, got {type(value).__name__}")
        if not name or "/" in name or "\0" in name:
            raise SampleError(f"sample {key!r}: invalid field name {name!r}")
        if name in _LABEL_FIELDS:
            _check_label(key, name, bytes(value))
        fields.append((name, bytes(value)))
    return key, fields


class ShardWriter(ABC):
    """Writes samples, in order, into one local shard file.

    Subclasses implement :meth:`write` and :meth:`finish`. The caller guarantees that
    ``path`` is a fresh temporary name and renames it when :meth:`finish` returns.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.num_samples = 0

    @abstractmethod
    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample (validated with :func:`check_sample`)."""

    @abstractmethod
    def finish(self) -> str | None:
        """Flush and close the shard; return the path of the sidecar written, if any."""

    def abort(self) -> None:  # noqa: B027 - optional hook
        """Release resources after a failure; the caller deletes the files."""


class ShardReader(ABC):
    """Reads the samples of one local shard file by index.

    A reader is created lazily inside the process that reads (after the DataLoader
    forked or spawned its workers) and is never pickled.
    """

    #: The dataset's number of classes when its manifest names them (set by whoever opens
    #: the reader): labels kept in a shard's index (Parquet sidecars) must lie below it.
    num_classes: int | None = None

    def __init__(self, path: str, entry: ShardEntry, sidecar_path: str | None = None) -> None:
        self.path = path
        self.entry = entry
        self.sidecar_path = sidecar_path

    def __len__(self) -> int:
        return self.entry.num_samples

    @abstractmethod
    def get(self, index: int) -> Sample:
        """Return sample ``index`` (0-based within the shard)."""

    def iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        """Yield samples ``start..stop-1`` in order; formats may read them sequentially."""
        for i in range(start, stop):
            yield self.get(i)

    def catalog(self) -> tuple[list[str], list[int]]:
        """Return every sample's key and payload bytes (sum of its field sizes), in order.

        Converters plan shards by bytes from this. Formats that keep keys and sizes in an
        index override it; this default reads every sample.
        """
        keys: list[str] = []
        sizes: list[int] = []
        for sample in self.iter_range(0, len(self)):
            keys.append(sample["__key__"])
            sizes.append(sum(len(v) for k, v in sample.items() if not k.startswith("__")))
        return keys, sizes

    def keys_of(self, indices: np.ndarray) -> list[str]:
        """Return the keys of samples ``indices`` (formats with an index override it: no sample is read)."""
        return [self.get(int(i))["__key__"] for i in indices]

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release file handles; the reader is not used afterwards."""

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{type(self).__name__} for {self.entry.name!r} holds open files and must not be "
            "pickled; pickle the StreamingDataset instead (it opens shards lazily)"
        )

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.entry.num_samples:
            raise IndexError(f"{self.entry.name}: sample {index} out of range [0, {self.entry.num_samples})")


#: One batch read's destination: ``(fields, out, sizes)``; each sample's first present field of
#: ``fields`` goes, back to back, into the ``uint8`` array ``out``; ``sizes`` from :meth:`BatchReads.field_sizes`.
FieldGroup = tuple[Sequence[str], np.ndarray, np.ndarray]


@runtime_checkable
class BatchReads(Protocol):
    """What a :class:`ShardReader` adds to serve zero-copy batches (:mod:`streamload.batch`).

    A reader with these methods gives field sizes from its index, without reading any
    sample, and reads fields straight into a caller's buffer, checksums checked. Readers
    without them are read sample by sample.
    """

    def field_sizes(self, indices: np.ndarray, fields: Sequence[str]) -> np.ndarray:
        """Return ``int64`` byte sizes of each sample's first present field of ``fields``.

        Raises:
            SampleError: Naming the key, if a sample has none of ``fields``.
        """

    def read_groups_into(self, indices: np.ndarray, groups: Sequence[FieldGroup]) -> None:
        """Read every group's fields of samples ``indices`` into the groups' ``out`` arrays in one pass."""


#: :class:`FieldGroup` with each sample's byte offset in ``out`` (``int64``): samples placed anywhere.
PlacedGroup = tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray]


@runtime_checkable
class PlacedReads(Protocol):
    """What a :class:`BatchReads` reader adds that reads each sample's field to a given place of ``out``.

    A shuffled batch's samples of one shard are not consecutive in the batch: read into
    their places directly, they need no copy afterwards (a copy a sample, each a numpy call
    that lets go of the GIL).
    """

    def read_groups_at(self, indices: np.ndarray, groups: Sequence[PlacedGroup]) -> None:
        """:meth:`BatchReads.read_groups_into`, sample ``k`` of each group to its ``out`` at byte ``at[k]``."""


@runtime_checkable
class GatherPlans(Protocol):
    """What a :class:`PlacedReads` reader of a local file adds: its part of a batch's one read call.

    A shuffled batch's samples come from many shards; read a shard at a time, the batch
    takes the GIL back once a shard. Each shard's plan (:class:`streamload._pread.Gather`)
    is made first, then all of them are read in one call that lets go of the GIL once
    (:func:`streamload._pread.gather_all`).
    """

    def gather_plan(self, indices: np.ndarray, groups: Sequence[PlacedGroup]) -> Gather | None:
        """This shard's reads of :meth:`PlacedReads.read_groups_at`, planned, not read; ``None``: read them that way."""


@runtime_checkable
class IntegerLabels(Protocol):
    """What a :class:`BatchReads` reader adds whose labels are integers in its index (Parquet's sidecar).

    A batch read takes them as they are, where other readers' ASCII-decimal ``cls``
    bytes are read and parsed.
    """

    def label_values(self, indices: np.ndarray, field: str) -> np.ndarray | None:
        """Return the ``int64`` labels of samples ``indices`` in ``field``, checked; ``None``: read ``field`` instead.

        Raises:
            SampleError: Naming the sample, if a label is out of the dataset's range.
        """


@runtime_checkable
class RangedReads(Protocol):
    """What the reader of a ranged format (:attr:`Format.ranged`) adds: the bytes a batch needs.

    Its constructor takes ``source=`` (a :class:`ShardBytes`) and ``check_headers=``
    (:meth:`Format.open_reader`); streaming mode fetches the extents this returns ahead of
    the batch, then the reader reads them through ``source``.
    """

    def sample_extents(self, indices: np.ndarray) -> np.ndarray:
        """Return the ``[start, end)`` byte extents, ``int64[n, 2]``, that reading samples ``indices`` touches."""


#: ``indexer(shard_path, shard_name, sidecar_out)`` builds the sidecar of a shard written
#: by another tool into ``sidecar_out``; returns ``(num_samples, field_names)``.
Indexer = Callable[[str, str, str], tuple[int, list[str]]]


@dataclass
class TableIndex:
    """What indexing one table file found: its rows, fields and class names.

    ``num_samples`` counts the rows kept (``skipped`` lists the others). With a string label
    column, ``label_names`` holds the file's distinct labels, sorted, and its sidecar's labels
    index them: :attr:`TableIndexing.relabel` maps them to the dataset's labels once every
    file was read.
    """

    num_samples: int
    fields: list[str]
    #: The class names the file's schema declares (a Hugging Face ``ClassLabel``), if any.
    classes: tuple[str, ...] | None
    label_names: tuple[str, ...] | None = None
    #: Rows left out (``on_error="skip"``): ``(row, why)``, in row order.
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class TableIndexing:
    """How a format read in place indexes its files: tables of someone else's, never rewritten.

    Such files are indexed together (``streamload index DIR --format NAME``): every file is
    read whole and checked before anything is published; the image and label columns can
    be chosen, bad rows skipped, and the index written apart from the files (``--output``,
    ``--split``).

    Attributes:
        kind: What the files are called in messages (``"Parquet"``).
        index: ``index(path, name, sidecar_out, image_column=, label_column=,
            num_classes=, on_error=)`` reads one file whole, writes its sidecar to
            ``sidecar_out`` and returns what it found.
        relabel: ``relabel(sidecar_path, mapping)`` rewrites the labels of a sidecar
            ``index`` wrote: label ``i`` becomes ``mapping[i]``.
    """

    kind: str
    index: Callable[..., TableIndex]
    relabel: Callable[[str, Sequence[int]], None]


@dataclass(frozen=True)
class Format:
    """A registered shard format.

    Attributes:
        name: The name used in manifests and ``--format``.
        extension: Shard file extension, with the dot.
        reader: The :class:`ShardReader` subclass.
        writer: The :class:`ShardWriter` subclass, or ``None`` for a format read in place
            and never written (``convert`` and :class:`~streamload.DatasetWriter` refuse it).
        sidecar_suffix: Suffix appended to the shard name for its sidecar, or ``None``.
        indexer: Builds a sidecar for a shard written by another tool, or ``None``.
        ranged: The reader serves reads from ranged requests (``source=``) and says which
            byte extents a batch needs (:class:`RangedReads`): its shards, with their
            sidecars, can be streamed instead of cached.
        tables: How files read in place are indexed (:class:`TableIndexing`), or ``None``.
        takes_sidecar: The reader takes its sidecar's bytes read by the caller
            (``sidecar=``, with a local shard's open descriptor as ``source=``): a local
            shard's files are then opened and read in one native call
            (:meth:`~streamload.storage.Storage.open_in_place`).
    """

    name: str
    extension: str
    reader: type[ShardReader]
    writer: type[ShardWriter] | None = None
    sidecar_suffix: str | None = None
    indexer: Indexer | None = None
    ranged: bool = False
    tables: TableIndexing | None = None
    takes_sidecar: bool = False

    @property
    def writable(self) -> bool:
        """True if ``convert`` can write this format (a format read in place is never written)."""
        return self.writer is not None

    @property
    def reads_in_place(self) -> bool:
        """True if the files are someone else's tables, indexed and read where they are (:attr:`tables`)."""
        return self.tables is not None

    def open_writer(self, path: str | os.PathLike[str]) -> ShardWriter:
        """Return a :class:`ShardWriter` of this format for the fresh file ``path``.

        Raises:
            ConfigError: Naming the format, if it is read in place and never written.
        """
        if self.writer is None:
            raise ConfigError(self.no_writer())
        return self.writer(path)

    def no_writer(self) -> str:
        """The message refusing to write this format (one without a writer)."""
        how = f" (streamload index DIR --format {self.name})" if self.tables is not None else ""
        return f"the {self.name} format is read in place{how}, never written; convert writes tar, lmdb or hdf5 shards"

    def open_reader(
        self,
        path: str,
        entry: ShardEntry,
        sidecar_path: str | None = None,
        *,
        source: ShardBytes | None = None,
        check_headers: bool = True,
        sidecar: bytes | None = None,
    ) -> ShardReader:
        """Open a reader of shard ``entry``: the local file ``path``, or ``source``'s bytes.

        ``source`` (ranged formats only) reads the shard's bytes instead of ``path``;
        ``check_headers=False`` lets the reader skip the reads that only check the shard's
        own headers against its index when it opens (round trips, when streamed);
        ``sidecar`` (with :attr:`takes_sidecar`): the sidecar's bytes, already read.

        Raises:
            ConfigError: If ``source`` is given for a format that cannot read from it.
        """
        if source is None:
            return self.reader(path, entry, sidecar_path)
        if not self.ranged:
            raise ConfigError(f"the {self.name} format reads local files only: its shards cannot be streamed")
        ranged: Any = self.reader  # a ranged format's reader takes source= and check_headers=
        if sidecar is None:
            opened: ShardReader = ranged(path, entry, sidecar_path, source=source, check_headers=check_headers)
            return opened
        if not self.takes_sidecar:
            raise ConfigError(f"the {self.name} format's reader reads its sidecar itself")
        opened = ranged(path, entry, sidecar_path, source=source, check_headers=check_headers, sidecar=sidecar)
        return opened

    def shard_name(self, index: int) -> str:
        """Return the canonical file name of shard ``index``."""
        return f"shard-{index:06d}{self.extension}"

    def sidecar_name(self, shard_name: str) -> str | None:
        """Return the sidecar file name for ``shard_name``, or ``None``."""
        return None if self.sidecar_suffix is None else shard_name + self.sidecar_suffix


def unsafe(entry_name: str, detail: str) -> UnsafeShardError:
    """Return an :class:`UnsafeShardError` naming the shard."""
    return UnsafeShardError(f"{entry_name}: {detail}")
