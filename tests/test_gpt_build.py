"""``GPTConfig.build``: what ``Parallel3D`` does with a config. With ``keep`` a rank holds only the modules its
stages run (the rest drawn, then moved to meta) and those hold exactly the one-process model's weights."""
import torch

from parallel_layers.families import recipe_for
from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.pipeline.any_model import kept_modules


def _cfg(**kw):
    return GPTConfig(**{**dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, dropout=0.0), **kw})


def test_build_keeps_only_the_named_modules_with_the_whole_models_weights():
    for tie in (True, False):
        cfg = _cfg(tie_embeddings=tie)
        torch.manual_seed(3)
        whole = GPT(cfg)
        after_whole = torch.rand(1)
        skeleton = cfg.build(seed=3, device=torch.device("meta"))
        keep = kept_modules(skeleton, recipe_for(skeleton), 1, 2)           # the last of two stages
        assert keep == {"blocks.2", "blocks.3", "ln_f", "wte" if tie else "lm_head"}
        part = cfg.build(seed=3, keep=keep.__contains__)
        assert torch.equal(torch.rand(1), after_whole)       # the generator is where the whole model leaves it
        ref = dict(whole.named_parameters())
        for name, p in part.named_parameters():
            if name.split(".")[0] in keep or ".".join(name.split(".")[:2]) in keep:
                assert not p.is_meta and torch.equal(p, ref[name]), name
            else:
                assert p.is_meta, name


def test_build_in_bf16_draws_in_fp32_and_rounds():
    cfg = _cfg()
    torch.manual_seed(0)
    ref = GPT(cfg)
    part = cfg.build(seed=0, dtype=torch.bfloat16, keep={"blocks.0"}.__contains__)
    mine, dense = dict(part.blocks[0].named_parameters()), dict(ref.blocks[0].named_parameters())
    assert mine and all(torch.equal(p, dense[n].to(torch.bfloat16)) for n, p in mine.items())
    assert all(p.is_meta for p in part.blocks[1].parameters())
