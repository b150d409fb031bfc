"""Which columns of a Parquet table make a sample, and the values a read takes from them.

The sample model (:mod:`streamload.formats.parquet`): one image column (a Hugging Face
``Image`` struct ``{bytes, path}``, or a plain binary column), an optional label column
(integers, or strings: class names) and every other column as the row's ``json``. A table
that does not fit it is a :class:`~streamload.ConfigError` naming the file and column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..._classes import long_name, repeated, shown
from ..._errors import ConfigError

__all__ = [
    "THRIFT_STRING_LIMIT",
    "ParquetColumns",
    "Plan",
    "class_label_names",
    "flat",
    "image_array",
    "image_values",
    "json_texts",
    "key_prefix",
    "plan_columns",
    "read_columns",
]

#: Longest string a footer (and the schema's ``huggingface`` metadata) may hold.
THRIFT_STRING_LIMIT = 16 << 20


@dataclass(frozen=True)
class ParquetColumns:
    """Which columns of a Parquet table make the sample.

    Attributes:
        image: The image column; ``None``: the Hugging Face ``Image`` feature, else the
            only binary (or ``{bytes, path}`` struct) column.
        label: The label column, integers (class indices) or strings (class names, or
            decimal indices, as ``convert`` reads them); ``None``: ``label`` if there is
            one, else the Hugging Face ``ClassLabel`` feature, else no label; ``""``: no label.
    """

    image: str | None = None
    label: str | None = None


def key_prefix(name: str) -> str:
    """The key prefix of file ``name``'s rows: its stem, with ``%``, ``.`` and ``~`` escaped."""
    stem = name[: -len(".parquet")] if name.endswith(".parquet") else name.rpartition(".")[0] or name
    return stem.replace("%", "%25").replace(".", "%2E").replace("~", "%7E") or "row"


def _hf_features(schema: Any) -> dict[str, Any]:
    """The Hugging Face features recorded in the schema's ``huggingface`` metadata ({} if none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw or len(raw) > THRIFT_STRING_LIMIT:
        return {}
    try:
        info = json.loads(raw)
        features = info.get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def class_label_names(schema: Any, column: str, name: str) -> tuple[str, ...] | None:
    """The names of column ``column``'s Hugging Face ``ClassLabel`` (``None`` if it is not one).

    Raises:
        ConfigError: Naming the file ``name``, if a class name is given twice or is longer
            than :data:`~streamload._classes.MAX_CLASS_NAME_BYTES` (naming its index).
    """
    feature = _hf_features(schema).get(column)
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
        return None
    found = feature.get("names")
    if not isinstance(found, list) or not all(isinstance(n, str) for n in found):
        return None
    twice = repeated(found)
    if twice:
        raise ConfigError(f"{name}: the ClassLabel of column {column!r} names class {shown(twice[0])!r} more than once")
    too_long = long_name(found)
    if too_long is not None:
        raise ConfigError(f"{name}: the ClassLabel of column {column!r}: {too_long}")
    return tuple(found)


def _image_kind(t: Any) -> str | None:
    """``"binary"`` or ``"struct"`` if an arrow type can hold image bytes, else ``None``."""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if "bytes" in names:
            inner = t.field("bytes").type
            if pa.types.is_binary(inner) or pa.types.is_large_binary(inner):
                return "struct"
    return None


@dataclass(frozen=True)
class Plan:
    """The columns of one file that make its samples."""

    image: str
    struct: bool
    has_path: bool
    label: str | None
    json_columns: tuple[str, ...]
    classes: tuple[str, ...] | None
    label_names: bool = False


def _named(name: str, names: list[str], column: str) -> str:
    """``column``, if the file ``name`` has it (else a ``ConfigError`` listing its columns)."""
    if column not in names:
        raise ConfigError(f"{name}: no column {column!r} (columns: {', '.join(names)})")
    return column


def _hf_typed(features: dict[str, Any], names: list[str], kind: str) -> list[str]:
    """The columns whose Hugging Face feature is of ``_type`` ``kind`` (``Image``, ``ClassLabel``)."""
    return [c for c in names if isinstance(features.get(c), dict) and features[c].get("_type") == kind]


def plan_columns(schema: Any, name: str, columns: ParquetColumns) -> Plan:
    """Choose the image, label and json columns of a file (``ConfigError`` naming file and column)."""
    names = list(schema.names)
    features = _hf_features(schema)
    if columns.image is not None:
        image = _named(name, names, columns.image)
    else:
        found = _hf_typed(features, names, "Image") or [c for c in names if _image_kind(schema.field(c).type)]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)} ({', '.join(found)})"
            raise ConfigError(
                f"{name}: {what} image columns (binary or {{bytes, path}} struct); name it with --image-column"
            )
        image = found[0]
    kind = _image_kind(schema.field(image).type)
    if kind is None:
        raise ConfigError(
            f"{name}: column {image!r} of type {schema.field(image).type} cannot hold images "
            "(expected binary or a {bytes, path} struct)"
        )
    label: str | None
    if columns.label == "":
        label = None
    elif columns.label is not None:
        label = _named(name, names, columns.label)
    else:
        hf_labels = _hf_typed(features, names, "ClassLabel")
        label = "label" if "label" in names else (hf_labels[0] if hf_labels else None)
    classes: tuple[str, ...] | None = None
    if label is not None:
        if label == image:
            raise ConfigError(f"{name}: column {label!r} cannot be both the image and the label")
        t = schema.field(label).type
        names_kind = pa.types.is_string(t) or pa.types.is_large_string(t)
        if not pa.types.is_integer(t) and not names_kind:
            raise ConfigError(
                f"{name}: label column {label!r} is {t}, not integers or class names (no labels: --label-column '')"
            )
        classes = class_label_names(schema, label, name)
    struct_type = schema.field(image).type
    has_path = kind == "struct" and "path" in [struct_type.field(i).name for i in range(struct_type.num_fields)]
    rest = tuple(c for c in names if c not in (image, label))
    names_kind = label is not None and not pa.types.is_integer(schema.field(label).type)
    return Plan(image, kind == "struct", has_path, label, rest, classes, names_kind)


def read_columns(plan: Plan) -> list[str]:
    """The columns a read needs (the struct's ``bytes`` leaf only)."""
    return [f"{plan.image}.bytes" if plan.struct else plan.image, *plan.json_columns]


def image_array(table: Any, plan: Plan) -> Any:
    """The image bytes of an arrow table read with :func:`read_columns`, as one binary array."""
    column = table.column(plan.image)
    col = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return col.field("bytes") if plan.struct else col


def image_values(table: Any, plan: Plan) -> list[Any]:
    """The image bytes of an arrow table, one ``bytes`` (or ``None``) per row."""
    return list(image_array(table, plan).to_pylist())


def flat(array: Any) -> tuple[np.ndarray, np.ndarray]:
    """A binary arrow array's values as ``(uint8 data, int64 offsets[len + 1])``, the data a view without a copy.

    A null value's extent is whatever its offsets say (empty when written by pyarrow): the
    row's digest check fails on it, since indexing refused null images.
    """
    offsets_buf, data_buf = array.buffers()[1:3]
    wide = pa.types.is_large_binary(array.type)
    raw: np.ndarray[Any, Any] = np.frombuffer(offsets_buf, dtype=np.int64 if wide else np.int32)
    offsets: np.ndarray[Any, Any] = raw[array.offset : array.offset + len(array) + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > len(data) or bool(np.any(offsets[1:] < offsets[:-1]))):
        raise ValueError("binary offsets are inconsistent")
    return data, offsets


def json_texts(table: Any, plan: Plan) -> list[bytes] | None:
    """Each row's ``json`` field: its other columns as sorted JSON (``None`` without such columns)."""
    if not plan.json_columns:
        return None
    values = {c: table.column(c).to_pylist() for c in plan.json_columns}
    return [
        json.dumps(
            {c: values[c][r] for c in plan.json_columns}, sort_keys=True, default=str, ensure_ascii=False
        ).encode()
        for r in range(table.num_rows)
    ]
