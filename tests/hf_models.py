"""Small Hugging Face models for the parity tests (random weights from one seed, no download), the loss
the tests hand to the pipeline, and the relative error the parity checks use."""
import os

import torch
import torch.nn.functional as F

VOCAB = 64


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def hf_model(kind: str, tie: bool, dropout: float = 0.0, layers: int = 4, init_std: float = 0.02):
    """``kind``: ``llama`` (GQA: 4 heads, 2 kv heads) or ``gpt2``; the same weights on every call
    (``init_std``: the config's ``initializer_range``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                          tie_word_embeddings=tie, attention_dropout=dropout, initializer_range=init_std)
        return LlamaForCausalLM(cfg)
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=tie,
                     initializer_range=init_std)
    return GPT2LMHeadModel(cfg)


def token_batches(steps: int, batch: int, seq: int, mask: bool, seed: int = 7):
    """``steps`` of ``(ids, targets, attention_mask or None)``; the mask pads every other sequence on the left."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        tgt = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        am = torch.ones(batch, seq, dtype=torch.long)
        if mask:
            am[1::2, :3] = 0
        out.append((idx, tgt, am if mask else None))
    return out


def rel_err(name, got, want):
    """``|got - want| / |want|``; GPT-2's key bias compares without its k section: its exact gradient is
    zero (softmax ignores a shift shared by all keys), so Adam turns rounding noise in it into lr-sized
    steps."""
    if name.endswith("attn.c_attn.bias"):
        d = got.numel() // 3
        keep = torch.cat([torch.arange(d), torch.arange(2 * d, 3 * d)])
        got, want = got[keep], want[keep]
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
