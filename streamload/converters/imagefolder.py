"""The image-folder source: ``ROOT/<class>/<...>/<image>`` to samples.

Classes are the sorted names of ROOT's sub-folders that hold an image (label ``i`` =
``classes[i]``); any image below a class folder, at any depth, belongs to that class. A
sub-folder that gives no image (empty, unreadable, a link loop) is no class: it is a
problem, an error unless skipping, then listed in the skip report. Each sample holds the
file's original bytes under its lower-cased extension and the label as ``cls`` (ASCII
decimal). Keys are derived from the relative path only, so they are deterministic, and
unique by construction (:func:`path_to_key`).

Images are the files whose extension is one of :data:`streamload.sample.IMAGE_EXTENSIONS`
(JPEG, PNG, WebP, GIF, BMP, TIFF, PPM/PGM/PBM: the one list the readers share).

Images directly in ROOT beside class folders have no class: the source refuses them,
saying how many and what to do (``labels="none"``, or move them into class folders); they
are never counted as files that are not inputs.

Folders without classes: with ``labels="none"`` every image below ROOT, at any depth, is a
sample without a ``cls`` field (sub-folders are only part of the key), and the dataset has
no classes. ``labels="auto"`` (the default) does that for a flat folder (images and no
sub-folder), and reads class folders otherwise.

Library warnings raised while an image is checked (truncated or malformed files, TIFF
tags) are not printed: each is listed with the file it came from in the conversion report
(:attr:`~.engine.ConvertReport.warnings`). An image past the readers' pixel limit is a
broken input (see :func:`.images.check_image`).

What the scan does with unusual entries:

* Symbolic links are followed, to files and to folders, class folders included (a
  dataset assembled from links converts like a copy); a link that leads back to a folder
  above it (a loop) is not followed and is listed as a problem.
* An entry that cannot be read (a dangling link, a folder whose listing fails) is a
  problem: an error under ``on_error="raise"``, skipped and listed in the manifest under
  ``"skip"``; nothing is dropped silently. A FIFO, socket or device with an image
  extension is a problem too (never opened, so a conversion cannot hang on it).
* Names starting with ``.`` are hidden: not taken, and listed with the files that are not
  inputs (a hidden folder once, not walked).
* Files that are not images by extension are listed as not inputs, each with why: a HEIC,
  HEIF or AVIF photo is named as one, with the Pillow plugin that reads its kind.
* Names that are not valid UTF-8 get escaped keys: each undecodable byte becomes
  ``%XX`` (see :func:`path_to_key`); class names are escaped the same way.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from typing import Any

from streamload._errors import ConfigError, SourceError
from streamload.manifest import SkippedInput
from streamload.sample import IMAGE_EXTENSIONS
from streamload.storage import is_local, local_path_of

from .images import (
    HIDDEN,
    WARNINGS_KEY,
    ImageItem,
    assign_keys,
    check_image,
    escape_folder,
    not_an_input,
    path_to_key,
)
from .places import within
from .source import Item, ScanResult, Source, printable

__all__ = [
    "IMAGE_EXTENSIONS",
    "LABEL_MODES",
    "WARNINGS_KEY",
    "EMPTY_CLASS",
    "ImageFolderSource",
    "path_to_key",
    "unclassed_images",
]

#: The reason recorded for a class folder without images (the report counts these apart).
EMPTY_CLASS = "empty class folder: it holds no image"

#: How an image folder's labels are found: ``"auto"``, ``"folders"`` or ``"none"``.
LABEL_MODES = ("auto", "folders", "none")


def _reason(exc: OSError) -> str:
    return printable(exc.strerror or str(exc))


def _extension(name: str) -> str:
    return name.rpartition(".")[2].lower() if "." in name else ""


class ImageFolderSource(Source):
    """Scan an image folder; load and check each image in the conversion workers.

    Args:
        root: The folder holding one sub-folder per class.
        check: How to check images while converting: ``"decode"`` (decode at reduced size,
            catches truncated and corrupt files), ``"header"`` (Pillow's ``verify()``),
            or ``"none"``.
        labels: ``"folders"``: one sub-folder per class; ``"none"``: no labels, every
            image below ``root``; ``"auto"``: ``"none"`` for a flat folder (no
            sub-folder), else ``"folders"``.

    Raises:
        SourceError: If ``root`` is not a readable folder or holds no class folder
            (``labels="folders"``).
    """

    names_are_paths = True

    def __init__(self, root: str, check: str = "decode", labels: str = "auto") -> None:
        if check not in ("decode", "header", "none"):
            raise SourceError(f"check={check!r} must be 'decode', 'header' or 'none'")
        if labels not in LABEL_MODES:
            raise SourceError(f"labels={labels!r} must be one of {', '.join(map(repr, LABEL_MODES))}")
        if not root:
            raise SourceError("the image folder is an empty string (expected ROOT/<class>/<image>)")
        self.root = os.path.abspath(root)
        self.check = check
        if not os.path.exists(self.root):  # a dangling link too
            raise SourceError(f"{printable(root)}: does not exist (expected a folder ROOT/<class>/<image>)")
        if not os.path.isdir(self.root):
            raise SourceError(f"{printable(root)}: not a directory (expected ROOT/<class>/<image>)")
        try:
            with os.scandir(self.root) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise SourceError(f"{printable(root)}: cannot list the folder: {_reason(exc)}") from exc
        folders = [e.name for e in entries if not e.name.startswith(".") and _is_dir(e.path)]
        self.labelled = labels == "folders" or (labels == "auto" and bool(folders))
        self._class_names = folders if self.labelled else []
        self.classes = [escape_folder(name) for name in self._class_names]
        if self.labelled and not self.classes:
            raise SourceError(
                f"{printable(root)}: no class sub-folders (expected ROOT/<class>/<image>; "
                "for images without labels use --labels none)"
            )
        if self.labelled:
            loose = [e.name for e in entries if not e.name.startswith(".") and _extension(e.name) in IMAGE_EXTENSIONS]
            loose = [name for name in loose if name not in folders]
            if loose:
                raise SourceError(unclassed_images(printable(root), loose, len(folders)))

    def describe(self) -> str:
        """Return the root path."""
        return self.root

    def meta(self) -> dict[str, Any]:
        """Return the root path (printable) for the manifest."""
        return {"source": printable(self.root)}

    def settings(self) -> dict[str, Any]:
        """Return how images are checked and labelled: a resume must do the same."""
        return {"check": self.check} if self.labelled else {"check": self.check, "labels": "none"}

    def check_destination(self, dst: str) -> None:
        """Refuse a local ``dst`` inside the folder or one of its (linked) class folders.

        The next conversion would read it back as a class or as images.

        Raises:
            ConfigError: Naming ``dst`` and the folder.
        """
        if not is_local(dst):
            return
        path = local_path_of(dst)
        for root in [self.root, *self.class_dirs()]:
            if within(path, root):
                where = "" if root == self.root else f" (in its linked class folder {printable(root)})"
                raise ConfigError(
                    f"DST {dst} is inside the image folder {printable(self.root)}{where}: "
                    "the next conversion would read it back as a class or as images. Write it outside SRC."
                )

    def class_dirs(self) -> list[str]:
        """Return the paths of the class folders (symbolic links as they are)."""
        return [os.path.join(self.root, name) for name in self._class_names]

    def scan(self) -> ScanResult:
        """List every image with its label, sorted by class and path.

        Files that are not images by extension and other files directly under the root
        are ignored (listed and counted; images there were refused when the source was
        made: they have no class). An empty class folder, an entry that cannot be read
        (a folder whose listing fails, a dangling link), a link loop and an image that is
        not a regular file are problems (an error unless skipping). Only the sub-folders
        that gave images are classes: :attr:`classes` is narrowed to them here, and the
        labels numbered over them.
        """
        if not self.labelled:
            return self._scan_unlabelled()
        items: list[ImageItem] = []
        ignored: list[SkippedInput] = []
        problems: list[SkippedInput] = []
        classes = set(self._class_names)
        try:
            with os.scandir(self.root) as it:
                top = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise SourceError(f"{printable(self.root)}: cannot list the folder: {_reason(exc)}") from exc
        for entry in top:
            if entry.name in classes:
                continue
            if entry.name.startswith("."):
                ignored.append(SkippedInput(printable(entry.name) + ("/" if _is_dir(entry.path) else ""), HIDDEN))
                continue
            try:
                st = os.stat(entry.path)
            except OSError as exc:
                problems.append(SkippedInput(printable(entry.name), f"cannot read: {_reason(exc)}"))
                continue
            if stat.S_ISREG(st.st_mode):
                ignored.append(SkippedInput(printable(entry.name), "file outside any class folder"))
            elif not stat.S_ISDIR(st.st_mode):
                ignored.append(SkippedInput(printable(entry.name), "not a regular file or folder"))
        for label, cls in enumerate(self._class_names):
            found = 0
            unreadable = False
            for kind, relpath, info in _walk(self.root, cls):
                name = relpath.rstrip("/").rpartition("/")[2]
                ext = _extension(name)
                if kind == "file":
                    if ext not in IMAGE_EXTENSIONS:
                        ignored.append(SkippedInput(printable(relpath), not_an_input(name)))
                        continue
                    assert isinstance(info, int)
                    items.append(ImageItem(key="", nbytes=info + len(str(label)), relpath=relpath, label=label))
                    found += 1
                elif kind == "hidden":
                    ignored.append(SkippedInput(printable(relpath), str(info)))
                elif kind == "special" and ext not in IMAGE_EXTENSIONS:
                    ignored.append(SkippedInput(printable(relpath), str(info)))
                elif kind == "unreadable" and ext and ext not in IMAGE_EXTENSIONS:
                    ignored.append(SkippedInput(printable(relpath), str(info)))
                else:
                    unreadable |= relpath == cls + "/"
                    problems.append(SkippedInput(printable(relpath), str(info)))
            if not found and not unreadable:
                problems.append(SkippedInput(printable(cls) + "/", EMPTY_CLASS))
        return ScanResult(assign_keys(self._classes_with_images(items)), ignored, problems)

    def _classes_with_images(self, items: list[ImageItem]) -> list[ImageItem]:
        """Narrow the classes to the folders that gave ``items``; the items relabelled over them."""
        used = sorted({item.label for item in items if item.label is not None})
        if len(used) == len(self._class_names):
            return items
        label = {old: new for new, old in enumerate(used)}
        self._class_names = [self._class_names[i] for i in used]
        self.classes = [escape_folder(name) for name in self._class_names]
        out = []
        for item in items:
            assert item.label is not None
            new = label[item.label]
            nbytes = item.nbytes - len(str(item.label)) + len(str(new))
            out.append(dataclasses.replace(item, label=new, nbytes=nbytes))
        return out

    def _scan_unlabelled(self) -> ScanResult:
        """Every image below the root, at any depth, without a label."""
        items: list[ImageItem] = []
        ignored: list[SkippedInput] = []
        problems: list[SkippedInput] = []
        for kind, relpath, info in _walk(self.root, ""):
            ext = _extension(relpath.rstrip("/").rpartition("/")[2])
            if kind == "file":
                if ext not in IMAGE_EXTENSIONS:
                    ignored.append(SkippedInput(printable(relpath), not_an_input(relpath)))
                    continue
                assert isinstance(info, int)
                items.append(ImageItem(key="", nbytes=info, relpath=relpath, label=None))
            elif kind == "hidden" or (kind in ("special", "unreadable") and ext not in IMAGE_EXTENSIONS):
                ignored.append(SkippedInput(printable(relpath), str(info)))
            else:
                problems.append(SkippedInput(printable(relpath), str(info)))
        return ScanResult(assign_keys(items), ignored, problems)

    def origin(self, item: Item) -> str:
        """Return the image's path relative to the root (printable)."""
        assert isinstance(item, ImageItem)
        return printable(item.relpath)

    def load(self, item: Item) -> dict[str, Any]:
        """Read one image and return its sample.

        Raises:
            SourceError: Naming the file, if it cannot be read, is not a regular file, or
                is not a valid image.
        """
        assert isinstance(item, ImageItem)
        path = os.path.join(self.root, item.relpath)
        try:
            # O_NONBLOCK: a file replaced by a FIFO since the scan cannot hang the worker
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise SourceError(f"{printable(path)}: cannot read: {_reason(exc)}") from exc
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SourceError(f"{printable(path)}: not a regular file (a FIFO, socket or device)")
            try:
                data = f.read()
            except OSError as exc:
                raise SourceError(f"{printable(path)}: cannot read: {_reason(exc)}") from exc
        sample: dict[str, Any] = {"__key__": item.key, item.relpath.rpartition(".")[2].lower(): data}
        if item.label is not None:
            sample["cls"] = str(item.label).encode()
        if self.check != "none":
            found = check_image(data, printable(path), self.check)
            if found:
                sample[WARNINGS_KEY] = found
        return sample


def unclassed_images(root: str, names: list[str], num_classes: int) -> str:
    """The refusal of images lying beside the class folders: how many, which, and what to do."""
    shown = ", ".join(printable(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"{root}: {len(names)} image(s) lie directly in the folder, beside its {num_classes} class folder(s), "
        f"so they have no class ({shown}): convert with --labels none to keep every image without labels, "
        "or move them into class folders"
    )


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


def _walk(root: str, cls: str) -> Iterator[tuple[str, str, int | str]]:
    """Walk ``root/cls``, following links; yield ``(kind, relpath, size or reason)``.

    Kinds: ``"file"`` (a regular file and its size), ``"special"`` (a FIFO, socket or
    device), ``"unreadable"`` (cannot be stat'ed), ``"problem"`` (a folder that cannot be
    listed or a link loop; its relpath ends with ``/``), ``"hidden"`` (a name starting
    with ``.``: a hidden folder, its relpath ending with ``/``, is not walked). Order: a
    folder's files sorted by name, then its sub-folders, each walked in turn (like
    :func:`os.walk` top-down). Iterative: no recursion limit on deep trees.
    """
    try:
        top = _ident(os.stat(os.path.join(root, cls)))
        ancestors = _chain(root)  # the root and every folder above it: a link to one is a loop
    except OSError as exc:
        yield "problem", cls + "/", f"cannot read: {_reason(exc)}"
        return
    if cls and top in ancestors:
        yield "problem", cls + "/", "link loop: this class folder leads back to the image folder or above it"
        return
    ancestors |= {top}
    stack: list[tuple[str, frozenset[tuple[int, int]]]] = [(cls, ancestors)]
    while stack:
        rel, above = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel)) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            yield "problem", rel + "/", f"cannot list this folder: {_reason(exc)}"
            continue
        folders: list[tuple[str, frozenset[tuple[int, int]]]] = []
        for entry in entries:
            relpath = f"{rel}/{entry.name}" if rel else entry.name
            if entry.name.startswith("."):
                yield "hidden", relpath + ("/" if _is_dir(entry.path) else ""), HIDDEN
                continue
            try:
                st = os.stat(entry.path)
            except OSError as exc:
                yield "unreadable", relpath, f"cannot read: {_reason(exc)}"
                continue
            if stat.S_ISDIR(st.st_mode):
                if _ident(st) in above:
                    yield "problem", relpath + "/", "link loop: it leads back to a folder above it"
                else:
                    folders.append((relpath, above | {_ident(st)}))
            elif stat.S_ISREG(st.st_mode):
                yield "file", relpath, st.st_size
            else:
                yield "special", relpath, "not a regular file (a FIFO, socket or device)"
        stack.extend(reversed(folders))


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _chain(path: str) -> frozenset[tuple[int, int]]:
    """The identities of ``path`` and of every folder above it."""
    out = {_ident(os.stat(path))}
    current = os.path.realpath(path)
    while True:
        out.add(_ident(os.stat(current)))
        parent = os.path.dirname(current)
        if parent == current:
            return frozenset(out)
        current = parent
