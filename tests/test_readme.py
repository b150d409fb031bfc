"""Every fenced ``python`` and ``bash`` block of README.md and docs/*.md runs, in order, like a reader would.

Each page (README.md, then every ``docs/*.md``) is read in its own fresh directory (the
fixture ``workspaces``): its blocks run one after another there, each as its own process
(``python block.py`` / ``bash -euo pipefail block.sh``) with this environment's
``python``, ``streamload`` and ``weed`` first on ``PATH``. A page's own blocks make the
data its later blocks read (a page that needs a dataset starts with a block that makes
one), so every page stands on its own. Blocks in other languages (``text``, ``json``,
console output) are not run. An HTML comment on the line before a block says how to treat
it:

- ``<!-- needs: s3 -->``: run against the SeaweedFS server of ``tests/s3server.py``; the
  pages' endpoint ``http://127.0.0.1:8333`` and their placeholder credentials (``any``)
  are replaced with that server's (which, unlike the pages' server, checks them).
  Skipped, with the reason, only if that module cannot be imported.
- ``<!-- output -->`` (before a ``text`` block): the output the block above prints. The
  block above runs and what it prints must be this text (whitespace runs compared as one
  space, so a long line may be wrapped), so the page shows what the code really prints.
- ``<!-- readme-test: no-run (reason) -->``: not run. Allowed only for the two setup
  commands (``bash scripts/...``, which would run this very test again), for starting a
  long-running ``weed server`` (the test starts its own), and for benchmarks
  (``python benchmarks/...``, ``bash benchmarks/...``: measurements, not tests, and minutes
  long).
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

ROOT = Path(__file__).resolve().parent.parent
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


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS = {_relative(p): page_blocks(p.read_text(encoding="utf-8"), _relative(p)) for p in PAGES}
RUNNABLE = [b for blocks in BLOCKS.values() for b in blocks if b.language in RUN_LANGUAGES]


def _no_run(block: Block) -> bool:
    return block.marker.startswith("<!-- readme-test: no-run")


def _needs_s3(block: Block) -> bool:
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
            if earlier.index not in self.done and not _no_run(earlier):
                self._run(earlier, request, f"(an earlier block, needed by the one at line {block.line}) ")
        self._run(block, request)

    def _run(self, block: Block, request: pytest.FixtureRequest, context: str = "") -> None:
        env = _env()
        code = _for_test_server(block.code, request) if _needs_s3(block) else block.code
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


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory) -> Workspaces:
    return Workspaces(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_doc_block_runs(block: Block, workspaces: Workspaces, request: pytest.FixtureRequest) -> None:
    if _no_run(block):
        reason = re.match(r"<!-- readme-test: no-run \((.+)\) -->", block.marker)
        assert reason, f"{block.where}: a no-run marker must give its reason in parentheses"
        for line in block.code.splitlines():
            assert any(p.match(line) for p in NO_RUN_ALLOWED), f"{block.where}: may not skip {line!r}"
        return
    assert block.marker == "" or _needs_s3(block), f"{block.where}: unknown marker {block.marker!r}"
    workspaces.reader(block.page).run_through(block, request)


def test_readme_keeps_the_two_commands() -> None:
    bash = "".join(b.code for b in BLOCKS["README.md"] if b.language == "bash")
    assert "bash scripts/demo.sh" in bash and "bash scripts/test.sh" in bash


def test_readme_has_runnable_blocks() -> None:
    # Guard against a parser change that silently finds nothing to run.
    readme = [b for b in RUNNABLE if b.page == "README.md"]
    assert sum(1 for b in readme if not _no_run(b)) >= 3
    assert any(_needs_s3(b) and b.language == "python" for b in readme)


def test_docs_pages_are_found() -> None:
    # Every docs page is read; the guides carry code that runs.
    assert {"docs/index.md", "docs/design.md"} <= set(BLOCKS)
    pages_with_code = {b.page for b in RUNNABLE if not _no_run(b)}
    assert len(pages_with_code - {"README.md"}) >= 5, pages_with_code


def test_fences_are_parsed_with_their_markers() -> None:
    text = "intro\n<!-- needs: s3 -->\n```python\nprint(1)\n```\n\n1. step\n\n   ```bash\n   echo hi\n   ```\n"
    blocks = page_blocks(text, "page.md")
    assert [(b.language, b.code, b.marker, b.line) for b in blocks] == [
        ("python", "print(1)\n", "<!-- needs: s3 -->", 3),
        ("bash", "echo hi\n", "", 9),
    ]


def test_license_file_matches_the_declared_license() -> None:
    declared = re.search(r'^license = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert declared is not None and declared.group(1) == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_readme_launches_a_ddp_example_with_torchrun() -> None:
    """The README shows a torchrun launch that runs (test_doc_block_runs runs it: 2 processes on gloo)."""
    launches = [
        b
        for b in RUNNABLE
        if b.page == "README.md" and not _no_run(b) and "torchrun --standalone --nproc_per_node 2" in b.code
    ]
    assert len(launches) == 1
    assert 'init_process_group("gloo")' in launches[0].code and "DistributedDataParallel" in launches[0].code


def test_output_blocks_follow_a_block_that_runs() -> None:
    """Every ``<!-- output -->`` block is a ``text`` block right after a block that runs (so it is checked)."""
    outputs = [b for blocks in BLOCKS.values() for b in blocks if b.marker == OUTPUT_MARKER]
    assert any(b.page == "docs/resume.md" for b in outputs)
    for shown in outputs:
        assert shown.language == "text", shown.where
        above = BLOCKS[shown.page][shown.index - 1]
        assert above.language in RUN_LANGUAGES and not _no_run(above), shown.where


def test_output_comparison_allows_wrapping_only() -> None:
    printed = "{'a': 1, 'window': 312, 'b': 2}\n"
    assert same_output(printed, "{'a': 1, 'window': 312,\n 'b': 2}")
    assert not same_output(printed, "{'a': 1, 'window': 400,\n 'b': 2}")
