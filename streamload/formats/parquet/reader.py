"""The reader of a Parquet file: its rows as samples, every byte checked against the sidecar.

The sidecar (:mod:`.sidecar`) says what each row is; the row groups (:mod:`.rowgroups`)
hold the bytes, decoded; batch reads are in :mod:`.batch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from ..._errors import CorruptShardError, SampleError
from ...manifest import ShardEntry
from ..base import Sample, ShardBytes, ShardReader
from .batch import ParquetBatchReads
from .rowgroups import RowGroups
from .sidecar import Sidecar

__all__ = ["ParquetShardReader"]


class ParquetShardReader(ParquetBatchReads, ShardReader):
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
        sc = self._sc = Sidecar.load(sidecar_path, entry)
        self._rg = RowGroups(path, entry, sc, source)
        # the sidecar's tables, as the hot paths read them
        self._rows, self._fields, self._codes, self._sizes = sc.rows, sc.fields, sc.codes, sc.sizes
        self._digests, self._labels, self._json_digests = sc.digests, sc.labels, sc.json_digests
        self._offsets, self._starts, self._extent = sc.offsets, sc.starts, sc.extent
        self._wanted: dict[tuple[str, ...], np.ndarray] = {}  # per field list: which image fields it takes

    # -- samples ------------------------------------------------------------------------

    def _key(self, index: int) -> str:
        return self._sc.key(index)

    def _row(self, index: int) -> int:
        """Sample ``index``'s row in the file."""
        return index if self._rows is None else int(self._rows[index])

    def _group_of(self, index: int) -> int:
        return int(np.searchsorted(self._starts, self._row(index), side="right")) - 1

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

    def _image(self, index: int) -> tuple[int, np.ndarray]:
        """Row ``index``'s image bytes (a view into its row group), checked; and its row group."""
        g = self._group_of(index)
        row = self._row(index)
        self._rg.went_on(row, row, g)
        if self._offsets is not None:
            size = int(self._sizes[index])
            raw = self._rg.source_bytes().pread(size, int(self._offsets[index]))
            field = self._fields[int(self._codes[index])]
            self._check(g, index, field, raw if len(raw) == size else None, self._digests[index], size)
            return g, np.frombuffer(raw, dtype=np.uint8)
        r = row - int(self._starts[g])
        for attempt in (0, 1):
            data, page, starts, ends, _ = self._rg.rows(g, np.array([r]))
            view = data[int(page[r])][int(starts[r]) : int(ends[r])]
            try:
                self._check(
                    g, index, self._fields[int(self._codes[index])], view, self._digests[index], int(self._sizes[index])
                )
            except CorruptShardError:
                if attempt or not self._rg.retry_slow():
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
        texts = self._rg.group(g)[4] if self._json_digests is not None else None
        if texts is not None and self._json_digests is not None:
            text = texts[self._row(index) - int(self._starts[g])]
            self._check(g, index, "json", text, self._json_digests[index], len(text))
            sample["json"] = text
        return sample

    # -- fields (for batch reads: .batch) ------------------------------------------------

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
        if self._offsets is not None and not self._sc.plan.json_columns:  # each row's own bytes
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

    def held_row_groups(self) -> list[int]:
        """The decoded row groups this reader holds now (what a read in order keeps: one)."""
        return self._rg.held()

    def close(self) -> None:
        """Drop the open file and the decoded row groups, and close the bytes it was given (``source``)."""
        rg = getattr(self, "_rg", None)  # None: the sidecar was refused
        if rg is not None:
            rg.close()
            source, rg.source = rg.source, None
            if source is not None:  # a download read early waits here until cached, as tar's does
                source.close()
