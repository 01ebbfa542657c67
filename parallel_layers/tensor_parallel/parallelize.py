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
``"partial"``      any module                    the same module; it runs on this rank's shard (a
                                                 per-head q/k norm), so its replicated parameters
                                                 get tp-partial gradients (``partial_grads``)
``"heads"``        any module                    the same module, every parameter split along dim 0
                                                 (per-head weights ``[heads, head_dim]``, Cohere's
                                                 q/k norms)
``"norm"``         an RMSNorm                    ``ShardedRMSNorm``: its weight split like the
                                                 projection before it, statistics all-reduced (a
                                                 norm over all heads' features: OLMo2's q/k norms)
=================  ============================  ===============================================

A style may also be a dict, ``{"style": "colwise", "gather_output": True}``: the other keys go to the
layer's ``from_dense`` (``sequence_parallel``, ``activation``, ``input_is_parallel``, ...), except:

- ``sections`` (column-wise styles): the output is several fused projections, each split over the
  ranks on its own, e.g. GPT-2's ``c_attn`` ``[q | k | v]``: ``{"style": "colwise", "sections": [d, d, d]}``
  gives rank r ``[q_r | k_r | v_r]`` (``dense_layouts``);
- ``attrs`` (style ``"divide"``): the attributes of the matched modules that count heads or features
  and must become local, e.g. GPT-2's attention splits its fused output by ``split_size``:
  ``{"style": "divide", "attrs": ["split_size", "num_heads", "embed_dim"]}``;
- ``config_attrs`` (style ``"divide"``): the matched modules get a *local config*, a copy of their
  ``config`` with these attributes divided by tp (its ``head_dim`` kept), for attention that reads
  head counts from its config in forward (Phi-3's ``qkv_proj`` split at
  ``config.num_attention_heads * head_dim``):
  ``{"style": "divide", "attrs": ["num_key_value_heads"],
  "config_attrs": ["num_attention_heads", "num_key_value_heads"]}``.
  Through ``Parallel3D``, pass such a plan as ``tp_plan=`` (or let the inferred recipe of a Hugging Face
  decoder write it: :func:`~parallel_layers.families.infer_plan.infer_tp_plan`).

Hugging Face's ``Conv1D`` (GPT-2's linears, weight stored ``[in, out]``) is taken wherever ``nn.Linear``
is. The plans of the shipped model families (``GPT2LMHeadModel``'s: fused attention, MLP, tied head)
are in :mod:`parallel_layers.families`, one file per family.

Tied weights stay tied: parameters shared by several modules (``lm_head.weight is
embed_tokens.weight``) are split alike and stay one ``Parameter`` on every rank (the vocabulary
embedding and a column-wise head both split the vocabulary rows). A plan that splits only one of them,
or splits them along different dimensions, is refused with the names and the fix.

The plan only moves weights and inserts the communication; code *between* the layers must work on the
local shard. A column-parallel q/k/v projection hands attention ``n_heads / tp`` heads: attention that
infers the head count from the tensor (``view(b, s, -1, head_dim)``, as Hugging Face Llama does) just
works; attention that reads ``config.num_attention_heads`` needs a local config (``config_attrs`` above).

Checked before anything is replaced, each error naming the numbers and the fix:

- a plan that splits attention (a module under one named ``*attn*``/``*attention*``) of a model whose
  ``config`` counts heads needs tp to divide ``num_attention_heads`` and ``num_key_value_heads``: each rank
  holds whole heads (KV heads are not replicated over ranks, as Megatron-LM does when tp exceeds them);
- a column-wise split of a fused projection (a name holding ``qkv`` or ``gate_up``, or GPT-2's
  ``c_attn``) needs ``sections`` (or ``"sections": None`` where contiguous slices are whole heads, e.g. a
  per-head interleaved ``[q|k|v]`` per head): without them a rank would get a slice of q and none of v,
  and train silently wrong;
- ``"vocab"`` on an ``nn.Embedding`` subclass with its own forward: one with ``embed_scale`` (Gemma's
  scaled embedding) keeps the scale on the parallel layer; any other is refused.
Unlike ``torch.distributed.tensor.parallel.parallelize_module`` the result holds plain tensors, not
DTensors.

:func:`gather_dense_state_dict` is the inverse for checking: the full dense weights (or gradients)
gathered from the shards, keyed like the original model.
"""
from __future__ import annotations

import copy
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
from .layers import ColumnParallelLinear, RowParallelLinear, set_parameter
from .partial_grads import mark_partial
from .sharded_norm import ShardedRMSNorm

_STYLES = {
    "colwise": (ColumnParallelLinear, nn.Linear, {}),
    "colwise_gather": (ColumnParallelLinear, nn.Linear, {"gather_output": True}),
    "rowwise": (RowParallelLinear, nn.Linear, {}),
    "vocab": (VocabParallelEmbedding, nn.Embedding, {}),
    "divide": (None, nn.Module, {}),
    "share": (None, nn.Module, {}),
    "partial": (None, nn.Module, {}),
    "heads": (None, nn.Module, {}),
    "norm": (ShardedRMSNorm, nn.Module, {}),
}


_KEPT = ("divide", "share", "partial", "heads")     # styles that keep the module (nothing replaced)


def _group_of(mesh) -> "dist.ProcessGroup":
    if isinstance(mesh, ParallelMesh):
        return mesh.tp_group
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    raise TypeError(f"parallelize: mesh must be a ParallelMesh or a torch.distributed ProcessGroup (the TP "
                    f"group); got {type(mesh).__name__}")


def plan_entry(spec) -> Tuple[object, dict]:
    """A plan entry's style name and options: ``(spec, {})`` for a name, the dict's ``"style"`` and the rest for a
    dict, ``(None, {})`` for anything else (:func:`parallelize` refuses those, naming the entry)."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping):
        options = dict(spec)
        return options.pop("style", None), options
    return None, {}


def _style(pattern: str, spec) -> tuple:
    name, options = plan_entry(spec)
    if not isinstance(spec, (str, Mapping)):
        raise TypeError(f"parallelize: plan[{pattern!r}] must be a style name or a dict with a 'style' key; "
                        f"got {type(spec).__name__}")
    if name not in _STYLES:
        raise ValueError(f"parallelize: plan[{pattern!r}] has style {name!r}; choose one of {sorted(_STYLES)}")
    cls, dense_type, defaults = _STYLES[name]
    return name, cls, dense_type, {**defaults, **options}


def _check_sizes(name: str, module: nn.Module, style: str, tp: int) -> None:
    if style in _KEPT or style in ("vocab", "norm"):
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


def _local_config(name: str, module: nn.Module, attrs, tp: int, made: dict) -> None:
    """Give ``module`` a copy of its ``config`` with ``attrs`` divided by tp (one copy per config)."""
    config = getattr(module, "config", None)
    if config is None:
        raise TypeError(f"parallelize: module {name!r} ({type(module).__name__}) has no config for config_attrs="
                        f"{list(attrs)}; divide its own attributes with 'attrs' instead")
    for attr in attrs:
        value = getattr(config, attr, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"parallelize: module {name!r}: its config has no integer attribute {attr!r} to "
                            f"divide (got {value!r})")
        if value % tp:
            raise ValueError(f"parallelize: module {name!r}: config.{attr}={value} does not divide by the "
                             f"tensor-parallel size {tp}")
    key = (id(config), tuple(attrs))
    if key not in made:
        local = copy.copy(config)
        heads = getattr(config, "num_attention_heads", None)
        if getattr(config, "head_dim", None) is None and heads and getattr(config, "hidden_size", None):
            local.head_dim = config.hidden_size // heads         # what the dense config derives, kept
        for attr in attrs:
            setattr(local, attr, getattr(config, attr) // tp)
        made[key] = (config, local)
    module.config = made[key][1]


_FUSED_NAMES = ("qkv", "gate_up")


def _looks_fused(name: str) -> bool:
    last = name.rpartition(".")[2].lower()
    return last == "c_attn" or any(part in last for part in _FUSED_NAMES)


def _fused_hint(name: str, model: nn.Module, n_out: int) -> str:
    last = name.rpartition(".")[2].lower()
    if "gate_up" in last:
        return f"'sections': [{n_out // 2}, {n_out // 2}] (gate, up)"
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads and kv:
        head_dim = getattr(config, "head_dim", None) or n_out // (heads + 2 * kv)
        if (heads + 2 * kv) * head_dim == n_out:
            return (f"'sections': [{heads * head_dim}, {kv * head_dim}, {kv * head_dim}] (q, k, v: "
                    f"num_attention_heads={heads} x head_dim={head_dim}, then num_key_value_heads={kv} x "
                    f"head_dim twice)")
    return f"'sections': [{n_out // 3}, {n_out // 3}, {n_out // 3}] (q, k, v), or the sizes of its parts"


def _check_fused(name: str, module: nn.Module, style: str, options: dict, model: nn.Module) -> None:
    if not style.startswith("colwise") or "sections" in options or not _looks_fused(name):
        return
    n_out = dense_layouts.linear_sizes(module)[1]
    raise ValueError(f"parallelize: module {name!r} looks like a fused projection ({n_out} output features of "
                     f"several parts side by side), split {style!r} without sections: a contiguous split would "
                     f"give rank 0 the start of the first part and nothing of the last, and train silently "
                     f"wrong; give {{'style': {style!r}, {_fused_hint(name, model, n_out)}}}, or "
                     f"'sections': None if its contiguous slices are whole heads (a per-head interleaved "
                     f"[q|k|v] such as GPT-NeoX's query_key_value)")


def _heads(config):
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv


def _check_heads(model: nn.Module, chosen: dict, tp: int) -> None:
    """Attention split over tp: every rank must hold whole query and key/value heads."""
    heads, kv = _heads(getattr(model, "config", None))
    if tp == 1 or not isinstance(heads, int) or not isinstance(kv, int):
        return
    attention = [n for n, ((style, _), _, _) in chosen.items() if style not in _KEPT
                 and any("attn" in part.lower() or "attention" in part.lower() for part in n.split("."))]
    if not attention or (heads % tp == 0 and kv % tp == 0):
        return
    fits = [t for t in range(1, min(heads, kv) + 1) if heads % t == 0 and kv % t == 0]
    raise ValueError(f"parallelize: tensor-parallel size {tp} splits the attention of {type(model).__name__} "
                     f"({attention[0]!r}, ...), but each rank must hold whole heads: tp must divide both "
                     f"config.num_attention_heads={heads} and config.num_key_value_heads={kv}; use tp in {fits} "
                     f"(key/value heads are not replicated over ranks), or leave attention out of the plan")


def _split_heads(name: str, module: nn.Module, group, tp: int) -> None:
    """Style ``"heads"``: keep this rank's rows (heads) of every parameter of ``module``."""
    rank = C.rank(group)
    for pname, p in list(module.named_parameters(recurse=False)):
        if p.ndim == 0 or p.shape[0] % tp:
            raise ValueError(f"parallelize: module {name!r} ({type(module).__name__}): style 'heads' splits its "
                             f"parameters along dim 0 (one row per head), but {pname} has shape {tuple(p.shape)}, "
                             f"which does not divide by the tensor-parallel size {tp}")
        rows = p.shape[0] // tp
        set_parameter(module, pname, p.detach()[rank * rows:(rank + 1) * rows].clone(),
                      requires_grad=p.requires_grad, tensor_parallel=True, partition_dim=0)
    module.tp_group = group


def _scaled_embedding(name: str, module: nn.Module, layer: nn.Module) -> nn.Module:
    """An ``nn.Embedding`` subclass with its own forward: keep Hugging Face's ``embed_scale`` (Gemma
    multiplies the looked-up rows by sqrt(hidden)); refuse any other."""
    if type(module).forward is nn.Embedding.forward:
        return layer
    scale = getattr(module, "embed_scale", None)
    if not torch.is_tensor(scale):
        raise ValueError(f"parallelize: module {name!r} is a {type(module).__name__}, an nn.Embedding with its own "
                         f"forward; 'vocab' would replace it by a plain vocabulary-parallel lookup and lose what "
                         f"that forward adds; leave it out of the plan or split a plain nn.Embedding")
    layer.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
    layer.register_forward_hook(_apply_embed_scale)
    return layer


def _apply_embed_scale(layer, inputs, out):
    return out * layer.embed_scale.to(layer.weight.dtype)


def _build(name: str, module: nn.Module, style: str, cls, options: dict, group, tp: int) -> nn.Module:
    options = dict(options)
    sections = options.pop("sections", None)
    if sections is not None and not style.startswith("colwise"):
        raise ValueError(f"parallelize: module {name!r}: sections= splits fused output features, so it needs a "
                         f"column-wise style, not {style!r}")
    if cls is VocabParallelEmbedding:
        return _scaled_embedding(name, module, cls.from_dense(module, tp_group=group, **options))
    if cls is ShardedRMSNorm:
        return cls.from_dense(module, group, name)
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
            _check_fused(name, module, style, options, model)
            chosen[name] = ((style, options), pattern, cls)
    _check_heads(model, chosen, tp)
    ties = _tied_groups(model)
    _check_ties(ties, chosen)
    configs: dict = {}
    for name, ((style, options), _, cls) in chosen.items():
        if style == "divide":
            _divide(name, modules[name], options.get("attrs", ()), tp)
            if options.get("config_attrs"):
                _local_config(name, modules[name], options["config_attrs"], tp, configs)
        elif style == "partial":
            mark_partial(modules[name])
        elif style == "heads":
            _split_heads(name, modules[name], group, tp)
        if style in _KEPT:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _build(name, modules[name], style, cls, options, group, tp))
    _retie(model, ties, chosen)
    return model


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


__all__ = ["parallelize", "plan_entry", "gather_dense_state_dict", "tp_partitions", "gather_partition"]
