"""PyTorch Lightning integration: :class:`StreamingDataModule` and :class:`SetEpochCallback`.

Needs the optional ``lightning`` package (``pip install 'streamload[lightning]'``);
``import streamload`` never imports this module, so the core works without it.

How the pieces meet in a ``Trainer(strategy="ddp", devices=N)`` run::

    setup(stage)           -- on every rank: StreamingDataset(..., rank=trainer.global_rank,
                              world_size=trainer.world_size, batch_size=batch_size)
    train_dataloader()     -- asked for by the fit loop after a checkpoint (if any) restored
                              current_epoch: dataset.set_epoch(trainer.current_epoch), then
                              a DataLoader (or StatefulDataLoader) without a sampler;
                              Lightning injects a DistributedSampler only for map-style data
    iter(loader)           -- for the run's first epoch right away, before any epoch hook;
                              each worker plans its share of this rank's share
    on_train_epoch_start   -- SetEpochCallback: set_epoch(current_epoch) before the later
                              epochs' iter(loader); shared memory, so persistent workers see it

Rank and world are the trainer's own, passed explicitly. Detecting them at iteration time
would also work (the process group exists by then, forked workers inherit it, and a
spawned worker gets the world its parent saw), but the trainer's values are the ones
Lightning reasons with, and they make ``len(dataset)`` right wherever it is asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import DataLoader

from ._errors import ConfigError
from .batch import RawBatch, RawCollate
from .dataset import StreamingDataset
from .loader import Loader
from .storageconfig import STORAGE_KEYWORDS, StorageConfig, config_from_arguments
from .streams import StreamSource
from .watching import Mark, Watch, attached_watch, watch

if TYPE_CHECKING:
    from .devicedecode import DeviceDecode

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "streamload.lightning needs PyTorch Lightning: pip install 'streamload[lightning]' (or pip install lightning)"
    ) from exc

__all__ = ["DataWatchCallback", "LoaderOptions", "SetEpochCallback", "StreamingDataModule", "streaming_datasets"]


@dataclass(frozen=True)
class LoaderOptions:
    """DataLoader settings of a :class:`StreamingDataModule`, other than batch size and workers.

    Attributes:
        pin_memory: Copy batches into page-locked memory so ``.to(device, non_blocking=True)``
            can overlap the copy with compute (only helps with a GPU).
        persistent_workers: Keep workers alive between epochs (skips re-forking and
            re-opening shards each epoch); ignored when ``num_workers == 0``.
        prefetch_factor: Batches each worker loads ahead (PyTorch's default is 2); ignored
            when ``num_workers == 0``.
        drop_last: Drop each rank's last incomplete batch.
        collate_fn: Batch collation function (PyTorch's default collate if ``None``).
        stateful: Use ``torchdata``'s ``StatefulDataLoader`` (the ``stateful`` extra).
            Lightning then stores the loader's position in every checkpoint and restores
            it, so a run resumed from a mid-epoch checkpoint continues at the first unseen
            batch instead of replaying the epoch from its start.
        watch: Watch the training loader (:func:`streamload.watch`) and log its figures to
            the trainer's loggers every logging step (:class:`DataWatchCallback`):
            ``data/wait_fraction``, ``data/wait_p50_ms``, ``data/wait_p95_ms`` and each
            stage's share, ``data/share_<stage>``. The data module's :attr:`watch` then
            holds the whole run's :class:`~streamload.DataReport`.
    """

    pin_memory: bool = False
    persistent_workers: bool = True
    prefetch_factor: int | None = None
    drop_last: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None
    stateful: bool = False
    watch: bool = True


class StreamingDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` reading train/val/test splits with :class:`StreamingDataset`.

    Works with any strategy and device count, DDP included, without a
    ``DistributedSampler``: each rank reads its own equal share of every training epoch
    (padded like ``DistributedSampler``, so no rank waits on another; validation and
    test read every sample exactly once, ``pad=False``), and the training set is
    reshuffled every epoch through :class:`SetEpochCallback`, which :meth:`setup` adds to
    the trainer unless one is already there.

    Args:
        train: Training dataset directory or URL, or a :class:`~streamload.Stream` or list
            of streams to mix (``None``: no training loader).
        val: Validation dataset directory or URL, or streams.
        test: Test dataset directory or URL, or streams.
        batch_size: Samples per batch on each rank.
        num_workers: DataLoader worker processes per rank.
        transform: Sample transform of the training set, e.g. :class:`~streamload.ImageLabel`.
        eval_transform: Transform of the validation and test sets (default: ``transform``).
        collate: Make whole batches in the workers, e.g.
            ``DecodeBatch(224, crop="random", flip=True)`` (see :mod:`streamload.batch`):
            batches then cross to the main process as shared-memory tensors without a
            copy, and the DataLoader does not batch again (``batch_size=None``).
        eval_collate: Batch maker of the validation and test sets (default: ``collate``).
        device_decode: Decode on the training device (a :class:`~streamload.DeviceDecode`):
            the workers only read bytes (``collate`` defaults to
            :class:`~streamload.batch.RawCollate`), each raw batch stays on the host
            through Lightning's ``transfer_batch_to_device`` and is decoded in
            ``on_after_batch_transfer`` on the trainer's device (the decode is moved there:
            each DDP rank its own GPU), so ``training_step`` receives ``(images, labels)``.
            The validation and test sets are decoded by it too, unless ``eval_collate``
            makes their batches (for them, give a center-crop decode as
            ``eval_device_decode``).
        eval_device_decode: The validation and test sets' :class:`~streamload.DeviceDecode`
            (default: ``device_decode``).
        shuffle: Shuffle the training set (validation and test are read in order).
        seed: Shuffle seed; with the epoch it fixes the order on every rank.
        loader: Other DataLoader settings; or ``"threads"``: read with
            :class:`streamload.Loader` on ``num_workers`` threads of each rank's process
            instead of worker processes (the same batches; no ``/dev/shm``; see
            ``docs/threads.md``). Its state is saved in Lightning's checkpoints.
        epoch_size: Samples per training epoch, all ranks (the training set only; see
            :class:`StreamingDataset`): subsamples or upsamples one dataset, or sets the
            size the training streams' weights share.
        storage: How every split's files are reached (a :class:`~streamload.StorageConfig`:
            fsspec options, cache, read-ahead, cached or streamed).
        dataset_options: Further :class:`StreamingDataset` keyword arguments for every
            split, e.g. ``drop_last``, ``shuffle_window``, ``partitions``, ``on_error``,
            ``pad``. The validation and test sets default to ``pad=False``: each sample
            scored once, the last batch short, ranks' counts differing by at most one
            (Lightning's ``self.log(..., sync_dist=True)`` and torchmetrics reduce once
            per epoch, which is what uneven ranks need); training keeps ``pad=True``.
            Storage settings given here (``storage_options``, ``cache_dir``...) are
            deprecated (a ``DeprecationWarning``; pass ``storage=``).

    Example:
        >>> dm = StreamingDataModule("shards/train", "shards/val", batch_size=64,
        ...                          num_workers=4, transform=ImageLabel(size=224))  # doctest: +SKIP
        >>> Trainer(strategy="ddp", devices=2).fit(model, datamodule=dm)  # doctest: +SKIP
        >>> mixed = StreamingDataModule([Stream("s3://web", weight=0.7), Stream("/data/books", weight=0.3)],
        ...                             "shards/val", epoch_size=1_000_000, batch_size=64)  # doctest: +SKIP
    """

    #: The training loader's watch (``LoaderOptions(watch=True)``): ``dm.watch.report()``.
    watch: Watch[Any] | None = None

    def __init__(
        self,
        train: StreamSource | None = None,
        val: StreamSource | None = None,
        test: StreamSource | None = None,
        *,
        batch_size: int = 32,
        num_workers: int = 0,
        transform: Callable[[Any], Any] | None = None,
        eval_transform: Callable[[Any], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        eval_collate: Callable[[list[Any]], Any] | None = None,
        device_decode: DeviceDecode | None = None,
        eval_device_decode: DeviceDecode | None = None,
        shuffle: bool = True,
        seed: int = 0,
        loader: LoaderOptions | Literal["threads"] | None = None,
        epoch_size: int | None = None,
        storage: StorageConfig | None = None,
        dataset_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"{batch_size=} must be >= 1")
        if num_workers < 0:
            raise ConfigError(f"{num_workers=} must be >= 0")
        reserved = {"shuffle", "seed", "transform", "collate", "rank", "world_size", "batch_size", "epoch_size"}
        clash = (reserved | {"storage"}) & set(dataset_options or {})
        if clash:
            raise ConfigError(f"dataset_options may not set {sorted(clash)}; use the arguments of the same name")
        options = dict(dataset_options or {})
        old = {name: options.pop(name) for name in STORAGE_KEYWORDS if name in options}
        #: The storage settings of every split (``None``: the defaults).
        self.storage = config_from_arguments("StreamingDataModule", storage, old)
        #: Each split's source: a URL, a stream or a list of streams (``None``: no such split).
        self.urls: dict[str, StreamSource | None] = {"train": train, "val": val, "test": test}
        self.epoch_size = epoch_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.transform = transform
        self.eval_transform = transform if eval_transform is None else eval_transform
        self.device_decode, self.eval_device_decode = _device_decodes(device_decode, eval_device_decode)
        if self.device_decode is not None and collate is None:
            collate = RawCollate()
        if self.eval_device_decode is not None and eval_collate is None:
            eval_collate = collate if isinstance(collate, RawCollate) else RawCollate()
        self.collate = collate
        self.eval_collate = collate if eval_collate is None else eval_collate
        self._on_device: dict[tuple[int, str], DeviceDecode] = {}
        #: ``True``: read on threads (:class:`streamload.Loader`), ``num_workers`` of them.
        self.threads = loader == "threads"
        if isinstance(loader, str) and not self.threads:
            raise ConfigError(f"loader={loader!r} must be a LoaderOptions or 'threads'")
        if self.threads and num_workers < 1:
            raise ConfigError(f"loader='threads' reads on num_workers threads: {num_workers=} must be >= 1")
        self.loader = loader if isinstance(loader, LoaderOptions) else LoaderOptions()
        if collate is not None and self.loader.collate_fn is not None:
            raise ConfigError("pass either collate= (batches made by the dataset) or LoaderOptions(collate_fn=)")
        self.shuffle = shuffle
        self.seed = seed
        self.dataset_options = options
        self.datasets: dict[str, StreamingDataset] = {}
        # A split not given has no loader method as far as Lightning can tell: it decides
        # "no validation loader" from whether val_dataloader is overridden, and would
        # otherwise warn "You passed in a `val_dataloader` but have no `validation_step`".
        for split, absent in _ABSENT.items():
            if self.urls[split] is None:
                setattr(self, f"{split}_dataloader", absent)

    # -- decoding on the device (device_decode=) ----------------------------------------

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Leave a raw batch on the host when it is decoded on the device (the decoder reads host bytes)."""
        if isinstance(batch, RawBatch) and (self.device_decode or self.eval_device_decode) is not None:
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Decode a raw batch on the trainer's device: ``(images, labels)`` (see ``device_decode``)."""
        if not isinstance(batch, RawBatch):
            return batch
        trainer = self.trainer
        training = trainer is None or bool(getattr(trainer, "training", True))
        decode = self.device_decode if training else self.eval_device_decode
        if decode is None:
            return batch
        device = trainer.strategy.root_device if trainer is not None else decode.device
        key = (id(decode), str(device))
        placed = self._on_device.get(key)
        if placed is None:
            placed = self._on_device[key] = decode if decode.device == device else decode.to(device)
        return placed(batch)

    # -- datasets --------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Build the datasets ``stage`` needs (on every rank) and register the epoch callback.

        Args:
            stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
        """
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage, ())
        rank_world = self._rank_world()
        for split in wanted:
            built = self.datasets.get(split)
            # Rebuild one made before a trainer was attached (or by another trainer).
            if self.urls[split] is not None and (built is None or (built.rank, built.world_size) != rank_world):
                self.datasets[split] = self._build(split)
        trainer = self.trainer  # None outside a Trainer
        if trainer is None:
            return
        # Trainer.callbacks is public and documented, but assigned outside __init__.
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, SetEpochCallback) for cb in callbacks):
            callbacks.append(SetEpochCallback())
        if self.loader.watch and not any(isinstance(cb, DataWatchCallback) for cb in callbacks):
            callbacks.append(DataWatchCallback())

    def _build(self, split: str) -> StreamingDataset:
        url = self.urls[split]
        assert url is not None
        rank, world_size = self._rank_world()
        train = split == "train"
        options: dict[str, Any] = {} if train else {"pad": False}  # evaluation reads each sample once
        options.update(self.dataset_options)
        return StreamingDataset(
            url,
            epoch_size=self.epoch_size if train else None,
            shuffle=self.shuffle and train,
            seed=self.seed,
            transform=self.transform if train else self.eval_transform,
            collate=self.collate if train else self.eval_collate,
            batch_size=self.batch_size,  # workers take whole batches in turn: no ragged batches
            rank=rank,
            world_size=world_size,
            storage=self.storage,
            **options,
        )

    def _rank_world(self) -> tuple[int | None, int | None]:
        trainer = self.trainer
        if trainer is None:
            return None, None  # detected at iteration time (torch.distributed, RANK/WORLD_SIZE)
        return trainer.global_rank, trainer.world_size

    # -- loaders ---------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader[Any] | Loader:
        """Return the training loader, its dataset set to the trainer's current epoch.

        Lightning creates the first epoch's iterator (and so starts the workers) in the
        fit loop's setup, before any epoch hook runs, but after a checkpoint has restored
        ``current_epoch``; setting the epoch here makes a resumed run read the order of the
        epoch it resumes in. :class:`SetEpochCallback` handles the epochs after it.
        """
        loader = self._loader("train")
        if self.trainer is not None:
            loader.dataset.set_epoch(self.trainer.current_epoch)  # type: ignore[attr-defined]
        if self.loader.watch:  # Lightning iterates the loader itself: hand it the twin whose iterations are timed
            self.watch = watch(loader, attach=True)
            return self.watch.loader  # type: ignore[return-value]  # an instance of a subclass of loader's class
        return loader

    def val_dataloader(self) -> DataLoader[Any] | Loader:
        """Return the validation loader."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader[Any] | Loader:
        """Return the test loader."""
        return self._loader("test")

    def _loader(self, split: str) -> DataLoader[Any] | Loader:
        dataset = self.datasets.get(split)
        if dataset is None:
            if self.urls[split] is None:
                raise ConfigError(f"StreamingDataModule has no {split} dataset: pass {split}=URL")
            dataset = self.datasets[split] = self._build(split)
        opts = self.loader
        if self.threads:
            return Loader(
                dataset, threads=self.num_workers, pin_memory=opts.pin_memory, prefetch=opts.prefetch_factor or 2
            )
        workers = self.num_workers > 0
        extra: dict[str, Any] = {}
        if workers and opts.prefetch_factor is not None:
            extra["prefetch_factor"] = opts.prefetch_factor
        loader_class: type[DataLoader[Any]] = DataLoader
        if opts.stateful:
            try:
                from torchdata.stateful_dataloader import StatefulDataLoader
            except ImportError as exc:
                raise ConfigError(
                    "LoaderOptions(stateful=True) needs torchdata: pip install 'streamload[stateful]'"
                ) from exc
            loader_class = StatefulDataLoader
        return loader_class(
            dataset,
            # With a collate the dataset yields whole batches: the loader must not batch again.
            batch_size=None if dataset.collate is not None else self.batch_size,
            num_workers=self.num_workers,
            pin_memory=opts.pin_memory,
            persistent_workers=opts.persistent_workers and workers,
            drop_last=opts.drop_last,
            collate_fn=opts.collate_fn,
            **extra,
        )


def _no_val_dataloader() -> Any:
    raise ConfigError("StreamingDataModule has no val dataset: pass val=URL")


def _no_test_dataloader() -> Any:
    raise ConfigError("StreamingDataModule has no test dataset: pass test=URL")


# Lightning's override check (lightning_utilities' is_overridden) follows __wrapped__: these
# stand-ins read as the base class's own hooks, not as loaders, and say what to pass if called.
_no_val_dataloader.__wrapped__ = pl.LightningDataModule.val_dataloader  # type: ignore[attr-defined]
_no_test_dataloader.__wrapped__ = pl.LightningDataModule.test_dataloader  # type: ignore[attr-defined]
#: The loader method of each optional split, when it is not given.
_ABSENT = {"val": _no_val_dataloader, "test": _no_test_dataloader}


def _device_decodes(train: Any, evaluate: Any) -> tuple[DeviceDecode | None, DeviceDecode | None]:
    from .devicedecode import DeviceDecode

    for name, value in (("device_decode", train), ("eval_device_decode", evaluate)):
        if value is not None and not isinstance(value, DeviceDecode):
            raise ConfigError(f"{name}= takes a streamload.DeviceDecode, not {type(value).__name__}")
    return train, train if evaluate is None else evaluate


class SetEpochCallback(pl.Callback):
    """Call ``set_epoch(trainer.current_epoch)`` on every training :class:`StreamingDataset`.

    Lightning calls ``set_epoch`` on a loader's *sampler* only, and the loader of an
    iterable dataset has none. From the second epoch of a run on, ``on_train_epoch_start``
    runs in the main process before the epoch's iterator is created, and
    :meth:`StreamingDataset.set_epoch` writes shared memory, so persistent workers see it.
    The first epoch's iterator is created earlier (in the fit loop's setup), so whoever
    builds the training loader sets that epoch: :meth:`StreamingDataModule.train_dataloader`
    does. :class:`StreamingDataModule` adds this callback itself; when the loaders come
    from a ``LightningModule``, add it to the trainer and call
    ``dataset.set_epoch(self.trainer.current_epoch)`` in ``train_dataloader``.
    """

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Set the epoch of every streaming dataset behind ``trainer.train_dataloader``."""
        for dataset in streaming_datasets(trainer.train_dataloader):
            dataset.set_epoch(trainer.current_epoch)


def streaming_datasets(loaders: Any) -> Iterator[StreamingDataset]:
    """Yield each :class:`StreamingDataset` behind a loader or a collection of loaders.

    Args:
        loaders: A DataLoader or :class:`streamload.Loader`, a Lightning ``CombinedLoader``, or a list, tuple or dict of
            them (what ``trainer.train_dataloader`` holds).
    """
    if loaders is None:
        return
    flattened = getattr(loaders, "flattened", None)  # CombinedLoader
    if isinstance(flattened, list):
        loaders = flattened
    if isinstance(loaders, DataLoader | Loader):
        if isinstance(loaders.dataset, StreamingDataset):
            yield loaders.dataset
    elif isinstance(loaders, Mapping):
        for value in loaders.values():
            yield from streaming_datasets(value)
    elif isinstance(loaders, list | tuple):
        for value in loaders:
            yield from streaming_datasets(value)


class DataWatchCallback(pl.Callback):
    """Log the figures of every watched training loader to the trainer's loggers, every logging step.

    Every ``trainer.log_every_n_steps`` optimizer steps it logs, over the steps since its
    last log, :meth:`streamload.DataReport.metrics`: ``data/wait_fraction`` (the share of
    the loop spent waiting for the next batch), ``data/wait_p50_ms``, ``data/wait_p95_ms``
    and each stage's share of the readers' time (``data/share_fetch``, ``data/share_read``,
    ``data/share_transform``, ``data/share_collate``). :class:`StreamingDataModule` adds it
    (``LoaderOptions(watch=True)``, the default); with loaders of your own, watch them with
    ``streamload.watch(loader, attach=True)`` in ``train_dataloader``, return its ``.loader`` (the
    timed twin of ``loader``) and add this callback.
    Each rank logs its own figures.
    """

    def __init__(self) -> None:
        self._marks: dict[int, Mark] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the figures since the last log when this step is a logging step."""
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50)))
        if trainer.global_step % every or not trainer.loggers:
            return
        for i, watched in enumerate(_watches(trainer.train_dataloader)):
            mark = self._marks.get(id(watched))
            self._marks[id(watched)] = watched.mark()
            metrics = watched.report(since=mark).metrics("data/" if i == 0 else f"data/{i}/")
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def _watches(loaders: Any) -> list[Watch[Any]]:
    """The watches attached to a loader or a collection of loaders (what ``trainer.train_dataloader`` holds)."""
    flattened = getattr(loaders, "flattened", None)  # CombinedLoader
    items = flattened if isinstance(flattened, list) else [loaders]
    out: list[Watch[Any]] = []
    for item in items:
        if isinstance(item, Mapping):
            out.extend(w for v in item.values() for w in _watches(v))
        elif isinstance(item, list | tuple):
            out.extend(w for v in item for w in _watches(v))
        else:
            found = attached_watch(item)
            if found is not None and all(found is not w for w in out):
                out.append(found)
    return out
