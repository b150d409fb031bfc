"""The argument parser of the ``streamload`` command: one small builder per subcommand, in its own module."""

from __future__ import annotations

import argparse
import re

from . import bench, convert, demo, index, info, show, verify

__all__ = ["build_parser", "cli_spelling", "subparser"]

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


#: ``name=value`` as the Python API writes an option in a message: ``on_error='skip'``, ``samples_per_shard=0``.
_KEYWORD = re.compile(r"""(?<![\w/.=-])([a-z][a-z0-9_]*)=('[^'\s]*'|"[^"\s]*"|[^\s,;:)'"/]+)""")


def cli_spelling(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with each option written as the command ``parser`` spells it: ``--on-error skip``.

    Messages come from the library, which names options as keyword arguments
    (``on_error='skip'``); a command-line user has typed ``--on-error skip``. Only names
    that are options of ``parser`` (by their ``dest``) are rewritten.
    """
    options = {
        action.dest: next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }

    def spell(match: re.Match[str]) -> str:
        option = options.get(match.group(1))
        if option is None:
            return match.group(0)
        return f"{option} {match.group(2).strip(chr(34) + chr(39))}"

    return _KEYWORD.sub(spell, message)


def _version() -> str:
    from .. import __version__

    return f"streamload {__version__}"
