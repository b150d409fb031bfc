"""The image a table's row holds or names: embedded bytes checked at the scan, a named file or URL read at load."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

import numpy as np

from streamload._errors import SourceError, StreamloadError
from streamload.manifest import SkippedInput
from streamload.sample import image_field_for
from streamload.storage import is_local, local_path_of

from ..bucket import read_url
from ..source import printable
from .checks import Where, arrow, ext_of, inside

__all__ = [
    "NOMINAL_IMAGE_BYTES",
    "embedded_sizes",
    "read_image",
    "read_named",
    "resolve_path",
    "row_image",
    "stored_by_path",
]

#: Payload size assumed for a row naming a file (its size is not known before it is read).
NOMINAL_IMAGE_BYTES = 100_000


def stored_by_path(path: str) -> str:
    """Why a row whose image struct holds a path but no bytes is not read, and what to do."""
    return (
        f"no image bytes, only a path ({printable(path)!r}): the images are stored by path, not embedded; "
        "--root DIR reads such paths under DIR (or embed the images in the file first)"
    )


def embedded_sizes(
    col: Any, first_row: int, by_path: bool, problems: list[tuple[int, SkippedInput]], where: Where
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Which rows of an image column hold image bytes, and how many: ``(ok, sizes)``.

    A row with no bytes is a problem (added to ``problems``), unless it names a path and
    ``by_path`` (a ``--root`` was given): it is then read from there, its size nominal.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = arrow(col)
    if arr is None:
        arr = pa.array(col)
    paths = None
    if pa.types.is_struct(arr.type):
        names = [arr.type.field(i).name for i in range(arr.type.num_fields)]
        paths = pc.struct_field(arr, "path").to_pylist() if "path" in names else None
        arr = pc.struct_field(arr, "bytes")
    lengths = pc.binary_length(arr).to_numpy(zero_copy_only=False)
    sizes = np.nan_to_num(lengths.astype(np.float64), nan=0).astype(np.int64)
    ok = sizes > 0
    for bad in np.flatnonzero(~ok).tolist():
        path = paths[bad] if paths is not None else None
        if path and by_path:  # stored by path: read under --root
            ok[bad], sizes[bad] = True, NOMINAL_IMAGE_BYTES
            continue
        reason = stored_by_path(path) if path else "no image bytes"
        problems.append((first_row + bad, SkippedInput(where(first_row + bad), reason)))
    return ok, sizes


def resolve_path(table: str, path: str) -> str:
    """Return the path or URL of ``path`` as named in ``table`` (relative: to the table's folder)."""
    if "://" in path or os.path.isabs(path):
        return path
    if is_local(table):
        return os.path.join(os.path.dirname(os.path.abspath(local_path_of(table))), path)
    return posixpath.join(table.rpartition("/")[0], path)


def read_named(
    table: str, named: str, where: str, root: str | None, storage_options: Mapping[str, Any]
) -> tuple[bytes, str, str]:
    """The image a row names by path: its bytes, field, and the row's description with the path.

    Raises:
        SourceError: If the path holds a NUL, lies outside ``root``, or cannot be read.
    """
    path = resolve_path(table, named)
    where = f"{where} ({printable(path)})"
    if "\x00" in path:
        raise SourceError(f"{where}: the path holds a NUL byte")
    if root is not None and not inside(path, root):
        raise SourceError(f"{where}: outside --root {printable(root)}")
    return read_image(path, where, storage_options), ext_of(path), where


def read_image(path: str, where: str, storage_options: Mapping[str, Any]) -> bytes:
    """The bytes of the file or URL ``path``; a failure is a :class:`~streamload.SourceError` naming ``where``."""
    if "://" in path and not path.startswith("file://"):
        try:
            return read_url(path, dict(storage_options))
        except StreamloadError as exc:
            message = printable(str(exc))
            message = message[len(path) :].lstrip(": ") if message.startswith(path) else message
            raise SourceError(f"{where}: {message}") from exc
    try:
        with open(local_path_of(path), "rb") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise SourceError(f"{where}: does not exist") from exc
    except OSError as exc:
        raise SourceError(f"{where}: cannot read: {exc.strerror or exc}") from exc


def row_image(
    values: Mapping[str, Any],
    columns: tuple[str | None, str],
    table: str,
    where: str,
    root: str | None,
    storage_options: Mapping[str, Any],
) -> tuple[bytes, str, str]:
    """The image of a row: its bytes, field, and the row's description (with the path it was read from).

    Args:
        values: The row's values.
        columns: The image column (``None``: none) and the path column.
        table: The table's path or URL (relative paths are under its folder).
        where: The row, for the messages.
        root: Where named paths must lie (``None``: anywhere); a struct with a path but
            no bytes is read from there.
        storage_options: fsspec options for the objects named.

    Raises:
        SourceError: If there are no bytes, or the named file cannot be read.
    """
    image_column, path_column = columns
    if not image_column:
        return read_named(table, str(values[path_column]), where, root, storage_options)
    value = values[image_column]
    name = ""
    if isinstance(value, dict):
        name = str(value.get("path") or "")
        value = value.get("bytes")
    if not value and name and root is not None:
        return read_named(table, name, where, root, storage_options)
    if not value:
        raise SourceError(f"{where}: {stored_by_path(name) if name else 'no image bytes'}")
    data = bytes(value)
    return data, image_field_for(data, name), where
