"""The byte interface of shard readers, kept here for the formats' imports: see :mod:`streamload.storage.bytes`."""

from __future__ import annotations

from ..storage.bytes import MAX_GAP, FileBytes, ShardBytes, gather

__all__ = ["MAX_GAP", "FileBytes", "ShardBytes", "gather"]
