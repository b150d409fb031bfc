"""A listing table as a conversion source: Parquet, CSV or JSONL rows to samples.

Each row names one image, by a path or URL (``--path-column``, default ``path``; relative
paths are resolved against the table's own folder or URL prefix), or holds its bytes
(``--image-column``: a Hugging Face image struct ``{"bytes", "path"}`` or a plain binary
column, detected automatically in Parquet). The label (``--label-column``, default
``label``) is a class index (an integer) or a class name; class names are sorted and
numbered, ``classes[i]`` being the name of label ``i``. ``--keep-columns a,b`` carries
other columns into each sample as a ``json`` field.

The table is never held whole in memory: Parquet is read a row group at a time (the
image bytes only to measure them), CSV in blocks, JSONL line by line. The scan keeps
three numbers per row (row number, payload size, label) in arrays (:class:`RowItems`,
about 20 bytes a row); the conversion task that writes a shard reads its rows again.

Keys are ``<table stem>/<row number>`` (rows count from 0, the header excluded), so
they are unique by construction; appending another table never collides, appending
the same table twice does. A row with no path, no image bytes or no label, or with a
path that is not an image file, is a broken input named by its row number: an error
under ``--on-error raise``, skipped and listed under ``skip`` like a missing object
(a 404) or a corrupt image found while converting.
"""

from __future__ import annotations

import json
import os
import posixpath
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from streamload._errors import ConfigError, SourceError, StreamloadError
from streamload.manifest import SkippedInput
from streamload.storage import is_local, local_path_of
from streamload.storage.filesystems import open_filesystem

from .imagefolder import IMAGE_EXTENSIONS, _check_image, _escape
from .remote import read_url
from .source import Item, ScanResult, Source, printable

__all__ = ["TABLE_EXTENSIONS", "RowItems", "TableItem", "TableSource", "is_table"]

#: Table formats by file extension.
TABLE_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
#: Payload size assumed for a row naming a file (its size is not known before it is read).
NOMINAL_IMAGE_BYTES = 100_000
#: Rows read per block from CSV and JSONL.
_BLOCK_ROWS = 65536


def is_table(src: str) -> bool:
    """True if ``src`` names a listing table by its extension."""
    return os.path.splitext(src.rstrip("/"))[1].lower() in TABLE_EXTENSIONS


@dataclass(frozen=True)
class TableItem(Item):
    """One row of the table: its number and its label (``-1``: none)."""

    row: int = 0
    label: int = -1


class RowItems(Sequence[Item]):
    """The items of a table as three arrays; :class:`TableItem` objects are made on access.

    Args:
        prefix: Key prefix (the table's stem).
        rows: Row numbers (int64).
        nbytes: Payload sizes (int64).
        labels: Labels (int64, ``-1`` for none).
    """

    unique_keys = True  # keys are made from distinct row numbers

    def __init__(self, prefix: str, rows: np.ndarray, nbytes: np.ndarray, labels: np.ndarray) -> None:
        self.prefix = prefix
        self.rows = rows
        self.nbytes = nbytes
        self.labels = labels

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> RowItems: ...

    def __getitem__(self, index: int | slice) -> Item | RowItems:
        if isinstance(index, slice):
            return RowItems(self.prefix, self.rows[index], self.nbytes[index], self.labels[index])
        row = int(self.rows[index])
        return TableItem(f"{self.prefix}/{row:010d}", int(self.nbytes[index]), row, int(self.labels[index]))

    def __iter__(self) -> Iterator[Item]:
        for i in range(len(self.rows)):
            yield self[i]

    def take(self, order: np.ndarray) -> RowItems:
        """Return the items in ``order`` (an array of positions)."""
        return RowItems(self.prefix, self.rows[order], self.nbytes[order], self.labels[order])

    def fingerprint_bytes(self) -> bytes:
        """Return the bytes that identify these items, in order (for the plan fingerprint)."""
        return self.prefix.encode() + b"\0" + self.rows.tobytes() + self.nbytes.tobytes() + self.labels.tobytes()


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


def _sniff(data: bytes) -> str:
    """The image extension of ``data`` by its magic bytes (``img`` if unknown)."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    return "img"


def _ext_of(path: str) -> str:
    name = path.rstrip("/").rpartition("/")[2]
    return name.rpartition(".")[2].lower() if "." in name else ""


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
    ) -> None:
        if check not in ("decode", "header", "none"):
            raise SourceError(f"check={check!r} must be 'decode', 'header' or 'none'")
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
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()
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
        base = url.rstrip("/").rpartition("/")[2] if "://" in url else os.path.basename(url)
        self.prefix = _escape(os.path.splitext(base)[0]) or "row"

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

    def _columns(self) -> dict[str, Any]:
        """The table's column names and (Arrow) types."""
        import pyarrow as pa

        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                with self._open() as f:
                    schema = pq.ParquetFile(f).schema_arrow
                return {name: schema.field(name).type for name in schema.names}
            if self.kind == "csv":
                import pyarrow.csv as pcsv

                with self._open() as f:
                    reader = pcsv.open_csv(f, read_options=pcsv.ReadOptions(block_size=1 << 20))
                    return {name: reader.schema.field(name).type for name in reader.schema.names}
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

    def _blocks(self, columns: Sequence[str]) -> Iterator[dict[str, list[Any] | Any]]:
        """Yield the table in blocks: ``{column: pyarrow array or list}``, a row group (or block) at a time."""
        import pyarrow as pa

        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                with self._open() as f:
                    pf = pq.ParquetFile(f)
                    for g in range(pf.num_row_groups):
                        t = pf.read_row_group(g, columns=list(columns))
                        yield {c: t.column(c) for c in columns}
            elif self.kind == "csv":
                import pyarrow.csv as pcsv

                types = {c: pa.string() for c in (self.path_column, self.label_column) if c}
                with self._open() as f:
                    reader = pcsv.open_csv(
                        f,
                        read_options=pcsv.ReadOptions(block_size=1 << 22),
                        convert_options=pcsv.ConvertOptions(column_types=types, include_columns=list(columns)),
                    )
                    for batch in reader:
                        yield {c: batch.column(c) for c in columns}
            else:
                with self._open() as f:
                    block: dict[str, list[Any]] = {c: [] for c in columns}
                    for n, line in enumerate(f):
                        if not line.strip():
                            continue
                        obj = json.loads(line)
                        if not isinstance(obj, dict):
                            raise SourceError(f"{self.url}: line {n + 1} is not a JSON object")
                        for c in columns:
                            block[c].append(obj.get(c))
                        if len(block[columns[0]]) >= _BLOCK_ROWS:
                            yield block
                            block = {c: [] for c in columns}
                    if block[columns[0]]:
                        yield block
        except StreamloadError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise self._fail(exc) from exc

    # -- the scan ----------------------------------------------------------------------

    def scan(self) -> ScanResult:
        """Read the table a block at a time; keep row numbers, sizes and labels of the good rows."""
        import pyarrow as pa
        import pyarrow.compute as pc

        label_col, image_col = self.label_column, self.image_column
        columns = [c for c in (image_col or self.path_column, label_col) if c]
        rows: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        codes: list[np.ndarray] = []
        names: dict[Any, int] = {}  # label value -> code, in order of appearance
        problems: list[SkippedInput] = []
        start = 0
        for block in self._blocks(columns):
            first = block[columns[0]]
            n = len(first)
            ok = np.ones(n, dtype=bool)
            if image_col:
                col = block[image_col]
                arr = col if isinstance(col, (pa.Array, pa.ChunkedArray)) else pa.array(col)
                if pa.types.is_struct(arr.type):
                    arr = pc.struct_field(arr, "bytes")
                lengths = pc.binary_length(arr).to_numpy(zero_copy_only=False)
                lengths = np.nan_to_num(lengths.astype(np.float64), nan=0).astype(np.int64)
                for bad in np.flatnonzero(lengths <= 0).tolist():
                    problems.append(SkippedInput(self._where(start + bad), "no image bytes"))
                ok &= lengths > 0
                size = lengths
            else:
                paths = block[self.path_column]
                values = paths.to_pylist() if not isinstance(paths, list) else paths
                size = np.full(n, NOMINAL_IMAGE_BYTES, dtype=np.int64)
                for i, p in enumerate(values):
                    if p is None or not str(p).strip():
                        problems.append(SkippedInput(self._where(start + i), "no path"))
                        ok[i] = False
                    elif _ext_of(str(p)) not in IMAGE_EXTENSIONS:
                        problems.append(SkippedInput(self._where(start + i, str(p)), "not an image file extension"))
                        ok[i] = False
            code = np.full(n, -1, dtype=np.int64)
            if label_col:
                col = block[label_col]
                values = col.to_pylist() if not isinstance(col, list) else col
                for i, v in enumerate(values):
                    if v is None or (isinstance(v, str) and not v.strip()) or isinstance(v, (bool, float, dict, list)):
                        if ok[i]:
                            why = "no label" if v is None or isinstance(v, str) else f"label {v!r} is not usable"
                            problems.append(SkippedInput(self._where(start + i), why))
                        ok[i] = False
                        continue
                    code[i] = names.setdefault(v, len(names))
            keep = np.flatnonzero(ok)
            rows.append(keep.astype(np.int64) + start)
            sizes.append(size[keep])
            codes.append(code[keep])
            start += n
        row_arr = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        size_arr = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        code_arr = np.concatenate(codes) if codes else np.zeros(0, np.int64)
        if label_col:
            labels = self._labels(names, code_arr, problems)
            good = labels >= 0
            if not good.all():
                row_arr, size_arr, labels = row_arr[good], size_arr[good], labels[good]
            digits = np.ones_like(labels)
            for power in range(1, 19):
                digits += labels >= 10**power
            size_arr = size_arr + digits  # the 'cls' field
        else:
            labels = code_arr
        problems.sort(key=lambda p: _row_of(p.path))
        return ScanResult(RowItems(self.prefix, row_arr, size_arr, labels), [], problems)  # type: ignore[arg-type]

    def _labels(self, names: dict[Any, int], codes: np.ndarray, problems: list[SkippedInput]) -> np.ndarray:
        """Turn label codes into labels: integers as they are, class names sorted and numbered."""
        values = list(names)
        ints: list[int] = []
        for v in values:
            text = str(v).strip()
            if isinstance(v, int) or (isinstance(v, str) and text.lstrip("-").isdigit()):
                ints.append(int(text))
            else:
                break
        if len(ints) == len(values):
            self._int_labels = True
            self.classes = []
            table = np.array(ints, dtype=np.int64) if ints else np.zeros(0, np.int64)
            labels = table[codes] if len(codes) else codes
            negative = labels < 0
            if negative.any():
                labels = labels.copy()
                labels[negative] = -2  # dropped by the caller
                problems.append(SkippedInput(self.url, f"{int(negative.sum())} rows have a negative label"))
            return labels
        self._int_labels = False
        self.classes = sorted(str(v) for v in values)
        order = {name: i for i, name in enumerate(self.classes)}
        table = np.array([order[str(v)] for v in values], dtype=np.int64)
        return table[codes] if len(codes) else codes

    def _where(self, row: int, path: str | None = None) -> str:
        return f"{printable(self.url)}: row {row}" + (f" ({printable(path)})" if path else "")

    # -- loading -----------------------------------------------------------------------

    def origin(self, item: Item) -> str:
        """Return ``<table>: row <n>``."""
        assert isinstance(item, TableItem)
        return self._where(item.row)

    def _row_values(self, row: int) -> dict[str, Any]:
        """The row's path/image and kept columns, read a row group (or the whole text table) at a time."""
        columns = [c for c in (self.image_column or self.path_column, *self.keep_columns) if c]
        with self._lock:
            if self._cache.get("pid") != os.getpid():
                self._cache = {"pid": os.getpid()}
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                if "offsets" not in self._cache:
                    with self._open() as f:
                        md = pq.ParquetFile(f).metadata
                    counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
                    self._cache["offsets"] = np.cumsum([0, *counts])
                offsets = self._cache["offsets"]
                g = int(np.searchsorted(offsets, row, side="right") - 1)
                if self._cache.get("group") != g:
                    with self._open() as f:
                        t = pq.ParquetFile(f).read_row_group(g, columns=columns)
                    self._cache.update(group=g, table=t)
                t = self._cache["table"]
                i = row - int(offsets[g])
                return {c: t.column(c)[i].as_py() for c in columns}
            if "rows" not in self._cache:
                data: dict[str, list[Any]] = {c: [] for c in columns}
                for block in self._blocks(columns):
                    for c in columns:
                        col = block[c]
                        data[c].extend(col if isinstance(col, list) else col.to_pylist())
                self._cache["rows"] = data
            rows = self._cache["rows"]
            return {c: rows[c][row] for c in columns}

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
        values = self._row_values(item.row)
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
            ext = _ext_of(name) if _ext_of(name) in IMAGE_EXTENSIONS else _sniff(data)
        else:
            path = self.resolve(str(values[self.path_column]))
            where = f"{where} ({printable(path)})"
            data = self._read(path, where)
            ext = _ext_of(path)
        if self.check != "none":
            _check_image(data, where, self.check)
        sample: dict[str, Any] = {"__key__": item.key, ext: data}
        if self.label_column:
            sample["cls"] = str(item.label).encode()
        if self.keep_columns:
            extra = {c: values[c] for c in self.keep_columns}
            sample["json"] = json.dumps(extra, sort_keys=True, default=str, ensure_ascii=False).encode()
        return sample

    def _read(self, path: str, where: str) -> bytes:
        if "://" in path and not path.startswith("file://"):
            try:
                return read_url(path, self.storage_options)
            except StreamloadError as exc:
                raise SourceError(f"{where}: {printable(str(exc))}") from exc
        try:
            with open(local_path_of(path), "rb") as f:
                return f.read()
        except FileNotFoundError as exc:
            raise SourceError(f"{where}: does not exist") from exc
        except OSError as exc:
            raise SourceError(f"{where}: cannot read: {exc.strerror or exc}") from exc

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = {}
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _row_of(where: str) -> int:
    head, _, tail = where.rpartition(": row ")
    try:
        return int(tail.split(" ", 1)[0]) if head else -1
    except ValueError:
        return -1
