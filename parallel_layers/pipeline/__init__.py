"""Pipeline parallelism: stages, schedules as instruction lists (GPipe, 1F1B, interleaved 1F1B), the
engine that executes them, point-to-point transfers, activation checkpointing and a recorded timeline."""
from ..families import BERT, GPT2, LLAMA, RECIPES, Recipe, recipe_for
from ..families.infer_recipe import InferenceError, infer_recipe
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
from .stage import checkpointed, partition_layers, stage_ids, tied_embedding_group
from .timeline import Timeline, bubble_breakdown, bubble_fraction, draw

__all__ = ["PipelineEngine", "SCHEDULES", "Instr", "Forward", "Backward", "ScheduleError", "build_schedule",
           "build_all", "format_schedule", "simulate", "simulate_timing", "GPTStage", "build_gpt_stages",
           "checkpointed", "partition_layers", "stage_ids", "tied_embedding_group", "Timeline", "bubble_fraction",
           "bubble_breakdown", "draw", "split_model", "recipe_for", "Recipe", "ModelStage", "balanced_boundaries",
           "RECIPES", "LLAMA", "GPT2", "BERT", "infer_recipe", "InferenceError"]


def __getattr__(name):
    # the reference GPT's stages are a model (models/gpt_stages.py); imported on first use, so the pipeline
    # package does not depend on the models built on it
    if name in ("GPTStage", "build_gpt_stages"):
        from ..models import gpt_stages
        return getattr(gpt_stages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
