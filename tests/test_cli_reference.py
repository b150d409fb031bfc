"""The README's command-line synopsis and docs/cli.md match the real parser.

Checked by content, not by exact text (argparse's wrapping differs between Python
versions): the same subcommands, and for each the same long options and positionals.
On failure, regenerate both with ``python docs/gen_cli.py --write``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from streamload.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
HINT = "regenerate with: python docs/gen_cli.py --write"


def _parser_commands() -> dict[str, tuple[set[str], set[str]]]:
    """{subcommand: (long options, positional names)} straight from build_parser()."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, tuple[set[str], set[str]]] = {}
    for name, sub in subs.choices.items():
        options = {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
        positionals = {a.metavar or a.dest for a in sub._actions if not a.option_strings}
        out[name] = (options, positionals)
    return out


def _sections(text: str, header: str) -> dict[str, str]:
    """Split ``text`` at lines matching ``header`` (a regex with one group: the command)."""
    parts = re.split(header, text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _check(documented: dict[str, str], where: str) -> None:
    expected = _parser_commands()
    assert set(documented) == set(expected), f"{where}: subcommands differ from the parser; {HINT}"
    for name, body in documented.items():
        options, positionals = expected[name]
        found = set(re.findall(r"--[a-z][a-z0-9-]*", body)) - {"--help"}
        assert found == options, f"{where}: `streamload {name}` options differ: {found ^ options}; {HINT}"
        for positional in positionals:
            assert re.search(rf"\b{re.escape(positional)}\b", body), f"{where}: {name} lacks {positional}; {HINT}"


def test_readme_synopsis_matches_parser() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- cli-reference:start -->(.*?)<!-- cli-reference:end -->", readme, re.DOTALL)
    assert block is not None, "README.md lost its cli-reference markers"
    _check(_sections(block.group(1), r"^streamload (\w+) "), "README.md")


def test_cli_md_matches_parser() -> None:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    _check(_sections(text, r"^## streamload (\w+)$"), "docs/cli.md")


@pytest.mark.parametrize("command", sorted(_parser_commands()))
def test_every_documented_command_answers_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from streamload.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"usage: streamload {command}" in capsys.readouterr().out
