"""Checks of a table's rows while scanning: paths, labels, and the confinement to ``--root``.

Each check takes a block's column (an Arrow array, or a Python list for JSONL), marks the
rows that pass (NumPy bool) and records the others as problems named by their row. Whole
columns are checked with Arrow compute where their type allows, row by row otherwise.
"""

from __future__ import annotations

import os
import re
from typing import Any, Protocol

import numpy as np

from streamload.manifest import SkippedInput
from streamload.sample import IMAGE_EXTENSIONS
from streamload.storage import is_local, local_path_of

__all__ = [
    "arrow",
    "check_labels",
    "check_paths",
    "ext_of",
    "inside",
    "int_label",
    "mask",
    "pylist",
    "root_of",
    "unusable",
    "Where",
]


class Where(Protocol):
    """Names a problem row for listings: ``where_of(row, path)``."""

    def __call__(self, row: int, path: str | None = None) -> str:
        """Return ``<table>: row <n>``, with the path when given."""
        ...


IMAGE_PATH = r"\.(?:" + "|".join(sorted(IMAGE_EXTENSIONS)) + r")/*$"
INT_TEXT = re.compile(r"-?[0-9]+")


def root_of(root: str) -> str:
    """``root`` as a resolved local directory (links resolved) or a URL prefix."""
    if is_local(root):
        return os.path.realpath(local_path_of(root))
    return root.rstrip("/")


def inside(path: str, root: str) -> bool:
    """True if ``path`` (resolved by :meth:`TableSource.resolve`) lies inside ``root`` (see :func:`root_of`)."""
    if "://" in root:
        if not path.startswith(root + "/"):
            return False
        # "%2e%2e" and other escapes stay as they are: a store reads them as names, not as "..".
        return all(part not in ("..", ".") for part in path[len(root) + 1 :].split("/"))
    if "://" in path and not path.startswith("file://"):
        return False
    real = os.path.realpath(local_path_of(path))
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def ext_of(path: str) -> str:
    """The extension of the last name in ``path``, lower case, without the dot (``""``: none)."""
    name = path.rstrip("/").rpartition("/")[2]
    return name.rpartition(".")[2].lower() if "." in name else ""


def int_label(value: Any) -> int | None:
    """The class index ``value`` spells (an int, or a string of decimal digits), else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        if INT_TEXT.fullmatch(text):
            return int(text)
    return None


def unusable(value: Any) -> str | None:
    """Why ``value`` cannot be a label (``None``: it can)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "no label"
    if isinstance(value, (bool, float, dict, list)):
        return f"label {value!r} is not usable"
    return None


def pylist(col: Any, lo: int = 0, hi: int | None = None) -> list[Any]:
    """A column (Arrow array or list) as a Python list of its rows ``[lo, hi)``."""
    if isinstance(col, list):
        return col[lo:hi]
    end = len(col) if hi is None else hi
    return list(col.slice(lo, end - lo).to_pylist())


def arrow(col: Any) -> Any:
    """``col`` as one Arrow array (chunks combined, dictionaries decoded), or ``None`` for a Python list."""
    import pyarrow as pa

    if isinstance(col, list):  # JSONL values: as Arrow only if all strings or all integers (or None)
        try:
            arr = pa.array(col)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
        t = arr.type
        return arr if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) else None
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    return col


def mask(array: Any) -> np.ndarray[Any, Any]:
    """A boolean Arrow array (nulls as false) as NumPy."""
    return np.asarray(array.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)


def check_paths(col: Any, first_row: int, n: int, problems: list[tuple[int, SkippedInput]], where_of: Where) -> Any:
    """Rows with a usable path (NumPy bool); the others are problems, named by ``where_of(row, path)``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = arrow(col)
    if arr is not None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        blank = mask(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0)) | null
        image = mask(pc.match_substring_regex(arr, IMAGE_PATH, ignore_case=True))
        nul = mask(pc.match_substring(arr, "\x00")) & ~blank
        for i in np.flatnonzero(blank).tolist():
            problems.append((first_row + i, SkippedInput(where_of(first_row + i), "no path")))
        for i in np.flatnonzero(nul).tolist():
            problems.append((first_row + i, SkippedInput(where_of(first_row + i), "the path holds a NUL byte")))
        image &= ~nul
        wrong = np.flatnonzero(~blank & ~image & ~nul)
        if len(wrong):
            for i, p in zip(wrong.tolist(), arr.take(pa.array(wrong)).to_pylist(), strict=True):
                where = where_of(first_row + i, str(p))
                problems.append((first_row + i, SkippedInput(where, "not an image file extension")))
        return ~blank & image
    ok = np.ones(n, dtype=bool)
    for i, p in enumerate(pylist(col)):
        if p is None or not str(p).strip():
            problems.append((first_row + i, SkippedInput(where_of(first_row + i), "no path")))
            ok[i] = False
        elif "\x00" in str(p):
            problems.append((first_row + i, SkippedInput(where_of(first_row + i), "the path holds a NUL byte")))
            ok[i] = False
        elif ext_of(str(p)) not in IMAGE_EXTENSIONS:
            where = where_of(first_row + i, str(p))
            problems.append((first_row + i, SkippedInput(where, "not an image file extension")))
            ok[i] = False
    return ok


def check_labels(
    col: Any,
    first_row: int,
    ok: np.ndarray[Any, Any],
    seen: dict[Any, None],
    problems: list[tuple[int, SkippedInput]],
    where_of: Where,
    force_names: bool,
) -> np.ndarray[Any, Any]:
    """Rows (of those ``ok``) with a usable label; the others are problems. Labels seen go to ``seen``.

    A negative class index is a problem unless ``force_names`` (labels are names: a later
    row was not an integer).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(ok)
    good = np.ones(n, dtype=bool)
    arr = arrow(col)
    negative: np.ndarray[Any, Any] | None = None
    if arr is not None and pa.types.is_integer(arr.type):
        null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        for v in pc.unique(arr.drop_null()).to_pylist():
            seen.setdefault(v, None)
        for i in np.flatnonzero(null & ok).tolist():
            problems.append((first_row + i, SkippedInput(where_of(first_row + i), "no label")))
        good &= ~null
        if not force_names:
            negative = mask(pc.less(arr, 0))
    elif arr is not None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        blank = mask(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0))
        blank |= np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        for i in np.flatnonzero(blank & ok).tolist():
            problems.append((first_row + i, SkippedInput(where_of(first_row + i), "no label")))
        good &= ~blank
        below: list[str] = []
        for v in pc.unique(arr).to_pylist():
            if v is None or not v.strip():
                continue
            seen.setdefault(v, None)
            index = int_label(v)
            if index is not None and index < 0:
                below.append(v)
        if below and not force_names:
            negative = mask(pc.is_in(arr, value_set=pa.array(below, type=arr.type)))
    else:
        negative = np.zeros(n, dtype=bool)
        for i, v in enumerate(pylist(col)):
            why = unusable(v)
            if why is None:
                try:
                    seen.setdefault(v, None)
                except TypeError:  # unhashable: not a label
                    why = f"label {v!r} is not usable"
            if why is not None:
                if ok[i]:
                    problems.append((first_row + i, SkippedInput(where_of(first_row + i), why)))
                good[i] = False
                continue
            index = int_label(v)
            negative[i] = index is not None and index < 0 and not force_names
    if negative is not None:
        bad = negative & good & ok
        if bad.any():
            values = pylist(col)
            for i in np.flatnonzero(bad).tolist():
                why = f"label {str(values[i]).strip()} is negative (labels are class indices)"
                problems.append((first_row + i, SkippedInput(where_of(first_row + i), why)))
            good &= ~negative
    return good
