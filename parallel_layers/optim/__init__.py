"""Drop-in fused optimizers that keep parameters, gradients and states in flat buffers."""
from .fused_adamw import FusedAdamW
from .fused_sgd import FusedSGD

__all__ = ["FusedAdamW", "FusedSGD"]
