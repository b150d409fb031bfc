"""The sample model: a ``dict`` of a key and named byte fields (``docs/design.md#sample-model``).

``{"__key__": str, "<field>": bytes, ...}``, each field named by its WebDataset extension
(``"jpg"``, ``"png"``, ``"cls"``, ``"json"``...). Every format stores and returns exactly
these dicts; decoding is a separate, optional step (:mod:`streamload.decode`). This module
holds the few facts about fields that the formats, batches and decoders share.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ._cstderr import c_stderr, wants_capture
from ._errors import SampleError

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_FIELDS",
    "Sample",
    "image_field",
    "image_field_for",
    "image_problem",
    "image_warnings",
    "label_of",
    "parse_label",
    "sniff_image",
]

#: A sample: ``{"__key__": str, field: bytes, ...}``.
Sample = dict[str, Any]

#: Field names (file extensions) holding encoded still images, in order of preference: every
#: kind Pillow decodes that a dataset plausibly holds. The one list of image kinds: the
#: converters take files with these extensions as images, the readers and decoders look
#: for these fields.
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "pnm")
#: :data:`IMAGE_FIELDS` as a set (lower-case file extensions, without the dot).
IMAGE_EXTENSIONS = frozenset(IMAGE_FIELDS)


_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def image_problem(exc: BaseException) -> str:
    """Why Pillow refused an image, for a person: no object reprs (``<_io.BytesIO object at 0x...>``)."""
    text = _REPR.sub("", str(exc)).strip()
    if type(exc).__name__ == "UnidentifiedImageError" or text == "cannot identify image file":
        return "Pillow cannot identify its format (damaged, or a kind it cannot read)"
    return text or type(exc).__name__


#: The first bytes of a TIFF: classic and BigTIFF (II+ and MM then NUL +), in the byte orders Pillow accepts.
_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+", b"MM*\x00", b"II\x00*")


def sniff_image(data: bytes | bytearray | memoryview) -> str | None:
    """Return the field name of an encoded image by its magic bytes, or ``None`` if unknown.

    Knows every kind of :data:`IMAGE_FIELDS` (one name per kind: ``jpg``, ``png``,
    ``webp``, ``gif``, ``bmp``, ``tif``, ``ppm``/``pgm``/``pbm``). The one rule of what
    bytes are an image: ``index`` keeps the rows it knows, and ``convert`` refuses (as a broken
    input) an image it does not know even when Pillow opens it.
    """
    head = bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in _TIFF_MAGIC:
        return "tif"
    if len(head) > 2 and head[0:1] == b"P" and head[1:2] in b"123456" and head[2:3] in b" \t\r\n#":
        return {b"1": "pbm", b"4": "pbm", b"2": "pgm", b"5": "pgm"}.get(head[1:2], "ppm")
    return None


def image_field_for(data: bytes | bytearray | memoryview, name: str = "") -> str:
    """Return the field an image's bytes are stored under.

    The extension of ``name``, if it is one of :data:`IMAGE_EXTENSIONS`, else the kind
    sniffed from ``data``, else ``"img"``.

    The rule every table-like input shares (``convert`` of a Parquet/CSV listing with image
    bytes, and the ``parquet`` format read in place).
    """
    base = name.rstrip("/").rpartition("/")[2]
    ext = base.rpartition(".")[2].lower() if "." in base else ""
    if ext in IMAGE_EXTENSIONS:
        return ext
    return sniff_image(data) or "img"


class _InsideBlock:
    """A warning filter's message pattern that matches only in a thread inside a recording block.

    ``warnings`` calls a filter's ``message.match(text)``; this one answers from the calling
    thread's state, so the ``"always"`` filter it sits in applies to the recording threads
    alone, and every other thread's warnings meet the process's filters as they are.
    """

    def __init__(self, local: threading.local) -> None:
        self.local = local

    def match(self, text: str) -> bool:
        return getattr(self.local, "sink", None) is not None

    def __repr__(self) -> str:
        return "<streamload: inside an image_warnings() block>"


class _WarningRecorder:
    """Records library warnings per thread while a :func:`image_warnings` block runs.

    :func:`warnings.catch_warnings` swaps process-wide state and is not safe across
    threads. This recorder changes no filter of the process's while it records: it puts
    one filter first, once (again only if another was put before it since), whose
    ``"always"`` applies to the threads inside a block and matches nothing elsewhere, so
    the user's own filters keep holding for every other thread's warnings, and the "once
    per location" registries are not reset again and again. While any thread is inside a block
    (reference-counted under a lock) ``showwarning`` records into the calling thread's
    list and hands other threads' warnings to the hook it replaced. Pillow's own log
    records (its ``PIL`` logger, warning and above) are recorded the same way.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.local = threading.local()
        self.saved: Any = None
        self.filter: tuple[Any, ...] = ("always", _InsideBlock(self.local), Warning, None, 0)
        self.handler = _PillowLogHandler(self)

    def show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        sink = getattr(self.local, "sink", None)
        if sink is not None:
            sink.append(f"{category.__name__}: {message}")
        elif self.saved is not None:
            self.saved(message, category, filename, lineno, file, line)

    def add_filter(self) -> None:
        """Put the recording threads' filter first, unless it is (the caller holds :attr:`lock` or is alone).

        First, so that a recording thread records every warning whatever the process's
        filters say (``"error"`` would otherwise make a file's warning its failure); it
        matches in no other thread, where the process's filters apply as they are. The
        list is changed only when another filter was put before it since.
        """
        filters: list[Any] = warnings.filters  # type: ignore[assignment]
        if not filters or filters[0] is not self.filter:
            for i in reversed(range(len(filters))):
                if filters[i] is self.filter:
                    del filters[i]
            filters.insert(0, self.filter)
            warnings._filters_mutated()  # type: ignore[attr-defined]

    def _install(self) -> None:
        with self.lock:
            self.add_filter()
            if self.depth == 0:
                self.saved = warnings.showwarning
                warnings.showwarning = self.show
                logging.getLogger("PIL").addHandler(self.handler)
            self.depth += 1

    def _uninstall(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                logging.getLogger("PIL").removeHandler(self.handler)
                if warnings.showwarning == self.show:
                    warnings.showwarning = self.saved
                self.saved = None

    @contextmanager
    def record(self, data: Any = None) -> Iterator[list[str]]:
        outer = getattr(self.local, "sink", None)
        sink: list[str] = []
        self.local.sink = sink
        self._install()
        try:
            if data is not None and wants_capture(data):
                lines: list[str] = []
                try:
                    with c_stderr() as lines:
                        yield sink
                finally:  # also when the decode raised: the lines may say why
                    sink.extend(f"libtiff: {line}" for line in lines)
            else:
                yield sink
        finally:
            self.local.sink = outer
            if outer is not None:
                outer.extend(sink)
            self._uninstall()


class _PillowLogHandler(logging.Handler):
    """Records Pillow's log records (``logging.getLogger("PIL")``) into the thread's sink."""

    def __init__(self, recorder: _WarningRecorder) -> None:
        super().__init__(logging.WARNING)
        self.recorder = recorder

    def emit(self, record: logging.LogRecord) -> None:
        sink = getattr(self.recorder.local, "sink", None)
        if sink is not None:
            sink.append(f"{record.name}: {record.getMessage()}")
        elif not logging.getLogger().handlers and logging.lastResort is not None:
            logging.lastResort.handle(record)  # another thread's record: as if this handler were absent


_RECORDER = _WarningRecorder()
_RECORDER.add_filter()  # now, before the user's script warns (adding a filter resets the "once" registries)


def image_warnings(data: Any = None) -> Any:
    """Context manager: the library warnings raised inside it, as ``"Category: message"`` strings.

    Pillow warns (``DecompressionBombWarning``, truncated or malformed files, TIFF tags,
    palette transparency) where we want a count and a line naming the file; inside the
    block warnings are recorded, not printed. Pillow's log records (warning and above)
    are recorded as ``"PIL.<module>: message"``. Safe to use from several threads at once.

    Args:
        data: The encoded image decoded inside the block. If it is a TIFF, what the C
            library under Pillow (libtiff) writes straight to the process's stderr (fd 2)
            meanwhile is captured too (see :mod:`streamload._cstderr`), one
            ``"libtiff: message"`` string per line; other kinds write nothing there.

    Example:
        >>> with image_warnings() as found:
        ...     warnings.warn("odd TIFF tag")
        >>> found
        ['UserWarning: odd TIFF tag']
    """
    return _RECORDER.record(data)


#: Labels must fit an ``int64`` tensor.
_LABEL_RANGE = (-(2**63), 2**63 - 1)


def parse_label(data: bytes | bytearray | memoryview) -> int:
    """Parse an ASCII-decimal label (WebDataset's ``cls`` encoding).

    Raises:
        ValueError: If the bytes are not a decimal integer that fits in 64 bits.
    """
    raw = bytes(data).strip()
    if len(raw) > 20:
        raise ValueError(f"label of {len(raw)} characters does not fit in 64 bits")
    value = int(raw.decode("ascii"))
    if not _LABEL_RANGE[0] <= value <= _LABEL_RANGE[1]:
        raise ValueError(f"label {value} does not fit in 64 bits")
    return value


def label_of(sample: Mapping[str, Any], field: str = "cls") -> int:
    """Return the integer label stored in ``field`` (ASCII decimal, WebDataset's encoding).

    Raises:
        SampleError: Naming the key, if the field is missing or not an integer.
    """
    try:
        return parse_label(sample[field])
    except KeyError as exc:
        raise SampleError(
            f"sample {sample.get('__key__')!r} has no {field!r} field (a dataset without labels: label_field=None)"
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise SampleError(f"sample {sample.get('__key__')!r} field {field!r} is not an integer") from exc


def image_field(sample: Mapping[str, Any]) -> str:
    """Return the name of the sample's image field (the first of :data:`IMAGE_FIELDS` present).

    Raises:
        SampleError: If the sample has no image field.
    """
    for name in IMAGE_FIELDS:
        if name in sample:
            return name
    raise SampleError(f"sample {sample.get('__key__')!r} has no image field (fields: {sorted(sample)})")
