"""StreamingDataModule under real Lightning: a 2-process CPU DDP fit (gloo) and the epoch hook.

The DDP test runs this file as a script. Lightning's ``strategy="ddp"`` starts the other
ranks by re-running the launching command (``sys.argv``) with ``LOCAL_RANK`` set, so it
cannot be launched from inside pytest (it would re-run pytest); ``ddp_spawn`` could, but
it pickles the module and data module into fresh interpreters and is not what users run.
Each rank writes the keys it saw per epoch to a JSON file that the test then checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.synthetic import make_image_folder

NUM_SAMPLES = 99  # odd: two ranks need one padded sample per epoch
BATCH = 8
EPOCHS = 2
STEPS_BEFORE_STOP = 3


def key_and_label(sample: dict[str, Any]) -> tuple[str, float]:
    """Transform: the sample's key and its label as a float (the images are not needed)."""
    return sample["__key__"], float(sample["cls"].decode())


def _make_lightning_module(out: Path) -> Any:
    import lightning.pytorch as pl

    class Recorder(pl.LightningModule):
        """A one-weight regression that records which keys each rank saw in each epoch."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: dict[str, list[str]] = {}

        def _record(self, name: str, keys: list[str]) -> None:
            self.seen.setdefault(name, []).extend(keys)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            keys, labels = batch
            self._record(f"train{self.current_epoch}", list(keys))
            return ((self.weight - labels.float()) ** 2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            keys, _ = batch
            self._record(f"val{self.current_epoch}", list(keys))

        def on_train_start(self) -> None:
            loader = self.trainer.train_dataloader
            sampler = loader.sampler
            self._dump(
                "loader",
                {
                    "sampler": type(sampler).__name__,
                    "num_workers": loader.num_workers,
                    "prefetch_factor": loader.prefetch_factor,
                    "persistent_workers": loader.persistent_workers,
                    "batches": len(loader),
                    "dataset_len": len(loader.dataset),
                },
            )

        def on_fit_end(self) -> None:
            self._dump("seen", self.seen)

        def _dump(self, what: str, data: Any) -> None:
            (out / f"{what}-rank{self.global_rank}.json").write_text(json.dumps(data))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recorder()


def fit(
    data: str,
    out: Path,
    devices: int,
    epochs: int = EPOCHS,
    tag: str = "",
    resume: str | None = None,
    steps: int = -1,
    stateful: bool = False,
    checkpoint_every: int | None = None,
) -> None:
    """Fit the recorder for ``epochs`` epochs with ``strategy="ddp"`` over ``devices`` CPU processes.

    Every call builds a fresh data module, as a new process would.
    """
    import lightning.pytorch as pl

    from streamload.lightning import LoaderOptions, StreamingDataModule

    dm = StreamingDataModule(
        data,
        data,
        batch_size=BATCH,
        num_workers=2,
        transform=key_and_label,
        seed=3,
        loader=LoaderOptions(persistent_workers=True, prefetch_factor=3, stateful=stateful),
    )
    callbacks = []
    if checkpoint_every is not None:  # a checkpoint taken mid-epoch, in out/tag/mid.ckpt
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=str(out / tag), filename="mid", every_n_train_steps=checkpoint_every, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=epochs,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    trainer.fit(_make_lightning_module(out / tag if tag else out), datamodule=dm, ckpt_path=resume)
    if tag:
        trainer.save_checkpoint(str(out / tag / "last.ckpt"))


def fit_and_resume_mid_epoch(data: str, out: Path) -> None:
    """One process, stateful loaders: one epoch (``full/``), 3 steps (``first/``), the rest resumed."""
    for tag in ("full", "first", "resumed"):
        (out / tag).mkdir()
    fit(data, out, 1, 1, tag="full", stateful=True)
    fit(data, out, 1, 1, tag="first", steps=STEPS_BEFORE_STOP, stateful=True, checkpoint_every=STEPS_BEFORE_STOP)
    fit(data, out, 1, 1, tag="resumed", resume=str(out / "first" / "mid.ckpt"), stateful=True)


def fit_and_resume(data: str, out: Path) -> None:
    """One process: a full run (``full/``), a one-epoch run (``first/``), and a resumed run."""
    for tag in ("full", "first", "resumed"):
        (out / tag).mkdir()
    fit(data, out, 1, EPOCHS, tag="full")
    fit(data, out, 1, 1, tag="first")
    fit(data, out, 1, EPOCHS, tag="resumed", resume=str(out / "first" / "last.ckpt"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    root = tmp_path_factory.mktemp("lightning-images")
    made = make_image_folder(str(root), num_classes=3, per_class=NUM_SAMPLES // 3, size=(8, 8), fmt="PNG")
    out = tmp_path_factory.mktemp("lightning-shards")
    convert(ImageFolderSource(str(root)), str(out), ConvertOptions(samples_per_shard=10, progress=False))
    keys = {rel.rsplit(".", 1)[0] for rel, _ in made}
    assert len(keys) == NUM_SAMPLES
    return out, keys


def _padded(world_size: int) -> int:
    """The items of an epoch: NUM_SAMPLES padded to whole global batches of BATCH * world_size."""
    step = BATCH * world_size
    return -(-NUM_SAMPLES // step) * step


def _repeats(seen: list[str], keys: set[str], total: int) -> list[str]:
    """Check that ``seen`` is the padded epoch: every key, ``total`` in all, the fewest repeats.

    Returns the repeated keys, sorted.
    """
    counts = Counter(seen)
    assert len(seen) == total
    assert set(counts) == keys  # the whole set, nothing else
    assert max(counts.values()) <= 2  # fewer than N extra items: nothing is read three times
    repeats = sorted(k for k, c in counts.items() if c == 2)
    assert len(repeats) == total - NUM_SAMPLES  # only the padding repeats
    return repeats


def _run_script(data: Path, out: Path, devices: int, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), str(data), str(out), str(devices)]
    full_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", **(env or {})}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        full_env.pop(var, None)
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"fit failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _load(out: Path, what: str, rank: int) -> Any:
    return json.loads((out / f"{what}-rank{rank}.json").read_text())


@pytest.mark.slow
def test_ddp_fit_two_cpu_processes_equal_shares_cover_everything(
    dataset: tuple[Path, set[str]], tmp_path: Path
) -> None:
    data, keys = dataset
    _run_script(data, tmp_path, devices=2)
    # Every epoch is padded to whole global batches of 2 * BATCH (the first samples again).
    per_rank = _padded(2) // 2

    for rank in (0, 1):
        loader = _load(tmp_path, "loader", rank)
        # Lightning injected no DistributedSampler; our settings reached the DataLoader.
        assert "Distributed" not in loader["sampler"], loader["sampler"]
        assert (loader["num_workers"], loader["prefetch_factor"], loader["persistent_workers"]) == (2, 3, True)
        assert loader["dataset_len"] == per_rank
        assert loader["batches"] == per_rank // BATCH  # whole batches only

    seen = [_load(tmp_path, "seen", rank) for rank in (0, 1)]
    full = NUM_SAMPLES // (2 * BATCH) * BATCH  # each rank's whole batches; 3 samples are left for the short one
    for epoch in range(EPOCHS):
        train = [s[f"train{epoch}"] for s in seen]
        assert [len(share) for share in train] == [per_rank, per_rank], epoch
        _repeats(train[0] + train[1], keys, _padded(2))
        # Validation reads every sample exactly once (pad=False): the short last global batch of
        # 3 is shared 1 + 2, so both ranks run the same number of batches and nothing is repeated.
        val = [s[f"val{epoch}"] for s in seen]
        assert [len(share) for share in val] == [full + 1, full + 2], epoch
        assert Counter(val[0] + val[1]) == Counter(keys)
    # set_epoch reached the (persistent) workers: the shuffled order changes between epochs.
    for s in seen:
        assert s["train0"] != s["train1"]
        assert s["val0"] == s["val1"]  # validation is read in order


@pytest.mark.slow
def test_resumed_run_reads_the_epoch_it_resumes_in(dataset: tuple[Path, set[str]], tmp_path: Path) -> None:
    # A fresh dataset starts at epoch 0; after resuming at epoch 1 from a checkpoint,
    # SetEpochCallback must make it read epoch 1's order, as the uninterrupted run did.
    data, keys = dataset
    _run_script(data, tmp_path, devices=0)
    full = _load(tmp_path / "full", "seen", 0)
    resumed = _load(tmp_path / "resumed", "seen", 0)
    assert "train0" not in resumed  # it really started at epoch 1
    _repeats(resumed["train1"], keys, _padded(1))
    assert full["train1"] != full["train0"]
    assert resumed["train1"] == full["train1"]


@pytest.mark.slow
def test_stateful_loader_resumes_mid_epoch_at_the_next_unseen_batch(
    dataset: tuple[Path, set[str]], tmp_path: Path
) -> None:
    # Stop after 3 steps, checkpoint, resume: Lightning stores the StatefulDataLoader's
    # state in the checkpoint, and the resumed run reads exactly the rest of the epoch.
    data, keys = dataset
    _run_script(data, tmp_path, devices=-1)
    full = _load(tmp_path / "full", "seen", 0)["train0"]
    first = _load(tmp_path / "first", "seen", 0)["train0"]
    rest = _load(tmp_path / "resumed", "seen", 0)["train0"]
    assert len(first) == STEPS_BEFORE_STOP * BATCH
    _repeats(full, keys, _padded(1))
    assert first + rest == full


def test_datamodule_outside_a_trainer_builds_loaders(dataset: tuple[Path, set[str]]) -> None:
    from streamload.lightning import StreamingDataModule

    data, keys = dataset
    dm = StreamingDataModule(data, batch_size=BATCH, transform=key_and_label, shuffle=False)
    dm.setup("fit")
    got = [k for batch_keys, _ in dm.train_dataloader() for k in batch_keys]
    # In order (manifest order: by class, then image), then the first samples again as padding.
    in_order = sorted(keys)
    padded = in_order + in_order[: _padded(1) - NUM_SAMPLES]
    assert got == padded
    with pytest.raises(Exception, match="no val dataset"):
        dm.val_dataloader()
    # Validation and test read every sample exactly once, in order: the last batch is short.
    test_dm = StreamingDataModule(test=str(data), batch_size=BATCH, transform=key_and_label)
    test_dm.setup("test")
    loader = test_dm.test_dataloader()
    assert [k for batch_keys, _ in loader for k in batch_keys] == in_order
    assert len(loader) == -(-NUM_SAMPLES // BATCH)
    val_dm = StreamingDataModule(data, data, batch_size=BATCH, transform=key_and_label)
    val_dm.setup("fit")
    batches = [list(batch_keys) for batch_keys, _ in val_dm.val_dataloader()]
    assert [len(b) for b in batches] == [BATCH] * (NUM_SAMPLES // BATCH) + [NUM_SAMPLES % BATCH]
    assert Counter(k for b in batches for k in b) == Counter(keys)
    assert len(val_dm.datasets["val"]) == NUM_SAMPLES and len(val_dm.datasets["train"]) == _padded(1)
    padded_val = StreamingDataModule(test=str(data), batch_size=BATCH, dataset_options={"pad": True})
    padded_val.setup("test")
    assert len(padded_val.datasets["test"]) == _padded(1)  # pad=True asked for: as before
    with pytest.raises(Exception, match="dataset_options may not set"):
        StreamingDataModule(data, dataset_options={"shuffle": True})


def test_datamodule_with_batches_made_in_the_workers(dataset: tuple[Path, set[str]]) -> None:
    from streamload.decode import DecodeBatch
    from streamload.lightning import StreamingDataModule

    data, _ = dataset
    dm = StreamingDataModule(data, data, batch_size=BATCH, num_workers=2, collate=DecodeBatch(8), shuffle=False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = [(images.clone(), labels.clone()) for images, labels in loader]
    assert len(loader) == len(batches) == _padded(1) // BATCH
    assert all(images.shape == (BATCH, 3, 8, 8) and images.dtype == torch.uint8 for images, _ in batches)
    labels = torch.cat([labels for _, labels in batches])
    # Classes of NUM_SAMPLES // 3 in order; the padding repeats the first samples (class 0).
    per_class = NUM_SAMPLES // 3
    expected = [i // per_class for i in range(NUM_SAMPLES)] + [i // per_class for i in range(_padded(1) - NUM_SAMPLES)]
    assert torch.bincount(labels).tolist() == torch.bincount(torch.tensor(expected)).tolist()


def test_import_streamload_without_lightning() -> None:
    # A meta-path finder that hides lightning, as if the extra were not installed.
    code = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('lightning', 'pytorch_lightning'):
            raise ImportError('hidden: ' + name)
sys.meta_path.insert(0, Hide())
import streamload, streamload.cli
streamload.cli.build_parser()
try:
    import streamload.lightning
except ImportError as exc:
    assert "pip install 'streamload[lightning]'" in str(exc), exc
    print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


if __name__ == "__main__":
    # python tests/test_lightning.py DATA OUT DEVICES
    # (DEVICES=0: fit_and_resume; -1: fit_and_resume_mid_epoch; both on one process)
    if int(sys.argv[3]) == 0:
        fit_and_resume(sys.argv[1], Path(sys.argv[2]))
    elif int(sys.argv[3]) == -1:
        fit_and_resume_mid_epoch(sys.argv[1], Path(sys.argv[2]))
    else:
        fit(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
