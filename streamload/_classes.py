"""Class names: found twice in linear time, bounded in length, shortened for display.

A dataset's classes come from others (a Hugging Face ``ClassLabel``, ``--classes``, class
folders, a table's label column, an ``index.json``): ImageNet-21k has 21,841 of them, and
nothing stops a file from naming one of a megabyte. Checking every name against every
other took 21 s for 30,000 names; :func:`repeated` counts them once. A name is a label,
not a document: one longer than :data:`MAX_CLASS_NAME_BYTES` (1 KiB in UTF-8, far above
any real class name: WordNet's longest synonym lists run to a few hundred bytes) is
refused where it enters (``index``, ``convert``, reading a manifest), naming the class's
index; and what ``info`` and ``show`` print of a name is at most :data:`SHOWN_CHARS`
characters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = ["MAX_CLASS_NAME_BYTES", "SHOWN_CHARS", "long_name", "repeated", "shown"]

#: The longest class name accepted, in UTF-8 bytes.
MAX_CLASS_NAME_BYTES = 1024
#: The most characters of a class name ``info`` and ``show`` print.
SHOWN_CHARS = 60


def repeated(names: Iterable[str]) -> list[str]:
    """The names given more than once, sorted (one pass over ``names``)."""
    return sorted(name for name, count in Counter(names).items() if count > 1)


def _utf8_bytes(name: str) -> int:
    return len(name.encode("utf-8", "surrogatepass"))


def long_name(names: Sequence[str]) -> str | None:
    """Say which of ``names`` is longer than :data:`MAX_CLASS_NAME_BYTES`, if one is (``None`` if none).

    The text names the class's index and its length, and shows its start:
    ``"class #3 ('aaaa...', 1,000,000 bytes) is longer than the 1024 bytes a class name may have"``.
    """
    for index, name in enumerate(names):
        # a name of more than 1024 characters is too long in any encoding: no encoding needed
        if len(name) > MAX_CLASS_NAME_BYTES or _utf8_bytes(name) > MAX_CLASS_NAME_BYTES:
            size = _utf8_bytes(name)
            return (
                f"class #{index} ({shown(name)!r}, {size:,} bytes) is longer than the {MAX_CLASS_NAME_BYTES} bytes "
                "(UTF-8) a class name may have"
            )
    return None


def shown(name: str, limit: int = SHOWN_CHARS) -> str:
    """``name`` for display: its first ``limit`` characters and ``...`` when it is longer."""
    return name if len(name) <= limit else name[: limit - 3] + "..."
