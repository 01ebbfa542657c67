"""Sequence parallelism for models the package did not write (``Parallel3D(sequence_parallel=True)``,
:mod:`parallel_layers.tensor_parallel.sequence_parallel`): the plan it derives, and the error that says why a
run cannot take it. Parity with one process: ``test_3d_any_model.py`` (fp32, gloo and the NCCL rules),
``test_precision_3d.py`` (bf16) and ``test_context_parallel_3d.py`` (with cp)."""
import pytest
import torch
from hf_models import hf_model, loss_fn

from parallel_layers.families.llama import llama_plan
from parallel_layers.tensor_parallel.sequence_parallel import sequence_parallel_plan
from parallel_layers.testing import cached_mesh

pytest.importorskip("transformers")


def test_the_plan_gathers_for_the_column_projections_and_scatters_after_the_row_ones():
    plan = sequence_parallel_plan(llama_plan(None), "model.layers")
    assert plan["model.layers.*.self_attn.[qkv]_proj"] == {"style": "colwise", "input_gathered": True}
    assert plan["model.layers.*.mlp.down_proj"] == {"style": "rowwise", "sequence_parallel": True}
    assert plan["model.embed_tokens"] == "vocab"                           # outside the blocks: unchanged
    assert plan["lm_head"] == {"style": "colwise", "gather_output": True}
    with pytest.raises(ValueError, match="gathers its output inside a block"):
        sequence_parallel_plan({"model.layers.*.mlp.up_proj": {"style": "colwise", "gather_output": True}},
                               "model.layers")


def body_odd_sequence(rank, world):
    from parallel_layers import PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    p3d = Parallel3D(hf_model("llama", False), cached_mesh(1, 2, 1), loss_fn=loss_fn, sequence_parallel=True,
                     pipeline=PipelineConfig(num_microbatches=1))
    ids = torch.randint(0, 64, (2, 7))
    refused = (r"sequence length 7 \(the hidden states' tokens\) does not divide by the tensor-parallel size 2; "
               r"pad the sequence to a multiple of 2")
    with pytest.raises(ValueError, match=refused):
        p3d.train_step(ids, ids)
    return True


def test_a_sequence_that_does_not_divide_by_tp_is_refused_with_the_fix(dist_pools):
    assert all(dist_pools(2).run(body_odd_sequence))


def body_stages_pass_shards(rank, world):
    from parallel_layers import PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    model = hf_model("llama", False)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    p3d = Parallel3D(model, cached_mesh(1, 2, 2), loss_fn=loss_fn, sequence_parallel=True,
                     pipeline=PipelineConfig(num_microbatches=2))
    stage = p3d.chunks[0]
    torch.manual_seed(0)
    if stage.is_first:                    # sends its tp rank's half of the 8 tokens
        return tuple(stage(torch.randint(0, 64, (2, 8))).shape) == (2, 4, hidden)
    # takes a half, builds its masks and rotary tables for all 8 tokens, gathers them for the head
    return tuple(stage(torch.randn(2, 4, hidden)).shape) == (2, 8, vocab)


def test_pipeline_stages_pass_sequence_shards(dist_pools):
    """tp 2 x pp 2: the first stage sends each tp rank's sequence shard (not the gathered whole, as Megatron-LM
    sends it: 1/tp of the bytes, no gather at the boundary); the last stage takes a shard and returns every
    token's logits. (Parity with one process with these sends: ``test_3d_any_model.py``.)"""
    assert all(dist_pools(4).run(body_stages_pass_shards))
