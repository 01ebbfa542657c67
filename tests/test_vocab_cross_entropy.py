"""Vocab-parallel cross entropy: parity with F.cross_entropy on the gathered logits, at tp = 1, 2, 4.

Every rank builds the same full logits from one seed and keeps its vocabulary slice; the loss (checked
on every rank) and the gradient shards (gathered here) must equal ``F.cross_entropy`` on the full
logits. Padded vocabulary columns hold huge garbage that must never leak into the loss or get a
gradient. The local kernels (Triton under TRITON_INTERPRET=1 vs the torch reference) are checked in
this process, no communication needed.
"""
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import target_skip_reason

from parallel_layers.ops import _backend
from parallel_layers.ops import cross_entropy as K
from parallel_layers.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel_layers.testing import cached_mesh

V_PAD = 40              # divisible by 1, 2 and 4
SHAPE = (2, 3)          # [batch, seq] of the 3-D logits
GARBAGE = 1e30          # in padded columns: finite in fp32, overflows any exp it leaks into
IGNORE = -100


def make_case(seed, shape, vocab, dtype):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(*shape, V_PAD, generator=g, dtype=torch.float64) * 3
    full[..., vocab:] = GARBAGE
    target = torch.randint(0, vocab, shape, generator=g)
    target.view(-1)[::4] = IGNORE           # some ignored targets
    upstream = torch.randn(shape, generator=g, dtype=torch.float64)
    return full.to(dtype), target, upstream.to(dtype)


def reference(full, target, upstream, vocab, ls, reduction):
    x = full.detach().clone().requires_grad_()
    loss = F.cross_entropy(x[..., :vocab].reshape(-1, vocab), target.reshape(-1), ignore_index=IGNORE,
                           label_smoothing=ls, reduction=reduction)
    if reduction == "none":
        loss = loss.view(target.shape)
        loss.backward(upstream)
    else:
        loss.backward()
    return loss.detach(), x.grad


CASES = list(itertools.product((torch.float64, torch.float32), (0.0, 0.1), ("mean", "sum", "none"),
                               (40, 37, 25), (True, False)))


def body_parity(rank, world, backend, cases, shape, device="cpu"):
    group = cached_mesh(tp=world).tp_group
    local = V_PAD // world
    out = []
    for i, (dtype, ls, reduction, vocab, inplace) in enumerate(cases):
        full, target, upstream = (t.to(device) for t in make_case(i, shape, vocab, dtype))
        leaf = full[..., rank * local:(rank + 1) * local].clone().requires_grad_()
        logits = leaf.clone()               # a non-leaf, as the LM head's output would be
        loss = vocab_parallel_cross_entropy(logits, target, tp_group=group, ignore_index=IGNORE,
                                            label_smoothing=ls, reduction=reduction, vocab_size=vocab,
                                            inplace_backward=inplace, backend=backend)
        loss.backward(upstream if reduction == "none" else None)
        overwritten = torch.equal(logits.detach(), leaf.grad) if inplace else None
        out.append((loss.detach().cpu(), leaf.grad.cpu(), overwritten))
    return out


def check_parity(results, world, cases, shape, f64_tol=1e-12):
    for i, (dtype, ls, reduction, vocab, inplace) in enumerate(cases):
        full, target, upstream = make_case(i, shape, vocab, dtype)
        ref_loss, ref_grad = reference(full, target, upstream, vocab, ls, reduction)
        tol = dict(rtol=f64_tol, atol=f64_tol) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
        where = f"tp={world} case {i}: {dtype}, ls={ls}, {reduction}, vocab {vocab}/{V_PAD}, inplace={inplace}"
        grads = []
        for rank, per_case in enumerate(results):
            loss, grad, overwritten = per_case[i]
            assert loss.dtype == dtype and loss.shape == ref_loss.shape, where
            torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{where}, rank {rank} loss: {m}")
            if inplace:
                assert overwritten, f"{where}: rank {rank}'s logits do not hold the gradient after backward"
            grads.append(grad)
        grad = torch.cat(grads, dim=-1)
        assert torch.all(grad[..., vocab:] == 0), f"{where}: padded columns got a gradient"
        assert torch.all(grad.view(-1, V_PAD)[target.view(-1) == IGNORE] == 0), f"{where}: ignored rows got a gradient"
        torch.testing.assert_close(grad, ref_grad, **tol, msg=lambda m: f"{where}, gathered gradient: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_f_cross_entropy(dist_pools, world):
    results = dist_pools(world).run(body_parity, None, CASES, SHAPE)
    check_parity(results, world, CASES, SHAPE)


def test_parity_2d_logits_and_triton_backend(dist_pools):
    """2-D ``[rows, V]`` logits, and the whole path through the Triton kernels (interpreted on CPU)."""
    cases = [(torch.float32, 0.1, "mean", 37, True), (torch.float64, 0.0, "none", 37, False),
             (torch.float64, 0.1, "sum", 25, True)]
    check_parity(dist_pools(4).run(body_parity, None, cases, (7,)), 4, cases, (7,))
    if not _backend.triton_interpreting():
        pytest.skip("TRITON_INTERPRET is not set: the Triton path cannot run on CPU tensors")
    check_parity(dist_pools(2).run(body_parity, "triton", cases, SHAPE), 2, cases, SHAPE)


def test_cuda_parity_tp1(dist_pools):
    """On a GPU: the whole function on CUDA tensors through the compiled Triton kernels (tp = 1, so no
    collective runs; the multi-rank algebra is covered on CPU above)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if _backend.triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 runs the interpreter, not the GPU kernels")
    cases = [c for c in CASES if c[3] != 40 and c[2] != "sum"]
    results = dist_pools(1).run(body_parity, None, cases, SHAPE, "cuda")
    # compiled Triton's exp is not correctly rounded: float32 to a few ulps, float64 near-exact
    check_parity(results, 1, cases, SHAPE, f64_tol=1e-10)


def body_all_ignored(rank, world):
    group = cached_mesh(tp=world).tp_group
    x = torch.randn(3, V_PAD // world, dtype=torch.float64, requires_grad=True)
    t = torch.full((3,), IGNORE)
    mean = vocab_parallel_cross_entropy(x, t, tp_group=group)
    mean.backward()
    total = vocab_parallel_cross_entropy(x.detach(), t, tp_group=group, reduction="sum")
    return mean.detach(), total, x.grad


def test_all_targets_ignored(dist_pools):
    for mean, total, grad in dist_pools(2).run(body_all_ignored):
        assert torch.isnan(mean) and total == 0  # F.cross_entropy: mean over no targets is nan
        assert torch.all(grad == 0)


def body_errors(rank, world):
    group = cached_mesh(tp=world).tp_group
    x = torch.randn(4, 5)
    t = torch.zeros(4, dtype=torch.int64)
    msgs = {}

    def catch(name, fn):
        try:
            fn()
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            msgs[name] = f"{type(exc).__name__}: {exc}"

    ce = vocab_parallel_cross_entropy
    catch("shape", lambda: ce(x, torch.zeros(3, dtype=torch.int64), tp_group=group))
    catch("dtype", lambda: ce(x, t.float(), tp_group=group))
    catch("vocab", lambda: ce(x, t, tp_group=group, vocab_size=5 * world + 1))
    catch("reduction", lambda: ce(x, t, tp_group=group, reduction="avg"))
    catch("group", lambda: ce(x, t, tp_group=None))
    catch("range", lambda: ce(x, t + 5 * world, tp_group=group))
    catch("smoothing", lambda: ce(x, t, tp_group=group, label_smoothing=1.5))
    y = x.clone().requires_grad_()
    loss = ce(y * 1, t, tp_group=group)
    loss.backward(retain_graph=True)
    catch("twice", lambda: loss.backward())
    return msgs


def test_errors_name_the_argument_and_sizes(dist_pools):
    for msgs in dist_pools(2).run(body_errors):
        assert "target has shape (3,)" in msgs["shape"] and "(4,)" in msgs["shape"]
        assert msgs["dtype"].startswith("TypeError") and "integer" in msgs["dtype"]
        assert "vocab_size=11" in msgs["vocab"] and "tp=2" in msgs["vocab"] and "10" in msgs["vocab"]
        assert "reduction='avg'" in msgs["reduction"]
        assert "tp_group is required" in msgs["group"]
        assert msgs["range"].startswith("IndexError") and "target 10" in msgs["range"]
        assert "label_smoothing=1.5" in msgs["smoothing"]
        assert "inplace_backward=False" in msgs["twice"]


# ----------------------------------------------------------------------------- local kernels

def _stats_case(rows, cols, n_valid, vocab_start, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols + 3, generator=g, dtype=torch.float64) * 4
    base[:, n_valid:] = GARBAGE
    logits = base.to(dtype)[:, :cols]          # a row stride != cols: rows are not packed
    target = torch.randint(vocab_start - 5, vocab_start + cols + 5, (rows,), generator=g)
    return logits, target


KERNEL_SHAPES = [  # rows, cols, n_valid, vocab_start
    (0, 16, 16, 0), (1, 1, 1, 0), (5, 37, 37, 10), (4, 37, 30, 0), (3, 20, 0, 40), (3, 5000, 4999, 7)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,n_valid,vocab_start", KERNEL_SHAPES)
def test_triton_kernels_match_reference(rows, cols, n_valid, vocab_start, dtype, device):
    """Triton on CPU tensors under TRITON_INTERPRET=1, or compiled on CUDA tensors (TRITON_INTERPRET=0)."""
    why = target_skip_reason(device, "triton")
    if why:
        pytest.skip(f"triton on {device}: {why}")
    logits, target = (t.to(device) for t in _stats_case(rows, cols, n_valid, vocab_start, dtype))
    if rows >= 3:
        logits[1, :n_valid] = float("-inf")     # a row of -inf only: max -inf, sum exp 0, no nan
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    m_ref, s_ref = K.ce_forward_stats(logits, target, vocab_start, n_valid, backend="torch")
    m_tri, s_tri = K.ce_forward_stats(logits, target, vocab_start, n_valid, backend="triton")
    torch.testing.assert_close(m_tri, m_ref, **tol)
    torch.testing.assert_close(s_tri[:, :2], s_ref[:, :2], **tol)
    finite = torch.isfinite(s_ref[:, 2])
    torch.testing.assert_close(s_tri[finite, 2], s_ref[finite, 2], **tol)

    acc = K.acc_dtype(dtype)
    lse = (torch.randn(rows, dtype=acc).abs() + 3).to(device)
    g = torch.randn(rows, dtype=acc).to(device)
    out_ref = torch.full_like(logits, float("nan"))
    K.ce_backward(logits, target, lse, g, vocab_start, n_valid, 0.1 / 50, 0.9, out_ref, backend="torch")
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else (
        dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-3))
    out_tri = torch.full_like(logits, float("nan"))
    K.ce_backward(logits, target, lse, g, vocab_start, n_valid, 0.1 / 50, 0.9, out_tri, backend="triton")
    torch.testing.assert_close(out_tri, out_ref, **tol)
    assert torch.all(out_ref[:, n_valid:] == 0)
    # in place: the gradient written over the logits themselves, by both backends
    for backend in ("torch", "triton"):
        x = logits.clone()
        K.ce_backward(x, target, lse, g, vocab_start, n_valid, 0.1 / 50, 0.9, x, backend=backend)
        torch.testing.assert_close(x, out_ref, **tol)


def test_reference_chunking_is_exact():
    """The CPU reference walks rows in chunks; tiny chunks must give the one-chunk answer."""
    logits, target = _stats_case(9, 37, 33, 5, torch.float32, seed=3)
    m1, s1 = torch.empty(9), torch.empty(9, 3)
    m2, s2 = torch.empty(9), torch.empty(9, 3)
    K.reference_ce_forward_stats(logits, target, 5, 33, m1, s1)
    K.reference_ce_forward_stats(logits, target, 5, 33, m2, s2, chunk_bytes=4 * 37 * 2)  # 2 rows a chunk
    assert torch.equal(m1, m2) and torch.equal(s1, s2)
    lse, g = torch.randn(9) + 5, torch.randn(9)
    o1, o2 = torch.empty_like(logits), logits.clone()
    K.reference_ce_backward(logits, target, lse, g, 5, 33, 0.0, 1.0, o1)
    K.reference_ce_backward(o2, target, lse, g, 5, 33, 0.0, 1.0, o2, chunk_bytes=4 * 37 * 2)
    assert torch.equal(o1, o2)


def test_backend_declaration(monkeypatch):
    """An op without a C++ kernel runs its torch reference on CPU, with no warning; forcing a backend
    it lacks is an error by argument, a warning by environment variable."""
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    _backend.clear_cache()
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.resolve("ce_backward", cpu, None, K.BACKENDS) == "torch"
    with pytest.raises(ValueError, match="ce_backward has no cpp kernel"):
        _backend.resolve("ce_backward", cpu, "cpp", K.BACKENDS)
    monkeypatch.setenv(_backend.ENV_VAR, "cpp")
    _backend.clear_cache()
    _backend._warned.discard("missing:ce_backward:cpp")
    with pytest.warns(RuntimeWarning, match="has no cpp kernel"):
        assert _backend.resolve("ce_backward", cpu, None, K.BACKENDS) == "torch"


def test_benchmark_smoke():
    """``python -m benchmarks.cross_entropy --smoke`` runs end to end (2 gloo ranks) and prints its table."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("PARALLEL_LAYERS_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cross_entropy", "--smoke", "--no-csv", "--device", "cpu"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    for case in ("vocab_ce", "vocab_ce_no_inplace", "loss_parallel"):
        assert case in rows and float(rows[case][1]) > 0, proc.stdout
