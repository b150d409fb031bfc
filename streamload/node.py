"""The one state protocol of the read path's nodes: ``state()`` and ``reset(state)``.

Every node of the chain (source → plan → fetch → read → map → collate → device; see
``docs/architecture.md``) keeps plain data that says where it stands (:meth:`Node.state`:
JSON-safe, nothing that needs pickling), and takes it back (:meth:`Node.reset`): ``None``
starts it afresh, a state returned by :meth:`Node.state` of a node of its kind puts it
where that one stood. A node that holds only what it fetched or made ahead (ranges,
stand-ins) drops it on any reset: a resumed chain reads it again. A chain's state is its
nodes' states nested under their names (:meth:`streamload.stages.Pipeline.state`), as
torchdata's nodes nest theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["Node"]


@runtime_checkable
class Node(Protocol):
    """A node of the read path: its state as plain data, and a reset to a state (or afresh)."""

    def state(self) -> Mapping[str, Any] | None:
        """Where the node stands, as plain data (``None``: nothing to say)."""

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Start afresh (``None``) or stand where ``state`` (from :meth:`state`) says."""
