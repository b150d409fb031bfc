"""StreamingDataModule without a validation split, under the real Lightning Trainer (one CPU process).

Lightning tells "no validation loader" from whether ``val_dataloader`` is overridden; a data
module without ``val`` must read as having none, so a module without ``validation_step``
trains without "You passed in a `val_dataloader` but have no `validation_step`".
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from streamload import ConfigError
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder

pl = pytest.importorskip("lightning.pytorch")


def key_and_label(sample: dict[str, Any]) -> tuple[str, float]:
    return sample["__key__"], float(sample["cls"].decode())


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("lval")
    make_image_folder(str(root / "images"), num_classes=2, per_class=8, size=(8, 8))
    convert(ImageFolderSource(str(root / "images"), check="none"), str(root / "ds"), ConvertOptions(progress=False))
    return str(root / "ds")


class _Regression(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        _, labels = batch
        return ((self.weight - labels.float()) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _WithValidation(_Regression):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        raise AssertionError("no validation loader: never called")


def _fit(model: Any, data: str) -> list[str]:
    from streamload.lightning import StreamingDataModule

    dm = StreamingDataModule(data, batch_size=4, num_workers=0, transform=key_and_label)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    return [str(w.message) for w in caught]


def test_no_val_split_sets_off_no_val_dataloader_warning(data: str) -> None:
    model = _Regression()
    said = _fit(model, data)
    assert model.steps == 4  # 16 samples, batches of 4: it trained
    assert not [s for s in said if "val_dataloader" in s], said


def test_validation_step_without_val_split_is_lightnings_own_skip(data: str) -> None:
    said = _fit(_WithValidation(), data)
    assert any("You defined a `validation_step` but have no `val_dataloader`" in s for s in said), said


def test_the_absent_loaders_still_say_what_to_pass(data: str) -> None:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from streamload.lightning import StreamingDataModule

    dm = StreamingDataModule(data, batch_size=4)
    assert is_overridden("train_dataloader", dm)
    assert not is_overridden("val_dataloader", dm) and not is_overridden("test_dataloader", dm)
    with pytest.raises(ConfigError, match="no val dataset: pass val=URL"):
        dm.val_dataloader()
    with pytest.raises(ConfigError, match="no test dataset: pass test=URL"):
        dm.test_dataloader()
    both = StreamingDataModule(data, data, test=data, batch_size=4)
    assert is_overridden("val_dataloader", both) and is_overridden("test_dataloader", both)
