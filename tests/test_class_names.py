"""Class names: 30,000 of them checked for repeats in one pass, none longer than 1 KiB, none printed whole.

``index`` read a Hugging Face ``ClassLabel``'s names and checked each against all the
others (30,000 names took 21 s); a 1 MB name was accepted, and ``info``/``show`` printed
it as one line of a million characters. The files here are written by the ``datasets``
library (and pyarrow, for a ``ClassLabel`` that ``datasets`` itself would refuse).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from PIL import Image

from streamload.cli import main

pytestmark = pytest.mark.timeout(120)

MANY = 30_000


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 5), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


def _hf_parquet(path: Path, names: list[str], labels: list[int]) -> None:
    """A split file as ``datasets`` writes it: an Image column and a ClassLabel of ``names``."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    rows = {"image": [{"bytes": _png(), "path": None}] * len(labels), "label": labels}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))


def _with_class_names(path: Path, names: list[str]) -> None:
    """Rewrite ``path`` (pyarrow) with its ClassLabel's names replaced by ``names`` (repeats included)."""
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    info = json.loads(meta[b"huggingface"])
    info["info"]["features"]["label"]["names"] = names
    meta[b"huggingface"] = json.dumps(info).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


class _Counted(str):
    """A str that counts the equality tests made on it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Counted.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_repeats_are_found_in_one_pass() -> None:
    from streamload._classes import repeated

    names = [_Counted(f"n{i:05d}") for i in range(MANY)] + [_Counted("n00007"), _Counted("n29999")]
    _Counted.compared = 0
    assert repeated(names) == ["n00007", "n29999"]
    assert _Counted.compared <= 4 * len(names)  # each name against the one it hashes with: not against all


def test_index_takes_30000_classlabel_names_and_names_a_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    names = [f"synset_{i:05d}" for i in range(MANY)]
    _hf_parquet(folder / "a.parquet", names, [0, 1, MANY - 1])
    assert main(["index", str(folder), "--format", "parquet"]) == 0
    manifest = json.loads((folder / "index.json").read_text())
    assert manifest["classes"] == names
    capsys.readouterr()
    _with_class_names(folder / "a.parquet", [*names[:-1], "synset_12345"])
    assert main(["index", str(folder), "--format", "parquet", "--overwrite"]) == 2
    assert "names class 'synset_12345' more than once" in capsys.readouterr().err


def test_a_class_name_over_1_kib_is_refused_naming_its_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    _hf_parquet(folder / "a.parquet", ["cat", "dog", "x" * 1_000_000], [0, 1])
    assert main(["index", str(folder), "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "class #2" in err and "1,000,000 bytes" in err and "1024 bytes" in err
    assert len(err) < 1000  # the name is not printed whole
    assert not (folder / "index.json").exists()
    (folder / "a.parquet").unlink()
    _hf_parquet(folder / "a.parquet", ["cat", "dog"], [0, 1])
    # 1024 bytes of UTF-8 is the bound: 512 two-byte characters pass, 513 do not
    assert main(["index", str(folder), "--format", "parquet", "--classes", "cat," + "é" * 512]) == 0
    assert main(["index", str(folder), "--format", "parquet", "--overwrite", "--classes", "cat," + "é" * 513]) == 2
    assert "--classes: class #1" in capsys.readouterr().err


@pytest.fixture
def dataset(tar_dataset: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    shutil.copytree(tar_dataset, out)
    return out


def _set_classes(ds: Path, change: Any) -> None:
    path = ds / "index.json"
    manifest = json.loads(path.read_text())
    manifest["classes"] = change(manifest["classes"])
    path.write_text(json.dumps(manifest))


def test_a_manifest_with_a_1_mb_class_name_is_refused_in_one_line(
    dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _set_classes(dataset, lambda c: [c[0], "y" * 1_000_000, *c[2:]])
    assert main(["info", str(dataset)]) == 2
    out, err = capsys.readouterr()
    assert "classes: class #1" in err and "1,000,000 bytes" in err
    assert len(out + err) < 1000


def test_info_and_show_print_at_most_60_characters_of_a_name(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = "z" * 1000  # within the bound: kept, but not printed whole
    _set_classes(dataset, lambda c: [long, *c[1:]])
    assert main(["info", str(dataset)]) == 0
    assert main(["show", str(dataset), "0"]) == 0
    out = capsys.readouterr().out
    assert long not in out and "z" * 57 + "..." in out
    assert max(len(line) for line in out.splitlines()) < 400
