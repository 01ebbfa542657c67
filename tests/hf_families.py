"""Tiny Hugging Face decoders of several families (random weights from one seed, no download) and a model
of our own with an ``nn.Sequential`` of blocks, for the tests of inferred recipes."""
import os

import torch
import torch.nn as nn

VOCAB = 128
FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gpt_neox", "gemma", "gpt2", "own")
# families whose forward does more than a Llama's around or inside its blocks (see _new_family)
NEW_FAMILIES = ("qwen3", "qwen2_sliding", "gemma2", "gemma3", "olmo2", "granite", "cohere", "cohere_qk", "falcon",
                "falcon_rope", "starcoder2", "gptj", "smollm3", "llama_tied")
# attention kinds of the Gemma 3 case: a mix of sliding and full layers (its default pattern, one full
# layer in 6, makes every layer of a 4-layer model sliding)
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")


def _common(layers):
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)


def family_model(kind: str, layers: int = 4, tie: bool = None, dtype=torch.float32, kv_heads: int = 2,
                 init_std: float = 0.02) -> nn.Module:
    """The same weights on every call. GQA (``kv_heads`` key/value heads for 4 query heads) where the family
    has it; Qwen2 with q/k/v biases; Phi-3 with fused qkv_proj and gate_up_proj; GPT-NeoX with its per-head
    fused query_key_value and parallel residual; Gemma with its scaled embedding, tied head and head_dim 8.
    The ``NEW_FAMILIES`` are described in :func:`_new_family`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as t
    torch.manual_seed(0)
    c = _common(layers)
    tied = {} if tie is None else {"tie_word_embeddings": tie}
    if kind == "own":
        model = OwnModel(layers)
    elif kind == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**c, num_key_value_heads=kv_heads, initializer_range=init_std, **tied))
    elif kind == "mistral":
        model = t.MistralForCausalLM(t.MistralConfig(**c, num_key_value_heads=kv_heads, sliding_window=8,
                                                     initializer_range=init_std, **tied))
    elif kind == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**c, num_key_value_heads=kv_heads, initializer_range=init_std, **tied))
    elif kind == "phi3":
        model = t.Phi3ForCausalLM(t.Phi3Config(**c, num_key_value_heads=kv_heads, pad_token_id=0, resid_pdrop=0.0,
                                               embd_pdrop=0.0, initializer_range=init_std, **tied))
    elif kind == "gpt_neox":
        model = t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**c, hidden_dropout=0.0, attention_dropout=0.0,
                                                     initializer_range=init_std, **tied))
    elif kind == "gemma":
        model = t.GemmaForCausalLM(t.GemmaConfig(**c, num_key_value_heads=kv_heads, head_dim=8,
                                                 initializer_range=init_std, **tied))
    elif kind == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=64,
                                               bos_token_id=None, eos_token_id=None, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0,
                                               initializer_range=init_std, **tied))
    elif kind in NEW_FAMILIES:
        model = _new_family(t, kind, c, layers, kv_heads, init_std, tied)
    else:
        raise ValueError(kind)
    if kind == "gemma":                     # its norms start at zero (weight + 1): give them something to learn
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0, 0.1)
    elif kind in NEW_FAMILIES:              # every norm's weight (zero-initialised in Gemma 2/3, ones elsewhere,
        with torch.no_grad():               # per head in Cohere's q/k norms) gets something to learn
            for m in model.modules():
                if ("Norm" in type(m).__name__ or isinstance(m, nn.LayerNorm)) and \
                        isinstance(getattr(m, "weight", None), nn.Parameter):
                    m.weight.add_(torch.randn_like(m.weight), alpha=0.1)
    return model.to(dtype)


def _new_family(t, kind, c, layers, kv_heads, init_std, tied):
    """The ``NEW_FAMILIES``, 4 query heads of head_dim 8, ``kv_heads`` key/value heads where the family has GQA:

    - qwen3: per-head q/k RMS norms (one weight of head_dim shared by the heads);
    - qwen2_sliding: ``use_sliding_window`` with window 4 from layer ``max_window_layers = layers // 2`` on
      (full, full, sliding, sliding; at 2 layers full, sliding);
    - gemma2: scaled embedding, 4 norms per block, attention and final logit soft-capping (small caps, so
      they bite), sliding (window 4) and full layers alternating, query_pre_attn_scalar 16;
    - gemma3 (``Gemma3ForCausalLM``, a ``Gemma3TextConfig``): ``GEMMA3_LAYER_TYPES`` (repeated), window 4, a local and
      a global rotary embedding (chosen by the layer's kind), q/k norms, scaled embedding;
    - olmo2: q/k RMS norms over all heads (``num_heads * head_dim`` features), norms after attention and MLP;
    - granite: embedding x4, residual x0.5 (in the blocks), attention scale 0.25, logits / 2;
    - cohere: parallel attention and MLP, logits x0.5, tied; cohere_qk: its per-head q/k LayerNorms
      (weights ``[heads, head_dim]``);
    - falcon: ALiBi, ``[q|k|v]`` per head (``query_key_value``, no multi-query), sequential attention and
      MLP, biases; falcon_rope: rotary, the new decoder architecture (``kv_heads`` groups of
      ``[q.. | k | v]``), parallel attention and MLP with two layer norms;
    - starcoder2: LayerNorms, biases, sliding window 8; gptj: partial rotary (4 of 8 dims) inside the attention,
      parallel residual, head with bias; smollm3: no rope in every 4th layer; llama_tied: tied embeddings."""
    gqa = dict(num_key_value_heads=kv_heads, initializer_range=init_std)
    if kind == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**c, **gqa, head_dim=8, **tied))
    if kind == "qwen2_sliding":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**c, **gqa, use_sliding_window=True, sliding_window=4,
                                                max_window_layers=layers // 2, **tied))
    if kind == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(**c, **gqa, head_dim=8, query_pre_attn_scalar=16, sliding_window=4,
                                                  final_logit_softcapping=2.0, attn_logit_softcapping=3.0, **tied))
    if kind == "gemma3":
        kinds = [GEMMA3_LAYER_TYPES[i % len(GEMMA3_LAYER_TYPES)] for i in range(layers)]
        return t.Gemma3ForCausalLM(t.Gemma3TextConfig(**c, **gqa, head_dim=8, query_pre_attn_scalar=16,
                                                      sliding_window=4, layer_types=kinds, **tied))
    if kind == "olmo2":
        return t.Olmo2ForCausalLM(t.Olmo2Config(**c, **gqa, **tied))
    if kind == "granite":
        return t.GraniteForCausalLM(t.GraniteConfig(**c, **gqa, embedding_multiplier=4.0, residual_multiplier=0.5,
                                                    attention_multiplier=0.25, logits_scaling=2.0, **tied))
    if kind in ("cohere", "cohere_qk"):
        return t.CohereForCausalLM(t.CohereConfig(**c, **gqa, logit_scale=0.5, use_qk_norm=kind == "cohere_qk",
                                                  **tied))
    if kind in ("falcon", "falcon_rope"):
        common = {k: v for k, v in c.items() if k != "intermediate_size"}
        arch = (dict(alibi=True, multi_query=False, parallel_attn=False, bias=True) if kind == "falcon" else
                dict(alibi=False, new_decoder_architecture=True, num_kv_heads=kv_heads, parallel_attn=True,
                     num_ln_in_parallel_attn=2, bias=False))
        return t.FalconForCausalLM(t.FalconConfig(**common, ffn_hidden_size=64, hidden_dropout=0.0,
                                                  attention_dropout=0.0, initializer_range=init_std, **arch, **tied))
    if kind == "starcoder2":
        return t.Starcoder2ForCausalLM(t.Starcoder2Config(**c, **gqa, sliding_window=8, residual_dropout=0.0,
                                                          embedding_dropout=0.0, **tied))
    if kind == "gptj":
        return t.GPTJForCausalLM(t.GPTJConfig(n_embd=32, n_layer=layers, n_head=4, rotary_dim=4, n_inner=64,
                                              vocab_size=VOCAB, n_positions=64, bos_token_id=None, eos_token_id=None,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                              initializer_range=init_std, **tied))
    if kind == "smollm3":
        return t.SmolLM3ForCausalLM(t.SmolLM3Config(**c, **gqa, pad_token_id=None, **tied))
    if kind == "llama_tied":
        return t.LlamaForCausalLM(t.LlamaConfig(**c, **gqa, tie_word_embeddings=True if tied == {} else tied[
            "tie_word_embeddings"]))
    raise ValueError(kind)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, h):
        return self.fc2(self.act(self.fc1(h)))


class OwnModel(nn.Module):
    """A model of our own: an embedding, an ``nn.Sequential`` of blocks, a norm and a head tied to the
    embedding; its forward runs its children in order."""

    def __init__(self, layers: int, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.blocks(self.embed(ids))))


def logits_of(model, ids, attention_mask=None):
    if isinstance(model, OwnModel):
        return model(ids)
    return model(input_ids=ids, attention_mask=attention_mask).logits
