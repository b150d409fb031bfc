"""The test suite's own layout: files named by subject, helpers shared from non-test modules.

Read from the source (``ast``) of every module under ``tests/``:

* no module imports from a ``test_*`` module (shared helpers live in ``tests/helpers/``
  or in the fixture modules beside the tests), so each test file can run, move or be
  split alone;
* no docstring and no test name cites the tracker (a number after a hash sign, the word for
  a tracker item): a test says what it checks, and the reader needs nothing outside the
  repository to understand it;
* no test file is named by round (``test_hostile3``, ``test_cluster_more``): a file name
  says what its tests are about.

Each rule is also run on small bad samples, so a rule that stopped matching fails too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

ISSUE = re.compile(r"\bissues?\b|#\d+", re.IGNORECASE)
ROUND_NAME = re.compile(r"(\d|_more|_extra|_again|_round|_new)$")
# subjects whose own names end in a digit
DIGIT_SUBJECTS = {"s3", "hdf5", "h5", "md5", "sha256", "xxh3", "utf8", "uint8", "int64"}


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _test_module_imports(path: Path, source: str) -> list[str]:
    """``line: name`` of each import of a ``test_*`` module in ``source`` (the module at ``path``)."""
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        for name in names:
            if any(part.startswith("test_") for part in name.split(".")):
                found.append(f"{node.lineno}: {name}")
                break
    return found


def _issue_citations(path: Path, source: str) -> list[str]:
    """``line: text`` of each docstring or test name in ``source`` that cites the tracker."""
    found = []
    tree = ast.parse(source, str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        line = getattr(node, "lineno", 1)
        cited = ISSUE.search(ast.get_docstring(node, clean=False) or "")
        if cited:
            found.append(f"{line}: {cited.group(0)!r} in a docstring")
        if not isinstance(node, ast.Module) and re.search(r"issue_?\d|_\d+_issue|issue\d", node.name, re.IGNORECASE):
            found.append(f"{line}: {node.name}")
    return found


def _round_named(path: Path) -> bool:
    last = path.stem.rpartition("_")[2]
    return path.name.startswith("test_") and last not in DIGIT_SUBJECTS and bool(ROUND_NAME.search(path.stem))


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = {
        str(p.relative_to(TESTS)): found for p in _modules() if (found := _test_module_imports(p, p.read_text()))
    }
    assert not offenders, f"move the shared helpers into tests/helpers/: {offenders}"


def test_no_docstring_or_test_name_cites_an_issue() -> None:
    offenders = {str(p.relative_to(TESTS)): found for p in _modules() if (found := _issue_citations(p, p.read_text()))}
    assert not offenders, f"say what the test checks, not which issue asked for it: {offenders}"


def test_test_files_are_named_by_subject_not_by_round() -> None:
    offenders = [str(p.relative_to(TESTS)) for p in _modules() if _round_named(p)]
    assert not offenders, f"name each file by what its tests are about: {offenders}"


@pytest.mark.parametrize(
    "source",
    [
        "from tests.test_cache import _entry\n",
        "from .test_batch import in_shared_memory\n",
        "import tests.test_ddp\n",
        "from tests import test_mix\n",
        "def f():\n    from tests.test_split import make_dataset\n",
    ],
)
def test_the_import_rule_catches_every_spelling(source: str) -> None:
    assert _test_module_imports(Path("x.py"), source)


def test_the_import_rule_lets_helpers_and_fixtures_through() -> None:
    source = "from tests.helpers.datasets import make_dataset\nfrom tests.s3server import SeaweedS3\nimport pytest\n"
    assert _test_module_imports(Path("x.py"), source) == []


@pytest.mark.parametrize(
    "source",
    [
        '"""Issue #13: a soak."""\n',
        'def test_x():\n    """Covers #12."""\n',
        'class TestX:\n    """What the issue asks for."""\n',
        "def test_issue_30_case():\n    pass\n",
    ],
)
def test_the_issue_rule_catches_docstrings_and_names(source: str) -> None:
    assert _issue_citations(Path("x.py"), source)


def test_the_issue_rule_ignores_code_and_comments() -> None:
    source = 'def test_x():\n    """Sample keys are checked."""\n    # see sample #0\n    assert "sample #0"\n'
    assert _issue_citations(Path("x.py"), source) == []


@pytest.mark.parametrize(
    "name", ["test_hostile3.py", "test_cluster_more.py", "test_s3_2.py", "test_cache_extra.py", "test_hdf52.py"]
)
def test_the_name_rule_catches_names_by_round(name: str) -> None:
    assert _round_named(Path(name))


@pytest.mark.parametrize(
    "name", ["test_s3.py", "test_append.py", "test_hdf5.py", "test_split.py", "s3server.py", "helpers/v2.py"]
)
def test_the_name_rule_lets_subject_names_through(name: str) -> None:
    assert not _round_named(Path(name))
