"""Image decode + geometry at the speed of the JPEG decoder.

One sample, step by step (``ImageDecoder.decode_into``)::

    header      width, height                    -- JPEG header only (no pixels)
    geometry    source box, output size          -- center or random-resized crop
    decode      libjpeg-turbo, DCT-scaled        -- simplejpeg when installed, else Pillow
                (the smallest scale M/8 that keeps the box >= the output: a 2-8x smaller
                decode when the source is much larger than the output); a JPEG that
                simplejpeg refuses (it is stricter than Pillow about extraneous bytes,
                odd markers) is decoded by Pillow instead, counted in ``fallbacks``
    resize      Pillow, bilinear, box=...        -- resamples only the cropped region
    copy        into the caller's batch slot     -- flipped in the same copy

Resize-then-crop is done as one ``resize(box=...)`` with the same scale factors, so the
output matches a plain Pillow ``resize`` + ``crop`` up to rounding. The only per-sample
Python is the geometry (a few float operations) and two or three calls into C.
"""

from __future__ import annotations

import io
import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from .._errors import ConfigError, SampleError
from .._shared import shared_block

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "Backend",
    "Crop",
    "ImageDecoder",
    "SharedCount",
    "check_pixels",
    "have_simplejpeg",
    "open_image",
    "planar",
    "to_eight_bits",
    "to_rgb",
]

_log = logging.getLogger("streamload.decode")

Crop = Literal["center", "random"]
Backend = Literal["auto", "simplejpeg", "pillow"]

_JPEG_MAGIC = b"\xff\xd8"
#: Largest image (width x height, from its header) decoded by default: Pillow's
#: ``MAX_IMAGE_PIXELS`` (about 1 GiB of 32-bit pixels), an error here rather than
#: Pillow's warning. A small PNG or JPEG can claim gigapixels (a decompression bomb).
DEFAULT_MAX_PIXELS = 1024 * 1024 * 1024 // 4 // 3


def check_pixels(width: int, height: int, max_pixels: int | None) -> None:
    """Raise :class:`SampleError` if a ``width`` x ``height`` image exceeds ``max_pixels`` (None: no limit)."""
    if max_pixels is not None and width * height > max_pixels:
        raise SampleError(
            f"image of {width}x{height} = {width * height} pixels is larger than max_pixels={max_pixels} "
            "(a decompression bomb?)"
        )


def open_image(data: Any, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Any:
    """Open encoded image bytes with Pillow (lazily: header only) after checking their size.

    Pillow's own ``Image.MAX_IMAGE_PIXELS`` check still applies (an image over twice it is
    refused by Pillow whatever ``max_pixels`` says); its error is reported the same way.

    Raises:
        SampleError: If the image has more than ``max_pixels`` pixels.
    """
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        size = pillow_refused_size(data)
        raise SampleError(f"image of {size} pixels is larger than Pillow's limit ({exc})") from exc
    check_pixels(img.size[0], img.size[1], max_pixels)
    return img


def pillow_refused_size(data: Any) -> str:
    """``"WxH = N"`` for a PNG or JPEG whose header Pillow refused to open, else ``"more"``."""
    head = bytes(data[:24])
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        return f"{width}x{height} = {width * height}"
    if head[:2] == _JPEG_MAGIC and have_simplejpeg():
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            return "more"
        return f"{width}x{height} = {width * height}"
    return "more"


def have_simplejpeg() -> bool:
    """Return True if the ``simplejpeg`` package (libjpeg-turbo) is importable."""
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        return False
    return True


_ADD_LOCK = threading.Lock()

#: Slots of a :class:`SharedCount`: the main process (0) and DataLoader workers 0..1022.
_SLOTS = 1024


class SharedCount:
    """A count kept in shared memory, one slot per process, so the main process sees its workers'.

    Made before the DataLoader starts its workers (fork or spawn), it is the same memory
    in all of them: :attr:`value` read in the training loop includes what every worker
    added. Each process adds to its own slot (the main process 0, worker ``i`` slot
    ``i + 1``), so no two processes write the same word.
    """

    def __init__(self) -> None:
        # A block of a shared arena: one descriptor for many counts, not one per decoder.
        self._slots = shared_block(_SLOTS)

    def add(self, count: int = 1) -> None:
        """Add ``count`` to this process's slot (threads of one process add under a lock)."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        with _ADD_LOCK:
            self._slots[0 if info is None else min(info.id + 1, _SLOTS - 1)] += count

    @property
    def value(self) -> int:
        """The sum over this process and its DataLoader workers."""
        return int(self._slots.sum())

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"SharedCount({self.value})"


class _Once:
    """Whether this process has logged a message yet (reset in a forked child)."""

    def __init__(self) -> None:
        self.done = False
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.done = False

    def __call__(self) -> bool:
        """True the first time in this process."""
        first, self.done = not self.done, True
        return first


_FALLBACK_LOGGED = _Once()


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    """``size`` as ``(height, width)``."""
    if isinstance(size, int):
        return size, size
    h, w = size
    return int(h), int(w)


class ImageDecoder:
    """Decode an encoded image into an RGB ``uint8`` array of a fixed size.

    Args:
        size: Output ``(height, width)`` or one int for a square.
        resize: For ``crop="center"``: the shorter side is resized to this first
            (default: ``min(size)``, i.e. crop the largest centred square); e.g. 256 for
            the usual "resize 256, center-crop 224".
        crop: ``"center"`` or ``"random"`` (random-resized crop, as in
            ``torchvision.transforms.RandomResizedCrop``).
        scale: Random crop's range of area fractions.
        ratio: Random crop's range of aspect ratios.
        flip: Flip horizontally with probability 0.5.
        backend: ``"simplejpeg"`` (libjpeg-turbo with DCT scaling to any M/8),
            ``"pillow"`` (``Image.draft``: scales 1/2, 1/4, 1/8), or ``"auto"`` (the
            default): simplejpeg when installed (``pip install streamload[fast]``), else
            Pillow. Non-JPEG images always go through Pillow. simplejpeg refuses some
            JPEGs that Pillow reads (extraneous bytes before a marker, a bad ICC or EXIF
            segment): each such image is decoded by Pillow instead, counted in
            :attr:`fallbacks`, and logged once per process on the ``streamload.decode``
            logger. So no backend decodes fewer images than Pillow.
        dct_scaling: Decode JPEGs at a reduced size when the output is smaller.
        max_pixels: Refuse (:class:`~streamload.SampleError`) an image whose header
            claims more than this many pixels, before decoding it; ``None``: no limit.

    Attributes:
        fallbacks: JPEGs simplejpeg refused and Pillow decoded, by this process and its
            DataLoader workers (a :class:`SharedCount`; ``int(decoder.fallbacks)``).
    """

    def __init__(
        self,
        size: int | Sequence[int] = 224,
        *,
        resize: int | None = None,
        crop: Crop = "center",
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: bool = False,
        backend: Backend = "auto",
        dct_scaling: bool = True,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.height, self.width = _pair(size)
        if max_pixels is not None and (
            isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1
        ):
            raise ConfigError(f"max_pixels={max_pixels!r} must be a positive int or None")
        self.max_pixels = max_pixels
        if self.height < 1 or self.width < 1:
            raise ConfigError(f"size={size!r} must be positive")
        if crop not in ("center", "random"):
            raise ConfigError(f"crop={crop!r} must be 'center' or 'random'")
        if backend not in ("auto", "simplejpeg", "pillow"):
            raise ConfigError(f"backend={backend!r} must be 'auto', 'simplejpeg' or 'pillow'")
        if backend == "simplejpeg" and not have_simplejpeg():
            raise ConfigError("backend='simplejpeg' needs the simplejpeg package: pip install streamload[fast]")
        self.resize = resize if resize is not None else min(self.height, self.width)
        self.crop: Crop = crop
        self.scale = scale
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.flip = flip
        self.backend: Backend = backend
        self.dct_scaling = dct_scaling
        self._use_simplejpeg = backend == "simplejpeg" or (backend == "auto" and have_simplejpeg())
        self.fallbacks = SharedCount()

    @property
    def shape(self) -> tuple[int, int, int]:
        """Output shape ``(height, width, 3)``."""
        return self.height, self.width, 3

    def __repr__(self) -> str:
        return (
            f"ImageDecoder(size=({self.height}, {self.width}), resize={self.resize}, crop={self.crop!r}, "
            f"flip={self.flip}, backend={'simplejpeg' if self._use_simplejpeg else 'pillow'})"
        )

    # -- geometry --------------------------------------------------------------------

    def box(self, width: int, height: int, rng: np.random.Generator | None = None) -> tuple[float, float, float, float]:
        """Return the source box ``(left, top, right, bottom)`` that maps onto the output."""
        if self.crop == "random":
            return self._random_box(width, height, rng if rng is not None else np.random.default_rng())
        short = min(width, height)
        # The plain pipeline's resized size, and its exact per-axis scale factors.
        rw = max(self.width, round(width * self.resize / short))
        rh = max(self.height, round(height * self.resize / short))
        sx, sy = rw / width, rh / height
        left, top = (rw - self.width) // 2, (rh - self.height) // 2
        return left / sx, top / sy, (left + self.width) / sx, (top + self.height) / sy

    def _random_box(self, width: int, height: int, rng: np.random.Generator) -> tuple[float, float, float, float]:
        area = width * height
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*self.log_ratio))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                left = int(rng.integers(0, width - w + 1))
                top = int(rng.integers(0, height - h + 1))
                return left, top, left + w, top + h
        # Fallback: the largest centred crop within the ratio range.
        in_ratio = width / height
        lo, hi = math.exp(self.log_ratio[0]), math.exp(self.log_ratio[1])
        if in_ratio < lo:
            w, h = width, round(width / lo)
        elif in_ratio > hi:
            w, h = round(height * hi), height
        else:
            w, h = width, height
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def _reduction(self, width: int, height: int, box: tuple[float, float, float, float]) -> int:
        """Largest power-of-two DCT reduction (1, 2, 4, 8) that keeps the box >= the output.

        libjpeg-turbo also scales by M/8, but measured here those decodes are slower than a
        full one; the power-of-two scales skip most of the inverse DCT and upsampling.
        """
        if not self.dct_scaling:
            return 1
        room = min((box[2] - box[0]) / self.width, (box[3] - box[1]) / self.height)
        factor = 1
        while factor < 8 and room >= 2 * factor:
            factor *= 2
        return factor

        # -- decoding --------------------------------------------------------------------

    def decode(
        self, data: bytes | memoryview | np.ndarray, rng: np.random.Generator | None = None, *, name: str | None = None
    ) -> np.ndarray:
        """Return the image as a new ``uint8`` array ``(height, width, 3)`` (``name``: see :meth:`decode_into`)."""
        out = np.empty(self.shape, dtype=np.uint8)
        self.decode_into(data, out, rng, name=name)
        return out

    def decode_into(
        self,
        data: bytes | memoryview | np.ndarray,
        out: np.ndarray,
        rng: np.random.Generator | None = None,
        *,
        name: str | None = None,
    ) -> None:
        """Decode ``data`` into ``out`` (a ``uint8`` array of :attr:`shape`, e.g. a batch slot).

        Args:
            data: The encoded image.
            out: Where the pixels go.
            rng: Generator of a random crop and flip.
            name: What the log line of a fallback to Pillow names the image by (a sample key).

        Raises:
            ValueError: From the decoder, for data that is not a valid image (the caller
                names the sample); ``OSError`` likewise, from Pillow.
        """
        img = self._image(data, rng, name)
        # Pack to RGB in C (RGBX -> RGB), then one memcpy into the slot: ~30 us, where
        # np.asarray(img)[..., :3] costs ~0.5 ms.
        out[...] = np.frombuffer(img.tobytes("raw", "RGB"), dtype=np.uint8).reshape(self.height, self.width, 3)

    def decode_chw(
        self, data: bytes | memoryview | np.ndarray, rng: np.random.Generator | None = None, *, name: str | None = None
    ) -> np.ndarray:
        """Return the image as a new C-contiguous ``uint8`` array ``(3, height, width)`` (planar RGB).

        The same pixels as :meth:`decode`, channels first: each plane is packed by Pillow
        in C, so the array needs no transposing copy, and a batch of them stacks with
        plain copies (what a DataLoader's default collate does).
        """
        return planar(self._image(data, rng, name))

    def _image(self, data: bytes | memoryview | np.ndarray, rng: np.random.Generator | None, name: str | None) -> Any:
        """The decoded, cropped, resized (and flipped) Pillow image of :meth:`decode_into`."""
        if self._use_simplejpeg and bytes(data[:2]) == _JPEG_MAGIC:
            img, box = self._jpeg(data, rng, name)
        else:
            img, box = self._pillow(data, rng)
        from PIL import Image

        if img.size != (self.width, self.height) or box != (0, 0, self.width, self.height):
            img = img.resize((self.width, self.height), Image.Resampling.BILINEAR, box=box)
        if self.flip and (rng if rng is not None else np.random.default_rng()).random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img

    def _jpeg(self, data: Any, rng: np.random.Generator | None, name: str | None) -> tuple[Any, tuple[float, ...]]:
        """simplejpeg, or Pillow for a JPEG it refuses (with the same crop box)."""
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as refused:
            return self._fallback(data, rng, None, refused, name)
        check_pixels(width, height, self.max_pixels)  # a refusal of ours, not simplejpeg's
        box = self.box(width, height, rng)
        try:
            return self._simplejpeg(data, width, height, box)
        except ValueError as refused:
            return self._fallback(data, rng, box, refused, name)

    def _fallback(
        self,
        data: Any,
        rng: np.random.Generator | None,
        box: tuple[float, float, float, float] | None,
        refused: ValueError,
        name: str | None,
    ) -> tuple[Any, tuple[float, ...]]:
        """Decode with Pillow a JPEG simplejpeg refused; count it, log the first of the process."""
        try:
            decoded = self._pillow(data, rng, box)
        except SampleError:
            raise
        except Exception as exc:  # Pillow cannot read it either: its error, with simplejpeg's
            raise ValueError(f"{exc} (simplejpeg: {refused})") from exc
        self.fallbacks.add()
        if _FALLBACK_LOGGED():
            _log.warning(
                "%s: simplejpeg refused this JPEG (%s); decoded with Pillow instead. Later ones of this "
                "process are counted, not logged (the decoder's or transform's .fallbacks)",
                "an image" if name is None else f"sample {name!r}",
                refused,
            )
        return decoded

    def _simplejpeg(
        self, data: Any, width: int, height: int, box: tuple[float, float, float, float]
    ) -> tuple[Any, tuple[float, ...]]:
        import simplejpeg
        from PIL import Image

        factor = self._reduction(width, height, box)
        # RGBX: Pillow's own pixel layout, so the decoded array becomes an image without a copy.
        array = simplejpeg.decode_jpeg(
            data, "RGBX", min_width=-(-width // factor), min_height=-(-height // factor), min_factor=factor
        )
        h, w = array.shape[:2]
        img = Image.frombuffer("RGBX", (w, h), array, "raw", "RGBX", 0, 1)
        return img, _scaled(box, width, w)

    def _pillow(
        self, data: Any, rng: np.random.Generator | None, box: tuple[float, float, float, float] | None = None
    ) -> tuple[Any, tuple[float, ...]]:
        src = open_image(data, self.max_pixels)
        width, height = src.size
        if box is None:
            box = self.box(width, height, rng)
        factor = self._reduction(width, height, box)
        if factor > 1 and src.format == "JPEG":
            src.draft("RGB", (width // factor, height // factor))  # Pillow: size // request >= scale
        img = to_rgb(src)
        return img, _scaled(box, width, img.size[0])


#: Pillow modes of more than 8 bits per sample (one band): scaled to 8 bits by :func:`to_eight_bits`.
WIDE_MODES = frozenset({"I", "F", "I;16", "I;16B", "I;16L", "I;16N"})


#: ``round(value / 257)`` for every 16-bit value (65535 -> 255): a look-up table of 64 KiB.
_SIXTEEN_BITS = ((np.arange(65536, dtype=np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


def to_eight_bits(img: Any) -> Any:
    """A one-band image of more than 8 bits per sample (:data:`WIDE_MODES`) as an 8-bit ``"L"`` image.

    Pillow's own conversion of these to ``"L"`` or ``"RGB"`` clips every value above 255
    (a 16-bit photo comes out almost white); here the values are scaled:

    * 16-bit (``I;16*``): ``round(value / 257)`` (65535 -> 255);
    * 32-bit integer (``I``): the same when every value lies in 0..65535 (Pillow opens
      16-bit PNG, PGM and TIFF files as ``I`` or ``I;16``), else the image's own minimum
      to maximum stretched over 0..255;
    * floating point (``F``): ``round(value * 255)`` when every value lies in [0, 1], else
      minimum to maximum stretched over 0..255. NaN becomes 0.

    A constant image outside those ranges becomes 0. Other modes are returned as they are.
    """
    from PIL import Image

    if img.mode not in WIDE_MODES:
        return img
    values = np.asarray(img)
    if img.mode == "F":
        values = values.astype(np.float64)
        finite = np.isfinite(values)
        if not finite.all():
            values = np.where(finite, values, np.nan)
        lo, hi = (float(np.nanmin(values)), float(np.nanmax(values))) if finite.any() else (0.0, 0.0)
        if not (0.0 <= lo and hi <= 1.0):
            values = (values - lo) / (hi - lo) if hi > lo else np.zeros_like(values)
        out = np.nan_to_num(np.rint(values * 255.0), nan=0.0)
    elif img.mode != "I":  # I;16*: one table look-up per pixel
        out = _SIXTEEN_BITS[values]
    else:
        lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
        if lo >= 0 and hi <= 65535:
            out = _SIXTEEN_BITS[values.astype(np.uint16)]
        elif hi > lo:
            wide = values.astype(np.int64) - lo
            out = (wide * 255 + (hi - lo) // 2) // (hi - lo)
        else:
            out = np.zeros(values.shape, dtype=np.uint8)
    return Image.fromarray(np.ascontiguousarray(out, dtype=np.uint8))  # a 2-D uint8 array: mode "L"


def to_rgb(img: Any) -> Any:
    """``img`` converted to ``"RGB"``; one of more than 8 bits per sample is scaled, not clipped.

    See :func:`to_eight_bits`.
    """
    img.load()  # decoded here (a lazily opened file's errors are raised by this call)
    if img.mode == "RGB":
        return img
    return to_eight_bits(img).convert("RGB")


def planar(img: Any) -> np.ndarray:
    """An RGB, RGBX or RGBA Pillow image's R, G, B planes as a new C-contiguous ``uint8`` ``(3, height, width)``.

    Each plane is packed by Pillow in C (``tobytes("raw", "R")``...), then copied once:
    cheaper than packing RGB and transposing it to channels-first.
    """
    width, height = img.size
    out = np.empty((3, height, width), dtype=np.uint8)
    for channel, band in enumerate("RGB"):
        out[channel] = np.frombuffer(img.tobytes("raw", band), dtype=np.uint8).reshape(height, width)
    return out


def _scaled(box: tuple[float, float, float, float], width: int, decoded_width: int) -> tuple[float, ...]:
    """Map a source box onto an image decoded at 1/factor (factor a power of two).

    A DCT-scaled decode has ``ceil(width / factor)`` columns, each covering exactly
    ``factor`` source columns, so the map is ``x / factor``, not ``x * decoded / width``.
    """
    factor = 1 << max(0, round(math.log2(width / decoded_width)))
    return box[0] / factor, box[1] / factor, box[2] / factor, box[3] / factor
