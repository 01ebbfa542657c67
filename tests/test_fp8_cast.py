"""FP8 cast kernels (C++ and Triton) bit-exact against the torch reference, and the scaling recipes.

The casts are exact operations (one float32 multiply, a saturating clamp, a round-to-nearest-even conversion;
the amax is a max), so every backend must produce the reference's bytes.
"""
import importlib
import importlib.util
import sys

import pytest
import torch
from conftest import is_interpreted

from parallel_layers import _checkout
from parallel_layers.fp8 import DelayedScaling, FP8Recipe, quantize, scale_from_amax

# In a checkout whose package is installed from another tree (an editable install of a sibling checkout),
# parallel_layers.triton_kernels must still be this checkout's folder: put the checkout's finder first, unless
# the Triton kernels were already imported (from this checkout, or the test below says where).
if "parallel_layers.triton_kernels" not in sys.modules:
    sys.meta_path.insert(0, _checkout.CheckoutTritonKernels())

F = importlib.import_module("parallel_layers.ops.fp8_cast")

FORMATS = ["e4m3", "e5m2"]
BLOCKS = [None, (1, -1), (1, 128), (128, 128), (64, 32)]


def as_bytes(t):
    return t.view(torch.uint8) if t is not None and t.dtype in F.FP8_MAX else t


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b)) if a.dtype in F.FP8_MAX else \
        torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)) and torch.equal(a.isnan(), b.isnan())


def sample(shape, dtype, seed=0, specials=True):
    """Values across many binades (subnormal in FP8 up to saturating), plus inf/-inf/NaN/-0/tiny."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-10, 4, shape[-1])
    if specials:
        x.view(-1)[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e-39, -3e-41])
    return x.to(dtype)


@pytest.fixture
def fp8_target(target):
    """``target`` for the backends the FP8 casts have (no plain-CUDA kernel: Triton covers CUDA)."""
    if target[1] not in F.BACKENDS:
        pytest.skip(f"the FP8 casts have no {target[1]} kernel")
    return target


def test_triton_kernels_come_from_this_checkout():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    tk = importlib.import_module("parallel_layers.triton_kernels")
    assert hasattr(tk, "fp8_cast"), f"parallel_layers.triton_kernels is {tk.__file__}, which has no FP8 kernels"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_cast_transpose_amax_bit_exact(fp8_target, dtype, fmt, block):
    device, backend = fp8_target
    shape = (128, 256) if not is_interpreted(fp8_target) or block == (128, 128) else (64, 128)
    if block == (128, 128) and shape[0] < 128:
        shape = (128, 128)
    x = sample(shape, dtype).to(device)
    grid_amax = F.fp8_amax(x, block=block, backend="torch")
    scale, _ = scale_from_amax(torch.nan_to_num(grid_amax, nan=float("inf")), fmt)
    scale = scale * 1.5  # push some values past fp8 max: saturation
    ours = F.fp8_cast(x, scale, fmt=fmt, block=block, transpose=True, with_amax=True, backend=backend)
    ref = F.fp8_cast(x, scale, fmt=fmt, block=block, transpose=True, with_amax=True, backend="torch")
    for what, a, b in zip(("out", "out_t", "amax"), ours, ref):
        assert same(a, b), f"{what} differs from the reference ({backend}, {dtype}, {fmt}, block {block})"
    assert same(F.fp8_amax(x, block=block, backend=backend), grid_amax)
    assert torch.equal(as_bytes(ours[1]), as_bytes(ours[0]).t())


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_float32_bit_pattern_sample_converts_like_torch(fp8_target, fmt):
    """Random fp32 bit patterns (NaNs of both signs, subnormals, huge values) at scale 1."""
    device, backend = fp8_target
    n = 1 << (12 if is_interpreted(fp8_target) else 18)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), generator=torch.Generator().manual_seed(3))
    x = bits.to(torch.int32).view(torch.float32).reshape(-1, 64).to(device)
    ours = F.fp8_cast(x, 1.0, fmt=fmt, backend=backend)[0]
    ref = F.fp8_cast(x, 1.0, fmt=fmt, backend="torch")[0]
    assert torch.equal(as_bytes(ours), as_bytes(ref))


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_nan_and_zero(fp8_target, fmt):
    device, backend = fp8_target
    fmax = F.FP8_MAX[F.fp8_dtype(fmt)]
    x = torch.tensor([[1e9, -1e9, float("inf"), -float("inf"), float("nan"), 0.0, fmax, -fmax]], device=device)
    out, _, amax = F.fp8_cast(x, 1.0, fmt=fmt, with_amax=True, backend=backend)
    got = out.float()[0].tolist()
    assert got[:4] == [fmax, -fmax, fmax, -fmax] and got[5:] == [0.0, fmax, -fmax]
    assert got[4] != got[4] and amax.isnan().all()
    zeros = torch.zeros(4, 128, device=device)
    amax = F.fp8_amax(zeros, backend=backend)
    scale, bad = scale_from_amax(amax, fmt)
    assert amax.item() == 0.0 and scale.item() == 1.0 and not bad
    assert F.fp8_cast(zeros, scale, fmt=fmt, backend=backend)[0].float().abs().sum() == 0


def test_scale_rules():
    fmax = 448.0
    amax = torch.tensor([[2.0, 0.0, float("inf"), float("nan"), 1e-45]])
    scale, bad = scale_from_amax(amax, "e4m3")
    assert scale[0, 0].item() == fmax / 2 and scale[0, 1].item() == 1.0
    assert scale[0, 2].item() == 1.0 and scale[0, 3].item() == 1.0 and bad.item()
    assert torch.isfinite(scale).all() and scale[0, 4].item() == torch.finfo(torch.float32).max
    scale, bad = scale_from_amax(torch.tensor([[4.0]]), "e5m2", margin=1)
    assert scale.item() == 57344.0 / 2 / 4 and not bad


def test_delayed_scaling_history():
    d = DelayedScaling(history_len=3, fmt="e4m3")
    assert d.scale.item() == 1.0  # no history yet
    for amax, expected in [(2.0, 448 / 2), (8.0, 448 / 8), (1.0, 448 / 8), (1.0, 448 / 8), (1.0, 448.0)]:
        assert not d.update(torch.tensor(amax))
        assert d.scale.item() == expected
    before = d.state_dict()
    assert d.update(torch.tensor(float("inf"))), "a non-finite amax must be reported"
    assert torch.equal(d.amax_history, before["amax_history"]) and d.scale.item() == before["scale"].item()
    x = torch.randn(16, 32)
    q, bad = quantize(x, "e4m3", (-1, -1), state=d)
    assert not bad and q.amax.item() == x.abs().max().item() and d.amax_history[0].item() == q.amax.item()
    # cast with the scale from the history, before this amax was recorded
    assert q.scale_inv.item() == torch.reciprocal(torch.tensor(448.0)).item()


def test_quantize_reports_nan_as_inf_and_keeps_scale_finite():
    x = torch.randn(8, 16)
    x[3, 4] = float("nan")
    q, bad = quantize(x, "e4m3", (-1, -1))
    assert bad and q.amax.item() == float("inf") and q.scale_inv.item() == 1.0


def test_recipe_blocks():
    assert FP8Recipe("block").block("weight") == (128, 128) and FP8Recipe("block").block("input") == (1, 128)
    assert FP8Recipe("row").block("grad") == (1, -1) and FP8Recipe("delayed").block("weight") == (-1, -1)
    with pytest.raises(ValueError, match="scaling"):
        FP8Recipe("blockwise")
    with pytest.raises(ValueError, match="e4m3"):
        FP8Recipe(grad_format="e3m4")


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_bad_input_errors(backend):
    with pytest.raises(ValueError, match=r"fp8_cast: x has dtype torch.float16.*x.float\(\)"):
        F.fp8_cast(torch.zeros(4, 4, dtype=torch.float16), 1.0, backend=backend)
    with pytest.raises(ValueError, match=r"fp8_amax: block cols = 128 does not divide the input's 200 cols.*256"):
        F.fp8_amax(torch.zeros(4, 200), block=(1, 128), backend=backend)
    with pytest.raises(ValueError, match=r"fp8_cast: block rows = 128 does not divide the input's 96 rows"):
        F.fp8_cast(torch.zeros(96, 128), 1.0, block=(128, 128), backend=backend)
    with pytest.raises(ValueError, match=r"fp8_cast: scale has shape \(3, 1\) but the blocks form a \(4, 1\)"):
        F.fp8_cast(torch.zeros(4, 8), torch.ones(3, 1), block=(1, -1), backend=backend)
    with pytest.raises(ValueError, match="fp8_cast: format 'e2m1'"):
        F.fp8_cast(torch.zeros(4, 8), 1.0, fmt="e2m1", backend=backend)


def test_empty_input():
    out, out_t, amax = F.fp8_cast(torch.zeros(0, 8), 1.0, transpose=True, with_amax=True)
    assert out.shape == (0, 8) and out_t.shape == (8, 0) and not amax.any()
