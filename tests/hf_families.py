"""Tiny Hugging Face decoders of several families (random weights from one seed, no download) and a model
of our own with an ``nn.Sequential`` of blocks, for the tests of inferred recipes."""
import os

import torch
import torch.nn as nn

VOCAB = 128
FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gpt_neox", "gemma", "gpt2", "own")


def _common(layers):
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)


def family_model(kind: str, layers: int = 4, tie: bool = None, dtype=torch.float32, kv_heads: int = 2,
                 init_std: float = 0.02) -> nn.Module:
    """The same weights on every call. GQA (``kv_heads`` key/value heads for 4 query heads) where the family
    has it; Qwen2 with q/k/v biases; Phi-3 with fused qkv_proj and gate_up_proj; GPT-NeoX with its per-head
    fused query_key_value and parallel residual; Gemma with its scaled embedding, tied head and head_dim 8."""
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
    else:
        raise ValueError(kind)
    if kind == "gemma":                     # its norms start at zero (weight + 1): give them something to learn
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0, 0.1)
    return model.to(dtype)


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
