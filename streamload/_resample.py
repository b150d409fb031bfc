"""Crop and resize a batch of differently sized images in a fixed number of kernel launches.

:class:`~streamload.DeviceDecode` has, per batch, a list of decoded images (each its own
size, on the GPU) and a source box per image (the CPU path's random or center crop). Each
is to become one ``height x width`` output. Doing it per image (slice, ``F.interpolate``)
costs several kernel launches and a Python round trip per image; here the whole batch is
one flat buffer and every step is a gather or an elementwise kernel over the batch.

The filter is Pillow's ``BILINEAR`` resampling (what the CPU path's
``Image.resize(..., box=...)`` does): separable, a triangle filter whose support grows
with the downscale factor (so a large reduction averages, it does not alias), taps
clipped at the image edges and the weights renormalized, the horizontal pass first and
its result rounded to 8 bits, then the vertical pass. The weights are float32 where
Pillow's are 22-bit fixed point, so a pixel may differ from Pillow's by one level on a
tie; see ``docs/gpu.md`` for how the GPU output relates to the CPU path's.

Per chunk of images (sorted by the rows their boxes span, each chunk bounded in memory),
the work is ``K_x + K_y`` gathers and multiply-adds, ``K`` the filter's taps (3 for an
upscale, 5 for a reduction by 2, ``2 * ceil(scale) + 1`` in general): none per image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["resample_boxes"]

#: Elements of the largest intermediate (``images x 3 x rows x width``) of one chunk.
_CHUNK_ELEMENTS = 48 * 1024 * 1024


def _coefficients(
    starts: torch.Tensor, ends: torch.Tensor, sizes: torch.Tensor, out: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pillow's ``precompute_coeffs`` for a batch: first tap, tap count and weights per output pixel.

    Args:
        starts: ``float64[N]``, each box's start along the axis (source pixels).
        ends: ``float64[N]``, its end.
        sizes: ``float64[N]``, the source size along the axis.
        out: Output pixels along the axis.

    Returns:
        ``first`` (``int64[N, out]``), ``count`` (``int64[N, out]``) and the normalized
        ``weights`` (``float32[N, out, K]``, zero past ``count``).
    """
    device = starts.device
    scale = (ends - starts) / out
    filterscale = scale.clamp(min=1.0)
    support = filterscale  # bilinear: support 1, scaled by the reduction
    centers = starts[:, None] + (torch.arange(out, device=device, dtype=torch.float64) + 0.5)[None, :] * scale[:, None]
    first = torch.trunc(centers - support[:, None] + 0.5).clamp(min=0)
    last = torch.minimum(torch.trunc(centers + support[:, None] + 0.5), sizes[:, None])
    count = (last - first).clamp(min=0)
    taps = int(math.ceil(float(support.max()))) * 2 + 1 if len(support) else 1
    j = torch.arange(taps, device=device, dtype=torch.float64)
    x = first[..., None] + j
    weights = (1.0 - ((x - centers[..., None] + 0.5) / filterscale[:, None, None]).abs()).clamp(min=0.0)
    weights = torch.where(j < count[..., None], weights, torch.zeros((), dtype=torch.float64, device=device))
    total = weights.sum(-1, keepdim=True)
    weights = weights / torch.where(total == 0, torch.ones_like(total), total)
    return first.to(torch.int64), count.to(torch.int64), weights.to(torch.float32)


def resample_boxes(
    images: Sequence[torch.Tensor],
    layouts: Sequence[str],
    boxes: Sequence[tuple[float, float, float, float]],
    size: tuple[int, int],
) -> torch.Tensor:
    """Crop each image to its box and resize it to ``size``: ``uint8[N, 3, height, width]``.

    Args:
        images: ``uint8`` images on one device, each ``[3, H, W]`` (``"CHW"``),
            ``[H, W, 3]`` (``"HWC"``), or one channel (``[1, H, W]`` / ``[H, W, 1]``,
            repeated to three).
        layouts: ``"CHW"`` or ``"HWC"`` per image.
        boxes: ``(left, top, right, bottom)`` in source pixels per image (as Pillow's
            ``resize(box=...)`` takes it).
        size: Output ``(height, width)``.

    Returns:
        A contiguous ``uint8`` ``[N, 3, height, width]`` tensor on the images' device.
    """
    height, width = size
    n = len(images)
    if n == 0:
        return torch.empty((0, 3, height, width), dtype=torch.uint8)
    device = images[0].device
    flat = torch.cat([img.reshape(-1) for img in images])
    # The geometry is worked out on the host and sent along (no read-back from the device:
    # the caller's thread never waits for the decode queued before this).
    geometry = []  # base, H, W, row stride, column stride, channel stride
    base = 0
    for img, layout in zip(images, layouts, strict=True):
        if layout == "CHW":
            c, h, w = img.shape
            geometry.append((base, h, w, w, 1, h * w if c == 3 else 0))
        else:
            h, w, c = img.shape
            geometry.append((base, h, w, w * c, c, 1 if c == 3 else 0))
        base += img.numel()
    geo = torch.tensor(geometry, dtype=torch.int64)
    box = torch.tensor(boxes, dtype=torch.float64)
    x_first, _, x_weights = _coefficients(box[:, 0], box[:, 2], geo[:, 2].double(), width)
    y_first, y_count, y_weights = _coefficients(box[:, 1], box[:, 3], geo[:, 1].double(), height)
    row0 = y_first[:, 0]
    rows = (y_first[:, -1] + y_count[:, -1] - row0).clamp(min=1)  # source rows each image's vertical taps span
    out = torch.empty((n, 3, height, width), dtype=torch.uint8, device=device)
    for chunk in _chunks(rows.tolist(), width):
        index = torch.tensor(chunk, dtype=torch.int64)
        out[_to(index, device)] = _resample_chunk(
            flat,
            _to(geo[index], device),
            _to(x_first[index], device),
            _to(x_weights[index], device),
            _to(y_first[index], device),
            _to(y_weights[index], device),
            _to(row0[index], device),
            int(rows[index].max()),
        )
    return out


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, copied without waiting for the stream (a staged copy)."""
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _chunks(rows: list[int], width: int) -> list[list[int]]:
    """Images grouped (by the rows they span, ascending) so a chunk's intermediate stays bounded."""
    order = sorted(range(len(rows)), key=rows.__getitem__)
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * 3 * rows[i] * width > _CHUNK_ELEMENTS:
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks


def _resample_chunk(
    flat: torch.Tensor,
    geo: torch.Tensor,
    x_first: torch.Tensor,
    x_weights: torch.Tensor,
    y_first: torch.Tensor,
    y_weights: torch.Tensor,
    row0: torch.Tensor,
    rows: int,
) -> torch.Tensor:
    n = geo.shape[0]
    device = flat.device
    width = x_first.shape[1]
    base, h, w, row_stride, col_stride, chan_stride = (geo[:, k] for k in range(6))
    # The horizontal pass over the rows the vertical taps need: [n, 3, rows, width].
    r = torch.minimum(row0[:, None] + torch.arange(rows, device=device)[None, :], (h - 1)[:, None])
    row_at = base[:, None] + r * row_stride[:, None]  # [n, rows]
    chan_at = torch.arange(3, device=device)[None, :] * chan_stride[:, None]  # [n, 3]
    start = (row_at[:, None, :, None] + chan_at[:, :, None, None]).expand(n, 3, rows, width)
    across = torch.zeros((n, 3, rows, width), dtype=torch.float32, device=device)
    for j in range(x_weights.shape[2]):
        col = torch.minimum(x_first + j, (w - 1)[:, None]) * col_stride[:, None]  # [n, width]
        taken = flat.take(start + col[:, None, None, :]).to(torch.float32)
        across.addcmul_(taken, x_weights[:, None, None, :, j])
    across = torch.floor(across + 0.5).clamp_(0, 255)  # Pillow's 8-bit intermediate
    # The vertical pass: [n, 3, height, width].
    height = y_first.shape[1]
    down = torch.zeros((n, 3, height, width), dtype=torch.float32, device=device)
    for i in range(y_weights.shape[2]):
        at = (y_first - row0[:, None] + i).clamp(0, rows - 1)  # [n, height]
        taken = torch.gather(across, 2, at[:, None, :, None].expand(n, 3, height, width))
        down.addcmul_(taken, y_weights[:, None, :, i, None])
    return torch.floor(down + 0.5).clamp_(0, 255).to(torch.uint8)
