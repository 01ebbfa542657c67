"""Multi-tensor kernels (unscale+norm, cast, bucket pack/unpack) on every backend against the reference.

Writes (cast, pack, unpack, unscaled values) must be bit-identical to the reference: one float32
multiply, then one round-to-nearest-even conversion. Norms agree to float32 summation order.
"""
import pytest
import torch
from conftest import is_interpreted

from parallel_layers import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tensor_sizes(target, seed=0):
    """Sizes 0, 1, odd, not a multiple of any block, one large-ish; plus a few hundred small ones (sixty under the
    Triton interpreter, which runs each launch in Python: test_thousands_of_small_tensors covers the count)."""
    g = torch.Generator().manual_seed(seed)
    few = [0, 1, 3, 1023, 1025, 4097] + ([] if is_interpreted(target) else [300_007])
    small = torch.randint(0, 40, (60 if is_interpreted(target) else 300,), generator=g).tolist()
    return few + small


def make_tensors(sizes, dtype, device, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        shape = (n,) if i % 3 else ((n, 1) if n else (0, 3))  # some 2-D shapes: only numel matters
        out.append((torch.randn(shape, generator=g) * scale).to(dtype).to(device))
    return out


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.numel() else a,
                                              b.view(torch.uint8) if b.numel() else b)


def assert_bitwise(xs, ys, what):
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert bits_equal(x, y), f"{what}[{i}] (numel {x.numel()}, {x.dtype}) differs from the reference"


# ------------------------------------------------------------------------------ unscale + norm
@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_and_norm_matches_reference(target, dtype):
    device, backend = target
    ours = make_tensors(tensor_sizes(target), dtype, device)
    ref = [t.clone() for t in ours]
    inv = torch.full((1,), 1 / 1024, device=device)
    n_ours, inf_ours = ops.unscale_and_norm(ours, inv_scale=inv, backend=backend)
    n_ref, inf_ref = ops.unscale_and_norm(ref, inv_scale=inv, backend="torch")
    assert_bitwise(ours, ref, "unscaled tensors")
    torch.testing.assert_close(n_ours, n_ref, rtol=1e-5, atol=0)
    assert inf_ours.item() == inf_ref.item() == 0.0
    assert n_ours.device.type == device.type and n_ours.dtype == torch.float32


def test_norm_without_unscale_leaves_tensors_alone(target):
    device, backend = target
    ts = make_tensors([5, 0, 4099, 17], torch.bfloat16, device)
    before = [t.clone() for t in ts]
    norm, found = ops.unscale_and_norm(ts, backend=backend)
    assert_bitwise(ts, before, "tensors")
    expected = torch.linalg.vector_norm(torch.cat([t.float().view(-1) for t in before]))
    torch.testing.assert_close(norm[0], expected, rtol=1e-5, atol=0)
    # Scaled but not written back (clip_grad_norm_ of scaled grads).
    norm_half, _ = ops.unscale_and_norm(ts, inv_scale=0.5, unscale=False, backend=backend)
    assert_bitwise(ts, before, "tensors")
    torch.testing.assert_close(norm_half[0], expected * 0.5, rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_detects_non_finite(target, dtype, bad):
    device, backend = target
    ts = make_tensors([100, 2049, 7], dtype, device)
    ts[1][2048] = bad  # the last element, in a chunk of its own for most block sizes
    found = torch.zeros(1, device=device)
    norm, found_out = ops.unscale_and_norm(ts, inv_scale=0.5, found_inf=found, backend=backend)
    assert found_out.data_ptr() == found.data_ptr(), "found_inf must be updated in place"
    assert found.item() == 1.0
    assert not torch.isfinite(norm).all()


def test_found_inf_accumulates_and_is_never_cleared(target):
    device, backend = target
    found = torch.ones(1, device=device)
    ops.unscale_and_norm(make_tensors([10, 20], torch.float32, device), inv_scale=1.0, found_inf=found,
                         backend=backend)
    assert found.item() == 1.0


def test_overflow_from_scaling_is_detected(target):
    device, backend = target
    ts = [torch.full((33,), 3e38, device=device)]
    _, found = ops.unscale_and_norm(ts, inv_scale=4.0, backend=backend)  # 1.2e39 overflows float32
    assert found.item() == 1.0


def test_thousands_of_small_tensors(target):
    device, backend = target
    count = 500 if is_interpreted(target) else 5000
    sizes = torch.randint(0, 50, (count,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = make_tensors(sizes, torch.float32, device, seed=3)
    ref = [t.clone() for t in ours]
    n1, _ = ops.unscale_and_norm(ours, inv_scale=0.125, backend=backend)
    n2, _ = ops.unscale_and_norm(ref, inv_scale=0.125, backend="torch")
    assert_bitwise(ours, ref, "tensors")
    torch.testing.assert_close(n1, n2, rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------ cast
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                 (torch.float32, torch.float32), (torch.bfloat16, torch.float16)])
def test_cast_matches_reference(target, src_dtype, dst_dtype):
    device, backend = target
    srcs = make_tensors(tensor_sizes(target, 1), src_dtype, device, seed=1)
    for scale in (1.0, 1 / 3):
        ours = ops.multi_tensor_cast(srcs, dtype=dst_dtype, scale=scale, backend=backend)
        ref = ops.multi_tensor_cast(srcs, dtype=dst_dtype, scale=scale, backend="torch")
        assert_bitwise(ours, ref, f"cast x{scale}")


def test_cast_into_given_destinations_and_flags_fp16_overflow(target):
    device, backend = target
    srcs = [torch.tensor([1.0, 70000.0, -3.0], device=device), torch.randn(4097, device=device)]
    dsts = [torch.empty(3, dtype=torch.float16, device=device), torch.empty(4097, dtype=torch.float16, device=device)]
    found = torch.zeros(1, device=device)
    out = ops.multi_tensor_cast(srcs, dsts, found_inf=found, backend=backend)
    assert out[0].data_ptr() == dsts[0].data_ptr()
    assert found.item() == 1.0 and torch.isinf(dsts[0][1])
    found.zero_()
    ops.multi_tensor_cast(srcs[1:], dsts[1:], found_inf=found, backend=backend)
    assert found.item() == 0.0
    # A scale pushes finite values over fp16's range: detected.
    ops.multi_tensor_cast([torch.full((5,), 40000.0, device=device)], dtype=torch.float16, scale=2.0,
                          found_inf=found, backend=backend)
    assert found.item() == 1.0


# --------------------------------------------------------------------------------------- buckets
@pytest.mark.parametrize("src_dtype,bucket_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_pack_matches_reference(target, src_dtype, bucket_dtype):
    device, backend = target
    srcs = make_tensors(tensor_sizes(target, 2), src_dtype, device, seed=2)
    ours = ops.pack_bucket(srcs, dtype=bucket_dtype, scale=0.25, backend=backend)
    ref = ops.pack_bucket(srcs, dtype=bucket_dtype, scale=0.25, backend="torch")
    assert ours.numel() == sum(s.numel() for s in srcs)
    assert bits_equal(ours, ref)


def test_pack_with_offsets_leaves_padding_untouched(target):
    device, backend = target
    srcs = make_tensors([5, 0, 130, 1], torch.float32, device)
    offsets = [3, 8, 16, 300]  # gaps (alignment padding) and an out-of-order-safe layout
    bucket = torch.full((301,), -7.0, dtype=torch.bfloat16, device=device)
    ops.pack_bucket(srcs, bucket, offsets=offsets, scale=0.5, backend=backend)
    expected = torch.full((301,), -7.0, dtype=torch.bfloat16, device=device)
    for s, o in zip(srcs, offsets):
        expected[o:o + s.numel()] = (s.float().view(-1) * 0.5).bfloat16()
    assert bits_equal(bucket, expected)


def test_pack_scale_before_downcast_avoids_fp16_overflow(target):
    device, backend = target
    grads = [torch.full((9,), 100000.0, device=device)]  # > fp16 max; / 4 ranks fits
    bucket = ops.pack_bucket(grads, dtype=torch.float16, scale=0.25, backend=backend)
    assert torch.isfinite(bucket).all() and bucket[0] == torch.tensor(25000.0).half()


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("bucket_dtype,dst_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                    (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_unpack_matches_reference(target, accumulate, bucket_dtype, dst_dtype):
    device, backend = target
    sizes = tensor_sizes(target, 4)
    ours = make_tensors(sizes, dst_dtype, device, seed=4)
    ref = [t.clone() for t in ours]
    bucket = (torch.randn(sum(sizes) + 11, generator=torch.Generator().manual_seed(5))).to(bucket_dtype).to(device)
    offsets, pos = [], 11
    for n in sizes:
        offsets.append(pos)
        pos += n
    ops.unpack_bucket(bucket, ours, offsets=offsets, scale=0.5, accumulate=accumulate, backend=backend)
    ops.unpack_bucket(bucket, ref, offsets=offsets, scale=0.5, accumulate=accumulate, backend="torch")
    assert_bitwise(ours, ref, "unpacked")


def test_pack_unpack_round_trip(target):
    device, backend = target
    grads = make_tensors([17, 0, 4099, 3], torch.float32, device)
    bucket = ops.pack_bucket(grads, scale=1.0, backend=backend)
    out = [torch.zeros_like(g) for g in grads]
    ops.unpack_bucket(bucket, out, accumulate=False, backend=backend)
    assert_bitwise(out, grads, "round trip")


# ------------------------------------------------------------------------------------- bad input
def _cpu_backends():
    from parallel_layers.ops import _backend
    return ["torch"] + (["cpp"] if _backend.resolve("multi_tensor_cast", torch.device("cpu")) == "cpp" else [])


@pytest.mark.parametrize("backend", _cpu_backends())
def test_multi_tensor_bad_input_names_the_argument(backend, monkeypatch):
    """The same errors whichever backend runs: the C++ ones check the lists themselves (no Python pass over
    thousands of tensors) and the Python checks then name the fault."""
    monkeypatch.setenv("PARALLEL_LAYERS_BACKEND", backend)
    from parallel_layers.ops import _backend
    _backend.clear_cache()
    a, b = torch.randn(4), torch.randn(5)
    bf = torch.empty(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"srcs\[1\] has dtype float16 but srcs\[0\] has"):
        ops.multi_tensor_cast([a, b.half()], [bf, torch.empty(5, dtype=torch.bfloat16)])
    with pytest.raises(TypeError, match=r"dsts\[1\] must be a torch.Tensor, got str"):
        ops.multi_tensor_cast([a, b], [bf, "x"])
    with pytest.raises(TypeError, match=r"srcs\[1\] has dtype int64"):
        ops.pack_bucket([a, torch.arange(3)], torch.empty(20))
    with pytest.raises(ValueError, match=r"dsts\[1\] must be contiguous"):
        ops.unpack_bucket(torch.empty(40), [a, torch.randn(4, 4).t()])
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype float16 but tensors\[0\] has"):
        ops.unscale_and_norm([a, b.half()])
    with pytest.raises(TypeError, match="tensors must be a list or tuple"):
        ops.unscale_and_norm(a)
    with pytest.raises(ValueError, match=r"tensors\[1\] must be contiguous"):
        ops.unscale_and_norm([a, torch.randn(4, 4).t()])
    with pytest.raises(ValueError, match=r"srcs\[1\] has 5 elements but dsts\[1\] has 4"):
        ops.multi_tensor_cast([a, b], [torch.empty(4, dtype=torch.bfloat16)] * 2)
    with pytest.raises(ValueError, match="got 2 srcs but 1 dsts"):
        ops.multi_tensor_cast([a, b], [torch.empty(4, dtype=torch.bfloat16)])
    with pytest.raises(TypeError, match="dtype=torch.int32 is not one of"):
        ops.multi_tensor_cast([a], dtype=torch.int32)
    with pytest.raises(ValueError, match="the tensors need 9 elements of bucket but it has 8"):
        ops.pack_bucket([a, b], torch.empty(8))
    with pytest.raises(ValueError, match="overlaps the previous one"):
        ops.pack_bucket([a, b], torch.empty(20), offsets=[0, 2])
    with pytest.raises(ValueError, match="got 1 offsets for 2 tensors"):
        ops.unpack_bucket(torch.empty(20), [a, b], offsets=[0])
    with pytest.raises(ValueError, match=r"dsts\[0\] is on meta"):
        ops.unpack_bucket(torch.empty(20), [torch.empty(3, device="meta")])
    with pytest.raises(ValueError, match="inv_scale must hold exactly one element"):
        ops.unscale_and_norm([a], inv_scale=torch.ones(2))
    with pytest.raises(TypeError, match="bucket has dtype int64"):
        ops.pack_bucket([a], torch.empty(4, dtype=torch.int64))


def test_forced_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.pack_bucket([torch.randn(3)], backend="triton")


def test_backend_from_environment_variable(monkeypatch):
    monkeypatch.setenv("PARALLEL_LAYERS_BACKEND", "torch")
    ops.clear_backend_cache()  # read once per process: anew after a change
    assert ops.resolve_backend("pack_bucket", torch.device("cpu")) == "torch"
    monkeypatch.setenv("PARALLEL_LAYERS_BACKEND", "nonsense")
    ops.clear_backend_cache()
    with pytest.raises(ValueError, match="from PARALLEL_LAYERS_BACKEND"):
        ops.pack_bucket([torch.randn(3)])


def test_automatic_choice_on_cuda_prefers_the_cuda_kernels(monkeypatch):
    """Where an op has both, CUDA tensors get the C++ CUDA kernel (faster on an H200 for every such op: the
    host's time per launch), Triton where the op has no CUDA kernel or the extension was built without CUDA."""
    from parallel_layers.ops import _backend
    monkeypatch.setenv("PARALLEL_LAYERS_BACKEND", "auto")
    _backend.clear_cache()
    have = {"cuda", "triton"}
    monkeypatch.setattr(_backend, "_availability",
                        lambda name, device: (object(), None) if name in have else (None, "absent here"))
    gpu = torch.device("cuda", 0)
    assert _backend._resolve("multi_tensor_cast", gpu, None, _backend.BACKENDS)[0] == "cuda"
    assert _backend._resolve("fp8_cast", gpu, None, ("torch", "triton"))[0] == "triton"
    have.discard("cuda")
    assert _backend._resolve("multi_tensor_cast", gpu, None, _backend.BACKENDS)[0] == "triton"
