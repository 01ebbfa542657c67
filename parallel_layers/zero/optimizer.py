"""ZeroOptimizer: AdamW with its state sharded over the data-parallel group (ZeRO stages 1 and 2).

Layout (Megatron-LM's distributed optimizer): ``DataParallel`` keeps parameters and gradients in flat
buffers cut into buckets, each padded to a multiple of lcm(dp, 64) elements, so every bucket splits into
``dp`` equal shards and rank r owns shard r of *every* bucket. This rank's shards, concatenated bucket
after bucket, form one flat "local shard" of ``S = sum(bucket.numel) / dp`` elements, and the optimizer
state is three fp32 tensors of ``S`` elements: master weights, exp_avg, exp_avg_sq.

A step, all on the device (no host sync, so an AMP ``found_inf`` costs nothing):

1. gradients: ``DataParallel(reduce_op="reduce_scatter")`` reduce-scattered every bucket during backward
   straight into its flat ``grad_shard`` (this rank's averaged shards, bucket after bucket: exactly the
   layout of the optimizer state), which the optimizer steps on as it is: no copy, no second shard.
   Stage 1 keeps the full grad buffer as well; stage 2 frees it between steps (see ``_release_grads``).
   (Stage 1 over ``reduce_op="all_reduce"`` slices the shard out of the full buffer instead.)
2. ONE fused ``adamw_step`` updates the whole local shard (master, moments, and for bf16/fp16 models the
   low-precision copy in the same pass), then
3. every bucket's updated shard is all-gathered (model dtype) into ``bucket.param_data``, so every rank
   holds the full updated model.

Padding elements have zero parameters and zero gradients, so Adam leaves them at zero.

Weight decay: ``weight_decay`` applies to every parameter; ``no_decay=[params]`` (or a predicate on the
parameter name, e.g. ``lambda name, p: p.ndim < 2``) excludes some. Uniform decay is folded into the
fused kernel; a mixed mask costs one extra elementwise pass (decoupled decay ``p *= 1 - lr*wd`` does not
depend on the moments, so applying it just before the kernel is the same update).

The buffer may be re-laid out once (``DataParallel`` rebuilds buckets from the order gradients arrived,
at the end of the first synced backward and, with reduce-scatter, *before* reducing, so the gradients are
already reduced in the new layout): the optimizer notices (the buffer storage changed) and re-derives its
shards. Before the first step that is free; when the state already holds something (``load_state_dict``
into a fresh wrapper, whose first backward then re-lays out) it is one all-gather of the state per old
bucket: a collective, all ranks of the DP group take part.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..distributed import collectives as C
from ..ops.optimizer_step import adamw_step
from ..ops._checks import scalar_tensor
from . import memory as M
from . import full_state

_STATES = ("master", "exp_avg", "exp_avg_sq")


def _scalar(owner: str, name: str, value, device) -> torch.Tensor:
    return scalar_tensor(f"{owner}.step", name, value, device, convert=True)


def step_multipliers(owner: str, device, grad_scale, clip_coef, found_inf):
    """``(gradient multiplier, found_inf)`` for the fused step, both on ``device``: the multiplier is
    ``clip_coef / grad_scale`` (``grad_scale`` is the loss scale the gradients carry)."""
    scale = (torch.ones(1, device=device) if grad_scale is None
             else torch.reciprocal(_scalar(owner, "grad_scale", grad_scale, device)))
    if clip_coef is not None:
        scale = scale * _scalar(owner, "clip_coef", clip_coef, device)
    inf = torch.zeros(1, device=device) if found_inf is None else _scalar(owner, "found_inf", found_inf, device)
    return scale, inf


class ZeroOptimizer:
    """Sharded AdamW over a ``DataParallel(module, dp_group, reduce_op="reduce_scatter")`` wrapper.

    ``stage=1``: optimizer state sharded. ``stage=2``: gradients sharded too (see :meth:`_grad_shard`).
    ``step(grad_scale=, found_inf=, clip_coef=)``: ``grad_scale`` is the loss scale the gradients carry
    (divided out, torch's convention, as ``FusedAdamW``), ``clip_coef`` multiplies them (e.g. the
    coefficient from ``clip_grad_norm_``), a nonzero ``found_inf`` skips the step with params, states and
    step count left bit-identical. All three may be 1-element device tensors.
    """

    def __init__(self, dp_module, *, stage: int, lr: float, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 no_decay: Union[None, Sequence[torch.nn.Parameter], Callable[[str, torch.nn.Parameter], bool]] = None,
                 backend: Optional[str] = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer: stage={stage!r} must be 1 (sharded optimizer state) or 2 (also "
                             f"sharded gradients); stage 3 shards parameters and needs its own wrapper")
        reduce_op = getattr(dp_module, "reduce_op", "reduce_scatter")
        # Stage 1 may also slice all-reduced gradients (on gloo, whose reduce-scatter is an emulation,
        # all-reduce is faster); stage 2 must not keep full gradients, so it needs the reduce-scatter.
        if reduce_op != "reduce_scatter" and not (stage == 1 and reduce_op == "all_reduce"):
            raise ValueError(f"ZeroOptimizer: the DataParallel wrapper uses reduce_op={reduce_op!r}; ZeRO stage "
                             f"{stage} needs reduce_op='reduce_scatter' (each rank reduces only the shard it steps)"
                             + ("" if stage == 2 else " or 'all_reduce' (stage 1 then slices its shard)"))
        if not 0 <= lr or not 0 <= eps or not 0 <= weight_decay:
            raise ValueError(f"ZeroOptimizer: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ZeroOptimizer: betas={betas!r} must be a pair in [0, 1)")
        self.dp, self.stage, self.backend = dp_module, stage, backend
        self.group = dp_module.dp_group
        self.dp_size, self.dp_rank = C.world_size(self.group), C.rank(self.group)
        # One group, for schedulers that edit param_groups[0]["lr"]; read on every step.
        self.param_groups = [dict(lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps),
                                  weight_decay=float(weight_decay))]
        module = getattr(dp_module, "module", dp_module)
        self._names = {id(p): n for n, p in module.named_parameters()}
        if no_decay is None:
            self._no_decay = set()
        elif callable(no_decay):
            self._no_decay = {id(p) for n, p in module.named_parameters() if no_decay(n, p)}
        else:
            self._no_decay = {id(p) for p in no_decay}
        buckets = self._buckets()
        self.device = buckets[0].param_data.device
        self.param_dtype = buckets[0].param_data.dtype
        if any(b.param_data.dtype != self.param_dtype for b in buckets):
            raise ValueError("ZeroOptimizer: the buckets hold parameters of several dtypes "
                             f"{sorted({str(b.param_data.dtype) for b in buckets})}; use one param dtype")
        self._step = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._use_broadcast = self.dp_size > 1 and dist.get_backend(self.group) == "gloo"
        self._grad_nbytes = 0      # stage 2: size of the grad buffer while it is materialised
        self._started = False      # has the state left its initial value (step taken or state loaded)?
        self._layout_key = None
        self._build(buckets)
        if stage == 2:
            # The grad buffer only needs to exist from forward to the step; see _release_grads.
            self._hook = dp_module.register_forward_pre_hook(self._materialize_grads)
            self._release_grads()

    # ------------------------------------------------------------------ stage 2: gradient memory
    def _grad_storage(self):
        return self.dp.buffer.grad_buffer.untyped_storage()

    def _release_grads(self) -> None:
        """Stage 2: free the full grad buffer; only this rank's gradient shard persists.

        What remains between steps: ONE copy of the gradient shard, DataParallel's flat fp32 ``grad_shard``
        (``S`` elements), which the reduce-scatter wrote and the optimizer stepped on (zeroed here: the step
        consumed it). The full buffer (autograd accumulates into it, so it is also the buckets' send
        memory) is re-allocated, zeroed, at the next forward of the wrapper and lives through backward:
        peak memory during backward is that of stage 1; the saving is on everything that happens between
        steps (optimizer step, evaluation, a forward's activations). The storage is resized in place, so
        ``p.grad``/``p.main_grad`` views stay valid. Consequence: each step consumes the gradients (as if
        ``zero_grad`` followed every step).
        """
        st = self._grad_storage()
        if st.nbytes():
            self._grad_nbytes = st.nbytes()
            st.resize_(0)
        self.dp.grad_shard.zero_()

    def _materialize_grads(self, *_unused) -> None:
        st = self._grad_storage()
        if st.nbytes() == 0 and self._grad_nbytes:
            st.resize_(self._grad_nbytes)
            self.dp.buffer.grad_buffer.zero_()

    # ------------------------------------------------------------------ layout
    def _buckets(self) -> list:
        return list(self.dp.buffer.buckets)

    def _key(self, buckets) -> tuple:
        return tuple((b.param_data.data_ptr(), b.numel) for b in buckets)

    def _describe(self, buckets) -> List[dict]:
        """Layout of the buckets by parameter *name* (survives a fresh model and a rebuild)."""
        return [dict(numel=b.numel, params=[(self._names.get(id(p), f"<unnamed {i}>"), o, p.numel())
                                            for i, (p, o) in enumerate(zip(b.params, b.param_offsets))])
                for b in buckets]

    def _build(self, buckets) -> None:
        """(Re)derive shard bookkeeping and buffers from the current bucket layout."""
        self._bucket_list = buckets
        self._layout_key = self._key(buckets)
        self._layout = self._describe(buckets)
        self._offsets, pos = [], 0
        for b in buckets:
            self._offsets.append(pos)
            pos += b.shard_numel
        self.shard_numel = pos
        dev = self.device
        with torch.no_grad():
            params = torch.empty(pos, dtype=self.param_dtype, device=dev)
            for b, off in zip(buckets, self._offsets):
                s, e = b.shard_range(self.dp_rank)
                params[off:off + b.shard_numel].copy_(b.param_data[s:e])
            low = self.param_dtype != torch.float32
            self.master = params.float() if low else params
            # Staging for the low-precision copy the kernel writes; it is what the all-gather sends.
            self.low = params if low else None
            self.exp_avg = torch.zeros(pos, dtype=torch.float32, device=dev)
            self.exp_avg_sq = torch.zeros(pos, dtype=torch.float32, device=dev)
            # reduce_scatter: DataParallel.grad_shard already is the flat shard. Stage 1 over all_reduce with
            # several buckets: the shards are not adjacent in the grad buffer; they are gathered here.
            own = not self._scattered() and len(buckets) > 1
            self._grad_flat = torch.zeros(pos, dtype=torch.float32, device=dev) if own else None
            self._decay_vec = self._decay_vector(buckets)

    def _decay_vector(self, buckets) -> Optional[torch.Tensor]:
        """Per-element weight decay of the local shard when the decay is not uniform, else None."""
        wd = self.param_groups[0]["weight_decay"]
        if wd == 0 or not self._no_decay:
            return None
        vec = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        for b, off in zip(buckets, self._offsets):
            for p, _, start, length in b.param_shard_overlaps(self.dp_rank):
                if id(p) not in self._no_decay:
                    vec[off + start:off + start + length] = 1.0
        return vec

    def _check_layout(self) -> None:
        buckets = self._buckets()
        if self._key(buckets) == self._layout_key:
            return
        old_layout, old = self._layout, (self.master, self.exp_avg, self.exp_avg_sq)
        self._build(buckets)
        if self._started:       # else nothing learned yet: the new shards start from the params
            self._remap(old_layout, old)

    def _remap(self, old_layout: List[dict], old: Sequence[torch.Tensor]) -> None:
        """Move this rank's state from ``old_layout`` to the current one (a collective over the DP group).

        Each old bucket's shards of the three states are all-gathered (one [shard, 3] gather per bucket),
        then every parameter's slice is copied to where the new layout puts it on this rank.
        """
        stacked = torch.stack([t.float() for t in old], dim=1)          # [S_old, 3]
        where: Dict[str, Tuple[torch.Tensor, int, int]] = {}
        pos = 0
        for desc in old_layout:
            n_shard = desc["numel"] // self.dp_size
            full = C.all_gather_dim0(stacked[pos:pos + n_shard], self.group)   # [numel, 3]
            pos += n_shard
            for name, o, n in desc["params"]:
                where[name] = (full, o, n)
        new = torch.stack([self.master, self.exp_avg, self.exp_avg_sq], dim=1)
        for b, off in zip(self._bucket_list, self._offsets):
            for p, start_p, start_s, length in b.param_shard_overlaps(self.dp_rank):
                name = self._names.get(id(p))
                if name not in where or where[name][2] != p.numel():
                    raise ValueError(f"ZeroOptimizer: parameter {name!r} ({p.numel()} elements) is not in the "
                                     f"saved layout with that size; was the state saved from another model?")
                full, o, _ = where[name]
                new[off + start_s:off + start_s + length] = full[o + start_p:o + start_p + length]
        self.master.copy_(new[:, 0])
        self.exp_avg.copy_(new[:, 1])
        self.exp_avg_sq.copy_(new[:, 2])
        if self.low is not None:
            self.low.copy_(self.master)

    # ------------------------------------------------------------------ step
    def _scattered(self) -> bool:
        return getattr(self.dp, "reduce_op", "reduce_scatter") == "reduce_scatter"

    def _grad_shard(self) -> torch.Tensor:
        """This rank's averaged gradient shard, flat fp32: DataParallel's ``grad_shard`` itself after a
        reduce-scatter; sliced from the all-reduced buffer otherwise (a view when there is one bucket)."""
        if self._scattered():
            g = self.dp.grad_shard
            if g.numel() != self.shard_numel or g.dtype != torch.float32:
                raise ValueError(f"ZeroOptimizer: DataParallel's grad_shard has {g.numel()} {g.dtype} elements, "
                                 f"expected {self.shard_numel} float32; build DataParallel with the default "
                                 f"grad_dtype (fp32 main grads)")
            return g
        views = []
        for b in self._bucket_list:
            s, e = b.shard_range(self.dp_rank)
            views.append(b.grad_data[s:e])
        if self._grad_flat is None:
            return views[0]
        for v, off in zip(views, self._offsets):
            self._grad_flat[off:off + v.numel()].copy_(v)
        return self._grad_flat

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None, clip_coef=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_layout()
        dev, g = self.device, self.param_groups[0]
        scale, inf = step_multipliers("ZeroOptimizer", dev, grad_scale, clip_coef, found_inf)
        keep = (inf == 0).to(torch.float32)
        self._step.add_(keep)   # counts only the steps taken; the kernel reads it on the device
        lr, wd = g["lr"], g["weight_decay"]
        if self._decay_vec is not None:
            # Mixed decay mask: decoupled decay first (skipped with the step: keep = 0 on overflow).
            self.master.addcmul_(self.master, self._decay_vec * keep, value=-lr * wd)
            wd = 0.0
        beta1, beta2 = g["betas"]
        adamw_step(self.master, self._grad_shard(), self.exp_avg, self.exp_avg_sq, lr=lr, step=self._step,
                   beta1=beta1, beta2=beta2, eps=g["eps"], weight_decay=wd, grad_scale=scale, found_inf=inf,
                   param_copy=self.low, backend=self.backend)
        self._started = True
        if self.stage == 2:
            self._release_grads()
        self._gather_params()
        return loss

    def _gather_params(self) -> None:
        """All-gather every bucket's updated shard into ``param_data`` (model dtype), async then wait.

        On gloo torch's all-gather is ~4x slower than broadcasting the same bytes (measured: 24 MB, 2 ranks,
        50 ms vs 12 ms), so there each rank broadcasts its shard into place instead (same result); our
        ring all-gather (``distributed.ring``) measured no faster than the broadcasts in the ZeRO-1 step."""
        src = self.master if self.low is None else self.low
        if self._use_broadcast:
            for b, off in zip(self._bucket_list, self._offsets):
                mine = b.param_data[self.dp_rank * b.shard_numel:(self.dp_rank + 1) * b.shard_numel]
                mine.copy_(src[off:off + b.shard_numel])
                for r in range(self.dp_size):
                    C.broadcast(b.param_data[r * b.shard_numel:(r + 1) * b.shard_numel], r, self.group)
            return
        works = []
        for b, off in zip(self._bucket_list, self._offsets):
            _, work = C.all_gather_dim0(src[off:off + b.shard_numel], self.group, out=b.param_data, async_op=True)
            if work is not None:
                works.append(work)
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (they are persistent views; ``set_to_none`` is accepted and ignored)."""
        if self.stage == 2 and self._grad_storage().nbytes() == 0:
            return          # released: the next forward re-allocates it zeroed
        self.dp.zero_grad()

    # ------------------------------------------------------------------ checkpoints
    def shard_pieces(self) -> List[Tuple[torch.nn.Parameter, int, int, int]]:
        """Where each parameter's state lives on this rank: ``(param, start in the parameter's flat view,
        start in this rank's flat state (master, exp_avg, exp_avg_sq), length)`` for every piece of a
        parameter in this rank's shard (the universal checkpoint reads and writes the state through it)."""
        self._check_layout()
        return [(p, start_p, off + start_s, n) for b, off in zip(self._bucket_list, self._offsets)
                for p, start_p, start_s, n in b.param_shard_overlaps(self.dp_rank)]

    @property
    def steps_taken(self) -> int:
        return int(self._step.item())

    def set_steps_taken(self, n: int) -> None:
        """Resume the step count (AdamW's bias correction) at ``n``; the state counts as learned."""
        self._step.fill_(n)
        self._started = True

    def _named_params(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return [(self._names.get(id(p), f"<unnamed {i}>"), p) for b in self._bucket_list
                for i, p in enumerate(b.params)]

    def full_state_dict(self) -> dict:
        """The whole state, whatever the dp size (:mod:`.full_state`): every parameter's fp32 master
        weights and AdamW moments in its shape, by the module's parameter name, with the step count and
        ``param_groups``. A collective over the dp group; :meth:`load_full_state_dict` loads it at any dp
        size or bucket layout (resuming on more or fewer ranks)."""
        return full_state.full_state_dict(self, self._named_params, self.group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load a :meth:`full_state_dict` saved at any dp size (no collective): this rank's shard of the
        masters and moments, the parameters (the masters in the parameters' dtype), the step count, and
        ``param_groups`` when the dict has them."""
        named = full_state.load_full_state_dict(self, state, self._named_params, "ZeroOptimizer")
        for name, p in named:                       # every rank holds the full parameters in stages 1 and 2
            p.copy_(state["state"][name]["master"].to(device=p.device, dtype=p.dtype))

    def state_dict(self) -> dict:
        """This rank's shard of the state (clones) and the layout it belongs to. Save one per rank."""
        self._check_layout()
        return {"stage": self.stage, "dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "param_groups": [dict(grp) for grp in self.param_groups], "layout": self._layout,
                "step": self._step.clone(), "started": self._started,
                **{k: getattr(self, k).clone() for k in _STATES}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` saved by the same DP rank of a run with the same DP size.

        If the saved bucket layout differs from the current one (e.g. it was saved after the buffer's
        rebuild), the state is moved over with a collective: call it on every rank of the DP group.
        Parameters are left as they are: load the model's own state dict for them."""
        if state.get("dp_size") != self.dp_size or state.get("dp_rank") != self.dp_rank:
            raise ValueError(f"ZeroOptimizer.load_state_dict: state saved by dp rank {state.get('dp_rank')} of "
                             f"{state.get('dp_size')}, loading into dp rank {self.dp_rank} of {self.dp_size}; "
                             f"resume with the same data-parallel size and give each rank its own file")
        self._check_layout()
        self.param_groups = [dict(grp) for grp in state["param_groups"]]
        self.param_groups[0]["betas"] = tuple(self.param_groups[0]["betas"])
        self._step.copy_(state["step"])
        tensors = [state[k].to(self.device) for k in _STATES]
        if state["layout"] == self._layout:
            self.master.copy_(tensors[0])
            self.exp_avg.copy_(tensors[1])
            self.exp_avg_sq.copy_(tensors[2])
            if self.low is not None:
                self.low.copy_(self.master)
        else:
            self._remap(state["layout"], tensors)
        self._decay_vec = self._decay_vector(self._bucket_list)
        self._started = True

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict:
        """Bytes this rank holds now (measured on the tensors' storages, padding included), per real
        parameter, beside the ZeRO paper's bytes per parameter for this stage.

        ``param_bytes``: the flat parameter buffer (full model, every rank). ``grad_bytes``: gradient memory
        that persists between steps: DataParallel's reduced fp32 shard (the one copy the optimizer steps on),
        plus, stage 1 only, the full grad buffer. ``comm_bytes``: communication buffers alive now (the
        low-precision pack/reduce-scatter buffers live only from a bucket's launch to its wait: 0 between
        steps). ``optimizer_bytes``: fp32 master, exp_avg, exp_avg_sq shards. ``staging_bytes``: the
        low-precision param-copy shard (bf16/fp16 models) and, stage 1 over all_reduce with several
        buckets, the flat grad shard gathered from the buffer.
        ``transient_grad_bytes``: stage 2's full grad buffer, allocated from forward to the step only.
        """
        self._check_layout()
        buckets = self._bucket_list
        num_params = sum(p.numel() for b in buckets for p in b.params)
        grad_mem = [self.dp.buffer.grad_buffer, getattr(self.dp, "grad_shard", None)]   # released: 0 bytes
        staged = [t for pair in getattr(self.dp, "_staged", {}).values() for t in pair]
        rep = {"stage": self.stage, "dp_size": self.dp_size, "dp_rank": self.dp_rank, "num_params": num_params,
               "padded_numel": sum(b.numel for b in buckets), "shard_numel": self.shard_numel,
               "param_bytes": M.storage_bytes(b.param_data for b in buckets),
               "grad_bytes": M.storage_bytes(grad_mem),
               "comm_bytes": M.storage_bytes(staged),
               "optimizer_bytes": M.storage_bytes([self.master, self.exp_avg, self.exp_avg_sq]),
               "staging_bytes": M.storage_bytes([self.low, self._grad_flat]),
               "transient_grad_bytes": self._grad_nbytes if self.stage == 2 else 0}
        rep["total_bytes"] = sum(rep[k] for k in ("param_bytes", "grad_bytes", "comm_bytes", "optimizer_bytes",
                                                  "staging_bytes"))
        per = {"params": "param", "grads": "grad", "comm": "comm", "optimizer": "optimizer",
               "staging": "staging", "total": "total"}
        rep["bytes_per_param"] = {k: rep[f"{v}_bytes"] / num_params for k, v in per.items()}
        rep["paper_bytes_per_param"] = M.paper_bytes_per_param(self.stage, self.dp_size)
        return rep


__all__ = ["ZeroOptimizer"]
