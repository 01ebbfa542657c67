"""Reference models built from the parallel layers."""
from .gpt import GPT, GPTConfig
from .recompute import checkpointed, checkpointed_block_count

__all__ = ["GPT", "GPTConfig", "checkpointed", "checkpointed_block_count"]
