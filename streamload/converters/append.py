"""Appending to a dataset: the base it adds to, the checks before writing, the manifest after.

``convert --append`` adds a source's samples as new shards after a dataset's own. Before
anything is written the appended samples must mean the same classes and carry the same
fields, and inputs whose keys the dataset holds are left out; the manifest published is
the dataset's with the new shards after its own. An append interrupted or killed is
resumed from its journal, which records the dataset it added to.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from streamload._errors import ConfigError, StreamloadError
from streamload._redact import redact
from streamload.formats import Format
from streamload.manifest import MANIFEST_NAME, Manifest
from streamload.storage import Destination

from .dataset_source import DatasetSource, SampleItem
from .journal import JOB_NAME, Journal, plan_of
from .options import ConvertOptions
from .source import Item, Source, printable, printable_json

__all__ = [
    "PROBES",
    "Appending",
    "abandon_append",
    "append_base",
    "append_journal",
    "appended",
    "base_before",
    "check_appendable",
    "keys_of",
]


def append_base(dest: Destination, dst: str, fmt: Format, options: ConvertOptions) -> tuple[Manifest, int]:
    """Return the dataset an append adds to and how many shards it has.

    The dataset is ``index.json`` as found, unless an append is under way there (its
    journal names ``base_shards``). Interrupted before publishing, that append left
    ``index.json`` as it was. Published but killed before its journal was removed, it
    left the dataset *with* its new shards: the base is then rebuilt from what the
    journal recorded of it (shards, skipped inputs, fields, classes and ``meta`` as they
    were), so that ``--append --resume`` plans the very same job and finds it complete.

    Raises:
        ConfigError: If there is no streamload dataset at ``dst``, it was indexed from
            another tool's shards, has another format or hash, or the journal of an
            interrupted append does not match it.
    """
    if dest.exists(MANIFEST_NAME) is None:
        raise ConfigError(f"{dst}: --append needs an existing dataset there (no index.json); convert without --append")
    try:
        manifest = Manifest.loads(dest.read_bytes(MANIFEST_NAME), f"{dst}/{MANIFEST_NAME}")
    except (StreamloadError, ValueError) as exc:
        raise ConfigError(f"{dst}/{MANIFEST_NAME}: not a streamload dataset to append to ({exc})") from exc
    if "indexed_by" in manifest.meta:
        raise ConfigError(f"{dst}: its shards were written by another tool (streamload index); --append refuses them")
    if manifest.format != fmt.name:
        raise ConfigError(
            f"{dst} holds {manifest.format} shards: --append writes the same format (use --format {manifest.format})"
        )
    if options.hash_algorithm is not None and manifest.hash_algorithm not in (None, options.hash_algorithm):
        algorithm = manifest.hash_algorithm
        raise ConfigError(f"{dst} uses the {algorithm} hash: append with --hash {algorithm}")
    if dest.exists(JOB_NAME) is None:
        return manifest, len(manifest.shards)
    try:
        job = json.loads(dest.read_bytes(JOB_NAME))
    except ValueError:
        job = {}
    base = job.get("base_shards") if isinstance(job, dict) else None
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base <= len(manifest.shards):
        return manifest, len(manifest.shards)  # another job's journal: Journal.open says what to do with it
    if base == len(manifest.shards):
        return manifest, base  # interrupted before publishing: index.json is the base itself
    return base_before(manifest, job, base, dst), base


def base_before(manifest: Manifest, job: dict[str, Any], shards: int, dst: str) -> Manifest:
    """The dataset before a published append whose journal ``job`` is still at ``dst``."""
    skipped, fields, classes, meta = (job.get(k) for k in ("base_skipped", "base_fields", "base_classes", "base_meta"))
    fine = (
        plan_of(manifest) == job.get("fingerprint")
        and isinstance(skipped, int)
        and not isinstance(skipped, bool)
        and 0 <= skipped <= len(manifest.skipped)
        and isinstance(fields, list)
        and all(isinstance(f, str) for f in fields)
        and isinstance(classes, list)
        and all(isinstance(c, str) for c in classes)
        and isinstance(meta, dict)
    )
    if not fine:
        raise ConfigError(
            f"{dst}: an append published its {len(manifest.shards) - shards} shards but {JOB_NAME} does not "
            "record the dataset it added to: the append cannot be resumed. Check the dataset "
            f"(streamload verify {dst}), then delete {dst}/{JOB_NAME} and its _done-* markers"
        )
    assert isinstance(skipped, int) and isinstance(meta, dict)  # for mypy: checked above
    return Manifest(
        format=manifest.format,
        shards=manifest.shards[:shards],
        fields=tuple(map(str, fields or ())),
        classes=tuple(map(str, classes or ())),
        hash_algorithm=manifest.hash_algorithm,
        skipped=manifest.skipped[:skipped],
        meta=meta,
    )


def append_journal(base: Manifest) -> dict[str, Any]:
    """What an append's journal records of the dataset it adds to (see :func:`append_base`)."""
    return {
        "base_shards": len(base.shards),
        "base_skipped": len(base.skipped),
        "base_fields": list(base.fields),
        "base_classes": list(base.classes),
        "base_meta": printable_json(dict(base.meta)),
    }


def check_appendable(
    source: Source, base: Manifest, dst: str, options: ConvertOptions, items: Sequence[Item] = ()
) -> None:
    """Refuse an append whose samples would not fit the dataset, before any shard is written.

    Labels must mean the same classes. The fields are checked on the first input that
    loads (the driver reads that one input): samples with other fields (a ``json`` of
    ``--keep-columns``, labels where the dataset has none, another image type) are
    refused here. :func:`appended` checks the fields of every shard again before
    publishing.

    Raises:
        ConfigError: Naming both class lists, or both field sets.
    """
    if list(source.classes) != list(base.classes) and (source.classes or base.classes):
        raise ConfigError(
            f"{printable(source.describe())} has classes {_few(source.classes)} but {dst} has {_few(base.classes)}: "
            "appended labels would name other classes"
        )
    if not base.fields:
        return
    for item in items[:PROBES]:
        try:
            sample = source.load(item)
        except (StreamloadError, UnicodeError):
            continue  # a broken input: its task reports it under --on-error
        fields = sorted(k for k in sample if not k.startswith("__"))
        if set(fields) != set(base.fields):
            raise ConfigError(
                f"{dst} has fields {_fields(base.fields)}; the appended samples have {_fields(fields)} "
                f"(first: {printable(source.origin(item))}): an appended dataset keeps the same fields. "
                "Nothing was written."
            )
        return


#: Inputs :func:`check_appendable` tries to load to learn the appended fields.
PROBES = 8


def _fields(names: Sequence[str]) -> str:
    return "{" + ", ".join(sorted(names)) + "}"


def _few(names: Sequence[str]) -> str:
    return "[" + ", ".join(map(repr, names[:5])) + (", ...]" if len(names) > 5 else "]") if names else "none"


def keys_of(dst: str, options: ConvertOptions, shards: int | None = None) -> set[str]:
    """The keys of the dataset at ``dst`` (from its shards' indexes); only its first ``shards`` if given."""
    existing = DatasetSource(dst, options.storage_options)
    try:
        scan = existing.scan()
    finally:
        existing.close()
    count = len(existing.manifest.shards) if shards is None else shards
    mine = {entry.name for entry in existing.manifest.shards[:count]}
    problems = [p for p in scan.problems if p.path in mine]
    if problems:
        first = problems[0]
        raise ConfigError(f"{dst}/{first.path}: {first.error}: cannot check the appended keys against it")
    return {item.key for item in scan.items if isinstance(item, SampleItem) and item.shard < count}


def appended(base: Manifest, offset: int, new: Manifest, source: Source, fingerprint: str, dst: str) -> Manifest:
    """The base dataset's manifest with the new shards after its own, and the append recorded in ``meta``."""
    if base.fields and set(new.fields) != set(base.fields):
        raise ConfigError(
            f"{dst} has fields {_fields(base.fields)}; the appended samples have {_fields(new.fields)}: "
            "an appended dataset keeps the same fields (nothing was published; the shards written for it were "
            "removed)"
        )
    meta = dict(base.meta)
    appends = list(meta.get("appends") or [])
    appends.append(
        {
            "source": printable(redact(source.describe())),
            "shards": len(new.shards),
            "samples": new.num_samples,
            "first_shard": new.shards[0].name if new.shards else None,
            "plan": fingerprint,
        }
    )
    meta["appends"] = appends
    converter = dict(meta.get("converter") or {})
    converter["plan"] = fingerprint  # what --resume compares: the latest job on this dataset
    meta["converter"] = converter
    return Manifest(
        format=base.format,
        shards=(*base.shards[:offset], *new.shards),
        fields=tuple(sorted(set(base.fields) | set(new.fields))),
        classes=base.classes or new.classes,
        hash_algorithm=base.hash_algorithm,
        skipped=(*base.skipped, *new.skipped),
        meta=meta,
    )


def abandon_append(dest: Destination, journal: Journal, base: Manifest) -> None:
    """After a refused append: delete the shards it wrote and its journal; the dataset stays as it was.

    Files of the base dataset and of the published ``index.json`` are never deleted.
    """
    published = Manifest.loads(dest.read_bytes(MANIFEST_NAME), f"{dest.url}/{MANIFEST_NAME}")
    kept = {f.name for m in (base, published) for entry in m.shards for f in (entry, entry.sidecar) if f is not None}
    for name in journal.outputs:
        if name not in kept:
            dest.remove(name)
    dest.clean_staging()
    journal.finish()


class Appending:
    """An append under way: the dataset it adds to, and what the engine asks of it.

    Args:
        dest: The destination (locked).
        dst: Its URL, for messages.
        fmt: The format of the new shards.
        options: The conversion's options.
        source: What is appended.

    Raises:
        ConfigError: See :func:`append_base`.
    """

    def __init__(self, dest: Destination, dst: str, fmt: Format, options: ConvertOptions, source: Source) -> None:
        self.dest, self.dst, self.options, self.source = dest, dst, options, source
        self.base, self.offset = append_base(dest, dst, fmt, options)

    def check(self, items: Sequence[Item]) -> None:
        """Refuse inputs that would not fit the dataset (see :func:`check_appendable`)."""
        check_appendable(self.source, self.base, self.dst, self.options, items)

    def keys(self) -> set[str]:
        """The keys of the dataset appended to."""
        return keys_of(self.dst, self.options, len(self.base.shards))

    def job(self) -> dict[str, Any]:
        """What the plan's fingerprint records of the dataset appended to."""
        return {"shards": self.offset, "plan": self.base.meta.get("converter", {}).get("plan")}

    def journal_extra(self) -> dict[str, Any]:
        """What the journal records of the dataset appended to."""
        return append_journal(self.base)

    def manifest(self, new: Manifest, fingerprint: str, journal: Journal) -> Manifest:
        """The manifest to publish; a refused one deletes what the append wrote (see :func:`abandon_append`).

        Raises:
            ConfigError: If the new shards' fields differ from the dataset's.
        """
        try:
            return appended(self.base, self.offset, new, self.source, fingerprint, self.dst)
        except ConfigError:
            abandon_append(self.dest, journal, self.base)
            raise
