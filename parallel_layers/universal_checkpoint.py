"""Universal checkpoints: a :class:`~parallel_layers.parallel3d.Parallel3D` run saved on one mesh and
resumed on another (other dp, tp, pp, ZeRO stage, schedule or dtype), or in a single process.

``Parallel3D.state_dict()`` holds one rank's shards and loads back only on the same mesh. Resuming on
a different number of ranks is the checkpoint complaint the anchors' trackers hear most; DeepSpeed
answers it with a converted "universal" checkpoint, torch DCP by resharding at load. Here the saved
form is the dense model itself, so nothing needs converting:

* every parameter under the full ``GPT``'s name, in fp32 (a bf16/fp16 run saves its fp32 master
  weights), and its AdamW moments ``exp_avg`` / ``exp_avg_sq`` in the parameter's dense shape;
* in ``meta.json``: the optimizer's step count, the caller's iteration, the model config, the loss
  scaler's state, the layout and hyperparameters it was saved with, and the files holding the tensors.

:func:`save_universal` (a collective over the world): the ZeRO shards of each stage are summed over dp
(each element is held by exactly one rank, every other adds zero) and the TP shards gathered over tp;
rank (dp 0, tp 0) of each pipeline rank writes its stages' tensors to ``stage<k>-of-<pp>.pt``, then
global rank 0 writes ``meta.json`` (last, and only after every file is written: a directory with a
``meta.json`` is complete).

:func:`load_universal`: every rank reads the files and copies its own slices (its stages, its TP slice,
its ZeRO shard) into the parameters, master weights, moments and step count. No collective. The next
step then computes what the single-process model would from the same weights and moments.

:func:`read_universal` returns the merged dense checkpoint for single-process use: ``model`` loads into
``GPT(config)`` and :func:`load_dense_adamw` fills a ``torch.optim.AdamW`` over it.

Not carried: the random streams (they are per layout: another mesh draws other dropout masks anyway),
the position in the data (the caller's step counter; ``meta["step"]`` is the optimizer's), and the
optimizer's hyperparameters (the resuming run's own ``lr`` etc. apply; the saved ones are in the meta).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .distributed import collectives as C
from .tensor_parallel.parallelize import gather_partition, tp_partitions
from .tensor_parallel.random import shard
from .zero.full_state import STATE_KEYS

FORMAT = "parallel_layers.universal/1"
META = "meta.json"
LATEST = "latest_checkpointed_iteration.txt"
STATES = ("param", "exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------- saving
def _named_params(model) -> List[Tuple[nn.Module, str, nn.Parameter]]:
    """(chunk, name in the chunk, parameter) for every parameter of this rank's stages."""
    return [(chunk, n, p) for chunk in model.chunks for n, p in chunk.named_parameters()]


def _local_states(model) -> Tuple[Dict[int, Dict[str, torch.Tensor]], int]:
    """``{id(param): {"param", "exp_avg", "exp_avg_sq"}}`` in fp32 and the parameter's TP-local shape,
    complete over dp (under ZeRO the optimizer's ``full_state_dict``, a collective over the dp group), and
    the optimizer's step count."""
    params = {id(p): p for _, _, p in _named_params(model)}
    opt = model.optimizer
    if model.zero == 0:                              # torch AdamW: full per-parameter state on every rank
        out, step = {}, 0
        for key, p in params.items():
            st = opt.state.get(p, {})
            out[key] = {"param": p.detach().float().clone()}
            for k in STATES[1:]:
                out[key][k] = st[k].detach().float().clone() if k in st else torch.zeros_like(p, dtype=torch.float32)
            if "step" in st:
                step = int(st["step"])
        return out, step
    full = opt.full_state_dict()["state"]            # gathered over dp, by the ModuleList's parameter names
    name_of = {id(p): n for n, p in model.model.named_parameters()}
    return ({key: {k: full[name_of[key]][z] for k, z in zip(STATES, STATE_KEYS)} for key in params},
            opt.steps_taken)


def _dense_size(model, name: str, part: Tuple[int, object, int]) -> int:
    # the untied LM head is column-parallel over the padded vocabulary: its dense rows are the true vocabulary
    return model.config.vocab_size if name.startswith("lm_head.") and part[0] == 0 else part[2]


def dense_states(model) -> Tuple[Dict[str, Dict[str, torch.Tensor]], int]:
    """This rank's stages as ``{GPT name: {"param", "exp_avg", "exp_avg_sq"}}`` (dense fp32 tensors)
    and the step count. A collective over the dp and tp groups."""
    local, step = _local_states(model)
    out = {}
    for chunk in model.chunks:
        parts = tp_partitions(chunk)
        for name, p in chunk.named_parameters():
            if id(p) in model._dup:                  # the last stage's tied embedding: the first saves it
                continue
            states = local[id(p)]
            if name in parts:
                dim, group, _ = parts[name]
                size = _dense_size(model, name, parts[name])
                states = {k: gather_partition(t, dim, group, size).clone() for k, t in states.items()}
            out[chunk.dense_name(name)] = states
    return out, step


def _layout(model) -> dict:
    m, e = model.mesh, model.engine
    return {"mesh (dp, tp, pp)": [m.dp, m.tp, m.pp], "zero": model.zero, "schedule": e.schedule,
            "chunks per rank": e.v, "dtype": str(model.dtype)}


def save_universal(model, directory: str, iteration: Optional[int] = None) -> None:
    """Save ``model`` (a ``Parallel3D``) as a universal checkpoint in ``directory``: a collective over
    the world (every rank calls it). See the module docstring for what is saved. ``iteration``: the
    caller's position in its data, kept as ``meta["iteration"]`` (default: the optimizer's step count,
    which does not count the steps an fp16 run skipped)."""
    states, step = dense_states(model)
    m = model.mesh
    rank = dist.get_rank()
    os.makedirs(directory, exist_ok=True)
    meta_path = os.path.join(directory, META)
    if rank == 0 and os.path.exists(meta_path):
        os.remove(meta_path)                         # the directory is incomplete until the new meta is in
    dist.barrier()
    files = [f"stage{k}-of-{m.pp}.pt" for k in range(m.pp)]
    writer = m.dp_rank == 0 and m.tp_rank == 0
    if writer:
        path = os.path.join(directory, files[m.pp_rank])
        torch.save({"format": FORMAT, **{k: {n: s[k].cpu() for n, s in states.items()} for k in STATES}},
                   path + ".tmp")
        os.replace(path + ".tmp", path)
    # which file holds which parameter, so that a loading rank reads only the files of its own stages
    written = [None] * dist.get_world_size()
    dist.all_gather_object(written, (files[m.pp_rank], sorted(states)) if writer else None)
    if rank == 0:
        group = model.optimizer.param_groups[0]
        meta = {"format": FORMAT, "step": step, "iteration": step if iteration is None else iteration,
                "config": dataclasses.asdict(model.config), "files": files,
                "index": {n: w[0] for w in written if w is not None for n in w[1]},
                "saved from": _layout(model),
                "optimizer": {k: group[k] for k in ("lr", "eps", "weight_decay")} | {"betas": list(group["betas"])},
                "scaler": None if model.scaler is None else model.scaler.state_dict()}
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(meta_path + ".tmp", meta_path)
    dist.barrier()


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's layout: one directory per saved iteration, ``root/iter_0000020``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def save_iteration(model, root: str, iteration: int) -> str:
    """:func:`save_universal` into ``iteration_dir(root, iteration)``, then rank 0 points ``root``'s
    ``latest_checkpointed_iteration.txt`` at it (Megatron-LM's name). A collective; returns the path."""
    path = iteration_dir(root, iteration)
    save_universal(model, path, iteration=iteration)
    if dist.get_rank() == 0:
        latest = os.path.join(root, LATEST)
        with open(latest + ".tmp", "w") as f:
            f.write(f"{iteration}\n")
        os.replace(latest + ".tmp", latest)
    return path


# ---------------------------------------------------------------------- loading
def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a universal checkpoint, else the latest iteration saved under it by
    :func:`save_iteration`."""
    if os.path.exists(os.path.join(path, META)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.exists(latest):
        with open(latest) as f:
            return iteration_dir(path, int(f.read().strip()))
    raise FileNotFoundError(f"universal checkpoint: {path!r} holds neither a {META} (a checkpoint) nor a {LATEST} "
                            f"(a directory of them, from save_iteration)")


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise FileNotFoundError(f"universal checkpoint: no {META} in {directory!r} (not a universal checkpoint, "
                                f"or its save did not finish); save one with save_universal(model, directory)")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"universal checkpoint {directory!r}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _read_files(directory: str, files) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{"param" | "exp_avg" | "exp_avg_sq": {name: tensor}}`` of ``files``, memory-mapped: only the
    tensors a caller touches are read from disk."""
    merged = {k: {} for k in STATES}
    for name in files:
        data = torch.load(os.path.join(directory, name), weights_only=True, map_location="cpu", mmap=True)
        for k in STATES:
            merged[k].update(data[k])
    return merged


def read_universal(directory: str) -> dict:
    """The whole dense checkpoint: ``meta.json``'s fields plus ``model`` (a ``GPT`` state dict in fp32),
    ``exp_avg`` and ``exp_avg_sq`` (by the same names)."""
    meta = read_meta(directory)
    merged = _read_files(directory, meta["files"])
    return dict(meta, model=merged["param"], exp_avg=merged["exp_avg"], exp_avg_sq=merged["exp_avg_sq"])


# GPTConfig fields that change how the model runs but not its weights: a resumed run may change them
RUNTIME_FIELDS = ("dropout", "sequence_parallel", "init_std", "seed")


def check_config(config, meta: dict, directory: str) -> None:
    """A ``ValueError`` naming every field where the checkpoint's model config differs from ``config``
    (:data:`RUNTIME_FIELDS` may differ)."""
    mine = dataclasses.asdict(config)
    differ = [k for k in mine if k not in RUNTIME_FIELDS and meta["config"].get(k) != mine[k]]
    if differ:
        raise ValueError(f"universal checkpoint {directory!r} holds another model: "
                         + "; ".join(f"{k}: saved {meta['config'].get(k)!r}, here {mine[k]!r}" for k in differ)
                         + ". Build the resuming run with the saved config (meta.json, 'config')")


def _local_slice(chunk, name: str, p: nn.Parameter, dense: torch.Tensor, parts: dict) -> torch.Tensor:
    """This rank's TP slice of a dense tensor (a copy: the file is memory-mapped), in the shape of ``p``
    (vocabulary padding: zero rows)."""
    if name in parts:
        dim, group, _ = parts[name]
        tp = C.world_size(group)
        dense = shard(dense, dim, C.rank(group), tp, padded_size=p.shape[dim] * tp)
    else:
        dense = dense.clone()
    if dense.shape != p.shape:
        raise ValueError(f"universal checkpoint: {chunk.dense_name(name)} is {tuple(dense.shape)} in the "
                         f"checkpoint but {tuple(p.shape)} on this rank")
    return dense


@torch.no_grad()
def load_universal(model, directory: str) -> dict:
    """Load a universal checkpoint into ``model`` (a ``Parallel3D`` of any mesh, ZeRO stage, schedule or
    dtype built with the same model config); returns its ``meta.json`` (``meta["step"]``: the
    optimizer steps taken). Every rank reads the files holding its stages; no collective."""
    meta = read_meta(directory)
    check_config(model.config, meta, directory)
    mine = _named_params(model)
    missing = sorted({chunk.dense_name(n) for chunk, n, _ in mine} - set(meta["index"]))
    if missing:
        raise ValueError(f"universal checkpoint {directory!r}: {len(missing)} parameters of this rank's stages "
                         f"are in none of its files {meta['files']}: {missing[:5]}")
    tensors = _read_files(directory, sorted({meta["index"][chunk.dense_name(n)] for chunk, n, _ in mine}))
    local = {}
    for chunk in model.chunks:
        parts = tp_partitions(chunk)
        for name, p in chunk.named_parameters():
            dn = chunk.dense_name(name)
            local[id(p)] = (p, {k: _local_slice(chunk, name, p, tensors[k][dn], parts) for k in STATES})
    step, opt = meta["step"], model.optimizer
    if model.zero == 0:
        for p, st in local.values():
            p.copy_(st["param"].to(p.dtype))
            opt.state[p] = _adamw_state(p, step, st["exp_avg"], st["exp_avg_sq"])
    else:                                            # this rank's ZeRO shard, parameters included
        name_of = {id(p): n for n, p in model.model.named_parameters()}
        state = {name_of[id(p)]: {z: st[k] for k, z in zip(STATES, STATE_KEYS)} for p, st in local.values()}
        opt.load_full_state_dict({"step": step, "state": state})
    if model.scaler is not None and meta.get("scaler") is not None:
        model.scaler.load_state_dict(meta["scaler"])
    return meta


def _adamw_state(p: nn.Parameter, step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict:
    """``torch.optim.AdamW``'s state of ``p`` (its step count as a CPU float tensor, moments like ``p``)."""
    return {"step": torch.tensor(float(step)), "exp_avg": exp_avg.to(p), "exp_avg_sq": exp_avg_sq.to(p)}


def load_dense_adamw(optimizer: torch.optim.Optimizer, model: nn.Module, ckpt: dict) -> None:
    """Fill a single-process ``torch.optim.AdamW`` over ``model`` (a ``GPT`` that loaded ``ckpt["model"]``)
    with the moments and step count of :func:`read_universal`'s ``ckpt``."""
    for name, p in model.named_parameters():
        optimizer.state[p] = _adamw_state(p, ckpt["step"], ckpt["exp_avg"][name], ckpt["exp_avg_sq"][name])


__all__ = ["save_universal", "load_universal", "read_universal", "read_meta", "check_config", "load_dense_adamw",
           "dense_states", "iteration_dir", "save_iteration", "resolve_checkpoint"]
