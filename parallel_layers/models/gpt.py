"""A reference GPT (decoder-only transformer) built from the tensor-parallel layers.

One class serves every parallel layout: ``GPT(config)`` is the plain single-process model made of
``nn.Linear``/``nn.Embedding`` (the oracle of the parity tests), and ``GPT(config, tp_group=g)`` is the
same model with its matmuls split over the tensor-parallel group ``g`` (Megatron-LM's layout):

=====================  ==========================================  ===================================
piece                  tensor parallel                             communication (forward)
=====================  ==========================================  ===================================
token embedding        ``VocabParallelEmbedding`` (vocab rows)     all-reduce (SP: reduce-scatter)
position embedding     replicated ``nn.Embedding``                 -
attention              qkv ``ColumnParallelLinear`` (heads split), all-reduce after ``proj``
                       causal SDPA on the local heads,
                       ``proj`` ``RowParallelLinear``
MLP                    ``fc`` column (GELU fused), ``fc2`` row     all-reduce after ``fc2``
LayerNorms, residual   replicated (SP: on sequence shards)         -
LM head                tied: ``h @ wte_shard^T``; untied: column   none (the loss is vocab-parallel)
=====================  ==========================================  ===================================

The qkv projection's output features are laid out *per head* (``[head, q|k|v, head_dim]``), so a
contiguous 1/tp slice of its rows is a whole set of heads with their q, k and v: no re-shuffle.

Initialisation: every module is constructed in one fixed order from the default generator, and the
parallel layers draw the full dense weight and keep their slice (see ``tensor_parallel.random``), so
``torch.manual_seed(s); GPT(cfg, tp_group=g)`` holds, at any TP size, exactly the slices of
``torch.manual_seed(s); GPT(cfg)``. Embeddings are then scaled to ``init_std`` (a shard-local op).

Sequence parallelism (``config.sequence_parallel``): activations between the TP regions are
``[b, s/tp, d]``; LayerNorm and position-embedding parameters see only this rank's tokens and are
marked ``sequence_parallel = True``: call :meth:`GPT.finish_grads` (it runs
``allreduce_sequence_parallel_grads``) after backward and before the optimizer step.

Dropout: on replicated activations it uses the default generator (seed it alike on every TP rank);
on sharded ones (attention probabilities of the local heads, sequence shards) it runs under the
tracker's ``"tensor-parallel"`` stream, seeded ``config.seed + 2718 + tp_rank``.

Under :class:`~parallel_layers.data_parallel.DataParallel` (which sets ``weight.grad_sink``) the tied
embedding / LM head weight gradient is written straight into the data-parallel buffer
(:mod:`parallel_layers.data_parallel.fused_grads`, Megatron-LM's gradient-accumulation fusion): the
token embedding at tp=1 and the tied or untied head; the plain model runs the unchanged torch ops.

For pipeline stages, the pieces are separable: :meth:`embed`, ``blocks`` (an ``nn.ModuleList``),
:meth:`head` (final LayerNorm and LM head, returns the logits shard) and :meth:`loss`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..activations.partitioned_checkpoint import SavedInputs
from ..activations.recompute import checkpoint_placement, run_blocks
from ..data_parallel.fused_grads import embedding_grad_into_buffer, grad_sink, linear_weight_grad_into_buffer
from ..distributed import collectives as C
from ..mesh import ParallelMesh
from ..tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
)


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_ff: Optional[int] = None          # default 4 * d_model
    max_seq_len: int = 1024
    dropout: float = 0.0                # embedding, attention-probability and residual dropout
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    sequence_parallel: bool = False
    bias: bool = True                   # biases of the linear layers
    init_std: float = 0.02              # std of the token and position embeddings
    seed: int = 1234                    # seed of the tensor-parallel dropout stream
    # Mixture of experts (0: every block's MLP is dense): each block's MLP becomes an MoELayer of num_experts
    # SwiGLU experts of moe_d_ff (default d_ff // moe_top_k: about the dense MLP's FLOPs per token), moe_top_k
    # per token, plus num_shared_experts always on; the router's losses weighted by the coefficients
    num_experts: int = 0
    moe_top_k: int = 2
    moe_d_ff: Optional[int] = None
    num_shared_experts: int = 0
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    moe_capacity_factor: Optional[float] = None

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if self.num_experts and self.moe_d_ff is None:
            self.moe_d_ff = max(1, self.d_ff // self.moe_top_k)
        if self.num_experts:
            from ..moe.layer import check_layer_options
            check_layer_options("GPTConfig", self.d_model, self.moe_d_ff, self.num_experts, self.moe_top_k,
                                scoring="softmax", capacity_factor=self.moe_capacity_factor,
                                aux_loss_coef=self.moe_aux_loss_coef, z_loss_coef=self.moe_z_loss_coef,
                                num_shared_experts=self.num_shared_experts, shared_expert_gate=False,
                                activation="silu", backend="auto")
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} does not divide by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1)")

    # the Hugging Face names of its sizes, so a reader of model configs (the layout planner) reads any one alike
    @property
    def num_hidden_layers(self) -> int:
        return self.n_layer

    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def intermediate_size(self) -> int:
        return self.d_ff

    def build(self, *, seed: int, tp_group=None, cp_group=None, cp_method: str = "ring", dtype=None,
              device=None, keep: Optional[Callable[[str], bool]] = None) -> "GPT":
        """``torch.manual_seed(seed); GPT(self, ...)``: the one-process model's weights at any layout (this
        rank's tensor-parallel slice of them; fp16/bf16 drawn in fp32 and rounded: :func:`draw_dtype`); the
        default generator is left where the one-process model leaves it (its dropout draws from there). What
        ``Parallel3D`` does with a config it is given (any config with this method). ``keep``: see :class:`GPT`."""
        torch.manual_seed(seed)
        return GPT(self, tp_group=tp_group, cp_group=cp_group, cp_method=cp_method, dtype=dtype, device=device,
                   keep=keep)


class _Linear(nn.Linear):
    """``nn.Linear`` with an optional activation: the dense twin of ``ColumnParallelLinear(activation=)``."""

    def __init__(self, *args, activation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation = activation

    def forward(self, x):
        y = super().forward(x)
        return F.gelu(y) if self.activation == "gelu" else F.silu(y) if self.activation == "silu" else y


_REDUCED = (torch.float16, torch.bfloat16)


def draw_dtype(dtype):
    """The dtype initial weights are drawn in: float32 for a bf16/fp16 model, rounded afterwards.

    Drawing directly in reduced precision is not the fp32 draw rounded: ``uniform_`` maps a value that
    rounds up to the upper bound back to the LOWER bound (a +0.25 weight becomes -0.25), so a bf16/fp16
    model would not start from the weights of the fp32 model with the same seed.
    """
    return torch.float32 if dtype in _REDUCED else dtype


def round_to(modules, dtype) -> None:
    """Convert the drawn weights to the model dtype in place (same Parameter objects and attributes)."""
    if dtype in _REDUCED:
        for m in modules:
            if m is not None:
                m.to(dtype)


class ParallelContext:
    """What a module needs to know about tensor parallelism: group, size, SP flag, layer factories."""

    def __init__(self, group, config: GPTConfig, dtype, device):
        self.group, self.sp = group, bool(config.sequence_parallel) and group is not None
        self.size, self.rank = (1, 0) if group is None else (C.world_size(group), C.rank(group))
        self.factory = dict(dtype=dtype, device=device)
        self.rng = None
        if group is not None:
            from ..tensor_parallel.random import tensor_parallel_rng_tracker
            self.rng = tensor_parallel_rng_tracker(config.seed, group)  # does not touch the default generator
        self.cp_group, self.cp_size, self.cp_rank, self.cp_method = None, 1, 0, "ring"

    def context_parallel(self, group, method: str, dropout: float) -> None:
        """Shard every sequence over ``group`` through attention (``parallel_layers.context_parallel``)."""
        if group is None or C.world_size(group) == 1:
            return
        if dropout:
            raise ValueError(f"GPT: context parallelism needs dropout=0 in attention (config.dropout={dropout})")
        self.cp_group, self.cp_size, self.cp_rank, self.cp_method = group, C.world_size(group), C.rank(group), method

    def positions(self, s: int, device) -> torch.Tensor:
        """The positions in the whole sequence of this rank's ``s`` tokens (cp: its zigzag shard)."""
        if self.cp_group is None:
            return torch.arange(s, device=device)
        from ..context_parallel.layout import zigzag_index
        return zigzag_index(s * self.cp_size, self.cp_size, self.cp_rank, device)

    def column(self, n_in, n_out, bias, activation=None):
        if self.group is None:
            return _Linear(n_in, n_out, bias, activation=activation, **self.factory)
        from ..tensor_parallel.layers import ColumnParallelLinear
        return ColumnParallelLinear(n_in, n_out, bias, tp_group=self.group, sequence_parallel=self.sp,
                                    activation=activation, **self.factory)

    def row(self, n_in, n_out, bias):
        if self.group is None:
            return nn.Linear(n_in, n_out, bias, **self.factory)
        from ..tensor_parallel.layers import RowParallelLinear
        return RowParallelLinear(n_in, n_out, bias, tp_group=self.group, input_is_parallel=True,
                                 sequence_parallel=self.sp, **self.factory)

    def layer_norm(self, d, eps):
        ln = nn.LayerNorm(d, eps=eps, **self.factory)
        for p in ln.parameters():
            p.sequence_parallel = self.sp  # applied to sequence shards: partial gradients under SP
        return ln

    def fork(self, sharded: bool):
        """Dropout on sharded activations draws from the TP stream; replicated ones from the default."""
        return self.rng.fork() if (sharded and self.rng is not None) else contextlib.nullcontext()


class Attention(nn.Module):
    """Causal self-attention on this rank's ``n_head / tp`` heads."""

    def __init__(self, config: GPTConfig, tp: ParallelContext):
        super().__init__()
        d = config.d_model
        self.head_dim = d // config.n_head
        self.n_local_heads = config.n_head // tp.size
        self.dropout = config.dropout
        self._tp = tp
        self.qkv = tp.column(d, 3 * d, config.bias)      # rows laid out [head, q|k|v, head_dim]
        self.proj = tp.row(d, d, config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                  # [b, s, 3 d / tp] (SP: the gathered sequence)
        b, s = qkv.shape[:2]
        # The local head count is read off the tensor, not stored: the block also works after
        # parallelize() or DTensor's parallelize_module() split qkv under it.
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        p = self.dropout if self.training else 0.0
        if self._tp.cp_group is not None:                # the sequence sharded over cp: ring or Ulysses
            from ..context_parallel import context_parallel_attention
            tp = self._tp
            seg = torch.zeros(b, s * tp.cp_size, dtype=torch.int64, device=q.device)   # one sequence per row
            y = context_parallel_attention(q, k, v, group=tp.cp_group, segments=seg, causal=True, method=tp.cp_method)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))
        with self._tp.fork(sharded=p > 0):               # local heads: a different mask on every rank
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, tp: ParallelContext):
        super().__init__()
        self.fc = tp.column(config.d_model, config.d_ff, config.bias, activation="gelu")
        self.fc2 = tp.row(config.d_ff, config.d_model, config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc(x))


def moe_mlp(config: GPTConfig, tp: ParallelContext) -> nn.Module:
    """A block's Mixture-of-Experts MLP: the same whole layer on every tensor-parallel rank (its experts are
    not split over tp; expert parallelism splits them, ``Parallel3D`` with ``ep > 1``). Its auxiliary losses
    train through the output's backward (``aux_loss_scale = 1``: one forward, one loss).

    Under sequence parallelism each tp rank routes only its shard of the sequence (Megatron-core's MoE with
    SP: no gather before the layer, no duplicated expert work): the router's statistics are summed over tp
    (the losses are those of the whole sequence), and every parameter's gradient is a partial sum over the
    rank's tokens, marked ``sequence_parallel`` as the norms' are, so it is summed over tp after backward."""
    from ..moe.layer import MoELayer
    layer = MoELayer(config.d_model, config.moe_d_ff, config.num_experts, config.moe_top_k,
                     capacity_factor=config.moe_capacity_factor, aux_loss_coef=config.moe_aux_loss_coef,
                     z_loss_coef=config.moe_z_loss_coef, num_shared_experts=config.num_shared_experts,
                     **tp.factory)
    layer.aux_loss_scale = 1.0
    if tp.sp:
        layer.aux_loss_group = tp.group
        for p in layer.parameters():
            p.sequence_parallel = True
    return layer


class Block(nn.Module):
    """Pre-LN transformer block: ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))`` (the MLP a
    Mixture-of-Experts layer when ``config.num_experts``)."""

    def __init__(self, config: GPTConfig, tp: ParallelContext):
        super().__init__()
        self.ln1 = tp.layer_norm(config.d_model, config.layer_norm_eps)
        self.attn = Attention(config, tp)
        self.ln2 = tp.layer_norm(config.d_model, config.layer_norm_eps)
        self.mlp = moe_mlp(config, tp) if config.num_experts else MLP(config, tp)
        self.dropout = config.dropout
        self._tp = tp

    def _drop(self, x):
        if not self.training or self.dropout == 0:
            return x
        with self._tp.fork(sharded=self._tp.sp):
            return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))


def untied_head(config: "GPTConfig", tp: ParallelContext) -> nn.Module:
    """The untied LM head: the dense ``nn.Linear(d, V)``'s init; with tp the rows are zero-padded to a multiple
    of tp (shared by ``GPT`` and the pipeline stage builder, which draw the same numbers)."""
    d, V = config.d_model, config.vocab_size
    dense = nn.Linear(d, V, bias=False, **tp.factory)
    if tp.group is None:
        return dense
    from ..tensor_parallel.layers import ColumnParallelLinear, set_parameter
    from ..tensor_parallel.random import shard
    padded = -(-V // tp.size) * tp.size
    head = ColumnParallelLinear(d, padded, bias=False, tp_group=tp.group, sequence_parallel=tp.sp,
                                dtype=dense.weight.dtype, device="meta")
    set_parameter(head, "weight", shard(dense.weight.detach(), 0, tp.rank, tp.size, padded),
                  tensor_parallel=True, partition_dim=0)
    head.dense_rows = V          # the dense layout drops the padding rows (tensor_parallel.dense_layouts.to_dense)
    return head


def resolve_tp_group(tp_group):
    """GPT's ``tp_group=``: a ProcessGroup, a ParallelMesh (its tp group) or None, checked, as a group or None."""
    if tp_group is None:
        return None
    if isinstance(tp_group, ParallelMesh):
        return tp_group.tp_group
    if not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"GPT: tp_group must be a torch.distributed ProcessGroup (e.g. mesh.tp_group), a "
                        f"ParallelMesh or None (the plain single-process model); got {type(tp_group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("GPT: a tp_group was given but torch.distributed is not initialised")
    return tp_group


class GPT(nn.Module):
    """Decoder-only transformer; ``tp_group=None`` is the plain model, a group (or mesh) splits it.

    ``forward(idx, targets=None, return_logits=None)`` returns ``(logits, loss)``: ``logits`` are the
    full-vocabulary ``[b, s, vocab_size]`` (gathered, padding dropped) when no targets are given or
    ``return_logits=True``, else ``None``; ``loss`` is the mean cross entropy (computed on the
    vocabulary shards, logits never gathered) when targets are given, else ``None``.

    ``checkpoint``: activation checkpointing in training mode, True for every block, an int ``n`` for the
    first ``n``, ``"sqrt"`` or a placement policy such as ``MemoryBudget(bytes)``
    (:mod:`~parallel_layers.activations.checkpoint_policy`; :mod:`parallel_layers.activations.recompute`: dropout
    masks replay exactly, TP stream included; works under ZeRO-3, which gathers a block's parameters again
    for its recomputation).

    ``checkpoint_inputs``: how a checkpointed block keeps its input until backward: None (whole),
    ``"partition"`` (a 1/tp slice per TP rank, all-gathered for the recomputation: ZeRO-R's partitioned
    activations; under sequence parallelism the input is already a shard and is kept as it is), ``"offload"``
    (in host memory) or ``"partition+offload"`` (:mod:`~parallel_layers.activations.partitioned_checkpoint`); the
    gradients are those of plain checkpointing, bit for bit.

    ``keep(name)``: the top-level modules (``"wte"``, ``"wpe"``, ``"blocks.i"``, ``"ln_f"``, ``"lm_head"``) to
    hold; the others are built and moved to the meta device at once (a pipeline rank's build; the weights it
    keeps are those of the whole model from the same seed).
    """

    def __init__(self, config: GPTConfig, *, tp_group=None, dtype=None, device=None,
                 checkpoint: Union[bool, int, str, object] = False, cp_group=None, cp_method: str = "ring",
                 checkpoint_inputs: Optional[str] = None, keep: Optional[Callable[[str], bool]] = None):
        super().__init__()
        self.checkpointing = checkpoint_placement(checkpoint, config.n_layer, "GPT")
        self.checkpoint_blocks = self.checkpointing.static_count
        group = resolve_tp_group(tp_group)
        tp = ParallelContext(group, config, draw_dtype(dtype), device)
        self.saved_inputs = SavedInputs.from_mode(checkpoint_inputs, group, tp.sp, "GPT: checkpoint_inputs",
                                                  checkpointed=self.checkpoint_blocks != 0, checkpoint=checkpoint)
        tp.context_parallel(cp_group, cp_method, config.dropout)
        for name, size in (("n_head", config.n_head), ("d_ff", config.d_ff)):
            if size % tp.size:
                raise ValueError(f"GPT: {name}={size} does not divide by the tensor-parallel size {tp.size}; "
                                 f"choose {name} a multiple of {tp.size} or a tensor-parallel size that divides it")
        self.config, self.tp_group, self.tp_size, self.tp_rank = config, group, tp.size, tp.rank
        self._tp = tp
        d, V = config.d_model, config.vocab_size
        # Construction order is part of the model's definition: it fixes which random numbers each
        # weight gets. Do not reorder (or add a module in the middle) without meaning to.
        # ``keep``: a module whose name it refuses is still built (drawing its numbers: the only exact way to
        # advance the generator past it) and moved to the meta device at once, so a pipeline rank holds its own
        # modules and at most one other (Parallel3D: pipeline.any_model.kept_modules)
        def kept(name: str, module: nn.Module) -> nn.Module:
            return module if keep is None or keep(name) else module.to("meta")
        if group is None:
            self.wte = kept("wte", nn.Embedding(V, d, **tp.factory))
        else:
            from ..tensor_parallel.embedding import VocabParallelEmbedding
            self.wte = kept("wte", VocabParallelEmbedding(V, d, tp_group=group, sequence_parallel=tp.sp,
                                                          **tp.factory))
        self.wpe = kept("wpe", nn.Embedding(config.max_seq_len, d, **tp.factory))
        self.wpe.weight.sequence_parallel = tp.sp
        self.blocks = nn.ModuleList(kept(f"blocks.{i}", Block(config, tp)) for i in range(config.n_layer))
        self.ln_f = kept("ln_f", tp.layer_norm(d, config.layer_norm_eps))
        self.lm_head = None if config.tie_embeddings else kept("lm_head", untied_head(config, tp))
        with torch.no_grad():
            self.wte.weight.mul_(config.init_std)   # N(0, 1) -> N(0, init_std^2), shard-local
            self.wpe.weight.mul_(config.init_std)
        round_to([self], dtype)
        tp.factory["dtype"] = dtype
        self.vocab_size_padded = getattr(self.wte, "num_embeddings_padded", V)

    @property
    def rng_tracker(self):
        """The tensor-parallel dropout streams (``tensor_parallel_rng_tracker``), None without TP: a
        checkpointed block's recomputation replays them."""
        return self._tp.rng

    @property
    def cp_size(self) -> int:
        """The context-parallel size its attention was built for (``cp_group=``): it takes token shards."""
        return self._tp.cp_size

    # ------------------------------------------------------------------ pieces (pipeline stages reuse them)
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings (+ dropout): ``[b, s, d]``, or ``[b, s/tp, d]`` under SP."""
        if idx.dim() != 2:
            raise ValueError(f"GPT: idx must be [batch, seq] token ids, got shape {tuple(idx.shape)}")
        s = idx.shape[1]
        if s * self._tp.cp_size > self.config.max_seq_len:
            raise ValueError(f"GPT: sequence length {s * self._tp.cp_size} exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        if self._tp.sp and s % self.tp_size:
            raise ValueError(f"GPT: sequence length {s} does not divide by the tensor-parallel size "
                             f"{self.tp_size} (sequence_parallel=True); pad the sequence to a multiple of it")
        if self.tp_group is None and grad_sink(self.wte.weight) is not None:
            x = embedding_grad_into_buffer(idx, self.wte.weight)   # gradient rows land in the DP buffer
        else:
            x = self.wte(idx)                                       # the module (and its hooks) as is
        pos = self._tp.positions(s, idx.device)          # cp: this rank's shard's positions in the sequence
        if self._tp.sp:
            pos = pos.chunk(self.tp_size)[self.tp_rank]   # this rank's positions
        x = x + self.wpe(pos)
        if self.training and self.config.dropout > 0:
            with self._tp.fork(sharded=self._tp.sp):
                x = F.dropout(x, self.config.dropout, True)
        return x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and LM head: the logits shard ``[b, s, V_pad / tp]`` (full ``V`` at tp=1)."""
        h = self.ln_f(h)
        if self.lm_head is not None:
            if self.tp_group is None and grad_sink(self.lm_head.weight) is not None:
                return linear_weight_grad_into_buffer(h, self.lm_head.weight)
            return self.lm_head(h)   # ColumnParallelLinear gathers the sequence itself under SP
        if self.tp_group is not None:
            # The gradient w.r.t. h is a partial sum over the vocabulary shards: all-reduce it
            # (under SP the gather's backward reduce-scatters, which sums and re-shards at once).
            h = (gather_from_sequence_parallel_region(h, self.tp_group, dim=1) if self._tp.sp
                 else copy_to_tensor_parallel_region(h, self.tp_group))
        return linear_weight_grad_into_buffer(h, self.wte.weight)   # F.linear; under DP: grad into its buffer

    def loss(self, logits_shard: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
             inplace_backward: bool = True, reduction: str = "mean") -> torch.Tensor:
        """Cross entropy over the targets that are not ``ignore_index``, from the logits shard: their mean
        (``reduction="sum"``: their sum)."""
        v_local = logits_shard.shape[-1]
        if self.tp_group is None:
            return F.cross_entropy(logits_shard.reshape(-1, v_local), targets.reshape(-1), ignore_index=ignore_index,
                                   reduction=reduction)
        from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy(logits_shard.reshape(-1, v_local), targets.reshape(-1),
                                            tp_group=self.tp_group, ignore_index=ignore_index, reduction=reduction,
                                            vocab_size=self.config.vocab_size, inplace_backward=inplace_backward)

    def gather_logits(self, logits_shard: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[b, s, vocab_size]`` (differentiable; padding columns dropped)."""
        if self.tp_group is None:
            return logits_shard
        return gather_from_tensor_parallel_region(logits_shard, self.tp_group)[..., :self.config.vocab_size]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                return_logits: Optional[bool] = None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        h = self.embed(idx)
        h = run_blocks(self.blocks, h, self.checkpointing if self.training else 0, self._tp.rng, self.saved_inputs)
        shard = self.head(h)
        want_logits = targets is None or bool(return_logits)
        # In-place backward overwrites the logits' saved softmax; only safe when nobody else reads them.
        loss = None if targets is None else self.loss(shard, targets, inplace_backward=not want_logits)
        return (self.gather_logits(shard) if want_logits else None), loss

    # ------------------------------------------------------------------ after backward / for tests
    def finish_grads(self) -> int:
        """Sum the partial gradients of sequence-parallel parameters over the TP group (no-op without SP).

        Call after ``backward()`` and before clipping / the optimizer step; returns how many gradients
        were reduced."""
        if not self._tp.sp:
            return 0
        from ..tensor_parallel.layers import allreduce_sequence_parallel_grads
        return allreduce_sequence_parallel_grads(self, self.tp_group)

    def dense_state_dict(self, grads: bool = False) -> Dict[str, torch.Tensor]:
        """The plain model's ``state_dict`` (or, with ``grads=True``, its gradients), gathered from the
        shards on every rank (a collective: every TP rank must call it). Keys match ``GPT(config)``."""
        from ..tensor_parallel.parallelize import gather_dense_state_dict
        out = gather_dense_state_dict(self, grads=grads)
        if self.lm_head is not None and "lm_head.weight" in out:
            out["lm_head.weight"] = out["lm_head.weight"][:self.config.vocab_size]
        return out


__all__ = ["GPTConfig", "GPT", "Block", "Attention", "MLP"]
