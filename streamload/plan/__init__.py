"""The split axis: which samples each rank and worker read, in which order, each epoch."""

from __future__ import annotations

from .mixture import MixLayout, apportion, epoch_counts, mixture_fingerprint
from .planner import EpochPlan, Layout, Run, ShardLayout, Split, Stage, default_window, samples_per_rank
from .world import World, detect_rank_world, detect_world, distributed_world

__all__ = [
    "EpochPlan",
    "Layout",
    "MixLayout",
    "Run",
    "ShardLayout",
    "Split",
    "Stage",
    "World",
    "apportion",
    "default_window",
    "detect_rank_world",
    "detect_world",
    "distributed_world",
    "epoch_counts",
    "mixture_fingerprint",
    "samples_per_rank",
]
