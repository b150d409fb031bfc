"""Indexing one Parquet file: every row read and checked once, its sidecar written beside it.

Every row is checked: image bytes present and of a known image kind
(:func:`~streamload.sample.sniff_image`, the rule ``convert`` applies too), label present
and in range. A bad row is an error naming file, column and row, or (``on_error="skip"``)
left out and listed. Rows stored as they are (an uncompressed PLAIN column chunk, as
Hugging Face writes its images) are located in the file itself, so reads take them by
positioned reads.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from ..._errors import ConfigError
from ...sample import IMAGE_EXTENSIONS, image_field_for, sniff_image
from ..base import TableIndex
from .footer import bad, check_footer, check_footer_size, open_parquet
from .schema import ParquetColumns, Plan, image_values, json_texts, key_prefix, plan_columns, read_columns
from .sidecar import write_sidecar

__all__ = ["ParquetIndex", "index_parquet", "index_table"]

#: What indexing one file found (the table formats' :class:`~streamload.formats.base.TableIndex`).
ParquetIndex = TableIndex
#: The columns found from the schema.
_FOUND_COLUMNS = ParquetColumns()


def index_parquet(
    path: str,
    name: str,
    sidecar_out: str,
    columns: ParquetColumns = _FOUND_COLUMNS,
    *,
    num_classes: int | None = None,
    on_error: str = "raise",
) -> ParquetIndex:
    """Read one Parquet file whole and write its sidecar to ``sidecar_out``.

    Every row is checked: image bytes present and of a known image kind
    (:func:`~streamload.sample.sniff_image`, the rule ``convert`` applies too), label
    present and in range (``0 <= label < num_classes``, else the Hugging Face ``ClassLabel``'s
    count, else ``>= 0``). A bad row is an error, or with ``on_error="skip"`` left out and
    listed (:attr:`ParquetIndex.skipped`; the sidecar then maps samples to the rows kept).

    Raises:
        ConfigError: Naming the file and column, for a table that does not fit the sample
            model (no such column, a column that holds no images, bad labels), or a file
            without rows (or, skipping, without a good one).
        CorruptShardError: Naming the file, for a damaged or hostile file.
    """
    size = os.path.getsize(path)
    check_footer_size(path, size, name)
    pf = open_parquet(path, name)
    md = pf.metadata
    plan = plan_columns(pf.schema_arrow, name, columns)
    extents = check_footer(md, size, name, [plan.image, *plan.json_columns])
    if md.num_rows == 0:
        raise ConfigError(f"{name}: holds no rows (an empty table): nothing to index; leave it out with --match")
    high = num_classes if num_classes is not None else (len(plan.classes) if plan.classes is not None else None)
    rows = _Rows(path, name, plan, md.num_rows, high, on_error)
    wanted = read_columns(plan)
    if plan.has_path:
        wanted.append(f"{plan.image}.path")
    if plan.label:
        wanted.append(plan.label)
    for g in range(md.num_row_groups):
        try:
            table = pf.read_row_group(g, columns=wanted, use_threads=False)
        except Exception as exc:
            raise bad(name, f"row group {g} cannot be read ({type(exc).__name__}: {exc})") from exc
        rows.add(g, md.row_group(g), table)
    found = rows.finish()
    sink = pa.BufferOutputStream()
    md.write_metadata_file(sink)
    meta = {
        "rows": md.num_rows,
        "row_groups": [md.row_group(g).num_rows for g in range(md.num_row_groups)],
        "image": plan.image,
        "struct": plan.struct,
        "label": plan.label,
        "json": list(plan.json_columns),
        "fields": rows.field_names,
        "prefix": key_prefix(name),
        "direct": rows.offsets is not None,
    }
    if rows.kept is not None:
        meta["kept"] = len(rows.kept)
    write_sidecar(sidecar_out, meta, sink.getvalue().to_pybytes(), rows.tables(extents))
    return found


def index_table(
    path: str,
    name: str,
    sidecar_out: str,
    *,
    image_column: str | None = None,
    label_column: str | None = None,
    num_classes: int | None = None,
    on_error: str = "raise",
) -> TableIndex:
    """:func:`index_parquet` as the format's :class:`~streamload.formats.base.TableIndexing` calls it."""
    columns = ParquetColumns(image_column, label_column)
    return index_parquet(path, name, sidecar_out, columns, num_classes=num_classes, on_error=on_error)


class _Rows:
    """The tables of a sidecar, filled one row group at a time; bad rows refused or left out."""

    def __init__(self, path: str, name: str, plan: Plan, n: int, high: int | None, on_error: str) -> None:
        self.path, self.name, self.plan, self.n, self.high, self.on_error = path, name, plan, n, high, on_error
        self.bad: dict[int, str] = {}
        self.field_names: list[str] = []
        self.codes = np.zeros(n, dtype=np.uint8)
        self.sizes = np.zeros(n, dtype=np.int64)
        self.digests = np.zeros(n, dtype=np.uint64)
        self.labels = np.zeros(n if plan.label else 0, dtype=np.int64)
        self.json_digests = np.zeros(n if plan.json_columns else 0, dtype=np.uint64)
        #: Each row's file offset while every row so far is stored as it is (else ``None``).
        self.offsets: np.ndarray | None = np.zeros(n, dtype=np.int64)
        self.seen: dict[str, int] = {}  # string labels: name -> code in order of appearance
        self.kept: np.ndarray | None = None
        self.row = 0

    def refuse(self, row: int, column: str, why: str) -> None:
        """Row ``row`` is bad: an error, or (skipping) left out."""
        if self.on_error != "skip":
            raise ConfigError(f"{self.name}: column {column!r}: row {row} {why}")
        self.bad.setdefault(row, f"column {column!r}: {why}")

    def add(self, g: int, rg: Any, table: Any) -> None:
        """Check and record the rows of row group ``g`` (``rg``: its footer metadata, ``table``: its columns)."""
        plan = self.plan
        images = image_values(table, plan)
        if len(images) != rg.num_rows:
            raise bad(self.name, f"row group {g} holds {len(images)} rows, its footer says {rg.num_rows}")
        if plan.label and plan.label_names:
            self._label_names(table.column(plan.label).combine_chunks())
        elif plan.label:
            self._label_numbers(table.column(plan.label))
        if self.offsets is not None:
            self.offsets = _locate_rows(self.path, rg, read_columns(plan)[0], images, self.row, self.offsets)
        paths = table.column(plan.image).combine_chunks().field("path").to_pylist() if plan.has_path else None
        self._images(images, paths, json_texts(table, plan))
        self.row += len(images)

    def _label_names(self, column: Any) -> None:
        """String labels: blank ones refused; each name coded in order of appearance (sorted in :meth:`finish`)."""
        label, row = self.plan.label, self.row
        assert label is not None
        blank = np.asarray(
            pc.or_kleene(column.is_null(), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0))
            .fill_null(True)
            .to_numpy(zero_copy_only=False),
            dtype=bool,
        )
        for r in np.flatnonzero(blank).tolist():
            self.refuse(row + r, label, "has no label")
        good = np.flatnonzero(~blank)
        encoded = column.filter(pa.array(~blank)).dictionary_encode()
        local = [self.seen.setdefault(v, len(self.seen)) for v in encoded.dictionary.to_pylist()]
        indices = np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
        self.labels[row + good] = np.asarray(local, dtype=np.int64)[indices]

    def _label_numbers(self, column: Any) -> None:
        """Integer labels: missing ones and those out of range refused."""
        label, row, high = self.plan.label, self.row, self.high
        assert label is not None
        missing = np.asarray(column.is_null(), dtype=bool)
        for r in np.flatnonzero(missing).tolist():
            self.refuse(row + r, label, "has no label")
        raw = np.asarray(column.fill_null(0).to_numpy())
        out_of_range = raw > np.iinfo(np.int64).max if raw.dtype.kind == "u" else raw < 0
        if high is not None:
            out_of_range |= raw >= high
        where = f"0..{high - 1}" if high is not None else ">= 0"
        for r in np.flatnonzero(out_of_range & ~missing).tolist():
            self.refuse(row + r, label, f"has label {int(raw[r])} (expected {where})")
        values = np.where(out_of_range | missing, 0, raw).astype(np.int64)
        self.labels[row : row + len(values)] = values

    def _images(self, images: list[Any], paths: list[Any] | None, texts: list[bytes] | None) -> None:
        """Check each row's image (and digest it with its ``json``)."""
        image = self.plan.image
        digest = xxhash.xxh3_64_intdigest
        for r, data in enumerate(images):
            i = self.row + r
            if not data:
                named = str(paths[r] or "") if paths is not None else ""
                self.refuse(i, image, _stored_by_path(named) if named else "has no image bytes")
                continue
            field = image_field_for(data, str(paths[r] or "") if paths is not None else "")
            if field not in IMAGE_EXTENSIONS or sniff_image(data) is None:
                self.refuse(i, image, "holds bytes that are not an image")
                continue
            if i in self.bad:
                continue
            if field not in self.field_names:
                if len(self.field_names) == 255:
                    raise ConfigError(f"{self.name}: column {image!r}: more than 255 image kinds")
                self.field_names.append(field)
            self.codes[i] = self.field_names.index(field)
            self.sizes[i] = len(data)
            self.digests[i] = digest(data)
            if texts is not None:
                self.json_digests[i] = digest(texts[r])

    def finish(self) -> TableIndex:
        """Number the string labels in sorted order, leave the bad rows out; return what was found."""
        plan, bad_rows = self.plan, self.bad
        label_names: tuple[str, ...] | None = None
        if plan.label_names:  # codes in order of appearance -> positions in the sorted names
            label_names = tuple(sorted(self.seen))
            order = np.empty(len(self.seen), dtype=np.int64)
            for position, found in enumerate(label_names):
                order[self.seen[found]] = position
            self.labels = order[self.labels] if len(self.seen) else self.labels
        if bad_rows:
            every = np.arange(self.n, dtype=np.int64)
            kept = self.kept = np.setdiff1d(every, np.fromiter(bad_rows, dtype=np.int64, count=len(bad_rows)))
            if not len(kept):
                first = min(bad_rows)
                raise ConfigError(f"{self.name}: no row holds a usable sample (row {first}: {bad_rows[first]})")
            self.codes, self.sizes, self.digests = self.codes[kept], self.sizes[kept], self.digests[kept]
            self.labels = self.labels[kept] if plan.label else self.labels
            self.json_digests = self.json_digests[kept] if plan.json_columns else self.json_digests
            self.offsets = self.offsets[kept] if self.offsets is not None else None
        fields = [*self.field_names, *(["cls"] if plan.label else []), *(["json"] if plan.json_columns else [])]
        skipped = sorted(bad_rows.items())
        return TableIndex(self.n - len(skipped), sorted(fields), plan.classes, label_names, skipped)

    def tables(self, extents: np.ndarray) -> dict[str, np.ndarray]:
        """The sidecar's tables (after :meth:`finish`), in the order they are written."""
        arrays: dict[str, np.ndarray] = {
            "field": self.codes,
            "size": self.sizes,
            "image_xxh3": self.digests,
            "extent": extents,
        }
        if self.kept is not None:
            arrays["row"] = self.kept
        if self.plan.label:
            arrays["label"] = self.labels
        if self.plan.json_columns:
            arrays["json_xxh3"] = self.json_digests
        if self.offsets is not None:
            arrays["offset"] = self.offsets
        return arrays


def _stored_by_path(path: str) -> str:
    """Why a row whose image struct names a path but holds no bytes cannot be read in place."""
    return (
        f"has no image bytes, only a path ({path!r}): the images are stored by path, not embedded in the "
        "file, so they cannot be read in place; streamload convert FILE DST --root DIR reads them (the paths "
        "under DIR), or embed them first (datasets: map datasets.table.embed_table_storage, then to_parquet)"
    )


def _locate_rows(
    path: str, rg: Any, leaf: str, images: list[Any], first_row: int, offsets: np.ndarray
) -> np.ndarray | None:
    """Find each row's image bytes in row group ``rg``'s column chunk ``leaf``, stored as they are.

    Only an uncompressed chunk without a dictionary qualifies: its PLAIN values are each
    a 4-byte length and the bytes. Returns ``offsets`` with the rows' file offsets filled
    in, or ``None`` if a row is not found so (then the file is read through pyarrow).
    Nothing depends on this being right but speed: every read is checked by its digest.
    """
    col = next((rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema == leaf), None)
    if col is None or col.compression != "UNCOMPRESSED" or col.has_dictionary_page:
        return None
    start = col.data_page_offset
    with open(path, "rb") as f:
        f.seek(start)
        chunk = f.read(col.total_compressed_size)
    pos = 0
    for r, data in enumerate(images):
        if not data:
            return None
        want = len(data).to_bytes(4, "little") + data
        at = pos if chunk.startswith(want, pos) else chunk.find(want, pos)
        if at < 0:
            return None
        offsets[first_row + r] = start + at + 4
        pos = at + len(want)
    return offsets
