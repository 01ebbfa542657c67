"""ZeRO-Infinity (``offload="disk"``) on real gloo ranks, dp 2: bit-identical to the same stage in memory,
resident memory bounded by the buffers, bad state files refused before any step, a failed write loses
nothing a checkpoint had, and checkpoints move between offloaded and in-memory optimizers."""
import copy
import gc
import hashlib
import os
import shutil

import pytest
import torch
import torch.nn as nn

from parallel_layers.testing import cached_mesh

CFG = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16, bias=False)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
TINY_MB = 0.05          # 1024-element sub-groups: a ~14k-element shard streams in 14 of them
LOSS_SCALE = 1024.0
STATES = ("master", "exp_avg", "exp_avg_sq")


def _gpt(dtype=torch.float32, seed=0, **cfg):
    from parallel_layers.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**dict(CFG, **cfg))).to(dtype)
    model.wpe.weight.requires_grad_(False)        # frozen: never stepped, never read or written
    return model


def _wrap(model, stage, root=None, buffer_mb=TINY_MB, rebuild=None):
    """(wrapper, optimizer): stages 1/2 over DataParallel(reduce_scatter), 3 over ZeroStage3; norms and
    biases without weight decay (runs mixing two weight decays), offloaded to ``root`` when given."""
    group = cached_mesh(dp=2).dp_group
    kw = {} if root is None else dict(offload="disk", offload_dir=root, offload_buffer_mb=buffer_mb)
    no_decay = lambda name, p: p.ndim < 2       # noqa: E731
    if stage == 3:
        from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

        z = ZeroStage3(model, group)
        return z, ZeroStage3Optimizer(z, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=no_decay, **kw)
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer

    dp = DataParallel(model, group, reduce_op="reduce_scatter", bucket_cap_mb=0.02, first_bucket_cap_mb=0.02,
                      rebuild_bucket_order=rebuild)
    return dp, ZeroOptimizer(dp, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=no_decay, **kw)


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (8, 12), generator=gen)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _step(rank, wrapper, opt, batch, scaled=False, found_inf=None):
    """Forward, backward, global clipping, step, zero_grad; ``scaled``: loss scaling as AMP does it."""
    x, y = batch
    _, loss = wrapper(x.chunk(2)[rank], y.chunk(2)[rank])
    if scaled:
        (loss * LOSS_SCALE).backward()
        opt.clip_grad_norm_(1.0, inv_scale=torch.tensor([1 / LOSS_SCALE]))
        opt.step(grad_scale=LOSS_SCALE, found_inf=found_inf)
    else:
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
    opt.zero_grad()


def _params(wrapper, stage):
    if stage == 3:
        return [wrapper.shard_buffer.clone()]
    return [p.detach().clone() for p in wrapper.module.parameters()]


def _states(opt):
    return [getattr(opt, k).clone() for k in STATES]


def _digest(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- parity
def _slow_writes(file, seconds=0.003):
    """Writes that lag (a slow disk): a buffer reused before its write-back finished would be caught."""
    import time

    write = file.write

    def slow(*args):
        time.sleep(seconds)
        write(*args)

    file.write = slow


def body_parity(rank, world, stage, dtype, root, slow_disk=False):
    scaled = dtype == torch.float16
    out = {}
    for kind in ("memory", "disk"):
        model = _gpt(dtype)
        frozen = model.wpe.weight.detach().clone()
        wrapper, opt = _wrap(model, stage, root if kind == "disk" else None)
        if kind == "disk" and slow_disk:
            _slow_writes(opt.offload_stream.file)
        skipped_untouched = None
        for i, batch in enumerate(_batches(5)):
            inf = torch.ones(1) if scaled and i == 2 else None       # an overflow: the step is skipped
            if kind == "disk" and inf is not None:
                before = (_digest(opt.offload_stream.file.path), dict(opt.offload_stream.stats))
            _step(rank, wrapper, opt, batch, scaled=scaled, found_inf=inf)
            if kind == "disk" and inf is not None:
                skipped_untouched = before == (_digest(opt.offload_stream.file.path), dict(opt.offload_stream.stats))
        now = wrapper.full_state_dict()["wpe.weight"] if stage == 3 else model.wpe.weight.detach()
        out[kind] = (_params(wrapper, stage), _states(opt), opt.steps_taken, torch.equal(now, frozen))
        if kind == "disk":
            stream = opt.offload_stream
            streamed = (stream.stats["steps"], len(stream.groups([(0, stream.numel)])), stream.states)
            path = stream.file.path
            opt.close_offload()             # the state file is scratch space: removed with the optimizer
            streamed += (os.path.exists(path),)
    mem, disk = out["memory"], out["disk"]
    return (_equal(mem[0], disk[0]), _equal(mem[1], disk[1]), mem[2], disk[2], mem[3] and disk[3],
            skipped_untouched, streamed)


@pytest.mark.parametrize("stage,dtype,slow_disk", [
    (1, torch.float32, False), (2, torch.float32, True), (3, torch.float32, False),
    (1, torch.float16, False), (2, torch.float16, False), (3, torch.float16, True)])
def test_offload_trains_bit_identically_to_in_memory(dist_pools, tmp_path, stage, dtype, slow_disk):
    for params_equal, states_equal, steps_mem, steps_disk, frozen, skipped_untouched, streamed in \
            dist_pools(2).run(body_parity, stage, dtype, str(tmp_path), slow_disk):
        assert params_equal and states_equal
        scaled = dtype == torch.float16
        assert steps_mem == steps_disk == (4 if scaled else 5)
        assert frozen
        n_steps, n_groups, states, file_left = streamed
        assert n_steps == steps_disk and n_groups > 4       # really streamed, through many sub-groups
        assert not file_left
        # ZeRO-3 with fp32 parameters: the master is the parameter shard itself, only the moments go to disk
        assert states == (STATES[1:] if stage == 3 and dtype == torch.float32 else STATES)
        if scaled:
            assert skipped_untouched                        # the skipped step read and wrote nothing


# ---------------------------------------------------------------------------------------------- memory
def _status_kb(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _large_blocks_as_fresh_mmaps():
    """Serve every block of 128 KiB or more from its own mmap. glibc otherwise raises its mmap threshold to
    the largest block freed so far, and a later large block can land in heap that earlier work freed, which
    RSS never sees grow (the in-memory optimizer once measured 14 of its 48 MiB)."""
    import ctypes

    m_mmap_threshold = -3                       # <malloc.h>; setting it also turns the dynamic threshold off
    assert ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 128 * 1024) == 1


def body_memory(rank, world, root):
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer

    _large_blocks_as_fresh_mmaps()
    group = cached_mesh(dp=2).dp_group
    tiny = DataParallel(nn.Linear(8, 8), group, reduce_op="reduce_scatter")
    warm = ZeroOptimizer(tiny, stage=1, lr=1e-3)        # a process's first ZeroOptimizer loads the kernels
    tiny(torch.randn(2, 8)).sum().backward()
    warm.step()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)])      # 8.4M parameters
    dp = DataParallel(model, group, reduce_op="reduce_scatter")
    x = torch.randn(4, 1024)

    def backward():
        dp(x).square().mean().backward()
        gc.collect()

    def growth(make_optimizer, steps=3):
        """The optimizer's resident memory: what its construction and its steps add to RSS and the most
        above that while they run (VmHWM reset before each); backward passes in between are not its."""
        held, peak, opt = 0, 0, None

        def phase(fn):
            nonlocal held, peak
            start = _status_kb("VmRSS")
            _reset_peak()
            fn()
            peak = max(peak, held + _status_kb("VmHWM") - start)
            held += _status_kb("VmRSS") - start

        def build():
            nonlocal opt
            opt = make_optimizer()

        phase(build)
        for _ in range(steps):
            backward()
            phase(opt.step)
            opt.zero_grad()
        return opt, peak

    backward()
    disk, disk_peak = growth(lambda: ZeroOptimizer(dp, stage=1, lr=1e-3, offload="disk", offload_dir=root,
                                                   offload_buffer_mb=4))
    state_bytes, buffers = 12 * disk.shard_numel, disk.offload_stream.buffer_bytes
    report = disk.memory_report()
    disk.close_offload()
    del disk
    _, mem_peak = growth(lambda: ZeroOptimizer(dp, stage=1, lr=1e-3))
    return disk_peak, mem_peak, state_bytes, buffers, report


def test_resident_memory_is_bounded_by_the_buffers(tmp_path):
    # gloo even under PL_TEST_BACKEND=nccl_rules: the rules backend runs ZeRO-1's all-gather on torch's gloo
    # all_gather_into_tensor, which stages the gathered buffer in host memory (NCCL keeps it on the device).
    # Ranks of their own, started fresh with glibc's mmap threshold (a variable read at process start: the pool
    # spawns them), not forked from the shared server whose heap they would inherit: a rank forked from it
    # once measured the in-memory optimizer at 16 of its 48 MiB.
    from parallel_layers.testing import WorkerPool
    with WorkerPool(2, env={"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}) as pool:
        results = pool.run(body_memory, str(tmp_path), timeout=300)
    for disk_peak, mem_peak, state_bytes, buffers, report in results:
        mib = 2**20
        assert state_bytes >= 48 * mib and buffers <= 4 * mib
        print(f"optimizer growth: offloaded {disk_peak / mib:.1f} MiB (buffers {buffers / mib:.1f} MiB), in memory "
              f"{mem_peak / mib:.1f} MiB (state {state_bytes / mib:.1f} MiB)")
        # In memory the optimizer's growth is of the order of its state (less where it reuses heap that
        # earlier work freed), offloaded its buffers: fresh mmaps, which no earlier free can hide.
        assert mem_peak > 0.5 * state_bytes, (mem_peak / mib, state_bytes / mib)
        assert disk_peak < buffers + 2 * mib, (disk_peak / mib, buffers / mib)
        assert disk_peak < state_bytes / 8, (disk_peak / mib, state_bytes / mib)
        assert report["optimizer_bytes"] == buffers and report["offload_bytes"] >= state_bytes


# ---------------------------------------------------------------------------------------------- bad files
def body_bad_files(rank, world, root):
    import torch.distributed as dist

    from parallel_layers.zero.state_file import OffloadStateError

    group = cached_mesh(dp=2).dp_group
    batch = _batches(1)[0]

    def fresh(name, **cfg):
        model = _gpt(**cfg)
        wrapper, opt = _wrap(model, 2, os.path.join(root, name))
        return model, wrapper, opt

    def refused(opt, wrapper):
        """Backward, then a step that must raise before changing anything: (message, nothing changed)."""
        x, y = batch
        wrapper(x.chunk(2)[rank], y.chunk(2)[rank])[1].backward()
        before = (_params(wrapper, 2), opt.steps_taken)
        try:
            opt.step()
        except OffloadStateError as exc:
            return str(exc), _equal(before[0], _params(wrapper, 2)) and before[1] == opt.steps_taken
        return None, False

    results = {}
    _, w, opt = fresh("missing")
    os.unlink(opt.offload_stream.file.path)
    results["missing"] = refused(opt, w)

    _, w, opt = fresh("truncated")
    os.truncate(opt.offload_stream.file.path, opt.offload_stream.file.nbytes // 2)
    results["truncated"] = refused(opt, w)

    _, w, opt = fresh("rank")                    # the other rank's file copied over this rank's
    mine = opt.offload_stream.file.path
    shutil.copyfile(mine, mine + ".copy")
    paths = [None, None]
    dist.all_gather_object(paths, mine, group=group)
    dist.barrier(group)
    shutil.copyfile(paths[1 - rank] + ".copy", mine)
    results["rank"] = refused(opt, w)

    _, w, opt = fresh("run")                     # this rank's file of another run (same model and layout)
    _, _, other = fresh("run-other")
    shutil.copyfile(other.offload_stream.file.path, opt.offload_stream.file.path)
    results["run"] = refused(opt, w)

    _, w, opt = fresh("replaced")                # a new file put in its place
    path = opt.offload_stream.file.path
    os.replace(shutil.copyfile(other.offload_stream.file.path, path + ".x"), path)
    results["replaced"] = refused(opt, w)

    _, w, opt = fresh("layout")                  # a file of another model
    _, _, small = fresh("layout-other", n_layer=1)
    shutil.copyfile(small.offload_stream.file.path, opt.offload_stream.file.path)
    results["layout"] = refused(opt, w)

    _, w, opt = fresh("stale")                   # an older copy of its own file put back
    _step(rank, w, opt, batch)                  # (the first step re-lays out the buckets: a new file)
    shutil.copyfile(opt.offload_stream.file.path, opt.offload_stream.file.path + ".old")
    _step(rank, w, opt, batch)
    shutil.copyfile(opt.offload_stream.file.path + ".old", opt.offload_stream.file.path)
    results["stale"] = refused(opt, w)

    try:                                        # two live optimizers on one file
        fresh("stale")
        results["locked"] = (None, True)
    except OffloadStateError as exc:
        results["locked"] = (str(exc), True)
    return results


def test_missing_truncated_or_foreign_state_file_is_refused_before_any_step(dist_pools, tmp_path):
    expected = {"missing": "is missing", "truncated": "truncated", "rank": "written by global rank",
                "run": "belongs to another run", "replaced": "was replaced by another file",
                "layout": "holds another layout", "stale": "older copy", "locked": "in use by another live optimizer"}
    for rank, results in enumerate(dist_pools(2).run(body_bad_files, str(tmp_path))):
        assert set(results) == set(expected)
        for case, (message, unchanged) in results.items():
            assert message is not None and expected[case] in message, (rank, case, message)
            assert "ZeroOptimizer" in message or case == "locked", message
            assert unchanged, (rank, case)
        assert f"dp rank {1 - rank} of 2" in results["rank"][0]


# ---------------------------------------------------------------------------------------------- failed writes
def body_failed_write(rank, world, root):
    from parallel_layers.zero.offload import OffloadIOError
    from parallel_layers.zero.state_file import OffloadStateError

    batches = _batches(5)
    ref_model = _gpt()
    ref, ref_opt = _wrap(ref_model, 2)
    for b in batches:
        _step(rank, ref, ref_opt, b)

    model = _gpt()
    dp, opt = _wrap(model, 2, os.path.join(root, "run"))
    for b in batches[:2]:
        _step(rank, dp, opt, b)
    ckpt = os.path.join(root, f"ckpt{rank}.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)

    calls = []
    real_write = opt.offload_stream.file.write

    def disk_full_on_third_write(name, lo, hi, src):      # the disk fills up mid-step
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_write(name, lo, hi, src)

    opt.offload_stream.file.write = disk_full_on_third_write
    errors = []
    for attempt in (lambda: _step(rank, dp, opt, batches[2]), lambda: _step(rank, dp, opt, batches[2]),
                    opt.state_dict):
        try:
            attempt()
            errors.append(None)
        except (OffloadIOError, OffloadStateError) as exc:
            errors.append((type(exc).__name__, str(exc)))

    # resume from the checkpoint taken before the failure, in a fresh optimizer: nothing was lost
    state = torch.load(ckpt, weights_only=True)
    model2 = _gpt(seed=7)
    model2.load_state_dict(state["model"])
    dp2, opt2 = _wrap(model2, 2, os.path.join(root, "resumed"))
    opt2.load_state_dict(state["optimizer"])
    for b in batches[2:]:
        _step(rank, dp2, opt2, b)
    return errors, _equal(_params(ref, 2), _params(dp2, 2)), _equal(_states(ref_opt), _states(opt2))


def test_failed_write_loses_nothing_a_checkpoint_had(dist_pools, tmp_path):
    for errors, params_equal, states_equal in dist_pools(2).run(body_failed_write, str(tmp_path)):
        (kind, msg), (kind2, msg2), (kind3, msg3) = errors
        assert kind == "OffloadIOError" and "No space left on device" in msg and ".optstate" in msg, msg
        assert "rebuild it and load the last checkpoint" in msg
        assert kind2 == kind3 == "OffloadStateError" and msg2 == msg3 == msg   # refuses to step or save
        assert params_equal and states_equal


# ---------------------------------------------------------------------------------------------- checkpoints
def body_checkpoint(rank, world, stage, root):
    """Uninterrupted in-memory run (5 steps) against runs resumed after step 3 from checkpoints of an
    offloaded or in-memory run, into offloaded or in-memory optimizers. Stage 1 re-lays out its buckets
    after the first backward, so a fresh wrapper loads the state across layouts (and again at its own
    re-layout), the offloaded one through its files."""
    batches = _batches(5)
    rebuild = True if stage == 1 else None

    def model_state(model, wrapper):
        return wrapper.full_state_dict() if stage == 3 else copy.deepcopy(model.state_dict())

    def run(model, offload_dir, steps):
        wrapper, opt = _wrap(model, stage, offload_dir, rebuild=rebuild)
        for b in steps:
            _step(rank, wrapper, opt, b)
        return wrapper, opt

    ref_model = _gpt()
    ref, ref_opt = run(ref_model, None, batches[:3])
    ref_sd, ref_model_sd = ref_opt.state_dict(), model_state(ref_model, ref)
    ref_full = ref_opt.full_state_dict()          # any-dp-size form (universal checkpoints build on it)
    for b in batches[3:]:
        _step(rank, ref, ref_opt, b)
    final = (_params(ref, stage), _states(ref_opt))

    disk_model = _gpt()
    disk, disk_opt = run(disk_model, os.path.join(root, "a"), batches[:3])
    path = os.path.join(root, f"ckpt{rank}.pt")
    torch.save(disk_opt.state_dict(), path)       # written from the mapped copy of the state file
    disk_model_sd = model_state(disk_model, disk)
    full = disk_opt.full_state_dict()             # read through the mapped state file
    same_full = all(torch.equal(full["state"][n][k], ref_full["state"][n][k])
                    for n in ref_full["state"] for k in STATES)
    for b in batches[3:]:
        _step(rank, disk, disk_opt, b)
    results = {"continued": (_equal(final[0], _params(disk, stage)), _equal(final[1], _states(disk_opt)))}
    saved = torch.load(path, weights_only=True)
    results["snapshot"] = (_equal([saved[k] for k in STATES], [ref_sd[k] for k in STATES]), same_full)

    model = _gpt(seed=9)                          # the full state into a fresh offloaded optimizer
    model.load_state_dict(ref_model_sd)
    wrapper, opt = run(model, os.path.join(root, "f"), [])
    opt.load_full_state_dict(ref_full)
    for b in batches[3:]:
        _step(rank, wrapper, opt, b)
    results["full->disk"] = (_equal(final[0], _params(wrapper, stage)), _equal(final[1], _states(opt)))

    for name, sd, model_sd, offload_dir in (("disk->memory", saved, disk_model_sd, None),
                                            ("disk->disk", saved, disk_model_sd, os.path.join(root, "c")),
                                            ("memory->disk", ref_sd, ref_model_sd, os.path.join(root, "e"))):
        model = _gpt(seed=9)
        model.load_state_dict(model_sd)
        wrapper, opt = run(model, offload_dir, [])
        if stage == 1:                          # the state moves across bucket layouts (a collective)
            results[name + " layouts differ"] = (sd["layout"] != opt.layout, True)
        opt.load_state_dict(sd)
        for b in batches[3:]:
            _step(rank, wrapper, opt, b)
        results[name] = (_equal(final[0], _params(wrapper, stage)), _equal(final[1], _states(opt)))
    return results


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoints_resume_with_offload_on_or_off(dist_pools, tmp_path, stage):
    for results in dist_pools(2).run(body_checkpoint, stage, str(tmp_path)):
        cases = {"continued", "snapshot", "full->disk", "disk->memory", "disk->disk", "memory->disk"}
        relaid = {c + " layouts differ" for c in cases if "->" in c and c != "full->disk"}
        assert set(results) == cases | (relaid if stage == 1 else set())
        for case, (params_equal, states_equal) in results.items():
            assert params_equal and states_equal, case


# ---------------------------------------------------------------------------------------------- options
def body_options(rank, world, root):
    errors = []
    for stage, kw in ((2, dict(offload="cpu")), (3, dict(offload="cpu")), (2, dict(offload_dir=root)),
                      (2, dict(offload="disk")), (2, dict(offload="nvme", offload_dir=root)),
                      (2, dict(offload="disk", offload_dir=root, offload_buffer_mb=0.01)),
                      (2, dict(offload="disk", offload_dir=root, offload_io="mmap"))):
        model = _gpt()
        try:
            if stage == 3:
                from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

                ZeroStage3Optimizer(ZeroStage3(model, cached_mesh(dp=2).dp_group), **kw)
            else:
                from parallel_layers.data_parallel.ddp import DataParallel
                from parallel_layers.zero import ZeroOptimizer

                ZeroOptimizer(DataParallel(model, cached_mesh(dp=2).dp_group, reduce_op="reduce_scatter"),
                              stage=stage, **kw)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_offload_options_are_checked(dist_pools, tmp_path):
    for errors in dist_pools(2).run(body_options, str(tmp_path)):
        cpu2, cpu3, dir_only, no_dir, kind, tiny, io = errors
        assert "nothing to move" in cpu2 and cpu2.startswith("ZeroOptimizer")
        assert "nothing to move" in cpu3 and cpu3.startswith("ZeroStage3Optimizer")
        assert "without offload='disk'" in dir_only
        assert "needs offload_dir" in no_dir
        assert "'nvme'" in kind
        assert "too small" in tiny and "MiB" in tiny
        assert "offload_io='mmap'" in io


# ---------------------------------------------------------------------------------------------- bf16 gradient shard
def body_bf16_grads(rank, world, root, backwards):
    """ZeRO-3, bf16 parameters, state on disk: the same 5 steps with an fp32 and a bf16 gradient shard
    (``backwards`` synced backwards per step: more than one sums in the shard's dtype)."""
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    group = cached_mesh(dp=2).dp_group
    out = {}
    for name, grad_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model = _gpt(torch.bfloat16)
        z = ZeroStage3(model, group, grad_dtype=grad_dtype, reduce_dtype=torch.bfloat16)
        opt = ZeroStage3Optimizer(z, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=lambda n, p: p.ndim < 2,
                                  offload="disk", offload_dir=os.path.join(root, name), offload_buffer_mb=TINY_MB)
        start = None
        for i, (x, y) in enumerate(_batches(5 * backwards)):
            _, loss = z(x.chunk(2)[rank], y.chunk(2)[rank])
            (loss / backwards).backward()
            if (i + 1) % backwards:
                continue
            opt.clip_grad_norm_(1.0)
            if start is None:
                start = opt.master.clone()
            opt.step()
            opt.zero_grad()
        out[name] = (z.shard_buffer.clone(), _states(opt), start, z.grad_buffer.dtype,
                     opt.memory_report()["grad_bytes"], z.shard_numel)
        opt.close_offload()
    (p32, s32, start, d32, g32, n), (p16, s16, _, d16, g16, _) = out["fp32"], out["bf16"]
    diff, moved = s16[0] - s32[0], s32[0] - start          # moved: what 5 steps did to the fp32 master
    return (torch.equal(p32, p16), _equal(s32, s16), (diff.norm() / moved.norm()).item(), diff.abs().max().item(),
            moved.abs().max().item(), (d32, d16), (g32, g16), n)


@pytest.mark.parametrize("backwards", [1, 2])
def test_bf16_gradient_shard_matches_the_fp32_one(dist_pools, tmp_path, backwards):
    for params_equal, states_equal, rel_diff, max_diff, max_moved, dtypes, grad_bytes, n in \
            dist_pools(2).run(body_bf16_grads, str(tmp_path), backwards):
        assert dtypes == (torch.float32, torch.bfloat16)
        assert grad_bytes == (4 * n, 2 * n)
        if backwards == 1:
            # a unit's gradients are reduced in bf16 either way and halving (dp 2) is exact in bf16: the
            # shards hold the same values, so the steps are the same
            assert params_equal and states_equal and max_diff == 0
        else:
            # Two backwards summed in the bf16 shard: each sum is rounded to 8 significant bits (relative
            # error <= 2^-9 of the sum). AdamW's update m / sqrt(v) is invariant to a common scale of the
            # gradients, so an element's update changes by about that relative amount, except where the two
            # backwards nearly cancel (the sum's relative error is then unbounded, but such elements are few and
            # their update moves them little). So over the whole shard the difference is a small fraction of
            # what training moved the master: 2^-5 (measured 0.3%) leaves room for 5 steps of propagation
            # (the bf16 parameters the next forward reads, the clip coefficient); and no element may drift
            # far against the largest move (measured 2%).
            assert 0 < rel_diff <= 2**-5, rel_diff
            assert max_diff <= 0.1 * max_moved, (max_diff, max_moved)


class _Stack(nn.Module):
    def __init__(self, width, depth, dtype):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False, dtype=dtype) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _train_step(z, opt, x):
    z(x).float().square().mean().backward()
    opt.step()


def body_grad_memory(rank, world, root):
    """RSS held by ZeroStage3's gradient shard (after backward against after zero_grad, which frees it) and
    the peak a whole step (forward, backward, offloaded step) adds, with an fp32 and a bf16 shard. Run in a
    fresh process with glibc's mmap threshold at 64 KiB: every buffer is mapped on its own and unmapped when
    freed, so RSS follows live memory (no earlier free can hide an allocation)."""
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    group = cached_mesh(dp=1).dp_group
    out = {}
    for name, grad_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        z = ZeroStage3(_Stack(1024, 8, torch.bfloat16), group, grad_dtype=grad_dtype,
                       reduce_dtype=torch.bfloat16)   # 8.4M parameters
        opt = ZeroStage3Optimizer(z, lr=1e-3, offload="disk", offload_dir=os.path.join(root, name),
                                  offload_buffer_mb=4)
        x = torch.randn(4, 1024, dtype=torch.bfloat16)
        _train_step(z, opt, x)                  # warm-up: kernels loaded, I/O threads started
        opt.zero_grad()
        gc.collect()
        before = _status_kb("VmRSS")
        _reset_peak()
        _train_step(z, opt, x)
        peak = _status_kb("VmHWM") - before
        after_backward = _status_kb("VmRSS")
        opt.zero_grad()                         # frees the gradient shard
        gc.collect()
        held = after_backward - _status_kb("VmRSS")
        out[name] = (held, peak, z.grad_nbytes)
        opt.close_offload()
        del z, opt
        gc.collect()
    return out


def test_bf16_gradient_shard_halves_the_resident_gradient_memory(tmp_path, monkeypatch):
    from parallel_layers.testing import WorkerPool

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")       # read by glibc when the worker starts
    with WorkerPool(1) as pool:
        out = pool.run(body_grad_memory, str(tmp_path), timeout=120)[0]
    (held32, peak32, bytes32), (held16, peak16, bytes16) = out["fp32"], out["bf16"]
    mib = 2**20
    print(f"gradient shard: fp32 {bytes32 / mib:.0f} MiB holds {held32 / mib:.1f} MiB of RSS, step peak "
          f"+{peak32 / mib:.1f} MiB; bf16 {bytes16 / mib:.0f} MiB holds {held16 / mib:.1f} MiB, step peak "
          f"+{peak16 / mib:.1f} MiB")
    assert bytes16 * 2 == bytes32
    for held, nbytes in ((held32, bytes32), (held16, bytes16)):
        assert 0.95 * nbytes <= held <= 1.05 * nbytes + mib, (held / mib, nbytes / mib)
    # the step's peak drops by the bytes saved (the rest of the step is the same in both)
    assert abs((peak32 - peak16) - (bytes32 - bytes16)) <= 0.1 * bytes16, (peak32 / mib, peak16 / mib)


# ---------------------------------------------------------------------------------------------- benchmark
def body_bench(rank, world, fn_name, *args):
    import importlib
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:        # benchmarks/ is a folder of the repo, not of the installed package
        sys.path.insert(0, repo)
    return getattr(importlib.import_module("benchmarks.zero_offload"), fn_name)(rank, world, *args)


def test_benchmark_smoke_rows(monkeypatch, dist_pools):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import harness, zero_offload

    monkeypatch.setattr(harness, "run_ranks", lambda fn, world, args=(), **_: dist_pools(world).run(
        body_bench, fn.__name__, *args, timeout=300))
    rows = zero_offload.collect("smoke", torch.device("cpu"))
    cases = {r["case"] for r in rows}
    assert {"disk_sequential_write", "disk_sequential_read", "io_read_direct_preadv"} <= cases
    steps = [r for r in rows if r["case"].startswith("zero2_offload_")]
    assert len(steps) == 2 * len(zero_offload.VARIANTS)
    for r in rows:
        assert set(r) <= set(harness.CSV_FIELDS) and r["mode"] == "smoke"
        assert r["gbps"] > 0
    for r in steps:
        assert r["ours_median_ms"] > 0 and r["speedup"] > 0 and r["bw_fraction"] > 0
