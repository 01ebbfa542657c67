"""Reference models built from the parallel layers."""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
