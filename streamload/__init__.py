"""streamload: feed PyTorch training from sharded datasets at the speed of the disk or the bucket.

The public surface is re-exported here; submodules prefixed with ``_`` are private.
"""

from __future__ import annotations

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
from .access import SampleView, ShardedDataset
from .dataset import SkipCounts, SkippedSample, StreamingDataset
from .decode import ImageLabel, decode_sample
from .device import DevicePrefetcher
from .loader import Loader
from .manifest import Manifest, ShardEntry
from .randomness import sample_generator, sample_seed
from .shards import StorageConfig
from .streams import Stream
from .watching import DataReport, Watch, watch
from .writer import DatasetWriter

__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "ConfigError",
    "ConversionInterrupted",
    "DataReport",
    "CorruptShardError",
    "DestinationBusyError",
    "DatasetWriter",
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
