"""Recipes inferred from the model itself: what :func:`~.registry.recipe_for` returns for a class that has
no shipped recipe.

**Hugging Face decoders** (a ``PreTrainedModel`` with an LM head: ``Phi3ForCausalLM``,
``GPTNeoXForCausalLM``, ``GemmaForCausalLM``, ...) built the usual way: a base model holding the token
embedding, a ``ModuleList`` of decoder layers and a final norm, and the LM head beside it. Read off the
structure and the config:

- blocks: the ``nn.ModuleList``/``nn.Sequential`` of one class holding most parameters (``config.num_hidden_layers``
  long where the config says so);
- first stage: the token embedding (``get_input_embeddings()``, its own forward: Gemma's sqrt(hidden)
  scale included), a learned position embedding (an ``nn.Embedding`` of ``max_position_embeddings``
  rows, added) and the base model's dropout, in that order; last stage: the final norm, then
  ``get_output_embeddings()``; every stage: the rotary embedding (``shared``);
- context: position ids (``arange`` unless given), the causal mask of ``transformers.masking_utils`` (a
  sliding-window mask where the model uses one; one per ``config.layer_types`` kind, each block taking
  its kind's, read off the block: its ``attention_type`` or its attention's ``layer_type`` / ``layer_idx``)
  and the rotary ``(cos, sin)`` (one per kind where the rotary embedding takes a ``layer_type``: Gemma 3's
  local and global tables); each block gets the ones its forward names (and any key a wrapper adds to
  the context, as context parallelism does);
- what the model's forwards compute between its parts (:mod:`.infer_forward`, checked against their
  source: Granite's embedding multiplier and logit scaling, Cohere's logit scale, Gemma 2/3's final
  soft-capping, Starcoder2's embedding dropout, Falcon's ALiBi); anything else they read is refused;
- the tensor-parallel plan: :func:`~.infer_plan.infer_tp_plan` (fused sections, local head counts).

**Your own model**: a module whose blocks sit in one ``nn.ModuleList`` or ``nn.Sequential`` attribute
and whose forward runs its children in the order they were registered: the children before the blocks
are the embedding (run in order on the input ids), the blocks map a tensor to a tensor, the children
after are the head (run in order). No masks or positions reach the blocks: write a ``Recipe`` for that.

What the inference cannot place (a module it does not know, a config option it does not reproduce)
raises :class:`InferenceError` naming the part and the ``Recipe`` to write (docs/custom_recipe.md).
"""
from __future__ import annotations

import inspect
import sys
import weakref
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

from .infer_forward import alibi_context, local_heads, read_forwards
from .infer_plan import infer_tp_plan
from .recipe import Recipe, first_output, get_module
from .recipe import positions as _positions

DOC = "docs/custom_recipe.md"
SKETCH = """Recipe(blocks="model.layers", first=["model.embed_tokens"], last=["model.norm", "lm_head"],
       shared=["model.rotary_emb"],
       embed=lambda model, ids, **side: model.model.embed_tokens(ids),
       context=my_context,      # (model, hidden, **side) -> what each block needs: mask, positions, rope
       block=lambda block, h, ctx: block(h, **ctx),
       head=lambda model, h: model.lm_head(model.model.norm(h)),
       tp_plan=lambda model: {...})   # optional: the parallelize plan
Parallel3D(model, mesh, recipe=recipe)"""
# config options that change the forward in ways the inferred recipe does not reproduce
UNSUPPORTED_CONFIG = ("output_multiplier_scale", "scale_emb")
# config options it reproduces where the model's forward applies them as infer_forward knows (else refused
# unless neutral): option -> (what the forward reads, its neutral values)
CONFIG_EXTRAS = {"final_logit_softcapping": ("config.final_logit_softcapping", (None,)),
                 "logits_scaling": ("config.logits_scaling", (None, 1)), "logit_scale": ("logit_scale", (None, 1)),
                 "embedding_multiplier": ("embedding_multiplier", (None, 1))}
MASK_KINDS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}
SIDE_FOR_BLOCKS = ("attention_mask", "position_ids", "position_embeddings")


class InferenceError(ValueError):
    """No recipe could be inferred: names the part and shows the recipe to write."""


def _fail(model: nn.Module, what: str) -> None:
    raise InferenceError(f"recipe_for: no recipe for {type(model).__name__} and none could be inferred: {what}. "
                         f"Pass recipe=Recipe(...) naming its parts (the complete example, with the contract of "
                         f"its context, is in {DOC}):\n{SKETCH}")


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_blocks(model: nn.Module) -> Tuple[str, nn.Module]:
    """The dotted name and module of ``model``'s block container (see the module docstring)."""
    found = []
    for name, m in model.named_modules():
        if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0 and len({type(c) for c in m}) == 1 \
                and _params(m) > 0 and not isinstance(m[0], (nn.Linear, nn.Embedding)):
            found.append((name, m))
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and any(len(m) == layers for _, m in found):
        found = [(n, m) for n, m in found if len(m) == layers]
    if not found:
        why = ("it is an nn.Sequential whose blocks are not grouped: nest them, "
               "nn.Sequential(embed, nn.Sequential(*blocks), norm, head)") if isinstance(model, nn.Sequential) else \
            "no nn.ModuleList or nn.Sequential of blocks of one class holds its blocks"
        _fail(model, why)
    return max(found, key=lambda nm: _params(nm[1]))


def _names(model: nn.Module) -> Dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def _child(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def block_kind(block: nn.Module, layer_types) -> Optional[str]:
    """The attention kind of ``block`` (``"full_attention"``, ``"sliding_attention"``): its
    ``attention_type``, else its attention's ``attention_type`` / ``layer_type``, else
    ``config.layer_types[layer_idx]`` of a submodule's ``layer_idx``; None if none says."""
    for attr in ("attention_type", "layer_type"):
        for m in block.modules():
            kind = getattr(m, attr, None)
            if isinstance(kind, str):
                return kind
    for m in block.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and layer_types and 0 <= idx < len(layer_types):
            return layer_types[idx]
    return None


def _mask_kinds(model: nn.Module, base: nn.Module, blocks: nn.Module) -> List[str]:
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = sorted(set(layer_types))
        unknown = [k for k in kinds if k not in MASK_KINDS]
        if unknown:
            _fail(model, f"config.layer_types holds {unknown}, attention kinds whose masks it does not know "
                         f"(known: {sorted(MASK_KINDS)})")
        if len(kinds) > 1:
            found = [block_kind(b, layer_types) for b in blocks]
            if found != list(layer_types)[:len(blocks)] or len(blocks) != len(layer_types):
                _fail(model, f"config.layer_types mixes {kinds} but its blocks do not say which kind each is "
                             f"(read off each block's attention_type, or its attention's layer_type or layer_idx: "
                             f"{found}, config.layer_types: {list(layer_types)})")
        return kinds
    source = inspect.getsource(sys.modules[type(base).__module__])
    if getattr(config, "sliding_window", None) is not None and MASK_KINDS["sliding_attention"] in source:
        return ["sliding_attention"]
    return ["full_attention"]


def _place_base_children(model: nn.Module, base_name: str, base: nn.Module, placed):
    """(positions, dropouts, norm, rotary) names among the base model's children (``placed``: the
    blocks', token embedding's and head's names, already placed)."""
    config = model.config
    max_pos = getattr(config, "max_position_embeddings", None)
    positions = norm = rotary = None
    dropouts = []
    after_blocks = False
    for name, child in base.named_children():
        full = _child(base_name, name)
        after_blocks = after_blocks or full == placed[0]
        if full in placed:
            continue
        kind = type(child).__name__
        if isinstance(child, nn.Embedding) and child.num_embeddings == max_pos and positions is None:
            positions = full
        elif isinstance(child, nn.Dropout):
            dropouts.append(full)
        elif "Rotary" in kind and _params(child) == 0 and rotary is None:
            rotary = full
        elif ("Norm" in kind or isinstance(child, nn.LayerNorm)) and norm is None and after_blocks:
            norm = full
        else:
            _fail(model, f"it cannot place {full!r} ({kind}) of the base model: not the token embedding, a "
                         f"learned position embedding, a dropout, the rotary embedding or the one final norm")
    if norm is None:
        _fail(model, f"it found no final norm among the children of {base_name or 'the model'!r}")
    return positions, dropouts, norm, rotary


def infer_hf_decoder(model: nn.Module) -> Recipe:
    """The recipe of a Hugging Face decoder (see the module docstring)."""
    config = model.config
    for attr in UNSUPPORTED_CONFIG:
        value = getattr(config, attr, None)
        if value is not None and value != 1:
            _fail(model, f"config.{attr}={value} changes the forward in a way the inferred recipe does not reproduce")
    blocks_name, blocks = find_blocks(model)
    base_name = blocks_name.rpartition(".")[0]
    base = get_module(model, base_name) if base_name else model
    names = _names(model)
    try:
        tok, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (NotImplementedError, AttributeError) as exc:
        _fail(model, f"get_input_embeddings()/get_output_embeddings() failed ({exc})")
    tok_name = names.get(id(tok)) if tok is not None else None
    if tok_name is None or tok_name.rpartition(".")[0] != base_name:
        _fail(model, f"its token embedding (get_input_embeddings()) is not a child of {base_name or 'the model'!r}, "
                     f"beside the blocks {blocks_name!r}")
    head_name = names.get(id(head)) if head is not None else None
    if head_name is None or "." in head_name:
        _fail(model, "it has no LM head (get_output_embeddings()) beside the base model: a *ForCausalLM is "
                     "expected")
    if base_name:
        for name, child in model.named_children():
            if name not in (base_name, head_name):
                _fail(model, f"it cannot place {name!r} ({type(child).__name__}) beside the base model "
                             f"{base_name!r} and the head {head_name!r}")
    positions, dropouts, norm, rotary = _place_base_children(model, base_name, base,
                                                             (blocks_name, tok_name, head_name))
    leaf = lambda name: name.rpartition(".")[2]                            # noqa: E731
    fwd = read_forwards(model, base, lambda what: _fail(model, what), blocks=leaf(blocks_name),
                        before=[leaf(n) for n in (tok_name, positions, *dropouts) if n],
                        after=[leaf(norm)] + ([head_name] if base is model else []))
    found = {r for extra in fwd.embed + fwd.head for r in extra.reads}
    for attr, (read, neutral) in CONFIG_EXTRAS.items():
        value = getattr(config, attr, None)
        if value not in neutral and read not in found:
            _fail(model, f"config.{attr}={value} changes the forward in a way the inferred recipe does not reproduce "
                         f"(its forward does not apply it as parallel_layers/families/infer_forward.py knows)")
    kinds = _mask_kinds(model, base, blocks)
    layer_types = getattr(config, "layer_types", None)
    if fwd.alibi and len(kinds) > 1:
        _fail(model, f"it has ALiBi and attention kinds {kinds}: ALiBi is folded into one causal mask only")
    per_kind_rotary = rotary is not None and "layer_type" in inspect.signature(
        type(get_module(model, rotary)).forward).parameters
    sides = SIDE_FOR_BLOCKS + (("alibi",) if fwd.alibi is not None else ())
    params = list(inspect.signature(type(blocks[0]).forward).parameters.values())[2:]   # after self, hidden
    needed = [p.name for p in params if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in sides]
    if needed:
        _fail(model, f"its blocks ({type(blocks[0]).__name__}) need {needed}, which the inferred context does not "
                     f"build (it gives {list(sides)})")
    accepted: Dict[type, Tuple[str, ...]] = {}
    block_kinds: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
    early = [e for e in fwd.embed if not e.after_positions]
    late = [e for e in fwd.embed if e.after_positions]
    mask_kwargs = dict(fwd.mask_options)
    heads = getattr(base, "num_heads", None) or config.num_attention_heads       # ALiBi's, all of them

    def embed(model, ids, attention_mask=None, position_ids=None):
        h = get_module(model, tok_name)(ids)
        base = get_module(model, base_name) if base_name else model
        for extra in early:
            h = extra.apply(base, h)
        if positions is not None:
            h = h + get_module(model, positions)(_positions(h, position_ids))
        for name in dropouts:
            h = get_module(model, name)(h)
        for extra in late:
            h = extra.apply(base, h)
        return h

    def context(model, hidden, attention_mask=None, position_ids=None):
        from transformers import masking_utils
        position_ids = _positions(hidden, position_ids)
        extra = {"position_ids": position_ids} if fwd.mask_position_ids else {}
        masks = {kind: getattr(masking_utils, MASK_KINDS[kind])(
            config=model.config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None,
            **extra, **mask_kwargs) for kind in kinds}
        ctx = {"position_ids": position_ids}
        if fwd.alibi is not None:
            ctx["alibi"] = None
            if fwd.alibi:
                base = get_module(model, base_name) if base_name else model
                ctx["alibi"], masks[kinds[0]] = alibi_context(model, base, hidden, attention_mask, masks[kinds[0]])
        ctx["attention_mask"] = masks if len(kinds) > 1 else masks[kinds[0]]
        if rotary is not None:
            rot = get_module(model, rotary)
            ctx["position_embeddings"] = ({kind: rot(hidden, position_ids, kind) for kind in kinds} if per_kind_rotary
                                          else rot(hidden, position_ids))
        return ctx

    def kind_of(block):
        if block not in block_kinds:
            block_kinds[block] = block_kind(block, layer_types) or kinds[0]
        return block_kinds[block]

    def block(block, h, ctx):
        # the side inputs its forward names; keys a wrapper added to the context (context parallelism's
        # cp_context) go through as they are
        cls = type(block)
        if cls not in accepted:
            params = inspect.signature(cls.forward).parameters
            accepted[cls] = tuple(k for k in sides if k in params)
        kwargs = {k: v for k, v in ctx.items() if k in accepted[cls] or k not in sides}
        for key in ("attention_mask", "position_embeddings"):       # one per attention kind
            if isinstance(kwargs.get(key), dict):
                kwargs[key] = kwargs[key][kind_of(block)]
        if fwd.alibi:                                  # ALiBi of every head: this tensor-parallel rank's heads
            kwargs["alibi"] = local_heads(kwargs.get("alibi"), heads, block)
            kwargs["attention_mask"] = local_heads(kwargs.get("attention_mask"), heads, block)
        return first_output(block(h, **kwargs))

    def head(model, h):
        logits = get_module(model, head_name)(get_module(model, norm)(h))
        for extra in fwd.head:
            logits = extra.apply(model, logits)
        return logits

    first = (tok_name,) + ((positions,) if positions else ()) + tuple(dropouts)
    return Recipe(blocks=blocks_name, first=first, last=(norm, head_name), shared=(rotary,) if rotary else (),
                  embed=embed, head=head, context=context, block=block,
                  tp_plan=lambda model: infer_tp_plan(model, blocks_name, tok_name, head_name))


def _run(names):
    def run(model, h):
        for name in names:
            h = get_module(model, name)(h)
        return h
    return run


def infer_sequential(model: nn.Module) -> Recipe:
    """The recipe of a model of your own whose children run in registration order (module docstring)."""
    blocks_name, _ = find_blocks(model)
    if "." in blocks_name:
        _fail(model, f"its blocks {blocks_name!r} are not a direct child of the model, so the order of the parts "
                     f"around them is not known")
    children = [n for n, _ in model.named_children()]
    at = children.index(blocks_name)
    first, last = tuple(children[:at]), tuple(children[at + 1:])
    if not first or not last:
        _fail(model, f"no module is registered {'before' if not first else 'after'} its blocks {blocks_name!r} "
                     f"(children in order: {children}), so there is no embedding or no head")
    embed_run, head_run = _run(first), _run(last)
    tok = first[0] if isinstance(get_module(model, first[0]), nn.Embedding) else None
    return Recipe(blocks=blocks_name, first=first, last=last,
                  embed=lambda model, ids: embed_run(model, ids), head=head_run,
                  context=lambda model, h: {}, block=lambda block, h, ctx: block(h),
                  tp_plan=lambda model: infer_tp_plan(model, blocks_name, tok, last[-1]))


def infer_recipe(model: nn.Module) -> Recipe:
    """A recipe for ``model`` read off its structure (Hugging Face decoders, or a model of your own whose
    children run in order), or :class:`InferenceError` naming what could not be placed."""
    if getattr(model, "config", None) is not None and hasattr(model, "get_input_embeddings"):
        return infer_hf_decoder(model)
    return infer_sequential(model)


__all__ = ["infer_recipe", "infer_hf_decoder", "infer_sequential", "find_blocks", "InferenceError"]
