"""Every fenced ``python`` and ``bash`` block of README.md runs, in order, like a reader would.

The blocks run one after another in one fresh directory (the fixture ``workspace``), each
as its own process (``python block.py`` / ``bash -euo pipefail block.sh``) with this
environment's ``python``, ``streamload`` and ``weed`` first on ``PATH``; the README's own
blocks make the data the later ones read. An HTML comment on the line before a block
says how to treat it:

- ``<!-- needs: s3 -->``: run against the SeaweedFS server of ``tests/s3server.py``; the
  README's endpoint ``http://127.0.0.1:8333`` and its placeholder credentials (``any``)
  are replaced with that server's (which, unlike the README's server, checks them).
  Skipped, with the reason, only if that module cannot be imported.
- ``<!-- readme-test: no-run (reason) -->``: not run. Allowed only for the two setup
  commands (``bash scripts/...``, which would run this very test again) and for starting
  a long-running ``weed server`` (the test starts its own).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
RUN_LANGUAGES = {"python", "bash", "sh"}
#: Lines a no-run block may hold.
NO_RUN_ALLOWED = (re.compile(r"^bash scripts/\w+\.sh\b"), re.compile(r"^(mkdir -p \S+ && )?weed server .*&$"))
README_ENDPOINT = "http://127.0.0.1:8333"
#: The README's placeholder credentials (SeaweedFS without identities takes any), by template.
README_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID=any AWS_SECRET_ACCESS_KEY=any": "AWS_ACCESS_KEY_ID={key} AWS_SECRET_ACCESS_KEY={secret}",
    '"key": "any", "secret": "any"': '"key": "{key}", "secret": "{secret}"',
}


@dataclass(frozen=True)
class Block:
    """A fenced code block of the README."""

    index: int
    line: int
    language: str
    code: str
    marker: str  # the HTML comment just before the block, or ""

    @property
    def id(self) -> str:
        return f"{self.index:02d}-{self.language}-line{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """Return every fenced block of ``text`` with the HTML comment right before it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[start - 1].strip() if start > 0 else ""
        marker = before if before.startswith("<!--") else ""
        code = "\n".join(lines[start + 1 : end]) + "\n"
        blocks.append(Block(len(blocks), start + 1, fence.group(1), code, marker))
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))
RUNNABLE = [b for b in BLOCKS if b.language in RUN_LANGUAGES]


def _no_run(block: Block) -> bool:
    return block.marker.startswith("<!-- readme-test: no-run")


def _needs_s3(block: Block) -> bool:
    return block.marker == "<!-- needs: s3 -->"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty directory in which the README's blocks run in order."""
    return tmp_path_factory.mktemp("readme")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(var, None)
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MPLBACKEND"] = "Agg"
    return env


def _for_test_server(code: str, request: pytest.FixtureRequest) -> str:
    """Point an s3 block at the test server: its endpoint and credentials for the README's."""
    try:
        import tests.s3server  # noqa: F401
    except ImportError as exc:  # pragma: no cover - the S3 test server is part of the suite
        pytest.skip(f"marked `needs: s3` and tests/s3server.py is not importable: {exc}")
    server = request.getfixturevalue("s3_server")
    assert README_ENDPOINT in code, "an s3 block should use the README's local endpoint"
    placeholders = [p for p in README_CREDENTIALS if p in code]
    assert placeholders, "an s3 block should carry the README's placeholder credentials"
    for placeholder in placeholders:
        code = code.replace(placeholder, README_CREDENTIALS[placeholder].format(key=server.key, secret=server.secret))
    return code.replace(README_ENDPOINT, server.endpoint_url)


class Reader:
    """Runs the README's blocks in order in one directory, as a reader following it would."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.done: set[int] = set()

    def run_through(self, block: Block, request: pytest.FixtureRequest) -> None:
        """Run every earlier block not run yet (their files are the input of later ones), then ``block``."""
        for earlier in RUNNABLE:
            if earlier.index >= block.index:
                break
            if earlier.index not in self.done and not _no_run(earlier):
                self._run(earlier, request, f"(an earlier block, needed by the one at line {block.line}) ")
        self._run(block, request)

    def _run(self, block: Block, request: pytest.FixtureRequest, context: str = "") -> None:
        env = _env()
        code = _for_test_server(block.code, request) if _needs_s3(block) else block.code
        suffix = ".py" if block.language == "python" else ".sh"
        script = self.workspace / f"readme_block_{block.index:02d}{suffix}"
        script.write_text(code, encoding="utf-8")
        cmd = [sys.executable, script.name] if suffix == ".py" else ["bash", "-euo", "pipefail", script.name]
        proc = subprocess.run(cmd, cwd=self.workspace, env=env, capture_output=True, text=True, timeout=540)
        self.done.add(block.index)
        assert proc.returncode == 0, (
            f"README block at line {block.line} {context}failed ({proc.returncode}):\n{code}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )


@pytest.fixture(scope="module")
def reader(workspace: Path) -> Reader:
    return Reader(workspace)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_block_runs(block: Block, reader: Reader, request: pytest.FixtureRequest) -> None:
    if _no_run(block):
        reason = re.match(r"<!-- readme-test: no-run \((.+)\) -->", block.marker)
        assert reason, f"line {block.line}: a no-run marker must give its reason in parentheses"
        for line in block.code.splitlines():
            assert any(p.match(line) for p in NO_RUN_ALLOWED), f"line {block.line}: may not skip {line!r}"
        return
    assert block.marker == "" or _needs_s3(block), f"line {block.line}: unknown marker {block.marker!r}"
    reader.run_through(block, request)


def test_readme_keeps_the_two_commands() -> None:
    bash = "".join(b.code for b in BLOCKS if b.language == "bash")
    assert "bash scripts/demo.sh" in bash and "bash scripts/test.sh" in bash


def test_readme_has_runnable_blocks() -> None:
    # Guard against a parser change that silently finds nothing to run.
    assert sum(1 for b in RUNNABLE if not _no_run(b)) >= 5
    assert any(_needs_s3(b) and b.language == "python" for b in RUNNABLE)
