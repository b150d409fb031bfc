"""Converters: sources (image folders, existing datasets) and the parallel conversion engine.

Installed as ``streamload.converters``.
"""

from __future__ import annotations

from .dataset_source import DatasetSource
from .engine import ConvertOptions, ConvertReport, convert, plan_shards
from .imagefolder import IMAGE_EXTENSIONS, ImageFolderSource, path_to_key
from .source import Item, ScanResult, Source

__all__ = [
    "IMAGE_EXTENSIONS",
    "ConvertOptions",
    "ConvertReport",
    "DatasetSource",
    "ImageFolderSource",
    "Item",
    "ScanResult",
    "Source",
    "convert",
    "open_source",
    "path_to_key",
    "plan_shards",
]


def open_source(src: str, storage_options: dict[str, object] | None = None) -> Source:
    """Return the source for ``src``: an existing dataset if it holds ``index.json``, else an image folder.

    Raises:
        ConfigError: If ``src`` is empty.
        SourceError: If a local ``src`` is not a readable folder.
    """
    from streamload._errors import ConfigError
    from streamload.storage import is_local, local_path_of

    if not src or (is_local(src) and not local_path_of(src)):
        raise ConfigError(f"the source {src!r} names no folder or dataset")
    if is_local(src):
        import os

        if os.path.isfile(os.path.join(local_path_of(src), "index.json")):
            return DatasetSource(src, storage_options)
        return ImageFolderSource(local_path_of(src))
    return DatasetSource(src, storage_options)
