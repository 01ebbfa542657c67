"""ZeRO-Offload (``offload="cpu"``): a CUDA model's optimizer shard in pinned host memory, stepped by the CPU
kernel. The CUDA tests (``cuda`` in their names: ``make gpu-check`` runs them) skip without a GPU; what runs
on any machine is the part that needs no device: the refusal on a CPU model, the chunking of the step, and
the schedule that decides when a gradient can cross to the host (which buckets and units a real backward
has reduced at each gradient hook, on gloo ranks)."""
import pytest
import torch

from parallel_layers.testing import cached_mesh

CFG = dict(vocab_size=64, n_layer=3, n_head=2, d_model=32, max_seq_len=16, bias=False)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
LOSS_SCALE = 1024.0
STATES = ("master", "exp_avg", "exp_avg_sq")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="ZeRO-Offload moves state off a CUDA device; no CUDA here")


def _gpt(dtype=torch.float32, seed=0, device="cpu"):
    from parallel_layers.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**CFG)).to(dtype=dtype, device=device)


def _batches(n, device="cpu", batch=4):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (batch, 12), generator=gen)
        out.append((x.to(device), torch.roll(x, -1, dims=1).to(device)))
    return out


# ---------------------------------------------------------------------------------------------- any machine
def test_split_spans_cuts_runs_into_chunks_in_order():
    from parallel_layers.zero.host_offload import segments_of, split_spans

    assert split_spans([(0, 10), (12, 13), (20, 31)], 4) == [(0, 4), (4, 8), (8, 10), (12, 13), (20, 24),
                                                              (24, 28), (28, 31)]
    assert split_spans([], 4) == []
    assert segments_of([3, 0, 5]) == [(0, 3), (3, 3), (3, 8)]
    with pytest.raises(ValueError, match="chunk_numel"):
        split_spans([(0, 1)], 0)


def body_refusals(rank, world):
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer, ZeroStage3, ZeroStage3Optimizer

    group = cached_mesh(dp=2).dp_group
    errors = []
    for make in (lambda: ZeroOptimizer(DataParallel(_gpt(), group, reduce_op="reduce_scatter"), stage=2,
                                       offload="cpu"),
                 lambda: ZeroStage3Optimizer(ZeroStage3(_gpt(), group), offload="cpu", offload_delayed_update=True),
                 lambda: ZeroStage3Optimizer(ZeroStage3(_gpt(), group), offload_delayed_update=True)):
        try:
            make()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_offload_cpu_on_a_cpu_model_says_there_is_nothing_to_move(dist_pools):
    for zero2, zero3_delayed, delayed_alone in dist_pools(2).run(body_refusals):
        assert zero2.startswith("ZeroOptimizer") and "nothing to move" in zero2
        assert zero3_delayed.startswith("ZeroStage3Optimizer") and "nothing to move" in zero3_delayed
        assert "offload_delayed_update" in delayed_alone and "offload='cpu'" in delayed_alone


def body_reduction_schedule(rank, world):
    """What the offloaded optimizers poll from their gradient hooks, seen from a hook registered the same
    way on a real backward: ZeroStage3's reduced units and DataParallel's launched buckets."""
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroStage3
    from parallel_layers.zero.host_offload import LaunchedBuckets, ReducedUnits

    group = cached_mesh(dp=2).dp_group
    x, y = _batches(1)[0]
    x, y = x.chunk(2)[rank], y.chunk(2)[rank]
    out = {}

    z = ZeroStage3(_gpt(), group, min_unit_numel=0)
    units, seen = ReducedUnits(z), []
    for p in z.module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.extend(("backward", i) for i in units.new()))
    for _ in range(2):                               # the timeline is new at every forward
        z(x, y)[1].backward()
        seen.extend(("after", i) for i in units.new())
        seen.append(("step", None))
        z.zero_grad()
    reduce_order = [e[1] for e in z.timeline if e[0] == "reduce_wait"]
    out["zero3"] = (seen, reduce_order, len(z.units))

    dp = DataParallel(_gpt(), group, reduce_op="reduce_scatter", bucket_cap_mb=0.01, first_bucket_cap_mb=0.01,
                      rebuild_bucket_order=False)
    buckets, seen = LaunchedBuckets(dp), []
    for p in dp.buffer.params:                       # after DataParallel's own hooks, as the optimizer's
        p.register_post_accumulate_grad_hook(lambda p: seen.extend(("backward", bi) for bi, _ in buckets.new()))
    tokens = [buckets.sync_token()]
    for _ in range(2):
        dp(x, y)[1].backward()
        seen.extend(("after", bi) for bi, _ in buckets.new())
        seen.append(("step", None))
        tokens.append(buckets.sync_token())
        dp.zero_grad()
    out["zero2"] = (seen, len(dp.buffer.buckets), [tokens[i] is not tokens[i + 1] for i in range(2)])
    return out


def test_gradients_are_reported_as_each_unit_or_bucket_is_reduced(dist_pools):
    """The host copy of a unit's (a bucket's) gradient is queued from the gradient hook that follows its
    reduction: during backward for all but the units reduced at its very end."""
    for out in dist_pools(2).run(body_reduction_schedule):
        seen, reduce_order, n_units = out["zero3"]
        steps = [[], []]
        k = 0
        for when, i in seen:
            if when == "step":
                k += 1
            else:
                steps[k].append((when, i))
        for reported in steps:
            assert sorted(i for _, i in reported) == list(range(n_units))      # every unit, once per backward
            during = [i for when, i in reported if when == "backward"]
            assert len(during) >= n_units - 2, reported                       # all but the end's
        assert [i for _, i in steps[1]] == reduce_order                       # in the order they were reduced

        seen, n_buckets, new_sync = out["zero2"]
        assert n_buckets > 2 and all(new_sync)
        per_step = [[], []]
        k = 0
        for when, bi in seen:
            if when == "step":
                k += 1
            else:
                per_step[k].append((when, bi))
        for reported in per_step:
            assert [bi for _, bi in reported] == list(range(n_buckets))        # launched in bucket order
            assert sum(when == "backward" for when, _ in reported) >= n_buckets - 1, reported


# ---------------------------------------------------------------------------------------------- CUDA
def _wrapper(model, stage):
    """Stages 1/2: DataParallel(reduce_scatter) in small buckets; 3: ZeroStage3, a unit per block (dp 1)."""
    group = cached_mesh(dp=1).dp_group
    if stage == 3:
        from parallel_layers.zero import ZeroStage3

        return ZeroStage3(model, group, min_unit_numel=0)
    from parallel_layers.data_parallel.ddp import DataParallel

    return DataParallel(model, group, reduce_op="reduce_scatter", bucket_cap_mb=0.02, first_bucket_cap_mb=0.02)


def _optimizer(wrapper, stage, **kw):
    from parallel_layers.zero import ZeroOptimizer, ZeroStage3Optimizer

    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=lambda name, p: p.ndim < 2, **kw)
    return ZeroStage3Optimizer(wrapper, **hyper) if stage == 3 else ZeroOptimizer(wrapper, stage=stage, **hyper)


def _wrap(model, stage, **kw):
    wrapper = _wrapper(model, stage)
    return wrapper, _optimizer(wrapper, stage, **kw)


def _step(wrapper, opt, batch, scaled=False, found_inf=None):
    x, y = batch
    _, loss = wrapper(x, y)
    if scaled:
        (loss * LOSS_SCALE).backward()
        opt.clip_grad_norm_(1.0, inv_scale=torch.tensor([1 / LOSS_SCALE], device=x.device))
        opt.step(grad_scale=LOSS_SCALE, found_inf=found_inf)
    else:
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
    opt.zero_grad()


def _params(wrapper, stage):
    if stage == 3:
        return wrapper.shard_buffer.detach().float().cpu()
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in wrapper.module.parameters()])


def _state(opt):
    opt.wait_for_step()
    return torch.cat([getattr(opt, k).detach().float().reshape(-1).cpu() for k in STATES])


def _close(new, ref, start):
    """How far ``new`` is from ``ref`` as (L2 difference over L2 of what training moved, max difference over
    the largest move). The CPU kernel rounds differently from the GPU kernels (Triton's FMAs, a division
    where the C++ kernel multiplies by a reciprocal): measured on CPU (the Triton kernel interpreted against
    the C++ one, this GPT, 5 steps) the masters differ by 5e-7 (fp32), 1.4e-4 (fp16) of the move; a GPU
    backward may add non-deterministic summation order (embedding backward's atomics)."""
    diff, moved = new - ref, ref - start
    return (diff.norm() / moved.norm()).item(), (diff.abs().max() / moved.abs().max()).item()


def body_cuda_parity(rank, world, stage, dtype):
    # deterministic backward (the embedding's, by sorting instead of atomics): both runs then hand the optimizers
    # the same gradients, so what differs is the optimizers alone
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _cuda_parity_runs(stage, dtype)
    finally:
        torch.use_deterministic_algorithms(was)


def _cuda_parity_runs(stage, dtype):
    scaled = dtype == torch.float16
    out, allocated = {}, {}
    for kind in ("memory", "cpu"):
        wrapper = _wrapper(_gpt(dtype, device="cuda"), stage)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()          # what the optimizer adds on the device
        opt = _optimizer(wrapper, stage, **({} if kind == "memory" else dict(offload="cpu")))
        torch.cuda.synchronize()
        allocated[kind] = torch.cuda.memory_allocated() - before
        start = _params(wrapper, stage)
        skipped_untouched = None
        for i, batch in enumerate(_batches(5, "cuda")):
            inf = torch.ones(1, device="cuda") if scaled and i == 2 else None
            if kind == "cpu" and inf is not None:
                before_skip = (_params(wrapper, stage), _state(opt))
            _step(wrapper, opt, batch, scaled=scaled, found_inf=inf)
            if kind == "cpu" and inf is not None:
                after = (_params(wrapper, stage), _state(opt))
                skipped_untouched = all(torch.equal(a, b) for a, b in zip(before_skip, after))
        report = opt.memory_report()
        out[kind] = (_params(wrapper, stage), _state(opt), opt.steps_taken, report)
        if kind == "cpu":
            out["host"] = (skipped_untouched, dict(opt.host_shard.stats), opt.shard_numel if stage != 3 else
                           wrapper.shard_numel, opt.master.is_pinned(), opt.master.device.type)
            opt.close_offload()
    return out, start, allocated


@needs_cuda
@pytest.mark.parametrize("stage,dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float32),
                                         (1, torch.float16), (2, torch.float16), (3, torch.float16),
                                         (2, torch.bfloat16), (3, torch.bfloat16)])
def test_host_offload_cuda_trains_as_in_device_memory(dist_pools, stage, dtype):
    out, start, allocated = dist_pools(1).run(body_cuda_parity, stage, dtype)[0]
    (p_mem, s_mem, steps_mem, _), (p_cpu, s_cpu, steps_cpu, rep_cpu) = out["memory"], out["cpu"]
    skipped_untouched, stats, shard_numel, pinned, state_device = out["host"]
    scaled = dtype == torch.float16
    assert steps_mem == steps_cpu == (4 if scaled else 5)
    rel, worst = _close(p_cpu, p_mem, start)
    assert rel <= 1e-3 and worst <= 0.02, (rel, worst)
    assert (s_cpu - s_mem).norm() <= 1e-3 * s_mem.norm()
    if scaled:
        assert skipped_untouched                        # the inf step stepped nothing and copied nothing back
    # the state lives in pinned host memory: the device holds none of it
    assert state_device == "cpu" and pinned
    assert rep_cpu["offload_bytes"] >= 12 * shard_numel and rep_cpu["optimizer_bytes"] == 0
    staging = 2 * shard_numel if stage != 3 and dtype != torch.float32 else 0    # the bf16/fp16 all-gather source
    assert allocated["cpu"] <= staging + (1 << 20), allocated
    assert allocated["memory"] >= 8 * shard_numel, allocated
    assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] > 0 and stats["steps"] == steps_cpu


def body_cuda_delayed(rank, world, dtype):
    """Delayed parameter update against its definition run in device memory: the gradient of step t is
    computed on the parameters of step t - 2 (the update of step t - 1 is still on the CPU) and applied to
    those of step t - 1."""
    batches = _batches(5, "cuda")
    z, opt = _wrap(_gpt(dtype, device="cuda"), 3)
    start = _params(z, 3)
    prev = z.shard_buffer.clone()
    for batch in batches:
        cur = z.shard_buffer.clone()
        z.shard_buffer.copy_(prev)              # forward and backward on the parameters one update stale
        _, loss = z(*batch)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        z.shard_buffer.copy_(cur)               # the update lands on the current ones
        opt.step()
        opt.zero_grad()
        prev = cur
    ref = (_params(z, 3), _state(opt))

    z2, opt2 = _wrap(_gpt(dtype, device="cuda"), 3, offload="cpu", offload_delayed_update=True)
    stale_first = None
    for i, batch in enumerate(batches):
        if i == 1:                              # the first step's update is still on the CPU
            stale_first = torch.equal(_params(z2, 3), start)
        _step(z2, opt2, batch)
    in_flight = opt2.host_shard.in_flight
    opt2.wait_for_step()                        # applies the last step
    got = (_params(z2, 3), _state(opt2))
    opt2.close_offload()
    return ref, got, start, stale_first, in_flight


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_offload_cuda_delayed_update_applies_each_step_one_step_late(dist_pools, dtype):
    ref, got, start, stale_first, in_flight = dist_pools(1).run(body_cuda_delayed, dtype)[0]
    assert stale_first and in_flight
    rel, worst = _close(got[0], ref[0], start)
    assert rel <= 1e-3 and worst <= 0.02, (rel, worst)
    assert (got[1] - ref[1]).norm() <= 1e-3 * ref[1].norm()


def body_cuda_overlap(rank, world):
    z, opt = _wrap(_gpt(torch.bfloat16, device="cuda"), 3, offload="cpu")
    host = opt.host_shard
    host.timing = True
    total = sum(u.shard_numel for u in z.units) * z.grad_buffer.element_size()
    x, y = _batches(1, "cuda")[0]
    _, loss = z(x, y)
    loss.backward()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    during = host.stats["d2h_bytes"]
    opt.step()
    fraction = host.overlap_fraction(end)
    opt.close_offload()
    return during, host.stats["d2h_bytes"], total, fraction, len(z.units)


@needs_cuda
def test_host_offload_cuda_copies_gradients_while_backward_runs(dist_pools):
    during, copied, total, fraction, n_units = dist_pools(1).run(body_cuda_overlap)[0]
    assert n_units >= 4
    assert copied == total                  # every unit once
    assert 0 < during < total               # queued from backward's hooks, the last units by the step
    assert 0.0 <= fraction <= 1.0


# ---------------------------------------------------------------------------------------------- benchmarks
def test_cpu_adam_and_host_offload_benchmarks_smoke(capsys):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import cpu_adam, harness, host_offload

    rows = cpu_adam.collect("smoke", torch.device("cpu"))
    names = {r["case"] for r in rows}
    assert {"cpu_adamw_vs_torch_loop", "cpu_adamw_vs_torch_foreach"} <= names
    assert {r["threads"] for r in rows} == set(cpu_adam.thread_counts())
    for r in rows:
        assert set(r) <= set(harness.CSV_FIELDS)
        assert r["ours_median_ms"] > 0 and r["speedup"] > 0 and 0 < r["bw_fraction"] and r["copy_gbps"] > 0
    assert host_offload.main(["--smoke", "--no-csv"]) == 0
    if not CUDA:
        assert "nothing to move" in capsys.readouterr().out
