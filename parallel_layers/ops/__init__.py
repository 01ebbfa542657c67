"""Fused ops: one function per op. Each picks a backend (see ``_backend``) and keeps its torch
reference (``reference_*``) beside it as the oracle. ``backend_kernel`` and ``scalar_tensor`` are for
the package's own fused optimizers, which pick kernels and check scalars the way the ops do."""
from ._backend import BACKENDS, ENV_VAR
from ._backend import clear_cache as clear_backend_cache
from ._backend import kernel as backend_kernel
from ._backend import resolve as resolve_backend
from ._checks import scalar_tensor
from .batch_stats import batch_stats
from .block_attention import block_attention_backward, block_attention_forward
from .bucket import pack_bucket, unpack_bucket
from .cast import multi_tensor_cast
from .linear import fused_linear, fused_linear_backend
from .moe_permute import permute_tokens, unpermute_tokens
from .moe_routing import router_topk
from .optimizer_step import adamw_step, sgd_step
from .unscale_norm import unscale_and_norm

__all__ = ["BACKENDS", "ENV_VAR", "clear_backend_cache", "resolve_backend", "adamw_step", "sgd_step",
           "unscale_and_norm", "multi_tensor_cast", "pack_bucket", "unpack_bucket", "fused_linear",
           "fused_linear_backend",
           "block_attention_forward", "block_attention_backward", "batch_stats", "backend_kernel", "scalar_tensor",
           "router_topk", "permute_tokens", "unpermute_tokens"]
