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
