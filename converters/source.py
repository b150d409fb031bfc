"""What the conversion engine needs from an input: a list of items, and a way to load one.

A source is scanned once in the parent process (cheap: names and sizes), then each
conversion worker loads the items of the shards it writes. Items are small, picklable
records; loading reads the bytes and checks them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamload.manifest import SkippedInput

__all__ = ["Item", "ScanResult", "Source", "printable"]


def printable(text: str) -> str:
    r"""Return ``text`` safe to encode as UTF-8 (manifests, messages).

    File names that are not valid UTF-8 reach Python as lone surrogates
    (``surrogateescape``); their bytes are shown as ``\xff`` escapes instead.
    """
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # surrogates no file name produces
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Item:
    """One future sample: its key and its payload size estimate in bytes."""

    key: str
    nbytes: int


@dataclass
class ScanResult:
    """A source's scan.

    Attributes:
        items: The samples to convert, in source order.
        ignored: Files that are not inputs (e.g. not an image), listed and counted.
        problems: Inputs that are broken as a whole (e.g. an empty class folder): an
            error under ``on_error="raise"``, listed as skipped under ``"skip"``.
    """

    items: list[Item]
    ignored: list[SkippedInput] = field(default_factory=list)
    problems: list[SkippedInput] = field(default_factory=list)


class Source(ABC):
    """An input to convert: an image folder, an existing dataset..."""

    #: Class names, label ``i`` = ``classes[i]``.
    classes: list[str]

    @abstractmethod
    def scan(self) -> ScanResult:
        """List the items in a deterministic order."""

    @abstractmethod
    def load(self, item: Item) -> dict[str, Any]:
        """Return the sample of ``item``; raise :class:`~streamload.SourceError` if broken."""

    @abstractmethod
    def describe(self) -> str:
        """Return a short description (a path or URL) for messages and the manifest."""

    def iter_items(self, items: Sequence[Item]) -> Iterator[Item]:
        """Yield the items of one planned shard, in order, ready for :meth:`load`.

        A source whose shards are described compactly (a listing table's row spans) reads
        its part here; the default yields ``items`` as they are.
        """
        return iter(items)

    def origin(self, item: Item) -> str:
        """Return where ``item`` comes from (a relative path), for error listings."""
        return item.key

    def meta(self) -> dict[str, Any]:
        """Return JSON metadata about the source for the manifest."""
        return {"source": self.describe()}

    def settings(self) -> dict[str, Any]:
        """Return the source's own settings that shape the output (JSON).

        A resumed conversion must have the same ones (they are part of its fingerprint).
        """
        return {}
