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

#: Bytes of CSV or JSONL read per block (a block ends at the first line end after this many).
TEXT_BLOCK_BYTES = 1 << 20
#: Rows decoded at a time from a Parquet row group.
PARQUET_BATCH_ROWS = 16384

# The two sizes above are read when a TableSource is made (tests make them small).
from .kinds import KINDS, TABLE_EXTENSIONS, is_table  # noqa: E402
from .source import NOMINAL_IMAGE_BYTES, TableSource  # noqa: E402
from .spans import RowList, RowSpan, TableItem, TablePlan  # noqa: E402

__all__ = [
    "KINDS",
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
