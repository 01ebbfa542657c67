"""ZeRO stages 1 and 2: AdamW state (and, stage 2, gradients) sharded over the data-parallel group."""
from .memory import expected_bytes, format_report, paper_bytes_per_param
from .optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer", "expected_bytes", "format_report", "paper_bytes_per_param"]
