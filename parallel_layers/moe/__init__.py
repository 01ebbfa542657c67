"""Mixture of Experts in one process: a router, token permutation, grouped experts, and the layer.

``MoELayer(hidden_size, intermediate_size, num_experts, top_k, ...)`` replaces a dense MLP: each token goes
to ``top_k`` of ``num_experts`` SwiGLU experts (softmax routing as Mixtral/Qwen/OLMoE, or DeepSeek-V3's
sigmoid routing with a balancing bias), optionally beside shared experts, with the load-balancing and z
losses a training loop adds (``layer.aux_loss``). Its pieces are usable alone: :mod:`.router` (the routing
math, a pure function, and ``Router``), :mod:`.permute` (tokens grouped by expert and back), :mod:`.experts`
(``GroupedExperts``: all experts in one grouped product), :mod:`.hf` (transformers' sparse MoE blocks read
in). Each keeps its torch reference beside it, the oracle its tests compare against.
:mod:`.expert_parallel` (``ExpertParallelMoE``) shards the experts over a process group (expert parallelism).
"""
from .expert_parallel import ExpertParallelMoE, all_to_all_rows
from .experts import GatedMLP, GroupedExperts, grouped_mm, grouped_mm_reference
from .hf import read_hf_block, to_hf_names
from .layer import MoELayer
from .permute import permute, permute_reference, unpermute, unpermute_reference
from .router import Router, Routing, expert_capacity, route

__all__ = ["MoELayer", "ExpertParallelMoE", "all_to_all_rows", "Router", "Routing", "route", "expert_capacity",
           "permute", "unpermute", "permute_reference", "unpermute_reference", "GroupedExperts", "GatedMLP",
           "grouped_mm", "grouped_mm_reference", "read_hf_block", "to_hf_names"]
