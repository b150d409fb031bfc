"""Whole batches made in the DataLoader worker, crossing to the main process as tensors.

A DataLoader worker hands its output to the main process through a queue. ``bytes``
objects are pickled, piped and unpickled (three copies, one Python object per sample,
all on the main process's single core); a tensor crosses as a shared-memory file
descriptor and is never copied. So a batch of encoded samples travels best as one
``uint8`` tensor holding every sample back to back plus an ``int64`` offsets tensor:
:class:`RawBatch`. Decoded images travel as one ``uint8`` tensor of the whole batch:
:class:`ImageBatch` (see :class:`streamload.decode.DecodeBatch`).

The batch is made inside the worker, by the dataset, so the DataLoader must not batch
again::

    ds = StreamingDataset(url, batch_size=256, collate=RawCollate())
    loader = DataLoader(ds, batch_size=None, num_workers=8, pin_memory=True)
    for batch in loader:                # RawBatch(data, offsets, labels, keys)
        jpegs = batch.samples()         # list of uint8 views, e.g. for nvjpeg decoding

Stream shape in the worker, per batch of ``B`` samples::

    plan runs of the batch (shard, local indices)    -- cut at batch boundaries
    sizes      int64[B]     from the format's index (tar: the sidecar), no data read
    data       uint8[sum]   allocated once, in shared memory when inside a worker
    read       one os.preadv per sample straight into data[offsets[i]:offsets[i+1]]
    labels     int64[B]     parsed from the label field

Formats that cannot give sizes without reading fall back to reading the sample dicts
and copying each field once into the buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast, overload, runtime_checkable

import numpy as np
import torch

from ._batchmem import Lease, Message, Spec, allocate, pack, unpack
from ._errors import ConfigError, SampleError
from ._pread import gather_all
from .formats.base import BatchReads, FieldGroup, GatherPlans, IntegerLabels, PlacedGroup, PlacedReads, ShardReader
from .labels import parse_labels
from .sample import IMAGE_FIELDS, Sample, label_of

__all__ = [
    "BatchCollate",
    "BatchReader",
    "ImageBatch",
    "RawBatch",
    "RawCollate",
    "batch_buffer",
    "batch_tensors",
    "in_worker",
    "serves_batches",
    "wants_places",
]

#: A batch's reads: ``(shard, local indices)``, in batch order.
Parts = Sequence[tuple[int, np.ndarray]]


class RawBatch:
    """Encoded samples of one batch, back to back in one tensor.

    Sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``. The DataLoader passes it through
    untouched (``default_convert``) and pins it with :meth:`pin_memory`.

    Attributes:
        data: ``uint8[total_bytes]``, the samples' field bytes concatenated.
        offsets: ``int64[B + 1]``, ``offsets[0] == 0`` and ``offsets[B] == len(data)``.
        labels: ``int64[B]`` labels, or ``None`` if no label field was asked for.
        keys: The samples' keys if asked for (these few strings are pickled), else ``None``.
        places: ``int64[B, 2]``: each sample's ``(epoch, position)`` in the epoch's padded
            sequence (its ``"__epoch__"``/``"__position__"``, the key of its random crop
            and flip, :func:`streamload.sample_generator`), or ``None`` when unknown
            (``RawCollate(places=False)``, or samples not read by a dataset).
    """

    __slots__ = ("_lease", "data", "keys", "labels", "offsets", "places")

    def __init__(
        self,
        data: torch.Tensor,
        offsets: torch.Tensor,
        labels: torch.Tensor | None = None,
        keys: tuple[str, ...] | None = None,
        lease: Lease | None = None,
        places: torch.Tensor | None = None,
    ) -> None:
        self.data = data
        self.offsets = offsets
        self.labels = labels
        self.keys = keys
        self._lease = lease
        self.places = places

    @property
    def batch_size(self) -> int:
        """Number of samples in the batch."""
        return int(self.offsets.shape[0]) - 1

    def __len__(self) -> int:
        return self.batch_size

    def sample(self, i: int) -> torch.Tensor:
        """Return sample ``i`` as a ``uint8`` view into :attr:`data` (no copy)."""
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def samples(self) -> list[torch.Tensor]:
        """Return every sample as a ``uint8`` view (e.g. for ``torchvision.io.decode_jpeg``)."""
        bounds = self.offsets.tolist()
        return [self.data[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def tobytes(self, i: int) -> bytes:
        """Return sample ``i`` as ``bytes`` (one copy)."""
        return bytes(self.sample(i).numpy())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RawBatch:
        """Return the batch with its tensors on ``device``."""
        data, offsets, labels = _map_tensors(
            (self.data, self.offsets, self.labels), lambda t: t.to(device, non_blocking=non_blocking)
        )
        assert data is not None and offsets is not None
        return RawBatch(data, offsets, labels, self.keys, places=self.places)

    def pin_memory(self, device: Any = None) -> RawBatch:
        """Return a copy in page-locked memory (what ``DataLoader(pin_memory=True)`` calls)."""
        data, offsets, labels = _map_tensors((self.data, self.offsets, self.labels), lambda t: t.pin_memory())
        assert data is not None and offsets is not None
        return RawBatch(data, offsets, labels, self.keys, places=self.places)

    def __reduce__(self) -> tuple[Any, ...]:
        lease = self._lease
        if lease is not None and lease.here():  # a worker sending its batch: a few integers
            message, specs = pack((self.data, self.offsets, self.labels, self.places), lease)
            return (_rebuild_raw, (message, specs, self.keys))
        return (RawBatch, (self.data, self.offsets, self.labels, self.keys, None, self.places))

    def __repr__(self) -> str:
        return f"RawBatch(batch_size={self.batch_size}, bytes={self.data.numel()}, labels={self.labels is not None})"


class ImageBatch:
    """Decoded images of one batch; a pair like ``(images, labels)``.

    ``images, labels = batch`` unpacks it and ``batch[0]`` / ``batch[1]`` (or ``batch[-1]``,
    ``batch[:]``) index it the same way, so code written for a DataLoader's
    ``(images, labels)`` tuples works unchanged. ``len(batch)`` is the number of images.

    Attributes:
        images: ``uint8`` ``[B, 3, H, W]`` (a channels-last view of one ``[B, H, W, 3]``
            buffer) or ``[B, H, W, 3]``, as the decoder's ``layout`` says.
        labels: ``int64[B]``, or ``None`` if no label field was asked for.
    """

    __slots__ = ("_lease", "images", "labels")

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | None, lease: Lease | None = None) -> None:
        self.images = images
        self.labels = labels
        self._lease = lease

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter((self.images, self.labels))

    @overload
    def __getitem__(self, index: int) -> torch.Tensor | None: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[torch.Tensor | None, ...]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | None | tuple[torch.Tensor | None, ...]:
        """Return ``images`` (``0``) or ``labels`` (``1``), as unpacking gives them; a slice gives a tuple.

        Raises:
            IndexError: If ``index`` is not 0, 1, -1 or -2.
            TypeError: If ``index`` is not an integer or a slice.
        """
        pair = (self.images, self.labels)
        if isinstance(index, slice):
            return pair[index]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"an ImageBatch is the pair (images, labels): index it with 0 or 1, not {index!r}")
        if not -2 <= index < 2:
            raise IndexError(
                f"an ImageBatch is the pair (images, labels): index {index} is out of range (use 0 or 1; "
                "batch.images[i] is image i)"
            )
        return pair[int(index)]

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ImageBatch:
        """Return the batch with its tensors on ``device``."""
        images, labels = _map_tensors((self.images, self.labels), lambda t: t.to(device, non_blocking=non_blocking))
        assert images is not None
        return ImageBatch(images, labels)

    def pin_memory(self, device: Any = None) -> ImageBatch:
        """Return a copy in page-locked memory (what ``DataLoader(pin_memory=True)`` calls)."""
        images, labels = _map_tensors((self.images, self.labels), lambda t: t.pin_memory())
        assert images is not None
        return ImageBatch(images, labels)

    def __reduce__(self) -> tuple[Any, ...]:
        lease = self._lease
        if lease is not None and lease.here():  # a worker sending its batch: a few integers
            message, specs = pack((self.images, self.labels), lease)
            return (_rebuild_images, (message, specs))
        return (ImageBatch, (self.images, self.labels))

    def __repr__(self) -> str:
        return f"ImageBatch(images={tuple(self.images.shape)}, labels={self.labels is not None})"


def _map_tensors(
    tensors: tuple[torch.Tensor | None, ...], fn: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor | None]:
    return [None if t is None else fn(t) for t in tensors]


# -- batch memory ----------------------------------------------------------------------
#
# Every tensor of a batch lives in one recycled buffer; inside a DataLoader worker that is
# a shared-memory segment of the worker's pool, and the batch crosses to the main process
# as a few integers once the segment has been sent (see streamload._batchmem).


def _rebuild_raw(message: Message, specs: list[Spec | None], keys: tuple[str, ...] | None) -> RawBatch:
    data, offsets, labels, places = unpack(message, specs)
    assert data is not None and offsets is not None
    return RawBatch(data, offsets, labels, keys, places=places)


def _rebuild_images(message: Message, specs: list[Spec | None]) -> ImageBatch:
    images, labels = unpack(message, specs)
    assert images is not None
    return ImageBatch(images, labels)


def in_worker() -> bool:
    """Return True inside a DataLoader worker process."""
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


def batch_buffer(shape: int | Sequence[int], shared: bool | None = None) -> tuple[torch.Tensor, Lease | None]:
    """Return an uninitialised ``uint8`` tensor of ``shape`` for a batch, and its lease.

    Inside a DataLoader worker (``shared=None`` detects it) the tensor lives in one of the
    worker's recycled shared-memory segments, so sending it to the main process copies
    nothing and, once the segment is warm, faults in no pages and passes no file
    descriptor. Pass the lease to :class:`RawBatch` / :class:`ImageBatch`. Elsewhere it
    is ordinary recycled memory and the lease is ``None``. :func:`batch_tensors` puts
    several tensors (data, offsets, labels) in one buffer.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    (tensor,), lease = allocate([(dims, torch.uint8)], shared)
    return tensor, lease


def batch_tensors(
    parts: Sequence[tuple[Sequence[int], torch.dtype]], shared: bool | None = None
) -> tuple[list[torch.Tensor], Lease | None]:
    """Return uninitialised tensors of the given shapes and dtypes, all in one batch buffer, and its lease.

    See :func:`batch_buffer`; a batch whose tensors share one buffer crosses to the main
    process as one small message.
    """
    return allocate(parts, shared)


class BatchCollate(Protocol):
    """What ``StreamingDataset(collate=...)`` accepts: a function of the batch's samples."""

    def __call__(self, samples: list[Any]) -> Any:
        """Make one batch from the samples (dicts, or the transform's outputs)."""


@runtime_checkable
class BatchReader(BatchCollate, Protocol):
    """A collate that can also read a planned batch straight from the shard readers.

    The dataset calls :meth:`read_batch` instead of reading sample dicts when it has no
    per-sample ``transform`` and ``on_error="raise"`` (:class:`RawCollate` is one).
    """

    def read_batch(self, open_reader: Callable[[int], ShardReader], parts: Parts) -> Any:
        """Read the batch whose reads are ``parts`` (``(shard, local indices)``, in order)."""


class RawCollate:
    """Collate encoded samples into a :class:`RawBatch` (one contiguous ``uint8`` tensor).

    Args:
        field: The field whose bytes make the batch, or a tuple of fields of which each
            sample's first present one is taken (default: the usual image extensions).
        label_field: ASCII-decimal label field parsed into ``labels``, or ``None``.
        keys: Also return the samples' keys (pickled strings; off by default).
        places: Also return each sample's ``(epoch, position)`` (:attr:`RawBatch.places`,
            16 bytes a sample in the batch's buffer; on by default): what
            :class:`~streamload.DeviceDecode` draws the CPU path's random crops and flips
            from. Samples without ``"__epoch__"``/``"__position__"`` (dicts not read by a
            dataset) give ``places=None``.

    Example:
        >>> ds = StreamingDataset("shards/", batch_size=256, collate=RawCollate())  # doctest: +SKIP
        >>> loader = DataLoader(ds, batch_size=None, num_workers=4)  # doctest: +SKIP
    """

    def __init__(
        self,
        field: str | Sequence[str] = IMAGE_FIELDS,
        label_field: str | None = "cls",
        keys: bool = False,
        places: bool = True,
    ) -> None:
        self.fields: tuple[str, ...] = (field,) if isinstance(field, str) else tuple(field)
        if not self.fields:
            raise ConfigError("RawCollate needs at least one field")
        if not isinstance(places, bool):
            raise ConfigError(f"RawCollate(places={places!r}) must be True or False")
        self.label_field = label_field
        self.keys = keys
        self.places = places

    def __repr__(self) -> str:
        return (
            f"RawCollate(field={self.fields!r}, label_field={self.label_field!r}, keys={self.keys}, "
            f"places={self.places})"
        )

    # -- the generic path: sample dicts in ---------------------------------------------

    def __call__(self, samples: list[Any]) -> RawBatch:
        """Collate sample dicts (``{"__key__", field: bytes}``) into a :class:`RawBatch`."""
        values = [self._field_of(s) for s in samples]
        sizes = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        where = _sample_places(samples) if self.places else None
        data, offsets_t, labels, lease, places = self._buffers(sizes, where)
        offsets = offsets_t.numpy()
        flat = data.numpy()
        for value, a, b in zip(values, offsets[:-1], offsets[1:], strict=True):
            flat[a:b] = np.frombuffer(value, dtype=np.uint8)
        if labels is not None:
            assert self.label_field is not None
            labels.numpy()[:] = [label_of(s, self.label_field) for s in samples]
        keys = tuple(s["__key__"] for s in samples) if self.keys else None
        return RawBatch(data, offsets_t, labels, keys, lease, places)

    @property
    def wants_places(self) -> bool:
        """Whether :meth:`read_batch` takes the samples' ``(epoch, position)`` (:attr:`places`)."""
        return self.places

    def _buffers(
        self, sizes: np.ndarray, where: np.ndarray | None = None, shared: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Lease | None, torch.Tensor | None]:
        """Data, offsets (filled from ``sizes``), labels and places (filled from ``where``), in one batch buffer."""
        n = len(sizes)
        parts: list[tuple[Sequence[int], torch.dtype]] = [((int(sizes.sum()),), torch.uint8), ((n + 1,), torch.int64)]
        if self.label_field is not None:
            parts.append(((n,), torch.int64))
        if where is not None:
            parts.append(((n, 2), torch.int64))
        tensors, lease = batch_tensors(parts, shared)
        offsets = tensors[1].numpy()
        offsets[0] = 0
        np.cumsum(sizes, out=offsets[1:])
        labels = tensors[2] if self.label_field is not None else None
        places = None
        if where is not None:
            places = tensors[-1]
            places.numpy()[:] = where
        return tensors[0], tensors[1], labels, lease, places

    def _field_of(self, sample: Sample) -> bytes:
        for name in self.fields:
            value = sample.get(name)
            if value is not None:
                return value  # type: ignore[no-any-return]
        raise SampleError(
            f"sample {sample.get('__key__')!r} has none of the fields {self.fields} "
            f"(it has {sorted(k for k in sample if not k.startswith('__'))})"
        )

    # -- the fast path: read straight from the shard readers ----------------------------

    def read_batch(
        self,
        open_reader: Callable[[int], ShardReader],
        parts: Parts,
        places: np.ndarray | None = None,
        shared: bool | None = None,
        then: Callable[[np.ndarray, np.ndarray], Any] | None = None,
    ) -> RawBatch:
        """Read a batch straight into one buffer: sizes from the index, then one read per shard.

        The batch's samples are grouped by shard (a shuffled or mixed batch has many small
        parts, often several from one shard), so each shard gets one size lookup and one
        read of all its samples; a group whose samples are not consecutive in the batch
        is read into scratch memory and copied to its places.

        Args:
            open_reader: Returns the open reader of a shard (the dataset's reader cache;
                called again for every step, so an evicted reader is simply reopened).
            parts: ``(shard, local indices)`` of the batch, in batch order.
            places: ``int64[B, 2]``, the samples' ``(epoch, position)`` (the dataset
                passes them when :attr:`places` is set); kept in :attr:`RawBatch.places`.
            shared: The batch's buffer in shared memory (``None``: inside a DataLoader
                worker); ``False`` for a batch that stays in its process (a decode's input).
            then: Called with the batch's data buffer and offsets (``uint8``, ``int64[B+1]``)
                once they are made; what it returns (a ``streamload.then`` continuation, e.g.
                the JPEG kernel's ``Job.then``) runs right after the batch's one gathered
                read, in the same release of the GIL. Not called where the batch is read
                another way (the caller runs its work itself then).
        """
        where = places if self.places else None
        if not all(serves_batches(open_reader(shard)) for shard, _ in parts):
            samples = [open_reader(shard).get(int(i)) for shard, idx in parts for i in idx]
            if where is not None:
                for sample, (epoch, item) in zip(samples, where.tolist(), strict=True):
                    sample["__epoch__"], sample["__position__"] = epoch, item
            return self(samples)
        label = None if self.label_field is None else (self.label_field,)
        groups = _group_by_shard(parts)
        n = sum(len(idx) for _, idx in parts)
        sizes = np.empty(n, dtype=np.int64)
        label_sizes: list[np.ndarray | None] = []
        label_values: list[np.ndarray | None] = []
        for shard, idx, pos in groups:
            reader = cast(BatchReads, open_reader(shard))
            sizes[pos] = reader.field_sizes(idx, self.fields)
            values = _integer_labels(reader, idx, label[0]) if label else None
            label_values.append(values)
            label_sizes.append(reader.field_sizes(idx, label) if label and values is None else None)
        data, offsets_t, labels, lease, places_t = self._buffers(sizes, where, shared)
        offsets, flat = offsets_t.numpy(), data.numpy()
        keys = tuple(k for shard, idx in parts for k in open_reader(shard).keys_of(idx)) if self.keys else None
        if all(values is None for values in label_values):  # every shard's reads in one call, where they can be
            after = None if then is None else lambda: then(flat, offsets)
            read = _gathered(open_reader, groups, self.fields, label, label_sizes, flat, sizes, after)
            if read is not None:
                if labels is not None and label is not None:
                    parse_labels(*read, lambda i: _key_at(open_reader, parts, i), label[0], out=labels)
                return RawBatch(data, offsets_t, labels, keys, lease, places_t)
        for (shard, idx, pos), lsize, values in zip(groups, label_sizes, label_values, strict=True):
            reader = cast(BatchReads, open_reader(shard))
            size = sizes[pos]
            first, last = int(pos[0]), int(pos[-1])
            in_place = last - first + 1 == len(pos)  # consecutive in the batch: read straight into place
            # not consecutive: each sample read to its place where the reader can, else into scratch and copied
            placed = not in_place and _implements(reader, PlacedReads)
            out = flat[offsets[first] : offsets[last + 1]] if in_place else np.empty(int(size.sum()), dtype=np.uint8)
            reads: list[FieldGroup] = [(self.fields, out, size)]
            if label and lsize is not None:
                loffsets = np.zeros(len(idx) + 1, dtype=np.int64)
                np.cumsum(lsize, out=loffsets[1:])
                raw = np.empty(int(loffsets[-1]), dtype=np.uint8)
                reads.append((label, raw, lsize))
            if placed:  # no copy a sample afterwards (each a numpy call that lets go of the GIL)
                to_place: list[PlacedGroup] = [(self.fields, flat, size, offsets[pos])]
                if label and lsize is not None:
                    to_place.append((label, raw, lsize, loffsets[:-1]))
                cast(PlacedReads, reader).read_groups_at(idx, to_place)
            else:
                reader.read_groups_into(idx, reads)  # data and labels in one pass over the shard
            if not in_place and not placed:
                at = 0
                for p, k in zip(pos.tolist(), size.tolist(), strict=True):
                    flat[offsets[p] : offsets[p] + k] = out[at : at + k]
                    at += k
            if values is not None and labels is not None:
                labels.numpy()[pos] = values
            elif label and lsize is not None and labels is not None:
                keys_of = _key_lookup(open_reader(shard), idx)
                if in_place:
                    parse_labels(raw, loffsets, keys_of, label[0], out=labels[first : last + 1])
                else:
                    labels.numpy()[pos] = parse_labels(raw, loffsets, keys_of, label[0]).numpy()
        return RawBatch(data, offsets_t, labels, keys, lease, places_t)


def _gathered(
    open_reader: Callable[[int], ShardReader],
    groups: list[tuple[int, np.ndarray, np.ndarray]],
    fields: tuple[str, ...],
    label: tuple[str] | None,
    label_sizes: Sequence[np.ndarray | None],
    flat: np.ndarray,
    sizes: np.ndarray,
    then: Callable[[], Any] | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Every shard's reads of a batch in one call (:func:`streamload._pread.gather_all`), into their places.

    The data to its places in ``flat`` (the batch's offsets: ``sizes``' running sum), the
    label fields back to back into one buffer, parsed afterwards in one go.

    Returns:
        The labels' bytes and offsets (empty without a label field), or ``None`` (nothing
        read) where a shard cannot plan its part (not a local tar file, the extension not
        built) or the batch spans more shards than the reader cache keeps open (opening
        one closed another: each shard is then read in turn, reopened as needed).
    """
    at = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=at[1:])
    label_at = np.zeros(len(sizes) + 1 if label else 1, dtype=np.int64)
    if label:
        for (_, _, pos), lsize in zip(groups, label_sizes, strict=True):
            assert lsize is not None  # no label values: every shard reads its labels
            label_at[pos + 1] = lsize
        np.cumsum(label_at, out=label_at)
    raw = np.empty(int(label_at[-1]), dtype=np.uint8)
    plans = []
    for shard, idx, pos in groups:
        reader = open_reader(shard)
        if not _implements(reader, GatherPlans):
            return None
        to_place: list[PlacedGroup] = [(fields, flat, sizes[pos], at[pos])]
        if label:
            to_place.append((label, raw, label_at[pos + 1] - label_at[pos], label_at[pos]))
        plan = cast(GatherPlans, reader).gather_plan(idx, to_place)
        if plan is None:
            return None
        plans.append(plan)
    return (raw, label_at) if gather_all(plans, None if then is None else then()) else None


def _key_at(open_reader: Callable[[int], ShardReader], parts: Parts, i: int) -> str:
    """The key of the batch's sample ``i``."""
    for shard, idx in parts:
        if i < len(idx):
            return open_reader(shard).keys_of(np.asarray(idx)[i : i + 1])[0]
        i -= len(idx)
    raise IndexError(i)


def _sample_places(samples: Sequence[Any]) -> np.ndarray | None:
    """``int64[B, 2]`` of the samples' ``(__epoch__, __position__)``, or ``None`` if any lacks them."""
    where = np.empty((len(samples), 2), dtype=np.int64)
    for i, sample in enumerate(samples):
        epoch = sample.get("__epoch__") if isinstance(sample, Mapping) else None
        item = sample.get("__position__") if isinstance(sample, Mapping) else None
        if not isinstance(epoch, int) or not isinstance(item, int):
            return None
        where[i] = epoch, item
    return where


def _group_by_shard(parts: Parts) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(shard, local indices, batch positions)`` per shard, in order of first appearance."""
    by_shard: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    at = 0
    for shard, idx in parts:
        indices, positions = by_shard.setdefault(shard, ([], []))
        indices.append(np.asarray(idx, dtype=np.int64))
        positions.append(np.arange(at, at + len(idx), dtype=np.int64))
        at += len(idx)
    return [
        (shard, np.concatenate(i) if len(i) > 1 else i[0], np.concatenate(p) if len(p) > 1 else p[0])
        for shard, (i, p) in by_shard.items()
    ]


#: ``(reader class, protocol)`` -> whether it implements it (``isinstance`` on a runtime protocol is slow).
_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def _implements(reader: object, protocol: type) -> bool:
    key = (type(reader), protocol)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = isinstance(reader, protocol)
    return known


def serves_batches(reader: ShardReader) -> bool:
    """Whether ``reader`` reads batches straight into a buffer (:class:`~streamload.formats.base.BatchReads`)."""
    return _implements(reader, BatchReads)


def wants_places(collate: object) -> bool:
    """Whether a :class:`BatchReader`'s ``read_batch`` takes the samples' ``(epoch, position)`` as ``places``."""
    return bool(getattr(collate, "wants_places", False))


def _integer_labels(reader: object, indices: np.ndarray, field: str) -> np.ndarray | None:
    """The reader's integer labels of ``indices`` in ``field``, where its index holds them; else ``None``."""
    return cast(IntegerLabels, reader).label_values(indices, field) if _implements(reader, IntegerLabels) else None


def _key_lookup(reader: ShardReader, indices: np.ndarray) -> Callable[[int], str]:
    return lambda i: reader.keys_of(indices[i : i + 1])[0]
