"""What ``show`` and ``verify`` write into the shard cache: where it is, and how much they wrote."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

from .._units import format_bytes
from .output import say

__all__ = ["CacheUse", "cache_dirs", "data_root_of"]


def data_root_of(url: str, storage: Any) -> str | None:
    """The ``data_root`` the manifest at ``url`` names, if any, without validating a local manifest twice.

    A local ``index.json`` is only searched for the field (validating a manifest of many
    shards takes seconds, and ``verify`` does it anyway); a remote one is loaded.
    """
    from ..dataref import DatasetRef
    from ..manifest import MANIFEST_NAME
    from ..storage import is_local, local_path_of

    if not is_local(url):
        return DatasetRef.open(url, storage).manifest.data_root
    try:
        with open(os.path.join(local_path_of(url), MANIFEST_NAME), "rb") as f:
            raw = f.read()
        if b'"data_root"' not in raw:
            return None
        root = json.loads(raw).get("data_root")
    except (OSError, ValueError, AttributeError):
        return None  # verify says what is wrong with it
    return root if isinstance(root, str) else None


def cache_dirs(url: str, data_root: str | None, storage_options: dict[str, Any], cache_dir: str | None) -> list[str]:
    """The shard-cache folders of a dataset (its URL's, its ``data_root``'s), and the key indexes' folder."""
    from ..storage import is_local
    from ..storage.cachedir import dataset_cache_key
    from ..storageconfig import StorageConfig

    base = os.path.expanduser(StorageConfig(cache_dir=cache_dir).cache_directory())
    remote = [u for u in (url, data_root) if u is not None and not is_local(u)]
    return [os.path.join(base, dataset_cache_key(u, storage_options)) for u in remote] + [os.path.join(base, "keys")]


def _tree_bytes(folders: Iterable[str]) -> int:
    """Bytes of the regular files below ``folders`` (links not followed; a file linked twice counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = list(folders)
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
            except OSError:
                continue
    return total


class CacheUse:
    """What a command wrote into the shard cache, measured before and after; said on stderr."""

    def __init__(self, command: str, folders: list[str], remote: bool) -> None:
        self.command, self.folders, self.remote = command, folders, remote
        self.before = _tree_bytes(folders)

    def report(self) -> None:
        """Say where the cache is and how much this command wrote there (if it is remote or wrote anything)."""
        after = _tree_bytes(self.folders)
        written = max(after - self.before, 0)
        if not (self.remote or written):
            return
        used = [f for f in self.folders if os.path.isdir(f)] or self.folders[:1]
        say(
            f"streamload {self.command}: {format_bytes(written)} written to the cache "
            f"{', '.join(used)} ({format_bytes(after)} there now; --cache-dir DIR puts it elsewhere, "
            "deleting the folder frees it)",
            file=sys.stderr,
        )
