"""Overlap host-to-device copies with compute: a one-batch-ahead device prefetcher.

While the model works on batch ``n`` (on the current CUDA stream), batch ``n + 1`` is
already being copied on a side stream::

    side stream     copy n+1 (pinned -> device, non_blocking)   copy n+2 ...
    compute stream            wait(n+1) | forward/backward n+1 | ...

Two details make it correct: the compute stream waits on the side stream before it
touches a batch (``wait_stream``), and each device tensor is marked as used by the
compute stream (``record_stream``) so the caching allocator does not hand its memory to
the next copy while the compute stream may still read it. Host tensors are pinned first
when they are not already (``DataLoader(pin_memory=True)`` does it in a thread), since a
copy from pageable memory is synchronous.

On a machine without CUDA (or with ``device="cpu"``) the prefetcher passes batches
through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from ._errors import ConfigError
from .batch import ImageBatch, RawBatch

__all__ = ["DevicePrefetcher", "check_device", "to_device"]

T = TypeVar("T")


def to_device(batch: Any, device: torch.device, non_blocking: bool = True, pin: bool = True) -> Any:
    """Return ``batch`` with every tensor moved to ``device``, structure kept.

    Handles tensors, :class:`~streamload.batch.RawBatch`, :class:`~streamload.batch.ImageBatch`,
    named tuples, tuples, lists and dicts; anything else is returned as it is.
    """

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        if pin and device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=non_blocking)

    return _map(batch, move)


def _map(batch: Any, fn: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, RawBatch):
        labels = None if batch.labels is None else fn(batch.labels)
        return RawBatch(fn(batch.data), fn(batch.offsets), labels, batch.keys, places=batch.places)
    if isinstance(batch, ImageBatch):
        return ImageBatch(fn(batch.images), None if batch.labels is None else fn(batch.labels))
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(_map(x, fn) for x in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(x, fn) for x in batch)
    if isinstance(batch, Mapping):
        return {k: _map(v, fn) for k, v in batch.items()}
    return batch


def _record(batch: Any, stream: Any) -> None:
    """Mark every CUDA tensor of ``batch`` as used by ``stream`` (see the module docstring)."""

    def mark(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            t.record_stream(stream)
        return t

    _map(batch, mark)


class DevicePrefetcher(Generic[T]):
    """Iterate ``loader`` with each batch already on ``device``, copied one batch ahead.

    Args:
        loader: Any iterable of batches (a DataLoader, usually with ``pin_memory=True``).
        device: Target device (default: the current CUDA device, else CPU).
        non_blocking: Asynchronous copies (needs pinned host memory to overlap).

    Example:
        >>> loader = DataLoader(ds, batch_size=None, num_workers=8, pin_memory=True)  # doctest: +SKIP
        >>> for images, labels in DevicePrefetcher(loader):  # doctest: +SKIP
        ...     loss = model(images.float()).loss  # the next batch is being copied meanwhile
    """

    def __init__(
        self, loader: Iterable[T], device: torch.device | str | None = None, non_blocking: bool = True
    ) -> None:
        self.loader = loader
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.non_blocking = non_blocking

    @property
    def active(self) -> bool:
        """True if batches are copied on a side CUDA stream; False for a passthrough."""
        return self.device.type == "cuda" and torch.cuda.is_available()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        if not self.active:
            yield from self.loader
            return
        yield from self._iter_cuda()

    def _iter_cuda(self) -> Iterator[T]:
        side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        it = iter(self.loader)

        def start(batch: T) -> T:
            with torch.cuda.stream(side):
                moved: T = to_device(batch, self.device, self.non_blocking)
            return moved

        try:
            pending = start(next(it))
        except StopIteration:
            return
        for upcoming in it:
            current = self._hand_over(pending, side)
            pending = start(upcoming)  # the copy of n+1 runs while the caller computes on n
            yield current
        yield self._hand_over(pending, side)

    def _hand_over(self, batch: T, side: Any) -> T:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(side)
        _record(batch, compute)
        return batch


def check_device(device: torch.device | str | None, who: str) -> torch.device | None:
    """Return ``device`` as a ``torch.device``, checked to exist in this process (``who`` names the caller).

    Raises:
        ConfigError: If it is not a device name, or names an accelerator this process lacks.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{who}(device={device!r}) is not a device: {exc}") from None
    if dev.type == "cpu":
        return dev
    module = getattr(torch, dev.type, None)
    available = getattr(module, "is_available", None)
    try:
        present = bool(available()) if callable(available) else False
        count = int(getattr(module, "device_count", lambda: 0)()) if present else 0
    except Exception:  # noqa: BLE001 - a broken driver: not present
        present, count = False, 0
    if not present:
        raise ConfigError(
            f"{who}(device={device!r}): no {dev.type} device is available to this process "
            f"(torch {torch.__version__}); pass device=None (or 'cpu') and move batches yourself"
        )
    if dev.index is not None and count and dev.index >= count:
        raise ConfigError(f"{who}(device={device!r}): this process sees {count} {dev.type} device(s)")
    return dev
