"""The tensor-parallel plan of a model, read off its blocks' layer names and its config.

Inside every block, each module's direct linear children are sorted by name (the names Hugging Face
decoders use), and a module is split only when all of its linears are known and it has both a
column-wise input side and a row-wise output side (so the local shard flows from one to the other):

==========================  =================================================================
column-wise (split output)  ``q_proj k_proj v_proj query key value gate_proj up_proj fc1 c_fc
                            w1 w3 fc_in dense_h_to_4h``
row-wise (split input)      ``o_proj out_proj dense c_proj down_proj fc2 w2 fc_out dense_4h_to_h``
fused, with sections        ``qkv_proj`` (q, k, v: ``num_attention_heads x head_dim``, then
                            ``num_key_value_heads x head_dim`` twice), ``c_attn`` (GPT-2: three
                            equal parts), ``gate_up_proj`` (two equal parts)
fused, per head             ``query_key_value`` of GPT-NeoX and Falcon (``[q|k|v]`` per head, or
                            ``[q.. | k | v]`` per key/value group: a contiguous split is whole heads,
                            ``"sections": None``; Falcon's multi-query layout is refused)
==========================  =================================================================

An attention module (one with a q/k/v projection) gets local head counts: its integer attributes
that count heads or features (``num_heads``, ``num_key_value_heads``, ``split_size``, ...) divided by tp,
and, when it holds a ``config``, a local copy with ``num_attention_heads`` and ``num_key_value_heads``
divided (Phi-3 reads them in forward). ``parallelize`` checks that tp divides both head counts.

A split module's other parameters (modules that are not linears: a q/k norm inside attention) run on
this rank's shard of the projections, so they are placed by their shape, with ``head_dim`` the
attention's (or the config's):

- a vector of ``head_dim`` (Qwen3's, Gemma 3's per-head q/k norms: one weight shared by every head) stays
  replicated with a tp-partial gradient (style ``"partial"``: summed over tp each step);
- a ``[heads, head_dim]`` or ``[kv_heads, head_dim]`` weight (Cohere's per-head norms: one row per head) is
  split by heads (style ``"heads"``);
- a vector of ``heads x head_dim`` or ``kv_heads x head_dim`` (OLMo2's q/k norms over all heads'
  features at once, which tp has split) becomes a ``ShardedRMSNorm`` (style ``"norm"``: its weight split
  like the projection, the sum of squares all-reduced), when its forward is an RMSNorm that layer
  reproduces bit for bit;
- anything else is refused naming the module.

A Mixture-of-Experts layer (:class:`~parallel_layers.moe.MoELayer`, which Hugging Face sparse MoE blocks
become in ``Parallel3D``) keeps its router, experts and shared-expert gate replicated over tp (expert
parallelism splits the experts); its shared expert, a gated MLP, is split column/row-wise as any MLP.

The token embedding goes over the vocabulary, the LM head column-wise with its logits gathered (the
user's loss sees whole logits); tied, they split alike and stay one parameter.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.nn as nn

from ..moe.hf_swap import is_moe_layer
from ..tensor_parallel import dense_layouts
from ..tensor_parallel.sharded_norm import dense_order
from .recipe import get_module

COLWISE = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "gate_proj", "up_proj", "fc1", "c_fc", "w1",
           "w3", "fc_in", "dense_h_to_4h"}
ROWWISE = {"o_proj", "out_proj", "dense", "c_proj", "down_proj", "fc2", "w2", "fc_out", "dense_4h_to_h"}
FUSED = {"qkv_proj", "c_attn", "gate_up_proj", "query_key_value"}
QKV = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv_proj", "c_attn", "query_key_value"}
# attention attributes that count heads or features and must become local
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads",
              "split_size", "embed_dim", "hidden_size", "all_head_size")
CONFIG_ATTRS = ("num_attention_heads", "num_key_value_heads")
# fused q/k/v layouts that are per head (a contiguous split is whole heads), by config.model_type
PER_HEAD_QKV = {"gpt_neox"}


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or dense_layouts.is_conv1d(m)


class PlanError(ValueError):
    """The plan cannot be read off the model: names the module and the fix."""


def _fused_spec(name: str, child: nn.Module, attn: nn.Module, config) -> dict:
    leaf = name.rpartition(".")[2]
    n_out = dense_layouts.linear_sizes(child)[1]
    if leaf == "gate_up_proj":
        return {"style": "colwise", "sections": [n_out // 2, n_out // 2]}
    if leaf == "c_attn":
        return {"style": "colwise", "sections": [n_out // 3] * 3}
    if leaf == "query_key_value":
        if getattr(config, "model_type", None) in PER_HEAD_QKV:
            return {"style": "colwise", "sections": None}
        if getattr(config, "model_type", None) == "falcon":
            if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
                raise PlanError(f"infer_tp_plan: {name!r} is Falcon's multi-query [q of every head | k | v]: one "
                                f"key/value head shared by all, which tensor parallelism would have to replicate "
                                f"(it does not); train it with tp=1, or pass tp_plan= without its attention")
            # [q|k|v] per head, or [q.. | k | v] per key/value group: a contiguous split is whole heads/groups
            return {"style": "colwise", "sections": None}
        raise PlanError(f"infer_tp_plan: {name!r} is a fused query_key_value of a {getattr(config, 'model_type', '?')}"
                        f" model whose layout is not known here (per head, as GPT-NeoX's, or [q | k | v]); pass "
                        f"tp_plan= with its sections (see tensor_parallel.parallelize)")
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or n_out // (heads + 2 * kv)
    sections = [heads * head_dim, kv * head_dim, kv * head_dim]
    if sum(sections) != n_out:
        raise PlanError(f"infer_tp_plan: {name!r} has {n_out} output features, not the q/k/v sections {sections} of "
                        f"num_attention_heads={heads}, num_key_value_heads={kv}, head_dim={head_dim}; pass tp_plan=")
    return {"style": "colwise", "sections": sections}


def _head_dim(module: nn.Module, config) -> Optional[int]:
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    return (getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
            or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None))


def _inner_plan(prefix: str, module: nn.Module, config) -> Dict[str, object]:
    """Styles of the non-linear modules with parameters inside a split ``module`` (see the module docstring)."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = _head_dim(module, config)
    plan: Dict[str, object] = {}

    def over_all_heads(shapes):
        return bool(head_dim) and len(shapes) == 1 and len(shapes[0]) == 1 and shapes[0][0] in \
            {h * head_dim for h in (heads, kv) if isinstance(h, int)}

    for sub, child in module.named_modules():
        own = list(child.parameters(recurse=False))
        if not sub or not own or _is_linear(child) or any(_is_linear(a) for a in _ancestors(module, sub)):
            continue
        name = f"{prefix}.{sub}"
        shapes = [tuple(p.shape) for p in own]
        if head_dim and all(s == (head_dim,) for s in shapes):
            plan[name] = "partial"
        elif head_dim and all(len(s) == 2 and s[0] in (heads, kv) and s[1] == head_dim for s in shapes):
            plan[name] = "heads"
        elif over_all_heads(shapes) and dense_order(child) is not None:
            plan[name] = "norm"
        else:
            what = (f"it normalizes over all heads' features at once ({shapes[0][0]} = heads x head_dim "
                    f"{head_dim}) and is not an RMSNorm that ShardedRMSNorm reproduces bit for bit"
                    if over_all_heads(shapes) else
                    f"its parameters {shapes} are neither one vector of head_dim={head_dim} shared by every "
                    f"head, nor one row per head, nor an RMSNorm over all heads")
            raise PlanError(f"infer_tp_plan: cannot place {name} ({type(child).__name__}) inside the split "
                            f"{prefix} ({type(module).__name__}): {what}. Train this model with tp=1 (dp, pp and "
                            f"ZeRO still apply), or pass tp_plan= that leaves {prefix} unsplit")
    return plan


def _ancestors(root: nn.Module, dotted: str):
    """The modules between ``root`` (excluded) and ``root.<dotted>`` (excluded)."""
    parts, m = dotted.split(".")[:-1], root
    for part in parts:
        m = getattr(m, part)
        yield m


def _module_plan(prefix: str, module: nn.Module, config) -> Dict[str, object]:
    """Plan entries for ``module``'s direct linears (names under ``prefix``), or {} when it has none."""
    linears = {n: c for n, c in module.named_children() if _is_linear(c)}
    if not linears or is_moe_layer(module):
        # an MoE layer's own linear (Qwen2-MoE's shared_expert_gate, one output) stays replicated, as its router
        # and experts do; its shared expert (a gated MLP child) is split below like any MLP
        return {}
    unknown = [n for n in linears if n not in COLWISE | ROWWISE | FUSED]
    col = [n for n in linears if n in COLWISE or n in FUSED]
    row = [n for n in linears if n in ROWWISE]
    if unknown or not col or not row:
        why = (f"its linear(s) {unknown} are not names it knows" if unknown else
               f"it has no {'row-wise output' if not row else 'column-wise input'} projection")
        raise PlanError(f"infer_tp_plan: cannot split {prefix or 'the model'} ({type(module).__name__}): {why} "
                        f"(column-wise: {sorted(COLWISE | FUSED)}; row-wise: {sorted(ROWWISE)}); pass "
                        f"tp_plan={{module pattern: style}} (see tensor_parallel.parallelize)")
    plan: Dict[str, object] = {}
    for n in col:
        plan[f"{prefix}.{n}"] = (_fused_spec(f"{prefix}.{n}", linears[n], module, config) if n in FUSED
                                 else "colwise")
    for n in row:
        plan[f"{prefix}.{n}"] = "rowwise"
    if any(n in QKV for n in linears):
        attrs = [a for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)
                 and not isinstance(getattr(module, a), bool)]
        config_attrs = [a for a in CONFIG_ATTRS if getattr(module, "config", None) is not None
                        and isinstance(getattr(module.config, a, None), int)]
        if attrs or config_attrs:
            plan[prefix] = {"style": "divide", "attrs": attrs, "config_attrs": config_attrs}
    plan.update(_inner_plan(prefix, module, config))
    return plan


def infer_tp_plan(model: nn.Module, blocks: str, embed: Optional[str], head: Optional[str]) -> Dict[str, object]:
    """The plan of ``model`` (see the module docstring): ``blocks`` the dotted name of its blocks'
    container, ``embed``/``head`` the token embedding's and LM head's names (or None)."""
    config = getattr(model, "config", None)
    container = get_module(model, blocks)
    plan: Dict[str, object] = {}
    for i, block in enumerate(container):
        per_block: Dict[str, object] = {}
        for sub, module in block.named_modules():
            prefix = f"{blocks}.{i}" + (f".{sub}" if sub else "")
            per_block.update(_module_plan(prefix, module, config))
        if not per_block:
            raise PlanError(f"infer_tp_plan: block {blocks}.{i} ({type(block).__name__}) has no linear layer to split; "
                            f"pass tp_plan= (see tensor_parallel.parallelize)")
        plan.update(per_block)
    if embed is not None and isinstance(get_module(model, embed), nn.Embedding):
        plan[embed] = "vocab"
    head_module = get_module(model, head) if head else None
    if head_module is not None and _is_linear(head_module):
        plan[head] = {"style": "colwise", "gather_output": True}
    return plan


__all__ = ["infer_tp_plan", "PlanError", "COLWISE", "ROWWISE", "FUSED"]
