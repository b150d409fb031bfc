"""Batch reads of a Parquet file (:class:`~streamload.formats.base.BatchReads`): sizes from the sidecar, bytes copied.

Rows stored as they are (``offset`` in the sidecar) are read like tar members: one
``preadv`` per run of rows close together in the file, the 4-byte lengths between them
into a scratch buffer, each row's digest checked after. Other images are sliced from their
decoded row groups (each decoded once per call at most, runs of consecutive rows copied at
once) and checked after; labels come from the sidecar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ..._errors import CorruptShardError
from ...storage.bytes import MAX_GAP, gather
from ..base import FieldGroup, ShardBytes
from .rowgroups import RowGroups

if TYPE_CHECKING:
    from ...manifest import ShardEntry

__all__ = ["ParquetBatchReads"]


class ParquetBatchReads:
    """The batch reads of :class:`~.reader.ParquetShardReader` (its sample reads are there)."""

    if TYPE_CHECKING:  # what the reader holds and does
        entry: ShardEntry
        path: str
        num_classes: int | None
        _rg: RowGroups
        _fields: list[str]
        _codes: np.ndarray
        _sizes: np.ndarray
        _digests: list[int]
        _labels: np.ndarray | None
        _offsets: np.ndarray | None
        _rows: np.ndarray | None
        _starts: np.ndarray
        _wanted: dict[tuple[str, ...], np.ndarray]

        def _check_index(self, index: int) -> None: ...
        def _check(self, group: int, index: int, field: str, data: Any, digest: int, size: int) -> None: ...
        def _choice(self, index: int, fields: Sequence[str]) -> str: ...
        def _value(self, index: int, name: str) -> Any: ...
        def _label(self, index: int) -> bytes: ...
        def _group_of(self, index: int) -> int: ...
        def _key(self, index: int) -> str: ...

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
        values = self.label_values(index, "cls")
        assert values is not None
        return [str(v).encode() for v in values.tolist()]

    def label_values(self, indices: np.ndarray, field: str) -> np.ndarray | None:
        """Return the sidecar's labels of samples ``indices`` (``field`` ``cls``), checked; ``None`` for others."""
        if field != "cls" or self._labels is None:
            return None
        index = self._checked_indices(indices)
        values: np.ndarray = self._labels[index]
        classes = self.num_classes
        bad = (values < 0) | (values >= classes) if classes is not None else values < 0
        if len(values) and bool(bad.any()):
            self._label(int(index[int(np.flatnonzero(bad)[0])]))  # raises, naming the sample
        return values

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
            self._rg.went_on(int(rows[0]), int(rows[-1]), int(groups[0]))
        else:
            self._rg.out_of_order()
        at = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(sizes, out=at[1:])
        try:
            self._copy_rows(index, rows, groups, out, at)
        except CorruptShardError:
            if not self._rg.retry_slow():
                raise
            self._copy_rows(index, rows, groups, out, at)

    def _copy_rows(
        self, index: np.ndarray, rows: np.ndarray, groups: np.ndarray, out: np.ndarray, at: np.ndarray
    ) -> None:
        for g in np.unique(groups).tolist():
            sel = np.flatnonzero(groups == g)
            local = rows[sel] - int(self._starts[g])
            data, page, starts, ends, _ = self._rg.rows(g, local)
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
        source = self._rg.source_bytes()
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
