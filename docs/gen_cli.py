"""Regenerate the command-line reference from ``streamload.cli.build_parser()``.

    python docs/gen_cli.py            # print what would be written
    python docs/gen_cli.py --write    # update README.md (between the cli-reference
                                      # markers) and docs/cli.md

``tests/test_cli_reference.py`` fails when either file no longer matches the parser
(a subcommand or option added, renamed or removed), and names this script.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CLI_MD = ROOT / "docs" / "cli.md"
START, END = "<!-- cli-reference:start -->", "<!-- cli-reference:end -->"
WIDTH = "100"  # argparse wraps to $COLUMNS; fixed so the output does not depend on the terminal


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Return ``{name: subparser}`` of a parser built with ``add_subparsers``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Return ``{name: one-line help}`` of the subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _usage(sub: argparse.ArgumentParser) -> str:
    prefix = "usage: "
    lines = sub.format_usage().rstrip().splitlines()
    # Drop "usage: " and shift the continuation lines left by as much.
    return "\n".join(
        line[len(prefix) :] if line.startswith(" " * len(prefix)) or i == 0 else line for i, line in enumerate(lines)
    )


def readme_block(parser: argparse.ArgumentParser) -> str:
    """The README's synopsis: one usage block per subcommand, with its one-line help."""
    helps = summaries(parser)
    lines = [START, "```text"]
    for name, sub in subcommands(parser).items():
        lines.append(f"# {helps.get(name, '')}")
        lines.append(_usage(sub))
        lines.append("")
    lines[-1] = "```"
    lines.append(END)
    return "\n".join(lines)


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    """``docs/cli.md``: the full ``--help`` of every subcommand."""
    helps = summaries(parser)
    out = [
        "# Command-line reference",
        "",
        "Generated from `streamload.cli.build_parser()` by `python docs/gen_cli.py --write`;",
        "`tests/test_cli_reference.py` checks it against the parser. Every command prints",
        "errors as one line and exits 2 (an empty path, a number out of range, a full disk too);",
        "`verify` exits 1 when it finds a problem. A command whose standard output is closed",
        "early (`streamload info DS | head -1`) stops quietly with status 141 (128 + SIGPIPE,",
        "what a shell reports for `yes | head -1`; `set -o pipefail` makes a pipeline fail on",
        "it, as for any Unix tool) and no traceback. Text that comes from a dataset (class",
        "names, keys, paths) is printed with control and invisible characters escaped. An",
        "error names the options it mentions as the command spells them (`--on-error skip`,",
        "not the Python keyword `on_error='skip'`). `convert` names, after its summary, every",
        "file it did not take (`  ignored PATH: why`: the first 20, photos of kinds it does not",
        "read such as HEIC and AVIF first, then a count), every input it skipped",
        "(`  skipped PATH: why`), library warnings (`  warning PATH: ...`) and names that differ",
        "from another only in Unicode normalization (`  twin PATH [NFD twin] ...`).",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    for name, sub in subcommands(parser).items():
        out += [
            "",
            f"## streamload {name}",
            "",
            helps.get(name, "").capitalize() + ".",
            "",
            "```text",
            sub.format_help().rstrip(),
            "```",
        ]
    return "\n".join(out) + "\n"


def update_readme(text: str, block: str) -> str:
    """Return ``text`` with the part between the markers replaced by ``block``."""
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{README}: markers {START} ... {END} not found")
    return pattern.sub(lambda _: block, text, count=1)


def main(argv: list[str]) -> int:
    """Print or write the generated reference."""
    os.environ["COLUMNS"] = WIDTH
    from streamload.cli import build_parser

    parser = build_parser()
    block, full = readme_block(parser), cli_markdown(parser)
    if "--write" not in argv:
        print(block)
        print(full)
        return 0
    README.write_text(update_readme(README.read_text(encoding="utf-8"), block), encoding="utf-8")
    CLI_MD.write_text(full, encoding="utf-8")
    print(f"updated {README.relative_to(ROOT)} and {CLI_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
