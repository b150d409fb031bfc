"""Reading inputs at fsspec URLs: the image folder in a bucket, and the objects a listing table names.

A remote image folder is listed with the filesystem's recursive listing in one pass
(one paged ``LIST`` on S3, never one request per file; read page by page, keeping each
object's path and size only; other filesystems: :meth:`fsspec.AbstractFileSystem.find`
with ``detail=True``); each item carries its object's path and size, and the
conversion task that writes the shard reads the object (retried like every other remote
read, see :mod:`streamload.storage.retry`).

The layout and keys are the local image folder's (:mod:`.imagefolder`): ``ROOT/<class>/...``,
classes sorted, images ordered like the local walk (a folder's files by name, then its
sub-folders), so a folder uploaded to a bucket converts to the same shards as the local
copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from streamload._errors import ConfigError, ShardNotFoundError, SourceError, StreamloadError
from streamload._redact import redact
from streamload.manifest import SkippedInput
from streamload.sample import IMAGE_EXTENSIONS
from streamload.storage.filesystems import open_filesystem
from streamload.storage.retry import RetryPolicy, retry_call
from streamload.storage.transport import translate_error
from streamload.storageconfig import StorageConfig

from .imagefolder import unclassed_images
from .images import HIDDEN, WARNINGS_KEY, ImageItem, assign_keys, check_image, escape_folder, not_an_input
from .source import Item, ScanResult, Source, printable

__all__ = ["RemoteImageFolderSource", "RemoteImageItem", "read_url"]


def read_url(url: str, storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy | None = None) -> bytes:
    """Return the bytes of the object at ``url`` (retried on transient errors).

    Raises:
        SourceError: Naming the URL, if it does not exist or cannot be read.
    """
    try:
        fs, path = open_filesystem(url, storage_options)
    except ConfigError as exc:
        raise SourceError(_named(url, str(exc))) from exc
    try:
        data = retry_call(lambda: fs.cat_file(path), retry or StorageConfig().retry_policy(), f"GET {url}")
    except Exception as exc:
        err = translate_error(exc, url, "read")
        if isinstance(err, ShardNotFoundError):
            raise SourceError(f"{url}: does not exist (404)") from exc
        raise SourceError(str(err) if redact(url) in str(err) else f"{url}: cannot read: {err}") from exc
    if not isinstance(data, bytes):
        raise SourceError(f"{url}: cannot read: the filesystem returned {type(data).__name__}")
    return data


def _named(url: str, message: str) -> str:
    """``message`` led by ``url``, unless it names it already (no ``url: url: ...``)."""
    return message if redact(url) in message else f"{url}: {message}"


def list_tree(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, int]]:
    """Return ``(root path, {path below root: size})`` of every object under ``url``, in one listing.

    Raises:
        SourceError: Naming the URL, if it cannot be listed.
    """
    try:
        fs, root = open_filesystem(url, storage_options)
    except ConfigError as exc:
        raise SourceError(_named(url, str(exc))) from exc
    root = root.rstrip("/")
    stream = _s3_pages(fs, root)
    listing = stream if stream is not None else lambda: _found(fs, root)
    try:
        return root, retry_call(listing, StorageConfig().retry_policy(), f"LIST {url}")
    except Exception as exc:
        raise SourceError(_named(url, str(translate_error(exc, url, "list")))) from exc


def _found(fs: Any, root: str) -> dict[str, int]:
    """Any fsspec filesystem: ``find`` (one paged listing on object stores), then keep path and size."""
    out: dict[str, int] = {}
    for path, info in fs.find(root, detail=True, withdirs=False).items():
        rel = str(path)[len(root) :].lstrip("/") if str(path).startswith(root) else str(path)
        if not rel or rel.endswith("/") or info.get("type") == "directory":
            continue
        out[rel] = int(info.get("size") or 0)
    return out


def _s3_pages(fs: Any, root: str) -> Callable[[], dict[str, int]] | None:
    """On S3 (s3fs): the listing read page by page, keeping only each object's path and size.

    ``find`` would hold every object's full info dict (and fill the filesystem's listing
    cache), about 1.2 kB per object; this keeps what the conversion needs, about a tenth of
    that. ``None`` where the filesystem is not s3fs or lacks its page iterator (then
    :func:`_found` lists).
    """
    if type(fs).__module__.partition(".")[0] != "s3fs" or not hasattr(fs, "_iterdir") or fs.version_aware:
        return None
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(root)
    prefix = f"{key}/" if key else ""

    async def pages() -> dict[str, int]:
        out: dict[str, int] = {}
        async for info in fs._iterdir(bucket, delimiter="", prefix=prefix):
            name = str(info.get("name") or "")  # "bucket/key" (recent s3fs also puts the bucket in "Key")
            name = name[len(bucket) + 1 :] if name.startswith(f"{bucket}/") else str(info.get("Key") or "")
            rel = name[len(prefix) :] if name.startswith(prefix) else ""
            if rel and not rel.endswith("/") and info.get("type") != "directory":
                out[rel] = int(info.get("size") or 0)
        return out

    return lambda: sync(fs.loop, pages)


@dataclass(frozen=True)
class RemoteImageItem(ImageItem):
    """One image object: its path below the root (``relpath``), its label and its size."""

    size: int = 0


def _order(relpath: str) -> tuple[tuple[int, str], ...]:
    """Sort key that orders paths like the local walk: a folder's files by name, then its sub-folders."""
    *folders, name = relpath.split("/")
    return (*((1, f) for f in folders), (0, name))


class RemoteImageFolderSource(Source):
    """An image folder (``ROOT/<class>/<...>/<image>``) at an fsspec URL.

    Args:
        url: The folder's URL (``s3://raw/images``).
        storage_options: fsspec options (credentials, endpoint).
        check: How images are checked, as for :class:`~.imagefolder.ImageFolderSource`.

    Raises:
        SourceError: If the URL cannot be listed or holds no class folder.
    """

    names_are_paths = True

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, check: str = "decode") -> None:
        if check not in ("decode", "header", "none"):
            raise SourceError(f"check={check!r} must be 'decode', 'header' or 'none'")
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.check = check
        self._root, self._objects = list_tree(self.url, self.storage_options)
        names = {rel.split("/", 1)[0] for rel in self._objects if "/" in rel}
        self._class_names = sorted(n for n in names if not n.startswith("."))
        self.classes = [escape_folder(n) for n in self._class_names]
        if not self.classes:
            raise SourceError(f"{self.url}: no class sub-folders (expected ROOT/<class>/<image>)")
        loose = sorted(rel for rel in self._objects if "/" not in rel and not rel.startswith("."))
        loose = [rel for rel in loose if rel.rpartition(".")[2].lower() in IMAGE_EXTENSIONS and "." in rel]
        if loose:
            raise SourceError(unclassed_images(self.url, loose, len(self.classes)))

    def describe(self) -> str:
        """Return the folder's URL."""
        return self.url

    def settings(self) -> dict[str, Any]:
        """Return how images are checked: a resume must check them the same way."""
        return {"check": self.check}

    def scan(self) -> ScanResult:
        """List every image object with its label and size, from the one listing done at construction."""
        labels = {name: i for i, name in enumerate(self._class_names)}
        items: list[RemoteImageItem] = []
        ignored: list[SkippedInput] = []
        hidden: set[str] = set()
        for rel in sorted(self._objects, key=_order):
            parts = rel.split("/")
            dot = next((k for k, p in enumerate(parts) if p.startswith(".")), None)
            if dot is not None:  # a hidden object, or one in a hidden folder (listed once)
                name = "/".join(parts[: dot + 1]) + ("/" if dot < len(parts) - 1 else "")
                if name not in hidden:
                    hidden.add(name)
                    ignored.append(SkippedInput(printable(name), HIDDEN))
                continue
            if len(parts) == 1:
                ignored.append(SkippedInput(printable(rel), "file outside any class folder"))
                continue
            ext = parts[-1].rpartition(".")[2].lower() if "." in parts[-1] else ""
            if ext not in IMAGE_EXTENSIONS:
                ignored.append(SkippedInput(printable(rel), not_an_input(parts[-1])))
                continue
            label = labels[parts[0]]
            size = self._objects[rel]
            items.append(RemoteImageItem(key="", nbytes=size + len(str(label)), relpath=rel, label=label, size=size))
        items.sort(key=lambda i: (i.label, _order(i.relpath)))
        return ScanResult(assign_keys(items), ignored, [])

    def origin(self, item: Item) -> str:
        """Return the object's URL."""
        assert isinstance(item, RemoteImageItem)
        return f"{self.url}/{printable(item.relpath)}"

    def load(self, item: Item) -> dict[str, Any]:
        """Read one image object and return its sample.

        Raises:
            SourceError: Naming the URL, if the object is gone (404), cannot be read, or
                is not a valid image.
        """
        assert isinstance(item, RemoteImageItem)
        url = f"{self.url}/{item.relpath}"
        try:
            data = read_url(url, self.storage_options)
        except StreamloadError as exc:
            raise SourceError(printable(str(exc))) from exc
        ext = item.relpath.rpartition(".")[2].lower()
        sample: dict[str, Any] = {"__key__": item.key, ext: data, "cls": str(item.label).encode()}
        if self.check != "none":
            found = check_image(data, printable(url), self.check)
            if found:
                sample[WARNINGS_KEY] = found
        return sample

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_objects"] = {}  # the listing stays with the driver: tasks carry their items
        return state
