"""The conversion journal: what lets an interrupted ``streamload convert`` resume.

Beside the output, a conversion keeps::

    _streamload-convert.json          the job: a fingerprint of the source, the options
                                      and the exact shard plan
    _done-shard-000007.tar.json       one marker per published shard: its manifest entry,
                                      fields, skipped inputs (written after the shard)

A shard is published atomically (staged, then renamed or uploaded), and its marker is
written after it, so after a crash (SIGKILL at any moment) every marker names a
complete shard. ``--resume`` re-checks each marked shard (size and hash) and rewrites
only what is missing or does not match; because shards are deterministic, the result is
byte-identical to an uninterrupted run. ``index.json`` is written last and the journal
removed after it.

The job file also lists the files the job writes (``outputs``) and, under
``--overwrite``, the files of the dataset it replaces (``replaces``), deleted only after
the new ``index.json`` is published. Together with the manifest and the markers, that is
how a conversion tells the files streamload wrote from the user's: :meth:`Journal.open`
refuses to write into a directory holding anything else (unless ``--overwrite``, which
writes beside such files and never deletes or replaces one).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from streamload._errors import ConfigError, ManifestError, StreamloadError
from streamload._files import check_file_name
from streamload.manifest import MANIFEST_NAME, FileEntry, Manifest, ShardEntry, SkippedInput
from streamload.storage import Destination
from streamload.storage.destination import STAGING_PREFIX
from streamload.storage.locks import LOCAL_LOCK_NAME, REMOTE_LOCK_NAME
from streamload.writer import ShardResult

from .source import Item

__all__ = ["JOB_NAME", "Journal", "JournalState", "plan_fingerprint", "plan_of"]

JOB_NAME = "_streamload-convert.json"
_MARKER_PREFIX = "_done-"
_MARKER_SUFFIX = ".json"
_VERSION = 1
#: Names that are streamload's wherever they appear in a destination.
_OURS = frozenset({JOB_NAME, LOCAL_LOCK_NAME, REMOTE_LOCK_NAME})
#: Foreign names shown in a refusal at most.
_SHOWN = 8


def plan_fingerprint(job: dict[str, Any], tasks: Sequence[tuple[int, Sequence[Item]]]) -> str:
    """Return a digest of the job options and the exact shard plan (every item, in order).

    A shard that describes itself compactly (``fingerprint_bytes``, a listing table's row
    span) is hashed as those bytes; the table's content is in ``job`` (``source_content``),
    so the digest costs O(shards) for a table, whatever its number of rows.
    """
    h = hashlib.sha256(json.dumps(job, sort_keys=True).encode())
    for index, items in tasks:
        h.update(f"\n#{index}".encode())
        compact = getattr(items, "fingerprint_bytes", None)
        if compact is not None:  # a table's shard (a row span or a row array): compact bytes, not one JSON per row
            h.update(compact())
            continue
        for item in items:
            # surrogateescape: file names that are not UTF-8 reach here as lone surrogates
            h.update(json.dumps(asdict(item), sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def plan_of(manifest: Manifest) -> str | None:
    """Return the plan fingerprint a converter recorded in ``manifest`` (``meta.converter.plan``)."""
    converter = manifest.meta.get("converter")
    plan = converter.get("plan") if isinstance(converter, dict) else None
    return plan if isinstance(plan, str) else None


def _marker(shard_name: str) -> str:
    return f"{_MARKER_PREFIX}{shard_name}{_MARKER_SUFFIX}"


def _is_marker(name: str) -> bool:
    return name.startswith(_MARKER_PREFIX) and name.endswith(_MARKER_SUFFIX)


def _files_of(manifest: Manifest) -> set[str]:
    out: set[str] = set()
    for entry in manifest.shards:
        out.add(entry.name)
        if entry.sidecar is not None:
            out.add(entry.sidecar.name)
    return out


def _plain(name: str) -> bool:
    """True if ``name`` is a plain file name streamload could have written (never a path)."""
    try:
        check_file_name(name, "file name")
    except StreamloadError:
        return False
    return True


def _names(value: Any) -> set[str]:
    return {v for v in value if isinstance(v, str)} if isinstance(value, list) else set()


def _shown(names: Iterable[str]) -> str:
    names = sorted(names)
    text = ", ".join(n.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for n in names[:_SHOWN])
    return text + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _result_to_json(result: ShardResult) -> dict[str, Any]:
    return {
        "entry": result.entry.to_json(),
        "fields": sorted(result.fields),
        "skipped": [s.to_json() for s in result.skipped],
        "payload_bytes": result.payload_bytes,
        "warnings": [s.to_json() for s in result.warnings],
    }


def _result_from_json(obj: Any, where: str) -> ShardResult:
    try:
        entry = ShardEntry.from_json(obj["entry"], where)
        return ShardResult(
            entry=entry,
            fields=set(obj["fields"]),
            skipped=[SkippedInput(str(s["path"]), str(s["error"])) for s in obj["skipped"]],
            payload_bytes=int(obj["payload_bytes"]),
            warnings=[SkippedInput(str(s["path"]), str(s["error"])) for s in obj.get("warnings", ())],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: malformed conversion marker ({exc})") from exc


@dataclass
class JournalState:
    """What :meth:`Journal.open` found.

    Attributes:
        reusable: Shards of an interrupted run that can be kept, by name.
        complete: The published manifest, when the destination already holds this very
            conversion, complete (``--resume`` has nothing left to do).
    """

    reusable: dict[str, ShardResult] = field(default_factory=dict)
    complete: Manifest | None = None


class Journal:
    """Records finished shards of one conversion at its destination.

    Args:
        dest: The destination (locked by the caller for the whole conversion).
        fingerprint: :func:`plan_fingerprint` of the job.
        shard_names: The shards of the plan, in order.
        outputs: Every file the plan may write (shards and sidecars); default: the shards.
    """

    def __init__(
        self,
        dest: Destination,
        fingerprint: str,
        shard_names: Sequence[str],
        outputs: Iterable[str] | None = None,
        *,
        append: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.dest = dest
        self.fingerprint = fingerprint
        self.shard_names = list(shard_names)
        self.outputs = sorted(set(self.shard_names) | set(outputs or ()))
        self.replaces: list[str] = []
        #: Adding shards to the dataset there: its index.json is kept until the new one replaces it.
        self.append = append
        self.extra = dict(extra or {})

    def open(self, resume: bool, overwrite: bool, hash_algorithm: str | None) -> JournalState:
        """Start (or resume) the job; return what can be reused.

        Raises:
            ConfigError: If the destination holds a dataset or an interrupted job and
                neither ``resume`` nor ``overwrite`` says what to do with it; if the
                interrupted job was for another source or other options; if it holds
                files streamload did not write (without ``overwrite``), or ``overwrite``
                would replace one of them.
        """
        where = self.dest.url
        names = set(self.dest.list_names())
        manifest, manifest_is_ours = self._read_manifest(names)
        job = self._read_job(names)
        foreign = names - self._ours(names, manifest if manifest_is_ours else None, job)
        if manifest is not None:
            foreign.discard(MANIFEST_NAME)
        if overwrite:
            clash = foreign & (set(self.outputs) | {MANIFEST_NAME})
            if clash:
                raise ConfigError(
                    f"{where}: --overwrite would replace {_shown(clash)}, which streamload did not write "
                    "(it never deletes or replaces such a file); move it away or convert into another destination"
                )
            old = (_files_of(manifest) if manifest is not None and manifest_is_ours else set()) | self._job_files(job)
            for name in names:
                if _is_marker(name):
                    old |= {self._shard_of_marker(name), self._shard_of_marker(name) + ".idx"}
            self.replaces = sorted(n for n in (old & names) - set(self.outputs) - {MANIFEST_NAME} - _OURS if _plain(n))
            self._write_job()  # first: the files of the old dataset stay known as ours after a crash
            if manifest is not None:
                self.dest.remove(MANIFEST_NAME)  # then: never leave a stale complete-looking dataset
            self._remove_markers(names)
            self.dest.clean_staging()
            return JournalState()
        clash = foreign & (set(self.outputs) | {MANIFEST_NAME})
        if clash:
            raise ConfigError(
                f"{where}: this conversion would replace {_shown(clash)}, which streamload did not write; "
                "move it away or convert into another destination"
            )
        if job is not None:
            if not resume:
                raise ConfigError(
                    f"{where} holds an interrupted conversion; run the same command with --resume to finish it, "
                    "or with --overwrite to start over"
                )
            self._check_job(job)
            self.replaces = sorted(n for n in _names(job.get("replaces")) if _plain(n))
            if manifest is not None:
                # Published, then killed before the journal was removed: done, unless a file
                # went missing since (then the journal finishes the job like any other).
                if plan_of(manifest) == self.fingerprint and self._missing(manifest) is None:
                    return JournalState(complete=manifest)
                if not self.append:  # an append keeps the dataset it adds to readable meanwhile
                    self.dest.remove(MANIFEST_NAME)  # or the dataset this job replaces (its files are in `replaces`)
            self.dest.clean_staging()
            reusable = self._reusable(hash_algorithm)
            self._write_job()
            return JournalState(reusable)
        if self.append and manifest is not None and manifest_is_ours and plan_of(manifest) != self.fingerprint:
            self.dest.clean_staging()
            self._write_job()
            return JournalState()
        if manifest is not None:
            if not manifest_is_ours:
                pass  # an index of files other tools wrote: only --overwrite may replace it
            elif resume and plan_of(manifest) == self.fingerprint:
                self._check_complete(manifest)
                return JournalState(complete=manifest)
            elif resume:
                raise ConfigError(
                    f"{where} already holds a complete dataset, made from another source, with other options or "
                    "by an older streamload: there is nothing to resume. Use --overwrite to replace it."
                )
            raise ConfigError(f"{where} already holds a dataset (index.json); use --overwrite to replace it")
        if foreign:
            raise ConfigError(
                f"{where} is not empty and was not written by streamload (it holds {_shown(foreign)}); "
                "convert into a new or empty directory, or use --overwrite to write beside these files "
                "(streamload never deletes or replaces a file it did not write)"
            )
        self.dest.clean_staging()
        self._write_job()
        return JournalState()

    def record(self, result: ShardResult) -> None:
        """Mark a published shard as done."""
        data = json.dumps(_result_to_json(result), sort_keys=True).encode()
        self.dest.write_bytes(_marker(result.entry.name), data)

    def finish(self) -> None:
        """After ``index.json`` is published: delete the replaced dataset's files, then the journal."""
        names = set(self.dest.list_names())
        keep = set(self.outputs) | {MANIFEST_NAME}
        for name in self.replaces:
            if name in names and name not in keep:
                self.dest.remove(name)
        self._remove_markers(names)
        self.dest.remove(JOB_NAME)

    # -- internals -------------------------------------------------------------------

    def _read_manifest(self, names: set[str]) -> tuple[Manifest | None, bool]:
        """Return the destination's manifest if it is a streamload one, and whether its shards are ours."""
        if MANIFEST_NAME not in names:
            return None, False
        try:
            manifest = Manifest.loads(self.dest.read_bytes(MANIFEST_NAME), f"{self.dest.url}/{MANIFEST_NAME}")
        except (StreamloadError, ValueError):
            return None, False  # not a streamload manifest: the user's file
        return manifest, "indexed_by" not in manifest.meta  # `streamload index`: shards of another tool

    def _read_job(self, names: set[str]) -> dict[str, Any] | None:
        if JOB_NAME not in names:
            return None
        try:
            job = json.loads(self.dest.read_bytes(JOB_NAME))
        except ValueError as exc:
            return {"unreadable": str(exc)}
        return job if isinstance(job, dict) else {"unreadable": "not a JSON object"}

    def _ours(self, names: set[str], manifest: Manifest | None, job: dict[str, Any] | None) -> set[str]:
        """The names in ``names`` that streamload wrote (see the module docstring)."""
        ours = {n for n in names if n in _OURS or n.startswith(STAGING_PREFIX) or _is_marker(n)}
        if manifest is not None:
            ours |= _files_of(manifest) | {MANIFEST_NAME}
        ours |= self._job_files(job)
        if job is not None and job.get("fingerprint") == self.fingerprint:
            ours |= set(self.outputs)
        for name in names:
            if _is_marker(name):
                shard = self._shard_of_marker(name)
                ours |= {shard, shard + ".idx"}
        return ours & names

    @staticmethod
    def _job_files(job: dict[str, Any] | None) -> set[str]:
        return set() if job is None else _names(job.get("outputs")) | _names(job.get("replaces"))

    @staticmethod
    def _shard_of_marker(name: str) -> str:
        return name[len(_MARKER_PREFIX) : -len(_MARKER_SUFFIX)]

    def _job_bytes(self) -> bytes:
        job = {
            "version": _VERSION,
            "fingerprint": self.fingerprint,
            "shards": len(self.shard_names),
            "outputs": self.outputs,
            "replaces": self.replaces,
            **self.extra,
        }
        return json.dumps(job, sort_keys=True).encode()

    def _write_job(self) -> None:
        self.dest.write_bytes(JOB_NAME, self._job_bytes())

    def _check_job(self, job: dict[str, Any]) -> None:
        if "unreadable" in job and "fingerprint" not in job:
            raise ConfigError(f"{self.dest.url}/{JOB_NAME} is unreadable ({job['unreadable']}); use --overwrite")
        if job.get("fingerprint") != self.fingerprint:
            raise ConfigError(
                f"{self.dest.url}: the interrupted conversion was for another source, other options or "
                "another input set; --resume would mix them. Use --overwrite to start over."
            )

    def _missing(self, manifest: Manifest) -> str | None:
        """Return the first file of ``manifest`` that is missing or of another size, if any."""
        for entry in manifest.shards:
            for f in (entry, entry.sidecar):
                if f is not None and self.dest.exists(f.name) != f.num_bytes:
                    return f.name
        return None

    def _check_complete(self, manifest: Manifest) -> None:
        """Check that every file of a complete ``manifest`` is there with its size."""
        missing = self._missing(manifest)
        if missing is not None:
            raise ConfigError(
                f"{self.dest.url} holds this conversion, complete, but {missing} is missing or has "
                "another size: run `streamload verify` on it, or convert again with --overwrite"
            )

    def _reusable(self, hash_algorithm: str | None) -> dict[str, ShardResult]:
        out: dict[str, ShardResult] = {}
        for name in self.shard_names:
            marker = _marker(name)
            if self.dest.exists(marker) is None:
                continue
            try:
                result = _result_from_json(json.loads(self.dest.read_bytes(marker)), f"{self.dest.url}/{marker}")
            except (ManifestError, ValueError):
                self.dest.remove(marker)  # unreadable: the shard is simply written again
                continue
            files: list[FileEntry] = [result.entry]
            if result.entry.sidecar is not None:
                files.append(result.entry.sidecar)
            if result.entry.name == name and all(self._intact(f, hash_algorithm) for f in files):
                out[name] = result
            else:
                self.dest.remove(marker)
        return out

    def _intact(self, entry: FileEntry, hash_algorithm: str | None) -> bool:
        if self.dest.exists(entry.name) != entry.num_bytes:
            return False
        if hash_algorithm is None or entry.hash is None:
            return True
        return self.dest.digest(entry.name, hash_algorithm) == entry.hash

    def _remove_markers(self, names: Iterable[str]) -> None:
        for name in names:
            if _is_marker(name):
                self.dest.remove(name)
