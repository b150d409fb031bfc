"""The listing table as a conversion source: :class:`TableSource`.

What it reads and how it plans is told in the package's docstring (:mod:`.`); here the
pieces meet: a block reader for the table's kind (:mod:`.kinds`), the row checks
(:mod:`.checks`), the streamed cut into row spans (:mod:`.spans`), and per task the
loading of a shard's rows and images.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from streamload._errors import ConfigError, SourceError, StreamloadError
from streamload.manifest import SkippedInput
from streamload.sample import image_field_for
from streamload.storage import is_local, local_path_of
from streamload.storage.filesystems import open_filesystem

from ..images import WARNINGS_KEY, check_image, escape_stem
from ..remote import read_url
from ..source import Item, PlanRequest, ScanResult, Source, SourcePlan, printable
from .checks import arrow, check_labels, check_paths, ext_of, inside, int_label, pylist, root_of, unusable
from .kinds import open_reader
from .spans import RowList, RowSpan, ScannedBlock, TableItem, TablePlan, plan_blocks, present_rows_of, row_key

__all__ = ["NOMINAL_IMAGE_BYTES", "TableSource"]

#: Payload size assumed for a row naming a file (its size is not known before it is read).
NOMINAL_IMAGE_BYTES = 100_000


def stored_by_path(path: str) -> str:
    """Why a row whose image struct holds a path but no bytes is not read, and what to do."""
    return (
        f"no image bytes, only a path ({printable(path)!r}): the images are stored by path, not embedded; "
        "--root DIR reads such paths under DIR (or embed the images in the file first)"
    )


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
        self.root = root_of(root) if root else None
        try:
            import pyarrow  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"{url}: reading listing tables needs pyarrow: pip install 'streamload[table]'") from exc
        self.url = url
        from . import PARQUET_BATCH_ROWS, TEXT_BLOCK_BYTES  # read now (tunable), then fixed for every task

        self.storage_options = dict(storage_options or {})
        self.reader = open_reader(url, self._open, TEXT_BLOCK_BYTES, PARQUET_BATCH_ROWS)
        self.kind = self.reader.kind
        self.path_column = path_column
        self.label_column = label_column
        self.keep_columns = list(keep_columns)
        self.check = check
        self.classes = []
        self._int_labels = True
        self._digest: str | None = None  # the table's content, as read by the scan
        self._force_names = False  # labels are class names (found by an earlier scan)
        self._class_index: dict[str, int] | None = None
        self._block_index: np.ndarray[Any, Any] | None = None  # (position, row) of every block, for RowList tasks
        self._seen: dict[Any, None] = {}  # the distinct label values of the last scan
        columns = self.reader.columns()
        if image_column is None:
            image_column = self.reader.image_column(columns)
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
        self.reader.fix_types(columns, {c for c in (self.path_column, self.label_column) if c})
        #: A Hugging Face ``ClassLabel``'s names: the classes of integer labels (which must index them).
        self._named_classes = self.reader.class_names(label_column) if label_column else None
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

    # -- reading blocks ----------------------------------------------------------------

    def _open(self) -> Any:
        """Open the table for binary reading (its block reader reads through this)."""
        if is_local(self.url):
            return open(local_path_of(self.url), "rb")  # noqa: SIM115 - returned to the caller
        fs, path = open_filesystem(self.url, self.storage_options)
        return fs.open(path, "rb")

    def _value_columns(self) -> list[str]:
        """The columns a task reads: the image or path, the label, the kept columns."""
        columns: list[str] = []
        for c in (self.image_column or self.path_column, self.label_column, *self.keep_columns):
            if c and c not in columns:
                columns.append(c)
        return columns

    # -- the scan ----------------------------------------------------------------------

    def _blocks(self, hasher: Any = None, index: list[tuple[int, int]] | None = None) -> Iterator[ScannedBlock]:
        """Scan the table: yield each block's good rows, payload sizes and problems; collect the labels."""
        import pyarrow as pa
        import pyarrow.compute as pc

        image_col, label_col = self.image_column, self.label_column
        columns = [c for c in (image_col or self.path_column, label_col) if c]
        if label_col == (image_col or self.path_column):
            columns = columns[:1]
        seen: dict[Any, None] = {}
        self._seen = seen
        for position, position_row, first_row, block in self.reader.blocks(columns, hasher=hasher):
            if index is not None and (not index or index[-1][0] != position):
                index.append((position, position_row))
            first = block[columns[0]]
            n = len(first)
            problems: list[tuple[int, SkippedInput]] = []
            if image_col:
                col = block[image_col]
                arr = arrow(col)
                if arr is None:
                    arr = pa.array(col)
                paths = None
                if pa.types.is_struct(arr.type):
                    names = [arr.type.field(i).name for i in range(arr.type.num_fields)]
                    paths = pc.struct_field(arr, "path").to_pylist() if "path" in names else None
                    arr = pc.struct_field(arr, "bytes")
                lengths = pc.binary_length(arr).to_numpy(zero_copy_only=False)
                sizes = np.nan_to_num(lengths.astype(np.float64), nan=0).astype(np.int64)
                ok = sizes > 0
                for bad in np.flatnonzero(~ok).tolist():
                    path = paths[bad] if paths is not None else None
                    if path and self.root is not None:  # stored by path: read under --root
                        ok[bad], sizes[bad] = True, NOMINAL_IMAGE_BYTES
                        continue
                    reason = stored_by_path(path) if path else "no image bytes"
                    problems.append((first_row + bad, SkippedInput(self._where(first_row + bad), reason)))
            else:
                ok = check_paths(block[self.path_column], first_row, n, problems, self._where)
                sizes = np.full(n, NOMINAL_IMAGE_BYTES, dtype=np.int64)
            if label_col:
                ok &= check_labels(
                    block[label_col], first_row, ok.copy(), seen, problems, self._where, self._force_names
                )
            problems.sort(key=lambda p: p[0])
            yield ScannedBlock(position, position_row, first_row, ok, sizes, problems)

    def _settle_labels(self) -> bool:
        """Fix the label mode and class table from the labels seen; True if the scan must run again.

        Labels are class indices when every one is an integer; else every label is a class
        name (sorted, numbered). A scan that left negative integers out as bad indices
        and then found names must run again, keeping them as names.
        """
        values = list(self._seen)
        self._class_index = None
        if not self._force_names and all(int_label(v) is not None for v in values):
            self._int_labels = True
            self.classes = list(self._named_classes or ())
            return False
        self._int_labels = False
        self.classes = sorted({str(v) for v in values})
        if self._force_names:
            return False
        rescan = any((i := int_label(v)) is not None and i < 0 for v in values)
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
        present_rows = present_rows_of(self.prefix, present or set())
        self._force_names = False
        while True:
            result = self._plan_pass(max_bytes, max_samples, shuffle, seed, present_rows, dst)
            if not self._settle_labels():
                return result

    def make_plan(self, request: PlanRequest) -> SourcePlan:
        """Plan for the engine: one streamed pass (:meth:`plan`), the driver holding O(shards).

        Appending, the rows whose keys the destination holds are left out as the scan cuts,
        and the check sees the first planned shard.
        """
        present = request.present() if request.present is not None else None
        plan = self.plan(
            request.max_bytes,
            request.max_samples,
            shuffle=request.shuffle,
            seed=request.seed,
            present=present,
            dst=request.dst,
        )
        if request.check is not None:
            request.check(plan.shards[0] if plan.shards else [])
        return SourcePlan(list(plan.shards), [*plan.problems, *plan.present])

    def _plan_pass(
        self,
        max_bytes: int | None,
        max_samples: int | None,
        shuffle: bool,
        seed: int,
        present_rows: np.ndarray[Any, Any],
        dst: str,
    ) -> TablePlan:
        hasher = self.reader.new_hasher()
        index: list[tuple[int, int]] | None = [] if shuffle else None

        def present(row: int) -> SkippedInput:
            key = row_key(self.prefix, row)
            return SkippedInput(self._where(row), f"its key {printable(key)!r} is already in {dst}")

        blocks = self._blocks(hasher, index)
        plan = plan_blocks(blocks, self.prefix, (max_bytes, max_samples), (shuffle, seed), present_rows, present)
        self._digest = self.reader.digest(hasher)
        if shuffle:
            self._block_index = np.array(index or [], dtype=np.int64).reshape(-1, 2)
        return plan

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
        for _, _, first_row, block in self.reader.blocks(columns, span.position, span.position_row):
            if first_row >= span.stop:
                break
            n = len(block[columns[0]])
            lo, hi = max(span.first - first_row, 0), min(span.stop - first_row, n)
            if lo >= hi:
                continue
            values = {c: pylist(block[c], lo, hi) for c in columns}
            for i in range(hi - lo):
                row = first_row + lo + i
                if row not in skip:
                    yield TableItem(row_key(self.prefix, row), 0, row, {c: values[c][i] for c in columns})

    def _blocks_of(self, rows: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
        """The ``(position, row)`` of each block holding one of ``rows`` (sorted), in table order."""
        index = self._block_index
        if index is None or not len(index):
            index = self.reader.block_index()
            if index is None:
                return [(self.reader.start, 0)]  # no index: read from the start
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
            for pos, _, first_row, block in self.reader.blocks(columns, position, position_row):
                if first_row > int(wanted[-1]) or (indexed and pos != position):
                    break  # past the last row wanted, or (indexed) past the block at this position
                n = len(block[columns[0]])
                lo, hi = np.searchsorted(wanted, [first_row, first_row + n])
                if hi > lo:
                    cols = {c: pylist(block[c]) for c in columns}
                    for i in (wanted[lo:hi] - first_row).tolist():
                        found[first_row + i] = {c: cols[c][i] for c in columns}
                if indexed and self.reader.one_block_per_position:
                    break  # the block of the index: exactly one
        for row in order.tolist():
            values = found.get(row)
            if values is None:
                raise SourceError(f"{self._where(row)}: the table has no such row (has it changed since the scan?)")
            yield TableItem(row_key(self.prefix, row), 0, row, values)

    def _row_values(self, row: int) -> Mapping[str, Any]:
        """One row's values (for an item that came without them)."""
        item = next(self._list_items(np.array([row], dtype=np.int64)))
        assert item.values is not None
        return item.values

    def _label_text(self, value: Any, where: str) -> str:
        """The ``cls`` field of a row's label value, through the class table of the scan."""
        if self._int_labels:
            index = int_label(value)
            if index is None or index < 0:
                raise SourceError(f"{where}: label {value!r} is not a class index (has the table changed?)")
            if self._named_classes is not None and index >= len(self._named_classes):
                raise SourceError(
                    f"{where}: label {index} is not one of the {len(self._named_classes)} classes of the "
                    f"column's ClassLabel (0..{len(self._named_classes) - 1})"
                )
            return str(index)
        if self._class_index is None:
            self._class_index = {name: i for i, name in enumerate(self.classes)}
        found = self._class_index.get(str(value)) if unusable(value) is None else None
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
            if not value and name and self.root is not None:
                data, ext, where = self._read_named(name, where)
            elif not value:
                raise SourceError(f"{where}: {stored_by_path(name) if name else 'no image bytes'}")
            else:
                data = bytes(value)
                ext = image_field_for(data, name)
        else:
            data, ext, where = self._read_named(str(values[self.path_column]), where)
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

    def _read_named(self, named: str, where: str) -> tuple[bytes, str, str]:
        """The image a row names by path: its bytes, field, and the row's description with the path."""
        path = self.resolve(named)
        where = f"{where} ({printable(path)})"
        if "\x00" in path:
            raise SourceError(f"{where}: the path holds a NUL byte")
        if self.root is not None and not inside(path, self.root):
            raise SourceError(f"{where}: outside --root {printable(self.root)}")
        return self._read_image(path, where), ext_of(path), where

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
