"""What the planner is asked: the request (model, cluster, batch). What it answers with, one layout (dp x tp x
pp x cp, ZeRO stage, schedule, micro-batches, checkpointing), is ``Parallel3D``'s
:class:`~parallel_layers.composition.layout.Layout`."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class Request:
    """``model``: a :class:`GPTConfig` or a Hugging Face ``PretrainedConfig`` (a causal LM's). ``world``:
    ranks; ``devices_per_node``: ranks that share a node's fast links; ``memory_bytes``: per rank;
    ``global_batch`` sequences of ``seq_len`` tokens per step; ``precision``: fp32, bf16 or fp16 (the model's
    dtype). ``fp8``: FP8 training, every Linear but the LM head and the MoE router an ``FP8Linear`` with
    ``FP8Recipe(scaling=fp8_recipe)`` (their GEMMs at the profile's fp8 rate, the casts at its memory bandwidth,
    the FP8 copies saved for backward: :mod:`.fp8`); ``fp8_gather``: ZeRO-3 gathers those weights in FP8 (1 byte
    an element instead of the model dtype's), an option apart from ``fp8``'s GEMMs.

    How the step runs, beside the layout: ``compiled``: each block compiled (``PipelineConfig(compile=True)``,
    torchtitan's per-block ``torch.compile``, Transformer Engine's fused kernels), the non-matmul ops between
    two matmuls one kernel (``accounting.OpTally.fused_traffic``); ``overlap_dp``: the data-parallel reduction
    and ZeRO-3's gathers run beside the compute, each unit's or bucket's during another's (FSDP2's prefetch,
    Megatron-core's ``overlap_grad_reduce`` / ``overlap_param_gather``; ``Parallel3D`` runs them before and
    after its pipeline: for a run of another framework, as its published tables are); ``sequence_parallel``: at
    tp > 1, ``Parallel3D(sequence_parallel=True)`` (probed as it runs)."""
    model: object
    world: int
    global_batch: int
    seq_len: int
    memory_bytes: float
    devices_per_node: int = 8
    precision: str = "fp32"
    fp8: bool = False
    fp8_recipe: str = "tensor"
    fp8_gather: bool = False
    compiled: bool = False
    overlap_dp: bool = False
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.precision not in DTYPES:
            raise ValueError(f"planner: precision={self.precision!r} must be one of {sorted(DTYPES)}")
        from ..fp8.recipes import SCALINGS
        if self.fp8_recipe not in SCALINGS:
            raise ValueError(f"planner: fp8_recipe={self.fp8_recipe!r} must be one of {SCALINGS}")
        if self.fp8_gather and not self.fp8:
            raise ValueError("planner: fp8_gather=True gathers the FP8 layers' weights in FP8: it needs fp8=True")
        for name in ("world", "global_batch", "seq_len", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"planner: {name}={getattr(self, name)} must be >= 1")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    # a GPTConfig reads as a Hugging Face config does (it has their size names: models.gpt.GPTConfig)
    def n_layer(self) -> int:
        return self.model.num_hidden_layers

    def vocab(self) -> int:
        return self.model.vocab_size

    def heads(self) -> int:
        return self.model.num_attention_heads

    def kv_heads(self) -> int:
        return getattr(self.model, "num_key_value_heads", None) or self.heads()

    def ffn(self) -> int:
        return getattr(self.model, "intermediate_size", None) or 4 * self.hidden()

    def hidden(self) -> int:
        return self.model.hidden_size

    def experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model): ``GPTConfig.num_experts``, or a Hugging Face
        config's ``num_local_experts`` (Mixtral) / ``num_experts`` (Qwen-MoE, OLMoE)."""
        return int(getattr(self.model, "num_local_experts", None) or getattr(self.model, "num_experts", None) or 0)

    def describe_model(self) -> str:
        return (f"{type(self.model).__name__.replace('Config', '')} L{self.n_layer()} d{self.hidden()} "
                f"h{self.heads()} V{self.vocab()}")


Options = Optional[dict]

__all__ = ["Request", "DTYPES"]
