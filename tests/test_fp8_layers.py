"""FP8 layers: FP8Linear against nn.Linear (FP8 tolerance), and the tensor-parallel FP8 MLP against the
one-process FP8 MLP on 2 gloo ranks (same scaling decisions: identical amaxes; outputs and gradients equal up to
float32 summation order, because a row-parallel GEMM sums its partial products across ranks).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers.fp8 import FP8ColumnParallelLinear, FP8Linear, FP8Recipe, FP8RowParallelLinear
from parallel_layers.fp8 import linear as fp8_linear
from parallel_layers.tensor_parallel.layers import allreduce_sequence_parallel_grads
from parallel_layers.testing import cached_mesh

RECIPES = ["tensor", "delayed", "row", "block"]
# FP8 E4M3 keeps 3 mantissa bits (relative rounding up to 2^-4); a product of two quantized operands summed over
# K terms lands within a few percent of the float32 result. E5M2 gradients keep 2 bits.
FP8_REL = 0.08
# TP vs one process: the same FP8 operands, summed in another order across ranks (float32 rounding).
TP_REL = 1e-5


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", RECIPES)
def test_fp8_linear_is_close_to_linear(scaling, dtype):
    torch.manual_seed(0)
    dense = nn.Linear(256, 128, dtype=dtype)
    layer = FP8Linear.from_linear(copy.deepcopy(dense), recipe=FP8Recipe(scaling))
    x = torch.randn(4, 8, 256, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(4, 8, 128, dtype=dtype)
    for _ in range(3):  # delayed scaling: the history fills in
        y = layer(x)
        y.backward(g)
    dense(x2).backward(g * 3)
    assert y.dtype == dtype and layer.weight.grad.dtype == dtype
    assert rel(y, dense(x2)) < FP8_REL
    assert rel(x.grad, x2.grad) < FP8_REL and rel(layer.weight.grad, dense.weight.grad) < FP8_REL
    assert rel(layer.bias.grad, dense.bias.grad) < 1e-2  # the bias gradient is not quantized
    assert layer.fp8_nonfinite.item() == 0.0


def test_out_dtype_and_scaled_mm_path():
    torch.manual_seed(1)
    layer = FP8Linear(64, 32, bias=False, out_dtype=torch.bfloat16)
    x = torch.randn(16, 64)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    # fprop is exactly _scaled_mm on the quantized operands (per-tensor scales)
    from parallel_layers.fp8 import quantize
    qx, _ = quantize(x, "e4m3", (-1, -1))
    qw, _ = quantize(layer.weight.detach(), "e4m3", (-1, -1))
    expected = torch._scaled_mm(qx.data, qw.data.t(), scale_a=qx.scale_inv.reshape(()),
                                scale_b=qw.scale_inv.reshape(()), out_dtype=torch.bfloat16)
    assert torch.equal(y, expected)


def test_nonfinite_is_reported_and_bad_input_rejected():
    layer = FP8Linear(16, 8)
    x = torch.randn(4, 16)
    x[1, 2] = float("nan")
    layer(x)
    with pytest.raises(FloatingPointError, match="inf or NaN"):
        layer.check_finite()
    layer.reset_nonfinite()
    layer.check_finite()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer(torch.randn(4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="out_dtype"):
        FP8Linear(16, 8, out_dtype=torch.float16)


# ---------------------------------------------------------------------- tensor parallel
def _recording(original, log):
    """``original`` (linear.quantize) recording every amax it computes into ``log``, in call order."""
    def quantize(*args, **kwargs):
        q, bad = original(*args, **kwargs)
        log.append(q.amax.clone())
        return q, bad
    return quantize


def body_fp8_mlp(rank, world, scaling, sp):
    group = cached_mesh(tp=world).tp_group
    b, s, h, ffn = 2, 4, 128, 256
    recipe = FP8Recipe(scaling)
    torch.manual_seed(21)
    fc1, fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)
    ref1, ref2 = FP8Linear.from_linear(copy.deepcopy(fc1), recipe=recipe), FP8Linear.from_linear(
        copy.deepcopy(fc2), recipe=recipe)
    col = FP8ColumnParallelLinear.from_dense(copy.deepcopy(fc1), tp_group=group, sequence_parallel=sp, recipe=recipe)
    row = FP8RowParallelLinear.from_dense(copy.deepcopy(fc2), tp_group=group, sequence_parallel=sp, recipe=recipe)
    out, worst = {}, {}
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        x = (torch.randn(b, s, h, generator=gen) * (1 + step)).requires_grad_()
        g = torch.randn(b, s, h, generator=gen)
        ref_log, tp_log = [], []
        original = fp8_linear.quantize
        fp8_linear.quantize = _recording(original, ref_log)
        try:
            y = ref2(F.gelu(ref1(x)))
            y.backward(g)
            fp8_linear.quantize = _recording(original, tp_log)
            xp = (x.detach().chunk(world, 1)[rank] if sp else x.detach()).clone().requires_grad_()
            yp = row(F.gelu(col(xp)))
            yp.backward(g.chunk(world, 1)[rank] if sp else g)
        finally:
            fp8_linear.quantize = original
        allreduce_sequence_parallel_grads([row], group)
        if scaling in ("tensor", "delayed"):  # one scale per tensor: the very same amaxes
            assert len(ref_log) == len(tp_log) == 6
            for i, (a, t) in enumerate(zip(ref_log, tp_log)):
                assert torch.equal(a, t), f"step {step}: amax #{i} differs: one process {a}, tp {t}"
        y_ref = y.chunk(world, 1)[rank] if sp else y
        x_ref = x.grad.chunk(world, 1)[rank] if sp else x.grad
        d = {"out": rel(yp, y_ref), "x.grad": rel(xp.grad, x_ref),
             "fc1.weight.grad": rel(col.weight.grad, ref1.weight.grad.chunk(world, 0)[rank]),
             "fc1.bias.grad": rel(col.bias.grad, ref1.bias.grad.chunk(world, 0)[rank]),
             "fc2.weight.grad": rel(row.weight.grad, ref2.weight.grad.chunk(world, 1)[rank]),
             "fc2.bias.grad": rel(row.bias.grad, ref2.bias.grad)}
        for k, v in d.items():
            worst[k] = max(worst.get(k, 0.0), v)
        for m in (ref1, ref2, col, row):
            m.zero_grad()
    if scaling == "delayed":
        for ref, tp in ((ref1, col), (ref2, row)):
            for role in ("input", "weight", "grad"):
                assert torch.equal(ref.fp8_states[role].amax_history, tp.fp8_states[role].amax_history), role
    out["worst"] = worst
    out["nonfinite"] = float(col.fp8_nonfinite.item() + row.fp8_nonfinite.item())
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("scaling", RECIPES)
def test_fp8_tp_mlp_matches_one_process(dist_pools, scaling, sp):
    per_rank = dist_pools(2).run(body_fp8_mlp, scaling, sp)
    for rank, result in enumerate(per_rank):
        assert result["nonfinite"] == 0.0
        for what, value in result["worst"].items():
            assert value <= TP_REL, f"rank {rank}, {scaling}, sp={sp}: {what} differs by {value:.3g} (relative)"


def body_sp_gather_bytes(rank, world, scaling):
    """Bytes the forward's sequence-parallel all-gather sends: FP8 layer against the bf16 one."""
    import parallel_layers.distributed.collectives as C
    from parallel_layers.tensor_parallel.layers import ColumnParallelLinear
    group = cached_mesh(tp=world).tp_group
    b, s, h, out = 2, 8, 128, 256
    torch.manual_seed(0)
    dense = nn.Linear(h, out)
    sent = []
    original = C.all_gather_dim0

    def counting(t, *args, **kwargs):
        sent.append(t.numel() * t.element_size())
        return original(t, *args, **kwargs)
    layers = {"bf16": ColumnParallelLinear.from_dense(copy.deepcopy(dense).bfloat16(), tp_group=group,
                                                      sequence_parallel=True),
              "fp8": FP8ColumnParallelLinear.from_dense(copy.deepcopy(dense).bfloat16(), tp_group=group,
                                                        sequence_parallel=True, recipe=FP8Recipe(scaling))}
    got = {}
    for name, layer in layers.items():
        x = torch.randn(b, s // world, h).bfloat16()
        sent.clear()
        C.all_gather_dim0 = counting
        try:
            with torch.no_grad():
                layer(x)
        finally:
            C.all_gather_dim0 = original
        got[name] = list(sent)
    return got, b * (s // world) * h


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_sequence_parallel_gather_sends_fp8_bytes(dist_pools, scaling):
    """Under sequence parallelism the FP8 column-parallel layer all-gathers the FP8 bytes of its input (1 byte an
    element, plus one float32 scale per row for row-wise scaling): half of what the bf16 layer sends."""
    for got, elements in dist_pools(2).run(body_sp_gather_bytes, scaling):
        rows = elements // 128      # the rows' float32 scales travel too under row-wise scaling
        assert sorted(got["fp8"]) == sorted([elements] + ([4 * rows] if scaling == "row" else [])), got
        # the bf16 layer's gather: 2 bytes an element (plus a flag element or a shape agreement of its own)
        assert max(got["bf16"]) in (2 * elements, 2 * elements + 2), got
