"""StreamingDataModule with streams: a real Lightning fit over a mixture (one process, 2 persistent workers)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from streamload import ConfigError, Stream
from tests.helpers.datasets import write_dataset

pl = pytest.importorskip("lightning.pytorch")

EPOCHS, BATCH, EPOCH_SIZE = 3, 5, 40


def tagged(sample: dict[str, Any]) -> str:
    return f"{sample['__source__']}:{sample['__key__']}"


class Recorder(pl.LightningModule):  # type: ignore[misc]
    """A one-weight model that records which samples each training epoch and validation saw."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: dict[str, list[str]] = {}

    def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(f"train{self.current_epoch}", []).extend(batch)
        return (self.weight**2).sum() + 0 * len(batch)

    def validation_step(self, batch: list[str], batch_idx: int) -> None:
        self.seen.setdefault(f"val{self.current_epoch}", []).extend(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_fit_reads_the_training_mixture_in_exact_counts_every_epoch(tmp_path: Path) -> None:
    from streamload.lightning import LoaderOptions, StreamingDataModule

    a = write_dataset(str(tmp_path / "a"), "tar", [8, 7, 10], "a")  # 25 samples
    b = write_dataset(str(tmp_path / "b"), "lmdb", [6, 9], "b")  # 15 samples
    dm = StreamingDataModule(
        [Stream(a, weight=0.75, name="a"), Stream(b, weight=0.25, name="b")],
        [Stream(a, name="a"), Stream(b, name="b")],
        batch_size=BATCH,
        num_workers=2,
        transform=tagged,
        seed=4,
        epoch_size=EPOCH_SIZE,
        loader=LoaderOptions(persistent_workers=True),
    )
    model = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=dm)
    epochs = [model.seen[f"train{e}"] for e in range(EPOCHS)]
    for keys in epochs:
        assert Counter(k.split(":")[0] for k in keys) == {"a": 30, "b": 10}
        per_key = Counter(keys)
        assert max(v for k, v in per_key.items() if k.startswith("b:")) == 1, "b is subsampled: each once"
        assert sorted(Counter(v for k, v in per_key.items() if k.startswith("a:")).items()) == [(1, 20), (2, 5)]
    assert epochs[0] != epochs[1] != epochs[2], "SetEpochCallback reshuffles (and resamples) each epoch"
    for e in range(EPOCHS):
        assert Counter(k.split(":")[0] for k in model.seen[f"val{e}"]) == {"a": 25, "b": 15}
    with pytest.raises(ConfigError, match="epoch_size"):
        StreamingDataModule(a, dataset_options={"epoch_size": 3})
