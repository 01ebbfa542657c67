"""fused_linear: the Triton matmul with its fused epilogue, and the autograd Function around it.

Forward oracle: ``reference_linear_epilogue`` run in float64 on the same (already rounded) inputs, which
is sharper than comparing with the reference in the input dtype (that one rounds twice: z, then act(z)).
The kernel accumulates in float32 and rounds once, at the store. Tolerances:
- float32 inputs: 1e-4 relative + 1e-5 absolute (measured ~1e-6 here: float32 accumulation-order
  differences only; on a GPU with ``torch.backends.cuda.matmul.allow_tf32 = True`` the kernel uses TF32
  like cuBLAS does, and the test widens to 5e-3).
- bf16 / fp16 outputs: 1e-2 relative (bf16 has 8 significant bits: one rounding is <= 2**-8 relative,
  and triton 3.9's interpreter truncates float32 -> bf16 instead of rounding, <= 2**-7) + 1e-3 absolute.
Backward: gradients of ours against torch autograd through the reference, same tolerances; the backward
formulas themselves are checked with ``torch.autograd.gradcheck`` in float64 (torch backend).

Targets: Triton on CPU tensors under TRITON_INTERPRET=1 (conftest sets it), and on CUDA tensors when a
GPU is present and TRITON_INTERPRET=0 (skipped here).
"""
import warnings

import pytest
import torch
from conftest import target_skip_reason

from parallel_layers.ops import _backend
from parallel_layers.ops import linear as L
from parallel_layers.ops.linear import fused_linear, reference_linear_epilogue

ACTS = [None, "gelu", "silu"]
TRITON_TARGETS = [("cpu", "triton"), ("cuda", "triton")]


@pytest.fixture(params=TRITON_TARGETS, ids=[f"{d}-{b}" for d, b in TRITON_TARGETS])
def tt(request):
    device, backend = request.param
    why = target_skip_reason(device, backend)
    if why:
        pytest.skip(f"{backend} on {device}: {why}")
    return torch.device(device)


def _tol(dtype):
    if dtype == torch.float32:
        tf32 = torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32
        return dict(rtol=5e-3 if tf32 else 1e-4, atol=5e-3 if tf32 else 1e-5)
    return dict(rtol=1e-2, atol=1e-3)


def _inputs(shape_x, n, dtype, device, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = shape_x[-1]
    x = torch.randn(shape_x, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / max(k, 1) ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(device), w.to(device), (b.to(device) if bias else None)


def _f64(t):
    return None if t is None else t.double()


def _check_forward(x, w, b, act, out_dtype=None):
    y = fused_linear(x, w, b, activation=act, out_dtype=out_dtype, backend="triton")
    want_dtype = out_dtype or x.dtype
    assert y.dtype == want_dtype and y.shape == (*x.shape[:-1], w.shape[0]) and y.device == x.device
    oracle = reference_linear_epilogue(_f64(x), _f64(w), _f64(b), act, None)
    torch.testing.assert_close(y.double(), oracle, **_tol(want_dtype))
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("shape_x,n", [((33, 29), 47), ((1, 1), 1), ((2, 5, 19), 70)],
                         ids=["33x47x29", "1x1x1", "3d-2x5x19-70"])
def test_forward_matches_reference(tt, shape_x, n, act, bias, dtype):
    x, w, b = _inputs(shape_x, n, dtype, tt, bias)
    _check_forward(x, w, b, act)


@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.float16, torch.float32), (torch.float32, torch.float16)],
                         ids=["bf16-fp32", "fp32-bf16", "fp16-fp32", "fp32-fp16"])
@pytest.mark.parametrize("act", ["gelu", None], ids=str)
def test_out_dtype_cast(tt, in_dtype, out_dtype, act):
    x, w, b = _inputs((37, 40), 50, in_dtype, tt)
    _check_forward(x, w, b, act, out_dtype)


def test_edge_shapes(tt):
    # exact multiples of the interpreter's block (EVEN_K, no tail tiles), a block-crossing K,
    # non-contiguous operands, and zero-size M / K.
    for shape_x, n in [((32, 64), 64), ((17, 100), 33)]:
        x, w, b = _inputs(shape_x, n, torch.float32, tt)
        _check_forward(x, w, b, "gelu")
    x, w, b = _inputs((40, 24), 30, torch.float32, tt)
    _check_forward(x[::2], w.t().contiguous().t(), b, "silu")  # x row stride 48, W column-major
    x, w, b = _inputs((0, 8), 5, torch.float32, tt)
    assert fused_linear(x, w, b, activation="gelu", backend="triton").shape == (0, 5)
    x, w, b = _inputs((3, 0), 5, torch.float32, tt)
    y = fused_linear(x, w, b, activation="gelu", backend="triton")
    torch.testing.assert_close(y, torch.nn.functional.gelu(b).expand(3, 5), rtol=1e-6, atol=1e-6)


def _grads(fn, x, w, b, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = fn(x, w, b)
    y.backward(g)
    return y.detach(), [t.grad for t in (x, w, b) if t is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_backward_matches_reference_autograd(tt, act, bias, dtype):
    x, w, b = _inputs((3, 11, 29), 47, dtype, tt, bias)
    g = torch.randn(3, 11, 47, generator=torch.Generator().manual_seed(1)).to(dtype).to(tt)
    _, ours = _grads(lambda x, w, b: fused_linear(x, w, b, activation=act, backend="triton"), x, w, b, g)
    # oracle: float64 autograd through the reference, from the same rounded inputs
    _, want = _grads(lambda x, w, b: reference_linear_epilogue(x, w, b, act, None),
                     x.double(), w.double(), _f64(b), g.double())
    # eager autograd through the reference in the input dtype: what users get without the fused op
    _, eager = _grads(lambda x, w, b: reference_linear_epilogue(x, w, b, act, None), x, w, b, g)
    for name, got, exp, ref in zip(("x", "weight", "bias"), ours, want, eager):
        assert got.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), exp, **_tol(dtype), msg=lambda m: f"grad {name}: {m}")
        else:
            # bf16 grads round grad_z and the matmul outputs to bf16, as eager autograd does: ours must be
            # no further from the float64 oracle than eager bf16 autograd is (1.5x, plus half a bf16 ulp of
            # the gradient's scale for ties going the other way).
            err, err_eager = (got.double() - exp).abs().max(), (ref.double() - exp).abs().max()
            assert err <= 1.5 * err_eager + exp.abs().max() * 2 ** -9, (name, err.item(), err_eager.item())


def test_backward_with_out_dtype(tt):
    x, w, b = _inputs((9, 21), 13, torch.bfloat16, tt)
    g = torch.randn(9, 13, generator=torch.Generator().manual_seed(2)).to(tt)
    y, ours = _grads(lambda x, w, b: fused_linear(x, w, b, activation="silu", out_dtype=torch.float32,
                                                  backend="triton"), x, w, b, g)
    assert y.dtype == torch.float32
    _, want = _grads(lambda x, w, b: reference_linear_epilogue(x, w, b, "silu", torch.float32), x, w, b, g)
    for got, exp in zip(ours, want):
        torch.testing.assert_close(got.float(), exp.float(), rtol=3e-2, atol=3e-2)


def test_no_grad_and_frozen_inputs(tt):
    x, w, b = _inputs((5, 7), 6, torch.float32, tt)
    w.requires_grad_()
    with torch.no_grad():
        y = fused_linear(x, w, b, activation="gelu", backend="triton")
    assert not y.requires_grad
    torch.testing.assert_close(y, reference_linear_epilogue(x, w, b, "gelu", None), rtol=1e-4, atol=1e-5)
    # only the weight requires grad: grad flows to it alone
    y = fused_linear(x, w, b, activation="gelu", backend="triton")
    y.sum().backward()
    w2 = w.detach().clone().requires_grad_()
    reference_linear_epilogue(x, w2, b, "gelu", None).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-5)


# ---- the backward formulas and the backend choice (torch backend; fast, exact) ----

@pytest.mark.parametrize("act", ACTS, ids=str)
def test_backward_formulas_gradcheck(act):
    x, w, b = _inputs((2, 3, 5), 4, torch.float64, "cpu")
    args = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda x, w, b: fused_linear(x, w, b, activation=act, backend="torch"),
                                    args)


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_torch_backend_matches_eager_autograd(act):
    x, w, b = _inputs((6, 4, 10), 8, torch.float32, "cpu")
    g = torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(3))
    y1, g1 = _grads(lambda x, w, b: fused_linear(x, w, b, activation=act, backend="torch"), x, w, b, g)
    y2, g2 = _grads(lambda x, w, b: reference_linear_epilogue(x, w, b, act, None), x, w, b, g)
    assert torch.equal(y1, y2)
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


def test_backend_choice(monkeypatch):
    x, w, b = _inputs((3, 4), 5, torch.float32, "cpu")
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    _backend.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU: the torch reference is this op's implementation, no warning
        assert L.fused_linear_backend(x, w, b)[0] == "torch"
        assert L.fused_linear_backend(x, w, b, backend="auto")[0] == "torch"
        fused_linear(x, w, b, activation="gelu")
    for forced in ("cpp", "cuda"):
        with pytest.raises(ValueError, match="has no .* kernel"):
            fused_linear(x, w, b, backend=forced)
    monkeypatch.setenv(_backend.ENV_VAR, "cpp")  # set for a whole run: this op takes the automatic choice
    _backend.clear_cache()
    assert L.fused_linear_backend(x, w, b)[0] == "torch"
    with pytest.raises(ValueError, match="unknown backend"):
        fused_linear(x, w, b, backend="nope")
    monkeypatch.setattr(_backend, "triton_interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_linear(x, w, b, backend="triton")


def test_argument_errors():
    x, w, b = _inputs((3, 4), 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match="activation"):
        fused_linear(x, w, b, activation="relu")
    with pytest.raises(ValueError, match="last dimension 4"):
        fused_linear(x, w[:, :3], b)
    with pytest.raises(ValueError, match="bias has shape"):
        fused_linear(x, w, b[:4])
    with pytest.raises(TypeError, match="weight has dtype"):
        fused_linear(x, w.double(), b)
    with pytest.raises(TypeError, match="out_dtype"):
        fused_linear(x, w, b, out_dtype=torch.int32)
    # what F.linear itself would accept: a bias that broadcasts, a 1-D weight, integer inputs
    with pytest.raises(ValueError, match="bias has shape"):
        fused_linear(x, w, b[:1])
    with pytest.raises(ValueError, match="weight must be 2-D"):
        fused_linear(x, w[0], None)
    with pytest.raises(TypeError, match="floating point"):
        fused_linear(x.long(), w.long(), b.long())
    with pytest.raises(ValueError, match="weight is on meta"):
        fused_linear(x, w.to("meta"), None)


def test_autocast_cpu_runs_in_autocast_dtype():
    x, w, b = _inputs((4, 6), 3, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused_linear(x, w, b, activation="gelu")
        want = reference_linear_epilogue(x, w, b, "gelu", None)
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_tuned_sizes(dtype):
    """Sizes that reach the autotuned configs (large tiles, EVEN_K, skinny M) on a real GPU."""
    if _backend.triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 runs the interpreter, not the GPU kernels")
    for shape_x, n in [((4, 128, 512), 768), ((16, 1024), 1024), ((300, 1000), 1100)]:
        x, w, b = _inputs(shape_x, n, dtype, torch.device("cuda"))
        for act in ACTS:
            _check_forward(x, w, b, act)
        name, why = L.fused_linear_backend(x, w, b, activation="gelu")
        if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
            assert name == "torch" and "TF32" in why
        else:
            assert name in ("triton", "torch"), why
        torch.testing.assert_close(fused_linear(x, w, b, activation="gelu"),
                                   fused_linear(x, w, b, activation="gelu", backend=name))


class _FakeRuns:
    """Stands in for the two forwards and the CUDA-event timer: counts calls, returns set timings."""

    def __init__(self, ms):
        self.ms, self.calls = ms, []

    def run(self, which):
        self.calls.append(which)

    def timer(self, fn):
        before = len(self.calls)
        fn()
        return self.ms[self.calls[before]]


def _big_inputs(dtype=torch.bfloat16):
    # 2*M*N*K = 2**28 > SMALL_FLOPS; meta tensors: the chooser never touches the data
    x = torch.empty(512, 512, dtype=dtype, device="meta")
    return x, torch.empty(512, 512, dtype=dtype, device="meta"), None


def test_linear_dispatch_rules():
    from parallel_layers.ops import linear_dispatch as D
    assert D.static_choice(4096, 4096, 4096, torch.float32)[0] == "torch"      # no TF32: FMA loops
    assert D.static_choice(16, 256, 256, torch.bfloat16)[0] == "torch"         # launch-bound
    assert D.static_choice(4096, 4096, 4096, torch.bfloat16) is None            # measured
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert D.static_choice(4096, 4096, 4096, torch.float32) is None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_linear_dispatch_measures_once_and_shares_the_result(tmp_path):
    from parallel_layers.ops import linear_dispatch as D
    path = str(tmp_path / "cache" / D.CACHE_FILE)
    x, w, b = _big_inputs()
    runs = _FakeRuns({"triton": 1.0, "torch": 2.0})
    first = D.BackendChooser(path, runs.timer)
    name, why = first.choose(x, w, b, "gelu", None, True, runs.run)
    assert name == "triton" and "measured" in why
    assert runs.calls[0] == "triton"                   # Triton autotunes before anything is timed
    n = len(runs.calls)
    assert first.choose(x, w, b, "gelu", None, True, runs.run)[0] == "triton" and len(runs.calls) == n
    # another process: reads the file, measures nothing
    other = _FakeRuns({"triton": 9.0, "torch": 1.0})
    assert D.BackendChooser(path, other.timer).choose(x, w, b, "gelu", None, True, other.run)[0] == "triton"
    assert other.calls == []
    # another shape class (no bias) is measured on its own, and both classes stay in the file
    assert D.BackendChooser(path, other.timer).choose(x, w, None, None, None, False, other.run)[0] == "torch"
    assert len(D._read(path)) == 2
    # a corrupt file is ignored (measured again), never fatal
    with open(path, "w") as f:
        f.write("{not json")
    again = _FakeRuns({"triton": 3.0, "torch": 1.0})
    assert D.BackendChooser(path, again.timer).choose(x, w, b, "gelu", None, True, again.run)[0] == "torch"
    assert again.calls


def test_linear_dispatch_unwritable_cache_warns_and_keeps_the_choice(tmp_path):
    from parallel_layers.ops import linear_dispatch as D
    blocker = tmp_path / "file"
    blocker.write_text("")
    x, w, b = _big_inputs()
    runs = _FakeRuns({"triton": 2.0, "torch": 1.0})
    chooser = D.BackendChooser(str(blocker / D.CACHE_FILE), runs.timer)
    with pytest.warns(RuntimeWarning, match="could not write the backend cache"):
        assert chooser.choose(x, w, b, "gelu", None, True, runs.run)[0] == "torch"
    n = len(runs.calls)
    assert chooser.choose(x, w, b, "gelu", None, True, runs.run)[0] == "torch" and len(runs.calls) == n


def test_no_config_the_autotuner_tries_spills_registers():
    """Compiled offline for sm_90 (no GPU needed): every config kept for a GeLU epilogue that also
    stores the pre-activation (the heaviest) fits in registers."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.linear_registers", "--check",
                          "--dtypes", "bf16", "--epilogues", "gelu+pre"],
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "128x128x64 g8 s4 w8" in out.stdout and "128x256x64" not in out.stdout


def test_one_config_tuning_switch(monkeypatch):
    """PARALLEL_LAYERS_LINEAR_TUNING=one (gpu-check's tests): one config per dtype and shape class, the first
    the autotuner's pruner keeps, so a CUDA test run compiles one kernel where the autotuner compiled up to 11."""
    import triton

    from parallel_layers.triton_kernels import matmul
    monkeypatch.delenv(matmul.TUNING_ENV, raising=False)
    assert matmul.tuning() == "full"
    monkeypatch.setenv(matmul.TUNING_ENV, "one")
    assert matmul.tuning() == "one"
    monkeypatch.setenv(matmul.TUNING_ENV, "some")
    with pytest.raises(ValueError, match="expected 'full' or 'one'"):
        matmul.tuning()
    for dtype in (torch.bfloat16, torch.float32):
        for m in (1, 33, 300, 4096):
            for act in (0, 1):
                x = torch.empty(m, 8, dtype=dtype, device="meta")
                kept = matmul.prune_configs(matmul.CONFIGS, {"x_ptr": x, "M": m}, ACTIVATION=act)
                one = matmul.one_config(x.element_size(), triton.next_power_of_2(m), act)
                assert (one.kwargs, one.num_warps, one.num_stages) == (kept[0].kwargs, kept[0].num_warps,
                                                                       kept[0].num_stages)


def test_interpreter_loops_with_runtime_bounds_under_this_numpy():
    """triton 3.6's interpreter took a runtime loop bound's index with int() on a 1-element array, an error
    since numpy 2.4 (the GPU image has triton 3.6 with numpy 2.5); triton_kernels backports triton 3.9's fix."""
    import inspect

    from triton.runtime import interpreter

    from parallel_layers.triton_kernels import _interpreter_compat as compat
    fixed = getattr(interpreter._patch_lang_tensor, "_parallel_layers_patched", False)
    assert fixed or compat.OLD_INDEX not in inspect.getsource(interpreter._patch_lang_tensor)


STANDIN_RUN = """
import torch
from parallel_layers.cli.gpu_check import standin
standin.install()
cases = [(33, 29, 47, torch.bfloat16, "gelu", True), (512, 512, 768, torch.float32, None, False)]
print("reached", standin.compile_fused_linear_launches(cases), "of", len(cases))
"""


@pytest.mark.slow
def test_one_config_launch_compiles_for_sm90_through_the_launch_path(tmp_path):
    """What gpu-check's CUDA tests run (PARALLEL_LAYERS_LINEAR_TUNING=one), up to the launch: the launcher's host
    code and Triton's specialisation and compile for sm_90, with a stand-in driver (no GPU needed)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PARALLEL_LAYERS_LINEAR_TUNING="one",
               TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", STANDIN_RUN], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "reached 2 of 2" in out.stdout, out.stdout + out.stderr[-3000:]
    assert len(list((tmp_path / "triton").glob("*/*.cubin"))) == 2
