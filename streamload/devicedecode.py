"""``DeviceDecode``: decode a batch of JPEG bytes on the GPU, with the CPU path's crops and flips.

The DataLoader workers (or the :class:`~streamload.Loader`'s threads) only read bytes
(``collate=RawCollate()``: one ``uint8`` tensor per batch, never touching CUDA); the
training process turns each :class:`~streamload.batch.RawBatch` into images on its GPU::

    host      headers    width, height of each JPEG (its frame header, no pixels)
              geometry   each sample's box and flip: ImageDecoder.box + one draw, from
                         samplegenerator_of(seed, epoch, position), as DecodeBatch draws them
    device    decode     the JPEG engine (nvImageCodec, hardware) or nvJPEG on the SMs
              resize     every image cropped to its box and resized at once (Pillow's
                         bilinear filter, streamload._resample), flipped, packed NCHW
    host      refused    JPEGs the device decoder cannot take, and other formats: decoded on
                         the CPU (ImageDecoder, the same box) and copied into their slots

All of it runs on a CUDA stream of its own; :meth:`DeviceDecode.iterate` decodes batch
``n + 1`` while the training step runs on batch ``n``.

With ``device="cpu"`` every image takes the CPU path of :class:`~streamload.decode.DecodeBatch`
(the same :class:`~streamload.decode.ImageDecoder`, the same generator per sample), so
the tensors are exactly ``DecodeBatch``'s: the way a machine without a GPU checks all but
the decoder.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from time import perf_counter
from typing import Any

import numpy as np
import torch

from ._errors import ConfigError, SampleError
from ._gpudecode import NO_PLACES, GpuDecoder, batch_geometry, fill_slots, generator_of, sample_name
from ._validate import check_on_error
from .batch import RawBatch
from .decode import DEFAULT_MAX_PIXELS, ImageDecoder, SharedCount, cannot_decode, report_warnings
from .decode.image import Backend, Crop
from .sample import image_warnings

__all__ = ["DeviceBatches", "DeviceDecode", "batch_geometry"]

_log = logging.getLogger("streamload.decode")
#: Skipped samples named in ``skipped_samples`` (all are counted).
_KEEP_SKIPPED = 1000
_DECODERS = ("auto", "hardware", "nvjpeg")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class DeviceDecode:
    """Decode :class:`~streamload.batch.RawBatch` batches of JPEGs on the GPU: ``(images, labels)``.

    Apply it in the training process to the batches of ``collate=RawCollate()``, read by
    DataLoader workers or a :class:`~streamload.Loader` (they only read bytes)::

        ds = StreamingDataset(url, batch_size=256, shuffle=True, collate=RawCollate())
        decode = DeviceDecode(224, crop="random", flip=True, mean=MEAN, std=STD, channels_last=True)
        for images, labels in decode.iterate(DataLoader(ds, batch_size=None, num_workers=4)):
            ...                                  # the next batch is decoded meanwhile

    Each sample's crop box and flip are :class:`~streamload.decode.DecodeBatch`'s (same
    settings), drawn from :func:`streamload.sample_generator` of ``(seed, epoch, position)``
    (:attr:`RawBatch.places`): the same on any rank, worker, resume, CPU or GPU. With
    ``device="cpu"`` the images are exactly ``DecodeBatch``'s. On CUDA (see ``docs/gpu.md``)
    the decoder, named by ``repr``, is nvImageCodec's hardware decoder where the GPU has
    JPEG engines, else nvJPEG on the SMs; crop and resize run batched (Pillow's bilinear
    filter; close to, not bit-identical with, the CPU path); what the GPU cannot decode is
    decoded on the CPU for that batch, with the same boxes, and counted in :attr:`fallbacks`.

    Args:
        size: Output ``(height, width)`` or one int for a square.
        crop: ``"center"`` or ``"random"`` (random-resized crop), as :class:`DecodeBatch`.
        flip: Random horizontal flip.
        seed: Seed of the crops and flips (``DecodeBatch(seed=...)``; ``None`` there is 0).
        device: ``"cuda"`` (this process's GPU: ``LOCAL_RANK`` when set, else the current
            device), ``"cuda:N"``, a ``torch.device``, or ``"cpu"``.
        resize: Shorter side before a center crop (default ``min(size)``).
        scale: Random crop's area range.
        ratio: Random crop's aspect-ratio range.
        mean: Per-channel mean on the 0-1 scale (e.g. ``(0.485, 0.456, 0.406)``): the
            images become ``(x / 255 - mean) / std`` in ``dtype``.
        std: Per-channel standard deviation on the 0-1 scale (with ``mean``).
        dtype: ``torch.uint8`` (the default without ``mean``/``std``) or a float dtype
            (``float32`` by default with them; without them a float dtype gives ``x / 255``).
        channels_last: Return the images in ``torch.channels_last`` memory format.
        decoder: ``"auto"``, ``"hardware"`` (nvImageCodec's hardware decoder only) or
            ``"nvjpeg"`` (torchvision's nvJPEG only).
        backend: The CPU decoder's backend (:class:`ImageDecoder`), for ``device="cpu"``
            and the fallbacks.
        max_pixels: Largest image decoded (its header's width x height); ``None``: no limit.
        on_error: ``"raise"`` (an image that cannot be decoded raises
            :class:`~streamload.SampleError` naming it) or ``"skip"``: it is counted in
            :attr:`skipped`, named in :attr:`skipped_samples` and the log, and its slot
            (image and label) repeats another sample of the batch, as ``DecodeBatch`` does
            under the dataset's ``on_error="skip"`` (the last good one before it, else the
            next; a batch with none raises).

    Raises:
        ConfigError: For an argument out of range, or ``device="cuda"`` without CUDA or
            without a GPU decoder installed (the message says what to install).

    Attributes:
        fallbacks: Images decoded on the CPU instead of the GPU decoder (a
            :class:`~streamload.decode.SharedCount`; always 0 with ``device="cpu"``).
        skipped: Images skipped under ``on_error="skip"`` (a ``SharedCount``).
        skipped_samples: ``(name, reason)`` of the first 1,000 of them.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        crop: Crop = "center",
        flip: bool = False,
        seed: int = 0,
        device: str | torch.device = "cuda",
        resize: int | None = None,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
        decoder: str = "auto",
        backend: Backend = "auto",
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        on_error: str = "raise",
    ) -> None:
        self.height, self.width = _size(size)
        self.on_error = check_on_error(on_error)
        if crop not in ("center", "random"):
            raise ConfigError(f"DeviceDecode(crop={crop!r}) must be 'center' or 'random'")
        _flag("flip", flip)
        _flag("channels_last", channels_last)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"DeviceDecode(seed={seed!r}) must be an integer >= 0")
        if resize is not None and (isinstance(resize, bool) or not isinstance(resize, int) or resize < 1):
            raise ConfigError(f"DeviceDecode(resize={resize!r}) must be a positive int or None")
        _range("scale", scale, upper=1.0)
        _range("ratio", ratio)
        if decoder not in _DECODERS:
            raise ConfigError(f"DeviceDecode(decoder={decoder!r}) must be one of {_DECODERS}")
        self.mean, self.std, self.dtype = _normalization(mean, std, dtype)
        self.device = _parse_device(device)
        self.crop: Crop = crop
        self.flip = flip
        self.seed = seed
        self.channels_last = channels_last
        self.decoder = decoder
        self.cpu = ImageDecoder(
            (self.height, self.width),
            resize=resize,
            crop=crop,
            flip=flip,
            scale=scale,
            ratio=ratio,
            backend=backend,
            max_pixels=max_pixels,
        )
        self.max_pixels = max_pixels
        self.fallbacks = SharedCount()
        self.skipped = SharedCount()
        self.skipped_samples: list[tuple[str, str]] = []
        self.warnings = 0
        self._gpu: GpuDecoder | None = None
        self.stage_clock = _StageClock()
        if self.device.type == "cuda":
            self._gpu = GpuDecoder.open(self.device, decoder)  # a ConfigError now, not at the first batch

    # -- what it is ----------------------------------------------------------------

    @property
    def decoder_name(self) -> str:
        """The decoder that runs: ``"nvimgcodec-hardware"``, ``"nvjpeg"`` or ``"cpu"``.

        ``"nvimgcodec-hardware+nvjpeg"``: the hardware decoder, nvJPEG taking the JPEGs it refuses.
        """
        if self._gpu is None and self.device.type == "cuda":
            self._gpu = GpuDecoder.open(self.device, self.decoder)
        return "cpu" if self._gpu is None else self._gpu.name

    @property
    def cpu_fallbacks(self) -> int:
        """JPEGs the CPU decoder's fast backend refused and Pillow decoded (``DecodeBatch.fallbacks``)."""
        return self.cpu.fallbacks.value

    def __repr__(self) -> str:
        norm = "" if self.mean is None else f", mean={self.mean}, std={self.std}"
        return (
            f"DeviceDecode(size=({self.height}, {self.width}), crop={self.crop!r}, flip={self.flip}, "
            f"seed={self.seed}, device={str(self.device)!r}, decoder={self.decoder_name!r}, "
            f"dtype={str(self.dtype).removeprefix('torch.')}{norm}, channels_last={self.channels_last})"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_gpu"] = None  # decoders, streams and events stay in their process
        state["stage_clock"] = None  # a lock, and CUDA events of this process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # the GPU decoder is opened at the first batch of this process
        self.stage_clock = _StageClock()

    # -- decoding ------------------------------------------------------------------

    def __call__(self, batch: RawBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode one raw batch: ``(images, labels)`` on :attr:`device`, the step's stream waiting for them.

        Raises:
            ConfigError: If ``batch`` is not a :class:`~streamload.batch.RawBatch`, or it
                carries no places and the crops or flips are random.
            SampleError: Naming the sample, for an image that cannot be decoded or is
                larger than ``max_pixels``.
        """
        pending = self.start(batch)
        return self.finish(pending)

    def start(self, batch: RawBatch) -> Any:
        """Begin decoding ``batch`` (on the decode stream on CUDA); :meth:`finish` hands it over."""
        if not isinstance(batch, RawBatch):
            raise ConfigError(
                f"DeviceDecode takes the RawBatch batches of StreamingDataset(collate=RawCollate()), "
                f"not {type(batch).__name__}"
            )
        gpu = self._gpu
        if gpu is None and self.device.type == "cuda":
            gpu = self._gpu = GpuDecoder.open(self.device, self.decoder)
        if gpu is None:
            start = perf_counter()
            out = self._decode_cpu(batch)
            self.stage_clock.add(perf_counter() - start)
            return out
        return gpu.start(self, batch)

    def finish(self, pending: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The images and labels of a :meth:`start`, the current stream made to wait for them."""
        if self._gpu is None:
            images, labels = pending
            return images, labels
        return self._gpu.finish(self, pending)  # (images, labels, the decode's end event)

    def iterate(self, loader: Iterable[RawBatch], ahead: bool = True) -> DeviceBatches:
        """Iterate ``loader``'s raw batches decoded, batch ``n + 1`` decoding while the caller works on ``n``.

        On CUDA the decode of the next batch is queued on the decode stream before the
        current one is handed over, so the GPU decodes it while the training step runs;
        the caller's stream waits only for the batch it receives. ``ahead=False`` takes a
        batch from ``loader`` only when the caller asks for it (no overlap between steps;
        the loader's own ``state_dict`` then counts exactly the batches handed over). See
        :class:`DeviceBatches`.
        """
        if not isinstance(ahead, bool):
            raise ConfigError(f"iterate(ahead={ahead!r}) must be True or False")
        return DeviceBatches(self, loader, ahead)

    def device_stage_seconds(self) -> dict[str, float]:
        """The ``decode`` stage's seconds so far (what :func:`streamload.watch` reports for :meth:`iterate`).

        On CUDA: CUDA-event time, read once completed (a batch in flight counts later); else CPU time.
        """
        return {"decode": self.stage_clock.seconds()}

    def to(self, device: str | torch.device) -> DeviceDecode:
        """The same decode on ``device`` (its own decoder and stream; counts and stage time shared).

        Raises:
            ConfigError: As the constructor's ``device=``.
        """
        target = _parse_device(device)
        if target == self.device:
            return self
        moved = copy.copy(self)
        moved.device = target
        moved._gpu = GpuDecoder.open(target, self.decoder) if target.type == "cuda" else None
        return moved

    def _decode_cpu(self, batch: RawBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every image on the CPU, exactly as :class:`DecodeBatch` decodes it."""
        n = batch.batch_size
        buffer = torch.empty((n, self.height, self.width, 3), dtype=torch.uint8)
        places = self.places_of(batch)
        bad = self.decode_on_cpu(batch, range(n), buffer.numpy(), places)
        labels = None if batch.labels is None else batch.labels.to(self.device)
        if bad:
            labels = fill_slots(buffer, labels, bad)
        return self.shape_images(buffer.permute(0, 3, 1, 2)), labels

    def places_of(self, batch: RawBatch) -> np.ndarray | None:
        """The batch's ``(epoch, position)`` rows; ``ConfigError`` if missing where crops or flips are random."""
        random = self.crop == "random" or self.flip
        places = None if batch.places is None else batch.places.cpu().numpy()
        if random and places is None:
            raise ConfigError(NO_PLACES)
        return places

    def decode_on_cpu(
        self, batch: RawBatch, which: Iterable[int], out: np.ndarray, places: np.ndarray | None
    ) -> list[int]:
        """Decode samples ``which`` of ``batch`` into ``out[k]`` (``[len, H, W, 3]``) with the CPU decoder.

        Returns the samples (of ``which``) that could not be decoded, each counted and
        logged (``on_error="skip"``); with ``on_error="raise"`` the first raises.
        """
        bad: list[int] = []
        decode_into = self.cpu.decode_into
        random = self.crop == "random" or self.flip
        data = batch.data if batch.data.device.type == "cpu" else batch.data.cpu()
        bounds = batch.offsets.tolist()
        for k, i in enumerate(which):
            raw = data[bounds[i] : bounds[i + 1]].numpy()
            name = sample_name(batch, i)
            found: list[str] = []
            try:
                with image_warnings(raw) as found:
                    decode_into(raw, out[k], generator_of(places, i, self.seed) if random else None, name=name)
            except Exception as exc:
                error = exc if isinstance(exc, SampleError) else cannot_decode({"__key__": name}, "image", exc, found)
                if self.on_error == "raise":
                    raise error from exc
                self.skip(name, error)
                bad.append(i)
                continue
            if found:
                self.warnings += report_warnings({"__key__": name}, "image", found)
        return bad

    def skip(self, name: str, error: BaseException) -> None:
        """Count and log a sample skipped under ``on_error="skip"`` (its slot is filled from the batch)."""
        self.skipped.add()
        if len(self.skipped_samples) < _KEEP_SKIPPED:
            self.skipped_samples.append((name, str(error)))
        _log.warning("DeviceDecode skipped %s (on_error='skip', a repeat of the batch in its slot): %s", name, error)

    def shape_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW (channels-last view or not) -> the asked dtype, normalization and memory format."""
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.dtype == torch.uint8:
            return images.contiguous(memory_format=fmt)
        out = images.to(dtype=torch.float32, memory_format=fmt).div_(255.0)
        if self.mean is not None and self.std is not None:
            # staged host-to-device copies: no wait for the stream's queued decode
            mean = torch.tensor(self.mean, dtype=torch.float32).view(1, 3, 1, 1).to(out.device, non_blocking=True)
            std = torch.tensor(self.std, dtype=torch.float32).view(1, 3, 1, 1).to(out.device, non_blocking=True)
            out.sub_(mean).div_(std)
        return out if self.dtype == torch.float32 else out.to(self.dtype)


class _StageClock:
    """The decode stage's seconds: CPU time added, CUDA event pairs read once they have completed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def pending(self, begin: Any, end: Any) -> None:
        with self._lock:
            self._events.append((begin, end))

    def seconds(self) -> float:
        with self._lock:
            left = []
            for begin, end in self._events:
                if end.query():
                    self._seconds += begin.elapsed_time(end) / 1e3
                else:
                    left.append((begin, end))
            self._events = left
            return self._seconds


class DeviceBatches:
    """``DeviceDecode.iterate(loader)``: the loader's raw batches as ``(images, labels)`` on the device.

    Iterating it iterates ``loader`` (each ``iter()`` an epoch). With ``ahead`` (the
    default) one batch is decoded ahead: when batch ``n`` is handed over, batch ``n + 1``
    is already taken from the loader and queued on the decode stream, so the GPU decodes
    it while the step on ``n`` runs. ``len()``, ``set_epoch`` and the loader's other
    attributes go to the loader.

    Saving a mid-epoch position: ``dataset.state_dict(samples_seen=steps * global_batch)``
    counts the loop's own steps and is exact. The loader's own ``state_dict()`` (a
    :class:`~streamload.Loader`'s, a ``StatefulDataLoader``'s) also counts the batch taken
    ahead, which a resume from it would skip; iterate with ``ahead=False`` to use it.

    Attributes:
        decode: The :class:`DeviceDecode`.
        loader: The loader of raw batches (what :func:`streamload.watch` looks through).
        ahead: Whether one batch is taken and decoded ahead.
    """

    def __init__(self, decode: DeviceDecode, loader: Iterable[RawBatch], ahead: bool = True) -> None:
        self.decode = decode
        self.loader = loader
        self.ahead = ahead

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        decode = self.decode
        it = iter(self.loader)
        if not self.ahead:
            for raw in it:
                yield decode(raw)
            return
        try:
            pending = decode.start(next(it))
        except StopIteration:
            return
        for raw in it:
            upcoming = decode.start(raw)  # queued before the caller gets the current one
            current = decode.finish(pending)
            pending = upcoming
            yield current
        yield decode.finish(pending)

    def device_stage_seconds(self) -> dict[str, float]:
        """The decode's device stage seconds (see :meth:`DeviceDecode.device_stage_seconds`)."""
        return self.decode.device_stage_seconds()

    def __getattr__(self, name: str) -> Any:  # set_epoch, state_dict... of the loader
        if name in ("decode", "loader", "ahead"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"DeviceBatches({self.decode!r}, {self.loader!r})"


# -- arguments -------------------------------------------------------------------------


def _size(size: Any) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) and not isinstance(size, bool) else size
    if (
        not isinstance(pair, tuple | list)
        or len(pair) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)
    ):
        raise ConfigError(f"DeviceDecode(size={size!r}) must be a positive int or a (height, width) pair of them")
    return int(pair[0]), int(pair[1])


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"DeviceDecode({name}={value!r}) must be True or False")


def _range(name: str, value: Any, upper: float | None = None) -> None:
    ok = (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        and 0 < value[0] <= value[1]
        and (upper is None or value[1] <= upper)
    )
    if not ok:
        bound = f" <= {upper}" if upper is not None else ""
        raise ConfigError(f"DeviceDecode({name}={value!r}) must be a pair (low, high) with 0 < low <= high{bound}")


def _normalization(
    mean: Sequence[float] | None, std: Sequence[float] | None, dtype: torch.dtype | None
) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None, torch.dtype]:
    if (mean is None) != (std is None):
        raise ConfigError(f"DeviceDecode(mean={mean!r}, std={std!r}): give both or neither")
    if dtype is not None and dtype != torch.uint8 and dtype not in _FLOAT_DTYPES:
        raise ConfigError(f"DeviceDecode(dtype={dtype!r}) must be torch.uint8 or a float dtype")
    if mean is None or std is None:
        return None, None, torch.uint8 if dtype is None else dtype
    values = []
    for name, given in (("mean", mean), ("std", std)):
        try:
            triple = tuple(float(v) for v in given)
        except (TypeError, ValueError):
            triple = ()
        if len(triple) != 3 or not all(np.isfinite(triple)) or (name == "std" and min(triple) <= 0):
            positive = ", > 0" if name == "std" else ""
            raise ConfigError(f"DeviceDecode({name}={given!r}) must be three finite numbers (0-1 scale){positive}")
        values.append(triple)
    if dtype == torch.uint8:
        raise ConfigError("DeviceDecode(mean=..., std=...) gives float images: dtype=torch.uint8 cannot hold them")
    return values[0], values[1], torch.float32 if dtype is None else dtype


def _parse_device(device: Any) -> torch.device:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"DeviceDecode(device={device!r}) is not a device: {exc}") from exc
    if parsed.type not in ("cuda", "cpu"):
        raise ConfigError(f"DeviceDecode(device={device!r}) must be 'cuda', 'cuda:N' or 'cpu'")
    if parsed.type == "cuda" and parsed.index is None and torch.cuda.is_available():
        local = os.environ.get("LOCAL_RANK")
        if local is not None and local.isdigit() and int(local) < torch.cuda.device_count():
            return torch.device("cuda", int(local))
        return torch.device("cuda", torch.cuda.current_device())
    return parsed
