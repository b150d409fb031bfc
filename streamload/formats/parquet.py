"""Parquet image tables read in place: one file is one shard, a row group the read unit.

Hugging Face datasets, Spark/Databricks exports and LAION-style sets keep images in Parquet:
an image column (a Hugging Face ``Image`` struct ``{bytes, path}``, or a plain binary
column), an optional label column (integers, a Hugging Face ``ClassLabel``'s names becoming
the dataset's classes; or strings, class names sorted and numbered over all the files as
``convert`` does) and other columns. ``streamload index DIR --format parquet`` reads
every file once and writes, beside each, a sidecar ``<file>.slpq`` (see below) and then
``index.json``; the files themselves are never rewritten.

**Sample model** (the same mapping ``convert`` gives such a table): row ``r`` of
``train-00000.parquet`` is ``{"__key__": "train-00000/0000000012", <img>: bytes, "cls":
b"3", "json": b"{...}"}``, where ``<img>`` is the image's extension (from the struct's
``path`` when it names an image file, else sniffed from the bytes: ``jpg``, ``png``,
``webp``...), ``cls`` the label in ASCII decimal (only with a label column) and ``json``
every other column of the row (``json.dumps(..., sort_keys=True, default=str)``; only if
there are other columns).

**Sidecar** (an uncompressed ``.npz`` read with ``allow_pickle=False``; its manifest hash
is checked before use)::

    meta       uint8[]      JSON: format, version, rows, row-group row counts, image
                            column (and whether it is a struct), label column, json
                            columns, field names, key prefix
    footer     uint8[]      the file's Parquet footer as indexed (a metadata-only file):
                            the reader never trusts the file's own footer
    field      uint8[n]     per row, the index of its image field name
    size       int64[n]     per row, its image's byte length
    image_xxh3 uint64[n]    per row, xxh3_64 of its image bytes
    label      int64[n]     per row, its label (only with a label column)
    json_xxh3  uint64[n]    per row, xxh3_64 of its ``json`` bytes (only with json columns)
    extent     int64[g, 2]  per row group, the byte span of the column chunks a read needs
    offset     int64[n]     per row, its image's offset in the file (only when every row's
                            bytes are stored as they are: meta ``direct``)
    row        int64[n]     per sample, its row in the file, increasing (only when bad rows
                            were left out, ``index --on-error skip``: meta ``kept`` = n;
                            every other table then holds the kept rows only)

**Integrity as for our own shards.** The file's size and hash are in the manifest (checked
on every cached copy); every row's image and ``json`` bytes are checked against their
digests on every read, so a flipped byte in a data page is a
:class:`~streamload.CorruptShardError` naming the file, row group and row (or a page that
no longer decompresses: the same error). Labels come from the sidecar.

**Reads.** Rows stored as they are (an uncompressed, PLAIN, dictionary-free image chunk,
as Hugging Face ``datasets`` writes images: each value a 4-byte length and the bytes) are
located at index time and read by positioned reads like tar members (``offset``), no
pyarrow involved. Otherwise only the columns the sample model needs (``image.bytes`` of a struct, the json
columns; never the label column nor the struct's ``path``), one row group at a time: the
image chunk read once and its pages decoded by :mod:`._pqpages` (each row a slice of its
page or dictionary entry; pyarrow where that decoder does not apply, and for the json
columns). A reader reading in row order keeps only its current row groups; shuffled reads
keep the decoded row groups per process up to :data:`ROW_GROUP_CACHE_BYTES`. Through
``cache="shards"`` the reader opens the cached file; through ``cache="none"`` it reads by
ranged GETs (:class:`~._bytes.ShardBytes`), the row groups' extents fetched ahead like tar
samples'.

**Bounds** (hostile or broken files): the footer's size and its Thrift containers are
bounded; every column chunk must lie inside the file; the column chunks one row-group read
decompresses are bounded (:data:`MAX_ROW_GROUP_BYTES`, at most :data:`MAX_EXPANSION` times
their stored size: a decompression bomb is refused before it is read; the pages decoded
here may not decompress past their chunk's declared size); the decoded row group must hold
exactly the rows the footer declared.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from .. import _env
from .._errors import ConfigError, CorruptShardError, SampleError, UnsafeShardError
from ..manifest import ShardEntry, algorithm_of, new_hasher
from ..sample import IMAGE_EXTENSIONS, image_field_for, sniff_image
from ._bytes import MAX_GAP, FileBytes, ShardBytes, gather
from ._pqpages import Unsupported, decode_chunk
from ._record import open_regular_file
from .base import FieldGroup, Format, Sample, ShardReader, ShardWriter, key_problem

__all__ = [
    "FORMAT",
    "MAX_EXPANSION",
    "MAX_ROW_GROUP_BYTES",
    "ParquetColumns",
    "ParquetIndex",
    "ParquetShardReader",
    "class_label_names",
    "index_parquet",
    "relabel_sidecar",
]

_MAGIC = "streamload-parquet"
_VERSION = 1
SIDECAR_SUFFIX = ".slpq"
#: Decompressed bytes one row-group read may produce (the needed column chunks together).
MAX_ROW_GROUP_BYTES = 1 << 30
#: Largest ratio of decompressed to stored bytes of a row-group read (plus 1 MiB of slack).
MAX_EXPANSION = 1000
_SLACK = 1 << 20
#: Largest Parquet footer read (bytes), and Thrift limits while parsing it.
MAX_FOOTER_BYTES = 64 << 20
_THRIFT_STRING_LIMIT = 16 << 20
_THRIFT_CONTAINER_LIMIT = 1 << 20
#: Bytes between rows read into a scratch buffer rather than splitting a ``preadv``; iovecs per call.
#: Largest sidecar read.
MAX_SIDECAR_BYTES = 1 << 31
#: Bytes of decoded row groups one process keeps, over all its readers (least recently
#: used dropped first; ``STREAMLOAD_PARQUET_CACHE`` overrides it, e.g. ``"2GB"``). A shuffle
#: window reads its files' row groups in random order: when they fit here each is decoded
#: once per window, otherwise again for most samples.
ROW_GROUP_CACHE_BYTES = 1 << 30


#: A decoded row group: its image bytes (pages), per row its page and span there (starts,
#: ends), its json texts.
_Group = tuple["list[np.ndarray]", np.ndarray, np.ndarray, np.ndarray, "list[bytes] | None"]


class _GroupCache:
    """Decoded row groups of one process, keyed by reader and row group, bounded in bytes."""

    def __init__(self) -> None:
        self.pid = -1
        self.items: OrderedDict[tuple[int, int], tuple[_Group, int]] = OrderedDict()
        self.total = 0
        self.budget = ROW_GROUP_CACHE_BYTES

    def _here(self) -> None:
        if self.pid != os.getpid():  # a forked child starts empty (its readers are new)
            self.items.clear()
            self.total, self.pid = 0, os.getpid()
            self.budget = _env.env_bytes(_env.PARQUET_CACHE, ROW_GROUP_CACHE_BYTES)

    def get(self, key: tuple[int, int]) -> _Group | None:
        self._here()
        kept = self.items.get(key)
        if kept is None:
            return None
        self.items.move_to_end(key)
        return kept[0]

    def put(self, key: tuple[int, int], group: _Group) -> None:
        self._here()
        texts = group[4]
        nbytes = sum(int(a.nbytes) for a in (*group[0], group[1], group[2], group[3]))
        nbytes += sum(map(len, texts)) if texts else 0
        self.items[key] = (group, nbytes)
        self.total += nbytes
        while self.total > self.budget and len(self.items) > 1:
            _, (_, dropped) = self.items.popitem(last=False)
            self.total -= dropped

    def drop(self, reader: int, below: int | None = None) -> None:
        """Drop ``reader``'s row groups (only those before row group ``below`` if given)."""
        for key in [k for k in self.items if k[0] == reader and (below is None or k[1] < below)]:
            self.total -= self.items.pop(key)[1]

    def held(self, reader: int) -> list[int]:
        """The row groups of ``reader`` held now, least recently used first."""
        self._here()
        return [g for r, g in self.items if r == reader]


_CACHE = _GroupCache()
#: Rows read one after another in row order after which a reader drops the row groups before.
_IN_ORDER = 8
_READERS = itertools.count()


@dataclass(frozen=True)
class ParquetColumns:
    """Which columns of a Parquet table make the sample.

    Attributes:
        image: The image column; ``None``: the Hugging Face ``Image`` feature, else the
            only binary (or ``{bytes, path}`` struct) column.
        label: The label column, integers (class indices) or strings (class names, or
            decimal indices, as ``convert`` reads them); ``None``: ``label`` if there is
            one, else the Hugging Face ``ClassLabel`` feature, else no label; ``""``: no label.
    """

    image: str | None = None
    label: str | None = None


@dataclass
class ParquetIndex:
    """What indexing one file found: its rows, fields and class names (Hugging Face ``ClassLabel``).

    ``num_samples`` counts the rows kept (``skipped`` lists the others). With a string label
    column, ``label_names`` holds the file's distinct labels, sorted, and its sidecar's labels
    index them: :func:`relabel_sidecar` maps them to the
    dataset's labels once every file was read.
    """

    num_samples: int
    fields: list[str]
    classes: tuple[str, ...] | None
    label_names: tuple[str, ...] | None = None
    #: Rows left out (``on_error="skip"``): ``(row, why)``, in row order.
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)


def _key_prefix(name: str) -> str:
    stem = name[: -len(".parquet")] if name.endswith(".parquet") else name.rpartition(".")[0] or name
    return stem.replace("%", "%25").replace(".", "%2E").replace("~", "%7E") or "row"


def _bad(name: str, detail: str) -> CorruptShardError:
    return CorruptShardError(f"{name}: {detail}")


def _open_parquet(source: Any, name: str, metadata: Any = None, pre_buffer: bool = True) -> Any:
    """A pyarrow ``ParquetFile`` over ``source``, its footer bounded; errors name ``name``."""
    try:
        return pq.ParquetFile(
            source,
            metadata=metadata,
            thrift_string_size_limit=_THRIFT_STRING_LIMIT,
            thrift_container_size_limit=_THRIFT_CONTAINER_LIMIT,
            pre_buffer=pre_buffer,
        )
    except Exception as exc:  # ArrowInvalid, OSError...: a damaged footer or not Parquet at all
        raise _bad(name, f"not a readable Parquet file ({type(exc).__name__}: {exc})") from exc


def _hf_features(schema: Any) -> dict[str, Any]:
    """The Hugging Face features recorded in the schema's ``huggingface`` metadata ({} if none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw or len(raw) > _THRIFT_STRING_LIMIT:
        return {}
    try:
        info = json.loads(raw)
        features = info.get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def class_label_names(schema: Any, column: str, name: str) -> tuple[str, ...] | None:
    """The names of column ``column``'s Hugging Face ``ClassLabel`` (``None`` if it is not one).

    Raises:
        ConfigError: Naming the file ``name``, if a class name is given twice.
    """
    feature = _hf_features(schema).get(column)
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
        return None
    found = feature.get("names")
    if not isinstance(found, list) or not all(isinstance(n, str) for n in found):
        return None
    twice = sorted({n for n in found if found.count(n) > 1})
    if twice:
        raise ConfigError(f"{name}: the ClassLabel of column {column!r} names class {twice[0]!r} more than once")
    return tuple(found)


def _image_kind(t: Any) -> str | None:
    """``"binary"`` or ``"struct"`` if an arrow type can hold image bytes, else ``None``."""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if "bytes" in names:
            inner = t.field("bytes").type
            if pa.types.is_binary(inner) or pa.types.is_large_binary(inner):
                return "struct"
    return None


@dataclass(frozen=True)
class _Plan:
    """The columns of one file that make its samples."""

    image: str
    struct: bool
    has_path: bool
    label: str | None
    json_columns: tuple[str, ...]
    classes: tuple[str, ...] | None
    label_names: bool = False


def _named(name: str, names: list[str], column: str) -> str:
    """``column``, if the file ``name`` has it (else a ``ConfigError`` listing its columns)."""
    if column not in names:
        raise ConfigError(f"{name}: no column {column!r} (columns: {', '.join(names)})")
    return column


def _hf_typed(features: dict[str, Any], names: list[str], kind: str) -> list[str]:
    """The columns whose Hugging Face feature is of ``_type`` ``kind`` (``Image``, ``ClassLabel``)."""
    return [c for c in names if isinstance(features.get(c), dict) and features[c].get("_type") == kind]


def _plan(schema: Any, name: str, columns: ParquetColumns) -> _Plan:
    """Choose the image, label and json columns of a file (``ConfigError`` naming file and column)."""
    names = list(schema.names)
    features = _hf_features(schema)
    if columns.image is not None:
        image = _named(name, names, columns.image)
    else:
        found = _hf_typed(features, names, "Image") or [c for c in names if _image_kind(schema.field(c).type)]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)} ({', '.join(found)})"
            raise ConfigError(
                f"{name}: {what} image columns (binary or {{bytes, path}} struct); name it with --image-column"
            )
        image = found[0]
    kind = _image_kind(schema.field(image).type)
    if kind is None:
        raise ConfigError(
            f"{name}: column {image!r} of type {schema.field(image).type} cannot hold images "
            "(expected binary or a {bytes, path} struct)"
        )
    label: str | None
    if columns.label == "":
        label = None
    elif columns.label is not None:
        label = _named(name, names, columns.label)
    else:
        hf_labels = _hf_typed(features, names, "ClassLabel")
        label = "label" if "label" in names else (hf_labels[0] if hf_labels else None)
    classes: tuple[str, ...] | None = None
    if label is not None:
        if label == image:
            raise ConfigError(f"{name}: column {label!r} cannot be both the image and the label")
        t = schema.field(label).type
        names_kind = pa.types.is_string(t) or pa.types.is_large_string(t)
        if not pa.types.is_integer(t) and not names_kind:
            raise ConfigError(
                f"{name}: label column {label!r} is {t}, not integers or class names (no labels: --label-column '')"
            )
        classes = class_label_names(schema, label, name)
    struct_type = schema.field(image).type
    has_path = kind == "struct" and "path" in [struct_type.field(i).name for i in range(struct_type.num_fields)]
    rest = tuple(c for c in names if c not in (image, label))
    names_kind = label is not None and not pa.types.is_integer(schema.field(label).type)
    return _Plan(image, kind == "struct", has_path, label, rest, classes, names_kind)


def _check_footer(md: Any, size: int, name: str, columns: Sequence[str]) -> np.ndarray:
    """Check every row group's column chunks against the file and the bounds; return the needed extents.

    Returns:
        ``int64[row_groups, 2]``: per row group, the byte span of the chunks of ``columns``
        (leaf paths, or their parents).
    """
    extents = np.zeros((md.num_row_groups, 2), dtype=np.int64)
    rows = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows < 0:
            raise _bad(name, f"row group {g} declares {rg.num_rows} rows")
        rows += rg.num_rows
        if rg.num_rows == 0:  # nothing is read from an empty row group (pyarrow writes its chunks at 0)
            continue
        lo, hi, stored, expanded = size, 0, 0, 0
        for j in range(rg.num_columns):
            col = rg.column(j)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset is not None and col.dictionary_page_offset > 0:
                start = min(start, col.dictionary_page_offset)
            end = start + col.total_compressed_size
            if start < 4 or col.total_compressed_size < 0 or end > size:
                raise _bad(
                    name,
                    f"row group {g} column {col.path_in_schema!r} lies at bytes {start}..{end}, "
                    f"outside the file of {size} bytes",
                )
            path = col.path_in_schema
            if any(path == c or path.startswith(c + ".") for c in columns):
                lo, hi = min(lo, start), max(hi, end)
                stored += col.total_compressed_size
                expanded += col.total_uncompressed_size
        if expanded > MAX_ROW_GROUP_BYTES or expanded > MAX_EXPANSION * stored + _SLACK:
            raise _bad(
                name,
                f"row group {g} declares {expanded} decompressed bytes for {stored} stored ones "
                f"(a decompression bomb? at most {MAX_ROW_GROUP_BYTES} bytes and {MAX_EXPANSION}x)",
            )
        extents[g] = (lo, hi) if hi else (0, 0)
    if rows != md.num_rows:
        raise _bad(name, f"row groups hold {rows} rows but the footer declares {md.num_rows}")
    return extents


def _read_columns(plan: _Plan) -> list[str]:
    """The columns a read needs (the struct's ``bytes`` leaf only)."""
    return [f"{plan.image}.bytes" if plan.struct else plan.image, *plan.json_columns]


def _image_array(table: Any, plan: _Plan) -> Any:
    column = table.column(plan.image)
    col = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return col.field("bytes") if plan.struct else col


def _image_values(table: Any, plan: _Plan) -> list[Any]:
    return list(_image_array(table, plan).to_pylist())


def _flat(array: Any) -> tuple[np.ndarray, np.ndarray]:
    """A binary arrow array's values as ``(uint8 data, int64 offsets[len + 1])``, the data a view without a copy.

    A null value's extent is whatever its offsets say (empty when written by pyarrow): the
    row's digest check fails on it, since indexing refused null images.
    """
    offsets_buf, data_buf = array.buffers()[1:3]
    wide = pa.types.is_large_binary(array.type)
    raw: np.ndarray[Any, Any] = np.frombuffer(offsets_buf, dtype=np.int64 if wide else np.int32)
    offsets: np.ndarray[Any, Any] = raw[array.offset : array.offset + len(array) + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > len(data) or bool(np.any(offsets[1:] < offsets[:-1]))):
        raise ValueError("binary offsets are inconsistent")
    return data, offsets


def _json_texts(table: Any, plan: _Plan) -> list[bytes] | None:
    if not plan.json_columns:
        return None
    values = {c: table.column(c).to_pylist() for c in plan.json_columns}
    return [
        json.dumps(
            {c: values[c][r] for c in plan.json_columns}, sort_keys=True, default=str, ensure_ascii=False
        ).encode()
        for r in range(table.num_rows)
    ]


def index_parquet(
    path: str,
    name: str,
    sidecar_out: str,
    columns: ParquetColumns = ParquetColumns(),
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
    _check_footer_size(path, size, name)
    pf = _open_parquet(path, name)
    md = pf.metadata
    plan = _plan(pf.schema_arrow, name, columns)
    extents = _check_footer(md, size, name, [plan.image, *plan.json_columns])
    n = md.num_rows
    if n == 0:
        raise ConfigError(f"{name}: holds no rows (an empty table): nothing to index; leave it out with --match")
    high = num_classes if num_classes is not None else (len(plan.classes) if plan.classes is not None else None)
    bad: dict[int, str] = {}

    def refuse(row: int, column: str, why: str) -> None:
        if on_error != "skip":
            raise ConfigError(f"{name}: column {column!r}: row {row} {why}")
        bad.setdefault(row, f"column {column!r}: {why}")

    field_names: list[str] = []
    codes = np.zeros(n, dtype=np.uint8)
    sizes = np.zeros(n, dtype=np.int64)
    digests = np.zeros(n, dtype=np.uint64)
    labels = np.zeros(n if plan.label else 0, dtype=np.int64)
    json_digests = np.zeros(n if plan.json_columns else 0, dtype=np.uint64)
    wanted = _read_columns(plan)
    if plan.has_path:
        wanted.append(f"{plan.image}.path")
    if plan.label:
        wanted.append(plan.label)
    row = 0
    digest = xxhash.xxh3_64_intdigest
    # Rows stored as they are (an uncompressed PLAIN column chunk, as Hugging Face writes its
    # images) are found in the file itself, so reads take them by positioned reads.
    offsets: np.ndarray | None = np.zeros(n, dtype=np.int64)
    seen: dict[str, int] = {}  # string labels: name -> code in order of appearance
    for g in range(md.num_row_groups):
        try:
            table = pf.read_row_group(g, columns=wanted, use_threads=False)
        except Exception as exc:
            raise _bad(name, f"row group {g} cannot be read ({type(exc).__name__}: {exc})") from exc
        images = _image_values(table, plan)
        if len(images) != md.row_group(g).num_rows:
            raise _bad(name, f"row group {g} holds {len(images)} rows, its footer says {md.row_group(g).num_rows}")
        paths = table.column(plan.image).combine_chunks().field("path").to_pylist() if plan.has_path else None
        texts = _json_texts(table, plan)
        if plan.label and plan.label_names:
            label_col = table.column(plan.label).combine_chunks()
            blank = np.asarray(
                pc.or_kleene(label_col.is_null(), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(label_col)), 0))
                .fill_null(True)
                .to_numpy(zero_copy_only=False),
                dtype=bool,
            )
            for r in np.flatnonzero(blank).tolist():
                refuse(row + r, plan.label, "has no label")
            good = np.flatnonzero(~blank)
            encoded = label_col.filter(pa.array(~blank)).dictionary_encode()
            local = [seen.setdefault(v, len(seen)) for v in encoded.dictionary.to_pylist()]
            indices = np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
            labels[row + good] = np.asarray(local, dtype=np.int64)[indices]
        elif plan.label:
            label_col = table.column(plan.label)
            missing = np.asarray(label_col.is_null(), dtype=bool)
            for r in np.flatnonzero(missing).tolist():
                refuse(row + r, plan.label, "has no label")
            raw = np.asarray(label_col.fill_null(0).to_numpy())
            out_of_range = raw > np.iinfo(np.int64).max if raw.dtype.kind == "u" else raw < 0
            if high is not None:
                out_of_range |= raw >= high
            where = f"0..{high - 1}" if high is not None else ">= 0"
            for r in np.flatnonzero(out_of_range & ~missing).tolist():
                refuse(row + r, plan.label, f"has label {int(raw[r])} (expected {where})")
            values = np.where(out_of_range | missing, 0, raw).astype(np.int64)
            labels[row : row + len(values)] = values
        if offsets is not None:
            offsets = _locate_rows(path, md.row_group(g), _read_columns(plan)[0], images, row, offsets)
        for r, data in enumerate(images):
            i = row + r
            if not data:
                named = str(paths[r] or "") if paths is not None else ""
                refuse(i, plan.image, _stored_by_path(named) if named else "has no image bytes")
                continue
            field = image_field_for(data, str(paths[r] or "") if paths is not None else "")
            if field not in IMAGE_EXTENSIONS or sniff_image(data) is None:
                refuse(i, plan.image, "holds bytes that are not an image")
                continue
            if i in bad:
                continue
            if field not in field_names:
                if len(field_names) == 255:
                    raise ConfigError(f"{name}: column {plan.image!r}: more than 255 image kinds")
                field_names.append(field)
            codes[i] = field_names.index(field)
            sizes[i] = len(data)
            digests[i] = digest(data)
            if texts is not None:
                json_digests[i] = digest(texts[r])
        row += len(images)
    label_names: tuple[str, ...] | None = None
    if plan.label_names:  # codes in order of appearance -> positions in the sorted names
        label_names = tuple(sorted(seen))
        order = np.empty(len(seen), dtype=np.int64)
        for position, found in enumerate(label_names):
            order[seen[found]] = position
        labels = order[labels] if len(seen) else labels
    kept: np.ndarray | None = None
    if bad:
        kept = np.setdiff1d(np.arange(n, dtype=np.int64), np.fromiter(bad, dtype=np.int64, count=len(bad)))
        if not len(kept):
            first = min(bad)
            raise ConfigError(f"{name}: no row holds a usable sample (row {first}: {bad[first]})")
        codes, sizes, digests = codes[kept], sizes[kept], digests[kept]
        labels = labels[kept] if plan.label else labels
        json_digests = json_digests[kept] if plan.json_columns else json_digests
        offsets = offsets[kept] if offsets is not None else None
    sink = pa.BufferOutputStream()
    md.write_metadata_file(sink)
    meta = {
        "format": _MAGIC,
        "version": _VERSION,
        "rows": n,
        "row_groups": [md.row_group(g).num_rows for g in range(md.num_row_groups)],
        "image": plan.image,
        "struct": plan.struct,
        "label": plan.label,
        "json": list(plan.json_columns),
        "fields": field_names,
        "prefix": _key_prefix(name),
        "direct": offsets is not None,
    }
    if kept is not None:
        meta["kept"] = len(kept)
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8),
        "footer": np.frombuffer(sink.getvalue().to_pybytes(), dtype=np.uint8),
        "field": codes,
        "size": sizes,
        "image_xxh3": digests,
        "extent": extents,
    }
    if kept is not None:
        arrays["row"] = kept
    if plan.label:
        arrays["label"] = labels
    if plan.json_columns:
        arrays["json_xxh3"] = json_digests
    if offsets is not None:
        arrays["offset"] = offsets
    with open(sidecar_out, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    fields = [*field_names, *(["cls"] if plan.label else []), *(["json"] if plan.json_columns else [])]
    skipped = sorted(bad.items())
    return ParquetIndex(n - len(skipped), sorted(fields), plan.classes, label_names, skipped)


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


def relabel_sidecar(path: str, mapping: Sequence[int]) -> None:
    """Rewrite the labels of a sidecar :func:`index_parquet` just wrote: label ``i`` becomes ``mapping[i]``."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    table = np.asarray(mapping, dtype=np.int64)
    arrays["label"] = table[arrays["label"]] if len(arrays["label"]) else arrays["label"]
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _check_footer_size(path: str, size: int, name: str) -> None:
    """Refuse a file too short for Parquet, without its magic, or whose footer claims too much."""
    with open(path, "rb") as f:
        head = f.read(4)
        if size < 12:
            raise _bad(name, f"not a Parquet file ({size} bytes)")
        f.seek(size - 8)
        tail = f.read(8)
    if head != b"PAR1" or tail[4:] != b"PAR1":
        raise _bad(name, "not a Parquet file (no PAR1 magic at its start and end)")
    footer = int.from_bytes(tail[:4], "little")
    if footer > min(size - 12, MAX_FOOTER_BYTES):
        raise _bad(name, f"its footer claims {footer} bytes (the file has {size}; at most {MAX_FOOTER_BYTES})")


class _SourceFile(io.RawIOBase):
    """A read-only, seekable file over :class:`ShardBytes` (ranged reads), for pyarrow."""

    def __init__(self, source: ShardBytes) -> None:
        super().__init__()
        self.source = source
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.source.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self.source.size - self.pos))
        if not want:
            return 0
        got = self.source.preadv([view[:want]], self.pos)
        self.pos += got
        return got


class ParquetShardReader(ShardReader):
    """Reads the rows of one Parquet file as samples, checked against its sidecar.

    Args:
        path: The local file (a cached copy), or its URL when ``source`` reads by ranges.
        entry: Its manifest entry.
        sidecar_path: The local sidecar.
        source: Ranged reads of the file (streaming mode); ``None``: open ``path``.
        check_headers: Unused (accepted for the streaming reader's signature).
    """

    def __init__(
        self,
        path: str,
        entry: ShardEntry,
        sidecar_path: str | None = None,
        source: ShardBytes | None = None,
        check_headers: bool = True,
    ) -> None:
        super().__init__(path, entry, sidecar_path)
        if sidecar_path is None:
            raise CorruptShardError(f"{entry.name}: Parquet shard has no sidecar in the manifest")
        self._source = source
        self._load_sidecar(sidecar_path)
        self._pid = -1
        self._file: Any = None
        self._token = next(_READERS)  # this reader's row groups in the process's cache
        self._current = -1  # the row group reads in row order are in (older ones are dropped)
        self._fast = True  # image chunks decoded from their pages (False: through pyarrow)
        self._handle: Any = None  # the open local file (pyarrow's), for the chunk reads
        self._wanted: dict[tuple[str, ...], np.ndarray] = {}  # per field list: which image fields it takes
        self._last_row = -2
        self._streak = 0  # rows read in row order up to _last_row

    # -- the sidecar ------------------------------------------------------------------

    def _load_sidecar(self, sidecar_path: str) -> None:
        name, n = self.entry.name, self.entry.num_samples
        fd = open_regular_file(sidecar_path, name)
        try:
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_SIDECAR_BYTES + 1)
        finally:
            os.close(fd)
        sidecar = self.entry.sidecar
        if sidecar is not None and sidecar.hash is not None:
            hasher = new_hasher(sidecar.algorithm or algorithm_of(sidecar.hash))
            hasher.update(raw)
            if hasher.hexdigest() != sidecar.hash:
                raise CorruptShardError(f"{name}: sidecar {sidecar.name} does not match its manifest hash")
        try:
            with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            meta = json.loads(arrays["meta"].tobytes())
        except Exception as exc:  # a damaged zip, a missing array, bad JSON
            raise CorruptShardError(f"{name}: Parquet sidecar is damaged ({type(exc).__name__}: {exc})") from exc
        if not isinstance(meta, dict) or meta.get("format") != _MAGIC or meta.get("version") != _VERSION:
            raise CorruptShardError(f"{name}: not a streamload Parquet sidecar (or another version)")
        groups = meta.get("row_groups")
        fields = meta.get("fields")
        rows = meta.get("rows")
        kept = arrays.get("row") if "kept" in meta else None  # rows left out at indexing: sample i is row[i]
        if (
            not isinstance(rows, int)
            or (rows != n if kept is None else meta.get("kept") != n)
            or not isinstance(groups, list)
            or not all(isinstance(g, int) and g >= 0 for g in groups)
            or sum(groups) != rows
            or not isinstance(fields, list)
            or not all(isinstance(f, str) and f in IMAGE_EXTENSIONS for f in fields)
        ):
            raise CorruptShardError(f"{name}: Parquet sidecar does not describe {n} rows")
        expect = {"field": (np.uint8, n), "size": (np.int64, n), "image_xxh3": (np.uint64, n)}
        if meta.get("label"):
            expect["label"] = (np.int64, n)
        if meta.get("json"):
            expect["json_xxh3"] = (np.uint64, n)
        if meta.get("direct"):
            expect["offset"] = (np.int64, n)
        if "kept" in meta:
            expect["row"] = (np.int64, n)
        for key, (dtype, length) in expect.items():
            arr = arrays.get(key)
            if arr is None or arr.dtype != dtype or arr.shape != (length,):
                raise CorruptShardError(f"{name}: Parquet sidecar table {key!r} is damaged")
        if (
            kept is not None
            and n
            and (int(kept[0]) < 0 or int(kept[-1]) >= rows or bool(np.any(kept[1:] <= kept[:-1])))
        ):
            raise CorruptShardError(f"{name}: Parquet sidecar table 'row' is damaged")
        extent = arrays.get("extent")
        if extent is None or extent.dtype != np.int64 or extent.shape != (len(groups), 2):
            raise CorruptShardError(f"{name}: Parquet sidecar table 'extent' is damaged")
        if n and (int(arrays["field"].max()) >= len(fields) or int(arrays["size"].min()) < 0):
            raise CorruptShardError(f"{name}: Parquet sidecar field table is damaged")
        direct = arrays.get("offset") if meta.get("direct") else None
        if direct is not None and n:
            ends = direct + arrays["size"]
            if int(direct.min()) < 4 or int(ends.max()) > self.entry.num_bytes - 8 or bool(np.any(ends < direct)):
                raise CorruptShardError(f"{name}: Parquet sidecar offsets lie outside the file")
        prefix = meta.get("prefix")
        problem = key_problem(f"{prefix}/{0:010d}") if isinstance(prefix, str) else "its key prefix is not a str"
        if problem is not None:
            raise UnsafeShardError(f"{name}: Parquet sidecar key prefix: {problem}")
        self._meta = meta
        self._rows_total: int = rows
        #: Per sample, its row in the file (``None``: sample ``i`` is row ``i``).
        self._rows: np.ndarray | None = kept
        self._fields: list[str] = fields
        self._codes = arrays["field"]
        self._sizes = arrays["size"]
        self._digests = arrays["image_xxh3"].tolist()
        self._labels = arrays.get("label")
        self._json_digests = arrays["json_xxh3"].tolist() if meta.get("json") else None
        self._extent = extent
        #: Rows stored as they are: each image's file offset (read by positioned reads, no pyarrow).
        self._offsets: np.ndarray | None = direct
        self._bytes: ShardBytes | None = None
        self._starts = np.concatenate([[0], np.cumsum(np.asarray(groups, dtype=np.int64))])
        self._footer = arrays["footer"].tobytes()
        self._plan = _Plan(
            str(meta.get("image")),
            bool(meta.get("struct")),
            False,
            meta.get("label"),
            tuple(map(str, meta.get("json") or ())),
            None,
        )

    # -- the file -----------------------------------------------------------------------

    def _ensure_open(self) -> Any:
        if self._pid == os.getpid() and self._file is not None:
            return self._file
        self.close()
        name = self.entry.name
        try:
            md = pq.read_metadata(pa.BufferReader(self._footer))
        except Exception as exc:
            raise CorruptShardError(f"{name}: Parquet footer in the sidecar is damaged ({exc})") from exc
        if md.num_rows != self._rows_total or md.num_row_groups != len(self._meta["row_groups"]):
            raise CorruptShardError(f"{name}: Parquet footer in the sidecar does not match the sidecar's rows")
        if self._source is not None:
            handle: Any = _SourceFile(self._source)
            size = self._source.size
        else:
            fd = open_regular_file(self.path, name)  # a FIFO or device in its place is refused
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            # Positioned reads, not a memory map: a file truncated while mapped would kill the
            # process with SIGBUS, where a short read is an error naming the file.
            handle = pa.OSFile(self.path)
            self._handle = handle
        if size != self.entry.num_bytes:
            raise CorruptShardError(
                f"{self.path}: shard {name} is {size} bytes, the manifest says {self.entry.num_bytes}"
            )
        _check_footer(md, size, name, [self._plan.image, *self._plan.json_columns])
        # Ranged reads: pyarrow coalesces the row group's column chunks into few requests.
        self._file = _open_parquet(handle, name, metadata=md, pre_buffer=self._source is not None)
        self._pid = os.getpid()
        return self._file

    def _row(self, index: int) -> int:
        """Sample ``index``'s row in the file."""
        return index if self._rows is None else int(self._rows[index])

    def _group_of(self, index: int) -> int:
        return int(np.searchsorted(self._starts, self._row(index), side="right")) - 1

    def _group(self, g: int) -> _Group:
        """Row group ``g`` decoded: its images' bytes and spans, its json texts."""
        kept = _CACHE.get((self._token, g)) if self._pid == os.getpid() else None
        if kept is not None:
            return kept
        pf = self._ensure_open()
        expected = int(self._starts[g + 1] - self._starts[g])
        direct = self._offsets is not None
        pages = None if direct or not self._fast else self._decode_pages(pf, g, expected)
        columns = list(self._plan.json_columns) if direct or pages is not None else _read_columns(self._plan)
        try:
            table = pf.read_row_group(g, columns=columns, use_threads=False) if columns else None
            if pages is not None:
                data, page, starts, ends = pages
            elif direct:  # the images are read from the file; spans here only count the rows
                count = expected if table is None else table.num_rows
                data, starts = [np.zeros(0, dtype=np.uint8)], np.zeros(count, dtype=np.int64)
                page, ends = np.zeros(count, dtype=np.int32), starts
            else:
                flat, offsets = _flat(_image_array(table, self._plan))
                data, page, starts, ends = [flat], np.zeros(len(offsets) - 1, np.int32), offsets[:-1], offsets[1:]
            texts = _json_texts(table, self._plan) if table is not None else None
        except Exception as exc:  # a damaged page: decompression or decoding fails
            raise CorruptShardError(
                f"{self.path}: shard {self.entry.name}, row group {g} cannot be read ({type(exc).__name__}: {exc})"
            ) from exc
        if len(starts) != expected or (table is not None and table.num_rows != expected):
            got = len(starts) if len(starts) != expected or table is None else table.num_rows
            raise CorruptShardError(
                f"{self.path}: shard {self.entry.name}, row group {g} holds {got} rows, expected {expected}"
            )
        group = (data, page, starts, ends, texts)
        _CACHE.put((self._token, g), group)
        return group

    def _decode_pages(
        self, pf: Any, g: int, rows: int
    ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray] | None:
        """Row group ``g``'s image spans decoded from the column chunk's pages (``None``: read it through pyarrow)."""
        md = pf.metadata
        leaf = _read_columns(self._plan)[0]
        rg = md.row_group(g)
        j = next((j for j in range(rg.num_columns) if rg.column(j).path_in_schema == leaf), None)
        if j is None:
            return None
        col = rg.column(j)
        start = col.data_page_offset
        if col.has_dictionary_page and col.dictionary_page_offset is not None and col.dictionary_page_offset > 0:
            start = min(start, col.dictionary_page_offset)
        size = int(col.total_compressed_size)
        schema = md.schema.column(j)
        try:
            if self._source is not None:
                chunk: Any = self._source.pread(size, int(start))
            else:  # pyarrow's read: into its memory pool, no fresh pages to fault in
                chunk = self._handle.read_at(size, int(start))
            if len(chunk) != size:
                return None  # a short file: pyarrow's read names it
            return decode_chunk(chunk, col, schema.max_definition_level, schema.max_repetition_level, rows)
        except Unsupported:
            self._fast = False  # the same for every row group of this file
            return None
        except Exception:  # a page that does not decode (or a failed read): pyarrow reads it, or names the damage
            return None

    # -- samples ------------------------------------------------------------------------

    def _key(self, index: int) -> str:
        return f"{self._meta['prefix']}/{self._row(index):010d}"

    def _label(self, index: int) -> bytes:
        """Row ``index``'s label from the sidecar, as ``cls`` bytes: not negative, below the dataset's classes."""
        assert self._labels is not None
        value = int(self._labels[index])
        classes = self.num_classes
        if value < 0 or (classes is not None and value >= classes):
            allowed = f"0..{classes - 1} (the dataset's {classes} classes)" if classes is not None else ">= 0"
            raise SampleError(
                f"{self.entry.name}: sample {self._key(index)!r}: label {value} in the sidecar is outside {allowed}"
            )
        return str(value).encode()

    def _source_bytes(self) -> ShardBytes:
        """The file's bytes for positioned reads (this process's own descriptor; ranged reads when streaming)."""
        if self._source is not None:
            return self._source
        if self._bytes is None or self._pid != os.getpid():
            if self._plan.json_columns:
                self._ensure_open()  # the footer checked: the json columns are read through pyarrow
            else:
                self.close()
                self._pid = os.getpid()  # images only: the sidecar's offsets were checked against the size
            fd = open_regular_file(self.path, self.entry.name)
            self._bytes = FileBytes(fd)
            if self._bytes.size != self.entry.num_bytes:
                raise CorruptShardError(
                    f"{self.path}: shard {self.entry.name} is {self._bytes.size} bytes, "
                    f"the manifest says {self.entry.num_bytes}"
                )
        return self._bytes

    def _went_on(self, first: int, last: int, g: int) -> None:
        """Rows ``first..last`` (in row group ``g`` from ``first``) are read next.

        After :data:`_IN_ORDER` rows read in row order (unshuffled), reaching a new row
        group drops this reader's row groups before it: a reader so holds its current row
        group only. A shuffle window's random order keeps the process's budget.
        """
        self._streak = self._streak + last - first + 1 if first == self._last_row + 1 else last - first + 1
        self._last_row = last
        if self._streak >= _IN_ORDER and g != self._current:
            self._current = g
            if self._pid == os.getpid():
                _CACHE.drop(self._token, below=g)

    def held_row_groups(self) -> list[int]:
        """The decoded row groups this reader holds now (what a read in order keeps: one)."""
        return _CACHE.held(self._token) if self._pid == os.getpid() else []

    def _image(self, index: int) -> tuple[int, np.ndarray]:
        """Row ``index``'s image bytes (a view into its row group), checked; and its row group."""
        g = self._group_of(index)
        row = self._row(index)
        self._went_on(row, row, g)
        if self._offsets is not None:
            size = int(self._sizes[index])
            raw = self._source_bytes().pread(size, int(self._offsets[index]))
            field = self._fields[int(self._codes[index])]
            self._check(g, index, field, raw if len(raw) == size else None, self._digests[index], size)
            return g, np.frombuffer(raw, dtype=np.uint8)
        for attempt in (0, 1):
            data, page, starts, ends, _ = self._group(g)
            r = row - int(self._starts[g])
            view = data[int(page[r])][int(starts[r]) : int(ends[r])]
            try:
                self._check(
                    g, index, self._fields[int(self._codes[index])], view, self._digests[index], int(self._sizes[index])
                )
            except CorruptShardError:
                if attempt or not self._retry_slow():
                    raise
                continue
            break
        return g, view

    def get(self, index: int) -> Sample:
        """Return row ``index`` as a sample, its bytes checked against the sidecar."""
        self._check_index(index)
        g, view = self._image(index)
        sample: Sample = {"__key__": self._key(index), self._fields[int(self._codes[index])]: view.tobytes()}
        if self._labels is not None:
            sample["cls"] = self._label(index)
        texts = self._group(g)[4]
        if texts is not None and self._json_digests is not None:
            text = texts[self._row(index) - int(self._starts[g])]
            self._check(g, index, "json", text, self._json_digests[index], len(text))
            sample["json"] = text
        return sample

    # -- batch reads (streamload.batch, BatchReads): sizes from the sidecar, bytes copied from the row groups --

    def _present(self, index: int, name: str) -> bool:
        if name == "cls":
            return self._labels is not None
        if name == "json":
            return self._json_digests is not None
        return name == self._fields[int(self._codes[index])]

    def _choice(self, index: int, fields: Sequence[str]) -> str:
        for name in fields:
            if self._present(index, name):
                return name
        raise SampleError(f"{self.entry.name}: sample {self._key(index)!r} has none of the fields {tuple(fields)}")

    def _value(self, index: int, name: str) -> Any:
        if name == "cls":
            return self._label(index)
        if name == "json":
            return self.get(index)["json"]
        return self._image(index)[1]

    def field_sizes(self, indices: np.ndarray, fields: Sequence[str]) -> np.ndarray:
        """Return the sizes of each sample's first present field of ``fields`` (images: from the sidecar)."""
        index = self._checked_indices(indices)
        if "json" not in fields and "cls" not in fields:
            self._image_rows(index, fields)
            out: np.ndarray = self._sizes[index]
            return out
        if tuple(fields) == ("cls",) and self._labels is not None:
            return np.fromiter(map(len, self._label_texts(index)), dtype=np.int64, count=len(index))
        out = np.empty(len(index), dtype=np.int64)
        for k, i in enumerate(index.tolist()):
            name = self._choice(i, fields)
            if name == "cls" or name == "json":
                out[k] = len(self._value(i, name))
            else:
                out[k] = int(self._sizes[i])
        return out

    def _checked_indices(self, indices: np.ndarray) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.entry.num_samples):
            bad = index[(index < 0) | (index >= self.entry.num_samples)]
            self._check_index(int(bad[0]))  # raises the reader's IndexError naming the sample
        return index

    def _image_rows(self, index: np.ndarray, fields: Sequence[str]) -> None:
        """Raise the ``SampleError`` of the first sample of ``index`` whose image field is not in ``fields``."""
        key = tuple(fields)
        wanted = self._wanted.get(key)
        if wanted is None:
            wanted = self._wanted[key] = np.array([f in fields for f in self._fields] + [False] * 256)[:256]
        ok = wanted[self._codes[index]]
        if not bool(ok.all()):
            self._choice(int(index[int(np.flatnonzero(~ok)[0])]), fields)

    def _label_texts(self, index: np.ndarray) -> list[bytes]:
        """The labels of samples ``index`` as ``cls`` bytes, each checked as :meth:`_label` does."""
        assert self._labels is not None
        values = self._labels[index]
        classes = self.num_classes
        bad = (values < 0) | (values >= classes) if classes is not None else values < 0
        if len(values) and bool(bad.any()):
            self._label(int(index[int(np.flatnonzero(bad)[0])]))  # raises, naming the sample
        return [str(v).encode() for v in values.tolist()]

    def read_groups_into(self, indices: np.ndarray, groups: Sequence[FieldGroup]) -> None:
        """Copy each group's fields of samples ``indices`` into the group's ``out``, each row checked.

        Rows stored as they are (``offset`` in the sidecar) are read like tar members: one
        ``preadv`` per run of rows close together in the file, the 4-byte lengths between
        them into a scratch buffer, each row's digest checked after. Other images are
        sliced from their decoded row groups (each decoded once per call at most, runs of
        consecutive rows copied at once) and checked after; labels come from the sidecar.
        """
        index = np.asarray(indices, dtype=np.int64)
        rows = index.tolist()
        for fields, out, sizes in groups:
            plain = "cls" not in fields and "json" not in fields
            if plain and rows and self._offsets is not None:
                self._read_direct(rows, fields, out, np.asarray(sizes, dtype=np.int64))
                continue
            if plain and rows:
                self._read_decoded(index, fields, out, np.asarray(sizes, dtype=np.int64))
                continue
            if tuple(fields) == ("cls",) and self._labels is not None and rows:
                text = b"".join(self._label_texts(index))
                if len(text) != int(np.sum(sizes)):
                    raise CorruptShardError(f"{self.entry.name}: labels changed size while read")
                out[: len(text)] = np.frombuffer(text, dtype=np.uint8)
                continue
            pos = 0
            for i, n in zip(rows, np.asarray(sizes).tolist(), strict=True):
                value = self._value(i, self._choice(i, fields))
                if len(value) != n:
                    raise CorruptShardError(f"{self.entry.name}: sample {self._key(i)!r} changed size while read")
                out[pos : pos + n] = np.frombuffer(value, dtype=np.uint8) if isinstance(value, bytes) else value
                pos += n

    def _read_decoded(self, index: np.ndarray, fields: Sequence[str], out: np.ndarray, sizes: np.ndarray) -> None:
        """Copy the images of samples ``index`` from their decoded row groups into ``out``, checked."""
        self._image_rows(index, fields)
        if not np.array_equal(self._sizes[index], sizes):
            raise CorruptShardError(f"{self.entry.name}: samples changed size while read")
        rows = index if self._rows is None else self._rows[index]
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        if len(rows) and (len(rows) == 1 or bool(np.all(np.diff(rows) == 1))):
            self._went_on(int(rows[0]), int(rows[-1]), int(groups[0]))
        else:
            self._streak = 0
        at = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(sizes, out=at[1:])
        try:
            self._copy_rows(index, rows, groups, out, at)
        except CorruptShardError:
            if not self._retry_slow():
                raise
            self._copy_rows(index, rows, groups, out, at)

    def _retry_slow(self) -> bool:
        """After a checksum failure of rows decoded from pages: read this file through pyarrow from now on.

        Returns whether a retry is worth it (the rows came from the page decoder).
        """
        if not self._fast or self._offsets is not None:
            return False
        self._fast = False
        _CACHE.drop(self._token)
        return True

    def _copy_rows(
        self, index: np.ndarray, rows: np.ndarray, groups: np.ndarray, out: np.ndarray, at: np.ndarray
    ) -> None:
        for g in np.unique(groups).tolist():
            data, page, starts, ends, _ = self._group(g)
            sel = np.flatnonzero(groups == g)
            local = rows[sel] - int(self._starts[g])
            lo, hi, where = starts[local], ends[local], page[local]
            wrong = np.flatnonzero(hi - lo != at[sel + 1] - at[sel])
            if len(wrong):
                bad = int(index[int(sel[int(wrong[0])])])
                self._check(g, bad, self._fields[int(self._codes[bad])], None, 0, 0)
            first, last = int(sel[0]), int(sel[-1])
            one = bool(np.all(where == where[0])) and bool(np.all(lo[1:] == hi[:-1]))
            if last - first + 1 == len(sel) and one:  # one run: one copy
                out[at[first] : at[last + 1]] = data[int(where[0])][int(lo[0]) : int(hi[-1])]
                continue
            if last - first + 1 == len(sel):  # together in the batch: one gather into place
                parts = [data[p][a:b] for p, a, b in zip(where.tolist(), lo.tolist(), hi.tolist(), strict=True)]
                np.concatenate(parts, out=out[at[first] : at[last + 1]])
                continue
            for k, p, a, b in zip(sel.tolist(), where.tolist(), lo.tolist(), hi.tolist(), strict=True):
                out[at[k] : at[k + 1]] = data[p][a:b]
        digest = xxhash.xxh3_64_intdigest
        view = out.data.cast("B")
        digests = self._digests
        for k, (i, a, b) in enumerate(zip(index.tolist(), at[:-1].tolist(), at[1:].tolist(), strict=True)):
            if digest(view[a:b]) != digests[i]:
                self._check(int(groups[k]), i, self._fields[int(self._codes[i])], None, 0, b - a)

    def _read_direct(self, rows: list[int], fields: Sequence[str], out: np.ndarray, sizes: np.ndarray) -> None:
        """Read the images of ``rows`` straight from the file into ``out`` (their sizes: ``sizes``), checked."""
        assert self._offsets is not None
        index = np.asarray(rows, dtype=np.int64)
        wanted = [k for k, f in enumerate(self._fields) if f in fields]
        missing = np.flatnonzero(~np.isin(self._codes[index], wanted))
        if len(missing):
            self._choice(rows[int(missing[0])], fields)  # raises the SampleError naming the sample
        if not np.array_equal(self._sizes[index], sizes):
            raise CorruptShardError(f"{self.entry.name}: samples changed size while read")
        starts = np.zeros(len(rows), dtype=np.int64)
        starts[1:] = np.cumsum(sizes[:-1])
        offs = self._offsets[index]
        order = np.argsort(offs, kind="stable")
        source = self._source_bytes()
        view = out.data.cast("B")
        scratch = self.__dict__.get("_scratch")
        if scratch is None:
            scratch = self.__dict__.setdefault("_scratch", memoryview(bytearray(MAX_GAP)))
        in_order = zip(offs[order].tolist(), sizes[order].tolist(), starts[order].tolist(), strict=True)
        segments = ((off, size, view[start:]) for off, size, start in in_order)
        gather(segments, scratch, lambda iov, offset, expected: self._preadv(source, iov, offset, expected))
        digest = xxhash.xxh3_64_intdigest
        for i, start, size in zip(rows, starts.tolist(), sizes.tolist(), strict=True):
            if digest(view[start : start + size]) != self._digests[i]:
                self._check(self._group_of(i), i, self._fields[int(self._codes[i])], None, 0, size)

    def _preadv(self, source: ShardBytes, iov: list[memoryview], offset: int, expected: int) -> None:
        got = source.preadv(iov, offset)
        if got != expected:
            raise CorruptShardError(
                f"{self.path}: shard {self.entry.name} is truncated at byte {offset + got} "
                f"(row group {self._group_of(self._row_at(offset))})"
            )

    def _row_at(self, offset: int) -> int:
        assert self._offsets is not None
        return max(0, int(np.searchsorted(self._offsets, offset, side="right")) - 1)

    def _check(self, group: int, index: int, field: str, data: Any, digest: int, size: int) -> None:
        if data is None or len(data) != size or xxhash.xxh3_64_intdigest(data) != digest:
            raise CorruptShardError(
                f"{self.path}: shard {self.entry.name}, row group {group}, row {self._row(index)} "
                f"(sample {self._key(index)!r}), field {field!r} does not match its checksum (corrupt bytes)"
            )

    def sample_extents(self, indices: np.ndarray) -> np.ndarray:
        """Return the ``[start, end)`` byte extents a read of samples ``indices`` needs (their row groups' chunks)."""
        index = np.asarray(indices, dtype=np.int64)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.entry.num_samples):
            raise IndexError(f"{self.entry.name}: sample indices out of range [0, {self.entry.num_samples})")
        if self._offsets is not None and not self._plan.json_columns:  # each row's own bytes
            starts = self._offsets[index]
            return np.stack([starts, starts + self._sizes[index]], axis=1)
        rows = index if self._rows is None else self._rows[index]
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        out: np.ndarray = self._extent[groups]
        return out

    def keys_of(self, indices: np.ndarray) -> list[str]:
        """Return the keys of samples ``indices`` (file stem and row; nothing is read)."""
        return [self._key(int(i)) for i in np.asarray(indices).tolist()]

    def catalog(self) -> tuple[list[str], list[int]]:
        """Return keys and image sizes from the sidecar (nothing is read from the file)."""
        n = self.entry.num_samples
        return [self._key(i) for i in range(n)], self._sizes.tolist()

    def iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        """Yield rows ``start..stop-1``, each row group decoded once."""
        for i in range(start, stop):
            yield self.get(i)

    def close(self, _getpid: Callable[[], int] = os.getpid, _cache: _GroupCache = _CACHE) -> None:
        """Drop the open file and the decoded row groups.

        What it calls is bound at definition: at interpreter exit this may run after the
        module's globals are gone.
        """
        source, handle, mine = self._bytes, self._handle, self._pid == _getpid()
        self._file, self._pid, self._bytes, self._handle = None, -1, None, None
        if mine:
            _cache.drop(self._token)
            if source is not None:
                source.close()
            if handle is not None:
                handle.close()


class _NoWriter(ShardWriter):
    """Parquet files are read in place, never written by streamload (convert writes tar, lmdb or hdf5)."""

    #: ``convert`` refuses a read-only format before it writes anything.
    read_only = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        raise ConfigError(
            "the parquet format is read in place (streamload index DIR --format parquet); "
            "convert writes tar, lmdb or hdf5 shards"
        )

    def write(self, sample: Any) -> None:  # pragma: no cover - never constructed
        raise NotImplementedError

    def finish(self) -> str | None:  # pragma: no cover - never constructed
        raise NotImplementedError


def _indexer(path: str, name: str, sidecar_out: str) -> tuple[int, list[str]]:
    found = index_parquet(path, name, sidecar_out)
    return found.num_samples, found.fields


#: For callers that index with chosen columns (``streamload index --image-column``...).
Indexer = Callable[[str, str, str, ParquetColumns], ParquetIndex]

FORMAT = Format(
    name="parquet",
    extension=".parquet",
    writer=_NoWriter,
    reader=ParquetShardReader,
    sidecar_suffix=SIDECAR_SUFFIX,
    indexer=_indexer,
    ranged=True,
)
