"""The native batch kernel: a batch of JPEGs decoded into the batch buffer in one call.

Per-sample calls into C (decode, resize, flip, pack) each release the GIL and must take it
back; beside a thread running Python (a training loop), each of those takes up to the
switch interval (5 ms). :func:`decode_batch` makes a batch's JPEG work one call that
releases the GIL once, whatever the batch size::

    headers     _jpegbatch.headers          -- C, GIL held (microseconds a sample)
    geometry    draw_crops (_draws.crops)   -- C, GIL held (~10 us a batch of 64): the
                                               numbers ImageDecoder.box and the flip draw
                                               from each sample's generator, bit for bit
                                               (Python's own draws where it cannot)
    decode      _jpegbatch.decode           -- C, GIL released once for the batch:
                                               libjpeg-turbo at 1/factor, Pillow's
                                               bilinear resample of the box, the flip,
                                               the write into each slot

A batch the dataset reads itself (:func:`read_decoded`: local tar shards, every sample's
``(epoch, position)`` known) goes further: the three steps are one job
(``_jpegbatch.prepare``) that the batch's gathered read (``_gather.pread_gather``) runs
right after its reads, so reading and decoding the batch is a single release of the GIL.

The kernel is a CPython extension (``streamload/decode/_jpegbatch.c``) linked against the
system's libjpeg-turbo and built by the package's install when a C compiler and
``jpeglib.h`` are there (optional: without them the install still succeeds). Where it is
absent, the per-sample path runs, with a one-line notice.

Samples the kernel does not take (not a JPEG, CMYK, a header it cannot read, larger than
``max_pixels``) go the per-sample path unchanged. Samples it refuses while decoding
(corrupt or truncated data, anything libjpeg warns about) are decoded by Pillow with the
same box and flip, counted in the decoder's ``fallbacks`` like simplejpeg's refusals.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ConfigError

if TYPE_CHECKING:
    from ..batch import ImageBatch, Parts, RawBatch
    from ..formats.base import ShardReader
    from . import DecodeBatch
    from .image import ImageDecoder

__all__ = [
    "DONE",
    "Drawn",
    "Refusal",
    "agrees_with_numpy",
    "available",
    "decode_batch",
    "draw_crops",
    "kernel",
    "read_decoded",
    "refused_into",
    "use_native",
]

_log = logging.getLogger("streamload.decode")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def kernel() -> ModuleType | None:
    """The compiled kernel module, or ``None`` when it was not built (logged once per process)."""
    if "module" in _STATE:
        return _STATE["module"]  # type: ignore[no-any-return]
    with _LOCK:
        if "module" not in _STATE:
            try:  # the compiled extension (no .py: imported by name)
                module: ModuleType | None = importlib.import_module(f"{__package__}._jpegbatch")
            except ImportError as exc:
                module = None
                _log.warning(
                    "streamload's native JPEG batch kernel is not built (%s): decoding per sample. Build it with "
                    "`pip install -e .` where gcc and libjpeg-turbo's headers (libjpeg62-turbo-dev) are installed",
                    exc,
                )
            _STATE["module"] = module
    return _STATE["module"]  # type: ignore[no-any-return]


def available() -> bool:
    """True if the native kernel is built (importable)."""
    return kernel() is not None


def use_native(native: bool | None, backend: str) -> bool:
    """Whether a :class:`~streamload.decode.DecodeBatch` uses the kernel.

    ``None`` (the default): with ``backend="auto"`` when the kernel is built; ``True``:
    always (raises :class:`~streamload.ConfigError` when it is not built); ``False``: never.
    """
    if native is None:
        return backend == "auto" and available()
    if native and not available():
        raise ConfigError("native=True needs streamload's native JPEG kernel, which is not built (see the log)")
    return bool(native)


class _Done:
    def __repr__(self) -> str:
        return "DONE"


#: A sample the kernel decoded into its slot.
DONE = _Done()


@dataclass(frozen=True)
class Refusal:
    """A JPEG the kernel refused while decoding: its geometry, for Pillow to decode it the same way."""

    box: tuple[float, float, float, float]
    flip: bool
    reason: str


def decode_batch(
    batch: DecodeBatch, samples: Sequence[Mapping[str, Any]], datas: Sequence[Any], slots: np.ndarray
) -> list[Any]:
    """Decode the batch's JPEGs (``datas``: each sample's image bytes) into ``slots`` in one GIL-free call.

    ``slots`` is the batch buffer, ``n x H x W x 3`` (C-contiguous ``uint8``).

    Each sample's box and flip are drawn here in sample order, from the generator the
    per-sample path would use (:meth:`DecodeBatch.sample_rng`), with the same
    :meth:`ImageDecoder.box` and the same draw for the flip, so the crops are identical.

    Returns:
        Per sample: :data:`DONE` (decoded into its slot), a :class:`Refusal` (to decode with
        Pillow: :func:`refused_into`), or ``None`` (not taken: the per-sample path, which
        draws from the sample's generator itself).
    """
    return _decode(batch, lambda i: batch.sample_rng(samples[i]), datas, slots, _places_of(samples))


def _places_of(samples: Sequence[Mapping[str, Any]]) -> np.ndarray | None:
    """The samples' ``(epoch, position)`` when every one has them, else ``None``.

    With them, each sample's generator is :func:`~streamload.randomness.place_generator`'s.
    """
    where = []
    for sample in samples:
        epoch, position = sample.get("__epoch__"), sample.get("__position__")
        if type(epoch) is not int or type(position) is not int or epoch < 0 or position < 0:
            return None
        where.append((epoch, position))
    return np.array(where, dtype=np.int64).reshape(-1, 2)


def _decode(
    batch: DecodeBatch,
    rng_of: Callable[[int], np.random.Generator],
    datas: Sequence[Any],
    slots: np.ndarray,
    where: np.ndarray | None = None,
) -> list[Any]:
    """:func:`decode_batch` with sample ``i``'s generator from ``rng_of(i)`` (asked for in sample order).

    ``where``: the samples' ``(epoch, position)`` (``int64[n, 2]``) when ``rng_of(i)`` is
    their :func:`~streamload.randomness.place_generator`: the draws are then made in C for
    the whole batch (:func:`draw_crops`), the same numbers without a generator a sample.
    """
    module = kernel()
    assert module is not None
    decoder = batch.decoder
    n = len(datas)
    dims = np.zeros((n, 3), dtype=np.int32)
    module.headers(datas, dims)
    drawn = None if where is None else draw_crops(decoder, dims, where, batch.seed or 0)
    if drawn is None:
        drawn = _draw_python(decoder, dims, rng_of)
    boxes, params, full, taken = drawn
    reasons = module.decode(datas, boxes, params, slots, decoder.height, decoder.width, _pillow13())
    return _outcomes(taken, full, params, reasons)


def _outcomes(taken: np.ndarray, full: np.ndarray, params: np.ndarray, reasons: Sequence[str | None]) -> list[Any]:
    """Per sample: :data:`DONE`, a :class:`Refusal` (its box, flip and reason), or ``None`` (not taken)."""
    out: list[Any] = [None] * len(taken)
    for i in np.flatnonzero(taken).tolist():
        reason = reasons[i]
        if reason is None:
            out[i] = DONE
        else:
            left, top, right, bottom = full[i].tolist()
            out[i] = Refusal((left, top, right, bottom), bool(params[i, 1]), reason)
    return out


#: Crop boxes on the reduced decode, (reduction, flip), boxes on the full image, taken.
Drawn = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _draw_python(decoder: ImageDecoder, dims: np.ndarray, rng_of: Callable[[int], np.random.Generator]) -> Drawn:
    """Each taken sample's box and flip, drawn in Python from its generator (:func:`draw_crops` without C)."""
    n = len(dims)
    boxes = np.zeros((n, 4), dtype=np.float32)
    params = np.zeros((n, 2), dtype=np.int32)
    full = np.zeros((n, 4), dtype=np.float64)
    taken = np.zeros(n, dtype=np.uint8)
    random = decoder.crop == "random" or decoder.flip
    max_pixels = decoder.max_pixels
    for i, (width, height, kind) in enumerate(dims.tolist()):
        if kind == 0 or (max_pixels is not None and width * height > max_pixels):
            continue  # the per-sample path: Pillow, or today's error naming the sample
        rng = rng_of(i) if random else None
        box = decoder.box(width, height, rng)
        factor = decoder._reduction(width, height, box)
        scale = _box_scale(width, factor)
        boxes[i] = (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)
        flip = decoder.flip and (rng if rng is not None else np.random.default_rng()).random() < 0.5
        params[i] = (factor, 1 if flip else 0)
        full[i] = box
        taken[i] = 1
    return boxes, params, full, taken


def draw_crops(decoder: ImageDecoder, dims: np.ndarray, where: np.ndarray, seed: int) -> Drawn | None:
    """Every taken sample's crop box and flip for the kernel, drawn in C for the whole batch.

    The numbers :func:`_draw_python` draws from each sample's
    ``place_generator(epoch, position, seed)``, bit for bit: numpy's SeedSequence, Philox and
    its ``uniform``/``integers``/``random``, and :meth:`ImageDecoder.box`'s arithmetic, made
    in C (``streamload/_draws.c``) in one call holding the GIL for microseconds, not one
    generator a sample (~20 us each of Python). Checked against numpy once per process
    before first use.

    Args:
        decoder: The geometry (size, crop, scale, ratio, flip, DCT scaling, ``max_pixels``).
        dims: ``int32[n, 3]`` width, height and kind (0: not the kernel's) from its headers.
        where: ``int64[n, 2]`` the samples' ``(epoch, position)``.
        seed: The decode's seed.

    Returns:
        ``(boxes, params, full, taken)`` as :func:`_decode` passes them on, or ``None``
        where the extension is not built, disagrees with numpy, the seed does not fit, or
        the decoder's geometry is its own (a subclass's or an instance's ``box``): the
        caller draws in Python.
    """
    module = _draws_module()
    if module is None or not 0 <= seed < 1 << 128 or not _own_geometry(decoder):
        return None
    return _crops(module, decoder, dims, where, seed)


def _own_geometry(decoder: ImageDecoder) -> bool:
    """Whether ``decoder`` draws with ImageDecoder's own geometry (not a subclass's or an instance's own)."""
    from .image import ImageDecoder

    return all(
        getattr(type(decoder), name) is getattr(ImageDecoder, name) and name not in vars(decoder)
        for name in ("box", "_random_box", "_reduction")
    )


def _crops(module: ModuleType, decoder: ImageDecoder, dims: np.ndarray, where: np.ndarray, seed: int) -> Drawn:
    """:func:`draw_crops` by ``module`` (``streamload._draws``)."""
    n = len(dims)
    boxes = np.zeros((n, 4), dtype=np.float32)
    params = np.zeros((n, 2), dtype=np.int32)
    full = np.zeros((n, 4), dtype=np.float64)
    taken = np.empty(n, dtype=np.uint8)
    geometry = _geometry(decoder)
    limit = -1 if decoder.max_pixels is None else decoder.max_pixels
    module.crops(
        _prefix(seed), np.ascontiguousarray(where, dtype=np.int64), dims, geometry, limit, boxes, full, params, taken
    )
    return boxes, params, full, taken


def _geometry(decoder: ImageDecoder) -> tuple[bool, bool, bool, int, int, float, float, float, float, float]:
    """The decoder's crop geometry as the C draws take it."""
    lo, hi = decoder.log_ratio
    return (
        decoder.crop == "random",
        decoder.flip,
        decoder.dct_scaling,
        decoder.width,
        decoder.height,
        float(decoder.scale[0]),
        float(decoder.scale[1]),
        lo,
        hi,
        float(decoder.resize),
    )


@functools.lru_cache(maxsize=16)
def _prefix(seed: int) -> np.ndarray:
    """The SeedSequence words of ``place_generator``'s key before the sample's epoch and position."""
    from ..randomness import seed_words

    words = np.asarray(seed_words(seed), dtype=np.uint32)
    words.flags.writeable = False  # shared by every batch of this seed
    return words


def _draws_module() -> ModuleType | None:
    """``streamload._draws`` once it has drawn what numpy draws for a few keys (else ``None``, logged once)."""
    if "draws" in _STATE:
        return _STATE["draws"]  # type: ignore[no-any-return]
    with _LOCK:
        if "draws" not in _STATE:
            _STATE["draws"] = _checked_draws()
    return _STATE["draws"]  # type: ignore[no-any-return]


def _checked_draws() -> ModuleType | None:
    try:
        module = importlib.import_module(f"{__package__.rsplit('.', 1)[0]}._draws")
    except ImportError:
        return None  # the kernel's notice covers the build; its boxes are drawn in Python
    if not agrees_with_numpy(module):
        _log.warning("streamload._draws does not draw what numpy draws here: crop boxes are drawn in Python")
        return None
    return module


def agrees_with_numpy(module: Any) -> bool:
    """Whether ``module.crops`` draws what numpy's generators draw, on a few keys, sizes and geometries."""
    from ..randomness import place_generator
    from .image import ImageDecoder

    dims = np.array([[500, 375, 1], [1, 1, 1], [4000, 30, 1], [333, 777, 1], [64, 64, 1]], dtype=np.int32)
    where = np.array([[0, 0], [3, 123456], [1 << 33, 7], [9, 1 << 40], [2, 2]], dtype=np.int64)
    for decoder in (
        ImageDecoder(160, crop="random", flip=True),
        ImageDecoder(224, crop="center", resize=256, flip=True),
    ):
        for seed in (0, 17, (1 << 64) + 3):
            try:
                got = _crops(module, decoder, dims, where, seed)
            except (TypeError, ValueError):
                return False

            def generator(i: int, seed: int = seed) -> np.random.Generator:
                return place_generator(int(where[i, 0]), int(where[i, 1]), seed)

            want = _draw_python(decoder, dims, generator)
            if not all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)):
                return False
    return True


def _pillow13() -> bool:
    """Whether the installed Pillow orders its resize passes as 13 does (the kernel follows it)."""
    if "pillow13" not in _STATE:
        import PIL

        _STATE["pillow13"] = int(PIL.__version__.split(".")[0]) >= 13
    return bool(_STATE["pillow13"])


def _box_scale(width: int, factor: int) -> int:
    """The per-sample path's map of a full-size box onto a 1/factor decode (``image._scaled``)."""
    import math

    decoded = -(-width // factor)
    return 1 << max(0, round(math.log2(width / decoded)))


def refused_into(decoder: ImageDecoder, data: Any, out: np.ndarray, refusal: Refusal, name: str | None) -> None:
    """Decode with Pillow, into ``out``, a JPEG the kernel refused: the same box and flip, a counted fallback.

    Raises:
        ValueError: When Pillow cannot read it either (the caller names the sample), as
            the per-sample path does.
    """
    from PIL import Image

    img, box = decoder._fallback(data, None, refusal.box, ValueError(refusal.reason), name)
    if img.size != (decoder.width, decoder.height) or box != (0, 0, decoder.width, decoder.height):
        img = img.resize((decoder.width, decoder.height), Image.Resampling.BILINEAR, box=box)
    if refusal.flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    out[...] = np.frombuffer(img.tobytes("raw", "RGB"), dtype=np.uint8).reshape(decoder.height, decoder.width, 3)


def read_decoded(
    batch: DecodeBatch, open_reader: Callable[[int], ShardReader], parts: Parts, places: np.ndarray | None
) -> ImageBatch:
    """:meth:`DecodeBatch.read_batch`: a planned batch read into one buffer and decoded by the kernel.

    The batch's encoded images and labels are read by the collate's :class:`~streamload.RawCollate`
    (sizes from the shards' indexes, one read call a shard, into memory that stays in this
    process), then the kernel decodes them from there in one call. Sample ``i``'s crop and
    flip come from :func:`streamload.randomness.place_generator` keyed by ``places[i]``:
    the generator its dict would get (:meth:`DecodeBatch.sample_rng`). A sample the kernel
    does not take or refuses is read again as its dict (:meth:`ShardReader.get`) and
    decoded per sample, counted as on the dict path.

    Sample dicts all along (:meth:`DecodeBatch.__call__`) when the kernel is off, a shard's
    reader does not read batches, or the read meets a bad sample (no image field, a label
    that is not an integer: the dict path raises its own error for it).
    """
    from .._errors import SampleError
    from ..batch import serves_batches
    from ..timing import current

    where = None if places is None else places.tolist()
    spots = [(shard, int(i)) for shard, idx in parts for i in np.asarray(idx).tolist()]

    def sample_of(i: int) -> dict[str, Any]:
        shard, local = spots[i]
        sample = open_reader(shard).get(local)
        if where is not None:
            sample["__epoch__"], sample["__position__"] = where[i]
        return sample

    if not batch.native or not all(serves_batches(open_reader(shard)) for shard, _ in parts):
        return batch([sample_of(i) for i in range(len(spots))])  # type: ignore[no-any-return]
    fused = _Fused.make(batch, places, len(spots))
    try:
        raw = batch.raw.read_batch(open_reader, parts, shared=False, then=None if fused is None else fused.then)
    except SampleError:
        return batch([sample_of(i) for i in range(len(spots))])  # type: ignore[no-any-return]
    clock = current()  # a watched iteration: the decode is the collate stage, the read before it the read's
    if fused is not None:
        outcomes, seconds = fused.finish(raw)
        if clock is not None:
            clock.charge(seconds)  # run inside the read's call: its time is the collate stage's all the same
        return _decoded(batch, raw, where, places, sample_of, fused, outcomes)
    if clock is None:
        return _decoded(batch, raw, where, places, sample_of)
    return clock.collate(lambda read: _decoded(batch, read, where, places, sample_of), raw)


class _Fused:
    """A batch's headers, crop draws and decode run by its read: one release of the GIL for both.

    The kernel's job (``_jpegbatch.prepare``) is made once the batch's buffer is (the read
    calls :meth:`then`) and handed to the gathered read as its continuation, so the read,
    the draws (:func:`draw_crops`'s, in C) and the decode are one GIL-free call. Where the
    batch is read another way, :meth:`finish` runs the job itself after the read.
    """

    def __init__(self, batch: DecodeBatch, places: np.ndarray, n: int, module: ModuleType) -> None:
        import torch

        from ..batch import batch_tensors

        decoder = batch.decoder
        shapes: list[tuple[Sequence[int], torch.dtype]] = [((n, *decoder.shape), torch.uint8)]
        if batch.label_field is not None:
            shapes.append(((n,), torch.int64))
        self.tensors, self.lease = batch_tensors(shapes)
        self.slots = self.tensors[0].numpy()
        self.batch, self.module, self.places = batch, module, np.ascontiguousarray(places, dtype=np.int64)
        self.dims = np.zeros((n, 3), dtype=np.int32)
        self.boxes = np.zeros((n, 4), dtype=np.float32)
        self.full = np.zeros((n, 4), dtype=np.float64)
        self.params = np.zeros((n, 2), dtype=np.int32)
        self.taken = np.zeros(n, dtype=np.uint8)
        self.job: Any = None

    @classmethod
    def make(cls, batch: DecodeBatch, places: np.ndarray | None, n: int) -> _Fused | None:
        """A fused decode for the batch, or ``None`` where its draws cannot be made in C."""
        module = kernel()
        seed = batch.seed or 0
        if (
            places is None
            or module is None
            or not hasattr(module, "prepare")
            or _draws_module() is None
            or not 0 <= seed < 1 << 128
            or not _own_geometry(batch.decoder)
        ):
            return None
        return cls(batch, places, n, module)

    def then(self, data: np.ndarray, offsets: np.ndarray) -> Any:
        """The job over the batch's buffer: its continuation, for the read to run."""
        decoder = self.batch.decoder
        self.job = self.module.prepare(
            data,
            offsets,
            _prefix(self.batch.seed or 0),
            self.places,
            _geometry(decoder),
            -1 if decoder.max_pixels is None else decoder.max_pixels,
            self.dims,
            self.boxes,
            self.full,
            self.params,
            self.taken,
            self.slots,
            decoder.height,
            decoder.width,
            _pillow13(),
        )
        return self.job.then

    def finish(self, raw: RawBatch) -> tuple[list[Any], float]:
        """Each sample's outcome (as :func:`_decode`'s) and the job's seconds, running it if the read did not."""
        if self.job is None:
            self.then(raw.data.numpy(), raw.offsets.numpy())
        reasons, seconds = self.job.finish()
        return _outcomes(self.taken, self.full, self.params, reasons), seconds


def _decoded(
    batch: DecodeBatch,
    raw: RawBatch,
    where: list[list[int]] | None,
    places: np.ndarray | None,
    sample_of: Callable[[int], dict[str, Any]],
    fused: _Fused | None = None,
    outcomes: list[Any] | None = None,
) -> ImageBatch:
    """The kernel over a read batch (:func:`read_decoded`), the samples it leaves decoded one by one.

    ``fused``, ``outcomes``: the batch already decoded by its read (:class:`_Fused`).
    """
    import torch

    from .._batchmem import channels_first
    from .._errors import SampleError
    from ..batch import ImageBatch, batch_tensors
    from ..randomness import place_generator
    from ..skips import sample_failed

    n = raw.batch_size
    decoder = batch.decoder
    if fused is not None and outcomes is not None:
        tensors, lease, slots, taken = fused.tensors, fused.lease, fused.slots, outcomes
    else:
        shapes: list[tuple[Sequence[int], torch.dtype]] = [((n, *decoder.shape), torch.uint8)]
        if batch.label_field is not None:
            shapes.append(((n,), torch.int64))
        tensors, lease = batch_tensors(shapes)
        slots = tensors[0].numpy()
        bounds = raw.offsets.tolist()
        view = raw.data.numpy().data
        datas = [view[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        seed = batch.seed or 0
        if where is not None:
            taken = _decode(batch, lambda i: place_generator(where[i][0], where[i][1], seed), datas, slots, places)
        else:
            taken = _decode(batch, lambda i: batch.rng(), datas, slots)
    labels = None
    if batch.label_field is not None and raw.labels is not None:
        labels = tensors[1]
        values = labels.numpy()
        values[:] = raw.labels.numpy()
    for i, word in enumerate(taken):
        if word is DONE:
            continue
        sample = sample_of(i)
        try:
            label = batch.decode_slot(sample, slots[i], word)
        except SampleError as error:
            if not sample_failed(i, error):
                raise
            continue
        if labels is not None:
            labels.numpy()[i] = label
    images = channels_first(tensors[0], lease) if batch.layout == "CHW" else tensors[0]
    return ImageBatch(images, labels, lease)
