"""Closing what is still open when the interpreter exits, while the modules it needs exist.

An iterator or a :class:`~streamload.ShardedDataset` still alive at exit would otherwise
be closed during the interpreter's teardown, after the modules' globals are gone: its
cleanup then fails on ``None`` where ``os`` or ``lmdb`` was, and Python prints "Exception
ignored in ..." for it. :func:`close_at_exit` registers such an object (weakly: it does
not keep it alive); an ``atexit`` hook closes every one still alive, before the teardown,
and drops whatever their closing raises.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

__all__ = ["close_at_exit"]


class _Closable(Protocol):
    def close(self) -> None: ...  # pragma: no cover


_LIVE: weakref.WeakSet[_Closable] = weakref.WeakSet()


def close_at_exit(obj: _Closable) -> None:
    """Close ``obj`` when the interpreter exits, if it is still alive then (held weakly)."""
    _LIVE.add(obj)


def _close_all() -> None:
    for obj in list(_LIVE):
        try:
            obj.close()
        except Exception:  # noqa: BLE001, S110 - best effort at exit: nothing is left to tell
            pass
    _LIVE.clear()


atexit.register(_close_all)
