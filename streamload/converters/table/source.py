"""The listing table as a conversion source: :class:`TableSource`.

What it reads and how it plans is told in the package's docstring (:mod:`.`); here the
pieces meet: a block reader for the table's kind (:mod:`.kinds`), the row checks
(:mod:`.checks`), the label mode and class table (:mod:`.labels`), the streamed cut into
row spans (:mod:`.spans`), and per task the reading of a shard's rows (:mod:`.rows`) and
their images (:mod:`.images`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from streamload._classes import long_name
from streamload._errors import ConfigError, SourceError
from streamload.manifest import SkippedInput
from streamload.storage import is_local, local_path_of
from streamload.storage.filesystems import open_filesystem

from ..images import WARNINGS_KEY, check_image, escape_stem
from ..source import Item, PlanRequest, ScanResult, Source, SourcePlan, printable
from .checks import check_labels, check_paths, root_of
from .images import NOMINAL_IMAGE_BYTES, embedded_sizes, resolve_path, row_image, stored_by_path
from .kinds import open_reader
from .labels import TableLabels
from .rows import list_items, span_items
from .spans import RowList, RowSpan, ScannedBlock, TableItem, TablePlan, plan_blocks, present_rows_of, row_key

__all__ = ["NOMINAL_IMAGE_BYTES", "TableSource", "stored_by_path"]


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
        self._digest: str | None = None  # the table's content, as read by the scan
        self._block_index: np.ndarray[Any, Any] | None = None  # (position, row) of every block, for RowList tasks
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
        self._labels = TableLabels(self.reader.class_names(label_column) if label_column else None)
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
        labels = json.dumps([self._labels.as_index, self.classes], ensure_ascii=False)
        return hashlib.sha256(f"{self._digest}\0{labels}".encode("utf-8", "surrogateescape")).hexdigest()

    def meta(self) -> dict[str, Any]:
        """Return the table and how labels were read, for the manifest."""
        labels = "index" if self._labels.as_index else "class names, sorted"
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
        image_col, label_col = self.image_column, self.label_column
        columns = [c for c in (image_col or self.path_column, label_col) if c]
        if label_col == (image_col or self.path_column):
            columns = columns[:1]
        seen = self._labels.seen = {}
        for position, position_row, first_row, block in self.reader.blocks(columns, hasher=hasher):
            if index is not None and (not index or index[-1][0] != position):
                index.append((position, position_row))
            first = block[columns[0]]
            n = len(first)
            problems: list[tuple[int, SkippedInput]] = []
            if image_col:
                ok, sizes = embedded_sizes(block[image_col], first_row, self.root is not None, problems, self._where)
            else:
                ok = check_paths(block[self.path_column], first_row, n, problems, self._where)
                sizes = np.full(n, NOMINAL_IMAGE_BYTES, dtype=np.int64)
            if label_col:
                ok &= check_labels(
                    block[label_col], first_row, ok.copy(), seen, problems, self._where, self._labels.force_names
                )
            problems.sort(key=lambda p: p[0])
            yield ScannedBlock(position, position_row, first_row, ok, sizes, problems)

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
        self._labels.force_names = False
        while True:
            result = self._plan_pass(max_bytes, max_samples, shuffle, seed, present_rows, dst)
            rescan = self._labels.settle()
            self.classes = _bounded(self._labels.classes, f"{self.url}: label column {self.label_column!r}")
            if not rescan:
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
            yield from span_items(self.reader, self._value_columns(), self.prefix, items)
        elif isinstance(items, RowList):
            yield from self._rows(items.row_array)
        else:
            yield from items

    def _rows(self, order: np.ndarray[Any, Any]) -> Iterator[TableItem]:
        """The rows of ``order``, through the blocks of the scan's index (else the reader's, else all)."""
        if self._block_index is None or not len(self._block_index):
            self._block_index = self.reader.block_index()
        return list_items(self.reader, self._value_columns(), self.prefix, order, self._block_index, self._where)

    def _row_values(self, row: int) -> Mapping[str, Any]:
        """One row's values (for an item that came without them)."""
        item = next(self._rows(np.array([row], dtype=np.int64)))
        assert item.values is not None
        return item.values

    def resolve(self, path: str) -> str:
        """Return the path or URL of ``path`` as named in the table (relative: to the table's folder)."""
        return resolve_path(self.url, path)

    def load(self, item: Item) -> dict[str, Any]:
        """Read one row's image (named or embedded) and return its sample.

        Raises:
            SourceError: Naming the row and the file or URL, if it is missing (a 404),
                unreadable, or not a valid image.
        """
        assert isinstance(item, TableItem)
        values = item.values if item.values is not None else self._row_values(item.row)
        columns = (self.image_column, self.path_column)
        data, ext, where = row_image(values, columns, self.url, self._where(item.row), self.root, self.storage_options)
        sample: dict[str, Any] = {"__key__": item.key, ext: data}
        if self.check != "none":
            found = check_image(data, where, self.check)
            if found:
                sample[WARNINGS_KEY] = found
        if self.label_column:
            sample["cls"] = self._labels.text(values[self.label_column], where).encode()
        if self.keep_columns:
            extra = {c: values[c] for c in self.keep_columns}
            sample["json"] = json.dumps(extra, sort_keys=True, default=str, ensure_ascii=False).encode()
        return sample


def _bounded(classes: Any, where: str) -> Any:
    """Return ``classes``, checked against the class-name bound (a ``SourceError`` naming ``where``)."""
    too_long = long_name(classes)
    if too_long is not None:
        raise SourceError(f"{where}: {too_long}")
    return classes
