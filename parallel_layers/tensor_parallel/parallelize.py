"""``parallelize(model, mesh, plan)``: turn the dense layers of any model into tensor-parallel ones.

A plan maps module-name patterns (``fnmatch`` style, matched against ``model.named_modules()``) to a
style; every match is replaced *in place* by the parallel layer built from it with ``from_dense``
(the dense weights are sliced, so the parallel model computes what the dense one did)::

    plan = {"model.embed_tokens": "vocab",
            "model.layers.*.self_attn.[qkv]_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise",
            "lm_head": "colwise_gather"}
    parallelize(model, mesh, plan)

=================  ============================  ===============================================
style              replaces                      becomes
=================  ============================  ===============================================
``"colwise"``      ``nn.Linear``                 ``ColumnParallelLinear`` (output ``[..., out/tp]``)
``"colwise_gather"`` ``nn.Linear``               ``ColumnParallelLinear(gather_output=True)``
``"rowwise"``      ``nn.Linear``                 ``RowParallelLinear`` (input ``[..., in/tp]``)
``"vocab"``        ``nn.Embedding``              ``VocabParallelEmbedding``

``"divide"``       any module                    the same module, integer attributes divided by tp
``"share"``        any module                    the same module; its parameters tied to split ones
                                                 become those split ones (a holder of a tied copy)
=================  ============================  ===============================================

A style may also be a dict, ``{"style": "colwise", "gather_output": True}``: the other keys go to the
layer's ``from_dense`` (``sequence_parallel``, ``activation``, ``input_is_parallel``, ...), except:

- ``sections`` (column-wise styles): the output is several fused projections, each split over the
  ranks on its own, e.g. GPT-2's ``c_attn`` ``[q | k | v]``: ``{"style": "colwise", "sections": [d, d, d]}``
  gives rank r ``[q_r | k_r | v_r]`` (``dense_layouts``);
- ``attrs`` (style ``"divide"``): the attributes of the matched modules that count heads or features
  and must become local, e.g. GPT-2's attention splits its fused output by ``split_size``:
  ``{"style": "divide", "attrs": ["split_size", "num_heads", "embed_dim"]}``.

Hugging Face's ``Conv1D`` (GPT-2's linears, weight stored ``[in, out]``) is taken wherever ``nn.Linear``
is. :func:`gpt2_plan` is the whole plan for ``GPT2LMHeadModel`` (attention, MLP, tied head).

Tied weights stay tied: parameters shared by several modules (``lm_head.weight is
embed_tokens.weight``) are split alike and stay one ``Parameter`` on every rank (the vocabulary
embedding and a column-wise head both split the vocabulary rows). A plan that splits only one of them,
or splits them along different dimensions, is refused with the names and the fix.

The plan only moves weights and inserts the communication; code *between* the layers must work on the
local shard. A column-parallel q/k/v projection hands attention ``n_heads / tp`` heads: attention that
infers the head count from the tensor (``view(b, s, -1, head_dim)``, as Hugging Face Llama does) just
works; attention that reads ``config.num_heads`` needs a local config with ``num_heads / tp``.
Unlike ``torch.distributed.tensor.parallel.parallelize_module`` the result holds plain tensors, not
DTensors.

:func:`gather_dense_state_dict` is the inverse for checking: the full dense weights (or gradients)
gathered from the shards, keyed like the original model.
"""
from __future__ import annotations

import difflib
from fnmatch import fnmatchcase
from typing import Dict, List, Mapping, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C
from ..mesh import ParallelMesh
from . import dense_layouts
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear

_STYLES = {
    "colwise": (ColumnParallelLinear, nn.Linear, {}),
    "colwise_gather": (ColumnParallelLinear, nn.Linear, {"gather_output": True}),
    "rowwise": (RowParallelLinear, nn.Linear, {}),
    "vocab": (VocabParallelEmbedding, nn.Embedding, {}),
    "divide": (None, nn.Module, {}),
    "share": (None, nn.Module, {}),
}


_KEPT = ("divide", "share")     # styles that keep the module (nothing replaced)


def _group_of(mesh) -> "dist.ProcessGroup":
    if isinstance(mesh, ParallelMesh):
        return mesh.tp_group
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    raise TypeError(f"parallelize: mesh must be a ParallelMesh or a torch.distributed ProcessGroup (the TP "
                    f"group); got {type(mesh).__name__}")


def _style(pattern: str, spec) -> tuple:
    if isinstance(spec, str):
        name, options = spec, {}
    elif isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("style", None)
    else:
        raise TypeError(f"parallelize: plan[{pattern!r}] must be a style name or a dict with a 'style' key; "
                        f"got {type(spec).__name__}")
    if name not in _STYLES:
        raise ValueError(f"parallelize: plan[{pattern!r}] has style {name!r}; choose one of {sorted(_STYLES)}")
    cls, dense_type, defaults = _STYLES[name]
    return name, cls, dense_type, {**defaults, **options}


def _check_sizes(name: str, module: nn.Module, style: str, tp: int) -> None:
    if style in _KEPT or style == "vocab":
        return  # divide: checked per attribute; share: nothing split; vocab: padded to a multiple of tp
    n_in, n_out = dense_layouts.linear_sizes(module)
    if style.startswith("colwise") and n_out % tp:
        what = ("out_features", n_out)
    elif style == "rowwise" and n_in % tp:
        what = ("in_features", n_in)
    else:
        return
    raise ValueError(f"parallelize: module {name!r} ({type(module).__name__}({n_in}, {n_out})) "
                     f"cannot be split {style}: {what[0]}={what[1]} does not divide by the tensor-parallel "
                     f"size {tp}; choose a tensor-parallel size that divides {what[1]} or leave it out of the plan")


def _accepts(style: str, dense_type, module: nn.Module) -> bool:
    if dense_type is nn.Linear:
        return isinstance(module, nn.Linear) or dense_layouts.is_conv1d(module)
    return isinstance(module, dense_type)


def _divide(name: str, module: nn.Module, attrs, tp: int) -> None:
    for attr in attrs:
        value = getattr(module, attr, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"parallelize: module {name!r} ({type(module).__name__}) has no integer attribute "
                            f"{attr!r} to divide (got {value!r})")
        if value % tp:
            raise ValueError(f"parallelize: module {name!r}: {attr}={value} does not divide by the tensor-parallel "
                             f"size {tp}")
    for attr in attrs:
        setattr(module, attr, getattr(module, attr) // tp)


def _build(name: str, module: nn.Module, style: str, cls, options: dict, group, tp: int) -> nn.Module:
    options = dict(options)
    sections = options.pop("sections", None)
    if sections is not None and not style.startswith("colwise"):
        raise ValueError(f"parallelize: module {name!r}: sections= splits fused output features, so it needs a "
                         f"column-wise style, not {style!r}")
    if cls is VocabParallelEmbedding:
        return cls.from_dense(module, tp_group=group, **options)
    dense = module if isinstance(module, nn.Linear) and not sections else \
        dense_layouts.as_linear(name, module, sections, tp)
    return dense_layouts.mark(cls.from_dense(dense, tp_group=group, **options), module, sections)


def _tied_groups(model: nn.Module) -> List[List[Tuple[str, str]]]:
    """Parameters shared by several (module, attribute) places, as lists of those places."""
    places: Dict[int, List[Tuple[str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            places.setdefault(id(p), []).append((mname, pname))
    return [sorted(set(v)) for v in places.values() if len(set(v)) > 1]


def _full(mname: str, pname: str) -> str:
    return f"{mname}.{pname}" if mname else pname


def _splits(chosen, module_name: str) -> bool:
    return module_name in chosen and chosen[module_name][0][0] not in _KEPT


def _shares(chosen, module_name: str) -> bool:
    return module_name in chosen and chosen[module_name][0][0] == "share"


def _check_ties(ties, chosen) -> None:
    for group in ties:
        split = [(m, p) for m, p in group if _splits(chosen, m)]
        follow = [(m, p) for m, p in group if _shares(chosen, m)]
        if split and len(split) + len(follow) != len(group):
            kept = [(m, p) for m, p in group if (m, p) not in split]
            raise ValueError(
                f"parallelize: {', '.join(_full(m, p) for m, p in split)} is tied to "
                f"{', '.join(_full(m, p) for m, p in kept)} (one Parameter), but the plan splits only the "
                f"first; add {', '.join(repr(m) for m, _ in kept)} to the plan with a style that "
                f"splits the same rows (an embedding 'vocab' with a head 'colwise'/'colwise_gather'), or untie "
                f"them before parallelize (e.g. config.tie_word_embeddings=False and a copied weight); a module "
                f"that only holds the tied copy (BERT's cls.predictions.bias) takes the style 'share'")


def _retie(model: nn.Module, ties, chosen) -> None:
    """Point every place of a tied group at the first place's new (sharded) Parameter."""
    for group in ties:
        split = [(m, p) for m, p in group if _splits(chosen, m)]
        if not split or len(split) + sum(_shares(chosen, m) for m, _ in group) != len(group):
            continue
        first_m, first_p = split[0]
        shared = getattr(model.get_submodule(first_m), first_p)
        for mname, pname in group:
            module = model.get_submodule(mname)
            mine = getattr(module, pname)
            if mine is shared:
                continue
            if _splits(chosen, mname) and (mine.shape != shared.shape
                                           or getattr(mine, "partition_dim", None) != shared.partition_dim):
                raise ValueError(
                    f"parallelize: {_full(first_m, first_p)} and {_full(mname, pname)} are tied but their styles "
                    f"({chosen[first_m][0][0]!r}, {chosen[mname][0][0]!r}) split them differently (local shapes "
                    f"{tuple(shared.shape)} and {tuple(mine.shape)}); give the embedding 'vocab' and the head "
                    f"'colwise' or 'colwise_gather' (both split the vocabulary rows, which must divide by tp)")
            setattr(module, pname, shared)


def parallelize(model: nn.Module, mesh: Union[ParallelMesh, "dist.ProcessGroup"],
                plan: Mapping[str, Union[str, dict]]) -> nn.Module:
    """Replace the modules ``plan`` names with tensor-parallel layers over ``mesh``'s TP group; returns
    ``model`` (changed in place). Every rank must call it with the same model and plan."""
    group = _group_of(mesh)
    tp = C.world_size(group)
    modules = dict(model.named_modules())
    chosen: Dict[str, tuple] = {}
    for pattern, spec in plan.items():
        style, cls, dense_type, options = _style(pattern, spec)
        matches = [n for n in modules if n and fnmatchcase(n, pattern)]
        if not matches:
            names = [n for n, m in modules.items()
                     if isinstance(m, (nn.Linear, nn.Embedding)) or dense_layouts.is_conv1d(m)]
            close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.0) or names[:5]
            raise ValueError(f"parallelize: pattern {pattern!r} matched no module of the model; candidates: "
                             f"{', '.join(close) or '(no nn.Linear or nn.Embedding in the model)'}")
        for name in matches:
            module = modules[name]
            if not _accepts(style, dense_type, module):
                raise TypeError(f"parallelize: pattern {pattern!r} matched {name!r}, a {type(module).__name__}, "
                                f"but style {style!r} replaces an {dense_type.__name__}"
                                + (" or a transformers Conv1D" if dense_type is nn.Linear else ""))
            if name in chosen and chosen[name][0] != (style, options):
                raise ValueError(f"parallelize: module {name!r} is matched by patterns {chosen[name][1]!r} and "
                                 f"{pattern!r} with different styles")
            _check_sizes(name, module, style, tp)
            chosen[name] = ((style, options), pattern, cls)
    ties = _tied_groups(model)
    _check_ties(ties, chosen)
    for name, ((style, options), _, cls) in chosen.items():
        if style == "divide":
            _divide(name, modules[name], options.get("attrs", ()), tp)
        if style in _KEPT:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _build(name, modules[name], style, cls, options, group, tp))
    _retie(model, ties, chosen)
    return model


def gpt2_plan(n_embd: int) -> Dict[str, Union[str, dict]]:
    """The plan for Hugging Face ``GPT2LMHeadModel`` (``n_embd``: ``config.n_embd``): the fused ``c_attn``
    split per q/k/v section, the attention's split size and head count made local, the MLP and
    attention output row-wise, the tied embedding and head over the vocabulary."""
    d = n_embd
    return {"transformer.wte": "vocab", "lm_head": {"style": "colwise", "gather_output": True},
            "transformer.h.*.attn.c_attn": {"style": "colwise", "sections": [d, d, d]},
            "transformer.h.*.attn": {"style": "divide", "attrs": ["split_size", "num_heads", "embed_dim"]},
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


def _gather_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    if C.world_size(group) == 1:
        return t.clone()
    full = C.all_gather_dim0(t.detach().movedim(dim, 0).contiguous(), group)
    return full.movedim(0, dim)


def tp_partitions(model: nn.Module) -> Dict[str, Tuple[int, object, int]]:
    """Every tensor-parallel parameter of ``model`` (``named_parameters`` names, duplicates kept):
    ``(partition_dim, tp_group, dense_size)``, the dimension it is split along, over which group, and
    its dense size along it (``VocabParallelEmbedding``: the true vocabulary, without the padding).
    Parameters absent from the map are replicated."""
    out = {}
    for mname, module in model.named_modules():
        if not hasattr(module, "tp_group"):
            continue
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            dim = getattr(p, "partition_dim", None)
            if dim is None:
                continue
            size = (module.num_embeddings if isinstance(module, VocabParallelEmbedding)
                    else p.shape[dim] * C.world_size(module.tp_group))
            out[f"{mname}.{pname}" if mname else pname] = (dim, module.tp_group, size)
    return out


def gather_partition(t: torch.Tensor, dim: int, group, dense_size: int) -> torch.Tensor:
    """The dense tensor of the TP shards ``t`` (a collective over ``group``), its padding dropped."""
    return _gather_dim(t, dim, group).narrow(dim, 0, dense_size)


def gather_dense_state_dict(model: nn.Module, *, grads: bool = False) -> Dict[str, torch.Tensor]:
    """The dense model's ``state_dict`` (``grads=True``: its gradients) gathered from the TP shards.

    Sharded parameters (``partition_dim`` set by the parallel layers) are all-gathered along that
    dimension over their layer's TP group; the vocabulary padding of ``VocabParallelEmbedding`` is
    dropped; everything else is copied as is. Every rank gets the full tensors. A collective: every TP
    rank must call it. A parameter without a gradient maps to ``None`` with ``grads=True``.
    """
    parts = tp_partitions(model)
    owners = {_full(m, p): (module, p) for m, module in model.named_modules(remove_duplicate=False)
              for p, _ in module.named_parameters(recurse=False, remove_duplicate=False)}
    source = ({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)} if grads
              else {n: t for n, t in model.state_dict(keep_vars=True).items()})
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in source.items():
        if tensor is None:
            out[name] = None
        elif name in parts:
            out[name] = gather_partition(tensor.detach(), *parts[name])
        else:
            out[name] = tensor.detach().clone()
        if tensor is not None and name in owners:   # Conv1D / fused sections: the dense original's layout
            out[name] = dense_layouts.to_dense(owners[name][0], owners[name][1], out[name])
    return out


__all__ = ["parallelize", "gpt2_plan", "gather_dense_state_dict", "tp_partitions", "gather_partition"]
