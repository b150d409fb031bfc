"""What every image source shares: keys from relative paths, and the image check.

The image-folder, bucket-folder and listing-table sources all name samples after file
paths and check image bytes the same way; these helpers are that one way. Keys are
derived from the relative path only, so they are deterministic and unique by
construction (:func:`path_to_key`); names that are not valid UTF-8 get reversible
``%XX`` escapes.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass

from streamload._errors import SourceError
from streamload.manifest import SkippedInput
from streamload.sample import image_problem, image_warnings, sniff_image

from .source import Item

__all__ = [
    "WARNINGS_KEY",
    "ImageItem",
    "assign_keys",
    "check_image",
    "escape_folder",
    "image_problem",
    "escape_stem",
    "HIDDEN",
    "ignored_first",
    "not_an_input",
    "path_to_key",
    "pixel_problem",
]


#: Key of a loaded sample under which a source hands the engine the library warnings its
#: check raised (a list of strings; never written: the writers skip ``__`` names).
WARNINGS_KEY = "__warnings__"


#: The reason listed for a hidden file or folder (its name starts with ``.``): not an input.
HIDDEN = "hidden (its name starts with '.'): not taken"

#: Photo kinds people have that streamload does not take (by lower-case extension).
_OTHER_PHOTOS = {"heic": "HEIC", "heif": "HEIF", "avif": "AVIF"}
#: What the reason of such a photo says (the CLI names these first).
_NOT_TAKEN = "photo, a kind streamload does not take"


def not_an_input(name: str) -> str:
    """Why a file named ``name`` (not an image by extension) is not taken: for a person.

    A HEIC/HEIF or AVIF photo is said to be one, with the Pillow plugin that reads its kind
    and whether the installed Pillow reads it, since a folder of phone photos would
    otherwise convert into nothing without a word.
    """
    ext = name.rpartition(".")[2].lower() if "." in name else ""
    kind = _OTHER_PHOTOS.get(ext)
    if kind is None:
        return "not an image file extension"
    if kind == "AVIF":
        reads = (
            f"Pillow reads AVIF itself from 11.3 when built with libavif (this Pillow {_pillow_reads('avif')}), "
            "older ones through the pillow-avif-plugin package"
        )
        article = "an"
    else:
        reads = f"Pillow reads {kind} only through the pillow-heif plugin"
        article = "a"
    return f"{article} {kind} {_NOT_TAKEN}: {reads}; convert it to JPEG, PNG or WebP first"


def _pillow_reads(feature: str) -> str:
    """``"13.0.0 is"`` or ``"13.0.0 is not"``: whether the installed Pillow was built with ``feature``."""
    import PIL
    from PIL import features

    try:
        able = bool(features.check(feature))
    except Exception:  # noqa: BLE001 - an older Pillow without the feature name
        able = False
    return f"{PIL.__version__} {'is' if able else 'is not'}"


def ignored_first(ignored: Sequence[SkippedInput], limit: int = 20) -> tuple[list[SkippedInput], int]:
    """The ignored files to name: photos of a kind not taken first, then the others, in order.

    Returns:
        The first ``limit`` of them, and how many more there are.
    """
    photos = [s for s in ignored if _NOT_TAKEN in s.error]
    ordered = photos + [s for s in ignored if _NOT_TAKEN not in s.error]
    return ordered[:limit], max(0, len(ordered) - limit)


def _undecodable(text: str) -> bool:
    """True if ``text`` holds bytes that were not UTF-8 (``surrogateescape`` surrogates)."""
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def _escape_bytes(text: str) -> str:
    return "".join(f"%{ord(ch) - 0xDC00:02X}" if "\udc80" <= ch <= "\udcff" else ch for ch in text)


def escape_stem(component: str) -> str:
    """A file stem (or any name) in a key: ``%``, ``.``, ``~`` and bytes that are not UTF-8 percent-escaped."""
    # Injective: '%' is escaped first, so the output never contains a bare '.' or '~',
    # and a '%XX' with XX >= 80 can only come from a byte that is not UTF-8.
    return _escape_bytes(component.replace("%", "%25").replace(".", "%2E").replace("~", "%7E"))


def escape_folder(component: str) -> str:
    """A folder name in a key: as is, unless it is not UTF-8 (then ``%`` and its bytes are escaped)."""
    return _escape_bytes(component.replace("%", "%25")) if _undecodable(component) else component


def path_to_key(relpath: str, disambiguate: bool = False, exact_extension: bool = False) -> str:
    r"""Return the WebDataset key of an image at ``relpath`` (``/``-separated, with extension).

    The key is the path without its extension; dots, ``%`` and ``~`` in the file's stem
    are percent-escaped, so the key's last component is dot-free (WebDataset splits the
    field name at the first dot) and distinct paths give distinct keys. Two files that
    differ only by extension (``a.jpg``, ``a.png``) are told apart with ``disambiguate``,
    which appends ``~<ext>`` (lower case); files whose extensions differ only in case
    (``a.jpg``, ``a.JPG``) need ``exact_extension`` too, which keeps the extension's case.

    Names that are not valid UTF-8 (lone surrogates from ``surrogateescape``) are escaped
    reversibly: each undecodable byte becomes ``%XX`` (upper-case hex, always 80-FF); a
    folder name holding one also has its ``%`` escaped as ``%25``. Ordinary folder names
    are kept as they are, so a folder literally named like an escaped one (``a%FF`` beside
    a folder whose name is the byte ``a\xff``) gives the same key: the converter checks
    keys unique over the whole scan and reports such a collision naming both files.
    """
    head, _, name = relpath.rpartition("/")
    stem, _, ext = name.rpartition(".")
    key = escape_stem(stem)
    if disambiguate:
        key += "~" + escape_stem(ext if exact_extension else ext.lower())
    if not head:
        return key
    return "/".join(escape_folder(part) for part in head.split("/")) + "/" + key


@dataclass(frozen=True)
class ImageItem(Item):
    """One image file: its path relative to the root and its label."""

    relpath: str = ""
    label: int | None = 0


def assign_keys(items: Sequence[ImageItem]) -> list[Item]:
    """Give each item its key; stems shared by several files get ``~ext`` suffixes.

    The suffix is the lower-case extension, unless two files of the group share it
    (``x.jpg``, ``x.JPG``): those keep their extension's case.
    """
    plain = [path_to_key(i.relpath) for i in items]
    groups: dict[str, list[str]] = {}
    for item, key in zip(items, plain, strict=True):
        groups.setdefault(key, []).append(item.relpath.rpartition(".")[2].lower())
    out: list[Item] = []
    for item, key in zip(items, plain, strict=True):
        exts = groups[key]
        if len(exts) > 1:
            ext = item.relpath.rpartition(".")[2].lower()
            key = path_to_key(item.relpath, disambiguate=True, exact_extension=exts.count(ext) > 1)
        out.append(dataclasses.replace(item, key=key))
    return out


def pixel_problem(width: int, height: int) -> str | None:
    """Why an image of ``width`` x ``height`` is refused: more pixels than the readers decode by default.

    The converters apply the readers' own limit (:data:`streamload.decode.DEFAULT_MAX_PIXELS`,
    Pillow's ``MAX_IMAGE_PIXELS``), so a dataset that converts reads back with the default
    decoders; ``None`` if the image is within it.
    """
    from streamload.decode.image import DEFAULT_MAX_PIXELS

    if width * height <= DEFAULT_MAX_PIXELS:
        return None
    return _too_large(f"{width}x{height} = {width * height:,}")


def _too_large(size: str) -> str:
    from streamload.decode.image import DEFAULT_MAX_PIXELS

    return (
        f"image of {size} pixels is larger than the readers' limit of {DEFAULT_MAX_PIXELS:,} pixels "
        "(max_pixels, streamload.decode.DEFAULT_MAX_PIXELS): ImageLabel, DecodeBatch and verify --decode "
        "would refuse it as a possible decompression bomb; downscale it, or leave it out (--on-error skip)"
    )


def check_image(data: bytes, path: str, how: str) -> list[str]:
    """Check that ``data`` is an image: ``how`` is ``"decode"`` (at reduced size) or ``"header"``.

    Bytes of no kind :func:`~streamload.sample.sniff_image` knows are refused first (the rule
    ``index`` applies too), so both keep the same images. An image whose header claims more
    pixels than the readers decode by default is refused too (:func:`pixel_problem`): a
    dataset that converts reads back.

    Returns:
        The library warnings the check raised (recorded, not printed), each once: Python
        warnings, Pillow's log records and, for a TIFF, the lines libtiff writes to the
        process's stderr (``"libtiff: ..."``).

    Raises:
        SourceError: Naming ``path``, if it is not a valid image (the reason written for a
            person, without the library's object reprs, with what the libraries said about
            it, if anything).
    """
    from PIL import Image

    if sniff_image(data) is None:
        raise SourceError(f"{path}: not a valid image: its first bytes are of no image kind streamload reads")
    found: list[str] = []
    try:
        with image_warnings(data) as found:
            with Image.open(io.BytesIO(data)) as img:
                too_large = pixel_problem(img.width, img.height)
                if too_large:
                    raise SourceError(f"{path}: {too_large}")
                if how == "header":
                    img.verify()
                else:
                    if img.format == "JPEG":
                        img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
                    img.load()
    except SourceError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's refusal, past twice its limit
        from streamload.decode.image import pillow_refused_size

        size = pillow_refused_size(data)
        raise SourceError(f"{path}: {_too_large(size) if size != 'more' else image_problem(exc)}") from exc
    except Exception as exc:
        said = list(dict.fromkeys(found))
        detail = f" ({'; '.join(said[:3])}{f'; and {len(said) - 3} more' if len(said) > 3 else ''})" if said else ""
        raise SourceError(f"{path}: not a valid image: {image_problem(exc)}{detail}") from exc
    return list(dict.fromkeys(found))
