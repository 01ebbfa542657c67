"""Context-parallel attention alone (ring and Ulysses) against single-process attention: outputs and
dQ/dK/dV of every rank's shard within 1e-5 (fp32) at cp 2 and 4, causal and not, grouped-query heads,
left padding, packed variable-length sequences, and a shard whose keys are all masked (zeros, not NaN)."""
import math

import pytest
import torch
import torch.nn.functional as F

from parallel_layers.context_parallel import (
    context_parallel_attention,
    dense_attention,
    segments,
    shard,
    visible,
    zigzag_index,
)
from parallel_layers.context_parallel.blocks import block_attention, block_attention_backward, merge

B, HQ, HKV, S, D = 2, 4, 2, 16, 8


def _inputs(seed=0, hkv=HKV):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=gen)
    k = torch.randn(B, hkv, S, D, generator=gen)
    v = torch.randn(B, hkv, S, D, generator=gen)
    dout = torch.randn(B, HQ, S, D, generator=gen)
    return q, k, v, dout


def _segments(case):
    if case == "plain":
        return segments(B, S)
    if case == "padding":                       # left padding of 5 on row 0
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :5] = 0
        return segments(B, S, attention_mask=mask)
    if case == "packed":                        # row 0: sequences of 3, 7, 6; row 1: 10, 6
        pos = torch.cat([torch.cat([torch.arange(3), torch.arange(7), torch.arange(6)])[None],
                         torch.cat([torch.arange(10), torch.arange(6)])[None]])
        return segments(B, S, position_ids=pos)
    if case == "masked_shard":                  # row 0's first 12 tokens padding: at cp 4 rank 0's and
        mask = torch.ones(B, S, dtype=torch.long)   # rank 1's first chunks see no key at all
        mask[0, :12] = 0
        return segments(B, S, attention_mask=mask)
    raise ValueError(case)


def _reference(q, k, v, dout, seg, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(S)
    out = dense_attention(q, k, v, visible(pos, pos, seg, seg, causal), D ** -0.5)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def test_reference_equals_sdpa_where_a_key_is_visible():
    q, k, v, _ = _inputs()
    seg = _segments("padding")
    pos = torch.arange(S)
    vis = visible(pos, pos, seg, seg, True)
    ours = dense_attention(q, k, v, vis, D ** -0.5)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=vis[:, None])
    rows = vis.any(-1)[:, None, :, None].expand_as(ours)
    assert torch.allclose(ours[rows], want[rows], atol=1e-6)
    assert torch.equal(ours[~rows], torch.zeros_like(ours[~rows]))


def test_blocks_merged_equal_the_whole_and_their_backward_too():
    q, k, v, dout = _inputs()
    seg = _segments("packed")
    pos = torch.arange(S)
    vis = visible(pos, pos, seg, seg, True)
    out, lse = block_attention(q, k, v, vis, 0.3)
    a_out, a_lse = block_attention(q, k[:, :, :6], v[:, :, :6], vis[:, :, :6], 0.3)
    b_out, b_lse = block_attention(q, k[:, :, 6:], v[:, :, 6:], vis[:, :, 6:], 0.3)
    m_out, m_lse = merge(a_out, a_lse, b_out, b_lse)
    assert torch.allclose(m_out, out, atol=1e-6) and torch.allclose(m_lse, lse, atol=1e-6)
    delta = (dout * out).sum(-1)
    dq, dk, dv = block_attention_backward(q, k, v, vis, 0.3, out, lse, dout, delta)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    dense_attention(qr, kr, vr, vis, 0.3).backward(dout)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert torch.allclose(got, want, atol=1e-5)


def body_cp_attention(rank, world, method, causal, case, hkv):
    from parallel_layers.testing import cached_mesh

    group = cached_mesh(dp=world).dp_group        # the cp group's role: every rank a shard of one sequence
    q, k, v, dout = _inputs(hkv=hkv)
    seg = _segments(case)
    want = _reference(q, k, v, dout, seg, causal)
    mine = [shard(t, world, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*mine, group=group, segments=seg, causal=causal, method=method)
    out.backward(shard(dout, world, rank, dim=2))
    got = (out.detach(),) + tuple(t.grad for t in mine)
    errs = [(g - shard(w, world, rank, dim=2)).abs().max().item() for g, w in zip(got, want)]
    finite = all(bool(torch.isfinite(g).all()) for g in got)
    return {"errs": errs, "finite": finite}


CASES = [(m, c, case) for m in ("ring", "ulysses") for c in (True, False) for case in ("plain", "padding", "packed")]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method,causal,case", CASES + [("ring", True, "masked_shard"),
                                                        ("ulysses", True, "masked_shard")])
def test_context_parallel_attention_matches_single_process(dist_pools, world, method, causal, case):
    hkv = 4 if method == "ulysses" and world == 4 else HKV
    for rank, out in enumerate(dist_pools(world).run(body_cp_attention, method, causal, case, hkv)):
        assert out["finite"], f"rank {rank}: non-finite output or gradient"
        assert max(out["errs"]) < 1e-5, f"rank {rank}: out/dq/dk/dv max errors {out['errs']}"


def body_ulysses_heads(rank, world):
    from parallel_layers.testing import cached_mesh
    q, k, v, _ = _inputs()
    try:
        context_parallel_attention(shard(q, world, rank, 2), shard(k, world, rank, 2), shard(v, world, rank, 2),
                                   group=cached_mesh(dp=world).dp_group, segments=segments(B, S), method="ulysses")
    except ValueError as exc:
        return str(exc)
    return None


def test_ulysses_names_the_heads_cp_must_divide(dist_pools):
    for msg in dist_pools(4).run(body_ulysses_heads):
        assert msg is not None and "cp=4 must divide the key/value heads (2; query heads 4)" in msg


def test_zigzag_balances_causal_work():
    cp = 4
    work = []
    for r in range(cp):
        pos = zigzag_index(64, cp, r)
        work.append(int((pos + 1).sum()))           # keys a causal query at position p sees: p + 1
    assert max(work) == min(work), work
    assert sorted(torch.cat([zigzag_index(64, cp, r) for r in range(cp)]).tolist()) == list(range(64))
    assert math.isclose(1.0, min(work) / max(work))


def body_count_messages(rank, world, method):
    """Every message one attention forward + backward sends from this rank: ``(count, bytes)``."""
    import torch.distributed as dist

    from parallel_layers.testing import cached_mesh

    group = cached_mesh(dp=world).dp_group
    sent = {"p2p": [], "all_to_all": []}
    real_batch, real_a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch(ops):
        sent["p2p"] += [op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend]
        return real_batch(ops)

    def a2a(out, inp, *args, **kwargs):
        sent["all_to_all"].append(inp.numel() * inp.element_size() * (world - 1) // world)   # what leaves the rank
        return real_a2a(out, inp, *args, **kwargs)

    dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a
    try:
        q, k, v, dout = _inputs(hkv=4 if method == "ulysses" else HKV)
        mine = [shard(t, world, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*mine, group=group, segments=segments(B, S), method=method)
        out.backward(shard(dout, world, rank, dim=2))
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = real_batch, real_a2a
    return {k: (len(v), sum(v)) for k, v in sent.items()}


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_messages_per_call_are_what_the_docstrings_predict(dist_pools, method):
    cp, n = 4, S // 4
    for out in dist_pools(4).run(body_count_messages, method):
        if method == "ring":
            kv = 2 * B * HKV * n * D * 4                       # K and V of one block (fp32 here)
            # forward: cp - 1 blocks passed on; backward: cp - 1 blocks with their fp32 accumulators, and
            # the accumulators' last hop home
            assert out["p2p"] == (3 * (cp - 1) + 1, (cp - 1) * kv + (cp - 1) * 2 * kv + kv), out
            assert out["all_to_all"] == (0, 0)
        else:
            hq = hkv = 4
            per_head = B * n * D * 4 * (cp - 1) // cp          # of one head's shard, what leaves the rank
            # forward: q, k, v, out; backward: the four again
            assert out["all_to_all"] == (8, 2 * (2 * hq + 2 * hkv) * per_head), out
            assert out["p2p"] == (0, 0)
