"""`streamload demo` (the README's first command) runs end to end."""

from __future__ import annotations

from pathlib import Path

from streamload.cli import main


def test_demo_runs_end_to_end(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--dir", str(tmp_path), "--images", "200", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "each exactly once" in out and "demo finished" in out
    assert "per-class counts [20, 20, 20, 20, 20, 20, 20, 20, 20, 20]" in out
    assert (tmp_path / "shards-tar" / "index.json").is_file()
