"""The ``streamload`` command line: ``convert``, ``info``, ``show``, ``verify``, ``index``, ``demo``, ``bench``.

One module per subcommand, each with its ``add_parser(sub)`` (the small builder
:func:`build_parser` calls, in :mod:`.parser`) and its ``run(args)``; :func:`main`
(:mod:`.main`) runs one and turns its errors into one line and an exit status. The options
several subcommands share (``-o``, ``--allow-data-root``) are in :mod:`.options`; what is
printed for a person goes through :func:`terminal_safe` (:mod:`.output`).
"""

from __future__ import annotations

from .main import EXIT_CLOSED_OUTPUT, main
from .output import terminal_safe
from .parser import build_parser

__all__ = ["EXIT_CLOSED_OUTPUT", "build_parser", "main", "terminal_safe"]
