"""Pipeline parallelism: stages, schedules as instruction lists (GPipe, 1F1B, interleaved 1F1B), the
engine that executes them, point-to-point transfers, activation checkpointing and a recorded timeline."""
from .any_model import ModelStage, balanced_boundaries, split_model
from .engine import PipelineEngine
from .schedules import (
    SCHEDULES,
    Backward,
    Forward,
    Instr,
    ScheduleError,
    build_all,
    build_schedule,
    format_schedule,
    simulate,
    simulate_timing,
)
from .stage import partition_layers, stage_ids, tied_embedding_group
from .timeline import Timeline, bubble_breakdown, bubble_fraction, draw

__all__ = ["PipelineEngine", "SCHEDULES", "Instr", "Forward", "Backward", "ScheduleError", "build_schedule",
           "build_all", "format_schedule", "simulate", "simulate_timing", "partition_layers",
           "stage_ids", "tied_embedding_group", "Timeline", "bubble_fraction", "bubble_breakdown", "draw",
           "split_model", "ModelStage", "balanced_boundaries"]
