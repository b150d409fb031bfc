"""The decode axis: how a sample's raw bytes become Python values and tensors.

Decoders are chosen by field name from a fixed table (:data:`FIELD_DECODERS`); nothing
read from a shard can select code to run (no pickle, no ``torch.load``, no eval).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .._errors import SampleError

__all__ = [
    "FIELD_DECODERS",
    "IMAGE_FIELDS",
    "ImageLabel",
    "decode_image",
    "decode_sample",
    "image_field",
    "label_of",
]

#: Field names (file extensions) holding encoded images.
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")


def _text(data: bytes) -> str:
    return bytes(data).decode("utf-8")


def _int(data: bytes) -> int:
    return int(bytes(data).decode("ascii").strip())


def _json(data: bytes) -> Any:
    return json.loads(bytes(data))


def decode_image(data: bytes, mode: str = "RGB") -> Any:
    """Decode image bytes to a Pillow image in ``mode`` (``"RGB"`` by default)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert(mode) if img.mode != mode else img.copy()


#: Field name -> decoder. Unknown fields stay bytes.
FIELD_DECODERS: Mapping[str, Callable[[bytes], Any]] = {
    "cls": _int,
    "cls2": _int,
    "index": _int,
    "txt": _text,
    "text": _text,
    "json": _json,
    **{name: decode_image for name in IMAGE_FIELDS},
}


def decode_sample(sample: Mapping[str, Any], fields: Mapping[str, Callable[[bytes], Any]] | None = None) -> dict[str, Any]:
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
        try:
            out[name] = decoder(value)
        except Exception as exc:
            raise SampleError(f"sample {sample.get('__key__')!r} field {name!r}: cannot decode: {exc}") from exc
    return out


def image_field(sample: Mapping[str, Any]) -> str:
    """Return the name of the sample's image field.

    Raises:
        SampleError: If the sample has no image field.
    """
    for name in IMAGE_FIELDS:
        if name in sample:
            return name
    raise SampleError(f"sample {sample.get('__key__')!r} has no image field (fields: {sorted(sample)})")


def label_of(sample: Mapping[str, Any], field: str = "cls") -> int:
    """Return the integer label stored in ``field`` (ASCII decimal, WebDataset's encoding)."""
    try:
        return _int(sample[field])
    except KeyError as exc:
        raise SampleError(f"sample {sample.get('__key__')!r} has no {field!r} field") from exc
    except ValueError as exc:
        raise SampleError(f"sample {sample.get('__key__')!r} field {field!r} is not an integer") from exc


class ImageLabel:
    """Transform a sample into ``(image, label)``: a ``uint8`` tensor (CHW, RGB) and an int.

    Decoding uses Pillow; when the image is much larger than ``size``, JPEG DCT scaling
    (``Image.draft``) decodes it at a reduced size first.

    Args:
        size: If given, resize the shorter side to ``size`` and center-crop to
            ``size x size``; otherwise keep the original size (batching then needs a
            custom collate).
        label_field: Field holding the label.

    Example:
        >>> ds = StreamingDataset("shards/", transform=ImageLabel(size=224))  # doctest: +SKIP
        >>> image, label = next(iter(ds))  # doctest: +SKIP
    """

    def __init__(self, size: int | None = None, label_field: str = "cls") -> None:
        self.size = size
        self.label_field = label_field

    def __call__(self, sample: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
        """Decode one sample."""
        from PIL import Image

        name = image_field(sample)
        try:
            with Image.open(io.BytesIO(sample[name])) as img:
                if self.size is not None and img.format == "JPEG":
                    img.draft("RGB", (self.size, self.size))
                img = img.convert("RGB")
                if self.size is not None:
                    img = _resize_center_crop(img, self.size)
                array = np.asarray(img)
        except Exception as exc:
            raise SampleError(f"sample {sample.get('__key__')!r} field {name!r}: cannot decode image: {exc}") from exc
        tensor = torch.from_numpy(array.copy()).permute(2, 0, 1)
        return tensor, label_of(sample, self.label_field)


def _resize_center_crop(img: Any, size: int) -> Any:
    from PIL import Image

    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))
