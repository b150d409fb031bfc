"""Converters: sources (image folders local or remote, listing tables, datasets) and the conversion engine.

Installed as ``streamload.converters``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .dataset_source import DatasetSource
from .engine import ConvertOptions, ConvertReport, convert, plan_shards
from .imagefolder import IMAGE_EXTENSIONS, ImageFolderSource, path_to_key
from .remote import RemoteImageFolderSource
from .source import Item, ScanResult, Source
from .table import TableSource, is_table

__all__ = [
    "IMAGE_EXTENSIONS",
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
]


def open_source(
    src: str,
    storage_options: dict[str, object] | None = None,
    *,
    check: str = "decode",
    labels: str = "auto",
    path_column: str = "path",
    label_column: str = "label",
    image_column: str | None = None,
    keep_columns: Sequence[str] = (),
    root: str | None = None,
) -> Source:
    """Return the source for ``src``, chosen by what it is.

    A Parquet, CSV or JSONL file (by extension) is a listing table (:class:`TableSource`);
    a directory or URL holding ``index.json`` is an existing dataset; a folder ``datasets``'
    ``save_to_disk`` wrote is refused, saying how to write it as Parquet; any other directory
    or URL is an image folder (local, or listed in one pass at the URL); ``labels`` says how
    a local image folder is labelled (see :class:`ImageFolderSource`). ``root`` confines
    the paths a listing table names (see :class:`TableSource`).

    Raises:
        ConfigError: If ``src`` is empty.
        SourceError: If a local ``src`` is not a readable folder.
    """
    import os

    from streamload._errors import ConfigError, StreamloadError
    from streamload.storage import is_local, local_path_of
    from streamload.storage.filesystems import open_filesystem

    from .._hf import saved_to_disk

    if not src or (is_local(src) and not local_path_of(src)):
        raise ConfigError(f"the source {src!r} names no folder or dataset")
    options = dict(storage_options or {})
    if is_table(src):
        url = os.path.abspath(local_path_of(src)) if is_local(src) else src
        return TableSource(url, path_column, label_column, image_column, keep_columns, options, check, root)
    if is_local(src):
        if os.path.isfile(os.path.join(local_path_of(src), "index.json")):
            return DatasetSource(src, options)
        saved = saved_to_disk(local_path_of(src))
        if saved is not None:
            raise ConfigError(saved)
        return ImageFolderSource(local_path_of(src), check, labels)
    try:
        fs, root = open_filesystem(src, options)
        has_manifest = fs.exists(f"{str(root).rstrip('/')}/index.json")
    except (StreamloadError, OSError, ValueError):
        has_manifest = True  # the dataset reader names what is wrong
    if has_manifest:
        return DatasetSource(src, options)
    if labels == "none":
        raise ConfigError(f"{src}: labels='none' is for local image folders; a bucket folder needs class folders")
    return RemoteImageFolderSource(src, options, check)
