"""The argument parser of the ``streamload`` command: one small builder per subcommand, in its own module."""

from __future__ import annotations

import argparse

from . import bench, convert, demo, index, info, show, verify

__all__ = ["build_parser", "subparser"]

#: The subcommands in the order ``--help`` lists them: each module's ``add_parser(sub)`` adds one.
SUBCOMMANDS = (convert, info, show, verify, index, demo, bench)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``streamload`` command."""
    parser = argparse.ArgumentParser(
        prog="streamload", description="Shard image datasets and stream them into PyTorch."
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """Return the parser of subcommand ``command`` (``parser`` itself if there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser | None = action.choices.get(command)
            return found or parser
    return parser


def _version() -> str:
    from .. import __version__

    return f"streamload {__version__}"
