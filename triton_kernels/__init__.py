"""Triton kernels behind ``parallel_layers.ops`` (backend ``"triton"``).

Each public function implements the *kernel contract* written in the docstring of the matching
``parallel_layers/ops/*.py`` module, with exactly its positional signature; the ops layer validates
arguments, so these launchers trust them. No torch.nn, no torch.distributed, no parallel_layers imports.

Modules:
  multi_tensor.py  how to walk many tensors in one launch (pointer/chunk table, shared block helpers)
  cast.py          multi-tensor scaled copy kernel: multi_tensor_cast (and pack/unpack's engine)
  bucket.py        pack_bucket / unpack_bucket on top of the scaled copy
  unscale_norm.py  unscale + inf/nan check + deterministic global L2 norm
  fp8_cast.py      FP8 block amax and the scaled saturating cast (+ transpose, + amax) in one pass
  optimizer.py     flat-buffer AdamW and SGD steps
  moe.py           Mixture-of-Experts router top-k, permutation index, row gathers and sums
  grouped_mm.py    grouped (per-expert) matrix product and its weight gradient

On CPU tensors these run only under ``TRITON_INTERPRET=1`` (set before this package is imported);
``_interpreter_compat`` keeps triton 3.6's interpreter working with numpy >= 2.4.
"""
from . import _interpreter_compat  # noqa: F401  (first: it patches triton 3.6's interpreter on import)
from .bucket import pack_bucket, unpack_bucket
from .cast import multi_tensor_cast
from .fp8_cast import fp8_amax, fp8_cast
from .grouped_mm import grouped_mm, grouped_mm_weight_grad
from .moe import moe_gather_rows, moe_permute_backward, moe_permute_index, moe_unpermute, router_topk
from .optimizer import adamw_step, sgd_step
from .unscale_norm import unscale_and_norm

__all__ = ["adamw_step", "sgd_step", "unscale_and_norm", "multi_tensor_cast", "pack_bucket", "unpack_bucket",
           "router_topk", "moe_permute_index", "moe_gather_rows", "moe_unpermute", "moe_permute_backward",
           "grouped_mm", "grouped_mm_weight_grad", "fp8_amax", "fp8_cast"]
