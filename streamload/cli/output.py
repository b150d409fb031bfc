"""What the command line prints for a person, made safe for a terminal.

Everything printed for a person (not ``--json``, which stays exact JSON with its control
characters escaped by JSON itself) goes through :func:`terminal_safe`: class names, keys,
paths, ``meta`` and error texts come from datasets others wrote, and an escape sequence
there must not reach the terminal (set its title, clear the screen, write the clipboard by
OSC 52, or forge a line), nor an invisible character hide in a name.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Sequence
from typing import Any

from .._redact import redact

__all__ = ["SafeFormatter", "say", "terminal_safe", "twin_marks"]

#: Unicode categories a terminal acts on or shows as nothing: controls (C0, C1, DEL), format
#: characters (bidirectional overrides and isolates, zero-width spaces and joiners, BOM, soft
#: hyphen), lone surrogates (undecodable file names) and the line and paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def terminal_safe(text: object) -> str:
    r"""Return ``str(text)`` with every character a terminal would act on, or show as nothing, escaped.

    Controls, bidirectional marks and overrides, zero-width and other invisible format
    characters, lone surrogates and line separators are written as Python escapes (ESC as
    ``\x1b``, a zero-width space as ``\u200b``); everything printable is kept.
    """
    out = str(text)
    if out.isprintable():  # the common case; non-printable is a superset of what is escaped
        return out
    return "".join(_escape(c) if unicodedata.category(c) in _UNSAFE_CATEGORIES else c for c in out)


def _form(name: str) -> str:
    """The Unicode normalization form ``name`` is written in: NFC, NFD or mixed."""
    if unicodedata.is_normalized("NFC", name):
        return "NFC"
    return "NFD" if unicodedata.is_normalized("NFD", name) else "mixed"


def twin_marks(names: Sequence[str]) -> dict[int, str]:
    """Return ``{position: "[NFC twin]"...}`` for the names that differ from another only in Unicode normalization.

    ``"café"`` written with a precomposed ``é`` (NFC) and with ``e`` + a combining accent
    (NFD) look identical but are different names (two classes, two keys).
    """
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(unicodedata.normalize("NFC", name), []).append(i)
    return {i: f"[{_form(names[i])} twin]" for group in groups.values() if len(group) > 1 for i in group}


def say(*parts: object, file: Any = None) -> None:
    """``print`` for a person: each part made :func:`terminal_safe`, the passwords of URLs in it shown as ``***``."""
    print(*(terminal_safe(redact(str(p))) for p in parts), file=file)


class SafeFormatter(logging.Formatter):
    """Log lines of a command made :func:`terminal_safe` (keys and paths in them come from datasets), URLs redacted."""

    def format(self, record: logging.LogRecord) -> str:
        """The record formatted, the passwords of URLs in it shown as ``***``, then made :func:`terminal_safe`."""
        return terminal_safe(redact(super().format(record)))
