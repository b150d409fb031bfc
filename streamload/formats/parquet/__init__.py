"""Parquet image tables read in place: one file is one shard, a row group the read unit.

Hugging Face datasets, Spark/Databricks exports and LAION-style sets keep images in Parquet:
an image column (a Hugging Face ``Image`` struct ``{bytes, path}``, or a plain binary
column), an optional label column (integers, a Hugging Face ``ClassLabel``'s names becoming
the dataset's classes; or strings, class names sorted and numbered over all the files as
``convert`` does) and other columns. ``streamload index DIR --format parquet`` reads
every file once and writes, beside each, a sidecar ``<file>.slpq`` (see below) and then
``index.json``; the files themselves are never rewritten.

**Sample model** (:mod:`.schema`; the same mapping ``convert`` gives such a table): row ``r`` of
``train-00000.parquet`` is ``{"__key__": "train-00000/0000000012", <img>: bytes, "cls":
b"3", "json": b"{...}"}``, where ``<img>`` is the image's extension (from the struct's
``path`` when it names an image file, else sniffed from the bytes: ``jpg``, ``png``,
``webp``...), ``cls`` the label in ASCII decimal (only with a label column) and ``json``
every other column of the row (``json.dumps(..., sort_keys=True, default=str)``; only if
there are other columns).

**Sidecar** (:mod:`.sidecar`; an uncompressed ``.npz`` read with ``allow_pickle=False``; its manifest hash
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

**Reads** (:mod:`.rowgroups`, :mod:`.batch`). Rows stored as they are (an uncompressed,
PLAIN, dictionary-free image chunk, as Hugging Face ``datasets`` writes images: each
value a 4-byte length and the bytes) are located at index time and read by positioned
reads like tar members (``offset``), no pyarrow involved. Otherwise only the columns the
sample model needs (``image.bytes`` of a struct, the json columns; never the label
column nor the struct's ``path``), one row group at a time: the image chunk read once
and its pages decoded by :mod:`.pages` (each row a slice of its page or dictionary
entry; pyarrow where that decoder does not apply, and for the json columns). A reader
reading in row order keeps only its current row groups; shuffled reads keep the decoded
row groups per process up to a budget (:mod:`~streamload.formats.table_cache`:
:func:`set_row_group_cache_bytes`, 1 GiB unless ``STREAMLOAD_PARQUET_CACHE`` says
otherwise). Through ``cache="shards"`` the reader opens the cached file; through
``cache="none"`` it reads by ranged GETs (:class:`~streamload.formats.base.ShardBytes`),
the row groups' extents fetched ahead like tar samples'.

**Bounds** (hostile or broken files, :mod:`.footer`): the footer's size and its Thrift
containers are bounded; every column chunk must lie inside the file; the column chunks
one row-group read decompresses are bounded (:data:`MAX_ROW_GROUP_BYTES`, at most
:data:`MAX_EXPANSION` times their stored size: a decompression bomb is refused before it
is read; the pages decoded here may not decompress past their chunk's declared size);
the decoded row group must hold exactly the rows the footer declared.
"""

from __future__ import annotations

from ..base import Format, TableIndexing
from ..table_cache import ROW_GROUP_CACHE_BYTES, set_row_group_cache_bytes
from .footer import MAX_EXPANSION, MAX_ROW_GROUP_BYTES
from .index import ParquetIndex, index_parquet, index_table
from .reader import ParquetShardReader
from .schema import ParquetColumns, class_label_names
from .sidecar import SIDECAR_SUFFIX, relabel_sidecar

__all__ = [
    "FORMAT",
    "MAX_EXPANSION",
    "MAX_ROW_GROUP_BYTES",
    "ROW_GROUP_CACHE_BYTES",
    "SIDECAR_SUFFIX",
    "ParquetColumns",
    "ParquetIndex",
    "ParquetShardReader",
    "class_label_names",
    "index_parquet",
    "relabel_sidecar",
    "set_row_group_cache_bytes",
]

#: Parquet files are read in place, never written (``convert`` writes tar, lmdb or hdf5).
FORMAT = Format(
    name="parquet",
    extension=".parquet",
    reader=ParquetShardReader,
    sidecar_suffix=SIDECAR_SUFFIX,
    ranged=True,
    tables=TableIndexing(kind="Parquet", index=index_table, relabel=relabel_sidecar),
)
