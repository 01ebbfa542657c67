"""The layout planner (issue 33): which dp x tp x pp x cp, ZeRO stage, schedule, micro-batches and
checkpointing for a model on a cluster, with each layout's predicted per-rank memory and step time.

``python -m parallel_layers plan ...`` (:mod:`.cli`), ``Parallel3D(..., layout="auto")`` (which runs that
command: :mod:`parallel_layers.composition.layout`, where the planner's answer, a ``Layout``, is defined), or
in code::

    from parallel_layers.planner import Request, plan, load_profile
    ranked = plan(Request(config, world=8, global_batch=32, seq_len=1024, memory_bytes=80 * 2**30),
                  load_profile("h100"))

Memory comes from the package's own code run on the meta device (:mod:`.probe`), time from those
counts at a hardware profile's rates (:mod:`.model`, :mod:`.hardware`, :mod:`.calibrate`);
:mod:`.measure` is how ``benchmarks/planner.py`` checks both against real runs.

FP8 training (``Request(fp8=True, fp8_recipe=..., fp8_gather=...)``, ``plan --fp8 [RECIPE] [--fp8-gather]``):
the converted Linears' GEMMs at the profile's fp8 rate, their casts at its memory bandwidth and their FP8
copies saved for backward (:mod:`.fp8`); a profile without an fp8 rate is refused.
"""
from .calibrate import calibrate
from .hardware import BUILTIN, Link, Profile, load_profile
from .model import Prediction, predict
from .search import candidate_layouts, plan, to_json
from .spec import Request

__all__ = ["Request", "Profile", "Link", "BUILTIN", "load_profile", "calibrate", "predict", "Prediction", "plan",
           "candidate_layouts", "to_json"]
