"""The command line's parts: one builder per subcommand, options read once, entry points.

The options of ``convert`` are built from the parsed arguments by name; ``-o`` and
``--allow-data-root`` become one :class:`~streamload.StorageConfig` handed to the readers,
the process environment untouched; ``python -m streamload`` runs the command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import streamload
import streamload.dataref
from streamload.cli import build_parser, main
from streamload.cli.convert import conversion_options
from streamload.cli.options import config_from_cli

ROOT = Path(__file__).resolve().parent.parent


def test_the_subcommands_keep_their_order_and_each_has_its_builder() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == ["convert", "info", "show", "verify", "index", "demo", "bench"]  # type: ignore[attr-defined]
    for name, command in sub.choices.items():  # type: ignore[attr-defined]
        assert command.get_default("func").__module__ == f"streamload.cli.{name}"


def test_convert_options_come_from_the_arguments_by_name(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["convert", "src", str(tmp_path / "out"), "--hash", "sha256", "--shard-size", "2MB", "-j", "3", "--shuffle"]
        + ["--seed", "7", "--on-error", "skip", "--executor", "local", "--no-progress", "-o", "anon=true"]
    )
    options = conversion_options(args)
    assert (options.hash_algorithm, options.shard_bytes, options.workers) == ("sha256", "2MB", 3)
    assert (options.shuffle, options.seed, options.on_error, options.progress) == (True, 7, "skip", False)
    assert (options.format, options.samples_per_shard, options.storage_options) == ("tar", None, {"anon": True})
    counted = conversion_options(build_parser().parse_args(["convert", "src", "dst", "--samples-per-shard", "9"]))
    assert (counted.samples_per_shard, counted.shard_bytes) == (9, None)  # a count wins over the default size


def test_allowed_data_roots_are_a_parameter_read_with_the_given_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMLOAD_ALLOW_DATA_ROOTS", raising=False)
    args = build_parser().parse_args(
        ["verify", "ds", "-o", "anon=true", "--allow-data-root", "s3://theirs/x", "--allow-data-root", "s3://b/y/"]
    )
    config = config_from_cli(args, cache_dir="/tmp/somewhere")
    assert config.allow_data_roots == {"s3://theirs/x": {"anon": True}, "s3://b/y": {"anon": True}}
    assert config.cache_dir == "/tmp/somewhere"
    assert config_from_cli(build_parser().parse_args(["info", "ds"])).allow_data_roots is None


def test_the_command_leaves_the_environment_alone(
    tar_dataset: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("STREAMLOAD_ALLOW_DATA_ROOTS", raising=False)
    seen: list[str | None] = []
    real = streamload.dataref.DatasetRef.open.__func__  # type: ignore[attr-defined]

    def spy(cls: type, url: str, config: streamload.StorageConfig | None = None) -> object:
        seen.append(os.environ.get("STREAMLOAD_ALLOW_DATA_ROOTS"))
        assert config is not None and config.allow_data_roots == {"s3://b/x": {}}
        return real(cls, url, config)

    monkeypatch.setattr(streamload.dataref.DatasetRef, "open", classmethod(spy))
    assert main(["info", str(tar_dataset), "--allow-data-root", "s3://b/x"]) == 0
    assert seen == [None]  # read as a parameter while the command ran, never set in the environment
    assert "samples" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["streamload", "streamload.cli"])
def test_python_dash_m_runs_the_command(module: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"streamload {streamload.__version__}"


def test_convert_info_and_verify_start_without_torch(tmp_path: Path) -> None:
    """The commands that read no samples into tensors never import torch (a second saved per command)."""
    code = (
        "import sys\n"
        "from streamload.synthetic import make_image_folder\n"
        "from streamload.cli import main\n"
        f"root = {str(tmp_path)!r}\n"
        "make_image_folder(root + '/images', num_classes=2, per_class=10, size=(8, 8))\n"
        "args = ['--samples-per-shard', '4', '--no-progress']\n"
        "assert main(['convert', root + '/images', root + '/ds', '--workers', '2', *args]) == 0\n"
        "assert main(['info', root + '/ds']) == 0 and main(['verify', root + '/ds']) == 0\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "import streamload\n"
        "assert streamload.StreamingDataset.__name__ == 'StreamingDataset' and 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "OK: 5 shards, 20 samples checked" in proc.stdout
