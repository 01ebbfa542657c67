"""What a Hugging Face decoder's own forwards compute besides calling its parts, for :mod:`.infer_recipe`.

The inferred recipe calls the model's own modules (token embedding, blocks, final norm, LM head); what the
base model's forward and the ``*ForCausalLM`` forward compute *between* those calls must be computed too, or
the recipe runs a different forward than the model's. Both forwards are read from their source (its syntax
tree, so formatting and comments do not matter), and every ``self.<name>`` / ``self.config.<name>`` they
read must be

- a child module (the parts the recipe places: embeddings, blocks, norm, rotary, head);
- bookkeeping that does not change what a training step computes (:data:`BOOKKEEPING`: caches, output
  flags, the loss function, the attention kinds' ``config.layer_types`` / ``config.sliding_window``, which
  :mod:`.infer_recipe` reads itself);
- or an extra below, whose statement is found in the source as written here (``ast.unparse``'s spelling):

- embedding: ``inputs_embeds = inputs_embeds * self.embedding_multiplier`` (Granite, HyperCLOVAX);
  ``nn.functional.dropout(hidden_states, p=self.embedding_dropout, training=self.training)`` (Starcoder2);
- head: ``logits = logits / self.config.logits_scaling`` (Granite) or ``logits = self.lm_head(hidden_states)
  * self.config.logits_scaling`` (HyperCLOVAX); ``logits = logits * self.logit_scale`` (Cohere);
  ``cap * tanh(logits / cap)`` with ``cap = config.final_logit_softcapping`` where it is not None (Gemma 2, 3);
- context: Falcon's ALiBi (``self.use_alibi``, ``self.num_heads``, ``self.config.hidden_size``):
  ``build_alibi_tensor`` of the model's module, folded into the causal mask (:func:`alibi_context`);
- accepted while off, refused while on: ``config.use_bidirectional_attention`` (Gemma 3: masks that see
  later tokens are not built), ``config.output_router_logits`` (mixtures of experts: the routers'
  load-balancing loss added to the model's loss, which the recipe's loss_fn does not see; the logits are
  the same either way; accepted once ``Parallel3D`` has replaced the MoE blocks, as it adds that loss itself:
  :mod:`parallel_layers.moe.hf_swap`);
- accepted: ``self.multi_query`` in GPT-BigCode's cross-attention mask (no encoder here).

Anything else (a method such as ``self._update_causal_mask``, an attribute such as ``self.scale_emb``, an
option read as ``self.config.<name>``) is refused naming it: :class:`~.infer_recipe.InferenceError`. So is
a base model's forward that calls its final norm before its blocks too (NanoChat) or its embedding in or
after them: the parts run in the order embedding, blocks, final norm.

The keyword arguments of the forward's mask calls (``create_causal_mask(config=..., ...)`` or a
``mask_kwargs`` dict) are read too: whether it passes ``position_ids`` and ``allow_is_causal_skip=False``
(Falcon materialises its mask), and any other keyword is refused.
"""
from __future__ import annotations

import ast
import inspect
import math
import re
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..moe.hf_swap import is_moe_layer

# what the forwards may read without changing what a training step computes
BOOKKEEPING = {"config", "config.num_hidden_layers", "config.vocab_size", "vocab_size", "loss_function",
               "gradient_checkpointing", "training", "config.return_dict", "config.use_return_dict",
               "config.output_attentions", "config.output_hidden_states", "config.use_cache",
               "warn_if_padding_and_no_attention_mask", "config.add_cross_attention",
               "has_sliding_layers", "config.layer_types", "config.sliding_window"}
# keyword arguments of transformers' mask functions the inferred context passes on as the forward does
MASK_KEYWORDS = {"config", "inputs_embeds", "attention_mask", "past_key_values", "position_ids", "cache_position",
                 "allow_is_causal_skip"}


@dataclass(frozen=True)
class Extra:
    """One statement of a forward the recipe reproduces (see the module docstring)."""
    reads: Tuple[str, ...]          # what the forward reads: "embedding_multiplier", "config.logits_scaling"
    where: str                      # "embed" (the base model's forward) or "head" (the *ForCausalLM's)
    pattern: str                    # a regex the forward's unparsed source must match
    apply: Optional[Callable] = None   # (owner module, tensor) -> tensor; None: nothing to compute
    refuse_if: Optional[Callable] = None   # (owner module) -> a reason to refuse, or None
    after_positions: bool = False   # embedding extras: after the learned positions and dropouts (else before)


def _softcap(owner, logits):
    cap = owner.config.final_logit_softcapping
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _bidirectional(owner):
    if getattr(owner.config, "use_bidirectional_attention", False):
        return ("config.use_bidirectional_attention=True (masks that let a sliding or full layer see later "
                "tokens) is not reproduced: the inferred context builds causal masks")
    return None


def _router_loss(owner):
    # blocks Parallel3D replaced by MoELayers: it adds this loss itself (moe.hf_router_loss.HFRouterLoss)
    if getattr(owner.config, "output_router_logits", False) and not any(is_moe_layer(m) for m in owner.modules()):
        return ("config.output_router_logits=True adds the routers' load-balancing loss (x router_aux_loss_coef) to "
                "the model's loss, which the recipe's loss_fn (on the logits) does not see: set it False (the logits "
                "are the same) or add that loss in a Recipe of your own")
    return None


ALIBI = Extra(("use_alibi", "num_heads", "config.hidden_size"), "embed",
              r"alibi = build_alibi_tensor\(mask, self\.num_heads, dtype=inputs_embeds\.dtype\)(.|\n)*"
              r"alibi = alibi\.reshape\(batch_size, -1, \*alibi\.shape\[1:\]\)\n\s*causal_mask = torch\.masked_fill\("
              r"alibi / math\.sqrt\(self\.config\.hidden_size // self\.num_heads\), causal_mask < -1, min_dtype\)")
EXTRAS = (
    Extra(("embedding_multiplier",), "embed",                               # Granite, HyperCLOVAX
          r"inputs_embeds = inputs_embeds \* self\.embedding_multiplier\n",
          lambda base, h: h * base.embedding_multiplier),
    Extra(("embedding_dropout",), "embed",                                  # Starcoder2
          r"= nn\.functional\.dropout\(hidden_states, p=self\.embedding_dropout, training=self\.training\)",
          lambda base, h: F.dropout(h, p=base.embedding_dropout, training=base.training), after_positions=True),
    Extra(("config.logits_scaling",), "head", r"logits = logits / self\.config\.logits_scaling\n",   # Granite
          lambda model, x: x / model.config.logits_scaling),
    Extra(("config.logits_scaling",), "head",                               # HyperCLOVAX multiplies
          r"logits = self\.lm_head\(hidden_states\) \* self\.config\.logits_scaling\n",
          lambda model, x: x * model.config.logits_scaling),
    Extra(("logit_scale",), "head", r"logits = logits \* self\.logit_scale\n",                    # Cohere
          lambda model, x: x * model.logit_scale),
    Extra(("config.final_logit_softcapping",), "head",                      # Gemma 2, 3
          r"if self\.config\.final_logit_softcapping is not None:\n\s*logits = logits / "
          r"self\.config\.final_logit_softcapping\n\s*logits = torch\.tanh\(logits\)\n\s*logits = logits \* "
          r"self\.config\.final_logit_softcapping\n", _softcap),
    Extra(("config.use_bidirectional_attention",), "embed", r"if self\.config\.use_bidirectional_attention:",
          refuse_if=_bidirectional),                                        # Gemma 3
    ALIBI,                                                                  # Falcon
    Extra(("config.output_router_logits", "num_experts", "num_experts_per_tok", "router_aux_loss_coef",
           "aux_loss_coef"), "head",                                        # mixtures of experts
          r"if output_router_logits:\n\s*aux_loss = load_balancing_loss_func\(outputs\.router_logits, [^\n]*\n\s*"
          r"if labels is not None:\n\s*loss \+= self\.(router_)?aux_loss_coef \* aux_loss\.to\(loss\.device\)\n",
          refuse_if=_router_loss),
    Extra(("multi_query",), "embed",                                        # GPT-BigCode: cross-attention only
          r"encoder_attention_mask = encoder_attention_mask\.bool\(\)\.unsqueeze\(2 if self\.multi_query else 1\)\n"),
)


@dataclass
class Forwards:
    """What :func:`read_forwards` found: the extras to compute and how the masks are called."""
    embed: List[Extra] = field(default_factory=list)
    head: List[Extra] = field(default_factory=list)
    alibi: Optional[bool] = None             # Falcon's ALiBi: None where the forward has none, else on/off
    mask_position_ids: bool = True           # the forward passes position_ids to its mask calls
    mask_options: Dict[str, object] = field(default_factory=dict)   # allow_is_causal_skip=False


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


@dataclass
class _Read:
    """One forward, read: its unparsed body, what it reads of ``self`` / ``self.config``, the keyword
    names of its causal-mask calls, the lines where it calls each ``self.<child>(...)`` and the line span of
    each loop over a ``self.<child>``."""
    text: str
    reads: Set[str]
    masks: List[Set[str]]
    calls: Dict[str, List[int]]
    loops: Dict[str, Tuple[int, int]]


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _mask_call(node) -> Optional[Set[str]]:
    """The keyword names of a causal-mask call (``create_*causal_mask(...)``, Starcoder2's
    ``mask_function(...)``) or of a ``mask_kwargs`` dict (naming ``config`` and ``inputs_embeds``); None
    for anything else (an encoder's bidirectional mask included)."""
    if isinstance(node, ast.Call):
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if "causal_mask" not in func and func != "mask_function":
            return None
        names = {k.arg for k in node.keywords if k.arg}
        skip = [k for k in node.keywords if k.arg == "allow_is_causal_skip"]
        if skip and not (isinstance(skip[0].value, ast.Constant) and skip[0].value.value is False):
            names.add("allow_is_causal_skip=?")
    elif isinstance(node, ast.Dict):
        names = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    else:
        return None
    return names if {"config", "inputs_embeds"} <= names else None


def _read(fn) -> _Read:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0]
    if body.body and isinstance(body.body[0], ast.Expr) and isinstance(body.body[0].value, ast.Constant):
        body.body = body.body[1:]                                   # the docstring
    out = _Read(ast.unparse(body) + "\n", set(), [], {}, {})
    for node in ast.walk(body):
        if isinstance(node, ast.Attribute) and _is_self(node.value):
            out.reads.add(node.attr)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                _is_self(node.value.value) and node.value.attr == "config":
            out.reads.add(f"config.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value):
            out.calls.setdefault(node.func.attr, []).append(node.lineno)
        if isinstance(node, (ast.For, ast.AsyncFor)):
            for sub in ast.walk(node.iter):
                if isinstance(sub, ast.Attribute) and _is_self(sub.value):
                    out.loops.setdefault(sub.attr, (node.lineno, node.end_lineno))
        names = _mask_call(node)
        if names is not None:
            out.masks.append(names)
    # reading self.config.X also reads self.config: only the X is of interest
    out.reads -= {"config"} if any(r.startswith("config.") for r in out.reads) else set()
    return out


def _check_order(qual: str, read: _Read, blocks: str, before: Sequence[str], after: Sequence[str], fail) -> None:
    """The parts the first stage runs are called before the loop over the blocks, the final ones after it
    (NanoChat's forward also calls its final norm before its blocks: that is not the recipe's forward)."""
    if blocks not in read.loops:
        fail(f"{qual} has no loop over self.{blocks}, its blocks, so the order of its parts is not known")
    start, end = read.loops[blocks]
    for name in before:
        if any(line >= start for line in read.calls.get(name, ())):
            fail(f"{qual} calls self.{name} in or after the loop over its blocks; the inferred recipe calls it "
                 f"once, before them")
    for name in after:
        lines = read.calls.get(name, ())
        if len(lines) > 1 or any(line <= end for line in lines):
            fail(f"{qual} calls self.{name} {'more than once' if len(lines) > 1 else 'before its blocks'}; the "
                 f"inferred recipe calls it once, after its blocks (the final norm)")


def read_forwards(model: nn.Module, base: nn.Module, fail: Callable[[str], None], blocks: str = "",
                  before: Sequence[str] = (), after: Sequence[str] = ()) -> Forwards:
    """The extras of ``model``'s forward and of its base model ``base``'s (the same module for a model
    without one), each checked against the source (their children are the parts :mod:`.infer_recipe` has
    placed, or refused). In the base model's forward, ``before`` (children's names) must be called before
    the loop over ``blocks``, ``after`` once after it. ``fail(what)`` raises."""
    out = Forwards()
    owners = [({"head"} if base is not model else {"head", "embed"}, type(model).forward, model)]
    if base is not model:
        owners.append(({"embed"}, type(base).forward, base))
    mask_calls: List[Set[str]] = []
    for wheres, fn, owner in owners:
        qual = f"{type(owner).__name__}.forward"
        try:
            read = _read(fn)
        except (OSError, TypeError, SyntaxError) as exc:
            fail(f"the source of {qual} cannot be read ({exc}), so what it computes around its parts is not known")
        if owner is base and blocks:
            _check_order(qual, read, blocks, before, after, fail)
        mask_calls += read.masks
        known = set(BOOKKEEPING) | {n for n, _ in owner.named_children()}
        for first_read in dict.fromkeys(e.reads[0] for e in EXTRAS if e.where in wheres):
            if first_read not in read.reads:
                continue
            options = [e for e in EXTRAS if e.where in wheres and e.reads[0] == first_read]
            extra = next((e for e in options if re.search(e.pattern, read.text)), None)
            if extra is None:
                fail(f"{qual} reads self.{first_read} in a way the inferred recipe does not reproduce (it knows "
                     f"{' or '.join(repr(e.pattern) for e in options)}, in parallel_layers/families/infer_forward.py)")
            why = extra.refuse_if(owner) if extra.refuse_if else None
            if why:
                fail(why)
            known |= set(extra.reads)
            if extra is ALIBI:
                out.alibi = bool(owner.use_alibi)
            elif extra.apply is not None:
                (out.embed if extra.where == "embed" else out.head).append(extra)
        unknown = sorted(read.reads - known)
        if unknown:
            fail(f"{qual} reads {', '.join('self.' + u for u in unknown)}, which the inferred recipe does not "
                 f"reproduce (it computes the parts, the masks, positions and rotary tables, and the extras of "
                 f"parallel_layers/families/infer_forward.py)")
    if not mask_calls:
        fail(f"{type(base).__name__}.forward builds no attention mask with transformers.masking_utils "
             f"(create_causal_mask(config=..., inputs_embeds=...)), the masks the inferred context builds")
    odd = sorted(set().union(*mask_calls) - MASK_KEYWORDS)
    if odd:
        fail(f"{type(base).__name__}.forward builds its masks with {odd}, which the inferred context does not pass")
    out.mask_position_ids = any("position_ids" in m for m in mask_calls)
    if all("allow_is_causal_skip" in m for m in mask_calls):
        out.mask_options["allow_is_causal_skip"] = False
    return out


def alibi_context(model: nn.Module, base: nn.Module, hidden: torch.Tensor, attention_mask, causal_mask):
    """Falcon's ALiBi, as ``FalconModel.forward`` builds it: ``(alibi, causal_mask)``, the bias of every head
    ``[b, heads, 1, n]`` and the causal mask ``[b, heads, n, n]`` that holds it (scaled by 1/sqrt(head_dim));
    the blocks take this tensor-parallel rank's heads (:func:`local_heads`)."""
    build = sys.modules[type(base).__module__].build_alibi_tensor
    batch, seq = hidden.shape[:2]
    mask = torch.ones((batch, seq), device=hidden.device, dtype=torch.long) if attention_mask is None \
        else attention_mask
    alibi = build(mask, base.num_heads, dtype=hidden.dtype)
    if causal_mask is not None and causal_mask.ndim == 4:
        min_dtype = torch.finfo(hidden.dtype).min
        if causal_mask.dtype == torch.bool:
            causal_mask = torch.where(causal_mask, torch.full((), 0.0, device=causal_mask.device, dtype=hidden.dtype),
                                      min_dtype)
        alibi = alibi.reshape(batch, -1, *alibi.shape[1:])
        causal_mask = torch.masked_fill(alibi / math.sqrt(model.config.hidden_size // base.num_heads),
                                        causal_mask < -1, min_dtype)
    return alibi, causal_mask


def tp_slot(block: nn.Module) -> Tuple[int, int]:
    """(rank, size) of the tensor-parallel group ``block``'s layers are split over ((0, 1) when dense)."""
    for m in block.modules():
        size = getattr(m, "tp_size", None)
        if isinstance(size, int) and size > 1:
            return int(m.tp_rank), size
    return 0, 1


def local_heads(t: Optional[torch.Tensor], heads: int, block: nn.Module) -> Optional[torch.Tensor]:
    """``t`` ``[b, heads, ...]`` cut to the heads of this tensor-parallel rank (a column-parallel fused
    ``[q|k|v]``-per-head projection gives rank r heads ``r*heads/tp .. (r+1)*heads/tp - 1``); ``t`` itself
    when dense or when its dim 1 is not ``heads``."""
    rank, size = tp_slot(block)
    if t is None or size == 1 or t.ndim < 2 or t.shape[1] != heads:
        return t
    per = heads // size
    return t[:, rank * per:(rank + 1) * per]


__all__ = ["EXTRAS", "BOOKKEEPING", "Forwards", "read_forwards", "alibi_context", "local_heads", "tp_slot"]
