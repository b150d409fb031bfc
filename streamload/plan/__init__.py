"""The split axis: which samples each rank and worker read, in which order, each epoch."""

from __future__ import annotations

from .planner import EpochPlan, Run, Split, Stage, default_window, samples_per_rank
from .world import World, detect_rank_world, detect_world, distributed_world

__all__ = [
    "EpochPlan",
    "Run",
    "Split",
    "Stage",
    "World",
    "default_window",
    "detect_rank_world",
    "detect_world",
    "distributed_world",
    "samples_per_rank",
]
