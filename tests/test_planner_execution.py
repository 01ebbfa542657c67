"""How the planner prices a step's execution beside its layout (``Request.compiled``, ``Request.overlap_dp``):
the fused tally of :class:`~parallel_layers.planner.accounting.OpTally` on hand-made op chains whose fused
bytes are known, and the overlapped data-parallel collectives against the unoverlapped ones."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel_layers.composition.layout import Layout
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.planner import Request, load_profile, predict
from parallel_layers.planner.accounting import OpTally

N = 256 * 1024                  # elements of each fp32 tensor below: 1 MiB
MB = N * 4


def _meta(*shape):
    return torch.zeros(*shape, device="meta")


def test_a_fused_chain_reads_its_input_once_and_writes_what_the_matmul_reads():
    x, w = _meta(512, 512), _meta(512, 512)
    with OpTally() as tally:
        out = ((x * 2) + 1).exp() @ w          # three elementwise ops, then a matmul: one kernel and the GEMM
        tally.end_phase(forward=False)
    assert tally.traffic == 6 * MB            # eager: each op reads and writes 1 MiB
    assert tally.fused_traffic == 2 * MB      # fused: x read once, the exp written for the matmul
    assert (tally.ops, tally.fused_ops) == (4, 2)
    del out


def test_a_tensor_used_across_a_matmul_is_written_once_and_read_again():
    x, w = _meta(512, 512), _meta(512, 512)
    with OpTally() as tally:
        h = x * 2
        a = h @ w
        r = a + h                             # h kept across the matmul: written, then read by the next kernel
        del h, a
        tally.end_phase(forward=False)        # r outlives the backward: written
    # x read, h written, a and h read, r written
    assert tally.fused_traffic == 5 * MB
    del r


def test_what_a_forward_keeps_for_backward_is_charged_once_when_backward_reads_it():
    x = _meta(512, 512).requires_grad_()
    with OpTally() as tally:
        y = (x * 3).sin()                     # sin keeps its input for backward: recomputed, never written
        loss = y.sum()
        tally.end_phase(forward=True)
        forward = tally.fused_traffic
        loss.backward()
        tally.end_phase(forward=False)
    assert forward == MB                      # x read (the sum's scalar result: 4 bytes, below)
    backward = tally.fused_traffic - forward
    # the kept x * 3 (1 MiB: its recomputation's read) and x.grad written (1 MiB); a few scalars beside
    assert 2 * MB <= backward <= 2 * MB + 64, backward
    del y


@pytest.fixture(scope="module")
def zero3():
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=64, max_seq_len=64)
    req = Request(cfg, world=4, global_batch=16, seq_len=64, memory_bytes=1e12)
    lay = Layout(dp=4, zero=3, num_microbatches=2)
    prof = load_profile("h100")
    cache: dict = {}
    return req, lay, prof, cache


def test_overlapped_collectives_are_hidden_up_to_the_compute_and_one_call(zero3):
    req, lay, prof, cache = zero3
    plain = predict(req, lay, prof, cache)
    overlapped = predict(dataclasses.replace(req, overlap_dp=True), lay, prof, cache)
    comm = plain.time_terms["dp_reduce"] + plain.time_terms["zero3_gather"]
    exposed = overlapped.time_terms["dp_reduce"] + overlapped.time_terms["zero3_gather"]
    assert 0 < exposed < comm
    assert exposed >= comm - plain.time_terms["pipeline"] - 1e-12
    for term in ("pipeline", "optimizer", "tied"):
        assert overlapped.time_terms[term] == plain.time_terms[term]
    assert overlapped.peak_bytes == plain.peak_bytes


def test_a_compiled_step_moves_less_than_the_eager_one(zero3):
    req, lay, prof, cache = zero3
    eager = predict(req, lay, prof, cache)
    compiled = predict(dataclasses.replace(req, compiled=True), lay, prof, cache)
    assert compiled.time_terms["pipeline"] < eager.time_terms["pipeline"]
    assert compiled.peak_bytes < eager.peak_bytes         # elementwise results recomputed, not kept


def test_the_cli_and_layout_auto_say_how_the_step_runs():
    """``plan --compiled --overlap-dp --sequence-parallel`` reach the request; ``Parallel3D(layout="auto")`` passes
    its compile and sequence-parallel settings to the planner's child."""
    from parallel_layers.composition.layout import Auto
    from parallel_layers.planner.cli import build_parser, request_of
    args = build_parser().parse_args(["--gpt", "2,64,4,256", "--compiled", "--overlap-dp", "--sequence-parallel"])
    req = request_of(args)
    assert (req.compiled, req.overlap_dp, req.sequence_parallel) == (True, True, True)
    plain = request_of(build_parser().parse_args(["--gpt", "2,64,4,256"]))
    assert (plain.compiled, plain.overlap_dp, plain.sequence_parallel) == (False, False, False)
    assert Auto(compiled=True, sequence_parallel=True).sequence_parallel
