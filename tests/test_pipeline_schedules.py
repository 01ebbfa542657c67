"""Pipeline schedules as data: no processes, no model. Every schedule is built for several (p, m, v),
then every rank's instruction stream is run against the others by ``simulate`` (rendezvous messages,
FIFO per pair), which raises on deadlock, mismatched messages, a forward without its input or a
backward before its forward."""
import itertools

import pytest

from parallel_layers.pipeline.schedules import (
    Instr,
    ScheduleError,
    build_all,
    build_schedule,
    format_schedule,
    simulate,
    simulate_timing,
)
from parallel_layers.pipeline.stage import partition_layers

CASES = [(s, p, m, 1) for s in ("gpipe", "1f1b") for p in (1, 2, 3, 4) for m in (4, 5, 8) if s == "gpipe" or m >= p]
CASES += [("gpipe", 4, 1, 1), ("gpipe", 3, 2, 1)]
CASES += [("interleaved", p, m, v) for p in (1, 2, 4) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)]


def computes(stream):
    return [s for s in stream if isinstance(s, Instr)]


def messages(stream):
    return [i for s in stream if isinstance(s, tuple) for i in s]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_schedule_runs_without_deadlock_and_covers_everything(schedule, p, m, v):
    streams = build_all(schedule, p, m, v)
    stats = simulate(streams, num_chunks=v)          # raises ScheduleError on any violation
    for r, stream in enumerate(streams):
        comp = computes(stream)
        # m forwards and m backwards per chunk, every (mb, chunk) exactly once
        for op in ("F", "B"):
            got = sorted((i.mb, i.chunk) for i in comp if i.op == op)
            assert got == sorted(itertools.product(range(m), range(v))), (r, op)
        # every forward precedes its backward
        pos = {(i.op, i.mb, i.chunk): k for k, i in enumerate(comp)}
        assert all(pos[("F", mb, c)] < pos[("B", mb, c)] for mb in range(m) for c in range(v))
        # interleaved covers every virtual stage c * p + r
        assert {i.chunk * p + r for i in comp} == {c * p + r for c in range(v)}
    assert stats["forwards"] == [m * v] * p and stats["backwards"] == [m * v] * p


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_every_send_has_its_receive(schedule, p, m, v):
    streams = build_all(schedule, p, m, v)
    sends, recvs = [], []
    for r, stream in enumerate(streams):
        for i in messages(stream):
            stage = i.chunk * p + r
            if i.op == "SEND_ACT":
                sends.append(("act", i.mb, stage, stage + 1, i.peer))
            elif i.op == "SEND_GRAD":
                sends.append(("grad", i.mb, stage, stage - 1, i.peer))
            elif i.op == "RECV_ACT":
                recvs.append(("act", i.mb, stage - 1, stage, r))
            else:
                recvs.append(("grad", i.mb, stage + 1, stage, r))
    assert sorted(sends) == sorted(recvs)
    S = p * v
    if p > 1:  # one activation and one gradient per stage boundary and microbatch
        assert len(sends) == 2 * m * (S - 1)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 7), (4, 4), (4, 8), (4, 16)])
def test_1f1b_bounds_in_flight_microbatches(p, m):
    stats = simulate(build_all("1f1b", p, m))
    assert all(n <= p for n in stats["max_in_flight"]), stats
    assert stats["max_in_flight"] == [min(p - r, m) for r in range(p)]
    gpipe = simulate(build_all("gpipe", p, m))
    assert gpipe["max_in_flight"] == [m] * p          # what 1F1B saves


def test_1f1b_shape_warmup_steady_cooldown():
    ops = [f"{i.op}{i.mb}" for i in computes(build_schedule("1f1b", 4, 6, rank=1))]
    assert ops == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"]
    ops = [f"{i.op}{i.mb}" for i in computes(build_schedule("gpipe", 2, 3, rank=0))]
    assert ops == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_interleaved_order_matches_megatron():
    # p=2, v=2, m=4, rank 0: warm-up 2*(p-r-1) + (v-1)*p = 4 forwards
    ops = [f"{i.op}{i.mb}.{i.chunk}" for i in computes(build_schedule("interleaved", 2, 4, rank=0, num_chunks=2))]
    assert ops[:4] == ["F0.0", "F1.0", "F0.1", "F1.1"]
    assert ops[4:8] == ["F2.0", "B0.1", "F3.0", "B1.1"]


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 9)])
def test_compute_orders_reach_the_ideal_bubble_in_the_timing_model(p, m):
    # equal stages, free messages: GPipe and 1F1B leave (p-1)/(m+p-1) idle, interleaved (v chunks)
    # (p-1)/v of a stage's microbatch time, i.e. (p-1)/(v m + p-1) of the step
    ideal = (p - 1) / (m + p - 1)
    for schedule in ("gpipe", "1f1b"):
        out = simulate_timing(build_all(schedule, p, m), forward=1.0, backward=2.0)
        assert out["bubble"] == pytest.approx(ideal), schedule
        assert out["step"] == pytest.approx(3.0 * (m + p - 1))
    if m % p == 0:
        for v in (2, 4):
            out = simulate_timing(build_all("interleaved", p, m, v), v, forward=1.0, backward=2.0)
            assert out["bubble"] == pytest.approx((p - 1) / (v * m + p - 1)), v
    # a latency or a heavier last stage only adds idle time
    slow = simulate_timing(build_all("1f1b", p, m), latency=0.05)["bubble"]
    heavy = simulate_timing(build_all("1f1b", p, m), last_stage_extra=0.1)["bubble"]
    assert slow > ideal and heavy > ideal


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_forward_only_schedule_runs_every_forward_once_and_no_backward(schedule, p, m, v):
    # evaluation: the same layout, forwards only; no gradient messages, nothing held for a backward
    streams = build_all(schedule, p, m, v, forward_only=True)
    stats = simulate(streams, num_chunks=v, forward_only=True)
    S = p * v
    for _r, stream in enumerate(streams):
        comp = computes(stream)
        assert {i.op for i in comp} == {"F"}
        assert sorted((i.mb, i.chunk) for i in comp) == sorted(itertools.product(range(m), range(v)))
        assert all(i.op in ("SEND_ACT", "RECV_ACT") for i in messages(stream))
    assert stats["forwards"] == [m * v] * p and stats["backwards"] == [0] * p
    n_sends = sum(i.op == "SEND_ACT" for st in streams for i in messages(st))
    assert n_sends == (m * (S - 1) if p > 1 else 0)
    # the training simulator rejects it (microbatches never run backward), and the forward-only one
    # rejects a training schedule: the flag is checked, not ignored
    with pytest.raises(ScheduleError, match="never ran backward"):
        simulate(streams, num_chunks=v)
    with pytest.raises(ScheduleError, match="forward-only"):
        simulate(build_all(schedule, p, m, v), num_chunks=v, forward_only=True)


def test_forward_only_order_of_virtual_stages():
    # p=2, v=2, m=4: groups of p microbatches through chunk 0, then chunk 1 (the interleaved forward order)
    ops = [f"{i.mb}.{i.chunk}" for i in computes(build_schedule("interleaved", 2, 4, rank=1, num_chunks=2,
                                                                 forward_only=True))]
    assert ops == ["0.0", "1.0", "0.1", "1.1", "2.0", "3.0", "2.1", "3.1"]
    ops = [i.mb for i in computes(build_schedule("1f1b", 4, 6, rank=2, forward_only=True))]
    assert ops == list(range(6))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="1F1B needs at least as many microbatches as stages"):
        build_schedule("1f1b", 4, 3, rank=0)
    with pytest.raises(ValueError, match="num_microbatches divisible by the pipeline size"):
        build_schedule("interleaved", 4, 6, rank=0, num_chunks=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2, rank=0)
    with pytest.raises(ValueError, match="one chunk per rank"):
        build_schedule("gpipe", 2, 2, rank=0, num_chunks=2)


def test_simulator_catches_a_deadlock_and_a_mismatch():
    streams = build_all("1f1b", 2, 2)
    # rank 1 waits for microbatch 1 first: its neighbour sends 0 first -> mismatch
    swapped = [list(s) for s in streams]
    swapped[1][0] = (Instr("RECV_ACT", 1, 0, 0),)
    with pytest.raises(ScheduleError):
        simulate(swapped)
    # a receive that nobody sends -> deadlock
    stuck = [list(s) for s in streams]
    stuck[0].insert(0, (Instr("RECV_GRAD", 0, 0, 1),))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(stuck)


def test_schedule_prints():
    text = format_schedule(build_schedule("1f1b", 2, 2, rank=0))
    assert "Forward(mb=0, chunk=0)" in text and "SendAct(mb=0, chunk=0, ->1)" in text
    assert "RecvGrad(mb=0, chunk=0, <-1)" in text


def test_partition_layers():
    assert partition_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert partition_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert partition_layers(8, 3, boundaries=[1, 5]) == [(0, 1), (1, 5), (5, 8)]
    with pytest.raises(ValueError, match="do not divide into 3 stages"):
        partition_layers(8, 3, require_divisible=True)
    with pytest.raises(ValueError, match="boundaries"):
        partition_layers(8, 3, boundaries=[5, 1])


def _synthetic_timelines(schedule, p, m, v, cost, gap=0.0):
    """Timelines a perfect engine would record: the timing model's own execution, each instruction
    taking ``cost(rank, op, mb, chunk)`` and ``gap`` of engine time before it, messages free."""
    from parallel_layers.pipeline.timeline import Event, Timeline

    streams = build_all(schedule, p, m, v)
    durations = {(r, i.op, i.mb, i.chunk): cost(r, i.op, i.mb, i.chunk) + gap
                 for r in range(p) for i in computes(streams[r])}
    # replay once to get start times: run the model rank by rank with these durations
    S, now, pos, ready, tls = p * v, [0.0] * p, [0] * p, {}, [Timeline(r) for r in range(p)]
    while any(pos[r] < len(streams[r]) for r in range(p)):
        for r in range(p):
            while pos[r] < len(streams[r]):
                st = streams[r][pos[r]]
                if not isinstance(st, Instr):
                    pos[r] += 1
                    continue
                s = st.chunk * p + r
                need = [("F", st.mb, s - 1)] if st.op == "F" and s > 0 else \
                       [("B", st.mb, s + 1)] if st.op == "B" and s < S - 1 else []
                if any(k not in ready for k in need):
                    break
                t0 = max([now[r]] + [ready[k] for k in need])
                if t0 > now[r] + 1e-12:
                    tls[r].events.append(Event("W", st.mb, st.chunk, now[r], t0))
                d = durations[(r, st.op, st.mb, st.chunk)]
                tls[r].events.append(Event(st.op, st.mb, st.chunk, t0 + gap, t0 + d))
                now[r] = ready[(st.op, st.mb, s)] = t0 + d
                pos[r] += 1
    for t in tls:
        t.t_end = max(now)
    return tls


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 2, 8, 1), ("gpipe", 4, 4, 1), ("interleaved", 2, 4, 2)])
def test_bubble_breakdown_attributes_the_idle_time(schedule, p, m, v):
    from parallel_layers.pipeline import bubble_breakdown

    equal = lambda r, op, mb, c: 1.0 if op == "F" else 2.0   # noqa: E731
    # a perfect run: measured == ideal, nothing else
    b = bubble_breakdown(_synthetic_timelines(schedule, p, m, v, equal), schedule, m, v)
    assert b["measured"] == pytest.approx(b["ideal"]) and b["compute"] == pytest.approx(b["ideal"])
    assert abs(b["engine_overhead"]) < 1e-12 and abs(b["messages"]) < 1e-12
    # the last rank 30% slower: the excess is stage imbalance
    slow = lambda r, op, mb, c: equal(r, op, mb, c) * (1.3 if r == p - 1 else 1.0)   # noqa: E731
    b = bubble_breakdown(_synthetic_timelines(schedule, p, m, v, slow), schedule, m, v)
    assert b["imbalance_jitter"] > 0.01 and abs(b["messages"]) < 1e-12 and abs(b["engine_overhead"]) < 1e-12
    # engine time before every instruction shows up as engine overhead, not as imbalance
    b = bubble_breakdown(_synthetic_timelines(schedule, p, m, v, equal, gap=0.2), schedule, m, v)
    assert b["engine_overhead"] > 0.01 and abs(b["imbalance_jitter"]) < 1e-12 and abs(b["messages"]) < 1e-12
    assert b["ideal"] + b["imbalance_jitter"] + b["engine_overhead"] + b["messages"] == pytest.approx(b["measured"])


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (2, 6, 3)])
def test_interleaved_needs_paired_batches_under_nccl(p, m, v):
    """Under NCCL a batch completes only when its sends are taken too (one Work, one stream per rank):
    interleaved 1F1B with a batch between every two instructions deadlocks there, and pairing each
    steady-state forward with its backward (Megatron's send_forward_backward_recv_forward_backward)
    does not."""
    from parallel_layers.pipeline.schedules import add_communication, interleaved_order

    unpaired = [add_communication(interleaved_order(p, m, r, v), p, r, v) for r in range(p)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(unpaired, num_chunks=v)
    simulate(build_all("interleaved", p, m, v), num_chunks=v)


def test_a_message_cost_occupies_the_rank_that_sends_or_receives():
    """``message_cost``: each send and receive costs its own rank that time (a CPU host moving gloo messages):
    a two-stage GPipe step of one micro-batch (F0 send, F1, B1 send, B0: four messages on its one path) takes
    4 c longer; the ranks' compute (busy) is unchanged."""
    streams = build_all("gpipe", 2, 1)
    plain = simulate_timing(streams, forward=1.0, backward=2.0)
    paid = simulate_timing(streams, forward=1.0, backward=2.0, message_cost=0.25)
    assert paid["step"] == pytest.approx(plain["step"] + 4 * 0.25)
    assert paid["busy"] == plain["busy"]
