"""The image-folder source: ``ROOT/<class>/<...>/<image>`` to samples.

Classes are the sorted names of ROOT's sub-folders (label ``i`` = ``classes[i]``); any
image below a class folder, at any depth, belongs to that class. Each sample holds the
file's original bytes under its lower-cased extension and the label as ``cls`` (ASCII
decimal). Keys are derived from the relative path only, so they are deterministic.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from streamload._errors import SourceError
from streamload.manifest import SkippedInput

from .source import Item, ScanResult, Source

__all__ = ["IMAGE_EXTENSIONS", "ImageFolderSource", "path_to_key"]

#: Extensions (lower case, without the dot) taken as images.
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif"})


def _escape(component: str) -> str:
    # Injective: '%' is escaped first, so the output never contains a bare '.' or '~'.
    return component.replace("%", "%25").replace(".", "%2E").replace("~", "%7E")


def path_to_key(relpath: str, disambiguate: bool = False) -> str:
    """Return the WebDataset key of an image at ``relpath`` (``/``-separated, with extension).

    The key is the path without its extension; dots, ``%`` and ``~`` in the file's stem
    are percent-escaped, so the key's last component is dot-free (WebDataset splits the
    field name at the first dot) and distinct paths give distinct keys. Two files that
    differ only by extension (``a.jpg``, ``a.png``) are told apart with ``disambiguate``,
    which appends ``~<ext>``.
    """
    head, _, name = relpath.rpartition("/")
    stem, _, ext = name.rpartition(".")
    key = _escape(stem)
    if disambiguate:
        key += "~" + ext.lower()
    return f"{head}/{key}" if head else key


@dataclass(frozen=True)
class ImageItem(Item):
    """One image file: its path relative to the root and its label."""

    relpath: str = ""
    label: int = 0


class ImageFolderSource(Source):
    """Scan an image folder; load and check each image in the conversion workers.

    Args:
        root: The folder holding one sub-folder per class.
        check: How to check images while converting: ``"decode"`` (decode at reduced size,
            catches truncated and corrupt files), ``"header"`` (Pillow's ``verify()``),
            or ``"none"``.
    """

    def __init__(self, root: str, check: str = "decode") -> None:
        if check not in ("decode", "header", "none"):
            raise SourceError(f"check={check!r} must be 'decode', 'header' or 'none'")
        self.root = os.path.abspath(root)
        self.check = check
        if not os.path.isdir(self.root):
            raise SourceError(f"{root}: not a directory (expected ROOT/<class>/<image>)")
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        if not self.classes:
            raise SourceError(f"{root}: no class sub-folders (expected ROOT/<class>/<image>)")

    def describe(self) -> str:
        """Return the root path."""
        return self.root

    def scan(self) -> ScanResult:
        """List every image with its label, sorted by class and path.

        Files that are not images by extension and files directly under the root are
        ignored (listed and counted); an empty class folder is a problem (an error unless
        skipping, and its label is kept either way so labels stay stable).
        """
        items: list[ImageItem] = []
        skipped: list[SkippedInput] = []
        problems: list[SkippedInput] = []
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            if entry.is_file() and not entry.name.startswith("."):
                skipped.append(SkippedInput(entry.name, "file outside any class folder"))
        for label, cls in enumerate(self.classes):
            found = 0
            for relpath, size in _walk_files(self.root, cls):
                ext = relpath.rpartition(".")[2].lower() if "." in relpath.rpartition("/")[2] else ""
                if ext not in IMAGE_EXTENSIONS:
                    skipped.append(SkippedInput(relpath, "not an image file extension"))
                    continue
                items.append(ImageItem(key="", nbytes=size + len(str(label)), relpath=relpath, label=label))
                found += 1
            if not found:
                problems.append(SkippedInput(cls + "/", f"class folder {cls!r} holds no image"))
        return ScanResult(_assign_keys(items), skipped, problems)

    def origin(self, item: Item) -> str:
        """Return the image's path relative to the root."""
        assert isinstance(item, ImageItem)
        return item.relpath

    def load(self, item: Item) -> dict[str, Any]:
        """Read one image and return its sample.

        Raises:
            SourceError: Naming the file, if it cannot be read or is not a valid image.
        """
        assert isinstance(item, ImageItem)
        path = os.path.join(self.root, item.relpath)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise SourceError(f"{path}: cannot read: {exc}") from exc
        if self.check != "none":
            _check_image(data, path, self.check)
        ext = item.relpath.rpartition(".")[2].lower()
        return {"__key__": item.key, ext: data, "cls": str(item.label).encode()}


def _walk_files(root: str, cls: str) -> Iterator[tuple[str, int]]:
    """Yield ``(relpath, size)`` of regular files under ``root/cls``, sorted, hidden skipped."""
    base = os.path.join(root, cls)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            yield f"{rel_dir}/{name}", st.st_size


def _assign_keys(items: list[ImageItem]) -> list[Item]:
    """Give each item its key; stems shared by several files get ``~ext`` suffixes."""
    plain = [path_to_key(i.relpath) for i in items]
    counts: dict[str, int] = {}
    for key in plain:
        counts[key] = counts.get(key, 0) + 1
    out: list[Item] = []
    for item, key in zip(items, plain, strict=True):
        if counts[key] > 1:
            key = path_to_key(item.relpath, disambiguate=True)
        out.append(ImageItem(key=key, nbytes=item.nbytes, relpath=item.relpath, label=item.label))
    return out


def _check_image(data: bytes, path: str, how: str) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            if how == "header":
                img.verify()
                return
            if img.format == "JPEG":
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except Exception as exc:
        raise SourceError(f"{path}: not a valid image: {exc}") from exc
