"""A Parquet file's row groups, decoded for a reader: this process's handles, the cache, the order read.

Rows stored as they are (meta ``direct``) are read by positioned reads
(:meth:`RowGroups.source_bytes`); otherwise only the columns the sample model needs
(``image.bytes`` of a struct, the json columns), one row group at a time: the image chunk
read once and its pages decoded by :mod:`.pages` (each row a slice of its page or
dictionary entry; pyarrow where that decoder does not apply, and for the json columns).
Decoded row groups go to the process's :data:`~streamload.formats.table_cache.CACHE`; a
reader reading in row order drops those behind it.

The open handles belong to the process that opened them
(:class:`~streamload._fork.ProcessLocal`): a forked worker opens its own.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..._errors import CorruptShardError
from ..._fork import ProcessLocal
from ...manifest import ShardEntry
from ...storage.bytes import FileBytes
from .._record import open_regular_file
from ..base import ShardBytes
from ..table_cache import CACHE, Group, RowGroupCache
from .footer import SourceFile, check_footer, chunk_start, open_parquet
from .pages import HEADER_PROBE, ChunkPages, Unsupported, decode_chunk
from .schema import flat, image_array, json_texts, read_columns
from .sidecar import Sidecar

__all__ = ["IN_ORDER", "RowGroups"]

#: Rows read one after another in row order after which a reader drops the row groups before.
IN_ORDER = 8
_READERS = itertools.count()


class _Handles:
    """One process's open handles on a file: pyarrow's (and its file), a descriptor for positioned reads."""

    __slots__ = ("bytes", "file", "handle")

    def __init__(self) -> None:
        self.file: Any = None  # the pyarrow ParquetFile
        self.handle: Any = None  # the local file pyarrow reads (pa.OSFile)
        self.bytes: ShardBytes | None = None  # positioned reads of the local file

    def close(self) -> None:
        source, handle = self.bytes, self.handle
        self.file = self.handle = self.bytes = None
        if source is not None:
            source.close()
        if handle is not None:
            handle.close()


class RowGroups:
    """The row groups of one Parquet file for one reader.

    Args:
        path: The local file, or its URL when ``source`` reads by ranges.
        entry: Its manifest entry.
        sidecar: Its checked sidecar.
        source: Ranged reads of the file (streaming mode); ``None``: open ``path``.
    """

    def __init__(self, path: str, entry: ShardEntry, sidecar: Sidecar, source: ShardBytes | None) -> None:
        self.path, self.entry, self.sidecar, self.source = path, entry, sidecar, source
        self._local: ProcessLocal[_Handles] = ProcessLocal(_Handles, _Handles.close)
        self.token = next(_READERS)  # this reader's row groups in the process's cache
        self._current = -1  # the row group reads in row order are in (older ones are dropped)
        #: Image chunks decoded from their pages (False: through pyarrow).
        self.fast = True
        self._last_row = -2
        self._streak = 0  # rows read in row order up to _last_row
        #: Per row group read page by page: its page directory (None: read whole).
        self._chunks: dict[int, ChunkPages | None] = {}
        self._sequential = False  # the latest read went on where the one before ended
        self._leaf_index = -1  # the image column's index among the leaves

    def open_file(self) -> Any:
        """This process's pyarrow ``ParquetFile``, over the sidecar's footer (checked against the file)."""
        handles = self._local.get()
        if handles.file is not None:
            return handles.file
        name, sidecar = self.entry.name, self.sidecar
        try:
            md = pq.read_metadata(pa.BufferReader(sidecar.footer))
        except Exception as exc:
            raise CorruptShardError(f"{name}: Parquet footer in the sidecar is damaged ({exc})") from exc
        if md.num_rows != sidecar.rows_total or md.num_row_groups != len(sidecar.meta["row_groups"]):
            raise CorruptShardError(f"{name}: Parquet footer in the sidecar does not match the sidecar's rows")
        if self.source is not None:
            handle: Any = SourceFile(self.source)
            size = self.source.size
        else:
            fd = open_regular_file(self.path, name)  # a FIFO or device in its place is refused
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            # Positioned reads, not a memory map: a file truncated while mapped would kill the
            # process with SIGBUS, where a short read is an error naming the file.
            handle = handles.handle = pa.OSFile(self.path)
        if size != self.entry.num_bytes:
            raise CorruptShardError(
                f"{self.path}: shard {name} is {size} bytes, the manifest says {self.entry.num_bytes}"
            )
        check_footer(md, size, name, [sidecar.plan.image, *sidecar.plan.json_columns])
        # Ranged reads: pyarrow coalesces the row group's column chunks into few requests.
        handles.file = open_parquet(handle, name, metadata=md, pre_buffer=self.source is not None)
        return handles.file

    def source_bytes(self) -> ShardBytes:
        """The file's bytes for positioned reads (this process's own descriptor; ranged reads when streaming)."""
        if self.source is not None:
            return self.source
        handles = self._local.get()
        if handles.bytes is None:
            if self.sidecar.plan.json_columns:
                self.open_file()  # the footer checked: the json columns are read through pyarrow
            # (images only: the sidecar's offsets were checked against the size)
            handles.bytes = FileBytes(open_regular_file(self.path, self.entry.name))
            if handles.bytes.size != self.entry.num_bytes:
                raise CorruptShardError(
                    f"{self.path}: shard {self.entry.name} is {handles.bytes.size} bytes, "
                    f"the manifest says {self.entry.num_bytes}"
                )
        return handles.bytes

    def group(self, g: int) -> Group:
        """Row group ``g`` decoded: its images' bytes and spans, its json texts."""
        kept = CACHE.get((self.token, g))
        if kept is not None and bool(np.all(kept[1] >= 0)):
            return kept
        if kept is not None and self._paged(g):  # partly decoded page by page: the rest likewise
            return self.rows(g, np.arange(int(self.sidecar.starts[g + 1] - self.sidecar.starts[g])))
        pf = self.open_file()
        sidecar = self.sidecar
        expected = int(sidecar.starts[g + 1] - sidecar.starts[g])
        direct = sidecar.offsets is not None
        pages = None if direct or not self.fast else self._decode_pages(pf, g, expected)
        columns = list(sidecar.plan.json_columns) if direct or pages is not None else read_columns(sidecar.plan)
        try:
            table = pf.read_row_group(g, columns=columns, use_threads=False) if columns else None
            if pages is not None:
                data, page, starts, ends = pages
            elif direct:  # the images are read from the file; spans here only count the rows
                count = expected if table is None else table.num_rows
                data, starts = [np.zeros(0, dtype=np.uint8)], np.zeros(count, dtype=np.int64)
                page, ends = np.zeros(count, dtype=np.int32), starts
            else:
                values, offsets = flat(image_array(table, sidecar.plan))
                data, page, starts, ends = [values], np.zeros(len(offsets) - 1, np.int32), offsets[:-1], offsets[1:]
            texts = json_texts(table, sidecar.plan) if table is not None else None
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
        CACHE.put((self.token, g), group)
        return group

    def rows(self, g: int, local: np.ndarray) -> Group:
        """Row group ``g`` with at least its rows ``local`` (positions in it) decoded.

        A local file's image chunk is decoded page by page: the pages holding ``local``,
        and the dictionary page if they need it. DataLoader workers take turns with the
        batches, and a row group spans several, so each worker decodes the pages of its
        own rows, not the whole row group. A read that goes on where the last one ended
        takes a new row group whole, in one read. Elsewhere (streaming, json columns, a
        page this decoder does not read) the whole row group is decoded (:meth:`group`).
        """
        key = (self.token, g)
        kept = CACHE.get(key)
        if kept is not None and bool(np.all(kept[1][local] >= 0)):
            return kept
        if not self._paged(g) or (kept is None and self._sequential):  # in order: the whole chunk, one read
            return self.group(g)
        col = self._image_chunk(self.open_file(), g)
        handle = self._local.get().handle
        try:
            if col is None:
                raise Unsupported("no image column chunk")
            start = chunk_start(col)
            pages = self._directory(g, lambda n, at: memoryview(handle.read_at(n, start + at)))
            group: Group = kept if kept is not None else (*pages.empty(), None)
            missing = local[group[1][local] < 0]
            pages.decode(group[:4], pages.pages_of(missing), lambda p: handle.read_at(p.stored, start + p.at))
        except Unsupported:
            self.fast = False  # the same for every row group of this file
            CACHE.discard(key)
            return self.group(g)
        except Exception:  # noqa: BLE001 - a page that does not decode: the whole row group's way names it
            CACHE.discard(key)
            self._chunks[g] = None
            return self.group(g)
        CACHE.put(key, group)  # (again: its decoded bytes grew)
        return group

    def _paged(self, g: int) -> bool:
        """Whether row group ``g`` is decoded page by page (a local file's image chunk, read by this decoder)."""
        plan = self.sidecar.plan
        return (
            self.fast
            and self.source is None
            and self.sidecar.offsets is None
            and not plan.json_columns
            and self._chunks.get(g, True) is not None
        )

    def _directory(self, g: int, read: Any) -> ChunkPages:
        """Row group ``g``'s page directory (walked once, through ``read(n, offset)`` of its chunk)."""
        known = self._chunks.get(g)
        if known is not None:
            return known
        pf = self.open_file()
        col = self._image_chunk(pf, g)
        if col is None:
            raise Unsupported("no image column chunk")
        schema = pf.metadata.schema.column(self._leaf_index)
        rows = int(self.sidecar.starts[g + 1] - self.sidecar.starts[g])
        pages = ChunkPages(read, col, schema.max_definition_level, schema.max_repetition_level, rows, HEADER_PROBE)
        self._chunks[g] = pages
        return pages

    def _image_chunk(self, pf: Any, g: int) -> Any:
        """Row group ``g``'s image column chunk (footer metadata), or ``None``."""
        rg = pf.metadata.row_group(g)
        if self._leaf_index < 0:
            leaf = read_columns(self.sidecar.plan)[0]
            self._leaf_index = next((j for j in range(rg.num_columns) if rg.column(j).path_in_schema == leaf), -1)
            if self._leaf_index < 0:
                return None
        return rg.column(self._leaf_index) if self._leaf_index < rg.num_columns else None

    def _decode_pages(
        self, pf: Any, g: int, rows: int
    ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray] | None:
        """Row group ``g``'s image spans decoded from the column chunk's pages (``None``: read it through pyarrow)."""
        col = self._image_chunk(pf, g)
        if col is None:
            return None
        md = pf.metadata
        j = self._leaf_index
        start = chunk_start(col)
        size = int(col.total_compressed_size)
        schema = md.schema.column(j)
        try:
            if self.source is not None:
                chunk: Any = self.source.pread(size, start)
            else:  # pyarrow's read: into its memory pool, no fresh pages to fault in
                chunk = self._local.get().handle.read_at(size, start)
            if len(chunk) != size:
                return None  # a short file: pyarrow's read names it
            return decode_chunk(chunk, col, schema.max_definition_level, schema.max_repetition_level, rows)
        except Unsupported:
            self.fast = False  # the same for every row group of this file
            return None
        except Exception:  # a page that does not decode (or a failed read): pyarrow reads it, or names the damage
            return None

    def went_on(self, first: int, last: int, g: int) -> None:
        """Rows ``first..last`` (in row group ``g`` from ``first``) are read next.

        After :data:`IN_ORDER` rows read in row order (unshuffled), reaching a new row
        group drops this reader's row groups before it: a reader so holds its current row
        group only. A shuffle window's random order keeps the process's budget.
        """
        self._sequential = first == self._last_row + 1
        self._streak = self._streak + last - first + 1 if self._sequential else last - first + 1
        self._last_row = last
        if self._streak >= IN_ORDER and g != self._current:
            self._current = g
            CACHE.drop(self.token, below=g)

    def out_of_order(self) -> None:
        """The rows read next are not in row order."""
        self._streak = 0
        self._sequential = False

    def held(self) -> list[int]:
        """The decoded row groups this reader holds now."""
        return CACHE.held(self.token)

    def retry_slow(self) -> bool:
        """After a checksum failure of rows decoded from pages: read this file through pyarrow from now on.

        Returns whether a retry is worth it (the rows came from the page decoder).
        """
        if not self.fast or self.sidecar.offsets is not None:
            return False
        self.fast = False
        CACHE.drop(self.token)
        return True

    def close(self, _cache: RowGroupCache = CACHE) -> None:
        """Close this process's handles and drop the decoded row groups.

        What it calls is bound at definition: at interpreter exit this may run after the
        module's globals are gone.
        """
        self._local.clear()
        _cache.drop(self.token)
