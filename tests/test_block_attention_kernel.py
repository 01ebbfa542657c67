"""The per-block attention op (``parallel_layers.ops.block_attention``) on every available backend against
the dense torch oracle of ``context_parallel/blocks.py`` (``layout.visible`` + ``block_attention`` + ``merge``,
``block_attention_backward``): the fused merge into a running ``(out, lse)``, the gradients added to running
``dq``/``dk``/``dv``, fp32 (1e-5) and bf16 inputs (fp32 accumulation; the triton backend rounds P and dS to
bf16 before their matmuls, as flash attention does: 5e-2), sizes that are not multiples of the tiles (16 under
the interpreter) and ones that are, grouped-query heads, causal and not, padding and packed segments, rows
that see no key (lse -inf, out 0, never NaN), several blocks merged equal to one, and the argument errors."""
import pytest
import torch
from conftest import target_skip_reason

from parallel_layers.context_parallel import blocks
from parallel_layers.context_parallel.layout import visible
from parallel_layers.ops import _backend
from parallel_layers.ops import block_attention as BA

TARGETS = [("cpu", "torch"), ("cpu", "triton"), ("cuda", "torch"), ("cuda", "triton")]


@pytest.fixture(params=TARGETS, ids=[f"{d}-{b}" for d, b in TARGETS])
def where(request):
    device, backend = request.param
    why = target_skip_reason(device, backend)
    if why and device == "cuda" and torch.cuda.is_available() and not _backend.triton_interpreting():
        pytest.fail(f"{backend} on {device} is unavailable on a machine with a GPU: {why}")
    if why:
        pytest.skip(f"{backend} on {device}: {why}")
    return torch.device(device), backend


def make_case(seed, b, hq, hkv, sq, sk, d, kind, dtype=torch.float32):
    """Queries at the zigzag-like positions of one shard, keys at another's; segments by ``kind``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    half = sq // 2
    q_pos = torch.cat([torch.arange(half) + 3, torch.arange(sq - half) + 3 + half + sk // 2])
    k_pos = torch.arange(sk)
    q_seg = torch.zeros(b, sq, dtype=torch.int64)
    k_seg = torch.zeros(b, sk, dtype=torch.int64)
    if kind == "padding":          # left padding on row 0: its first keys and queries are -1
        q_seg[0, :min(4, sq)] = -1
        k_seg[0, :min(5, sk)] = -1
    elif kind == "packed":         # several sequences per row, ids rising along the row
        q_seg = (q_pos[None] // 11).expand(b, sq).clone()
        k_seg = (k_pos[None] // 11).expand(b, sk).clone()
        k_seg[-1, -3:] = -1
    elif kind == "masked":         # row 0's queries see no key of this block; the last row some padding keys
        q_seg[0] = 7
        k_seg[-1, ::3] = -1
    return q, k, v, q_pos, k_pos, q_seg, k_seg


def running(seed, b, hq, sq, d, dead_rows=2):
    """A running (out, lse) as earlier blocks leave it: some rows have seen nothing yet (0, -inf)."""
    g = torch.Generator().manual_seed(seed + 1000)
    out = torch.randn(b, hq, sq, d, generator=g)
    lse = torch.randn(b, hq, sq, generator=g) * 2
    out[:, :, :dead_rows] = 0
    lse[:, :, :dead_rows] = float("-inf")
    return out, lse


def oracle_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, out, lse):
    vis = visible(q_pos, k_pos, q_seg, k_seg, causal)
    out_b, lse_b = blocks.block_attention(q, k, v, vis, scale)
    return blocks.merge(out, lse, out_b, lse_b)


def tolerances(dtype, backend):
    if dtype == torch.float32 or backend == "torch":
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=2e-2, atol=5e-2)


def assert_lse_close(got, want, **tol):
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "-inf rows differ"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], **tol)


SHAPES = [  # (b, hq, hkv, sq, sk, d)
    (1, 1, 1, 1, 1, 16),      # one query, one key
    (2, 4, 2, 15, 17, 8),     # odd: sq, sk below one tile and d padded to 16
    (2, 2, 2, 16, 32, 16),    # exact tiles
    (1, 3, 1, 33, 20, 12),    # three query tiles, a partial key tile, hq/hkv = 3
]
KINDS = ["plain", "padding", "packed", "masked"]
CASES = [(s, kind, causal) for i, s in enumerate(SHAPES) for j, kind in enumerate(KINDS) for causal in (True, False)
         if (i + j) % 2 == 0 or s[3] <= 1]  # every shape and kind, causal and not, without the full product


def _case_id(c):
    (b, hq, hkv, sq, sk, d), kind, causal = c
    return f"b{b}h{hq}kv{hkv}-{sq}x{sk}d{d}-{kind}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_and_backward_match_the_dense_oracle(where, case):
    device, backend = where
    (b, hq, hkv, sq, sk, d), kind, causal = case
    _run_case(device, backend, b, hq, hkv, sq, sk, d, kind, causal, torch.float32, seed=sq * 7 + sk)


@pytest.mark.parametrize("kind,causal", [("padding", True), ("masked", False)])
def test_bf16_inputs_accumulate_in_fp32(where, kind, causal):
    device, backend = where
    _run_case(device, backend, 2, 4, 2, 17, 19, 16, kind, causal, torch.bfloat16, seed=5)


def _run_case(device, backend, b, hq, hkv, sq, sk, d, kind, causal, dtype, seed):
    scale = d ** -0.5
    q, k, v, q_pos, k_pos, q_seg, k_seg = make_case(seed, b, hq, hkv, sq, sk, d, kind, dtype)
    out0, lse0 = running(seed, b, hq, sq, d)
    want_out, want_lse = oracle_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, out0, lse0)
    tol = tolerances(dtype, backend)

    dev = [t.to(device) for t in (q, k, v, q_pos, k_pos, q_seg, k_seg)]
    out, lse = out0.to(device), lse0.to(device)
    got = BA.block_attention_forward(*dev, causal, scale, out, lse, backend=backend)
    assert got[0] is out and got[1] is lse                     # merged in place
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), want_out, **tol)
    assert_lse_close(lse.cpu(), want_lse, **tol)

    # Backward of this block, from the final (out, lse) (here: the oracle's), added to running gradients.
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    delta = (dout.float() * want_out).sum(-1)
    vis = visible(q_pos, k_pos, q_seg, k_seg, causal)
    wq, wk, wv = blocks.block_attention_backward(q, k, v, vis, scale, want_out, want_lse, dout, delta)
    base = [torch.randn(t.shape, generator=g) for t in (wq, wk, wv)]
    grads = [t.clone().to(device) for t in base]
    ret = BA.block_attention_backward(*dev, causal, scale, want_lse.to(device), dout.to(device), delta.to(device),
                                      *grads, backend=backend)
    assert all(r is t for r, t in zip(ret, grads))
    for name, got_g, b0, want in zip(("dq", "dk", "dv"), grads, base, (wq, wk, wv)):
        assert torch.isfinite(got_g).all(), name
        torch.testing.assert_close(got_g.cpu() - b0, want, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_rows_that_see_nothing_stay_zero_and_minus_inf(where):
    """A fresh running result, queries that see no key of the block (padding queries, another segment, all
    keys padding): lse stays -inf, out 0, gradients 0; no NaN anywhere."""
    device, backend = where
    b, hq, hkv, sq, sk, d = 2, 2, 1, 18, 21, 8
    q, k, v, q_pos, k_pos, q_seg, k_seg = make_case(3, b, hq, hkv, sq, sk, d, "plain")
    q_seg[0, :5] = -1          # padding queries
    q_seg[0, 5:9] = 4          # a segment no key is in
    k_seg[1] = -1              # row 1: every key is padding
    dev = [t.to(device) for t in (q, k, v, q_pos, k_pos, q_seg, k_seg)]
    out = torch.zeros(b, hq, sq, d, device=device)
    lse = torch.full((b, hq, sq), float("-inf"), device=device)
    BA.block_attention_forward(*dev, True, 0.5, out, lse, backend=backend)
    dead = torch.zeros(b, sq, dtype=torch.bool)
    dead[0, :9] = True
    dead[1] = True
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isinf(lse.cpu()[:, :, dead[0]][0]).all() and torch.isinf(lse.cpu()[1]).all()
    assert (out.cpu()[0][:, :9] == 0).all() and (out.cpu()[1] == 0).all()
    assert torch.isfinite(lse.cpu()[0][:, 9:]).all()
    want_out, want_lse = oracle_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, True, 0.5,
                                        torch.zeros(b, hq, sq, d), torch.full((b, hq, sq), float("-inf")))
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-5, atol=1e-5)
    dout = torch.randn(b, hq, sq, d)
    delta = (dout * want_out).sum(-1)
    grads = [torch.zeros(t.shape, device=device) for t in (q, k, v)]
    BA.block_attention_backward(*dev, True, 0.5, lse, dout.to(device), delta.to(device), *grads, backend=backend)
    dq, dk, dv = (t.cpu() for t in grads)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert (dq[0][:, :9] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


def test_a_block_no_query_sees_changes_nothing(where):
    device, backend = where
    b, hq, hkv, sq, sk, d = 1, 2, 2, 17, 17, 8
    q, k, v, q_pos, k_pos, q_seg, k_seg = make_case(4, b, hq, hkv, sq, sk, d, "plain")
    k_pos = k_pos + 1000       # causal: every key is in every query's future
    dev = [t.to(device) for t in (q, k, v, q_pos, k_pos, q_seg, k_seg)]
    out0, lse0 = running(4, b, hq, sq, d)
    out, lse = out0.to(device), lse0.to(device)
    BA.block_attention_forward(*dev, True, 0.3, out, lse, backend=backend)
    assert torch.equal(out.cpu(), out0) and torch.equal(lse.cpu(), lse0)
    grads = [torch.ones(t.shape, device=device) for t in (q, k, v)]
    dout, delta = torch.randn(q.shape).to(device), torch.randn(lse.shape).to(device)
    BA.block_attention_backward(*dev, True, 0.3, lse, dout, delta, *grads, backend=backend)
    assert all(bool((t == 1).all()) for t in grads)


def test_blocks_merged_in_turn_equal_one_block(where):
    """The ring's use: the keys in three blocks (uneven, crossing tiles), each merged in turn, equal the
    oracle over all the keys at once; the three backward shares sum to the whole block's gradients."""
    device, backend = where
    b, hq, hkv, sq, sk, d = 2, 4, 2, 20, 40, 8
    q, k, v, q_pos, k_pos, q_seg, k_seg = make_case(6, b, hq, hkv, sq, sk, d, "packed")
    out0 = torch.zeros(b, hq, sq, d)
    lse0 = torch.full((b, hq, sq), float("-inf"))
    want_out, want_lse = oracle_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, True, 0.4, out0, lse0)
    out, lse = out0.to(device), lse0.to(device)
    cuts = [(0, 7), (7, 24), (24, 40)]
    for a, z in cuts:
        BA.block_attention_forward(q.to(device), k[:, :, a:z].to(device), v[:, :, a:z].to(device), q_pos.to(device),
                                   k_pos[a:z].to(device), q_seg.to(device), k_seg[:, a:z].to(device), True, 0.4,
                                   out, lse, backend=backend)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-5, atol=1e-5)
    assert_lse_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)
    dout = torch.randn(q.shape)
    delta = (dout * want_out).sum(-1)
    vis = visible(q_pos, k_pos, q_seg, k_seg, True)
    wq, wk, wv = blocks.block_attention_backward(q, k, v, vis, 0.4, want_out, want_lse, dout, delta)
    dq = torch.zeros(q.shape, device=device)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    for a, z in cuts:
        part_k, part_v = torch.zeros(b, hkv, z - a, d, device=device), torch.zeros(b, hkv, z - a, d, device=device)
        BA.block_attention_backward(q.to(device), k[:, :, a:z].to(device), v[:, :, a:z].to(device), q_pos.to(device),
                                    k_pos[a:z].to(device), q_seg.to(device), k_seg[:, a:z].to(device), True, 0.4,
                                    lse, dout.to(device), delta.to(device), dq, part_k, part_v, backend=backend)
        dk[:, :, a:z], dv[:, :, a:z] = part_k.cpu(), part_v.cpu()
    for got, want in ((dq.cpu(), wq), (dk, wk), (dv, wv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_queries_and_empty_sizes(where):
    """q, k, v as transposed views ([b, s, h, d] memory, as attention layers hold them) and zero sizes."""
    device, backend = where
    b, hq, hkv, sq, sk, d = 1, 2, 1, 9, 11, 8
    q, k, v, q_pos, k_pos, q_seg, k_seg = make_case(8, b, hq, hkv, sq, sk, d, "plain")
    views = [t.transpose(1, 2).contiguous().to(device).transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous()
    out, lse = torch.zeros(b, hq, sq, d, device=device), torch.full((b, hq, sq), float("-inf"), device=device)
    idx = [t.to(device) for t in (q_pos, k_pos, q_seg, k_seg)]
    BA.block_attention_forward(*views, *idx, False, 0.3, out, lse, backend=backend)
    want_out, _ = oracle_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, False, 0.3, torch.zeros(b, hq, sq, d),
                                 torch.full((b, hq, sq), float("-inf")))
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-5, atol=1e-5)
    # No keys at all: nothing changes; no queries: nothing to do.
    out2, lse2 = out.clone(), lse.clone()
    BA.block_attention_forward(views[0], views[1][:, :, :0], views[2][:, :, :0], idx[0], idx[1][:0], idx[2],
                               idx[3][:, :0], True, 0.3, out2, lse2, backend=backend)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    e = torch.zeros(b, hq, 0, d, device=device)
    BA.block_attention_forward(e, views[1], views[2], idx[0][:0], idx[1], idx[2][:, :0], idx[3], True, 0.3,
                               torch.zeros(b, hq, 0, d, device=device), torch.zeros(b, hq, 0, device=device),
                               backend=backend)


def test_reference_chunking_matches_one_chunk():
    b, hq, hkv, sq, sk, d = 2, 4, 2, 13, 10, 8
    q, k, v, q_pos, k_pos, q_seg, k_seg = make_case(9, b, hq, hkv, sq, sk, d, "padding")
    args = (q, k, v, q_pos, k_pos, q_seg, k_seg, True, 0.35)
    results = []
    for chunk_bytes in (BA.CHUNK_BYTES, 4 * b * hq * sk * 3):       # 3 query rows a chunk
        out, lse = running(9, b, hq, sq, d)
        BA.reference_block_attention_forward(*args, out, lse, chunk_bytes=chunk_bytes)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
        delta = (dout * out).sum(-1)
        grads = [torch.zeros(t.shape) for t in (q, k, v)]
        BA.reference_block_attention_backward(*args, lse, dout, delta, *grads, chunk_bytes=chunk_bytes)
        results.append((out, lse, *grads))
    for one, many in zip(*results):
        torch.testing.assert_close(one, many, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_backend_choice_and_errors():
    b, hq, hkv, sq, sk, d = 1, 4, 2, 3, 5, 8
    q, k, v, q_pos, k_pos, q_seg, k_seg = make_case(10, b, hq, hkv, sq, sk, d, "plain")
    out, lse = torch.zeros(b, hq, sq, d), torch.full((b, hq, sq), float("-inf"))
    assert _backend.resolve(BA._FWD, torch.device("cpu"), "auto", BA.BACKENDS) == "torch"   # no warning: it IS the op
    with pytest.raises(ValueError, match="no cpp kernel"):
        BA.block_attention_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, True, 0.3, out, lse, backend="cpp")
    with pytest.raises(ValueError, match="block_attention_forward: k, v .* dividing q's 4"):
        BA.block_attention_forward(q, k[:, :1].expand(1, 3, sk, d), v[:, :1].expand(1, 3, sk, d), q_pos, k_pos,
                                   q_seg, k_seg, True, 0.3, out, lse)
    with pytest.raises(ValueError, match="k_seg has shape"):
        BA.block_attention_forward(q, k, v, q_pos, k_pos, q_seg, k_seg[:, :2], True, 0.3, out, lse)
    with pytest.raises(TypeError, match="q_pos has dtype int32"):
        BA.block_attention_forward(q, k, v, q_pos.int(), k_pos, q_seg, k_seg, True, 0.3, out, lse)
    with pytest.raises(TypeError, match="lse has dtype bfloat16"):
        BA.block_attention_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, True, 0.3, out, lse.bfloat16())
    with pytest.raises(TypeError, match="v has dtype bfloat16"):
        BA.block_attention_forward(q, k, v.bfloat16(), q_pos, k_pos, q_seg, k_seg, True, 0.3, out, lse)
    grads = [torch.zeros(t.shape) for t in (q, k, v)]
    with pytest.raises(ValueError, match="dk has shape"):
        BA.block_attention_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, True, 0.3, lse, torch.zeros(q.shape),
                                    torch.zeros(lse.shape), grads[0], grads[1][:, :, :2].contiguous(), grads[2])
    with pytest.raises(ValueError, match="dout has shape"):
        BA.block_attention_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, True, 0.3, lse, torch.zeros(1, 4, 3, 4),
                                    torch.zeros(lse.shape), *grads)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["plain", "padding", "packed"])
def test_cpu_flash_kernels_equal_the_reference(causal, case):
    """The CPU path of the op (ATen's flash kernels, fed the mask as a bias) against the torch reference:
    a block merged into a running result, and its backward from the final out/lse."""
    from parallel_layers.ops import block_attention_cpu
    from parallel_layers.ops.block_attention import (
        reference_block_attention_backward,
        reference_block_attention_forward,
    )

    torch.manual_seed(0)
    b, hq, hkv, sq, sk, d = 2, 4, 2, 24, 20, 8
    q, k, v = torch.randn(b, hq, sq, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)
    q_pos, k_pos = torch.arange(10, 10 + sq), torch.arange(sk)
    q_seg, k_seg = torch.zeros(b, sq, dtype=torch.int64), torch.zeros(b, sk, dtype=torch.int64)
    if case == "padding":
        k_seg[0, :12] = -1
        q_seg[1, :3] = -1
    elif case == "packed":
        q_seg[:, 8:] = 1
        k_seg[:, 15:] = 1
    start_out, start_lse = torch.randn(b, hq, sq, d), torch.randn(b, hq, sq)
    start_lse[0, :, :2] = float("-inf")
    start_out[0, :, :2] = 0
    got = (start_out.clone(), start_lse.clone())
    want = (start_out.clone(), start_lse.clone())
    block_attention_cpu.forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, 0.3, *got)
    reference_block_attention_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, 0.3, *want)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
    assert torch.allclose(got[1][torch.isfinite(want[1])], want[1][torch.isfinite(want[1])], atol=1e-5)
    out, lse = want
    dout = torch.randn(b, hq, sq, d)
    delta = (dout * out).sum(-1)
    grads = [[torch.zeros(b, hq, sq, d), torch.zeros(b, hkv, sk, d), torch.zeros(b, hkv, sk, d)] for _ in range(2)]
    block_attention_cpu.backward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, 0.3, lse, dout, out, *grads[0])
    reference_block_attention_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, 0.3, lse, dout, delta, *grads[1])
    for a, r in zip(*grads):
        assert torch.isfinite(a).all() and torch.allclose(a, r, atol=1e-5)


@pytest.mark.parametrize("owner", [0, 1, 2, 3])
def test_cpu_flash_kernels_on_zigzag_blocks_build_no_mask(owner):
    """One segment, no padding: a zigzag block is cut into fully visible and plainly causal pieces (no mask
    built) and still equals the reference, forward and backward."""
    from parallel_layers.context_parallel.layout import zigzag_index
    from parallel_layers.ops import block_attention_cpu
    from parallel_layers.ops.block_attention import (
        reference_block_attention_backward,
        reference_block_attention_forward,
    )

    torch.manual_seed(1)
    b, hq, hkv, d, seq, cp, rank = 2, 4, 2, 8, 64, 4, 1
    q_pos, k_pos = zigzag_index(seq, cp, rank), zigzag_index(seq, cp, owner)
    pieces = block_attention_cpu._pieces(q_pos, k_pos, torch.zeros(b, 16, dtype=torch.int64),
                                         torch.zeros(b, 16, dtype=torch.int64), True)
    assert pieces and all(isinstance(mode, str) for *_, mode in pieces), pieces
    q, k, v = torch.randn(b, hq, 16, d), torch.randn(b, hkv, 16, d), torch.randn(b, hkv, 16, d)
    seg = torch.zeros(b, 16, dtype=torch.int64)
    got = (torch.zeros(b, hq, 16, d), torch.full((b, hq, 16), float("-inf")))
    want = (torch.zeros(b, hq, 16, d), torch.full((b, hq, 16), float("-inf")))
    block_attention_cpu.forward(q, k, v, q_pos, k_pos, seg, seg, True, 0.3, *got)
    reference_block_attention_forward(q, k, v, q_pos, k_pos, seg, seg, True, 0.3, *want)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
    out, lse = want
    dout = torch.randn(b, hq, 16, d)
    grads = [[torch.zeros(b, hq, 16, d), torch.zeros(b, hkv, 16, d), torch.zeros(b, hkv, 16, d)] for _ in range(2)]
    block_attention_cpu.backward(q, k, v, q_pos, k_pos, seg, seg, True, 0.3, lse, dout, out, *grads[0])
    reference_block_attention_backward(q, k, v, q_pos, k_pos, seg, seg, True, 0.3, lse, dout,
                                       (dout * out).sum(-1), *grads[1])
    for a, r in zip(*grads):
        assert torch.allclose(a, r, atol=1e-5)
