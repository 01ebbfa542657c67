"""Universal checkpoints: a :class:`~parallel_layers.composition.parallel3d.Parallel3D` run saved on one mesh and
resumed on another (other dp, tp, pp, ZeRO stage, schedule or dtype), or in a single process.

``Parallel3D.state_dict()`` holds one rank's shards and loads back only on the same mesh. Resuming on
a different number of ranks is the checkpoint complaint the anchors' trackers hear most; DeepSpeed
answers it with a converted "universal" checkpoint, torch DCP by resharding at load. Here the saved
form is the dense model itself, so nothing needs converting:

* every parameter under the whole model's name (the full ``GPT``'s, or ``model.named_parameters()`` of
  a model of your own), in fp32 (a bf16/fp16 run saves its fp32 master weights) and the dense layout
  (a Hugging Face ``Conv1D`` as ``[in, out]``, a fused ``c_attn`` as ``[q | k | v]``), and its AdamW
  moments ``exp_avg`` / ``exp_avg_sq`` in the parameter's dense shape;
* in ``meta.json``: the optimizer's step count, the caller's iteration, the model (the ``GPTConfig``,
  or a model's class and parameter shapes: ``Parallel3D.description``), the loss
  scaler's state, the FP8 layers' delayed-scaling histories (by module name: the same on every layout),
  the layout and hyperparameters it was saved with, and the manifest: for every tensor
  the file holding it, its shape, dtype and the crc32 of each state's bytes.

Integrity: ``meta.json`` carries a checksum of its own contents, and every stage file a header (the
save it belongs to, its stage, the iteration and step). Loading checks all of it before anything is
changed: a flipped bit, a NaN or infinite value, a file of another save or stage, a missing tensor or
file, or an edited ``meta.json`` is refused with the file and tensor named. A save of non-finite
tensors is refused as well (a diverged run must not become the latest checkpoint).

Crash safety: ``meta.json`` is what makes a directory a checkpoint, and it is written last. Stage files
carry a fresh name per save (``stage<k>-of-<pp>.<save id>.pt``), so a save never overwrites the files
of the checkpoint already there; every file is written under a temporary name, fsynced and renamed
into place, and ``meta.json`` is replaced in one rename once every stage file is on disk. Only then are
the previous save's files removed, and only then does :func:`save_iteration` move
``latest_checkpointed_iteration.txt``. A process killed at any moment leaves the latest complete
checkpoint loadable (leftovers of the killed save are removed by the next save into that directory).

:func:`save_universal` (a collective over the world): the ZeRO shards of each stage are summed over dp
(each element is held by exactly one rank, every other adds zero) and the TP shards gathered over tp;
rank (dp 0, tp 0) of each pipeline rank writes its stages' tensors, then global rank 0 writes
``meta.json``.

:func:`load_universal` (a collective over the world): every rank reads and checks the files of its own
stages and cuts its own slices (its stages, its TP slice, its ZeRO shard); the ranks agree that every
file is sound, then copy their slices into the parameters, master weights, moments and step count. The
next step then computes what the single-process model would from the same weights and moments.

:func:`read_universal` returns the merged dense checkpoint for single-process use, every file checked:
``model`` loads into ``GPT(config)`` (or, ``strict=False`` where weights are tied, into the dense model
of your own) and :func:`load_dense_adamw` fills a ``torch.optim.AdamW`` over it.

Not carried in the dense model: the random streams (they are per layout: another mesh draws other dropout
masks anyway), the position in the data (the caller's step counter; ``meta["step"]`` is the optimizer's),
and the optimizer's hyperparameters (the resuming run's own ``lr`` etc. apply; the saved ones are in the
meta). :mod:`parallel_layers.resilience` adds ``meta["resume"]``: every rank's random streams with the
layout they belong to (restored when the resuming layout is the same) and the caller's data position.

A save is two halves: :func:`snapshot_universal` copies the state into host memory (collectives over
the model's groups) and :func:`write_universal` writes it (collectives over a group of the caller's
choice only). An asynchronous save (:mod:`parallel_layers.resilience.local_snapshot`) takes only this
rank's own shards in the training thread, assembles the same :class:`UniversalSnapshot` in its background
thread on groups of its own, and writes it with the same :func:`write_universal`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C
from ..moe.expert_parallel import is_expert
from ..tensor_parallel.parallelize import gather_partition, tp_partitions
from ..tensor_parallel.random import shard
from ..zero.full_state import STATE_KEYS

FORMAT = "parallel_layers.universal/2"
UNCHECKED_FORMATS = ("parallel_layers.universal/1",)    # written before checksums and headers existed
META = "meta.json"
LATEST = "latest_checkpointed_iteration.txt"
STATES = ("param", "exp_avg", "exp_avg_sq")
# the stage files of any save (and their temporary names): what a save may remove once it is complete
_STAGE_FILE = re.compile(r"stage\d+-of-\d+(\.[0-9a-f]+)?\.pt(\.tmp)?")
_SAVED_STAGE_FILE = re.compile(r"stage\d+-of-\d+\.[0-9a-f]+\.pt")
_MANIFEST_KEYS = {"file", "shape", "dtype", "crc32"}


class CheckpointError(ValueError):
    """A universal checkpoint that is incomplete, corrupted or inconsistent; the message names the file
    (and tensor) at fault."""


# ---------------------------------------------------------------------- integrity
def tensor_crc32(t: torch.Tensor) -> int:
    """crc32 of a tensor's bytes (row-major, native byte order)."""
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def meta_checksum(meta: dict) -> int:
    """crc32 of ``meta`` without its ``checksum`` field, over a canonical JSON form."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _not_finite(tensors: Dict[str, Dict[str, torch.Tensor]]) -> List[str]:
    return [f"{n} ({k})" for n, st in tensors.items() for k in STATES if not torch.isfinite(st[k]).all()]


# ---------------------------------------------------------------------- files, crash-safely
def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX; other systems cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(temporary path)``, fsync, rename onto ``path``: whenever the process dies, ``path`` is
    absent, its previous complete contents, or the new complete contents."""
    tmp = path + ".tmp"
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def write_text(text: str) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "w") as f:
            f.write(text)
    return write


def _remove_stale(directory: str, keep: List[str]) -> None:
    """Remove the stage files of earlier or killed saves into ``directory`` (after ``meta.json`` names
    ``keep``) and a temporary ``meta.json`` a killed save left."""
    for name in os.listdir(directory):
        if (_STAGE_FILE.fullmatch(name) and name not in keep) or name == META + ".tmp":
            os.remove(os.path.join(directory, name))
    fsync_dir(directory)


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
    name_of = model.mode.optimizer_names()
    return ({key: {k: full[name_of[key]][z] for k, z in zip(STATES, STATE_KEYS)} for key in params},
            opt.steps_taken)


def dense_states(model) -> Tuple[Dict[str, Dict[str, torch.Tensor]], int]:
    """This rank's stages as ``{GPT name: {"param", "exp_avg", "exp_avg_sq"}}`` (dense fp32 tensors)
    and the step count. A collective over the dp and tp groups."""
    local, step = _local_states(model)
    out = {}
    ep_group = model.mesh.group("ep") if "ep" in model.mesh.sizes else None
    for chunk in model.chunks:
        parts = tp_partitions(chunk)
        for name, p in chunk.named_parameters():
            if id(p) in model.duplicate_ids:         # the last stage's tied embedding: the first saves it
                continue
            states = local[id(p)]
            if ep_group is not None and is_expert(p):
                # every rank's experts, in order: the layer's whole [num_experts, ...] tensors
                states = {k: C.all_gather_dim0(t.contiguous(), ep_group) for k, t in states.items()}
            if name in parts:
                states = {k: gather_partition(t, *parts[name]) for k, t in states.items()}
            # the dense model's layout (vocabulary padding dropped, Conv1D / fused sections restored)
            out[chunk.dense_name(name)] = {k: chunk.dense_tensor(name, t).clone() for k, t in states.items()}
    return out, step


def _layout(model) -> dict:
    m, e = model.mesh, model.engine
    return {"mesh": dict(m.sizes), "zero": model.zero, "schedule": e.schedule,
            "chunks per rank": e.num_chunks, "dtype": str(model.dtype)}


def _own_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, contiguous, holding no more storage than its own elements (``torch.save`` writes
    a view's whole storage)."""
    t = t.detach().cpu().contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def _write_stage(directory: str, file: str, header: dict, states: Dict[str, Dict[str, torch.Tensor]]) -> dict:
    """Write one pipeline rank's tensors to ``directory/file``; returns their manifest entries."""
    bad = _not_finite(states)
    if bad:
        raise CheckpointError(f"save_universal: {len(bad)} tensor(s) of stage {header['stage']} hold NaN or infinite "
                              f"values, e.g. {bad[:3]}: the run has diverged. Not saved; {directory!r} keeps its "
                              f"previous checkpoint, if any. Resume from an earlier checkpoint with a lower learning "
                              f"rate or gradient clipping")
    tensors = {k: {n: _own_bytes(st[k]) for n, st in states.items()} for k in STATES}
    manifest = {n: {"file": file, "shape": list(t.shape), "dtype": str(t.dtype),
                    "crc32": {k: tensor_crc32(tensors[k][n]) for k in STATES}} for n, t in tensors["param"].items()}
    os.makedirs(directory, exist_ok=True)
    write_atomically(os.path.join(directory, file),
                      lambda tmp: torch.save({"format": FORMAT, "header": header, **tensors}, tmp))
    return manifest


def gathered(obj, group=None) -> list:
    """``obj`` of every rank of ``group`` (default: the world), in group rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def attempt(fn: Callable[[], object]) -> dict:
    """``{"ok": fn()}``, or ``{"error": text}`` if it raised: sent to every rank, so that all of them
    raise together instead of waiting on the one that failed."""
    try:
        return {"ok": fn()}
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised there
        return {"error": f"{type(exc).__name__}: {exc}"}


def raise_failures(results: list, what: str, directory: str) -> None:
    failed: Dict[str, List[int]] = {}
    for rank, res in enumerate(results):
        if res is not None and "error" in res:
            failed.setdefault(res["error"], []).append(rank)
    if failed:
        raise CheckpointError(f"universal checkpoint {directory!r}: {what} failed: "
                              + "; ".join(f"rank(s) {ranks}: {err}" for err, ranks in failed.items()))


def _check_count(name: str, value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where}: {name} {value!r} must be a non-negative integer")


def check_iteration(iteration, where: str) -> None:
    """A ``CheckpointError`` unless ``iteration`` (the caller's position, ``meta["iteration"]``) is a
    non-negative integer."""
    _check_count("iteration", iteration, where)


def run_description(model) -> dict:
    """What ``meta.json`` says of the model and its run, taken when the state is (the snapshot's time)."""
    group = model.optimizer.param_groups[0]
    return {"config": model.description, "saved from": _layout(model),
            "optimizer": {k: group[k] for k in ("lr", "eps", "weight_decay")} | {"betas": list(group["betas"])},
            "scaler": None if model.scaler is None else model.scaler.state_dict(),
            "fp8": model.fp8_scaling_state()}


def _meta(snap: "UniversalSnapshot", files: List[str], manifests: List[dict], fp8: dict) -> dict:
    """``meta.json``: ``fp8``, every stage's FP8 scaling states (rank 0's snapshot holds only its own stages')."""
    meta = {"format": FORMAT, "save": snap.save_id, "step": snap.step, "iteration": snap.iteration,
            "config": snap.described["config"], "files": files,
            "tensors": {n: e for m in manifests for n, e in sorted(m.items())},
            **{k: v for k, v in snap.described.items() if k != "config"}, "fp8": fp8}
    if snap.resume is not None:
        meta["resume"] = snap.resume
    meta["checksum"] = meta_checksum(meta)
    return meta


def _commit(directory: str, meta: dict, latest_root: Optional[str] = None, iteration: int = 0) -> None:
    """Rank 0, once every stage file is on disk: ``meta.json`` in one rename, then the earlier save's files
    go; with ``latest_root``, its ``latest_checkpointed_iteration.txt`` then names ``iteration``."""
    write_atomically(os.path.join(directory, META), write_text(json.dumps(meta, indent=1)))
    _remove_stale(directory, meta["files"])
    fsync_dir(os.path.dirname(os.path.abspath(directory)))
    if latest_root is not None:
        write_atomically(os.path.join(latest_root, LATEST), write_text(f"{iteration}\n"))


@dataclasses.dataclass
class UniversalSnapshot:
    """One save's state, taken from the model into host memory by :func:`snapshot_universal` (the only
    part of a save that needs the model) and written by :func:`write_universal` (which needs only this).
    ``states``: this rank's stages' dense fp32 tensors on the CPU, on the rank that writes them (dp 0,
    tp 0, cp 0 of each pipeline rank; empty elsewhere). ``resume``: what a resumed run of the same layout
    needs besides the dense model (:mod:`parallel_layers.resilience`), or None."""
    states: Dict[str, Dict[str, torch.Tensor]]
    step: int
    iteration: int
    save_id: str
    stage: int
    pp: int
    writer: bool
    described: dict
    resume: Optional[dict] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.states.values() for t in st.values())


def is_stage_writer(mesh) -> bool:
    """Whether this rank writes its pipeline stage's file: one per pipeline rank (index 0 along every other
    dimension)."""
    return all(index == 0 for name, index in mesh.coordinates.items() if name != "pp")


def snapshot_universal(model, iteration: Optional[int] = None, resume: Optional[dict] = None) -> UniversalSnapshot:
    """This rank's part of a universal checkpoint of ``model``, copied to host memory: a collective over
    the world (the ZeRO shards summed over dp, the TP shards gathered over tp, one save id agreed). Once it
    returns, training may change the model: the snapshot holds copies."""
    states, step = dense_states(model)
    iteration = step if iteration is None else iteration
    _check_count("iteration", iteration, "save_universal")
    m = model.mesh
    save_id = gathered(secrets.token_hex(6))[0]              # rank 0's: one name for this save's files
    writer = is_stage_writer(m)
    host = {n: {k: t.detach().to("cpu") for k, t in st.items()} for n, st in states.items()} if writer else {}
    return UniversalSnapshot(host, step, iteration, save_id, m.pp_rank, m.pp, writer, run_description(model), resume)


def write_universal(snap: UniversalSnapshot, directory: str, group=None, latest_root: Optional[str] = None) -> None:
    """Write a :func:`snapshot_universal` into ``directory``: the writers their stage file, then global
    rank 0 ``meta.json`` (a collective over ``group``, default the world: every rank of it calls this; a
    background writer passes a group of its own so its collectives never interleave with training's).
    Every rank raises :class:`CheckpointError` if any rank's part failed; the checkpoint already in
    ``directory`` is then left as it was, and nothing is published. ``latest_root``: rank 0 also points its
    ``latest_checkpointed_iteration.txt`` at this iteration once ``meta.json`` is in place (in the same
    step, so no collective more)."""
    files = [f"stage{k}-of-{snap.pp}.{snap.save_id}.pt" for k in range(snap.pp)]
    header = {"save": snap.save_id, "stage": snap.stage, "pp": snap.pp, "iteration": snap.iteration,
              "step": snap.step}
    mine = None
    if snap.writer:      # its manifest, and its stages' FP8 scaling states (rank 0 holds only its own)
        mine = attempt(lambda: (_write_stage(directory, files[snap.stage], header, snap.states),
                                snap.described.get("fp8") or {}))
    written = gathered(mine, group)
    raise_failures(written, "writing the stage files", directory)
    committed = None
    if dist.get_rank() == 0:
        oks = [w["ok"] for w in written if w is not None]
        meta = _meta(snap, files, [manifest for manifest, _ in oks],
                     {k: v for _, fp8 in oks for k, v in sorted(fp8.items())})
        committed = attempt(lambda: _commit(directory, meta, latest_root, snap.iteration))
    raise_failures(gathered(committed, group), "writing meta.json", directory)


def save_universal(model, directory: str, iteration: Optional[int] = None) -> None:
    """Save ``model`` (a ``Parallel3D``) as a universal checkpoint in ``directory``: a collective over
    the world (every rank calls it). See the module docstring for what is saved and how a crash is
    survived. ``iteration``: the caller's position in its data, kept as ``meta["iteration"]`` (default:
    the optimizer's step count, which does not count the steps an fp16 run skipped). Every rank raises
    :class:`CheckpointError` if any rank's part failed; the checkpoint already in ``directory`` is then
    left as it was. :func:`snapshot_universal` then :func:`write_universal`, the two halves an
    asynchronous save (:class:`parallel_layers.resilience.AsyncCheckpointer`) runs apart."""
    write_universal(snapshot_universal(model, iteration), directory)


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's layout: one directory per saved iteration, ``root/iter_0000020``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def point_latest(root: str, iteration: int, group=None) -> None:
    """Rank 0 points ``root``'s ``latest_checkpointed_iteration.txt`` at ``iteration`` in one rename (a
    collective over ``group``: every rank learns whether it worked)."""
    done = None
    if dist.get_rank() == 0:
        done = attempt(lambda: write_atomically(os.path.join(root, LATEST), write_text(f"{iteration}\n")))
    raise_failures(gathered(done, group), f"pointing {LATEST} at it", iteration_dir(root, iteration))


def save_iteration(model, root: str, iteration: int) -> str:
    """:func:`save_universal` into ``iteration_dir(root, iteration)``, then rank 0 points ``root``'s
    ``latest_checkpointed_iteration.txt`` at it (Megatron-LM's name) in one rename. A collective;
    returns the path."""
    path = iteration_dir(root, iteration)
    save_universal(model, path, iteration=iteration)
    point_latest(root, iteration)
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
            text = f.read().strip()
        if not text.isdigit():
            raise CheckpointError(f"universal checkpoint: {latest} holds {text[:40]!r}, not an iteration number; "
                                  f"pass one of the iter_NNNNNNN directories under {path!r} instead")
        return iteration_dir(path, int(text))
    raise FileNotFoundError(f"universal checkpoint: {path!r} holds neither a {META} (a checkpoint) nor a {LATEST} "
                            f"(a directory of them, from save_iteration)")


def _check_meta(meta, path: str) -> None:
    """The format, step and iteration, ``meta.json``'s checksum and its manifest."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"universal checkpoint: {path} holds a {type(meta).__name__}, not a JSON object")
    fmt = meta.get("format")
    if fmt in UNCHECKED_FORMATS:
        raise CheckpointError(f"universal checkpoint: {path} is format {fmt!r}, written before checkpoints carried "
                              f"checksums; this version loads only verifiable ones ({FORMAT!r}). Load it with the "
                              f"version that wrote it and save it again")
    if fmt != FORMAT:
        raise CheckpointError(f"universal checkpoint {os.path.dirname(path)!r}: format {fmt!r}, expected {FORMAT!r}")
    for key in ("step", "iteration"):
        _check_count(key, meta.get(key), f"universal checkpoint: {path}")
    if meta.get("checksum") != meta_checksum(meta):
        raise CheckpointError(f"universal checkpoint: {path} does not match its checksum (edited or corrupted); "
                              f"load an earlier checkpoint")
    _check_manifest(meta, path)


def _check_manifest(meta: dict, path: str) -> None:
    """Stage files named as a save names them, and every tensor in one of them with all it is checked by."""
    files, tensors = meta.get("files"), meta.get("tensors")
    if (not isinstance(files, list) or not isinstance(tensors, dict) or not tensors
            or not all(isinstance(e, dict) and _MANIFEST_KEYS <= set(e) for e in tensors.values())):
        raise CheckpointError(f"universal checkpoint: {path} lacks its list of files or a complete tensor manifest "
                              f"({sorted(_MANIFEST_KEYS)} of every tensor)")
    odd = [f for f in files if not (isinstance(f, str) and _SAVED_STAGE_FILE.fullmatch(f))]
    if odd:
        raise CheckpointError(f"universal checkpoint: {path} lists files that are no stage files of a save: {odd[:3]}")
    strays = sorted({e["file"] for e in tensors.values()} - set(files))
    if strays:
        raise CheckpointError(f"universal checkpoint: {path} puts tensors in files it does not list: {strays}")


def read_meta(directory: str) -> dict:
    """``directory``'s ``meta.json``, checked (format, checksum, step and iteration); not the stage files."""
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise FileNotFoundError(f"universal checkpoint: no {META} in {directory!r} (not a universal checkpoint, "
                                f"or its save did not finish); save one with save_universal(model, directory)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"universal checkpoint: {path} is not valid JSON ({exc}): corrupted; load an "
                              f"earlier checkpoint") from exc
    _check_meta(meta, path)
    return meta


def _open_stage(directory: str, file: str) -> dict:
    path = os.path.join(directory, file)
    if not os.path.exists(path):
        raise CheckpointError(f"universal checkpoint: {path} is missing ({META} lists it)")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a damaged zip
        raise CheckpointError(f"universal checkpoint: {path} cannot be read ({type(exc).__name__}: {exc}): "
                              f"truncated or corrupted") from exc
    if not isinstance(data, dict) or not isinstance(data.get("header"), dict):
        raise CheckpointError(f"universal checkpoint: {path} is not a stage file of format {FORMAT!r}")
    return data


def _check_header(path: str, header: dict, meta: dict, stage: int) -> None:
    """The file belongs to this save, at this stage."""
    h = header
    if h.get("save") != meta["save"]:
        raise CheckpointError(f"universal checkpoint: {path} belongs to another save (iteration {h.get('iteration')}, "
                              f"step {h.get('step')}) than its {META} (iteration {meta['iteration']}, step "
                              f"{meta['step']}): a stage file copied from another checkpoint")
    pp = len(meta["files"])
    if (h.get("stage"), h.get("pp")) != (stage, pp):
        raise CheckpointError(f"universal checkpoint: {path} holds stage {h.get('stage')} of {h.get('pp')}, but "
                              f"{META} lists it as stage {stage} of {pp}: stage files swapped or renamed")
    if (h.get("iteration"), h.get("step")) != (meta["iteration"], meta["step"]):
        raise CheckpointError(f"universal checkpoint: {path} was saved at iteration {h.get('iteration')}, step "
                              f"{h.get('step')}, but {META} says iteration {meta['iteration']}, step {meta['step']}")


def _check_tensor(path: str, name: str, state: str, t, entry: dict) -> None:
    where = f"universal checkpoint: {path}: {name} ({state})"
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{where} is a {type(t).__name__}, not a tensor")
    if list(t.shape) != entry["shape"] or str(t.dtype) != entry["dtype"]:
        raise CheckpointError(f"{where} is {tuple(t.shape)} {t.dtype}, but {META} says {tuple(entry['shape'])} "
                              f"{entry['dtype']}")
    crc = tensor_crc32(t)
    if crc != entry["crc32"].get(state):
        raise CheckpointError(f"{where} does not match its checksum (crc32 {crc:#010x}, {META}: "
                              f"{entry['crc32'].get(state)}): the file is corrupted; load an earlier checkpoint")
    if not torch.isfinite(t).all():
        raise CheckpointError(f"{where} holds NaN or infinite values; load an earlier checkpoint")


def _check_stage(path: str, file: str, data: dict, meta: dict) -> None:
    """Every tensor ``meta.json`` puts in ``file``, in every state, and nothing else, as recorded."""
    listed = sorted(n for n, e in meta["tensors"].items() if e["file"] == file)
    for state in STATES:
        held = data.get(state)
        if not isinstance(held, dict):
            raise CheckpointError(f"universal checkpoint: {path} has no {state} tensors")
        missing = [n for n in listed if n not in held]
        if missing:
            raise CheckpointError(f"universal checkpoint: {path} lacks {len(missing)} tensor(s) {META} puts in it: "
                                  f"{missing[:5]} ({state})")
        extra = sorted(set(held) - set(listed))
        if extra:
            raise CheckpointError(f"universal checkpoint: {path} holds tensors {META} does not list: {extra[:5]} "
                                  f"({state})")
        for name in listed:
            _check_tensor(path, name, state, held[name], meta["tensors"][name])


def _read_files(directory: str, meta: dict, files) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{"param" | "exp_avg" | "exp_avg_sq": {name: tensor}}`` of ``files``, every one checked against
    ``meta`` (memory-mapped: the checks read each tensor once)."""
    merged = {k: {} for k in STATES}
    for file in files:
        path = os.path.join(directory, file)
        data = _open_stage(directory, file)
        _check_header(path, data["header"], meta, meta["files"].index(file))
        _check_stage(path, file, data, meta)
        for k in STATES:
            merged[k].update(data[k])
    return merged


def read_universal(directory: str) -> dict:
    """The whole dense checkpoint, every file checked: ``meta.json``'s fields plus ``model`` (a ``GPT``
    state dict in fp32), ``exp_avg`` and ``exp_avg_sq`` (by the same names)."""
    meta = read_meta(directory)
    merged = _read_files(directory, meta, meta["files"])
    return dict(meta, model=merged["param"], exp_avg=merged["exp_avg"], exp_avg_sq=merged["exp_avg_sq"])


# GPTConfig fields that change how the model runs but not its weights: a resumed run may change them
RUNTIME_FIELDS = ("dropout", "sequence_parallel", "init_std", "seed")


def check_config(config, meta: dict, directory: str) -> None:
    """A ``ValueError`` naming every field where the checkpoint's model differs from ``config`` (a
    ``GPTConfig``, or ``Parallel3D.description``: a model's class and parameter shapes); the GPT's
    :data:`RUNTIME_FIELDS` may differ."""
    mine = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    differ = [k for k in mine if k not in RUNTIME_FIELDS and meta["config"].get(k) != mine[k]]
    if differ:
        raise ValueError(f"universal checkpoint {directory!r} holds another model: "
                         + "; ".join(f"{k}: saved {meta['config'].get(k)!r}, here {mine[k]!r}" for k in differ)
                         + ". Build the resuming run with the saved config (meta.json, 'config')")


def _local_slice(chunk, name: str, p: nn.Parameter, dense: torch.Tensor, parts: dict,
                 ep: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """This rank's TP slice of a dense tensor (a copy: the file is memory-mapped), in the shape of ``p``
    (vocabulary padding: zero rows); an expert's parameter, this rank's experts of it (``ep``: its rank
    and size)."""
    dense = chunk.local_tensor(name, dense)      # the parallel layer's layout (Conv1D, fused sections)
    if is_expert(p) and ep is not None:
        rank, _ = ep                             # this rank's experts: rows [rank * n, (rank + 1) * n)
        dense = dense.narrow(0, rank * p.shape[0], p.shape[0])
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


def _read_local(model, directory: str) -> Tuple[dict, Dict[int, tuple]]:
    """``meta.json`` and ``{id(param): (param, {state: this rank's slice})}`` of this rank's stages, read
    from the files holding them, each checked."""
    meta = read_meta(directory)
    check_config(model.description, meta, directory)
    mine = _named_params(model)
    missing = sorted({chunk.dense_name(n) for chunk, n, _ in mine} - set(meta["tensors"]))
    if missing:
        raise CheckpointError(f"universal checkpoint {directory!r}: {len(missing)} parameters of this rank's stages "
                              f"are in none of its files {meta['files']}: {missing[:5]}")
    files = sorted({meta["tensors"][chunk.dense_name(n)]["file"] for chunk, n, _ in mine})
    tensors = _read_files(directory, meta, files)
    local = {}
    sizes = model.mesh.sizes
    ep = (model.mesh.coordinates["ep"], sizes["ep"]) if sizes.get("ep", 1) > 1 else None
    for chunk in model.chunks:
        parts = tp_partitions(chunk)
        for name, p in chunk.named_parameters():
            dn = chunk.dense_name(name)
            local[id(p)] = (p, {k: _local_slice(chunk, name, p, tensors[k][dn], parts, ep) for k in STATES})
    return meta, local


@torch.no_grad()
def load_universal(model, directory: str) -> dict:
    """Load a universal checkpoint into ``model`` (a ``Parallel3D`` of any mesh, ZeRO stage, schedule or
    dtype built with the same model config); returns its ``meta.json`` (``meta["step"]``: the
    optimizer steps taken). A collective over the world: every rank reads and checks the files holding
    its stages, and if any rank finds a fault every rank raises :class:`CheckpointError` naming it,
    before the model is touched."""
    read = attempt(lambda: _read_local(model, directory))
    raise_failures(gathered(None if "ok" in read else read), "loading", directory)
    meta, local = read["ok"]
    step, opt = meta["step"], model.optimizer
    if model.zero == 0:
        for p, st in local.values():
            p.copy_(st["param"].to(p.dtype))
            opt.state[p] = _adamw_state(p, step, st["exp_avg"], st["exp_avg_sq"])
    else:                                            # this rank's ZeRO shard, parameters included
        name_of = model.mode.optimizer_names()
        state = {name_of[id(p)]: {z: st[k] for k, z in zip(STATES, STATE_KEYS)} for p, st in local.values()}
        opt.load_full_state_dict({"step": step, "state": state})
    if model.scaler is not None and meta.get("scaler") is not None:
        model.scaler.load_state_dict(meta["scaler"])
    model.load_fp8_scaling_state(meta.get("fp8") or {})
    return meta


def _adamw_state(p: nn.Parameter, step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict:
    """``torch.optim.AdamW``'s state of ``p`` (its step count as a CPU float tensor, moments like ``p``)."""
    return {"step": torch.tensor(float(step)), "exp_avg": exp_avg.to(p), "exp_avg_sq": exp_avg_sq.to(p)}


def load_dense_adamw(optimizer: torch.optim.Optimizer, model: nn.Module, ckpt: dict) -> None:
    """Fill a single-process ``torch.optim.AdamW`` over ``model`` (a ``GPT`` that loaded ``ckpt["model"]``)
    with the moments and step count of :func:`read_universal`'s ``ckpt``."""
    for name, p in model.named_parameters():
        optimizer.state[p] = _adamw_state(p, ckpt["step"], ckpt["exp_avg"][name], ckpt["exp_avg_sq"][name])


__all__ = ["save_universal", "snapshot_universal", "write_universal", "UniversalSnapshot", "point_latest",
           "load_universal", "read_universal", "read_meta", "check_config", "load_dense_adamw", "dense_states",
           "iteration_dir", "save_iteration", "resolve_checkpoint", "CheckpointError", "tensor_crc32",
           "meta_checksum", "run_description", "is_stage_writer", "check_iteration"]
