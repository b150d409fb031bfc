"""`streamload demo` (the README's first command) runs end to end."""

from __future__ import annotations

from pathlib import Path

from streamload.cli import main


def test_demo_runs_end_to_end(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--dir", str(tmp_path), "--images", "200", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "demo finished" in out
    # 200 samples: per-sample dicts each once; batches of 256 pad the one batch to 256.
    assert "per-sample dicts: 200 samples, each exactly once:" in out
    assert "(RawCollate, shared memory): 200 samples, 256 with padding" in out
    assert "256 samples, each exactly once" not in out
    assert "per-class counts [20, 20, 20, 20, 20, 20, 20, 20, 20, 20]" in out
    assert (tmp_path / "shards-tar" / "index.json").is_file()


def test_demo_run_again_replaces_its_own_output_only(tmp_path: Path, capsys) -> None:
    args = ["demo", "--dir", str(tmp_path), "--images", "30", "--workers", "0"]
    assert main(args) == 0
    capsys.readouterr()
    (tmp_path / "notes.txt").write_text("mine")
    assert main([*args[:-3], "20", "--workers", "0"]) == 0  # fewer images: nothing of the first run is left
    out = capsys.readouterr().out
    assert f"replacing the previous demo output in {tmp_path}: images, shards-tar" in out
    assert "per-class counts [2, 2, 2, 2, 2, 2, 2, 2, 2, 2]" in out
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # a folder the demo did not write is not replaced without --overwrite
    other = tmp_path / "other"
    (other / "images").mkdir(parents=True)
    (other / "images" / "keep.jpg").write_bytes(b"x")
    other_args = ["demo", "--dir", str(other), "--images", "20", "--workers", "0"]
    assert main(other_args) == 2
    assert "not written by streamload demo; pass --overwrite" in capsys.readouterr().err
    assert (other / "images" / "keep.jpg").exists()
    assert main([*other_args, "--overwrite"]) == 0
    assert not (other / "images" / "keep.jpg").exists()
