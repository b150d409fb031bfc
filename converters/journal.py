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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from streamload._errors import ConfigError, ManifestError
from streamload.manifest import MANIFEST_NAME, FileEntry, ShardEntry, SkippedInput
from streamload.storage import Destination
from streamload.writer import ShardResult

from .source import Item

__all__ = ["JOB_NAME", "Journal", "plan_fingerprint"]

JOB_NAME = "_streamload-convert.json"
_VERSION = 1


def plan_fingerprint(job: dict[str, Any], tasks: Sequence[tuple[int, Sequence[Item]]]) -> str:
    """Return a digest of the job options and the exact shard plan (every item, in order)."""
    h = hashlib.sha256(json.dumps(job, sort_keys=True).encode())
    for index, items in tasks:
        h.update(f"\n#{index}".encode())
        for item in items:
            h.update(json.dumps(asdict(item), sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def _marker(shard_name: str) -> str:
    return f"_done-{shard_name}.json"


def _result_to_json(result: ShardResult) -> dict[str, Any]:
    return {
        "entry": result.entry.to_json(),
        "fields": sorted(result.fields),
        "skipped": [s.to_json() for s in result.skipped],
        "payload_bytes": result.payload_bytes,
    }


def _result_from_json(obj: Any, where: str) -> ShardResult:
    try:
        entry = ShardEntry.from_json(obj["entry"], where)
        return ShardResult(
            entry=entry,
            fields=set(obj["fields"]),
            skipped=[SkippedInput(str(s["path"]), str(s["error"])) for s in obj["skipped"]],
            payload_bytes=int(obj["payload_bytes"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: malformed conversion marker ({exc})") from exc


class Journal:
    """Records finished shards of one conversion at its destination."""

    def __init__(self, dest: Destination, fingerprint: str, shard_names: Sequence[str]) -> None:
        self.dest = dest
        self.fingerprint = fingerprint
        self.shard_names = list(shard_names)

    def open(self, resume: bool, overwrite: bool, hash_algorithm: str | None) -> dict[str, ShardResult]:
        """Start (or resume) the job; return the shards that can be reused, by name.

        Raises:
            ConfigError: If the destination holds a dataset or an interrupted job and
                neither ``resume`` nor ``overwrite`` says what to do with it, or if the
                interrupted job was for another source or other options.
        """
        has_manifest = self.dest.exists(MANIFEST_NAME) is not None
        has_job = self.dest.exists(JOB_NAME) is not None
        where = self.dest.url
        if overwrite:
            self.dest.remove(MANIFEST_NAME)  # first: never leave a stale complete-looking dataset
            self._remove_markers()
            self.dest.remove(JOB_NAME)
        elif has_job and not resume:
            raise ConfigError(
                f"{where} holds an interrupted conversion; run the same command with --resume to finish it, "
                "or with --overwrite to start over"
            )
        elif has_manifest and not has_job:
            raise ConfigError(f"{where} already holds a dataset (index.json); use --overwrite to replace it")
        self.dest.clean_staging()
        reusable: dict[str, ShardResult] = {}
        if resume and has_job and not overwrite:
            self._check_job()
            reusable = self._reusable(hash_algorithm)
        self.dest.write_bytes(JOB_NAME, self._job_bytes())
        return reusable

    def record(self, result: ShardResult) -> None:
        """Mark a published shard as done."""
        data = json.dumps(_result_to_json(result), sort_keys=True).encode()
        self.dest.write_bytes(_marker(result.entry.name), data)

    def finish(self) -> None:
        """Remove the journal after ``index.json`` is published."""
        self._remove_markers()
        self.dest.remove(JOB_NAME)

    # -- internals -------------------------------------------------------------------

    def _job_bytes(self) -> bytes:
        job = {"version": _VERSION, "fingerprint": self.fingerprint, "shards": len(self.shard_names)}
        return json.dumps(job, sort_keys=True).encode()

    def _check_job(self) -> None:
        try:
            job = json.loads(self.dest.read_bytes(JOB_NAME))
        except ValueError as exc:
            raise ConfigError(f"{self.dest.url}/{JOB_NAME} is unreadable ({exc}); use --overwrite") from exc
        if not isinstance(job, dict) or job.get("fingerprint") != self.fingerprint:
            raise ConfigError(
                f"{self.dest.url}: the interrupted conversion was for another source, other options or "
                "another input set; --resume would mix them. Use --overwrite to start over."
            )

    def _reusable(self, hash_algorithm: str | None) -> dict[str, ShardResult]:
        out: dict[str, ShardResult] = {}
        for name in self.shard_names:
            marker = _marker(name)
            if self.dest.exists(marker) is None:
                continue
            result = _result_from_json(json.loads(self.dest.read_bytes(marker)), f"{self.dest.url}/{marker}")
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

    def _remove_markers(self) -> None:
        for name in self.shard_names:
            self.dest.remove(_marker(name))
