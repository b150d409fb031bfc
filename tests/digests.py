"""A file's digest by the algorithm its manifest names (for tests that re-seal a manifest as a hostile writer would)."""

from __future__ import annotations

from typing import Any

from streamload.manifest import new_hasher


def digest(data: bytes, manifest: dict[str, Any]) -> str:
    """Return the hex digest of ``data`` with the algorithm of ``manifest`` (a parsed ``index.json``)."""
    hasher = new_hasher(manifest.get("hash") or "sha256")
    hasher.update(data)
    return hasher.hexdigest()
