"""ASCII-decimal labels (WebDataset's ``cls``) read back to back into one buffer, parsed at once."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ._errors import SampleError
from .sample import parse_label

__all__ = ["parse_labels"]


def parse_labels(
    raw: np.ndarray, offsets: np.ndarray, keys: Callable[[int], str], field: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Parse ASCII-decimal labels (WebDataset's ``cls``) stored back to back in ``raw`` (into ``out``)."""
    if out is None:  # numpy's memory, not torch.empty: a torch op lets go of the GIL
        out = torch.from_numpy(np.empty(len(offsets) - 1, dtype=np.int64))
    values = out.numpy()
    if _digits_only(raw, offsets, values):
        return out
    blob = raw.tobytes()
    for i in range(len(values)):
        try:
            values[i] = parse_label(blob[offsets[i] : offsets[i + 1]])
        except (ValueError, UnicodeDecodeError) as exc:
            raise SampleError(f"sample {keys(i)!r} field {field!r} is not an integer label") from exc
    return out


#: Powers of ten of the digits of a label of up to 18 digits (below 2**63: no overflow).
_POWERS = 10 ** np.arange(17, -1, -1, dtype=np.int64)


def _digits_only(raw: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> bool:
    """Parse labels of 1 to 18 plain digits at once into ``values``; ``False``: some label is not (parse each)."""
    n = len(offsets) - 1
    if n == 0:
        return True
    lengths = np.diff(offsets)
    if int(lengths.min()) < 1 or int(lengths.max()) > 18:
        return False
    digits = raw[int(offsets[0]) : int(offsets[-1])].astype(np.int64) - 48
    if int(digits.min()) < 0 or int(digits.max()) > 9:
        return False
    # each digit times ten to the power of its place from its label's end
    place = np.repeat(offsets[1:] - offsets[0], lengths) - np.arange(len(digits)) - 1
    # each label's sum as a difference of running sums (int64 wraps, and the differences,
    # each a label below 2**63, come out exact); not np.add.reduceat, which lets go of the
    # GIL (a wait beside a thread running Python)
    sums = np.zeros(len(digits) + 1, dtype=np.int64)
    np.cumsum(digits * _POWERS[17 - place], out=sums[1:])
    values[:] = sums[offsets[1:] - offsets[0]] - sums[offsets[:-1] - offsets[0]]
    return True
