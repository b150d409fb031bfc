"""The GPU side of :class:`~streamload.DeviceDecode`: its decoders, stream, and a batch's geometry.

``GpuDecoder.start`` runs, for one :class:`~streamload.batch.RawBatch`: each JPEG's frame
header (``_jpeghead``), each sample's box and flip (:func:`batch_geometry`, the CPU path's
draws), the device decoder (nvImageCodec's hardware decoder, or nvJPEG through
torchvision), the batched crop and resize (``_resample``), the flips, and the CPU decode
of whatever the device decoders did not take, all queued on the decoder's own CUDA
stream. The same code runs on a CPU "device" with a stand-in decoder (what the tests do
on a machine without a GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from time import perf_counter
from typing import Any, Protocol

import numpy as np
import torch

from ._errors import ConfigError, SampleError
from ._jpeghead import jpeg_head
from .batch import RawBatch
from .decode import ImageDecoder
from .decode.image import check_pixels
from .randomness import sample_generator


class DecodeOwner(Protocol):
    """What the GPU side asks of its :class:`~streamload.DeviceDecode` (no import: it imports this module)."""

    height: int
    width: int
    seed: int
    max_pixels: int | None
    on_error: str
    cpu: ImageDecoder
    fallbacks: Any
    stage_clock: Any

    def places_of(self, batch: RawBatch) -> np.ndarray | None:
        """The batch's ``(epoch, position)`` rows."""

    def decode_on_cpu(
        self, batch: RawBatch, which: Iterable[int], out: np.ndarray, places: np.ndarray | None
    ) -> list[int]:
        """Decode samples ``which`` into ``out`` on the CPU; return those skipped."""

    def skip(self, name: str, error: BaseException) -> None:
        """Count and log a skipped sample."""

    def shape_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW to the asked dtype and memory format."""


__all__ = [
    "INSTALL",
    "NO_PLACES",
    "Decoded",
    "GpuDecoder",
    "batch_geometry",
    "fill_slots",
    "generator_of",
    "sample_name",
]

_log = logging.getLogger("streamload.decode")

#: What ``pip install`` brings the GPU decoders (the extra), and what torchvision needs.
INSTALL = (
    "pip install 'streamload[gpu]' (nvImageCodec, the GPU's JPEG engine), or a torchvision built for "
    "your CUDA torch (nvJPEG on the SMs; from the index your torch came from)"
)


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
        raise ConfigError(NO_PLACES)
    boxes: list[tuple[float, float, float, float]] = []
    flips: list[bool] = []
    for i, (width, height) in enumerate(sizes):
        rng = generator_of(places, i, seed) if random else None
        boxes.append(decoder.box(width, height, rng))
        flips.append(bool(decoder.flip and rng is not None and rng.random() < 0.5))
    return boxes, flips


NO_PLACES = (
    "the batch carries no sample places (epoch, position), and random crops or flips are drawn from them: "
    "read it with StreamingDataset(collate=RawCollate()) (places=True, the default)"
)


def generator_of(places: np.ndarray | None, i: int, seed: int) -> np.random.Generator:
    assert places is not None
    epoch, position = int(places[i, 0]), int(places[i, 1])
    return sample_generator({"__epoch__": epoch, "__position__": position}, seed)


def fill_slots(images: torch.Tensor, labels: torch.Tensor | None, bad: list[int]) -> torch.Tensor | None:
    """Under ``on_error="skip"``: each bad slot (image and label) a repeat of a good sample of the batch.

    The last good sample before it, else the first after it: ``DecodeBatch``'s rule. The
    images are filled in place; the labels are returned (a copy, when any is filled).

    Raises:
        SampleError: If no sample of the batch could be decoded.
    """
    skipped = set(bad)
    good = [i for i in range(images.shape[0]) if i not in skipped]
    if not good:
        raise SampleError(f"every one of the {images.shape[0]} images of this batch failed to decode")
    source = [max((j for j in good if j < i), default=good[0]) for i in bad]
    into = torch.tensor(bad).to(images.device, non_blocking=True)
    take = torch.tensor(source).to(images.device, non_blocking=True)
    images[into] = images[take]
    if labels is None:
        return None
    labels = labels.clone()
    labels[into] = labels[take]
    return labels


def sample_name(batch: RawBatch, i: int) -> str:
    if batch.keys is not None:
        return batch.keys[i]
    if batch.places is not None:
        return f"#{i} of the batch (epoch {int(batch.places[i, 0])}, position {int(batch.places[i, 1])})"
    return f"#{i} of the batch"


# -- the GPU ---------------------------------------------------------------------------


class GpuDecoder:
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
    def open(cls, device: torch.device, choice: str) -> GpuDecoder:
        """The decoder of ``device`` (``choice``: auto, hardware, nvjpeg).

        Raises:
            ConfigError: Without CUDA, or without the decoder asked for (or any).
        """
        if not torch.cuda.is_available():
            raise ConfigError(
                f"DeviceDecode(device={str(device)!r}) needs a CUDA GPU and a CUDA build of torch, and torch "
                f"{torch.__version__} sees none; use device='cpu' (DecodeBatch's decode) or install a CUDA "
                f"torch and then {INSTALL}"
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
        raise ConfigError(f"DeviceDecode(decoder={choice!r}) found no GPU JPEG decoder ({found}): {INSTALL}")

    def start(self, owner: DecodeOwner, batch: RawBatch) -> Any:
        """Queue the batch's decode (on the decode stream); return what :meth:`finish` hands over."""
        stream = self.stream
        if stream is None:
            begun = perf_counter()
            images, labels = self._work(owner, batch)
            owner.stage_clock.add(perf_counter() - begun)
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
        owner.stage_clock.pending(begin, end)
        return images, labels, end

    def _work(self, owner: DecodeOwner, batch: RawBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        from ._resample import resample_boxes

        places = owner.places_of(batch)
        n = batch.batch_size
        data = batch.data if batch.data.device.type == "cpu" else batch.data.cpu()
        bounds = batch.offsets.tolist()
        raws = [data[bounds[i] : bounds[i + 1]].numpy() for i in range(n)]
        heads = [jpeg_head(raw) for raw in raws]
        candidates = [i for i, head in enumerate(heads) if head is not None and head.gpu_decodable]
        gpu: list[int] = []
        bad: list[int] = []  # skipped (on_error="skip")
        sizes = []
        for i in candidates:
            head = heads[i]
            assert head is not None
            try:
                check_pixels(head.width, head.height, owner.max_pixels)
            except SampleError as exc:
                error = SampleError(f"sample {sample_name(batch, i)!r}: {exc}")
                if owner.on_error == "raise":
                    raise error from exc
                owner.skip(sample_name(batch, i), error)
                bad.append(i)
                continue
            gpu.append(i)
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
        on_cpu = sorted(set(range(n)) - {gpu[k] for k in taken} - set(bad))
        if on_cpu:  # not a JPEG the decoder takes, or refused by it: the CPU path, the same box
            host = torch.empty((len(on_cpu), owner.height, owner.width, 3), dtype=torch.uint8)
            if self.device.type == "cuda":
                host = host.pin_memory()
            failed = owner.decode_on_cpu(batch, on_cpu, host.numpy(), places)
            bad.extend(failed)
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
        if bad:
            labels = fill_slots(out, labels, sorted(bad))
        return owner.shape_images(out), labels

    def finish(self, owner: DecodeOwner, pending: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
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
