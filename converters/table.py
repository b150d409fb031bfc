"""A listing table as a conversion source: Parquet, CSV or JSONL rows to samples.

Each row names one image, by a path or URL (``--path-column``, default ``path``; relative
paths are resolved against the table's own folder or URL prefix), or holds its bytes
(``--image-column``: a Hugging Face image struct ``{"bytes", "path"}`` or a plain binary
column, detected automatically in Parquet). The label (``--label-column``, default
``label``) is a class index (an integer) or a class name; class names are sorted and
numbered, ``classes[i]`` being the name of label ``i``. ``--keep-columns a,b`` carries
other columns into each sample's ``json`` field.

**Planning is streamed.** The table is read a block at a time (a batch of a Parquet row
group, or :data:`TEXT_BLOCK_BYTES` of CSV/JSONL cut at a line end) and shards are cut as
it goes, with the engine's rule (:class:`~.planning.ShardCutter`). A planned shard is a
:class:`RowSpan`: its rows ``[first, stop)``, the few rows inside left out (broken, or
already in the dataset an append adds to), and where its reading starts (the row group,
or the byte offset of the block holding ``first``). The driver keeps the spans, the
problems and the distinct label values: O(shards + bad rows + classes), never O(rows).
The task that writes a shard reads only its own rows: the row groups its span touches,
one batch at a time, or the text from its byte offset to its last row.

The class table (names sorted) is known only after the whole scan, so a task reads each
row's label value itself and maps it through the source's class table. Whether labels are
class indices or names is also decided by the whole scan (all integers: indices); a row
with a negative index is a problem named by row. Should a later row turn the labels into
names after negative integers were left out, the table is scanned once more.

With ``shuffle`` a global seeded permutation of the rows is planned
(:class:`RowList`): that is O(rows) by nature (8 bytes a row, 16 with a byte limit and
embedded images), and each shuffled shard's rows are spread over the whole table, so its
task reads every block that holds one of them.

The payload size a row counts for ``--shard-size`` is its image's: the embedded bytes'
length, or a nominal :data:`NOMINAL_IMAGE_BYTES` for a path (its size is not known before
it is read); the few bytes of ``cls`` and ``json`` are not counted.

Keys are ``<table stem>/<row number>`` (rows count from 0, the header and blank lines
excluded), so they are unique by construction; appending another table never collides,
appending the same table twice does (the rows already there are left out, named). A row
with no path, no image bytes or no label, with a path that is not an image file, or with
an unusable or negative label is a broken input named by its row number: an error under
``--on-error raise``, skipped and listed under ``skip`` like a missing object (a 404) or
a corrupt image found while converting.

CSV follows pyarrow's default of no line breaks inside values (``newlines_in_values``
off): blocks are cut at line ends and each is parsed with the header line before it; CRLF
line ends, quoting and blank lines are fine.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import posixpath
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import xxhash

from streamload._errors import ConfigError, SourceError, StreamloadError
from streamload.manifest import SkippedInput
from streamload.sample import IMAGE_EXTENSIONS, image_field_for
from streamload.storage import is_local, local_path_of
from streamload.storage.filesystems import open_filesystem

from .images import WARNINGS_KEY, check_image, escape_stem
from .planning import ShardCutter, cuts
from .remote import read_url
from .source import Item, ScanResult, Source, printable

__all__ = [
    "NOMINAL_IMAGE_BYTES",
    "PARQUET_BATCH_ROWS",
    "TABLE_EXTENSIONS",
    "TEXT_BLOCK_BYTES",
    "RowList",
    "RowSpan",
    "TableItem",
    "TablePlan",
    "TableSource",
    "is_table",
]

#: Table formats by file extension.
TABLE_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
#: Payload size assumed for a row naming a file (its size is not known before it is read).
NOMINAL_IMAGE_BYTES = 100_000
#: Bytes of CSV or JSONL read per block (a block ends at the first line end after this many).
TEXT_BLOCK_BYTES = 1 << 20
#: Rows decoded at a time from a Parquet row group.
PARQUET_BATCH_ROWS = 16384

_IMAGE_PATH = r"\.(?:" + "|".join(sorted(IMAGE_EXTENSIONS)) + r")/*$"
_INT = re.compile(r"-?[0-9]+")


def is_table(src: str) -> bool:
    """True if ``src`` names a listing table by its extension."""
    return os.path.splitext(src.rstrip("/"))[1].lower() in TABLE_EXTENSIONS


@dataclass(frozen=True)
class TableItem(Item):
    """One row of the table: its number and, once read by a task, its values (by column)."""

    row: int = 0
    values: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


class _Rows(Sequence[Item]):
    """Rows of a table as items (made on access); subclasses say which rows."""

    prefix: str

    def rows(self) -> Iterator[int]:
        """Yield the row numbers, in shard order."""
        raise NotImplementedError

    def _item(self, row: int) -> TableItem:
        return TableItem(f"{self.prefix}/{row:010d}", 0, row)

    def __iter__(self) -> Iterator[Item]:
        for row in self.rows():
            yield self._item(row)

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Item]: ...

    def __getitem__(self, index: int | slice) -> Item | Sequence[Item]:
        if isinstance(index, slice):
            return [self._item(self._row_at(i)) for i in range(len(self))[index]]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(index)
        return self._item(self._row_at(index % n))

    def _row_at(self, index: int) -> int:
        raise NotImplementedError


class RowSpan(_Rows):
    """A planned shard of a table, compactly: rows ``[first, stop)`` minus ``excluded``.

    Args:
        prefix: Key prefix (the table's stem).
        first: Its first row.
        stop: One past its last row.
        excluded: Rows inside left out (sorted).
        position: Where its reading starts: the Parquet row group, or the byte offset of
            the CSV/JSONL block, holding ``first``.
        position_row: The row number at ``position``.
    """

    def __init__(
        self, prefix: str, first: int, stop: int, excluded: Sequence[int], position: int, position_row: int
    ) -> None:
        self.prefix = prefix
        self.first = first
        self.stop = stop
        self.excluded = tuple(excluded)
        self.position = position
        self.position_row = position_row

    def __len__(self) -> int:
        return self.stop - self.first - len(self.excluded)

    def rows(self) -> Iterator[int]:
        """Yield the row numbers of the span, in order."""
        skip = set(self.excluded)
        return (r for r in range(self.first, self.stop) if r not in skip)

    def _row_at(self, index: int) -> int:
        row = self.first + index
        for e in self.excluded:  # sorted: each one at or before the candidate pushes it on
            if e <= row:
                row += 1
        return row

    def fingerprint_bytes(self) -> bytes:
        """Return the bytes that identify this span (for the plan fingerprint)."""
        head = struct.pack("<5q", self.first, self.stop, self.position, self.position_row, len(self.excluded))
        return self.prefix.encode() + b"\0" + head + np.asarray(self.excluded, dtype="<i8").tobytes()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSpan) and self.__getstate__() == other.__getstate__()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"RowSpan({self.prefix!r}, first={self.first}, stop={self.stop}, excluded={self.excluded}, "
            f"position={self.position}, position_row={self.position_row})"
        )

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.prefix, self.first, self.stop, self.excluded, self.position, self.position_row)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.prefix, self.first, self.stop, self.excluded, self.position, self.position_row = state


class RowList(_Rows):
    """A planned shard of a table as an explicit array of rows (a shuffled plan only).

    Args:
        prefix: Key prefix (the table's stem).
        rows: Row numbers, in shard order (int64).
    """

    def __init__(self, prefix: str, rows: np.ndarray[Any, Any]) -> None:
        self.prefix = prefix
        self.row_array = np.asarray(rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.row_array)

    def rows(self) -> Iterator[int]:
        """Yield the row numbers, in shard order."""
        return iter(self.row_array.tolist())

    def _row_at(self, index: int) -> int:
        return int(self.row_array[index])

    def fingerprint_bytes(self) -> bytes:
        """Return the bytes that identify these rows, in order (for the plan fingerprint)."""
        return self.prefix.encode() + b"\0" + self.row_array.astype("<i8").tobytes()


@dataclass
class TablePlan:
    """A table's streamed scan and plan.

    Attributes:
        shards: The planned shards, in order (:class:`RowSpan`, or :class:`RowList` when shuffled).
        problems: Broken rows, in row order.
        present: Rows left out because their keys are already in the destination (appending).
        samples: Rows planned.
        rows: Rows in the table.
    """

    shards: list[Sequence[Item]]
    problems: list[SkippedInput]
    present: list[SkippedInput]
    samples: int
    rows: int


@dataclass
class _Block:
    """One block of the scan: its rows' verdicts and sizes."""

    position: int
    position_row: int
    first_row: int
    ok: np.ndarray[Any, Any]
    sizes: np.ndarray[Any, Any]
    problems: list[tuple[int, SkippedInput]]


class _SpanBuilder:
    """Turn the shard starts found while scanning into :class:`RowSpan` objects."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.spans: list[Sequence[Item]] = []
        self._open: tuple[int, int, int] | None = None  # first, position, position_row
        self._bad: list[int] = []  # left-out rows not yet given to a span, sorted
        self._head = 0
        self._last_good = -1

    def feed(self, block: _Block, ok: np.ndarray[Any, Any], starts: np.ndarray[Any, Any]) -> None:
        good = np.flatnonzero(ok)
        self._bad.extend((block.first_row + np.flatnonzero(~ok)).tolist())
        for s in starts.tolist():
            self._start(block.first_row + int(good[s]), block.position, block.position_row)
        if len(good):
            self._last_good = block.first_row + int(good[-1])

    def _take_bad(self, stop: int) -> list[int]:
        end = bisect.bisect_left(self._bad, stop, self._head)
        taken = self._bad[self._head : end]
        self._head = end
        if self._head > 4096 and self._head * 2 > len(self._bad):
            del self._bad[: self._head]
            self._head = 0
        return taken

    def _start(self, row: int, position: int, position_row: int) -> None:
        excluded = self._take_bad(row)
        if self._open is not None:
            first, pos, pos_row = self._open
            self.spans.append(RowSpan(self.prefix, first, row, excluded, pos, pos_row))
        self._open = (row, position, position_row)

    def finish(self) -> list[Sequence[Item]]:
        if self._open is not None:
            first, pos, pos_row = self._open
            stop = self._last_good + 1
            self.spans.append(RowSpan(self.prefix, first, stop, self._take_bad(stop), pos, pos_row))
            self._open = None
        return self.spans


def _root_of(root: str) -> str:
    """``root`` as a resolved local directory (links resolved) or a URL prefix."""
    if is_local(root):
        return os.path.realpath(local_path_of(root))
    return root.rstrip("/")


def _inside(path: str, root: str) -> bool:
    """True if ``path`` (resolved by :meth:`TableSource.resolve`) lies inside ``root`` (see :func:`_root_of`)."""
    if "://" in root:
        if not path.startswith(root + "/"):
            return False
        # "%2e%2e" and other escapes stay as they are: a store reads them as names, not as "..".
        return all(part not in ("..", ".") for part in path[len(root) + 1 :].split("/"))
    if "://" in path and not path.startswith("file://"):
        return False
    real = os.path.realpath(local_path_of(path))
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _is_image_type(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if "bytes" in names:
            inner = t.field("bytes").type
            return bool(pa.types.is_binary(inner) or pa.types.is_large_binary(inner))
    return False


def _ext_of(path: str) -> str:
    name = path.rstrip("/").rpartition("/")[2]
    return name.rpartition(".")[2].lower() if "." in name else ""


def _int_label(value: Any) -> int | None:
    """The class index ``value`` spells (an int, or a string of decimal digits), else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        if _INT.fullmatch(text):
            return int(text)
    return None


def _unusable(value: Any) -> str | None:
    """Why ``value`` cannot be a label (``None``: it can)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "no label"
    if isinstance(value, (bool, float, dict, list)):
        return f"label {value!r} is not usable"
    return None


def _pylist(col: Any, lo: int = 0, hi: int | None = None) -> list[Any]:
    """A column (Arrow array or list) as a Python list of its rows ``[lo, hi)``."""
    if isinstance(col, list):
        return col[lo:hi]
    end = len(col) if hi is None else hi
    return list(col.slice(lo, end - lo).to_pylist())


def _arrow(col: Any) -> Any:
    """``col`` as one Arrow array (chunks combined, dictionaries decoded), or ``None`` for a Python list."""
    import pyarrow as pa

    if isinstance(col, list):  # JSONL values: as Arrow only if all strings or all integers (or None)
        try:
            arr = pa.array(col)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
        t = arr.type
        return arr if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) else None
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    return col


def _mask(array: Any) -> np.ndarray[Any, Any]:
    """A boolean Arrow array (nulls as false) as NumPy."""
    return np.asarray(array.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)


class TableSource(Source):
    """Rows of a Parquet, CSV or JSONL table (local or at a URL) naming or holding images.

    Args:
        url: The table (its extension says the format).
        path_column: The column of image paths or URLs.
        label_column: The column of labels (class indices or names); ``""``: no labels.
        image_column: A column of image bytes (struct ``{"bytes", "path"}`` or binary);
            ``None``: detected in Parquet.
        keep_columns: Other columns carried into each sample's ``json`` field.
        storage_options: fsspec options for the table and the objects it names.
        check: How images are checked (``"decode"``, ``"header"``, ``"none"``).
        root: If given, every path the table names must resolve inside it (a local
            directory or a URL prefix): a row naming ``../x``, an absolute path, another
            bucket or another scheme is an input problem (skipped with ``on_error="skip"``),
            and nothing outside is read. ``None``: paths may point anywhere.

    Raises:
        SourceError: If the table cannot be read.
        ConfigError: If a named column is missing (the message lists the columns there are).
    """

    def __init__(
        self,
        url: str,
        path_column: str = "path",
        label_column: str = "label",
        image_column: str | None = None,
        keep_columns: Sequence[str] = (),
        storage_options: Mapping[str, Any] | None = None,
        check: str = "decode",
        root: str | None = None,
    ) -> None:
        if check not in ("decode", "header", "none"):
            raise SourceError(f"check={check!r} must be 'decode', 'header' or 'none'")
        self.root = _root_of(root) if root else None
        try:
            import pyarrow  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"{url}: reading listing tables needs pyarrow: pip install 'streamload[table]'") from exc
        self.url = url
        self.kind = TABLE_EXTENSIONS.get(os.path.splitext(url)[1].lower(), "")
        if not self.kind:
            raise ConfigError(f"{url}: not a listing table (expected {', '.join(sorted(TABLE_EXTENSIONS))})")
        self.storage_options = dict(storage_options or {})
        self.path_column = path_column
        self.label_column = label_column
        self.keep_columns = list(keep_columns)
        self.check = check
        self.classes = []
        self._int_labels = True
        # How the table is cut into blocks, fixed here so that every task cuts it as the scan did.
        self._block_bytes = TEXT_BLOCK_BYTES
        self._batch_rows = PARQUET_BATCH_ROWS
        self._header = b""  # CSV: the header line, parsed before each block
        self._data_start = 0  # CSV: the byte offset of the first line after it
        self._csv_types: dict[str, Any] = {}  # CSV: column types, inferred once from the first block
        self._digest: str | None = None  # the table's content, as read by the scan
        self._force_names = False  # labels are class names (found by an earlier scan)
        self._class_index: dict[str, int] | None = None
        self._block_index: np.ndarray[Any, Any] | None = None  # (position, row) of every block, for RowList tasks
        self._seen: dict[Any, None] = {}  # the distinct label values of the last scan
        columns = self._columns()
        if image_column is None and self.kind == "parquet":
            image_column = next((name for name, t in columns.items() if _is_image_type(t)), None)
        self.image_column = image_column
        wanted = [c for c in (image_column, label_column, *self.keep_columns) if c]
        if image_column is None:
            wanted.append(path_column)
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise ConfigError(
                f"{url}: no column {', '.join(map(repr, missing))} (it has: {', '.join(columns) or 'none'}); "
                "name them with --path-column, --label-column, --image-column, --keep-columns"
            )
        if self.kind == "csv":
            import pyarrow as pa

            strings = {c for c in (self.path_column, self.label_column) if c}
            self._csv_types = {
                name: pa.string() if name in strings or pa.types.is_null(t) else t for name, t in columns.items()
            }
        base = url.rstrip("/").rpartition("/")[2] if "://" in url else os.path.basename(url)
        self.prefix = escape_stem(os.path.splitext(base)[0]) or "row"

    # -- the table ---------------------------------------------------------------------

    def describe(self) -> str:
        """Return the table's path or URL."""
        return self.url

    def settings(self) -> dict[str, Any]:
        """Return the columns and the image check: a resume must use the same ones."""
        return {
            "check": self.check,
            "path_column": self.path_column,
            "label_column": self.label_column,
            "image_column": self.image_column,
            "keep_columns": self.keep_columns,
        }

    def content_digest(self) -> str | None:
        """Return a digest of the table's content as the last scan read it (``None`` before a scan).

        CSV and JSONL: an xxh3-128 of every byte; Parquet: a SHA-256 of its footer (the
        schema, and each column chunk's size, offsets and statistics) and its size. The
        label mode and class table are part of it.
        """
        if self._digest is None:
            return None
        labels = json.dumps([self._int_labels, self.classes], ensure_ascii=False)
        return hashlib.sha256(f"{self._digest}\0{labels}".encode("utf-8", "surrogateescape")).hexdigest()

    def meta(self) -> dict[str, Any]:
        """Return the table and how labels were read, for the manifest."""
        labels = "index" if self._int_labels else "class names, sorted"
        return {"source": printable(self.url), "source_table": self.kind, "labels": labels}

    def _open(self) -> Any:
        if is_local(self.url):
            return open(local_path_of(self.url), "rb")  # noqa: SIM115 - returned to the caller
        fs, path = open_filesystem(self.url, self.storage_options)
        return fs.open(path, "rb")

    def _fail(self, exc: BaseException) -> SourceError:
        if isinstance(exc, FileNotFoundError):
            return SourceError(f"{self.url}: the table does not exist")
        return SourceError(f"{self.url}: cannot read the table: {printable(str(exc))}")

    def _check_unique(self, names: Sequence[str]) -> None:
        """Refuse a header naming a column twice (which of the two would a row's value be?)."""
        twice = sorted({n for n in names if list(names).count(n) > 1})
        if twice:
            raise SourceError(
                f"{self.url}: the header names column(s) {', '.join(map(repr, map(printable, twice)))} more than once; "
                "give every column its own name"
            )

    def _columns(self) -> dict[str, Any]:
        """The table's column names and (Arrow) types; for CSV, find the header line too."""
        import pyarrow as pa

        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                with self._open() as f:
                    schema = pq.ParquetFile(f).schema_arrow
                self._check_unique(schema.names)
                return {name: schema.field(name).type for name in schema.names}
            if self.kind == "csv":
                import pyarrow.csv as pcsv

                with self._open() as f:
                    offset = 0
                    for line in f:
                        offset += len(line)
                        if line.strip(b"\r\n"):
                            self._header = line if line.endswith(b"\n") else line + b"\n"
                            break
                    self._data_start = offset
                    f.seek(0)
                    reader = pcsv.open_csv(f, read_options=pcsv.ReadOptions(block_size=1 << 20))
                    schema = reader.schema
                    reader.close()  # before the file closes: its reading thread must not outlive it
                self._check_unique(schema.names)
                return {name: schema.field(name).type for name in schema.names}
            with self._open() as f:
                for line in f:
                    if line.strip():
                        obj = json.loads(line)
                        if not isinstance(obj, dict):
                            raise SourceError(f"{self.url}: row 0 is not a JSON object")
                        return {str(k): pa.null() for k in obj}
            return {}
        except StreamloadError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise self._fail(exc) from exc

    # -- reading blocks ----------------------------------------------------------------

    def _value_columns(self) -> list[str]:
        """The columns a task reads: the image or path, the label, the kept columns."""
        columns: list[str] = []
        for c in (self.image_column or self.path_column, self.label_column, *self.keep_columns):
            if c and c not in columns:
                columns.append(c)
        return columns

    def _raw_blocks(self, f: Any, offset: int, hasher: Any = None) -> Iterator[tuple[int, bytes]]:
        """Yield ``(offset, bytes)`` blocks of a text table from ``offset``, each ending at a line end.

        A block ends at the first line end at or after ``offset + block_bytes - 1`` (or at
        the end of the file), so blocks depend only on where reading starts.
        """
        size = self._block_bytes
        f.seek(offset)
        buf = b""
        eof = False
        while True:
            cut = buf.find(b"\n", size - 1) if len(buf) >= size else -1
            while cut < 0 and not eof:
                chunk = f.read(size)
                if not chunk:
                    eof = True
                    break
                if hasher is not None:
                    hasher.update(chunk)
                buf += chunk
                if len(buf) >= size:
                    cut = buf.find(b"\n", size - 1)
            if not buf:
                return
            end = cut + 1 if cut >= 0 else len(buf)
            yield offset, buf[:end]
            offset += end
            buf = buf[end:]

    def _parse_csv(self, data: bytes, columns: Sequence[str], offset: int) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        text = self._header + data
        try:
            table = pcsv.read_csv(
                pa.BufferReader(text),
                read_options=pcsv.ReadOptions(use_threads=False, block_size=min(len(text) + 1, 2**31 - 1)),
                convert_options=pcsv.ConvertOptions(
                    column_types={c: self._csv_types[c] for c in columns if c in self._csv_types},
                    include_columns=list(columns),
                ),
            )
        except (ValueError, pa.ArrowException) as exc:
            raise SourceError(f"{self.url}: cannot read the CSV block at byte {offset}: {printable(str(exc))}") from exc
        return {c: table.column(c) for c in columns}

    def _parse_jsonl(self, data: bytes, columns: Sequence[str], first_row: int) -> dict[str, Any]:
        lines = [line for line in data.split(b"\n") if line.strip()]
        try:  # one call for the block; row by row only to name a broken row
            objs = json.loads(b"[" + b",".join(lines) + b"]") if lines else []
            if len(objs) != len(lines):
                raise ValueError("a line holds more than one value")
        except (ValueError, RecursionError):
            objs = []
            for i, line in enumerate(lines):
                try:
                    objs.append(json.loads(line))
                except ValueError as exc:
                    row = first_row + i
                    raise SourceError(f"{self.url}: row {row} is not valid JSON: {printable(str(exc))}") from exc
        block: dict[str, list[Any]] = {c: [] for c in columns}
        for i, obj in enumerate(objs):
            if not isinstance(obj, dict):
                raise SourceError(f"{self.url}: row {first_row + i} is not a JSON object")
            for c in columns:
                block[c].append(obj.get(c))
        return block

    def _read(
        self, columns: Sequence[str], position: int | None = None, position_row: int = 0, hasher: Any = None
    ) -> Iterator[tuple[int, int, int, dict[str, Any]]]:
        """Yield ``(position, position_row, first_row, columns)`` blocks from ``position`` on.

        ``position`` is a Parquet row group or a text block's byte offset (``None``: the
        start of the data), ``position_row`` the row number there.
        """
        import pyarrow as pa

        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                with self._open() as f:
                    pf = pq.ParquetFile(f)
                    row = position_row
                    for g in range(position or 0, pf.num_row_groups):
                        group_row = row
                        for batch in pf.iter_batches(
                            batch_size=self._batch_rows, row_groups=[g], columns=list(columns), use_threads=False
                        ):
                            yield g, group_row, row, {c: batch.column(c) for c in columns}
                            row += batch.num_rows
                return
            with self._open() as f:
                start = (self._data_start if self.kind == "csv" else 0) if position is None else position
                if hasher is not None and self.kind == "csv":
                    hasher.update(self._header)
                row = position_row
                for offset, data in self._raw_blocks(f, start, hasher):
                    if self.kind == "csv":
                        block = self._parse_csv(data, columns, offset)
                    else:
                        block = self._parse_jsonl(data, columns, row)
                    yield offset, row, row, block
                    row += len(block[columns[0]])
        except StreamloadError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise self._fail(exc) from exc

    def _parquet_digest(self) -> str:
        """A digest of a Parquet file's footer (schema, column chunks' sizes and statistics) and size."""
        try:
            with self._open() as f:
                size = f.seek(0, 2)
                f.seek(size - 8)
                tail = f.read(8)
                length = int.from_bytes(tail[:4], "little")
                f.seek(max(size - 8 - length, 0))
                footer = f.read(length)
        except OSError as exc:
            raise self._fail(exc) from exc
        return hashlib.sha256(footer + size.to_bytes(8, "little")).hexdigest()

    # -- the scan ----------------------------------------------------------------------

    def _check_paths(self, col: Any, first_row: int, n: int, problems: list[tuple[int, SkippedInput]]) -> Any:
        """Rows with a usable path (NumPy bool); the others are problems."""
        import pyarrow as pa
        import pyarrow.compute as pc

        arr = _arrow(col)
        if arr is not None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            blank = _mask(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0)) | null
            image = _mask(pc.match_substring_regex(arr, _IMAGE_PATH, ignore_case=True))
            nul = _mask(pc.match_substring(arr, "\x00")) & ~blank
            for i in np.flatnonzero(blank).tolist():
                problems.append((first_row + i, SkippedInput(self._where(first_row + i), "no path")))
            for i in np.flatnonzero(nul).tolist():
                problems.append((first_row + i, SkippedInput(self._where(first_row + i), "the path holds a NUL byte")))
            image &= ~nul
            wrong = np.flatnonzero(~blank & ~image & ~nul)
            if len(wrong):
                for i, p in zip(wrong.tolist(), arr.take(pa.array(wrong)).to_pylist(), strict=True):
                    where = self._where(first_row + i, str(p))
                    problems.append((first_row + i, SkippedInput(where, "not an image file extension")))
            return ~blank & image
        ok = np.ones(n, dtype=bool)
        for i, p in enumerate(_pylist(col)):
            if p is None or not str(p).strip():
                problems.append((first_row + i, SkippedInput(self._where(first_row + i), "no path")))
                ok[i] = False
            elif "\x00" in str(p):
                problems.append((first_row + i, SkippedInput(self._where(first_row + i), "the path holds a NUL byte")))
                ok[i] = False
            elif _ext_of(str(p)) not in IMAGE_EXTENSIONS:
                where = self._where(first_row + i, str(p))
                problems.append((first_row + i, SkippedInput(where, "not an image file extension")))
                ok[i] = False
        return ok

    def _check_labels(
        self,
        col: Any,
        first_row: int,
        ok: np.ndarray[Any, Any],
        seen: dict[Any, None],
        problems: list[tuple[int, SkippedInput]],
    ) -> np.ndarray[Any, Any]:
        """Rows (of those ``ok``) with a usable label; the others are problems. Labels seen go to ``seen``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        n = len(ok)
        good = np.ones(n, dtype=bool)
        arr = _arrow(col)
        negative: np.ndarray[Any, Any] | None = None
        if arr is not None and pa.types.is_integer(arr.type):
            null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            for v in pc.unique(arr.drop_null()).to_pylist():
                seen.setdefault(v, None)
            for i in np.flatnonzero(null & ok).tolist():
                problems.append((first_row + i, SkippedInput(self._where(first_row + i), "no label")))
            good &= ~null
            if not self._force_names:
                negative = _mask(pc.less(arr, 0))
        elif arr is not None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            blank = _mask(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0))
            blank |= np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            for i in np.flatnonzero(blank & ok).tolist():
                problems.append((first_row + i, SkippedInput(self._where(first_row + i), "no label")))
            good &= ~blank
            below: list[str] = []
            for v in pc.unique(arr).to_pylist():
                if v is None or not v.strip():
                    continue
                seen.setdefault(v, None)
                index = _int_label(v)
                if index is not None and index < 0:
                    below.append(v)
            if below and not self._force_names:
                negative = _mask(pc.is_in(arr, value_set=pa.array(below, type=arr.type)))
        else:
            negative = np.zeros(n, dtype=bool)
            for i, v in enumerate(_pylist(col)):
                why = _unusable(v)
                if why is None:
                    try:
                        seen.setdefault(v, None)
                    except TypeError:  # unhashable: not a label
                        why = f"label {v!r} is not usable"
                if why is not None:
                    if ok[i]:
                        problems.append((first_row + i, SkippedInput(self._where(first_row + i), why)))
                    good[i] = False
                    continue
                index = _int_label(v)
                negative[i] = index is not None and index < 0 and not self._force_names
        if negative is not None:
            bad = negative & good & ok
            if bad.any():
                values = _pylist(col)
                for i in np.flatnonzero(bad).tolist():
                    why = f"label {str(values[i]).strip()} is negative (labels are class indices)"
                    problems.append((first_row + i, SkippedInput(self._where(first_row + i), why)))
                good &= ~negative
        return good

    def _blocks(self, hasher: Any = None, index: list[tuple[int, int]] | None = None) -> Iterator[_Block]:
        """Scan the table: yield each block's good rows, payload sizes and problems; collect the labels."""
        import pyarrow as pa
        import pyarrow.compute as pc

        image_col, label_col = self.image_column, self.label_column
        columns = [c for c in (image_col or self.path_column, label_col) if c]
        if label_col == (image_col or self.path_column):
            columns = columns[:1]
        seen: dict[Any, None] = {}
        self._seen = seen
        for position, position_row, first_row, block in self._read(columns, hasher=hasher):
            if index is not None and (not index or index[-1][0] != position):
                index.append((position, position_row))
            first = block[columns[0]]
            n = len(first)
            problems: list[tuple[int, SkippedInput]] = []
            if image_col:
                col = block[image_col]
                arr = _arrow(col)
                if arr is None:
                    arr = pa.array(col)
                if pa.types.is_struct(arr.type):
                    arr = pc.struct_field(arr, "bytes")
                lengths = pc.binary_length(arr).to_numpy(zero_copy_only=False)
                sizes = np.nan_to_num(lengths.astype(np.float64), nan=0).astype(np.int64)
                ok = sizes > 0
                for bad in np.flatnonzero(~ok).tolist():
                    problems.append((first_row + bad, SkippedInput(self._where(first_row + bad), "no image bytes")))
            else:
                ok = self._check_paths(block[self.path_column], first_row, n, problems)
                sizes = np.full(n, NOMINAL_IMAGE_BYTES, dtype=np.int64)
            if label_col:
                ok &= self._check_labels(block[label_col], first_row, ok.copy(), seen, problems)
            problems.sort(key=lambda p: p[0])
            yield _Block(position, position_row, first_row, ok, sizes, problems)

    def _settle_labels(self) -> bool:
        """Fix the label mode and class table from the labels seen; True if the scan must run again.

        Labels are class indices when every one is an integer; else every label is a class
        name (sorted, numbered). A scan that left negative integers out as bad indices
        and then found names must run again, keeping them as names.
        """
        values = list(self._seen)
        self._class_index = None
        if not self._force_names and all(_int_label(v) is not None for v in values):
            self._int_labels = True
            self.classes = []
            return False
        self._int_labels = False
        self.classes = sorted({str(v) for v in values})
        if self._force_names:
            return False
        rescan = any((i := _int_label(v)) is not None and i < 0 for v in values)
        self._force_names = True
        return rescan

    def plan(
        self,
        max_bytes: int | None,
        max_samples: int | None,
        *,
        shuffle: bool = False,
        seed: int = 0,
        present: set[str] | None = None,
        dst: str = "",
    ) -> TablePlan:
        """Scan the table a block at a time and cut it into shards (the engine's rule, see :mod:`.planning`).

        Args:
            max_bytes: Payload bytes per shard at most (``None``: no byte limit).
            max_samples: Rows per shard at most (wins over ``max_bytes``).
            shuffle: Plan a seeded permutation of the rows (O(rows) memory) instead of spans.
            seed: The permutation's seed.
            present: Keys already in the destination (appending): those rows are left out.
            dst: The destination, for the messages about present keys.

        Returns:
            The :class:`TablePlan`. Without ``shuffle`` the driver holds O(shards + bad
            rows + classes), whatever the number of rows.

        Raises:
            SourceError: If the table cannot be read.
        """
        present_rows = self._present_rows(present or set())
        self._force_names = False
        while True:
            result = self._plan_pass(max_bytes, max_samples, shuffle, seed, present_rows, dst)
            if not self._settle_labels():
                return result

    def _present_rows(self, present: set[str]) -> np.ndarray[Any, Any]:
        """The rows of this table whose keys are in ``present`` (sorted)."""
        head = self.prefix + "/"
        rows = []
        for key in present:
            if key.startswith(head):
                tail = key[len(head) :]
                if tail.isascii() and tail.isdigit() and f"{int(tail):010d}" == tail:
                    rows.append(int(tail))
        return np.unique(np.array(rows, dtype=np.int64))

    def _plan_pass(
        self,
        max_bytes: int | None,
        max_samples: int | None,
        shuffle: bool,
        seed: int,
        present_rows: np.ndarray[Any, Any],
        dst: str,
    ) -> TablePlan:
        hasher = xxhash.xxh3_128() if self.kind != "parquet" else None
        index: list[tuple[int, int]] | None = [] if shuffle else None
        cutter = ShardCutter(max_bytes, max_samples)
        builder = _SpanBuilder(self.prefix)
        keep_sizes = shuffle and max_samples is None and max_bytes is not None
        rows_kept: list[np.ndarray[Any, Any]] = []
        sizes_kept: list[np.ndarray[Any, Any]] = []
        problems: list[SkippedInput] = []
        dups: list[SkippedInput] = []
        samples = total = 0
        for block in self._blocks(hasher, index):
            n = len(block.ok)
            ok = block.ok
            if len(present_rows):
                lo, hi = np.searchsorted(present_rows, [block.first_row, block.first_row + n])
                if hi > lo:
                    hit = np.zeros(n, dtype=bool)
                    hit[present_rows[lo:hi] - block.first_row] = True
                    hit &= ok
                    for i in np.flatnonzero(hit).tolist():
                        row = block.first_row + i
                        key = f"{self.prefix}/{row:010d}"
                        dups.append(SkippedInput(self._where(row), f"its key {printable(key)!r} is already in {dst}"))
                    ok = ok & ~hit
            problems.extend(p for _, p in block.problems)
            good = np.flatnonzero(ok)
            samples += len(good)
            total += n
            if shuffle:
                rows_kept.append(good + block.first_row)
                if keep_sizes:
                    sizes_kept.append(block.sizes[good])
            else:
                builder.feed(block, ok, cutter.feed(block.sizes[good]))
        self._digest = hasher.hexdigest() if hasher is not None else self._parquet_digest()
        if not shuffle:
            return TablePlan(builder.finish(), problems, dups, samples, total)
        # A global permutation: O(rows) by nature (the one case that keeps an array of rows).
        self._block_index = np.array(index or [], dtype=np.int64).reshape(-1, 2)
        rows = np.concatenate(rows_kept) if rows_kept else np.zeros(0, np.int64)
        order = np.random.default_rng(seed).permutation(len(rows))
        rows = rows[order]
        if keep_sizes:
            sizes = (np.concatenate(sizes_kept) if sizes_kept else np.zeros(0, np.int64))[order]
        else:
            sizes = np.zeros(len(rows), dtype=np.int64)  # only the count matters
        bounds = cuts(sizes, max_bytes, max_samples)
        shards: list[Sequence[Item]] = [
            RowList(self.prefix, rows[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        return TablePlan(shards if len(rows) else [], problems, dups, samples, total)

    def scan(self) -> ScanResult:
        """Scan the whole table; the items are every good row in order (one :class:`RowList`: O(rows)).

        The engine plans a table with :meth:`plan` instead, which keeps O(shards).
        """
        result = self.plan(None, None, shuffle=True)
        arrays = [s.row_array for s in result.shards if isinstance(s, RowList)]
        items = RowList(self.prefix, np.sort(np.concatenate(arrays)) if arrays else np.zeros(0, np.int64))
        return ScanResult(items, [], result.problems)  # type: ignore[arg-type]

    def _where(self, row: int, path: str | None = None) -> str:
        return f"{printable(self.url)}: row {row}" + (f" ({printable(path)})" if path else "")

    # -- loading -----------------------------------------------------------------------

    def origin(self, item: Item) -> str:
        """Return ``<table>: row <n>``."""
        assert isinstance(item, TableItem)
        return self._where(item.row)

    def iter_items(self, items: Sequence[Item]) -> Iterator[Item]:
        """Yield the items of a planned shard with their row values, reading only the shard's part of the table.

        A :class:`RowSpan` reads from its row group or byte offset to its last row, one
        block at a time; a :class:`RowList` reads the blocks holding its rows.

        Raises:
            SourceError: If the table cannot be read.
        """
        if isinstance(items, RowSpan):
            yield from self._span_items(items)
        elif isinstance(items, RowList):
            yield from self._list_items(items.row_array)
        else:
            yield from items

    def _span_items(self, span: RowSpan) -> Iterator[TableItem]:
        columns = self._value_columns()
        skip = set(span.excluded)
        for _, _, first_row, block in self._read(columns, span.position, span.position_row):
            if first_row >= span.stop:
                break
            n = len(block[columns[0]])
            lo, hi = max(span.first - first_row, 0), min(span.stop - first_row, n)
            if lo >= hi:
                continue
            values = {c: _pylist(block[c], lo, hi) for c in columns}
            for i in range(hi - lo):
                row = first_row + lo + i
                if row not in skip:
                    yield TableItem(f"{self.prefix}/{row:010d}", 0, row, {c: values[c][i] for c in columns})

    def _blocks_of(self, rows: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
        """The ``(position, row)`` of each block holding one of ``rows`` (sorted), in table order."""
        index = self._block_index
        if index is None or not len(index):
            if self.kind != "parquet":
                return [(self._data_start if self.kind == "csv" else 0, 0)]  # no index: read from the start
            import pyarrow.parquet as pq

            try:
                with self._open() as f:
                    md = pq.ParquetFile(f).metadata
            except OSError as exc:
                raise self._fail(exc) from exc
            counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
            index = np.stack([np.arange(len(counts)), np.cumsum([0, *counts])[:-1]], axis=1).astype(np.int64)
            self._block_index = index
        which = np.unique(np.searchsorted(index[:, 1], rows, side="right") - 1)
        return [(int(index[k, 0]), int(index[k, 1])) for k in which.tolist() if k >= 0]

    def _list_items(self, order: np.ndarray[Any, Any]) -> Iterator[TableItem]:
        columns = self._value_columns()
        wanted = np.unique(order)
        found: dict[int, dict[str, Any]] = {}
        blocks = self._blocks_of(wanted)
        indexed = self._block_index is not None and len(self._block_index) > 0
        for position, position_row in blocks:
            for pos, _, first_row, block in self._read(columns, position, position_row):
                if first_row > int(wanted[-1]) or (self.kind == "parquet" and pos != position):
                    break
                n = len(block[columns[0]])
                lo, hi = np.searchsorted(wanted, [first_row, first_row + n])
                if hi > lo:
                    cols = {c: _pylist(block[c]) for c in columns}
                    for i in (wanted[lo:hi] - first_row).tolist():
                        found[first_row + i] = {c: cols[c][i] for c in columns}
                if indexed and self.kind != "parquet":
                    break  # a text block of the index: exactly one
        for row in order.tolist():
            values = found.get(row)
            if values is None:
                raise SourceError(f"{self._where(row)}: the table has no such row (has it changed since the scan?)")
            yield TableItem(f"{self.prefix}/{row:010d}", 0, row, values)

    def _row_values(self, row: int) -> Mapping[str, Any]:
        """One row's values (for an item that came without them)."""
        item = next(self._list_items(np.array([row], dtype=np.int64)))
        assert item.values is not None
        return item.values

    def _label_text(self, value: Any, where: str) -> str:
        """The ``cls`` field of a row's label value, through the class table of the scan."""
        if self._int_labels:
            index = _int_label(value)
            if index is None or index < 0:
                raise SourceError(f"{where}: label {value!r} is not a class index (has the table changed?)")
            return str(index)
        if self._class_index is None:
            self._class_index = {name: i for i, name in enumerate(self.classes)}
        found = self._class_index.get(str(value)) if _unusable(value) is None else None
        if found is None:
            raise SourceError(f"{where}: label {value!r} is not one of the classes (has the table changed?)")
        return str(found)

    def resolve(self, path: str) -> str:
        """Return the path or URL of ``path`` as named in the table (relative: to the table's folder)."""
        if "://" in path or os.path.isabs(path):
            return path
        if is_local(self.url):
            return os.path.join(os.path.dirname(os.path.abspath(local_path_of(self.url))), path)
        return posixpath.join(self.url.rpartition("/")[0], path)

    def load(self, item: Item) -> dict[str, Any]:
        """Read one row's image (named or embedded) and return its sample.

        Raises:
            SourceError: Naming the row and the file or URL, if it is missing (a 404),
                unreadable, or not a valid image.
        """
        assert isinstance(item, TableItem)
        values = item.values if item.values is not None else self._row_values(item.row)
        where = self._where(item.row)
        if self.image_column:
            value = values[self.image_column]
            name = ""
            if isinstance(value, dict):
                name = str(value.get("path") or "")
                value = value.get("bytes")
            if not value:
                raise SourceError(f"{where}: no image bytes")
            data = bytes(value)
            ext = image_field_for(data, name)
        else:
            path = self.resolve(str(values[self.path_column]))
            where = f"{where} ({printable(path)})"
            if "\x00" in path:
                raise SourceError(f"{where}: the path holds a NUL byte")
            if self.root is not None and not _inside(path, self.root):
                raise SourceError(f"{where}: outside --root {printable(self.root)}")
            data = self._read_image(path, where)
            ext = _ext_of(path)
        sample: dict[str, Any] = {"__key__": item.key, ext: data}
        if self.check != "none":
            found = check_image(data, where, self.check)
            if found:
                sample[WARNINGS_KEY] = found
        if self.label_column:
            sample["cls"] = self._label_text(values[self.label_column], where).encode()
        if self.keep_columns:
            extra = {c: values[c] for c in self.keep_columns}
            sample["json"] = json.dumps(extra, sort_keys=True, default=str, ensure_ascii=False).encode()
        return sample

    def _read_image(self, path: str, where: str) -> bytes:
        if "://" in path and not path.startswith("file://"):
            try:
                return read_url(path, self.storage_options)
            except StreamloadError as exc:
                message = printable(str(exc))
                message = message[len(path) :].lstrip(": ") if message.startswith(path) else message
                raise SourceError(f"{where}: {message}") from exc
        try:
            with open(local_path_of(path), "rb") as f:
                return f.read()
        except FileNotFoundError as exc:
            raise SourceError(f"{where}: does not exist") from exc
        except OSError as exc:
            raise SourceError(f"{where}: cannot read: {exc.strerror or exc}") from exc

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_class_index"] = None
        state["_seen"] = {}
        return state
