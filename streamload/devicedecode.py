"""``DeviceDecode``: decode a batch of JPEG bytes on the GPU, with the CPU path's crops and flips.

The DataLoader workers (or the :class:`~streamload.Loader`'s threads) only read bytes
(``collate=RawCollate()``: one ``uint8`` tensor per batch, never touching CUDA); the
training process turns each :class:`~streamload.batch.RawBatch` into images on its GPU::

    host      headers    width, height of each JPEG (its frame header, no pixels)
              geometry   each sample's box and flip: ImageDecoder.box + one draw, from
                         sample_generator(seed, epoch, position), as DecodeBatch draws them
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
from ._jpeghead import jpeg_head
from .batch import RawBatch
from .decode import DEFAULT_MAX_PIXELS, ImageDecoder, SharedCount, _cannot_decode, _report
from .decode.image import Backend, Crop, check_pixels
from .randomness import sample_generator
from .sample import image_warnings

__all__ = ["DeviceBatches", "DeviceDecode", "batch_geometry"]

_log = logging.getLogger("streamload.decode")

#: What ``pip install`` brings the GPU decoders (the extra), and what torchvision needs.
_INSTALL = (
    "pip install 'streamload[gpu]' (nvImageCodec, the GPU's JPEG engine), or a torchvision built for "
    "your CUDA torch (nvJPEG on the SMs; from the index your torch came from)"
)

_DECODERS = ("auto", "hardware", "nvjpeg")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def batch_geometry(
    decoder: ImageDecoder, sizes: Sequence[tuple[int, int]], places: np.ndarray | None, seed: int
) -> tuple[list[tuple[float, float, float, float]], list[bool]]:
    """Each sample's source box and flip, exactly as :class:`~streamload.decode.DecodeBatch` draws them.

    The box is :meth:`ImageDecoder.box` of the image's size; the flip is one more draw of
    the same generator (``random() < 0.5``, after the box's draws, as the decoder makes
    it). The generator of sample ``i`` is :func:`streamload.sample_generator` of
    ``(seed, *places[i])``.

    Args:
        decoder: The CPU decoder whose crop settings apply.
        sizes: ``(width, height)`` of each image.
        places: ``int64[B, 2]`` ``(epoch, position)`` per sample; may be ``None`` only
            when nothing is random (a center crop without flips).
        seed: The crops' seed.

    Raises:
        ConfigError: If the crops or flips are random and ``places`` is ``None``.
    """
    random = decoder.crop == "random" or decoder.flip
    if random and places is None:
        raise ConfigError(_NO_PLACES)
    boxes: list[tuple[float, float, float, float]] = []
    flips: list[bool] = []
    for i, (width, height) in enumerate(sizes):
        rng = _generator(places, i, seed) if random else None
        boxes.append(decoder.box(width, height, rng))
        flips.append(bool(decoder.flip and rng is not None and rng.random() < 0.5))
    return boxes, flips


_NO_PLACES = (
    "the batch carries no sample places (epoch, position), and random crops or flips are drawn from them: "
    "read it with StreamingDataset(collate=RawCollate()) (places=True, the default)"
)


def _generator(places: np.ndarray | None, i: int, seed: int) -> np.random.Generator:
    assert places is not None
    epoch, position = int(places[i, 0]), int(places[i, 1])
    return sample_generator({"__epoch__": epoch, "__position__": position}, seed)


class DeviceDecode:
    """Decode :class:`~streamload.batch.RawBatch` batches of JPEGs on the GPU: ``(images, labels)``.

    Apply it in the training process to the batches of ``collate=RawCollate()``, read by
    DataLoader workers or a :class:`~streamload.Loader` (they only read bytes)::

        ds = StreamingDataset(url, batch_size=256, shuffle=True, collate=RawCollate())
        decode = DeviceDecode(224, crop="random", flip=True, mean=MEAN, std=STD, channels_last=True)
        for images, labels in decode.iterate(DataLoader(ds, batch_size=None, num_workers=4)):
            ...                                  # the next batch is decoded meanwhile

    Each sample's crop box and flip are the CPU path's (:class:`~streamload.decode.DecodeBatch`
    with the same settings): drawn from :func:`streamload.sample_generator` keyed by
    ``(seed, epoch, position)``, which the raw batch carries (:attr:`RawBatch.places`). So a
    run keeps its crops across ranks, workers, resumes, and between the CPU and the GPU.
    With ``device="cpu"`` the images are exactly ``DecodeBatch``'s.

    On CUDA the decoder is chosen once, reported by ``repr`` and :attr:`decoder_name`:
    nvImageCodec's hardware decoder (the GPU's JPEG engines, no SMs used) where the GPU has
    one, else nvJPEG on the SMs through ``torchvision.io.decode_jpeg``. Crop and resize run
    batched on the GPU (Pillow's bilinear filter, not bit-identical to the CPU path's
    DCT-scaled decode: see ``docs/gpu.md``). JPEGs the GPU decoder refuses (CMYK, 12-bit,
    arithmetic-coded, lossless, or refused at decode) and other formats are decoded on the
    CPU for that batch, with the same boxes, and counted in :attr:`fallbacks`.

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

    Raises:
        ConfigError: For an argument out of range, or ``device="cuda"`` without CUDA or
            without a GPU decoder installed (the message says what to install).

    Attributes:
        fallbacks: Images decoded on the CPU instead of the GPU decoder (a
            :class:`~streamload.decode.SharedCount`; always 0 with ``device="cpu"``).
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
    ) -> None:
        self.height, self.width = _size(size)
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
        self.warnings = 0
        self._gpu: _Gpu | None = None
        self._clock = _StageClock()
        if self.device.type == "cuda":
            self._gpu = _Gpu.open(self.device, decoder)  # a ConfigError now, not at the first batch

    # -- what it is ----------------------------------------------------------------

    @property
    def decoder_name(self) -> str:
        """The decoder that runs: ``"nvimgcodec-hardware"``, ``"nvjpeg"`` or ``"cpu"``.

        ``"nvimgcodec-hardware+nvjpeg"``: the hardware decoder, nvJPEG taking the JPEGs it refuses.
        """
        if self._gpu is None and self.device.type == "cuda":
            self._gpu = _Gpu.open(self.device, self.decoder)
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
        state["_clock"] = None  # a lock, and CUDA events of this process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # the GPU decoder is opened at the first batch of this process
        self._clock = _StageClock()

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
            gpu = self._gpu = _Gpu.open(self.device, self.decoder)
        if gpu is None:
            start = perf_counter()
            out = self._decode_cpu(batch)
            self._clock.add(perf_counter() - start)
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
        """Seconds spent in the ``decode`` stage so far: CUDA-event time of the device work, or CPU time.

        What :func:`streamload.watch` reports as the ``decode`` stage of a loader fed
        through :meth:`iterate`. On CUDA the events are read when they have completed
        (no synchronization); a batch still in flight counts at its next call.
        """
        return {"decode": self._clock.seconds()}

    def to(self, device: str | torch.device) -> DeviceDecode:
        """The same decode on ``device`` (its own decoder and stream; counts and stage time shared).

        What :class:`~streamload.lightning.StreamingDataModule` does with the trainer's
        device, so one ``DeviceDecode`` made before the ranks exist serves each rank's GPU.

        Raises:
            ConfigError: As the constructor's ``device=``.
        """
        target = _parse_device(device)
        if target == self.device:
            return self
        moved = copy.copy(self)
        moved.device = target
        moved._gpu = _Gpu.open(target, self.decoder) if target.type == "cuda" else None
        return moved

    def _decode_cpu(self, batch: RawBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every image on the CPU, exactly as :class:`DecodeBatch` decodes it."""
        n = batch.batch_size
        buffer = torch.empty((n, self.height, self.width, 3), dtype=torch.uint8)
        places = self._places(batch)
        self.decode_on_cpu(batch, range(n), buffer.numpy(), places)
        images = self._finish_images(buffer.permute(0, 3, 1, 2))
        labels = None if batch.labels is None else batch.labels.to(self.device)
        return images, labels

    def _places(self, batch: RawBatch) -> np.ndarray | None:
        random = self.crop == "random" or self.flip
        places = None if batch.places is None else batch.places.cpu().numpy()
        if random and places is None:
            raise ConfigError(_NO_PLACES)
        return places

    def decode_on_cpu(self, batch: RawBatch, which: Iterable[int], out: np.ndarray, places: np.ndarray | None) -> None:
        """Decode samples ``which`` of ``batch`` into ``out[k]`` (``[len, H, W, 3]``) with the CPU decoder."""
        decode_into = self.cpu.decode_into
        random = self.crop == "random" or self.flip
        data = batch.data if batch.data.device.type == "cpu" else batch.data.cpu()
        bounds = batch.offsets.tolist()
        for k, i in enumerate(which):
            raw = data[bounds[i] : bounds[i + 1]].numpy()
            name = _name(batch, i)
            found: list[str] = []
            try:
                with image_warnings(raw) as found:
                    decode_into(raw, out[k], _generator(places, i, self.seed) if random else None, name=name)
            except Exception as exc:
                raise _cannot_decode({"__key__": name}, "image", exc, found) from exc
            if found:
                self.warnings += _report({"__key__": name}, "image", found)

    def _finish_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW (channels-last view or not) -> the asked dtype, normalization and memory format."""
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.dtype == torch.uint8:
            return images.contiguous(memory_format=fmt)
        out = images.to(dtype=torch.float32, memory_format=fmt).div_(255.0)
        if self.mean is not None and self.std is not None:
            mean = torch.tensor(self.mean, dtype=torch.float32, device=out.device).view(1, 3, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32, device=out.device).view(1, 3, 1, 1)
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


def _name(batch: RawBatch, i: int) -> str:
    if batch.keys is not None:
        return batch.keys[i]
    if batch.places is not None:
        return f"#{i} of the batch (epoch {int(batch.places[i, 0])}, position {int(batch.places[i, 1])})"
    return f"#{i} of the batch"


# -- the GPU ---------------------------------------------------------------------------


class _Gpu:
    """A device's batched decode: its JPEG decoder, its CUDA stream and its timing events.

    ``decode`` takes a list of encoded JPEGs (``uint8`` host arrays) and the stream, and
    returns per image ``(tensor, "CHW" | "HWC")`` on the device, or ``None`` for an image
    it refused. Everything after it (resize, flips, fallbacks, assembly) is the same code
    on any device; on a device without streams (a CPU stand-in) the work runs in place.
    """

    def __init__(self, device: torch.device, name: str, decode: Any, retry: Any = None) -> None:
        self.device = device
        self.name = name
        self._decode = decode
        #: A second GPU decoder for the images the first refused (the hardware decoder takes
        #: no progressive JPEGs, for one): nvJPEG on the SMs, when it loads.
        self._retry = retry
        self.stream: Any = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @classmethod
    def open(cls, device: torch.device, choice: str) -> _Gpu:
        """The decoder of ``device`` (``choice``: auto, hardware, nvjpeg).

        Raises:
            ConfigError: Without CUDA, or without the decoder asked for (or any).
        """
        if not torch.cuda.is_available():
            raise ConfigError(
                f"DeviceDecode(device={str(device)!r}) needs a CUDA GPU and a CUDA build of torch, and torch "
                f"{torch.__version__} sees none; use device='cpu' (DecodeBatch's decode) or install a CUDA "
                f"torch and then {_INSTALL}"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"DeviceDecode(device={str(device)!r}): this process sees {torch.cuda.device_count()} GPU(s)"
            )
        tried: list[str] = []
        if choice in ("auto", "hardware"):
            hardware = _nvimgcodec_hardware(device, tried)
            if hardware is not None:
                retry = _torchvision_nvjpeg(device, []) if choice == "auto" else None
                return cls(device, "nvimgcodec-hardware" + ("+nvjpeg" if retry is not None else ""), hardware, retry)
        if choice in ("auto", "nvjpeg"):
            nvjpeg = _torchvision_nvjpeg(device, tried)
            if nvjpeg is not None:
                return cls(device, "nvjpeg", nvjpeg)
        found = "; ".join(tried)
        raise ConfigError(f"DeviceDecode(decoder={choice!r}) found no GPU JPEG decoder ({found}): {_INSTALL}")

    def start(self, owner: DeviceDecode, batch: RawBatch) -> Any:
        """Queue the batch's decode (on the decode stream); return what :meth:`finish` hands over."""
        stream = self.stream
        if stream is None:
            begun = perf_counter()
            images, labels = self._work(owner, batch)
            owner._clock.add(perf_counter() - begun)
            return images, labels, None
        if batch.data.is_cuda:  # copied to the GPU by a loader: back to the host, on the stream that copied it
            batch = batch.to("cpu")
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        # Nothing read back from the device below: this thread queues the work and returns.
        with torch.cuda.stream(stream):
            begin.record(stream)
            images, labels = self._work(owner, batch)
            end.record(stream)
        owner._clock.pending(begin, end)
        return images, labels, end

    def _work(self, owner: DeviceDecode, batch: RawBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        from ._resample import resample_boxes

        places = owner._places(batch)
        n = batch.batch_size
        data = batch.data if batch.data.device.type == "cpu" else batch.data.cpu()
        bounds = batch.offsets.tolist()
        raws = [data[bounds[i] : bounds[i + 1]].numpy() for i in range(n)]
        heads = [jpeg_head(raw) for raw in raws]
        gpu = [i for i, head in enumerate(heads) if head is not None and head.gpu_decodable]
        sizes = []
        for i in gpu:
            head = heads[i]
            assert head is not None
            try:
                check_pixels(head.width, head.height, owner.max_pixels)
            except SampleError as exc:
                raise SampleError(f"sample {_name(batch, i)!r}: {exc}") from exc
            sizes.append((head.width, head.height))
        boxes, flips = batch_geometry(owner.cpu, sizes, None if places is None else places[gpu], owner.seed)
        out = torch.empty((n, 3, owner.height, owner.width), dtype=torch.uint8, device=self.device)
        decoded: Decoded = self._decode([raws[i] for i in gpu], self.stream) if gpu else []
        refused = [k for k, image in enumerate(decoded) if image is None]
        if refused and self._retry is not None:
            for k, image in zip(refused, self._retry([raws[gpu[k]] for k in refused], self.stream), strict=True):
                decoded[k] = image
        pairs = [(k, image) for k, image in enumerate(decoded) if image is not None]
        taken = [k for k, _ in pairs]
        if taken:
            images = [image for _, (image, _) in pairs]
            layouts = [layout for _, (_, layout) in pairs]
            resized = resample_boxes(images, layouts, [boxes[k] for k in taken], (owner.height, owner.width))
            flipped = _host_to(torch.tensor([flips[k] for k in taken]), self.device)
            resized = torch.where(flipped[:, None, None, None], resized.flip(-1), resized)
            out[_host_to(torch.tensor([gpu[k] for k in taken]), self.device)] = resized
        on_cpu = sorted(set(range(n)) - {gpu[k] for k in taken})
        if on_cpu:  # not a JPEG the decoder takes, or refused by it: the CPU path, the same box
            host = torch.empty((len(on_cpu), owner.height, owner.width, 3), dtype=torch.uint8)
            if self.device.type == "cuda":
                host = host.pin_memory()
            owner.decode_on_cpu(batch, on_cpu, host.numpy(), places)
            owner.fallbacks.add(len(on_cpu))
            if _FALLBACK_LOGGED():
                _log.warning(
                    "DeviceDecode: %d of %d images of a batch decoded on the CPU (not JPEGs the %s decoder "
                    "takes, or refused by it); later ones are counted in .fallbacks, not logged",
                    len(on_cpu),
                    n,
                    self.name,
                )
            moved = host.to(self.device, non_blocking=True).permute(0, 3, 1, 2)
            out[_host_to(torch.tensor(on_cpu), self.device)] = moved
        labels = None if batch.labels is None else batch.labels.to(self.device, non_blocking=True)
        return owner._finish_images(out), labels

    def finish(self, owner: DeviceDecode, pending: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The current stream waits for the batch's decode; its tensors are marked as used by it."""
        images, labels, done = pending
        if done is None:
            return images, labels
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        images.record_stream(compute)
        if labels is not None:
            labels.record_stream(compute)
        return images, labels


def _host_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a synchronizing copy (pageable memory is staged)."""
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


class _Once:
    def __init__(self) -> None:
        self.done = False

    def __call__(self) -> bool:
        first, self.done = not self.done, True
        return first


_FALLBACK_LOGGED = _Once()

Decoded = list[tuple[torch.Tensor, str] | None]


def _nvimgcodec_hardware(device: torch.device, tried: list[str]) -> Any:
    """The hardware JPEG decoder of nvImageCodec on ``device``, or ``None`` (why appended to ``tried``)."""
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        tried.append(f"nvImageCodec not importable: {exc}")
        return None
    try:
        backend = nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)
        decoder = nvimgcodec.Decoder(device_id=device.index or 0, backends=[backend])
        params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.RGB)
    except Exception as exc:  # noqa: BLE001 - a GPU without JPEG engines, a missing libnvjpeg
        tried.append(f"nvImageCodec's hardware decoder unavailable: {exc}")
        return None

    def one(raw: np.ndarray, stream: Any) -> Any:
        try:
            return decoder.decode([raw], params=params, cuda_stream=stream.cuda_stream)[0]
        except Exception:  # noqa: BLE001 - refused: the CPU decodes it
            return None

    def decode(raws: list[np.ndarray], stream: Any) -> Decoded:
        try:
            images = decoder.decode(raws, params=params, cuda_stream=stream.cuda_stream)
        except Exception:  # noqa: BLE001 - a refusal failing the whole call: image by image
            images = [one(raw, stream) for raw in raws]
        out: Decoded = []
        for image in images:
            if image is None:
                out.append(None)
                continue
            tensor = torch.as_tensor(image, device=device)
            out.append((tensor, "HWC" if tensor.shape[-1] in (1, 3) else "CHW"))
        return out

    return decode


def _torchvision_nvjpeg(device: torch.device, tried: list[str]) -> Any:
    """The batched nvJPEG decode of torchvision on ``device``, or ``None`` (why appended to ``tried``)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as exc:  # noqa: BLE001 - ImportError, or a torchvision built for another torch
        tried.append(f"torchvision not importable: {exc}")
        return None

    def one(raw: np.ndarray) -> tuple[torch.Tensor, str] | None:
        try:
            image = decode_jpeg(torch.from_numpy(raw), mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            return None
        return image, "CHW"

    def decode(raws: list[np.ndarray], stream: Any) -> Decoded:
        tensors = [torch.from_numpy(raw) for raw in raws]
        try:
            images = decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one refused image fails the batch call: find it image by image
            return [one(raw) for raw in raws]
        return [(image, "CHW") for image in images]

    return decode


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
