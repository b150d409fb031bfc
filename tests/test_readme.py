"""Every fenced ``python`` and ``bash`` block of README.md and docs/*.md runs, in order, like a reader would.

The training guides' blocks run in ``test_docs_training.py`` (so the suite's two test
processes share the pages), every other page's here; the reader is ``tests/helpers/doc_blocks.py``.
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

import re

import pytest

from tests.helpers.doc_blocks import (
    BLOCKS,
    OUTPUT_MARKER,
    ROOT,
    RUN_LANGUAGES,
    RUNNABLE,
    TRAINING_GUIDES,
    Block,
    Workspaces,
    check_block_runs,
    needs_s3,
    no_run,
    page_blocks,
    same_output,
)


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory) -> Workspaces:
    return Workspaces(tmp_path_factory)


HERE = [b for b in RUNNABLE if b.page not in TRAINING_GUIDES]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", HERE, ids=[b.id for b in HERE])
def test_doc_block_runs(block: Block, workspaces: Workspaces, request: pytest.FixtureRequest) -> None:
    check_block_runs(block, workspaces, request)


def test_readme_keeps_the_two_commands() -> None:
    bash = "".join(b.code for b in BLOCKS["README.md"] if b.language == "bash")
    assert "bash scripts/demo.sh" in bash and "bash scripts/test.sh" in bash


def test_readme_has_runnable_blocks() -> None:
    # Guard against a parser change that silently finds nothing to run.
    readme = [b for b in RUNNABLE if b.page == "README.md"]
    assert sum(1 for b in readme if not no_run(b)) >= 3
    assert any(needs_s3(b) and b.language == "python" for b in readme)


def test_docs_pages_are_found() -> None:
    # Every docs page is read; the guides carry code that runs.
    assert {"docs/index.md", "docs/design.md"} <= set(BLOCKS)
    pages_with_code = {b.page for b in RUNNABLE if not no_run(b)}
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
        if b.page == "README.md" and not no_run(b) and "torchrun --standalone --nproc_per_node 2" in b.code
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
        assert above.language in RUN_LANGUAGES and not no_run(above), shown.where


def test_output_comparison_allows_wrapping_only() -> None:
    printed = "{'a': 1, 'window': 312, 'b': 2}\n"
    assert same_output(printed, "{'a': 1, 'window': 312,\n 'b': 2}")
    assert not same_output(printed, "{'a': 1, 'window': 400,\n 'b': 2}")
