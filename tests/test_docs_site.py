"""The documentation site builds, and the docs stand on their own.

``mkdocs build --strict`` turns every warning into a failure: a broken link between pages,
a page missing from the nav, an API reference that no longer resolves, a docstring griffe
cannot parse.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: References the docs must not carry: files that live outside this repository.
FOREIGN = ("../" + "shared", "DESIGN" + ".md", "STYLE" + ".md")
#: Paths checked for FOREIGN: the whole repository.
CHECKED = (".",)


def _text(page: Path) -> str:
    """The visible text of an HTML page, whitespace collapsed."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", body)))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


@pytest.mark.timeout(300)
def test_site_builds_with_the_api_reference(site: Path) -> None:
    api = _text(site / "api" / "index.html")
    assert "streamload.StreamingDataset" in api
    # A sentence of StreamingDataset's docstring, rendered from the code.
    assert "Every sample is read exactly once per epoch over all ranks and DataLoader workers" in api
    assert "streamload.converters.convert" in api and "Convert source into a dataset at dst" in api
    assert "StreamingDataModule" in api  # streamload.lightning
    assert "streamload.CorruptShardError" in api


@pytest.mark.timeout(300)
def test_site_has_every_page_and_the_design_anchors(site: Path) -> None:
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    for page in pages - {"index"}:
        assert (site / page / "index.html").is_file(), page
    design = (site / "design" / "index.html").read_text(encoding="utf-8")
    anchors = [
        "sample-model",
        "a-dataset-on-disk",
        "epochs-and-the-split",
        "stop-and-resume",
        "storage-and-the-cache",
        "conversion",
        "errors",
        "untrusted-input",
    ]
    for anchor in anchors:
        assert f'id="{anchor}"' in design, anchor
    assert not (site / "gen_cli.py").exists()


def test_design_headings_are_stable() -> None:
    # Code docstrings cite these sections as docs/design.md#<anchor>: same headings, same order.
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert re.findall(r"^## (.+)$", text, flags=re.MULTILINE) == [
        "Sample model",
        "A dataset on disk",
        "Epochs and the split",
        "Stop and resume",
        "Storage and the cache",
        "Conversion",
        "Errors",
        "Untrusted input",
    ]


def test_docs_cite_no_file_outside_the_repository() -> None:
    """Every file git tracks or would track is searched for references to files outside the repository."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    files = [name for name in listed if name]
    assert "README.md" in files and "docs/design.md" in files
    found = []
    for name in files:
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        found += [f"{name}: {ref}" for ref in FOREIGN if ref in text]
    assert not found, "references to files outside the repository:\n" + "\n".join(found)
