"""The planner's FP8 training option (issue 49 part 4): FP8 GEMMs at the profile's fp8 rate, the casts'
bytes, the FP8 copies saved for backward against what an ``FP8Linear`` really keeps on CPU, and the refusal of
a profile without FP8 tensor cores. The model's formulas are in ``parallel_layers/planner/fp8.py``."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from parallel_layers.composition.layout import Layout
from parallel_layers.fp8 import FP8Linear, FP8Recipe
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.planner import BUILTIN, Link, Profile, Request, plan, predict
from parallel_layers.planner.fp8 import FP8Gemm, cast_bytes, saved_bytes
from parallel_layers.planner.measure import live_tensor_bytes
from parallel_layers.planner.model import probe_layout

RECIPES = ["tensor", "delayed", "row", "block"]
BIG = GPTConfig(vocab_size=1024, n_layer=2, n_head=16, d_model=2048, max_seq_len=2048)   # GEMM-dominated


def _req(model=BIG, **kw):
    return Request(model, world=1, global_batch=8, seq_len=2048, memory_bytes=1e12, precision="bf16", **kw)


def test_fp8_step_is_faster_than_bf16_on_an_h100_at_a_gemm_dominated_shape():
    cache: dict = {}
    lay = Layout(zero=1)
    bf16 = predict(_req(), lay, BUILTIN["h100"], cache)
    for recipe in RECIPES:
        fp8 = predict(_req(fp8=True, fp8_recipe=recipe), lay, BUILTIN["h100"], cache)
        # the H200's measured rates at these shapes: FP8 GEMMs 1.3-1.6x bf16's, less the casts and attention
        assert fp8.step_s < 0.95 * bf16.step_s, (recipe, fp8.step_s, bf16.step_s)
        # parameters, gradients and optimizer state unchanged (fp32 master weights, the weight in the model dtype)
        for term in ("parameters", "gradients", "optimizer"):
            assert fp8.memory[0][term] == bf16.memory[0][term]
    # the converted Linears: every one of the blocks (qkv, proj, fc, fc2), not the tied head
    gemms = probe_layout(_req(fp8=True), lay, cache)[0].chunks[0].fp8.gemms
    assert [g.name.split(".")[-1] for g in gemms] == ["qkv", "proj", "fc", "fc2"] * 2
    assert all(g.m == 8 * 2048 for g in gemms)


def test_cast_bytes_are_the_formula():
    """M K N = 64 32 16, bf16 input and weight: read the tensor (twice under current scaling: amax, cast; once
    delayed), write 1 byte an element, and the transposed copy where the other GEMM wants it."""
    g = FP8Gemm("x", 64, 32, 16, x_size=2, w_size=2)
    mk, nk, mn = 64 * 32, 16 * 32, 64 * 16
    # per tensor current: input 2 reads, data + data_t; weight likewise; gradient 2 reads, data + data_t
    assert cast_bytes(g, "tensor") == (mk * (4 + 2) + nk * (4 + 2), mn * (4 + 2))
    assert cast_bytes(g, "delayed") == (mk * (2 + 2) + nk * (2 + 2), mn * (2 + 2))
    # row / block: no transposed copies; the backward transposes the FP8 weight, gradient and input
    for recipe in ("row", "block"):
        assert cast_bytes(g, recipe) == (mk * 5 + nk * 5, mn * 5 + 2 * nk + 2 * mn + 2 * mk)
    # compiled: the input's and the gradient's casts fused into the kernels that make them (their FP8 data and
    # transposed copy, 2 bytes, instead of the bf16 tensor the fused tally charged: nothing more); the weight's
    assert cast_bytes(g, "tensor", fused=True) == (nk * (4 + 2), 0)
    assert cast_bytes(g, "delayed", fused=True) == (nk * (2 + 2), 0)
    assert cast_bytes(g, "row", fused=True) == (nk * 5, 2 * nk + 2 * mn + 2 * mk)
    # an input that needs no gradient: the weight's transposed copy is not written, nor the dgrad GEMM run
    g2 = dataclasses.replace(g, dgrad=False)
    assert cast_bytes(g2, "tensor") == (mk * 6 + nk * 5, mn * 6)
    assert g.flops_f == 2 * 64 * 32 * 16 and g.flops_b == 2 * g.flops_f and g2.flops_b == g.flops_f


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_saved_bytes_are_what_fp8linear_keeps_on_cpu(recipe, dtype):
    """The bytes alive after an FP8Linear forward, less its output, are the planner's saved bytes exactly
    (the FP8 copies live on the autograd ctx, not in saved_tensors: counted from every live tensor)."""
    M, K, N = 256, 256, 128
    torch.manual_seed(0)
    layer = FP8Linear(K, N, recipe=FP8Recipe(scaling=recipe), dtype=dtype)
    x = torch.randn(M, K, dtype=dtype, requires_grad=True)
    before = live_tensor_bytes()
    y = layer(x)
    kept = live_tensor_bytes() - before - y.numel() * y.element_size()
    g = FP8Gemm("l", M, K, N, x.element_size(), layer.weight.element_size())
    assert kept == saved_bytes(g, recipe), (kept, saved_bytes(g, recipe))
    y.sum().backward()
    del y
    # the backward drops the FP8 copies: what stays is at most the gradients
    assert live_tensor_bytes() - before <= x.grad.nbytes + layer.weight.grad.nbytes + layer.bias.grad.nbytes


def test_fp8_frees_the_inputs_only_the_linears_kept():
    """Without checkpointing the high-precision inputs only Linears keep are freed (LayerNorm outputs, the
    MLP's activation), not the attention's output (SDPA keeps it too); with checkpointing nothing was kept."""
    small = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=64)
    req = Request(small, world=1, global_batch=2, seq_len=64, memory_bytes=1e12, precision="bf16", fp8=True)
    acct = probe_layout(req, Layout(zero=1))[0].chunks[0].fp8
    tokens, d = 2 * 64, 64
    assert acct.freed == 2 * tokens * (d + d + 4 * d) * 2        # 2 blocks: LN1 out, LN2 out, gelu out, bf16
    assert probe_layout(req, Layout(zero=1, checkpoint=True))[0].chunks[0].fp8.freed == 0


def test_a_profile_without_fp8_is_refused_with_its_name_and_the_fix(tmp_path):
    cpu = Profile(name="this CPU (calibrated)", flops={"fp32": 1e11}, peak_flops={"fp32": 1e11}, mem_bw=1e10,
                  intra={"*": Link(1e-5, 1e-9)}, inter={"*": Link(1e-5, 1e-9)}, measured=True)
    small = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=64)
    req = Request(small, world=1, global_batch=2, seq_len=64, memory_bytes=1e12, precision="bf16", fp8=True)
    for prof in (cpu, BUILTIN["a100"]):
        with pytest.raises(ValueError, match=rf"{re.escape(prof.name)}.*no fp8 matmul rate.*h100 or h200"):
            plan(req, prof, [(Layout(zero=1), None)])
    path = tmp_path / "cpu.json"
    cpu.save(str(path))
    from parallel_layers.planner.cli import main
    with pytest.raises(SystemExit, match="no fp8 matmul rate"):
        main(["--gpt", "2,64,4,256", "--world", "1", "--seq-len", "64", "--global-batch", "2", "--fp8",
              "--profile", str(path)])
    with pytest.raises(ValueError, match="fp8_recipe"):
        Request(small, world=1, global_batch=2, seq_len=64, memory_bytes=1e12, fp8=True, fp8_recipe="mx")


def test_fp8_gather_quarters_zero3_weight_gather_bytes_of_converted_weights():
    """ZeRO-3's gather of the FP8 layers' weights at 1 byte an element (an option apart from the GEMMs)."""
    small = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=64)
    base = Request(small, world=2, global_batch=4, seq_len=64, memory_bytes=1e12, precision="bf16", fp8=True)
    lay, cache = Layout(dp=2, zero=3), {}
    plain = predict(base, lay, BUILTIN["h100"], cache)
    gathered = predict(dataclasses.replace(base, fp8_gather=True), lay, BUILTIN["h100"], cache)
    assert 0 < gathered.time_terms["zero3_gather"] < plain.time_terms["zero3_gather"]
    assert gathered.time_terms["pipeline"] == plain.time_terms["pipeline"]
