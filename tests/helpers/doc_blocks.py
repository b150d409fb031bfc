"""The fenced code blocks of README.md and docs/*.md, and a reader that runs a page's blocks in order.

What runs and how is described in ``tests/test_readme.py``; the pages' blocks are run by two
test modules, each a share of the pages (``TRAINING_GUIDES`` in ``test_docs_training.py``,
the others in ``test_readme.py``), so that the suite's two test processes share the work.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
README = ROOT / "README.md"
#: The pages whose blocks run: the README first, then the docs in name order.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = {"python", "bash", "sh"}
#: Lines a no-run block may hold.
NO_RUN_ALLOWED = (
    re.compile(r"^bash scripts/\w+\.sh\b"),
    re.compile(r"^(mkdir -p \S+ && )?weed server .*&$"),
    re.compile(r"^(python|bash) benchmarks/[\w/.-]+\b"),
)
#: The marker of a block that shows what the block above it prints.
OUTPUT_MARKER = "<!-- output -->"
README_ENDPOINT = "http://127.0.0.1:8333"
#: The pages' placeholder credentials (SeaweedFS without identities takes any), by template.
README_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID=any AWS_SECRET_ACCESS_KEY=any": "AWS_ACCESS_KEY_ID={key} AWS_SECRET_ACCESS_KEY={secret}",
    '"key": "any", "secret": "any"': '"key": "{key}", "secret": "{secret}"',
}


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page."""

    page: str  # the page's path relative to the repository root
    index: int
    line: int
    language: str
    code: str
    marker: str  # the HTML comment just before the block, or ""

    @property
    def id(self) -> str:
        return f"{self.page}-{self.index:02d}-{self.language}-line{self.line}"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Return every fenced block of ``text`` with the HTML comment right before it.

    A fence may be indented (a block inside a list item); its code is dedented by as much.
    """
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if re.match(r"^\s*```\s*$", lines[j]))
        before = lines[start - 1].strip() if start > 0 else ""
        marker = before if before.startswith("<!--") else ""
        code = textwrap.dedent("\n".join(lines[start + 1 : end]) + "\n")
        blocks.append(Block(page, len(blocks), start + 1, fence.group(2), code, marker))
        i = end + 1
    return blocks


def relative(path: Path) -> str:
    """``path`` relative to the repository root, with forward slashes."""
    return path.relative_to(ROOT).as_posix()


BLOCKS = {relative(p): page_blocks(p.read_text(encoding="utf-8"), relative(p)) for p in PAGES}
RUNNABLE = [b for blocks in BLOCKS.values() for b in blocks if b.language in RUN_LANGUAGES]
#: The training guides, whose blocks run in ``tests/test_docs_training.py``; every other page's
#: blocks run in ``tests/test_readme.py`` (two modules: the suite's two processes share them).
TRAINING_GUIDES = frozenset(
    f"docs/{name}.md" for name in ("lightning", "mixing", "reproducibility", "resume", "threads", "tuning")
)


def no_run(block: Block) -> bool:
    """True for a block marked not to run."""
    return block.marker.startswith("<!-- readme-test: no-run")


def needs_s3(block: Block) -> bool:
    """True for a block that runs against the test S3 server."""
    return block.marker == "<!-- needs: s3 -->"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(var, None)
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MPLBACKEND"] = "Agg"
    return env


def _for_test_server(code: str, request: pytest.FixtureRequest) -> str:
    """Point an s3 block at the test server: its endpoint and credentials for the page's."""
    try:
        import tests.s3server  # noqa: F401
    except ImportError as exc:  # pragma: no cover - the S3 test server is part of the suite
        pytest.skip(f"marked `needs: s3` and tests/s3server.py is not importable: {exc}")
    server = request.getfixturevalue("s3_server")
    assert README_ENDPOINT in code, "an s3 block should use the pages' local endpoint"
    placeholders = [p for p in README_CREDENTIALS if p in code]
    assert placeholders, "an s3 block should carry the pages' placeholder credentials"
    for placeholder in placeholders:
        code = code.replace(placeholder, README_CREDENTIALS[placeholder].format(key=server.key, secret=server.secret))
    return code.replace(README_ENDPOINT, server.endpoint_url)


class Reader:
    """Runs one page's blocks in order in one directory, as a reader following it would."""

    def __init__(self, workspace: Path, blocks: list[Block]) -> None:
        self.workspace = workspace
        self.runnable = [b for b in blocks if b.language in RUN_LANGUAGES]
        #: The output block right after a runnable block, by the runnable block's index.
        self.outputs = {b.index - 1: b for b in blocks if b.marker == OUTPUT_MARKER}
        self.done: set[int] = set()

    def run_through(self, block: Block, request: pytest.FixtureRequest) -> None:
        """Run every earlier block not run yet (their files are the input of later ones), then ``block``."""
        for earlier in self.runnable:
            if earlier.index >= block.index:
                break
            if earlier.index not in self.done and not no_run(earlier):
                self._run(earlier, request, f"(an earlier block, needed by the one at line {block.line}) ")
        self._run(block, request)

    def _run(self, block: Block, request: pytest.FixtureRequest, context: str = "") -> None:
        env = _env()
        code = _for_test_server(block.code, request) if needs_s3(block) else block.code
        suffix = ".py" if block.language == "python" else ".sh"
        script = self.workspace / f"block_{block.index:02d}{suffix}"
        script.write_text(code, encoding="utf-8")
        cmd = [sys.executable, script.name] if suffix == ".py" else ["bash", "-euo", "pipefail", script.name]
        proc = subprocess.run(cmd, cwd=self.workspace, env=env, capture_output=True, text=True, timeout=540)
        self.done.add(block.index)
        assert proc.returncode == 0, (
            f"{block.where}: block {context}failed ({proc.returncode}):\n{code}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
        shown = self.outputs.get(block.index)
        if shown is not None:
            assert same_output(proc.stdout, shown.code), (
                f"{shown.where}: the page shows an output the block above does not print; it prints:\n{proc.stdout}"
            )


def same_output(printed: str, shown: str) -> bool:
    """True if ``shown`` is what was ``printed``, runs of whitespace (line wraps) counted as one space."""
    return " ".join(printed.split()) == " ".join(shown.split())


class Workspaces:
    """One fresh directory and :class:`Reader` per page, made when the page's first block runs."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.readers: dict[str, Reader] = {}

    def reader(self, page: str) -> Reader:
        if page not in self.readers:
            workspace = self.factory.mktemp(re.sub(r"\W+", "-", page))
            self.readers[page] = Reader(workspace, BLOCKS[page])
        return self.readers[page]


def check_block_runs(block: Block, workspaces: Workspaces, request: pytest.FixtureRequest) -> None:
    """Run ``block`` (and the blocks of its page before it) the way ``test_doc_block_runs`` does.

    A no-run block must give its reason and hold only the lines allowed to be skipped.
    """
    if no_run(block):
        reason = re.match(r"<!-- readme-test: no-run \((.+)\) -->", block.marker)
        assert reason, f"{block.where}: a no-run marker must give its reason in parentheses"
        for line in block.code.splitlines():
            assert any(p.match(line) for p in NO_RUN_ALLOWED), f"{block.where}: may not skip {line!r}"
        return
    assert block.marker == "" or needs_s3(block), f"{block.where}: unknown marker {block.marker!r}"
    workspaces.reader(block.page).run_through(block, request)
