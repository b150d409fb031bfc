"""What the conversion engine needs from an input: a plan of items, and a way to load one.

A source is planned once in the parent process (:meth:`Source.make_plan`: scanned, cheap:
names and sizes, then cut into shards), then each conversion worker loads the items of
the shards it writes. Items are small, picklable records; loading reads the bytes and
checks them. The engine knows sources only by this interface: a source that plans in its
own way (a listing table streams its plan), refuses some destinations (an image folder
refuses one inside itself) or has a content that a resume must find unchanged (a table)
says so by overriding :meth:`Source.make_plan`, :meth:`Source.check_destination` or
:meth:`Source.content_digest`.
"""

from __future__ import annotations

import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamload._errors import SampleError
from streamload._redact import redact
from streamload.formats import check_sample
from streamload.manifest import SkippedInput

from .._files import printable
from .planning import plan_shards

__all__ = [
    "normalization_twins",
    "Item",
    "PlanRequest",
    "ScanResult",
    "Source",
    "SourcePlan",
    "drop_present",
    "printable",
    "printable_json",
    "unique_keys",
]


def printable_json(value: Any) -> Any:
    """``value`` with every string :func:`~.source.printable` (a manifest is UTF-8)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): printable_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_json(v) for v in value]
    return value


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


@dataclass(frozen=True)
class PlanRequest:
    """How the engine asks a source to cut itself into shards.

    Attributes:
        max_bytes: Payload bytes per shard at most (``None``: no byte limit).
        max_samples: Items per shard at most (wins over ``max_bytes``).
        shuffle: Plan a seeded permutation of the items.
        seed: The permutation's seed.
        dst: The destination (for messages).
        check: Appending: refuses inputs that would not fit the dataset; called once the
            scan is done, with the first inputs of the plan.
        present: Appending: returns the keys already at the destination; their inputs are
            left out, each a problem.
    """

    max_bytes: int | None
    max_samples: int | None
    shuffle: bool = False
    seed: int = 0
    dst: str = ""
    check: Callable[[Sequence[Item]], None] | None = None
    present: Callable[[], set[str]] | None = None


@dataclass
class SourcePlan:
    """A source's plan.

    Attributes:
        shards: The planned shards, in order (each a sequence of items).
        problems: Broken inputs and inputs whose keys clash, in the order they are reported.
        ignored: Files that are not inputs.
    """

    shards: list[Sequence[Item]]
    problems: list[SkippedInput]
    ignored: list[SkippedInput] = field(default_factory=list)


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

    #: Whether inputs are named by file paths a person chose (an image folder): their
    #: Unicode normalization twins are listed (:func:`normalization_twins`); class names
    #: are checked for every source.
    names_are_paths = False

    def meta(self) -> dict[str, Any]:
        """Return JSON metadata about the source for the manifest (a URL's password never written)."""
        return {"source": redact(self.describe())}

    def settings(self) -> dict[str, Any]:
        """Return the source's own settings that shape the output (JSON).

        A resumed conversion must have the same ones (they are part of its fingerprint).
        """
        return {}

    def content_digest(self) -> str | None:
        """Return a digest of the content the plan was made from (``None``: not known).

        A resumed conversion must find the same one (it is part of its fingerprint); a
        source whose names do not tell its content (a table edited in place) gives one.
        """
        return None

    def check_destination(self, dst: str) -> None:
        """Refuse a destination that would destroy this source or be read back as part of it.

        Raises:
            ConfigError: Naming the destination and the source.
        """
        return None

    def make_plan(self, request: PlanRequest) -> SourcePlan:
        """Scan and cut into shards: items with unusable or repeated keys left out, then shuffled and cut.

        Appending (``request.check``), the check sees every item kept, and then the items
        whose keys the destination holds are left out. A source that plans while it scans
        (a listing table) overrides this.
        """
        scan = self.scan()
        items, clashes = unique_keys(self, scan.items)
        if request.check is not None:
            request.check(items)
        if request.present is not None:
            items, present_items = drop_present(self, items, request.present(), request.dst)
            clashes += present_items
        order = list(items)
        if request.shuffle:
            permutation = np.random.default_rng(request.seed).permutation(len(order))
            order = [order[i] for i in permutation]
        shards: list[Sequence[Item]] = list(plan_shards(order, request.max_bytes, request.max_samples))
        return SourcePlan(shards, [*scan.problems, *clashes], scan.ignored)


def unique_keys(source: Source, items: Sequence[Item]) -> tuple[Sequence[Item], list[SkippedInput]]:
    """Keep the items whose keys are valid and unique; the others are problems naming both inputs."""
    first: dict[str, Item] = {}
    out: list[Item] = []
    problems: list[SkippedInput] = []
    for item in items:
        try:
            check_sample({"__key__": item.key})
        except (SampleError, UnicodeError) as exc:
            problems.append(SkippedInput(printable(source.origin(item)), f"unusable key: {printable(str(exc))}"))
            continue
        other = first.setdefault(item.key, item)
        if other is not item:
            problems.append(
                SkippedInput(
                    printable(source.origin(item)),
                    f"its key {printable(item.key)!r} is also the key of {printable(source.origin(other))}",
                )
            )
            continue
        out.append(item)
    return out, problems


def drop_present(
    source: Source, items: Sequence[Item], present: set[str], dst: str
) -> tuple[Sequence[Item], list[SkippedInput]]:
    """Keep the items whose keys are not in the dataset yet; the others are problems."""
    keep = [item.key not in present for item in items]
    problems = [
        SkippedInput(printable(source.origin(item)), f"its key {printable(item.key)!r} is already in {dst}")
        for item, k in zip(items, keep, strict=True)
        if not k
    ]
    if all(keep):
        return items, problems
    return [item for item, k in zip(items, keep, strict=True) if k], problems


def _form(name: str) -> str:
    if unicodedata.is_normalized("NFC", name):
        return "NFC"
    return "NFD" if unicodedata.is_normalized("NFD", name) else "mixed"


def normalization_twins(source: Source, items: Sequence[Item]) -> list[SkippedInput]:
    """Inputs and classes whose names differ from another's only in Unicode normalization.

    ``café`` written with a precomposed ``é`` (NFC, what macOS apps and most editors write)
    and with ``e`` and a combining accent (NFD, what some file systems and tools give back)
    look identical but are different names: two samples, or two classes, where a person
    sees one. Each is listed (as ``info`` marks class names), naming the other and both
    forms; nothing is dropped. Inputs are checked for sources whose inputs are files a
    person named (:attr:`Source.names_are_paths`; a table's rows are not walked again).
    """
    out: list[SkippedInput] = []
    named = [source.origin(item) for item in items] if source.names_are_paths else []
    for what, names in (("class", [f"{name}/" for name in source.classes]), ("sample", named)):
        groups: dict[str, list[str]] = {}
        for name in names:
            if not name.isascii():
                groups.setdefault(unicodedata.normalize("NFC", name), []).append(name)
        for group in groups.values():
            if len(group) < 2:
                continue
            for name in group:
                others = ", ".join(f"{other} ({_form(other)})" for other in group if other is not name)
                out.append(
                    SkippedInput(
                        printable(name),
                        f"[{_form(name)} twin] looks identical to {others} but differs in Unicode normalization: "
                        f"a different {what}",
                    )
                )
    return out
