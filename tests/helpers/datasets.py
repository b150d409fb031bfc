"""Small datasets written shard by shard through the public writer API, with keys that say where they are."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


@contextmanager
def without_lock_settle() -> Iterator[None]:
    """Writers to a bucket skip the lock's settle wait (a second): for a fixture's one writer, racing nobody."""
    from streamload.storage.locks import RemoteLock

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RemoteLock, "settle_s", 0.0)
        yield


def make_dataset(root: Path, counts: list[int]) -> Path:
    """A tar dataset whose shard i holds counts[i] samples keyed s<i>_<j>."""
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import LocalDestination
    from streamload.writer import publish_manifest, write_shard

    fmt = get_format("tar")
    dest = LocalDestination(str(root))
    entries = []
    for i, n in enumerate(counts):
        samples = ({"__key__": f"s{i}_{j}", "txt": f"{i}-{j}".encode()} for j in range(n))
        entries.append(write_shard(fmt, dest, fmt.shard_name(i), samples).entry)
    publish_manifest(dest, Manifest(format="tar", shards=tuple(entries), fields=("txt",)))
    return root


def write_dataset(
    url: str, fmt: str, counts: list[int], tag: str, storage_options: dict[str, Any] | None = None
) -> str:
    """A dataset whose shard i holds counts[i] samples keyed <tag><i>_<j>, with a txt and a cls field."""
    from streamload.formats import get_format
    from streamload.manifest import Manifest
    from streamload.storage import open_destination
    from streamload.writer import publish_manifest, write_shard

    format_ = get_format(fmt)
    dest = open_destination(url, storage_options)
    entries = []
    for i, n in enumerate(counts):
        samples = (
            {"__key__": f"{tag}{i}_{j}", "txt": f"{tag}-{i}-{j}".encode(), "cls": str(j % 3).encode()} for j in range(n)
        )
        entries.append(write_shard(format_, dest, format_.shard_name(i), samples).entry)
    publish_manifest(dest, Manifest(format=fmt, shards=tuple(entries), fields=("cls", "txt")))
    return url
