"""ZeRO stages 1-3: AdamW state (stage 2: and gradients; stage 3: and parameters) sharded over the
data-parallel group.

:class:`ZeroOptimizer` (stages 1 and 2, over ``DataParallel``) and :class:`ZeroStage3Optimizer` (over
:class:`ZeroStage3`) are ``torch.optim.Optimizer``s: ``torch.optim.AdamW``'s param groups, torch's LR
schedulers. Their gradients are shards: clip with ``optimizer.clip_grad_norm_(max_norm)``
(``torch.nn.utils.clip_grad_norm_`` on the parameters raises an error saying so)."""
from .memory import expected_bytes, format_report, paper_bytes_per_param
from .optimizer import ZeroOptimizer
from .stage3 import ZeroStage3
from .stage3_optimizer import ZeroStage3Optimizer

__all__ = ["ZeroOptimizer", "ZeroStage3", "ZeroStage3Optimizer", "expected_bytes", "format_report",
           "paper_bytes_per_param"]
