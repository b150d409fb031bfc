"""The decode axis: how a sample's raw bytes become Python values and tensors.

Decoders are chosen by field name from a fixed table (:data:`FIELD_DECODERS`); nothing
read from a shard can select code to run (no pickle, no ``torch.load``, no eval).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch

from .._batchmem import channels_first
from .._errors import SampleError, StreamloadError
from .._fork import ProcessLocal
from ..randomness import sample_generator
from ..sample import IMAGE_FIELDS, image_field, image_problem, image_warnings, label_of, parse_label
from ..skips import sample_failed
from . import native as _native
from .image import (
    DEFAULT_MAX_PIXELS,
    WIDE_MODES,
    Backend,
    Crop,
    ImageDecoder,
    SharedCount,
    open_image,
    planar,
    to_eight_bits,
)

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "FIELD_DECODERS",
    "IMAGE_FIELDS",
    "DecodeBatch",
    "ImageDecoder",
    "ImageLabel",
    "SharedCount",
    "decode_image",
    "decode_sample",
    "image_field",
    "label_of",
]


_log = logging.getLogger("streamload.decode")


def _report(sample: Mapping[str, Any], field: str, found: list[str]) -> int:
    """Log the library warnings one image's decode raised, one line each naming the sample."""
    for text in dict.fromkeys(found):
        _log.warning("sample %r field %r: %s", sample.get("__key__"), field, text)
    return len(found)


def _cannot_decode(sample: Mapping[str, Any], field: str, exc: BaseException, found: list[str]) -> SampleError:
    """The error of an image that cannot be decoded, with what the libraries said about it."""
    said = list(dict.fromkeys(found))
    detail = f" ({'; '.join(said[:3])}{f'; and {len(said) - 3} more' if len(said) > 3 else ''})" if said else ""
    return SampleError(
        f"sample {sample.get('__key__')!r} field {field!r}: cannot decode image: {image_problem(exc)}{detail}"
    )


def _text(data: bytes) -> str:
    return bytes(data).decode("utf-8")


def _json(data: bytes) -> Any:
    return json.loads(bytes(data))


def decode_image(data: bytes, mode: str = "RGB", max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Any:
    """Decode image bytes to a Pillow image in ``mode`` (``"RGB"`` by default).

    An image of more than 8 bits per sample (16-bit PNG or TIFF, 32-bit integer or float
    TIFF) asked for in an 8-bit mode is scaled to 8 bits, not clipped (see
    :func:`streamload.decode.image.to_eight_bits`).

    Raises:
        SampleError: If the image header claims more than ``max_pixels`` pixels (checked
            before decoding; ``None``: no limit).
    """
    with open_image(data, max_pixels) as img:
        if img.mode == mode:
            return img.copy()
        if mode not in WIDE_MODES:
            img = to_eight_bits(img)
        return img.convert(mode) if img.mode != mode else img


#: Field name -> decoder. Unknown fields stay bytes.
FIELD_DECODERS: Mapping[str, Callable[[bytes], Any]] = {
    "cls": parse_label,
    "cls2": parse_label,
    "index": parse_label,
    "txt": _text,
    "text": _text,
    "json": _json,
    **{name: decode_image for name in IMAGE_FIELDS},
}


def decode_sample(
    sample: Mapping[str, Any], fields: Mapping[str, Callable[[bytes], Any]] | None = None
) -> dict[str, Any]:
    """Return a copy of ``sample`` with each known field decoded (images to Pillow images).

    Args:
        sample: A sample dict from :class:`~streamload.StreamingDataset`.
        fields: Decoders to use instead of :data:`FIELD_DECODERS`.

    Raises:
        SampleError: Naming the key and field, if a field cannot be decoded.
    """
    table = FIELD_DECODERS if fields is None else fields
    out: dict[str, Any] = {}
    for name, value in sample.items():
        decoder = table.get(name) if not name.startswith("__") else None
        if decoder is None:
            out[name] = value
            continue
        with image_warnings(value if name in IMAGE_FIELDS else None) as found:
            try:
                out[name] = decoder(value)
            except Exception as exc:
                raise SampleError(f"sample {sample.get('__key__')!r} field {name!r}: cannot decode: {exc}") from exc
        if found:
            _report(sample, name, found)
    return out


class ImageLabel:
    """Transform a sample into ``(image, label)``: a ``uint8`` tensor (CHW, RGB) and an int.

    With ``size``, decoding goes through :class:`ImageDecoder` (libjpeg-turbo DCT
    scaling when the image is much larger than ``size``, one box resize); for whole
    batches made in the worker, prefer :class:`DecodeBatch`.

    Args:
        size: If given, resize the shorter side to ``size`` and center-crop to
            ``size x size``; otherwise keep the original size (batching then needs a
            custom collate).
        label_field: Field holding the label; ``None`` for a dataset without labels (the
            transform then returns the image tensor alone).
        backend: See :class:`ImageDecoder`.
        max_pixels: Largest image decoded (width x height, from its header); a larger
            one raises :class:`~streamload.SampleError`. ``None``: no limit.

    Library warnings raised by a decode (Pillow's, for a malformed or huge file, and what
    libtiff writes to stderr for a TIFF) are logged once each on the ``streamload.decode``
    logger naming the sample, and counted in :attr:`warnings` (per process), never printed
    raw. JPEGs the fast backend refuses are decoded by Pillow: :attr:`fallbacks`.

    Example:
        >>> ds = StreamingDataset("shards/", transform=ImageLabel(size=224))  # doctest: +SKIP
        >>> image, label = next(iter(ds))  # doctest: +SKIP
    """

    def __init__(
        self,
        size: int | None = None,
        label_field: str | None = "cls",
        backend: Backend = "auto",
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.size = size
        self.label_field = label_field
        self.max_pixels = max_pixels
        self.warnings = 0
        self._decoder = None if size is None else ImageDecoder(size, backend=backend, max_pixels=max_pixels)

    @property
    def fallbacks(self) -> int:
        """JPEGs the fast backend refused and Pillow decoded, here and in the DataLoader workers."""
        return 0 if self._decoder is None else self._decoder.fallbacks.value

    def __call__(self, sample: Mapping[str, Any]) -> Any:
        """Decode one sample: ``(image, label)``, or the image alone when ``label_field`` is ``None``."""
        name = image_field(sample)
        data = sample[name]
        found: list[str] = []
        try:
            with image_warnings(data) as found:
                if self._decoder is not None:
                    array = self._decoder.decode_chw(data, name=sample.get("__key__"))
                else:
                    array = planar(decode_image(data, max_pixels=self.max_pixels))
        except Exception as exc:
            raise _cannot_decode(sample, name, exc, found) from exc
        if found:
            self.warnings += _report(sample, name, found)
        # Channels-first and contiguous (planes packed by Pillow): the DataLoader's default
        # collate stacks these with plain copies, not a transposing one per image.
        tensor = torch.from_numpy(array)
        if self.label_field is None:
            return tensor
        return tensor, label_of(sample, self.label_field)


class DecodeBatch:
    """Collate samples into an :class:`~streamload.batch.ImageBatch`, decoding in the worker.

    Every image is decoded straight into its slot of one ``uint8`` batch buffer (shared
    memory inside a DataLoader worker, recycled between batches), so the batch reaches
    the main process without a copy. Use as ``StreamingDataset(collate=...)``.

    Args:
        size: Output ``(height, width)`` or one int for a square.
        resize: Shorter side before a center crop (default: ``min(size)``).
        crop: ``"center"`` or ``"random"`` (random-resized crop).
        flip: Random horizontal flip.
        scale: Random crop's area range.
        ratio: Random crop's aspect-ratio range.
        backend: ``"auto"``, ``"simplejpeg"`` or ``"pillow"`` (see :class:`ImageDecoder`).
        field: Image field, or fields of which each sample's first present one is used.
        label_field: ASCII-decimal label field, or ``None`` (a dataset without labels: the
            batch's ``labels`` is ``None``).
        layout: ``"CHW"`` (a channels-last ``[B, 3, H, W]`` view) or ``"HWC"``.
        seed: Seed of the random crops and flips (default 0). Each sample's crop and flip
            come from :func:`streamload.sample_generator` keyed by (seed, epoch, the
            sample's position in the epoch): bit-identical whichever rank or worker
            decodes it, and after a resume. Samples read elsewhere (no
            ``__epoch__``/``__position__``) draw from a per-process generator
            (seed, worker id; the worker's torch seed when ``seed`` is ``None``).
        max_pixels: Largest image decoded (see :class:`ImageDecoder`); ``None``: no limit.
        native: Decode the batch's JPEGs with streamload's native batch kernel (one call a
            batch, the GIL released once: :mod:`streamload.decode.native`). ``None`` (the
            default): when it is built and ``backend="auto"``; ``True``: required;
            ``False``: the per-sample path. The crops, flips and pixels are the same
            either way (it follows Pillow's bilinear arithmetic; docs/design.md).

    Library warnings of a decode (Python's, Pillow's log, libtiff's stderr lines) are
    logged naming the sample and counted in :attr:`warnings` (per process); JPEGs the
    fast backend refused and Pillow decoded are counted in :attr:`fallbacks` (over the
    DataLoader workers too), the first of each process logged.

    Example:
        >>> ds = StreamingDataset("shards/", batch_size=256, shuffle=True,
        ...                       collate=DecodeBatch(224, crop="random", flip=True))  # doctest: +SKIP
        >>> for images, labels in DataLoader(ds, batch_size=None, num_workers=8): ...  # doctest: +SKIP
    """

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        *,
        resize: int | None = None,
        crop: Crop = "center",
        flip: bool = False,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        backend: Backend = "auto",
        field: str | tuple[str, ...] = IMAGE_FIELDS,
        label_field: str | None = "cls",
        layout: str = "CHW",
        seed: int | None = None,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        native: bool | None = None,
    ) -> None:
        if layout not in ("CHW", "HWC"):
            raise SampleError(f"layout={layout!r} must be 'CHW' or 'HWC'")
        self.decoder = ImageDecoder(
            size, resize=resize, crop=crop, flip=flip, scale=scale, ratio=ratio, backend=backend, max_pixels=max_pixels
        )
        self.fields = (field,) if isinstance(field, str) else tuple(field)
        self.label_field = label_field
        self.layout = layout
        self.seed = seed
        self.native = _native.use_native(native, backend)
        from ..batch import RawCollate

        #: Reads a planned batch's encoded images and labels into one buffer (:meth:`read_batch`).
        self.raw = RawCollate(field=self.fields, label_field=label_field, places=False)
        self.warnings = 0  # library warnings raised by decodes in this process (each logged naming its sample)
        #: A good sample of an earlier batch: what fills a batch whose every sample was skipped.
        self._stand_in: Mapping[str, Any] | None = None
        self._rng: ProcessLocal[np.random.Generator] = ProcessLocal(partial(_process_rng, seed))

    def __repr__(self) -> str:
        return f"DecodeBatch({self.decoder!r}, label_field={self.label_field!r}, layout={self.layout!r})"

    @property
    def fallbacks(self) -> int:
        """JPEGs the fast backend refused and Pillow decoded, here and in the DataLoader workers."""
        return self.decoder.fallbacks.value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_rng"]
        state["_stand_in"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rng = ProcessLocal(partial(_process_rng, self.seed))

    def rng(self) -> np.random.Generator:
        """This process's generator, for samples that carry no ``__epoch__``/``__position__``."""
        return self._rng.get()

    def sample_rng(self, sample: Mapping[str, Any]) -> np.random.Generator:
        """The generator of ``sample``'s crop and flip: keyed by (seed, epoch, position) when it has them."""
        if "__position__" in sample and "__epoch__" in sample:
            return sample_generator(sample, self.seed or 0)
        return self.rng()

    def __call__(self, samples: list[Any]) -> Any:
        """Decode the samples into one :class:`~streamload.batch.ImageBatch`.

        A sample that cannot be decoded (or has no image field, or a bad label) raises a
        :class:`~streamload.SampleError` naming it (its shard too, inside a dataset).
        Under the dataset's ``on_error="skip"`` it is counted and named as a skipped
        sample (:func:`streamload.skips.sample_failed`) and its slot, image and label,
        holds a repeat of another sample of the batch: the last good one before it (of
        the same stream in a mixture, if the batch has one), else the next; so the batch
        keeps its shape, as the per-sample path keeps the item count.
        """
        from ..batch import ImageBatch, batch_tensors

        parts: list[tuple[tuple[int, ...], torch.dtype]] = [((len(samples), *self.decoder.shape), torch.uint8)]
        if self.label_field is not None:
            parts.append(((len(samples),), torch.int64))
        tensors, lease = batch_tensors(parts)
        buffer = tensors[0]
        slots = buffer.numpy()
        labels: list[int] = [0] * len(samples)
        bad: list[int] = []
        taken = self._native_batch(samples, slots) if self.native else None
        for i, sample in enumerate(samples):
            try:
                labels[i] = self.decode_slot(sample, slots[i], None if taken is None else taken[i])
            except SampleError as error:
                if not sample_failed(i, error):
                    raise
                bad.append(i)
        if bad:
            self._fill(samples, bad, slots, labels)
        elif samples:
            self._stand_in = samples[-1]
        label_tensor = None
        if self.label_field is not None:
            label_tensor = tensors[1]
            label_tensor.numpy()[:] = labels
        images = channels_first(buffer, lease) if self.layout == "CHW" else buffer
        return ImageBatch(images, label_tensor, lease)

    #: :meth:`read_batch` takes each sample's ``(epoch, position)``: the key of its crop and flip.
    wants_places = True

    def read_batch(self, open_reader: Callable[[int], Any], parts: Any, places: np.ndarray | None = None) -> Any:
        """Read a planned batch straight from the shard readers and decode it (the dataset calls this).

        With the native kernel, the batch's encoded images and labels are read into one
        buffer (:meth:`streamload.RawCollate.read_batch`: one read call a shard) and
        decoded from there in one call: a batch lets go of the GIL a few times, not a few
        times a sample. The crops, flips and pixels are those of :meth:`__call__` on the
        same samples' dicts (each sample's generator keyed by its ``places`` row, its
        ``(epoch, position)``); samples the kernel does not take or refuses are read as
        dicts and decoded per sample. See :func:`streamload.decode.native.read_decoded`.

        Args:
            open_reader: Returns the open reader of a shard.
            parts: ``(shard, local indices)`` of the batch, in batch order.
            places: ``int64[B, 2]``: the samples' ``(epoch, position)`` (``None``: unknown;
                the crops are drawn from :meth:`rng`).
        """
        return _native.read_decoded(self, open_reader, parts, places)

    def decode_slot(self, sample: Mapping[str, Any], slot: np.ndarray, native: Any = None) -> int:
        """Decode one sample's image into ``slot`` (an ``(height, width, 3)`` ``uint8`` array); return its label.

        ``native`` is the batch kernel's word on the sample (:func:`streamload.decode.native.decode_batch`):
        ``DONE`` (its image is in ``slot`` already), a ``Refusal`` (decoded here by Pillow with
        the kernel's geometry, counted as a fallback), or ``None`` (the per-sample path).

        The label is 0 when :attr:`label_field` is ``None``. Library warnings are logged
        and counted (:attr:`warnings`).

        Raises:
            SampleError: Naming the sample and field: no image field, an image that cannot
                be decoded, a missing or bad label.
        """
        if native is _native.DONE:
            return 0 if self.label_field is None else label_of(sample, self.label_field)
        name = self._field_of(sample)
        data = sample[name]
        found: list[str] = []
        random = self.decoder.crop == "random" or self.decoder.flip
        try:
            with image_warnings(data) as found:
                if isinstance(native, _native.Refusal):
                    _native.refused_into(self.decoder, data, slot, native, sample.get("__key__"))
                else:
                    rng = self.sample_rng(sample) if random else None
                    self.decoder.decode_into(data, slot, rng, name=sample.get("__key__"))
        except Exception as exc:
            raise _cannot_decode(sample, name, exc, found) from exc
        if found:
            self.warnings += _report(sample, name, found)
        return 0 if self.label_field is None else label_of(sample, self.label_field)

    def _fill(self, samples: list[Any], bad: list[int], slots: np.ndarray, labels: list[int]) -> None:
        """Fill the skipped slots ``bad`` with repeats of good samples of the batch (see :meth:`__call__`)."""
        skipped = set(bad)
        good = [i for i in range(len(samples)) if i not in skipped]
        if not good:  # the whole batch failed: a good sample of an earlier batch, decoded again
            stand_in = self._stand_in
            if stand_in is None:
                raise StreamloadError(
                    f"every one of the {len(samples)} samples of this batch failed to decode, and no earlier "
                    "batch of this process had a good one; nothing to substitute"
                )
            labels[bad[0]] = self.decode_slot(stand_in, slots[bad[0]])
            good, skipped = [bad[0]], skipped - {bad[0]}
        else:
            self._stand_in = samples[good[-1]]
        for i in sorted(skipped):
            stream = _stream_of(samples[i])
            same = [j for j in good if _stream_of(samples[j]) == stream] or good
            before = [j for j in same if j < i]
            j = before[-1] if before else same[0]
            slots[i] = slots[j]
            labels[i] = labels[j]

    def _native_batch(self, samples: list[Any], slots: np.ndarray) -> list[Any]:
        """The native kernel's pass over the batch (per sample: DONE, a Refusal, or None: not taken)."""
        datas = [next((sample[name] for name in self.fields if name in sample), b"") for sample in samples]
        return _native.decode_batch(self, samples, datas, slots)

    def _field_of(self, sample: Mapping[str, Any]) -> str:
        for name in self.fields:
            if name in sample:
                return name
        raise SampleError(f"sample {sample.get('__key__')!r} has none of the fields {self.fields}")


def _stream_of(sample: Any) -> Any:
    """A sample's stream in a mixture (its ``__source__``), ``None`` otherwise."""
    return sample.get("__source__") if isinstance(sample, Mapping) else None


#: What :class:`streamload.DeviceDecode` raises and logs for an image it decodes on the CPU: the same words.
cannot_decode = _cannot_decode
report_warnings = _report


def _process_rng(seed: int | None) -> np.random.Generator:
    """A generator of this process (made anew in each DataLoader worker): ``seed`` (else torch's) and the worker id."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    worker = 0 if info is None else info.id
    base = torch.initial_seed() if seed is None else seed
    return np.random.default_rng([base & 0xFFFFFFFFFFFFFFFF, worker])
