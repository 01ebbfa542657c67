"""ZeRO stages 1-3: AdamW state (stage 2: and gradients; stage 3: and parameters) sharded over the
data-parallel group."""
from .memory import expected_bytes, format_report, paper_bytes_per_param
from .optimizer import ZeroOptimizer
from .stage3 import ZeroStage3
from .stage3_optimizer import ZeroStage3Optimizer

__all__ = ["ZeroOptimizer", "ZeroStage3", "ZeroStage3Optimizer", "expected_bytes", "format_report",
           "paper_bytes_per_param"]
