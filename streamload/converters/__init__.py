"""Converters: sources (image folders local or remote, listing tables, datasets) and the conversion engine.

Installed as ``streamload.converters``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .bucket import RemoteImageFolderSource
from .dataset_source import DatasetSource
from .engine import ConvertOptions, ConvertReport, convert, plan_shards
from .imagefolder import IMAGE_EXTENSIONS, ImageFolderSource, path_to_key
from .source import Item, ScanResult, Source
from .table import TableSource, is_table

__all__ = [
    "IMAGE_EXTENSIONS",
    "SOURCE_KEYWORDS",
    "ConvertOptions",
    "ConvertReport",
    "DatasetSource",
    "ImageFolderSource",
    "Item",
    "RemoteImageFolderSource",
    "ScanResult",
    "Source",
    "TableSource",
    "convert",
    "open_source",
    "path_to_key",
    "plan_shards",
    "source_kind",
]


#: The keywords :func:`open_source` takes for each kind of source, beside ``storage_options``.
SOURCE_KEYWORDS: dict[str, tuple[str, ...]] = {
    "a listing table": ("check", "path_column", "label_column", "image_column", "keep_columns", "root"),
    "an existing dataset": ("allow_data_roots",),
    "a local image folder": ("check", "labels"),
    "an image folder at a URL": ("check", "labels"),
}


def source_kind(src: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Return which kind of source ``src`` is: a key of :data:`SOURCE_KEYWORDS`.

    A Parquet, CSV or JSONL file (by extension) is a listing table; a directory or URL
    holding ``index.json`` is an existing dataset; any other directory or URL is an image
    folder (local, or at the URL).

    Raises:
        ConfigError: If ``src`` is empty.
    """
    import os

    from streamload._errors import ConfigError, StreamloadError
    from streamload.storage import is_local, local_path_of
    from streamload.storage.filesystems import open_filesystem

    if not src or (is_local(src) and not local_path_of(src)):
        raise ConfigError(f"the source {src!r} names no folder or dataset")
    if is_table(src):
        return "a listing table"
    if is_local(src):
        local = os.path.isfile(os.path.join(local_path_of(src), "index.json"))
        return "an existing dataset" if local else "a local image folder"
    try:
        fs, root = open_filesystem(src, dict(storage_options or {}))
        has_manifest = fs.exists(f"{str(root).rstrip('/')}/index.json")
    except (StreamloadError, OSError, ValueError):
        has_manifest = True  # the dataset reader names what is wrong
    return "an existing dataset" if has_manifest else "an image folder at a URL"


def open_source(src: str, storage_options: Mapping[str, Any] | None = None, **options: Any) -> Source:
    """Return the source for ``src``, chosen by what it is (:func:`source_kind`).

    Each kind takes its own keywords (:data:`SOURCE_KEYWORDS`): a listing table
    (:class:`TableSource`) its columns, ``root`` (confining the paths it names) and
    ``check``; an image folder ``check`` and ``labels`` (how a local one is labelled, see
    :class:`ImageFolderSource`); an existing dataset (:class:`DatasetSource`)
    ``allow_data_roots`` (see :class:`~streamload.StorageConfig`). A folder ``datasets``'
    ``save_to_disk`` wrote is refused, saying how to write it as Parquet.

    Raises:
        ConfigError: If ``src`` is empty, or a keyword is not one its kind takes (naming both).
        SourceError: If a local ``src`` is not a readable folder.
    """
    import os

    from streamload._errors import ConfigError
    from streamload.storage import is_local, local_path_of

    from .._hf import saved_to_disk

    kind = source_kind(src, storage_options)
    takes = SOURCE_KEYWORDS[kind]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        listed = ", ".join(f"{name}=" for name in takes) or "none"
        raise ConfigError(f"{src} is {kind}: it takes no {unknown[0]}= (its options: {listed})")
    so = dict(storage_options or {})
    if kind == "a listing table":
        url = os.path.abspath(local_path_of(src)) if is_local(src) else src
        return TableSource(url, storage_options=so, **options)
    if kind == "an existing dataset":
        return DatasetSource(src, so, **options)
    if kind == "a local image folder":
        saved = saved_to_disk(local_path_of(src))
        if saved is not None:
            raise ConfigError(saved)
        return ImageFolderSource(local_path_of(src), **options)
    if options.get("labels") == "none":
        raise ConfigError(f"{src}: labels='none' is for local image folders; a bucket folder needs class folders")
    return RemoteImageFolderSource(src, so, options.get("check", "decode"))
