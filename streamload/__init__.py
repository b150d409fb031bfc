"""streamload: feed PyTorch training from sharded datasets at the speed of the disk or the bucket.

The public surface is re-exported here; submodules prefixed with ``_`` are private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import (
    CacheError,
    ConfigError,
    ConversionInterrupted,
    CorruptShardError,
    DestinationBusyError,
    ManifestError,
    ManifestNotFoundError,
    PlanError,
    RangeResponseError,
    SampleError,
    SampleNotFoundError,
    ShardError,
    ShardNotFoundError,
    SourceError,
    StorageError,
    StreamloadError,
    UnsafeShardError,
)

if TYPE_CHECKING:
    from .access import SampleView, ShardedDataset
    from .dataset import SkipCounts, SkippedSample, StreamingDataset
    from .decode import ImageLabel, decode_sample
    from .device import DevicePrefetcher
    from .devicedecode import DeviceDecode
    from .loader import Loader
    from .manifest import Manifest, ShardEntry
    from .randomness import sample_generator, sample_seed
    from .storageconfig import StorageConfig
    from .streams import Stream
    from .watching import DataReport, Watch, watch
    from .writer import DatasetWriter

#: Where each public name lives: imported when first asked for, so that a command that
#: needs no reader (``streamload convert``, ``info``, ``verify``) starts without torch.
_LAZY = {
    "SampleView": "access",
    "ShardedDataset": "access",
    "SkipCounts": "dataset",
    "SkippedSample": "dataset",
    "StreamingDataset": "dataset",
    "ImageLabel": "decode",
    "decode_sample": "decode",
    "DevicePrefetcher": "device",
    "DeviceDecode": "devicedecode",
    "Loader": "loader",
    "Manifest": "manifest",
    "ShardEntry": "manifest",
    "sample_generator": "randomness",
    "sample_seed": "randomness",
    "StorageConfig": "storageconfig",
    "Stream": "streams",
    "DataReport": "watching",
    "Watch": "watching",
    "watch": "watching",
    "DatasetWriter": "writer",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'streamload' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "ConfigError",
    "ConversionInterrupted",
    "DataReport",
    "CorruptShardError",
    "DestinationBusyError",
    "DatasetWriter",
    "DeviceDecode",
    "DevicePrefetcher",
    "ImageLabel",
    "Loader",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "PlanError",
    "RangeResponseError",
    "SampleError",
    "SampleNotFoundError",
    "SampleView",
    "ShardEntry",
    "ShardError",
    "ShardNotFoundError",
    "ShardedDataset",
    "SkipCounts",
    "SkippedSample",
    "SourceError",
    "StorageConfig",
    "StorageError",
    "Stream",
    "StreamingDataset",
    "StreamloadError",
    "UnsafeShardError",
    "Watch",
    "__version__",
    "decode_sample",
    "sample_generator",
    "sample_seed",
    "watch",
]
