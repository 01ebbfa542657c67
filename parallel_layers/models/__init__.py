"""Reference models built from the parallel layers."""
from .checkpointing import checkpointed, checkpointed_block_count
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "checkpointed", "checkpointed_block_count"]
