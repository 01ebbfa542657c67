"""A layout of ``Parallel3D`` (``layout=``): the mesh sizes and the settings that go with them, given
(:class:`Layout`) or planned (``"auto"``, :class:`Auto`): the layout planner's best feasible one, agreed by
every rank.

Global rank 0 runs the planner in a child process (``python -m parallel_layers plan --json``: the planner
plays every rank under a fake process group, which cannot share a process with the real one) and the
chosen layout is broadcast over the world group, so every rank builds the same mesh and settings. The
planner (``parallel_layers.planner``) sits above this layer: it builds ``Parallel3D`` on meta to measure a
layout, and ranks layouts; this module only starts it as a program and reads its JSON
(:func:`model_to_json` writes the model it plans for, :func:`model_from_json` is how the planner reads it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..dimensions import in_reading_order, names, world_size
from ..models.gpt import GPTConfig
from .config import DataParallelConfig, PipelineConfig


class _LayoutMethods:
    """What a :class:`Layout` computes from its fields."""

    @property
    def sizes(self) -> dict:
        """Every parallel dimension's size, in the rank grid's order (``ParallelMesh(**layout.sizes)``)."""
        return {name: getattr(self, name, 1) for name in names()}

    @property
    def world(self) -> int:
        return world_size(self.sizes)

    def name(self) -> str:
        dims = "x".join(f"{n}{v}" for n, v in in_reading_order(self.sizes) if v > 1) or "dp1"
        sched = f" {self.schedule} m{self.num_microbatches}" + (f" v{self.num_chunks}" if self.num_chunks > 1 else "")
        return f"{dims} z{self.zero}{sched if self.pp > 1 else f' m{self.num_microbatches}'}" + \
            (" ckpt" if self.checkpoint else "")

    def parallel3d_kwargs(self) -> dict:
        """The keywords of ``Parallel3D`` this layout sets."""
        return dict(pipeline=PipelineConfig(schedule=self.schedule, num_microbatches=self.num_microbatches,
                                            num_chunks=self.num_chunks, checkpoint=self.checkpoint),
                    data_parallel=DataParallelConfig(zero=self.zero))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# One size per parallel dimension (each declared once, in parallel_layers.dimensions: a new one becomes a field
# here), then the settings that go with them.
Layout = dataclasses.make_dataclass(
    "Layout", [(name, int, dataclasses.field(default=1)) for name, _ in in_reading_order({})] + [
        ("zero", int, dataclasses.field(default=0)), ("schedule", str, dataclasses.field(default="1f1b")),
        ("num_microbatches", int, dataclasses.field(default=1)), ("num_chunks", int, dataclasses.field(default=1)),
        ("checkpoint", bool, dataclasses.field(default=False))],
    bases=(_LayoutMethods,), frozen=True)
Layout.__module__ = __name__
Layout.__doc__ = """One way to run: the mesh sizes (``dp``, ``tp``, ``pp``, ``cp``: a field per dimension of
:data:`~parallel_layers.dimensions.DIMENSIONS`, 1 by default) and the Parallel3D settings that go with them."""


def model_from_json(text: Union[str, dict]) -> object:
    """A GPTConfig (``{"gpt": {...}}``) or a Hugging Face config (``{"model_type": ...}``) from JSON."""
    d = json.loads(text) if isinstance(text, str) else dict(text)
    if "gpt" in d:
        return GPTConfig(**d["gpt"])
    from transformers import AutoConfig
    return AutoConfig.for_model(**d)


def model_to_json(model: object) -> dict:
    if isinstance(model, GPTConfig):
        return {"gpt": dataclasses.asdict(model)}
    return model.to_dict()


@dataclasses.dataclass
class Auto:
    """What ``layout="auto"`` plans for. ``global_batch`` (default 8 x world) sequences of ``seq_len`` tokens
    (default: the model's maximum length); ``memory_gib`` per rank (default: the GPU's, or the host's
    memory shared by the ranks); ``profile``: a built-in name or a calibrated JSON file (default: h100 on
    a GPU; on CPU this machine's, calibrated first: ``--calibrate``, some seconds); ``compiled``: price the
    blocks compiled (``plan --compiled``; ``Parallel3D`` sets it where ``PipelineConfig(compile=...)`` asks);
    ``sequence_parallel``: plan tp with it (``plan --sequence-parallel``; set by ``Parallel3D(sequence_parallel=
    True)``)."""
    global_batch: Optional[int] = None
    seq_len: Optional[int] = None
    memory_gib: Optional[float] = None
    profile: Optional[str] = None
    devices_per_node: int = 8
    precision: str = "fp32"
    compiled: bool = False
    sequence_parallel: bool = False


def _defaults(auto: Auto, model, world: int) -> Auto:
    cfg = model if isinstance(model, GPTConfig) else getattr(model, "config", None)
    seq = auto.seq_len or (cfg.max_seq_len if isinstance(cfg, GPTConfig) else cfg.max_position_embeddings)
    if auto.memory_gib is not None:
        mem = auto.memory_gib
    elif torch.cuda.is_available():
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world
    return dataclasses.replace(auto, global_batch=auto.global_batch or 8 * world, seq_len=seq, memory_gib=mem)


# what a launcher (torchrun, the test pool) tells its ranks; the planner's children start process groups of
# their own and must not join the launcher's (TORCHELASTIC_USE_AGENT_STORE: connect to the agent's store)
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def planner_environment(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) without the launcher's variables, for the planner's children."""
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}


def run_planner(cmd: list, what: str) -> subprocess.CompletedProcess:
    """Run one of the planner's commands in a child without the launcher's variables; its output in the error."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=planner_environment())
    if proc.returncode != 0:
        raise RuntimeError(f"Parallel3D(layout='auto'): {what} failed (exit {proc.returncode}): "
                           f"{' '.join(cmd[1:])}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def plan_in_child(model, world: int, auto: Auto) -> Layout:
    """Run the planner in a child process; the best feasible layout (``ValueError`` when none fits)."""
    auto = _defaults(auto, model, world)
    cfg = model if isinstance(model, GPTConfig) else getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"Parallel3D(layout='auto'): {type(model).__name__} has no config to plan from; pass a "
                         f"GPTConfig, a Hugging Face model, or a Layout")
    with tempfile.TemporaryDirectory() as tmp:
        model_path, out = os.path.join(tmp, "model.json"), os.path.join(tmp, "plan.json")
        with open(model_path, "w") as fh:
            json.dump(model_to_json(cfg), fh, default=str)
        cmd = [sys.executable, "-m", "parallel_layers", "plan", "--model-json", model_path, "--world", str(world),
               "--global-batch", str(auto.global_batch), "--seq-len", str(auto.seq_len),
               "--memory-gib", str(auto.memory_gib), "--devices-per-node", str(auto.devices_per_node),
               "--precision", auto.precision, "--json", out] + (["--compiled"] if auto.compiled else []) + \
            (["--sequence-parallel"] if auto.sequence_parallel else [])
        profile = auto.profile or ("h100" if torch.cuda.is_available() else None)
        if profile is None:
            profile = os.path.join(tmp, "profile.json")
            run_planner([sys.executable, "-m", "parallel_layers", "plan", "--calibrate", profile, "--world", "2"],
                         "calibrating this machine's profile")
        run_planner(cmd + ["--profile", profile], "the planner")
        if not os.path.exists(out):
            raise RuntimeError(f"Parallel3D(layout='auto'): the planner wrote no plan to {out}")
        with open(out) as fh:
            result = json.load(fh)
    if result["best"] is None:
        reasons = "; ".join(f"{p['name']}: {p['reason']}" for p in result["layouts"][:3])
        raise ValueError(f"Parallel3D(layout='auto'): no layout of {world} ranks fits {auto.memory_gib:.1f} GiB per "
                         f"rank (e.g. {reasons}); lower the batch or sequence, add ranks, or pass more memory_gib")
    return Layout(**result["best"]["layout"])


def resolve_layout(layout: Union[str, Auto, Layout], model, compiled: bool = False,
                   sequence_parallel: bool = False) -> Layout:
    """The layout every rank uses: a ``Layout`` as given, ``"auto"``/``Auto(...)`` planned on global rank
    0 and broadcast over the world (a collective: every rank calls it); ``compiled``, ``sequence_parallel``:
    how the run will execute (priced so)."""
    if isinstance(layout, Layout):
        return layout
    if layout == "auto":
        layout = Auto()
    if not isinstance(layout, Auto):
        raise ValueError(f"Parallel3D: layout={layout!r} must be 'auto', an Auto or a Layout "
                         f"(parallel_layers.composition.layout)")
    if compiled or sequence_parallel:
        layout = dataclasses.replace(layout, compiled=layout.compiled or compiled,
                                     sequence_parallel=layout.sequence_parallel or sequence_parallel)
    world = dist.get_world_size()
    box = [plan_in_child(model, world, layout) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = ["Layout", "Auto", "resolve_layout", "plan_in_child", "planner_environment", "model_from_json",
           "model_to_json"]
