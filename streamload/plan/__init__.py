"""The split axis: which samples each rank and worker read, in which order, each epoch."""

from __future__ import annotations

from .mixture import MixLayout, apportion, epoch_counts, mixture_fingerprint
from .planner import (
    DEFAULT_PARTITIONS,
    EpochPlan,
    Layout,
    Remainder,
    Run,
    ShardLayout,
    Split,
    default_window,
    global_batch,
    locality_warning,
    partition_count,
    rank_samples,
    samples_per_rank,
)
from .world import World, detect_rank_world, detect_world, distributed_world

__all__ = [
    "DEFAULT_PARTITIONS",
    "EpochPlan",
    "Layout",
    "MixLayout",
    "Remainder",
    "Run",
    "ShardLayout",
    "Split",
    "World",
    "apportion",
    "default_window",
    "detect_rank_world",
    "detect_world",
    "distributed_world",
    "epoch_counts",
    "global_batch",
    "locality_warning",
    "mixture_fingerprint",
    "partition_count",
    "rank_samples",
    "samples_per_rank",
]
