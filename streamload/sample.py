"""The sample model: a ``dict`` of a key and named byte fields (``docs/design.md#sample-model``).

``{"__key__": str, "<field>": bytes, ...}``, each field named by its WebDataset extension
(``"jpg"``, ``"png"``, ``"cls"``, ``"json"``...). Every format stores and returns exactly
these dicts; decoding is a separate, optional step (:mod:`streamload.decode`). This module
holds the few facts about fields that the formats, batches and decoders share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._errors import SampleError

__all__ = ["IMAGE_FIELDS", "Sample", "image_field", "label_of", "parse_label"]

#: A sample: ``{"__key__": str, field: bytes, ...}``.
Sample = dict[str, Any]

#: Field names (file extensions) holding encoded images, in order of preference.
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")


#: Labels must fit an ``int64`` tensor.
_LABEL_RANGE = (-(2**63), 2**63 - 1)


def parse_label(data: bytes | bytearray | memoryview) -> int:
    """Parse an ASCII-decimal label (WebDataset's ``cls`` encoding).

    Raises:
        ValueError: If the bytes are not a decimal integer that fits in 64 bits.
    """
    raw = bytes(data).strip()
    if len(raw) > 20:
        raise ValueError(f"label of {len(raw)} characters does not fit in 64 bits")
    value = int(raw.decode("ascii"))
    if not _LABEL_RANGE[0] <= value <= _LABEL_RANGE[1]:
        raise ValueError(f"label {value} does not fit in 64 bits")
    return value


def label_of(sample: Mapping[str, Any], field: str = "cls") -> int:
    """Return the integer label stored in ``field`` (ASCII decimal, WebDataset's encoding).

    Raises:
        SampleError: Naming the key, if the field is missing or not an integer.
    """
    try:
        return parse_label(sample[field])
    except KeyError as exc:
        raise SampleError(f"sample {sample.get('__key__')!r} has no {field!r} field") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise SampleError(f"sample {sample.get('__key__')!r} field {field!r} is not an integer") from exc


def image_field(sample: Mapping[str, Any]) -> str:
    """Return the name of the sample's image field (the first of :data:`IMAGE_FIELDS` present).

    Raises:
        SampleError: If the sample has no image field.
    """
    for name in IMAGE_FIELDS:
        if name in sample:
            return name
    raise SampleError(f"sample {sample.get('__key__')!r} has no image field (fields: {sorted(sample)})")
