"""The training guides' code blocks (resume, mixing, reproducibility, tuning, Lightning, threads) run in order.

The same reader as ``test_readme.py`` (``tests/helpers/doc_blocks.py``): each page in its own
fresh directory, each block its own process, ``<!-- output -->`` blocks compared with what
the block above prints. These pages run here, apart from the others, so that the suite's two
test processes share the pages' blocks (a test file stays in one process).
"""

from __future__ import annotations

import pytest

from tests.helpers.doc_blocks import BLOCKS, RUNNABLE, TRAINING_GUIDES, Block, Workspaces, check_block_runs, no_run

HERE = [b for b in RUNNABLE if b.page in TRAINING_GUIDES]


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory) -> Workspaces:
    return Workspaces(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", HERE, ids=[b.id for b in HERE])
def test_doc_block_runs(block: Block, workspaces: Workspaces, request: pytest.FixtureRequest) -> None:
    check_block_runs(block, workspaces, request)


def test_every_training_guide_is_a_page_with_code_that_runs() -> None:
    # A guide renamed or emptied would otherwise drop out of both modules silently.
    assert TRAINING_GUIDES <= set(BLOCKS)
    assert {b.page for b in HERE if not no_run(b)} == TRAINING_GUIDES
