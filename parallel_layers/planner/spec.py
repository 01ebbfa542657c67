"""What the planner is asked and what it answers with: the request (model, cluster, batch) and one
layout (dp x tp x pp x cp, ZeRO stage, schedule, micro-batches, checkpointing)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from ..models.gpt import GPTConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run: the mesh sizes and the Parallel3D settings that go with them."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    num_microbatches: int = 1
    num_chunks: int = 1
    checkpoint: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        dims = "x".join(f"{k}{v}" for k, v in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))
                        if v > 1) or "dp1"
        sched = f" {self.schedule} m{self.num_microbatches}" + (f" v{self.num_chunks}" if self.num_chunks > 1 else "")
        return f"{dims} z{self.zero}{sched if self.pp > 1 else f' m{self.num_microbatches}'}" + \
            (" ckpt" if self.checkpoint else "")

    def parallel3d_kwargs(self) -> dict:
        """The keywords of ``Parallel3D`` this layout sets."""
        from ..composition.config import DataParallelConfig, PipelineConfig
        return dict(pipeline=PipelineConfig(schedule=self.schedule, num_microbatches=self.num_microbatches,
                                            num_chunks=self.num_chunks, checkpoint=self.checkpoint),
                    data_parallel=DataParallelConfig(zero=self.zero))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Request:
    """``model``: a :class:`GPTConfig` or a Hugging Face ``PretrainedConfig`` (a causal LM's). ``world``:
    ranks; ``devices_per_node``: ranks that share a node's fast links; ``memory_bytes``: per rank;
    ``global_batch`` sequences of ``seq_len`` tokens per step; ``precision``: fp32, bf16 or fp16."""
    model: object
    world: int
    global_batch: int
    seq_len: int
    memory_bytes: float
    devices_per_node: int = 8
    precision: str = "fp32"

    def __post_init__(self):
        if self.precision not in DTYPES:
            raise ValueError(f"planner: precision={self.precision!r} must be one of {sorted(DTYPES)}")
        for name in ("world", "global_batch", "seq_len", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"planner: {name}={getattr(self, name)} must be >= 1")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def is_gpt(self) -> bool:
        return isinstance(self.model, GPTConfig)

    def n_layer(self) -> int:
        return self.model.n_layer if self.is_gpt else self.model.num_hidden_layers

    def vocab(self) -> int:
        return self.model.vocab_size

    def heads(self) -> int:
        return self.model.n_head if self.is_gpt else self.model.num_attention_heads

    def kv_heads(self) -> int:
        if self.is_gpt:
            return self.model.n_head
        return getattr(self.model, "num_key_value_heads", None) or self.heads()

    def ffn(self) -> int:
        return self.model.d_ff if self.is_gpt else getattr(self.model, "intermediate_size", 4 * self.hidden())

    def hidden(self) -> int:
        return self.model.d_model if self.is_gpt else self.model.hidden_size

    def describe_model(self) -> str:
        if self.is_gpt:
            c = self.model
            return f"GPT L{c.n_layer} d{c.d_model} h{c.n_head} V{c.vocab_size}"
        return (f"{type(self.model).__name__.replace('Config', '')} L{self.n_layer()} d{self.hidden()} "
                f"h{self.heads()} V{self.vocab()}")


def model_from_json(text: Union[str, dict]) -> object:
    """A GPTConfig (``{"gpt": {...}}``) or a Hugging Face config (``{"model_type": ...}``) from JSON."""
    import json
    d = json.loads(text) if isinstance(text, str) else dict(text)
    if "gpt" in d:
        return GPTConfig(**d["gpt"])
    from transformers import AutoConfig
    return AutoConfig.for_model(**d)


def model_to_json(model: object) -> dict:
    if isinstance(model, GPTConfig):
        return {"gpt": dataclasses.asdict(model)}
    return model.to_dict()


Options = Optional[dict]

__all__ = ["Layout", "Request", "DTYPES", "model_from_json", "model_to_json"]
